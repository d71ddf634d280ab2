"""The live view's benchmark: does `kvctl top` keep up with its refresh interval on a fleet?

``agents`` real agent processes on loopback (ephemeral ports, a 16 MiB cpu tier, no disk), split
over up to 4 DCs in a throwaway SQLite inventory, each given a few chunks and lookups through the
data-plane SDK and then a modest stream of lookups and puts in a background thread for the whole
measurement, so their counters move as a busy fleet's do. Then, in the same run:

* ``poll_seconds``: one refresh's work off the UI thread, :meth:`FleetSource.poll` (the inventory
  read, every agent's ``/v1/stats`` at once, GPUs every 10 s, link RTTs) plus
  :meth:`Sampler.update` (counters into the view), ``cycles`` times. Reference
  ``health_fanout_seconds``: :func:`kvctl.fleet.fanout.fan_out` of ``health()`` over the same
  nodes, the bare HTTP round trip to every agent with the same concurrency and no store work and
  no database. Second reference ``health_kept_clients_seconds``: the same ``health()`` calls
  with the same concurrency over one :class:`AgentClient` per node made once and kept open (the
  floor for one request to every agent from this process); ``fan_out`` makes a new client per
  node per call, whose cost alone is ``agent_client_setup_seconds_median``. The three take
  turns going first each cycle, so drift hits all alike. ``poll_vs_health_ratio`` is median
  over median; ``poll_vs_interval_ratio`` is the p95 poll over the refresh interval (below 1:
  the view keeps up).
* ``app``: the real Textual app (:func:`kvctl.tui.app.create_app`, read-only) run headless for
  ``seconds`` on the same inventory: ticks expected (``seconds / interval``) next to the polls
  applied (``refreshes``) and the ticks skipped because a poll was still running
  (``late_ticks``); whether every node was up in the last view; the event loop's lag (how late
  a short sleep on the app's loop wakes: the UI thread was busy, or waited for the GIL, that
  long) over the whole window; then, with polling paused and the last poll finished, the UI
  thread's own cost of applying one view (``FleetScreen.show_view``, in milliseconds) next to
  the interval.

Every agent is stopped at the end (SIGTERM, then SIGKILL after a grace period), also on errors
and Ctrl-C. The result is JSON-safe; nothing here asserts a speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import os
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.bench.common import host_info
from kvctl.errors import InvalidArgument

DEFAULT_AGENTS = 50
DEFAULT_INTERVAL_S = 1.0
DEFAULT_SECONDS = 20.0
DEFAULT_CYCLES = 20
MAX_DCS = 4
AGENT_CPU = "16MiB"
#: agents started at the same time (each is a Python process importing kvctl: ~1 s of CPU)
START_CONCURRENCY_PER_CPU = 2
START_TIMEOUT_S = 90.0
STOP_GRACE_S = 20.0
#: what each agent gets before the measurement: one chain of chunks, then lookups of it
SEED_CHUNKS = 8
CHUNK_BYTES = 64 << 10
SEED_LOOKUPS = 4
#: background traffic over the whole fleet during the measurement (each op: one lookup of an
#: agent's chain, a lookup that misses, and every PUT_EVERY-th op a put of a fresh chunk)
TRAFFIC_OPS_PER_S = 50.0
PUT_EVERY = 4
#: the app's terminal, the show_view samples, and the loop-lag probe's sleep
APP_SIZE = (160, 60)
SHOW_VIEW_REPEATS = 5
LAG_STEP_S = 0.05
#: per agent, as `kvctl top` asks by default
POLL_TIMEOUT_S = 2.0
#: AgentClient constructions timed on their own (one per node, the first few nodes)
CLIENT_SETUP_SAMPLES = 5


def run_top_bench(
    agents: int = DEFAULT_AGENTS,
    interval_s: float = DEFAULT_INTERVAL_S,
    seconds: float = DEFAULT_SECONDS,
    *,
    cycles: int = DEFAULT_CYCLES,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    if agents < 1:
        raise InvalidArgument(f"--agents must be at least 1, got {agents}")
    if not interval_s > 0 or math.isinf(interval_s):
        raise InvalidArgument(f"--interval must be a positive number of seconds, got {interval_s}")
    if not seconds > 0 or math.isinf(seconds):
        raise InvalidArgument(f"--seconds must be a positive number of seconds, got {seconds}")
    if cycles < 1:
        raise InvalidArgument(f"cycles must be at least 1, got {cycles}")
    say = progress or (lambda _msg: None)
    started_s = time.perf_counter()
    dcs = min(MAX_DCS, agents)
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-top-") as tmp:
        root = Path(tmp)
        with _fleet(root, agents, dcs, say) as fleet:
            say(f"{agents} agents up in {fleet.start_seconds:.1f} s; writing the inventory")
            engine = _inventory(root / "top.db", fleet.agents, dcs)
            try:
                say("seeding each agent with chunks and lookups")
                with _traffic(fleet.agents) as traffic:
                    say(f"timing {cycles} polls, health fan-outs and kept-client rounds, in turn")
                    figures = _cycles(engine, fleet.agents, cycles, interval_s)
                    say(f"running the view headless for {seconds:g} s at {interval_s:g} s")
                    app = asyncio.run(_headless(engine, agents, interval_s, seconds))
                rss = [r for r in (_rss_bytes(a.proc.pid) for a in fleet.agents) if r is not None]
            finally:
                engine.dispose()
            say(f"stopping {agents} agents")
        pids = [a.proc.pid for a in fleet.agents]
    return {
        "benchmark": "top",
        **host_info(),
        "agents": agents,
        "dcs": dcs,
        "interval_seconds": interval_s,
        "app_seconds": seconds,
        "cycles": cycles,
        "elapsed_seconds": time.perf_counter() - started_s,
        "agent_start_seconds": fleet.start_seconds,
        "agent_rss_bytes_median": statistics.median(rss) if rss else None,
        **figures,
        "app": app,
        "traffic": traffic.as_dict(),
        "agent_pids": pids,
        "notes": [
            "poll_seconds is one refresh's work off the UI thread (FleetSource.poll + "
            "Sampler.update); health_fanout_seconds is fan_out(health) over the same agents with "
            "the same concurrency; health_kept_clients_seconds the same calls over clients made "
            "once and kept open; the three take turns, so drift hits all alike",
            "fan_out makes a new AgentClient (an httpx.Client) per node per call: "
            "agent_client_setup_seconds_median is that construction alone, paid once per node "
            "per poll under the GIL",
            "the poll asks each agent's GPUs every 10 s besides its stats, as the view does, so "
            "a few poll samples carry that extra request",
            "the agents, this process and the background traffic share the host's cores: on a "
            "small VM the figures measure that contention too",
            "ticks_expected is seconds / interval; the app also ticks once when it starts, so "
            "refreshes can exceed it by one, and the last poll may still be running at the end",
            "show_view_ms is timed after the window with polling paused and no poll running: "
            "the UI thread's own cost; loop_lag_seconds covers the window, polls included",
        ],
    }


# --- the fleet --------------------------------------------------------------------------------
@dataclass(slots=True)
class _Agent:
    name: str
    dc: str
    proc: subprocess.Popen[bytes]
    state: Any  # kvctl.agent.daemon.AgentState


@dataclass(slots=True)
class _Fleet:
    agents: list[_Agent] = field(default_factory=list)
    start_seconds: float = 0.0


@contextlib.contextmanager
def _fleet(root: Path, n: int, dcs: int, say: Callable[[str], None]) -> Iterator[_Fleet]:
    """``n`` agents started concurrently; every one that started is stopped on the way out,
    whatever happened (a failed start, an error, Ctrl-C)."""
    from kvctl.agent.daemon import spawn_agent

    fleet = _Fleet()
    lock = threading.Lock()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}

    def start(i: int) -> None:
        name, dc = f"top-{i}", f"dc-{i % dcs}"
        data_dir = root / name
        env = {**base_env, "XDG_CONFIG_HOME": str(data_dir / "xdg")}
        argv = [
            "--name", name, "--dc", dc,
            "--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0",
            "--cpu", AGENT_CPU, "--disk", "0", "--log-level", "warning",
        ]  # fmt: skip
        proc, state = spawn_agent(argv, data_dir, env=env, detach=False, timeout_s=START_TIMEOUT_S)
        with lock:
            fleet.agents.append(_Agent(name, dc, proc, state))

    workers = max(1, min(n, START_CONCURRENCY_PER_CPU * (os.cpu_count() or 1)))
    say(f"starting {n} agents ({workers} at a time) over {dcs} DCs")
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvctl-bench-start")
    try:
        futures = [pool.submit(start, i) for i in range(n)]
        errors = [f.exception() for f in futures]
        failed = [e for e in errors if e is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} of {n} agents did not start; the first: {failed[0]}")
        fleet.start_seconds = time.perf_counter() - t0
        fleet.agents.sort(key=lambda a: int(a.name.split("-")[1]))
        yield fleet
    finally:
        # starts still running finish (or give up) first, so no agent escapes the stop below
        pool.shutdown(wait=True, cancel_futures=True)
        _stop_all([a.proc for a in fleet.agents])


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to all at once, then wait; whatever is left after the grace period (or on a
    second Ctrl-C) is killed."""
    try:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.01, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _inventory(path: Path, agents: list[_Agent], dcs: int) -> Any:
    from kvctl.db.inventory import add_dc, add_node
    from kvctl.db.migrate import open_db

    engine = open_db(f"sqlite:///{path}", auto_upgrade=True)
    with engine.begin() as conn:
        for d in range(dcs):
            add_dc(conn, f"dc-{d}")
        for a in agents:
            add_node(conn, a.name, dc=a.dc, agent_url=a.state.control_url)
    return engine


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# --- traffic ----------------------------------------------------------------------------------
def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


