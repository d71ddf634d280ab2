from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.errors import InvalidArgument
from kvctl.store.errors import CapacityError, KeyNotFound, PayloadSizeError
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.cpu import ArenaAllocator, CpuTier


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def put(tier: CpuTier, i: int, n: int) -> bytes:
    data = bytes([i % 256]) * n
    tier.put(ChunkMeta(k(i), n), data)
    return data


def test_round_trip_and_capacity_to_the_byte() -> None:
    t = CpuTier(1000)
    put(t, 1, 600)
    put(t, 2, 400)  # exactly full
    assert t.used_bytes == 1000 and t.free_bytes == 0
    with pytest.raises(CapacityError):
        put(t, 3, 1)
    assert t.get(k(1)) == bytes([1]) * 600
    assert t.get(k(2)) == bytes([2]) * 400
    assert len(t) == 2


def test_refused_puts_change_nothing() -> None:
    t = CpuTier(100)
    put(t, 1, 50)
    with pytest.raises(PayloadSizeError):
        t.put(ChunkMeta(k(2), 10), b"x" * 9)
    with pytest.raises(InvalidArgument, match="already"):
        put(t, 1, 50)
    with pytest.raises(InvalidArgument, match="positive"):
        t.put(ChunkMeta(k(3), 0), b"")
    assert t.used_bytes == 50 and len(t) == 1 and t.get(k(1)) == bytes([1]) * 50


def test_fragmentation_is_compacted_instead_of_refusing() -> None:
    t = CpuTier(400)
    for i in range(4):
        put(t, i, 100)
    t.delete(k(0))
    t.delete(k(2))  # 200 bytes free in two 100-byte holes
    data = put(t, 9, 200)
    assert t.compactions == 1
    assert t.get(k(9)) == data
    assert t.get(k(1)) == bytes([1]) * 100 and t.get(k(3)) == bytes([3]) * 100


def test_resize_grows_and_shrinks_keeping_bytes() -> None:
    t = CpuTier(300)
    put(t, 1, 100)
    put(t, 2, 100)
    t.delete(k(1))
    t.resize(150)  # compacts the survivor into the smaller arena
    assert t.capacity_bytes == 150 and t.get(k(2)) == bytes([2]) * 100
    with pytest.raises(CapacityError):
        t.resize(99)
    t.resize(10_000)
    put(t, 3, 5000)
    assert t.get(k(2)) == bytes([2]) * 100


def test_unknown_key_small_buffer_and_close() -> None:
    t = CpuTier(100)
    with pytest.raises(KeyNotFound):
        t.get(k(1))
    put(t, 1, 10)
    with pytest.raises(InvalidArgument, match="smaller"):
        t.read_into(k(1), memoryview(bytearray(5)))
    t.close()
    from kvctl.store.errors import TierUnavailable

    with pytest.raises(TierUnavailable):
        t.get(k(1))


def test_allocator_coalesces_neighbours() -> None:
    a = ArenaAllocator(300)
    offs = [a.alloc(100) for _ in range(3)]
    assert offs == [0, 100, 200] and a.alloc(1) is None
    a.free(0, 100)
    a.free(200, 100)
    assert a.holes == 2
    a.free(100, 100)
    assert a.holes == 1 and a.largest_hole_bytes == 300


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(1, 300)), max_size=80))
def test_random_puts_and_deletes_match_a_dict(ops: list[tuple[bool, int, int]]) -> None:
    t = CpuTier(1024)
    model: dict[bytes, bytes] = {}
    rng = random.Random(0)
    for is_put, i, n in ops:
        key = k(i)
        if is_put and key not in model and n <= t.free_bytes:
            data = rng.randbytes(n)
            t.put(ChunkMeta(key, n), data)
            model[key] = data
        elif not is_put and key in model:
            assert t.delete(key) == len(model.pop(key))
    assert t.used_bytes == sum(map(len, model.values()))
    for key, data in model.items():
        assert t.get(key) == data


def test_resize_beyond_what_can_be_mapped_is_a_capacity_error_and_keeps_the_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvctl.store.tiers import memroom

    tier = CpuTier(1024)
    tier.put(ChunkMeta(b"k" * 16, 100), b"x" * 100)
    # the host's memory refuses it before any mapping is tried
    with pytest.raises(CapacityError, match=r"cannot reserve .* keeps its capacity of 1 KiB"):
        tier.resize(2**62)
    # where the room cannot be read (not Linux), the mapping itself fails
    monkeypatch.setattr(memroom, "MEMINFO", tmp_path / "no-meminfo")
    monkeypatch.setattr(memroom, "CGROUP_ROOT", tmp_path / "no-cgroups")
    monkeypatch.setattr(memroom, "SELF_CGROUP", tmp_path / "no-self-cgroup")
    with pytest.raises(CapacityError, match="cannot map"):
        tier.resize(2**62)  # more address space than a process gets: mmap fails
    assert tier.capacity_bytes == 1024
    out = bytearray(100)
    assert tier.read_into(b"k" * 16, memoryview(out)) == 100 and out == b"x" * 100


@pytest.mark.parametrize("n", [1000, 5 << 20])  # one plain copy; one split over threads
def test_read_into_fills_any_writable_buffer_in_place(n: int) -> None:
    tier = CpuTier(8 << 20)
    data = put(tier, 1, n)
    for out in (bytearray(n + 5), memoryview(bytearray(n))):
        assert tier.read_into(k(1), out) == n  # type: ignore[arg-type]
        assert bytes(out[:n]) == data
