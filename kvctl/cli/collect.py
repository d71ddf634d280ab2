"""`kvctl collect`: record the fleet's cache, power, link and engine metrics in the database."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from kvctl.cli.options import DbOpt, db_errors, open_engine
from kvctl.cli.output import console, err_console, fail, print_json
from kvctl.interrupts import stop_signals

#: the collector's own /metrics (the agent's control API is 7070, its data plane 7071)
DEFAULT_METRICS_PORT = 9470


#: the longest --interval and --link-interval: a day
MAX_INTERVAL_S = 86_400.0


def collect_command(
    once: Annotated[bool, typer.Option("--once", help="One cycle, then exit.")] = False,
    interval: Annotated[
        float,
        # past a day is no collector's; 1e300 failed with a bug's line (OverflowError: time_t)
        typer.Option(
            "--interval", help="Seconds between cache scrapes.", min=0.1, max=MAX_INTERVAL_S
        ),
    ] = 10.0,
    dc: Annotated[str | None, typer.Option(help="Only nodes in this DC.")] = None,
    db: DbOpt = None,
    links: Annotated[
        bool, typer.Option("--links/--no-links", help="Probe links between DCs.")
    ] = True,
    link_interval: Annotated[
        float,
        typer.Option(
            "--link-interval", help="Seconds between link probes.", min=1, max=MAX_INTERVAL_S
        ),
    ] = 60.0,
    probe_size: Annotated[
        str, typer.Option("--probe-size", help="Bytes sent each way per link probe (max 64MiB).")
    ] = "1MiB",
    metrics_listen: Annotated[
        str,
        typer.Option(
            "--metrics-listen",
            help="Serve the collector's own /metrics on HOST:PORT, or 'off'. It has no auth: "
            "keep it on loopback and let a local Prometheus or a proxy reach it.",
        ),
    ] = f"127.0.0.1:{DEFAULT_METRICS_PORT}",
    routers: Annotated[
        list[str] | None,
        typer.Option(
            "--router",
            help="Also scrape this `kvctl router serve` (its decisions, index hits and pulls "
            "per DC link) each interval; repeat for several.",
            show_default=False,
        ),
    ] = None,
    router_token_file: Annotated[
        Path | None,
        typer.Option(
            "--router-token-file",
            help="File holding the routers' bearer token (default: $KVCTL_ROUTER_TOKEN).",
            show_default=False,
        ),
    ] = None,
    emulate_power: Annotated[
        str | None,
        typer.Option(
            "--emulate-power",
            help="On nodes whose agent has no NVML, record emulated GPU energy instead: the "
            "modeled prefill time of the tokens their cache did not serve (whole chunks only) "
            "x the board power of the node's inventory GPU (its gpu_model: h100, l4, ...); "
            "this GPU profile for nodes whose gpu_model names none. Kept apart from measured "
            "readings and shown as emulated.",
            show_default=False,
        ),
    ] = None,
    emulate_model: Annotated[
        str,
        typer.Option("--emulate-model", help="Model profile of --emulate-power's prefill time."),
    ] = "llama-3.1-8b",
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print JSON for scripts: --once one document; the loop one line per scrape, "
            "link round and upkeep (its 'kind'), each written as it ends.",
        ),
    ] = False,
) -> None:
    """Scrape every agent in the fleet inventory into the metrics database.

    Each interval: cache counters per node and tier, GPU power from the node's NVML (through
    its agent), and the node's inference-engine metrics when it has an engine URL. Link probes
    (RTT, loss, bandwidth through the agents' data plane) run on their own, slower schedule;
    rollups and retention every minute. Unreachable nodes are recorded as down, as are those
    not answering (no full answer within 80% of the interval, at most 5 s, per request; a link
    probe's within its own worst case plus 5 s, about 33 s at the default --probe-size); one
    that refuses the token as up with no figures (shown "token refused": KVCTL_TOKEN is not its
    token), as is one still opening its tiers (shown "starting": it serves once they are open);
    the loop goes on. Several collectors (say one per DC with --dc) can write to one
    PostgreSQL; a --once run beside the loop is fine too (each increase is counted once, by
    whichever saves first, and the other counts on from it). --once exits 1 when some figures
    were not recorded: a node down, refusing the token or starting, a router down, or the
    database refusing the samples or their upkeep.

    With --emulate-power GPU, a node without NVML gets an emulated GPU energy instead: the
    modeled prefill seconds of the tokens its cache did not serve (its lookup and hit token
    counters: whole chunks only, a prompt's partial last chunk is not counted; at
    --emulate-model's prefill rate at MFU 0.5, at most the interval) x the published board
    power, on the node's inventory GPU (fleet add-node --gpu-model) where that names a profile
    and on GPU otherwise; in a table of its own: the dashboard shows it as emulated, never
    added to measured.

    With --router, each interval also records what the router decided since the last scrape
    (decisions per node, sent to a node holding the prefix or not, index hits, tokens fetched
    instead of prefilled, bytes pulled per DC link): the dashboard's Routing page.

    The agents' token is read from KVCTL_TOKEN; the routers' from --router-token-file or
    KVCTL_ROUTER_TOKEN.

    Examples:

      kvctl collect --once

      kvctl collect --interval 5 --dc fra-1

      kvctl collect --router http://10.0.0.9:9480 --router-token-file router.token

      kvctl collect --emulate-power l4 --emulate-model qwen2.5-0.5b

      KVCTL_DB_URL=postgresql://kvctl@db/kvctl kvctl collect --metrics-listen 127.0.0.1:9471
    """
    from collectors.collector import Collector, CollectorConfig, CycleReport
    from kvctl.cli.router import router_token
    from kvctl.db.inventory import InventoryError
    from kvctl.errors import InvalidArgument
    from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
    from kvctl.units import parse_size
    from kvctl.wire.address import split_host_port

    try:
        probe_bytes = parse_size(probe_size)
    except ValueError as exc:
        fail(str(exc))
    if probe_bytes > 64 << 20:
        fail(f"--probe-size is at most 64MiB, got {probe_size}")
    for url in routers or ():
        if not url.startswith(("http://", "https://")):
            fail(f"--router takes the router's URL, e.g. http://127.0.0.1:9480; got {url!r}")
    emulation = None
    if emulate_power is not None:
        try:
            emulation = ModeledInputs(model_profile(emulate_model), gpu_profile(emulate_power))
        except InvalidArgument as exc:
            fail(str(exc))
    config = CollectorConfig(
        interval_s=interval,
        link_interval_s=link_interval if links else float("inf"),
        dc=dc,
        probe_bytes=probe_bytes,
        routers=tuple(routers or ()),
        router_token=router_token(router_token_file) if routers else None,
        emulate_power=emulation,
        keep_refused=not once,
    )
    # routers' rows need no inventory, so a database is made for them; nodes come from the
    # inventory, which a mistyped --db would not find (and must not create empty)
    engine = open_engine(db, create=bool(routers))
    try:
        collector = Collector(engine, config)
    except ValueError as exc:  # a router URL the database cannot key
        engine.dispose()
        fail(str(exc))
    try:
        with db_errors():
            try:
                nodes = collector.nodes()
            except InventoryError as exc:  # --dc naming no DC
                fail(str(exc))
        if not nodes and not routers:
            fail(
                "the fleet inventory has no nodes" + (f" in DC {dc!r}" if dc else ""),
                hint="add them with `kvctl fleet add-node` (or `kvctl fleet import FILE`)",
            )
        if once:
            try:
                _once(collector, links, json_out)
            except KeyboardInterrupt:
                # at once: the scrapes under way are on daemon threads, not waited for; a
                # batch is written whole or not at all (the collector holds a Ctrl-C over it)
                written = collector.rows_written
                done = f"{written} rows recorded before it" if written else "nothing recorded"
                err_console.print(
                    f"[yellow]interrupted:[/] {done}, the scrapes under way dropped",
                    highlight=False,
                )
                raise typer.Exit(130) from None
            return
        server = None
        if metrics_listen != "off":
            try:
                host, port = split_host_port(metrics_listen, DEFAULT_METRICS_PORT)
                server, bound = collector.metrics.serve(host, port)
            except (OSError, ValueError) as exc:
                taken = isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE
                fail(
                    f"cannot serve /metrics on {metrics_listen}: {exc}",
                    hint="another process listens there (another `kvctl collect`?): stop it, "
                    "or give --metrics-listen another port (or off)"
                    if taken
                    else None,
                )
            err_console.print(f"collector metrics on http://{host}:{bound}/metrics")
        stop = threading.Event()

        def show(kind: str, report: CycleReport | dict[str, Any]) -> None:
            if json_out:
                data = report.as_dict() if isinstance(report, CycleReport) else report
                print_json({"kind": kind, **data}, line=True)
            elif isinstance(report, CycleReport):
                _line(kind, report)

        scraped = f"{len(nodes)} nodes" + (f" and {len(routers)} router(s)" if routers else "")
        err_console.print(f"collecting from {scraped} every {interval:g}s (Ctrl-C stops)")
        try:
            with stop_signals(stop):
                collector.run(stop, on_cycle=show)
        except KeyboardInterrupt:  # a second Ctrl-C while a write was stuck (interrupts_held)
            err_console.print(
                "[yellow]interrupted:[/] stopped during a database write; the batch under way "
                "may not be recorded",
                highlight=False,
            )
            raise typer.Exit(130) from None
        if server is not None:
            server.shutdown()
        if kept := collector.pending_rows:  # stopped while the database refused them
            err_console.print(
                f"[yellow]stopped with {kept} rows unwritten:[/] the database refused them; "
                "their samples are lost, their counted increases are not (the next run counts "
                "them from the state saved last)",
                highlight=False,
                soft_wrap=True,
            )
    finally:
        collector.close()
        engine.dispose()


def _line(kind: str, r: Any) -> None:
    from rich.markup import escape

    down = f", [red]{len(r.down)} down[/]: {escape(', '.join(sorted(r.down)))}" if r.down else ""
    if r.token_refused:  # up, but unread: the token to fix, not the agent
        refused = escape(", ".join(sorted(r.token_refused)))
        down += f", [yellow]{len(r.token_refused)} token refused[/]: {refused}"
    if r.starting:  # up, but unread until its tiers are open: time, not a fix, is needed
        starting = escape(", ".join(sorted(r.starting)))
        down += f", [yellow]{len(r.starting)} starting[/]: {starting}"
    if r.routers_down:
        down += f", [red]router down[/]: {escape(', '.join(sorted(r.routers_down)))}"
    if r.skipped:  # DC pairs whose nodes answered but cannot be read: no sample, no failure
        down += f", [yellow]{len(r.skipped)} not probed[/]: {escape(', '.join(sorted(r.skipped)))}"
    if r.rejected:  # node (or link) -> its fields rejected as impossible, stored as unknown
        values = sum(len(fields) for fields in r.rejected.values())
        down += f", [yellow]{values} value(s) rejected[/]: {escape(', '.join(sorted(r.rejected)))}"
    # the first warning says why (the database away, another collector on these nodes)
    why = escape(r.warnings[0]) if r.warnings else "not written"
    saved = "" if r.written else f" [yellow]({why})[/]"
    console.print(
        f"{kind:<6} {len(r.up)} up{down} · {sum(r.rows.values())} rows · {r.seconds:.2f}s{saved}",
        highlight=False,
    )


def _once(collector: Any, links: bool, json_out: bool) -> None:
    from rich.markup import escape
    from rich.table import Table
    from sqlalchemy.exc import SQLAlchemyError

    report = collector.collect_once()
    link_report = collector.probe_links_once() if links else None
    try:
        maint = collector.maintain()
    except SQLAlchemyError as exc:  # the samples are in, or kept: upkeep failing is a warning
        maint = {"error": str(getattr(exc, "orig", None) or exc)}
        report.warnings.append(f"rollup/retention failed: {maint['error']}")
        report.written = False
    if json_out:
        print_json(
            {
                "scrape": report.as_dict(),
                "links": None if link_report is None else link_report.as_dict(),
                "maintenance": maint,
            }
        )
    else:
        table = Table("target", "state", "detail", title="kvctl collect --once")

        def row(name: str, state: str, detail: str = "") -> None:
            # escaped: names and errors are the inventory's and the agents' text, not markup
            table.add_row(escape(name), state, escape(detail))

        for name in report.up:
            row(name, "[green]up[/]")
        for name, err in sorted(report.token_refused.items()):
            row(name, "[yellow]token refused[/]", err)
        for name, err in sorted(report.starting.items()):
            row(name, "[yellow]starting[/]", err)
        for name, err in sorted(report.down.items()):
            row(name, "[red]down[/]", err)
        for name in report.routers_up:
            row(name, "[green]router up[/]")
        for name, err in sorted(report.routers_down.items()):
            row(name, "[red]router down[/]", err)
        if link_report is not None:
            for name in link_report.up:
                row(name, "[green]link ok[/]")
            for name, err in sorted(link_report.down.items()):
                row(name, "[red]link failed[/]", err)
            for name, why in sorted(link_report.skipped.items()):
                row(name, "[yellow]link not probed[/]", why)
        console.print(table)
        for w in report.warnings:
            err_console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
        rows = sum(report.rows.values()) + (sum(link_report.rows.values()) if link_report else 0)
        console.print(f"{rows} rows written")
    # a node refusing the token, or starting, is up, but none of its figures were recorded:
    # a failure too (a script retrying --once until 0 gets a cycle with every node's figures)
    unread = report.token_refused or report.starting
    if report.down or unread or report.routers_down or not report.written:
        raise typer.Exit(1)
