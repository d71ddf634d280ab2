"""`kvctl agent start` where the filesystem holding the data directory is full (the disk tier,
DATA_DIR/disk by default, filled it): one line naming the file that could not be written and
why (with --detach, whose agent had no room to log it, one saying the filesystem is full), a
hint that fits, exit 2, no traceback. Found in
review: the foreground said '[Errno 28] No space left on device' naming no file with a hint about
sizes and ports (exit 1), --detach 'kvctl failed where it did not expect to' (a bug's message).
The hint's way out (a smaller --disk, in the foreground) is checked too. Real ENOSPC from a
small tmpfs (skipped where one cannot be mounted)."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.agent.daemon import STATE_FILE, DataDirFull, spawn_agent, stop_agent
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from tests.functional.agents import EPHEMERAL, key, payload
from tests.tmpfs import tmpfs
from tests.unit.test_disk_tier import as_after_a_crash

KIB = 1024


def fill(path: Path) -> None:
    """Write ``path`` until its filesystem has no byte left."""
    with open(path, "wb", buffering=0) as f:
        block = b"\0" * (4 * KIB)
        while True:
            try:
                f.write(block)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
    assert os.statvfs(path).f_bavail == 0


def start(tmp_path: Path, data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    env["COLUMNS"] = "1000"  # long paths in one piece
    argv = ["agent", "start", "--data-dir", str(data_dir), *EPHEMERAL, "--cpu", "4MiB", *args]
    return subprocess.run(
        [sys.executable, "-m", "kvctl", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def disk_chunks(data_dir: Path, count: int, size_bytes: int) -> None:
    """``count`` chunks in the disk tier of ``data_dir``, as an agent killed leaves them: no
    clean-close index, whose removal at the next start would free a block of the filesystem
    these tests fill."""
    store = TieredStore([CpuTier(size_bytes), DiskTier(data_dir / "disk", 64 << 20)])
    try:
        for i in range(count):
            k = key(i, 77)
            store.put(k, payload(k, size_bytes))
        store.move([key(i, 77) for i in range(count)], "disk")
    finally:
        store.close()
    as_after_a_crash(data_dir / "disk")


@pytest.mark.parametrize("detach", [False, True])
def test_a_full_data_dir_is_one_line_naming_the_file(tmp_path: Path, detach: bool) -> None:
    with tmpfs(tmp_path / "fs", "1m") as fs:
        data_dir = fs / "agent"
        disk_chunks(data_dir, 4, 64 * KIB)
        fill(fs / "filler")
        out = start(tmp_path, data_dir, "--disk", "16MiB", *(["--detach"] if detach else []))
        assert out.returncode == 2, out.stdout + out.stderr
        errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
        written = re.escape(str(data_dir / STATE_FILE))
        assert len(errors) == 1, out.stderr
        if detach:  # the agent's own line had no room in its log: its start says what it sees
            assert re.fullmatch(
                r"error: the agent did not start \(exit code \d+\): the filesystem holding "
                f"{re.escape(str(data_dir))} has 0 bytes free, too few for the files the agent "
                r"writes there \(agent.json\); its log, .*agent\.log, is empty: no room for it "
                "either",
                errors[0],
            ), out.stderr
        else:
            assert re.fullmatch(
                f"error: cannot write ({written}): its filesystem is full "
                r"\(no space left on device\)",
                errors[0],
            ), out.stderr
        assert f"hint: free space on the filesystem holding {data_dir}" in out.stderr
        assert "smaller --disk" in out.stderr  # its disk tier is there to trim
        assert "Traceback" not in out.stderr and "Errno" not in out.stderr
        assert not [p for p in data_dir.iterdir() if re.fullmatch(written, str(p))]
        assert not [p.name for p in data_dir.iterdir() if p.name.endswith(".tmp")]


def test_a_smaller_disk_makes_the_room_the_agent_needs(tmp_path: Path) -> None:
    """What the hint says: started in the foreground with a smaller --disk, the tier is trimmed
    before the agent writes its files, so it starts on a filesystem its disk tier filled."""
    with tmpfs(tmp_path / "fs", "1m") as fs:
        data_dir = fs / "agent"
        disk_chunks(data_dir, 4, 64 * KIB)
        fill(fs / "filler")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
        proc, state = spawn_agent(
            [*EPHEMERAL, "--cpu", "4MiB", "--disk", "64KiB"], data_dir, env=env, detach=False
        )
        try:
            assert state.pid == proc.pid and (data_dir / STATE_FILE).is_file()
        finally:
            stop_agent(data_dir, timeout_s=20, force=True)
            proc.wait(20)


def test_a_detached_agent_failing_on_a_full_filesystem_says_the_filesystem_is_full(
    tmp_path: Path,
) -> None:
    """A child that exits before serving while its data directory's filesystem is full: its log
    could not say why, so the parent says what it sees (the free bytes)."""
    with tmpfs(tmp_path / "fs", "256k") as fs:
        data_dir = fs / "agent"
        data_dir.mkdir(mode=0o700)
        fill(fs / "filler")
        with pytest.raises(DataDirFull, match=r"filesystem holding .* has 0 bytes free"):
            spawn_agent([*EPHEMERAL, "--cpu", "not-a-size"], data_dir)
