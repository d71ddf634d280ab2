"""Signals a command takes over for a block, the handlers before put back after it.

``interrupts_held`` keeps a Ctrl-C off a short block that must not be torn, such as writing an
answer to the audit trail: a KeyboardInterrupt raised inside SQLAlchemy's commit can leave its
connection holding SQLite's write lock, so the row is lost and every later write in the
process waits out the busy timeout ("database is locked"). ``stop_signals`` turns the signals
that end a process into a stop event for long-running commands. ``wait_interruptibly`` waits
for calls on other threads so that a Ctrl-C is never held for the whole wait."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION, Future, wait
from contextlib import contextmanager
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")


@contextmanager
def on_sigint(handler: Callable[[int, FrameType | None], Any]) -> Iterator[None]:
    """``handler`` takes SIGINT for the block; the one in place before is put back after it.
    Outside the main thread (where no handler can be set, and none runs) or where the handler
    in place was set outside Python (not ours to swap), the block runs as is."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is None
    ):
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class ForcedInterrupt(KeyboardInterrupt):
    """A Ctrl-C pressed again while a held block was stuck: the operator asked to stop now, so
    nothing more is waited for, nor another write tried (it would be stuck the same way)."""


#: seconds after a held Ctrl-C from which another one is not held: the block is stuck (a
#: database write waiting on a lock), and the operator's second Ctrl-C stops it now
FORCE_AFTER_SECONDS = 2.0


@contextmanager
def interrupts_held(
    *, force_after_s: float = FORCE_AFTER_SECONDS, clock: Callable[[], float] = time.monotonic
) -> Iterator[None]:
    """A SIGINT during the block is noted and raised again once the block is over (also when
    it failed), for the handler in place before it (KeyboardInterrupt, a command's
    "interrupted: ..." line). A block that does not end (a write blocked on a lock) would hold
    it forever: a SIGINT ``force_after_s`` or more after the first one held raises
    :class:`ForcedInterrupt` at once, in the block; one sooner (a quick double press) is held too,
    and stderr says how to stop now."""
    pending: list[float] = []
    forced = False

    def held(signum: int, frame: FrameType | None) -> None:
        nonlocal forced
        now_s = clock()
        if pending and now_s - pending[0] >= force_after_s:
            forced = True
            raise ForcedInterrupt
        if pending and len(pending) == 1:  # once: said from a signal handler, so a raw write
            with contextlib.suppress(OSError):
                os.write(2, b"finishing a write first; Ctrl-C again in a moment to stop now\n")
        pending.append(now_s)

    try:
        with on_sigint(held):
            yield
    finally:
        if pending and not forced:
            signal.raise_signal(signal.SIGINT)


@contextmanager
def stop_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP set ``stop`` for the block, instead of ending a long-running
    command (the demo, the collector) halfway through; the handlers before are put back after
    it. SIGHUP too: a closed terminal must not leave a fleet running on its own."""
    previous = {}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # (one set outside Python cannot be put back from here)
                signal.signal(sig, handler)


#: the longest the main thread sleeps in one go in :func:`wait_interruptibly`, so the longest a
#: Ctrl-C waits to be seen there
INTERRUPT_CHECK_S = 0.1


#: released by a future's done-callback (see :func:`wait_interruptibly`): only the main thread
#: sleeps on it, so one lock serves every wait; a release by a future no longer waited for
#: (a wait before) only costs one more look at the futures
_WOKEN = threading.Lock()
_WOKEN.acquire()
#: the futures that have the callback releasing :data:`_WOKEN`: each gets it once, not once per
#: wait (a fan-out waits on its pending nodes again after each answer: thousands of callbacks
#: per future, each run when it finishes)
_BELLED: weakref.WeakSet[Future[Any]] = weakref.WeakSet()


def _wake(_: Future[Any]) -> None:
    with contextlib.suppress(RuntimeError):  # released already, not yet slept on
        _WOKEN.release()


def wait_interruptibly(
    futures: Iterable[Future[T]], timeout_s: float | None = None, return_when: str = ALL_COMPLETED
) -> tuple[set[Future[T]], set[Future[T]]]:
    """``concurrent.futures.wait`` (the futures done, those not), but on the main thread in
    sleeps of at most :data:`INTERRUPT_CHECK_S`. CPython runs a Python signal handler only
    between bytecodes: a SIGINT that arrives once the thread has let go of the GIL to sleep in
    a lock wait, and before it sleeps (on a loaded machine it can spend milliseconds there,
    waiting for the thread it handed the GIL to), wakes nothing, and its KeyboardInterrupt came
    only when the whole wait ended (up to a command's --timeout). The end of each short sleep
    runs it. The sleeps are on a lock of this module, not a ``threading.Condition``: an
    interrupt landing between a Condition's release of its lock and its wait left the lock
    released, and the ``with`` around it then raised RuntimeError instead of the
    KeyboardInterrupt."""
    fs = set(futures)
    if threading.current_thread() is not threading.main_thread():
        return wait(fs, timeout_s, return_when)  # no signal handler runs here
    end_s = None if timeout_s is None else time.monotonic() + timeout_s
    for f in fs:
        if f not in _BELLED:
            f.add_done_callback(_wake)
            _BELLED.add(f)
    while True:
        done = {f for f in fs if f.done()}
        left_s = None if end_s is None else end_s - time.monotonic()
        if _waited_for(done, fs, return_when) or (left_s is not None and left_s <= 0):
            return done, fs - done
        _WOKEN.acquire(
            timeout=INTERRUPT_CHECK_S if left_s is None else min(left_s, INTERRUPT_CHECK_S)
        )


def _waited_for(done: set[Future[T]], fs: set[Future[T]], return_when: str) -> bool:
    """Whether what ``return_when`` waits for has come."""
    if len(done) == len(fs):
        return True
    if return_when == FIRST_COMPLETED:
        return bool(done)
    if return_when == FIRST_EXCEPTION:
        return any(not f.cancelled() and f.exception() is not None for f in done)
    return False
