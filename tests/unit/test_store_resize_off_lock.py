"""A cpu tier resized to another size maps its new arena and copies its chunks into it without
the store's lock (``CpuTier.begin_resize`` / ``copy_resize`` / ``finish_resize``): reads,
lookups and puts go on meanwhile, and whatever they changed (chunks put, deleted, put again
into another chunk's old bytes, evicted; the arena compacted or resized by someone else) is
right after the resize, or the resize is made again under the lock as before.

The tier is a real CpuTier whose copy waits at a gate once done, so a test acts between the
copy and the swap; every wait is bounded."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import threading
from pathlib import Path

import pytest

from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.cpu import CpuTier, ResizePlan
from tests.unit.test_store_parallel_reads import CHUNK, WAIT_S, Background, data_of, key, put_in


class GatedCopyCpu(CpuTier):
    """A cpu tier whose ``copy_resize`` waits at ``gate`` once it has copied."""

    def __init__(self, capacity_bytes: int, **kw: object) -> None:
        super().__init__(capacity_bytes, **kw)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.copied = threading.Event()
        self.finished: list[bool] = []

    def copy_resize(self, plan: ResizePlan) -> None:
        super().copy_resize(plan)
        self.copied.set()
        if not self.gate.wait(WAIT_S):
            raise AssertionError("the test never opened the gate")

    def finish_resize(self, plan: ResizePlan) -> bool:
        done = super().finish_resize(plan)
        self.finished.append(done)
        return done


def _store(chunks: int, shared: bool = False) -> tuple[TieredStore, GatedCopyCpu]:
    cpu = GatedCopyCpu(chunks * CHUNK, shared=shared)
    return TieredStore([cpu], chunk_tokens=4, eviction="lru"), cpu


def _check(store: TieredStore, cpu: CpuTier, keys: list[bytes]) -> None:
    """Exactly ``keys`` are held, each with its own bytes, and the tier's books agree."""
    assert set(cpu.keys()) == set(keys) == {e.key for e in store.entries()}
    assert cpu.used_bytes == len(keys) * CHUNK and cpu.reserved_bytes == 0
    for k in keys:
        assert store.get(k) == data_of(k), k.hex()
    offsets = sorted(cpu._slots.values())
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(offsets))
    assert cpu._alloc.free_bytes == cpu.capacity_bytes - cpu.used_bytes


def _resizing(store: TieredStore, cpu: GatedCopyCpu, capacity: int) -> Background:
    running = Background(lambda: store.resize("cpu", capacity))
    assert cpu.copied.wait(WAIT_S), "the resize never reached its copy"
    return running


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_a_resize_copies_its_chunks_without_the_lock(shared: bool) -> None:
    store, cpu = _store(16, shared)
    keys = [key(i) for i in range(12)]
    put_in(store, keys, "cpu")
    generation = cpu.generation
    running = _resizing(store, cpu, 32 * CHUNK)
    # the lock is free while the new arena is filled: reads, lookups and puts complete
    assert Background(lambda: store.get(keys[3])).result() == data_of(keys[3])
    assert Background(lambda: store.lookup(keys)).result().matched_chunks == 12
    assert Background(lambda: store.put(key(50), data_of(key(50)))).result() == "cpu"
    assert cpu.capacity_bytes == 16 * CHUNK  # not swapped yet
    cpu.gate.set()
    running.result()
    assert cpu.finished == [True]  # the copy was used, not made again under the lock
    assert cpu.capacity_bytes == 32 * CHUNK and cpu.generation == generation + 1
    _check(store, cpu, [*keys, key(50)])


def test_chunks_changed_while_the_resize_copies_are_right_after_it() -> None:
    store, cpu = _store(16)
    keys = [key(i) for i in range(10)]
    put_in(store, keys, "cpu")
    running = _resizing(store, cpu, 24 * CHUNK)
    assert store.evict([keys[0], keys[1]]).done == 2  # gone: not kept
    # a new chunk lands in the first freed region, then the evicted one comes back elsewhere:
    # what the copy took from that region is another chunk's bytes by now
    put_in(store, [key(60), keys[0], key(61)], "cpu")
    cpu.gate.set()
    running.result()
    assert cpu.finished == [True]
    _check(store, cpu, [*keys[2:], key(60), keys[0], key(61)])


def test_a_shrink_evicts_what_puts_added_meanwhile() -> None:
    store, cpu = _store(16)
    keys = [key(i) for i in range(6)]
    put_in(store, keys, "cpu")
    running = _resizing(store, cpu, 8 * CHUNK)
    more = [key(i) for i in range(20, 30)]  # fills the old arena past the new size
    put_in(store, more, "cpu")
    cpu.gate.set()
    running.result()
    assert cpu.capacity_bytes == 8 * CHUNK and cpu.used_bytes <= 8 * CHUNK
    kept = [k for k in [*keys, *more] if k in store]
    assert len(kept) == 8 and all(k in kept for k in more[-8:])  # LRU: the newest stayed
    _check(store, cpu, kept)


