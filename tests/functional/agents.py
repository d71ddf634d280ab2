"""Real agent processes for functional tests: started with `kvctl agent start` on loopback with
ephemeral ports, stopped with SIGTERM (and the exit code checked). One a failed test left
running is killed when the test process exits."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvctl.agent.daemon import AgentState, spawn_agent
from kvctl.client import AgentClient, DataClient
from kvctl.ports import free_loopback_port

EPHEMERAL = ["--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0"]
#: the host-memory tier of an agent whose test does not size it: the default (1 GiB) is
#: committed at start and released at stop, about 0.4 s of CPU for each of the suite's
#: hundreds of agents, for room no test without --cpu fills
TEST_CPU = ["--cpu", "64MiB"]


@dataclass
class Agent:
    data_dir: Path
    proc: subprocess.Popen[bytes]
    state: AgentState
    token: str = ""
    args: list[str] = field(default_factory=list)

    def data(self, transport: str = "tcp", **kw: object) -> DataClient:
        address = self.state.data_tcp if transport == "tcp" else self.state.data_unix
        assert address is not None
        return DataClient.connect(address, token=self.token, **kw)  # type: ignore[arg-type]

    def control(self, token: str | None = None) -> AgentClient:
        return AgentClient(self.state.control_url, token=self.token if token is None else token)

    def stop(self, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def log(self) -> str:
        return (self.data_dir / "agent.log").read_text(errors="replace")


def start_agent(data_dir: Path, *args: str, token: str = "") -> Agent:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(data_dir / "xdg")  # no user config file leaks in
    if token:
        env["KVCTL_TOKEN"] = token
    sized = any(a in ("--cpu", "--config", "-c") or a.startswith("--cpu=") for a in args)
    proc, state = spawn_agent(
        [*EPHEMERAL, *([] if sized else TEST_CPU), *args], data_dir, env=env, detach=False
    )
    _started.append(proc)
    return Agent(data_dir, proc, state, token, list(args))


#: every agent process started here: a test that fails before stopping its agent would leave it
#: running past the test run (found idle hours later, taking CPU from the next runs)
_started: list[subprocess.Popen[bytes]] = []


@atexit.register
def _kill_leftovers() -> None:
    for proc in _started:
        if proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


@contextlib.contextmanager
def running_agent(data_dir: Path, *args: str, token: str = "") -> Iterator[Agent]:
    agent = start_agent(data_dir, *args, token=token)
    try:
        yield agent
    finally:
        if agent.proc.poll() is None:
            code = agent.stop()
            assert code == 0, f"agent exited {code} on SIGTERM:\n{agent.log()[-3000:]}"


@contextlib.contextmanager
def node_and_pool_agents(root: Path) -> Iterator[tuple[Agent, Agent]]:
    """A node agent (node-a) and a pool agent (pool-1, ``--role pool``), both small, in DC fra."""
    small = ("--cpu", "1MiB", "--disk", "2MiB")
    with (
        running_agent(root / "a", "--name", "node-a", "--dc", "fra", *small) as node,
        running_agent(
            root / "p", "--role", "pool", "--name", "pool-1", "--dc", "fra", *small
        ) as pool,
    ):
        yield node, pool


def fra_fleet(tmp_path: Path, nodes: dict[str, str], *, check_agent: bool = True) -> str:
    """A SQLite fleet database in ``tmp_path`` with DC fra holding ``nodes`` (name: agent URL);
    its URL."""
    from kvctl.db.inventory import add_dc, add_node
    from kvctl.db.migrate import open_db

    url = f"sqlite:///{tmp_path / 'kvctl.db'}"
    engine = open_db(url)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        for name, agent_url in nodes.items():
            add_node(conn, name, dc="fra", agent_url=agent_url, check_agent=check_agent)
    engine.dispose()
    return url


def files_holding(root: Path, *secrets: bytes) -> list[Path]:
    """The files under ``root`` holding any of ``secrets`` (one gone while it is looked at is
    skipped: an agent renames and removes its temp files as it runs)."""
    found = []
    for path in root.rglob("*"):
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            if path.is_file() and any(s in path.read_bytes() for s in secrets):
                found.append(path)
    return found


#: every port :func:`closed_port` gave in this process
_handed_out: set[int] = set()


def closed_port() -> int:
    """A loopback port nothing listens on (below the ephemeral range, so no socket bound to
    port 0 takes it meanwhile), never one it gave before in this process: tests give each node
    of an inventory a port of its own, and the inventory refuses two nodes on one agent URL.
    Each draw is random, so four independent ones repeated a port about once in 3,800 fills."""
    while (port := free_loopback_port()) in _handed_out:
        pass
    _handed_out.add(port)
    return port


def payload(key: bytes, size: int) -> bytes:
    """Deterministic bytes for a key, so any chunk served can be checked without a copy."""
    block = hashlib.blake2b(key, digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


def key(i: int, space: int = 0) -> bytes:
    return hashlib.blake2b(f"{space}:{i}".encode(), digest_size=16).digest()


def traffic(agent: Agent, n: int, space: int) -> None:
    """``n`` chunks stored (as t1), then looked up (as t2) with one miss after them: n + 1
    lookups and n hits, so an agent's counters move by known amounts."""
    keys = [key(i, space) for i in range(n)]
    with agent.data() as dc:
        for k in keys:
            dc.put(k, payload(k, 4096), tenant="t1")
        dc.lookup([*keys, key(10_000, space)], tenant="t2")


def metric(agent: Agent, name: str, *, default: float | None = None, **labels: str) -> float:
    """The first sample ``name`` on the agent's /metrics whose labels include ``labels``;
    ``default`` where there is none (None: a failed assertion)."""
    for family in text_string_to_metric_families(agent.control().metrics_text()):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    if default is None:
        raise AssertionError(f"{name}{labels or ''} not on the agent's /metrics")
    return default


def start_in_foreground(config_home: Path, *argv: str) -> tuple[int, str]:
    """`kvctl agent start ARGV` in the foreground, as an operator runs it (no KVCTL_* variable,
    no config file, a wide terminal), for a start expected to fail: its exit code and its
    stderr with whitespace runs made one space (rich wraps long lines)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(config_home)
    env["COLUMNS"] = "1000"
    run = subprocess.run(
        [sys.executable, "-m", "kvctl", "agent", "start", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,  # a hang guard: it serves forever if let
    )
    return run.returncode, " ".join(run.stderr.split())
