"""kvctl.daemon_pool.DaemonPool: calls past ``max_workers`` wait for a thread, in the order
submitted; with ``overflow_after_s``, one that has waited that long gets a thread of its own, up
to ``max_threads``, and those extra threads end once idle; a pool whose calls never wait makes
no more threads than before; shutting it cancels the calls not started. Gates, not timings:
each call runs until the test opens its gate."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, wait
from functools import partial
from typing import Any

import pytest

from kvctl.daemon_pool import DaemonPool

#: a hang guard, never a timing claim
GUARD_S = 30.0


class Gates:
    """Calls that each note they started and run until their gate opens."""

    def __init__(self, count: int) -> None:
        self.started = [threading.Event() for _ in range(count)]
        self.gates = [threading.Event() for _ in range(count)]

    def call(self, i: int) -> int:
        self.started[i].set()
        assert self.gates[i].wait(GUARD_S), "a gate the test forgot to open"
        return i

    def open_all(self) -> None:
        for g in self.gates:
            g.set()


def until(check: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + GUARD_S
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def overflow_watchers(name: str) -> int:
    return sum(t.name == f"{name}-overflow" and t.is_alive() for t in threading.enumerate())


def test_without_overflow_a_call_waits_for_one_of_the_threads() -> None:
    pool = DaemonPool(2, "t-plain")
    gates = Gates(3)
    futures = [pool.submit(gates.call, i) for i in range(3)]
    try:
        assert gates.started[0].wait(GUARD_S) and gates.started[1].wait(GUARD_S)
        assert (pool.threads, pool.queued) == (2, 1)  # the third waits, however long
        assert overflow_watchers("t-plain") == 0
        gates.gates[0].set()
        assert gates.started[2].wait(GUARD_S)  # on the thread the first left
        assert pool.threads == 2
        gates.open_all()
        assert [f.result(GUARD_S) for f in futures] == [0, 1, 2]
    finally:
        gates.open_all()
        pool.shutdown()


def test_a_call_that_waited_gets_a_thread_of_its_own_up_to_the_bound_and_those_end_idle() -> None:
    pool = DaemonPool(2, "t-over", overflow_after_s=0.01, max_threads=4, idle_s=0.05)
    gates = Gates(5)
    futures = [pool.submit(gates.call, i) for i in range(5)]
    try:
        # the first two on the pool's threads; the next two, once they waited, on their own
        for i in range(4):
            assert gates.started[i].wait(GUARD_S), i
        # the bound: the fifth waits for a thread to come free, however long
        assert (pool.threads, pool.queued) == (4, 1)
        assert not gates.started[4].is_set()
        gates.gates[0].set()
        assert gates.started[4].wait(GUARD_S)
        gates.open_all()
        assert [f.result(GUARD_S) for f in futures] == [0, 1, 2, 3, 4]
        # the threads past max_workers end once idle; the pool's own stay
        assert until(lambda: pool.threads == 2), pool.threads
        assert until(lambda: overflow_watchers("t-over") == 0)
        time.sleep(0.2)  # four idle times: still the pool's two
        assert pool.threads == 2
        # and a call that does not wait runs on them
        assert pool.submit(lambda: "again").result(GUARD_S) == "again"
        assert pool.threads == 2
    finally:
        gates.open_all()
        pool.shutdown()


def test_calls_that_never_wait_make_no_thread_past_those_of_before() -> None:
    pool = DaemonPool(4, "t-healthy", overflow_after_s=60.0, max_threads=256)
    try:
        for i in range(50):  # one at a time
            assert pool.submit(lambda i=i: i).result(GUARD_S) == i
        futures = [pool.submit(lambda i=i: i) for i in range(200)]  # queued a moment
        assert [f.result(GUARD_S) for f in futures] == list(range(200))
        assert 1 <= pool.threads <= 4  # max_workers, as before: none of their own
        # the watcher of calls waiting ends once none waits (here: long before it was due)
        assert until(lambda: overflow_watchers("t-healthy") == 0)
    finally:
        pool.shutdown()


def test_shutting_a_pool_cancels_the_calls_not_started_and_lets_those_under_way_end() -> None:
    pool = DaemonPool(1, "t-shut", overflow_after_s=60.0)
    gates = Gates(3)
    futures = [pool.submit(gates.call, i) for i in range(3)]
    assert gates.started[0].wait(GUARD_S)
    pool.shutdown()  # returns at once: the first call is not waited for
    assert futures[1].cancelled() and futures[2].cancelled()
    with pytest.raises(CancelledError):
        futures[1].result(0)
    with pytest.raises(RuntimeError, match="the t-shut pool is closed"):
        pool.submit(gates.call, 0)
    gates.open_all()
    assert futures[0].result(GUARD_S) == 0
    assert until(lambda: pool.threads == 0)
    assert not gates.started[1].is_set() and not gates.started[2].is_set()


def test_the_threads_are_daemons_and_a_failing_call_is_its_futures_exception() -> None:
    pool = DaemonPool(2, "t-daemon")
    seen: list[bool] = []

    def boom() -> None:
        seen.append(threading.current_thread().daemon)
        raise ValueError("boom")

    try:
        with pytest.raises(ValueError, match="boom"):
            pool.submit(boom).result(GUARD_S)
        assert seen == [True]
        assert pool.submit(lambda: 1).result(GUARD_S) == 1  # the thread lives on
    finally:
        pool.shutdown()


@pytest.mark.parametrize("seed", range(30))
def test_a_pool_under_submits_from_many_threads_completes_or_cancels_every_poll(seed: int) -> None:
    """Invariants of ``DaemonPool`` with real threads (first written for the router followers'
    own pool, which it replaced): polls submitted from several threads at once (some failing),
    threads handed polls as others come free, and (odd seeds) a shutdown racing the submits.
    Every future ends (a result, the poll's error, or cancelled: none left
    waiting), a poll that raises leaves its thread serving the next, no more than
    ``max_threads`` polls run at once, no poll runs twice, and no thread is left once the pool
    is shut."""
    lane = DaemonPool(
        2, "kvctl-test-pool", overflow_after_s=0.0 if seed % 3 == 0 else None, max_threads=5
    )
    lock = threading.Lock()
    running: set[int] = set()
    ran: list[int] = []
    peak = [0]

    def poll(i: int) -> int:
        with lock:
            assert i not in running
            running.add(i)
            peak[0] = max(peak[0], len(running))
            ran.append(i)
        time.sleep(0.0005 * (i % 3))
        with lock:
            running.discard(i)
        if i % 7 == 0:
            raise ValueError(f"poll {i} failed")
        return i

    submitted: list[tuple[int, Any]] = []
    go = threading.Event()

    def submitter(k: int) -> None:
        go.wait(30)
        for j in range(60):
            i = k * 1000 + j
            try:
                submitted.append((i, lane.submit(partial(poll, i))))
            except RuntimeError:  # the pool is shut: said so, nothing queued
                return

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    go.set()
    if seed % 2:
        assert until(lambda: len(submitted) >= 10 * (seed % 5 + 1)), "too few polls submitted"
        lane.shutdown()
    for t in threads:
        t.join(30)
    if not seed % 2:
        for _, f in submitted:
            f.exception(30)  # none cancelled: wait for each to run
        lane.shutdown()
    assert not [t for t in threads if t.is_alive()]
    # shutdown waits for no call under way: those end on their own, each within the guard
    wait([f for _, f in submitted], timeout=GUARD_S)
    for i, f in submitted:
        assert f.done(), f"poll {i} never ended"
        if f.cancelled():
            assert seed % 2 and i not in ran
        elif i % 7 == 0:
            assert isinstance(f.exception(), ValueError)
        else:
            assert f.result() == i
    assert len(ran) == len(set(ran)) and peak[0] <= 5
    # shut: each thread ends once its call is over
    assert until(lambda: lane.threads == 0)
    assert until(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("kvctl-test-pool")]
    )


def test_a_call_cancelled_by_shutdown_ends_every_wait_for_it() -> None:
    """concurrent.futures.wait() counts a cancelled future done only once it is notified (an
    executor does that as it meets it): shutdown's cancelled calls were not, so the router
    followers' stop(), waiting for its polls, waited for ever on those it cancelled."""
    pool = DaemonPool(1, "kvctl-test-cancel")
    gates = Gates(3)
    futures = [pool.submit(gates.call, i) for i in range(3)]
    assert gates.started[0].wait(GUARD_S)
    pool.shutdown()
    gates.open_all()
    _, not_done = wait(futures, timeout=GUARD_S)
    assert not not_done and futures[0].result() == 0
    assert futures[1].cancelled() and futures[2].cancelled()