@dataclass(slots=True)
class _Traffic:
    seed_puts: int = 0
    seed_lookups: int = 0
    ops: int = 0
    lookups: int = 0
    puts: int = 0
    errors: int = 0
    last_error: str | None = None
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "chunk_bytes": CHUNK_BYTES,
            "seed_puts": self.seed_puts,
            "seed_lookups": self.seed_lookups,
            "background_ops_per_second_target": TRAFFIC_OPS_PER_S,
            "background_ops": self.ops,
            "background_ops_per_second": self.ops / self.seconds if self.seconds else None,
            "background_lookups": self.lookups,
            "background_puts": self.puts,
            "errors": self.errors,
            "last_error": self.last_error,
        }


@contextlib.contextmanager
def _traffic(agents: list[_Agent]) -> Iterator[_Traffic]:
    """Seed every agent with a chain and some lookups, then keep a modest stream of lookups (hits
    and misses) and puts going over the whole fleet until the block ends."""
    import numpy as np

    from kvctl.client import DataClient
    from kvctl.store.keys import parents_of

    stats = _Traffic()
    payload = np.full(CHUNK_BYTES, 7, dtype=np.uint8)
    chains = {a.name: [_key(f"{a.name}:seed:{i}") for i in range(SEED_CHUNKS)] for a in agents}
    clients: list[Any] = []
    stop = threading.Event()
    thread: threading.Thread | None = None
    try:
        for a in agents:
            client = DataClient.connect(a.state.data_tcp, token="")
            clients.append(client)
            chain = chains[a.name]
            client.put_many([(k, payload) for k in chain], parents=parents_of(chain))
            stats.seed_puts += len(chain)
            for j in range(SEED_LOOKUPS):
                client.lookup(chain[: SEED_CHUNKS - j])
                client.lookup([_key(f"{a.name}:miss:{j}")])
                stats.seed_lookups += 2

        def run() -> None:
            t0 = time.perf_counter()
            step = 1.0 / TRAFFIC_OPS_PER_S
            n = 0
            while not stop.is_set():
                i = n % len(agents)
                client, chain = clients[i], chains[agents[i].name]
                try:
                    client.lookup(chain)
                    client.lookup([_key(f"{agents[i].name}:miss:{n}")])
                    stats.lookups += 2
                    if n % PUT_EVERY == 0:
                        client.put(_key(f"{agents[i].name}:bg:{n}"), payload)
                        stats.puts += 1
                except Exception as exc:  # an agent hiccup must not end the traffic
                    stats.errors += 1
                    stats.last_error = f"{type(exc).__name__}: {exc}"
                n += 1
                stats.ops = n
                stats.seconds = time.perf_counter() - t0
                # a fixed schedule: a slow op is caught up, never queued behind
                stop.wait(max(0.0, t0 + n * step - time.perf_counter()))

        thread = threading.Thread(target=run, name="kvctl-bench-traffic", daemon=True)
        thread.start()
        yield stats
    finally:
        stop.set()
        if thread is not None:
            thread.join(10)
        for client in clients:
            with contextlib.suppress(Exception):
                client.close()


