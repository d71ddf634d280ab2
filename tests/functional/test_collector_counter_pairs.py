"""Figures the collector takes from several counters at once (a plan's seconds saved:
recompute_s - fetch_s; emulated power: lookup_tokens - hit_tokens; hit ratios: hits over
lookups) across a scrape where one of them was rejected as impossible, on a real SQLite and
PostgreSQL: they wait and catch up together, so sums over the window are exact, no interval
goes unemulated and no row puts one span's hits over another's lookups. A counter unknown at
a node's first scrape leaves the next scrape its baseline.

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


def _node(db: Engine, agent: StandIn, engine_url: str | None = None) -> int:
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url, engine_url=engine_url)
    with db.connect() as conn:
        return int(conn.execute(select(Node.id).where(Node.name == "n1")).scalar_one())


def _collect(
    db: Engine, agent: StandIn, answers: list[Any], path: str = "/v1/stats", **config: Any
) -> None:
    """One scrape per answer (of ``path``), ``interval_s`` apart."""
    now = [T0_S]
    collector = Collector(db, CollectorConfig(**config), clock=lambda: now[0])
    try:
        for answer in answers:
            agent.answers[path] = answer
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


def test_hits_and_lookups_catch_up_together_across_a_rejected_lookups(
    db: Engine, agent: StandIn
) -> None:
    """lookup_chunks NaN at scrape 2, every other figure sound: no counter of the node
    advances at that scrape, so no row puts hits over lookups of another span. Before, scrape
    2's row said 5 hits of 0 lookups (a bucket of it alone, or with a scrape of few lookups,
    read a hit ratio past 100%), and scrape 3's 20 lookups with 3 hits."""
    node_id = _node(db, agent)
    rejected = _stats(20, 9, 2.0)
    rejected["stats"]["lookup_chunks"] = math.nan
    _collect(db, agent, [_stats(10, 4, 1.0), rejected, _stats(30, 12, 3.0)], interval_s=30.0)

    rows = _rows(db, "cache_sample", node_id)
    total = [(r["lookups"], r["hits"], r["hit_tokens"]) for r in rows if r["tier"] == "all"]
    cpu = [r["hits"] for r in rows if r["tier"] == "cpu"]
    assert total == [(0, 0, 0), (0, 0, 0), (20, 8, 8 * 256)]
    assert cpu == [0, 0, 8]
    # its bytes were read all the same
    assert all(r["used_bytes"] == 4096 for r in rows if r["tier"] == "cpu")


def test_a_counter_unknown_at_the_first_scrape_leaves_the_next_the_baseline(
    db: Engine, agent: StandIn
) -> None:
    """A node first seen with an impossible lookup_tokens, recompute_s and GPU energy: the
    next scrape is their baseline, and the one after counts the interval. Before, the next
    scrape counted their all-time values as one interval's (here 2.56 M tokens looked up,
    50,000 s of prefill and 9 MJ in 30 s)."""
    node_id = _node(db, agent)
    first = _stats(10_000, 4_000, math.nan)
    first["stats"]["lookup_tokens"] = math.nan
    gpus = [
        {"nvml": {"available": True}, "gpus": [{**reading, "energy_j": joules}]}
        for reading in agent.answers["/v1/gpus"]["gpus"]
        for joules in (math.nan, 9e6, 9e6 + 6_000)
    ]
    answers = [first, _stats(10_000, 4_000, 50_000.0), _stats(10_010, 4_004, 50_001.0)]
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=30.0), clock=lambda: now[0])
    try:
        for answer, gpu in zip(answers, gpus, strict=True):
            agent.answers["/v1/stats"], agent.answers["/v1/gpus"] = answer, gpu
            assert collector.collect_once().written
            now[0] += 30
    finally:
        collector.close()

    tokens = [r["lookup_tokens"] for r in _rows(db, "cache_sample", node_id) if r["tier"] == "all"]
    assert tokens == [0, 0, 10 * 256]
    plans = _rows(db, "plan_sample", node_id)
    assert [r["recompute_s"] for r in plans] == [None, 0.0, pytest.approx(1.0)]
    assert [r["saved_s"] for r in plans] == [None, 0.0, pytest.approx(1.0)]
    energy = [r["energy_j"] for r in _rows(db, "power_sample", node_id)]
    assert energy == [None, 0.0, pytest.approx(6_000.0)]


def _vllm(prompt_tokens: float, cached_tokens: float, requests: float | None) -> str:
    """A vLLM's /metrics: prompt tokens, those served from its prefix cache, and finished
    requests (None: none finished yet, so the labelled counter has no sample)."""
    lines = [
        "# TYPE vllm:prompt_tokens_total counter",
        f'vllm:prompt_tokens_total{{model_name="m"}} {prompt_tokens}',
        "# TYPE vllm:prefix_cache_hits_total counter",
        f'vllm:prefix_cache_hits_total{{model_name="m"}} {cached_tokens}',
        "# TYPE vllm:request_success_total counter",
    ]
    if requests is not None:
        lines.append(
            f'vllm:request_success_total{{finished_reason="stop",model_name="m"}} {requests}'
        )
    return "\n".join([*lines, ""])


