"""Demotions written without the store's lock: a put that makes room in the cpu arena begins its
victims' demotions under the lock (room taken on disk, the victim held in place by a lease and
still readable), writes their files without the lock, then commits them. Meanwhile other
threads read, lease, look up and put; a victim evicted, pinned or moved meanwhile, a write that
fails, or the store closing, never leaves a corrupt or missing index entry, a stray file or
reserved room behind.

The disk tier is a real DiskTier whose writes (detached or not) wait at a gate, so a test holds a
demotion mid-write and acts meanwhile. Every wait is bounded: a regression (the write held
under the lock) fails instead of hanging."""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.store.errors import CapacityError, DiskFullError, TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import Buffer, ChunkMeta, WriteSlot
from kvctl.store.tiers.cpu import CpuTier, Lease
from kvctl.store.tiers.disk import DiskTier, audit_directory
from tests.unit.test_store_parallel_reads import Background

#: bound on every wait for another thread: reached only when something is broken
WAIT_S = 30.0
CHUNK = 4096


class SlowDisk(DiskTier):
    """A real disk tier whose chunk writes wait while ``gate`` is clear: the detached ones
    (``write_reserved``) and a plain ``put`` alike, so a store that still wrote under its
    lock would be held at the gate with its lock. ``fail`` makes the next writes fail as a full
    disk does."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        super().__init__(directory, capacity_bytes)
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        #: reserving a detached write raises TierUnavailable (a device that went away)
        self.broken = False
        self._cv = threading.Condition()
        self.inside = 0

    def _held(self) -> None:
        with self._cv:
            self.inside += 1
            self._cv.notify_all()
        try:
            if not self.gate.wait(WAIT_S):
                raise AssertionError("the test never opened the gate")
        finally:
            with self._cv:
                self.inside -= 1
        if self.fail:
            raise DiskFullError(28, f"disk tier {self.name!r} is out of space (test)")

    def put(self, meta: ChunkMeta, data: Buffer | None) -> None:
        if meta.key not in self._writing:  # (a new copy of a key being demoted goes at once)
            self._held()
        super().put(meta, data)

    def write_reserved(self, slot: WriteSlot, data: Buffer) -> None:
        self._held()
        super().write_reserved(slot, data)

    def reserve_write(self, meta: ChunkMeta) -> WriteSlot:
        if self.broken:
            raise TierUnavailable(f"tier {self.name!r}: device gone (test)")
        return super().reserve_write(meta)

    def wait_inside(self, n: int = 1) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self.inside >= n, WAIT_S)


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def data_of(k: bytes) -> bytes:
    return random.Random(k).randbytes(CHUNK)


def make_store(
    tmp_path: Path, cpu_chunks: int = 4, disk_chunks: int = 64
) -> tuple[TieredStore, CpuTier, SlowDisk]:
    cpu = CpuTier(cpu_chunks * CHUNK)
    disk = SlowDisk(tmp_path / "disk", disk_chunks * CHUNK)
    return TieredStore([cpu, disk], chunk_tokens=4, eviction="lru"), cpu, disk


def full_store(tmp_path: Path) -> tuple[TieredStore, CpuTier, SlowDisk, list[bytes]]:
    """A store whose cpu arena is full of four chunks, key(0) the least recently used."""
    store, cpu, disk = make_store(tmp_path)
    keys = [key(i) for i in range(4)]
    for k in keys:
        assert store.put(k, data_of(k), tenant="t") == "cpu"
    assert cpu.free_bytes == 0
    return store, cpu, disk, keys


def events_of(store: TieredStore) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    store.subscribe(seen.append)
    return seen


def held_demotion(
    tmp_path: Path,
) -> tuple[TieredStore, CpuTier, SlowDisk, list[bytes], Background]:
    """``full_store`` with a put of key(9) held mid-demotion: the victim's disk write waits at
    the gate (open it with ``disk.gate.set()``, then take ``put.result()``)."""
    store, cpu, disk, keys = full_store(tmp_path)
    disk.gate.clear()
    put = Background(lambda: store.put(key(9), data_of(key(9)), tenant="t"))
    assert disk.wait_inside()
    return store, cpu, disk, keys, put


def read(store: TieredStore, k: bytes) -> bytes:
    out = bytearray(CHUNK)
    n = store.read_into(k, memoryview(out), tenant="t")
    return bytes(out[:n])


def files_on(disk: DiskTier) -> set[str]:
    return {
        name[: -len(".kv")]
        for _dir, _subdirs, names in os.walk(disk.directory)
        for name in names
        if name.endswith(".kv")
    }


def check_invariants(store: TieredStore) -> None:
    """Each tier holds exactly its chunks' bytes (the disk: exactly their files, nothing left
    being written), every chunk is in the one tier the index says, and reads back exact."""
    entries = store.entries()
    for name in store.tier_names:
        tier = store.tier(name)
        mine = [e for e in entries if e.tier == name]
        assert tier.used_bytes == sum(e.size_bytes for e in mine), name
        assert set(tier.keys()) == {e.key for e in mine}, name
        if isinstance(tier, DiskTier):
            # a promotion's disk copy is renamed away at once and unlinked in the background
            deadline_s = time.monotonic() + WAIT_S
            while tier.pending_unlink_bytes and time.monotonic() < deadline_s:
                time.sleep(0.01)
            assert files_on(tier) == {e.key.hex() for e in mine}
            audit = audit_directory(tier.directory)
            assert audit.chunk_keys == {e.key for e in mine}
            assert not audit.temp_files and not audit.invalid_files
    cpu = store.lease_tier
    assert cpu is not None and cpu.reserved_bytes == 0 and cpu.lease_count == 0
    for e in entries:
        assert store.tier(e.tier).get(e.key) == data_of(e.key)


def test_a_put_demoting_to_a_slow_disk_holds_up_no_reader_and_no_lookup(tmp_path: Path) -> None:
    store, _cpu, disk, keys = full_store(tmp_path)
    seen = events_of(store)
    disk.gate.clear()
    new = key(9)
    put = Background(lambda: store.put(new, data_of(new), tenant="t"))
    assert disk.wait_inside(), "the put never reached the demotion's write"

    # each of these takes the store's lock; they complete while the disk write is held
    other = keys[2]
    lease = Background(lambda: store.lease(other, math.inf, tenant="t")).result()
    assert isinstance(lease, Lease) and bytes(store.leased_view(lease)) == data_of(other)
    assert Background(lambda: read(store, other)).result() == data_of(other)
    found = Background(lambda: store.lookup(keys, tenant="t")).result()
    assert found.matched_chunks == 4  # the victim is still cached, in cpu, while it is written
    # the victim itself is still read from its cpu bytes
    assert store.entry(keys[0]).tier == "cpu"
    assert Background(lambda: read(store, keys[0])).result() == data_of(keys[0])
    assert disk.inside == 1 and "demote" not in [ev["type"] for ev in seen]

    disk.gate.set()
    assert put.result() == "cpu"
    # once the put is answered its victim's file is in place (the crash benchmark's promise)
    assert store.entry(keys[0]).tier == "disk" and keys[0].hex() in files_on(disk)
    assert [ev["type"] for ev in seen].count("demote") == 1
    assert store.stats.tiers["disk"].demotions == 1
    assert store.stats.tiers["cpu"].evictions["capacity"] == 1
    store.release([lease.lease_id])
    check_invariants(store)


def test_a_slow_demotion_holds_up_no_refresh_and_no_pin(tmp_path: Path) -> None:
    store, _cpu, disk, keys, put = held_demotion(tmp_path)
    assert Background(lambda: store.put(keys[3], data_of(keys[3]), tenant="t")).result() == "cpu"
    assert Background(lambda: store.pin([keys[2]])).result().done == 1
    disk.gate.set()
    assert put.result() == "cpu"
    assert store.entry(keys[0]).tier == "disk"
    check_invariants(store)


def test_a_victim_evicted_while_it_is_written_leaves_no_file(tmp_path: Path) -> None:
    store, _cpu, disk, keys, put = held_demotion(tmp_path)
    assert Background(lambda: store.evict([keys[0]])).result().done == 1
    disk.gate.set()
    assert put.result() == "cpu"
    assert keys[0] not in store and files_on(disk) == set()
    assert disk.used_bytes == 0 and len(disk) == 0
    check_invariants(store)


def test_a_victim_pinned_while_it_is_written_stays_in_cpu(tmp_path: Path) -> None:
    store, _cpu, disk, keys = full_store(tmp_path)
    seen = events_of(store)
    disk.gate.clear()
    put = Background(lambda: store.put(key(9), data_of(key(9)), tenant="t"))
    assert disk.wait_inside()
    assert Background(lambda: store.pin([keys[0]])).result().done == 1
    disk.gate.set()  # the put then makes room with another victim
    assert put.result() == "cpu"
    e = store.entry(keys[0])
    assert e.tier == "cpu" and e.pinned
    assert keys[0].hex() not in files_on(disk)
    assert [ev["key"] for ev in seen if ev["type"] == "demote"] == [keys[1].hex()]
    check_invariants(store)


def test_a_victim_moved_while_it_is_written_is_where_the_move_put_it(tmp_path: Path) -> None:
    store, _cpu, disk, keys, put = held_demotion(tmp_path)
    # moving it to disk meanwhile lands (a write of its own); the demotion's copy is given up
    # at its commit (only its temp file is removed), not doubled
    assert Background(lambda: store.move([keys[0]], "disk")).result().done == 1
    disk.gate.set()
    assert put.result() == "cpu"
    assert store.entry(keys[0]).tier == "disk"
    check_invariants(store)


def test_a_failed_demotion_write_is_a_counted_drop(tmp_path: Path) -> None:
    store, _cpu, disk, keys = full_store(tmp_path)
    disk.fail = True
    assert store.put(key(9), data_of(key(9)), tenant="t") == "cpu"
    assert keys[0] not in store and store.stats.demotion_failures == 1
    assert files_on(disk) == set() and disk.used_bytes == 0
    disk.fail = False
    check_invariants(store)


def test_a_flush_demotion_whose_write_fails_keeps_the_chunk(tmp_path: Path) -> None:
    """An operator's flush --demote never drops: a write that fails below (a full disk)
    leaves the chunk in the arena, counted failed, and readable."""
    store, _cpu, disk, keys = full_store(tmp_path)
    disk.fail = True
    r = store.flush("cpu", demote=True)
    assert (r.done, r.failed) == (0, 4)
    assert [store.entry(k).tier for k in keys] == ["cpu"] * 4
    assert store.get(keys[0], tenant="t") == data_of(keys[0])
    assert store.stats.demotion_failures == 4
    assert files_on(disk) == set() and disk.used_bytes == 0
    disk.fail = False
    assert store.flush("cpu", demote=True).done == 4
    assert [store.entry(k).tier for k in keys] == ["disk"] * 4
    check_invariants(store)


def test_a_reserved_put_demotes_without_the_lock_too(tmp_path: Path) -> None:
    store, _cpu, disk, keys = full_store(tmp_path)
    disk.gate.clear()
    reserve = Background(lambda: store.reserve_put(key(9), CHUNK, tenant="t"))
    assert disk.wait_inside()
    assert Background(lambda: store.lookup(keys, tenant="t")).result().matched_chunks == 4
    disk.gate.set()
    slot = reserve.result()
    assert slot is not None
    slot.view[:] = data_of(key(9))
    assert store.commit_put(slot) == "cpu"
    assert store.entry(keys[0]).tier == "disk"
    check_invariants(store)


def test_closing_the_store_mid_demotion_leaves_nothing_half_done(tmp_path: Path) -> None:
    store, _cpu, disk, _keys, put = held_demotion(tmp_path)
    Background(store.close).result()
    disk.gate.set()
    with pytest.raises(Exception):  # noqa: B017 - whichever error a closed store gives
        put.result()
    assert not audit_directory(disk.directory).invalid_files


def test_many_threads_putting_with_demotions_and_reading_agree(tmp_path: Path) -> None:
    """Putters that keep demoting, beside readers, lookups and leases that promote from disk
    (demoting too): every read is exact, and in the end every chunk is in exactly one tier,
    its file (if on disk) complete."""
    store, _cpu, _disk = make_store(tmp_path, cpu_chunks=6, disk_chunks=256)
    errors: list[BaseException] = []
    n_per = 40
    # readers and leasers start once every putter has put 10 chunks (30 in all, 6 of them in
    # the cpu tier: the rest demoted), so there is something on disk for them to promote: a
    # putter slow to start under load could otherwise leave them nothing but misses
    putters_going = threading.Barrier(7, timeout=WAIT_S)

    def putter(base: int) -> None:
        try:
            for i in range(n_per):
                if i == 10:
                    putters_going.wait()
                k = key(base + i)
                store.put(k, data_of(k), tenant="t")
        except BaseException as exc:
            errors.append(exc)

    def reader(base: int) -> None:
        try:
            putters_going.wait()
            for i in range(n_per):
                k = key(base + i)
                with contextlib.suppress(KeyError):
                    assert read(store, k) == data_of(k)
                store.lookup([key(base + j) for j in range(i + 1)], tenant="t")
        except BaseException as exc:
            errors.append(exc)

    def leaser(base: int) -> None:
        # leases of chunks mostly demoted by now: each promotes, demoting another to make room
        try:
            putters_going.wait()
            for i in range(0, n_per, 3):
                ks = [key(base + i + j) for j in range(3)]
                got = store.lease_many(ks, math.inf, tenant="t")
                for k, lease in zip(ks, got, strict=True):
                    if isinstance(lease, Lease):
                        assert bytes(store.leased_view(lease)) == data_of(k)
                store.release([g.lease_id for g in got if isinstance(g, Lease)])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=putter, args=(b,)) for b in (0, 1000, 2000)]
    threads += [threading.Thread(target=reader, args=(b,)) for b in (0, 1000)]
    threads += [threading.Thread(target=leaser, args=(b,)) for b in (0, 2000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 4)
        assert not t.is_alive()
    assert not errors, errors
    assert len(store) == 3 * n_per  # the disk holds the rest: nothing dropped
    assert store.stats.tiers["cpu"].promotions > 0  # leases did bring chunks up from disk
    check_invariants(store)


def test_the_runtime_put_copies_into_a_reserved_slot_with_put_semantics(tmp_path: Path) -> None:
    """The agent's put (what PUT and PUT_STAGED call) lands new chunks through a reserved
    slot, with the same answers, metadata and events as ``TieredStore.put``."""
    store, _cpu, _disk = make_store(tmp_path)
    seen = events_of(store)
    rt = AgentRuntime(AgentSettings(data_dir=str(tmp_path), isolated_tenants=("iso",)), store)

    def put(k: bytes, **kw: Any) -> str | None:
        args: dict[str, Any] = dict(
            tokens=None, tenant="t", parent=None, depth=0, priority=35, pinned=False
        )
        args.update(kw)
        return rt.put(k, data_of(k), isolated=args.pop("isolated", False), **args)

    assert put(key(1), tokens=3, parent=key(0), depth=2, priority=70) == "cpu"
    e = store.entry(key(1))
    assert (e.tokens, e.parent, e.depth, e.priority, e.pinned) == (3, key(0), 2, 70, False)
    assert put(key(1)) == "cpu"  # cached already: a refresh
    assert put(key(2), pinned=True) == "cpu" and store.entry(key(2)).pinned
    # an isolated tenant's put over another tenant's chunk replaces it, as a put does
    assert put(key(1), tenant="iso") == "cpu"
    assert store.entry(key(1)).tenant == "iso" and store.entry(key(1)).isolated
    for i in range(3, 8):  # demotions as a put makes them
        assert put(key(i)) == "cpu"
    assert [ev["type"] for ev in seen].count("demote") >= 1
    check_invariants(store)
    rt.close()


# --- found by review: a move, a re-put and the counts while a demotion is being written -----
def test_a_move_mid_demotion_leaves_the_victim_out_of_the_cpu_policy(tmp_path: Path) -> None:
    """A move of the victim while its demotion is written must not put it back into cpu's
    policy (a failed move did, before): cpu would keep planning room around a chunk it no
    longer holds and refuse every later put."""
    store, cpu, disk, keys, put = held_demotion(tmp_path)
    assert Background(lambda: store.move([keys[0]], "disk")).result().done == 1
    disk.gate.set()
    assert put.result() == "cpu"
    assert store.entry(keys[0]).tier == "disk"
    for k in (keys[1], keys[2], keys[3], key(9)):  # keys[0]'s stale entry would be the LRU
        assert read(store, k) == data_of(k)
    assert cpu.free_bytes == 0
    assert store.put(key(10), data_of(key(10)), tenant="t") == "cpu"
    check_invariants(store)


def test_an_isolated_put_replacing_a_victim_mid_demotion_lands(tmp_path: Path) -> None:
    store, _cpu, disk, keys = full_store(tmp_path)
    store.set_isolated_tenants(["iso"])
    assert store.pin(keys[1:]).done == 3  # cpu: room for one unpinned chunk
    disk.gate.clear()
    put = Background(lambda: store.put(key(9), data_of(key(9)), tenant="t"))
    assert disk.wait_inside()  # keys[0] being written to disk
    other = bytes(reversed(data_of(keys[0])))
    res = Background(lambda: store.put(keys[0], other, tenant="iso"))
    try:
        landed = res.result()
    finally:
        disk.gate.set()
        put.result()
    assert landed == "disk"
    assert store.get(keys[0], tenant="iso") == other  # the old copy's file never replaced it


def test_evict_then_reput_to_disk_mid_demotion_lands(tmp_path: Path) -> None:
    store, _cpu, disk, keys, put = held_demotion(tmp_path)
    assert Background(lambda: store.evict([keys[0]])).result().done == 1
    res = Background(lambda: store.put(keys[0], data_of(keys[0]), tenant="t", tier="disk"))
    try:
        landed = res.result()
    finally:
        disk.gate.set()
        put.result()
    assert landed == "disk"
    assert read(store, keys[0]) == data_of(keys[0])


def test_a_victim_pinned_mid_demotion_is_not_counted_evicted(tmp_path: Path) -> None:
    store, _cpu, disk, keys, put = held_demotion(tmp_path)
    assert Background(lambda: store.pin([keys[0]])).result().done == 1
    disk.gate.set()
    assert put.result() == "cpu"
    assert store.entry(keys[0]).tier == "cpu"
    assert store.stats.tiers["cpu"].evictions["capacity"] == 1


def test_a_victim_evicted_mid_demotion_is_counted_once(tmp_path: Path) -> None:
    store, _cpu, disk, keys, put = held_demotion(tmp_path)
    assert Background(lambda: store.evict([keys[0]])).result().done == 1
    disk.gate.set()
    assert put.result() == "cpu"
    assert len(store.entries("cpu")) == 4 and store.entry(keys[1]).tier == "cpu"
    evictions = store.stats.tiers["cpu"].evictions
    assert sum(evictions.values()) == 1, dict(evictions)


# --- a lease that promotes a disk chunk into a full arena ---------------------------------------
def held_promotion(
    tmp_path: Path, bring_up: Callable[[TieredStore, bytes], Any]
) -> tuple[TieredStore, CpuTier, SlowDisk, list[bytes], Background]:
    """cpu holds key(1..4), disk key(0); ``bring_up(store, key(0))`` runs in the background,
    held mid-way: the demotion that makes its room in cpu (key(1), the least recently used)
    waits at the disk's gate."""
    store, cpu, disk, keys = full_store(tmp_path)
    assert store.put(key(4), data_of(key(4)), tenant="t") == "cpu"  # key(0) demoted (gate open)
    assert store.entry(keys[0]).tier == "disk"
    disk.gate.clear()
    job = Background(lambda: bring_up(store, keys[0]))
    assert disk.wait_inside(), "it never reached the demotion's write"
    return store, cpu, disk, [*keys, key(4)], job


