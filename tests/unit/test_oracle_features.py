"""``oracle-features``: ``lineage-learned-arc`` scored by each feature row's reuse rate recorded
on a first replay of the same requests (``kvctl.store.policies.oracles``). The recording pass
decides as ``lineage-learned-arc`` does and keeps exactly the samples its model labels; the
table scores a row by the smoothed log-odds of its samples, rows seen fewer than
``FEATURE_MIN_COUNT`` times fall back to weights fitted on every sample; the simulator runs it
only when named, reports its second pass, and is deterministic."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import pytest

from kvctl.store.errors import InvalidArgument
from kvctl.store.policies import EVICTION_POLICIES, LineageLearnedARCPolicy, make_eviction_policy
from kvctl.store.policies.oracles import (
    FEATURE_MIN_COUNT,
    FeatureOraclePolicy,
    RecordingReuseModel,
    TableReuseModel,
    reuse_table,
)
from kvctl.store.policies.reuse_model import ReuseModel
from kvctl.workload import simulate as sim
from kvctl.workload.generators import generate
from kvctl.workload.trace import TraceRequest

NAME = "oracle-features"
#: a model that fits within the small workload (by default it needs 1,000 labelled samples)
EARLY: dict[str, Any] = {"retrain_every": 100, "min_samples": 100}


def _workload() -> tuple[list[TraceRequest], dict[str, int]]:
    requests = generate("chat", 0, requests=200)
    unique = len({b for r in requests for b in r.block_ids})
    return requests, {"cpu": sim.capacity_from_fraction(unique, 0.05)}


def _replay(
    requests: list[TraceRequest], tiers: dict[str, int], policy: LineageLearnedARCPolicy
) -> list[tuple[str, ...]]:
    """Each request's hit tiers when ``policy`` runs the (one) tier."""
    hits: list[tuple[str, ...]] = []
    sim._replay(
        sim._Chains(requests),
        requests,
        tiers,
        lambda _name: policy,
        admission="all",
        policy=NAME,
        progress=None,
        on_request=lambda _i, t: hits.append(tuple(t)),
        bypass_unreachable=True,
    )
    return hits


def test_the_table_is_the_smoothed_log_odds_of_rows_with_enough_samples() -> None:
    samples: dict[tuple[int, ...], list[float]] = {
        (0, 1): [5.0, 2.0],
        (0, 2): [4.0, 4.0],
        (0, 3): [10.0, 0.0],
        (0, 4): [5.0, 5.0],
    }
    table = reuse_table(samples, min_count=5)
    assert set(table) == {(0, 1), (0, 3), (0, 4)}
    assert table[(0, 1)] == pytest.approx(math.log(2.5 / 3.5))
    assert table[(0, 3)] == pytest.approx(math.log(0.5 / 10.5))
    p = 5.5 / 6  # the smoothed rate (reused + 0.5) / (samples + 1), as log-odds
    assert table[(0, 4)] == pytest.approx(math.log(p / (1 - p)))


def test_recording_decides_as_lineage_learned_arc_and_keeps_every_labelled_sample() -> None:
    requests, tiers = _workload()
    recorder = RecordingReuseModel(**EARLY)
    recorded = _replay(requests, tiers, LineageLearnedARCPolicy(reuse_model=recorder))
    assert recorded == _replay(requests, tiers, LineageLearnedARCPolicy(**EARLY))
    assert recorder.fits > 0  # the model did pick, so the equality above means something
    total = sum(n for n, _ in recorder.samples.values())
    assert 0 < total < 20_000  # the model's window (window_samples) holds them all
    again: dict[tuple[int, ...], list[float]] = {}
    for f, y in recorder._labelled:
        a = again.setdefault(f, [0.0, 0.0])
        a[0] += 1.0
        a[1] += y
    assert again == recorder.samples and list(again) == list(recorder.samples)


def test_a_row_scores_its_recorded_rate_and_rarer_rows_fall_back_to_one_fit() -> None:
    requests, tiers = _workload()
    recorder = RecordingReuseModel()
    _replay(requests, tiers, LineageLearnedARCPolicy(reuse_model=recorder))
    samples = recorder.samples
    assert any(n >= FEATURE_MIN_COUNT for n, _ in samples.values())
    assert any(n < FEATURE_MIN_COUNT for n, _ in samples.values())
    oracle = FeatureOraclePolicy(samples)
    model = oracle.model
    assert isinstance(model, TableReuseModel)
    # the fallback weights: the model's own fit over every recorded sample at once
    whole = ReuseModel()
    whole._labelled = deque(recorder._labelled)
    whole._fit()
    assert model._w == whole._w and model.fits == 1
    _replay(requests, tiers, oracle)
    assert model.fits == 1 and len(model._labelled) == 0  # it never trained
    now = model._newest_tick
    seen = {"table": 0, "fallback": 0}
    for key in model._entries:
        rec = model._hist.get(key)
        if rec is None:
            continue
        row = rec.static + model._dynamic(rec, now)
        n, pos = samples.get(row, (0.0, 0.0))
        if n >= FEATURE_MIN_COUNT:
            seen["table"] += 1
            assert model._score(key, now) == pytest.approx(math.log((pos + 0.5) / (n - pos + 0.5)))
        else:
            seen["fallback"] += 1
            weights = model._w or []
            assert model._score(key, now) == pytest.approx(sum(weights[i] for i in row))
    assert seen["table"] and seen["fallback"]


