"""An agent's data plane read counts (``/v1/stats`` dataplane.read_chunks and
read_missing_chunks) that cannot be true, on a real SQLite and PostgreSQL: rejected by field,
recorded as NULL, the hit counts and the other node untouched, and the next sound scrape
counts the reads from the last known values. Before, the collector read them unchecked: a
string raised TypeError out of collect_once (no node's samples written that cycle), and a
negative count or more missing chunks than reads were stored as they came (a 'reads gone'
ratio past 100%). The agents are stand-ins answering over loopback HTTP."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.models import Node
from tests.functional.test_collector_impossible_values import T0_S, StandIn, _rows, _stats

pytestmark = pytest.mark.slow


def _with_reads(lookups: int, reads: Any, missing: Any) -> dict[str, Any]:
    stats = copy.deepcopy(_stats(lookups, lookups // 2, 0.5))
    stats["dataplane"] = {"read_chunks": reads, "read_missing_chunks": missing}
    return stats


@pytest.mark.parametrize(
    ("reads", "missing", "field", "why"),
    [
        ("many", 0, "dataplane.read_chunks", "not a number"),
        (-3, 0, "dataplane.read_chunks", "negative"),
        (True, 0, "dataplane.read_chunks", "not a number"),
        (2**70, 0, "dataplane.read_chunks", "beyond BIGINT"),
        (20, 50, "dataplane.read_missing_chunks", "more than dataplane.read_chunks"),
    ],
)
def test_read_counts_that_cannot_be_are_rejected_and_the_cycle_written(
    db: Engine,
    stand_ins: tuple[StandIn, StandIn],
    reads: Any,
    missing: Any,
    field: str,
    why: str,
) -> None:
    n1, n2 = stand_ins
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=n1.url)
        add_node(conn, "n2", dc="fra", agent_url=n2.url)
    with db.connect() as conn:
        ids = dict(conn.execute(select(Node.name, Node.id)).all())
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=5.0), clock=lambda: now[0])
    try:
        n1.answers["/v1/stats"] = _with_reads(10, 10, 1)  # the baseline
        assert collector.collect_once().rejected == {}
        n1.answers["/v1/stats"] = _with_reads(20, reads, missing)
        now[0] += 10
        bad = collector.collect_once()
        n1.answers["/v1/stats"] = _with_reads(30, 16, 3)
        now[0] += 10
        good = collector.collect_once()
    finally:
        collector.close()
    assert bad.written and sorted(bad.up) == ["n1", "n2"]
    assert bad.as_dict()["rejected"]["n1"]["fields"] == {field: why}
    assert good.rejected == {}
    rows = [r for r in _rows(db, "cache_sample", ids["n1"]) if r["tier"] == "all"]
    assert [r["lookups"] for r in rows] == [0, 10, 10]  # the hits' series never waited
    assert [(r["read_chunks"], r["read_missing_chunks"]) for r in rows] == [
        (0, 0),
        (None, None),
        (6, 2),  # from the last known values (10, 1)
    ]
    assert len(_rows(db, "cache_sample", ids["n2"])) > 0


def test_a_dataplane_that_is_not_an_object_is_rejected(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    n1, _n2 = stand_ins
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=n1.url)
    stats = copy.deepcopy(_stats(3, 1, 0.5))
    stats["dataplane"] = [1, 2]
    n1.answers["/v1/stats"] = stats
    collector = Collector(db, CollectorConfig(interval_s=5.0))
    try:
        report = collector.collect_once()
    finally:
        collector.close()
    assert report.as_dict()["rejected"]["n1"]["fields"] == {"dataplane": "not an object"}
    assert report.written
