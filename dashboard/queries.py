"""The dashboard's read side: every figure its pages show, from the metrics database only.

Plain functions over a SQLAlchemy connection returning dataclasses, so tests assert exact
figures without a browser and the pages only lay them out. Nothing here imports dash.

Measured figures come from samples (agent counters, NVML, engine metrics, link probes);
modeled ones (GPU-seconds, energy and carbon saved, TTFT without cache, fetch-or-recompute)
carry the :class:`~kvctl.workload.profiles.ModeledInputs` they assumed. GPU time saved is the
agents' own fetch-or-recompute figure where a node reported one in the window (prefill minus
fetch time of the chunks its plans took; measured only when its prefill rate was), else hit
tokens / the modeled prefill rate. Windows read rollups
through :func:`kvctl.db.rollup.window` and :func:`kvctl.db.rollup.buckets`, so a 30-day
window reads daily and hourly rows, not samples.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import select
from sqlalchemy.engine import Connection

from kvctl.db.inventory import DcInfo, NodeInfo, list_dcs, list_links, list_nodes
from kvctl.db.models import raw_table
from kvctl.db.plans import SavedPlan, latest_plans
from kvctl.db.rollup import DAY_MS, HOUR_MS, MINUTE_MS, buckets, series, window
from kvctl.fleet.efficiency import JOULES_PER_KWH, gpu_key, savings
from kvctl.workload.plan import FIBER_SECONDS_PER_KM
from kvctl.workload.profiles import GPUS, ModeledInputs, ModelProfile

MEASURED: Final = "measured"
MODELED: Final = "modeled"
DEFAULT_CHUNK_TOKENS: Final = 256


# --- windows -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Window:
    name: str
    start_ms: int
    end_ms: int
    #: bucket width of the window's time series
    step_ms: int

    @property
    def span_ms(self) -> int:
        return self.end_ms - self.start_ms


#: the window picker: name -> (span, time-series bucket); buckets are whole rollup widths so
#: long windows read coarse rollups
WINDOWS: Final = {
    "15m": (15 * MINUTE_MS, MINUTE_MS),
    "1h": (HOUR_MS, MINUTE_MS),
    "24h": (DAY_MS, 15 * MINUTE_MS),
    "7d": (7 * DAY_MS, HOUR_MS),
    "30d": (30 * DAY_MS, 6 * HOUR_MS),
}
DEFAULT_WINDOW: Final = "1h"


def window_for(name: str, now_ms: int) -> Window:
    """The window ``name`` (a key of :data:`WINDOWS`) ending at ``now_ms``."""
    try:
        span, step = WINDOWS[name]
    except KeyError:
        raise ValueError(f"unknown window {name!r}; choose from {', '.join(WINDOWS)}") from None
    return Window(name, now_ms - span, now_ms, step)


# --- inventory ---------------------------------------------------------------------------------
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


# --- modeled inputs per node -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Assumptions:
    """What modeled figures assume: the served model, the GPU of nodes whose GPU model names
    no profile, and the MFU. Each node otherwise uses the profile of its own GPU."""

    model: ModelProfile
    default_gpu: str
    mfu: float

    def inputs_for(self, gpu_model: str) -> ModeledInputs:
        return ModeledInputs(self.model, GPUS[gpu_key(gpu_model) or self.default_gpu], self.mfu)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name,
            "default_gpu": self.default_gpu,
            "mfu": self.mfu,
            "basis": MODELED,
        }


# --- measured counts, summable from node to DC to fleet ----------------------------------------
TIER_ORDER: Final = ("gpu", "cpu", "disk", "remote", "peer")


@dataclass(slots=True)
class Counts:
    """Measured counters of one node, a DC or the fleet over a window, and the modeled savings
    of its hits. Every ``*_nodes`` field counts the nodes a figure covers."""

    nodes: int = 0
    samples: int = 0
    up_samples: int = 0
    lookups: int = 0
    lookup_tokens: int = 0
    hits: int = 0
    hit_tokens: int = 0
    reuse_hits: int = 0
    sharing_hits: int = 0
    evictions: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    tier_reuse_hits: dict[str, int] = field(default_factory=dict)
    tier_sharing_hits: dict[str, int] = field(default_factory=dict)
    #: per tier: the sum over nodes of each node's mean over the window
    used_bytes: dict[str, float] = field(default_factory=dict)
    capacity_bytes: dict[str, float] = field(default_factory=dict)
    #: per tier: nodes with a capacity reading in the window
    capacity_nodes: dict[str, int] = field(default_factory=dict)
    # NVML
    energy_nodes: int = 0
    energy_j: float = 0.0
    power_w: float = 0.0
    # engine metrics
    engine_nodes: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0
    ttft_count: int = 0
    ttft_sum_s: float = 0.0
    #: modeled prefill seconds of the cached prompt tokens (nodes with engine metrics)
    cached_prefill_s: float = 0.0
    #: engine tokens and NVML energy of the nodes that have both (tokens per joule)
    both_nodes: int = 0
    both_tokens: int = 0
    both_energy_j: float = 0.0
    # the agents' fetch-or-recompute plans (nodes that reported them in the window)
    #: nodes whose GPU time saved is their plans' figure
    plan_nodes: int = 0
    #: per prefill basis (measured, configured, modeled): prefill - fetch seconds of the chunks
    #: the plans took
    plan_saved_s: dict[str, float] = field(default_factory=dict)
    plan_recompute_s: float = 0.0
    plan_fetch_s: float = 0.0
    plan_fetch_chunks: int = 0
    plan_recompute_chunks: int = 0
    #: nodes with hits but no plan figures (older agents): GPU time is tokens / modeled rate
    token_model_nodes: int = 0
    # savings of the hits
    gpu_seconds_saved: float = 0.0
    it_joules_saved: float = 0.0
    facility_joules_saved: float = 0.0
    carbon_g_saved: float = 0.0
    #: nodes with hits whose DC has a grid intensity (carbon covers only these)
    carbon_known_nodes: int = 0
    #: nodes with hits whose DC has no grid intensity (left out of carbon) or no PUE (IT only)
    carbon_unknown_nodes: int = 0
    pue_unknown_nodes: int = 0
    #: nodes whose GPU model names no profile (modeled with the default GPU)
    default_gpu_nodes: int = 0

    def add(self, other: Counts) -> None:
        for name in self.__slots__:  # type: ignore[attr-defined]
            mine, theirs = getattr(self, name), getattr(other, name)
            if isinstance(mine, dict):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                setattr(self, name, mine + theirs)

    # measured ratios; None where the denominator is zero
    @property
    def up_ratio(self) -> float | None:
        return _div(self.up_samples, self.samples)

    @property
    def hit_ratio(self) -> float | None:
        return _div(self.hits, self.lookups)

    @property
    def reuse_ratio(self) -> float | None:
        """Hits on a chunk the same tenant stored, per lookup (reuse + sharing = hit ratio)."""
        return _div(self.reuse_hits, self.lookups)

    @property
    def sharing_ratio(self) -> float | None:
        """Hits on a chunk another tenant stored, per lookup."""
        return _div(self.sharing_hits, self.lookups)

    @property
    def token_hit_ratio(self) -> float | None:
        return _div(self.hit_tokens, self.lookup_tokens)

    def tier_hit_ratio(self, tier: str) -> float | None:
        return _div(self.tier_hits.get(tier, 0), self.lookups)

    @property
    def tiers(self) -> list[str]:
        seen = set(self.tier_hits) | set(self.capacity_bytes)
        return [t for t in TIER_ORDER if t in seen] + sorted(seen - set(TIER_ORDER))

    @property
    def tokens_per_joule(self) -> float | None:
        """Engine tokens (prompt + generated) per NVML joule, over nodes that report both."""
        return _div(self.both_tokens, self.both_energy_j)

    @property
    def ttft_mean_s(self) -> float | None:
        return _div(self.ttft_sum_s, self.ttft_count)

    @property
    def ttft_without_cache_mean_s(self) -> float | None:
        """Modeled: measured TTFT plus the prefill its cached prompt tokens would have taken."""
        return _div(self.ttft_sum_s + self.cached_prefill_s, self.ttft_count)

    @property
    def energy_kwh(self) -> float | None:
        return self.energy_j / JOULES_PER_KWH if self.energy_nodes else None

    @property
    def carbon_saved_g(self) -> float | None:
        """Modeled carbon saved on the nodes whose DC has a grid intensity; None when hits
        were made but no such DC had one (unknown, not zero)."""
        if self.carbon_unknown_nodes and not self.carbon_known_nodes:
            return None
        return self.carbon_g_saved

    @property
    def facility_kwh_saved(self) -> float:
        return self.facility_joules_saved / JOULES_PER_KWH

    @property
    def plan_bases(self) -> list[str]:
        """Prefill bases behind the plans' seconds saved (those with any, else all seen)."""
        kinds = [k for k, v in self.plan_saved_s.items() if v] or list(self.plan_saved_s)
        return sorted(kinds)

    @property
    def gpu_time_basis(self) -> str:
        """Measured only when every second counted comes from plans on a measured prefill rate:
        a configured or modeled rate, or hits without plans, make the whole figure modeled."""
        measured = self.plan_nodes and not self.token_model_nodes
        return MEASURED if measured and self.plan_bases == [MEASURED] else MODELED

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__}  # type: ignore[attr-defined]
        for prop in (
            "up_ratio",
            "hit_ratio",
            "reuse_ratio",
            "sharing_ratio",
            "token_hit_ratio",
            "tokens_per_joule",
            "ttft_mean_s",
            "ttft_without_cache_mean_s",
            "energy_kwh",
            "facility_kwh_saved",
            "carbon_saved_g",
            "plan_bases",
            "gpu_time_basis",
        ):
            out[prop] = getattr(self, prop)
        out["tier_hit_ratio"] = {t: self.tier_hit_ratio(t) for t in self.tiers}
        return out


