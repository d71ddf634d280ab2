"""Per-DC totals summed in SQL, for fleets too large to count node by node (the benches'
fleet summary), and exact cache counter sums per node and tier (the demo's cross-check)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Float, and_, case, cast, func, select, union_all
from sqlalchemy.engine import Connection

from kvctl.db.analytics.counts import HIT_COUNT_COLUMNS
from kvctl.db.analytics.values import COUNT_LIMIT
from kvctl.db.inventory import counted_since, removed_label
from kvctl.db.models import DataCenter, Node, RemovedNode
from kvctl.db.rollup import count_sum, series, window
from kvctl.ratios import HitCounts, ratio


@dataclass(slots=True, kw_only=True)
class DcSummary(HitCounts):
    """Measured figures of one DC (or the fleet) over a window; None where nothing was read."""

    dc: str
    nodes: int = 0
    up_ratio: float | None = None
    hit_tokens: int = 0
    used_bytes: float | None = None
    capacity_bytes: float | None = None
    energy_j: float | None = None
    power_w: float | None = None
    prompt_tokens: int | None = None
    cached_prompt_tokens: int | None = None


@dataclass(slots=True)
class FleetSummary:
    start_ms: int
    end_ms: int
    dcs: list[DcSummary] = field(default_factory=list)
    total: DcSummary = field(default_factory=lambda: DcSummary(dc="fleet"))


def _per_dc(
    conn: Connection, table: str, start_ms: int, end_ms: int, cols: dict[str, Any]
) -> dict[str, Any]:
    # each figure is named for the counter or gauge it reads: aggregate only those
    where = {"tier": "all"} if table == "cache_sample" else None
    w = window(conn, series(table), start_ms, end_ms, where=where, columns=list(cols)).subquery()
    dc_of = _node_dcs(start_ms)
    q = (
        select(dc_of.c.dc, *(fn(w).label(name) for name, fn in cols.items()))
        .select_from(w)
        .join(dc_of, dc_of.c.node_id == w.c.node_id)
        .group_by(dc_of.c.dc)
    )
    return {row[0]: row._mapping for row in conn.execute(q)}


def _node_dcs(start_ms: int) -> Any:
    """Each node's DC name: the inventory's nodes, and the removed ones (``RemovedNode``),
    whose samples stay in the totals of the windows that hold them: those the read model
    counts in a window from ``start_ms`` (``removed_nodes``), so these totals are its totals."""
    live = select(Node.id.label("node_id"), DataCenter.name.label("dc")).join(
        DataCenter, DataCenter.id == Node.dc_id
    )
    gone = select(RemovedNode.id.label("node_id"), RemovedNode.dc.label("dc")).where(
        counted_since(start_ms)
    )
    return union_all(live, gone).subquery("node_dc")


def _mean(w: Any, gauge: str) -> Any:
    """A gauge's mean per series over the window; NULL (not a division error) with no reading."""
    return cast(w.c[f"{gauge}_sum"], Float) / func.nullif(w.c[f"{gauge}_n"], 0)


def _sound_sum(w: Any, counter: str) -> Any:
    """The sum of a hit count over the nodes (``w``: one row per node) whose hit counts over
    the window can be true: no more hits than lookups, hit tokens than lookup tokens (reuse
    and sharing hits are not held to hits: an agent moves a hit between them when its copy
    arrives, so a span can hold the move without its hit). A node's that cannot (rows
    recorded from an agent whose hits rose past its lookups, before the collector refused such
    intervals) are unknown, left out of its DC's sums as ``HitCounts.add_hits`` leaves them
    out: never 1e9 hits over 1 lookup. Nor a count below zero, which no collector records (rows
    written by hand, a broken export): the read model has such a node's hits unknown too
    (``Counts.impossible_hits``), and these totals are its totals."""
    c = w.c
    sound = and_(
        c.hits <= c.lookups,
        c.hit_tokens <= c.lookup_tokens,
        # a count with no reading (NULL, an older agent's reuse/sharing) is none, not below 0
        *(func.coalesce(c[name], 0) >= 0 for name in HIT_COUNT_COLUMNS),
        # nor at the 64-bit limit (``beyond_count``): summed apart, never into a DC's sum
        *(func.coalesce(c[name], 0) < COUNT_LIMIT for name in HIT_COUNT_COLUMNS),
    )
    return count_sum(case((sound, c[counter]), else_=0))


