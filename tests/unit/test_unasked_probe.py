"""A lookup with nothing of its chain here and one remote source does not ask that source when
no answer could make fetching pay: the plan as if the source held the whole chain (each chunk
as small and as long as any it has answered with) fetches nothing. The answer and the counts
must be what asking would have given; the source must be asked where a fetch could pay (a
chain long enough to amortise the round trip included), with a local prefix, with two sources,
before any answer has bounded the chunks, and every ``ASK_ANYWAY_AFTER``-th time regardless.

The pool is a real ``TieredStore`` answering as an agent's data plane does (``StorePeer``,
counting its probes)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvctl.remote.federation import (
    ASK_ANYWAY_AFTER,
    PEER_TIER,
    POOL_TIER,
    RemoteTiers,
    Source,
)
from kvctl.remote.fetchplan import PrefillModel
from kvctl.remote.links import LinkEstimator
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.unit.test_federation_index import StorePeer, key

TOKENS = 16


def node(
    pool_store: TieredStore,
    *,
    rtt_s: float,
    bandwidth_bytes_per_s: float,
    alpha_s: float,
    beta_s: float = 0.0,
    peer: TieredStore | None = None,
) -> tuple[RemoteTiers, StorePeer]:
    pool = StorePeer("pool", pool_store)
    link = LinkEstimator("pool", rtt_s=rtt_s, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
    peers = []
    if peer is not None:
        figures = {"rtt_s": rtt_s, "bandwidth_bytes_per_s": bandwidth_bytes_per_s}
        peers.append(Source("p", PEER_TIER, StorePeer("p", peer), LinkEstimator("p", **figures)))
    r = RemoteTiers(
        TieredStore([CpuTier(1 << 20)], chunk_tokens=TOKENS),
        pool=Source("pool", POOL_TIER, pool, link),
        peers=peers,
        prefill=PrefillModel(alpha_s, beta_s, "configured"),
    )
    return r, pool


def pool_of(chains: dict[str, list[int]]) -> TieredStore:
    """A pool holding, per space, a chain of chunks of these sizes."""
    store = TieredStore([CpuTier(64 << 20)], chunk_tokens=TOKENS)
    for space, sizes in chains.items():
        for i, size in enumerate(sizes):
            parent = key(space, i - 1) if i else None
            store.put(key(space, i), bytes(size), tokens=TOKENS, tenant="t", parent=parent)
    return store


def chain(space: str, n: int) -> list[bytes]:
    return [key(space, i) for i in range(n)]


@pytest.fixture
def fast_prefill() -> Iterator[tuple[RemoteTiers, StorePeer]]:
    # 1 KiB chunks over 1 MB/s with a 5 ms round trip, against 0.1 ms a token of prefill: no
    # prefix of a 4-chunk chain is worth fetching (6-9 ms against 1.6-6.4 ms)
    r, pool = node(
        pool_of({"a": [1024] * 4, "b": [1024] * 4}),
        rtt_s=5e-3,
        bandwidth_bytes_per_s=1e6,
        alpha_s=1e-4,
    )
    yield r, pool
    r.close()


def test_a_lookup_that_no_answer_could_make_fetch_asks_nothing(
    fast_prefill: tuple[RemoteTiers, StorePeer],
) -> None:
    r, pool = fast_prefill
    first = r.lookup(chain("a", 4), tenant="t")  # nothing bounds the chunks yet: asked
    assert pool.probes == 1 and first.matched_chunks == 0
    assert first.locations == ("remote",) * 4  # found, and left to recompute
    assert r.chunk_bounds == (1024, TOKENS)
    second = r.lookup(chain("b", 4), tenant="t")
    assert pool.probes == 1  # not asked
    assert second.matched_chunks == 0 and second.locations == (None,) * 4
    plans = r.planner.counters()
    assert plans.lookups == 2 and plans.unasked == 1
    assert plans.reasons == {"slower-than-recompute": 2}
    event = r.planner.last_plan
    assert event is not None
    assert (event["unasked"], event["missed"], event["recompute"], event["fetch"]) == (4, 0, 0, 0)
    assert event["links"]["pool"]["rtt_s"] == pytest.approx(5e-3)
    assert r.planner.status()["plans"]["unasked_lookups"] == 1


def test_every_so_often_it_asks_anyway(fast_prefill: tuple[RemoteTiers, StorePeer]) -> None:
    r, pool = fast_prefill
    r.lookup(chain("a", 4), tenant="t")
    for _ in range(2 * ASK_ANYWAY_AFTER):
        r.lookup(chain("b", 4), tenant="t")
    assert pool.probes == 1 + 2
    assert r.planner.counters().unasked == 2 * (ASK_ANYWAY_AFTER - 1)


def test_smaller_chunks_than_any_seen_are_learned_by_asking_anyway() -> None:
    # bounded by 64 KiB chunks (0.57 s each over 1 MB/s with 5 ms rtt: never worth it), then a
    # chain of 64-byte chunks that is (5 ms + 0.06 ms against 16 ms of prefill)
    r, pool = node(
        pool_of({"big": [64 << 10] * 2, "small": [64] * 2}),
        rtt_s=5e-3,
        bandwidth_bytes_per_s=1e6,
        alpha_s=1e-3,
    )
    try:
        assert r.lookup(chain("big", 2), tenant="t").matched_chunks == 0
        taken = [r.lookup(chain("small", 2), tenant="t").matched_chunks for _ in range(40)]
        # asked for the big chain, at the ASK_ANYWAY_AFTER-th small one, then every time
        assert pool.probes == 2 + len(taken) - ASK_ANYWAY_AFTER
        assert taken.index(2) == ASK_ANYWAY_AFTER - 1
        assert set(taken[ASK_ANYWAY_AFTER - 1 :]) == {2}
        assert r.chunk_bounds == (64, TOKENS)
    finally:
        r.close()


def test_a_chain_whose_whole_length_pays_for_the_round_trip_is_asked() -> None:
    # one chunk: 10 ms rtt against 1.6 ms of prefill; 32 chunks: 10.3 ms against 51 ms
    r, pool = node(
        pool_of({"a": [1024] * 32, "b": [1024] * 32}),
        rtt_s=1e-2,
        bandwidth_bytes_per_s=1e8,
        alpha_s=1e-4,
    )
    try:
        r.lookup(chain("a", 32), tenant="t")
        assert r.lookup(chain("b", 32), tenant="t").matched_chunks == 32
        assert pool.probes == 2
        # alone, a chunk never pays for the round trip: not asked
        assert r.lookup(chain("b", 1), tenant="t").matched_chunks == 0
        assert pool.probes == 2 and r.planner.counters().unasked == 1
    finally:
        r.close()


def test_a_local_prefix_or_a_second_source_is_always_asked() -> None:
    pool_store = pool_of({"a": [1024] * 4, "b": [1024] * 4})
    r, pool = node(
        pool_store, rtt_s=5e-3, bandwidth_bytes_per_s=1e6, alpha_s=1e-4, peer=pool_of({})
    )
    try:
        r.lookup(chain("a", 4), tenant="t")
        r.lookup(chain("b", 4), tenant="t")
        assert pool.probes == 2  # two sources: asked
    finally:
        r.close()
    r, pool = node(pool_store, rtt_s=5e-3, bandwidth_bytes_per_s=1e6, alpha_s=1e-4)
    try:
        r.lookup(chain("a", 4), tenant="t")
        r.store.put(key("b", 0), bytes(1024), tokens=TOKENS, tenant="t")
        assert r.lookup(chain("b", 4), tenant="t").matched_chunks == 1
        assert pool.probes == 2  # chunk 0 is here: the rest asked for
    finally:
        r.close()


def test_not_asking_never_changes_an_answer_or_a_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random link figures, prefill rates (with attention), chain lengths, chunk sizes (one per
    pool, as one model's are) and a pool holding some prefix of each chain: a node that may
    leave the pool unasked answers and counts as one that always asks, chunk for chunk."""
    unasked = probes = 0
    for seed in range(40):
        rng = random.Random(seed)
        figures = {
            "rtt_s": rng.choice([1e-4, 1e-3, 1e-2]),
            "bandwidth_bytes_per_s": rng.choice([1e5, 1e6, 1e8]),
            "alpha_s": rng.choice([1e-6, 1e-5, 1e-4]),
            "beta_s": rng.choice([0.0, 1e-8, 1e-6]),
        }
        size = rng.choice([256, 1024, 4096])
        asked = [(f"c{i}", rng.randint(1, 24)) for i in range(12)]
        store = pool_of({space: [size] * rng.randint(0, n) for space, n in asked})
        lazy, lazy_pool = node(store, **figures)
        eager, eager_pool = node(store, **figures)
        monkeypatch.setattr(eager.planner, "_not_worth_asking", lambda *_a: None)
        try:
            for space, n in asked:
                got = lazy.lookup(chain(space, n), tenant="t")
                want = eager.lookup(chain(space, n), tenant="t")
                assert got.matched_chunks == want.matched_chunks, (seed, figures, space)
                assert got.matched_tokens == want.matched_tokens
            a, b = lazy.planner.counters(), eager.planner.counters()
            assert (a.lookups, a.fetch_chunks, a.fetched) == (b.lookups, b.fetch_chunks, b.fetched)
            assert a.saved_s == pytest.approx(b.saved_s)
            assert lazy_pool.probes + a.unasked == eager_pool.probes == len(asked)
            unasked += a.unasked
            probes += lazy_pool.probes
        finally:
            lazy.close()
            eager.close()
    assert unasked and probes > 40  # both kinds of lookup were compared


def test_unasked_lookups_are_on_metrics_and_in_agent_remote(
    fast_prefill: tuple[RemoteTiers, StorePeer], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvctl.agent.metrics import AgentMetrics
    from kvctl.cli.agent import _render_remote

    r, _ = fast_prefill
    metrics = AgentMetrics(r.store)
    metrics.add_plan_source(r.planner.counters)
    assert "kvctl_plan_unasked_lookups_total 0.0" in metrics.render()[0].decode()
    r.lookup(chain("a", 4), tenant="t")
    _render_remote({"configured": True, "role": "node", **r.status()})
    assert "not asked" not in capsys.readouterr().out
    r.lookup(chain("b", 4), tenant="t")
    assert "kvctl_plan_unasked_lookups_total 1.0" in metrics.render()[0].decode()
    _render_remote({"configured": True, "role": "node", **r.status()})
    out = " ".join(capsys.readouterr().out.split())  # the console wraps lines
    assert "1 not asked of the pool or peers (no fetch could pay)" in out
