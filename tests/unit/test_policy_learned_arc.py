"""``lineage-learned-arc``: ``lineage-arc`` whose pick among chunks seen once comes from an online
reuse model. Its bookkeeping follows the store under random operations with the model fitting
early, it is ``lineage-arc`` exactly until the model's first fit, and it is deterministic under
a seed while it trains online. (The property tests over every registered policy, in
test_policies.py, cover it too: pins hold, lineage is never orphaned, isolation holds.)"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.store.errors import InvalidArgument
from kvctl.store.policies import EVICTION_POLICIES, LineageLearnedARCPolicy
from kvctl.store.policies.reuse_model import _DIM, _GROUPS, _OFF, ReuseModel
from kvctl.store.store import TieredStore
from kvctl.workload import simulate as sim
from kvctl.workload.generators import generate
from kvctl.workload.trace import read_mooncake_trace
from tests.unit import test_policy_arc as arc_checks
from tests.unit.policy_ops import OPS, apply_ops, small_tiers

NAME = "lineage-learned-arc"
#: a model that fits after a few samples, so small runs exercise its picks
EARLY = {"sample_size": 2, "retrain_every": 5, "min_samples": 5}


def test_registered_and_its_model_arguments_checked() -> None:
    assert EVICTION_POLICIES[NAME] is LineageLearnedARCPolicy
    for bad in ({"sample_size": 0}, {"window_factor": 0}, {"retrain_every": 0}, {"l2": -1}):
        with pytest.raises(InvalidArgument):
            ReuseModel(**bad)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(ops=OPS, two_tiers=st.booleans())
def test_the_model_tracks_exactly_the_policys_chunks_and_leaves(
    ops: list[tuple[str, int, int]], two_tiers: bool
) -> None:
    policy = LineageLearnedARCPolicy(**EARLY)
    store = TieredStore(small_tiers(two_tiers), eviction={"cpu": policy})
    for _ in apply_ops(store, ops):
        tracked = {e.key for e in store.entries("cpu") if not e.pinned}
        model = policy.model
        assert set(model._entries) == tracked == set(policy._member)
        leaves = {k for k, e in model._entries.items() if e.children == 0}
        assert set(model._leaves) == leaves
        assert all(model._leaves[i] == k for k, i in model._leaf_pos.items())
        assert set(model._score_cache) <= tracked  # scores of keys gone are not kept


def _replay(
    monkeypatch: pytest.MonkeyPatch, name: str, make: Callable[[], Any], workload: str
) -> tuple[sim.PolicyResult, list[tuple[str, ...]]]:
    """``workload``'s replay at 5% of its unique blocks through ``make()``'s policy registered
    as ``name``: the result and each request's hit tiers."""
    requests = generate(workload, 0, requests=300)
    unique = len({b for r in requests for b in r.block_ids})
    monkeypatch.setitem(EVICTION_POLICIES, name, make)
    hits: list[tuple[str, ...]] = []
    result = sim.simulate_policy(
        requests,
        tiers={"cpu": sim.capacity_from_fraction(unique, 0.05)},
        policy=name,
        on_request=lambda _i, tiers: hits.append(tuple(tiers)),
    )
    return result, hits


