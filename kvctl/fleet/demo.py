"""The demo fleet: real agents in two emulated DCs, a collector, a replayed workload.

Everything lives in one workspace directory: the SQLite metrics database, one data directory
per agent, the processes' logs, ``demo.json`` (what runs, for the next run to clean up after a
killed one) and ``replay.json`` (the replay's report). Processes run in their own sessions, so a
Ctrl-C in the terminal reaches the demo only, and the demo stops them in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvctl.agent.daemon import pid_alive, spawn_agent, stop_agent
from kvctl.paths import default_state_dir
from kvctl.profiles import DEMO_MODEL, model_profile

if TYPE_CHECKING:
    from kvctl.workload.replay import ReplayNode, ReplayReport

STATE_FILE = "demo.json"
LOCK_FILE = "demo.lock"
REPORT_FILE = "replay.json"
DB_FILE = "kvctl.db"


@dataclass(frozen=True, slots=True)
class DemoDc:
    name: str
    region: str
    location: str
    carbon_g_per_kwh: float
    pue: float


#: two small DCs 80 km apart; carbon intensities are typical of their grids (illustrative)
DEMO_DCS = (
    DemoDc("fra-1", "eu-central", "Frankfurt", 380.0, 1.35),
    DemoDc("ams-1", "eu-west", "Amsterdam", 270.0, 1.2),
)
DEMO_LINK_KM = 80.0


@dataclass(frozen=True, slots=True)
class DemoConfig:
    workdir: Path
    nodes_per_dc: int = 2
    cpu: str = "64MiB"
    disk: str = "256MiB"
    model: str = DEMO_MODEL
    kv_scale: float = 1 / 16
    speed: float | None = 10.0
    collect_interval_seconds: float = 2.0
    link_interval_seconds: float = 10.0
    link_km: float = DEMO_LINK_KM
    #: where the dashboard listens (loopback); 0: any free port
    dashboard_port: int = 8050


def default_workdir() -> Path:
    return default_state_dir() / "demo"


@dataclass
class DemoProcess:
    role: str
    name: str
    pid: int
    log: Path
    url: str = ""


@dataclass
class DemoFleet:
    """What ``start`` brought up; ``stop`` takes all of it down."""

    config: DemoConfig
    db_url: str
    #: when the counters' baseline was taken: the database window the run is compared over
    started_ms: int = 0
    processes: list[DemoProcess] = field(default_factory=list)
    _popen: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    #: the workspace lock, held while this demo runs
    _lock_fd: int | None = None

    @property
    def agents(self) -> list[DemoProcess]:
        return [p for p in self.processes if p.role == "agent"]

    def replay_targets(self) -> tuple[list[ReplayNode], dict[tuple[str, str], float]]:
        """The running agents and the link between the DCs, as ``replay`` takes them."""
        from kvctl.workload.replay import ReplayNode

        dcs = dict(node_names(self.config))
        nodes = [ReplayNode(p.name, dcs[p.name], p.url) for p in self.agents]
        return nodes, {(DEMO_DCS[0].name, DEMO_DCS[1].name): self.config.link_km}

    def write_state(self, status: str) -> None:
        doc = {
            "status": status,
            "db_url": self.db_url,
            "updated_s": time.time(),
            "processes": [
                {"role": p.role, "name": p.name, "pid": p.pid, "log": str(p.log), "url": p.url}
                for p in self.processes
            ],
        }
        path = self.config.workdir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)

    def spawn(self, role: str, name: str, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        """Start a process of the fleet in its own session (Ctrl-C reaches the demo only, and
        the demo stops it in order), logging to ``log``, and record it for stop and cleanup."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=_child_env(self.config.workdir),
                cwd=self.config.workdir,
            )
        self._popen[proc.pid] = proc
        self.processes.append(DemoProcess(role, name, proc.pid, log))
        self.write_state("running")
        return proc

    def stop(self, timeout_s: float = 20.0) -> list[str]:
        """SIGTERM every process (collector first, so it writes its last scrape while the
        agents still answer), wait, SIGKILL what is left. Returns what had to be killed."""
        killed: list[str] = []
        order = sorted(self.processes, key=lambda p: p.role == "agent")
        for p in order:
            proc = self._popen.get(p.pid)
            if proc is not None and proc.poll() is not None:
                continue  # already reaped: its pid may belong to someone else by now
            _signal(p.pid, signal.SIGTERM)
            if p.role != "agent" and not self._wait(p, timeout_s):
                killed.append(f"{p.role} {p.name}")
        deadline = time.monotonic() + timeout_s
        for p in order:
            if not self._wait(p, max(deadline - time.monotonic(), 0.1)):
                killed.append(f"{p.role} {p.name}")
        self.write_state("stopped")
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None
        return killed

    def _wait(self, p: DemoProcess, timeout_s: float) -> bool:
        proc = self._popen.get(p.pid)
        if proc is not None:
            try:
                proc.wait(timeout_s)
                return True
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                return False
        deadline = time.monotonic() + timeout_s
        while pid_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(p.pid):
            _signal(p.pid, signal.SIGKILL)
            return False
        return True


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _ours(pid: int, workdir: Path) -> bool:
    """A leftover pid is ours only if it still runs kvctl on this very workspace (pids recycle,
    and ``/x/demo`` must not match ``/x/demo2``)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    agents = f"{workdir / 'agents'}/"
    return "kvctl" in args and (_db_url(workdir) in args or any(a.startswith(agents) for a in args))


def _db_url(workdir: Path) -> str:
    return f"sqlite:///{(workdir / DB_FILE).resolve()}"


class DemoBusy(ValueError):
    """Another demo runs in this workspace."""


def _lock(workdir: Path) -> int:
    """Hold ``demo.lock`` for this demo's life: a second demo here must not take the first
    one's processes for leftovers."""
    import fcntl

    fd = os.open(workdir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise DemoBusy(
            f"another kvctl demo (pid {holder}) runs in {workdir}; stop it, or pick another "
            "--workdir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def clean_leftovers(workdir: Path) -> list[str]:
    """Stop what a previous demo in ``workdir`` left running (a killed demo cannot clean up)."""
    stopped: list[str] = []
    for data_dir in sorted((workdir / "agents").glob("*")):
        with contextlib.suppress(TimeoutError, OSError):
            if stop_agent(data_dir, timeout_s=10.0, force=True) is not None:
                stopped.append(f"agent {data_dir.name}")
    state = workdir / STATE_FILE
    try:
        doc = json.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return stopped
    for p in doc.get("processes", []):
        pid = p.get("pid")
        if p.get("role") != "agent" and isinstance(pid, int) and _ours(pid, workdir):
            _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid) and _ours(pid, workdir):
                _signal(pid, signal.SIGKILL)
            stopped.append(f"{p.get('role')} {p.get('name')}")
    return stopped


def _agent_config(path: Path, model_id: str) -> None:
    m = model_profile(model_id)
    path.write_text(
        "# written by kvctl demo\n[agent]\n\n[[agent.models]]\n"
        f'id = "{m.name}"\nlayers = {m.layers}\nkv_heads = {m.kv_heads}\n'
        f'head_dim = {m.head_dim}\ndtype = "{m.dtype}"\n',
        encoding="utf-8",
    )


def _child_env(workdir: Path) -> dict[str, str]:
    # the user's KVCTL_* settings (a token, another database) must not leak into the demo
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(workdir / "xdg")
    env["KVCTL_ACTOR"] = "kvctl-demo"
    return env


def node_names(config: DemoConfig) -> list[tuple[str, str]]:
    """(node, DC) of every demo node: ``fra-1-a``, ``fra-1-b``, ..."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [
        (f"{dc.name}-{letters[i]}", dc.name) for dc in DEMO_DCS for i in range(config.nodes_per_dc)
    ]


def start(config: DemoConfig, *, on_step: Callable[[str], None] = lambda _: None) -> DemoFleet:
    """Bring the fleet up: agents, inventory, collector. Stops what it started on failure."""
    from kvctl.db.fleetfile import import_fleet
    from kvctl.db.migrate import open_db

    workdir = config.workdir
    workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (workdir / "xdg").mkdir(exist_ok=True)
    lock_fd = _lock(workdir)
    try:
        for what in clean_leftovers(workdir):
            on_step(f"stopped {what} left running by an earlier demo")
    except BaseException:
        os.close(lock_fd)
        raise
    fleet = DemoFleet(config, _db_url(workdir), _lock_fd=lock_fd)
    db_url = fleet.db_url
    env = _child_env(workdir)
    config_file = workdir / "agent.toml"
    _agent_config(config_file, config.model)
    try:
        for name, dc in node_names(config):
            data_dir = workdir / "agents" / name
            argv = [
                "--config", str(config_file), "--name", name, "--dc", dc,
                "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
                "--cpu", config.cpu, "--disk", config.disk,
            ]  # fmt: skip
            proc, state = spawn_agent(argv, data_dir, env=env, detach=True)
            fleet._popen[proc.pid] = proc
            fleet.processes.append(
                DemoProcess("agent", name, proc.pid, data_dir / "agent.log", state.control_url)
            )
            fleet.write_state("starting")
            on_step(f"agent {name} ({dc}) at {state.control_url}")
        doc: dict[str, Any] = {
            "dcs": [dataclasses.asdict(d) for d in DEMO_DCS],
            "nodes": [
                {"name": p.name, "dc": dc, "agent_url": p.url, "gpu_model": "(none: demo)"}
                for p, (_, dc) in zip(fleet.agents, node_names(config), strict=True)
            ],
            "links": [
                {"a": DEMO_DCS[0].name, "b": DEMO_DCS[1].name, "distance_km": config.link_km}
            ],
        }
        engine = open_db(db_url)
        try:
            with engine.begin() as conn:
                # prune: a workspace from a run with more nodes keeps no stale ones
                import_fleet(conn, doc, prune=True)
        finally:
            engine.dispose()
        on_step(f"inventory: {len(DEMO_DCS)} DCs {config.link_km:g} km apart, in {db_url}")
        # the collector's first sample of a node only sets its baseline: take it before any
        # traffic, so the database counts every request of the run
        fleet.started_ms = int(time.time() * 1000)
        collect_once(fleet)
        log = workdir / "collector.log"
        argv = [
            sys.executable, "-m", "kvctl", "collect", "--db", db_url,
            "--interval", f"{config.collect_interval_seconds:g}",
            "--link-interval", f"{config.link_interval_seconds:g}",
            "--probe-size", "256KiB", "--metrics-listen", "off",
        ]  # fmt: skip
        fleet.spawn("collector", "collect", argv, log)
        on_step(f"collector every {config.collect_interval_seconds:g} s (log: {log})")
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _free_port(preferred: int) -> int:
    """``preferred`` when nothing listens there on loopback, else a port the kernel picks."""
    import socket

    for port in (preferred, 0) if preferred else (0,):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise OSError("no free port on 127.0.0.1")


def start_dashboard(fleet: DemoFleet, *, timeout_s: float = 30.0) -> str:
    """Serve the dashboard on the demo's database (loopback); returns its URL once it answers.
    It is one of the fleet's processes, so stopping the demo (or cleaning up after a killed
    one) stops it too."""
    import httpx

    config = fleet.config
    port = _free_port(config.dashboard_port)
    log = config.workdir / "dashboard.log"
    argv = [
        sys.executable, "-m", "kvctl", "dashboard", "--db", fleet.db_url,
        "--host", "127.0.0.1", "--port", str(port), "--model", config.model, "--refresh", "5",
    ]  # fmt: skip
    proc = fleet.spawn("dashboard", "dashboard", argv, log)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the dashboard exited at start (exit {proc.returncode}); see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code == 200:
                return url
        time.sleep(0.2)
    raise RuntimeError(f"the dashboard did not answer on {url} within {timeout_s:g} s; see {log}")


def save_demo_plan(fleet: DemoFleet, requests: list[Any], workload_name: str) -> dict[str, Any]:
    """What-if plan of the demo's workload for the dashboard's capacity page: tier sizes as
    the demo's per node, in the model's real KV bytes (the demo's payloads are scaled by
    ``kv_scale``), saved for each DC (both DCs run the same nodes)."""
    from kvctl.db.migrate import open_db
    from kvctl.db.plans import save_plan
    from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
    from kvctl.units import parse_size
    from kvctl.workload.plan import plan

    config = fleet.config
    unscale = 1 / config.kv_scale
    tiers = {
        "cpu": int(parse_size(config.cpu) * unscale),
        "disk": int(parse_size(config.disk) * unscale),
        # a pool as large as a DC's node caches together
        "remote": int((parse_size(config.cpu) + parse_size(config.disk)) * unscale)
        * config.nodes_per_dc,
    }
    report = plan(
        requests,
        tiers_bytes=tiers,
        inputs=ModeledInputs(model_profile(config.model), gpu_profile("h100")),
        distances_km=(config.link_km,),
        curve_points=8,
        workload_name=workload_name,
    ).as_dict()
    engine = open_db(fleet.db_url)
    try:
        with engine.begin() as conn:
            now = int(time.time() * 1000)
            for dc in DEMO_DCS:
                save_plan(conn, report, dc=dc.name, now_ms=now)
    finally:
        engine.dispose()
    return report


@contextlib.contextmanager
def stop_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop`` instead of killing the demo half way through."""
    previous = {}
    # SIGHUP too: a closed terminal must not leave the fleet running on its own
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def collect_once(fleet: DemoFleet) -> None:
    """One synchronous collector cycle (cache counters only) into the demo's database."""
    argv = [
        sys.executable, "-m", "kvctl", "collect", "--once", "--no-links",
        "--db", fleet.db_url, "--metrics-listen", "off",
    ]  # fmt: skip
    log = fleet.config.workdir / "collector.log"
    with open(log, "ab") as out:
        done = subprocess.run(
            argv,
            start_new_session=True,  # a Ctrl-C for the demo must not kill it half way
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_child_env(fleet.config.workdir),
            cwd=fleet.config.workdir,
            timeout=120,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"the collector failed (exit code {done.returncode}); see {log}")


