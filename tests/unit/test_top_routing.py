"""`kvctl top`'s routing figures: the router's counters since it started turned into the recent
window's rates and shares per node and per DC link, a router restart or a gap, a router that
does not answer (N/A with its reason, never a crash), and the cells and the routing lines."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvctl.db.inventory import NodeInfo
from kvctl.tui.cells import Cells, Palette
from kvctl.tui.model import (
    Poll,
    Reading,
    RouterReading,
    RoutingView,
    Sampler,
    Thresholds,
    arrange,
    sort_rows,
)
from kvctl.tui.sources import RouterWatch, router_url
from tests.functional.agents import closed_port
from tests.unit.test_top_model import stats

URL = "http://127.0.0.1:9480"


def node(name: str, dc: str, i: int) -> NodeInfo:
    return NodeInfo(i, name, dc, f"http://127.0.0.1:{7000 + i}", "", None)


A, B, C = node("a", "fra", 1), node("b", "fra", 2), node("c", "ams", 3)


def router_stats(
    nodes: dict[str, tuple[int, int]],
    links: dict[tuple[str, str], tuple[int, int]] | None = None,
    **totals: int,
) -> dict[str, Any]:
    """The shape of the router's ``/v1/stats`` (``Router.stats``): ``nodes`` as (decisions,
    to_holder), ``links`` as (chunks, bytes); fleet totals default to the nodes' sums."""
    out: dict[str, Any] = {
        "decisions": sum(d for d, _ in nodes.values()),
        "to_holder": sum(h for _, h in nodes.values()),
        "no_node": 0,
        "requested_chunks": 0,
        "indexed_chunks": 0,
        "local_chunks": 0,
        "pulled_chunks": 0,
        "pulled_bytes": 0,
        "tokens": 0,
        "fetched_tokens": 0,
        "recomputed_tokens": 0,
        "policies": {},
        "latency": {"count": 0, "sum_s": 0.0, "buckets": []},
        "decision_s": {"p50": None, "p99": None, "samples": 0, "basis": "measured"},
        "queue_basis": "modeled",
    }
    out.update(totals)
    out["nodes"] = {
        n: {"decisions": d, "to_holder": h, "queue_s": 0.0} for n, (d, h) in nodes.items()
    }
    out["links"] = [
        {"from_dc": a, "to_dc": b, "chunks": c, "bytes": n}
        for (a, b), (c, n) in sorted((links or {}).items())
    ]
    return out


def poll(ts_s: float, router: dict[str, Any] | None, error: str | None = None) -> Poll:
    agents = [Reading(n, stats()) for n in (A, B, C)]
    return Poll(ts_s, agents, None, 0.01, RouterReading(URL, router, error))


