"""Re-taking the store's lock to end work begun without it, through interrupts.

A detached disk write, read or demotion is begun under the store's lock, runs without it, and
must be ended under it again (its slot committed or given back, its read ended, its demotion
landed or undone). Python runs signal handlers in the main thread while it waits for a lock, so
a KeyboardInterrupt (or any handler's exception) could land in that wait: a plain ``with lock:``
then never runs its block, and the key stays "being written" for good, its bytes counted and its
temp file left. ``relocked`` holds such an interrupt back until the block has run, then raises
it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


def _owned(lock: threading.RLock) -> bool:
    """Whether this thread holds ``lock`` (what ``threading.Condition`` asks; not in the stubs)."""
    return bool(lock._is_owned())  # type: ignore[attr-defined]


@contextlib.contextmanager
def relocked(lock: threading.RLock) -> Iterator[None]:
    """``with lock:`` for a block that ends what was begun without the lock: an exception
    raised in this thread while it waits for the lock (a signal handler's) is raised once the
    block has run and the lock is released. Reentrant use (the lock already held) is a plain
    acquire."""
    interrupt: BaseException | None = None
    if _owned(lock):
        lock.acquire()  # held already: returns at once
    else:
        while True:
            try:
                # owned also where the exception came between acquire's return and this check
                while not _owned(lock):
                    lock.acquire()
                break
            except BaseException as exc:
                interrupt = interrupt or exc
    try:
        yield
    finally:
        lock.release()
        if interrupt is not None:
            raise interrupt  # a failure of the block itself stays as its __context__
