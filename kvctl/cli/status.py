"""`kvctl status`: one row per node (up or down, hit ratio, reuse vs sharing, reads gone, tier
occupancy, last seen), totals per DC and each tier's reuse and sharing per DC; live from the
agents, or as the collectors recorded a window."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from kvctl.cli.options import DbOpt, DcOpt, JsonOpt, NodeOpt, TimeoutOpt, db_errors, open_engine
from kvctl.cli.output import console, err_console, print_json, user_errors
from kvctl.format import format_utc_minute, percent

if TYPE_CHECKING:
    from rich.table import Table

    from kvctl.db.analytics.counts import Counts
    from kvctl.db.analytics.recorded import Recorded
    from kvctl.fleet.status import DcStatus, FleetStatus, TierUse
    from kvctl.ratios import HitCounts

WindowOpt = Annotated[
    str | None,
    typer.Option(
        "--window",
        "-w",
        help=(
            "Report what the collectors recorded over the last DURATION (e.g. 15m, 1h, 7d) "
            "instead of asking the agents."
        ),
        metavar="DURATION",
        show_default=False,
    ),
]


def status_command(
    node: NodeOpt = None,
    dc: DcOpt = None,
    window: WindowOpt = None,
    timeout: TimeoutOpt = 3.0,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show every node's agent live: up or down, hit ratio and its split into reuse (same
    tenant) and sharing (another tenant's chunks), reads gone, tier occupancy, last seen;
    totals per DC, and per DC each tier's reuse and sharing hit ratios.

    Counters are since each agent started. "Reads gone" is the share of the chunks engines'
    reads asked for that were no longer there (a lookup counts a hit when it answers; the
    chunk may be evicted before the engine reads it): a column where any agent reports reads,
    N/A for an agent older than the counts or one that served no read yet. Each tier's reuse
    and sharing hit ratios are the hits that tier served per lookup, so a DC's tiers add up to
    its hit ratio (per node too in --json, under `tiers`).

    A node that does not answer is shown down with the last time the collectors reached it
    (`kvctl collect`), and never fails the command; one that took the connection and said
    nothing within --timeout (hung or overloaded) is shown not answering; one still opening
    its tiers is shown up, starting (no figures yet). A figure an agent answers that cannot be
    true (NaN, Infinity, negative, more reads gone than reads) is N/A and left out of the
    totals, the node up with its other figures, and named under the table (`rejected` in
    --json), as `kvctl top` does.

    With --window, no agent is asked: the same figures are what the collectors recorded over
    that window (the dashboard's numbers), with the share of scrapes each node answered and,
    where any, those answered without figures (unread: the token refused, the agent starting,
    or figures rejected). Nodes removed since the window started (`kvctl fleet rm`) still
    count in it, listed as removed.

    Examples:

      kvctl status

      kvctl status --dc fra

      kvctl status --window 1h

      kvctl status --node gpu-a1 --node gpu-a2 --json
    """
    from kvctl.db.analytics.recorded import recorded, removed_in
    from kvctl.db.analytics.windows import window_of
    from kvctl.fleet.status import FleetStatus, fleet_status
    from kvctl.fleet.targets import resolve_targets

    win = None
    if window is not None:
        with user_errors():
            win = window_of(window, int(time.time() * 1000))  # from 1970 at the earliest
    engine = open_engine(db)
    try:
        with (
            db_errors(),
            user_errors(hint="`kvctl fleet ls` lists DCs and nodes"),
            engine.connect() as conn,
        ):
            everyone = not (node or dc)
            nodes = resolve_targets(conn, nodes=node or [], dcs=dc or [], all_nodes=everyone)
            result: FleetStatus | Recorded
            if win is None:  # live: the agents of the inventory's nodes
                result = fleet_status(conn, nodes, timeout_s=timeout)
            else:  # a window's totals keep the nodes removed since it started
                gone = removed_in(conn, win, dcs=dc or [], everyone=everyone)
                result = recorded(conn, win, nodes, gone)
    except KeyboardInterrupt:  # read-only: no agent still asked is waited for
        err_console.print("[yellow]interrupted[/]", highlight=False)
        raise typer.Exit(130) from None
    finally:
        engine.dispose()
    if json_out:
        print_json(result.as_dict())
    elif isinstance(result, FleetStatus):
        _render(result)
    else:
        _render_recorded(result)


def _ago(ts_ms: int | None, now_ms: int) -> str:
    if ts_ms is None:
        return "never"
    s = max(now_ms - ts_ms, 0) / 1000
    if s < 5:
        return "now"
    for unit, width in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= width:
            return f"{s / width:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def _tiers(tiers: dict[str, TierUse]) -> str:
    return "  ".join(f"{name} {percent(t.occupancy_ratio)}" for name, t in tiers.items()) or "N/A"


