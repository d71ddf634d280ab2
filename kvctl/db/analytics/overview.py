"""The fleet over a window: each DC's and the fleet's counts, links and NVML coverage (the
dashboard's fleet page and the benches), and the capacity planner's view."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from kvctl.db.analytics.counts import Assumptions, Counts, node_counts, total
from kvctl.db.analytics.inventory import Inventory, has_figures, inventory
from kvctl.db.analytics.links import LinkFigures, link_figures
from kvctl.db.analytics.windows import Window
from kvctl.db.models import raw_table
from kvctl.db.plans import SavedPlan, latest_plans
from kvctl.db.rollup import MINUTE_MS


@dataclass(frozen=True, slots=True)
class Overview:
    window: Window
    assume: Assumptions
    #: with the nodes removed since the window's start that recorded figures in it
    inventory: Inventory
    #: per DC name, in inventory order, then the removed DCs' (their names marked removed)
    dcs: dict[str, Counts]
    fleet: Counts
    links: list[LinkFigures]
    #: nodes whose agent said NVML is available, in the window's last samples; None: unknown
    nvml_nodes: int | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "window": self.window.as_dict(),
            "assumptions": self.assume.as_dict(),
            "dcs": {name: c.as_dict() for name, c in self.dcs.items()},
            "fleet": self.fleet.as_dict(),
            "links": [link.as_dict() for link in self.links],
            "nvml_nodes": self.nvml_nodes,
        }


def nvml_nodes(conn: Connection, start_ms: int, end_ms: int) -> int | None:
    """Nodes whose agent reported NVML available in the window's last 15 minutes (raw samples:
    the collector records it per scrape); None when no agent said either way."""
    t = raw_table("node_sample")
    q = select(t.c.node_id, t.c.nvml_available).where(
        t.c.ts_ms >= max(start_ms, end_ms - 15 * MINUTE_MS),
        t.c.ts_ms < end_ms,
        t.c.nvml_available.is_not(None),
    )
    seen: dict[int, bool] = {}
    for node_id, available in conn.execute(q):
        seen[node_id] = seen.get(node_id, False) or bool(available)
    return sum(seen.values()) if seen else None


def overview(conn: Connection, win: Window, assume: Assumptions) -> Overview:
    """Each DC's and the fleet's counts over the window. A node removed since the window's
    start still counts in them, in its DC (a DC removed too: under its name marked removed),
    so decommissioning a node never changes a past window's totals."""
    inv = inventory(conn, removed_since_ms=win.start_ms)
    dcs = {d.name: d for d in [*inv.dcs, *inv.removed_dcs()]}
    per_node = node_counts(conn, win.start_ms, win.end_ms, [*inv.nodes, *inv.removed], dcs, assume)
    # removed nodes that recorded nothing in the window are not listed; their link probes in
    # it still count, as on the links page
    probed = inv
    inv = replace(inv, removed=[n for n in inv.removed if has_figures(per_node[n.id])])
    counted = [*inv.nodes, *inv.removed]
    current = [d.name for d in inv.dcs]
    gone = sorted({n.dc for n in inv.removed} - set(current))
    by_dc = {
        inv.dc_label(name): total(per_node[n.id] for n in counted if n.dc == name)
        for name in [*current, *gone]
    }
    fleet = total(by_dc.values())
    return Overview(
        window=win,
        assume=assume,
        inventory=inv,
        dcs=by_dc,
        fleet=fleet,
        links=link_figures(conn, win.start_ms, win.end_ms, probed),
        nvml_nodes=nvml_nodes(conn, win.start_ms, win.end_ms) if not fleet.energy_nodes else None,
    )


@dataclass(frozen=True, slots=True)
class CapacityView:
    plans: dict[str | None, SavedPlan]
    #: per DC (None: the fleet): mean cpu-tier capacity per node with readings over the
    #: window (measured), for the curve
    cpu_capacity_bytes_per_node: dict[str | None, float | None]


def capacity(conn: Connection, ov: Overview) -> CapacityView:
    per_node: dict[str | None, float | None] = {}
    for name, c in [*ov.dcs.items(), (None, ov.fleet)]:
        cap, nodes = c.capacity_bytes.get("cpu"), c.capacity_nodes.get("cpu", 0)
        per_node[name] = cap / nodes if cap is not None and nodes else None
    return CapacityView(latest_plans(conn), per_node)