def held_lease_promotion(
    tmp_path: Path,
) -> tuple[TieredStore, CpuTier, SlowDisk, list[bytes], Background]:
    """``held_promotion`` by a lease of key(0)."""
    return held_promotion(tmp_path, lambda store, k: store.lease_many([k], math.inf, tenant="t"))


def others_go_on_while_the_victim_is_written(
    store: TieredStore, disk: SlowDisk, keys: list[bytes], seen: list[dict[str, Any]]
) -> None:
    """With a promotion's victim (key(1)) held mid-write: reads, lookups and other leases
    complete, the victim is still read from cpu, and nothing has moved yet."""
    assert Background(lambda: read(store, keys[2])).result() == data_of(keys[2])
    assert Background(lambda: store.lookup(keys[1:], tenant="t")).result().matched_chunks == 4
    other = Background(lambda: store.lease(keys[3], math.inf, tenant="t")).result()
    assert bytes(store.leased_view(other)) == data_of(keys[3])
    store.release([other.lease_id])
    assert store.entry(keys[1]).tier == "cpu"
    assert Background(lambda: read(store, keys[1])).result() == data_of(keys[1])
    assert disk.inside == 1 and not [ev for ev in seen if ev["type"] in ("demote", "promote")]


def test_a_lease_promoting_from_disk_demotes_without_the_lock(tmp_path: Path) -> None:
    store, _cpu, disk, keys, lease = held_lease_promotion(tmp_path)
    seen = events_of(store)
    others_go_on_while_the_victim_is_written(store, disk, keys, seen)

    disk.gate.set()
    (got,) = lease.result()
    assert isinstance(got, Lease) and bytes(store.leased_view(got)) == data_of(keys[0])
    assert store.entry(keys[0]).tier == "cpu" and store.entry(keys[1]).tier == "disk"
    assert [ev["type"] for ev in seen] == ["demote", "promote"]
    store.release([got.lease_id])
    check_invariants(store)


