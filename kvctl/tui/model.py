"""What `kvctl top` shows, as plain data: agents' cumulative counters turned into recent rates
and ratios per node and per DC, history for sparklines, sorting, filtering and grouping.

No Textual here (a layering test checks it): the view model is what `kvctl top --json` prints,
and what the tests check figure by figure.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

from kvctl.counters import CounterTracker
from kvctl.db.inventory import NodeInfo
from kvctl.db.sample_checks import (
    UNREADABLE_TIER,
    USAGE_GAUGES,
    Rejections,
    checked_stats,
    count,
    known,
)
from kvctl.fleet.since_start import SinceStart, since_start
from kvctl.ratios import HitCounts, ratio, read_figures, tier_figures
from kvctl.wire.stats import cache_counters

_V = TypeVar("_V")

#: polls kept per node: the sparklines' width and the occupancy history's length
HISTORY_POLLS = 60
#: hit ratios and rates are over this many polls (30 s at the default 2 s interval)
WINDOW_POLLS = 15


# --- what a poll brings back -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GpuPower:
    """A node's GPUs at one poll: total board power, or why there is none."""

    power_w: float | None
    gpus: int
    note: str | None = None
    #: readings' fields rejected as impossible (``gpus[0].power_w``: why), read as missing
    rejected: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Reading:
    """One node's answer to one poll (``stats`` is the agent's ``/v1/stats``)."""

    node: NodeInfo
    stats: Mapping[str, Any] | None
    error: str | None = None
    elapsed_s: float = 0.0
    #: None when GPUs were not asked this poll (they are asked less often than stats)
    gpu: GpuPower | None = None
    #: for a node that did not answer: the collectors' last successful scrape of it (epoch
    #: seconds), where the source has a database and they reached it once
    last_seen_s: float | None = None
    #: it answered, refusing the token (or asking for one): up, its figures not ours to read
    auth_refused: bool = False
    #: it answered "starting" (still opening its tiers): up, with no figures yet
    starting: bool = False
    #: it took the connection (or is still being asked) and said nothing: hung or overloaded,
    #: not down
    silent: bool = False
    #: when the answer was read (epoch seconds), where not at the poll's own time: an answer
    #: that came back after an earlier poll's deadline
    read_at_s: float | None = None
    #: the agent's ``/v1/info``, when the source asked for it with the stats
    info: Mapping[str, Any] | None = None

    @property
    def up(self) -> bool:
        return self.stats is not None


@dataclass(frozen=True, slots=True)
class Poll:
    ts_s: float
    readings: list[Reading]
    #: RTT (s) per DC pair, both orders; None when the source has no link probes (direct agents)
    rtt_s: Mapping[tuple[str, str], float | None] | None = None
    elapsed_s: float = 0.0
    #: the router's answer; None when no router is watched (the view shows no routing)
    router: RouterReading | None = None
    #: per DC pair (both orders), what the RTT is made of: "measured", "emulated" (every probe
    #: included an agent-emulated delay) or "mixed" (some did); None without link probes
    rtt_basis: Mapping[tuple[str, str], str] | None = None
    #: the fleet database failed this poll: the inventory and RTTs are as last read (the
    #: agents were asked all the same)
    db_error: str | None = None


@dataclass(frozen=True, slots=True)
class RouterReading:
    """The router's ``/v1/stats`` (its counts since it started) at one poll, or why there is
    none."""

    url: str
    stats: Mapping[str, Any] | None
    error: str | None = None
    #: when it was read (epoch seconds), where not at the poll's own time
    read_at_s: float | None = None


# --- thresholds --------------------------------------------------------------------------------
class Level(Enum):
    NONE = "none"
    GOOD = "good"
    WARN = "warn"
    CRIT = "crit"


@dataclass(frozen=True, slots=True)
class Thresholds:
    occupancy_warn_ratio: float = 0.85
    occupancy_crit_ratio: float = 0.95
    #: hit ratios at or above this are good; below the low mark they warn
    hit_good_ratio: float = 0.5
    hit_low_ratio: float = 0.1
    rtt_warn_s: float = 0.002
    rtt_crit_s: float = 0.005

    def occupancy(self, ratio: float | None) -> Level:
        if ratio is None:
            return Level.NONE
        if ratio >= self.occupancy_crit_ratio:
            return Level.CRIT
        return Level.WARN if ratio >= self.occupancy_warn_ratio else Level.NONE

    def hit(self, ratio: float | None) -> Level:
        if ratio is None:
            return Level.NONE
        if ratio >= self.hit_good_ratio:
            return Level.GOOD
        return Level.WARN if ratio < self.hit_low_ratio else Level.NONE

    def rtt(self, rtt_s: float | None) -> Level:
        if rtt_s is None:
            return Level.NONE
        if rtt_s >= self.rtt_crit_s:
            return Level.CRIT
        return Level.WARN if rtt_s >= self.rtt_warn_s else Level.GOOD


# --- the view ----------------------------------------------------------------------------------
@dataclass(slots=True)
class TierGauge:
    used_bytes: int = 0
    capacity_bytes: int = 0
    pinned_bytes: int = 0
    chunks: int = 0
    evictions_per_s: float | None = None

    @property
    def occupancy_ratio(self) -> float | None:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else None

    def add(self, other: TierGauge) -> None:
        self.used_bytes += other.used_bytes
        self.capacity_bytes += other.capacity_bytes
        self.pinned_bytes += other.pinned_bytes
        self.chunks += other.chunks
        if other.evictions_per_s is not None:
            self.evictions_per_s = (self.evictions_per_s or 0.0) + other.evictions_per_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "used_bytes": self.used_bytes,
            "capacity_bytes": self.capacity_bytes,
            "pinned_bytes": self.pinned_bytes,
            "chunks": self.chunks,
            "occupancy_ratio": self.occupancy_ratio,
            "evictions_per_s": self.evictions_per_s,
        }


