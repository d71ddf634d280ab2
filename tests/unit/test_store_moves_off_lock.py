"""Operator moves that touch the disk without the store's lock: a move up from disk (``move``,
``prefetch``, ``pin --tier cpu``) reads the file without it, a ``pin --tier disk`` writes it
without it, and a pinned put landing on disk writes its file without it. Meanwhile reads and
lookups of other chunks complete; a chunk evicted, brought up or damaged meanwhile ends as
such; pins land where asked.

The tiers are real ones whose disk I/O waits at a gate (GatedDisk: reads; SlowDisk: writes);
every wait is bounded, so a regression (the I/O under the lock) fails instead of hanging."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.store.errors import CapacityError, CorruptChunk, TierUnavailable
from kvctl.store.store import BulkResult, TieredStore
from kvctl.store.tiers.base import Buffer, ChunkMeta, ReadPlan
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.metered import MeteredTier
from tests.unit import test_store_detached_demotions as writes
from tests.unit.test_store_parallel_reads import (
    CHUNK,
    Background,
    GatedDisk,
    check_invariants,
    data_of,
    key,
    make_store,
    put_in,
)


def _read(store: TieredStore, k: bytes) -> bytes:
    out = bytearray(CHUNK)
    n = store.read_into(k, memoryview(out))
    return bytes(out[:n])


def _held_up_read(
    tmp_path: Path, op: Callable[[TieredStore, list[bytes]], BulkResult]
) -> tuple[TieredStore, list[bytes], list[bytes], Background]:
    """A store with chunks on disk and in cpu, and ``op`` on the disk ones running in another
    thread, its first disk read held at the gate."""
    store, _cpu, disk = make_store(tmp_path)
    on_disk = [key(i) for i in range(3)]
    in_cpu = [key(i) for i in range(10, 13)]
    put_in(store, on_disk, "disk")
    put_in(store, in_cpu, "cpu")
    disk.gate.clear()
    running = Background(lambda: op(store, on_disk))
    assert disk.wait_inside(1), "the move never reached its read"
    return store, on_disk, in_cpu, running


OPS: dict[str, Callable[[TieredStore, list[bytes]], BulkResult]] = {
    "move": lambda store, keys: store.move(keys, "cpu"),
    "prefetch": lambda store, keys: store.prefetch(keys),
    "pin": lambda store, keys: store.pin(keys, tier="cpu"),
}


@pytest.mark.parametrize("op", OPS, ids=list(OPS))
def test_a_move_up_from_disk_reads_without_the_lock(tmp_path: Path, op: str) -> None:
    store, on_disk, in_cpu, running = _held_up_read(tmp_path, OPS[op])
    # the store's lock is free while the file is read: others read, look up and put
    assert Background(lambda: _read(store, in_cpu[0])).result() == data_of(in_cpu[0])
    assert Background(lambda: store.lookup(in_cpu)).result().matched_chunks == 3
    assert Background(lambda: store.put(key(20), data_of(key(20)))).result() == "cpu"
    store.tier("disk").gate.set()  # type: ignore[attr-defined]
    result = running.result()
    assert (result.done, result.missing, result.failed) == (3, 0, 0)
    assert store.locate(on_disk) == ["cpu"] * 3
    assert all(store.entry(k).pinned == (op == "pin") for k in on_disk)
    assert all(_read(store, k) == data_of(k) for k in on_disk)
    assert store.stats.tiers["disk"].bytes_read >= 3 * CHUNK  # the reads are counted
    store.unpin(on_disk)
    check_invariants(store)


def test_a_chunk_evicted_while_its_move_up_reads_is_missing(tmp_path: Path) -> None:
    store, on_disk, _in_cpu, running = _held_up_read(tmp_path, OPS["move"])
    assert store.evict(on_disk[:1]).done == 1  # the one being read
    store.tier("disk").gate.set()  # type: ignore[attr-defined]
    result = running.result()
    assert (result.done, result.missing, result.failed) == (2, 1, 0)
    assert store.locate(on_disk) == [None, "cpu", "cpu"]
    check_invariants(store)


def test_a_chunk_brought_up_while_its_move_up_reads_is_done(tmp_path: Path) -> None:
    store, on_disk, _in_cpu, running = _held_up_read(tmp_path, OPS["prefetch"])
    # an ungated read promotes it first (as an engine's read would)
    assert store.tier("disk").ungated(lambda: _read(store, on_disk[0])) == data_of(on_disk[0])  # type: ignore[attr-defined]
    store.tier("disk").gate.set()  # type: ignore[attr-defined]
    assert running.result().done == 3
    assert store.locate(on_disk) == ["cpu"] * 3
    check_invariants(store)


def test_a_damaged_file_read_by_a_move_up_is_dropped_not_moved(tmp_path: Path) -> None:
    store, _cpu, disk = make_store(tmp_path)
    keys = [key(i) for i in range(2)]
    put_in(store, keys, "disk")
    path = disk._path(keys[0])
    with open(path, "r+b") as f:  # one payload byte flipped: the checksum fails
        f.seek(os.path.getsize(path) - 1)
        last = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([last[0] ^ 0xFF]))
    result = store.move(keys, "cpu")
    assert (result.done, result.missing, result.failed) == (1, 1, 0)
    assert store.locate(keys) == [None, "cpu"]
    assert store.stats.corrupt_dropped == 1
    check_invariants(store)


def test_a_pin_to_disk_writes_without_the_lock(tmp_path: Path) -> None:
    store, _cpu, disk, keys = writes.full_store(tmp_path)
    disk.gate.clear()
    pin = Background(lambda: store.pin(keys[:2], tier="disk"))
    assert disk.wait_inside(), "the pin never reached its write"
    assert Background(lambda: writes.read(store, keys[3])).result() == writes.data_of(keys[3])
    assert Background(lambda: store.lookup(keys, tenant="t")).result().matched_chunks == 4
    disk.gate.set()
    result = pin.result()
    assert (result.done, result.missing, result.failed) == (2, 0, 0)
    assert [store.entry(k).tier for k in keys[:2]] == ["disk", "disk"]
    assert all(store.entry(k).pinned for k in keys[:2])
    assert store.flush("disk").skipped_pinned == 2  # pinned where they went
    store.unpin(keys[:2])
    writes.check_invariants(store)


def test_a_pin_beyond_the_tier_is_refused_before_anything_moves(tmp_path: Path) -> None:
    store, _cpu, _disk = make_store(tmp_path, cpu=2 * CHUNK)
    keys = [key(i) for i in range(3)]
    put_in(store, keys, "disk")
    with pytest.raises(CapacityError, match="exceeds its capacity"):
        store.pin(keys, tier="cpu")
    assert store.locate(keys) == ["disk"] * 3 and not any(store.entry(k).pinned for k in keys)
    check_invariants(store)


def test_a_pinned_put_to_disk_writes_without_the_lock(tmp_path: Path) -> None:
    store, _cpu, disk, keys = writes.full_store(tmp_path)
    disk.gate.clear()
    new = key(9)
    put = Background(
        lambda: store.put(new, writes.data_of(new), tenant="t", tier="disk", pinned=True)
    )
    assert disk.wait_inside(), "the put never reached its write"
    assert Background(lambda: writes.read(store, keys[0])).result() == writes.data_of(keys[0])
    assert new not in store  # not stored until its file is in place
    disk.gate.set()
    assert put.result() == "disk"
    assert store.entry(new).tier == "disk" and store.entry(new).pinned
    assert store.evict([new]).skipped_pinned == 1
    store.unpin([new])
    writes.check_invariants(store)


class _FailingReads(GatedDisk):
    """A disk whose reads of ``failing`` raise as a disk that cannot open the file does."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        super().__init__(directory, capacity_bytes)
        self.failing: set[bytes] = set()

    def read_planned(self, plan: ReadPlan, out: memoryview) -> str | None:
        if plan.key in self.failing:
            raise TierUnavailable(f"disk tier {self.name!r}: Too many open files (test)")
        return super().read_planned(plan, out)


