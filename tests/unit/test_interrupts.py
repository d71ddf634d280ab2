"""interrupts_held: a Ctrl-C inside the block comes after it, to the handler that was there."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import pytest

from kvctl.interrupts import interrupts_held, stop_signals


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