def final_collect(fleet: DemoFleet) -> None:
    """Stop the collector loop and take a last sample while the agents still answer, so the
    database holds every count of the run."""
    for p in fleet.processes:
        if p.role == "collector":
            _signal(p.pid, signal.SIGTERM)
            fleet._wait(p, 20.0)
    collect_once(fleet)


def database_counters(fleet: DemoFleet, report: ReplayReport) -> dict[str, Any]:
    """The run's counters as the database has them next to the replay's, node by node."""
    from kvctl.db.analytics.summary import node_cache_counters
    from kvctl.db.migrate import open_db

    engine = open_db(fleet.db_url)
    try:
        with engine.connect() as conn:
            sums = node_cache_counters(conn, fleet.started_ms, int(time.time() * 1000) + 1)
    finally:
        engine.dispose()
    nodes: dict[str, dict[str, dict[str, int]]] = {}
    for name, t in report.nodes.items():
        db = sums.get(name, {})
        whole = db.get("all", {})
        # the database's names for the agent's counters; it keeps no count of lookup calls
        recorded = {
            "lookup_chunks": whole.get("lookups", 0),
            "hit_chunks": whole.get("hits", 0),
            "hit_tokens": whole.get("hit_tokens", 0),
            "reuse_hits": whole.get("reuse_hits", 0),
            "sharing_hits": whole.get("sharing_hits", 0),
            **{f"hits[{tier}]": c.get("hits", 0) for tier, c in db.items() if tier != "all"},
        }
        expected = {k: 0 for k in recorded if k.startswith("hits[")}
        expected |= t.expected(report.owners_known[name])
        del expected["lookups"]
        nodes[name] = {
            k: {"replay": v, "database": recorded.get(k, 0)} for k, v in expected.items()
        }
    agree = all(v["replay"] == v["database"] for f in nodes.values() for v in f.values())
    wrong = [
        f"{n}.{k}: replay {v['replay']}, database {v['database']}"
        for n, f in nodes.items()
        for k, v in f.items()
        if v["replay"] != v["database"]
    ]
    return {"agree": agree, "nodes": nodes, "detail": "; ".join(wrong[:5])}
