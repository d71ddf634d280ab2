"""Figures no BIGINT column holds, on a real SQLite and PostgreSQL: a router counting beyond
it, an agent whose tiers' figures each fit but sum (the node's ``all`` row) beyond it, a
router's seconds as an int no float holds. The figure is refused by name, and every node's
samples of the cycle are written all the same.

Router and agent are stand-ins answering over loopback HTTP (a real router or agent never
counts past 2**63; one buggy or hostile can say so).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from collectors.router import ROUTER_COUNTERS
from kvctl.db.inventory import add_dc, add_node
from tests.functional.test_collector_impossible_values import T0_S, StandIn, _rows, _stats

pytestmark = pytest.mark.slow


def _router_stats(requested: int) -> dict[str, Any]:
    return {
        **dict.fromkeys(ROUTER_COUNTERS, 0),
        "requested_chunks": requested,
        "latency": {"sum_s": 0.0},
        "nodes": {"n1": {"decisions": 0, "to_holder": 0}},
        "links": [],
    }


@pytest.fixture
def stand_ins() -> Iterator[tuple[StandIn, StandIn]]:
    agent, router = StandIn("n1"), StandIn("router")
    router.answers["/v1/info"] = {"started_s": 1_700_000_000.0}
    try:
        yield agent, router
    finally:
        agent.close()
        router.close()


def test_a_count_beyond_bigint_refuses_the_router_not_the_batch(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """Before, the increase (2**64 - 5) went into a BIGINT column: PostgreSQL refused the
    cycle's whole batch, every node's rows with it, at every retry; SQLite's driver raised
    OverflowError out of collect_once, ending the collector's loop."""
    agent, router = stand_ins
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url)
    now = [T0_S]
    config = CollectorConfig(interval_s=5.0, routers=(router.url,))
    collector = Collector(db, config, clock=lambda: now[0])
    try:
        router.answers["/v1/stats"] = _router_stats(5)
        first = collector.collect_once()
        assert first.written and first.routers_up == [router.url]
        now[0] += 5
        router.answers["/v1/stats"] = _router_stats(2**64)
        report = collector.collect_once()
        assert report.written, report.warnings
        assert "requested_chunks" in report.routers_down[router.url]
        assert len(_rows(db, "node_sample", 1)) == 2
        assert len(_rows(db, "cache_sample", 1)) == 6  # all, cpu, disk at each scrape
    finally:
        collector.close()


def test_tier_figures_summing_beyond_bigint_are_rejected_not_the_batch(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """Each tier's capacity and bytes read fit a BIGINT, their sums (the node's ``all`` row)
    do not. Before, PostgreSQL refused the cycle's whole batch at every retry, and SQLite's
    driver raised OverflowError out of collect_once. Now the sums are rejected by name and
    the node's ``all`` figures are unknown for that scrape; the tiers' rows are kept."""
    agent, _router = stand_ins
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url)
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=5.0), clock=lambda: now[0])
    try:
        assert collector.collect_once().written
        now[0] += 5
        stats = _stats(10, 4, 1.0)
        for tier in ("cpu", "disk"):
            stats["usage"][tier]["capacity_bytes"] = 2**62
            stats["stats"]["tiers"][tier]["bytes_read"] = 2**62 + 1
        agent.answers["/v1/stats"] = stats
        report = collector.collect_once()
        assert report.written, report.warnings
        assert set(report.rejected["n1"]) >= {
            "usage (capacity_bytes summed)",
            "stats.tiers (bytes_read summed)",
        }, report.rejected
    finally:
        collector.close()
    rows = _rows(db, "cache_sample", 1)
    assert sorted(r["tier"] for r in rows if r["ts_ms"] == report.ts_ms) == ["cpu", "disk"]


@pytest.mark.parametrize("where", ["latency.sum_s", "info.started_s"])
def test_seconds_beyond_a_float_refuse_the_router_not_the_cycle(
    db: Engine, stand_ins: tuple[StandIn, StandIn], where: str
) -> None:
    """A router's seconds as an integer of 400 digits (JSON reads it as an int no float
    holds). Before, math.isfinite raised OverflowError out of the router's scrape and
    collect_once, ending the collector's loop."""
    agent, router = stand_ins
    stats = _router_stats(5)
    if where == "latency.sum_s":
        stats["latency"]["sum_s"] = 10**400
    else:
        router.answers["/v1/info"] = {"started_s": 10**400}
    router.answers["/v1/stats"] = stats
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url)
    config = CollectorConfig(interval_s=5.0, routers=(router.url,))
    collector = Collector(db, config, clock=lambda: T0_S)
    try:
        report = collector.collect_once()
    finally:
        collector.close()
    assert report.written and report.up == ["n1"], report.as_dict()
    assert where in report.routers_down[router.url], report.routers_down


def test_a_counter_bouncing_past_bigint_in_sum_leaves_the_rollups_running(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """An agent whose bytes-read counter bounces between 2**62 and 0: each row's increase fit a
    BIGINT, but the minute's rollup summed two of them past it, and that one failed
    transaction stopped every series' rollups (kvctl db maintain failed, windows fell back
    on raw rows for ever). An increase faster than any node counts is now dropped."""
    from kvctl.db.rollup import HOUR_MS, Retention, maintain

    agent, _router = stand_ins
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url)
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=5.0), clock=lambda: now[0])
    try:
        for read in (0, 2**62, 0, 2**62, 0, 10):  # 10 s apart, within one minute
            stats = _stats(10, 4, 1.0)
            stats["stats"]["tiers"]["cpu"]["bytes_read"] = read
            agent.answers["/v1/stats"] = stats
            report = collector.collect_once()
            assert report.written and not report.rejected, report.as_dict()
            now[0] += 10
    finally:
        collector.close()
    done = maintain(db, int(T0_S * 1000) + 2 * HOUR_MS, Retention())
    assert done["rolled_up"], done
    with db.connect() as conn:
        q = "SELECT SUM(bytes_read) FROM cache_1m WHERE tier = 'cpu'"
        rolled = conn.exec_driver_sql(q).scalar_one()
    assert rolled == 10  # the last, believable increase; the bounces counted nothing
