"""What `kvctl agent start/stop/status` make of a data dir whose agent died without cleaning up
(SIGKILL, a crash, a reboot): its agent.json stays, naming a pid that may be another process's
by now, even another agent's. And two agents on one data dir: the second must refuse."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.agent.daemon import STATE_FILE, AgentState, _answers, stop_agent
from kvctl.cli.main import app
from tests.functional.agents import (
    EPHEMERAL,
    closed_port,
    files_holding,
    running_agent,
    start_agent,
    start_in_foreground,
)
from tests.tmpfs import tmpfs

runner = CliRunner()
SMALL = ["--cpu", "8MiB", "--disk", "0", "--socket", "off"]


def _run(tmp_path: Path, *args: str, **env: str) -> Any:
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    clean["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    clean["COLUMNS"] = "1000"
    return runner.invoke(app, list(args), env=clean | env)


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_a_dead_agents_pid_now_another_agents_is_not_stopped_and_does_not_block_a_start(
    tmp_path: Path,
) -> None:
    dead_dir, other_dir = tmp_path / "dead", tmp_path / "other"
    killed = start_agent(dead_dir, *SMALL)
    killed.kill9()
    with running_agent(other_dir, *SMALL) as other:
        # the killed agent's pid, reused (after a reboot, say) by the agent of another data dir
        record = json.loads((dead_dir / STATE_FILE).read_text())
        record["pid"] = other.proc.pid
        (dead_dir / STATE_FILE).write_text(json.dumps(record))

        status = _run(tmp_path, "agent", "status", "--data-dir", str(dead_dir))
        assert status.exit_code == 1, status.output
        assert "is not running: it did not stop cleanly" in _flat(status.output)

        stop = _run(tmp_path, "agent", "stop", "--data-dir", str(dead_dir))
        assert stop.exit_code == 0, stop.output
        assert f"no agent is running for {dead_dir}" in _flat(stop.output)
        assert other.proc.poll() is None, "stop signalled another data dir's agent"

        argv = ["--data-dir", str(dead_dir), *EPHEMERAL, *SMALL, "--detach"]
        start = _run(tmp_path, "agent", "start", *argv)
        try:
            assert start.exit_code == 0, start.output
            state = AgentState.read(dead_dir)
            assert state is not None and state.pid not in (other.proc.pid, killed.proc.pid)
        finally:
            stop_agent(dead_dir, timeout_s=20, force=True)
        assert other.proc.poll() is None


def test_a_second_agent_on_a_data_dir_whose_agent_is_still_starting_refuses(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "agent"
    with running_agent(data_dir, *SMALL) as first:
        # as the first agent is until it has opened its tiers (a large disk tier's scan takes
        # minutes): running, its agent.json not written yet
        (data_dir / STATE_FILE).unlink()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
        argv = ["--data-dir", str(data_dir), *EPHEMERAL, *SMALL]
        second = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "agent", "start", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            out, _ = second.communicate(timeout=60)  # a hang guard: it serves forever if let
        finally:
            if second.poll() is None:
                second.kill()
                second.wait(10)
        said = _flat(out.decode(errors="replace"))
        assert second.returncode == 1, said
        assert f"an agent (pid {first.proc.pid}) already serves {data_dir}" in said
        assert first.proc.poll() is None


def test_stop_of_an_agent_that_ignores_sigterm_says_it_waited_then_killed(tmp_path: Path) -> None:
    data_dir = tmp_path / "agent"
    agent = start_agent(data_dir, *SMALL)
    try:
        os.kill(agent.proc.pid, signal.SIGSTOP)  # hung: SIGTERM is not acted on
        stop = _run(tmp_path, "agent", "stop", "--data-dir", str(data_dir), "--timeout", "1")
        assert stop.exit_code == 1, stop.output
        said = _flat(stop.output)
        assert f"agent pid {agent.proc.pid} still running 1 s after SIGTERM" in said
        assert "--force" in said
        assert agent.proc.poll() is None

        argv = ["--data-dir", str(data_dir), "--timeout", "1", "--force"]
        stop = _run(tmp_path, "agent", "stop", *argv)
        assert stop.exit_code == 0, stop.output
        assert "killed (SIGKILL): it had not exited 1 s after SIGTERM" in _flat(stop.output)
        assert agent.proc.wait(10) == -signal.SIGKILL
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)


@pytest.mark.parametrize("detach", [True, False])
def test_a_data_dir_not_utf8_is_refused_before_anything_is_made(
    tmp_path: Path, detach: bool
) -> None:
    data_dir = os.fsencode(tmp_path) + b"/d\xff\xfeir with space"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    argv = [b"--data-dir", data_dir, *(a.encode() for a in [*EPHEMERAL, *SMALL])]
    proc = subprocess.Popen(
        [sys.executable.encode(), b"-m", b"kvctl", b"agent", b"start", *argv]
        + ([b"--detach"] if detach else []),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:  # a hang guard: a foreground agent serves until stopped
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    said = _flat(err.decode(errors="replace"))
    assert proc.returncode == 2, said
    assert "error: data_dir '" in said and "\\xff\\xfeir with space' is not valid UTF-8" in said
    assert "Traceback" not in said and "UnicodeEncodeError" not in said
    assert not os.path.exists(data_dir)


def test_the_commands_said_for_a_data_dir_with_spaces_run_as_copied(tmp_path: Path) -> None:
    data_dir = tmp_path / "data dir's"
    start = _run(tmp_path, "agent", "start", "--data-dir", str(data_dir), *EPHEMERAL, *SMALL, "-d")
    try:
        assert start.exit_code == 0, start.output
        # the command the start line says stops it, pasted into a shell
        said = _flat(start.output).split("stop: ", 1)[1]
        words = shlex.split(said)
        assert words[:3] == ["kvctl", "agent", "stop"], said
        stop = _run(tmp_path, *words[1:])
        assert stop.exit_code == 0, stop.output
        assert AgentState.read(data_dir) is None
        status = _run(tmp_path, "agent", "status", "--data-dir", str(data_dir))
        assert status.exit_code == 1, status.output
        hint = _flat(status.output).split("start one there: `", 1)[1].split("`", 1)[0]
        assert shlex.split(hint)[:5] == ["kvctl", "agent", "start", "--data-dir", str(data_dir)]
    finally:
        stop_agent(data_dir, timeout_s=20, force=True)


def test_a_detached_start_repeats_what_it_warned_of(tmp_path: Path) -> None:
    data_dir = tmp_path / "agent"
    data_dir.mkdir(mode=0o755)
    data_dir.chmod(0o755)  # others can list it: the agent warns
    argv = ["--data-dir", str(data_dir), *EPHEMERAL, "--cpu", "8MiB", "--disk", "100000TiB"]
    start = _run(tmp_path, "agent", "start", *argv, "--detach")
    try:
        assert start.exit_code == 0, start.output
        said = _flat(start.output)
        assert "warning: disk tier disk: capacity" in said and "lower --disk or free space" in said
        assert f"warning: data directory {data_dir} has mode 0755" in said, said
        assert said.index("started (pid") < said.index("warning:")
    finally:
        stop_agent(data_dir, timeout_s=20, force=True)


def test_a_config_file_others_can_read_giving_the_token_is_warned_of(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    secret = "cfg-t0ken-s3cret"
    config.write_text(f'[agent]\ntoken = "{secret}"\ncpu = "8MiB"\ndisk = "0"\n')
    data_dir = tmp_path / "agent"
    argv = ["--config", str(config), "--data-dir", str(data_dir), *EPHEMERAL, "--detach"]
    try:
        for mode, warned in ((0o644, True), (0o600, False)):
            config.chmod(mode)
            start = _run(tmp_path, "agent", "start", *argv)
            assert start.exit_code == 0, start.output
            said = _flat(start.output)
            expected = (
                f"warning: {config} gives token and other users can read it (mode 0644): "
                f"`chmod 600 {config}`"
            )
            assert (expected in said) is warned, said
            assert secret not in said
            stop_agent(data_dir, timeout_s=20)
    finally:
        stop_agent(data_dir, timeout_s=20, force=True)


def test_a_socket_path_another_agent_listens_on_or_a_file_is_left_as_it_is(
    tmp_path: Path,
) -> None:
    sock = tmp_path / "engines.sock"
    args = ["--cpu", "8MiB", "--disk", "0", "--socket", str(sock)]
    with running_agent(tmp_path / "a", *args) as first:
        argv = ["--data-dir", str(tmp_path / "b"), *EPHEMERAL, *args]
        code, said = start_in_foreground(tmp_path / "xdg", *argv)
        assert code == 1, said
        assert f"Unix socket (socket) on {sock}: another agent" in said, said
        with first.data("unix") as client:  # the first agent's engines still reach it there
            assert client.ping() >= 0
    # after a clean stop the path is free; a killed agent's socket is taken over
    killed = start_agent(tmp_path / "a", *args)
    killed.kill9()
    assert sock.is_socket()
    with running_agent(tmp_path / "b", *args) as taken, taken.data("unix") as client:
        assert client.ping() >= 0
    assert not sock.exists()
    # a --socket naming a file by mistake: refused, the file kept
    sock.write_text("not a socket\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    argv = ["--data-dir", str(tmp_path / "c"), *EPHEMERAL, *args]
    out = subprocess.run(
        [sys.executable, "-m", "kvctl", "agent", "start", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert "it exists and is not a socket (left as it is)" in _flat(out.stderr)
    assert sock.read_text() == "not a socket\n"


def test_an_agent_still_starting_is_said_starting_and_stop_stops_it(tmp_path: Path) -> None:
    data_dir = tmp_path / "agent"
    agent = start_agent(data_dir, *SMALL)
    try:
        # as an agent is while it opens its tiers after a crash: the lock held, agent.json
        # still the dead agent's (its pid gone, its URL closed)
        record = json.loads((data_dir / STATE_FILE).read_text())
        dead = subprocess.Popen(["true"])
        dead.wait()
        record |= {"pid": dead.pid, "control_url": f"http://127.0.0.1:{closed_port()}"}
        (data_dir / STATE_FILE).write_text(json.dumps(record))
        starting = f"an agent (pid {agent.proc.pid}) is starting from {data_dir}"

        for named in (True, False):
            where = ["--data-dir", str(data_dir)] if named else []
            status = _run(tmp_path, "agent", "status", *where, KVCTL_DATA_DIR=str(data_dir))
            assert status.exit_code == 1, status.output
            assert starting in _flat(status.output), status.output
            assert "hung" not in status.output and "--force" not in status.output

        stop = _run(tmp_path, "agent", "stop", "--data-dir", str(data_dir))
        assert stop.exit_code == 0, stop.output
        said = _flat(stop.output)
        assert f"agent starting from {data_dir} (pid {agent.proc.pid}) stopped" in said
        assert agent.proc.wait(20) == 0
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait(10)


def _start_cmd(tmp_path: Path, data_dir: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    argv = ["--data-dir", str(data_dir), *EPHEMERAL, *SMALL, "--detach", *args]
    return [sys.executable, "-m", "kvctl", "agent", "start", *argv], env


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat_text = Path(entry.path, "stat").read_text()
            except OSError:
                continue  # gone meanwhile
            if int(stat_text.rpartition(")")[2].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_a_detach_killed_midway_leaves_its_token_in_no_file(tmp_path: Path) -> None:
    """Killed (a closed ssh session, an OOM kill) once its agent exists, before it serves: the
    token it hands its agent is in no file, and the agent serves on."""
    data_dir = tmp_path / "agent"
    cmd, env = _start_cmd(tmp_path, data_dir)
    env["KVCTL_TOKEN"] = "midway-t0ken"
    parent = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(2000):  # a hang guard, 100 s at most
            if _children(parent.pid) or parent.poll() is not None:
                break
            time.sleep(0.05)
        assert parent.poll() is None, "the start ended before it had started its agent"
        parent.kill()  # its agent exists: it holds its settings already
        parent.wait(10)
        for _ in range(600):  # its agent, in a session of its own, starts on
            if (state := AgentState.read(data_dir)) is not None and state.alive:
                break
            time.sleep(0.1)
        assert AgentState.read(data_dir) is not None, "the detached agent did not start"
        assert not list(data_dir.glob("agent-settings*"))
        assert not files_holding(tmp_path, b"midway-t0ken")
    finally:
        stop_agent(data_dir, timeout_s=20, force=True)


def test_two_detached_starts_at_once_each_hand_their_own_settings(tmp_path: Path) -> None:
    data_dir = tmp_path / "agent"
    for round_ in range(2):
        names = [f"r{round_}-{i}" for i in (1, 2)]
        starts = []
        for name in names:
            cmd, env = _start_cmd(tmp_path, data_dir, "--name", name)
            starts.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
        try:
            outs = [p.communicate(timeout=90)[0] for p in starts]
        finally:
            for p in starts:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
        try:
            codes = [p.returncode for p in starts]
            assert sorted(codes) == [0, 1], (codes, outs)
            won = codes.index(0)
            state = AgentState.read(data_dir)
            assert state is not None and state.name == names[won], (names[won], state)
            assert f"agent {names[won]} started" in outs[won]
            assert stop_agent(data_dir, timeout_s=20) is not None
            assert not list(data_dir.glob("agent-settings*"))
        finally:  # the detached agent is no child of the test's: stopped here whatever failed
            stop_agent(data_dir, timeout_s=20, force=True)


def test_a_pool_password_on_a_foreground_agents_command_line_is_warned_of(
    tmp_path: Path,
) -> None:
    password = "p00l-on-argv"
    pool = f"redis://:{password}@127.0.0.1:{closed_port()}/0"
    with running_agent(tmp_path / "agent", *SMALL, "--pool", pool) as agent:
        log = _flat(agent.log())
    assert "warning: the password in --pool is on this agent's command line" in log, log
    assert password not in log
    # the same URL from the environment: nothing on the command line, nothing said
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    env["KVCTL_POOL"] = pool
    from kvctl.agent.daemon import spawn_agent

    proc, _ = spawn_agent([*EPHEMERAL, *SMALL], tmp_path / "env", env=env, detach=False)
    proc.terminate()
    assert proc.wait(20) == 0
    assert "--pool" not in (tmp_path / "env" / "agent.log").read_text()


@pytest.mark.parametrize("detach", [True, False])
def test_a_data_dir_on_a_read_only_filesystem_is_said_so(tmp_path: Path, detach: bool) -> None:
    with tmpfs(tmp_path / "fs", "1m") as fs:
        (fs / "agent").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True, timeout=30)
        argv = ["--data-dir", str(fs / "agent"), *EPHEMERAL, *SMALL]
        start = _run(tmp_path, "agent", "start", *argv, *(["--detach"] if detach else []))
        assert start.exit_code == 2, start.output
        said = _flat(start.output)
        assert f"the data directory {fs / 'agent'} is on a read-only filesystem" in said, said
        assert "owner or mode" not in said


def test_a_lock_holder_that_wrote_no_pid_does_not_make_stop_signal_the_records_pid(
    tmp_path: Path,
) -> None:
    """A data dir's lock held by a process whose pid is not in the lock file (an agent between
    taking the lock and writing its pid, or one whose pid did not fit on a full filesystem),
    beside a dead agent's agent.json naming a pid now another agent's: the held lock was taken
    for proof that the recorded pid runs, and stop SIGTERMed the other data dir's agent."""
    dead_dir, other_dir = tmp_path / "dead", tmp_path / "other"
    killed = start_agent(dead_dir, *SMALL)
    killed.kill9()
    holder_code = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.ftruncate(fd, 0)\n"
        "print('held', flush=True)\n"
        "time.sleep(120)\n"
    )
    with running_agent(other_dir, *SMALL) as other:
        record = json.loads((dead_dir / STATE_FILE).read_text())
        record["pid"] = other.proc.pid
        (dead_dir / STATE_FILE).write_text(json.dumps(record))
        holder = subprocess.Popen(
            [sys.executable, "-c", holder_code, str(dead_dir / "agent.lock")],
            stdout=subprocess.PIPE,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
            stop = _run(tmp_path, "agent", "stop", "--data-dir", str(dead_dir), "--timeout", "2")
            time.sleep(0.5)  # a SIGTERM sent would have the other agent on its way out
            assert other.proc.poll() is None, (
                f"stop signalled another data dir's agent: {stop.output}"
            )
            said = _flat(stop.output)
            assert str(other.proc.pid) not in said, said
            # the lock's holder is the one stopped, found through the kernel's lock table
            assert f"(pid {holder.pid})" in said, said
            assert holder.wait(10) == -signal.SIGTERM
        finally:
            if holder.poll() is None:
                holder.kill()
                holder.wait(10)


def test_stop_says_stopped_once_the_agent_process_is_gone_not_when_it_drops_its_lock(
    tmp_path: Path,
) -> None:
    """An agent drops agent.lock as serve() returns, and its process exits after that (atexit
    handlers, threads joined at exit, a GPU context's teardown): stop waited only for the lock,
    so it said 'stopped' (and a script went on to its next step) while the agent's process
    still ran; before the lock it waited for the pid to be gone. Here the exit is made slow."""
    data_dir = tmp_path / "agent"
    argv = ["kvctl", "agent", "start", "--data-dir", str(data_dir), *EPHEMERAL, *SMALL]
    exited = tmp_path / "exited"  # written by the agent's process as the last thing it does
    code = (
        "import atexit, pathlib, sys, time\n"
        f"atexit.register(pathlib.Path({str(exited)!r}).touch)\n"
        "atexit.register(time.sleep, 2.0)\n"
        f"sys.argv = {argv!r}\n"
        "from kvctl.cli.main import main\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    agent = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    try:
        deadline_s = time.monotonic() + 60  # a hang guard
        while (state := AgentState.read(data_dir)) is None or not _answers(state.control_url):
            assert agent.poll() is None and time.monotonic() < deadline_s
            time.sleep(0.05)
        stop = _run(tmp_path, "agent", "stop", "--data-dir", str(data_dir), "--timeout", "20")
        assert stop.exit_code == 0, stop.output
        assert f"(pid {agent.pid}) stopped" in _flat(stop.output)
        assert exited.exists(), "stop said 'stopped' while the agent's process still ran"
        assert agent.wait(10) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.wait(10)


def test_a_pool_url_not_utf8_is_refused_without_showing_its_password(tmp_path: Path) -> None:
    """115db57's refusal of a setting that is not UTF-8 quoted its value, the pool URL's password
    included (a Latin-1 password in KVCTL_POOL), to the terminal or the service's journal, and
    told the operator to 'rename the directory'."""
    env: dict[bytes, bytes] = {
        os.fsencode(k): os.fsencode(v) for k, v in os.environ.items() if not k.startswith("KVCTL_")
    }
    env[b"XDG_CONFIG_HOME"] = os.fsencode(tmp_path / "xdg")
    env[b"KVCTL_POOL"] = b"redis://:p\xe4ssw0rd-secret@127.0.0.1:1/0"
    data_dir = tmp_path / "agent"
    argv = ["--data-dir", str(data_dir), *EPHEMERAL, *SMALL, "--detach"]
    proc = subprocess.run(
        [sys.executable, "-m", "kvctl", "agent", "start", *argv],
        env=env,
        capture_output=True,
        timeout=60,  # a hang guard
    )
    said = _flat(proc.stderr.decode(errors="replace"))
    assert proc.returncode == 2, said
    assert "pool" in said and "is not valid UTF-8" in said
    assert "w0rd-secret" not in said and "p\\xe4ss" not in said, said
    assert "rename the directory" not in said, said


def test_status_of_a_stopped_agent_says_it_is_stopped_and_how_to_resume_it(
    tmp_path: Path,
) -> None:
    """An agent run in a terminal and suspended there (Ctrl-Z) answers nothing: "not
    answering ... hung or overloaded? ... `kvctl agent stop --force`" sent the operator to kill
    an agent that one `kill -CONT` resumes."""
    data_dir = tmp_path / "agent"
    agent = start_agent(data_dir, *SMALL)
    pid = agent.proc.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        out = _run(tmp_path, "agent", "status", "--data-dir", str(data_dir))
        report = json.loads(
            _run(tmp_path, "agent", "status", "--data-dir", str(data_dir), "--json").stdout
        )
        assert out.exit_code == 1, out.output
        said = _flat(out.output)
        assert said.startswith("not answering:"), said
        assert f"the agent process (pid {pid}) is stopped" in said and f"`kill -CONT {pid}`" in said
        assert "hung or overloaded" not in said
        assert report["up"] is False and f"(pid {pid}) is stopped" in report["error"]
        # a stop waits in vain: the SIGTERM is acted on once the agent is resumed
        stop = _run(tmp_path, "agent", "stop", "--data-dir", str(data_dir), "--timeout", "1")
        assert stop.exit_code == 1, stop.output
        said = _flat(stop.output)
        assert f"agent pid {pid} still running 1 s after SIGTERM" in said
        assert f"it is stopped (SIGSTOP, or Ctrl-Z in its terminal): `kill -CONT {pid}`" in said
        os.kill(pid, signal.SIGCONT)
        assert agent.proc.wait(60) == 0  # the SIGTERM, acted on: a clean stop
    finally:
        if agent.proc.poll() is None:
            os.kill(pid, signal.SIGCONT)
            stop_agent(data_dir, timeout_s=30, force=True)
