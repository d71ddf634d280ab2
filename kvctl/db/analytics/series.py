"""A DC's or a node's figures over a window bucket by bucket, and a node's notable events."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from kvctl.agent_starting import says_starting
from kvctl.db.analytics.values import as_int, beyond_count, gauge_mean, possible_joules
from kvctl.db.analytics.windows import Window, bucket_starts, bucketed_rows
from kvctl.db.models import raw_table
from kvctl.db.rollup import buckets, series
from kvctl.ratios import HitCounts


@dataclass(slots=True)
class TimeSeries:
    """Time series of a DC or node: one entry per bucket start (ms), ascending."""

    bucket_ms: list[int] = field(default_factory=list)
    #: whether the bucket holds any cache sample: the counts of a bucket without one are not
    #: zeros but unknown (the collector did not run), and plots leave them out
    sampled: list[bool] = field(default_factory=list)
    #: per tier: sum over nodes of each node's mean used bytes in the bucket
    used_bytes: dict[str, list[float | None]] = field(default_factory=dict)
    capacity_bytes: dict[str, list[float | None]] = field(default_factory=dict)
    lookups: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)
    reuse_hits: list[int] = field(default_factory=list)
    sharing_hits: list[int] = field(default_factory=list)
    evictions: list[int] = field(default_factory=list)
    #: sum over GPUs of each GPU's mean power in the bucket; None without readings
    power_w: list[float | None] = field(default_factory=list)
    energy_j: list[float | None] = field(default_factory=list)
    #: the emulated power and energy (nodes without NVML), never added to the measured ones
    emulated_power_w: list[float | None] = field(default_factory=list)
    emulated_energy_j: list[float | None] = field(default_factory=list)

    def hit_counts(self) -> list[HitCounts]:
        """Each bucket's counts, for its ratios."""
        return [
            HitCounts(*c)
            for c in zip(self.lookups, self.hits, self.reuse_hits, self.sharing_hits, strict=True)
        ]


def time_series(conn: Connection, win: Window, node_ids: list[int]) -> TimeSeries:
    """Bucketed series over the window for the given nodes (a DC's or one node's)."""
    starts = bucket_starts(win)
    n = len(starts)
    out = TimeSeries(bucket_ms=starts)
    out.lookups, out.hits, out.reuse_hits = [0] * n, [0] * n, [0] * n
    out.sharing_hits, out.evictions = [0] * n, [0] * n
    out.power_w, out.energy_j = [None] * n, [None] * n
    out.emulated_power_w, out.emulated_energy_j = [None] * n, [None] * n
    out.sampled = [False] * n
    if not node_ids:
        return out
    where = {"node_id": node_ids}
    q = buckets(
        conn,
        series("cache_sample"),
        win.start_ms,
        win.end_ms,
        win.step_ms,
        where=where,
        columns=[
            "lookups",
            "hits",
            "reuse_hits",
            "sharing_hits",
            "evictions",
            "used_bytes",
            "capacity_bytes",
        ],
    )
    for i, m in bucketed_rows(conn, q, starts):
        out.sampled[i] = True
        if m["tier"] == "all":
            looked, hits = as_int(m["lookups"]), as_int(m["hits"])
            reuse, sharing = as_int(m["reuse_hits"]), as_int(m["sharing_hits"])
            # a node's bucket whose hits cannot be true (rows from before the collector
            # refused them, or below zero: written by hand) is left out of the bucket's hit
            # counts: unknown, not summed
            counts = HitCounts(looked, hits, reuse, sharing)
            sound = min(looked, hits, reuse, sharing) >= 0 and not any(
                beyond_count(v) for v in (looked, hits, reuse, sharing)
            )
            if sound and not counts.impossible:
                out.lookups[i] += looked
                out.hits[i] += hits
                out.reuse_hits[i] += reuse
                out.sharing_hits[i] += sharing
            out.evictions[i] += as_int(m["evictions"])
            continue
        for gauge, target in (
            ("used_bytes", out.used_bytes),
            ("capacity_bytes", out.capacity_bytes),
        ):
            values = target.setdefault(m["tier"], [None] * n)
            if (mean := gauge_mean(m, gauge)) is not None:
                values[i] = (values[i] or 0.0) + mean
    _add_power(conn, "power_sample", win, where, starts, out.power_w, out.energy_j)
    _add_power(
        conn,
        "emulated_power_sample",
        win,
        where,
        starts,
        out.emulated_power_w,
        out.emulated_energy_j,
    )
    return out


