"""Measured counts of a node, a DC or the fleet over a window, summable from node to DC to
fleet, and the modeled savings of their hits.

Measured figures come from samples (agent counters, NVML, engine metrics, fetch-or-recompute
plans); modeled ones (GPU-seconds, energy and carbon saved, TTFT without cache) carry the
:class:`~kvctl.profiles.ModeledInputs` they assumed. GPU time saved is the agents' own
fetch-or-recompute figure where a node reported one in the window (prefill minus fetch time of
the chunks its plans took; measured only when its prefill rate was), else hit tokens / the
modeled prefill rate. Hit ratios are :class:`~kvctl.ratios.HitCounts`' own.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, Final

from sqlalchemy.engine import Connection

from kvctl.db.analytics.savings import JOULES_PER_KWH, Savings, gpu_key, savings
from kvctl.db.analytics.values import (
    as_float,
    as_int,
    beyond_count,
    gauge_mean,
    possible_joules,
    possible_seconds,
)
from kvctl.db.inventory import DcInfo, NodeInfo
from kvctl.db.rollup import series, window
from kvctl.profiles import GPUS, GPUProfile, ModeledInputs, ModelProfile
from kvctl.ratios import (
    HitCounts,
    fraction,
    ratio,
    read_figures,
    tier_figures,
    tier_hit_counts,
)

MEASURED: Final = "measured"
MODELED: Final = "modeled"
#: a reading made up from a profile where the real one is missing (GPU energy without NVML):
#: never added to a measured one
EMULATED: Final = "emulated"
#: counted by replaying the same requests through the real store on size-only tiers
REPLAYED: Final = "replayed"
TIER_ORDER: Final = ("gpu", "cpu", "disk", "remote", "peer")
#: why a node's figure is unknown (``Counts.unknown_figures``): rows no collector writes (by
#: hand, an import, a broken export) that make it impossible; the node is left out of it
UNKNOWN_TTFT: Final = "TTFT: its seconds not a finite number, or below zero"
UNKNOWN_PLANS: Final = "plans' seconds saved: not a finite number, or below zero"
UNKNOWN_ENERGY: Final = "NVML energy: a GPU's joules below zero or not a finite number"
UNKNOWN_EMULATED: Final = "emulated energy: joules or busy seconds below zero or not finite"


def beyond_counts_reason(table: str) -> str:
    """Why a node's figures of ``table`` are unknown: a count at or past the 64-bit limit."""
    return f"{table}: a count at or past the 64-bit limit"


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


