"""An interrupt (a signal handler's exception, like KeyboardInterrupt) that lands while a detached
disk write waits to re-take the store's lock: the write is still committed or given back, then
the interrupt is raised. Before ``relocked``, the block that ends the write never ran: the key
stayed "being written", its bytes counted and its temp file left (found by review).

Signals are handled in the main thread, so the store call runs there and a helper thread holds
the lock, opens the write's gate and signals the main thread once it waits for the lock."""

from __future__ import annotations

import contextlib
import linecache
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

import pytest

from kvctl.store import relock as relock_module
from kvctl.store.relock import relocked
from tests.unit.test_store_detached_demotions import (
    WAIT_S,
    SlowDisk,
    check_invariants,
    data_of,
    full_store,
    key,
    pinned_full_store,
)


class Interrupt(BaseException):
    """What the signal handler raises in the main thread (like KeyboardInterrupt)."""


def _waiting_for_a_lock(frame: FrameType | None, caller: str) -> bool:
    """Whether the main thread is blocked taking a lock on behalf of ``caller``: the innermost
    frame stands on a line taking it, and a function named ``caller...`` is on the stack."""
    if frame is None:
        return False
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    taking = "lock" in line  # `with self._lock:`, `with relocked(...)`, `lock.acquire()`
    chain = []
    while frame is not None:
        chain.append(frame.f_code.co_name)
        frame = frame.f_back
    return taking and any(n.startswith(caller) for n in chain) and "__del__" not in chain


@contextmanager
def interrupted_at_relock(
    lock: threading.RLock, caller: str, ready: Callable[[], bool]
) -> Iterator[threading.Event]:
    """While the block runs in the main thread: once ``ready()`` (its detached write begun), a
    helper takes ``lock``, calls ``ready`` again to let the write finish, and signals the main
    thread until its handler raises Interrupt there, waiting for ``lock`` in ``caller``; then
    it lets the lock go. Yields the event set once the interrupt was raised."""
    main = threading.get_ident()
    raised = threading.Event()
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        if raised.is_set() or not _waiting_for_a_lock(frame, caller):
            return
        raised.set()
        raise Interrupt

    def helper() -> None:
        deadline_s = time.monotonic() + WAIT_S
        while not ready() and time.monotonic() < deadline_s and not stop.is_set():
            time.sleep(0.005)
        with lock:
            ready()  # the write may finish now; the main thread then waits for the lock
            # a signal that lands before the main thread blocks is handled only when it wakes:
            # send until handled
            while not raised.is_set() and time.monotonic() < deadline_s and not stop.is_set():
                signal.pthread_kill(main, signal.SIGUSR1)
                raised.wait(0.02)

    before = signal.signal(signal.SIGUSR1, handler)
    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    try:
        yield raised
    finally:
        stop.set()
        thread.join(WAIT_S)
        signal.signal(signal.SIGUSR1, before)


def _gate_opener(disk: SlowDisk) -> Callable[[], bool]:
    """``ready`` for a write held at ``disk``'s gate: first, whether it is held; then, with the
    lock taken, open the gate."""
    state = {"held": False}

    def ready() -> bool:
        if not state["held"]:
            state["held"] = disk.inside >= 1
            return state["held"]
        disk.gate.set()
        return True

    return ready


@contextmanager
def _while_a_helper_holds(lock: threading.RLock, caller: str) -> Iterator[threading.Event]:
    """``interrupted_at_relock`` whose block starts once the helper holds ``lock``."""
    taken = {"n": 0}

    def ready() -> bool:
        taken["n"] += 1
        return True

    with interrupted_at_relock(lock, caller, ready) as raised:
        deadline_s = time.monotonic() + WAIT_S
        while taken["n"] < 2 and time.monotonic() < deadline_s:
            time.sleep(0.001)
        yield raised


def test_relocked_runs_its_block_then_raises_an_interrupt_met_while_waiting() -> None:
    lock = threading.RLock()
    ran = []
    with (
        _while_a_helper_holds(lock, "test_relocked_runs_its_block") as raised,
        pytest.raises(Interrupt),
        relocked(lock),
    ):
        ran.append(lock._is_owned())  # type: ignore[attr-defined]
    assert raised.is_set() and ran == [True]
    assert not lock._is_owned()  # type: ignore[attr-defined]
    assert lock.acquire(timeout=WAIT_S)  # nobody holds it
    lock.release()


