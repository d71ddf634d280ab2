"""The dashboard's Routing page on a known history of router scrapes (SQLite and PostgreSQL):
hand-worked KPIs, decisions per node, pulls per DC link, the saved route report as `kvctl bench
route` returns it, the empty states; and the Links page labelling an RTT by its basis."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from dashboard.app import create_app, render
from dashboard.pages import rtt_badge, rtt_basis_label
from kvctl.bench.route import RouteBenchConfig, run_route_bench
from kvctl.db.analytics.links import RttBasis
from kvctl.db.analytics.routing import pulled_series, routing_summary
from kvctl.db.analytics.windows import window_for
from kvctl.db.ingest import insert_rows
from kvctl.db.models import raw_table
from kvctl.db.rollup import MINUTE_MS
from kvctl.db.route_reports import latest_route_report, save_route_report
from kvctl.format import format_bytes
from tests.functional.dashboard_history import NOW, OLD, T, fill_history
from tests.functional.test_dashboard_app import by_id, card_value, text_of, url_of, walk

ROUTER = "http://router-1:9480"
MIB = 2**20
ROUTE_COUNTERS = ("decisions", "to_holder", "no_node", "requested_chunks", "indexed_chunks",
                  "local_chunks", "pulled_chunks", "pulled_bytes", "tokens", "fetched_tokens",
                  "recomputed_tokens", "decision_s")  # fmt: skip


def _router_row(ts_ms: int, **counts: float) -> dict[str, Any]:
    return {"router": ROUTER, "node": "", "ts_ms": ts_ms, **dict.fromkeys(ROUTE_COUNTERS, 0),
            **counts}  # fmt: skip


def _node_row(ts_ms: int, node: str, decisions: int, to_holder: int) -> dict[str, Any]:
    row = {"router": ROUTER, "node": node, "ts_ms": ts_ms, **dict.fromkeys(ROUTE_COUNTERS)}
    return {**row, "decisions": decisions, "to_holder": to_holder}


def _link_row(ts_ms: int, a: str, b: str, chunks: int) -> dict[str, Any]:
    return {"router": ROUTER, "from_dc": a, "to_dc": b, "ts_ms": ts_ms,
            "pulled_chunks": chunks, "pulled_bytes": chunks * MIB}  # fmt: skip


def fill_routing(db: Engine) -> None:
    later = T + 10 * MINUTE_MS
    with db.begin() as conn:
        insert_rows(
            conn,
            raw_table("route_sample"),
            [
                _router_row(OLD, decisions=100, to_holder=100),  # before the window
                _router_row(T, decisions=6, to_holder=3, no_node=1, requested_chunks=20,
                            indexed_chunks=12, local_chunks=8, pulled_chunks=4,
                            pulled_bytes=4 * MIB, tokens=5120, fetched_tokens=3072,
                            recomputed_tokens=2048, decision_s=0.006),
                _router_row(later, decisions=4, to_holder=4, requested_chunks=10,
                            indexed_chunks=8, local_chunks=6, pulled_chunks=2,
                            pulled_bytes=2 * MIB, tokens=2560, fetched_tokens=2048,
                            recomputed_tokens=512, decision_s=0.004),
                _node_row(T, "fra-a", 4, 1),
                _node_row(T, "ams-a", 2, 2),
                _node_row(later, "fra-a", 1, 1),
                _node_row(later, "ams-a", 3, 3),
            ],
        )  # fmt: skip
        insert_rows(
            conn,
            raw_table("route_link_sample"),
            [_link_row(T, "ams", "fra", 4), _link_row(later, "fra", "fra", 2)],
        )


@pytest.fixture
def app(db: Engine):  # type: ignore[no-untyped-def]
    fill_history(db)
    app = create_app(url_of(db), now_ms=lambda: NOW)
    yield app
    app.server.extensions["kvctl"].engine.dispose()


def test_routing_page_empty_says_how_to_get_data(app: Any) -> None:
    page, _ = render(app, "/routing", "", "1h", None, None)
    text = text_of(page)
    assert "No router decisions recorded" in text
    assert "kvctl collect --router URL" in text
    assert "No route report saved" in text


def test_routing_summary_and_page_with_data(app: Any, db: Engine) -> None:
    fill_routing(db)
    with db.connect() as conn:
        r = routing_summary(conn, NOW - 60 * MINUTE_MS, NOW)
    assert (r.decisions, r.to_holder, r.no_node, r.scrapes) == (10, 7, 1, 2)
    assert r.to_holder_share == pytest.approx(0.7)
    assert r.index_hit_ratio == pytest.approx(20 / 30)
    assert r.fetched_token_share == pytest.approx(5120 / 7680)
    with db.connect() as conn:
        ps = pulled_series(conn, window_for("1h", NOW))
    i, j = ps.bucket_ms.index(T), ps.bucket_ms.index(T + 10 * MINUTE_MS)
    assert list(ps.pulled_bytes) == [("ams", "fra"), ("fra", "fra")]
    assert (
        ps.pulled_bytes["ams", "fra"][i] == 4 * MIB and ps.pulled_bytes["fra", "fra"][j] == 2 * MIB
    )
    assert sum(v is not None for v in ps.pulled_bytes["ams", "fra"]) == 1
    assert r.decision_mean_s == pytest.approx(0.001)
    assert [(n.node, n.decisions, n.to_holder) for n in r.nodes] == [
        ("ams-a", 5, 5),
        ("fra-a", 5, 2),
    ]
    assert [(lk.from_dc, lk.to_dc, lk.pulled_bytes) for lk in r.links] == [
        ("ams", "fra", 4 * MIB),
        ("fra", "fra", 2 * MIB),
    ]

    page, _ = render(app, "/routing", "", "1h", None, None)
    assert card_value(page, "card-route-decisions") == "10"
    assert card_value(page, "card-route-holder") == "70.0%"
    assert card_value(page, "card-route-index") == "66.7%"
    assert card_value(page, "card-route-fetched") == "5,120"
    assert card_value(page, "card-route-pulled") == "6 MiB"
    assert "modeled" in text_of(by_id(page, "card-route-fetched"))
    nodes = {row["node"]: row for row in by_id(page, "table-route-nodes").data}
    assert nodes["fra-a"]["to no holder"] == 3 and nodes["ams-a"]["share to a holder"] == "100.0%"
    links = {row["link"]: row for row in by_id(page, "table-route-links").data}
    assert links["ams→fra"]["bytes"] == 4 * MIB and links["fra"]["chunks"] == 2
    by_id(page, "fig-route-nodes")
    by_id(page, "fig-route-pulls")
    # every section says its basis
    for section in (c for c in walk_sections(page)):
        label = text_of(section)
        assert "measured" in label or "modeled" in label

    # the last scrape is 30 minutes old: none in a 15-minute window
    page, _ = render(app, "/routing", "", "15m", None, None)
    assert "No router decisions recorded" in text_of(page)


def walk_sections(page: Any) -> list[Any]:
    from tests.functional.test_dashboard_app import walk

    return [c for c in walk(page) if getattr(c, "className", "") == "section"]


def test_route_report_as_bench_route_returns_it(app: Any, db: Engine) -> None:
    result = run_route_bench(
        RouteBenchConfig.quick(workloads=("chat",), requests=40, redis_url=None)
    )
    with db.begin() as conn:
        save_route_report(conn, result, now_ms=NOW - MINUTE_MS)
    with db.connect() as conn:
        assert latest_route_report(conn) == json.loads(json.dumps(result))
    page, _ = render(app, "/routing", "", "1h", None, None)
    rows = {row["policy"]: row for row in by_id(page, "table-route-report-0").data}
    policies = result["workloads"][0]["policies"]
    assert set(rows) == set(policies)
    cost = policies["cost"]
    assert rows["cost"]["hit ratio"] == f"{cost['hit_ratio'] * 100:.1f}%"
    ratio = cost["vs_reference"]["ttft_mean_ratio_to_reference"]
    assert rows["cost"]["mean TTFT vs round-robin"] == f"{ratio:.2f}x"
    assert rows["round-robin"]["mean TTFT vs round-robin"] == "1.00x"
    # labelled exactly as the report's own basis says
    assert result["modeled_inputs"]["basis"] in text_of(page)
    # and with what a pulled block weighs in its bytes (the model's whole KV)
    pulled = [p for p in policies.values() if sum(p["pulled_chunks_by_link"].values())]
    assert pulled  # round-robin pulls on this workload
    per = pulled[0]["pulled_bytes"] / sum(pulled[0]["pulled_chunks_by_link"].values())
    assert f"bytes at {format_bytes(per)} per pulled block" in text_of(page)

    # a report with a basis of its own (the demo's) is labelled with that
    demo = {"basis": "replayed on size-only tiers, TTFT modeled", **result["workloads"][0]}
    with db.begin() as conn:
        save_route_report(conn, demo, now_ms=NOW)
    page, _ = render(app, "/routing", "", "1h", None, None)
    assert "replayed on size-only tiers, TTFT modeled" in text_of(page)
    assert len(by_id(page, "table-route-report-0").data) == len(policies)


def test_links_page_labels_rtt_by_basis(app: Any, db: Engine) -> None:
    from sqlalchemy import select

    from kvctl.db.models import Node

    with db.connect() as conn:
        ids = dict(conn.execute(select(Node.name, Node.id)).all())
    emulated = {"src_node_id": ids["fra-b"], "dst_node_id": ids["ams-a"],
                "ts_ms": T + 3 * MINUTE_MS, "rtt_s": 0.0018, "bandwidth_bytes_per_s": 1e9,
                "loss_ratio": 0.0,
                "probe_bytes": 1, "ok": True, "error": None, "rtt_basis": "emulated",
                "emulated_delay_s": 0.0008}  # fmt: skip
    with db.begin() as conn:
        insert_rows(conn, raw_table("link_sample"), [emulated])
    page, _ = render(app, "/links", "", "1h", None, None)
    (row,) = by_id(page, "table-links").data
    # the history's older probes carry no basis: measured
    assert row["RTT basis"] == "emulated (+0.80 ms delay) and measured"
    assert "emulated (+0.80 ms delay)" in text_of(page)
    assert rtt_basis_label(RttBasis({"measured": 3}, None, None)) == "measured"
    assert rtt_basis_label(RttBasis({"emulated": 2}, 0.0008, 0.0008)) == "emulated (+0.80 ms delay)"
    # the figures of those RTTs are badged with both bases, not "measured"
    assert badge_of(page, "fig-rtt-matrix") == "measured + emulated"
    assert badge_of(page, "fig-rtt-time") == "measured + emulated"
    fleet, _ = render(app, "/", "", "1h", None, None)
    assert badge_of(fleet, "fig-schematic") == "measured + emulated"


def badge_of(page: Any, graph_id: str) -> str:
    """The basis badge of the section holding ``graph_id``."""
    for section in (c for c in walk(page) if getattr(c, "className", "") == "section"):
        if any(getattr(c, "id", None) == graph_id for c in walk(section)):
            badge = next(c for c in walk(section) if "basis " in getattr(c, "className", ""))
            return str(badge.children)
    raise AssertionError(f"no section holds {graph_id!r}")


def test_rtt_badge_by_the_probes_of_the_dcs_shown() -> None:
    measured, emulated = (
        RttBasis({"measured": 3}, None, None),
        RttBasis({"emulated": 2}, 1e-3, 1e-3),
    )
    both = {("ams", "fra"): measured, ("fra", "lon"): emulated}
    assert rtt_badge({("ams", "fra"): measured}, ["ams", "fra"]) == "measured"
    assert rtt_badge({("fra", "lon"): emulated}, ["fra", "lon"]) == "emulated"
    assert rtt_badge(both, ["ams", "fra", "lon"]) == "measured-emulated"
    # only the links of the DCs shown count
    assert rtt_badge(both, ["ams"]) == "measured"
    assert rtt_badge(both, ["lon"]) == "emulated"
    assert rtt_badge({}, ["ams"]) == "measured"


def test_the_sharing_cards_name_the_block_size_they_count_by() -> None:
    """The replayed ratios count the workload's blocks, the measured Hit ratio the agents'
    full chunks: next to each other, the titles say which (a review read a replayed ceiling
    under the measured figure as an error)."""
    from dashboard.pages import sharing_cards
    from kvctl.db.route_reports import SavedRouteReport

    report = {
        "requests": 40,
        "sharing": {
            "with_sharing": {"hit_ratio": 0.711, "pulled_hit_ratio": 0.1},
            "without_sharing": {"hit_ratio": 0.6},
            "hit_ratio_gain": 0.111,
            "unlimited_cache_hit_ratio": 0.715,
            "block_tokens": 512,
        },
    }
    cards = sharing_cards(SavedRouteReport(NOW, report))
    titles = [text_of(c) for c in cards]
    assert "Hit ratio with sharing (per 512-token block)" in titles[0]
    assert "Hit ratio without sharing (per 512-token block)" in titles[1]
    assert "the measured Hit ratio counts the agents' full chunks" in titles[1]
