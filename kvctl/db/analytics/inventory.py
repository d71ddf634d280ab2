"""The fleet's inventory as the read model reports it: DCs, nodes and link distances, and the
nodes removed since a window's start, whose samples stay in that window's totals."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy.engine import Connection

from kvctl.db.analytics.counts import Counts
from kvctl.db.inventory import (
    DcInfo,
    NodeInfo,
    RemovedNodeInfo,
    list_dcs,
    list_links,
    list_nodes,
    removed_label,
    removed_nodes,
)


@dataclass(frozen=True, slots=True)
class Inventory:
    dcs: list[DcInfo]
    nodes: list[NodeInfo]
    #: (dc_a, dc_b) with dc_a < dc_b by name -> distance in km
    links_km: dict[tuple[str, str], float]
    #: removed nodes whose samples may be in the window (``removed_nodes``), by DC and name
    removed: list[RemovedNodeInfo] = field(default_factory=list)

    def dc(self, name: str) -> DcInfo:
        for d in self.dcs:
            if d.name == name:
                return d
        raise KeyError(name)

    def nodes_of(self, dc: str) -> list[NodeInfo]:
        return [n for n in self.nodes if n.dc == dc]

    def dc_of_nodes(self) -> dict[int, str]:
        """Each node's DC name by node id, the removed nodes' too (their probes still count)."""
        return {n.id: n.dc for n in [*self.nodes, *self.removed]}

    def removed_of(self, dc: str) -> list[RemovedNodeInfo]:
        return [n for n in self.removed if n.dc == dc]

    def removed_dcs(self) -> list[DcInfo]:
        """The DCs of removed nodes that are no longer in the inventory, as their nodes last
        saw them (grid intensity, PUE: the modeled savings of their hits), by name."""
        current = {d.name for d in self.dcs}
        seen: dict[str, RemovedNodeInfo] = {}
        for n in sorted(self.removed, key=lambda n: n.removed_ms):
            if n.dc not in current:
                seen[n.dc] = n
        return [
            DcInfo(0, name, "", "", n.dc_carbon_g_per_kwh, n.dc_pue, 0)
            for name, n in sorted(seen.items())
        ]

    def dc_label(self, name: str) -> str:
        """A DC's name as listings show it: marked where it is no longer in the inventory."""
        return name if any(d.name == name for d in self.dcs) else removed_label(name)


def pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def inventory(conn: Connection, *, removed_since_ms: int | None = None) -> Inventory:
    """DCs and nodes sorted by name, links keyed by their DCs' names; with
    ``removed_since_ms``, the removed nodes that may have samples since then too."""
    links = {(lk.a, lk.b): lk.distance_km for lk in list_links(conn)}
    removed = [] if removed_since_ms is None else removed_nodes(conn, since_ms=removed_since_ms)
    return Inventory(list_dcs(conn), list_nodes(conn), links, removed)


def has_figures(c: Counts) -> bool:
    """Whether a node recorded anything in the window (a removed node without is not listed)."""
    return bool(
        c.samples
        or c.read_samples
        or c.energy_nodes
        or c.emulated_energy_nodes
        or c.engine_nodes
        or c.plan_nodes
    )
