"""The demo fleet: real agents in two emulated DCs, a router, a collector, a replayed workload.

The agents share for real: every node has the other nodes as peers and a pool agent
(``--role pool``, in the first DC) as its pool, with an emulated delay of the fiber round trip
on each pull across the DCs (``--link NAME:delay_ms``: emulated, not measured), and asks the
router's fleet index which peers to probe. The router (``kvctl router serve`` on the demo's
database) follows every node's events and tells the replay where to send each request. The pool
is not in the inventory: it serves other agents, never requests.

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
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvctl import json_text
from kvctl.agent.daemon import pid_alive, spawn_agent, stop_agent
from kvctl.paths import default_state_dir
from kvctl.ports import free_loopback_port, free_loopback_ports
from kvctl.profiles import DEMO_MODEL, FIBER_SECONDS_PER_KM, model_profile

if TYPE_CHECKING:
    from kvctl.workload.replay import ReplayNode, ReplayReport
    from kvctl.workload.trace import TraceRequest

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
DEMO_GPU = "l4"
#: the pool agent's name (as its peers call it: ``--link pool:...``) and DC
POOL_NAME = "pool"
POOL_DC = DEMO_DCS[0].name
#: the order ``DemoFleet.stop`` takes the roles down in: readers first, the pool last (the nodes
#: write through to it until they stop)
STOP_ORDER = ("collector", "dashboard", "router", "agent", "pool")


@dataclass(frozen=True, slots=True)
class DemoConfig:
    workdir: Path
    nodes_per_dc: int = 2
    cpu: str = "64MiB"
    disk: str = "256MiB"
    #: the pool agent's memory (it keeps no disk tier)
    pool_cpu: str = "256MiB"
    model: str = DEMO_MODEL
    #: the GPU profile every modeled prefill of the demo is on: the agents' fetch-or-recompute,
    #: the router's costs and queues, the replay's savings. Small DCs run modest GPUs; on an L4
    #: the workload's prefill loads a node enough that the router spreads requests, so nodes
    #: pull prefixes from each other and the pool (on an H100 one node per DC takes it all).
    gpu: str = DEMO_GPU
    kv_scale: float = 1 / 16
    speed: float | None = 10.0
    collect_interval_seconds: float = 2.0
    link_interval_seconds: float = 5.0
    link_km: float = DEMO_LINK_KM
    #: where the dashboard listens (loopback); 0: any free port
    dashboard_port: int = 8050
    router_poll_s: float = 0.2

    @property
    def link_delay_ms(self) -> float:
        """The emulated delay of one pull across the DCs: the fiber round trip."""
        return 2 * self.link_km * FIBER_SECONDS_PER_KM * 1000


MIB = 1 << 20
#: the tiers the demo never sizes below (a workload this small still gets room to move)
MIN_CPU_BYTES = 64 * MIB
MIN_DISK_BYTES = 256 * MIB
MIN_POOL_BYTES = 256 * MIB
#: what sizing may take of the machine: each node's cpu tier and the pool are its memory (a
#: cap, not an allocation: the arenas fill as chunks arrive), disk tiers are files
MAX_CPU_BYTES = 256 * MIB
MAX_POOL_BYTES = 512 * MIB
MAX_DISK_BYTES = 4 << 30
#: the cpu tier's share of a node's bytes (the rest on disk), as in the default 64 + 256 MiB
CPU_SHARE = 0.2
#: requests the comparison replayed while the demo runs takes (a few seconds on a laptop)
PREVIEW_REQUESTS = 300
#: requests the capacity plan simulates (its miss-ratio curve replays them 8 times)
PLAN_REQUESTS = 600


@dataclass(frozen=True, slots=True)
class TierSizing:
    """How the demo sized its tiers from the workload, and why (the summary says so)."""

    #: the requests the demo can reach: those within --duration x --speed of the trace's
    #: start, or all of them
    requests: int
    requests_total: int
    #: unique KV bytes of those requests, as the agents store them (x kv_scale)
    unique_bytes: int
    cpu_bytes: int
    disk_bytes: int
    pool_bytes: int
    #: what held a tier below its share of the working set (memory caps)
    capped: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def reachable(
    requests: list[TraceRequest], duration_s: float | None, speed: float | None
) -> list[TraceRequest]:
    """The requests a demo of ``duration_s`` at ``speed`` can reach on the trace's clock
    (all of them without a duration, or flat out). A slow machine serves fewer: an upper
    bound, so tiers sized for them are never too small."""
    if duration_s is None or speed is None or not requests:
        return list(requests)
    end_ms = requests[0].timestamp_ms + duration_s * speed * 1000
    return [r for r in requests if r.timestamp_ms <= end_ms]


def unique_kv_bytes(requests: list[TraceRequest], kv_bytes_per_token: int) -> int:
    """Bytes of every distinct prefix block of ``requests`` at ``kv_bytes_per_token``: what a
    cache must hold to keep all of their reuse."""
    tokens: dict[int, int] = {}
    for r in requests:
        for block, n in zip(r.block_ids, r.block_token_counts, strict=True):
            tokens.setdefault(block, n)
    return sum(tokens.values()) * kv_bytes_per_token


def size_tiers(
    config: DemoConfig, requests: list[TraceRequest], duration_s: float | None
) -> tuple[DemoConfig, TierSizing]:
    """``config`` with tiers sized so the workload's reuse shows: the nodes' cpu + disk
    together hold the unique KV of the requests the demo can reach (each node an equal share,
    a fifth of it on cpu), and the pool holds it too (every node writes through to it); never
    below the defaults, memory tiers capped (:data:`MAX_CPU_BYTES`, :data:`MAX_POOL_BYTES`),
    disk at :data:`MAX_DISK_BYTES` per node. Tiers smaller than the working set evict chunks
    before their reuse comes back (a trace's next turn arrives minutes later)."""
    reach = reachable(requests, duration_s, config.speed)
    per_token = max(1, round(model_profile(config.model).kv_bytes_per_token * config.kv_scale))
    unique = unique_kv_bytes(reach, per_token)
    nodes = 2 * config.nodes_per_dc
    share = -(-unique // nodes)
    capped: list[str] = []

    def bounded(tier: str, wanted: int, low: int, high: int) -> int:
        if wanted > high:
            capped.append(tier)
        return min(max(low, wanted), high)

    cpu = bounded("cpu", int(share * CPU_SHARE), MIN_CPU_BYTES, MAX_CPU_BYTES)
    disk = bounded("disk", share - cpu, MIN_DISK_BYTES, MAX_DISK_BYTES)
    pool = bounded("pool", unique, MIN_POOL_BYTES, MAX_POOL_BYTES)
    mib = [-(-b // MIB) for b in (cpu, disk, pool)]  # whole MiB, rounded up
    sized = dataclasses.replace(
        config, cpu=f"{mib[0]}MiB", disk=f"{mib[1]}MiB", pool_cpu=f"{mib[2]}MiB"
    )
    return sized, TierSizing(
        len(reach), len(requests), unique, mib[0] * MIB, mib[1] * MIB, mib[2] * MIB, tuple(capped)
    )


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
    #: the router the replay asks (empty until it serves)
    router_url: str = ""
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

    def router_args(self) -> list[str]:
        """The collector's flags to record the router's decisions too (the dashboard's
        Routing page)."""
        return ["--router", self.router_url] if self.router_url else []

    def emulation_args(self) -> list[str]:
        """The collector's flags to emulate the GPU energy of nodes without NVML (the demo's
        GPU and model profiles); nodes with NVML keep their measured readings."""
        return ["--emulate-power", self.config.gpu, "--emulate-model", self.config.model]

    def agent_links(self) -> dict[str, dict[str, Any]]:
        """The links the agents emulate on their pulls, for reports."""
        a, b = DEMO_DCS[0].name, DEMO_DCS[1].name
        return {
            "<->".join(sorted((a, b))): {
                "basis": "emulated",
                "distance_km": self.config.link_km,
                "delay_ms": self.config.link_delay_ms,
                "applied_by": "agents: --link NAME:delay_ms on pulls from the other DC's peers "
                f"and, in {b}, from the pool (in {POOL_DC})",
            }
        }

    def write_state(self, status: str) -> None:
        doc = {
            "status": status,
            "db_url": self.db_url,
            "router_url": self.router_url,
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
        """SIGTERM every process role by role in ``STOP_ORDER`` (the collector first, so it
        writes its last scrape while the agents still answer; the pool last), waiting for each
        role's processes, SIGKILL what is left. Returns what had to be killed."""
        killed: list[str] = []
        rank = {role: i for i, role in enumerate(STOP_ORDER)}
        for stage in sorted({rank.get(p.role, 0) for p in self.processes}):
            group = [p for p in self.processes if rank.get(p.role, 0) == stage]
            for p in group:
                proc = self._popen.get(p.pid)
                if proc is not None and proc.poll() is not None:
                    continue  # already reaped: its pid may belong to someone else by now
                _signal(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            for p in group:
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
    """Stop what a previous demo in ``workdir`` left running (a killed demo cannot clean up):
    the processes its ``demo.json`` names (collector, dashboard, router), then every agent
    with a data directory in the workspace, the pool last."""
    stopped: list[str] = []
    state = workdir / STATE_FILE
    try:
        doc = json_text.loads(state.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        doc = {}
    # a hand-edited or torn file of another shape stops nothing by pid; the agents still stop
    processes = doc.get("processes") if isinstance(doc, dict) else None
    for p in processes if isinstance(processes, list) else []:
        if not isinstance(p, dict):
            continue
        pid = p.get("pid")
        if p.get("role") in ("agent", "pool") or not isinstance(pid, int):
            continue  # agents are found by their data directories below
        if _ours(pid, workdir):
            _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid) and _ours(pid, workdir):
                _signal(pid, signal.SIGKILL)
            stopped.append(f"{p.get('role')} {p.get('name')}")
    dirs = sorted((workdir / "agents").glob("*"), key=lambda d: (d.name == POOL_NAME, d.name))
    for data_dir in dirs:
        with contextlib.suppress(TimeoutError, OSError):
            if stop_agent(data_dir, timeout_s=10.0, force=True) is not None:
                role = "pool" if data_dir.name == POOL_NAME else "agent"
                stopped.append(f"{role} {data_dir.name}")
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


def _node_remote_args(
    config: DemoConfig, name: str, dc: str, data_ports: dict[str, int], router_url: str
) -> list[str]:
    """A node's pool, peers (every other node), emulated delays (pulls from the other DC) and
    fleet index."""
    dcs = dict(node_names(config))
    delay = f"delay_ms={config.link_delay_ms:g}"
    args = ["--pool", f"kvctl://127.0.0.1:{data_ports[POOL_NAME]}", "--index-url", router_url]
    if dc != POOL_DC:
        args += ["--link", f"{POOL_NAME}:{delay}"]
    for peer, peer_dc in dcs.items():
        if peer == name:
            continue
        args += ["--peer", f"{peer}=127.0.0.1:{data_ports[peer]}"]
        if peer_dc != dc:
            args += ["--link", f"{peer}:{delay}"]
    return args


def start(config: DemoConfig, *, on_step: Callable[[str], None] = lambda _: None) -> DemoFleet:
    """Bring the fleet up: the pool, the agents, inventory, router, collector. Stops what it
    started on failure."""
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
    names = [name for name, _ in node_names(config)]
    # chosen before any agent starts, so every data-plane address is known to its peers
    *node_ports, pool_port, router_port = free_loopback_ports(len(names) + 2)
    data_ports = dict(zip([*names, POOL_NAME], [*node_ports, pool_port], strict=True))
    router_url = f"http://127.0.0.1:{router_port}"
    try:
        argv = [
            "--config", str(config_file), "--role", "pool", "--name", POOL_NAME, "--dc", POOL_DC,
            "--listen", "127.0.0.1:0", "--data-listen", f"127.0.0.1:{pool_port}",
            "--cpu", config.pool_cpu, "--disk", "0",
        ]  # fmt: skip
        pool_dir = workdir / "agents" / POOL_NAME
        proc, state = spawn_agent(argv, pool_dir, env=env, detach=True)
        fleet._popen[proc.pid] = proc
        fleet.processes.append(
            DemoProcess("pool", POOL_NAME, proc.pid, pool_dir / "agent.log", state.control_url)
        )
        fleet.write_state("starting")
        on_step(f"pool agent ({POOL_DC}, {config.pool_cpu}) at kvctl://127.0.0.1:{pool_port}")
        for name, dc in node_names(config):
            data_dir = workdir / "agents" / name
            argv = [
                "--config", str(config_file), "--name", name, "--dc", dc,
                "--listen", "127.0.0.1:0", "--data-listen", f"127.0.0.1:{data_ports[name]}",
                "--cpu", config.cpu, "--disk", config.disk, "--gpu", config.gpu,
                *_node_remote_args(config, name, dc, data_ports, router_url),
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
        start_router(fleet, router_port)
        on_step(
            f"router at {fleet.router_url}, following {len(fleet.agents)} agents "
            f"(log: {workdir / 'router.log'})"
        )
        # the collector's first sample of a node only sets its baseline: take it before any
        # traffic, so the database counts every request of the run
        fleet.started_ms = int(time.time() * 1000)
        collect_once(fleet)
        log = workdir / "collector.log"
        argv = [
            sys.executable, "-m", "kvctl", "collect", "--db", db_url,
            "--interval", f"{config.collect_interval_seconds:g}",
            "--link-interval", f"{config.link_interval_seconds:g}",
            "--probe-size", "256KiB", "--metrics-listen", "off", *fleet.router_args(),
            *fleet.emulation_args(),
        ]  # fmt: skip
        fleet.spawn("collector", "collect", argv, log)
        on_step(f"collector every {config.collect_interval_seconds:g} s (log: {log})")
    except BaseException:
        fleet.stop()
        raise
    return fleet


def start_router(fleet: DemoFleet, port: int, *, timeout_s: float = 30.0) -> None:
    """Serve the router on the demo's inventory at ``port`` (loopback), and wait until it
    answers and follows every node's events."""
    from kvctl.client import AgentClient
    from kvctl.router.client import RouterClient, RouterClientError

    config = fleet.config
    with AgentClient(fleet.agents[0].url, timeout_s=5.0) as first:
        chunk_tokens = int(first.info()["chunk_tokens"])
    log = config.workdir / "router.log"
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "kvctl", "router", "serve", "--db", fleet.db_url,
        "--listen", f"127.0.0.1:{port}", "--chunk-tokens", str(chunk_tokens),
        "--model", config.model, "--gpu", config.gpu, "--poll-s", f"{config.router_poll_s:g}",
    ]  # fmt: skip
    proc = fleet.spawn("router", "router", argv, log)
    fleet.processes[-1].url = url
    want = {p.name for p in fleet.agents}
    deadline = time.monotonic() + timeout_s
    up: set[str] = set()
    with RouterClient(url, timeout_s=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the router exited at start (exit {proc.returncode}); see {log}"
                )
            with contextlib.suppress(RouterClientError):
                client.health()
                followers = client.index().get("followers", [])
                up = {str(f["node"]) for f in followers if f.get("up")}
                if want <= up:
                    fleet.router_url = url
                    fleet.write_state("starting")
                    return
            time.sleep(0.2)
    missing = ", ".join(sorted(want - up)) or "its API"
    raise RuntimeError(
        f"the router at {url} did not follow {missing} within {timeout_s:g} s; see {log}"
    )


def _free_port(preferred: int) -> int:
    """``preferred`` when nothing listens there on loopback, else another free one."""
    import socket

    if preferred:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", preferred))
            except OSError:
                pass
            else:
                return preferred
    return free_loopback_port()


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
        "--host", "127.0.0.1", "--port", str(port), "--model", config.model,
        "--gpu", config.gpu, "--refresh", "5",
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
        # the demo's pool agent
        "remote": int(parse_size(config.pool_cpu) * unscale),
    }
    report = plan(
        requests,
        tiers_bytes=tiers,
        inputs=ModeledInputs(model_profile(config.model), gpu_profile(config.gpu)),
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


def energy_used(fleet: DemoFleet) -> dict[str, Any]:
    """The GPU energy the database recorded over the run: NVML's (measured) and the emulated
    energy of nodes without NVML (the collector's --emulate-power), each on its own, never
    summed."""
    from kvctl.db.analytics.counts import measured_counts, total
    from kvctl.db.inventory import list_nodes
    from kvctl.db.migrate import open_db
    from kvctl.profiles import BOARD_POWER_SOURCES, gpu_profile

    engine = open_db(fleet.db_url)
    try:
        with engine.connect() as conn:
            nodes = list_nodes(conn)
            end_ms = int(time.time() * 1000) + 1
            c = total(measured_counts(conn, fleet.started_ms, end_ms, nodes).values())
    finally:
        engine.dispose()
    gpu = gpu_profile(fleet.config.gpu)
    return {
        "measured": {
            "basis": "measured (NVML)",
            "nodes": c.energy_nodes,
            "energy_j": c.energy_j if c.energy_nodes else None,
        },
        "emulated": {
            "basis": "emulated: modeled prefill seconds of the tokens the cache did not serve "
            "x the GPU profile's board power",
            "nodes": c.emulated_energy_nodes,
            "energy_j": c.emulated_energy_j if c.emulated_energy_nodes else None,
            "busy_s": c.emulated_busy_s,
            "tokens_per_joule": c.emulated_tokens_per_joule,
            "gpu": gpu.name,
            "board_power_watts": gpu.board_power_watts,
            "board_power_source": BOARD_POWER_SOURCES.get(gpu.name),
            "model": fleet.config.model,
        },
    }


def collect_once(fleet: DemoFleet) -> None:
    """One synchronous collector cycle (cache counters only) into the demo's database."""
    argv = [
        sys.executable, "-m", "kvctl", "collect", "--once", "--no-links",
        "--db", fleet.db_url, "--metrics-listen", "off", *fleet.router_args(),
        *fleet.emulation_args(),
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
    from kvctl.db.analytics.routing import routing_summary
    from kvctl.db.analytics.summary import node_cache_counters
    from kvctl.db.migrate import open_db

    engine = open_db(fleet.db_url)
    end_ms = int(time.time() * 1000) + 1
    try:
        with engine.connect() as conn:
            sums = node_cache_counters(conn, fleet.started_ms, end_ms)
            routed = routing_summary(conn, fleet.started_ms, end_ms) if report.router else None
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
    routing: dict[str, dict[str, int]] = {}
    if report.router is not None and routed is not None:
        # the replay is the router's only client: the decisions it got are all the router made
        db_nodes = {n.node: n for n in routed.nodes}
        routing = {
            "decisions": {"replay": report.router.decisions, "database": routed.decisions},
            "to_holder": {"replay": report.router.to_holder, "database": routed.to_holder},
            **{
                f"decisions[{name}]": {
                    "replay": report.router.by_node.get(name, 0),
                    "database": db_nodes[name].decisions if name in db_nodes else 0,
                }
                for name in sorted(set(report.nodes) | set(db_nodes))
            },
        }
        nodes["router"] = routing
    agree = all(v["replay"] == v["database"] for f in nodes.values() for v in f.values())
    wrong = [
        f"{n}.{k}: replay {v['replay']}, database {v['database']}"
        for n, f in nodes.items()
        for k, v in f.items()
        if v["replay"] != v["database"]
    ]
    return {"agree": agree, "nodes": nodes, "detail": "; ".join(wrong[:5])}