@dataclass(slots=True)
class WindowCounts(HitCounts):
    """Counter increases over the recent window (lookups and hits are :class:`HitCounts`', with
    its ``unknown``: a count whose counter was rejected from this poll's answer is N/A, and so
    is every figure taken over it) and the seconds it spans."""

    seconds: float = 0.0
    evictions: float = 0.0
    io_bytes: float = 0.0

    @property
    def hit_known(self) -> bool:
        return self.known("lookups", "hits")

    def rate(self, value: float) -> float | None:
        return value / self.seconds if self.seconds > 0 else None

    @property
    def evictions_per_s(self) -> float | None:
        return self.rate(self.evictions) if self.known("evictions") else None

    @property
    def io_bytes_per_s(self) -> float | None:
        return self.rate(self.io_bytes) if self.known("io_bytes") else None

    @property
    def lookups_per_s(self) -> float | None:
        return self.rate(self.lookups) if self.known("lookups") else None

    def add(self, other: WindowCounts) -> None:
        """Add ``other``'s known counts (see :attr:`summed_unknown`)."""
        self.add_hits(other)
        if other.known("evictions"):
            self.evictions += other.evictions
        if other.known("io_bytes"):
            self.io_bytes += other.io_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "window_seconds": self.seconds,
            **self.hit_figures(),
            "lookups_per_s": self.lookups_per_s,
            "evictions_per_s": self.evictions_per_s,
            "io_bytes_per_s": self.io_bytes_per_s,
        }

    def figures(self, read: bool) -> dict[str, Any]:
        """``as_dict``, or every figure None where no counts were read (a node down, refusing
        the token or starting, a DC with none read): unknown, as `kvctl status --json` says,
        not 0 lookups."""
        figures = self.as_dict()
        return figures if read else dict.fromkeys(figures)


@dataclass(slots=True)
class NodeRow:
    node: NodeInfo
    #: it answered with its figures
    up: bool
    error: str | None = None
    #: it answered but refused the token: up, without figures
    auth_refused: bool = False
    #: it answered "starting" (opening its tiers): up, without figures yet; not one to restart
    starting: bool = False
    #: it took the connection and said nothing (hung, overloaded), or is still being asked
    silent: bool = False
    #: seconds since the node was last seen up, by the collectors or by this view (None while
    #: up); with neither, since this view's first poll that found it down (a lower bound)
    down_for_s: float | None = None
    #: when the node last answered (ms since the epoch): this poll while up; while down, the
    #: later of the collectors' last successful scrape and this view's last answer, or None
    last_seen_ms: int | None = None
    recent: WindowCounts = field(default_factory=WindowCounts)
    #: hit ratio since the agent started (its own counters)
    lifetime_hit_ratio: float | None = None
    uptime_s: float | None = None
    tiers: dict[str, TierGauge] = field(default_factory=dict)
    #: hit ratio of each poll, oldest first (None: no lookups in that poll)
    hit_history: list[float | None] = field(default_factory=list)
    #: per tier: occupancy ratio at each poll, oldest first
    occupancy_history: dict[str, list[float | None]] = field(default_factory=dict)
    #: RTT to each other DC (collectors' probes over the last 15 minutes)
    rtt_s: dict[str, float | None] = field(default_factory=dict)
    #: each of those RTTs' basis: "measured", "emulated" or "mixed" (see :class:`Poll`)
    rtt_basis: dict[str, str] = field(default_factory=dict)
    gpu: GpuPower | None = None
    #: the router's decisions for this node; None without a router, while it is down, or for
    #: a node the router does not route to
    routing: NodeRouting | None = None
    #: fields of its answers (stats and GPUs) rejected as impossible (``stats.drops``: why):
    #: N/A, as is every figure taken over them
    rejected: dict[str, str] = field(default_factory=dict)
    #: its counts since its agent started, as `kvctl status` shows them (the hits each tier
    #: served, its engines' reads); None while its figures are not read
    since_start: SinceStart | None = None

    @property
    def name(self) -> str:
        return self.node.name

    def read_figures(self) -> dict[str, float | None]:
        """Its engines' reads since its agent started and the share gone, as `kvctl status
        --json` names them; null while not read, or not reported."""
        since = self.since_start
        return read_figures(0, 0, 0) if since is None else since.read_figures()

    def tiers_as_dict(self) -> dict[str, dict[str, Any]]:
        """Each tier's gauges and, since its agent started, the hits it served split into reuse
        and sharing per lookup of the node (a tier with hits but no gauges, the pool's or the
        peers', or gauges rejected: gauges null)."""
        since = self.since_start
        counted = {} if since is None else since.tier_hits
        names = [*self.tiers, *(t for t in tier_order(counted) if t not in self.tiers)]
        out: dict[str, dict[str, Any]] = {}
        for t in names:
            gauge = self.tiers.get(t)
            out[t] = gauge.as_dict() if gauge is not None else dict.fromkeys(_GAUGE_NAMES)
            if since is not None and t in counted:
                out[t] |= tier_figures(since.tier_hit_counts(t))
        return out

    @property
    def dc(self) -> str:
        return self.node.dc

    @property
    def answered(self) -> bool:
        """It answered this poll: with its figures, refusing the token, or starting."""
        return self.up or self.auth_refused or self.starting

    @property
    def state(self) -> str:
        """ "up", "token refused" or "starting" (up, no figures), "not answering" (hung) or
        "down"."""
        if self.up:
            return "up"
        if self.auth_refused:
            return "token refused"
        if self.starting:
            return "starting"
        return "not answering" if self.silent else "down"

    @property
    def worst_link(self) -> tuple[str, float] | None:
        """The other DC with the slowest measured RTT, and that RTT."""
        known = [(dc, v) for dc, v in self.rtt_s.items() if v is not None]
        return max(known, key=lambda p: p[1]) if known else None

    @property
    def max_rtt_s(self) -> float | None:
        worst = self.worst_link
        return None if worst is None else worst[1]

    @property
    def worst_link_basis(self) -> str | None:
        """What the slowest link's RTT is made of (None: no RTT)."""
        worst = self.worst_link
        return None if worst is None else self.rtt_basis.get(worst[0], "measured")

    def as_dict(self) -> dict[str, Any]:
        return {
            "node": self.name,
            "dc": self.dc,
            "agent_url": self.node.agent_url,
            # as `kvctl status --json`: a node refusing the token is up, auth_refused; one
            # opening its tiers is up, starting
            "up": self.answered,
            "auth_refused": self.auth_refused,
            "starting": self.starting,
            "state": self.state,
            "error": self.error,
            "down_for_s": self.down_for_s,
            "last_seen_ms": self.last_seen_ms,
            # a down (refusing, starting) node's counts were not read
            **self.recent.figures(self.up),
            "lifetime_hit_ratio": self.lifetime_hit_ratio,
            # since its agent started, as lifetime_hit_ratio (`kvctl status --json`'s names)
            **self.read_figures(),
            "uptime_s": self.uptime_s,
            "tiers": self.tiers_as_dict(),
            "rtt_s": self.rtt_s,
            "rtt_basis": self.rtt_basis,
            "gpu_power_w": None if self.gpu is None else self.gpu.power_w,
            "gpu_note": None if self.gpu is None else self.gpu.note,
            "routing": None if self.routing is None else self.routing.as_dict(),
            "rejected": self.rejected,
        }


