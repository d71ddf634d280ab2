"""``bypass_unreachable``: a chunk deeper in its chain than every tier together can hold is not
stored (a lookup matches a chunk only after all chunks before it, so it could never be matched,
and storing it would evict chunks that can be); everything else is stored as before."""

from __future__ import annotations

import random
from pathlib import Path

from kvctl.store.index import Entry
from kvctl.store.policies.lru import LineageLRUPolicy
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from kvctl.workload.simulate import simulate, simulate_policy
from kvctl.workload.trace import TraceRequest

CHUNK = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def put_chain(store: TieredStore, first: int, n: int, **kw: object) -> list[str | None]:
    """Chunks ``first .. first + n - 1`` as one chain: where each landed (None: not stored)."""
    where: list[str | None] = []
    parent = None
    for depth in range(n):
        k = key(first + depth)
        where.append(
            store.put(k, bytes(CHUNK), tenant="t", parent=parent, depth=depth, **kw)  # type: ignore[arg-type]
        )
        parent = k
    return where


def test_a_chain_deeper_than_the_tier_stores_what_a_lookup_can_reach_and_no_more() -> None:
    store = TieredStore([CpuTier(4 * CHUNK)], bypass_unreachable=True)
    assert put_chain(store, 100, 1) == ["cpu"]  # another chain's chunk
    assert put_chain(store, 0, 3) == ["cpu"] * 3  # fills the tier: 4 chunks
    before = {k: store.entry(k).tier for k in (key(100), key(0), key(1), key(2))}
    bypassed = store.stats.bypassed_puts
    # a chain of 7: its chunks at depth 4 to 6 need 5 to 7 chunks of room, the tier has 4
    where = put_chain(store, 0, 7)
    assert where[:3] == ["cpu"] * 3 and where[4:] == [None] * 3
    assert store.stats.bypassed_puts == bypassed + 3
    assert store.stats.unreachable_puts == 3  # the rule's own count, apart from policies'
    assert all(key(i) not in store for i in range(4, 7))
    # only the chunk at depth 3 (the tier's 4th) could be stored, and it took one place
    assert where[3] == "cpu" and store.stats.tiers["cpu"].evictions["capacity"] == 1
    assert store.lookup([key(i) for i in range(7)], tenant="t").matched_chunks == 4
    assert sum(k in store for k in before) == 3


def test_without_the_setting_every_chunk_is_stored() -> None:
    store = TieredStore([CpuTier(4 * CHUNK)])  # the store's default: off
    assert put_chain(store, 0, 7) == ["cpu"] * 7
    assert store.stats.bypassed_puts == store.stats.unreachable_puts == 0
    # the tail (stored, never to be matched) pushed the chain's middle out: a lookup from its
    # first chunk matches 1 chunk, against 4 with the setting
    assert store.lookup([key(i) for i in range(7)], tenant="t").matched_chunks == 1


def test_every_tier_counts_and_a_pin_or_a_chunk_of_unknown_depth_is_always_stored(
    tmp_path: Path,
) -> None:
    store = TieredStore(
        [CpuTier(2 * CHUNK), DiskTier(tmp_path / "disk", 4 * CHUNK)], bypass_unreachable=True
    )
    # 2 + 4 chunks of room: depth 5 is the deepest a lookup can reach across both tiers
    assert put_chain(store, 0, 7) == ["cpu"] * 6 + [None]
    assert store.lookup([key(i) for i in range(7)], tenant="t").matched_chunks == 6
    # a pin asks for the chunk whatever it costs
    assert store.put(key(50), bytes(CHUNK), parent=key(5), depth=6, pinned=True) == "cpu"
    # a caller that does not say the depth (0) is never second-guessed
    assert store.put(key(60), bytes(CHUNK), parent=key(50)) is not None


def test_a_store_grown_by_a_resize_reaches_deeper() -> None:
    store = TieredStore([CpuTier(2 * CHUNK)], bypass_unreachable=True)
    assert put_chain(store, 0, 3) == ["cpu", "cpu", None]
    store.resize("cpu", 3 * CHUNK)
    assert put_chain(store, 0, 3)[2] == "cpu"


def _random_trace(seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1 << 30) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    out = []
    for i in range(300):
        blocks = [*rng.choice(prefixes)][: rng.randint(1, 12)]
        blocks += [rng.randrange(1 << 30) for _ in range(rng.randint(0, 4))]
        out.append(
            TraceRequest(
                timestamp_ms=i,
                input_tokens=len(blocks) * 16,
                output_tokens=1,
                block_ids=tuple(blocks),
                block_tokens=16,
            )
        )
    return out


def test_no_block_at_a_depth_past_the_capacity_is_ever_a_hit_so_bypassing_it_loses_none() -> None:
    """The premise, on random traces and every policy: a lookup from a request's first block
    never matches a block at depth >= the capacity in blocks, whatever is kept."""
    for seed in range(3):
        trace = _random_trace(seed)
        for cap in (2, 5, 9):
            for policy in ("lru", "lineage-lru", "lineage-adaptive"):
                matched: list[int] = []
                simulate_policy(
                    trace,
                    tiers={"cpu": cap},
                    policy=policy,
                    on_request=lambda _i, hits, seen=matched: seen.append(len(hits)),
                    bypass_unreachable=False,
                )
                assert 0 < max(matched) <= cap


def test_system_prompt_keeps_its_short_prompts_when_long_tails_are_turned_away() -> None:
    from kvctl.workload.generators import generate

    trace = generate("system-prompt", 0)
    kept = simulate(trace, tiers={"cpu": 25}, policies=["lineage-lru"], bypass_unreachable=False)
    turned = simulate(trace, tiers={"cpu": 25}, policies=["lineage-lru"])
    assert turned.bypass_unreachable and not kept.bypass_unreachable
    assert turned.as_dict()["bypass_unreachable"] is True
    # measured: 2.41% of blocks kept against 7.20% turned away (the 50k and 100k-token prompts'
    # tails no longer flush the 1k-10k ones); Belady already turns them away itself
    assert turned.result("lineage-lru").hit_blocks > 2 * kept.result("lineage-lru").hit_blocks
    assert turned.result("belady").hit_blocks == kept.result("belady").hit_blocks


class _Declining(LineageLRUPolicy):
    """A policy that declines every newcomer on a full tier (as Belady's bypass does)."""

    def admit(self, entry: Entry, now_s: float) -> bool:
        return False


def test_a_policys_decline_is_bypassed_but_not_counted_as_unreachable() -> None:
    store = TieredStore([CpuTier(2 * CHUNK)], eviction={"cpu": _Declining()})
    assert put_chain(store, 0, 2) == ["cpu", "cpu"]  # room for both
    assert put_chain(store, 10, 1) == [None]  # a full tier: the policy declines
    assert store.stats.bypassed_puts == 1 and store.stats.unreachable_puts == 0
    assert store.stats.as_dict()["unreachable_puts"] == 0
