"""Huge pages under the shared arena (``kvctl.store.tiers.hugepages``): the kernel's mode read
from sysfs files as Linux writes them, the commit that takes the huge-page path only under
``advise``, and the bytes a mapping holds on huge pages as the kernel counts them (smaps)."""

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
        ("never", "advise", "advise"),  # the PMD size's own setting wins over the global one
        ("always", "never", "never"),
        (None, None, None),  # no THP (or not Linux): N/A
    ],
)
def test_the_mode_is_the_pmd_sizes_own_unless_it_inherits(
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


@linux
@pytest.mark.parametrize("mode", ["never", "deny", "always", "within_size"])
def test_commit_outside_advise_allocates_the_file(mode: str) -> None:
    fd, arena = _memfd(8 * MIB)
    try:
        assert hugepages.commit(arena, fd, 8 * MIB, mode=mode) is False
        assert os.fstat(fd).st_blocks * 512 >= 8 * MIB  # committed, not faulted in later
        assert hugepages.smaps_bytes(arena, "Rss") == 0  # and not through the mapping
    finally:
        arena.close()
        os.close(fd)


@linux
def test_commit_under_advise_populates_through_the_mapping() -> None:
    fd, arena = _memfd(8 * MIB)
    try:
        through_mapping = hugepages.commit(arena, fd, 8 * MIB, mode="advise")
        assert os.fstat(fd).st_blocks * 512 >= 8 * MIB
        if through_mapping:  # Linux 5.14+: MADV_POPULATE_WRITE
            assert hugepages.smaps_bytes(arena, "Rss") == 8 * MIB
        arena[:4] = b"kvkv"  # the mapping is writable as before
        assert os.pread(fd, 4, 0) == b"kvkv"
    finally:
        arena.close()
        os.close(fd)


@linux
def test_the_cpu_tier_reports_its_arenas_huge_pages_as_the_kernel_allows() -> None:
    tier = CpuTier(8 * MIB, shared=True)
    try:
        huge = tier.huge_page_bytes()
        assert huge is not None and 0 <= huge <= 8 * MIB
        if hugepages.shmem_mode() in ("never", "deny"):
            assert huge == 0
    finally:
        tier.close()


def _vm_flags(mapping: mmap.mmap) -> set[str]:
    flags = hugepages.vm_flags(mapping)
    assert flags, "smaps unreadable"
    return flags


@linux
def test_an_arena_committed_under_advise_stores_resizes_and_stays_sealed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The path a host with ``shmem_enabled = advise`` takes, whatever this one's setting (the
    mode is read from sysfs; only that read is replaced here)."""
    monkeypatch.setattr(hugepages, "shmem_mode", lambda root=hugepages.THP_ROOT: "never")
    plain = CpuTier(4 * MIB, shared=True)
    try:
        assert "hg" not in _vm_flags(plain.arena_mapping()[0])  # as made under never
    finally:
        plain.close()
    monkeypatch.setattr(hugepages, "shmem_mode", lambda root=hugepages.THP_ROOT: "advise")
    tier = CpuTier(4 * MIB, shared=True)
    try:
        assert "hg" in _vm_flags(tier.arena_mapping()[0])  # marked for huge pages
        data = bytes(range(256)) * 4096
        tier.put(ChunkMeta(b"k" * 16, len(data)), data)
        tier.resize(8 * MIB)  # a resize's new arena takes the same path
        assert tier.get(b"k" * 16) == data
        assert "hg" in _vm_flags(tier.arena_mapping()[0])
        fd = tier.reader_fd()
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:  # still sealed: reopened read-write, it cannot be mapped writable
            with pytest.raises(PermissionError):
                mmap.mmap(reopened, 8 * MIB)
        finally:
            os.close(reopened)
            os.close(fd)
    finally:
        tier.close()


@linux
def test_the_tier_reads_smaps_once_per_arena_and_not_at_all_where_none_can_be_huge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading smaps walks the whole process's page tables (150 ms for an 8 GiB arena on 4 KiB
    pages), so /v1/info must not do it on every call."""
    real = hugepages.huge_bytes
    reads: list[int] = []

    def counted(mapping: mmap.mmap, smaps: Path = Path("/proc/self/smaps")) -> int | None:
        reads.append(len(mapping))
        return real(mapping, smaps)

    monkeypatch.setattr(hugepages, "huge_bytes", counted)
    monkeypatch.setattr(hugepages, "shmem_mode", lambda root=hugepages.THP_ROOT: "never")
    tier = CpuTier(4 * MIB, shared=True)
    try:
        assert tier.huge_page_bytes() == 0 and reads == []  # never: nothing can be huge
        monkeypatch.setattr(hugepages, "shmem_mode", lambda root=hugepages.THP_ROOT: "always")
        first = tier.huge_page_bytes()
        assert tier.huge_page_bytes() == first and reads == [4 * MIB]  # kept
        tier.resize(8 * MIB)  # a new arena: read again
        assert tier.huge_page_bytes() is not None and reads == [4 * MIB, 8 * MIB]
    finally:
        tier.close()
