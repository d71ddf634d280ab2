"""The store says in its log when a tier fails: taken offline, demotions that do not land (with
the errno), and back online; a line a minute per kind at most, with a count of the rest."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from kvctl.store.ratelog import RateLimitedLog
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from tests.unit.test_disk_tier import key, payload
from tests.unit.test_store_full_filesystem import tmpfs

KIB = 1024
CHUNK = 64 * KIB


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvctl.store.store"]


def block_fan_out(directory: Path) -> None:
    """Every chunk write into the disk tier at ``directory`` fails (ENOTDIR), as on a broken
    device: a file where each fan-out directory would be (none exists yet)."""
    for i in range(256):
        (directory / f"{i:02x}").write_bytes(b"")


def unblock_fan_out(directory: Path) -> None:
    for i in range(256):
        (directory / f"{i:02x}").unlink()


def test_a_tier_going_offline_failing_demotions_and_coming_back_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = DiskTier(tmp_path / "disk", 64 * CHUNK)
    store = TieredStore([CpuTier(4 * CHUNK), disk], eviction="lru", offline_retry_s=0)
    try:
        for i in range(4):
            assert store.put(key(i), payload(i, CHUNK)) == "cpu"
        block_fan_out(tmp_path / "disk")
        with caplog.at_level(logging.INFO, logger="kvctl.store"):
            for i in range(4, 10):  # each demotes one chunk to disk, which fails
                assert store.put(key(i), payload(i, CHUNK)) == "cpu"
        assert store.stats.demotion_failures == 6 and "disk" in store.offline_tiers
        lines = said(caplog)
        assert len(lines) == 2, lines  # one of each kind: the rest are counted
        assert lines[0].startswith("tier disk taken offline: disk tier 'disk' cannot write")
        assert lines[0].endswith(
            "Not a directory [ENOTDIR]; its chunks go to the next tier down, and a write "
            "tries it again after 0 s"
        )
        assert lines[1].startswith("a chunk could not be demoted into tier disk")
        assert "Not a directory [ENOTDIR]" in lines[1]
        caplog.clear()
        unblock_fan_out(tmp_path / "disk")
        with caplog.at_level(logging.INFO, logger="kvctl.store"):
            assert store.put(key(10), payload(10, CHUNK)) == "cpu"
        assert "disk" not in store.offline_tiers
        assert said(caplog) == ["tier disk back online"]
    finally:
        store.close()


def test_a_demotion_into_a_filesystem_full_of_other_files_is_logged_with_its_errno(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with tmpfs(tmp_path / "fs", "1m") as fs:
        store = TieredStore([CpuTier(CHUNK), DiskTier(fs / "tier", 64 * CHUNK)], eviction="lru")
        try:
            with open(fs / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
                f.write(b"\0" * (1 << 20))
            store.put(key(0), payload(0, CHUNK))
            with caplog.at_level(logging.WARNING, logger="kvctl.store"):
                store.put(key(1), payload(1, CHUNK))
            assert store.stats.demotion_failures == 1 and key(0) not in store
            [line] = [m for m in said(caplog) if "could not be demoted" in m]
            assert "its filesystem is full (0 bytes free" in line and "[ENOSPC]" in line
        finally:
            store.close()


def test_the_rate_limited_log_says_the_first_then_a_line_an_interval_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    say = RateLimitedLog(logging.getLogger("kvctl.store.test"), interval_s=60, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kvctl.store.test"):
        assert say.say("a", logging.WARNING, "disk %s failed", "x")
        now[0] += 1
        assert not say.say("a", logging.WARNING, "disk %s failed", "y")
        assert not say.say("a", logging.WARNING, "disk %s failed", "z")
        assert say.say("b", logging.WARNING, "other kind")  # kinds are limited apart
        now[0] += 60
        assert say.say("a", logging.WARNING, "disk %s failed", "w")
        assert not say.say("a", logging.WARNING, "disk %s failed", "v")
        say.forget("a")
        assert say.say("a", logging.WARNING, "disk %s failed", "u")
    assert [r.getMessage() for r in caplog.records] == [
        "disk x failed",
        "other kind",
        "disk w failed (and 2 more like it in the last 61 s, not logged)",
        "disk u failed",
    ]
