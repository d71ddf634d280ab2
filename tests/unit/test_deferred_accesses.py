"""Policies' access bookkeeping replayed after a read (``policies.deferred``): the same decisions
as inline, whenever the replay happens."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.store.index import Entry
from kvctl.store.policies import EVICTION_POLICIES, make_eviction_policy
from kvctl.store.policies import deferred as deferred_module
from kvctl.store.policies.base import EvictionPolicy
from kvctl.store.policies.deferred import SETTLE_SLICE, DeferredAccesses, Settler
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.unit.policy_ops import OPS, apply_ops, k, small_tiers

DEFERRABLE = {
    "lru",
    "lineage-lru",
    "lineage-lru2",
    "lineage-arc",
    "lineage-adaptive",
    "lineage-chain",
}


class Recorder(EvictionPolicy):
    """Records each call with what it read of the entry then."""

    name = "recorder"
    accesses_deferrable = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, bytes, int, int]] = []

    def _note(self, what: str, e: Entry) -> None:
        self.calls.append((what, e.key, e.last_tick, e.access_count))

    def on_insert(self, entry: Entry) -> None:
        self._note("insert", entry)

    def on_access(self, entry: Entry) -> None:
        self._note("access", entry)

    def on_remove(self, entry: Entry) -> None:
        self._note("remove", entry)

    def on_children_changed(self, entry: Entry) -> None:
        self._note("children", entry)

    def on_victim(self, entry: Entry) -> None:
        self._note("victim", entry)

    def victim(self, now_s: float) -> Entry | None:
        self.calls.append(("victim?", b"", 0, 0))
        return None

    def victims(self, now_s: float) -> Iterator[Entry]:
        self.calls.append(("victims?", b"", 0, 0))
        return iter(())

    def __len__(self) -> int:
        return 0


def entry(name: str, tick: int) -> Entry:
    return Entry(key=k(name), tier="cpu", size_bytes=1, tokens=1, tenant="", parent=None,
                 last_tick=tick)  # fmt: skip


def access(e: Entry, tick: int) -> Entry:
    """What the store does to an entry on an access before telling the policy."""
    e.last_tick = tick
    e.access_count += 1
    return e


def test_accesses_wait_for_the_next_other_call_and_replay_in_order() -> None:
    inner = Recorder()
    wakes: list[int] = []
    policy = DeferredAccesses(inner, wake=lambda: wakes.append(1))
    a, b = entry("a", 1), entry("b", 2)
    policy.on_access(access(a, 3))
    policy.on_access(access(b, 4))
    assert inner.calls == [] and policy.queued == 2 and wakes == [1]  # one wake per batch
    policy.on_insert(entry("c", 5))
    assert inner.calls == [
        ("access", k("a"), 3, 2),
        ("access", k("b"), 4, 2),
        ("insert", k("c"), 5, 1),
    ]
    assert policy.queued == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda p, e: p.on_remove(e),
        lambda p, e: p.on_children_changed(e),
        lambda p, e: p.on_victim(e),
        lambda p, e: p.victim(0.0),
        lambda p, e: p.victims(0.0),
        lambda p, e: p.admit(e, 0.0),
    ],
)
def test_every_other_call_replays_the_queue_first(
    call: Callable[[DeferredAccesses, Entry], object],
) -> None:
    inner = Recorder()
    policy = DeferredAccesses(inner)
    policy.on_access(access(entry("a", 1), 2))
    call(policy, entry("z", 9))
    assert inner.calls[0] == ("access", k("a"), 2, 2)
    assert policy.queued == 0


def test_an_entry_accessed_again_while_queued_is_replayed_as_it_was_first() -> None:
    inner = Recorder()
    policy = DeferredAccesses(inner)
    a = entry("a", 1)
    policy.on_access(access(a, 2))
    policy.on_access(access(a, 3))
    assert inner.calls == []
    policy.flush()  # not tick 3 twice
    assert inner.calls == [("access", k("a"), 2, 2), ("access", k("a"), 3, 3)]
    assert (a.last_tick, a.access_count) == (3, 3)


def test_the_queue_is_bounded() -> None:
    inner = Recorder()
    policy = DeferredAccesses(inner, max_queued=3)
    for i in range(7):
        policy.on_access(access(entry(f"e{i}", i), i + 10))
    assert policy.queued == 1  # replayed at 3, then at 6
    assert [c[1] for c in inner.calls] == [k(f"e{i}") for i in range(6)]


def test_a_partial_replay_takes_the_oldest_and_leaves_the_rest_queued() -> None:
    inner = Recorder()
    policy = DeferredAccesses(inner)
    for i in range(5):
        policy.on_access(access(entry(f"e{i}", i), i + 10))
    assert policy.flush(2) == 3
    assert [c[1] for c in inner.calls] == [k("e0"), k("e1")]
    assert policy.flush() == 0
    assert [c[1] for c in inner.calls] == [k(f"e{i}") for i in range(5)]


def test_only_policies_that_allow_it_are_wrapped() -> None:
    settler = Settler(threading.RLock())
    for name in EVICTION_POLICIES:
        if name == "belady":
            continue
        wrapped = settler.wrap(make_eviction_policy(name))
        assert isinstance(wrapped, DeferredAccesses) == (name in DEFERRABLE), name
    assert set(EVICTION_POLICIES) >= DEFERRABLE


class Threadless(Settler):
    def _wake(self) -> None:
        pass


def threadless(store: TieredStore) -> TieredStore:
    """``store`` deferring its policies' accesses, replayed only when something asks for them
    (no thread: the test decides when)."""
    store._settler = settler = Threadless(store._lock)
    store._policies = {n: settler.wrap(p) for n, p in store._policies.items()}
    return store


def evictions(store: TieredStore) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    store.subscribe(
        lambda ev: (
            out.append((str(ev["type"]), str(ev["key"]), str(ev.get("tier", ""))))
            if ev["type"] in ("evict", "demote")
            else None
        )
    )
    return out


@pytest.mark.parametrize("policy", sorted(set(EVICTION_POLICIES) - {"belady"}))
@settings(max_examples=40, deadline=None)
@given(ops=OPS, two_tiers=st.booleans(), settle_at=st.lists(st.booleans(), max_size=60))
def test_the_same_decisions_as_inline_whenever_the_replay_comes(
    policy: str, ops: list[tuple[str, int, int]], two_tiers: bool, settle_at: list[bool]
) -> None:
    """Two stores take the same operations; the second defers its policies' accesses, and
    replays them at drawn points between operations (as its thread may) or not at all: every
    eviction and demotion, and where every chunk ends up, must be the same."""
    inline = TieredStore(small_tiers(two_tiers), eviction=policy, clock=lambda: 0.0)
    deferred = threadless(TieredStore(small_tiers(two_tiers), eviction=policy, clock=lambda: 0.0))
    wrapped = deferred._settler._wrapped  # type: ignore[union-attr]
    assert len(wrapped) == (len(deferred.tier_names) if policy in DEFERRABLE else 0)
    seen = (evictions(inline), evictions(deferred))
    steps = zip(apply_ops(inline, ops), apply_ops(deferred, ops), strict=True)
    for i, _ in enumerate(steps):
        if i < len(settle_at) and settle_at[i]:
            deferred.settle_policies()
        assert seen[0] == seen[1]
    assert sorted((e.key, e.tier) for e in inline.entries()) == sorted(
        (e.key, e.tier) for e in deferred.entries()
    )


def test_a_read_is_replayed_by_the_thread_and_counts_for_eviction() -> None:
    """lineage-lru over a 4-chunk arena: a and b, stored before c, read under leases; the
    thread replays those reads with no other call to the store, and a put then evicts c, the
    chunk used longest ago."""
    store = TieredStore([CpuTier(4 * 64)], eviction="lineage-lru", defer_accesses=True)
    try:
        for name in "abc":
            store.put(k(name), bytes(64))
        for _ in range(2 * SETTLE_SLICE):  # more than one slice of the settler's
            leases = store.lease_many([k("a"), k("b")], 5.0)
            store.release([lease.lease_id for lease in leases])  # type: ignore[union-attr]
        settler = store._settler
        assert settler is not None
        deadline = time.monotonic() + 10.0
        while settler.queued and time.monotonic() < deadline:
            time.sleep(0.001)
        assert settler.queued == 0
        store.put(k("d"), bytes(64))
        store.put(k("e"), bytes(64))
        assert k("c") not in store
        assert all(k(n) in store for n in "abde")
    finally:
        store.close()
    assert settler._thread is not None
    settler._thread.join(5.0)
    assert not settler._thread.is_alive()


def test_the_store_reports_what_is_queued() -> None:
    store = threadless(TieredStore([CpuTier(4 * 64)], eviction="lineage-adaptive"))
    for name in "ab":
        store.put(k(name), bytes(64))
    for name in "aba":
        store.get(k(name))
    assert store.queued_accesses == 3 == store.snapshot()["queued_accesses"]
    store.settle_policies()
    assert store.queued_accesses == 0
    store.get(k("b"))
    (status,) = store.policy_status().values()  # replays what is queued: the leader is current
    assert status["policy"] == "lineage-adaptive" and store.queued_accesses == 0


def test_two_queued_reads_of_one_chunk_count_as_two() -> None:
    """lineage-lru2 ranks by the access before the last: a, read twice since b and c were
    last read, must outlast them, as inline; replaying both reads with the second's tick would
    count one (a's access before the last would be its put) and evict a."""
    for defer in (False, True):
        store = TieredStore([CpuTier(3 * 64)], eviction="lineage-lru2")
        if defer:
            store = threadless(store)
        try:
            for name in "abc":
                store.put(k(name), bytes(64))
            for name in "bcaa":
                store.get(k(name))
            store.put(k("d"), bytes(64))
            assert [k(n) in store for n in "abcd"] == [True, False, True, True], defer
        finally:
            store.close()


def test_a_store_dropped_without_close_is_freed_and_its_thread_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(deferred_module, "IDLE_CHECK_SECONDS", 0.02)
    store = TieredStore([CpuTier(4 * 64)], eviction="lineage-adaptive", defer_accesses=True)
    store.put(k("a"), bytes(64))
    store.get(k("a"))  # queues an access: the thread starts
    settler = store._settler
    assert settler is not None and settler._thread is not None
    thread, gone = settler._thread, weakref.ref(settler)
    del store, settler
    gc.collect()
    assert gone() is None
    thread.join(5.0)
    assert not thread.is_alive()


def test_a_policy_shared_by_two_tiers_gets_one_queue() -> None:
    settler = Settler(threading.RLock())
    shared = make_eviction_policy("lineage-lru")
    assert settler.wrap(shared) is settler.wrap(shared)
    assert settler.wrap(make_eviction_policy("lineage-lru")) is not settler.wrap(shared)
