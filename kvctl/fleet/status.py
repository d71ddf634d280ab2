"""The fleet at a glance: each node's agent asked live (up, hit ratio since its start, reuse vs
sharing, the hits each tier served split into reuse and sharing, tier occupancy, the share of
its engines' reads whose chunk was gone), last-seen from the collectors' history for nodes that
are down, and totals per DC."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from kvctl.db.inventory import NodeInfo
from kvctl.db.models import Node, NodeSample
from kvctl.db.sample_checks import UNREADABLE_TIER, checked_stats, known
from kvctl.fleet.fanout import NodeResult, fan_out, read_deadline_s
from kvctl.fleet.since_start import TIER_HIT_NAMES, TierHits, since_start
from kvctl.ratios import (
    HIT_COUNT_NAMES,
    HitCounts,
    read_figures,
    tier_figures,
)
from kvctl.wire.reports import AgentStats


@dataclass(slots=True)
class TierUse:
    used_bytes: int = 0
    capacity_bytes: int = 0

    @property
    def occupancy_ratio(self) -> float | None:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else None

    def add(self, other: TierUse) -> None:
        self.used_bytes += other.used_bytes
        self.capacity_bytes += other.capacity_bytes

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "occupancy_ratio": self.occupancy_ratio}


#: a tier that reported hits but no usage (the pool's and peers' counted tiers), or whose
#: usage was rejected: its occupancy figures are null
_NO_USE: dict[str, Any] = {"used_bytes": None, "capacity_bytes": None, "occupancy_ratio": None}


def tiers_as_dict(
    use: dict[str, TierUse], hits: dict[str, TierHits], whole: HitCounts
) -> dict[str, dict[str, Any]]:
    """Each tier's occupancy and the hits it served (reuse and sharing, per lookup of the
    whole), under the names of `kvctl status --window --json`'s ``tiers``."""
    names = [*use, *(t for t in hits if t not in use)]
    return {
        t: {
            **(use[t].as_dict() if t in use else _NO_USE),
            **(tier_figures(hits[t].over(whole)) if t in hits else {}),
        }
        for t in names
    }


@dataclass(slots=True)
class NodeStatus:
    node: str
    dc: str
    agent_url: str
    up: bool
    error: str | None = None
    #: up, but it refused the token (or needed one): its figures could not be read
    auth_refused: bool = False
    #: not up: it took the connection and said nothing within the timeout (hung, overloaded)
    silent: bool = False
    #: up, but still opening its tiers (it answered "starting"): no figures yet, and starting
    #: it again would only start it over
    starting: bool = False
    #: a count whose counter the agent answered impossible (NaN, negative, ...) is in its
    #: ``unknown``: None, as is every ratio over it, and never summed
    counts: HitCounts = field(default_factory=HitCounts)
    #: a tier whose used or capacity bytes were impossible is left out, as one not reported
    tiers: dict[str, TierUse] = field(default_factory=dict)
    uptime_s: float | None = None
    #: when the node last answered: now when up, else the collectors' last successful scrape
    last_seen_ms: int | None = None
    #: fields of its answer rejected as impossible (``stats.drops``: why), as `kvctl top` says
    rejected: dict[str, str] = field(default_factory=dict)
    #: the hits each tier served since its agent started (those of its tiers it reported)
    tier_hits: dict[str, TierHits] = field(default_factory=dict)
    #: chunks its engines' reads asked for since its agent started, and those not there; None
    #: where not reported (an agent older than the counts) or rejected as impossible
    read_chunks: int | None = None
    read_missing_chunks: int | None = None
    #: a tier of its answer could not be read (``UNREADABLE_TIER``): its hits are in none of
    #: ``tier_hits``
    tiers_unreadable: bool = False

    @property
    def reads_known(self) -> bool:
        """Whether its read counts were read and known."""
        return self.read and self.read_chunks is not None and self.read_missing_chunks is not None

    def read_figures(self) -> dict[str, float | None]:
        """The read counts and the share gone (``kvctl.ratios.read_figures``)."""
        if not self.reads_known:
            return read_figures(0, 0, 0)
        return read_figures(1, self.read_chunks or 0, self.read_missing_chunks or 0)

    @property
    def state(self) -> str:
        """ "up", "token refused" or "starting" (up, no figures), "not answering" (hung) or
        "down", as `kvctl top` says."""
        if self.auth_refused:
            return "token refused"
        if self.starting:
            return "starting"
        if self.up:
            return "up"
        return "not answering" if self.silent else "down"

    @property
    def read(self) -> bool:
        """Whether its figures were read: up, it let us, and it is serving."""
        return self.up and not self.auth_refused and not self.starting

    def figures(self) -> dict[str, float | None]:
        """Its counts and ratios under their JSON names, None where unread or unknown."""
        return figures_or_unknown(self.counts, self.read)

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "dc": self.dc,
            "agent_url": self.agent_url,
            "up": self.up,
            "auth_refused": self.auth_refused,
            "starting": self.starting,
            "state": self.state,
            "error": self.error,
            **self.figures(),
            **self.read_figures(),
            "tiers": tiers_as_dict(self.tiers, self.tier_hits, self.counts),
            "uptime_s": self.uptime_s,
            "last_seen_ms": self.last_seen_ms,
            "rejected": self.rejected,
        }


