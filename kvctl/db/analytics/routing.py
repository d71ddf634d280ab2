"""What the routers decided over a window (the collector's scrapes of `kvctl router serve`):
decisions, the share sent to a node already holding part of the prefix, index hits, tokens
fetched instead of prefilled, decisions per node, bytes pulled per DC link; and the latest
saved replayed comparison of routing policies.

The router's counts are measured (it counts every decision it makes); the tokens it fetches and
the bytes it pulls are its plans (what it told the chosen node to do), not bytes seen on a wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection

from kvctl.db.analytics.values import as_float, as_int
from kvctl.db.analytics.windows import Window, bucket_starts, bucketed_rows
from kvctl.db.models import SERIES_BY_TABLE
from kvctl.db.rollup import buckets, series, window
from kvctl.db.route_reports import SavedRouteReport, latest_saved_route_report
from kvctl.ratios import ratio

#: the router's own row in route_sample (node rows carry only decisions and to_holder)
ROUTER_ROW = ""
ROUTER_COUNTERS = tuple(c for c in SERIES_BY_TABLE["route_sample"].sums if c != "decision_s")


@dataclass(frozen=True, slots=True)
class NodeRouting:
    """Decisions that chose one node (summed over the routers)."""

    node: str
    decisions: int
    to_holder: int

    @property
    def not_to_holder(self) -> int:
        return self.decisions - self.to_holder

    @property
    def to_holder_share(self) -> float | None:
        return ratio(self.to_holder, self.decisions)


@dataclass(frozen=True, slots=True)
class LinkPulls:
    """Chunks the decisions pulled from holders in ``from_dc`` to chosen nodes in ``to_dc``."""

    from_dc: str
    to_dc: str
    pulled_chunks: int
    pulled_bytes: int


@dataclass(frozen=True, slots=True)
class RoutingSummary:
    start_ms: int
    end_ms: int
    #: the routers scraped in the window (redacted URLs)
    routers: tuple[str, ...] = ()
    #: scrapes of those routers in the window
    scrapes: int = 0
    decisions: int = 0
    #: decisions sent to a node already holding part of the prompt's prefix
    to_holder: int = 0
    #: requests no node could serve
    no_node: int = 0
    requested_chunks: int = 0
    #: chunks the fleet index placed on some node (index hits)
    indexed_chunks: int = 0
    local_chunks: int = 0
    pulled_chunks: int = 0
    pulled_bytes: int = 0
    tokens: int = 0
    #: prompt tokens the decisions fetch (locally or pulled) instead of prefilling
    fetched_tokens: int = 0
    recomputed_tokens: int = 0
    #: seconds the routers spent deciding, summed (measured in the routers)
    decision_s: float = 0.0
    nodes: tuple[NodeRouting, ...] = ()
    links: tuple[LinkPulls, ...] = ()
    report: SavedRouteReport | None = field(default=None, compare=False)

    @property
    def has_data(self) -> bool:
        return self.scrapes > 0

    @property
    def to_holder_share(self) -> float | None:
        """Decisions sent to a node already holding part of the prefix, per decision."""
        return ratio(self.to_holder, self.decisions)

    @property
    def index_hit_ratio(self) -> float | None:
        """Chunks the index placed on some node, per chunk of the routed prompts."""
        return ratio(self.indexed_chunks, self.requested_chunks)

    @property
    def fetched_token_share(self) -> float | None:
        """Prompt tokens fetched instead of prefilled, per routed token."""
        return ratio(self.fetched_tokens, self.tokens)

    @property
    def decision_mean_s(self) -> float | None:
        return ratio(self.decision_s, self.decisions)

    def as_dict(self) -> dict[str, Any]:
        return {
            "start_ms": self.start_ms,
            "end_ms": self.end_ms,
            "routers": list(self.routers),
            "scrapes": self.scrapes,
            **{c: getattr(self, c) for c in ROUTER_COUNTERS},
            "decision_s": self.decision_s,
            "to_holder_share": self.to_holder_share,
            "index_hit_ratio": self.index_hit_ratio,
            "fetched_token_share": self.fetched_token_share,
            "decision_mean_s": self.decision_mean_s,
            "nodes": [
                {"node": n.node, "decisions": n.decisions, "to_holder": n.to_holder}
                for n in self.nodes
            ],
            "links": [
                {
                    "from_dc": lk.from_dc,
                    "to_dc": lk.to_dc,
                    "pulled_chunks": lk.pulled_chunks,
                    "pulled_bytes": lk.pulled_bytes,
                }
                for lk in self.links
            ],
            "report": None
            if self.report is None
            else {"ts_ms": self.report.ts_ms, "report": self.report.report},
        }


def routing_summary(conn: Connection, start_ms: int, end_ms: int) -> RoutingSummary:
    """Every router's decisions over [start, end), summed, and the latest saved route report."""
    totals = dict.fromkeys(ROUTER_COUNTERS, 0)
    decision_s = 0.0
    scrapes = 0
    routers: set[str] = set()
    per_node: dict[str, list[int]] = {}
    for r in conn.execute(window(conn, series("route_sample"), start_ms, end_ms)):
        m = r._mapping
        if m["node"] == ROUTER_ROW:
            routers.add(m["router"])
            scrapes += as_int(m["samples"])
            for c in ROUTER_COUNTERS:
                totals[c] += as_int(m[c])
            decision_s += as_float(m["decision_s"])
        else:
            acc = per_node.setdefault(m["node"], [0, 0])
            acc[0] += as_int(m["decisions"])
            acc[1] += as_int(m["to_holder"])
    pulls: dict[tuple[str, str], list[int]] = {}
    for r in conn.execute(window(conn, series("route_link_sample"), start_ms, end_ms)):
        m = r._mapping
        acc = pulls.setdefault((m["from_dc"], m["to_dc"]), [0, 0])
        acc[0] += as_int(m["pulled_chunks"])
        acc[1] += as_int(m["pulled_bytes"])
    return RoutingSummary(
        start_ms=start_ms,
        end_ms=end_ms,
        routers=tuple(sorted(routers)),
        scrapes=scrapes,
        **totals,
        decision_s=decision_s,
        nodes=tuple(NodeRouting(n, d, h) for n, (d, h) in sorted(per_node.items())),
        links=tuple(LinkPulls(a, b, c, nb) for (a, b), (c, nb) in sorted(pulls.items())),
        report=latest_saved_route_report(conn),
    )


@dataclass(frozen=True, slots=True)
class PulledSeries:
    bucket_ms: list[int]
    #: (from_dc, to_dc) -> bytes pulled in each bucket; None: no sample of the link there
    pulled_bytes: dict[tuple[str, str], list[int | None]]


def pulled_series(conn: Connection, win: Window) -> PulledSeries:
    """Bytes the routers' decisions pulled per DC link, per bucket of the window."""
    starts = bucket_starts(win)
    out: dict[tuple[str, str], list[int | None]] = {}
    q = buckets(
        conn,
        series("route_link_sample"),
        win.start_ms,
        win.end_ms,
        win.step_ms,
        columns=["pulled_bytes"],
    )
    for i, m in bucketed_rows(conn, q, starts):
        values = out.setdefault((m["from_dc"], m["to_dc"]), [None] * len(starts))
        values[i] = (values[i] or 0) + as_int(m["pulled_bytes"])
    return PulledSeries(starts, dict(sorted(out.items())))