@dataclass(slots=True)
class DcRow:
    dc: str
    nodes: int = 0
    #: nodes that answered: with their figures, refusing the token (``refused``) or starting
    #: (``starting``), the last two without figures
    up: int = 0
    refused: int = 0
    starting: int = 0
    #: counts summed over nodes, for ratios; rates are the nodes' rates summed (their windows
    #: differ: a node back from down has a shorter one)
    recent: WindowCounts = field(default_factory=WindowCounts)
    lookups_per_s: float | None = None
    evictions_per_s: float | None = None
    io_bytes_per_s: float | None = None
    tiers: dict[str, TierGauge] = field(default_factory=dict)
    power_w: float | None = None
    #: the router's decisions for the DC's nodes, summed (None: none of them is routed to)
    routing: NodeRouting | None = None
    #: the nodes whose engines' reads since their agents started are known, and their sums
    read_nodes: int = 0
    read_chunks: int = 0
    read_missing_chunks: int = 0

    def add(self, row: NodeRow) -> None:
        self.nodes += 1
        reads = row.read_figures() if row.up else read_figures(0, 0, 0)
        if reads["read_chunks"] is not None:
            self.read_nodes += 1
            self.read_chunks += int(reads["read_chunks"])
            self.read_missing_chunks += int(reads["read_missing_chunks"] or 0)
        if row.routing is not None:  # the router's figures stand whether the agent answers
            if self.routing is None:
                self.routing = NodeRouting()
            self.routing.add(row.routing)
        if row.auth_refused or row.starting:  # up, as `kvctl status` counts it, no figures
            self.up += 1
            self.refused += int(row.auth_refused)
            self.starting += int(row.starting)
        if not row.up:
            return
        self.up += 1
        self.recent.seconds = max(self.recent.seconds, row.recent.seconds)
        # a count is unknown for the DC only where no node with figures knows it
        unknown = row.recent.summed_unknown
        first = self.read == 1
        self.recent.unknown = unknown if first else self.recent.unknown & unknown
        self.recent.add(row.recent)
        self.lookups_per_s = _plus(self.lookups_per_s, row.recent.lookups_per_s)
        self.evictions_per_s = _plus(self.evictions_per_s, row.recent.evictions_per_s)
        self.io_bytes_per_s = _plus(self.io_bytes_per_s, row.recent.io_bytes_per_s)
        for name, t in row.tiers.items():
            self.tiers.setdefault(name, TierGauge()).add(t)
        if row.gpu is not None and row.gpu.power_w is not None:
            self.power_w = (self.power_w or 0.0) + row.gpu.power_w

    @property
    def read(self) -> int:
        """The nodes whose figures were read: up, neither refusing the token nor starting."""
        return self.up - self.refused - self.starting

    def as_dict(self) -> dict[str, Any]:
        return {
            "dc": self.dc,
            "nodes": self.nodes,
            "up": self.up,
            "auth_refused": self.refused,
            "starting": self.starting,
            # no node's figures read: nothing counted
            **self.recent.figures(self.read > 0),
            "lookups_per_s": self.lookups_per_s,
            "evictions_per_s": self.evictions_per_s,
            "io_bytes_per_s": self.io_bytes_per_s,
            # since the agents started: `kvctl status --json`'s
            **read_figures(self.read_nodes, self.read_chunks, self.read_missing_chunks),
            "tiers": {k: t.as_dict() for k, t in self.tiers.items()},
            "gpu_power_w": self.power_w,
            "routing": None if self.routing is None else self.routing.as_dict(),
        }


def _plus(a: float | None, b: float | None) -> float | None:
    if b is None:
        return a
    return b if a is None else a + b


