"""`kvctl agent start --detach`: the child gets its settings in a memory file it inherits, never
on its command line (which `ps` shows every user) nor in a file a killed start could leave
behind, and runs with exactly the parent's settings."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent import daemon
from kvctl.agent.config import load_settings
from kvctl.agent.daemon import SETTINGS_FILE_PATTERN, SETTINGS_MEMFD_NAME, AgentState, stop_agent
from kvctl.client import AgentClient
from tests.functional.agents import closed_port, files_holding

TOKEN = "detach-s3cret-token"
POOL_PASSWORD = "p00l-passw0rd"


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "agent"
    yield path
    stop_agent(path, timeout_s=20, force=True)


def test_detached_agent_gets_its_settings_in_a_memory_file_not_argv_nor_a_file(
    tmp_path: Path, data_dir: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")  # no user config file leaks in
    env["KVCTL_TOKEN"] = TOKEN
    env["KVCTL_CPU"] = "16MiB"  # the --cpu flag below must still win in the child
    pool = f"redis://:{POOL_PASSWORD}@127.0.0.1:{closed_port()}/0"
    args = [
        "--data-dir", str(data_dir), "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
        "--cpu", "8MiB", "--disk", "0", "--pool", pool, "--name", "detached-1",
    ]  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "kvctl", "agent", "start", "--detach", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    state = AgentState.read(data_dir)
    assert state is not None and state.alive
    argv = Path(f"/proc/{state.pid}/cmdline").read_bytes().split(b"\0")
    assert b"--settings-fd" in argv
    assert not any(TOKEN.encode() in a or POOL_PASSWORD.encode() in a for a in argv), argv
    assert not list(data_dir.glob(SETTINGS_FILE_PATTERN))
    secrets = (TOKEN.encode(), POOL_PASSWORD.encode())
    assert not files_holding(data_dir, *secrets)
    environ = Path(f"/proc/{state.pid}/environ").read_bytes()
    assert not any(s in environ for s in secrets)  # it reads no KVCTL_* setting: given none
    # read at start, then closed: the running agent holds no memory file with them
    assert not [t for t in daemon._fd_targets(state.pid) if SETTINGS_MEMFD_NAME in t]
    with AgentClient(state.control_url, token=TOKEN) as client:
        info = client.info()
    assert info["name"] == "detached-1"
    assert {t["name"]: t["capacity_bytes"] for t in info["tiers"]} == {"cpu": 8 << 20}


def test_an_agent_not_serving_in_time_is_stopped_and_the_error_says_so(
    tmp_path: Path, data_dir: Path
) -> None:
    from kvctl.agent.daemon import spawn_agent

    with pytest.raises(
        RuntimeError, match=r"not serving after 0 s, its log silent for the last 0 s, so stopped"
    ) as caught:
        argv = ["--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--cpu", "8MiB"]
        spawn_agent([*argv, "--disk", "0"], data_dir, timeout_s=0.01)
    assert f"in {data_dir / 'agent.log'}" in str(caught.value)  # with what it logged, if any
    state = AgentState.read(data_dir)
    assert state is None or not state.alive


def test_a_failed_start_shows_what_this_run_logged_not_an_earlier_ones(data_dir: Path) -> None:
    """Before: the error showed the log file's last 20 lines, so an earlier failed start's
    error ('cannot listen on ...') stood first, as if it were this one's cause."""
    from kvctl.agent.daemon import spawn_agent

    data_dir.mkdir(parents=True, exist_ok=True)
    earlier = "2026-01-01 00:00:00,000 ERROR kvctl.agent: cannot listen on 127.0.0.1:1 (EARLIER)"
    (data_dir / "agent.log").write_text(earlier + "\n")
    (data_dir / "agent.log").chmod(0o600)
    argv = ["--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0", "--cpu", "5TiB"]
    with pytest.raises(RuntimeError) as caught:
        spawn_agent([*argv, "--disk", "0"], data_dir, timeout_s=60)
    said = str(caught.value)
    assert "EARLIER" not in said, said
    assert "what it logged, in" in said and "5" in said.partition("what it logged")[2], said


def test_no_file_holds_the_token_when_the_child_is_spawned(
    tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The moment the child is spawned is the last a kill of its start could strand what it
    hands over: nothing under the data dir (nor its parent) holds the token then."""
    flags = {
        "data_dir": str(data_dir), "listen": "127.0.0.1:0", "data_listen": "127.0.0.1:0",
        "cpu": "8MiB", "disk": 0, "token": TOKEN,
    }  # fmt: skip
    settings = load_settings(flags=flags, env={}).settings
    seen: list[list[str]] = []
    real_popen = subprocess.Popen

    def spawning(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append([str(p) for p in files_holding(tmp_path, TOKEN.encode())])
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(daemon.subprocess, "Popen", spawning)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    proc, state = daemon.spawn_with_settings(settings, env=env, detach=False)
    try:
        assert seen == [[]]
        with AgentClient(state.control_url, token=TOKEN) as client:
            assert client.info()["tiers"][0]["capacity_bytes"] == 8 << 20
    finally:
        stop_agent(data_dir, timeout_s=20, force=True)
        proc.wait(20)


def test_a_start_with_its_standard_streams_closed_hands_over_its_settings(
    tmp_path: Path, data_dir: Path
) -> None:
    """Run with stdin and stdout closed (a cron job, `<&- >&-`): the memory file is not given
    fd 0 or 1, which its child's own stdin and log are put over (the agent then read
    /dev/null for its settings and came up with every default: found in review)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    env["KVCTL_TOKEN"] = TOKEN
    args = [
        "--data-dir", str(data_dir), "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
        "--cpu", "8MiB", "--disk", "0", "--name", "closed-streams",
    ]  # fmt: skip

    def close_stdin_and_stdout() -> None:
        os.close(0)
        os.close(1)

    out = subprocess.run(
        [sys.executable, "-m", "kvctl", "agent", "start", "--detach", *args],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        preexec_fn=close_stdin_and_stdout,
    )
    assert out.returncode == 0, out.stderr
    state = AgentState.read(data_dir)
    assert state is not None and state.alive and state.name == "closed-streams"
    with AgentClient(state.control_url, token=TOKEN) as client:
        assert {t["name"]: t["capacity_bytes"] for t in client.info()["tiers"]} == {"cpu": 8 << 20}


def test_settings_fd_names_only_a_memory_file_of_settings(tmp_path: Path) -> None:
    """--settings-fd given anything but the memory file a detaching start makes (here its
    stdin, /dev/null, which would read as all defaults) is refused, naming what it is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    out = subprocess.run(
        [sys.executable, "-m", "kvctl", "agent", "start", "--settings-fd", "0"],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stdout + out.stderr
    said = " ".join(out.stderr.split())
    assert "descriptor 0 is /dev/null, not the settings a detaching start hands its agent" in said
    assert "Traceback" not in out.stderr
