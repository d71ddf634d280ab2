"""A tier holds at most one chunk per MIN_CHARGED_BYTES of its capacity (MIN_CHUNK_SLOTS at
least), so the agent's memory for its index is bounded by its configured capacities. Before,
only payload bytes counted: a 64 MiB tier could hold 64 M one-byte chunks at ~1-3 KiB of index
memory each (reviewer's exp4_tiny_chunks.py: ~3 KiB of agent RSS per one-byte chunk)."""

from __future__ import annotations

import gc
import os
import tracemalloc
from pathlib import Path

import pytest

from kvctl.store.errors import CapacityError
from kvctl.store.index import MAX_TENANT_BYTES
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import MIN_CHARGED_BYTES, MIN_CHUNK_SLOTS, chunk_limit
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from kvctl.store.tiers.metered import MeteredTier

MIB = 1 << 20


def long_tenant(i: int) -> str:
    """A tenant name at the cap, a new one per chunk (as each frame decodes its own)."""
    return f"{i:08d}".ljust(MAX_TENANT_BYTES, "T")


def test_the_limit_is_one_chunk_per_min_charged_bytes_and_never_below_the_floor() -> None:
    assert MIN_CHARGED_BYTES == 4096 and MIN_CHUNK_SLOTS == 1024
    assert chunk_limit(64 * MIB) == 16384
    assert chunk_limit(1000) == chunk_limit(0) == MIN_CHUNK_SLOTS
    assert CpuTier(16 * MIB).max_chunks() == 4096
    assert CpuTier(16 * MIB).max_chunks(8 * MIB) == 2048
    assert MeteredTier("cpu", 10**9).max_chunks() is None  # the simulator's blocks


def test_tiny_chunks_under_long_tenant_names_stay_within_the_tiers_index_memory() -> None:
    """Three times the limit of one-byte chunks, each under its own 256-byte tenant name: the
    tier keeps the newest 4096 (evicting by its policy, as for bytes), and the memory the
    store holds stops growing once it is full."""
    store = TieredStore([CpuTier(16 * MIB)])
    limit = 4096
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held: list[int] = []
        keys: list[bytes] = []
        for i in range(3 * limit):
            k = os.urandom(16)
            keys.append(k)
            assert store.put(k, b"x", tenant=long_tenant(i)) == "cpu"
            if (i + 1) % limit == 0:
                gc.collect()
                held.append(tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert len(store) == limit
    assert store.locate(keys[-limit:]) == ["cpu"] * limit  # the newest stayed
    usage = store.usage()["cpu"]
    assert (usage["chunks"], usage["used_bytes"]) == (limit, limit)  # used_bytes: payload
    assert store.stats.tiers["cpu"].evictions["capacity"] == 2 * limit
    # full after the first third: the rest costs little more (dict slots, policy lists)
    # where, unbounded, each third added as much again
    assert held[2] < 1.25 * held[0], held
    assert held[2] - held[1] < 0.05 * held[0], held


def test_a_full_tier_demotes_its_chunks_and_the_next_tier_keeps_to_its_limit_too(
    tmp_path: Path,
) -> None:
    store = TieredStore([CpuTier(4 * MIB), DiskTier(tmp_path / "disk", 4 * MIB)])
    n = 3000
    for i in range(n):
        store.put(os.urandom(16), b"x", tenant=long_tenant(i))
    usage = store.usage()
    assert usage["cpu"]["chunks"] == 1024 and usage["disk"]["chunks"] == 1024
    assert len(store) == 2048
    stats = store.stats.tiers
    assert stats["disk"].demotions == n - 1024
    assert stats["disk"].evictions["capacity"] == n - 2048


def test_a_tier_full_of_pinned_chunks_refuses_a_new_one_saying_why() -> None:
    store = TieredStore([CpuTier(MIB)])  # 1 MiB: the floor, 1024 chunks
    for i in range(MIN_CHUNK_SLOTS):
        store.put(i.to_bytes(16, "big"), b"x", pinned=True)
    with pytest.raises(CapacityError, match=r"holds its most chunks \(1024, one per 4096 bytes"):
        store.put(os.urandom(16), b"x")
    assert len(store) == MIN_CHUNK_SLOTS
    assert store.usage()["cpu"]["used_bytes"] == MIN_CHUNK_SLOTS  # bytes to spare


def test_a_resize_evicts_down_to_the_new_capacitys_limit() -> None:
    store = TieredStore([CpuTier(16 * MIB)])
    for _ in range(4096):
        store.put(os.urandom(16), b"x")
    store.resize("cpu", 8 * MIB)
    assert len(store) == 2048
    assert store.stats.tiers["cpu"].evictions["resize"] == 2048


def test_a_disk_tier_reopened_over_its_limit_is_trimmed_at_start(tmp_path: Path) -> None:
    """Files an agent kept under a larger --disk (or before the limit) are evicted down to
    the limit when the store opens, as bytes over a smaller capacity are."""
    store = TieredStore([DiskTier(tmp_path / "disk", 16 * MIB)])
    for i in range(2000):
        store.put(i.to_bytes(16, "big"), b"x")
    assert len(store) == 2000
    store.close()
    store = TieredStore([DiskTier(tmp_path / "disk", 4 * MIB)])
    assert len(store) == 1024
    assert store.usage()["disk"]["chunks"] == 1024
    assert store.stats.tiers["disk"].evictions["resize"] == 2000 - 1024
    store.close()


def test_chunks_of_min_charged_bytes_or_more_never_meet_the_limit() -> None:
    store = TieredStore([CpuTier(8 * MIB)])
    for _ in range(3000):
        store.put(os.urandom(16), bytes(MIN_CHARGED_BYTES))
    assert len(store) == 2048  # 8 MiB of them: the bytes bound first
    assert store.stats.tiers["cpu"].evictions["capacity"] == 3000 - 2048


def test_a_size_only_tier_has_no_chunk_limit() -> None:
    """The simulator counts capacities in one-byte blocks (kvctl.workload.simulate)."""
    store = TieredStore([MeteredTier("cpu", 5000)])
    for i in range(5000):
        store.put(i.to_bytes(16, "big"), None, size_bytes=1)
    assert len(store) == 5000


def test_lineage_adaptive_shadow_caches_keep_to_the_tiers_limit() -> None:
    """``lineage-adaptive`` (the agent's default) replays every access in a shadow cache per
    candidate, sized in bytes as the tier was when it first filled: after 4 KiB chunks, each
    shadow took 8 MiB of one-byte chunks, ~2.8 KiB of memory a put while the tier held 2048.
    Now each shadow keeps to the tier's most chunks too, and follows a resize."""
    store = TieredStore([CpuTier(8 * MIB)], eviction="lineage-adaptive")
    policy = store._policies["cpu"]
    for _ in range(2100):  # fills it in bytes: the policy learns 8 MiB as its capacity
        store.put(os.urandom(16), bytes(MIN_CHARGED_BYTES))

    def shadow_sizes() -> list[int]:
        return [len(s.entries) for s in policy._shadows]  # type: ignore[attr-defined]

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held: list[int] = []
        for i in range(18_000):
            store.put(os.urandom(16), b"x")
            if (i + 1) % 6000 == 0:
                gc.collect()
                held.append(tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert len(store) == 2048
    assert max(shadow_sizes()) <= 2048, shadow_sizes()
    # flat but for dicts' resizing (x1.3 here), where unbounded each 6000 puts added ~17 MB
    assert held[2] < 1.6 * held[0], held
    store.resize("cpu", 4 * MIB)
    assert len(store) == 1024
    assert max(shadow_sizes()) <= 1024, shadow_sizes()
