"""What the collectors recorded over a window, for `kvctl status --window` and `kvctl top
--json`: each node's measured counts (scrapes answered, hit ratio and its reuse/sharing split,
evictions, occupancy per tier) and their sums per DC and for the fleet. The same counts as the
dashboard's, so the same window gives the same figures."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from kvctl.db.analytics.counts import Counts, measured_counts, total
from kvctl.db.analytics.windows import Window
from kvctl.db.inventory import NodeInfo


@dataclass(frozen=True, slots=True)
class Recorded:
    window: Window
    #: in the order asked for
    nodes: list[tuple[NodeInfo, Counts]]
    #: per DC of those nodes, by name
    dcs: dict[str, Counts]
    fleet: Counts

    def as_dict(self, *, nodes: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"window": self.window.as_dict()}
        if nodes:
            out["nodes"] = [{"node": n.name, "dc": n.dc, **figures(c)} for n, c in self.nodes]
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
        "evictions": c.evictions,
        "tiers": tiers,
    }


def recorded(conn: Connection, win: Window, nodes: Sequence[NodeInfo]) -> Recorded:
    """``nodes``' recorded figures over ``win``, summed per DC and for all of them."""
    counts = measured_counts(conn, win.start_ms, win.end_ms, nodes)
    by_dc = {
        dc: total(counts[n.id] for n in nodes if n.dc == dc) for dc in sorted({n.dc for n in nodes})
    }
    return Recorded(win, [(n, counts[n.id]) for n in nodes], by_dc, total(by_dc.values()))
