"""A shared cpu arena's pages are faulted into the agent's mapping ahead of the puts that write
them (``kvctl.store.tiers.prefault``): how far is checked through the kernel's own count of the
mapping's resident pages (/proc/self/smaps), never by timing; the bytes stored are unchanged,
and a resize or close while it runs loses nothing."""

from __future__ import annotations

import mmap
import os
import sys

import pytest

from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.hugepages import smaps_bytes
from kvctl.store.tiers.prefault import MADV_POPULATE_READ, Prefaulter

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="shared arenas and smaps are Linux only"
)
MIB = 1 << 20


def _rss_bytes(arena: mmap.mmap) -> int:
    """Resident bytes of the mapping holding ``arena`` (its smaps entry)."""
    rss = smaps_bytes(arena, "Rss")
    assert rss is not None, "smaps unreadable"
    return rss


def _supported(p: Prefaulter) -> None:
    p.join(30)
    if p.failed:
        pytest.skip(f"this kernel cannot prefault: {p.failed}")


def test_pages_ahead_of_the_puts_are_mapped_and_the_bytes_are_unchanged() -> None:
    t = CpuTier(64 * MIB, shared=True)
    prefault = t._prefault
    assert prefault is not None
    prefault.ahead_bytes = 8 * MIB
    data = bytes(range(256)) * (MIB // 256)
    t.put(ChunkMeta(b"k" * 16, MIB), data)
    _supported(prefault)
    # AHEAD_BYTES from the start (at creation), then at least 8 MiB past the put
    assert prefault.populated_bytes >= min(64 * MIB, 9 * MIB)
    assert _rss_bytes(t._arena) >= prefault.populated_bytes
    assert t.get(b"k" * 16) == data
    t.close()


def test_only_the_asked_for_range_is_mapped() -> None:
    fd = os.memfd_create("prefault-test")
    os.ftruncate(fd, 32 * MIB)
    os.posix_fallocate(fd, 0, 32 * MIB)
    arena = mmap.mmap(fd, 32 * MIB)
    p = Prefaulter(arena, ahead_bytes=4 * MIB)
    p.want(2 * MIB)
    _supported(p)
    assert p.populated_bytes == 6 * MIB
    assert 6 * MIB <= _rss_bytes(arena) < 32 * MIB  # nothing past it was touched
    assert bytes(arena[: 6 * MIB]) == bytes(6 * MIB)  # faulted in, not written
    p.want(100 * MIB)  # capped at the arena's end
    _supported(p)
    assert p.populated_bytes == 32 * MIB
    p.stop()
    p.want(0)  # stopped: asks nothing more
    arena.close()
    os.close(fd)


def test_a_read_only_mapping_is_populated_without_a_write() -> None:
    # an engine's view of the agent's arena: the agent wrote a chunk, the engine only reads
    fd = os.memfd_create("prefault-read-test")
    os.ftruncate(fd, 16 * MIB)
    os.posix_fallocate(fd, 0, 16 * MIB)
    writer = mmap.mmap(fd, 16 * MIB)
    writer[MIB : 2 * MIB] = bytes([9]) * MIB
    reader = mmap.mmap(fd, 16 * MIB, prot=mmap.PROT_READ)
    assert _rss_bytes(reader) < 4 * MIB
    p = Prefaulter(reader, ahead_bytes=8 * MIB, advice=MADV_POPULATE_READ)
    p.want(0)
    _supported(p)
    assert p.populated_bytes == 8 * MIB
    assert 8 * MIB <= _rss_bytes(reader) < 16 * MIB
    assert reader[MIB : 2 * MIB] == bytes([9]) * MIB and reader[0:MIB] == bytes(MIB)
    reader.close()
    writer.close()
    os.close(fd)


def test_a_resize_or_close_while_it_runs_loses_nothing() -> None:
    t = CpuTier(256 * MIB, shared=True)
    chunk = bytes([7]) * MIB
    for i in range(4):
        t.put(ChunkMeta(i.to_bytes(16, "little"), MIB), chunk)
    old = t._prefault
    t.resize(128 * MIB)  # a new arena: the old one's prefaulter stops, a new one starts
    assert old is not None and t._prefault is not None and t._prefault is not old
    assert all(t.get(i.to_bytes(16, "little")) == chunk for i in range(4))
    t.close()  # while its thread may still be populating: the unmap waits for it
    old.join(30)
    assert t._prefault is not None
    t._prefault.join(30)


def test_a_private_arena_is_not_prefaulted() -> None:
    # its pages are not committed at start: faulting them ahead would take memory
    assert CpuTier(8 * MIB)._prefault is None


def test_a_resize_waits_for_the_prefault_step_in_flight_and_unmaps_the_old_arena(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A resize stopped the old arena's prefaulter without waiting for its step in flight,
    which holds an export of the arena: the old arena's release then failed (BufferError) and
    left it mapped until that thread let go (a full CI run's gpu-tier test found it open). The
    step is held at a gate the resize's own thread cannot open; a timer opens it."""
    import threading

    from kvctl.store.tiers import prefault

    real = prefault.madvise_fn()
    if real is None:
        pytest.skip("no madvise in this C library")
    gate, inside = threading.Event(), threading.Event()

    def held(*args: object) -> int:
        inside.set()
        gate.wait(30)
        return real(*args)

    monkeypatch.setattr(prefault, "madvise_fn", lambda: held)
    t = CpuTier(64 * MIB, shared=True)
    try:
        t.put(ChunkMeta(b"k" * 16, 4096, 1), bytes(4096))
        assert inside.wait(30), "the prefaulter never ran"
        old, _ = t.arena_mapping()
        timer = threading.Timer(0.5, gate.set)  # opens it while the resize waits, if it does
        timer.start()
        t.resize(32 * MIB)
        timer.join()
        assert old.closed  # released once the step let go of it, not left mapped
    finally:
        gate.set()
        t.close()