def test_a_done_callback_of_a_call_cancelled_by_shutdown_may_call_the_pool() -> None:
    """A cancelled future runs its done callbacks as it is cancelled and notified: shutdown did
    that holding the pool's lock, so a callback that asked the pool anything (its queue, a
    submit of a follow-up call) waited for that lock for ever, and shutdown with it. The calls
    are cancelled once the lock is let go: the callback is answered (a submit refused: the
    pool is closed)."""
    pool = DaemonPool(1, "kvctl-test-callback")
    gates = Gates(2)
    running = pool.submit(gates.call, 0)
    assert gates.started[0].wait(GUARD_S)
    queued = pool.submit(gates.call, 1)
    told: list[object] = []

    def follow_up(fut: Any) -> None:
        told.append(pool.queued)
        try:
            pool.submit(gates.call, 1)
        except RuntimeError as exc:
            told.append(str(exc))

    queued.add_done_callback(follow_up)
    shutting = threading.Thread(
        target=pool.shutdown, name="kvctl-test-callback-shutdown", daemon=True
    )
    shutting.start()
    shutting.join(GUARD_S)
    stuck = shutting.is_alive()
    gates.open_all()
    assert not stuck, "shutdown hung in the cancelled call's done callback"
    assert told == [0, "the kvctl-test-callback pool is closed"]
    assert queued.cancelled() and running.result(GUARD_S) == 0
    assert until(lambda: pool.threads == 0)