def test_counts_since_start_and_the_windows_rates_per_node_and_link() -> None:
    s = Sampler(window_polls=2)
    first = s.update(
        poll(100.0, router_stats({"a": (10, 8), "b": (0, 0), "c": (0, 0)}, requested_chunks=40))
    )
    r = first.routing
    assert r is not None and r.up and r.total.decisions == 10
    # one poll: counts since the router started, no window yet (N/A, not zero)
    assert r.recent.seconds == 0 and r.recent.decisions_per_s is None
    row_a = first.row("a")
    assert row_a is not None and row_a.routing is not None
    assert row_a.routing.decisions == 10 and row_a.routing.lifetime_to_holder_share == 0.8
    assert row_a.routing.decisions_per_s is None and row_a.routing.to_holder_share is None

    s.update(
        poll(
            102.0,
            router_stats(
                {"a": (14, 12), "b": (2, 0), "c": (0, 0)},
                {("ams", "fra"): (3, 3000)},
                requested_chunks=60,
                indexed_chunks=30,
                local_chunks=20,
                pulled_chunks=3,
                pulled_bytes=3000,
                tokens=960,
                fetched_tokens=368,
                recomputed_tokens=592,
            ),
        )
    )
    view = s.update(
        poll(
            104.0,
            router_stats(
                {"a": (16, 14), "b": (6, 1), "c": (0, 0)},
                {("ams", "fra"): (5, 5000), ("fra", "ams"): (1, 1000)},
                requested_chunks=100,
                indexed_chunks=50,
                local_chunks=30,
                pulled_chunks=6,
                pulled_bytes=6000,
                tokens=1600,
                fetched_tokens=576,
                recomputed_tokens=1024,
            ),
        )
    )
    r = view.routing
    assert r is not None
    t = r.total  # since the router started
    assert t.decisions == 22 and t.to_holder == 15
    assert t.to_holder_share == pytest.approx(15 / 22)
    assert t.index_hit_ratio == pytest.approx(0.5)
    assert t.reused_ratio == pytest.approx(36 / 100)
    assert t.token_hit_ratio == pytest.approx(576 / 1600)
    # the window: 4 s, 12 decisions (a 6, b 6), 7 of them to a holder (a 6, b 1)
    assert r.recent.seconds == pytest.approx(4.0)
    assert r.recent.decisions == 12 and r.recent.decisions_per_s == pytest.approx(3.0)
    assert r.recent.to_holder_share == pytest.approx(7 / 12)
    ra, rb, rc = (view.row(n).routing for n in "abc")  # type: ignore[union-attr]
    assert ra is not None and rb is not None and rc is not None
    assert ra.decisions_per_s == pytest.approx(6 / 4) and ra.to_holder_share == pytest.approx(1.0)
    assert rb.decisions_per_s == pytest.approx(6 / 4) and rb.to_holder_share == pytest.approx(1 / 6)
    assert rc.decisions_per_s == 0 and rc.to_holder_share is None
    # links: bytes since start, and bytes/s over the window (a link first seen counts from 0)
    assert [(x.from_dc, x.to_dc, x.chunks, x.pulled_bytes) for x in r.links] == [
        ("ams", "fra", 5, 5000),
        ("fra", "ams", 1, 1000),
    ]
    assert [x.bytes_per_s for x in r.links] == [pytest.approx(5000 / 4), pytest.approx(1000 / 4)]
    # DC totals sum their nodes' decisions; the fleet's too
    fra = next(d for d in view.dcs if d.dc == "fra")
    assert fra.routing is not None and fra.routing.recent_decisions == 12
    assert fra.routing.to_holder_share == pytest.approx(7 / 12)
    assert view.total.routing is not None and view.total.routing.decisions == 22
    # sortable: most routed first, a node the router never sent work last
    assert [x.name for x in sort_rows(view.rows, "holder", reverse=True)] == ["a", "b", "c"]
    grouped = arrange(view, sort="routed", group=True)
    assert [ln.dc.dc if ln.dc else ln.row.name for ln in grouped] == ["ams", "c", "fra", "a", "b"]  # type: ignore[union-attr]
    data = json.loads(json.dumps(view.as_dict()))
    assert data["routing"]["since_router_start"]["decisions"] == 22
    assert data["routing"]["recent"]["decisions_per_s"] == pytest.approx(3.0)
    assert data["nodes"][0]["routing"]["recent"]["decisions"] == 6


def test_a_router_restart_counts_from_zero_and_a_gap_restarts_the_window() -> None:
    s = Sampler(max_gap_s=3.0)
    s.update(poll(0.0, router_stats({"a": (100, 90)}, {("fra", "ams"): (9, 900)})))
    # restarted: every counter is lower, so each is new since the new start
    view = s.update(poll(2.0, router_stats({"a": (4, 1)}, {("fra", "ams"): (1, 100)})))
    r = view.routing
    assert r is not None and r.recent.decisions == 4 and r.recent.to_holder == 1
    assert r.links[0].bytes_per_s == pytest.approx(100 / 2)
    # down for a poll: N/A with the reason, nodes' routing cells N/A
    down = s.update(poll(4.0, None, "the router at http://127.0.0.1:9480 did not answer"))
    assert down.routing is not None and not down.routing.up
    assert "did not answer" in (down.routing.error or "")
    assert all(row.routing is None for row in down.rows)
    assert json.loads(json.dumps(down.as_dict()))["routing"]["up"] is False
    # back after 4 s: the step across the gap is not averaged in
    back = s.update(poll(6.0, router_stats({"a": (10, 5)})))
    assert back.routing is not None and back.routing.up and back.routing.recent.seconds == 0
    assert back.routing.total.decisions == 10