def _div(num: float, den: float) -> float | None:
    return num / den if den else None


def _f(v: Any) -> float:
    return 0.0 if v is None else float(v)


def _i(v: Any) -> int:
    return 0 if v is None else int(v)


def _mean(m: Mapping[str, Any], gauge: str) -> float | None:
    n = m[f"{gauge}_n"]
    return float(m[f"{gauge}_sum"]) / float(n) if n else None


CACHE_COLUMNS: Final = (
    "lookups",
    "lookup_tokens",
    "hits",
    "hit_tokens",
    "reuse_hits",
    "sharing_hits",
    "evictions",
    "used_bytes",
    "capacity_bytes",
)
PLAN_COLUMNS: Final = ("saved_s", "recompute_s", "fetch_s", "fetch_chunks", "recompute_chunks")
ENGINE_COLUMNS: Final = (
    "prompt_tokens",
    "cached_prompt_tokens",
    "generation_tokens",
    "requests",
    "ttft_count",
    "ttft_sum_s",
)


def node_counts(
    conn: Connection,
    start_ms: int,
    end_ms: int,
    nodes: Iterable[NodeInfo],
    dcs: Mapping[str, DcInfo],
    assume: Assumptions,
) -> dict[int, Counts]:
    """Measured counts and savings per node id over [start, end); five queries, whatever the
    number of nodes.

    A node with plan samples in the window is credited its plans' seconds saved (prefill minus
    fetch of the chunks taken, from the rates its agent decided with), and nothing for hits
    made before its agent reported plans (an upgrade inside the window): a saving is never
    claimed on a figure that ignored fetch time. Other nodes: hit tokens / modeled rate."""
    by_id = {n.id: n for n in nodes}
    out = {i: Counts(nodes=1) for i in by_id}

    def rows(table: str, columns: Iterable[str]) -> Iterable[Mapping[str, Any]]:
        # every node's rows: a filter of 1,000 ids costs more than the rows it skips
        q = window(conn, series(table), start_ms, end_ms, columns=list(columns))
        for r in conn.execute(q):
            m = r._mapping
            if m["node_id"] in out:
                yield m

    for m in rows("node_sample", ("up",)):
        c = out[m["node_id"]]
        c.samples += _i(m["samples"])
        c.up_samples += _i(m["up"])
    for m in rows("cache_sample", CACHE_COLUMNS):
        c, tier = out[m["node_id"]], m["tier"]
        if tier == "all":
            c.lookups = _i(m["lookups"])
            c.lookup_tokens = _i(m["lookup_tokens"])
            c.hits = _i(m["hits"])
            c.hit_tokens = _i(m["hit_tokens"])
            c.reuse_hits = _i(m["reuse_hits"])
            c.sharing_hits = _i(m["sharing_hits"])
            c.evictions = _i(m["evictions"])
            continue
        c.tier_hits[tier] = _i(m["hits"])
        c.tier_hit_tokens[tier] = _i(m["hit_tokens"])
        c.tier_reuse_hits[tier] = _i(m["reuse_hits"])
        c.tier_sharing_hits[tier] = _i(m["sharing_hits"])
        if (used := _mean(m, "used_bytes")) is not None:
            c.used_bytes[tier] = used
        if (cap := _mean(m, "capacity_bytes")) is not None:
            c.capacity_bytes[tier] = cap
            c.capacity_nodes[tier] = 1
    energy: dict[int, float] = defaultdict(float)
    for m in rows("power_sample", ("energy_j", "power_w")):
        c = out[m["node_id"]]
        if m["energy_j"] is not None:
            energy[m["node_id"]] += float(m["energy_j"])
        c.power_w += _mean(m, "power_w") or 0.0
    for node_id, joules in energy.items():
        out[node_id].energy_nodes = 1
        out[node_id].energy_j = joules
    for m in rows("plan_sample", PLAN_COLUMNS):
        c, basis = out[m["node_id"]], m["prefill_basis"]
        c.plan_nodes = 1
        c.plan_saved_s[basis] = c.plan_saved_s.get(basis, 0.0) + _f(m["saved_s"])
        c.plan_recompute_s += _f(m["recompute_s"])
        c.plan_fetch_s += _f(m["fetch_s"])
        c.plan_fetch_chunks += _i(m["fetch_chunks"])
        c.plan_recompute_chunks += _i(m["recompute_chunks"])
    for m in rows("engine_sample", ENGINE_COLUMNS):
        c = out[m["node_id"]]
        c.engine_nodes = 1
        c.prompt_tokens += _i(m["prompt_tokens"])
        c.cached_prompt_tokens += _i(m["cached_prompt_tokens"])
        c.generation_tokens += _i(m["generation_tokens"])
        c.requests += _i(m["requests"])
        c.ttft_count += _i(m["ttft_count"])
        c.ttft_sum_s += _f(m["ttft_sum_s"])
    for node_id, c in out.items():
        node = by_id[node_id]
        dc = dcs[node.dc]
        inputs = assume.inputs_for(node.gpu_model)
        c.default_gpu_nodes = int(gpu_key(node.gpu_model) is None)
        # each ratio's numerator and denominator come from the same nodes
        if c.ttft_count:
            c.cached_prefill_s = inputs.prefill_seconds(c.cached_prompt_tokens)
        if c.energy_nodes and c.prompt_tokens + c.generation_tokens:
            c.both_nodes = 1
            c.both_tokens = c.prompt_tokens + c.generation_tokens
            c.both_energy_j = c.energy_j
        plan_saved_s = sum(c.plan_saved_s.values()) if c.plan_nodes else None
        c.token_model_nodes = int(plan_saved_s is None and c.hit_tokens > 0)
        if c.hit_tokens or plan_saved_s:
            s = savings(
                c.hit_tokens,
                inputs,
                pue=dc.pue,
                carbon_g_per_kwh=dc.carbon_g_per_kwh,
                plan_saved_s=plan_saved_s,
            )
            c.gpu_seconds_saved = s.gpu_seconds
            c.it_joules_saved = s.it_joules
            c.facility_joules_saved = s.facility_joules
            c.carbon_g_saved = s.carbon_g or 0.0
            c.carbon_unknown_nodes = int(s.carbon_g is None)
            c.carbon_known_nodes = int(s.carbon_g is not None)
            c.pue_unknown_nodes = int(not s.pue_known)
    return out


