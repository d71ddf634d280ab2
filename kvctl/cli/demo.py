"""`kvctl demo`: the main job on one machine: a real fleet serving a real workload."""

from __future__ import annotations

import contextlib
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from kvctl.cli.extras import needs_extra
from kvctl.cli.options import JsonOpt, LimitOpt, SeedOpt, TenantsOpt, WorkloadOpt
from kvctl.cli.output import console, err_console, fail, json_text, print_json, user_errors
from kvctl.cli.replay import load_for_replay
from kvctl.format import percent

if TYPE_CHECKING:
    from kvctl.fleet.demo import DemoFleet, TierSizing
    from kvctl.workload.replay import ReplayReport
    from kvctl.workload.source import Workload


def demo_command(
    trace: Annotated[
        pathlib.Path | None,
        typer.Option(help="Trace to replay; when the file is absent the built-in workload runs."),
    ] = None,
    workload: WorkloadOpt = "builtin",
    seed: SeedOpt = 0,
    limit: LimitOpt = None,
    tenants: TenantsOpt = 8,
    workdir: Annotated[
        pathlib.Path | None,
        typer.Option(
            "--workdir", help="Workspace (default: ~/.local/state/kvctl/demo).", show_default=False
        ),
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            "--duration", help="Stop after this many seconds (default: at Ctrl-C).", min=1
        ),
    ] = None,
    speed: Annotated[
        float,
        typer.Option(
            "--speed", help="Replay this many times faster than the trace; 0: flat out.", min=0
        ),
    ] = 10.0,
    gpu: Annotated[
        str,
        typer.Option(
            "--gpu",
            help="GPU profile the demo's prefill is modeled on: the agents' fetch-or-recompute, "
            "the router's costs, the modeled savings (h100, a100, l4, ...).",
        ),
    ] = "l4",
    nodes_per_dc: Annotated[
        int, typer.Option("--nodes-per-dc", help="Agents in each of the two DCs.", min=1, max=8)
    ] = 2,
    dashboard: Annotated[
        bool, typer.Option("--dashboard/--no-dashboard", help="Serve the dashboard.")
    ] = True,
    browser: Annotated[
        bool, typer.Option("--browser/--no-browser", help="Open the dashboard in a browser.")
    ] = True,
    json_out: JsonOpt = False,
) -> None:
    """Run the demo fleet: two DCs of agents sharing a pool and each other, a router, a
    collector and a replayed workload.

    Starts a pool agent and 2 x --nodes-per-dc agents as separate processes on loopback, each
    node with the pool and every other node as its peers; registers the nodes with a link
    between the DCs in a SQLite database in the workspace; starts the router on it and the
    collector; and replays the workload (the built-in one, or --trace) through the agents'
    data plane, each request on the node the router picks. The agents pull what they reuse
    from their peers and the pool themselves; pulls across the DCs wait an emulated delay (the
    fiber round trip, 5 us per km each way). It serves the dashboard on the database (port
    8050, or a free one; --browser opens it) with a capacity plan of the workload saved for
    its capacity page. Stops at --duration or Ctrl-C, stopping everything it started; the
    summary shows the routing, hits by tier (pool and peers too), bytes pulled across and
    within the DCs, and whether the agents and the database counted what the replay did. The
    workspace (database, logs, replay.json) stays for `kvctl status`/`kvctl db` and the next
    run.

    Tiers are sized from the workload: the nodes' cpu + disk together, and the pool, hold the
    unique KV of the requests --duration x --speed can reach (never below 64 MiB cpu, 256 MiB
    disk and pool; memory tiers capped), so its reuse is not evicted before it comes back.
    The served requests are replayed again with and without sharing (size-only tiers; without:
    requests stay in their home DC, each node serves what it holds itself): the value of
    sharing, measured in replay, in the summary and on the dashboard. Where the agents have no
    NVML the collector emulates their GPU energy from the GPU profile's board power, labelled
    emulated.

    Examples:

      kvctl demo

      kvctl demo --trace ../shared/data/mooncake_synthetic_trace.jsonl --speed 20

      kvctl demo --duration 60 --no-browser --workload rag --workdir /tmp/kvctl-demo
    """
    if dashboard:  # before any agent starts
        needs_extra("kvctl demo", "dashboard", otherwise="or run it with --no-dashboard")
    from kvctl.fleet.demo import (
        DemoConfig,
        default_workdir,
        size_tiers,
        start,
        start_dashboard,
    )
    from kvctl.interrupts import stop_signals

    say: Callable[[str], None] = (lambda _: None) if json_out else _say
    with user_errors(hint="see `kvctl demo --help`"):
        # only a missing trace (`make demo` on a machine without it): a pipe (`--trace <(...)`)
        # is read, and a directory said to be one, not both replaced as "not found"
        if trace is not None and not trace.exists():
            err_console.print(
                f"[yellow]{escape(str(trace))} not found; using the built-in workload instead[/]",
                highlight=False,
            )
            trace = None
        from kvctl.profiles import gpu_profile

        gpu_profile(gpu)  # an unknown profile fails here, before anything starts
        config = DemoConfig(
            (workdir or default_workdir()).resolve(),
            nodes_per_dc=nodes_per_dc,
            gpu=gpu,
            speed=speed or None,
        )
        loaded = load_for_replay(trace, workload, seed, limit, tenants, quiet=json_out)
        config, sizing = size_tiers(config, loaded.requests, duration)
        if not json_out:
            console.print(
                f"[bold]kvctl demo[/]: {escape(loaded.name)} ({len(loaded.requests):,} requests) "
                f"on a fleet of {2 * nodes_per_dc} agents in 2 DCs; workspace "
                f"{escape(str(config.workdir))}",
                highlight=False,
            )
        say(sizing_text(sizing, config.kv_scale))
        stop = threading.Event()
        planning: threading.Thread | None = None
        with stop_signals(stop), _demo_errors(config.workdir):
            fleet = start(config, on_step=say)
            try:
                if dashboard:
                    url = start_dashboard(fleet)
                    say(f"dashboard: {url} (log: {config.workdir / 'dashboard.log'})")
                    planning = _plan_in_background(fleet, loaded, duration, say)
                    if browser:
                        import webbrowser

                        webbrowser.open(url)
                report = _run(fleet, loaded, stop, duration, say)
                db_check = _final_check(fleet, report)
            finally:
                say("stopping ...")
                killed = fleet.stop()
                if killed:
                    err_console.print(
                        f"[yellow]had to kill:[/] {escape(', '.join(killed))}", highlight=False
                    )
    energy = _energy(fleet)
    if planning is not None and planning.is_alive():
        say("waiting for the capacity plan ...")
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: go on without it
            planning.join(PLAN_WAIT_S)
    comparison = _save_route_comparison(fleet, loaded, report, say)
    from kvctl.fleet.demo import REPORT_FILE

    (config.workdir / REPORT_FILE).write_text(json_text(report.as_dict()), encoding="utf-8")
    if json_out:
        print_json(
            {
                **report.as_dict(),
                "workdir": str(config.workdir),
                "router_url": fleet.router_url,
                "agent_links": fleet.agent_links(),
                "database": db_check,
                "routing_compared": comparison,
                "sharing": None if comparison is None else comparison.get("sharing"),
                "tiers": sizing.as_dict(),
                "energy": energy,
            }
        )
    else:
        from kvctl.cli.replay import render_replay

        render_replay(report)
        _print_db_check(db_check)
        _print_energy(energy, report.modeled()["prefill_joules_saved"])
        _print_comparison(comparison)
        _print_sharing(comparison)
        console.print(escape(sizing_text(sizing, config.kv_scale)), highlight=False)
        console.print(
            f"workspace kept in {escape(str(config.workdir))}: kvctl.db (history), replay.json, "
            f"logs; `kvctl db current --db {escape(fleet.db_url)}` reads it",
            highlight=False,
        )
    if report.agents_agree is False or db_check.get("agree") is False:
        raise typer.Exit(1)