# --- poll vs health fan-out -------------------------------------------------------------------
def spread(samples: list[float]) -> dict[str, Any]:
    """min, median, p95 (nearest rank) and max of ``samples``, and the samples."""
    return {**_summary(samples), "samples": samples}


def _summary(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    ordered = sorted(samples)
    return {
        "min": ordered[0],
        "median": statistics.median(ordered),
        "p95": ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)],
        "max": ordered[-1],
    }


def _cycles(engine: Any, agents: list[_Agent], cycles: int, interval_s: float) -> dict[str, Any]:
    from kvctl.client import AgentClient
    from kvctl.fleet.fanout import DEFAULT_CONCURRENCY, fan_out
    from kvctl.tui.model import Sampler
    from kvctl.tui.sources import FleetSource

    source = FleetSource(engine, token="", timeout_s=POLL_TIMEOUT_S)
    sampler = Sampler()
    nodes = source.targets()
    samples: dict[str, list[float]] = {"poll": [], "health": [], "kept": []}
    counts: dict[str, list[int]] = {"poll": [], "health": [], "kept": []}
    kept = [AgentClient(n.agent_url, token="", timeout_s=POLL_TIMEOUT_S) for n in nodes]
    pool = ThreadPoolExecutor(max_workers=max(1, min(DEFAULT_CONCURRENCY, len(nodes))))

    def poll() -> int:
        return sampler.update(source.poll()).total.up

    def health() -> int:
        res = fan_out(nodes, lambda c: c.health(), token="", timeout_s=POLL_TIMEOUT_S)
        return sum(r.ok for r in res)

    def health_kept() -> int:
        def one(client: Any) -> bool:
            try:
                client.health()
            except Exception:
                return False
            return True

        return sum(pool.map(one, kept))

    def timed(name: str, fn: Callable[[], int]) -> Callable[[], None]:
        def run() -> None:
            t = time.perf_counter()
            n = fn()
            samples[name].append(time.perf_counter() - t)
            counts[name].append(n)

        return run

    try:
        poll()  # not timed: the first poll is a baseline (no rates yet) and asks every GPU
        health()
        health_kept()  # not timed: opens each kept client's connection
        steps = [timed("poll", poll), timed("health", health), timed("kept", health_kept)]
        for r in range(cycles):  # each goes first, second and third in turn
            k = r % len(steps)
            for step in steps[k:] + steps[:k]:
                step()
        setup = []
        for n in nodes[:CLIENT_SETUP_SAMPLES]:
            t = time.perf_counter()
            AgentClient(n.agent_url, token="").close()
            setup.append(time.perf_counter() - t)
    finally:
        pool.shutdown(wait=True)
        for c in kept:
            c.close()
    p, h, k = spread(samples["poll"]), spread(samples["health"]), spread(samples["kept"])
    return {
        "poll_seconds": p,
        "health_fanout_seconds": h,
        "poll_vs_health_ratio": p["median"] / max(h["median"], 1e-9),
        "poll_vs_interval_ratio": p["p95"] / interval_s,
        "health_kept_clients_seconds": k,
        "health_fanout_vs_kept_clients_ratio": h["median"] / max(k["median"], 1e-9),
        "agent_client_setup_seconds_median": statistics.median(setup),
        "poll_nodes_up_min": min(counts["poll"]),
        "health_nodes_ok_min": min(counts["health"]),
        "health_kept_clients_ok_min": min(counts["kept"]),
    }