def test_a_victim_evicted_while_a_lease_waits_for_its_room(tmp_path: Path) -> None:
    store, _cpu, disk, keys, lease = held_lease_promotion(tmp_path)
    assert Background(lambda: store.evict([keys[1]])).result().done == 1
    disk.gate.set()
    (got,) = lease.result()  # its room came from the eviction: leased all the same
    assert isinstance(got, Lease) and bytes(store.leased_view(got)) == data_of(keys[0])
    assert keys[1] not in {e.key for e in store.entries()}
    store.release([got.lease_id])
    check_invariants(store)


def test_a_lease_whose_demotion_fails_still_gets_its_chunk(tmp_path: Path) -> None:
    store, _cpu, disk, keys, lease = held_lease_promotion(tmp_path)
    disk.fail = True
    disk.gate.set()
    (got,) = lease.result()  # the victim is dropped (counted): its room is free all the same
    assert isinstance(got, Lease) and bytes(store.leased_view(got)) == data_of(keys[0])
    assert store.stats.demotion_failures == 1
    disk.fail = False
    store.release([got.lease_id])
    check_invariants(store)


def test_two_batches_leasing_one_disk_chunk_demote_once(tmp_path: Path) -> None:
    """A second batch asking for the chunk whose room the first is making waits for it rather
    than making room again (found in review: the key was not marked while it waited, so each
    batch demoted a victim for the one chunk promoted)."""
    store, _cpu, disk, keys, first = held_lease_promotion(tmp_path)
    second = Background(lambda: store.lease_many([keys[0]], math.inf, tenant="t"))
    # time enough for the second batch to reach a demotion's write of its own, if it made one
    time.sleep(0.5)
    assert disk.inside == 1
    disk.gate.set()
    got = [*first.result(), *second.result()]
    assert all(isinstance(g, Lease) for g in got)
    assert store.entry(keys[0]).tier == "cpu" and store.entry(keys[1]).tier == "disk"
    assert [store.entry(k).tier for k in keys[2:]] == ["cpu"] * 3  # one victim, not two
    store.release([g.lease_id for g in got if isinstance(g, Lease)])
    check_invariants(store)