def test_a_plain_with_lock_is_cut_before_its_block_by_the_same_interrupt() -> None:
    """The control: what ``relocked`` guards against does happen with ``with lock:``."""
    lock = threading.RLock()
    ran = []
    # the lock taken on a line of its own: the handler knows the wait by the line it is on
    with _while_a_helper_holds(lock, "test_a_plain_with_lock_is_cut") as raised:  # noqa: SIM117
        with pytest.raises(Interrupt), lock:
            ran.append(True)
    assert raised.is_set() and ran == []


def test_a_put_to_disk_interrupted_while_it_retakes_the_lock_lands_whole(tmp_path: Path) -> None:
    store, _cpu, disk, keys = pinned_full_store(tmp_path)
    disk.gate.clear()
    new = key(9)
    with (
        interrupted_at_relock(store.locked(), "_land_put", _gate_opener(disk)) as raised,
        pytest.raises(Interrupt),
    ):
        store.put(new, data_of(new), tenant="t")
    assert raised.is_set()
    # its file was written: committed and indexed before the interrupt was raised
    assert store.entry(new).tier == "disk" and store.get(new, tenant="t") == data_of(new)
    assert store.put(key(10), data_of(key(10)), tenant="t") == "disk"  # the disk takes more
    store.unpin(keys)
    check_invariants(store)


def test_a_demotion_interrupted_while_it_retakes_the_lock_ends(tmp_path: Path) -> None:
    store, cpu, disk, keys = full_store(tmp_path)
    disk.gate.clear()
    new = key(9)
    with (
        interrupted_at_relock(store.locked(), "_finish_demotions", _gate_opener(disk)) as raised,
        pytest.raises(Interrupt),
    ):
        store.put(new, data_of(new), tenant="t")
    assert raised.is_set()
    # the victim's demotion landed; the put that made room for it was cut short
    assert store.entry(keys[0]).tier == "disk" and cpu.lease_count == 0
    assert new not in store
    assert store.put(new, data_of(new), tenant="t") == "cpu"
    check_invariants(store)


def test_reentrant_use_under_a_hail_of_interrupts_never_leaves_the_lock_held() -> None:
    """Found by review: the reentrant path took a level with ``acquire()`` outside its
    ``try``, so an interrupt handled right after it returned left the lock held for good
    (after 54-206 interrupts in three runs of this loop)."""
    lock = threading.RLock()
    main = threading.get_ident()
    stop = threading.Event()
    interrupts = 0
    harmful = {relock_module.__file__, contextlib.__file__}  # where an interrupt can do harm

    def handler(signum: int, frame: FrameType | None) -> None:
        if frame is not None and frame.f_code.co_filename in harmful:
            raise Interrupt

    def pinger() -> None:
        while not stop.is_set():
            signal.pthread_kill(main, signal.SIGUSR1)
            time.sleep(0.0002)

    before = signal.signal(signal.SIGUSR1, handler)
    thread = threading.Thread(target=pinger, daemon=True)
    thread.start()
    # 3 s, or longer (up to 30 s) on a loaded machine until the signals landed often enough
    started_s = time.monotonic()
    try:
        while interrupts < 1000 and (
            (elapsed_s := time.monotonic() - started_s) < 3.0
            or (elapsed_s < 30.0 and interrupts <= 200)
        ):
            try:
                try:
                    with lock, relocked(lock):  # as a release made under the store's lock
                        pass
                except Interrupt:
                    interrupts += 1
                assert not lock._is_owned(), f"the lock was left held after {interrupts} interrupts"  # type: ignore[attr-defined]
            except Interrupt:
                interrupts += 1
    finally:
        stop.set()
        thread.join(WAIT_S)
        signal.signal(signal.SIGUSR1, before)
    assert interrupts > 50  # the signals did land where they could do harm
    assert lock.acquire(timeout=WAIT_S)
    lock.release()