def test_until_its_first_fit_it_is_lineage_arc(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[LineageLearnedARCPolicy] = []

    def never_fits() -> LineageLearnedARCPolicy:
        made.append(LineageLearnedARCPolicy(min_samples=10**9))
        return made[-1]

    learned, learned_hits = _replay(monkeypatch, NAME, never_fits, "rag")
    arc, arc_hits = _replay(monkeypatch, "lineage-arc", EVICTION_POLICIES["lineage-arc"], "rag")
    assert made[0].model.fits == 0 and made[0].model._labelled  # it sampled, never fitted
    assert learned_hits == arc_hits and learned.evictions == arc.evictions > 0


def test_deterministic_under_a_seed_and_trained_online(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[LineageLearnedARCPolicy] = []

    def early(seed: int) -> Callable[[], LineageLearnedARCPolicy]:
        def make() -> LineageLearnedARCPolicy:
            made.append(LineageLearnedARCPolicy(seed=seed, retrain_every=500, min_samples=500))
            return made[-1]

        return make

    first, first_hits = _replay(monkeypatch, NAME, early(1), "rag")
    again, again_hits = _replay(monkeypatch, NAME, early(1), "rag")
    _, arc_hits = _replay(monkeypatch, "lineage-arc", EVICTION_POLICIES["lineage-arc"], "rag")
    model = made[0].model
    assert model.fits > 0  # it learned from its own history, during the replay
    assert set(model._score_cache) <= set(model._entries)  # no score of a key gone is kept
    assert first_hits == again_hits and first.hit_ratio == again.hit_ratio
    assert first_hits != arc_hits  # its picks changed what was evicted


def test_the_simulator_and_a_live_store_make_the_same_learned_decisions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """test_policy_arc's check (simulator, a metered store and one over real bytes evict the
    same chunks in the same order), with a model that fits within its short replay."""
    made: list[LineageLearnedARCPolicy] = []

    def early() -> LineageLearnedARCPolicy:
        made.append(LineageLearnedARCPolicy(retrain_every=50, min_samples=50))
        return made[-1]

    monkeypatch.setitem(EVICTION_POLICIES, NAME, early)
    arc_checks.test_simulator_and_a_store_over_real_bytes_make_the_same_decisions(
        NAME, "builtin", False
    )
    assert len(made) == 3 and all(p.model.fits > 0 for p in made)


def test_leads_lineage_arc_on_the_whole_shared_trace_at_5_percent(shared_trace) -> None:  # type: ignore[no-untyped-def]
    """The measured claim: 17.03% of blocks against 16.64% for lineage-arc (43.1% and 42.1% of
    Belady), the model refitting as it goes."""
    requests = read_mooncake_trace(shared_trace)
    cap = sim.capacity_from_fraction(len({b for r in requests for b in r.block_ids}), 0.05)
    learned = sim.simulate_policy(requests, tiers={"cpu": cap}, policy=NAME).hit_ratio
    arc = sim.simulate_policy(requests, tiers={"cpu": cap}, policy="lineage-arc").hit_ratio
    assert learned > arc + 0.003


def test_the_fit_equals_dense_newton_steps_over_every_feature() -> None:
    """The refit works on the features seen, with bincounts for x @ v, x.T @ r and the Hessian;
    it must give the weights of the plain dense Newton steps over all features (which it
    replaced: 3x slower), and leave the features never seen at 0."""
    rng = random.Random(7)
    model = ReuseModel(l2=10.0, newton_steps=4)
    for _ in range(3_000):
        feats = tuple(_OFF[g] + rng.randrange(min(size, 5)) for g, size in _GROUPS)
        cnt = feats[1] - _OFF["cnt"]
        model._labelled.append((feats, float(rng.random() < 0.1 + 0.15 * cnt)))
    model._fit()
    assert model._w is not None
    rows = [f for f, _ in model._labelled]
    x = np.zeros((len(rows), _DIM))
    for i, f in enumerate(rows):
        x[i, list(f)] = 1.0
    y = np.array([label for _, label in model._labelled])
    w = np.zeros(_DIM)
    w[0] = math.log((y.sum() + 1.0) / (len(y) - y.sum() + 1.0))
    for _ in range(4):  # these data need no backtracking: full steps
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        g = x.T @ (p - y) + 10.0 * w
        h = (x * (p * (1 - p))[:, None]).T @ x + 10.0 * np.eye(_DIM)
        w = w - np.linalg.solve(h, g)
    assert np.allclose(model._w, w, rtol=0, atol=1e-9)
    seen = {i for f in rows for i in f}
    assert all(model._w[i] == 0.0 for i in range(_DIM) if i not in seen)
    assert len(seen) < _DIM  # the shortcut was taken


@pytest.mark.parametrize(("after_ticks", "label"), [(10, 1.0), (11, 0.0), (500, 0.0)])
def test_a_reuse_past_the_boundary_is_labelled_not_reused(after_ticks: int, label: float) -> None:
    """A sample is reused only if its key comes back within the boundary (window_factor x
    capacity accesses). A tier whose model sees few accesses (a lower tier) can see a key's next
    access long after its boundary passed with no access between to expire the sample: that
    must count as not reused, not as a reuse."""
    from kvctl.store.index import Entry
    from kvctl.store.policies.reuse_model import _Sample

    model = ReuseModel(window_factor=1.0)
    model._capacity = 10  # boundary: 10 accesses after the sample

    def access(key: bytes, tick: int) -> None:
        model.on_insert(
            Entry(
                key=key,
                tier="cpu",
                size_bytes=1,
                tokens=512,
                tenant="t",
                parent=None,
                last_tick=tick,
            )
        )

    access(b"k", 1)
    sample = _Sample(5, (0,))
    model._pending.append((b"k", sample))
    model._pending_by_key[b"k"] = [sample]
    access(b"k", 5 + after_ticks)
    assert list(model._labelled) == [((0,), label)]