@pytest.mark.parametrize("op", ["move", "prefetch"])
def test_a_move_up_whose_read_fails_counts_that_chunk_failed_and_moves_the_rest(
    tmp_path: Path, op: str
) -> None:
    """Found by review: the read's error escaped and the rest of the batch was never moved
    (under the lock, it had been counted failed)."""
    disk = _FailingReads(tmp_path / "disk", 64 * CHUNK)
    store = TieredStore([CpuTier(32 * CHUNK), disk], chunk_tokens=4)
    keys = [key(i) for i in range(3)]
    put_in(store, keys, "disk")
    disk.failing.add(keys[0])
    result = OPS[op](store, keys)
    assert (result.done, result.failed, result.missing) == (2, 1, 0)
    assert store.locate(keys) == ["disk", "cpu", "cpu"]
    disk.failing.clear()
    check_invariants(store)  # the failed one is back in its tier's policy, readable


class _DeviceTier(MeteredTier):
    """A tier above cpu that holds bytes but no leases (as the gpu tier: its chunks cannot be
    read in place by another thread); counts its reads, which the store makes under its lock."""

    holds_payload = True

    def __init__(self, name: str, capacity_bytes: int) -> None:
        super().__init__(name, capacity_bytes)
        self._bytes: dict[bytes, bytes] = {}
        self.reads = 0

    def put(self, meta: ChunkMeta, data: Buffer | None) -> None:
        super().put(meta, data)
        assert data is not None
        self._bytes[meta.key] = bytes(data)

    def read_into(self, key: bytes, out: memoryview) -> int:
        data = self._bytes[key]
        out[: len(data)] = data
        self.reads += 1
        return len(data)

    def delete(self, key: bytes) -> int:
        self._bytes.pop(key, None)
        return super().delete(key)


