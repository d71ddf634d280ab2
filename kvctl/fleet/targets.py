"""Which nodes a command acts on: named nodes, whole DCs, or the whole fleet."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sqlalchemy.engine import Connection

from kvctl.db.inventory import InventoryError, NodeInfo, list_nodes

if TYPE_CHECKING:
    from kvctl.workload.replay import ReplayNode


def resolve_targets(
    conn: Connection,
    *,
    nodes: Sequence[str] = (),
    dcs: Sequence[str] = (),
    all_nodes: bool = False,
) -> list[NodeInfo]:
    """The inventory's nodes named by ``nodes``, in ``dcs``, or all; each node once, in DC then
    name order. Naming nothing, an unknown node, or an empty selection is an error."""
    if not (nodes or dcs or all_nodes):
        raise InventoryError("name the targets: --node NODE, --dc DC, or --all for every node")
    if all_nodes and (nodes or dcs):
        raise InventoryError("--all already means every node; drop --node/--dc")
    everything = list_nodes(conn)
    if all_nodes:
        chosen = everything
    else:
        for dc in dcs:
            list_nodes(conn, dc=dc)  # raises with the known DCs for an unknown name
        by_name = {n.name: n for n in everything}
        unknown = [n for n in nodes if n not in by_name]
        if unknown:
            known = ", ".join(sorted(by_name)[:20]) or "none"
            raise InventoryError(
                f"no node named {', '.join(map(repr, unknown))} (known: {known}); "
                "`kvctl fleet ls` lists them"
            )
        wanted = set(nodes)
        chosen = [n for n in everything if n.name in wanted or n.dc in dcs]
    if not chosen:
        raise InventoryError(
            "no nodes to act on: the fleet has none there yet (`kvctl fleet add-node`)"
        )
    return chosen


def describe(nodes: Sequence[str] = (), dcs: Sequence[str] = (), all_nodes: bool = False) -> str:
    """The selection as the audit trail records it: ``all``, ``dc:a,dc:b``, ``node:x``."""
    if all_nodes:
        return "all"
    return ",".join([*(f"dc:{d}" for d in dcs), *(f"node:{n}" for n in nodes)])


def replay_targets(
    conn: Connection,
    *,
    nodes: Sequence[str] = (),
    dcs: Sequence[str] = (),
    all_nodes: bool = False,
) -> tuple[list[ReplayNode], dict[tuple[str, str], float]]:
    """Nodes to replay against (the whole fleet when nothing is named) and the length in km of
    every inventory link, for the replay's emulated link delays."""
    from kvctl.db.inventory import list_links
    from kvctl.workload.replay import ReplayNode

    everyone = not (nodes or dcs or all_nodes)
    chosen = resolve_targets(conn, nodes=nodes, dcs=dcs, all_nodes=all_nodes or everyone)
    links = {(link.a, link.b): link.distance_km for link in list_links(conn)}
    return [ReplayNode(n.name, n.dc, n.agent_url) for n in chosen], links