def test_an_engine_counter_unknown_at_the_first_scrape_leaves_the_next_the_baseline(
    db: Engine, agent: StandIn
) -> None:
    """The engine's prompt-token counter is negative at the node's first scrape (rejected):
    the next scrape is its baseline, the one after counts its interval. Before, the next
    scrape counted its all-time value as one interval's: 5 M prompt tokens in 30 s. A
    counter not exposed yet (no request finished) is no unknown one: counted from zero when
    it shows."""
    node_id = _node(db, agent, engine_url=f"{agent.url}/metrics")
    answers = [_vllm(-1, 0, None), _vllm(5e6, 1e6, None), _vllm(5e6 + 300, 1e6 + 100, 3)]
    _collect(db, agent, answers, path="/metrics", interval_s=30.0)

    rows = _rows(db, "engine_sample", node_id)
    # the first scrape's counters wait with the one rejected; the second is their baseline
    assert [r["prompt_tokens"] for r in rows] == [None, 0, 300]
    assert [r["cached_prompt_tokens"] for r in rows] == [None, 0, 100]
    assert [r["requests"] for r in rows] == [None, None, 3]


def _vllm_ttft(prompt_tokens: float, cached_tokens: float, fast: int, slow: int) -> str:
    """``_vllm`` with a TTFT histogram: ``fast`` requests under 0.5 s, ``slow`` over 2 s."""
    n = fast + slow
    return _vllm(prompt_tokens, cached_tokens, n) + "\n".join(
        [
            "# TYPE vllm:time_to_first_token_seconds histogram",
            f'vllm:time_to_first_token_seconds_bucket{{le="0.5",model_name="m"}} {fast}',
            f'vllm:time_to_first_token_seconds_bucket{{le="2.0",model_name="m"}} {fast}',
            f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {n}',
            f'vllm:time_to_first_token_seconds_count{{model_name="m"}} {n}',
            f'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {0.1 * fast + 3 * slow}',
            "",
        ]
    )


def test_an_engines_counters_catch_up_together_across_a_rejected_one(
    db: Engine, agent: StandIn
) -> None:
    """The engine's cached-token counter is negative at scrape 2, every other figure sound:
    none of its counters advances at that scrape, and scrape 3's row covers both intervals of
    all of them, its TTFT quantiles too. Before, each counter caught up alone: scrape 3's row
    said 100 cached of 10 prompt tokens (a cache serving 1,000% of the prompts), and its TTFT
    quantiles were those of scrape 3's one slow request where its count covered 11."""
    node_id = _node(db, agent, engine_url=f"{agent.url}/metrics")
    answers = [
        _vllm_ttft(100, 50, fast=0, slow=10),
        _vllm_ttft(200, -1, fast=10, slow=10),
        _vllm_ttft(210, 150, fast=10, slow=11),
    ]
    _collect(db, agent, answers, path="/metrics", interval_s=30.0)

    rows = _rows(db, "engine_sample", node_id)
    counts = [
        (r["prompt_tokens"], r["cached_prompt_tokens"], r["requests"], r["ttft_count"])
        for r in rows
    ]
    assert counts == [(0, 0, 0, 0), (None, None, None, None), (110, 100, 11, 11)]
    assert rows[1]["ttft_p50_s"] is None
    # 10 of the 11 requests since scrape 1 were fast: the median is under 0.5 s
    assert rows[2]["ttft_p50_s"] is not None and rows[2]["ttft_p50_s"] <= 0.5
    assert rows[2]["ttft_sum_s"] == pytest.approx(0.1 * 10 + 3)


@pytest.mark.parametrize(
    ("cached", "ttft_sum"),
    [("NaN", None), ("+Inf", None), ("150", "NaN")],
    ids=["counter-nan", "counter-inf", "ttft-sum-nan"],
)
def test_an_engine_figure_not_finite_is_rejected_and_its_counters_catch_up_together(
    db: Engine, agent: StandIn, cached: str, ttft_sum: str | None
) -> None:
    """At scrape 2 the engine's cached-token counter (or its TTFT histogram's sum) reads NaN or
    Infinity, as a negative one: rejected (named in the cycle's rejected, counted in
    kvctl_collector_rejected_values_total), its counters wait, and scrape 3's row covers both
    intervals. Before, the parser read it as not exposed: nothing rejected, the other counters
    advanced alone and the cached-token counter caught up alone (scrape 3's row: 100 cached of
    10 prompt tokens)."""
    node_id = _node(db, agent, engine_url=f"{agent.url}/metrics")
    second = _vllm_ttft(200, 0, fast=10, slow=10).replace(
        'vllm:prefix_cache_hits_total{model_name="m"} 0',
        f'vllm:prefix_cache_hits_total{{model_name="m"}} {cached}',
    )
    if ttft_sum is not None:
        second = second.replace(
            'vllm:time_to_first_token_seconds_sum{model_name="m"} 31.0',
            f'vllm:time_to_first_token_seconds_sum{{model_name="m"}} {ttft_sum}',
        )
    assert second != _vllm_ttft(200, 0, fast=10, slow=10)
    answers = [
        _vllm_ttft(100, 50, fast=0, slow=10),
        second,
        _vllm_ttft(210, 150, fast=10, slow=11),
    ]
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=30.0), clock=lambda: now[0])
    reports = []
    try:
        for answer in answers:
            agent.answers["/metrics"] = answer
            reports.append(collector.collect_once())
            now[0] += 30.0
        rejected_total = collector.metrics.registry.get_sample_value(
            "kvctl_collector_rejected_values_total", {"kind": "agent"}
        )
    finally:
        collector.close()

    field = "engine.cached_prompt_tokens" if ttft_sum is None else "engine.ttft"
    assert [r.rejected for r in reports] == [{}, {"n1": {field: "not finite"}}, {}]
    assert rejected_total == 1
    rows = _rows(db, "engine_sample", node_id)
    counts = [
        (r["prompt_tokens"], r["cached_prompt_tokens"], r["requests"], r["ttft_count"])
        for r in rows
    ]
    assert counts == [(0, 0, 0, 0), (None, None, None, None), (110, 100, 11, 11)]
    assert rows[2]["ttft_sum_s"] == pytest.approx(0.1 * 10 + 3)
