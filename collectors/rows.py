"""Agent and engine readings to database rows, counters turned into increases on the way.

Pure functions of what was scraped plus the counter tracker, so they are tested without a
network and the collector loop only schedules, scrapes and writes.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from collectors.engines import EngineReading, Histogram, histogram_delta, histogram_quantile
from kvctl.counters import CounterTracker
from kvctl.db.analytics.savings import gpu_key
from kvctl.db.models import SERIES_BY_TABLE
from kvctl.db.sample_checks import READ_COUNTERS, Rejections, known
from kvctl.profiles import GPUS, ModeledInputs
from kvctl.wire.stats import cache_counters

CACHE_COUNTERS = tuple(c for c in SERIES_BY_TABLE["cache_sample"].sums if c not in READ_COUNTERS)
ENGINE_COUNTERS = SERIES_BY_TABLE["engine_sample"].sums


def _int(v: float | None) -> int | None:
    return None if v is None else round(v)


#: counts that are parts of the node's lookups, per node and per tier (a tier's hits are part
#: of the node's: a lookup asks every tier), each with the node counter it is part of; tracker
#: names (``kvctl.wire.stats.cache_counters``)
HIT_PARTS = (
    ("hits", "lookups"),
    ("reuse_hits", "lookups"),
    ("sharing_hits", "lookups"),
    ("hit_tokens", "lookup_tokens"),
)
#: the counters a hit ratio (chunks or tokens) is read from: counted together or not at all
HIT_COUNTERS = ("lookups", "lookup_tokens", "hits", "hit_tokens", "reuse_hits", "sharing_hits")
#: the agent's names of the node's counters, where the tracker's differ
_NODE_FIELD = {"lookups": "lookup_chunks", "hits": "hit_chunks", "evictions": "drops"}


def _field(tier: str, counter: str) -> str:
    """Where ``tier``'s (``all``: the node's) ``counter`` is in ``/v1/stats``."""
    if tier == "all":
        return f"stats.{_NODE_FIELD.get(counter, counter)}"
    return f"stats.tiers.{tier}.{counter}"


def hits_beyond_lookups(
    increases: Mapping[str, Mapping[str, float | None]],
    values: Mapping[str, Mapping[str, float | None]] | None = None,
) -> dict[str, str]:
    """The figures of one interval (each tier's increases, ``all`` the node's) whose hits cannot
    be true, by field, with why: hits (chunks, of a tier, reuse or sharing hits) that rose more
    than the node's chunk lookups, hit tokens more than its lookup tokens, where the agent's
    own counts since its start (``values``, by tier) say so too. An interval of a sound agent
    can have more: it counts a lookup's remote hits (from peers or the pool) just after the
    lookup, not in the same step, and moves a hit between reuse and sharing when the copy
    arrives (``kvctl.remote.counting``), so a scrape between the two puts hits in the next
    interval; but its counts since its start never have more hits than lookups. Also the node's
    lookups whose increase was dropped as faster than any agent counts
    (``kvctl.counters.MAX_INCREASE_PER_S``): the interval's hits have nothing to be read
    over."""
    node = increases.get("all", {})
    totals = (values or {}).get("all", {})
    out: dict[str, str] = {}
    for tier, inc in increases.items():
        counts = (values or {}).get(tier, {})
        for part, whole in HIT_PARTS:
            rose, of = inc.get(part), node.get(whole)
            if rose is None or not rose:
                continue
            if of is None:
                out[_field("all", whole)] = "rose faster than any agent counts"
                continue
            total, total_of = counts.get(part), totals.get(whole)
            if rose > of and (total is None or total_of is None or total > total_of):
                out[_field(tier, part)] = f"rose more than {_field('all', whole)}"
    return out


def cache_rows(
    tracker: CounterTracker,
    node_id: int,
    ts_ms: int,
    stats: Mapping[str, Any],
    rejected: Rejections | None = None,
) -> list[dict[str, Any]]:
    """``cache_sample`` rows of one scrape of ``/v1/stats`` (checked: ``kvctl.db.sample_checks``).

    A figure rejected from the answer is unknown, and makes every counter of the node wait:
    their series keep their last known values, so their increases are counted together at the
    next scrape that reads them all (the rows say 0 meanwhile: the columns are NOT NULL) and
    sums over any window stay exact. Together, because hits are read over lookups (per node and
    per tier) bucket by bucket: one counter caught up alone put one span's hits over another's
    lookups (a bucket could read more hits than lookups). One unknown at a node's first scrape
    leaves the next scrape the baseline, never the all-time counts as one interval's. A tier
    whose gauges are unknown has no row for this scrape (its bytes would read 0 in NOT NULL
    columns); an unknown tier leaves the node's ``all`` row out too.

    An interval whose hits rose more than its lookups (``hits_beyond_lookups``) is impossible:
    its hit counts (``HIT_COUNTERS``, every tier's) are not counted (0 in the rows) and the
    counters' values are the next interval's baseline, as for an increase past the tracker's
    bound; the fields are named in ``rejected``. Waiting instead (as for an unknown figure)
    would read every later interval against the old values, the bad jump in each. One node's
    1e9 hits over 1 lookup made the fleet's hit ratio read 10,000,000,100%.
    """
    usage: Mapping[str, Mapping[str, float]] = stats["usage"]
    epoch = stats.get("started_s")
    tiers: dict[str, tuple[dict[str, Any], dict[str, float | None]]] = {}
    for tier, raw in cache_counters(stats).items():
        if tier == "all":
            gauges = {
                k: sum(u[k] for u in usage.values())
                for k in ("used_bytes", "capacity_bytes", "pinned_bytes", "chunks")
            }
        else:
            gauges = dict(usage.get(tier, {}))
        tiers[tier] = (gauges, {k: known(v) for k, v in raw.items()})
    whole = all(
        known(v) is not None
        for gauges, counters in tiers.values()
        for v in (*gauges.values(), *counters.values())
    )
    increases: dict[str, dict[str, float | None]] = {}
    if whole:
        for tier, (_gauges, counters) in tiers.items():
            series = f"cache:{node_id}:{tier}"
            increases[tier] = tracker.increase(series, counters, epoch=epoch, ts_ms=ts_ms)
        values = {tier: counters for tier, (_gauges, counters) in tiers.items()}
        if impossible := hits_beyond_lookups(increases, values):
            for where, why in impossible.items():
                if rejected is not None:
                    rejected.add(where, f"{why} since the last scrape")
            for inc in increases.values():
                inc.update(dict.fromkeys(HIT_COUNTERS))
    rows = []
    for tier, (gauges, _counters) in tiers.items():
        if any(known(v) is None for v in gauges.values()):
            continue
        inc = increases.get(tier, {})
        rows.append(
            {
                "node_id": node_id,
                "tier": tier,
                "ts_ms": ts_ms,
                **{c: _int(inc.get(c)) or 0 for c in CACHE_COUNTERS},
                "used_bytes": gauges.get("used_bytes", 0),
                "capacity_bytes": gauges.get("capacity_bytes", 0),
                "pinned_bytes": gauges.get("pinned_bytes", 0),
                "items": gauges.get("chunks", 0),
                **dict.fromkeys(READ_COUNTERS),
            }
        )
    for row in rows:
        if row["tier"] == "all":
            row |= read_increases(tracker, node_id, ts_ms, stats)
    return rows


def read_increases(
    tracker: CounterTracker, node_id: int, ts_ms: int, stats: Mapping[str, Any]
) -> dict[str, int | None]:
    """The increases of the node's data plane read counts since the last scrape: a series of
    their own, so an agent without them (older), or one unknown, leaves them NULL and never
    holds back the hit counts (the two are read together: a missing chunk alone is a gap)."""
    dataplane = stats.get("dataplane")
    raw = {
        c: known(dataplane.get(c)) if isinstance(dataplane, Mapping) else None
        for c in READ_COUNTERS
    }
    if None in raw.values():
        return dict.fromkeys(READ_COUNTERS)
    inc = tracker.increase(f"reads:{node_id}", raw, epoch=stats.get("started_s"), ts_ms=ts_ms)
    return {c: _int(inc[c]) for c in READ_COUNTERS}


#: prefill bases an agent may report; anything else is recorded as "unknown", never measured
PREFILL_BASES = ("measured", "configured", "modeled")


def _input_name(value: object, limit: int) -> str:
    """A plan input's name as the agent reported it, '' when absent (a measured or configured
    rate names no GPU: it is the node's own), cut to the column's width."""
    return value.strip()[:limit] if isinstance(value, str) else ""


def _gpu_input(value: object) -> str:
    """The GPU profile a plan's prefill rate was modeled on (``gpu_profile``'s key, so "H100"
    and "h100" are one series), else the name as given."""
    name = _input_name(value, 32)
    return gpu_key(name) or name


def plan_rows(
    tracker: CounterTracker, node_id: int, ts_ms: int, stats: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """The ``plan_sample`` row of one scrape of ``/v1/stats``; none from an agent that does not
    plan fetch-or-recompute (no ``fetch_plans``)."""
    plans = stats.get("fetch_plans")
    if not isinstance(plans, Mapping) or not isinstance(plans.get("plans"), Mapping):
        return []
    p: Mapping[str, Any] = plans["plans"]
    # the agent's PrefillModel reports its basis's kind alongside the basis text, and the
    # model and GPU profile its rate was for: the seconds saved are seconds of that GPU
    prefill = plans.get("prefill") if isinstance(plans.get("prefill"), Mapping) else {}
    kind = prefill.get("kind")
    inputs = prefill.get("inputs") if isinstance(prefill.get("inputs"), Mapping) else {}
    raw = {
        c: known(p.get(c)) for c in ("recompute_s", "fetch_s", "fetch_chunks", "recompute_chunks")
    }
    # saved_s is taken from the pair: one unknown makes all wait, to catch up at the same
    # scrape (one alone caught up was counted in no saved_s); an unknown at the first scrape
    # leaves the next the baseline (not the all-time seconds as one interval's)
    inc: Mapping[str, float | None] = dict.fromkeys(raw)
    if None not in raw.values():
        inc = tracker.increase(f"plan:{node_id}", raw, epoch=stats.get("started_s"), ts_ms=ts_ms)
    recompute_s, fetch_s = inc["recompute_s"], inc["fetch_s"]
    # saved_s is recompute_s - fetch_s on the agent, but not monotonic (a link overridden to
    # "fetch" takes chunks slower than recompute), so the tracker would read a decrease as a
    # restart: its increase is taken from the two counters that only grow
    saved_s = None if recompute_s is None or fetch_s is None else recompute_s - fetch_s
    return [
        {
            "node_id": node_id,
            "ts_ms": ts_ms,
            "prefill_basis": kind if kind in PREFILL_BASES else "unknown",
            "prefill_model": _input_name(inputs.get("model"), 64),
            "prefill_gpu": _gpu_input(inputs.get("gpu")),
            "saved_s": saved_s,
            "recompute_s": recompute_s,
            "fetch_s": fetch_s,
            "fetch_chunks": _int(inc["fetch_chunks"]),
            "recompute_chunks": _int(inc["recompute_chunks"]),
        }
    ]


def power_rows(
    tracker: CounterTracker, node_id: int, ts_ms: int, gpus: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """``power_sample`` rows from ``/v1/gpus``; none when NVML is unavailable on the node."""
    rows = []
    for g in gpus.get("gpus", []):
        index = int(g["index"])
        energy_j = g.get("energy_j")
        inc: Mapping[str, float | None] = {"energy_j": None}
        # unknown: the series waits (an unknown first reading leaves the next the baseline,
        # not the GPU's all-time joules as one interval's)
        if energy_j is not None:
            series = f"power:{node_id}:{index}"
            inc = tracker.increase(series, {"energy_j": energy_j}, epoch=None, ts_ms=ts_ms)
        rows.append(
            {
                "node_id": node_id,
                "gpu_index": index,
                "ts_ms": ts_ms,
                "power_w": g.get("power_w"),
                "energy_j": inc["energy_j"],
                "utilization_ratio": g.get("utilization_ratio"),
                "memory_used_bytes": g.get("memory_used_bytes"),
                "memory_total_bytes": g.get("memory_total_bytes"),
            }
        )
    return rows


def emulation_for(default: ModeledInputs, gpu_model: str) -> ModeledInputs:
    """What ``--emulate-power`` assumes of one node: its inventory GPU's profile when its
    gpu_model names one (an H100 node is never emulated at an L4's watts), else ``default``'s
    GPU; the model and MFU are ``default``'s either way."""
    key = gpu_key(gpu_model)
    if key is None or key == default.gpu.name:
        return default
    return ModeledInputs(default.model, GPUS[key], default.mfu)


def emulated_power_rows(
    tracker: CounterTracker,
    node_id: int,
    ts_ms: int,
    stats: Mapping[str, Any],
    inputs: ModeledInputs,
) -> list[dict[str, Any]]:
    """The ``emulated_power_sample`` row of one scrape of ``/v1/stats``: the modeled prefill
    seconds of the tokens the node's cache did not serve since its previous scrape (its
    counters' lookup_tokens - hit_tokens) x the board power. None at a node's first scrape (a
    baseline: no interval yet), nor where either counter is unknown (the next row covers its
    interval). The agents count whole chunks only (a prompt's partial last
    chunk is never looked up), so the prefill emulated is that of whole chunks: the views say
    so. The busy time is at most the interval (a node sent more work than its GPU could do
    in it shows at full power), and the energy and power follow from it, so they never
    disagree. ``inputs``: what
    ``kvctl collect --emulate-power`` assumes of a node without NVML (the prefill rate of the
    model on the GPU at its MFU, the GPU's published board power)."""
    whole = cache_counters(stats).get("all", {})
    series = f"emulated:{node_id}"
    counters = {k: known(whole.get(k)) for k in ("lookup_tokens", "hit_tokens")}
    if None in counters.values():
        # both or no sample: the next row that reads both covers the whole span since the
        # last one, its time and its misses (lookups - hits of that same span). Advancing
        # one alone mixed one span's lookups with two spans' hits, and the skipped span's
        # time was never emulated
        return []
    since_ms = tracker.last_ts_ms(series)
    inc = tracker.increase(series, counters, epoch=stats.get("started_s"), ts_ms=ts_ms)
    looked, hit = inc["lookup_tokens"], inc["hit_tokens"]
    if since_ms is None or ts_ms <= since_ms or looked is None or hit is None:
        return []
    if hit > looked:  # impossible (``hits_beyond_lookups``): cache_rows names it
        return []
    interval_s = (ts_ms - since_ms) / 1000
    # one GPU cannot be busy longer than the interval: cap the time, and energy and power
    # both follow from the capped time
    busy_s = min(inputs.prefill_seconds(max(looked - hit, 0.0)), interval_s)
    energy_j = busy_s * inputs.gpu.board_power_watts
    power_w = energy_j / interval_s
    return [
        {
            "node_id": node_id,
            "gpu_profile": inputs.gpu.name,
            "model": inputs.model.name,
            "ts_ms": ts_ms,
            "lookup_tokens": round(looked),
            "busy_s": busy_s,
            "energy_j": energy_j,
            "power_w": power_w,
        }
    ]


def engine_row(
    tracker: CounterTracker,
    node_id: int,
    ts_ms: int,
    reading: EngineReading,
    previous_ttft: Histogram | None,
    *,
    epoch: float | None = None,
    rejected: Collection[str] = (),
) -> dict[str, Any]:
    """One ``engine_sample`` row. TTFT quantiles cover the requests since ``previous_ttft``
    (None on the first scrape: the quantiles are then unknown rather than all-time).

    ``rejected``: the reading's figures rejected as impossible (``engine_rejected``). One
    counter unknown makes all the engine's counters wait, as an agent's cache counters do:
    none advances at this scrape (the row's counts and TTFT quantiles are unknown), and all
    catch up at the next scrape that reads them all, over the same span. Its figures are read
    over each other (cached over prompt tokens, LMCache hits over lookups, reused over missed
    blocks, TTFT sum over count, prompt tokens over GPU energy): one caught up alone put one
    span's hits over another's lookups (more cached than prompt tokens in a row). One
    unknown at a node's first scrape leaves the next scrape the baseline. The caller keeps
    ``previous_ttft`` (``engine_waits``) so the quantiles cover the same span as the counts.
    A counter the engine does not expose (None in the reading, not rejected) is left out of
    the tracker's series: one that shows later was created since (a labelled counter at its
    first increment), counted from zero."""
    ttft = reading.ttft
    raw: dict[str, float | None] = {
        "prompt_tokens": reading.prompt_tokens,
        "cached_prompt_tokens": reading.cached_prompt_tokens,
        "generation_tokens": reading.generation_tokens,
        "requests": reading.requests,
        "ttft_count": None if ttft is None else ttft.count,
        "ttft_sum_s": None if ttft is None else ttft.sum,
        "lmcache_hit_tokens": reading.lmcache_hit_tokens,
        "lmcache_requested_tokens": reading.lmcache_requested_tokens,
        "kv_reused_blocks": reading.kv_reused_blocks,
        "kv_missed_blocks": reading.kv_missed_blocks,
        "kvbm_matched_tokens": reading.kvbm_matched_tokens,
        "kvbm_offload_host_blocks": reading.kvbm_offload_host_blocks,
        "kvbm_offload_disk_blocks": reading.kvbm_offload_disk_blocks,
        "kvbm_onboard_host_blocks": reading.kvbm_onboard_host_blocks,
        "kvbm_onboard_disk_blocks": reading.kvbm_onboard_disk_blocks,
    }
    waits = engine_waits(rejected)
    inc: Mapping[str, float | None] = {}
    if not waits:
        inc = tracker.increase(
            f"engine:{node_id}",
            {c: v for c, v in raw.items() if v is not None},
            epoch=epoch,
            ts_ms=ts_ms,
            missing_means_unread=reading.missing_means_unread,
        )
    quantiles: dict[str, float | None] = {
        "ttft_p50_s": None,
        "ttft_p90_s": None,
        "ttft_p99_s": None,
    }
    if ttft is not None and previous_ttft is not None and not waits:
        # counted from zero (a restart under a new epoch): the whole histogram is this
        # interval's; otherwise subtract the previous scrape's buckets
        from_zero = inc.get("ttft_count") == ttft.count
        window = ttft if from_zero else histogram_delta(ttft, previous_ttft)
        for q, col in ((0.5, "ttft_p50_s"), (0.9, "ttft_p90_s"), (0.99, "ttft_p99_s")):
            quantiles[col] = histogram_quantile(window, q)
    return {
        "node_id": node_id,
        "ts_ms": ts_ms,
        "engine": reading.engine,
        **{c: inc.get(c) if c == "ttft_sum_s" else _int(inc.get(c)) for c in ENGINE_COUNTERS},
        **quantiles,
        "kv_usage_ratio": reading.kv_usage_ratio,
        "lmcache_local_cache_usage_bytes": reading.lmcache_local_cache_usage_bytes,
    }


def engine_waits(rejected: Collection[str]) -> bool:
    """Whether an engine reading's ``rejected`` figures (``engine_rejected``) make its
    counters wait (``engine_row``): a counter or the TTFT histogram is among them. A gauge
    (KV usage, LMCache's bytes) or the start time is read on its own: nothing waits on it."""
    return "ttft" in rejected or any(c in rejected for c in ENGINE_COUNTERS)


def engine_rejected(rejected: Rejections) -> frozenset[str]:
    """The engine reading's figures among a scrape's ``rejected`` (``collectors.collector.
    checked_engine`` names them ``engine.<field>``; ``engine.ttft.*``: the histogram), by
    ``EngineReading`` field name."""
    return frozenset(
        where.removeprefix("engine.").split(".")[0]
        for where in rejected.fields
        if where.startswith("engine.")
    )
