"""A lookup with nothing of its chain here and one remote source does not ask that source when
no answer could make fetching pay: the plan as if the source held the whole chain (each chunk
as small and as long as any it has answered with, over the link without its round trip)
fetches nothing. The answer, the store's counts and the pull hints must be what asking would
have given (the plan's own counters say "unasked" instead of why the chunks found were
recomputed); the source must be asked where a fetch could pay (a chain that pays only whole
included), with a local prefix or a local chunk past a gap, with two sources, with a breaker
not closed, before any answer has bounded the chunks, and every ``ASK_ANYWAY_AFTER``-th time
regardless. A round trip measured high by a slow spell must not stop the probes that measure
it back down.

The pool is a real ``TieredStore`` answering as an agent's data plane does (``StorePeer``,
counting its probes)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Sequence

import pytest

from kvctl.remote import federation
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
from kvctl.store.tiers.base import ChunkMeta
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


def pool_of(chains: dict[str, list[int]], tokens: dict[str, int] | None = None) -> TieredStore:
    """A pool holding, per space, a chain of chunks of these sizes (of ``tokens[space]`` tokens
    each, else ``TOKENS``)."""
    store = TieredStore([CpuTier(64 << 20)], chunk_tokens=TOKENS)
    for space, sizes in chains.items():
        n = (tokens or {}).get(space, TOKENS)
        for i, size in enumerate(sizes):
            parent = key(space, i - 1) if i else None
            store.put(key(space, i), bytes(size), tokens=n, tenant="t", parent=parent)
    return store


def chain(space: str, n: int) -> list[bytes]:
    return [key(space, i) for i in range(n)]


@pytest.fixture(autouse=True)
def patient_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """No probe is given up as late (0.5 s): on a loaded CI machine one was, and a lookup
    that lost its answer differed from its twin for that reason alone."""
    monkeypatch.setattr(federation, "PROBE_DEADLINE_S", 60.0)


@pytest.fixture
def fast_prefill() -> Iterator[tuple[RemoteTiers, StorePeer]]:
    # 1 KiB chunks over 100 kB/s (10 ms each, before any round trip) against 0.1 ms a token of
    # prefill (1.6 ms a chunk): no prefix of a chain is worth fetching
    r, pool = node(
        pool_of({"a": [1024] * 4, "b": [1024] * 4}),
        rtt_s=5e-3,
        bandwidth_bytes_per_s=1e5,
        alpha_s=1e-4,
    )
    yield r, pool
    r.close()


def lazy_and_eager(
    store: TieredStore, monkeypatch: pytest.MonkeyPatch, **figures: float
) -> tuple[tuple[RemoteTiers, StorePeer], tuple[RemoteTiers, StorePeer]]:
    """Two nodes over the same pool: one that may leave it unasked, one that always asks."""
    lazy, eager = node(store, **figures), node(store, **figures)
    monkeypatch.setattr(eager[0].planner, "_not_worth_asking", lambda *_a: None)
    return lazy, eager


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
    assert plans.reasons == {"slower-than-recompute": 1, "unasked": 1}
    assert plans.recompute_chunks == 4  # the found ones only: the unasked are not known
    event = r.planner.last_plan
    assert event is not None and event["reason"] == "unasked"
    assert (event["unasked"], event["missed"], event["recompute"], event["fetch"]) == (4, 0, 0, 0)
    assert event["usable"] == 0 and event["links"]["pool"]["bandwidth_bytes_per_s"] == 1e5
    assert r.planner.status()["plans"]["unasked_lookups"] == 1


def test_every_so_often_it_asks_anyway(fast_prefill: tuple[RemoteTiers, StorePeer]) -> None:
    r, pool = fast_prefill
    r.lookup(chain("a", 4), tenant="t")
    for _ in range(2 * ASK_ANYWAY_AFTER):
        r.lookup(chain("b", 4), tenant="t")
    assert pool.probes == 1 + 2
    assert r.planner.counters().unasked == 2 * (ASK_ANYWAY_AFTER - 1)


def test_smaller_chunks_than_any_seen_are_learned_by_asking_anyway() -> None:
    # bounded by 64 KiB chunks (66 ms each over 1 MB/s: never worth it), then a chain of
    # 64-byte chunks that is (5 ms + 0.06 ms against 16 ms of prefill)
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


def test_larger_chunks_answered_later_do_not_raise_the_bound() -> None:
    r, pool = node(
        pool_of({"s1": [64] * 2, "big": [64 << 10] * 2, "s2": [64] * 2}),
        rtt_s=5e-3,
        bandwidth_bytes_per_s=1e6,
        alpha_s=1e-3,
    )
    try:
        r.lookup(chain("s1", 2), tenant="t")
        r.lookup(chain("big", 2), tenant="t")
        assert r.chunk_bounds == (64, TOKENS)
        assert r.lookup(chain("s2", 2), tenant="t").matched_chunks == 2
        assert pool.probes == 3
    finally:
        r.close()


def test_the_longest_chunks_answered_bound_the_tokens() -> None:
    # 1 KiB chunks at 100 kB/s (10 ms each) against 0.1 ms a token: a chunk of 128 tokens
    # (12.8 ms) is worth fetching, one of 16 (1.6 ms) is not
    spaces = {"long": [1024] * 4, "short": [1024] * 4, "long2": [1024] * 4}
    store = pool_of(spaces, tokens={"long": 128, "long2": 128})
    r, pool = node(store, rtt_s=1e-4, bandwidth_bytes_per_s=1e5, alpha_s=1e-4)
    try:
        assert r.lookup(chain("long", 4), tenant="t").matched_chunks == 4
        assert r.lookup(chain("short", 4), tenant="t").matched_chunks == 0
        assert r.chunk_bounds == (1024, 128)
        assert r.lookup(chain("long2", 4), tenant="t").matched_chunks == 4
        assert pool.probes == 3
    finally:
        r.close()


def test_a_chain_that_pays_only_whole_is_asked() -> None:
    # attention: one chunk costs 0.42 ms to recompute against 2.6 ms over the link (10 kB at 4
    # MB/s), eight cost 17.7 ms against 20.5 ms, sixteen 64 ms against 41 ms
    figures = {"rtt_s": 1e-4, "bandwidth_bytes_per_s": 4e6, "alpha_s": 1e-5, "beta_s": 2e-6}
    r, pool = node(pool_of({"a": [10240] * 16, "b": [10240] * 16}), **figures)
    try:
        r.lookup(chain("a", 1), tenant="t")
        assert r.lookup(chain("b", 16), tenant="t").matched_chunks == 16
        assert pool.probes == 2
        assert r.lookup(chain("b", 1), tenant="t").matched_chunks == 0  # alone: not asked
        assert r.lookup(chain("b", 8), tenant="t").matched_chunks == 0
        assert pool.probes == 2 and r.planner.counters().unasked == 2
    finally:
        r.close()


def test_a_local_prefix_a_chunk_past_a_gap_or_a_second_source_is_always_asked() -> None:
    pool_store = pool_of({"a": [1024] * 4, "b": [1024] * 4, "g": [1024] * 4})
    figures = {"rtt_s": 1e-4, "bandwidth_bytes_per_s": 1e5, "alpha_s": 1e-4}
    r, pool = node(pool_store, peer=pool_of({}), **figures)
    try:
        r.lookup(chain("a", 4), tenant="t")
        r.lookup(chain("b", 4), tenant="t")
        assert pool.probes == 2  # two sources: asked
    finally:
        r.close()
    r, pool = node(pool_store, **figures)
    try:
        r.lookup(chain("a", 4), tenant="t")
        r.store.put(key("b", 0), bytes(1024), tokens=TOKENS, tenant="t")
        assert r.lookup(chain("b", 4), tenant="t").matched_chunks == 1
        assert pool.probes == 2  # chunk 0 is here: the rest asked for
    finally:
        r.close()
    # all four from the pool: 41 ms against 6.4 ms; chunk 0 from it (2.6 ms at 400 kB/s) and
    # 1-3 read here for nothing: worth it
    r, pool = node(pool_store, **{**figures, "bandwidth_bytes_per_s": 4e5})
    try:
        r.lookup(chain("a", 4), tenant="t")
        for i in range(1, 4):
            r.store.put(key("g", i), bytes(1024), tokens=TOKENS, tenant="t", parent=key("g", i - 1))
        assert r.lookup(chain("g", 4), tenant="t").matched_chunks == 4
        assert pool.probes == 2
    finally:
        r.close()


def test_a_source_whose_breaker_is_not_closed_is_asked(
    fast_prefill: tuple[RemoteTiers, StorePeer],
) -> None:
    r, _ = fast_prefill
    r.lookup(chain("a", 4), tenant="t")
    source = r.sources[0]
    ticket = source.breaker.admit()
    assert ticket is not None
    source.breaker.failed(ticket)
    assert source.breaker.state != "closed"
    r.lookup(chain("b", 4), tenant="t")
    assert r.planner.counters().unasked == 0 and source.counters.skipped == 1


@pytest.mark.parametrize("override", ["fetch", "recompute"])
def test_a_forced_link_answers_as_when_always_asked(
    monkeypatch: pytest.MonkeyPatch, override: str
) -> None:
    store = pool_of({"a": [1024] * 4, "b": [1024] * 4})
    figures = {"rtt_s": 5e-3, "bandwidth_bytes_per_s": 1e5, "alpha_s": 1e-4}
    (lazy, lazy_pool), (eager, _) = lazy_and_eager(store, monkeypatch, **figures)
    try:
        for r in (lazy, eager):
            r.sources[0].link.override = override
        got = [lazy.lookup(chain(c, 4), tenant="t").matched_chunks for c in "ab"]
        want = [eager.lookup(chain(c, 4), tenant="t").matched_chunks for c in "ab"]
        assert got == want == ([4, 4] if override == "fetch" else [0, 0])
        assert lazy_pool.probes == (2 if override == "fetch" else 1)
    finally:
        lazy.close()
        eager.close()


def test_the_store_counts_and_the_hints_are_as_when_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = pool_of({"a": [1024] * 4, "b": [1024] * 4})
    figures = {"rtt_s": 1e-4, "bandwidth_bytes_per_s": 1e8, "alpha_s": 1e-4}
    (lazy, _), (eager, _) = lazy_and_eager(store, monkeypatch, **figures)
    try:
        for r in (lazy, eager):
            assert r.lookup(chain("a", 4), tenant="t").matched_chunks == 4  # hints left
            r.sources[0].link.configured_bandwidth_bytes_per_s = 1e4  # slower: not worth it
            assert r.lookup(chain("a", 4), tenant="t").matched_chunks == 0
        assert lazy.planner.counters().unasked == 1
        assert lazy._hints == eager._hints == {}  # no pull moves the first lookup's hits
        a, b = lazy.store.stats, eager.store.stats
        assert (a.lookups, a.lookup_chunks, a.lookup_tokens, a.hit_chunks) == (
            b.lookups,
            b.lookup_chunks,
            b.lookup_tokens,
            b.hit_chunks,
        )
    finally:
        lazy.close()
        eager.close()


class SlowPool(StorePeer):
    """A pool whose probes take ``delay_s`` (a slow spell, then back to normal)."""

    delay_s = 0.02

    def probe_many(self, keys: Sequence[bytes], *, tenant: str) -> list[ChunkMeta | None]:
        time.sleep(self.delay_s)
        return super().probe_many(keys, tenant=tenant)


def test_a_round_trip_measured_high_does_not_stop_the_probes_that_measure_it() -> None:
    """The default: the link's round trip is measured by the probes themselves. One slow probe
    seeds it at ~20 ms (4 chunks: 20 ms against 6.4 ms of prefill); once the pool is quick
    again the node must keep asking (the check leaves the round trip out), so the probes bring
    the figure down and the chain is fetched. (Compared against a second node before, whose own
    timing put its first fetch one lookup apart on a loaded CI machine.)"""
    store = pool_of({f"s{i}": [1024] * 4 for i in range(60)})
    pool = SlowPool("pool", store)
    link = LinkEstimator("pool", bandwidth_bytes_per_s=1e9)  # rtt measured
    r = RemoteTiers(
        TieredStore([CpuTier(1 << 20)], chunk_tokens=TOKENS),
        pool=Source("pool", POOL_TIER, pool, link),
        prefill=PrefillModel(1e-4, 0.0, "configured"),
    )
    try:
        assert r.lookup(chain("s0", 4), tenant="t").matched_chunks == 0
        assert link.link().rtt_s is not None and link.link().rtt_s > 6.4e-3
        pool.delay_s = 0.0
        taken = [r.lookup(chain(f"s{i}", 4), tenant="t").matched_chunks for i in range(1, 60)]
        assert pool.probes == 60 and r.planner.counters().unasked == 0
        assert 4 in taken
    finally:
        r.close()


def test_not_asking_never_changes_an_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random link figures, prefill rates (with attention), chain lengths, chunk sizes (one per
    pool, as one model's are) and a pool holding some prefix of each chain: a node that may
    leave the pool unasked answers as one that always asks, chunk for chunk, and counts the
    same fetches and savings."""
    unasked = probes = 0
    for seed in range(40):
        rng = random.Random(seed)
        figures = {
            "rtt_s": rng.choice([1e-4, 1e-3, 1e-2]),
            "bandwidth_bytes_per_s": rng.choice([1e4, 1e5, 1e6, 1e8]),
            "alpha_s": rng.choice([1e-6, 1e-5, 1e-4]),
            "beta_s": rng.choice([0.0, 1e-8, 1e-6]),
        }
        size = rng.choice([256, 1024, 4096])
        asked = [(f"c{i}", rng.randint(1, 24)) for i in range(12)]
        store = pool_of({space: [size] * rng.randint(0, n) for space, n in asked})
        (lazy, lazy_pool), (eager, eager_pool) = lazy_and_eager(store, monkeypatch, **figures)
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
            assert a.reasons["unasked"] == a.unasked
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