@dataclass(slots=True)
class Counts(HitCounts):
    """Measured counters of one node, a DC or the fleet over a window (lookups and hits are
    :class:`HitCounts`'), and the modeled savings of its hits. Every ``*_nodes`` field counts
    the nodes a figure covers."""

    nodes: int = 0
    #: nodes removed from the inventory whose samples are counted here (not in ``nodes``)
    removed_nodes: int = 0
    samples: int = 0
    #: scrapes the agent answered (up), whether or not its figures could be read
    up_samples: int = 0
    #: scrapes whose figures were recorded (a cache row of the node as a whole); the up ones
    #: without are ``unread_samples``
    read_samples: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    #: nodes whose agents reported their data plane reads in the window; the chunks those
    #: reads asked for, and those not there (evicted since the lookup that counted them as
    #: hits, or never looked up)
    read_nodes: int = 0
    read_chunks: int = 0
    read_missing_chunks: int = 0
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
    # emulated GPU energy (nodes without NVML, ``kvctl collect --emulate-power``): kept apart
    emulated_energy_nodes: int = 0
    emulated_energy_j: float = 0.0
    #: modeled prefill seconds the emulated energy is made of
    emulated_busy_s: float = 0.0
    #: prompt tokens looked up in the emulated samples (agent counters): tokens per joule
    emulated_lookup_tokens: int = 0
    #: per "gpu/model" profile pair the emulation assumed: nodes
    emulated_profiles: dict[str, int] = field(default_factory=dict)
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
    #: per GPU profile the plans' prefill rate was modeled on ('' where the plans named none:
    #: a measured or configured rate, or rows from before 0011): prefill - fetch seconds
    plan_saved_s_by_gpu: dict[str, float] = field(default_factory=dict)
    #: per prefill input the plans reported, "model on gpu (basis)": seconds saved
    plan_inputs: dict[str, float] = field(default_factory=dict)
    #: per plan model named ('' not reported): seconds saved; compared with the page's model
    plan_models: dict[str, float] = field(default_factory=dict)
    #: per GPU profile whose board power priced the plans' seconds: those seconds
    plan_energy_gpus: dict[str, float] = field(default_factory=dict)
    #: per "node: plans on X, inventory Y" where the plans' GPU is not the node's: nodes
    plan_gpu_mismatches: dict[str, int] = field(default_factory=dict)
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
    #: per reason (``UNKNOWN_*``, :func:`beyond_counts_reason`): nodes whose figure it names
    #: is unknown, left out of that figure's sums
    unknown_figures: dict[str, int] = field(default_factory=dict)

    def add(self, other: Counts) -> None:
        for f in _figure_fields():
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, dict):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                setattr(self, f.name, mine + theirs)

    # measured ratios; None where the denominator is zero
    @property
    def up_ratio(self) -> float | None:
        return ratio(self.up_samples, self.samples)

    @property
    def unread_samples(self) -> int:
        """Scrapes answered but without figures: the agent refused the collector's token or was
        still opening its tiers (its node is up, its counts are not), or figures it answered
        were rejected as impossible.
        A node up and idle has none; one up and unread is not idle, its counts are unknown."""
        return max(self.up_samples - self.read_samples, 0)

    @property
    def read_missing_ratio(self) -> float | None:
        """Of the chunks reads asked for (on the nodes that report reads), those not there."""
        return self.read_figures()["read_missing_ratio"]

    def read_figures(self) -> dict[str, float | None]:
        """The read counts and their ratio under their JSON names (``kvctl.ratios``'), null
        where no node reported reads: the live status's too."""
        return read_figures(self.read_nodes, self.read_chunks, self.read_missing_chunks)

    @property
    def token_hit_ratio(self) -> float | None:
        return fraction(self.hit_tokens, self.lookup_tokens) if self.known("lookups") else None

    def tier_hit_counts(self, tier: str) -> HitCounts:
        """The hits ``tier`` served and their reuse/sharing split, over the node's (DC's,
        fleet's) lookups: a lookup asks every tier, a hit is served by one. So each tier's
        ratios are :class:`HitCounts`' own, and the tiers' hit (reuse, sharing) ratios add up
        to the whole's."""
        return tier_hit_counts(
            self,
            self.tier_hits.get(tier, 0),
            self.tier_reuse_hits.get(tier, 0),
            self.tier_sharing_hits.get(tier, 0),
        )

    def tier_hit_ratio(self, tier: str) -> float | None:
        return self.tier_hit_counts(tier).hit_ratio

    def tier_figures(self, tier: str) -> dict[str, float | None]:
        """``tier``'s hit counts and every ratio (:meth:`HitCounts.hit_figures`), but the
        lookups: they are the whole's, not the tier's."""
        return tier_figures(self.tier_hit_counts(tier))

    @property
    def impossible_hits(self) -> bool:
        """Whether the hit counts cannot be true (``HitCounts.impossible``; or more hit tokens
        than lookup tokens, more hits in a tier than the node's lookups; or a count below zero,
        which no collector records: rows written by hand or restored from a broken export):
        rows recorded from an agent whose hits rose past its lookups, before the collector
        refused such intervals."""
        return (
            self.impossible
            or self.hit_tokens > self.lookup_tokens
            or any(v > self.lookups for v in self.tier_hits.values())
            or any(v > self.lookup_tokens for v in self.tier_hit_tokens.values())
            or min(self._hit_count_values(), default=0) < 0
        )

    def _hit_count_values(self) -> list[float]:
        """Every count the hit figures are made of, the tiers' too."""
        out = [self.lookups, self.hits, self.reuse_hits, self.sharing_hits]
        out += [self.lookup_tokens, self.hit_tokens]
        for per_tier in self._tier_hit_dicts():
            out += per_tier.values()
        return out

    def _tier_hit_dicts(self) -> tuple[dict[str, int], ...]:
        """The per-tier hit counts, by tier: what ``impossible_hits`` checks and
        ``unknown_hits`` clears with the whole's."""
        return (
            self.tier_hits,
            self.tier_hit_tokens,
            self.tier_reuse_hits,
            self.tier_sharing_hits,
        )

    def unknown_hits(self) -> None:
        """All hit counts unknown (``HitCounts.unknown_hits``), the tokens' and tiers' too."""
        HitCounts.unknown_hits(self)
        self.lookup_tokens = self.hit_tokens = 0
        for per_tier in self._tier_hit_dicts():
            per_tier.clear()

    def occupancy_ratio(self, tier: str) -> float | None:
        """Mean used over mean capacity of the tier, over the nodes with readings."""
        used, cap = self.used_bytes.get(tier), self.capacity_bytes.get(tier)
        return None if used is None or cap is None else ratio(used, cap)

    @property
    def tiers(self) -> list[str]:
        seen = set(self.tier_hits) | set(self.capacity_bytes)
        return [t for t in TIER_ORDER if t in seen] + sorted(seen - set(TIER_ORDER))

    @property
    def tokens_per_joule(self) -> float | None:
        """Engine tokens (prompt + generated) per NVML joule, over nodes that report both."""
        return ratio(self.both_tokens, self.both_energy_j)

    @property
    def emulated_tokens_per_joule(self) -> float | None:
        """Emulated: prompt tokens looked up (agent counters) per emulated joule, on the same
        nodes; more hits, fewer tokens to prefill, more tokens per joule."""
        if not self.emulated_energy_nodes:
            return None
        return ratio(self.emulated_lookup_tokens, self.emulated_energy_j)

    @property
    def emulated_energy_kwh(self) -> float | None:
        return self.emulated_energy_j / JOULES_PER_KWH if self.emulated_energy_nodes else None

    @property
    def ttft_mean_s(self) -> float | None:
        return ratio(self.ttft_sum_s, self.ttft_count)

    @property
    def ttft_without_cache_mean_s(self) -> float | None:
        """Modeled: measured TTFT plus the prefill its cached prompt tokens would have taken."""
        return ratio(self.ttft_sum_s + self.cached_prefill_s, self.ttft_count)

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
        out = {f.name: getattr(self, f.name) for f in _figure_fields()} | self.hit_figures()
        for prop in (
            "up_ratio",
            "unread_samples",
            "read_missing_ratio",
            "token_hit_ratio",
            "tokens_per_joule",
            "ttft_mean_s",
            "ttft_without_cache_mean_s",
            "energy_kwh",
            "emulated_energy_kwh",
            "emulated_tokens_per_joule",
            "facility_kwh_saved",
            "carbon_saved_g",
            "plan_bases",
            "gpu_time_basis",
        ):
            out[prop] = getattr(self, prop)
        out["tier_hit_ratio"] = {t: self.tier_hit_ratio(t) for t in self.tiers}
        for name in ("reuse_hit_ratio", "sharing_hit_ratio"):
            out[f"tier_{name}"] = {t: getattr(self.tier_hit_counts(t), name) for t in self.tiers}
        return out