# --- the router's decisions --------------------------------------------------------------------
#: the router's fleet-wide counters (``/v1/stats``) that the view reads, all since it started
ROUTER_COUNTERS = (
    "decisions",
    "to_holder",
    "requested_chunks",
    "indexed_chunks",
    "local_chunks",
    "pulled_chunks",
    "pulled_bytes",
    "tokens",
    "fetched_tokens",
    "recomputed_tokens",
)


@dataclass(slots=True)
class RoutedCounts:
    """The router's decisions and what they reuse: since the router started (``seconds`` 0), or
    the increases over the recent window and the seconds it spans."""

    seconds: float = 0.0
    decisions: float = 0
    #: decisions sent to a node that held part of the prefix in its own tiers
    to_holder: float = 0
    requested_chunks: float = 0
    #: requested chunks the fleet index placed on some node (the tenant may see)
    indexed_chunks: float = 0
    #: chunks the chosen node reads from its own tiers / pulls from another node
    local_chunks: float = 0
    pulled_chunks: float = 0
    pulled_bytes: float = 0
    tokens: float = 0
    fetched_tokens: float = 0
    recomputed_tokens: float = 0

    @property
    def index_hit_ratio(self) -> float | None:
        """Requested chunks the index found somewhere in the fleet."""
        return ratio(self.indexed_chunks, self.requested_chunks)

    @property
    def reused_ratio(self) -> float | None:
        """Requested chunks the chosen node reuses (its own or pulled) instead of prefilling."""
        return ratio(self.local_chunks + self.pulled_chunks, self.requested_chunks)

    @property
    def to_holder_share(self) -> float | None:
        """Decisions sent to a node already holding (part of) the prefix."""
        return ratio(self.to_holder, self.decisions)

    @property
    def token_hit_ratio(self) -> float | None:
        """Prompt tokens fetched rather than prefilled (the bench's name for it)."""
        return ratio(self.fetched_tokens, self.tokens)

    def rate_of(self, value: float) -> float | None:
        """``value`` per second of the window; None for counts since the router started."""
        return value / self.seconds if self.seconds > 0 else None

    @property
    def decisions_per_s(self) -> float | None:
        return self.rate_of(self.decisions)

    def add(self, other: RoutedCounts) -> None:
        for name in ROUTER_COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, Any]:
        return {
            **({"window_seconds": self.seconds} if self.seconds else {}),
            **{name: getattr(self, name) for name in ROUTER_COUNTERS},
            "index_hit_ratio": self.index_hit_ratio,
            "reused_ratio": self.reused_ratio,
            "to_holder_share": self.to_holder_share,
            "token_hit_ratio": self.token_hit_ratio,
            **({"decisions_per_s": self.decisions_per_s} if self.seconds else {}),
        }


@dataclass(slots=True)
class NodeRouting:
    """One node's part of the router's decisions: since the router started, and the increases
    over the recent window (``seconds`` 0: no window yet)."""

    decisions: float = 0
    to_holder: float = 0
    recent_decisions: float = 0.0
    recent_to_holder: float = 0.0
    seconds: float = 0.0

    @property
    def decisions_per_s(self) -> float | None:
        return self.recent_decisions / self.seconds if self.seconds > 0 else None

    @property
    def to_holder_share(self) -> float | None:
        """Of the recent window's decisions for this node, those it held the prefix for."""
        return ratio(self.recent_to_holder, self.recent_decisions)

    @property
    def lifetime_to_holder_share(self) -> float | None:
        return ratio(self.to_holder, self.decisions)

    def add(self, other: NodeRouting) -> None:
        self.decisions += other.decisions
        self.to_holder += other.to_holder
        self.recent_decisions += other.recent_decisions
        self.recent_to_holder += other.recent_to_holder
        self.seconds = max(self.seconds, other.seconds)

    def as_dict(self) -> dict[str, Any]:
        return {
            "decisions": self.decisions,
            "to_holder": self.to_holder,
            "to_holder_share": self.lifetime_to_holder_share,
            "recent": {
                "window_seconds": self.seconds,
                "decisions": self.recent_decisions,
                "to_holder": self.recent_to_holder,
                "to_holder_share": self.to_holder_share,
                "decisions_per_s": self.decisions_per_s,
            },
        }


@dataclass(slots=True)
class LinkPulls:
    """Chunks the router's decisions pull across one DC link (``from_dc`` holds them), since it
    started; ``bytes_per_s`` over the recent window (None: no window yet)."""

    from_dc: str
    to_dc: str
    chunks: float = 0
    pulled_bytes: float = 0
    bytes_per_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "from_dc": self.from_dc,
            "to_dc": self.to_dc,
            "chunks": self.chunks,
            "pulled_bytes": self.pulled_bytes,
            "recent_bytes_per_s": self.bytes_per_s,
        }


@dataclass(slots=True)
class RoutingView:
    """What the router says at this poll; when it did not answer, ``error`` says why and there
    are no figures (N/A, not zero)."""

    url: str
    up: bool
    error: str | None = None
    #: counts since the router started
    total: RoutedCounts = field(default_factory=RoutedCounts)
    #: increases over the recent window (``seconds`` 0 until two polls)
    recent: RoutedCounts = field(default_factory=RoutedCounts)
    nodes: dict[str, NodeRouting] = field(default_factory=dict)
    links: list[LinkPulls] = field(default_factory=list)
    #: requests no node could serve, since the router started
    no_node: float = 0

    def as_dict(self) -> dict[str, Any]:
        if not self.up:
            return {"router": self.url, "up": False, "error": self.error}
        return {
            "router": self.url,
            "up": True,
            "error": None,
            "since_router_start": {**self.total.as_dict(), "no_node": self.no_node},
            "recent": self.recent.as_dict() if self.recent.seconds else None,
            "nodes": {k: v.as_dict() for k, v in self.nodes.items()},
            "links": [link.as_dict() for link in self.links],
        }