def _three_tiers(tmp_path: Path) -> tuple[TieredStore, _DeviceTier, writes.SlowDisk]:
    device = _DeviceTier("gpu", 8 * writes.CHUNK)
    cpu = CpuTier(4 * writes.CHUNK)
    disk = writes.SlowDisk(tmp_path / "disk", 64 * writes.CHUNK)
    return TieredStore([device, cpu, disk], chunk_tokens=4, eviction="lru"), device, disk


def test_a_move_from_a_device_tier_to_disk_writes_without_the_lock(tmp_path: Path) -> None:
    """A move across two tiers (gpu to disk) was made whole under the lock, its disk write
    included: the chunk is copied to host memory under it, and written without it."""
    store, device, disk = _three_tiers(tmp_path)
    keys = [writes.key(i) for i in range(4)]
    for k in keys:
        assert store.put(k, writes.data_of(k), tenant="t") == "gpu"
    seen = writes.events_of(store)
    disk.gate.clear()
    move = Background(lambda: store.move(keys[:2], "disk"))
    assert disk.wait_inside(), "the move never reached its write"
    # the lock is free while the file is written: the chunk is still readable where it was
    assert Background(lambda: writes.read(store, keys[0])).result() == writes.data_of(keys[0])
    assert Background(lambda: store.lookup(keys, tenant="t")).result().matched_chunks == 4
    new = writes.key(9)
    assert Background(lambda: store.put(new, writes.data_of(new), tenant="t")).result() == "gpu"
    disk.gate.set()
    result = move.result()
    assert (result.done, result.failed, result.missing) == (2, 0, 0)
    assert store.locate(keys) == ["disk", "disk", "gpu", "gpu"]
    assert [ev["type"] for ev in seen] == ["store", "move", "move"]  # the put landed first
    assert store.stats.tiers["gpu"].bytes_read >= 2 * writes.CHUNK
    assert device.reads >= 3  # the two copies the move wrote, and the read meanwhile
    assert all(writes.read(store, k) == writes.data_of(k) for k in keys)


def test_a_device_chunk_evicted_or_pinned_while_its_move_is_written_ends_as_such(
    tmp_path: Path,
) -> None:
    store, device, disk = _three_tiers(tmp_path)
    keys = [writes.key(i) for i in range(3)]
    for k in keys:
        assert store.put(k, writes.data_of(k), tenant="t") == "gpu"
    disk.gate.clear()
    move = Background(lambda: store.move(keys[:2], "disk"))
    assert disk.wait_inside()
    assert Background(lambda: store.evict([keys[0]])).result().done == 1
    disk.gate.set()
    first = move.result()
    assert (first.done, first.missing) == (1, 1)  # the other went on once the gate opened
    assert keys[0] not in store and store.entry(keys[1]).tier == "disk"
    disk.gate.clear()
    move = Background(lambda: store.move([keys[2]], "disk"))
    assert disk.wait_inside()
    assert Background(lambda: store.pin([keys[2]])).result().done == 1
    disk.gate.set()
    assert (move.result().done, move.result().failed) == (0, 1)
    assert store.entry(keys[2]).tier == "gpu" and store.entry(keys[2]).pinned
    assert writes.read(store, keys[2]) == writes.data_of(keys[2])
    store.unpin([keys[2]])
    assert writes.files_on(disk) == {keys[1].hex()}  # no stray file of the evicted one
    assert device.used_bytes == writes.CHUNK


def test_a_device_chunk_found_corrupt_by_its_move_is_dropped_and_counted_missing(
    tmp_path: Path,
) -> None:
    """Found in review: a gpu tier whose copy fails drops the chunk and raises CorruptChunk; the
    move went on to ``_move``, whose second read raised KeyNotFound out of ``move`` and left the
    index naming a chunk the tier no longer held."""
    store, device, _disk = _three_tiers(tmp_path)
    keys = [writes.key(i) for i in range(2)]
    for k in keys:
        assert store.put(k, writes.data_of(k), tenant="t") == "gpu"
    lost = keys[0]

    def corrupt(key: bytes, out: memoryview) -> int:
        if key == lost:
            device.delete(key)
            raise CorruptChunk(f"chunk {key.hex()} lost in a failed device copy (test)")
        return _DeviceTier.read_into(device, key, out)

    device.read_into = corrupt  # type: ignore[method-assign]
    result = store.move(keys, "disk")
    assert (result.done, result.missing, result.failed) == (1, 1, 0)
    assert lost not in store and store.entry(keys[1]).tier == "disk"
    assert store.stats.corrupt_dropped == 1
    assert writes.read(store, keys[1]) == writes.data_of(keys[1])