# --- the real app, headless -------------------------------------------------------------------
async def _headless(engine: Any, agents: int, interval_s: float, seconds: float) -> dict[str, Any]:
    from kvctl.tui.app import create_app
    from kvctl.tui.sources import FleetSource

    source = FleetSource(engine, token="", timeout_s=POLL_TIMEOUT_S)
    app = create_app(source, interval_s=interval_s, readonly=True)
    lags: list[float] = []
    show_s: list[float] = []
    async with app.run_test(size=APP_SIZE) as pilot:
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            await asyncio.sleep(min(LAG_STEP_S, max(0.0, end - t)))
            lags.append(max(0.0, time.perf_counter() - t - LAG_STEP_S))
        window_s = time.perf_counter() - t0
        refreshes, late_ticks = app.refreshes, app.late_ticks
        in_flight = _polling(app)
        view = app.view
        poll_error = app.poll_error
        screen_name = type(app.screen).__name__
        app.paused = True  # no new polls; let the running one finish, then time the UI alone
        settle = time.perf_counter() + 2 * POLL_TIMEOUT_S + 5.0
        while _polling(app) and time.perf_counter() < settle:
            await asyncio.sleep(LAG_STEP_S)
        shown = app.view
        if shown is not None:
            for _ in range(SHOW_VIEW_REPEATS):
                t = time.perf_counter()
                app.screen.show_view(shown)  # type: ignore[attr-defined]
                show_s.append(time.perf_counter() - t)
                await pilot.pause()
    expected = seconds / interval_s
    rows = 0 if view is None else len(view.rows)
    up = 0 if view is None else view.total.up
    show_ms = [s * 1000 for s in show_s]
    return {
        "window_seconds": window_s,
        "ticks_expected": expected,
        "refreshes": refreshes,
        "late_ticks": late_ticks,
        "refreshes_vs_expected_ratio": refreshes / expected,
        "poll_in_flight_at_end": in_flight,
        "poll_error": poll_error,
        "last_view_poll_seconds": None if view is None else view.poll_s,
        "rows": rows,
        "up": up,
        "all_up": view is not None and rows == agents and up == agents,
        "screen": screen_name,
        "show_view_ms": spread(show_ms) if show_ms else None,
        "show_view_vs_interval_ratio": (
            None if not show_ms else statistics.median(show_ms) / 1000 / interval_s
        ),
        # how late a LAG_STEP_S sleep on the app's loop woke: the UI thread was busy that long
        "loop_lag_seconds": {"step_seconds": LAG_STEP_S, "count": len(lags), **_summary(lags)},
    }