def test_a_chunk_waiting_for_its_room_is_not_evicted_from_disk_meanwhile(tmp_path: Path) -> None:
    """While its room is made it stays out of the disk tier's policy, like a chunk being read."""
    store, _cpu, disk, keys, lease = held_lease_promotion(tmp_path)
    with store.locked():
        candidates = {e.key for e in store._policies["disk"].victims(0.0)}
    assert keys[0] not in candidates  # the only chunk on disk, yet no candidate
    disk.gate.set()
    (got,) = lease.result()
    assert isinstance(got, Lease)
    store.release([got.lease_id])
    check_invariants(store)


# --- a plain read that promotes a disk chunk into a full arena ----------------------------------
def held_read_promotion(
    tmp_path: Path,
) -> tuple[TieredStore, CpuTier, SlowDisk, list[bytes], Background]:
    """``held_promotion`` by a plain read of key(0) (a GET): its bytes are read already."""
    return held_promotion(tmp_path, read)


def test_a_read_promoting_from_disk_demotes_without_the_lock(tmp_path: Path) -> None:
    """Found in review of the lease path: a plain read (the TCP GET, a peer's pull) promoted its
    disk chunk under the lock, writing the arena's victim to disk while every reader waited."""
    store, _cpu, disk, keys, reader = held_read_promotion(tmp_path)
    seen = events_of(store)
    others_go_on_while_the_victim_is_written(store, disk, keys, seen)
    # the chunk whose room is being made is no candidate for the disk's own evictions
    with store.locked():
        assert keys[0] not in {e.key for e in store._policies["disk"].victims(0.0)}

    disk.gate.set()
    assert reader.result() == data_of(keys[0])
    assert store.entry(keys[0]).tier == "cpu" and store.entry(keys[1]).tier == "disk"
    assert [ev["type"] for ev in seen] == ["demote", "promote"]
    check_invariants(store)


