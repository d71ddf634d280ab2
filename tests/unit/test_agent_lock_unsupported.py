"""A data dir on a filesystem that refuses flock (NFSv3 whose lock daemon does not answer:
ENOLCK; some FUSE and network filesystems: EOPNOTSUPP): the agent still starts there, as it did
before agent.lock, and status/stop fall back to agent.json's pid instead of failing. No such
filesystem can be mounted here, so flock is made to fail the way theirs does."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.agent import daemon
from kvctl.agent.daemon import LOCK_FILE, STATE_FILE, hold_data_dir, running_agent
from kvctl.cli.main import app


@pytest.fixture
def no_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    def flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    fake = types.SimpleNamespace(**{k: getattr(fcntl, k) for k in dir(fcntl) if k.isupper()})
    fake.flock = flock
    monkeypatch.setattr(daemon, "fcntl", fake)


@pytest.fixture
def kvctl_like() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that pid_alive takes for a kvctl one (its command line says kvctl)."""
    code = "import time; print('up', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code, "kvctl"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def test_an_agent_starts_on_a_data_dir_without_flock_and_says_so(
    tmp_path: Path, no_flock: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvctl.agent"):
        fd = hold_data_dir(tmp_path)  # raised OSError: the agent did not start at all
    assert fd < 0
    said = " ".join(caplog.messages)
    assert "cannot lock" in said and "No locks available" in said


def test_status_and_stop_fall_back_to_the_recorded_pid_where_flock_fails(
    tmp_path: Path, no_flock: None, kvctl_like: subprocess.Popen[bytes]
) -> None:
    (tmp_path / LOCK_FILE).write_text("")  # left by the agent's own try
    record = {"pid": kvctl_like.pid, "name": "a", "dc": "local",
              "control_url": "http://127.0.0.1:1", "data_tcp": None, "data_unix": None,
              "started_s": 1.0, "version": "0"}  # fmt: skip
    (tmp_path / STATE_FILE).write_text(json.dumps(record))
    state = running_agent(tmp_path)  # raised OSError
    assert state is not None and state.pid == kvctl_like.pid

    env = {k: None for k in os.environ if k.startswith("KVCTL_")}
    stop = CliRunner().invoke(
        app, ["agent", "stop", "--data-dir", str(tmp_path), "--timeout", "10"], env=env
    )
    assert stop.exit_code == 0, stop.output
    assert f"(pid {kvctl_like.pid}) stopped" in " ".join(stop.output.split())
    assert kvctl_like.wait(10) != 0