@dataclass(slots=True)
class FleetView:
    ts_s: float
    rows: list[NodeRow]
    dcs: list[DcRow]
    total: DcRow
    #: tiers any node has, in the store's order (fastest first)
    tiers: list[str]
    poll_s: float
    polls: int
    #: whether link RTTs are known at all (the database's probes)
    has_links: bool
    #: the router's figures; None when no router is watched
    routing: RoutingView | None = None
    #: see :attr:`Poll.db_error`
    db_error: str | None = None

    def row(self, name: str) -> NodeRow | None:
        return next((r for r in self.rows if r.name == name), None)

    def as_dict(self) -> dict[str, Any]:
        return {
            # milliseconds since the epoch, an int: the name and unit of `kvctl status --json`
            # and `kvctl collect --json`, so one parser reads all three
            "ts_ms": round(self.ts_s * 1000),
            "poll_seconds": self.poll_s,
            "polls": self.polls,
            "nodes": [r.as_dict() for r in self.rows],
            "dcs": [d.as_dict() for d in self.dcs],
            "total": self.total.as_dict(),
            "routing": None if self.routing is None else self.routing.as_dict(),
            "database_error": self.db_error,
        }


TIER_ORDER = ("gpu", "cpu", "disk", "remote", "peer")
#: a tier's gauges by their JSON names (``TierGauge.as_dict``)
_GAUGE_NAMES = (*USAGE_GAUGES, "occupancy_ratio", "evictions_per_s")


def tier_order(names: Iterable[str]) -> list[str]:
    rank = {n: i for i, n in enumerate(TIER_ORDER)}
    return sorted(set(names), key=lambda n: (rank.get(n, len(rank)), n))


# --- counters in, view out ---------------------------------------------------------------------
@dataclass(slots=True)
class _Step:
    """One poll's increases for one node."""

    seconds: float
    counts: WindowCounts
    tier_evictions: dict[str, float]
    #: the counts with no increase this step: their counter unknown at this poll (counted at
    #: the next that reads it), or read for the first time
    unknown: frozenset[str] = frozenset()


@dataclass(slots=True)
class _NodeState:
    steps: deque[_Step] = field(default_factory=lambda: deque(maxlen=WINDOW_POLLS))
    hit_history: deque[float | None] = field(default_factory=lambda: deque(maxlen=HISTORY_POLLS))
    occupancy: dict[str, deque[float | None]] = field(default_factory=dict)
    last_ts_s: float | None = None
    down_since_s: float | None = None
    #: the last poll at which the node answered
    last_up_s: float | None = None
    gpu: GpuPower | None = None