def test_a_lease_of_a_chunk_a_read_is_promoting_waits_and_demotes_nothing_more(
    tmp_path: Path,
) -> None:
    store, _cpu, disk, keys, reader = held_read_promotion(tmp_path)
    lease = Background(lambda: store.lease_many([keys[0]], math.inf, tenant="t"))
    time.sleep(0.5)  # time enough for the batch to begin a demotion of its own, if it made one
    assert disk.inside == 1
    disk.gate.set()
    assert reader.result() == data_of(keys[0])
    (got,) = lease.result()
    assert isinstance(got, Lease) and bytes(store.leased_view(got)) == data_of(keys[0])
    assert [store.entry(k).tier for k in keys] == ["cpu", "disk", "cpu", "cpu", "cpu"]
    store.release([got.lease_id])
    check_invariants(store)


def test_a_read_whose_victim_fails_to_demote_still_promotes(tmp_path: Path) -> None:
    store, _cpu, disk, keys, reader = held_read_promotion(tmp_path)
    disk.fail = True
    disk.gate.set()
    assert reader.result() == data_of(keys[0])  # the victim is dropped (counted): room all the same
    assert store.stats.demotion_failures == 1 and keys[1] not in store
    assert store.entry(keys[0]).tier == "cpu"
    disk.fail = False
    check_invariants(store)


def test_a_chunk_evicted_while_its_read_makes_room_is_still_answered(tmp_path: Path) -> None:
    store, _cpu, disk, keys, reader = held_read_promotion(tmp_path)
    assert Background(lambda: store.evict([keys[0]])).result().done == 1
    disk.gate.set()
    assert reader.result() == data_of(keys[0])  # read and checked before it went
    assert keys[0] not in store and store.entry(keys[1]).tier == "disk"
    check_invariants(store)


