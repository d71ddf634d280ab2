"""`kvctl agent logs`: the end of a detached agent's log, and with --follow what it logs next,
across the agent's own rollover; a data dir with no log says where such an agent's lines go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.waiting import wait_until

runner = CliRunner()


def _log(data_dir: Path, lines: range) -> Path:
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = data_dir / "agent.log"
    with path.open("a") as f:
        f.writelines(f"line {i}\n" for i in lines)
    return path


def test_the_last_lines_of_the_log(tmp_path: Path) -> None:
    _log(tmp_path / "a", range(1, 101))
    out = runner.invoke(app, ["agent", "logs", "--data-dir", str(tmp_path / "a"), "-n", "3"])
    assert out.exit_code == 0, out.output
    assert out.stdout == "line 98\nline 99\nline 100\n"
    every = runner.invoke(app, ["agent", "logs", "--data-dir", str(tmp_path / "a"), "-n", "500"])
    assert every.stdout.splitlines() == [f"line {i}" for i in range(1, 101)]


def test_no_log_says_where_the_lines_go(tmp_path: Path) -> None:
    out = runner.invoke(app, ["agent", "logs", "--data-dir", str(tmp_path / "none")])
    assert out.exit_code == 2
    said = " ".join(out.output.split())
    assert f"no agent log at {tmp_path / 'none' / 'agent.log'}" in said
    assert "journalctl -u kvctl-agent" in said


def test_follow_goes_on_across_a_rollover_until_interrupted(tmp_path: Path) -> None:
    data_dir = tmp_path / "f"
    path = _log(data_dir, range(1, 6))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvctl",
            "agent",
            "logs",
            "--data-dir",
            str(data_dir),
            "-f",
            "-n",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        got: list[str] = []
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)

        def read_until(last: str) -> bool:
            chunk = proc.stdout.read() if proc.stdout is not None else None
            if chunk:
                got.extend(chunk.decode().splitlines())
            return bool(got) and got[-1] == last

        wait_until("the last lines", lambda: read_until("line 5"), 30.0)
        _log(data_dir, range(6, 8))
        wait_until("lines logged next", lambda: read_until("line 7"), 30.0)
        # a rollover as the agent's: agent.log becomes agent.log.1 (its writer still has it
        # open, and writes its last line there), a new agent.log takes its place
        with path.open("a") as old:
            os.rename(path, path.with_name("agent.log.1"))
            old.write("line 8\n")
        _log(data_dir, range(9, 11))
        wait_until("lines after the rollover", lambda: read_until("line 10"), 30.0)
        assert got == ["line 4", "line 5", "line 6", "line 7", "line 8", "line 9", "line 10"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