class Sampler:
    """Turns successive polls into a :class:`FleetView`. Counters become increases with the
    collectors' own tracker, so an agent restart starts its counts from zero instead of showing
    a negative rate. One poll at a time: the app feeds it from a single worker."""

    def __init__(self, *, window_polls: int = WINDOW_POLLS, max_gap_s: float | None = None) -> None:
        self._tracker = CounterTracker()
        self._state: dict[str, _NodeState] = {}
        self._window_polls = window_polls
        #: a step longer than this (a node back from down, a paused view) restarts the window,
        #: so "recent" never averages over a gap
        self._max_gap_s = max_gap_s
        self.polls = 0
        self._router_last: _RouterSample | None = None
        self._router_ts_s: float | None = None
        self._router_steps: deque[_RouterStep] = deque(maxlen=window_polls)

    def update(self, poll: Poll) -> FleetView:
        self.polls += 1
        rows = [self._safe_row(r, poll) for r in poll.readings]
        router = poll.router
        routing = None if router is None else self._routing(router, router.read_at_s or poll.ts_s)
        if routing is not None and routing.up:
            for row in rows:
                row.routing = routing.nodes.get(row.name)
        seen = {r.node.name for r in poll.readings}
        for gone in set(self._state) - seen:  # removed from the inventory
            del self._state[gone]
        by_dc: dict[str, DcRow] = {}
        total = DcRow("fleet")
        for row in rows:
            by_dc.setdefault(row.dc, DcRow(row.dc)).add(row)
            total.add(row)
        tiers = tier_order(t for r in rows for t in r.tiers)
        return FleetView(
            ts_s=poll.ts_s,
            rows=rows,
            dcs=[by_dc[k] for k in sorted(by_dc)],
            total=total,
            tiers=tiers,
            poll_s=poll.elapsed_s,
            polls=self.polls,
            has_links=poll.rtt_s is not None,
            routing=routing,
            db_error=poll.db_error,
        )

    def _routing(self, reading: RouterReading, ts_s: float) -> RoutingView:
        """The router's counts since it started, and their increases over the recent window
        (the same window and gap rule as the agents')."""
        if reading.stats is None:
            return RoutingView(reading.url, False, reading.error or "no answer")
        try:
            sample = _router_sample(reading.stats)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            why = f"not a router's stats ({type(exc).__name__}: {exc})"
            return RoutingView(reading.url, False, why)
        last, last_ts_s = self._router_last, self._router_ts_s
        self._router_last, self._router_ts_s = sample, ts_s
        if last is not None and last_ts_s is not None and ts_s > last_ts_s:
            seconds = ts_s - last_ts_s
            if self._max_gap_s is not None and seconds > self._max_gap_s:
                self._router_steps.clear()
            else:
                self._router_steps.append(_router_step(last, sample, seconds))
        recent = RoutedCounts()
        node_inc: dict[str, tuple[float, float]] = {}
        link_inc: dict[tuple[str, str], float] = {}
        for step in self._router_steps:
            recent.seconds += step.counts.seconds
            recent.add(step.counts)
            for name, (d, h) in step.nodes.items():
                d0, h0 = node_inc.get(name, (0.0, 0.0))
                node_inc[name] = (d0 + d, h0 + h)
            for pair, nbytes in step.link_bytes.items():
                link_inc[pair] = link_inc.get(pair, 0.0) + nbytes
        nodes = {}
        for name, (d, h) in sample.nodes.items():
            recent_d, recent_h = node_inc.get(name, (0.0, 0.0))
            nodes[name] = NodeRouting(d, h, recent_d, recent_h, recent.seconds)
        links = [
            LinkPulls(a, b, chunks, nbytes, recent.rate_of(link_inc.get((a, b), 0.0)))
            for (a, b), (chunks, nbytes) in sorted(sample.links.items())
        ]
        return RoutingView(
            reading.url,
            True,
            total=RoutedCounts(**sample.totals),
            recent=recent,
            nodes=nodes,
            links=links,
            no_node=sample.no_node,
        )

    def _safe_row(self, reading: Reading, poll: Poll) -> NodeRow:
        """One node's row; an answer that is not an agent's stats marks that node down."""
        try:
            return self._row(reading, poll)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            why = f"not an agent's stats ({type(exc).__name__}: {exc})"
            return self._row(Reading(reading.node, None, why), poll)

    def _row(self, reading: Reading, poll: Poll) -> NodeRow:
        node = reading.node
        state = self._state.setdefault(
            node.name, _NodeState(steps=deque(maxlen=self._window_polls))
        )
        if reading.gpu is not None:
            state.gpu = reading.gpu
        rtt = _rtt_from(node.dc, poll.rtt_s)
        rtt_basis = _rtt_from(node.dc, poll.rtt_basis)
        if reading.auth_refused or reading.starting:
            return self._unread_row(reading, poll, state, rtt, rtt_basis)
        if reading.stats is None:
            if state.down_since_s is None:
                state.down_since_s = poll.ts_s
            # down since it was last seen up (what `kvctl status` says), not since this view
            # started: the collectors may have reached it long before top was opened
            seen = [t for t in (reading.last_seen_s, state.last_up_s) if t is not None]
            last_seen_s = max(seen) if seen else None
            since_s = state.down_since_s if last_seen_s is None else last_seen_s
            state.hit_history.append(None)
            for hist in state.occupancy.values():
                hist.append(None)
            return NodeRow(
                node,
                False,
                reading.error,
                silent=reading.silent,
                down_for_s=max(poll.ts_s - since_s, 0.0),
                last_seen_ms=None if last_seen_s is None else round(last_seen_s * 1000),
                hit_history=list(state.hit_history),
                occupancy_history={k: list(v) for k, v in state.occupancy.items()},
                rtt_s=rtt,
                rtt_basis=rtt_basis,
                gpu=state.gpu,
            )
        state.down_since_s = None
        # an answer that came back after an earlier poll's deadline counts at its own time
        at_s = poll.ts_s if reading.read_at_s is None else reading.read_at_s
        state.last_up_s = at_s
        # the collectors' checks: a figure that cannot be true (NaN, negative, ...) is UNKNOWN
        # here, N/A on screen, and the rest of the answer stands
        stats, rejected = checked_stats(reading.stats)
        for part in ("stats", "usage"):  # without these, it is not an agent's answer at all
            if part in rejected.fields:
                raise ValueError(f"{part}: {rejected.fields[part]}")
        counters = {
            tier: {k: known(v) for k, v in raw.items()}
            for tier, raw in cache_counters(stats).items()
            if tier != UNREADABLE_TIER
        }
        step = self._step(node.name, counters, stats.get("started_s"), at_s, state)
        if step is not None and self._max_gap_s is not None and step.seconds > self._max_gap_s:
            state.steps.clear()
            step = None
        if step is not None:
            state.steps.append(step)
        hit_unknown = step is None or not step.unknown.isdisjoint(("lookups", "hits"))
        state.hit_history.append(None if hit_unknown or step is None else step.counts.hit_ratio)
        recent = WindowCounts()
        tier_ev: dict[str, float] = {}
        for s in state.steps:
            recent.seconds += s.seconds
            recent.add(s.counts)
            for t, v in s.tier_evictions.items():
                tier_ev[t] = tier_ev.get(t, 0.0) + v
        # unknown now: rejected from this answer, or read for the first time (a baseline)
        recent.unknown = _unknown_counts(counters["all"]) | (step.unknown if step else frozenset())
        tiers: dict[str, TierGauge] = {}
        for name, u in stats["usage"].items():
            if name == UNREADABLE_TIER:
                continue
            history = state.occupancy.setdefault(name, deque(maxlen=HISTORY_POLLS))
            gauges = [known(u[g]) for g in USAGE_GAUGES]  # TierGauge's order
            if any(v is None for v in gauges):  # no gauge made of unknowns: N/A, like no tier
                history.append(None)
                continue
            g = TierGauge(*(int(v) for v in gauges if v is not None))
            ev_known = counters.get(name, {}).get("evictions") is not None
            g.evictions_per_s = recent.rate(tier_ev[name]) if name in tier_ev and ev_known else None
            tiers[name] = g
            history.append(g.occupancy_ratio)
        since = since_start(stats)
        started_s = stats["started_s"]
        gpu_rejected = {} if state.gpu is None else dict(state.gpu.rejected)
        return NodeRow(
            node,
            True,
            last_seen_ms=round(at_s * 1000),
            recent=recent,
            lifetime_hit_ratio=since.counts.hit_ratio,
            uptime_s=None if started_s is None else max(at_s - float(started_s), 0.0),
            tiers={k: tiers[k] for k in tier_order(tiers)},
            hit_history=list(state.hit_history),
            occupancy_history={k: list(v) for k, v in state.occupancy.items()},
            rtt_s=rtt,
            rtt_basis=rtt_basis,
            gpu=state.gpu,
            rejected={**rejected.fields, **gpu_rejected, **since.impossible},
            since_start=since,
        )

    def _unread_row(
        self,
        reading: Reading,
        poll: Poll,
        state: _NodeState,
        rtt: dict[str, float | None],
        rtt_basis: dict[str, str],
    ) -> NodeRow:
        """A node that answered refusing the token or starting (opening its tiers): up
        (restarting it would not help), its figures unread (N/A, not zero)."""
        state.down_since_s = None
        state.last_up_s = poll.ts_s
        state.hit_history.append(None)
        for hist in state.occupancy.values():
            hist.append(None)
        return NodeRow(
            reading.node,
            False,
            reading.error,
            auth_refused=reading.auth_refused,
            starting=reading.starting,
            last_seen_ms=round(poll.ts_s * 1000),
            hit_history=list(state.hit_history),
            occupancy_history={k: list(v) for k, v in state.occupancy.items()},
            rtt_s=rtt,
            rtt_basis=rtt_basis,
            gpu=state.gpu,
        )

    def _step(
        self,
        name: str,
        counters: Mapping[str, Mapping[str, float | None]],
        epoch: float | None,
        ts_s: float,
        state: _NodeState,
    ) -> _Step | None:
        """This poll's increases; None on the first poll of a node (a baseline only). A counter
        that is unknown (None) keeps its last known value in the tracker, so its increase is
        counted, whole, at the next poll that reads it."""
        ts_ms = int(ts_s * 1000)
        last_ts_s, state.last_ts_s = state.last_ts_s, ts_s
        first = last_ts_s is None
        seconds = 0.0 if last_ts_s is None else ts_s - last_ts_s
        inc: dict[str, dict[str, float | None]] = {
            # missing_means_unread: a counter unknown since the node was first seen is a
            # baseline when it is read, not an increase of its whole value
            tier: self._tracker.increase(
                f"{name}:{tier}", raw, epoch=epoch, ts_ms=ts_ms, missing_means_unread=True
            )
            for tier, raw in counters.items()
        }
        if first or seconds <= 0:
            return None
        a = inc["all"]
        counts = WindowCounts(
            seconds=seconds,
            lookups=a["lookups"] or 0.0,
            hits=a["hits"] or 0.0,
            reuse_hits=a["reuse_hits"] or 0.0,
            sharing_hits=a["sharing_hits"] or 0.0,
            evictions=a["evictions"] or 0.0,
            io_bytes=(a["bytes_read"] or 0.0) + (a["bytes_written"] or 0.0),
        )
        tier_ev = {t: v["evictions"] or 0.0 for t, v in inc.items() if t != "all"}
        # None: unknown at this poll, or a baseline (unknown since the node was first seen)
        return _Step(seconds, counts, tier_ev, _unknown_counts(a))