# --- an operator's move or flush down to disk ---------------------------------------------------
def test_a_move_to_disk_is_written_without_the_lock(tmp_path: Path) -> None:
    """Found in review: ``move`` and ``flush`` held the lock for the whole batch, each chunk's
    disk write included, so an operator's ``kvctl move``/``flush --demote`` stalled every read."""
    store, _cpu, disk, keys = full_store(tmp_path)
    seen = events_of(store)
    disk.gate.clear()
    move = Background(lambda: store.move(keys[:2], "disk"))
    assert disk.wait_inside(), "the move never reached its write"
    assert Background(lambda: read(store, keys[3])).result() == data_of(keys[3])
    assert Background(lambda: store.lookup(keys, tenant="t")).result().matched_chunks == 4
    other = Background(lambda: store.lease(keys[2], math.inf, tenant="t")).result()
    assert bytes(store.leased_view(other)) == data_of(keys[2])
    store.release([other.lease_id])
    assert Background(lambda: read(store, keys[0])).result() == data_of(keys[0])  # still in cpu
    disk.gate.set()
    result = move.result()
    assert (result.done, result.failed, result.missing) == (2, 0, 0)
    assert [store.entry(k).tier for k in keys] == ["disk", "disk", "cpu", "cpu"]
    assert [ev["type"] for ev in seen] == ["move", "move"]
    stats = store.stats.tiers
    assert sum(stats["cpu"].evictions.values()) == 0 and stats["disk"].demotions == 0
    check_invariants(store)


def test_a_move_whose_write_fails_leaves_the_chunk_where_it_was(tmp_path: Path) -> None:
    store, _cpu, disk, keys = full_store(tmp_path)
    disk.fail = True
    result = store.move([keys[0]], "disk")
    assert (result.done, result.failed) == (0, 1)
    assert store.entry(keys[0]).tier == "cpu" and read(store, keys[0]) == data_of(keys[0])
    assert store.stats.demotion_failures == 1
    disk.fail = False
    check_invariants(store)


def test_a_chunk_pinned_while_its_move_is_written_stays_pinned_where_it_is(
    tmp_path: Path,
) -> None:
    store, _cpu, disk, keys = full_store(tmp_path)
    disk.gate.clear()
    move = Background(lambda: store.move([keys[0]], "disk"))
    assert disk.wait_inside()
    assert Background(lambda: store.pin([keys[0]])).result().done == 1
    disk.gate.set()
    assert (move.result().done, move.result().failed) == (0, 1)
    assert store.entry(keys[0]).tier == "cpu" and store.entry(keys[0]).pinned
    store.unpin([keys[0]])
    check_invariants(store)


def test_a_flush_demoting_to_disk_holds_up_no_reader(tmp_path: Path) -> None:
    store, _cpu, disk, keys = full_store(tmp_path)
    seen = events_of(store)
    disk.gate.clear()
    flush = Background(lambda: store.flush("cpu", demote=True))
    assert disk.wait_inside(), "the flush never reached a write"
    reads = [Background(lambda k=k: read(store, k)).result() for k in keys]  # type: ignore[misc]
    assert reads == [data_of(k) for k in keys]
    disk.gate.set()
    assert flush.result().done == 4
    assert [store.entry(k).tier for k in keys] == ["disk"] * 4
    assert [ev["type"] for ev in seen].count("demote") == 4
    assert store.stats.tiers["cpu"].evictions["flush"] == 4
    assert store.stats.tiers["disk"].demotions == 4
    check_invariants(store)


def test_a_resize_demotes_in_batches_written_without_the_lock(tmp_path: Path) -> None:
    store, cpu, disk, keys = full_store(tmp_path)
    disk.gate.clear()
    resize = Background(lambda: store.resize("cpu", 2 * CHUNK))
    assert disk.wait_inside(), "the resize never reached a write"
    assert Background(lambda: read(store, keys[3])).result() == data_of(keys[3])
    assert Background(lambda: store.lookup(keys, tenant="t")).result().matched_chunks == 4
    disk.gate.set()
    assert resize.result().done == 2
    assert cpu.capacity_bytes == 2 * CHUNK and cpu.resident_bytes <= 2 * CHUNK
    assert [store.entry(k).tier for k in keys] == ["disk", "disk", "cpu", "cpu"]
    assert store.stats.tiers["cpu"].evictions["resize"] == 2
    assert store.stats.tiers["disk"].demotions == 2
    check_invariants(store)


def test_a_resize_below_the_pinned_bytes_is_refused_having_moved_nothing(tmp_path: Path) -> None:
    store, cpu, _disk, keys = full_store(tmp_path)
    store.pin(keys[:3])
    with pytest.raises(CapacityError, match="pinned"):
        store.resize("cpu", 2 * CHUNK)
    assert cpu.capacity_bytes == 4 * CHUNK and len(store.entries("cpu")) == 4
    store.unpin(keys[:3])


