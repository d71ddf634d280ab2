"""``lineage-arc`` (leaf-first ARC) driven through the real store, and the simulator making the
same decisions as a store over real bytes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.store.errors import InvalidArgument
from kvctl.store.policies import EVICTION_POLICIES, LineageARCPolicy, make_eviction_policy
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.metered import MeteredTier
from kvctl.workload.generators import generate
from kvctl.workload.simulate import capacity_from_fraction, simulate_policy
from kvctl.workload.trace import TraceRequest, read_mooncake_trace
from tests.unit.policy_ops import OPS, apply_ops, k, small_tiers


def evicted_keys(store: TieredStore) -> list[bytes]:
    """The keys the store evicts from now on, in order (a live list)."""
    out: list[bytes] = []
    store.subscribe(
        lambda ev: out.append(bytes.fromhex(str(ev["key"]))) if ev["type"] == "evict" else None
    )
    return out


def names(keys: list[bytes]) -> list[str]:
    return [key.rstrip(b".").decode() for key in keys]


def arc_store(capacity: int, **kw: float) -> tuple[TieredStore, LineageARCPolicy]:
    policy = LineageARCPolicy(**kw)
    return TieredStore([MeteredTier("cpu", capacity)], eviction={"cpu": policy}), policy


def test_registered_and_arguments_checked() -> None:
    assert EVICTION_POLICIES["lineage-arc"] is LineageARCPolicy
    assert isinstance(make_eviction_policy("lineage-arc"), LineageARCPolicy)
    with pytest.raises(InvalidArgument, match="ghost_factor"):
        LineageARCPolicy(ghost_factor=0)
    with pytest.raises(InvalidArgument, match="initial_t1_ratio"):
        LineageARCPolicy(initial_t1_ratio=1.5)


def test_chunks_seen_once_go_first_while_their_list_is_over_its_target() -> None:
    store, _ = arc_store(4, initial_t1_ratio=0.5)
    gone = evicted_keys(store)
    for name in "abcd":
        store.put(k(name), None, size_bytes=1)
    store.touch(k("a"))  # seen twice: into T2
    # full: the target for T1 starts at half the tier here (2 chunks); T1 holds b, c, d (3 > 2),
    # so the least recently used chunk seen once goes, although a is older than all of them
    for name in "efg":
        store.put(k(name), None, size_bytes=1)
    assert names(gone) == ["b", "c", "d"]
    assert k("a") in store


def test_ghost_hits_move_the_target_toward_the_list_that_lost_the_chunk() -> None:
    store, policy = arc_store(4, initial_t1_ratio=0.5)
    for name in "abcd":
        store.put(k(name), None, size_bytes=1)
    store.touch(k("a"))
    store.touch(k("b"))  # T2 = a, b; T1 = c, d
    store.put(k("e"), None, size_bytes=1)  # T1 (2) is not over 2: T2's LRU a goes
    store.put(k("f"), None, size_bytes=1)  # T1 = c, d, e (3 > 2): c goes
    assert k("a") not in store and k("c") not in store
    assert policy._target_t1_bytes == 2
    store.put(k("c"), None, size_bytes=1)  # back from T1's ghosts: T1 should have been larger
    assert policy._target_t1_bytes == 3
    assert policy._member[k("c")] == 2  # a returning chunk is one seen again
    store.put(k("a"), None, size_bytes=1)  # back from T2's ghosts: T2 should have been larger
    assert policy._target_t1_bytes == 2


def test_leaf_first_and_never_the_chunk_just_stored_while_another_leaf_is_left() -> None:
    store, policy = arc_store(3)
    assert policy.initial_t1_ratio == 0  # as in ARC: T1 is over its target from the start
    gone = evicted_keys(store)
    store.put(k("x"), None, size_bytes=1)
    store.touch(k("x"))  # T2
    store.put(k("a"), None, size_bytes=1)
    store.put(k("b"), None, size_bytes=1, parent=k("a"), depth=1)
    # T1 (a, b) is over its target, but its only leaf is b, stored last: the parent of c. Taking
    # it would orphan c, so the other list's leaf x goes instead; a, a parent, is never taken
    store.put(k("c"), None, size_bytes=1, parent=k("b"), depth=2)
    assert names(gone) == ["x"]
    store.put(k("d"), None, size_bytes=1, parent=k("c"), depth=3)  # now c is the newest: b, a?
    assert names(gone) == [
        "x",
        "c",
    ]  # only c was a leaf: the newest is taken when nothing else is left


def test_a_chunk_back_from_a_pin_keeps_its_list() -> None:
    store, policy = arc_store(8)
    store.put(k("a"), None, size_bytes=1)
    store.touch(k("a"))
    store.put(k("b"), None, size_bytes=1)
    store.pin([k("a"), k("b")])
    assert len(policy) == 0
    store.unpin([k("a"), k("b")])
    assert policy._member == {k("a"): 2, k("b"): 1}
    store.pin([k("b")])
    store.touch(k("b"))  # accessed while pinned: seen twice when it comes back
    store.unpin([k("b")])
    assert policy._member[k("b")] == 2


@settings(max_examples=60, deadline=None)
@given(ops=OPS, two_tiers=st.booleans())
def test_bookkeeping_matches_the_tier_after_any_operations(
    ops: list[tuple[str, int, int]], two_tiers: bool
) -> None:
    """Whatever the store does (puts of chains, touches, pins, deletes, demotions to a second
    tier), each tier's policy tracks exactly its unpinned chunks and their bytes, and the ghost
    and away lists stay bounded."""
    tiers = small_tiers(two_tiers)
    store = TieredStore(tiers, eviction="lineage-arc")
    for _ in apply_ops(store, ops):
        for tier in tiers:
            policy = store._policies[tier.name]
            assert isinstance(policy, LineageARCPolicy)
            unpinned = {e.key: e for e in store.entries(tier.name) if not e.pinned}
            assert set(policy._member) == set(unpinned)
            assert sum(policy._bytes.values()) == sum(e.size_bytes for e in unpinned.values())
            assert len(policy._away) <= max(policy._peak_entries, 64)
            ghosts = len(policy._ghosts[1]) + len(policy._ghosts[2])
            assert ghosts <= max(2 * policy._peak_entries, 64)


# --- one code path: the simulator decides as a store over real bytes does ---------------------


def _replay(
    store: TieredStore, requests: list[TraceRequest], chunk_bytes: int, with_data: bool
) -> list[int]:
    """The simulator's replay loop: a lookup per request, then each block touched or stored."""
    matched: list[int] = []
    for r in requests:
        keys = [b.to_bytes(16, "little") for b in r.block_ids]
        matched.append(store.lookup(keys, tenant=r.tenant).matched_chunks)
        parent = None
        for depth, (key, tokens) in enumerate(zip(keys, r.block_token_counts, strict=True)):
            if key in store:
                store.touch(key, tenant=r.tenant)
            elif with_data:
                data = key[:1] * chunk_bytes
                store.put(key, data, tokens=tokens, tenant=r.tenant, parent=parent, depth=depth)
            else:
                store.put(key, None, size_bytes=1, tokens=tokens, tenant=r.tenant,
                          parent=parent, depth=depth)  # fmt: skip
            parent = key
    return matched


