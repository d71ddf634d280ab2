"""Text with a NUL character or a lone surrogate in what an agent or a router answers (a
tier's name, a plan's model or GPU, a router's node and DC names), on a real SQLite and
PostgreSQL. PostgreSQL stores no NUL in text, and neither driver encodes a lone surrogate:
one such string refused the cycle's whole batch, every node's samples with it, at every retry
(or, on SQLite, ended the collector's loop). The tier is refused by name; other text is stored
with the character replaced by U+FFFD.

Agent and router are stand-ins answering over loopback HTTP.
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


@pytest.fixture
def stand_ins() -> Iterator[tuple[StandIn, StandIn]]:
    agent, router = StandIn("n1"), StandIn("router")
    router.answers["/v1/info"] = {"started_s": 1_700_000_000.0}
    router.answers["/v1/stats"] = {
        **dict.fromkeys(ROUTER_COUNTERS, 0),
        "latency": {"sum_s": 0.0},
        "nodes": {"n\x001": {"decisions": 1, "to_holder": 0}},
        "links": [{"from_dc": "a\x00", "to_dc": "b", "chunks": 1, "bytes": 2}],
    }
    try:
        yield agent, router
    finally:
        agent.close()
        router.close()


def _nul_stats() -> dict[str, Any]:
    stats = _stats(10, 4, 1.0)
    stats["stats"]["tiers"]["x\x00"] = stats["stats"]["tiers"]["disk"]
    stats["usage"]["x\x00"] = stats["usage"]["disk"]
    stats["fetch_plans"]["prefill"]["inputs"]["model"] = "llama\x00"
    return stats


def test_nul_in_answered_text_is_not_the_batch(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    agent, router = stand_ins
    agent.answers["/v1/stats"] = _nul_stats()
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url)
    now = [T0_S]
    config = CollectorConfig(interval_s=5.0, routers=(router.url,))
    collector = Collector(db, config, clock=lambda: now[0])
    try:
        for _ in range(2):
            report = collector.collect_once()
            assert report.written, report.warnings
            now[0] += 5
    finally:
        collector.close()
    assert "stats.tiers.x\ufffd" in report.rejected["n1"], report.rejected
    assert {r["tier"] for r in _rows(db, "cache_sample", 1)} == {"cpu", "disk"}
    assert [r["prefill_model"] for r in _rows(db, "plan_sample", 1)] == ["llama\ufffd"] * 2
    with db.connect() as conn:
        nodes = {r.node for r in conn.exec_driver_sql("SELECT node FROM route_sample")}
        dcs = {r.from_dc for r in conn.exec_driver_sql("SELECT from_dc FROM route_link_sample")}
    assert nodes == {"", "n\ufffd1"} and dcs == {"a\ufffd"}


def test_lone_surrogates_in_answered_text_are_not_the_batch(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """JSON's "\\ud800" reads as a lone surrogate, which neither driver encodes: SQLite's
    raised UnicodeEncodeError out of collect_once, ending the collector's loop; psycopg
    refused the batch at every retry."""
    agent, _router = stand_ins
    stats = _stats(10, 4, 1.0)
    stats["stats"]["tiers"]["y\ud800"] = stats["stats"]["tiers"]["disk"]
    stats["fetch_plans"]["prefill"]["inputs"]["gpu"] = "h\udfff"
    agent.answers["/v1/stats"] = stats
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url)
    collector = Collector(db, CollectorConfig(interval_s=5.0), clock=lambda: T0_S)
    try:
        report = collector.collect_once()
    finally:
        collector.close()
    assert report.written, report.warnings
    assert "stats.tiers.y\ufffd" in report.rejected["n1"], report.rejected
    assert [r["prefill_gpu"] for r in _rows(db, "plan_sample", 1)] == ["h\ufffd"]