def _say(message: str) -> None:
    """One step of the demo, as it goes. Escaped: steps quote paths, URLs and errors, which
    are not markup."""
    console.print(f"  {escape(message)}", highlight=False)


#: how long the end of the demo waits for the capacity plan still being computed
PLAN_WAIT_S = 120.0


def _plan_in_background(
    fleet: DemoFleet, loaded: Workload, duration: float | None, say: Callable[[str], None]
) -> threading.Thread:
    """For the dashboard while the demo runs, computed beside the replay so the replay starts
    at once: first a replayed comparison of routing with and without sharing on the workload's
    first requests (the served requests replace it at the end), then the capacity page's plan
    of the requests the demo can reach (at most :data:`PLAN_REQUESTS`). Returns the thread, for
    the end of the demo to wait for the plan."""
    from kvctl.fleet.demo import PLAN_REQUESTS, PREVIEW_REQUESTS, reachable, save_demo_plan

    reach = reachable(loaded.requests, duration, fleet.config.speed)

    def work() -> None:
        first = reach[:PREVIEW_REQUESTS]
        try:
            save_route_comparison(
                fleet,
                first,
                loaded.name,
                scope=f"the workload's first {len(first):,} requests, replayed while the demo "
                "ran (the served requests replace them at its end)",
            )
        except Exception as exc:  # the end of the demo makes the comparison again
            say(f"routing comparison not saved yet: {exc}")
        else:
            say(f"sharing and routing replayed on the first {len(first):,} requests for the "
                "dashboard")  # fmt: skip
        planned = reach[:PLAN_REQUESTS]
        name = loaded.name
        if len(planned) < len(loaded.requests):
            name += f" (first {len(planned):,} requests)"
        try:
            save_demo_plan(fleet, planned, name)
        except Exception as exc:  # the demo goes on without a capacity plan
            say(f"capacity plan not saved: {exc}")
        else:
            say(f"capacity plan of {name} saved for the dashboard's capacity page")

    thread = threading.Thread(target=work, name="plan", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def _demo_errors(workdir: pathlib.Path) -> Iterator[None]:
    """A process that did not come up, an agent that died, a database that failed: one line
    and where the logs are, never a traceback."""
    import subprocess

    from kvctl.client import AgentError
    from kvctl.db.engine import DatabaseError
    from kvctl.workload.replay import ReplayError

    try:
        yield
    except (RuntimeError, AgentError, ReplayError, DatabaseError) as exc:
        fail(str(exc), hint=f"logs are in {workdir}")
    except subprocess.TimeoutExpired as exc:
        fail(f"{' '.join(map(str, exc.cmd))} took over {exc.timeout:g} s", hint=f"see {workdir}")


def _final_check(fleet: DemoFleet, report: ReplayReport) -> dict[str, object]:
    """The last collector sample, then the database's counters against the replay's; the
    replay's report stands even when the database cannot be read."""
    import subprocess

    from kvctl.fleet.demo import database_counters, final_collect

    try:
        final_collect(fleet)
        return database_counters(fleet, report)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        return {"agree": None, "detail": f"not checked: {exc}"}


def _save_route_comparison(
    fleet: DemoFleet, loaded: Workload, report: ReplayReport, say: Callable[[str], None]
) -> dict[str, Any] | None:
    """The requests the replay served, replayed again under every routing policy (and the cost
    policy without sharing) on the demo's own nodes, link and tier sizes (size-only tiers,
    TTFT modeled), saved for the dashboard's Routing and fleet pages beside the real router's
    counts. None when it could not be made."""
    served = loaded.requests[: report.requests.requests]
    if not served:
        return None
    say(f"replaying those {len(served):,} requests under each routing policy, and without "
        "sharing, for comparison ...")  # fmt: skip
    try:
        return save_route_comparison(
            fleet, served, loaded.name, scope=f"the {len(served):,} requests the demo served"
        )
    except Exception as exc:  # the demo's own run stands without the comparison
        say(f"routing comparison not saved: {exc}")
        return None


def save_route_comparison(
    fleet: DemoFleet, requests: list[Any], workload_name: str, *, scope: str
) -> dict[str, Any]:
    """``requests`` replayed under every routing policy, and under the cost policy without
    sharing, on the demo's own nodes, link and tier sizes (size-only tiers, in the model's real
    KV bytes); saved for the dashboard (the Routing page and the fleet page's sharing cards)
    with ``scope`` saying which requests these were."""
    from kvctl.bench.route_compare import compare_routing
    from kvctl.db.migrate import open_db
    from kvctl.db.route_reports import save_route_report
    from kvctl.fleet.demo import DEMO_DCS, node_names
    from kvctl.units import parse_size

    config = fleet.config
    unscale = 1 / config.kv_scale
    result = compare_routing(
        requests,
        nodes=node_names(config),
        links_km={(DEMO_DCS[0].name, DEMO_DCS[1].name): config.link_km},
        cpu_bytes=int(parse_size(config.cpu) * unscale),
        disk_bytes=int(parse_size(config.disk) * unscale),
        model=config.model,
        gpu=config.gpu,
        workload_name=workload_name,
    )
    result["scope"] = scope
    engine = open_db(fleet.db_url)
    try:
        with engine.begin() as conn:
            save_route_report(conn, result, now_ms=int(time.time() * 1000))
    finally:
        engine.dispose()
    return result


def _energy(fleet: DemoFleet) -> dict[str, Any] | None:
    """The run's GPU energy as the database has it (measured and emulated apart); None when
    the database cannot be read."""
    from kvctl.fleet.demo import energy_used

    try:
        return energy_used(fleet)
    except Exception as exc:  # the replay's report stands without it
        err_console.print(f"[yellow]energy:[/] not read: {escape(str(exc))}", highlight=False)
        return None


def sizing_text(sizing: TierSizing, kv_scale: float) -> str:
    """What the tiers were sized to, and why."""
    from kvctl.format import format_bytes

    capped = (
        f" ({' and '.join(sizing.capped)} held to the demo's cap, below the working set: some "
        "reuse is evicted before it comes back)"
        if sizing.capped
        else ""
    )
    return (
        f"tiers sized to the workload: its first {sizing.requests:,} of "
        f"{sizing.requests_total:,} requests (what --duration x --speed can reach) hold "
        f"{format_bytes(sizing.unique_bytes)} of unique KV (x{kv_scale:g}); so that reuse is "
        f"not evicted before it comes back, each node gets an equal share (cpu "
        f"{format_bytes(sizing.cpu_bytes)}, disk {format_bytes(sizing.disk_bytes)}) and the "
        f"pool {format_bytes(sizing.pool_bytes)}{capped}"
    )


def _print_energy(energy: dict[str, Any] | None, saved_it_joules: float | None) -> None:
    for line in energy_lines(energy, saved_it_joules):
        console.print(escape(line), highlight=False)


def energy_lines(energy: dict[str, Any] | None, saved_it_joules: float | None) -> list[str]:
    """The summary's energy lines, in one unit (the largest figure's) and each naming its
    basis: the GPUs' IT energy here; the dashboard's Energy saved is facility energy (x each
    DC's PUE), so the two differ by the PUE, never by a unit."""
    from kvctl.format import (
        ENERGY_UNITS,
        common_scale,
        format_number,
        format_scaled,
        format_seconds,
    )

    measured = (energy or {}).get("measured") or {"nodes": 0}
    emulated = (energy or {}).get("emulated") or {"nodes": 0}
    unit = common_scale(
        (
            saved_it_joules,
            measured.get("energy_j") if measured["nodes"] else None,
            emulated.get("energy_j") if emulated["nodes"] else None,
        ),
        ENERGY_UNITS,
    )
    out = []
    if saved_it_joules is not None:
        out.append(
            f"energy saved (modeled, IT: GPU board power, no PUE): "
            f"{format_scaled(saved_it_joules, unit)}; the dashboard's Energy saved is facility "
            "energy (x each DC's PUE)"
        )
    if measured["nodes"]:
        out.append(
            f"GPU energy used (measured, IT, NVML, {measured['nodes']} node(s)): "
            f"{format_scaled(measured['energy_j'], unit)}"
        )
    if emulated["nodes"]:
        out.append(
            f"GPU energy used (emulated, IT: no NVML on {emulated['nodes']} node(s)): "
            f"{format_scaled(emulated['energy_j'], unit)} = "
            f"{format_seconds(emulated['busy_s'])} of modeled prefill of the tokens the cache "
            "did not serve (whole chunks only; at most each scrape interval: prefill past it "
            f"is not counted) x {emulated['gpu']} board power "
            f"{emulated['board_power_watts']:g} W ({emulated['board_power_source']}); "
            f"{format_number(emulated['tokens_per_joule'])} prompt tokens per joule (emulated)"
        )
    return out


def _print_sharing(result: dict[str, Any] | None) -> None:
    sharing = (result or {}).get("sharing")
    if not sharing:
        return
    shared, alone = sharing["with_sharing"], sharing["without_sharing"]
    gain = sharing["hit_ratio_gain"]
    console.print(
        f"value of sharing (measured in replay, the same {result['requests']:,} requests, cost "
        f"routing, size-only tiers of the demo's sizes): hit ratio "
        f"{percent(shared['hit_ratio'])} with sharing vs {percent(alone['hit_ratio'])} without "
        f"(requests in their home DC, each node alone)"
        + ("" if gain is None else f", {gain * 100:+.1f} pts")
        + f"; an unlimited cache: {percent(sharing['unlimited_cache_hit_ratio'])} (the "
        f"workload's own reuse; all per {sharing.get('block_tokens', '?')}-token block, so a "
        "ceiling of these, not of the replay's hit ratio above, counted per chunk: a smaller "
        "chunk reuses part of a block)",
        highlight=False,
    )


def _print_comparison(result: dict[str, Any] | None) -> None:
    if not result:
        return
    ref = result["policies"][result["reference"]]
    parts = []
    for name, p in result["policies"].items():
        ttft = p["vs_reference"]["ttft_mean_ratio_to_reference"]
        ttft_text = "" if ttft is None else f", TTFT {ttft:.2f}x"
        parts.append(f"{name} {percent(p['hit_ratio'])}{ttft_text}")
    console.print(
        f"routing compared on the same {result['requests']:,} requests ({result['basis']}; "
        f"round-robin hit {percent(ref['hit_ratio'])}): " + " · ".join(parts),
        highlight=False,
    )


def _run(
    fleet: DemoFleet,
    loaded: Workload,
    stop: threading.Event,
    duration: float | None,
    say: Callable[[str], None],
) -> ReplayReport:
    from kvctl.fleet.demo import DEMO_DCS, POOL_DC, POOL_NAME
    from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
    from kvctl.router.client import RouterClient
    from kvctl.workload.replay import replay

    config = fleet.config
    deadline = None if duration is None else time.monotonic() + duration
    nodes, links = fleet.replay_targets()
    say(f"watch it: kvctl status --db {fleet.db_url}")
    dcs = " <-> ".join(d.name for d in DEMO_DCS)
    say(
        f"link {dcs}: {config.link_km:g} km; the agents delay their pulls across it by "
        f"{config.link_delay_ms:g} ms (emulated fiber round trip)"
    )
    say(f"requests are routed by {fleet.router_url}; agents pull from their peers and the pool")
    say("Ctrl-C stops the demo" + (f", or it stops after {duration:g} s" if duration else ""))
    result: dict[str, ReplayReport | BaseException] = {}
    inputs = ModeledInputs(model_profile(config.model), gpu_profile(config.gpu))

    def work() -> None:
        try:
            with RouterClient(fleet.router_url) as router:
                result["report"] = replay(
                    loaded.requests,
                    nodes,
                    inputs,
                    workload_name=loaded.name,
                    salt=loaded.salt,
                    kv_scale=config.kv_scale,
                    speed=config.speed,
                    links_km=links,
                    token="",
                    stop=stop,
                    routing="router",
                    router=router,
                    source_dcs={POOL_NAME: POOL_DC},
                )
        except BaseException as exc:  # reported by the main thread
            result["error"] = exc

    worker = threading.Thread(target=work, name="replay", daemon=True)
    worker.start()
    announced = False
    while not stop.is_set():
        if deadline is not None and time.monotonic() >= deadline:
            break
        worker.join(0.2)
        if not worker.is_alive() and not announced:
            announced = True
            if "error" in result:
                break
            say("replay finished; the fleet keeps serving" + ("" if duration else " until Ctrl-C"))
    stop.set()
    worker.join()
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    report = result["report"]
    assert not isinstance(report, BaseException)
    return report


def _print_db_check(check: dict[str, object]) -> None:
    if check.get("agree"):
        nodes = check.get("nodes")
        router = (
            " and the router's decisions" if isinstance(nodes, dict) and "router" in nodes else ""
        )
        console.print(
            f"database: the collected counters equal the replay's, node by node{router} ✓"
        )
    elif check.get("agree") is None:
        err_console.print(
            f"[yellow]database:[/] {escape(str(check.get('detail')))}", highlight=False
        )
    else:
        detail = str(check.get("detail", "differs from the replay"))
        err_console.print(f"[yellow]database:[/] {escape(detail)}", highlight=False)
