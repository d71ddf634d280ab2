"""Faulting a shared arena's pages into the agent's mapping ahead of the puts that write them.

The cpu tier's shared arena is a memfd whose pages are committed at start (``posix_fallocate``),
but the agent's mapping of it starts empty: the first write to each 4 KiB page takes a page
fault. On the machines measured that fault costs more than the copy (on a 2-core VM, 64 MiB
into untouched arena pages took 40-52 ms, into touched ones 9-11 ms), so a fresh agent stored
new chunks at a fraction of memcpy speed until its arena had been written once.

``Prefaulter`` keeps the mapping populated ``ahead_bytes`` past the furthest byte a put has
asked for, from a background thread (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+, through
ctypes so the GIL is free while the kernel works). It only maps pages the memfd already holds:
it writes nothing and commits no memory (page tables only). Where the kernel lacks the call it
stops at once and puts fault as before. Each call holds an export of the arena, so the mapping
cannot be unmapped under it (a tier closing meanwhile leaves the unmap to the last export).

An engine's read-only mapping of the same arena starts empty too, and its first read of each
page faults (64 MiB at 16k tokens of the TTFT bench's model: the first fetch ran at about half
the speed of the next): it populates that mapping the same way with ``MADV_POPULATE_READ``.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable
from typing import cast

from kvctl.store.tiers.hostreg import buffer_address

#: madvise(2) advice: populate (prefault) page tables readable / writable (Linux 5.14)
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23
_ADVICE_NAMES = {
    MADV_POPULATE_READ: "MADV_POPULATE_READ",
    MADV_POPULATE_WRITE: "MADV_POPULATE_WRITE",
}
#: how far past the furthest requested byte the mapping is kept populated
AHEAD_BYTES = 256 << 20
#: bytes populated per call (so a close or a stop is noticed between calls)
STEP_BYTES = 32 << 20

_libc: ctypes.CDLL | None = None


def madvise_fn() -> Callable[..., int] | None:
    global _libc
    if _libc is None:
        try:
            # the process's own symbols, where libc is: ctypes.util.find_library would run
            # ldconfig in a subprocess (writing /dev/null), which the agent's sandbox forbids
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return None
    fn = getattr(_libc, "madvise", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast("Callable[..., int]", fn)


class Prefaulter:
    """Populates ``arena``'s pages up to ``want(end) + ahead_bytes``; ``populated_bytes`` says
    how far it got. One short-lived thread at a time, started by ``want``, gone when caught up.
    ``advice``: ``MADV_POPULATE_READ`` for a read-only mapping."""

    def __init__(
        self, arena: mmap.mmap, *, ahead_bytes: int = AHEAD_BYTES, advice: int = MADV_POPULATE_WRITE
    ) -> None:
        self._arena = arena
        self._advice = advice
        self._size = len(arena)
        self.ahead_bytes = ahead_bytes
        self._lock = threading.Lock()
        self._target = 0
        self.populated_bytes = 0
        self._thread: threading.Thread | None = None
        self._stopped = False
        #: why populating stopped early ("" while it works)
        self.failed = ""

    def want(self, end: int) -> None:
        """Bytes up to ``end`` are being written: keep ``ahead_bytes`` past it populated."""
        target = min(self._size, end + self.ahead_bytes)
        with self._lock:
            if self._stopped or target <= self._target:
                return
            self._target = target
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvctl-arena-prefault", daemon=True
                )
                self._thread.start()

    def stop(self) -> None:
        """Populate no further (the arena is being replaced or closed)."""
        with self._lock:
            self._stopped = True

    def close(self) -> None:
        """``stop``, and wait for the call in flight (one step at most): it holds an export of
        the arena, so whoever unmaps the arena next (a client closing, or mapping it anew)
        could not while it runs, and the mapping would outlive them."""
        self.stop()
        self.join()

    def join(self, timeout_s: float | None = None) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        madvise = madvise_fn()
        while True:
            with self._lock:
                start, target = self.populated_bytes, self._target
                if self._stopped or start >= target or madvise is None:
                    if madvise is None:
                        self.failed = "no madvise in this C library"
                        self._stopped = True
                    self._thread = None
                    return
            end = min(target, start + STEP_BYTES)
            try:
                with memoryview(self._arena) as whole, whole[start:end] as part:
                    rc = madvise(ctypes.c_void_p(buffer_address(part)), end - start,
                                 self._advice)  # fmt: skip
            except (ValueError, BufferError):  # the arena was closed meanwhile
                rc, err = -1, 0
            else:
                err = ctypes.get_errno() if rc else 0
            with self._lock:
                if rc != 0:
                    advice = _ADVICE_NAMES.get(self._advice, self._advice)
                    self.failed = f"madvise({advice}) failed (errno {err})"
                    self._stopped = True
                    self._thread = None
                    return
                self.populated_bytes = end