@pytest.mark.parametrize("policy", list(EVICTION_POLICIES))
@pytest.mark.parametrize(
    ("workload", "bypass"), [("builtin", False), ("builtin", True), ("system-prompt", True)]
)
def test_simulator_and_a_store_over_real_bytes_make_the_same_decisions(
    policy: str, workload: str, bypass: bool
) -> None:
    # system-prompt's long prompts outgrow the cache: its deep blocks are turned away
    requests = generate(workload, 4, requests=120)
    unique = len({b for r in requests for b in r.block_ids})
    cap = capacity_from_fraction(unique, 0.05)
    chunk_bytes = 64
    sim_matched: list[int] = []
    result = simulate_policy(
        requests,
        tiers={"cpu": cap},
        policy=policy,
        on_request=lambda i, tiers: sim_matched.append(len(tiers)),
        bypass_unreachable=bypass,
    )
    metered = TieredStore(
        [MeteredTier("cpu", cap)], eviction=policy, clock=lambda: 0.0, bypass_unreachable=bypass
    )
    live = TieredStore(
        [CpuTier(cap * chunk_bytes)],
        eviction=policy,
        chunk_bytes=chunk_bytes,
        clock=lambda: 0.0,
        bypass_unreachable=bypass,
    )
    try:
        gone_metered = evicted_keys(metered)
        gone_live = evicted_keys(live)
        assert _replay(metered, requests, chunk_bytes, with_data=False) == sim_matched
        assert _replay(live, requests, chunk_bytes, with_data=True) == sim_matched
        assert sum(sim_matched) == result.hit_blocks
        assert len(gone_live) == result.evictions > 0
        assert gone_live == gone_metered  # the same chunks, in the same order
    finally:
        live.close()


def test_leads_lineage_lru2_on_the_whole_shared_trace_at_10_percent(shared_trace) -> None:  # type: ignore[no-untyped-def]
    """The measured claim (lineage-arc 27.85% of blocks against 26.79% for lineage-lru2, 55.0%
    and 52.9% of Belady). The whole trace: on its first 2,000 requests lineage-lru2 still leads
    (8.81% against 8.35%), as ARC's split needs ghost hits to move."""
    requests = read_mooncake_trace(shared_trace)
    cap = capacity_from_fraction(len({b for r in requests for b in r.block_ids}), 0.1)
    arc = simulate_policy(requests, tiers={"cpu": cap}, policy="lineage-arc").hit_ratio
    lru2 = simulate_policy(requests, tiers={"cpu": cap}, policy="lineage-lru2").hit_ratio
    assert arc > lru2 + 0.005
