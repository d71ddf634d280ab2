"""A stand-in for cudaHostRegister/cudaHostUnregister where there is no GPU: it keeps the same
books CUDA keeps (registered ranges, pinned by whole pages) and refuses what CUDA refuses, so the
registry's and the gpu tier's bookkeeping can be tested on any machine."""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
from collections.abc import Iterator

from kvctl.store.tiers.hostreg import HostRegistrationError

PAGE = mmap.PAGESIZE


class FakeRegistrar:
    def __init__(self) -> None:
        self.live: dict[int, tuple[int, int]] = {}  # address -> (size_bytes, flags)
        self.calls: list[tuple[object, ...]] = []
        #: set to make the next register (or unregister) fail as the driver would
        self.refuse: str | None = None
        #: addresses of ranges that were no longer (wholly) mapped when unregistered: pages CUDA
        #: keeps locked that belong to no mapping any more. Must stay empty.
        self.unmapped_at_unregister: list[int] = []

    def register(self, address: int, size_bytes: int, flags: int) -> None:
        self.calls.append(("register", address, size_bytes, flags))
        if self.refuse is not None:
            raise HostRegistrationError(self.refuse)
        first, last = address // PAGE, (address + size_bytes - 1) // PAGE
        for a, (n, _flags) in self.live.items():
            if first <= (a + n - 1) // PAGE and a // PAGE <= last:
                raise HostRegistrationError(
                    "cudaHostRegister failed: part or all of the requested memory range is "
                    "already mapped (cudaError 712)"
                )
        self.live[address] = (size_bytes, flags)

    def unregister(self, address: int) -> None:
        self.calls.append(("unregister", address))
        if self.refuse is not None:
            raise HostRegistrationError(self.refuse)
        entry = self.live.pop(address, None)
        if entry is None:
            raise HostRegistrationError(
                "cudaHostUnregister failed: pointer does not correspond to a registered memory "
                "region (cudaError 713)"
            )
        if not mapped(address, entry[0]):
            self.unmapped_at_unregister.append(address)

    def count(self, what: str) -> int:
        return sum(1 for c in self.calls if c[0] == what)


def mapped(address: int, size_bytes: int) -> bool:
    """Whether every page of [address, address + size_bytes) is mapped in this process now (by
    /proc/self/maps, whose adjacent entries may split or merge a mapping)."""
    first, end = address // PAGE * PAGE, address + size_bytes
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(maxsplit=1)[0].split("-"))
            if lo < end and first < hi:
                spans.append((lo, hi))
    for lo, hi in sorted(spans):
        if lo > first:
            return False
        first = max(first, hi)
        if first >= end:
            return True
    return False


@contextlib.contextmanager
def shared_maps(size: int) -> Iterator[tuple[mmap.mmap, mmap.mmap]]:
    """A writable and a read-only (PROT_READ) mapping of one memfd, as the agent's arena and a
    client's view of it. Closed at the end (every export must be gone by then)."""
    fd = os.memfd_create("kvctl-test", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        rw = mmap.mmap(fd, size)
        ro = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        yield rw, ro
    finally:
        gc.collect()  # tensors held by the frames of a failed assertion
        rw.close()
        ro.close()
