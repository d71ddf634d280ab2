"""Huge pages under the shared arena (``kvctl.store.tiers.hugepages``): the kernel's mode read
from sysfs files as Linux writes them, the commit that takes the huge-page path where the mode
allows it, and the bytes a mapping holds on huge pages as the kernel counts them (smaps)."""

from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest

from kvctl.store.tiers import hugepages
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.hostreg import buffer_address

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and smaps")
#: MADV_HUGEPAGE is refused (and marks nothing) by a kernel built without huge pages
thp = pytest.mark.skipif(not hugepages.THP_ROOT.exists(), reason="a kernel without THP")
MIB = 1 << 20


def _sysfs(root: Path, global_mode: str | None, per_size: str | None) -> Path:
    if global_mode is not None:
        root.mkdir(parents=True, exist_ok=True)
        words = ["always", "within_size", "advise", "never", "deny", "force"]
        text = " ".join(f"[{w}]" if w == global_mode else w for w in words)
        (root / "shmem_enabled").write_text(text + "\n")
    if per_size is not None:
        (root / "hugepages-2048kB").mkdir(parents=True, exist_ok=True)
        words = ["always", "inherit", "within_size", "advise", "never"]
        text = " ".join(f"[{w}]" if w == per_size else w for w in words)
        (root / "hugepages-2048kB" / "shmem_enabled").write_text(text + "\n")
    return root


@pytest.mark.parametrize(
    ("global_mode", "per_size", "expected"),
    [
        ("never", None, "never"),  # a kernel before per-size settings (< 6.11)
        ("advise", "inherit", "advise"),
        # the per-size settings apply to anonymous shared mappings, not to a memfd (a file)
        ("never", "advise", "never"),
        ("always", "never", "always"),
        (None, None, None),  # no THP (or not Linux): N/A
    ],
)
def test_the_mode_of_a_memfd_is_the_global_one(
    tmp_path: Path, global_mode: str | None, per_size: str | None, expected: str | None
) -> None:
    root = _sysfs(tmp_path / "thp", global_mode, per_size)
    assert hugepages.shmem_mode(root) == expected


def test_a_file_without_a_selection_reads_as_unknown(tmp_path: Path) -> None:
    (tmp_path / "shmem_enabled").write_text("always advise never\n")
    assert hugepages.shmem_mode(tmp_path) is None


