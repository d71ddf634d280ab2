"""Hits that cannot be true, on a real SQLite and PostgreSQL: an agent whose hits rose more
than its lookups in an interval (an adversarial review's node added 1e9 hits a scrape over 1
lookup, and the dashboard's fleet card read "Hit ratio 10000000100.0%"), and one that says it
restarted at every scrape (its whole counters counted again each time).

The collector records such an interval's hit counts as unknown (0, the columns are NOT NULL)
and names the fields in ``rejected``; counting goes on from the bad values, so the next
sound interval is exact. Rows recorded before (an older collector's) are read as unknown per
node: the fleet's and the DC's ratios are over the other nodes, never above 100%.

The agents are stand-ins (a loopback HTTP server, ``StandIn``): a real agent never says this.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig, CycleReport
from kvctl.db.analytics.counts import Assumptions
from kvctl.db.analytics.overview import overview
from kvctl.db.analytics.recorded import recorded
from kvctl.db.analytics.series import time_series
from kvctl.db.analytics.summary import fleet_summary
from kvctl.db.analytics.windows import Window
from kvctl.db.ingest import insert_rows
from kvctl.db.inventory import add_dc, add_node, list_nodes
from kvctl.db.models import Node, raw_table
from kvctl.db.rollup import HOUR_MS
from kvctl.profiles import MODELS
from tests.functional.test_collector_impossible_values import (
    STARTED_S,
    T0_S,
    StandIn,
    _rows,
    _stats,
)

pytestmark = pytest.mark.slow

INFLATED = 10**9
#: every hit count of the node and its cpu tier rose past its lookups (chunks and tokens)
BEYOND = "rose more than stats.lookup_chunks since the last scrape"
BEYOND_TOKENS = "rose more than stats.lookup_tokens since the last scrape"
WINDOW = Window("1h", int(T0_S * 1000) - 60_000, int(T0_S * 1000) + HOUR_MS, 60_000)


def _fleet(db: Engine, stand_ins: tuple[StandIn, StandIn]) -> dict[str, int]:
    n1, n2 = stand_ins
    for n in stand_ins:  # no uptime: each agent's first scrape is its baseline
        n.answers["/v1/health"] = {"status": "ok"}
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=n1.url, gpu_model="H100")
        add_node(conn, "n2", dc="fra", agent_url=n2.url, gpu_model="H100")
    with db.connect() as conn:
        return dict(conn.execute(select(Node.name, Node.id)).all())


def _collect(
    db: Engine, stand_ins: tuple[StandIn, StandIn], answers: list[tuple[Any, Any]]
) -> list[CycleReport]:
    """One cycle per (n1's, n2's) /v1/stats answer, 10 s apart; their reports."""
    n1, n2 = stand_ins
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=5.0), clock=lambda: now[0])
    reports: list[CycleReport] = []
    try:
        for a1, a2 in answers:
            n1.answers["/v1/stats"], n2.answers["/v1/stats"] = a1, a2
            reports.append(collector.collect_once())
            assert reports[-1].written, reports[-1].warnings
            now[0] += 10
    finally:
        collector.close()
    return reports


def _ratios(db: Engine) -> dict[str, Any]:
    """The fleet's and each node's hit ratios as the dashboard and `kvctl status` read them."""
    assume = Assumptions(MODELS["llama-3.1-8b"], default_gpu="h100", mfu=0.5)
    with db.connect() as conn:
        ov = overview(conn, WINDOW, assume)
        summary = fleet_summary(conn, WINDOW.start_ms, WINDOW.end_ms)
        nodes = list_nodes(conn)
        rec = recorded(conn, WINDOW, nodes)
        series = time_series(conn, WINDOW, [n.id for n in nodes])
    return {
        "fleet": (ov.fleet.hit_ratio, ov.fleet.token_hit_ratio, ov.fleet.tier_hit_ratio("cpu")),
        "fleet_counts": (ov.fleet.hits, ov.fleet.lookups),
        "summary": (summary.total.hit_ratio, summary.dcs[0].hit_ratio),
        "recorded": {n.name: c.hit_ratio for n, c in rec.nodes},
        "recorded_total": rec.fleet.hit_ratio,
        "series": [c.hit_ratio for c in series.hit_counts() if c.lookups or c.hits],
    }


def test_hits_rising_past_lookups_are_rejected_and_counting_goes_on(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    ids = _fleet(db, stand_ins)
    inflated = _stats(11, INFLATED + 4, 1.0)
    reports = _collect(
        db,
        stand_ins,
        [
            (_stats(10, 4, 1.0), _stats(10, 4, 1.0)),  # the baseline
            (_stats(20, 9, 1.0), inflated),  # n2: 1e9 hits over 1 lookup
            (_stats(30, 12, 1.0), _stats(16, INFLATED + 7, 1.0)),  # n2: 3 hits over 5
        ],
    )
    first, bad, good = reports
    assert first.rejected == {} and good.rejected == {}
    assert bad.rejected == {
        "n2": {
            "stats.hit_chunks": BEYOND,
            "stats.sharing_hits": BEYOND,
            "stats.hit_tokens": BEYOND_TOKENS,
            "stats.tiers.cpu.hits": BEYOND,
            "stats.tiers.cpu.sharing_hits": BEYOND,
            "stats.tiers.cpu.hit_tokens": BEYOND_TOKENS,
        }
    }
    assert any(w.startswith("n2: 6 value(s) rejected") for w in bad.warnings)

    t2, t3 = (int((T0_S + 10 * i) * 1000) for i in (1, 2))
    cache = _rows(db, "cache_sample", ids["n2"])
    at = {(r["ts_ms"], r["tier"]): r for r in cache}
    # the bad interval: no hit counted, in any tier; its gauges and other counters recorded
    for tier in ("all", "cpu", "disk"):
        row = at[(t2, tier)]
        assert (row["lookups"], row["hits"], row["hit_tokens"], row["sharing_hits"]) == (0,) * 4
    assert at[(t2, "all")]["used_bytes"] == 4096
    # counted on from the bad values: the next interval is exact
    assert (at[(t3, "all")]["hits"], at[(t3, "all")]["lookups"]) == (3, 5)
    assert at[(t3, "cpu")]["hits"] == 3 and at[(t3, "all")]["hit_tokens"] == 3 * 256

    # n1: 8 hits over 20 lookups, n2: 3 over 5; never a ratio above 100%
    ratios = _ratios(db)
    assert ratios["fleet_counts"] == (11, 25)
    assert ratios["fleet"] == (pytest.approx(11 / 25),) * 3
    assert ratios["summary"] == (pytest.approx(11 / 25),) * 2
    assert ratios["recorded"] == {"n1": pytest.approx(8 / 20), "n2": pytest.approx(3 / 5)}


def test_old_rows_with_hits_past_lookups_are_unknown_not_above_100_percent(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """Rows an older collector recorded from such an agent: the node's hit counts over the
    window are unknown (its ratio None), the fleet's and the DC's are the other node's."""
    ids = _fleet(db, stand_ins)
    t0 = int(T0_S * 1000)

    def row(node: str, tier: str, ts_ms: int, lookups: int, hits: int) -> dict[str, Any]:
        return {
            "node_id": ids[node],
            "tier": tier,
            "ts_ms": ts_ms,
            "lookups": lookups if tier == "all" else 0,
            "lookup_tokens": lookups * 256 if tier == "all" else 0,
            "hits": hits,
            "hit_tokens": hits * 256,
            "reuse_hits": 0,
            "sharing_hits": hits,
            "evictions": 0,
            "promotions": 0,
            "demotions": 0,
            "bytes_read": 0,
            "bytes_written": 0,
            "used_bytes": 1,
            "capacity_bytes": 2,
            "pinned_bytes": 0,
            "items": 1,
        }

    rows = [row("n1", t, t0 + i * 10_000, 10, 4) for i in range(3) for t in ("all", "cpu")]
    rows += [row("n2", t, t0 + 10_000, 1, INFLATED) for t in ("all", "cpu")]
    rows += [row("n2", t, t0 + 20_000, 10, 5) for t in ("all", "cpu")]
    with db.begin() as conn:
        insert_rows(conn, raw_table("cache_sample"), rows)
    ratios = _ratios(db)
    assert ratios["fleet"] == (pytest.approx(12 / 30),) * 3
    assert ratios["fleet_counts"] == (12, 30)
    assert ratios["summary"] == (pytest.approx(12 / 30),) * 2
    assert ratios["recorded"] == {"n1": pytest.approx(0.4), "n2": None}
    assert ratios["recorded_total"] == pytest.approx(0.4)
    # bucket by bucket (1 minute): the bad node's bucket left out of that bucket's counts
    assert all(r is not None and 0 <= r <= 1 for r in ratios["series"]), ratios["series"]


