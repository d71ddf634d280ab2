"""A detached agent's log, DATA_DIR/agent.log, rolls over by size (log_max, log_backups):
before, it grew for as long as the agent ran, until the disk was full. Real agents, a tiny cap,
made to log through a real request (each /v1/probe logs a line)."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from kvctl.agent.daemon import AgentState, spawn_agent, stop_agent
from kvctl.cli.main import app
from kvctl.client import AgentClient
from tests.functional.agents import EPHEMERAL, closed_port

MAX_BYTES = 4096
BACKUPS = 2
SMALL = ["--cpu", "8MiB", "--disk", "0", "--socket", "off"]
ROTATING = ["--log-max", str(MAX_BYTES), "--log-backups", str(BACKUPS)]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")  # no user config file leaks in
    # a fatal signal makes Python's faulthandler write a traceback straight to fd 2
    env["PYTHONFAULTHANDLER"] = "1"
    return env


@contextlib.contextmanager
def _agent(tmp_path: Path, data_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    no_core = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, no_core[1]))  # its SIGABRT leaves no core file
    try:
        proc, _ = spawn_agent([*EPHEMERAL, *SMALL, *ROTATING], data_dir, env=_env(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, no_core)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _fd_file(pid: int, fd: int) -> int:
    return os.stat(f"/proc/{pid}/fd/{fd}").st_ino


def test_the_log_rolls_over_keeping_its_backups_and_fd_2_follows(tmp_path: Path) -> None:
    data_dir = tmp_path / "agent"
    log = data_dir / "agent.log"
    with _agent(tmp_path, data_dir) as proc:
        state = AgentState.read(data_dir)
        assert state is not None
        target = f"127.0.0.1:{closed_port()}"  # refused at once: each probe is one quick line
        with contextlib.ExitStack() as held, AgentClient(state.control_url) as ctl:
            # each file agent.log has been, held open: a deleted one's inode is not reused
            seen: dict[int, object] = {}
            for _ in range(5000):  # a hang guard: the agent looks at its log twice a second
                f = open(log, "rb")  # noqa: SIM115 (held until the end of the loop)
                if os.fstat(f.fileno()).st_ino in seen:
                    f.close()
                else:
                    seen[os.fstat(f.fileno()).st_ino] = held.enter_context(f)
                if len(seen) > BACKUPS + 1:
                    break  # rolled over more times than it keeps files
                ctl.probe(target, pings=1, size_bytes=0, timeout_s=1.0)
        assert len(seen) > BACKUPS + 1, f"rolled over {len(seen) - 1} times"
        rolled = "rolled over, the lines before are in agent.log.1 (2 kept)"
        for _ in range(600):  # the last probes' lines may be over the cap: until rolled over,
            text = log.read_text()  # and the new file's first line (written once it is named)
            if len(text) < MAX_BYTES and rolled in text:
                break
            time.sleep(0.05)
        kept = sorted(p.name for p in data_dir.glob("agent.log*"))
        assert kept == ["agent.log", "agent.log.1", "agent.log.2"], kept
        for name in kept[1:]:
            text = (data_dir / name).read_text()
            # each over the cap when rolled over, and cut between lines
            assert len(text) >= MAX_BYTES and text.endswith("\n"), (name, text[-200:])
            assert "probe of 127.0.0.1" in text
        assert rolled in log.read_text()
        # stdout and stderr both write to the new file, not to the one now agent.log.1
        assert _fd_file(proc.pid, 1) == _fd_file(proc.pid, 2) == log.stat().st_ino
        # a write to fd 2 that is no logging record: faulthandler's, from C, as it dies
        proc.send_signal(signal.SIGABRT)
        assert proc.wait(30) == -signal.SIGABRT
    said = log.read_text()
    assert "Fatal Python error: Aborted" in said, said[-2000:]


def _run(tmp_path: Path, *args: str) -> Any:
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    clean["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    clean["COLUMNS"] = "1000"
    return CliRunner().invoke(app, list(args), env=clean)


def test_a_detached_start_repeats_its_warnings_across_a_rollover(tmp_path: Path) -> None:
    """An earlier run's log over the cap is rolled over as the agent starts, between the two
    warnings it logs: the start reads the first in the old file (now agent.log.1) and the
    second in the new one, and repeats both."""
    data_dir = tmp_path / "agent"
    data_dir.mkdir(mode=0o755)
    data_dir.chmod(0o755)  # others can list it: warned of before the rollover
    earlier = "2026-01-01 00:00:00,000 INFO kvctl.agent: an earlier run's line\n" * 200
    (data_dir / "agent.log").write_text(earlier)
    argv = ["--data-dir", str(data_dir), *EPHEMERAL, *ROTATING, "--cpu", "8MiB"]
    # a disk tier above the free space: warned of as the tiers open, after the rollover
    start = _run(tmp_path, "agent", "start", *argv, "--disk", "100000TiB", "--detach")
    try:
        assert start.exit_code == 0, start.output
        said = " ".join(start.output.split())
        assert f"warning: data directory {data_dir} has mode 0755" in said, said
        assert "warning: disk tier disk: capacity" in said, said
        assert (data_dir / "agent.log.1").read_text().startswith(earlier)
    finally:
        stop_agent(data_dir, timeout_s=20, force=True)
