"""Faults around the store's disk reads without its lock: a disk copy that cannot be deleted
after its chunk was promoted, a lease batch cut short while its reads still run, a batch or a
clean-up after ``close``, slow unlinks beside reads, and what the measured bandwidth counts.

The tiers are real ones (GatedDisk and subclasses of it); every wait is bounded."""

from __future__ import annotations

import gc
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest

from kvctl.store.accounting import MIN_BANDWIDTH_SAMPLE_BYTES, busy_seconds
from kvctl.store.errors import TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import ChunkMeta, ReadPlan
from kvctl.store.tiers.cpu import CpuTier, Lease
from tests.unit.test_store_parallel_reads import (
    CHUNK,
    WAIT_S,
    Background,
    GatedDisk,
    check_invariants,
    check_results,
    data_of,
    key,
    make_store,
    put_in,
)

#: how long a held unlink waits before going ahead anyway (so a regression fails, not hangs)
UNLINK_HOLD_S = 8.0


class ReadOnlyDisk(GatedDisk):
    """A disk tier whose files cannot be renamed or unlinked while ``read_only`` is set (the
    filesystem remounted read-only, or EIO): deletes raise TierUnavailable as DiskTier's do."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        super().__init__(directory, capacity_bytes)
        self.read_only = False

    def _refuse(self, k: bytes) -> None:
        if self.read_only:
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot delete {self._path(k)}: Read-only file system"
            )

    def delete(self, key: bytes) -> int:
        self._refuse(key)
        return super().delete(key)

    def delete_later(self, key: bytes) -> Callable[[], None] | None:
        self._refuse(key)
        return super().delete_later(key)


class SlowUnlinkDisk(GatedDisk):
    """A disk tier whose unlinks (``delete_later``'s clean-up calls) wait at ``unlink_gate``
    (at most UNLINK_HOLD_S), and whose detached reads take ``read_delay_s`` each."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        super().__init__(directory, capacity_bytes)
        self.unlink_gate = threading.Event()
        self.unlink_threads: set[int] = set()
        self.unlinks_started = threading.Semaphore(0)
        self.unlinks_done = 0
        self.read_delay_s = 0.0

    def delete_later(self, key: bytes) -> Callable[[], None] | None:
        cleanup = super().delete_later(key)
        if cleanup is None:
            return None

        def held() -> None:
            self.unlink_threads.add(threading.get_ident())
            self.unlinks_started.release()
            self.unlink_gate.wait(UNLINK_HOLD_S)
            cleanup()
            self.unlinks_done += 1

        return held

    def read_planned(self, plan: ReadPlan, out: memoryview) -> str | None:
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
        return super().read_planned(plan, out)


class LingeringCpu(CpuTier):
    """A cpu tier that outlives the store's ``close``: stands for a batch planned before the
    store was closed that reaches its reads after."""

    def close(self) -> None:
        pass

    def really_close(self) -> None:
        super().close()


class LingeringDisk(GatedDisk):
    def close(self) -> None:
        pass

    def really_close(self) -> None:
        super().close()


def wait_until(store: TieredStore, ok: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Whether ``ok()`` (checked under the store's lock) came true within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with store.locked():
            if ok():
                return True
        time.sleep(0.01)
    return False


# --- a disk copy that cannot be deleted ----------------------------------------------------------


def test_a_promotion_whose_disk_copy_cannot_be_deleted_leaves_the_chunk_on_disk(
    tmp_path: Path,
) -> None:
    cpu = CpuTier(32 * CHUNK)
    disk = ReadOnlyDisk(tmp_path / "disk", 64 * CHUNK)
    store = TieredStore([cpu, disk], chunk_tokens=4)
    a, b, c = key(1), key(2), key(3)
    put_in(store, [a, b], "disk")
    put_in(store, [c], "cpu")
    disk.read_only = True

    # read_into/get promote a hit: the cpu copy is taken back, the bytes are still served
    assert store.get(a) == data_of(a)
    assert store.locate([a]) == ["disk"] and a not in cpu
    check_invariants(store)

    # a batch with such a key is not a failed batch: that key is a fallback
    results = store.lease_many([a, c, b], math.inf)
    assert results[0] is None and results[2] is None and isinstance(results[1], Lease)
    assert store.locate([a, b, c]) == ["disk", "disk", "cpu"]
    check_results(store, [a, c, b], results)
    check_invariants(store)

    disk.read_only = False  # the disk is writable again: the keys move up as ever
    results = store.lease_many([a, b], math.inf)
    assert all(isinstance(r, Lease) for r in results)
    assert store.locate([a, b]) == ["cpu", "cpu"]
    check_results(store, [a, b], results)
    check_invariants(store)


def test_a_key_the_lease_tier_already_holds_is_a_fallback_not_a_failed_batch(
    tmp_path: Path,
) -> None:
    store, cpu, _ = make_store(tmp_path)
    stray, in_cpu, on_disk = key(1), key(2), key(3)
    put_in(store, [stray, on_disk], "disk")
    put_in(store, [in_cpu], "cpu")
    # a copy in the cpu tier that the index does not place there
    cpu.put(ChunkMeta(stray, CHUNK), bytes(CHUNK))
    results = store.lease_many([stray, in_cpu, on_disk], math.inf)
    assert results[0] is None
    assert isinstance(results[1], Lease) and isinstance(results[2], Lease)
    assert store.locate([stray]) == ["disk"] and cpu.reserved_bytes == 0
    check_results(store, [stray, in_cpu, on_disk], results)
    assert store.get(stray) == data_of(stray)  # the fallback: read from disk, where it is
    assert store.locate([stray]) == ["disk"]


# --- a batch cut short while its reads run ------------------------------------------------------


class Interrupt(BaseException):
    """What a signal handler raises in the waiting thread (like KeyboardInterrupt)."""


def test_an_interrupted_batch_gives_back_the_space_of_its_reads(tmp_path: Path) -> None:
    gc.collect()  # fewer finalizers left to run in the main thread while it is signalled
    store, cpu, disk = make_store(tmp_path, read_threads=2)
    keys = [key(i) for i in range(4)]
    put_in(store, keys, "disk")
    disk.gate.clear()
    main = threading.get_ident()
    raised = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        # raised where lease_many would see it: a signal handled in an object's __del__ (a
        # collected store of another test, say) has its exception ignored; the next one comes
        chain = []
        while frame is not None:
            chain.append(frame.f_code.co_name)
            frame = frame.f_back
        if raised.is_set() or "__del__" in chain or "lease_many" not in chain:
            return
        raised.set()
        raise Interrupt

    def interrupt_while_reading() -> None:
        if not disk.wait_inside(2):  # two reads running, two queued behind them
            return
        # a signal that lands just before the main thread blocks is handled only when it wakes
        # up: send it until it is handled
        while not raised.is_set():
            signal.pthread_kill(main, signal.SIGUSR1)
            raised.wait(0.05)

    before = signal.signal(signal.SIGUSR1, handler)
    interrupter = threading.Thread(target=interrupt_while_reading, daemon=True)
    interrupter.start()
    try:
        with pytest.raises(Interrupt):
            store.lease_many(keys, math.inf)
    finally:
        interrupter.join(WAIT_S)
        signal.signal(signal.SIGUSR1, before)
    # the queued reads were given up at once; the two still running keep their space for now
    assert cpu.reserved_bytes == 2 * CHUNK and len(cpu) == 0 and disk.inside == 2
    assert store.locate(keys) == ["disk"] * 4
    disk.gate.set()
    assert wait_until(store, lambda: cpu.reserved_bytes == 0), "reserved space was kept"
    check_invariants(store)

    results = store.lease_many(keys, math.inf)  # the keys are read as ever afterwards
    assert all(isinstance(r, Lease) for r in results)
    assert disk.reads == 2 + 4  # the queued reads of the cut batch never ran
    check_results(store, keys, results)
    check_invariants(store)


# --- after close ----------------------------------------------------------------------------------


def _store_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("kvctl-store")}


def test_a_closed_store_starts_no_threads_and_leaks_no_reservation(tmp_path: Path) -> None:
    cpu = LingeringCpu(32 * CHUNK)
    disk = LingeringDisk(tmp_path / "disk", 64 * CHUNK)
    store = TieredStore([cpu, disk], chunk_tokens=4, read_threads=4)
    keys = [key(i) for i in range(6)]
    put_in(store, keys, "disk")
    check_results(store, keys[:2], store.lease_many(keys[:2], math.inf))  # pools started
    assert wait_until(store, lambda: disk.pending_unlink_bytes == 0)
    before = _store_threads()
    store.close()
    try:
        # a batch reaching its reads after close is refused, its space given back
        with pytest.raises(TierUnavailable, match="closed"):
            store.lease_many(keys[2:4], math.inf)
        assert cpu.reserved_bytes == 0 and store.locate(keys[2:4]) == ["disk", "disk"]
        # a promotion's clean-up after close is done in place
        assert store.get(keys[4]) == data_of(keys[4])
        assert store.locate([keys[4]]) == ["cpu"]
        assert not any(p.name.endswith(".tmp") for p in (tmp_path / "disk").rglob("*"))
        assert _store_threads() - before == set()
    finally:
        cpu.really_close()
        disk.really_close()


# --- slow unlinks beside reads; the measured bandwidth ---------------------------------------


def test_slow_unlinks_never_hold_up_a_batch_of_reads(tmp_path: Path) -> None:
    cpu = CpuTier(32 * CHUNK)
    disk = SlowUnlinkDisk(tmp_path / "disk", 64 * CHUNK)
    store = TieredStore([cpu, disk], chunk_tokens=4, read_threads=2)
    promoted, batch = [key(1), key(2)], [key(3), key(4)]
    put_in(store, [*promoted, *batch], "disk")
    try:
        check_results(store, promoted, store.lease_many(promoted, math.inf))
        for _ in promoted:  # both unlinks are running, held
            assert disk.unlinks_started.acquire(timeout=WAIT_S)
        assert disk.pending_unlink_bytes == 2 * CHUNK
        disk.gate.clear()
        held = Background(lambda: store.lease_many(batch, math.inf))
        assert disk.wait_inside(2)  # both read at once, beside the unlinks
        assert disk.unlinks_done == 0, "the reads waited for the unlinks"
        disk.gate.set()
        results = held.result()
        assert disk.unlinks_done == 0
        assert all(isinstance(r, Lease) for r in results)
        assert not disk.reader_threads & disk.unlink_threads
        check_results(store, batch, results)
    finally:
        disk.unlink_gate.set()
    # the batch's own two promotions queued two more unlinks
    assert wait_until(store, lambda: disk.unlinks_done == 4 and disk.pending_unlink_bytes == 0)
    check_invariants(store)


def test_a_slow_unlink_does_not_lower_a_batchs_measured_bandwidth(tmp_path: Path) -> None:
    size = MIN_BANDWIDTH_SAMPLE_BYTES
    cpu = CpuTier(16 * size)
    disk = SlowUnlinkDisk(tmp_path / "disk", 16 * size)
    store = TieredStore([cpu, disk], chunk_tokens=4, read_threads=2)
    small, batch = key(1), [key(2), key(3)]
    put_in(store, [small], "disk")  # too small to be a bandwidth sample
    put_in(store, batch, "disk", size=size)
    try:
        check_results(store, [small], store.lease_many([small], math.inf))
        assert disk.unlinks_started.acquire(timeout=WAIT_S)  # one unlink held
        assert store.read_bandwidth()["disk"] is None
        disk.read_delay_s = 0.3
        check_results(store, batch, store.lease_many(batch, math.inf))
    finally:
        disk.unlink_gate.set()
    bw = store.read_bandwidth()["disk"]
    # two reads of 0.3 s at once: ~2 * size / 0.3 s; timed from the batch's start behind the
    # held unlink it was ~1 * size / 0.3 s (a wide margin: the two reads start together, give
    # or take a busy machine's scheduling)
    assert bw is not None and bw > 1.2 * size / 0.3, bw
    assert bw < 2 * size / 0.3


def test_a_batchs_read_time_is_the_union_of_its_reads_own_intervals() -> None:
    assert busy_seconds([]) == 0
    assert busy_seconds([(1.0, 2.0)]) == 1.0
    # two at once count once; a gap with none of them running (queued behind other work)
    # does not count at all
    assert busy_seconds([(0.0, 1.0), (0.5, 1.5), (3.0, 4.0), (3.2, 3.4)]) == 2.5
    assert busy_seconds([(3.0, 4.0), (0.0, 10.0)]) == 10.0


def test_close_is_safe_with_reads_and_unlinks_under_way(tmp_path: Path) -> None:
    # not a regression test: closing mid-batch neither hangs nor hands out closed bytes
    store, _, disk = make_store(tmp_path, read_threads=2)
    keys = [key(i) for i in range(4)]
    put_in(store, keys, "disk")
    disk.gate.clear()
    held = Background(lambda: store.lease_many(keys, math.inf))
    assert disk.wait_inside(2)
    store.close()
    disk.gate.set()
    with pytest.raises(TierUnavailable):
        held.result()
