"""interrupts_held: a Ctrl-C inside the block comes after it, to the handler that was there.
wait_interruptibly: concurrent.futures.wait, where a Ctrl-C caught while the main thread sleeps
comes at once, not when the wait ends."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future
from types import FrameType

import pytest

from kvctl.interrupts import interrupts_held, stop_signals, wait_interruptibly

#: a hang guard, never a timing claim
GUARD_S = 30.0


def test_a_sigint_inside_the_block_is_raised_after_it() -> None:
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt), interrupts_held():
        signal.raise_signal(signal.SIGINT)
        done.append("the rest of the block")
    assert done == ["the rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_handler_in_place_gets_the_held_sigint_once() -> None:
    seen: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        with interrupts_held():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # a second Ctrl-C in the block: one interrupt
            assert seen == []
        assert seen == [signal.SIGINT]
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, previous)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def test_a_later_sigint_stops_a_stuck_block_at_once(capfd: pytest.CaptureFixture[str]) -> None:
    """A block that does not end (a database write blocked on a lock) held the Ctrl-C for as
    long as it ran: a second one, a while after the first, now raises inside the block."""
    clock = Clock()
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt), interrupts_held(force_after_s=2.0, clock=clock):
        signal.raise_signal(signal.SIGINT)  # held
        clock.now_s = 0.5
        signal.raise_signal(signal.SIGINT)  # a quick double press: held, and told how to stop
        done.append("after the quick second press")
        clock.now_s = 2.5
        signal.raise_signal(signal.SIGINT)  # stuck: stops here
        done.append("never")
    assert done == ["after the quick second press"]
    assert "Ctrl-C again in a moment to stop now" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_forced_stop_is_one_interrupt() -> None:
    seen: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    clock = Clock()
    previous = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_held(clock=clock):
            signal.raise_signal(signal.SIGINT)
            clock.now_s = 5.0
            signal.raise_signal(signal.SIGINT)
        assert seen == []  # the held one is not raised again after the forced one
    finally:
        signal.signal(signal.SIGINT, previous)


def test_no_sigint_no_interrupt_and_the_handler_is_put_back() -> None:
    with interrupts_held():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_outside_the_main_thread_the_block_just_runs() -> None:
    # signal.signal works only in the main thread: the block must not fail there
    failures: list[BaseException] = []

    def run() -> None:
        try:
            with interrupts_held():
                pass
        except BaseException as exc:
            failures.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert failures == []


def test_stop_signals_set_the_event_and_put_the_handlers_back() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    stop = threading.Event()
    with stop_signals(stop):
        signal.raise_signal(signal.SIGTERM)  # a service manager's stop: no exception
        assert stop.is_set()
    assert {s: signal.getsignal(s) for s in before} == before


def _main_thread_asleep_in_wait_interruptibly() -> bool:
    """In its lock wait, or in threading's Condition.wait under it (as concurrent.futures.wait
    sleeps: what a check of this test against plain ``wait`` needs)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names[:1] in (["wait"], ["wait_interruptibly"]) and "wait_interruptibly" in names


def test_a_sigint_caught_while_the_main_thread_sleeps_comes_before_the_wait_ends() -> None:
    """Caught on another thread, Python's C handler wakes no sleeper: the same as on the main
    thread after it let go of the GIL to sleep and before it slept (the window in which a
    loaded CI machine held `kvctl top --json`'s Ctrl-C for its whole --timeout). The call
    waited for is let go only after GUARD_S: a KeyboardInterrupt that came with the wait's end
    finds it done."""
    call: Future[None] = Future()
    sent: list[bool] = []

    def take_sigint() -> None:
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            if _main_thread_asleep_in_wait_interruptibly():
                time.sleep(0.2)  # still there a moment later: asleep in its lock wait
                if _main_thread_asleep_in_wait_interruptibly():
                    signal.pthread_kill(threading.get_ident(), signal.SIGINT)
                    sent.append(True)
                    break
            time.sleep(0.01)
        time.sleep(GUARD_S if sent else 0)
        call.set_result(None)

    threading.Thread(target=take_sigint, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        wait_interruptibly([call], 4 * GUARD_S)
    assert sent and not call.done(), "the interrupt came only once the call ended"


def _set_later(fut: Future[int], value: int) -> None:
    threading.Timer(0.2, fut.set_result, (value,)).start()


def test_wait_interruptibly_waits_as_concurrent_futures_wait() -> None:
    a: Future[int] = Future()
    b: Future[int] = Future()
    _set_later(a, 1)
    done, not_done = wait_interruptibly([a, b], return_when=FIRST_COMPLETED)
    assert (done, not_done) == ({a}, {b})
    _set_later(b, 2)
    done, not_done = wait_interruptibly([a, b], GUARD_S)
    assert (done, not_done) == ({a, b}, set())
    stuck: Future[int] = Future()
    done, not_done = wait_interruptibly([a, stuck], 0.3)  # its timeout: what is done by then
    assert (done, not_done) == ({a}, {stuck})
    assert wait_interruptibly([stuck], 0) == (set(), {stuck})


def test_wait_interruptibly_off_the_main_thread_just_waits() -> None:
    fut: Future[int] = Future()
    out: list[set[Future[int]]] = []
    t = threading.Thread(target=lambda: out.append(wait_interruptibly([fut], GUARD_S)[0]))
    t.start()
    fut.set_result(3)
    t.join(GUARD_S)
    assert out == [{fut}]


class _CountingFuture(Future[int]):
    """A future that counts the done-callbacks it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.callbacks = 0

    def add_done_callback(self, fn: Callable[[Future[int]], object]) -> None:
        self.callbacks += 1
        super().add_done_callback(fn)


def test_waiting_again_on_a_future_adds_no_callback_to_it() -> None:
    """A fan-out waits on its pending nodes again after each answer: a callback per wait left
    each future of thousands of nodes with thousands of callbacks, all run when it finished."""
    pending = [_CountingFuture() for _ in range(3)]
    for _ in range(50):
        assert wait_interruptibly(pending, 0, FIRST_COMPLETED) == (set(), set(pending))
    assert [f.callbacks for f in pending] == [1, 1, 1]
    _set_later(pending[1], 7)  # and each still ends a wait when it finishes
    assert wait_interruptibly(pending, GUARD_S, FIRST_COMPLETED)[0] == {pending[1]}
