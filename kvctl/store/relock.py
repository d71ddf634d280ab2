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
    block has run and the lock is released. Where this thread holds the lock already, the
    block just runs."""
    if _owned(lock):
        # held already, and only this thread can let it go: take nothing (an acquire here
        # would count a level that an interrupt right after it leaves held for good)
        yield
        return
    interrupt: BaseException | None = None
    try:
        # owned also where an exception came between acquire's return and this check
        while not _owned(lock):
            try:
                lock.acquire()
            except BaseException as exc:
                interrupt = interrupt or exc
        yield
    finally:
        if _owned(lock):  # not where a second interrupt cut the wait itself
            lock.release()
        if interrupt is not None:
            raise interrupt  # a failure of the block itself stays as its __context__