def test_an_arena_compacted_while_the_resize_copies_is_resized_again_under_the_lock() -> None:
    store, cpu = _store(16)
    keys = [key(i) for i in range(8)]
    put_in(store, keys, "cpu")
    running = _resizing(store, cpu, 20 * CHUNK)
    # the same size: compacted in place, under the lock; the copy's offsets are stale now
    assert store.evict(keys[:3]).done == 3
    Background(lambda: store.resize("cpu", 16 * CHUNK)).result()
    cpu.gate.set()
    running.result()
    assert cpu.finished == [False]  # given up: made again, all under the lock
    assert cpu.capacity_bytes == 20 * CHUNK
    _check(store, cpu, keys[3:])


def test_a_store_closed_while_the_resize_copies_leaves_nothing_mapped() -> None:
    store, cpu = _store(8)
    put_in(store, [key(1)], "cpu")
    running = _resizing(store, cpu, 16 * CHUNK)
    store.close()
    cpu.gate.set()
    with pytest.raises(Exception, match="closed"):
        running.result()
    assert cpu._plan is None and cpu.finished == [False]


def test_the_old_arena_is_unmapped_after_the_lock_is_let_go() -> None:
    """Unmapping frees its pages (30 ms per 128 MiB on the dev VM): the store does it once
    the swap is made and the lock released, and the plan keeps no arena afterwards."""
    store, cpu = _store(8)
    put_in(store, [key(1)], "cpu")
    plans: list[ResizePlan] = []
    released: list[bool] = []
    real_release = cpu.release_resize

    def release(plan: ResizePlan) -> None:
        released.append(store.locked()._is_owned())  # type: ignore[attr-defined]
        plans.append(plan)
        real_release(plan)

    cpu.release_resize = release  # type: ignore[method-assign]
    cpu.gate.set()
    store.resize("cpu", 16 * CHUNK)
    assert released == [False] and cpu.finished == [True]
    (plan,) = plans
    assert plan.retired is None and plan.arena is None and plan.view is None
    _check(store, cpu, [key(1)])


def test_a_plan_can_be_given_up_before_its_copy(tmp_path: Path) -> None:
    cpu = CpuTier(4 * CHUNK)
    plan = cpu.begin_resize(8 * CHUNK)
    assert plan is not None
    assert cpu.begin_resize(16 * CHUNK) is None  # one at a time
    cpu.abort_resize(plan)
    cpu.release_resize(plan)
    assert cpu._plan is None and plan.arena is None
    assert cpu.finish_resize(plan) is False  # stale
    assert cpu.begin_resize(cpu.capacity_bytes) is None  # the same size compacts in place


def test_a_chunk_deleted_and_put_back_in_place_during_the_copy_is_copied_again() -> None:
    """Its old bytes may have been another chunk's while the copy read them (a torn copy, here
    made by hand): a delete marks it, and the finish copies it again under the lock."""
    cpu = CpuTier(8 * CHUNK)
    keys = [key(i) for i in range(3)]
    for k in keys:
        cpu.put(_meta(k), data_of(k))
    plan = cpu.begin_resize(16 * CHUNK)
    assert plan is not None
    cpu.copy_resize(plan)
    _, _, dst, n = next(m for m in plan.moves if m[0] == keys[0])
    assert plan.view is not None
    plan.view[dst : dst + n] = b"\xee" * n  # what a copy racing a reuse of the region took
    old = cpu._slots[keys[0]]
    cpu.delete(keys[0])
    cpu.put(_meta(keys[0]), data_of(keys[0]))
    assert cpu._slots[keys[0]] == old  # back at the same place: only the delete tells
    assert cpu.finish_resize(plan)
    out = bytearray(CHUNK)
    for k in keys:
        cpu.read_into(k, memoryview(out))
        assert bytes(out) == data_of(k)


def _meta(k: bytes) -> ChunkMeta:
    return ChunkMeta(key=k, size_bytes=CHUNK)


class _InterruptedAbort(CpuTier):
    """A tier whose plan's abort is followed by an interrupt (one that landed while the
    store waited to re-take its lock is raised right after the block)."""

    def abort_resize(self, plan: ResizePlan) -> None:
        super().abort_resize(plan)
        raise KeyboardInterrupt("landed right after abort_resize's block (test)")


def _memfds() -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += "kvctl-cpu" in os.readlink(f"/proc/self/fd/{fd}")
    return n


def test_an_interrupt_after_the_resize_still_unmaps_the_old_arena() -> None:
    """Found by review: the arena the resize replaced was released after the lock's block, so
    an interrupt raised there leaked it (a shared arena's memfd: its memory stays committed)."""
    cpu = _InterruptedAbort(4 * CHUNK, shared=True)
    store = TieredStore([cpu], chunk_tokens=4)
    put_in(store, [key(1)], "cpu")
    gc.collect()
    before = _memfds()
    for chunks in (8, 12, 16):
        with pytest.raises(KeyboardInterrupt):
            store.resize("cpu", chunks * CHUNK)
        assert cpu.capacity_bytes == chunks * CHUNK  # the resize itself was made
    gc.collect()
    assert _memfds() == before
    assert store.get(key(1)) == data_of(key(1))
