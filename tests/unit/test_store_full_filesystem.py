"""A disk tier whose filesystem fills up below the tier's capacity (others' files, or a capacity
larger than the free space) makes room as at its capacity: its own chunks go by its policy, and
the write is made again. Real ENOSPC from a small tmpfs."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import pytest

from kvctl.agent.metrics import AgentMetrics
from kvctl.paths import write_atomic
from kvctl.store.errors import CapacityError
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from tests.tmpfs import tmpfs
from tests.unit.test_disk_tier import key, payload

KIB = 1024
MIB = 1024 * KIB


def test_puts_that_only_fit_on_disk_evict_its_oldest_chunks_when_its_filesystem_fills(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """exp13: a 64 MiB disk tier on an 8 MiB filesystem, 3 MiB chunks the 2 MiB cpu tier
    cannot take. The third found the filesystem full and was refused ('no room') for good."""
    with tmpfs(tmp_path / "fs", "8m") as fs:
        store = TieredStore([CpuTier(2 * MIB), DiskTier(fs, 64 * MIB)], eviction="lru")
        try:
            with caplog.at_level(logging.WARNING, logger="kvctl.store"):
                for i in range(6):
                    assert store.put(key(i), payload(i, 3 * MIB)) == "disk"
            assert store.locate([key(i) for i in range(6)]) == [None] * 4 + ["disk"] * 2
            assert store.get(key(5)) == payload(5, 3 * MIB)
            disk = store.stats.tiers["disk"]
            assert disk.evictions["filesystem"] == 4 and disk.evictions["capacity"] == 0
            assert disk.filesystem_full == 4
            assert store.snapshot()["stats"]["tiers"]["disk"]["filesystem_full"] == 4
            text = AgentMetrics(store).render()[0].decode()
            assert 'kvctl_tier_filesystem_full_total{tier="disk"} 4.0' in text
            assert 'kvctl_evictions_total{reason="filesystem",tier="disk"} 4.0' in text
        finally:
            store.close()
    said = [r.getMessage() for r in caplog.records if "filesystem is full" in r.getMessage()]
    assert len(said) == 1, said  # the first at once, the rest within the minute counted
    assert "evicted 1 of its chunks" in said[0]


def test_demotions_to_a_full_filesystem_keep_the_newest_chunks(tmp_path: Path) -> None:
    """A cpu tier demoting to a disk tier whose filesystem fills first: the disk tier evicts
    its oldest chunks for the newer ones instead of dropping every demotion from then on and
    freezing with its oldest."""
    with tmpfs(tmp_path / "fs", "2m") as fs:
        store = TieredStore([CpuTier(512 * KIB), DiskTier(fs, 64 * MIB)], eviction="lru")
        try:
            keys = [key(i) for i in range(40)]
            for i, k in enumerate(keys):
                store.put(k, payload(i, 128 * KIB))
            where = store.locate(keys)
            assert where[-4:] == ["cpu"] * 4
            on_disk = [i for i, t in enumerate(where) if t == "disk"]
            # the newest of the demoted (the ones just below the cpu tier's) are on disk
            assert on_disk and on_disk[-1] == 35 and on_disk == list(range(on_disk[0], 36))
            assert len(on_disk) >= 8  # the filesystem's 2 MiB hold at least 8 of them
            assert store.stats.demotion_failures == 0
            assert store.stats.tiers["disk"].evictions["filesystem"] == on_disk[0]
            disk = store.tier("disk")
            for i in on_disk:  # read in place: a store read would promote, and demote again
                assert disk.get(keys[i]) == payload(i, 128 * KIB)
        finally:
            store.close()


def test_a_filesystem_full_of_other_files_refuses_saying_so_and_recovers(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", "4m") as fs:
        store = TieredStore([CpuTier(MIB), DiskTier(fs / "tier", 64 * MIB)], eviction="lru")
        try:
            filler = fs / "filler"
            with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
                f.write(b"\0" * 4 * MIB)
            with pytest.raises(CapacityError) as info:
                store.put(key(1), payload(1, 2 * MIB))
            said = str(info.value)
            assert "tier 'disk': its filesystem is full (0 bytes free" in said, said
            assert "none of its chunks can be evicted" in said
            assert store.stats.tiers["disk"].filesystem_full == 1
            assert key(1) not in store
            filler.unlink()  # space comes back: no restart needed
            assert store.put(key(1), payload(1, 2 * MIB)) == "disk"
            assert store.get(key(1)) == payload(1, 2 * MIB)
        finally:
            store.close()


def _free_bytes(path: Path) -> int:
    fs = os.statvfs(path)
    return fs.f_bavail * fs.f_frsize


@pytest.mark.parametrize("demoted", [False, True], ids=["puts", "demotions"])
def test_a_tier_filling_its_filesystem_leaves_room_for_the_agents_own_files(
    tmp_path: Path, demoted: bool
) -> None:
    """The default layout: DATA_DIR/disk on the filesystem of DATA_DIR, whose agent.json the
    agent must write to start again. A 64 MiB tier filled far past its 8 MiB filesystem by
    puts only it can take, or by demotions from the cpu tier, left the filesystem with no more
    than its last round's slack (8 KiB; or nothing: ENOSPC for agent.json). Now it keeps 1/64
    of it (128 KiB) free."""
    with tmpfs(tmp_path / "fs", "8m") as data_dir:
        store = TieredStore(
            [CpuTier(512 * KIB), DiskTier(data_dir / "disk", 64 * MIB)], eviction="lru"
        )
        try:
            n = 128  # 128 KiB each: twice what the filesystem holds
            for i in range(n):
                where = store.put(key(i), payload(i, 128 * KIB), tier=None if demoted else "disk")
                assert where == ("cpu" if demoted else "disk")
                assert _free_bytes(data_dir) >= 128 * KIB
            on_disk = store.locate([key(i) for i in range(n)]).count("disk")
            assert on_disk >= 40  # the rest of the filesystem holds chunks
            assert store.stats.demotion_failures == 0
            assert store.stats.tiers["disk"].evictions["filesystem"] > 0
            # what agent.json and the log need, with their temp files
            write_atomic(data_dir / "agent.json", "x" * 8 * KIB, mode=0o600)
            with open(data_dir / "agent.log", "ab") as log_file:
                log_file.write(b"y" * 16 * KIB)
        finally:
            store.close()


def test_the_headroom_is_a_share_of_a_small_filesystem_and_64_mib_of_a_large_one(
    tmp_path: Path,
) -> None:
    with tmpfs(tmp_path / "small", "2m") as small:
        tier = DiskTier(small, 64 * MIB)
        try:
            assert tier.headroom_bytes == 32 * KIB  # 1/64 of 2 MiB
        finally:
            tier.close()
    with tmpfs(tmp_path / "large", "16g") as large:  # tmpfs takes no memory until written
        tier = DiskTier(large, 64 * MIB)
        try:
            assert tier.headroom_bytes == 64 * MIB
        finally:
            tier.close()
