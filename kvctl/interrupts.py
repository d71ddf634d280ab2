"""Signals a command takes over for a block, the handlers before put back after it.

``interrupts_held`` keeps a Ctrl-C off a short block that must not be torn, such as writing an
answer to the audit trail: a KeyboardInterrupt raised inside SQLAlchemy's commit can leave its
connection holding SQLite's write lock, so the row is lost and every later write in the
process waits out the busy timeout ("database is locked"). ``stop_signals`` turns the signals
that end a process into a stop event for long-running commands."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


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


@contextmanager
def interrupts_held() -> Iterator[None]:
    """A SIGINT during the block is noted and raised again once the block is over (also when
    it failed), for the handler in place before it (KeyboardInterrupt, a command's
    "interrupted: ..." line)."""
    pending: list[int] = []
    try:
        with on_sigint(lambda signum, frame: pending.append(signum)):
            yield
    finally:
        if pending:
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
