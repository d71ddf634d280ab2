"""Eviction and admission policies, driven through the real store."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.store.errors import KeyNotFound
from kvctl.store.keys import KVLayout, Namespace, keys_for, parents_of
from kvctl.store.policies import (
    EVICTION_POLICIES,
    BeladyPolicy,
    FrequencyAdmission,
    make_admission_policy,
    make_eviction_policy,
)
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.metered import MeteredTier
from tests.conftest import chain, put_chain


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_lru_evicts_least_recently_used(ns: Namespace) -> None:
    store = TieredStore([MeteredTier("cpu", 3)], eviction="lru")
    for i in range(3):
        store.put(k(i), None, size_bytes=1)
    store.touch(k(0))
    store.put(k(3), None, size_bytes=1)
    assert k(1) not in store and {k(0), k(2), k(3)} <= set(e.key for e in store.entries())


def test_lineage_lru_evicts_leaves_first(ns: Namespace) -> None:
    # LRU would evict the chain's root first (it was touched first); leaf-first takes the tail
    store = TieredStore([CpuTier(300)], eviction="lineage-lru")
    keys = chain(ns, 3)
    put_chain(store, keys)
    other = chain(ns, 1, seed=5)[0]
    store.put(other, b"x" * 100)
    assert keys[2] not in store and keys[0] in store and keys[1] in store
    lru = TieredStore([CpuTier(300)], eviction="lru")
    put_chain(lru, keys)
    lru.put(other, b"x" * 100)
    assert keys[0] not in lru  # the orphaning LRU does


def test_priority_evicts_low_priority_first_and_retention_expires() -> None:
    now = [0.0]
    store = TieredStore([MeteredTier("cpu", 3)], eviction="priority", clock=lambda: now[0])
    store.put(k(1), None, size_bytes=1, priority=90, retention_seconds=10)
    store.put(k(2), None, size_bytes=1, priority=10)
    store.put(k(3), None, size_bytes=1)  # default 35
    store.put(k(4), None, size_bytes=1)
    assert k(2) not in store  # lowest priority went first, although k(1) is older
    store.put(k(5), None, size_bytes=1)
    assert k(3) not in store and k(1) in store
    now[0] = 11.0  # k(1)'s retention ended: it is back to 35 and now the oldest
    store.put(k(6), None, size_bytes=1)
    assert k(1) not in store and k(4) in store


def test_frequency_admission_counts_ghosts() -> None:
    gate = FrequencyAdmission(min_accesses=3, ghost_entries=2)
    store = TieredStore(
        [MeteredTier("cpu", 1), MeteredTier("disk", 10)], eviction="lru", admission={"disk": gate}
    )
    for _ in range(3):  # k(1) comes and goes three times; the third time it is admitted
        store.put(k(1), None, size_bytes=1)
        store.put(k(2), None, size_bytes=1)
        if k(2) in store and store.entry(k(2)).tier == "cpu":
            store.evict([k(2)])
    assert store.entry(k(1)).tier == "disk"
    assert gate.refused >= 2


def test_belady_keeps_the_chunk_used_soonest() -> None:
    seq = [1, 2, 3, 1, 2, 4, 1, 2, 3, 4]
    next_pos = [
        next((j for j in range(i + 1, len(seq)) if seq[j] == x), math.inf)
        for i, x in enumerate(seq)
    ]
    oracle: dict[bytes, float] = {}
    store = TieredStore([MeteredTier("cpu", 2)], eviction={"cpu": BeladyPolicy(oracle)})
    hits = 0
    for i, x in enumerate(seq):
        oracle[k(x)] = next_pos[i]
        if k(x) in store:
            hits += 1
            store.touch(k(x))
        else:
            store.put(k(x), None, size_bytes=1)
    # OPT with bypass on this sequence and 2 slots: hits at positions 3, 4, 6, 7 (1,2 kept)
    assert hits == 4


def test_unknown_policy_names_list_the_choices() -> None:
    with pytest.raises(ValueError, match="lineage-lru"):
        make_eviction_policy("fifo")
    with pytest.raises(ValueError, match="frequency"):
        make_admission_policy("never")


# --- properties every policy must hold -------------------------------------------------------

ops = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 4), st.sampled_from(["t0", "t1", "t2"])),
    min_size=1,
    max_size=40,
)


@pytest.mark.parametrize("policy", list(EVICTION_POLICIES))
@settings(max_examples=40, deadline=None)
@given(requests=ops, pin_first=st.booleans(), bypass=st.booleans())
def test_pins_hold_and_lineage_never_orphans(
    policy: str, requests: list[tuple[int, int, str]], pin_first: bool, bypass: bool
) -> None:
    ns = Namespace("m", KVLayout(1, 1, 1))
    # turning away chains deeper than the tier (up to 4 chunks here, 3 of room) changes neither
    cap = 3 if bypass else 6
    store = TieredStore([MeteredTier("cpu", cap)], eviction=policy, bypass_unreachable=bypass)
    pinned: bytes | None = None
    orphaned: list[bytes] = []

    def on_event(event: dict[str, object]) -> None:
        if event["type"] == "evict":
            key = bytes.fromhex(str(event["key"]))
            if any(e.parent == key for e in store.entries()):
                orphaned.append(key)

    store.subscribe(on_event)
    for doc, n, tenant in requests:
        keys = keys_for([doc] * (n * 4), ns, 4)
        store.lookup(keys, tenant=tenant)
        for depth, (key, parent) in enumerate(zip(keys, parents_of(keys), strict=True)):
            if key in store:
                store.touch(key, tenant=tenant)
            else:
                store.put(key, None, size_bytes=1, parent=parent, tenant=tenant, depth=depth)
        if pin_first and pinned is None:
            pinned = keys[0]
            store.pin([pinned])
    if pinned is not None:
        assert pinned in store
    assert store.tier("cpu").used_bytes <= cap
    if bypass:
        assert all(e.depth < cap for e in store.entries())
    if policy.startswith("lineage"):
        assert orphaned == []


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["alice", "bob", "carol"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=3),  # prefix made of shared parts
            st.booleans(),  # isolated policy for this tenant's puts
        ),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from(list(EVICTION_POLICIES)),
)
def test_isolated_chunks_never_reach_another_tenant(
    requests: list[tuple[str, list[int], bool]], policy: str
) -> None:
    """Tries to read another tenant's isolated chunk through every path: lookup, get, touch and
    a put over it (which replaces it), with shared keys (no salt) so only the store's check
    stands in the way."""
    ns = Namespace("m", KVLayout(1, 1, 1))
    store = TieredStore([CpuTier(4096)], eviction=policy)
    owner: dict[bytes, tuple[str, bool]] = {}
    for tenant, parts, isolated in requests:
        tokens = [t for p in parts for t in [p] * 4]
        keys = keys_for(tokens, ns, 4)
        res = store.lookup(keys, tenant=tenant)
        for key, loc in zip(keys, res.locations, strict=True):
            if loc is not None:
                o_tenant, o_iso = owner[key]
                assert not o_iso or o_tenant == tenant
        for key, parent in zip(keys, parents_of(keys), strict=True):
            if key in owner and key in store:
                o_tenant, o_iso = owner[key]
                if o_iso and o_tenant != tenant:
                    with pytest.raises(KeyNotFound):
                        store.get(key, tenant=tenant)
                    with pytest.raises(KeyNotFound):
                        store.touch(key, tenant=tenant)
                    # a put over it answers as for a new chunk and replaces it: the owner
                    # loses its copy (a miss), and never did anyone read the other's bytes
                    if store.put(key, tenant.encode() * 8, tenant=tenant, parent=parent):
                        owner[key] = (tenant, False)
                        assert store.get(key, tenant=tenant) == tenant.encode() * 8
                    continue
                assert store.get(key, tenant=tenant) == o_tenant.encode() * 8
            elif key not in store:
                data = tenant.encode() * 8
                if store.put(key, data, tenant=tenant, parent=parent, isolated=isolated):
                    owner[key] = (tenant, isolated)