def test_an_answer_that_is_not_the_routers_is_down_with_the_reason() -> None:
    view = Sampler().update(poll(1.0, {"status": "ok"}))
    assert view.routing is not None and not view.routing.up
    assert view.routing.error == "not a router's stats (KeyError: 'decisions')"
    bad = router_stats({"a": (1, 0)})
    bad["nodes"]["a"]["decisions"] = -3
    view = Sampler().update(poll(1.0, bad))
    assert view.routing is not None and "not a count: -3" in (view.routing.error or "")
    # the agents' rows are unaffected
    assert all(row.up for row in view.rows)


def test_no_router_no_routing() -> None:
    view = Sampler().update(Poll(1.0, [Reading(A, stats())], None, 0.01))
    assert view.routing is None and view.rows[0].routing is None
    assert view.as_dict()["routing"] is None


def test_cells_and_the_routing_lines() -> None:
    cells = Cells(Palette(), Thresholds())
    s = Sampler()
    first = s.update(poll(0.0, router_stats({"a": (2, 2), "b": (0, 0)})))
    assert str(cells.routed(first.row("a").routing)) == "N/A"  # type: ignore[union-attr]
    assert str(cells.to_holder(first.row("a").routing)) == "N/A"  # type: ignore[union-attr]
    assert str(cells.routed(first.row("c").routing)) == "N/A"  # type: ignore[union-attr]
    view = s.update(
        poll(
            2.0,
            router_stats(
                {"a": (5, 4), "b": (0, 0)},
                {("ams", "fra"): (4, 4 << 20), ("fra", "fra"): (1, 1 << 20)},
                requested_chunks=20,
                indexed_chunks=15,
                local_chunks=8,
                pulled_chunks=5,
                pulled_bytes=5 << 20,
                tokens=5120,
                fetched_tokens=3328,
                recomputed_tokens=1792,
                no_node=1,
            ),
        )
    )
    assert str(cells.routed(view.row("a").routing)) == "1.5"  # type: ignore[union-attr]
    assert str(cells.to_holder(view.row("a").routing)) == "67%"  # type: ignore[union-attr]
    assert str(cells.to_holder(view.row("b").routing)) == "idle"  # type: ignore[union-attr]
    assert view.routing is not None
    assert str(cells.routing(view.routing)).splitlines() == [
        "routing since the router started: 5 decisions · 80% to a holder · index hit 75% of 20 "
        "chunks · reused 65%: 8 local, 5 pulled · tokens fetched 3,328, prefilled 1,792 · 1 "
        "with no node",
        "now 1.5 decisions/s · pulled between DCs since the router started: ams→fra 4.0M in 4 "
        "chunks (2.0M/s now) · within a DC: fra 1.0M in 1 chunks (512K/s now)",
    ]
    down = RoutingView(URL, False, "the router answered 401: bad token")
    assert str(cells.routing(down)) == (
        "router down: the router answered 401: bad token · routing figures N/A"
    )


def test_the_router_watch_never_raises_and_checks_its_url() -> None:
    watch = RouterWatch(f"http://127.0.0.1:{closed_port()}", timeout_s=0.5)
    try:
        reading = watch.read()
    finally:
        watch.close()
    assert reading.stats is None and "did not answer" in (reading.error or "")
    assert router_url("https://router.example:9480/") == "https://router.example:9480"
    with pytest.raises(ValueError, match="not a router URL"):
        router_url("127.0.0.1:9480")
    with pytest.raises(ValueError, match="not in its URL"):
        router_url("http://op:secret@127.0.0.1:9480")
