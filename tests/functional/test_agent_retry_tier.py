"""`kvctl agent retry-tier disk` (POST /v1/tiers/{tier}/retry): an operator who fixed the
directory of a disk tier the agent could not open at start brings it online now, not after the
agent's backoff (up to 60 s between tries). Before, only the backoff's thread could.

The directory is made unusable for real (a regular file where it should be: tests run as root,
so chmod would not bite); the CLI runs as a process against the agent's real control API."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl import http_serving
from kvctl.agent.api import create_app
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.store.errors import CapacityError
from kvctl.store.tiers.disk import DiskTier
from tests.unit.test_disk_tier import put
from tests.unit.test_disk_tier_retry import _break, _fix

from .agents import closed_port, running_agent
from .waiting import wait_until

KIB = 1024
#: the agent's own retries never come within a test: whatever brings the tier online is the
#: command
NEVER_S = 3600.0


def _kvctl(*args: str, home: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    if home is not None:
        env["XDG_CONFIG_HOME"] = str(home / "xdg")  # no user config file leaks in
    return subprocess.run(
        [sys.executable, "-m", "kvctl", *args],
        capture_output=True,
        text=True,
        env={**env, "COLUMNS": "250"},
        timeout=120,
    )


def _said(run: subprocess.CompletedProcess[str]) -> str:
    return " ".join((run.stdout + run.stderr).split())


@contextlib.contextmanager
def _control_api(runtime: AgentRuntime) -> Iterator[str]:
    """``runtime``'s control API served as the agent serves it, on a loopback port."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(http_serving.serving_config(create_app(runtime), "warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    try:
        wait_until("uvicorn to serve", lambda: server.started, 20)
        host, port = sock.getsockname()
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


