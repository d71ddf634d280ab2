"""`kvctl top`: the live view of the fleet (or of agents by URL) in the terminal."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvctl.cli.extras import needs_extra
from kvctl.cli.options import (
    DbOpt,
    DcOpt,
    JsonOpt,
    NodeOpt,
    TimeoutOpt,
    db_errors,
    open_engine,
)
from kvctl.cli.output import err_console, fail, print_json, user_errors

if TYPE_CHECKING:
    from kvctl.tui.sources import RouterWatch, Source

AgentOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--agent",
        "-a",
        help="Watch this agent's control URL directly, no database (repeat for several).",
        metavar="URL",
        show_default=False,
    ),
]


def top_command(
    agent: AgentOpt = None,
    node: NodeOpt = None,
    dc: DcOpt = None,
    interval: Annotated[
        float, typer.Option("--interval", "-i", help="Seconds between polls.", min=0.2)
    ] = 2.0,
    readonly: Annotated[
        bool, typer.Option("--readonly", help="Refuse every action (watch only).")
    ] = False,
    timeout: TimeoutOpt = 2.0,
    theme: Annotated[
        str | None,
        typer.Option("--theme", help="Textual theme, e.g. textual-light or textual-dark."),
    ] = None,
    window: Annotated[
        str,
        typer.Option(
            "--window",
            "-w",
            help=(
                "With --json on a fleet database: also report, under `recorded`, what the "
                "collectors recorded over the last DURATION (e.g. 15m, 1h) per DC and in total."
            ),
            metavar="DURATION",
        ),
    ] = "15m",
    router: Annotated[
        str | None,
        typer.Option(
            "--router",
            help=(
                "Also read this router's decisions each poll (`kvctl router serve`; default: "
                "$KVCTL_ROUTER_URL when set, else no router)."
            ),
            metavar="URL",
            show_default=False,
        ),
    ] = None,
    router_token_file: Annotated[
        Path | None,
        typer.Option(
            "--router-token-file",
            help="File holding the router's bearer token (default: $KVCTL_ROUTER_TOKEN).",
            show_default=False,
        ),
    ] = None,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Watch the fleet live: per node up/down, hit ratio and its trend, reuse vs sharing,
    occupancy per tier, evictions/s, I/O, link RTT and GPU power; drill into a node for its
    tier history, live events, hottest prefixes and pinned chunks, and, since its agent
    started, the share of its engines' reads whose chunk was gone (reads gone, as `kvctl
    status` has it) and each tier's reuse / sharing hit ratio.

    Sort (s, or click a header), filter (/), group by DC (g); pin, unpin, evict, flush and
    resize from the view, each confirmed first and written to the audit trail like the CLI's.
    Press ? in the view for every key. Nodes that stop answering stay on screen as down.

    With --json, polls twice --interval apart and prints the figures once (for scripts), with
    what the collectors recorded over --window beside them (null with --agent: no database).
    Each node's read_chunks, read_missing_chunks and read_missing_ratio, and each tier's hits
    with their reuse / sharing ratios, count since its agent started, under `kvctl status
    --json`'s names.

    With --router, each poll also reads the router's counts: ROUTED/s and TO HOLDER per node
    (over the recent window), and a routing line with its figures since it started. A router
    that does not answer shows "router down" with the reason and N/A; the view goes on.

    Examples:

      kvctl top

      kvctl top --dc fra --interval 1

      kvctl top --agent http://127.0.0.1:7070 --readonly

      kvctl top --json --interval 1

      kvctl top --json --window 1h

      kvctl top --router http://127.0.0.1:9480 --router-token-file router.token
    """
    from kvctl.db.analytics.windows import duration_ms
    from kvctl.tui.sources import AgentSource, FleetSource

    if not json_out:  # the figures once, as JSON, need no Textual
        needs_extra("kvctl top", "tui", otherwise="`kvctl top --json` runs without it")
    if agent and (node or dc):
        fail("--agent watches agents by URL; --node/--dc pick from the inventory: use one way")
    with user_errors():
        duration_ms(window)  # a bad --window fails before any poll
    token = None  # the SDK reads KVCTL_TOKEN
    watch = _router_watch(router, router_token_file, timeout)
    audit_engine = None
    source: Source
    with user_errors(hint="an agent URL looks like http://127.0.0.1:7070"):
        if agent:
            source = AgentSource(agent, token=token, timeout_s=timeout, router=watch)
            if not readonly and not json_out:
                # actions are audited in the local database, made if need be
                audit_engine = open_engine(db, create=True)
        else:
            engine = open_engine(db)
            source = FleetSource(
                engine,
                dcs=dc or [],
                nodes=node or [],
                token=token,
                timeout_s=timeout,
                router=watch,
            )
            with db_errors(), user_errors(hint="`kvctl fleet ls` lists DCs and nodes"):
                source.targets()  # an unknown DC or node, or an empty fleet, fails here
            audit_engine = None if readonly else engine
    if json_out:
        try:
            _print_once(source, interval, window, wait_s=timeout)
        except KeyboardInterrupt:  # read-only, its calls on daemon threads: nothing to wait for
            err_console.print("[yellow]interrupted[/]", highlight=False)
            raise typer.Exit(130) from None
        return
    if not all(stream is not None and stream.isatty() for stream in (sys.stdin, sys.stdout)):
        # the full-screen view would write its escape codes into a pipe or file
        fail(
            "kvctl top needs a terminal (standard input and output are not one)",
            hint="kvctl top --json prints the figures once, for scripts",
        )
    from kvctl.tui.app import create_app

    with user_errors():
        app = create_app(
            source, interval_s=interval, readonly=readonly, audit_engine=audit_engine, theme=theme
        )
    app.run()
    if audit_engine is not None and audit_engine is not getattr(source, "engine", None):
        audit_engine.dispose()
    if app.return_code:
        raise typer.Exit(app.return_code)


def _router_watch(url: str | None, token_file: Path | None, timeout_s: float) -> RouterWatch | None:
    """The router to read each poll: --router, else $KVCTL_ROUTER_URL, else none."""
    from kvctl.cli.router import ROUTER_URL_ENV, router_token
    from kvctl.tui.sources import RouterWatch

    url = url or os.environ.get(ROUTER_URL_ENV) or None
    if url is None:
        if token_file is not None:
            fail("--router-token-file needs a router: give --router URL (or $KVCTL_ROUTER_URL)")
        return None
    with user_errors(hint="a router URL looks like http://127.0.0.1:9480"):
        return RouterWatch(url, token=router_token(token_file), timeout_s=timeout_s)


def _print_once(source: Source, interval_s: float, window: str, wait_s: float) -> None:
    """Two polls ``interval_s`` apart, so rates are real rates; then the figures as JSON, and
    the fleet database's record of ``window`` under ``recorded``. Each poll waits ``wait_s``
    for the agents at most (--timeout): one that trickles its answer reads as not answering
    instead of holding the script for as long as it trickles."""
    from kvctl.tui.model import Sampler
    from kvctl.tui.sources import FleetSource

    sampler = Sampler()
    with db_errors():
        sampler.update(source.poll(wait_s))
        time.sleep(interval_s)
        view = sampler.update(source.poll(wait_s))
        recorded = source.recorded(window) if isinstance(source, FleetSource) else None
    source.close()
    doc = view.as_dict()
    doc["recorded"] = None if recorded is None else recorded.as_dict(nodes=False)
    print_json(doc)