# --- found by review: a key whose older copy is still being written, a prefetch's chunk moved -----
class OneKeyGateDisk(SlowDisk):
    """A SlowDisk whose gate holds only the first detached write of each key in ``held``; other
    writes (and every plain ``put``) go at once."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        super().__init__(directory, capacity_bytes)
        self.held: set[bytes] = set()

    def put(self, meta: ChunkMeta, data: Buffer | None) -> None:
        DiskTier.put(self, meta, data)

    def write_reserved(self, slot: WriteSlot, data: Buffer) -> None:
        if slot.meta.key in self.held:
            self.held.discard(slot.meta.key)
            self._held()
        DiskTier.write_reserved(self, slot, data)


def held_old_copy(tmp_path: Path) -> tuple[TieredStore, OneKeyGateDisk, list[bytes], Background]:
    """cpu (room for five) holds key(0..3); a move of key(0) to disk is held mid-write, key(0)
    is evicted meanwhile and put again (into cpu's free room): the disk is still writing the
    old copy's file when the new copy is moved or flushed down."""
    cpu = CpuTier(5 * CHUNK)
    disk = OneKeyGateDisk(tmp_path / "disk", 64 * CHUNK)
    store = TieredStore([cpu, disk], chunk_tokens=4, eviction="lru")
    keys = [key(i) for i in range(4)]
    for k in keys:
        assert store.put(k, data_of(k), tenant="t") == "cpu"
    disk.held = {keys[0]}
    disk.gate.clear()
    move = Background(lambda: store.move([keys[0]], "disk"))
    assert disk.wait_inside()
    assert Background(lambda: store.evict([keys[0]])).result().done == 1
    assert Background(lambda: store.put(keys[0], data_of(keys[0]), tenant="t")).result() == "cpu"
    return store, disk, keys, move


def test_a_flush_of_a_key_whose_old_copy_is_being_written_demotes_it(tmp_path: Path) -> None:
    """Found in review: the flush's detached demotion could not reserve the key's write (the
    old copy's was under way) and dropped the chunk as a failed demotion; flushed under the
    lock it was demoted (a put of a new copy goes at once)."""
    store, disk, keys, move = held_old_copy(tmp_path)
    try:
        result = Background(lambda: store.flush("cpu", demote=True)).result()
    finally:
        disk.gate.set()
    assert move.result().missing == 1  # its chunk was evicted meanwhile
    assert result.done == 4
    assert [store.entry(k).tier for k in keys] == ["disk"] * 4
    assert store.stats.demotion_failures == 0
    assert store.stats.tiers["cpu"].evictions["flush"] == 4
    assert store.stats.tiers["disk"].demotions == 4
    check_invariants(store)


def test_a_move_of_a_key_whose_old_copy_is_being_written_lands(tmp_path: Path) -> None:
    store, disk, keys, move = held_old_copy(tmp_path)
    try:
        result = Background(lambda: store.move([keys[0]], "disk")).result()
    finally:
        disk.gate.set()
    assert move.result().missing == 1
    assert (result.done, result.failed) == (1, 0)
    assert store.entry(keys[0]).tier == "disk" and read(store, keys[0]) == data_of(keys[0])
    assert store.stats.demotion_failures == 0
    check_invariants(store)


def test_a_victim_whose_old_copy_is_being_written_is_demoted_not_dropped(tmp_path: Path) -> None:
    store, disk, keys, move = held_old_copy(tmp_path)
    for k in keys[1:]:  # key(0)'s new copy is the least recently used
        assert read(store, k) == data_of(k)
    try:
        # cpu: key(1..3), key(0) and the old copy's bytes (held for its write): full
        landed = Background(lambda: store.put(key(9), data_of(key(9)), tenant="t")).result()
    finally:
        disk.gate.set()
    assert landed == "cpu"
    assert move.result().missing == 1
    assert store.entry(keys[0]).tier == "disk" and store.stats.demotion_failures == 0
    check_invariants(store)


class _HookedLock:
    """The store's lock, running ``hook`` once in ``thread`` the next time it takes the lock
    while not holding it: there, between two chunks of a bulk operation, another thread acts."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.hook: Any = None
        self.thread = 0

    def arm(self, hook: Any) -> None:
        self.hook, self.thread = hook, threading.get_ident()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        hook = self.hook
        if hook is not None and threading.get_ident() == self.thread and not self.real._is_owned():
            self.hook = None
            hook()
        return bool(self.real.acquire(blocking, timeout))

    def release(self) -> None:
        self.real.release()

    def _is_owned(self) -> bool:
        return bool(self.real._is_owned())

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.real.release()


def test_a_prefetch_never_moves_down_a_chunk_that_went_up_meanwhile(tmp_path: Path) -> None:
    """Found in review: a prefetch that no longer held the lock for its batch passed its keys to
    ``move``, which moves either way: a chunk brought above the prefetch's tier meanwhile (here
    by a read's promotion into the lease tier) was moved back down to it."""
    store = TieredStore(
        [
            CpuTier(4 * CHUNK, name="cpu0"),
            CpuTier(4 * CHUNK, name="cpu1"),
            DiskTier(tmp_path / "disk", 64 * CHUNK),
        ],
        chunk_tokens=4,
        eviction="lru",
    )
    first, second = key(1), key(2)
    for k in (first, second):
        assert store.put(k, data_of(k), tenant="t", tier="disk") == "disk"
    hooked = _HookedLock(store._lock)
    store._lock = hooked  # type: ignore[assignment]

    def on_event(ev: dict[str, Any]) -> None:
        if ev["type"] == "move" and ev["key"] == first.hex():  # between the two chunks
            hooked.arm(lambda: Background(lambda: read(store, second)).result())

    store.subscribe(on_event)
    result = store.prefetch([first, second], "cpu1")
    assert hooked.hook is None, "the read never ran between the chunks"
    assert store.entry(first).tier == "cpu1"
    assert store.entry(second).tier == "cpu0"  # promoted by the read: above cpu1, left there
    assert (result.done, result.missing, result.failed) == (1, 0, 0)
    check_invariants(store)


def test_a_chunk_moved_up_and_down_while_a_read_makes_its_room_leaves_no_stale_policy_entry(
    tmp_path: Path,
) -> None:
    """Found in review: a chunk being read (out of its policy) that a move brought up into cpu
    was put in cpu's policy all the same, and a move back down, seeing it still being read,
    left it there: cpu's policy kept a chunk cpu no longer held, planned every later put's room
    around it and sent every put down to disk. A read making its room (a victim's demotion
    written without the lock) keeps it being read long enough for an operator's two moves."""
    cpu = CpuTier(4 * CHUNK)
    disk = OneKeyGateDisk(tmp_path / "disk", 64 * CHUNK)
    store = TieredStore([cpu, disk], chunk_tokens=4, eviction="lru")
    keys = [key(i) for i in range(5)]
    for k in keys:
        assert store.put(k, data_of(k), tenant="t") == "cpu"
    assert store.entry(keys[0]).tier == "disk"
    disk.held = {keys[1]}  # the victim of key(0)'s promotion
    disk.gate.clear()
    reader = Background(lambda: read(store, keys[0]))
    try:
        assert disk.wait_inside()
        assert Background(lambda: store.move([keys[0]], "cpu")).result().done == 1
        assert Background(lambda: store.move([keys[0]], "disk")).result().done == 1
        # the victim pinned, the free room taken: the read does not promote key(0) after all
        assert Background(lambda: store.pin([keys[1]])).result().done == 1
        assert Background(lambda: store.put(key(20), data_of(key(20)), tenant="t")).result()
    finally:
        disk.gate.set()
    assert reader.result() == data_of(keys[0])
    assert store.entry(keys[0]).tier == "disk"
    with store.locked():
        for name in store.tier_names:
            tracked = {e.key for e in store._policies[name].victims(0.0)}
            assert tracked == {e.key for e in store.entries(name) if not e.pinned}, name
    for i in range(30, 36):  # each lands in cpu, evicting its least recently used chunk
        assert store.put(key(i), data_of(key(i)), tenant="t") == "cpu"
    store.unpin([keys[1]])
    check_invariants(store)


def test_a_flush_or_move_counts_a_chunk_pinned_or_evicted_mid_write_as_such(
    tmp_path: Path,
) -> None:
    """Found in review: a chunk pinned while its flush was written counted nowhere (neither
    done nor skipped as pinned), and one evicted while its move was written counted as a
    failed move, not as missing (as one evicted before the move reached it does)."""
    store, _cpu, disk, keys = full_store(tmp_path)
    disk.gate.clear()
    flush = Background(lambda: store.flush("cpu", demote=True))
    try:
        assert disk.wait_inside()  # keys[0] first
        assert Background(lambda: store.pin([keys[0]])).result().done == 1
    finally:
        disk.gate.set()
    result = flush.result()
    assert (result.done, result.skipped_pinned) == (3, 1)
    assert store.entry(keys[0]).tier == "cpu"
    store.unpin([keys[0]])

    disk.gate.clear()
    move = Background(lambda: store.move([keys[0]], "disk"))
    try:
        assert disk.wait_inside()
        assert Background(lambda: store.evict([keys[0]])).result().done == 1
    finally:
        disk.gate.set()
    result = move.result()
    assert (result.done, result.failed, result.missing) == (0, 0, 1)
    check_invariants(store)


def test_a_disk_that_refuses_a_detached_write_is_taken_offline(tmp_path: Path) -> None:
    """As a put there that raised TierUnavailable takes it offline (found in review)."""
    store, _cpu, disk, keys = full_store(tmp_path)
    disk.broken = True
    assert store.put(key(9), data_of(key(9)), tenant="t") == "cpu"  # its victim is dropped
    assert "disk" in store.offline_tiers and keys[0] not in store
    assert store.stats.demotion_failures == 1
    disk.broken = False
    assert store.move([keys[1]], "disk").failed == 1  # offline until it is tried again
    assert store.entry(keys[1]).tier == "cpu"


# --- a put that lands on disk (the cpu tier cannot take it) ------------------------------------
def pinned_full_store(tmp_path: Path) -> tuple[TieredStore, CpuTier, SlowDisk, list[bytes]]:
    """``full_store`` with every cpu chunk pinned: a new chunk can only go to disk."""
    store, cpu, disk, keys = full_store(tmp_path)
    assert store.pin(keys).done == 4
    return store, cpu, disk, keys


def test_a_put_landing_on_disk_is_written_without_the_lock(tmp_path: Path) -> None:
    store, _cpu, disk, keys = pinned_full_store(tmp_path)
    seen = events_of(store)
    disk.gate.clear()
    new = key(9)
    put = Background(lambda: store.put(new, data_of(new), tenant="t"))
    assert disk.wait_inside(), "the put never reached its write"
    assert Background(lambda: read(store, keys[2])).result() == data_of(keys[2])
    assert Background(lambda: store.lookup([new], tenant="t")).result().matched_chunks == 0
    other = Background(lambda: store.lease(keys[3], math.inf, tenant="t")).result()
    assert bytes(store.leased_view(other)) == data_of(keys[3])
    store.release([other.lease_id])
    assert not seen  # not stored until its file is in place
    disk.gate.set()
    assert put.result() == "disk"
    assert store.entry(new).tier == "disk" and read(store, new) == data_of(new)
    assert [ev["type"] for ev in seen] == ["store"]
    assert store.stats.tiers["disk"].puts == 1
    store.unpin(keys)
    check_invariants(store)


def test_a_put_whose_disk_write_fails_is_refused_with_nothing_left(tmp_path: Path) -> None:
    store, _cpu, disk, keys = pinned_full_store(tmp_path)
    disk.fail = True
    with pytest.raises(CapacityError):
        store.put(key(9), data_of(key(9)), tenant="t")
    assert key(9) not in store
    disk.fail = False
    store.unpin(keys)
    check_invariants(store)


def test_the_same_key_put_twice_while_the_first_is_written_is_stored_once(tmp_path: Path) -> None:
    store, _cpu, disk, keys = pinned_full_store(tmp_path)
    seen = events_of(store)
    disk.gate.clear()
    new = key(9)
    first = Background(lambda: store.put(new, data_of(new), tenant="t"))
    assert disk.wait_inside()
    # the second goes at once (a disk put of a key being written is not held): it is stored
    assert Background(lambda: store.put(new, data_of(new), tenant="t")).result() == "disk"
    disk.gate.set()
    assert first.result() == "disk"  # its own copy was not committed: it refreshed the other
    assert [ev["type"] for ev in seen] == ["store"]
    store.unpin(keys)
    check_invariants(store)
