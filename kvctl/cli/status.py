"""`kvctl status`: one row per node (up or down, hit ratio, reuse vs sharing, tier occupancy,
last seen) and totals per DC."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvctl.cli.options import DbOpt, DcOpt, JsonOpt, NodeOpt, TimeoutOpt, db_errors, open_engine
from kvctl.cli.output import console, print_json, user_errors
from kvctl.format import percent as pct

if TYPE_CHECKING:
    from kvctl.fleet.status import Counts, FleetStatus, TierUse


def status_command(
    node: NodeOpt = None,
    dc: DcOpt = None,
    timeout: TimeoutOpt = 3.0,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show every node's agent live: up or down, hit ratio and its split into reuse (same
    tenant) and sharing (another tenant's chunks), tier occupancy, last seen; totals per DC.

    Counters are since each agent started. A node that does not answer is shown down with the
    last time the collectors reached it (`kvctl collect`), and never fails the command.

    Examples:

      kvctl status

      kvctl status --dc fra

      kvctl status --node gpu-a1 --node gpu-a2 --json
    """
    from kvctl.fleet.status import fleet_status
    from kvctl.fleet.targets import resolve_targets

    engine = open_engine(db)
    with (
        db_errors(),
        user_errors(hint="`kvctl fleet ls` lists DCs and nodes"),
        engine.connect() as conn,
    ):
        everyone = not (node or dc)
        nodes = resolve_targets(conn, nodes=node or [], dcs=dc or [], all_nodes=everyone)
        status = fleet_status(conn, nodes, timeout_s=timeout)
    engine.dispose()
    if json_out:
        print_json(status.as_dict())
        return
    _render(status)


def _ratio(r: float | None) -> str:
    return "N/A" if r is None else pct(r)


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
    return "  ".join(f"{name} {_ratio(t.occupancy_ratio)}" for name, t in tiers.items()) or "N/A"


def _split(c: Counts) -> str:
    if c.reuse_share_ratio is None:
        return "N/A"
    return f"{_ratio(c.reuse_share_ratio)} / {_ratio(c.sharing_share_ratio)}"


def _render(status: FleetStatus) -> None:
    from rich.table import Table

    now_ms = status.ts_ms
    nodes = Table(title="nodes (counters since each agent started)", title_justify="left")
    for col in ("node", "dc", "state", "hit ratio", "reuse / sharing", "occupancy", "last seen"):
        nodes.add_column(col, justify="right" if col == "hit ratio" else "left")
    for n in status.nodes:
        nodes.add_row(
            n.node,
            n.dc,
            "[green]up[/]" if n.up else "[bold red]down[/]",
            _ratio(n.counts.hit_ratio) if n.up else "N/A",
            _split(n.counts) if n.up else "N/A",
            _tiers(n.tiers) if n.up else "N/A",
            _ago(n.last_seen_ms, now_ms),
        )
    console.print(nodes)
    dcs = Table(title="per DC", title_justify="left")
    for col in ("dc", "up", "hit ratio", "reuse / sharing", "occupancy"):
        dcs.add_column(col, justify="left" if col in ("dc", "occupancy") else "right")
    for d in [*status.dcs, status.total]:
        c = d.counts
        split = (
            "N/A"
            if c.reuse_share_ratio is None
            else f"{_ratio(c.reuse_share_ratio)} / {_ratio(c.sharing_share_ratio)}"
        )
        name = f"[bold]{d.dc}[/]" if d is status.total else d.dc
        dcs.add_row(name, f"{d.up}/{d.nodes}", _ratio(c.hit_ratio), split, _tiers(dict(d.tiers)))
    console.print(dcs)
    down = [n for n in status.nodes if not n.up]
    for n in down:
        console.print(f"[red]{n.node}[/] down: {n.error}", highlight=False)