@dataclass(slots=True)
class DcStatus:
    dc: str
    nodes: int = 0
    up: int = 0
    #: the nodes summed into ``counts``: up, read, and none of their hit counts unknown
    counted: int = 0
    counts: HitCounts = field(default_factory=HitCounts)
    tiers: dict[str, TierUse] = field(default_factory=dict)
    #: the hits each tier served on the ``counted`` nodes (over their lookups); a tier one of
    #: them could not count is unknown for the DC, never short by that node
    tier_hits: dict[str, TierHits] = field(default_factory=dict)
    #: nodes whose read counts are known, and their sums
    read_nodes: int = 0
    read_chunks: int = 0
    read_missing_chunks: int = 0
    #: a counted node had a tier that could not be read: each tier's sum may be short by its
    #: hits (which tier is not always known: none read of too many, a name too long), so
    #: every tier's counts are unknown, never a split that does not add up to the hit ratio
    tiers_unreadable: bool = False

    def add(self, n: NodeStatus) -> None:
        self.nodes += 1
        if not n.up:
            return
        self.up += 1
        # as `kvctl top` sums: a node with one hit count unknown adds none of its four (never
        # hits of one set of nodes over lookups of another)
        if n.read and n.counts.known(*HIT_COUNT_NAMES):
            self.counted += 1
            self.counts.add_hits(n.counts)
            for name, t in n.tier_hits.items():
                self.tier_hits.setdefault(name, TierHits()).add(t)
            self.tiers_unreadable |= n.tiers_unreadable
        for name, t in n.tiers.items():
            self.tiers.setdefault(name, TierUse()).add(t)
        if n.reads_known:
            self.read_nodes += 1
            self.read_chunks += n.read_chunks or 0
            self.read_missing_chunks += n.read_missing_chunks or 0

    def read_figures(self) -> dict[str, float | None]:
        """The read counts of the nodes that reported them, and the share gone."""
        return read_figures(self.read_nodes, self.read_chunks, self.read_missing_chunks)

    def tier_hit_counts(self, tier: str) -> HitCounts:
        """The hits ``tier`` served on the counted nodes, over their lookups."""
        return self._tier_hits_of(self.tier_hits.get(tier, TierHits())).over(self.counts)

    def _tier_hits_of(self, t: TierHits) -> TierHits:
        return TierHits(unknown=frozenset(TIER_HIT_NAMES)) if self.tiers_unreadable else t

    def _tier_hits(self) -> dict[str, TierHits]:
        return {name: self._tier_hits_of(t) for name, t in self.tier_hits.items()}

    def figures(self) -> dict[str, float | None]:
        # no node's counts read and known: nothing counted, which is unknown, not zero lookups
        return figures_or_unknown(self.counts, self.counted > 0)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dc": self.dc,
            "nodes": self.nodes,
            "up": self.up,
            **self.figures(),
            **self.read_figures(),
            "tiers": tiers_as_dict(dict(self.tiers), self._tier_hits(), self.counts),
        }


def figures_or_unknown(counts: HitCounts, read: bool) -> dict[str, float | None]:
    """The counts and ratios under their JSON names; every one null when they were not read
    (a node down or refusing the token): 0 lookups would claim it was idle."""
    figures = counts.hit_figures()
    return figures if read else dict.fromkeys(figures)


@dataclass(slots=True)
class FleetStatus:
    ts_ms: int
    nodes: list[NodeStatus]
    dcs: list[DcStatus]
    total: DcStatus

    def as_dict(self) -> dict[str, Any]:
        return {
            "ts_ms": self.ts_ms,
            "nodes": [n.as_dict() for n in self.nodes],
            "dcs": [d.as_dict() for d in self.dcs],
            "total": self.total.as_dict(),
        }