def _add_power(
    conn: Connection,
    table: str,
    win: Window,
    where: Mapping[str, Any],
    starts: Sequence[int],
    power_w: list[float | None],
    energy_j: list[float | None],
) -> None:
    """Add ``table``'s power (the sum of each series' mean) and energy to each bucket's. A
    node's energy in a bucket that is below zero or not finite (rows written by hand, a broken
    export: no collector records one) is unknown, left out of the bucket's as
    ``counts.measured_counts`` leaves it out of a window's."""
    q = buckets(
        conn,
        series(table),
        win.start_ms,
        win.end_ms,
        win.step_ms,
        where=where,
        columns=["energy_j", "power_w"],
    )
    node_joules: dict[tuple[int, int], float] = defaultdict(float)  # (bucket, node): J
    #: (bucket, node) with a GPU's energy that cannot be true, hidden in a sound node sum
    impossible: set[tuple[int, int]] = set()
    for i, m in bucketed_rows(conn, q, starts):
        if (mean := gauge_mean(m, "power_w")) is not None:
            power_w[i] = (power_w[i] or 0.0) + mean
        if m["energy_j"] is not None:
            joules = float(m["energy_j"])  # one GPU's (one GPU profile's, emulated)
            node_joules[i, m["node_id"]] += joules
            if not possible_joules(joules):
                impossible.add((i, m["node_id"]))
    for (i, node), joules in node_joules.items():
        if (i, node) not in impossible and possible_joules(joules):
            energy_j[i] = (energy_j[i] or 0.0) + joules


@dataclass(frozen=True, slots=True)
class NodeEvent:
    ts_ms: int
    kind: str
    detail: str


def node_events(conn: Connection, win: Window, node_id: int, *, limit: int = 10) -> list[NodeEvent]:
    """A node's notable events in the window, newest first, read from raw samples (kept two
    days by default): agent restarts, unreachable spells with their error, spells where it
    answered but its figures could not be read (an up sample with an error: "starting" while
    its agent opened its tiers, "token refused" otherwise: it refused the collector's token),
    and the buckets with the most evictions."""
    t = raw_table("node_sample")
    q = (
        select(t.c.ts_ms, t.c.up, t.c.agent_started_s, t.c.error)
        .where(t.c.node_id == node_id, t.c.ts_ms >= win.start_ms, t.c.ts_ms < win.end_ms)
        .order_by(t.c.ts_ms)
    )
    events: list[NodeEvent] = []
    started: float | None = None
    spell: _Spell | None = None
    for ts, up, agent_started, error in conn.execute(q):
        kind = _kind(up, error)
        if spell is not None and spell.kind != kind:
            events.append(spell.event())
            spell = None
        if kind is not None:
            spell = spell or _Spell(kind, ts)
            spell.count += 1
            spell.error = error or spell.error
        if agent_started is not None:
            if started is not None and agent_started != started:
                events.append(NodeEvent(ts, "restart", "agent restarted: counters reset"))
            started = agent_started
    if spell is not None:
        events.append(spell.event(ongoing=True))
    s = time_series(conn, win, [node_id])
    peaks = sorted(
        ((e, b) for b, e in zip(s.bucket_ms, s.evictions, strict=True) if e),
        reverse=True,
    )[:3]
    events += [NodeEvent(b, "evictions", f"{e:,} chunks evicted in this bucket") for e, b in peaks]
    events.sort(key=lambda e: e.ts_ms, reverse=True)
    return events[:limit]


def _kind(up: bool, error: str | None) -> str | None:
    """The spell a node sample belongs to: None for one read, else "down", "starting" (it
    answered that its tiers are opening) or "token refused" (any other answer left unread)."""
    if not up:
        return "down"
    if not error:
        return None
    return "starting" if says_starting(error) else "token refused"


@dataclass(slots=True)
class _Spell:
    """Consecutive samples of a node down, starting, or up with its figures unread."""

    kind: str
    since_ms: int
    count: int = 0
    error: str = ""

    def event(self, *, ongoing: bool = False) -> NodeEvent:
        scrapes = f"{self.count} scrape{'s' * (self.count != 1)}"
        if self.kind == "down":
            tail = " (still down)" if ongoing else ""
            text = f"unreachable for {scrapes}{tail}: {self.error or 'no answer'}"
        elif self.kind == "starting":
            # it answered: up, opening its tiers; its figures are recorded once it serves
            tail = " (still starting)" if ongoing else ""
            text = f"starting for {scrapes}{tail}, no figures recorded: {self.error}"
        else:
            # it answered: up (as `kvctl status` says), but none of its figures were recorded
            tail = " (still refused)" if ongoing else ""
            text = f"up but unreadable for {scrapes}{tail}, no figures recorded: {self.error}"
        return NodeEvent(self.since_ms, self.kind, text)