def test_a_node_restarting_at_every_scrape_is_not_counted_again_each_time(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """A new ``started_s`` at every scrape, the counters the same: each restart counted its
    whole counters from zero again (1,000 lookups a scrape that no one made). One restart is
    counted; one at the very next scrape again is not (its values the new baseline), and
    ``started_s`` is named; once the start time holds, counting goes on from there."""
    ids = _fleet(db, stand_ins)

    def at(started_s: float, lookups: int = 1000, hits: int = 500) -> dict[str, Any]:
        answer = _stats(lookups, hits, 1.0)
        answer["started_s"] = started_s
        return answer

    sound = _stats(10, 4, 1.0)
    reports = _collect(
        db,
        stand_ins,
        [
            (sound, at(STARTED_S)),  # the baseline
            (sound, at(STARTED_S + 11)),  # a restart: counted from zero
            (sound, at(STARTED_S + 22)),  # again: not counted
            (sound, at(STARTED_S + 33)),  # again: not counted
            (sound, at(STARTED_S + 33, 1010, 506)),  # it held: 10 lookups, 6 hits
        ],
    )
    why = "a new start time again, as at the previous scrape: its restart not counted"
    assert [r.rejected.get("n2") for r in reports] == [
        None,
        None,
        {"started_s": why},
        {"started_s": why},
        None,
    ]
    total = [r for r in _rows(db, "cache_sample", ids["n2"]) if r["tier"] == "all"]
    assert [(r["lookups"], r["hits"]) for r in total] == [
        (0, 0),
        (1000, 500),
        (0, 0),
        (0, 0),
        (10, 6),
    ]
    plans = _rows(db, "plan_sample", ids["n2"])
    assert [p["fetch_chunks"] for p in plans] == [0, 500, None, None, 6]
