"""`kvctl demo`: the main job on one machine: a real fleet serving a real workload."""

from __future__ import annotations

import contextlib
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvctl.cli.extras import needs_extra
from kvctl.cli.options import JsonOpt
from kvctl.cli.output import console, err_console, fail, print_json, user_errors
from kvctl.cli.replay import LimitOpt, SeedOpt, TenantsOpt, WorkloadOpt, load_for_replay

if TYPE_CHECKING:
    from kvctl.fleet.demo import DemoFleet
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
        start,
        start_dashboard,
        stop_signals,
    )

    say: Callable[[str], None] = (
        (lambda _: None) if json_out else (lambda m: console.print(f"  {m}", highlight=False))
    )
    with user_errors(hint="see `kvctl demo --help`"):
        if trace is not None and not trace.is_file():
            err_console.print(f"[yellow]{trace} not found; using the built-in workload instead[/]")
            trace = None
        from kvctl.profiles import gpu_profile

        gpu_profile(gpu)  # an unknown profile fails here, before anything starts
        config = DemoConfig(
            (workdir or default_workdir()).resolve(),
            nodes_per_dc=nodes_per_dc,
            gpu=gpu,
            speed=speed or None,
        )
        loaded = load_for_replay(trace, workload, seed, limit, tenants)
        if not json_out:
            console.print(
                f"[bold]kvctl demo[/]: {loaded.name} ({len(loaded.requests):,} requests) on a "
                f"fleet of "
                f"{2 * nodes_per_dc} agents in 2 DCs; workspace {config.workdir}",
                highlight=False,
            )
        stop = threading.Event()
        with stop_signals(stop), _demo_errors(config.workdir):
            fleet = start(config, on_step=say)
            try:
                if dashboard:
                    url = start_dashboard(fleet)
                    say(f"dashboard: {url} (log: {config.workdir / 'dashboard.log'})")
                    _plan_in_background(fleet, loaded, say)
                    if browser:
                        import webbrowser

                        webbrowser.open(url)
                report = _run(fleet, loaded, stop, duration, say)
                db_check = _final_check(fleet, report)
            finally:
                say("stopping ...")
                killed = fleet.stop()
                if killed:
                    err_console.print(f"[yellow]had to kill:[/] {', '.join(killed)}")
    comparison = _save_route_comparison(fleet, loaded, report, say)
    from kvctl.fleet.demo import REPORT_FILE

    (config.workdir / REPORT_FILE).write_text(_json(report.as_dict()), encoding="utf-8")
    if json_out:
        print_json(
            {
                **report.as_dict(),
                "workdir": str(config.workdir),
                "router_url": fleet.router_url,
                "agent_links": fleet.agent_links(),
                "database": db_check,
                "routing_compared": comparison,
            }
        )
    else:
        from kvctl.cli.replay import render_replay

        render_replay(report)
        _print_db_check(db_check)
        _print_comparison(comparison)
        console.print(
            f"workspace kept in {config.workdir}: kvctl.db (history), replay.json, logs; "
            f"`kvctl db current --db {fleet.db_url}` reads it"
        )
    if report.agents_agree is False or db_check.get("agree") is False:
        raise typer.Exit(1)


def _plan_in_background(fleet: DemoFleet, loaded: Workload, say: Callable[[str], None]) -> None:
    """The capacity page's plan, computed beside the replay so the replay starts at once."""
    from kvctl.fleet.demo import save_demo_plan

    def work() -> None:
        try:
            save_demo_plan(fleet, loaded.requests, loaded.name)
        except Exception as exc:  # the demo goes on without a capacity plan
            say(f"capacity plan not saved: {exc}")
        else:
            say("capacity plan of the workload saved for the dashboard's capacity page")

    threading.Thread(target=work, name="plan", daemon=True).start()


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
    """The requests the replay served, replayed again under every routing policy on the
    demo's own nodes, link and tier sizes (size-only tiers, TTFT modeled), saved for the
    dashboard's Routing page beside the real router's counts. None when it could not be made."""
    from kvctl.bench.route_compare import compare_routing
    from kvctl.db.migrate import open_db
    from kvctl.db.route_reports import save_route_report
    from kvctl.fleet.demo import DEMO_DCS, node_names
    from kvctl.units import parse_size

    config = fleet.config
    served = loaded.requests[: report.requests.requests]
    if not served:
        return None
    say(f"replaying those {len(served):,} requests under each routing policy for comparison ...")
    unscale = 1 / config.kv_scale
    try:
        result = compare_routing(
            served,
            nodes=node_names(config),
            links_km={(DEMO_DCS[0].name, DEMO_DCS[1].name): config.link_km},
            cpu_bytes=int(parse_size(config.cpu) * unscale),
            disk_bytes=int(parse_size(config.disk) * unscale),
            model=config.model,
            gpu=config.gpu,
            workload_name=loaded.name,
        )
        engine = open_db(fleet.db_url)
        try:
            with engine.begin() as conn:
                save_route_report(conn, result, now_ms=int(time.time() * 1000))
        finally:
            engine.dispose()
    except Exception as exc:  # the demo's own run stands without the comparison
        say(f"routing comparison not saved: {exc}")
        return None
    return result


def _print_comparison(result: dict[str, Any] | None) -> None:
    if not result:
        return
    ref = result["policies"][result["reference"]]
    parts = []
    for name, p in result["policies"].items():
        ttft = p["vs_reference"]["ttft_mean_ratio_to_reference"]
        ttft_text = "" if ttft is None else f", TTFT {ttft:.2f}x"
        parts.append(f"{name} {p['hit_ratio'] or 0:.1%}{ttft_text}")
    console.print(
        f"routing compared on the same {result['requests']:,} requests ({result['basis']}; "
        f"round-robin hit {ref['hit_ratio'] or 0:.1%}): " + " · ".join(parts),
        highlight=False,
    )


def _json(data: object) -> str:
    import json

    return json.dumps(data, indent=2, default=str) + "\n"


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
        err_console.print(f"[yellow]database:[/] {check.get('detail')}")
    else:
        err_console.print(f"[yellow]database:[/] {check.get('detail', 'differs from the replay')}")
