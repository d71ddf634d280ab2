"""Transparent huge pages (2 MiB) under the cpu tier's shared arena.

The shared arena is a memfd, so it lives in shmem, and Linux gives shmem huge pages only as
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` says (``never`` by default). On 4 KiB
pages an engine's copy out of the arena took 4-25% longer than out of huge ones on the 2-core VM
this was measured on (the engine's copy of 4-64 MiB, caches flushed, interleaved samples, seven
runs: slower in every one; on huge pages it matched a copy out of process memory). A serving
engine reads the arena at memory or link speed, so it pays that on every fetch.

Under ``advise`` an arena gets huge pages only when its pages are faulted in through a mapping
marked ``MADV_HUGEPAGE``: ``posix_fallocate`` (how the arena's memory is committed otherwise)
allocates small ones. ``commit`` therefore commits through the mapping, marked, wherever huge
pages are allowed (``MADV_POPULATE_WRITE``: the agent's mapping is then whole at once, so what
it maps on huge pages can be read at start), and through ``posix_fallocate`` under ``never``
and ``deny``, or where the populate fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from pathlib import Path

from kvctl.store.tiers.prefault import MADV_POPULATE_WRITE, madvise_fn

THP_ROOT = Path("/sys/kernel/mm/transparent_hugepage")
#: the setting that makes them: an operator turns them on with
#: ``echo advise > /sys/kernel/mm/transparent_hugepage/shmem_enabled`` (root; not persistent)
SHMEM_SETTING = THP_ROOT / "shmem_enabled"
#: the modes under which shmem gets huge pages (``advise``: where a mapping asks for them)
HUGE_MODES = ("always", "within_size", "advise", "force")


def shmem_mode(root: Path = THP_ROOT) -> str | None:
    """The kernel's huge-page mode for a memfd: the global ``shmem_enabled`` (the per-size ones
    of Linux 6.11+, ``hugepages-*/shmem_enabled``, apply to anonymous shared mappings only, not
    to tmpfs files such as a memfd). None where it cannot be read (not Linux, no THP)."""
    return _selected(root / "shmem_enabled")


def _selected(path: Path) -> str | None:
    """The bracketed word of a sysfs choice file (``always [advise] never``)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def advise(mapping: mmap.mmap) -> None:
    """Ask for huge pages under ``mapping`` (a hint: refused or without effect, nothing
    changes)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and len(mapping) > 1:
        with contextlib.suppress(OSError, ValueError):
            mapping.madvise(advice)


def commit(
    mapping: mmap.mmap, fd: int, size_bytes: int, *, mode: str | None = None, huge: bool = True
) -> bool:
    """Commit the memfd ``fd``'s first ``size_bytes`` (``mapping`` maps them writable): a short
    shm or RAM budget is then an OSError now (ENOSPC from ``posix_fallocate``), not a SIGBUS on
    some later write. Wherever the kernel allows huge pages (``HUGE_MODES``) it commits through
    ``mapping``, marked for them, so that they are huge; ``huge=False`` never does, for a caller
    that must be quick. True when ``mapping`` was populated that way (its page tables are then
    built)."""
    mode = shmem_mode() if mode is None else mode
    if huge and mode in HUGE_MODES:
        advise(mapping)
        if _populate_write(mapping, size_bytes):
            return True
    # never, deny (no huge pages), or the populate failed (an old kernel, or not enough
    # memory: fallocate then says which)
    os.posix_fallocate(fd, 0, size_bytes)
    return False


def committed_huge_bytes(mapping: mmap.mmap, populated: bool, mode: str | None) -> int | None:
    """Bytes of an arena on huge pages once ``commit`` returned ``populated`` under ``mode``:
    read from smaps where the mapping was populated (it is whole, so the figure is the arena's);
    0 where ``posix_fallocate`` could only allocate small pages; None where it may have
    allocated huge ones that no mapping shows yet (``always``, ``within_size``, ``force``)."""
    if populated:
        return huge_bytes(mapping)
    return 0 if mode not in HUGE_MODES or mode == "advise" else None


def anonymous_region(size_bytes: int) -> mmap.mmap:
    """Anonymous memory of this process only (MAP_SHARED would be shmem), asking for huge pages:
    its 2 MiB faults make fresh memory about as fast as memory used before."""
    region = mmap.mmap(-1, size_bytes, flags=mmap.MAP_PRIVATE)
    advise(region)
    return region


def _populate_write(mapping: mmap.mmap, size_bytes: int) -> bool:
    """``madvise(MADV_POPULATE_WRITE)`` over the mapping's first bytes, through ctypes so the
    GIL is free meanwhile (an arena of tens of GiB takes seconds to zero)."""
    madvise = madvise_fn()
    if madvise is None:
        return False
    from kvctl.store.tiers.hostreg import buffer_address

    with memoryview(mapping) as view:
        rc = madvise(ctypes.c_void_p(buffer_address(view)), size_bytes, MADV_POPULATE_WRITE)
    return rc == 0


def huge_bytes(mapping: mmap.mmap, smaps: Path = Path("/proc/self/smaps")) -> int | None:
    """Bytes of ``mapping`` this process maps with huge pages (None where unreadable)."""
    return smaps_bytes(mapping, "ShmemPmdMapped", "FilePmdMapped", "AnonHugePages", smaps=smaps)


def smaps_bytes(
    mapping: mmap.mmap, *fields: str, smaps: Path = Path("/proc/self/smaps")
) -> int | None:
    """The sum of ``fields`` (e.g. ``Rss``) over the kernel's entries for ``mapping`` in
    ``smaps`` (None where it cannot be read). An entry reaching past the mapping counts whole:
    exact for a file's mapping such as the arena's (never merged with a neighbour's entry), an
    upper bound for anonymous memory."""
    lines = _entry_lines(mapping, smaps)
    if lines is None:
        return None
    wanted = {f"{name}:" for name in fields}
    return sum(int(line.split()[1]) for line in lines if line.split()[0] in wanted) << 10


def vm_flags(mapping: mmap.mmap, smaps: Path = Path("/proc/self/smaps")) -> set[str] | None:
    """The kernel's flags for ``mapping`` (smaps' ``VmFlags``: ``hg`` once it is marked
    ``MADV_HUGEPAGE``); None where they cannot be read."""
    lines = _entry_lines(mapping, smaps)
    if lines is None:
        return None
    return {flag for line in lines if line.startswith("VmFlags:") for flag in line.split()[1:]}


def _entry_lines(mapping: mmap.mmap, smaps: Path) -> list[str] | None:
    """The field lines of the smaps entries overlapping ``mapping``."""
    from kvctl.store.tiers.hostreg import buffer_address

    try:
        with memoryview(mapping) as view:
            start = buffer_address(view)
        text = smaps.read_text()
    except (OSError, ValueError, BufferError):
        return None
    end = start + len(mapping)
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in head and ":" not in head:  # an entry's first line: "start-end perms ..."
            lo, _, hi = head.partition("-")
            try:
                inside = int(lo, 16) < end and int(hi, 16) > start
            except ValueError:
                inside = False
        elif inside and head:
            out.append(line)
    return out


__all__ = [
    "HUGE_MODES",
    "SHMEM_SETTING",
    "advise",
    "anonymous_region",
    "commit",
    "committed_huge_bytes",
    "huge_bytes",
    "shmem_mode",
    "smaps_bytes",
    "vm_flags",
]