def _memfd(size: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("hugepages-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd, mmap.mmap(fd, size)


def _smaps_entry(start: int, end: int, **fields: int) -> str:
    lines = [f"{start:x}-{end:x} rw-s 00000000 00:01 42    /memfd:kvctl-cpu (deleted)"]
    lines += [f"{name}: {kib:>8} kB" for name, kib in fields.items()]
    lines.append("VmFlags: rd wr sh mr mw me ms sd hg")
    return "\n".join(lines)


@linux
def test_smaps_counts_only_the_entries_of_the_mapping(tmp_path: Path) -> None:
    arena = mmap.mmap(-1, 8 * MIB)
    with memoryview(arena) as view:
        start = buffer_address(view)
    end = start + 8 * MIB
    smaps = tmp_path / "smaps"
    smaps.write_text(
        "\n".join(
            [
                _smaps_entry(start - 4 * MIB, start, Rss=4096, ShmemPmdMapped=4096),  # before
                # the kernel may split one mapping into several entries
                _smaps_entry(start, start + 4 * MIB, Rss=4096, ShmemPmdMapped=2048),
                _smaps_entry(start + 4 * MIB, end, Rss=4096, ShmemPmdMapped=4096),
                _smaps_entry(end, end + 2 * MIB, Rss=2048, AnonHugePages=2048),  # after
            ]
        )
        + "\n"
    )
    assert hugepages.huge_bytes(arena, smaps) == 6 * MIB
    assert hugepages.smaps_bytes(arena, "Rss", smaps=smaps) == 8 * MIB
    assert hugepages.vm_flags(arena, smaps) == {
        "rd",
        "wr",
        "sh",
        "mr",
        "mw",
        "me",
        "ms",
        "sd",
        "hg",
    }
    assert hugepages.huge_bytes(arena, tmp_path / "missing") is None
    arena.close()


@linux
def test_this_processs_smaps_sees_a_touched_mapping() -> None:
    fd, arena = _memfd(4 * MIB)  # a file's mapping: never merged with a neighbour's entry
    try:
        assert hugepages.smaps_bytes(arena, "Rss") == 0
        arena.write(b"\1" * (4 * MIB))
        assert hugepages.smaps_bytes(arena, "Rss") == 4 * MIB
        huge = hugepages.huge_bytes(arena)
        assert huge is not None and 0 <= huge <= 4 * MIB
    finally:
        arena.close()
        os.close(fd)


def _fixed_mode(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The kernel's mode as a host with ``mode`` reads it (only that sysfs read is replaced)."""
    monkeypatch.setattr(hugepages, "shmem_mode", lambda root=hugepages.THP_ROOT: mode)


@linux
@pytest.mark.parametrize(
    ("mode", "huge"), [("never", True), ("deny", True), ("advise", False), ("always", False)]
)
def test_commit_where_no_huge_page_is_wanted_allocates_the_file(
    mode: str | None, huge: bool
) -> None:
    fd, arena = _memfd(8 * MIB)
    try:
        assert hugepages.commit(arena, fd, 8 * MIB, mode=mode, huge=huge) is False
        assert os.fstat(fd).st_blocks * 512 >= 8 * MIB  # committed, not faulted in later
        assert hugepages.smaps_bytes(arena, "Rss") == 0  # and not through the mapping
        assert "hg" not in (hugepages.vm_flags(arena) or set())
    finally:
        arena.close()
        os.close(fd)


@linux
@thp
@pytest.mark.parametrize("mode", ["advise", "always", "within_size", "force"])
def test_commit_where_huge_pages_are_allowed_populates_through_the_mapping(mode: str) -> None:
    fd, arena = _memfd(8 * MIB)
    try:
        through_mapping = hugepages.commit(arena, fd, 8 * MIB, mode=mode)
        assert os.fstat(fd).st_blocks * 512 >= 8 * MIB
        assert "hg" in _vm_flags(arena)
        if through_mapping:  # Linux 5.14+: MADV_POPULATE_WRITE
            assert hugepages.smaps_bytes(arena, "Rss") == 8 * MIB
        arena[:4] = b"kvkv"  # the mapping is writable as before
        assert os.pread(fd, 4, 0) == b"kvkv"
    finally:
        arena.close()
        os.close(fd)


@linux
def test_the_cpu_tier_reports_its_arenas_huge_pages_as_this_kernel_allows() -> None:
    tier = CpuTier(64 * MIB, shared=True)
    try:
        huge = tier.huge_page_bytes()
        mode = hugepages.shmem_mode()
        if mode in ("never", "deny", None):
            assert huge == 0
        elif mode == "advise":  # 32 huge pages: a host this short of them is not a test host
            assert huge is not None and 0 < huge <= 64 * MIB
        else:
            assert huge is None or 0 <= huge <= 64 * MIB
    finally:
        tier.close()


def _vm_flags(mapping: mmap.mmap) -> set[str]:
    flags = hugepages.vm_flags(mapping)
    assert flags, "smaps unreadable"
    return flags


def _resize_without_the_lock(tier: CpuTier, capacity_bytes: int) -> None:
    """The store's usual resize: planned under its lock, copied without, finished under it."""
    plan = tier.begin_resize(capacity_bytes)
    assert plan is not None
    tier.copy_resize(plan)
    assert tier.finish_resize(plan)
    tier.release_resize(plan)


@linux
@thp
def test_an_arena_committed_under_advise_stores_resizes_and_stays_sealed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The path a host with ``shmem_enabled = advise`` takes, whatever this one's setting."""
    _fixed_mode(monkeypatch, "never")
    plain = CpuTier(4 * MIB, shared=True)
    try:
        assert "hg" not in _vm_flags(plain.arena_mapping()[0])  # as made under never
        assert plain.huge_page_bytes() == 0
    finally:
        plain.close()
    _fixed_mode(monkeypatch, "advise")
    tier = CpuTier(4 * MIB, shared=True)
    try:
        assert "hg" in _vm_flags(tier.arena_mapping()[0])  # marked for huge pages
        data = bytes(range(256)) * 4096
        tier.put(ChunkMeta(b"k" * 16, len(data)), data)
        _resize_without_the_lock(tier, 8 * MIB)  # the usual resize: the same path
        assert tier.get(b"k" * 16) == data
        assert "hg" in _vm_flags(tier.arena_mapping()[0])
        tier.resize(16 * MIB)  # under the store's lock: the quick way, small pages
        assert tier.get(b"k" * 16) == data
        assert "hg" not in _vm_flags(tier.arena_mapping()[0]) and tier.huge_page_bytes() == 0
        fd = tier.reader_fd()
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:  # still sealed: reopened read-write, it cannot be mapped writable
            with pytest.raises(PermissionError):
                mmap.mmap(reopened, 16 * MIB)
        finally:
            os.close(reopened)
            os.close(fd)
    finally:
        tier.close()


@linux
@thp
def test_the_tier_reads_smaps_once_per_arena_when_it_commits_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading smaps walks the whole process's page tables (150 ms for an 8 GiB arena on 4 KiB
    pages): once per arena, where it is committed through the mapping, never per /v1/info."""
    real = hugepages.huge_bytes
    reads: list[int] = []

    def counted(mapping: mmap.mmap, smaps: Path = Path("/proc/self/smaps")) -> int | None:
        reads.append(len(mapping))
        return real(mapping, smaps)

    monkeypatch.setattr(hugepages, "huge_bytes", counted)
    _fixed_mode(monkeypatch, "never")
    small = CpuTier(4 * MIB, shared=True)
    try:
        assert small.huge_page_bytes() == 0 and reads == []  # never: nothing can be huge
    finally:
        small.close()
    _fixed_mode(monkeypatch, "always")
    tier = CpuTier(4 * MIB, shared=True)
    try:
        assert reads == [4 * MIB]  # read as committed
        first = tier.huge_page_bytes()
        assert first is not None and tier.huge_page_bytes() == first and reads == [4 * MIB]
        _resize_without_the_lock(tier, 8 * MIB)  # a new arena: read again
        assert tier.huge_page_bytes() is not None and reads == [4 * MIB, 8 * MIB]
        tier.resize(16 * MIB)  # fallocate under "always": huge or not, not mapped yet to tell
        assert tier.huge_page_bytes() is None and reads == [4 * MIB, 8 * MIB]
    finally:
        tier.close()