def _unknown_counts(whole: Mapping[str, float | None]) -> frozenset[str]:
    """The :class:`WindowCounts` counts a node's counters (its ``all``) leave unknown."""
    of = {
        "lookups": ("lookups",),
        "hits": ("hits",),
        "reuse_hits": ("reuse_hits",),
        "sharing_hits": ("sharing_hits",),
        "evictions": ("evictions",),
        "io_bytes": ("bytes_read", "bytes_written"),
    }
    return frozenset(k for k, raw in of.items() if any(whole.get(c) is None for c in raw))


@dataclass(frozen=True, slots=True)
class _RouterSample:
    """The router's counters at one poll, read off its ``/v1/stats``."""

    totals: dict[str, float]
    #: node -> (decisions, to_holder)
    nodes: dict[str, tuple[float, float]]
    #: (from_dc, to_dc) -> (chunks, bytes) pulled
    links: dict[tuple[str, str], tuple[float, float]]
    no_node: float


@dataclass(frozen=True, slots=True)
class _RouterStep:
    """One poll's increases of the router's counters."""

    counts: RoutedCounts
    nodes: dict[str, tuple[float, float]]
    link_bytes: dict[tuple[str, str], float]


def _count(value: Any) -> float:
    # the collectors' check: NaN or Infinity would make every increase, and the JSON, NaN
    if count(value, "", Rejections()) is None:
        raise ValueError(f"not a count: {value!r}")
    return float(value)


def _router_sample(stats: Mapping[str, Any]) -> _RouterSample:
    return _RouterSample(
        totals={name: _count(stats[name]) for name in ROUTER_COUNTERS},
        nodes={
            str(name): (_count(row["decisions"]), _count(row["to_holder"]))
            for name, row in stats["nodes"].items()
        },
        links={
            (str(link["from_dc"]), str(link["to_dc"])): (
                _count(link["chunks"]),
                _count(link["bytes"]),
            )
            for link in stats["links"]
        },
        no_node=_count(stats.get("no_node", 0)),
    )


def _router_step(last: _RouterSample, now: _RouterSample, seconds: float) -> _RouterStep:
    """The increases from ``last`` to ``now``. The router's counters only grow while it runs:
    one that went down means it restarted, and every count is then new since its start (a node
    or link seen for the first time also counts from zero)."""
    restarted = any(now.totals[k] < last.totals[k] for k in ROUTER_COUNTERS)

    def inc(value: float, before: float) -> float:
        return value if restarted else max(value - before, 0.0)

    counts = RoutedCounts(
        seconds, **{k: inc(now.totals[k], last.totals[k]) for k in ROUTER_COUNTERS}
    )
    nodes = {}
    for name, (d, h) in now.nodes.items():
        d0, h0 = last.nodes.get(name, (0.0, 0.0))
        nodes[name] = (inc(d, d0), inc(h, h0))
    links = {
        pair: inc(nbytes, last.links.get(pair, (0.0, 0.0))[1])
        for pair, (_chunks, nbytes) in now.links.items()
    }
    return _RouterStep(counts, nodes, links)


