"""`kvctl demo` as a user runs it: a real subprocess that starts a pool agent, agents with the pool
and each other as peers, a router and a collector, replays through the router, stops at
--duration or a signal, leaves no process behind and a readable workspace, and cleans up after a
demo that was killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    env["COLUMNS"] = "120"
    return env


def _demo(workdir: Path, *args: str) -> list[str]:
    dashboard = () if "--dashboard" in args else ("--no-dashboard",)
    return [
        sys.executable, "-m", "kvctl", "demo", "--workdir", str(workdir),
        "--no-browser", *dashboard, *args,
    ]  # fmt: skip


def _run_demo(tmp_path: Path, workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _demo(workdir, *args), capture_output=True, text=True, env=_env(tmp_path), timeout=240
    )


def _start_demo(
    tmp_path: Path, workdir: Path, stdout: int, *args: str, role: str = "collector"
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        _demo(workdir, *args),
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path),
    )
    _wait_running(workdir, proc, role)
    return proc


def _ours(workdir: Path) -> list[str]:
    """Command lines of live processes that belong to this workspace (but not zombies)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if str(workdir) in cmdline and state != "Z":
            found.append(cmdline)
    return found


def test_demo_runs_for_its_duration_and_leaves_nothing_running(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    done = _run_demo(tmp_path, workdir, "--duration", "12", "--workload", "chat", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["requests"]["requests"] > 0
    assert out["agents_agree"] is True
    assert out["database"]["agree"] is True, out["database"]
    # the router's own count, as the collector recorded it, equals the decisions the replay got
    routed = out["database"]["nodes"]["router"]["decisions"]
    assert routed == {"replay": out["router"]["decisions"], "database": out["router"]["decisions"]}
    assert set(out["nodes"]) == {"fra-1-a", "fra-1-b", "ams-1-a", "ams-1-b"}  # not the pool
    # the router routed; the agents, not the replay, pulled from their peers and the pool
    assert out["routing"] == "router" and out["router"]["decisions"] > 0
    routing = out["router"]
    assert (
        routing["decisions"] + routing["fallbacks"] + routing["no_chunks"]
        == (out["requests"]["requests"])
    )
    tiers = out["requests"]["hits_by_tier"]
    assert tiers.get("peer", 0) + tiers.get("remote", 0) > 0, tiers
    pulled = sum(link["chunks"] for link in out["pulls"]["by_link"].values())
    assert pulled > 0 and out["pulls"]["basis"].startswith("measured")
    assert out["links_emulated"] == {}  # the replay emulates nothing: the agents do
    link = out["agent_links"]["ams-1<->fra-1"]
    assert link["basis"] == "emulated" and link["delay_ms"] == pytest.approx(0.8)
    assert _ours(workdir) == []
    state = json.loads((workdir / "demo.json").read_text())
    assert state["status"] == "stopped"
    assert state["router_url"] == out["router_url"]
    roles = sorted(p["role"] for p in state["processes"])
    assert roles == ["agent"] * 4 + ["collector", "pool", "router"]
    assert json.loads((workdir / "replay.json").read_text())["requests"] == out["requests"]
    assert (workdir / "kvctl.db").is_file() and (workdir / "collector.log").is_file()
    # the same requests replayed under every policy, saved for the dashboard's Routing page
    compared = out["routing_compared"]
    assert compared["requests"] == out["requests"]["requests"]
    assert set(compared["policies"]) == {"round-robin", "session-affinity", "prefix-only", "cost"}
    assert all(p["index_mismatches"] == 0 for p in compared["policies"].values())
    from kvctl.db.migrate import open_db
    from kvctl.db.route_reports import latest_route_report

    engine = open_db(state["db_url"])
    try:
        with engine.connect() as conn:
            assert latest_route_report(conn) == compared
    finally:
        engine.dispose()

    # a second run in the same workspace, over an earlier one's leftovers: see the next test


def _wait_running(
    workdir: Path, proc: subprocess.Popen[str], role: str, timeout_s: float = 90
) -> None:
    """Until the demo runs, with a process of ``role`` started."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = json.loads((workdir / "demo.json").read_text())
            if state["status"] == "running" and role in {p["role"] for p in state["processes"]}:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("the demo did not come up")


def test_ctrl_c_stops_everything(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    proc = _start_demo(tmp_path, workdir, subprocess.PIPE)
    # a second demo in the same workspace must not take the running one's fleet for leftovers
    second = _run_demo(tmp_path, workdir, "--duration", "3")
    assert second.returncode == 2
    assert "another kvctl demo" in second.stderr and str(proc.pid) in second.stderr
    # the first demo, its four agents, the pool, the router and the collector
    assert len(_ours(workdir)) == 8
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped early" in out
    assert _ours(workdir) == []


def test_a_killed_demo_is_cleaned_up_by_the_next(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    proc = _start_demo(tmp_path, workdir, subprocess.DEVNULL, "--dashboard", role="dashboard")
    state = json.loads((workdir / "demo.json").read_text())
    (dash,) = [p for p in state["processes"] if p["role"] == "dashboard"]
    proc.kill()  # no chance to clean up: its agents, pool, router, collector, dashboard run on
    proc.wait(30)
    # four agents, the pool, the router, the collector and the dashboard
    assert len(_ours(workdir)) == 8
    assert Path(f"/proc/{dash['pid']}").exists()
    # a second run in the same workspace starts over the leftovers (running processes, disk
    # tiers, history), and its report reads as a first run's
    done = _run_demo(tmp_path, workdir, "--duration", "4", "--nodes-per-dc", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "database: the collected counters equal the replay's" in done.stdout
    assert "fra-1-a (fra-1)" in done.stdout and "modeled" in done.stdout
    assert "router decisions" in done.stdout
    assert "routing compared on the same" in done.stdout
    assert "left running by an earlier demo" in done.stdout
    for what in ("router router", "pool pool", "dashboard dashboard"):
        assert f"stopped {what} left running" in done.stdout, done.stdout
    assert _ours(workdir) == []
    # the inventory follows the new, smaller fleet
    assert "fra-1-b" not in done.stdout.split("stopping")[-1]


def test_demo_help_and_bad_input(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvctl.cli.main import app

    result = CliRunner().invoke(app, ["demo", "--workload", "nope", "--workdir", str(tmp_path)])
    assert result.exit_code == 2
    assert "nope" in result.output
    assert not (tmp_path / "demo.json").exists()