#: the split's column: shares of the hits (kvctl/ratios.py's ``*_share_of_hits``), not the
#: per-lookup ``*_hit_ratio`` the dashboard's "reuse/sharing hit ratio" columns show
SPLIT_COLUMN = "reuse / sharing (of hits)"


def _split(c: HitCounts) -> str:
    """Reuse / sharing as shares of the hits."""
    if c.reuse_share_of_hits is None:
        return "N/A"
    return f"{percent(c.reuse_share_of_hits)} / {percent(c.sharing_share_of_hits)}"


def _split_of(figures: Mapping[str, float | None]) -> str:
    """Reuse / sharing as shares of the hits, from a live row's figures (None: unknown)."""
    reuse, sharing = figures["reuse_share_of_hits"], figures["sharing_share_of_hits"]
    if reuse is None and sharing is None:
        return "N/A"
    return f"{percent(reuse)} / {percent(sharing)}"


#: a node's state (NodeStatus.state) as the table shows it
STATES = {
    "up": "[green]up[/]",
    "token refused": "[yellow]up, token refused[/]",
    "starting": "[yellow]up, starting[/]",
    "not answering": "[bold yellow]not answering[/]",
    "down": "[bold red]down[/]",
}


def _render(status: FleetStatus) -> None:
    from rich.table import Table

    from kvctl.db.sample_checks import Rejections

    now_ms = status.ts_ms
    # reads that found their chunk gone: a column where any node reported reads, as --window
    reads = status.total.read_nodes > 0
    ratios = ("hit ratio", *((READS_COLUMN,) if reads else ()))
    nodes = Table(title="nodes (counters since each agent started)", title_justify="left")
    for col in ("node", "dc", "state", *ratios, SPLIT_COLUMN, "occupancy", "last seen"):
        nodes.add_column(col, justify="right" if col in ratios else "left")
    for n in status.nodes:
        # None where not read (down, token refused, starting) or rejected as impossible: N/A
        f = n.figures()
        # escaped: names and errors are the inventory's and the agents' text, not markup
        nodes.add_row(
            escape(n.node),
            escape(n.dc),
            STATES[n.state],
            percent(f["hit_ratio"]),
            *((percent(n.read_figures()["read_missing_ratio"]),) if reads else ()),
            _split_of(f),
            _tiers(n.tiers) if n.read else "N/A",
            _ago(n.last_seen_ms, now_ms),
        )
    console.print(nodes)
    dcs = Table(title="per DC", title_justify="left")
    for col in ("dc", "up", *ratios, SPLIT_COLUMN, "occupancy"):
        dcs.add_column(col, justify="left" if col in ("dc", "occupancy") else "right")
    every = [*status.dcs, status.total]
    for d in every:
        f = d.figures()
        dcs.add_row(
            _dc_label(d.dc, total=d is status.total),
            f"{d.up}/{d.nodes}",
            percent(f["hit_ratio"]),
            *((percent(d.read_figures()["read_missing_ratio"]),) if reads else ()),
            _split_of(f),
            _tiers(dict(d.tiers)),
        )
    console.print(dcs)
    if reads:
        _reads_note()
    tiers = _tier_order(status.total.tier_hits)
    if tiers:
        console.print(_live_tier_split_table(every, tiers, status.total))
    for n in status.nodes:
        if n.rejected:  # escaped: a rejected tier's name is the agent's text
            why = escape(Rejections(dict(n.rejected)).summary())
            console.print(
                f"[yellow]{escape(n.node)}[/] {len(n.rejected)} value(s) rejected as impossible, "
                f"shown N/A and left out of the totals: {why}",
                highlight=False,
            )
        if n.auth_refused or n.starting:
            console.print(f"[yellow]{escape(n.node)}[/] {escape(str(n.error))}", highlight=False)
        elif not n.up:
            console.print(
                f"[red]{escape(n.node)}[/] {n.state}: {escape(str(n.error))}", highlight=False
            )


def _occupancy(c: Counts) -> str:
    known = [(t, c.occupancy_ratio(t)) for t in c.tiers]
    return "  ".join(f"{t} {percent(r)}" for t, r in known if r is not None) or "N/A"