# --- fleet overview ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LinkFigures:
    """One DC pair (a == b: between nodes of one DC) over a window."""

    dc_a: str
    dc_b: str
    distance_km: float | None
    probes: int
    ok_probes: int
    rtt_mean_s: float | None
    rtt_max_s: float | None
    bandwidth_bytes_per_s: float | None
    loss_ratio: float | None

    @property
    def ok_ratio(self) -> float | None:
        return _div(self.ok_probes, self.probes)

    @property
    def fiber_rtt_s(self) -> float | None:
        """Modeled: the round trip light needs over the link's fiber."""
        return None if self.distance_km is None else 2 * FIBER_SECONDS_PER_KM * self.distance_km

    def as_dict(self) -> dict[str, Any]:
        return {
            "dc_a": self.dc_a,
            "dc_b": self.dc_b,
            "distance_km": self.distance_km,
            "probes": self.probes,
            "ok_probes": self.ok_probes,
            "ok_ratio": self.ok_ratio,
            "rtt_mean_s": self.rtt_mean_s,
            "rtt_max_s": self.rtt_max_s,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "loss_ratio": self.loss_ratio,
            "fiber_rtt_s": self.fiber_rtt_s,
        }


def link_figures(conn: Connection, start_ms: int, end_ms: int, inv: Inventory) -> list[LinkFigures]:
    """Probe figures per DC pair (inventory links first, then any pair that was probed)."""
    dc_of = {n.id: n.dc for n in inv.nodes}
    acc: dict[tuple[str, str], list[float]] = {}
    q = window(
        conn,
        series("link_sample"),
        start_ms,
        end_ms,
        columns=["ok", "rtt_s", "bandwidth_bytes_per_s", "loss_ratio"],
    )
    for r in conn.execute(q):
        m = r._mapping
        a, b = dc_of.get(m["src_node_id"]), dc_of.get(m["dst_node_id"])
        if a is None or b is None:
            continue
        v = acc.setdefault(pair(a, b), [0, 0, 0.0, 0, 0.0, 0.0, 0, 0.0, 0])
        v[0] += _i(m["samples"])
        v[1] += _i(m["ok"])
        v[2] += _f(m["rtt_s_sum"])
        v[3] += _i(m["rtt_s_n"])
        v[4] = max(v[4], _f(m["rtt_s_max"]))
        v[5] += _f(m["bandwidth_bytes_per_s_sum"])
        v[6] += _i(m["bandwidth_bytes_per_s_n"])
        v[7] += _f(m["loss_ratio_sum"])
        v[8] += _i(m["loss_ratio_n"])
    out = []
    for key in [*sorted(inv.links_km), *sorted(set(acc) - set(inv.links_km))]:
        v = acc.get(key, [0, 0, 0.0, 0, 0.0, 0.0, 0, 0.0, 0])
        out.append(
            LinkFigures(
                dc_a=key[0],
                dc_b=key[1],
                distance_km=inv.links_km.get(key),
                probes=int(v[0]),
                ok_probes=int(v[1]),
                rtt_mean_s=_div(v[2], v[3]),
                rtt_max_s=v[4] if v[3] else None,
                bandwidth_bytes_per_s=_div(v[5], v[6]),
                loss_ratio=_div(v[7], v[8]),
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class Overview:
    window: Window
    assume: Assumptions
    inventory: Inventory
    #: per DC name, in inventory order
    dcs: dict[str, Counts]
    fleet: Counts
    links: list[LinkFigures]
    #: nodes whose agent said NVML is available, in the window's last samples; None: unknown
    nvml_nodes: int | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "window": {
                "name": self.window.name,
                "start_ms": self.window.start_ms,
                "end_ms": self.window.end_ms,
            },
            "assumptions": self.assume.as_dict(),
            "dcs": {name: c.as_dict() for name, c in self.dcs.items()},
            "fleet": self.fleet.as_dict(),
            "links": [link.as_dict() for link in self.links],
            "nvml_nodes": self.nvml_nodes,
        }


def total(counts: Iterable[Counts]) -> Counts:
    """The sum of ``counts`` (nodes into a DC, DCs into the fleet)."""
    out = Counts()
    for c in counts:
        out.add(c)
    return out


def nvml_nodes(conn: Connection, start_ms: int, end_ms: int) -> int | None:
    """Nodes whose agent reported NVML available in the window's last 15 minutes (raw samples:
    the collector records it per scrape); None when no agent said either way."""
    t = raw_table("node_sample")
    q = select(t.c.node_id, t.c.nvml_available).where(
        t.c.ts_ms >= max(start_ms, end_ms - 15 * MINUTE_MS),
        t.c.ts_ms < end_ms,
        t.c.nvml_available.is_not(None),
    )
    seen: dict[int, bool] = {}
    for node_id, available in conn.execute(q):
        seen[node_id] = seen.get(node_id, False) or bool(available)
    return sum(seen.values()) if seen else None


def overview(conn: Connection, win: Window, assume: Assumptions) -> Overview:
    inv = inventory(conn)
    dcs = {d.name: d for d in inv.dcs}
    per_node = node_counts(conn, win.start_ms, win.end_ms, inv.nodes, dcs, assume)
    by_dc = {d.name: total(per_node[n.id] for n in inv.nodes_of(d.name)) for d in inv.dcs}
    fleet = total(by_dc.values())
    return Overview(
        window=win,
        assume=assume,
        inventory=inv,
        dcs=by_dc,
        fleet=fleet,
        links=link_figures(conn, win.start_ms, win.end_ms, inv),
        nvml_nodes=nvml_nodes(conn, win.start_ms, win.end_ms) if not fleet.energy_nodes else None,
    )


# --- DC and node detail: time series -----------------------------------------------------------
def bucket_starts(win: Window) -> list[int]:
    """Start of every time-series bucket of the window, the first one holding its start."""
    return list(range(win.start_ms - win.start_ms % win.step_ms, win.end_ms, win.step_ms))


@dataclass(slots=True)
class TimeSeries:
    """Time series of a DC or node: one entry per bucket start (ms), ascending."""

    bucket_ms: list[int] = field(default_factory=list)
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

    def hit_ratio(self) -> list[float | None]:
        return [_div(h, n) for h, n in zip(self.hits, self.lookups, strict=True)]

    def reuse_ratio(self) -> list[float | None]:
        return [_div(h, n) for h, n in zip(self.reuse_hits, self.lookups, strict=True)]

    def sharing_ratio(self) -> list[float | None]:
        return [_div(h, n) for h, n in zip(self.sharing_hits, self.lookups, strict=True)]


def time_series(conn: Connection, win: Window, node_ids: list[int]) -> TimeSeries:
    """Bucketed series over the window for the given nodes (a DC's or one node's)."""
    starts = bucket_starts(win)
    pos = {b: i for i, b in enumerate(starts)}
    n = len(starts)
    out = TimeSeries(bucket_ms=starts)
    out.lookups, out.hits, out.reuse_hits = [0] * n, [0] * n, [0] * n
    out.sharing_hits, out.evictions = [0] * n, [0] * n
    out.power_w, out.energy_j = [None] * n, [None] * n
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
    for r in conn.execute(q):
        m = r._mapping
        i = pos.get(int(m["bucket_ms"]))
        if i is None:
            continue
        if m["tier"] == "all":
            out.lookups[i] += _i(m["lookups"])
            out.hits[i] += _i(m["hits"])
            out.reuse_hits[i] += _i(m["reuse_hits"])
            out.sharing_hits[i] += _i(m["sharing_hits"])
            out.evictions[i] += _i(m["evictions"])
            continue
        for gauge, target in (
            ("used_bytes", out.used_bytes),
            ("capacity_bytes", out.capacity_bytes),
        ):
            values = target.setdefault(m["tier"], [None] * n)
            if (mean := _mean(m, gauge)) is not None:
                values[i] = (values[i] or 0.0) + mean
    q = buckets(
        conn,
        series("power_sample"),
        win.start_ms,
        win.end_ms,
        win.step_ms,
        where=where,
        columns=["energy_j", "power_w"],
    )
    for r in conn.execute(q):
        m = r._mapping
        i = pos.get(int(m["bucket_ms"]))
        if i is None:
            continue
        if (mean := _mean(m, "power_w")) is not None:
            out.power_w[i] = (out.power_w[i] or 0.0) + mean
        if m["energy_j"] is not None:
            out.energy_j[i] = (out.energy_j[i] or 0.0) + float(m["energy_j"])
    return out


@dataclass(frozen=True, slots=True)
class NodeEvent:
    ts_ms: int
    kind: str
    detail: str


def node_events(conn: Connection, win: Window, node_id: int, *, limit: int = 10) -> list[NodeEvent]:
    """A node's notable events in the window, newest first, read from raw samples (kept two
    days by default): agent restarts, unreachable spells with their error, and the buckets
    with the most evictions."""
    t = raw_table("node_sample")
    q = (
        select(t.c.ts_ms, t.c.up, t.c.agent_started_s, t.c.error)
        .where(t.c.node_id == node_id, t.c.ts_ms >= win.start_ms, t.c.ts_ms < win.end_ms)
        .order_by(t.c.ts_ms)
    )
    events: list[NodeEvent] = []
    started: float | None = None
    down_since: int | None = None
    down_error = ""
    down_count = 0
    for ts, up, agent_started, error in conn.execute(q):
        if up:
            if down_since is not None:
                events.append(_down_event(down_since, down_count, down_error))
                down_since = None
            if agent_started is not None:
                if started is not None and agent_started != started:
                    events.append(NodeEvent(ts, "restart", "agent restarted: counters reset"))
                started = agent_started
        else:
            if down_since is None:
                down_since, down_count = ts, 0
            down_count += 1
            down_error = error or down_error
    if down_since is not None:
        events.append(_down_event(down_since, down_count, down_error, ongoing=True))
    s = time_series(conn, win, [node_id])
    peaks = sorted(
        ((e, b) for b, e in zip(s.bucket_ms, s.evictions, strict=True) if e),
        reverse=True,
    )[:3]
    events += [NodeEvent(b, "evictions", f"{e:,} chunks evicted in this bucket") for e, b in peaks]
    events.sort(key=lambda e: e.ts_ms, reverse=True)
    return events[:limit]


def _down_event(since_ms: int, count: int, error: str, *, ongoing: bool = False) -> NodeEvent:
    tail = " (still down)" if ongoing else ""
    text = f"unreachable for {count} scrape{'s' * (count != 1)}{tail}: {error or 'no answer'}"
    return NodeEvent(since_ms, "down", text)


@dataclass(frozen=True, slots=True)
class LinkSeries:
    bucket_ms: list[int]
    #: per DC pair: mean RTT in each bucket (None: no successful probe)
    rtt_s: dict[tuple[str, str], list[float | None]]


def link_series(conn: Connection, win: Window, inv: Inventory) -> LinkSeries:
    dc_of = {n.id: n.dc for n in inv.nodes}
    starts = bucket_starts(win)
    pos = {b: i for i, b in enumerate(starts)}
    sums: dict[tuple[str, str], list[list[float]]] = {}
    q = buckets(
        conn, series("link_sample"), win.start_ms, win.end_ms, win.step_ms, columns=["rtt_s"]
    )
    for r in conn.execute(q):
        m = r._mapping
        a, b = dc_of.get(m["src_node_id"]), dc_of.get(m["dst_node_id"])
        i = pos.get(int(m["bucket_ms"]))
        if a is None or b is None or i is None:
            continue
        acc = sums.setdefault(pair(a, b), [[0.0, 0] for _ in starts])
        acc[i][0] += _f(m["rtt_s_sum"])
        acc[i][1] += _i(m["rtt_s_n"])
    return LinkSeries(starts, {k: [_div(s, n) for s, n in v] for k, v in sorted(sums.items())})


# --- links: fetch or recompute -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class BreakEven:
    """design.md's fetch-or-recompute rule for one chunk over one measured link (modeled
    compute, measured RTT and bandwidth)."""

    link: LinkFigures
    chunk_tokens: int
    chunk_bytes: int
    recompute_s: float
    fetch_s: float | None

    @property
    def worth_fetching(self) -> bool | None:
        return None if self.fetch_s is None else self.fetch_s < self.recompute_s

    @property
    def max_rtt_s(self) -> float | None:
        """The largest RTT at which fetching still wins at the measured bandwidth."""
        bw = self.link.bandwidth_bytes_per_s
        return None if not bw else max(0.0, self.recompute_s - self.chunk_bytes / bw)


def break_even(
    links: Iterable[LinkFigures], inputs: ModeledInputs, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> list[BreakEven]:
    chunk_bytes = chunk_tokens * inputs.model.kv_bytes_per_token
    recompute = inputs.prefill_seconds(chunk_tokens)
    out = []
    for link in links:
        fetch = None
        if link.rtt_mean_s is not None and link.bandwidth_bytes_per_s:
            fetch = link.rtt_mean_s + chunk_bytes / link.bandwidth_bytes_per_s
        out.append(BreakEven(link, chunk_tokens, chunk_bytes, recompute, fetch))
    return out


# --- capacity planning -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CapacityView:
    plans: dict[str | None, SavedPlan]
    #: per DC (None: the fleet): mean cpu-tier capacity per node with readings over the
    #: window (measured), for the curve
    cpu_capacity_bytes_per_node: dict[str | None, float | None]


def capacity(conn: Connection, ov: Overview) -> CapacityView:
    per_node: dict[str | None, float | None] = {}
    for name, c in [*ov.dcs.items(), (None, ov.fleet)]:
        cap, nodes = c.capacity_bytes.get("cpu"), c.capacity_nodes.get("cpu", 0)
        per_node[name] = cap / nodes if cap is not None and nodes else None
    return CapacityView(latest_plans(conn), per_node)