def _rtt_from(dc: str, by_pair: Mapping[tuple[str, str], _V] | None) -> dict[str, _V]:
    """A per DC pair mapping, seen from ``dc``: keyed by the other DC."""
    if not by_pair:
        return {}
    return {b: v for (a, b), v in sorted(by_pair.items()) if a == dc and b != dc}


# --- sorting, filtering, grouping ---------------------------------------------------------------
def _occupancy_key(tier: str) -> Callable[[NodeRow], float | None]:
    def key(r: NodeRow) -> float | None:
        t = r.tiers.get(tier)
        return None if t is None else t.occupancy_ratio

    return key


_STATE_RANK = {"down": 0, "not answering": 1, "token refused": 2, "starting": 3, "up": 4}

_SORT_KEYS: dict[str, Callable[[NodeRow], Any]] = {
    "dc": lambda r: (r.dc, r.name),
    "node": lambda r: r.name,
    # the most in need of a look first: down, not answering, then answering unread (the token
    # to fix, then a start to wait for), then up
    "state": lambda r: (_STATE_RANK[r.state], r.name),
    "hit": lambda r: r.recent.hit_ratio,
    "trend": lambda r: r.recent.hit_ratio,
    "split": lambda r: r.recent.sharing_share_of_hits,
    "evictions": lambda r: r.recent.evictions_per_s,
    "io": lambda r: r.recent.io_bytes_per_s,
    "rtt": lambda r: r.max_rtt_s,
    "power": lambda r: None if r.gpu is None else r.gpu.power_w,
    "routed": lambda r: None if r.routing is None else r.routing.decisions_per_s,
    "holder": lambda r: None if r.routing is None else r.routing.to_holder_share,
}


def sort_key(column: str) -> Callable[[NodeRow], Any]:
    if column.startswith("tier:"):
        return _occupancy_key(column.removeprefix("tier:"))
    try:
        return _SORT_KEYS[column]
    except KeyError:
        raise ValueError(f"cannot sort by {column!r}") from None


def sort_rows(rows: Sequence[NodeRow], column: str, *, reverse: bool = False) -> list[NodeRow]:
    """Rows ordered by ``column``; rows without a value (down, idle, N/A) always come last,
    whichever the direction, so the interesting ones stay on screen."""
    key = sort_key(column)
    known: list[tuple[Any, NodeRow]] = []
    unknown: list[NodeRow] = []
    for r in rows:
        v = key(r)
        if v is None or _is_nan(v):
            unknown.append(r)
        else:
            known.append((v, r))
    known.sort(key=lambda p: (p[0], p[1].name), reverse=reverse)
    unknown.sort(key=lambda r: r.name)
    return [r for _, r in known] + unknown


def _is_nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def matches(row: NodeRow, query: str) -> bool:
    """Every word of ``query`` is in the node's name, DC or state (``up``/``down``), case
    aside; ``dc:NAME`` and ``node:NAME`` match one field exactly, ``!word`` excludes."""
    state = "up" if row.answered else "down"
    haystack = f"{row.name} {row.dc} {state} {row.state}".lower()
    for word in query.lower().split():
        negate = word.startswith("!")
        word = word.removeprefix("!")
        if not word:
            continue
        if word.startswith("dc:"):
            hit = row.dc.lower() == word[3:]
        elif word.startswith("node:"):
            hit = row.name.lower() == word[5:]
        elif word in ("up", "down"):
            hit = state == word
        else:
            hit = word in haystack
        if hit == negate:
            return False
    return True


@dataclass(frozen=True, slots=True)
class Line:
    """One line of the fleet table: a node, or a DC's header when grouped."""

    row: NodeRow | None = None
    dc: DcRow | None = None


def arrange(
    view: FleetView,
    *,
    sort: str = "dc",
    reverse: bool = False,
    query: str = "",
    group: bool = False,
) -> list[Line]:
    """The table's lines: filtered, sorted, and under a header per DC when grouped (the
    header's totals cover the DC's nodes that pass the filter)."""
    rows = [r for r in view.rows if matches(r, query)] if query.strip() else list(view.rows)
    rows = sort_rows(rows, sort, reverse=reverse)
    if not group:
        return [Line(row=r) for r in rows]
    out: list[Line] = []
    for dc in sorted({r.dc for r in rows}):
        members = [r for r in rows if r.dc == dc]
        head = DcRow(dc)
        for r in members:
            head.add(r)
        out.append(Line(dc=head))
        out.extend(Line(row=r) for r in members)
    return out


# --- small renderings shared by the table and --json-less text -----------------------------------
SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float | None], width: int, *, top: float = 1.0) -> str:
    """The last ``width`` values as block characters (0..top); a gap where a value is missing."""
    tail = list(values)[-width:]
    out = []
    for v in tail:
        if v is None:
            out.append(" ")
        else:
            idx = round(min(max(v / top, 0.0), 1.0) * (len(SPARK) - 1))
            out.append(SPARK[idx])
    return "".join(out).rjust(width)


def bar(ratio: float | None, width: int) -> str:
    """A horizontal gauge in eighths over a light track: ``████▌░░░`` for 0.56 over 8 cells."""
    if ratio is None:
        return " " * width
    eighths = round(min(max(ratio, 0.0), 1.0) * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part else ""
    return ("█" * full + partial).ljust(width, "░")