def test_retry_tier_brings_a_fixed_disk_tier_online_at_once(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with DiskTier(disk, 4 << 20) as tier:
        for i in range(3):
            put(tier, i, 64 * KIB)
    aside = _break(disk)
    settings = AgentSettings(
        name="r1", data_dir=str(tmp_path), cpu_bytes=1 << 20, disk_bytes=4 << 20, shm=False
    )
    runtime = AgentRuntime.open(settings, disk_retry_first_s=NEVER_S, disk_retry_max_s=NEVER_S)
    retry = runtime.disk_retry
    assert retry is not None
    try:
        with _control_api(runtime) as url:
            # still broken: said so with the reason, exit 1, the tier still absent
            run = _kvctl("agent", "retry-tier", "disk", "--url", url)
            assert run.returncode == 1, _said(run)
            said = _said(run)
            assert "disk tier still unavailable (1 try so far; the agent tries again" in said
            assert "cannot use directory" in said and "fix its directory" in said, said
            assert "disk" in runtime.store.absent_tiers

            # status says how to try it now, and its eviction policy is not running
            run = _kvctl("agent", "status", "--url", url)
            assert run.returncode == 0, _said(run)
            said = _said(run)
            assert "1 retry so far" in said and "`kvctl agent retry-tier disk` tries it now" in said
            assert "disk absent" in said and "disk lineage" not in said, said
            assert "cpu lineage-adaptive" in said, said

            _fix(disk, aside)
            run = _kvctl("agent", "retry-tier", "disk", "--url", url, "--json")
            assert run.returncode == 0, _said(run)
            answer = json.loads(run.stdout)
            assert answer["state"] == "online" and answer["online"] and answer["retried"]
            assert answer["reason"] is None and answer["next_try_s"] is None
            assert answer["tries"] == 2
            assert answer["usage"]["chunks"] == 3
            assert answer["usage"]["used_bytes"] == 3 * 64 * KIB
            # online now, its chunks indexed; the backoff's thread ends (it slept an hour)
            assert runtime.store.absent_tiers == {}
            assert runtime.usage()["disk"]["chunks"] == 3
            thread = retry._thread
            assert thread is not None
            thread.join(20)
            assert not thread.is_alive()

            run = _kvctl("agent", "status", "--url", url)
            said = _said(run)
            assert "unavailable" not in said and "disk absent" not in said, said
            assert "disk lineage-adaptive" in said, said

            # again: nothing to retry, and that is no failure
            run = _kvctl("agent", "retry-tier", "disk", "--url", url)
            assert run.returncode == 0, _said(run)
            assert "disk tier is online already: nothing to retry" in _said(run)
            run = _kvctl("agent", "retry-tier", "cpu", "--url", url, "--json")
            assert run.returncode == 0, _said(run)
            assert json.loads(run.stdout)["retried"] is False

            run = _kvctl("agent", "retry-tier", "ssd", "--url", url)
            assert run.returncode == 1, _said(run)
            said = _said(run)
            assert "unknown tier 'ssd'; this store has cpu, disk" in said, said
            assert "kvctl agent status" in said, said
    finally:
        runtime.close()


def test_retry_tier_names_a_gpu_tier_this_machine_cannot_have(tmp_path: Path) -> None:
    settings = AgentSettings(
        name="r2",
        data_dir=str(tmp_path),
        cpu_bytes=1 << 20,
        disk_bytes=0,
        shm=False,
        gpu_capacity_bytes=1 << 20,
        gpu_device="cuda:63",  # no machine here has 64 GPUs
    )
    runtime = AgentRuntime.open(settings)
    try:
        assert [t["name"] for t in runtime.unavailable_tiers] == ["gpu"]
        with _control_api(runtime) as url:
            run = _kvctl("agent", "retry-tier", "gpu", "--url", url)
        assert run.returncode == 1, _said(run)
        said = _said(run)
        assert "the gpu tier is unavailable on this machine (" in said, said
        assert "restart the agent once that is fixed" in said, said
    finally:
        runtime.close()


def test_retry_tier_of_an_agent_that_is_down_says_so(tmp_path: Path) -> None:
    run = _kvctl("agent", "retry-tier", "disk", "--url", f"http://127.0.0.1:{closed_port()}")
    assert run.returncode == 1, _said(run)
    said = _said(run)
    assert "down: cannot reach the agent at" in said and "start it with" in said, said


def test_retry_tier_on_a_running_agent_by_its_data_dir(tmp_path: Path) -> None:
    """The operator's path: `kvctl agent start` on a broken disk directory, the agent's own
    first retry fails, the directory is fixed, `kvctl agent retry-tier disk --data-dir` brings
    it online with that call's try (the agent's next would be 10 s after its first)."""
    data_dir = tmp_path / "a"
    data_dir.mkdir(mode=0o700)
    (data_dir / "disk").write_bytes(b"not a directory")
    with running_agent(data_dir, "--cpu", "1MiB", "--disk", "4MiB") as agent:
        with agent.control() as control:

            def tried_once() -> bool:
                [gone] = control.info()["unavailable_tiers"]
                return gone.get("tries", 0) >= 1

            wait_until("the agent's own first retry", tried_once, 60)
        (data_dir / "disk").unlink()
        run = _kvctl("agent", "retry-tier", "disk", "--data-dir", str(data_dir), home=data_dir)
        assert run.returncode == 0, _said(run)
        assert "disk tier online: 0 chunks (0 B) in it, capacity 4 MiB" in _said(run)
        with agent.control() as control:
            info = control.info()
        assert info["unavailable_tiers"] == []
        assert [t["name"] for t in info["tiers"]] == ["cpu", "disk"]
        assert "disk tier usable again (try" in agent.log()


def test_retry_tier_brings_a_tier_that_failed_in_service_back_online_once_fixed(
    tmp_path: Path,
) -> None:
    """A disk tier opened at start that then failed (its directory gone under it) is offline,
    not absent: the store would try it again on a put after its retry delay. The command
    writes to it now: still broken, it stays offline (exit 1, the reason); fixed, it is online
    at once (exit 0) and the next put lands in it. Before, the command only said it was not
    retried here."""
    settings = AgentSettings(
        name="r3", data_dir=str(tmp_path), cpu_bytes=64 * KIB, disk_bytes=4 << 20, shm=False
    )
    runtime = AgentRuntime.open(settings)
    runtime.store.offline_retry_s = NEVER_S  # no put of the store's own tries it meanwhile
    try:
        aside = _break(tmp_path / "disk")
        # larger than the cpu tier: it goes to disk, whose write fails, taking it offline
        with pytest.raises(CapacityError):  # and the cpu tier cannot hold it either
            runtime.store.put(b"k" * 16, b"x" * (128 * KIB))
        assert "disk" in runtime.store.offline_tiers
        with _control_api(runtime) as url:
            run = _kvctl("agent", "retry-tier", "disk", "--url", url)
            assert run.returncode == 1, _said(run)
            said = _said(run)
            assert "disk tier still offline (failed in service): disk tier 'disk' cannot" in said
            answer = json.loads(
                _kvctl("agent", "retry-tier", "disk", "--url", url, "--json").stdout
            )
            assert answer["state"] == "offline" and answer["retried"] is True
            assert answer["reason"] == runtime.store.offline_tiers["disk"]
            assert "cannot write in" in answer["reason"], answer

            _fix(tmp_path / "disk", aside)
            run = _kvctl("agent", "retry-tier", "disk", "--url", url)
            assert run.returncode == 0, _said(run)
            assert "disk tier online: 0 chunks (0 B) in it, capacity 4 MiB" in _said(run)
        assert runtime.store.offline_tiers == {}
        runtime.store.put(b"k" * 16, b"x" * (128 * KIB))
        assert runtime.store.locate([b"k" * 16]) == ["disk"]
        # the probe left nothing behind in the directory
        assert not [p.name for p in (tmp_path / "disk").iterdir() if p.name.startswith(".probe")]
    finally:
        runtime.close()