def _polling(app: Any) -> bool:
    """Whether a poll is running (the app's own flag; a tick finding it set is late)."""
    return bool(getattr(app, "_polling", False))


# --- people's output --------------------------------------------------------------------------
def render_top_bench(result: dict[str, Any]) -> Any:
    """A rich table of the figures and their references (the CLI's non-JSON output)."""
    from rich.table import Table

    def ms(s: float | None) -> str:
        return "" if s is None else f"{s * 1000:,.1f} ms"

    app = result["app"]
    interval = result["interval_seconds"]
    table = Table(
        "figure",
        "value",
        "reference",
        "ref. value",
        "ratio",
        title=f"kvctl top on {result['agents']} agents, every {interval:g} s",
        caption=(
            f"{result['cycles']} cycles of each, taking turns; the app ran headless for "
            f"{app['window_seconds']:.1f} s; {result['cpu_count']} CPUs shared by all"
        ),
    )
    p, h = result["poll_seconds"], result["health_fanout_seconds"]
    table.add_row(
        "poll + sampler, median",
        ms(p["median"]),
        "health fan-out, median",
        ms(h["median"]),
        f"{result['poll_vs_health_ratio']:.2f}",
    )
    table.add_row(
        "poll + sampler, p95",
        ms(p["p95"]),
        "refresh interval",
        ms(interval),
        f"{result['poll_vs_interval_ratio']:.2f}",
    )
    k = result["health_kept_clients_seconds"]
    table.add_row(
        "health fan-out, median",
        ms(h["median"]),
        "kept-open clients, median",
        ms(k["median"]),
        f"{result['health_fanout_vs_kept_clients_ratio']:.2f}",
    )
    table.add_row(
        "one AgentClient made", ms(result["agent_client_setup_seconds_median"]), "", "", ""
    )
    table.add_row(
        "refreshes applied",
        f"{app['refreshes']}",
        "ticks expected",
        f"{app['ticks_expected']:g}",
        f"{app['refreshes_vs_expected_ratio']:.2f}",
    )
    table.add_row("late ticks", f"{app['late_ticks']}", "", "", "")
    table.add_row("nodes up in the last view", f"{app['up']}", "agents", f"{app['rows']}", "")
    show = app["show_view_ms"]
    if show is not None:
        table.add_row(
            "show_view (UI thread), median",
            f"{show['median']:,.1f} ms",
            "refresh interval",
            ms(interval),
            f"{app['show_view_vs_interval_ratio']:.3f}",
        )
    lag = app["loop_lag_seconds"]
    if "max" in lag:
        table.add_row("UI loop lag, p95 / max", f"{ms(lag['p95'])} / {ms(lag['max'])}", "", "", "")
    return table