def test_with_no_samples_it_never_picks() -> None:
    model = TableReuseModel({})
    assert model._w is None and model.table == {}
    assert model.pick(lambda _k: True) is None


def test_lineage_learned_arc_takes_a_model_or_its_arguments() -> None:
    given = ReuseModel(seed=3)
    assert LineageLearnedARCPolicy(reuse_model=given).model is given
    default = LineageLearnedARCPolicy(sample_size=8).model
    assert type(default) is ReuseModel and default.sample_size == 8
    with pytest.raises(InvalidArgument):
        LineageLearnedARCPolicy(reuse_model=given, seed=1)


def test_it_runs_only_when_named_and_never_as_an_agents_policy() -> None:
    assert NAME in sim.ORACLE_POLICIES and NAME in sim.SIMULATION_POLICIES
    assert NAME not in EVICTION_POLICIES
    with pytest.raises(InvalidArgument):
        make_eviction_policy(NAME)
    assert sim.policies_with_references([NAME]) == [NAME, "lru", "belady"]


def test_simulate_reports_the_oracle_pass_deterministically() -> None:
    requests, tiers = _workload()
    runs = [sim.simulate(requests, tiers=tiers, policies=[NAME]) for _ in range(2)]
    assert [r.policy for r in runs[0].results] == [NAME, "lru", "belady"]
    first, second = (r.result(NAME) for r in runs)
    assert (first.hit_blocks, first.hit_tokens, first.evictions) == (
        second.hit_blocks, second.hit_tokens, second.evictions,
    )  # fmt: skip
    assert 0 < first.hit_blocks <= runs[0].result("belady").hit_blocks
    # the reported pass is the oracle's: the same hits as FeatureOraclePolicy on the recording
    recorder = RecordingReuseModel()
    _replay(requests, tiers, LineageLearnedARCPolicy(reuse_model=recorder))
    oracle_hits = _replay(requests, tiers, FeatureOraclePolicy(recorder.samples))
    assert first.hit_blocks == sum(len(h) for h in oracle_hits)


def test_one_policy_replay_calls_back_for_the_oracle_pass_alone() -> None:
    requests, tiers = _workload()
    hooked: list[int] = []
    progress: list[tuple[str, int, int]] = []
    sim.simulate_policy(
        requests,
        tiers=tiers,
        policy=NAME,
        on_request=lambda i, _t: hooked.append(i),
        progress=lambda p, done, total: progress.append((p, done, total)),
    )
    assert hooked == list(range(len(requests)))
    done = [d for _, d, _ in progress]
    assert done == sorted(done) and progress[-1] == (NAME, 2 * len(requests), 2 * len(requests))
    assert {t for _, _, t in progress} == {2 * len(requests)}


def test_each_tier_records_and_is_scored_from_its_own_samples() -> None:
    """Two tiers: each tier's recording pass has its own model (one shared by both would be fed
    both tiers' chunks), and each tier's oracle is scored from that tier's samples alone."""
    requests = generate("rag", 0, requests=300)
    unique = len({b for r in requests for b in r.block_ids})
    tiers = {
        "cpu": sim.capacity_from_fraction(unique, 0.02),
        "disk": sim.capacity_from_fraction(unique, 0.08),
    }
    hits: list[tuple[str, ...]] = []
    result = sim.simulate_policy(
        requests, tiers=tiers, policy=NAME, on_request=lambda _i, t: hits.append(tuple(t))
    )
    assert result.hits_by_tier["cpu"] and result.hits_by_tier["disk"]
    recorders = {n: RecordingReuseModel() for n in tiers}
    chains = sim._Chains(requests)
    run = {"admission": "all", "policy": NAME, "progress": None, "bypass_unreachable": True}
    sim._replay(
        chains, requests, tiers, lambda n: LineageLearnedARCPolicy(reuse_model=recorders[n]), **run
    )
    cpu, disk = recorders["cpu"].samples, recorders["disk"].samples
    assert cpu and disk and cpu != disk  # both tiers evicted, and learned different rates
    expected: list[tuple[str, ...]] = []
    sim._replay(
        chains,
        requests,
        tiers,
        lambda n: FeatureOraclePolicy(recorders[n].samples),
        on_request=lambda _i, t: expected.append(tuple(t)),
        **run,
    )
    assert hits == expected