def node_status(node: NodeInfo, stats: AgentStats, now_ms: int) -> NodeStatus:
    """A node's status from its agent's ``/v1/stats``, checked as the collectors and `kvctl
    top` check it (:mod:`kvctl.db.sample_checks`): a figure that cannot be true (NaN,
    Infinity, negative, ...) is unknown and listed in ``rejected``, the rest stands. Raises
    ValueError (not an agent's stats) without its ``stats`` or ``usage`` objects."""
    checked, rejected = checked_stats(stats)
    for part in ("stats", "usage"):  # without these, it is not an agent's answer at all
        if part in rejected.fields:
            raise ValueError(f"{part}: {rejected.fields[part]}")
    tiers: dict[str, TierUse] = {}
    for name, u in checked["usage"].items():
        used, capacity = known(u["used_bytes"]), known(u["capacity_bytes"])
        if name == UNREADABLE_TIER or used is None or capacity is None:
            continue
        tiers[name] = TierUse(int(used), int(capacity))
    since = since_start(checked)
    started_s = checked["started_s"]
    return NodeStatus(
        node.name,
        node.dc,
        node.agent_url,
        True,
        counts=since.counts,
        tiers=tiers,
        uptime_s=None if started_s is None else max(now_ms / 1000 - started_s, 0.0),
        last_seen_ms=now_ms,
        rejected=dict(rejected.fields) | since.impossible,
        tier_hits=since.tier_hits,
        read_chunks=since.read_chunks,
        read_missing_chunks=since.read_missing_chunks,
        tiers_unreadable=since.tiers_unreadable,
    )


def last_seen(conn: Connection, node_ids: Sequence[int]) -> dict[int, int]:
    """The collectors' last successful scrape of each node, where there is one."""
    if not node_ids:
        return {}
    # per node, its newest up sample by walking the (node_id, ts_ms) key backwards: a grouped
    # max over every up sample of the nodes read all of them (3.1 s on PostgreSQL for 250
    # down nodes of 1,000 with two days of samples, against 10 ms so), on every top poll
    newest = (
        select(NodeSample.ts_ms)
        .where(NodeSample.node_id == Node.id, NodeSample.up.is_(True))
        .order_by(NodeSample.ts_ms.desc())
        .limit(1)
        .correlate(Node)
        .scalar_subquery()
    )
    q = select(Node.id, newest).where(Node.id.in_(list(node_ids)))
    return {node_id: ts for node_id, ts in conn.execute(q) if ts is not None}


def fleet_status(
    conn: Connection,
    nodes: Sequence[NodeInfo],
    *,
    token: str | None = None,
    timeout_s: float = 3.0,
    on_result: Callable[[NodeResult[AgentStats]], None] | None = None,
    clock: Callable[[], float] = time.time,
) -> FleetStatus:
    """Ask every node's agent at once; a node that does not answer, or whose answer is not an
    agent's stats, is down (``silent`` when it took the connection and said nothing: not
    answering), never an error. One that refuses the token is up (``auth_refused``), as is
    one still opening its tiers (``starting``), without figures: it answered, and starting it
    again would not help."""
    results = fan_out(
        nodes,
        lambda c: c.stats(),
        token=token,
        timeout_s=timeout_s,
        on_result=on_result,
        deadline_s=read_deadline_s(timeout_s),
    )
    now_ms = int(clock() * 1000)
    answered: dict[int, NodeStatus] = {}
    errors: dict[int, str | None] = {}
    silent: set[int] = set()
    for r in results:
        if r.auth_refused or r.starting:  # it answered: up, with no figures to show
            answered[r.node.id] = NodeStatus(
                r.node.name,
                r.node.dc,
                r.node.agent_url,
                True,
                r.error,
                auth_refused=r.auth_refused,
                starting=r.starting,
                last_seen_ms=now_ms,
            )
            continue
        if r.silent:  # "cannot reach the agent ... is it running?" would send one to start it
            silent.add(r.node.id)
            errors[r.node.id] = (
                f"{r.node.agent_url} took the connection and said nothing for {timeout_s:g} s: "
                "hung or overloaded? Its log (agent.log in its data dir) says what it was doing"
            )
            if r.overdue:  # it said something, too slowly: its own error says so
                errors[r.node.id] = r.error
            continue
        if not r.ok or r.value is None:
            errors[r.node.id] = r.error
            continue
        try:
            answered[r.node.id] = node_status(r.node, r.value, now_ms)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            errors[r.node.id] = f"not an agent's stats ({type(exc).__name__}: {exc})"
    seen = last_seen(conn, list(errors))
    statuses = [
        answered.get(n.id)
        or NodeStatus(
            n.name,
            n.dc,
            n.agent_url,
            False,
            errors[n.id],
            silent=n.id in silent,
            last_seen_ms=seen.get(n.id),
        )
        for n in (r.node for r in results)
    ]
    by_dc: dict[str, DcStatus] = {}
    total = DcStatus("fleet")
    for s in statuses:
        by_dc.setdefault(s.dc, DcStatus(s.dc)).add(s)
        total.add(s)
    return FleetStatus(now_ms, statuses, [by_dc[k] for k in sorted(by_dc)], total)