#: the cache counts a node's hit figures are made of (all of them sound, or none counted)
HIT_COUNT_COLUMNS: Final = (
    "lookups",
    "lookup_tokens",
    "hits",
    "hit_tokens",
    "reuse_hits",
    "sharing_hits",
)
CACHE_COLUMNS: Final = (
    *HIT_COUNT_COLUMNS,
    "evictions",
    "used_bytes",
    "capacity_bytes",
    "read_chunks",
    "read_missing_chunks",
)
#: the sums of seconds and joules: floats, never past a count's limit (``beyond_count``)
FLOAT_SUMS: Final = frozenset(
    {"saved_s", "recompute_s", "fetch_s", "ttft_sum_s", "energy_j", "busy_s", "decision_s"}
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


def plan_input_label(model: str, gpu: str, basis: str) -> str:
    """What a node's plans priced their seconds from, for notes: "llama-3.1-8b on h100
    (modeled)"; a rate that names no GPU (measured, configured) is the node's own GPU's."""
    if not model and not gpu:  # an agent older than the field, or one that names nothing
        return f"inputs not reported ({basis})"
    return f"{model or 'model not reported'} on {gpu or 'its own GPU'} ({basis})"


def total(counts: Iterable[Counts]) -> Counts:
    """The sum of ``counts`` (nodes into a DC, DCs into the fleet)."""
    out = Counts()
    for c in counts:
        out.add(c)
    return out


def measured_counts(
    conn: Connection, start_ms: int, end_ms: int, nodes: Iterable[NodeInfo]
) -> dict[int, Counts]:
    """Measured counts per node id over [start, end); five queries, whatever the number of
    nodes. A removed node (``NodeInfo.removed``) counts in ``removed_nodes``, not ``nodes``.
    Nothing modeled: :func:`node_counts` adds the savings."""
    out = {n.id: Counts(nodes=0, removed_nodes=1) if n.removed else Counts(nodes=1) for n in nodes}

    beyond: dict[str, set[int]] = defaultdict(set)

    def rows(table: str, columns: Iterable[str]) -> Iterable[Mapping[Any, Any]]:
        # every node's rows: a filter of 1,000 ids costs more than the rows it skips
        s = series(table)
        q = window(conn, s, start_ms, end_ms, columns=list(columns))
        counts = [c for c in columns if c in s.sums and c not in FLOAT_SUMS]
        for r in conn.execute(q):
            m = r._mapping
            if m["node_id"] not in out:
                continue
            if any(beyond_count(m[c]) for c in counts):
                # no counter reaches 2**63: the rows are unknown, as a reading rejected
                beyond[table].add(m["node_id"])
                out[m["node_id"]].unknown_figures[beyond_counts_reason(table)] = 1
                continue
            yield m

    for m in rows("node_sample", ("up",)):
        c = out[m["node_id"]]
        c.samples += as_int(m["samples"])
        c.up_samples += as_int(m["up"])
    for m in rows("cache_sample", CACHE_COLUMNS):
        c, tier = out[m["node_id"]], m["tier"]
        if tier == "all":
            c.read_samples = as_int(m["samples"])
            c.lookups = as_int(m["lookups"])
            c.lookup_tokens = as_int(m["lookup_tokens"])
            c.hits = as_int(m["hits"])
            c.hit_tokens = as_int(m["hit_tokens"])
            c.reuse_hits = as_int(m["reuse_hits"])
            c.sharing_hits = as_int(m["sharing_hits"])
            c.evictions = as_int(m["evictions"])
            if m["read_chunks"] is not None and m["read_missing_chunks"] is not None:
                c.read_nodes = 1
                c.read_chunks = as_int(m["read_chunks"])
                c.read_missing_chunks = as_int(m["read_missing_chunks"])
            continue
        c.tier_hits[tier] = as_int(m["hits"])
        c.tier_hit_tokens[tier] = as_int(m["hit_tokens"])
        c.tier_reuse_hits[tier] = as_int(m["reuse_hits"])
        c.tier_sharing_hits[tier] = as_int(m["sharing_hits"])
        if (used := gauge_mean(m, "used_bytes")) is not None:
            c.used_bytes[tier] = used
        if (cap := gauge_mean(m, "capacity_bytes")) is not None:
            c.capacity_bytes[tier] = cap
            c.capacity_nodes[tier] = 1
    for node_id in beyond["cache_sample"]:
        # a tier's row left out would leave the others' hits over the whole's lookups
        out[node_id].unknown_hits()
        out[node_id].read_samples = 0
    for c in out.values():
        # one node's impossible hits (old rows: the collector refuses them since) are unknown,
        # never summed into its DC's and the fleet's ratios: those are over the other nodes
        if c.impossible_hits:
            c.unknown_hits()
    energy: dict[int, float] = defaultdict(float)
    #: nodes with a GPU whose energy cannot be true: a node's sum over its GPUs may look
    #: sound (one GPU's -1 MJ under another's 2 MJ) and still be no figure
    impossible_gpu: set[int] = set(beyond["power_sample"])
    for m in rows("power_sample", ("energy_j", "power_w")):
        c = out[m["node_id"]]
        if m["energy_j"] is not None:
            joules = float(m["energy_j"])  # one GPU's (the series is per node and GPU)
            energy[m["node_id"]] += joules
            if not possible_joules(joules):
                impossible_gpu.add(m["node_id"])
        c.power_w += gauge_mean(m, "power_w") or 0.0
    for node_id, joules in energy.items():
        if node_id in impossible_gpu or not possible_joules(joules):
            # unknown, as without NVML: never summed into its DC's and the fleet's
            out[node_id].unknown_figures[UNKNOWN_ENERGY] = 1
            continue
        out[node_id].energy_nodes = 1
        out[node_id].energy_j = joules
    # emulated energy: its own table and its own fields, never summed with NVML's
    emulated: dict[int, float] = defaultdict(float)
    impossible_emulated: set[int] = set(beyond["emulated_power_sample"])
    for m in rows("emulated_power_sample", ("energy_j", "busy_s", "lookup_tokens")):
        c = out[m["node_id"]]
        if m["energy_j"] is not None:
            joules = float(m["energy_j"])  # one GPU profile's
            emulated[m["node_id"]] += joules
            if not possible_joules(joules):
                impossible_emulated.add(m["node_id"])
        if not possible_seconds(as_float(m["busy_s"])):
            impossible_emulated.add(m["node_id"])
        c.emulated_busy_s += as_float(m["busy_s"])
        c.emulated_lookup_tokens += as_int(m["lookup_tokens"])
        c.emulated_profiles[f"{m['gpu_profile']}/{m['model']}"] = 1
    for node_id in set(emulated) | impossible_emulated:
        c = out[node_id]
        joules = emulated.get(node_id, 0.0)
        if node_id in impossible_emulated or not possible_joules(joules):
            # unknown: nor its busy time and tokens, the other nodes' tokens per joule
            c.emulated_busy_s, c.emulated_lookup_tokens = 0.0, 0
            c.emulated_profiles.clear()
            c.unknown_figures[UNKNOWN_EMULATED] = 1
            continue
        c.emulated_energy_nodes = 1
        c.emulated_energy_j = joules
    impossible_plans: set[int] = set(beyond["plan_sample"])
    for m in rows("plan_sample", PLAN_COLUMNS):
        if not all(possible_seconds(as_float(m[k])) for k in ("recompute_s", "fetch_s")) or (
            not math.isfinite(as_float(m["saved_s"]))
        ):
            # saved_s alone may be below zero (a link overridden to slower): not the others
            impossible_plans.add(m["node_id"])
        c, basis = out[m["node_id"]], m["prefill_basis"]
        model, gpu = m["prefill_model"] or "", m["prefill_gpu"] or ""
        c.plan_nodes = 1
        c.plan_saved_s[basis] = c.plan_saved_s.get(basis, 0.0) + as_float(m["saved_s"])
        saved_s = as_float(m["saved_s"])
        c.plan_saved_s_by_gpu[gpu] = c.plan_saved_s_by_gpu.get(gpu, 0.0) + saved_s
        label = plan_input_label(model, gpu, basis)
        c.plan_inputs[label] = c.plan_inputs.get(label, 0.0) + saved_s
        c.plan_models[model] = c.plan_models.get(model, 0.0) + saved_s
        c.plan_recompute_s += as_float(m["recompute_s"])
        c.plan_fetch_s += as_float(m["fetch_s"])
        c.plan_fetch_chunks += as_int(m["fetch_chunks"])
        c.plan_recompute_chunks += as_int(m["recompute_chunks"])
    for node_id in impossible_plans:
        # unknown: still a node with plans (its hits are not priced at the modeled rate
        # instead), whose seconds saved are left out of every sum
        c = out[node_id]
        c.plan_nodes = 1
        for per in (c.plan_saved_s, c.plan_saved_s_by_gpu, c.plan_inputs, c.plan_models):
            per.clear()
        c.plan_recompute_s = c.plan_fetch_s = 0.0
        c.plan_fetch_chunks = c.plan_recompute_chunks = 0
        c.unknown_figures[UNKNOWN_PLANS] = 1
    impossible_ttft: set[int] = set()
    for m in rows("engine_sample", ENGINE_COLUMNS):
        c = out[m["node_id"]]
        c.engine_nodes = 1
        c.prompt_tokens += as_int(m["prompt_tokens"])
        c.cached_prompt_tokens += as_int(m["cached_prompt_tokens"])
        c.generation_tokens += as_int(m["generation_tokens"])
        c.requests += as_int(m["requests"])
        c.ttft_count += as_int(m["ttft_count"])
        c.ttft_sum_s += as_float(m["ttft_sum_s"])
        if not possible_seconds(as_float(m["ttft_sum_s"])):
            impossible_ttft.add(m["node_id"])
    for node_id in impossible_ttft:
        # unknown: nor its count, or the TTFT mean is the other nodes' seconds over all counts
        out[node_id].ttft_count, out[node_id].ttft_sum_s = 0, 0.0
        out[node_id].unknown_figures[UNKNOWN_TTFT] = 1
    for c in out.values():
        # tokens per joule: numerator and denominator from the same nodes
        if c.energy_nodes and c.prompt_tokens + c.generation_tokens:
            c.both_nodes = 1
            c.both_tokens = c.prompt_tokens + c.generation_tokens
            c.both_energy_j = c.energy_j
    return out


def node_counts(
    conn: Connection,
    start_ms: int,
    end_ms: int,
    nodes: Iterable[NodeInfo],
    dcs: Mapping[str, DcInfo],
    assume: Assumptions,
) -> dict[int, Counts]:
    """:func:`measured_counts` and the modeled savings of each node's hits.

    A node with plan samples in the window is credited its plans' seconds saved (prefill minus
    fetch of the chunks taken, from the rates its agent decided with), and nothing for hits
    made before its agent reported plans (an upgrade inside the window): a saving is never
    claimed on a figure that ignored fetch time. Other nodes: hit tokens / modeled rate."""
    by_id = {n.id: n for n in nodes}
    out = measured_counts(conn, start_ms, end_ms, by_id.values())
    for node_id, c in out.items():
        node = by_id[node_id]
        dc = dcs[node.dc]
        inputs = assume.inputs_for(node.gpu_model)
        c.default_gpu_nodes = int(gpu_key(node.gpu_model) is None)
        # TTFT without cache: numerator and denominator from the same nodes
        if c.ttft_count:
            c.cached_prefill_s = inputs.prefill_seconds(c.cached_prompt_tokens)
        plan_saved_s = sum(c.plan_saved_s.values()) if c.plan_nodes else None
        c.token_model_nodes = int(plan_saved_s is None and c.hit_tokens > 0)
        if not (c.hit_tokens or plan_saved_s):
            continue
        found: list[Savings] = []
        if plan_saved_s is None:
            found.append(_savings(c, inputs, dc))
        else:
            # each GPU's seconds at that GPU's board power: an agent planning on its default
            # h100 while the inventory says L4 saved H100-seconds, not L4-seconds
            for plan_gpu, seconds in sorted(c.plan_saved_s_by_gpu.items()):
                profile = GPUS.get(gpu_key(plan_gpu) or "") or inputs.gpu
                c.plan_energy_gpus[profile.name] = (
                    c.plan_energy_gpus.get(profile.name, 0.0) + seconds
                )
                if plan_gpu and gpu_key(node.gpu_model) not in (None, profile.name):
                    mismatch = f"{node.name}: plans on {profile.name}, inventory {node.gpu_model}"
                    c.plan_gpu_mismatches[mismatch] = 1
                found.append(_savings(c, inputs, dc, seconds, profile))
        c.gpu_seconds_saved = sum(s.gpu_seconds for s in found)
        c.it_joules_saved = sum(s.it_joules for s in found)
        c.facility_joules_saved = sum(s.facility_joules for s in found)
        carbon = [s.carbon_g for s in found if s.carbon_g is not None]
        c.carbon_g_saved = sum(carbon)
        c.carbon_unknown_nodes = int(dc.carbon_g_per_kwh is None)
        c.carbon_known_nodes = int(dc.carbon_g_per_kwh is not None)
        c.pue_unknown_nodes = int(dc.pue is None)
    return out


def _savings(
    c: Counts,
    inputs: ModeledInputs,
    dc: DcInfo,
    plan_saved_s: float | None = None,
    plan_gpu: GPUProfile | None = None,
) -> Savings:
    return savings(
        c.hit_tokens,
        inputs,
        pue=dc.pue,
        carbon_g_per_kwh=dc.carbon_g_per_kwh,
        plan_saved_s=plan_saved_s,
        plan_gpu=plan_gpu,
    )


@functools.cache
def _figure_fields() -> tuple[Field[Any], ...]:
    """:class:`Counts`' figures: its fields but ``HitCounts.unknown``, which the database's
    sums never set (an impossible value is NULL there, left out of every sum)."""
    return tuple(f for f in fields(Counts) if f.name != "unknown")
