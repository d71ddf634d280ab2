"""Figures the collector takes from two counters at once (a plan's seconds saved: recompute_s -
fetch_s; emulated power: lookup_tokens - hit_tokens) across a scrape where one of the two was
rejected as impossible, on a real SQLite and PostgreSQL: both wait and catch up together, so
sums over the window are exact and no interval goes unemulated.

The agent is a stand-in answering over loopback HTTP (a real agent never says NaN).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.models import Node
from kvctl.profiles import DEFAULT_GPU, DEFAULT_MFU, DEFAULT_MODEL, GPUS, MODELS, ModeledInputs
from tests.functional.test_collector_impossible_values import T0_S, StandIn, _rows, _stats

pytestmark = pytest.mark.slow


@pytest.fixture
def agent() -> Iterator[StandIn]:
    a = StandIn("n1")
    try:
        yield a
    finally:
        a.close()


def _node(db: Engine, agent: StandIn) -> int:
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url)
    with db.connect() as conn:
        return int(conn.execute(select(Node.id).where(Node.name == "n1")).scalar_one())


def _collect(db: Engine, agent: StandIn, answers: list[dict[str, Any]], **config: Any) -> None:
    """One scrape per answer, ``interval_s`` apart."""
    now = [T0_S]
    collector = Collector(db, CollectorConfig(**config), clock=lambda: now[0])
    try:
        for answer in answers:
            agent.answers["/v1/stats"] = answer
            assert collector.collect_once().written
            now[0] += config["interval_s"]
    finally:
        collector.close()


def _plans(recompute_s: float, fetch_s: float) -> dict[str, Any]:
    stats = _stats(10, 4, recompute_s)
    stats["fetch_plans"]["plans"]["fetch_s"] = fetch_s
    return stats


def test_seconds_saved_sum_exactly_across_a_rejected_recompute_s(
    db: Engine, agent: StandIn
) -> None:
    """recompute_s NaN at scrape 2: its saved_s is unknown, and scrape 3's covers both
    intervals of both counters. Before, fetch_s's increase of scrape 2 was counted in no
    saved_s: the window's seconds saved read 19 where the agent's figures say 15."""
    node_id = _node(db, agent)
    _collect(
        db,
        agent,
        [_plans(10.0, 1.0), _plans(math.nan, 5.0), _plans(30.0, 6.0)],
        interval_s=10.0,
    )
    plans = _rows(db, "plan_sample", node_id)
    assert [r["saved_s"] for r in plans] == [0.0, None, pytest.approx(15.0)]
    # the pair waited together: neither is counted at the scrape that read one of them
    assert (plans[1]["recompute_s"], plans[1]["fetch_s"]) == (None, None)
    saved = sum(r["saved_s"] or 0.0 for r in plans)
    recompute = sum(r["recompute_s"] or 0.0 for r in plans)
    fetch = sum(r["fetch_s"] or 0.0 for r in plans)
    assert saved == pytest.approx(recompute - fetch) == pytest.approx((30 - 10) - (6 - 1))


def _tokens(lookup_tokens: float, hit_tokens: float) -> dict[str, Any]:
    stats = _stats(0, 0, 0.0)
    stats["stats"]["lookup_tokens"] = lookup_tokens
    stats["stats"]["hit_tokens"] = hit_tokens
    return stats


@pytest.mark.parametrize("rejected", ["hit_tokens", "lookup_tokens"])
def test_emulated_energy_covers_the_interval_of_a_rejected_token_counter(
    db: Engine, agent: StandIn, rejected: str
) -> None:
    """50,000 tokens missed every minute; one of the two counters negative at scrape 2. The
    row of scrape 3 covers both minutes: twice scrape 1's misses, busy time and energy, at
    the same power. Before, it mixed one minute's lookups with two minutes' hits: 0 J, and
    the minute of scrape 2 was never emulated."""
    agent.answers["/v1/gpus"] = {"nvml": {"available": False}, "gpus": []}
    node_id = _node(db, agent)
    good = [(0, 0), (100_000, 50_000), (200_000, 100_000), (300_000, 150_000)]
    answers = [_tokens(*pair) for pair in good]
    answers[2]["stats"][rejected] = -1
    inputs = ModeledInputs(MODELS[DEFAULT_MODEL], GPUS[DEFAULT_GPU], DEFAULT_MFU)
    _collect(db, agent, answers, interval_s=60.0, emulate_power=inputs)

    rows = _rows(db, "emulated_power_sample", node_id)
    t1, t3 = (int((T0_S + 60 * i) * 1000) for i in (1, 3))
    assert [r["ts_ms"] for r in rows] == [t1, t3]
    first, catch_up = rows
    busy_s = inputs.prefill_seconds(50_000)
    assert 0 < busy_s < 60
    assert first["busy_s"] == pytest.approx(busy_s)
    assert first["energy_j"] == pytest.approx(busy_s * inputs.gpu.board_power_watts)
    assert catch_up["lookup_tokens"] == 2 * first["lookup_tokens"] == 200_000
    assert catch_up["busy_s"] == pytest.approx(2 * busy_s)
    assert catch_up["energy_j"] == pytest.approx(2 * first["energy_j"])
    # over its two minutes: the same power as the first minute's
    assert catch_up["power_w"] == pytest.approx(first["power_w"])
