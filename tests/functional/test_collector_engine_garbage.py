"""An engine answering JSON that is no TensorRT-LLM iteration stats (an unhashable DP rank,
arrays nested deeper than Python's json reads), on a real SQLite and PostgreSQL: the cycle
goes on, the engine is said unreadable, and the node's agent figures are written.

Agent and engine are stand-ins answering over loopback HTTP.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from tests.functional.test_collector_impossible_values import T0_S, StandIn, _rows

pytestmark = pytest.mark.slow


@pytest.fixture
def agent() -> Iterator[StandIn]:
    a = StandIn("n1")
    try:
        yield a
    finally:
        a.close()


@pytest.mark.parametrize(
    "answer",
    ['[{"iter": 1, "attentionDpRank": [0]}, {"iter": 2}]', "[" * 100_000],
    ids=["unhashable-rank", "deep-nesting"],
)
def test_engine_json_garbage_is_one_warning_not_the_end_of_the_cycle(
    db: Engine, agent: StandIn, answer: str
) -> None:
    """Before, TypeError (unhashable rank) and RecursionError (deep nesting) escaped the
    engine's parser and collect_once, ending the collector's loop."""
    agent.answers["/metrics"] = answer
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url, engine_url=f"{agent.url}/metrics")
    collector = Collector(db, CollectorConfig(interval_s=5.0), clock=lambda: T0_S)
    try:
        report = collector.collect_once()
    finally:
        collector.close()
    assert report.written and report.up == ["n1"], report.as_dict()
    assert any("n1: engine at" in w for w in report.warnings), report.warnings
    assert len(_rows(db, "node_sample", 1)) == 1
    assert not _rows(db, "engine_sample", 1)