def fleet_summary(conn: Connection, start_ms: int, end_ms: int) -> FleetSummary:
    """Per-DC and fleet totals over [start, end): exact, read through rollups where possible.
    Removed nodes' samples count in their DC (``nodes`` counts the inventory's)."""
    out = FleetSummary(start_ms, end_ms)
    names = conn.execute(select(DataCenter.name).order_by(DataCenter.name)).scalars().all()
    counts = dict(
        conn.execute(
            select(DataCenter.name, func.count(Node.id))
            .join(Node, Node.dc_id == DataCenter.id, isouter=True)
            .group_by(DataCenter.name)
        ).all()
    )
    cache = _per_dc(
        conn,
        "cache_sample",
        start_ms,
        end_ms,
        {
            # each node's hit counts where they can be true (``_sound``), else none of them
            "lookups": lambda w: _sound_sum(w, "lookups"),
            "lookup_tokens": lambda w: _sound_sum(w, "lookup_tokens"),
            "hits": lambda w: _sound_sum(w, "hits"),
            "hit_tokens": lambda w: _sound_sum(w, "hit_tokens"),
            "reuse_hits": lambda w: _sound_sum(w, "reuse_hits"),
            "sharing_hits": lambda w: _sound_sum(w, "sharing_hits"),
            # the DC's bytes = the sum over its nodes of each node's mean over the window
            "used_bytes": lambda w: func.sum(_mean(w, "used_bytes")),
            "capacity_bytes": lambda w: func.sum(_mean(w, "capacity_bytes")),
        },
    )
    up = _per_dc(
        conn,
        "node_sample",
        start_ms,
        end_ms,
        {"up": lambda w: count_sum(w.c.up), "samples": lambda w: count_sum(w.c.samples)},
    )
    power = _per_dc(
        conn,
        "power_sample",
        start_ms,
        end_ms,
        {
            "energy_j": lambda w: func.sum(w.c.energy_j),
            "power_w": lambda w: func.sum(_mean(w, "power_w")),
        },
    )
    engine = _per_dc(
        conn,
        "engine_sample",
        start_ms,
        end_ms,
        {
            "prompt_tokens": lambda w: count_sum(w.c.prompt_tokens),
            "cached_prompt_tokens": lambda w: count_sum(w.c.cached_prompt_tokens),
        },
    )
    total = out.total
    up_sum = samples_sum = 0
    # DCs removed with their nodes: their samples still count, under the name marked removed
    gone = sorted((set(cache) | set(up) | set(power) | set(engine)) - set(names))
    for name in [*names, *gone]:
        label = name if name in counts else removed_label(name)
        d = DcSummary(dc=label, nodes=int(counts.get(name, 0)))
        if (c := cache.get(name)) is not None:
            d.lookups = int(c["lookups"] or 0)
            d.hits = int(c["hits"] or 0)
            d.hit_tokens = int(c["hit_tokens"] or 0)
            d.reuse_hits = int(c["reuse_hits"] or 0)
            d.sharing_hits = int(c["sharing_hits"] or 0)
            d.used_bytes = None if c["used_bytes"] is None else float(c["used_bytes"])
            d.capacity_bytes = None if c["capacity_bytes"] is None else float(c["capacity_bytes"])
        if (u := up.get(name)) is not None:
            d.up_ratio = None if u["up"] is None else ratio(int(u["up"]), int(u["samples"] or 0))
            up_sum += int(u["up"] or 0)
            samples_sum += int(u["samples"] or 0)
        if (p := power.get(name)) is not None:
            d.energy_j = None if p["energy_j"] is None else float(p["energy_j"])
            d.power_w = None if p["power_w"] is None else float(p["power_w"])
        if (e := engine.get(name)) is not None:
            d.prompt_tokens = None if e["prompt_tokens"] is None else int(e["prompt_tokens"])
            cached = e["cached_prompt_tokens"]
            d.cached_prompt_tokens = None if cached is None else int(cached)
        out.dcs.append(d)
        total.nodes += d.nodes
        total.add_hits(d)
        total.hit_tokens += d.hit_tokens
        for attr in ("used_bytes", "capacity_bytes", "energy_j", "power_w"):
            if (v := getattr(d, attr)) is not None:
                setattr(total, attr, (getattr(total, attr) or 0.0) + v)
        for attr in ("prompt_tokens", "cached_prompt_tokens"):
            if (v := getattr(d, attr)) is not None:
                setattr(total, attr, (getattr(total, attr) or 0) + v)
    total.up_ratio = ratio(up_sum, samples_sum)
    return out


CACHE_COUNTERS = ("lookups", "hits", "hit_tokens", "reuse_hits", "sharing_hits")


def node_cache_counters(
    conn: Connection, start_ms: int, end_ms: int, *, counters: tuple[str, ...] = CACHE_COUNTERS
) -> dict[str, dict[str, dict[str, int]]]:
    """Exact sums of cache counters over [start, end) per node name and tier (``all`` is the
    node as a whole); nodes without samples are left out."""
    w = window(conn, series("cache_sample"), start_ms, end_ms, columns=list(counters)).subquery()
    q = (
        select(Node.name, w.c.tier, *(count_sum(getattr(w.c, c)).label(c) for c in counters))
        .select_from(w)
        .join(Node, Node.id == w.c.node_id)
        .group_by(Node.name, w.c.tier)
    )
    out: dict[str, dict[str, dict[str, int]]] = {}
    for row in conn.execute(q):
        m = row._mapping
        out.setdefault(m["name"], {})[m["tier"]] = {c: int(m[c] or 0) for c in counters}
    return out