def _render_recorded(rec: Recorded) -> None:
    from rich.table import Table

    win = rec.window
    span = f"{format_utc_minute(win.start_ms)} to {format_utc_minute(win.end_ms)}"
    # scrapes up without figures (token refused, starting, rejected): a column where any were
    unread = rec.fleet.unread_samples > 0
    # reads that found their chunk gone: a column where any node reported reads
    reads = rec.fleet.read_nodes > 0
    columns = (
        "scrapes up",
        *(("unread",) if unread else ()),
        "lookups",
        "hit ratio",
        *((READS_COLUMN,) if reads else ()),
        SPLIT_COLUMN,
        "occupancy",
    )
    nodes = Table(title=f"nodes, recorded over the last {win.name} ({span})", title_justify="left")
    for col in ("node", "dc", *columns):
        nodes.add_column(col, justify="left" if col in ("node", "dc", "occupancy") else "right")
    for n, c in rec.nodes:
        nodes.add_row(
            escape(n.label), escape(n.dc), *_recorded_cells(c, unread=unread, reads=reads)
        )
    console.print(nodes)
    dcs = Table(title="per DC", title_justify="left")
    for col in ("dc", "nodes", *columns):
        dcs.add_column(col, justify="left" if col in ("dc", "occupancy") else "right")
    for name, c in [*rec.dcs.items(), ("fleet", rec.fleet)]:
        label = _dc_label(name, total=c is rec.fleet)
        counted = f"{c.nodes} + {c.removed_nodes} removed" if c.removed_nodes else str(c.nodes)
        dcs.add_row(label, counted, *_recorded_cells(c, unread=unread, reads=reads))
    console.print(dcs)
    if reads:
        _reads_note()
    if rec.fleet.tiers:
        rows = [*rec.dcs.items(), ("fleet", rec.fleet)]
        split = [(_dc_label(n, total=c is rec.fleet), c.tier_hit_counts) for n, c in rows]
        console.print(_tier_split_table(rec.fleet.tiers, split))
    if not rec.fleet.samples:
        console.print("nothing recorded in this window: is `kvctl collect` running?")


#: the per-tier table's title: per lookup of the whole (kvctl/ratios.py's ``*_hit_ratio``),
#: so a DC's tiers add up to its hit ratio, unlike the shares of hits of SPLIT_COLUMN
TIER_SPLIT_TITLE = "reuse / sharing hit ratio by tier (hits the tier served per lookup)"


def _tier_split(t: HitCounts) -> str:
    if t.reuse_hit_ratio is None and t.sharing_hit_ratio is None:
        return "N/A"
    return f"{percent(t.reuse_hit_ratio)} / {percent(t.sharing_hit_ratio)}"


def _tier_split_table(
    tiers: Sequence[str], rows: Sequence[tuple[str, Callable[[str], HitCounts]]]
) -> Table:
    """Per row (a DC, the fleet: its label and its tiers' hit counts), each tier's reuse /
    sharing hit ratio; recorded or live alike."""
    from rich.table import Table

    table = Table(title=TIER_SPLIT_TITLE, title_justify="left")
    table.add_column("dc")
    for tier in tiers:
        table.add_column(tier, justify="right")
    for label, counts_of in rows:
        table.add_row(label, *(_tier_split(counts_of(t)) for t in tiers))
    return table


def _live_tier_split_table(dcs: Sequence[DcStatus], tiers: list[str], total: DcStatus) -> Table:
    """The live figures' per-tier split: since each agent started, over the DC's counted nodes
    (N/A for a DC none of whose nodes was counted: no lookups)."""
    return _tier_split_table(
        tiers, [(_dc_label(d.dc, total=d is total), d.tier_hit_counts) for d in dcs]
    )


def _tier_order(tiers: Mapping[str, object]) -> list[str]:
    from kvctl.db.analytics.counts import TIER_ORDER

    return [t for t in TIER_ORDER if t in tiers] + sorted(set(tiers) - set(TIER_ORDER))


def _dc_label(name: str, *, total: bool) -> str:
    # escaped: a DC's name is the inventory's text, not markup
    return f"[bold]{escape(name)}[/]" if total else escape(name)


def _reads_note() -> None:
    console.print(
        f"{READS_COLUMN}: of the chunks engines read, those not there: evicted "
        "between the lookup that counted them as hits and the read, or never looked up",
        highlight=False,
        soft_wrap=True,
    )


#: the recorded tables' column of reads that found their chunk gone (``read_missing_ratio``)
READS_COLUMN = "reads gone"


def _recorded_cells(c: Counts, *, unread: bool, reads: bool) -> tuple[str, ...]:
    return (
        percent(c.up_ratio),
        *((f"{c.unread_samples:,}",) if unread else ()),
        f"{c.lookups:,}",
        percent(c.hit_ratio),
        *((percent(c.read_missing_ratio),) if reads else ()),
        _split(c),
        _occupancy(c),
    )
