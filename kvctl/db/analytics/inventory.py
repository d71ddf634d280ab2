"""The fleet's inventory as the read model reports it: DCs, nodes and link distances."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.engine import Connection

from kvctl.db.inventory import DcInfo, NodeInfo, list_dcs, list_links, list_nodes


@dataclass(frozen=True, slots=True)
class Inventory:
    dcs: list[DcInfo]
    nodes: list[NodeInfo]
    #: (dc_a, dc_b) with dc_a < dc_b by name -> distance in km
    links_km: dict[tuple[str, str], float]

    def dc(self, name: str) -> DcInfo:
        for d in self.dcs:
            if d.name == name:
                return d
        raise KeyError(name)

    def nodes_of(self, dc: str) -> list[NodeInfo]:
        return [n for n in self.nodes if n.dc == dc]


def pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def inventory(conn: Connection) -> Inventory:
    """DCs and nodes sorted by name, links keyed by their DCs' names."""
    links = {(lk.a, lk.b): lk.distance_km for lk in list_links(conn)}
    return Inventory(list_dcs(conn), list_nodes(conn), links)
