"""The disk tier's scan at open: a chunk file it cannot read, a directory it cannot use, and
what it logs while it scans."""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.bench.common import drop_file_pages, files_under
from kvctl.store.errors import DirectoryInUse
from kvctl.store.tiers import disk as disk_module
from kvctl.store.tiers.disk import DiskTier
from tests.unit.test_disk_tier import as_after_a_crash, chunk_path, key, put

KIB = 1024


@contextlib.contextmanager
def unreadable(path: Path) -> Iterator[None]:
    """``path`` (a regular file) reads as a bad sector does, with EIO, while the block lasts:
    this process's /proc/<pid>/mem is bind-mounted over it (a read at offset 0, which no mapping
    covers, is EIO) and a directory listing still shows a regular file there. Root only."""
    done = subprocess.run(
        ["mount", "--bind", f"/proc/{os.getpid()}/mem", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount over a file here: {done.stderr.strip()}")
    try:
        with pytest.raises(OSError) as info, open(path, "rb") as f:
            f.read(1)
        assert info.value.errno == 5  # EIO, as the tier will meet it
        yield
    finally:
        subprocess.run(["umount", str(path)], check=False, timeout=30)


def test_a_chunk_file_that_cannot_be_read_at_open_is_skipped_and_the_tier_opens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with DiskTier(tmp_path, 1 << 20) as tier:
        kept = [put(tier, i, 4 * KIB) for i in range(3)]
    as_after_a_crash(tmp_path)
    bad = chunk_path(tmp_path, key(1))
    with (
        unreadable(bad),
        caplog.at_level(logging.WARNING, logger="kvctl.store"),
        DiskTier(tmp_path, 1 << 20) as tier,
    ):
        assert set(tier.keys()) == {key(0), key(2)}
        assert tier.get(key(0)) == kept[0] and tier.get(key(2)) == kept[2]
        assert tier.used_bytes == 8 * KIB
        assert tier.unreadable_on_open == 1 and tier.dropped_on_open == 0
        assert tier.unreadable_reasons == [
            f"{key(1).hex()[:2]}/{key(1).hex()}.kv: Input/output error"
        ]
    warned = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
    assert len(warned) == 1 and str(bad) in warned[0]
    # left in place: readable again, it is served again
    with DiskTier(tmp_path, 1 << 20) as tier:
        assert tier.unreadable_on_open == 0
        assert tier.get(key(1)) == kept[1]


def _settings(tmp_path: Path) -> AgentSettings:
    return AgentSettings(
        name="d1", data_dir=str(tmp_path), cpu_bytes=1 << 20, disk_bytes=1 << 20, shm=False
    )


def test_an_agent_starts_past_an_unreadable_chunk_file(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "disk", 1 << 20) as tier:
        put(tier, 0, 4 * KIB)
        put(tier, 1, 4 * KIB)
    as_after_a_crash(tmp_path / "disk")
    with unreadable(chunk_path(tmp_path / "disk", key(1))):
        runtime = AgentRuntime.open(_settings(tmp_path))
        try:
            assert runtime.store.locate([key(0), key(1)]) == ["disk", None]
            assert runtime.info()["unavailable_tiers"] == []
            # counted where an operator and the collectors look (/v1/stats, /metrics), not
            # only in the log
            tiers = runtime.stats()["stats"]["tiers"]
            assert tiers["disk"]["unreadable_on_open"] == 1
            assert tiers["cpu"]["unreadable_on_open"] == 0
            text = runtime.metrics.render()[0].decode()
            assert 'kvctl_tier_unreadable_on_open_total{tier="disk"} 1.0' in text
            assert 'kvctl_tier_unreadable_on_open_total{tier="cpu"} 0.0' in text
        finally:
            runtime.close()


def test_an_agent_starts_without_a_disk_tier_whose_directory_is_unusable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "disk").write_bytes(b"not a directory")
    with caplog.at_level(logging.WARNING, logger="kvctl.agent"):
        runtime = AgentRuntime.open(_settings(tmp_path))
    try:
        # its place is kept while it is absent (tried again: tests/unit/test_disk_tier_retry.py)
        assert runtime.store.tier_names == ["cpu", "disk"] and "disk" not in runtime.usage()
        [gone] = runtime.info()["unavailable_tiers"]
        assert gone["name"] == "disk" and gone.get("capacity_bytes") == 1 << 20
        assert gone.get("device") == str(tmp_path / "disk")
        assert "cannot use directory" in gone["reason"]
        assert runtime.store.put(key(0), b"x" * 4096) == "cpu"  # the cpu tier serves
    finally:
        runtime.close()
    assert any("disk tier unavailable" in r.getMessage() for r in caplog.records)


def test_an_agent_does_not_start_on_a_disk_directory_another_agent_holds(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "disk", 1 << 20), pytest.raises(DirectoryInUse):
        AgentRuntime.open(_settings(tmp_path))


def test_the_scan_at_open_logs_its_start_progress_and_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with DiskTier(tmp_path, 1 << 20) as tier:
        for i in range(5):
            put(tier, i, 4 * KIB)
    as_after_a_crash(tmp_path)  # the whole scan, file by file
    (tmp_path / key(0).hex()[:2] / ".left.tmp").write_bytes(b"x")  # dropped at open
    monkeypatch.setattr(disk_module, "_SCAN_PROGRESS_S", 0.0)  # progress at every file
    with caplog.at_level(logging.INFO, logger="kvctl.store"), DiskTier(tmp_path, 1 << 20):
        pass
    said = [r.getMessage() for r in caplog.records if r.name == "kvctl.store.tiers.disk"]
    assert said[0] == f"disk tier disk: scanning {tmp_path} for chunks"
    progress = [m for m in said if "files so far" in m]
    assert [m.split(": ")[2].split(" files")[0] for m in progress] == [str(n) for n in range(6)]
    assert said[-1].startswith(f"disk tier disk: scanned {tmp_path} in ")
    assert said[-1].endswith(": 6 files, 5 chunks (20 KiB), 1 dropped (torn, corrupt or leftover)")


def _fill_for_scan(directory: Path) -> dict[bytes, bytes]:
    """Chunks over many fan-out directories, then leftovers a crash could leave: a torn chunk,
    garbage under a chunk's name, a temp file; no clean-close index (the scan reads every file)."""
    with DiskTier(directory, 4 << 20) as tier:
        kept = {key(i): put(tier, i, 1 * KIB + i, tenant=f"t{i % 3}") for i in range(300)}
    as_after_a_crash(directory)
    torn = chunk_path(directory, key(7))
    os.truncate(torn, torn.stat().st_size - 10)
    del kept[key(7)]
    garbage = chunk_path(directory, key(1000))
    garbage.parent.mkdir(exist_ok=True)
    garbage.write_bytes(os.urandom(300))
    (chunk_path(directory, key(3)).parent / ".x.1.1.tmp").write_bytes(b"x")
    return kept


@pytest.mark.parametrize("verify", [False, True])
def test_a_scan_from_the_device_reads_on_threads_and_finds_what_one_thread_finds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    one, many = tmp_path / "one", tmp_path / "many"
    kept = _fill_for_scan(one)
    shutil.copytree(one, many)
    threads: dict[Path, set[str]] = {one: set(), many: set()}
    real = disk_module._load_chunk

    def spy(path: str, *args: Any, **kw: Any) -> Any:
        threads[one if path.startswith(str(one)) else many].add(threading.current_thread().name)
        return real(path, *args, **kw)

    monkeypatch.setattr(disk_module, "_load_chunk", spy)
    found = {}
    for directory in (one, many):
        if directory is many:  # its files' pages dropped: their headers come from the device
            monkeypatch.setattr(disk_module, "_SCAN_SAMPLE_FILES", 16)
            drop_file_pages(files_under(many))
            probe = next(many.rglob("*.kv"))
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_inblock
            probe.read_bytes()
            if resource.getrusage(resource.RUSAGE_THREAD).ru_inblock == before:
                pytest.skip(f"{tmp_path}'s filesystem serves dropped pages with no block read")
        with DiskTier(directory, 4 << 20, verify_on_open=verify) as tier:
            found[directory] = (
                tier.recover(),
                {k: tier.get(k) for k in list(tier.keys())},
                tier.dropped_on_open,
                sorted(tier.dropped_reasons),
                tier.used_bytes,
            )
    assert threads[one] == {threading.current_thread().name}  # from the page cache: one thread
    assert any(t.startswith("kvctl-disk-scan") for t in threads[many]), threads[many]
    assert found[one][1] == kept
    assert found[one][2] == 3  # torn, garbage, temp file
    assert found[one] == found[many]
    assert not [t for t in threading.enumerate() if t.name.startswith("kvctl-disk-scan")]
