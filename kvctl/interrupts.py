"""Ctrl-C held off for the length of a short block that must not be torn, such as writing an
answer to the audit trail: a KeyboardInterrupt raised inside SQLAlchemy's commit can leave its
connection holding SQLite's write lock, so the row is lost and every later write in the
process waits out the busy timeout ("database is locked")."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def interrupts_held() -> Iterator[None]:
    """A SIGINT during the block is noted and raised again once the block is over, for the
    handler in place before it (KeyboardInterrupt, a command's "interrupted: ..." line).
    Outside the main thread, where no signal handler runs, the block runs as is."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is None  # set outside Python: not ours to swap
    ):
        yield
        return
    pending: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            signal.raise_signal(signal.SIGINT)
