"""How many tiers, nodes and links one answer may make the collector write, on a real SQLite
and PostgreSQL. Each tier an agent reports is a ``cache_sample`` and a ``counter_state`` row
a scrape, each node or DC link a router reports a row: an adversarial review's agent reporting
20,000 tiers had the collector write 40,000 rows a scrape (80,000 in 30 s), and the
dashboard's fleet page then take 10 s. An agent has at most five tiers; more than
``MAX_TIERS`` are rejected (named, none read, the node's counters wait), a router's answer
with more than ``MAX_ROUTER_NODES`` nodes or ``MAX_ROUTER_LINKS`` links is not read (said why).

The agent and the router are stand-ins (``StandIn``, a loopback HTTP server).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from collectors.router import MAX_ROUTER_LINKS, MAX_ROUTER_NODES, ROUTER_COUNTERS
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.sample_checks import MAX_TIERS
from tests.functional.test_collector_impossible_values import T0_S, StandIn, _stats

pytestmark = pytest.mark.slow


def _count(db: Engine, table: str) -> int:
    with db.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def _many_tiers(n: int, lookups: int, hits: int) -> dict[str, Any]:
    answer = _stats(lookups, hits, 1.0)
    for i in range(n):
        answer["stats"]["tiers"][f"t{i}"] = copy.deepcopy(answer["stats"]["tiers"]["disk"])
        answer["usage"][f"t{i}"] = dict(answer["usage"]["disk"])
    return answer


def test_an_agent_reporting_thousands_of_tiers_is_not_read(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    n1, _n2 = stand_ins
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=n1.url)
    now = [T0_S]
    # deadlines a loaded machine meets: the 20,000-tier answer is megabytes of JSON, and what
    # is checked here is that it is refused by its count, not by the default 4 s deadline nor
    # by the cycle's wait for its scrapes (0.9 x interval_s: 4.5 s at 5 s missed it in CI)
    config = CollectorConfig(interval_s=60.0, timeout_s=60.0)
    collector = Collector(db, config, clock=lambda: now[0])
    reports = []
    try:
        # a baseline, 20,000 tiers, then sound again: 10 lookups, 6 hits since the baseline
        for answer in (_stats(10, 4, 1.0), _many_tiers(20_000, 15, 7), _stats(20, 10, 1.0)):
            n1.answers["/v1/stats"] = answer
            reports.append(collector.collect_once())
            assert reports[-1].written, reports[-1].warnings
            now[0] += 10
    finally:
        collector.close()
    first, many, after = reports
    assert many.up == ["n1"] and many.rejected == {
        "n1": {
            "stats.tiers": f"20,002 tiers, more than the {MAX_TIERS} read",
            "usage": f"20,002 tiers, more than the {MAX_TIERS} read",
        }
    }
    assert first.rejected == {} and after.rejected == {}
    # the baseline's and the last scrape's rows (all, cpu, disk) only; counter series likewise
    assert _count(db, "cache_sample") == 6 and _count(db, "counter_state") < 10
    with db.connect() as conn:
        total = conn.execute(
            text("SELECT lookups, hits FROM cache_sample WHERE tier = 'all' ORDER BY ts_ms")
        ).all()
    # the node's counters waited through the unread scrape: counted whole at the next
    assert [tuple(r) for r in total] == [(0, 0), (10, 6)]


def _router_stats(nodes: int, links: int) -> dict[str, Any]:
    return {
        **dict.fromkeys(ROUTER_COUNTERS, 0),
        "latency": {"sum_s": 0.0},
        "nodes": {f"n{i}": {"decisions": 1, "to_holder": 0} for i in range(nodes)},
        "links": [
            {"from_dc": f"d{i}", "to_dc": "x", "chunks": 1, "bytes": 1} for i in range(links)
        ],
    }


@pytest.mark.parametrize(
    ("nodes", "links", "why"),
    [
        (MAX_ROUTER_NODES + 1, 0, f"{MAX_ROUTER_NODES + 1:,} nodes, more than the"),
        (1, MAX_ROUTER_LINKS + 1, f"{MAX_ROUTER_LINKS + 1:,} links, more than the"),
    ],
)
def test_a_router_reporting_too_many_nodes_or_links_is_not_read(
    db: Engine, stand_ins: tuple[StandIn, StandIn], nodes: int, links: int, why: str
) -> None:
    router, _n2 = stand_ins
    router.answers["/v1/info"] = {"started_s": T0_S - 100}
    router.answers["/v1/stats"] = _router_stats(nodes, links)
    # a deadline a loaded machine meets (the answers are megabytes of JSON)
    collector = Collector(
        db, CollectorConfig(interval_s=5.0, timeout_s=60.0, routers=(router.url,))
    )
    try:
        report = collector.collect_once()
        # within the caps: read
        router.answers["/v1/stats"] = _router_stats(MAX_ROUTER_NODES, MAX_ROUTER_LINKS)
        sound = collector.collect_once()
    finally:
        collector.close()
    assert report.routers_up == [] and why in report.routers_down[router.url]
    assert sound.routers_up == [router.url]
    assert _count(db, "route_sample") == MAX_ROUTER_NODES + 1
    assert _count(db, "route_link_sample") == MAX_ROUTER_LINKS


def test_the_router_caps_leave_room_for_a_large_fleet() -> None:
    """A router's answer names every node it ever decided for and its DCs' pulling pairs: the
    first caps (4,096 each) reported a 128-DC fleet's router down (a review's reading)."""
    dcs = 128
    assert dcs * (dcs - 1) <= MAX_ROUTER_LINKS and MAX_ROUTER_NODES >= 4 * 4096
