"""What the collectors recorded over a window, for `kvctl status --window` and `kvctl top
--json`: each node's measured counts (scrapes answered, hit ratio and its reuse/sharing split,
the chunks reads asked for and those not there, evictions, occupancy per tier, and the hits
each tier served split into reuse and sharing, over the whole's lookups, so the tiers' ratios
add up to the whole's) and their sums per DC and for the fleet. The same counts as the
dashboard's, so the same window gives the same figures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from kvctl.db.analytics.counts import Counts, measured_counts, total
from kvctl.db.analytics.inventory import has_figures
from kvctl.db.analytics.windows import Window
from kvctl.db.inventory import (
    NodeInfo,
    RemovedNodeInfo,
    list_dcs,
    removed_label,
    removed_nodes,
)


@dataclass(frozen=True, slots=True)
class Recorded:
    window: Window
    #: in the order asked for, then the removed nodes counted (``NodeInfo.removed``)
    nodes: list[tuple[NodeInfo, Counts]]
    #: per DC of those nodes, by name
    dcs: dict[str, Counts]
    fleet: Counts

    def as_dict(self, *, nodes: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"window": self.window.as_dict()}
        if nodes:
            out["nodes"] = [
                {"node": n.name, "dc": n.dc, "removed": n.removed, **figures(c)}
                for n, c in self.nodes
            ]
        out["dcs"] = [{"dc": name, **figures(c)} for name, c in self.dcs.items()]
        out["total"] = {"dc": "fleet", **figures(self.fleet)}
        return out


def figures(c: Counts) -> dict[str, Any]:
    """One recorded row as JSON."""
    tiers = {
        t: {
            "used_bytes": c.used_bytes.get(t),
            "capacity_bytes": c.capacity_bytes.get(t),
            "occupancy_ratio": c.occupancy_ratio(t),
            # the hits this tier served, split into reuse and sharing, per lookup of the whole
            **c.tier_figures(t),
        }
        for t in c.tiers
    }
    return {
        "nodes": c.nodes,
        "samples": c.samples,
        "up_samples": c.up_samples,
        "up_ratio": c.up_ratio,
        # up but unread (a refused token, starting): its counts of those scrapes are unknown
        "unread_samples": c.unread_samples,
        **c.hit_figures(),
        # of the chunks reads asked for, those gone (hits counted at lookup, evicted before
        # the read) or never looked up; null where no node reported reads
        **c.read_figures(),
        "evictions": c.evictions,
        "tiers": tiers,
        # per reason: nodes whose figure it names is unknown, left out (rows written by hand)
        "unknown_figures": c.unknown_figures,
    }


def recorded(
    conn: Connection,
    win: Window,
    nodes: Sequence[NodeInfo],
    removed: Sequence[RemovedNodeInfo] = (),
) -> Recorded:
    """``nodes``' recorded figures over ``win``, summed per DC and for all of them; and those
    of the ``removed`` nodes (:func:`removed_in`) that recorded any in it, after them, so a
    node's removal never changes a past window's totals."""
    counts = measured_counts(conn, win.start_ms, win.end_ms, [*nodes, *removed])
    listed = [*nodes, *(n for n in removed if has_figures(counts[n.id]))]
    # a removed DC's row is marked, as the dashboard's is
    current = {d.name for d in list_dcs(conn)} if removed else {n.dc for n in nodes}
    by_dc = {
        dc if dc in current else removed_label(dc): total(
            counts[n.id] for n in listed if n.dc == dc
        )
        for dc in sorted({n.dc for n in listed})
    }
    return Recorded(win, [(n, counts[n.id]) for n in listed], by_dc, total(by_dc.values()))


def removed_in(
    conn: Connection, win: Window, *, dcs: Sequence[str] = (), everyone: bool = False
) -> list[RemovedNodeInfo]:
    """The removed nodes whose samples may be in ``win`` that a report of ``everyone`` or of
    the DCs ``dcs`` counts (a report of named nodes counts none)."""
    if not (everyone or dcs):
        return []
    return removed_nodes(conn, since_ms=win.start_ms, dcs=None if everyone else dcs)
