"""Read an inference engine's ``/metrics`` text into one typed KV-cache reading.

vLLM, SGLang, TensorRT-LLM, LMCache and NVIDIA Dynamo's KV block manager (KVBM) each expose
their own Prometheus names; this module maps the few that matter for KV-cache operations
(prompt, cached and generated tokens, finished requests, cache usage, time to first token,
blocks reused and missed, LMCache hits, KVBM's matched tokens and the blocks it moves between
tiers) onto ``EngineReading``. Names follow the engines' sources: vLLM
``vllm/v1/metrics/loggers.py``, SGLang ``sglang/srt/metrics/collector.py``, LMCache
``lmcache/observability.py``, TensorRT-LLM ``tensorrt_llm/metrics/collector.py`` (main of 2026,
served by trtllm-serve at ``/prometheus/metrics``; its ``/metrics`` is JSON iteration stats,
also read here), KVBM ``lib/llm/src/block_manager/metrics_kvbm.rs`` and the ``kvbm`` names of
``lib/runtime/src/metrics/prometheus_names.rs`` (dynamo-llm 1.1.1; served on
``DYN_KVBM_METRICS_PORT``, default 6880, with the ``kvbm_`` prefix and no ``_total``).

Only counters become figures (their increases between scrapes, across restarts, in
``collectors.rows``). Engines' own hit-rate gauges (``sglang:cache_hit_rate``,
``trtllm_kv_cache_hit_rate``, ``cacheHitRate``, ``kvbm_host_cache_hit_rate``,
``kvbm_disk_cache_hit_rate``) are averages over windows kvctl does not know and are not read.

Counters arrive with or without ``_total`` (prometheus_client adds it, multiprocess mode and
other exporters may not, some proxies re-export them as gauges or untyped), so lookups go by
sample name, never by family name or type. A metric is summed over its label sets (model_name,
engine index, worker), except ratio gauges, which are averaged: vLLM's own logger averages
KV-cache usage across engines, and a sum of two 0.6 usages would read as 1.2.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvctl import json_text

KNOWN_ENGINES: tuple[str, ...] = ("vllm", "sglang", "trtllm", "lmcache", "kvbm")
#: what a figure exposed with a sample that is not finite (NaN, Infinity) reads as: exposed, so
#: the collector rejects it (``collectors.collector.checked_engine``), never "not exposed"
NOT_FINITE = math.nan
#: engines that serve requests (one per endpoint); LMCache and KVBM run inside one of them
_SERVING = {"vllm": "vllm:", "sglang": "sglang:", "trtllm": "trtllm_"}

# vLLM PromptTokenStats.ALL_SOURCES is (local_compute, local_cache_hit, external_kv_transfer);
# the last two are the tokens whose KV was not computed by this prefill.
_CACHED = frozenset({"local_cache_hit", "external_kv_transfer"})

_Labels = Mapping[str, str]
_Samples = list[tuple[_Labels, float]]


class UnknownEngine(ValueError):
    """The text is valid exposition but carries no metric of a known engine."""


class _NotFiniteHistogram:
    """A histogram exposed with a count, sum or bucket that is not finite (no ``Histogram``
    can hold it): ``EngineReading.ttft_not_finite``."""


_NOT_FINITE_HISTOGRAM = _NotFiniteHistogram()


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative Prometheus histogram summed over its label sets."""

    buckets: tuple[tuple[float, float], ...]  # (upper bound `le`, cumulative count), ascending
    sum: float
    count: float

    def __post_init__(self) -> None:
        if not self.buckets:
            raise ValueError("histogram has no buckets")
        bounds = [le for le, _ in self.buckets]
        # `not a < b` also catches NaN bounds
        if any(not a < b for a, b in pairwise(bounds)):
            raise ValueError(f"histogram bounds must be strictly ascending, got {bounds}")
        if bounds[-1] != math.inf:
            raise ValueError("histogram's last bucket must be le=+Inf")
        values = [c for _, c in self.buckets] + [self.sum, self.count]
        if not all(math.isfinite(v) for v in values):
            raise ValueError("histogram counts and sum must be finite")


@dataclass(frozen=True, slots=True)
class EngineReading:
    """One scrape of one engine. Counters are cumulative; None means not exposed, NaN
    (``NOT_FINITE``) exposed with a sample that is not finite."""

    engine: str  # "vllm" | "sglang" | "trtllm" | "lmcache" | "kvbm" (only its metrics present)
    prompt_tokens: float | None
    cached_prompt_tokens: float | None
    generation_tokens: float | None
    requests: float | None  # finished requests
    kv_usage_ratio: float | None  # GPU KV cache usage, 0..1
    ttft: Histogram | None  # time to first token, seconds
    lmcache_hit_tokens: float | None
    lmcache_requested_tokens: float | None
    lmcache_local_cache_usage_bytes: float | None
    #: the engine process's start time (``process_start_time_seconds``): a change means its
    #: counters restarted, even when they have already grown past their old values
    process_start_s: float | None = None
    #: the engine's own KV-cache blocks reused / not found when a request's blocks were
    #: allocated (TensorRT-LLM; a partially reused block counts as reused)
    kv_reused_blocks: float | None = None
    kv_missed_blocks: float | None = None
    #: KVBM: prompt tokens it matched in its host/disk tiers, and blocks it moved: offloaded
    #: device -> host, to disk (host -> disk and device -> disk), onboarded host -> device and
    #: disk -> device (its object-storage tier is not read)
    kvbm_matched_tokens: float | None = None
    kvbm_offload_host_blocks: float | None = None
    kvbm_offload_disk_blocks: float | None = None
    kvbm_onboard_host_blocks: float | None = None
    kvbm_onboard_disk_blocks: float | None = None
    #: the source leaves out counters that keep counting (TensorRT-LLM's JSON stats when idle):
    #: one missing before is a baseline when it shows, not an increase since the engine started
    missing_means_unread: bool = False
    #: the TTFT histogram was exposed with a figure that is not finite (``ttft`` is None)
    ttft_not_finite: bool = False


def parse_engine_metrics(text: str) -> EngineReading:
    """Parse an engine's metrics: Prometheus text exposition, or TensorRT-LLM's JSON iteration
    stats (trtllm-serve's ``/metrics``).

    Raises ``UnknownEngine`` when no metric of a known engine is present and ``ValueError``
    when the text is neither valid exposition nor TensorRT-LLM's JSON.
    """
    if text.lstrip().startswith(("[", "{")):  # exposition lines never start with either
        return _trtllm_iterations_reading(text)
    series = _samples_by_name(text)
    serving = [e for e, prefix in _SERVING.items() if any(n.startswith(prefix) for n in series)]
    if len(serving) > 1:
        # One reading describes one engine; a merged endpoint would mix two token accountings.
        raise ValueError(f"metrics of {' and '.join(serving)} present; scrape one engine at a time")
    side = _SideFields(
        lmcache_hit_tokens=_counter(series, "lmcache:num_hit_tokens"),
        lmcache_requested_tokens=_counter(series, "lmcache:num_requested_tokens"),
        lmcache_local_cache_usage_bytes=_gauge_sum(series, "lmcache:local_cache_usage"),
        kvbm_matched_tokens=_counter(series, "kvbm_matched_tokens"),
        kvbm_offload_host_blocks=_counter(series, "kvbm_offload_blocks_d2h"),
        kvbm_offload_disk_blocks=_counters(
            series, "kvbm_offload_blocks_h2d", "kvbm_offload_blocks_d2d"
        ),
        kvbm_onboard_host_blocks=_counter(series, "kvbm_onboard_blocks_h2d"),
        kvbm_onboard_disk_blocks=_counter(series, "kvbm_onboard_blocks_d2d"),
    )
    if serving == ["vllm"]:
        reading = _vllm_reading(series, side)
    elif serving == ["sglang"]:
        reading = _sglang_reading(series, side)
    elif serving == ["trtllm"]:
        reading = _trtllm_reading(series, side)
    elif any(n.startswith("lmcache:") for n in series):
        reading = _reading("lmcache", side)
    elif any(n.startswith("kvbm_") for n in series):
        reading = _reading("kvbm", side)
    else:
        raise UnknownEngine(f"no metric of a known engine ({', '.join(KNOWN_ENGINES)}) in the text")
    starts = [v for _labels, v in series.get("process_start_time_seconds", [])]
    # several processes (API server, engine cores) behind one endpoint: any restart shows up
    # as a change of the latest start time (unknown when one is not finite: max() of a NaN
    # depends on the order)
    start_s = None
    if starts:
        start_s = max(starts) if all(math.isfinite(v) for v in starts) else NOT_FINITE
    return replace(reading, process_start_s=start_s)


def histogram_delta(current: Histogram, previous: Histogram | None) -> Histogram:
    """Observations between two scrapes of one histogram.

    A fall in the count or in any bucket, or a changed bucket layout, means the engine restarted
    between the scrapes, so everything in ``current`` is new and it is returned as is.
    """
    if previous is None or current.count < previous.count:
        return current
    before = dict(previous.buckets)
    if set(before) != {le for le, _ in current.buckets}:
        return current
    buckets = tuple((le, c - before[le]) for le, c in current.buckets)
    if any(c < 0 for _, c in buckets):
        return current
    return Histogram(
        buckets=buckets, sum=current.sum - previous.sum, count=current.count - previous.count
    )


def histogram_quantile(h: Histogram, q: float) -> float | None:
    """The q-quantile by linear interpolation within a bucket, as PromQL's histogram_quantile.

    The lowest bucket starts at 0 unless its bound is not positive. A quantile in the +Inf bucket
    is the highest finite bound. None when there are no observations or no finite bound.
    """
    if not 0.0 <= q <= 1.0:  # also rejects NaN
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    bounds = [le for le, _ in h.buckets]
    cumulative: list[float] = []
    for _, c in h.buckets:  # cumulative counts can dip when processes race; PromQL clamps too
        cumulative.append(max(c, cumulative[-1]) if cumulative else c)
    total = cumulative[-1]
    if h.count == 0 or total <= 0 or len(bounds) < 2:
        return None
    rank = q * total
    # First bucket holding the rank; requiring c > 0 keeps q=0 off an empty leading bucket.
    b = next(i for i, c in enumerate(cumulative) if c >= rank and c > 0)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = bounds[b - 1] if b > 0 else 0.0
    below = cumulative[b - 1] if b > 0 else 0.0
    return start + (bounds[b] - start) * (rank - below) / (cumulative[b] - below)


def _samples_by_name(text: str) -> dict[str, _Samples]:
    """Every sample in the text keyed by sample name (family names and types are ignored)."""
    series: dict[str, _Samples] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                series.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    except (ValueError, IndexError, KeyError) as exc:
        raise ValueError(f"malformed Prometheus exposition: {exc}") from exc
    return series


def _finite_sum(samples: _Samples, where: Callable[[_Labels], bool] | None = None) -> float:
    picked = [v for labels, v in samples if where is None or where(labels)]
    # A NaN or infinite series makes the total not finite (never a partial sum, which would
    # look like a reset): exposed, and rejected by the collector, not taken for not exposed
    if not all(math.isfinite(v) for v in picked):
        return NOT_FINITE
    return float(sum(picked))


def _counter(
    series: Mapping[str, _Samples], name: str, where: Callable[[_Labels], bool] | None = None
) -> float | None:
    """Sum of a counter exposed as ``name_total`` or, failing that, ``name``."""
    samples = series.get(f"{name}_total") or series.get(name)
    return None if samples is None else _finite_sum(samples, where)


def _counters(series: Mapping[str, _Samples], *names: str) -> float | None:
    """Sum of the counters of ``names`` that are exposed (an older release lacks some); None
    when none is, ``NOT_FINITE`` when one is not finite."""
    values = [_counter(series, n) for n in names if f"{n}_total" in series or n in series]
    if not values:
        return None
    if not all(v is not None and math.isfinite(v) for v in values):
        return NOT_FINITE
    return float(sum(v for v in values if v is not None))


def _gauge_sum(series: Mapping[str, _Samples], name: str) -> float | None:
    samples = series.get(name)
    return None if samples is None else _finite_sum(samples)


def _gauge_mean(series: Mapping[str, _Samples], name: str) -> float | None:
    samples = series.get(name)
    if not samples:
        return None
    return _finite_sum(samples) / len(samples)


def _histogram(series: Mapping[str, _Samples], name: str) -> Histogram | _NotFiniteHistogram | None:
    """A histogram's buckets, sum and count, each summed over the label sets (None: not
    exposed)."""
    bucket_samples = series.get(f"{name}_bucket")
    if bucket_samples is None:
        return None
    groups: dict[frozenset[tuple[str, str]], dict[float, float]] = {}
    for labels, value in bucket_samples:
        try:
            le = float(labels["le"])
        except (KeyError, ValueError):
            raise ValueError(f"{name}_bucket sample without a numeric le label") from None
        if math.isnan(le):
            raise ValueError(f"{name}_bucket has le=NaN")
        key = frozenset((k, v) for k, v in labels.items() if k != "le")
        groups.setdefault(key, {})[le] = value
    if any(math.inf not in group for group in groups.values()):
        raise ValueError(f"{name} has a label set without an le=+Inf bucket")
    # Only bounds every series shares keep the summed counts cumulative.
    shared = set.intersection(*(set(g) for g in groups.values()))
    counts = [sum(g[le] for g in groups.values()) for le in sorted(shared)]
    sums = series.get(f"{name}_sum")
    if sums is None:
        raise ValueError(f"{name} has buckets but no {name}_sum")
    total = _finite_sum(sums)
    count_samples = series.get(f"{name}_count")
    count = counts[-1] if count_samples is None else _finite_sum(count_samples)
    if not all(math.isfinite(v) for v in [total, count, *counts]):
        return _NOT_FINITE_HISTOGRAM
    return Histogram(
        buckets=tuple(zip(sorted(shared), counts, strict=True)), sum=total, count=count
    )


@dataclass(frozen=True, slots=True)
class _SideFields:
    """What LMCache and KVBM expose, running inside the serving engine (or scraped alone)."""

    lmcache_hit_tokens: float | None = None
    lmcache_requested_tokens: float | None = None
    lmcache_local_cache_usage_bytes: float | None = None
    kvbm_matched_tokens: float | None = None
    kvbm_offload_host_blocks: float | None = None
    kvbm_offload_disk_blocks: float | None = None
    kvbm_onboard_host_blocks: float | None = None
    kvbm_onboard_disk_blocks: float | None = None


def _reading(
    engine: str,
    side: _SideFields,
    *,
    prompt_tokens: float | None = None,
    cached_prompt_tokens: float | None = None,
    generation_tokens: float | None = None,
    requests: float | None = None,
    kv_usage_ratio: float | None = None,
    ttft: Histogram | _NotFiniteHistogram | None = None,
    kv_reused_blocks: float | None = None,
    kv_missed_blocks: float | None = None,
) -> EngineReading:
    return EngineReading(
        engine=engine,
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=cached_prompt_tokens,
        generation_tokens=generation_tokens,
        requests=requests,
        kv_usage_ratio=kv_usage_ratio,
        ttft=ttft if isinstance(ttft, Histogram) else None,
        ttft_not_finite=ttft is _NOT_FINITE_HISTOGRAM,
        lmcache_hit_tokens=side.lmcache_hit_tokens,
        lmcache_requested_tokens=side.lmcache_requested_tokens,
        lmcache_local_cache_usage_bytes=side.lmcache_local_cache_usage_bytes,
        kv_reused_blocks=kv_reused_blocks,
        kv_missed_blocks=kv_missed_blocks,
        kvbm_matched_tokens=side.kvbm_matched_tokens,
        kvbm_offload_host_blocks=side.kvbm_offload_host_blocks,
        kvbm_offload_disk_blocks=side.kvbm_offload_disk_blocks,
        kvbm_onboard_host_blocks=side.kvbm_onboard_host_blocks,
        kvbm_onboard_disk_blocks=side.kvbm_onboard_disk_blocks,
    )


def _vllm_reading(series: Mapping[str, _Samples], side: _SideFields) -> EngineReading:
    by_source = "vllm:prompt_tokens_by_source"
    prompt = _counter(series, "vllm:prompt_tokens")
    if prompt is None:
        # vLLM's invariant: the sources sum to the prompt tokens plus the recomputed ones (the
        # last token of a fully cached prompt is computed again and also counted as a hit).
        prompt = _counter(series, by_source)
        recomputed = _counter(series, "vllm:prompt_tokens_recomputed")
        if prompt is not None and recomputed is not None:
            prompt -= recomputed
    if f"{by_source}_total" in series or by_source in series:
        # Counted once per prefill; prefix_cache_hits is recorded at scheduling and can count a
        # request again each time the scheduler retries it.
        cached = _counter(series, by_source, lambda labels: labels.get("source") in _CACHED)
    else:
        # gpu_prefix_cache_hits is the older name; before vLLM PR #18003 it counted blocks.
        cached = _counter(series, "vllm:prefix_cache_hits")
        if cached is None:
            cached = _counter(series, "vllm:gpu_prefix_cache_hits")
    usage = _gauge_mean(series, "vllm:kv_cache_usage_perc")
    if usage is None:
        usage = _gauge_mean(series, "vllm:gpu_cache_usage_perc")
    return _reading(
        "vllm",
        side,
        prompt_tokens=prompt,
        cached_prompt_tokens=cached,
        generation_tokens=_counter(series, "vllm:generation_tokens"),
        requests=_counter(series, "vllm:request_success"),
        kv_usage_ratio=usage,  # a 0..1 fraction despite the _perc suffix
        ttft=_histogram(series, "vllm:time_to_first_token_seconds"),
    )


def _sglang_reading(series: Mapping[str, _Samples], side: _SideFields) -> EngineReading:
    return _reading(
        "sglang",
        side,
        prompt_tokens=_counter(series, "sglang:prompt_tokens"),
        cached_prompt_tokens=_counter(series, "sglang:cached_tokens"),
        generation_tokens=_counter(series, "sglang:generation_tokens"),
        requests=_counter(series, "sglang:num_requests"),
        kv_usage_ratio=_gauge_mean(series, "sglang:token_usage"),
        ttft=_histogram(series, "sglang:time_to_first_token_seconds"),
    )


def _trtllm_reading(series: Mapping[str, _Samples], side: _SideFields) -> EngineReading:
    usage = _gauge_mean(series, "trtllm_kv_cache_utilization")
    if usage is None:  # the block gauges it is computed from
        used = _gauge_sum(series, "trtllm_kv_cache_used_blocks")
        total = _gauge_sum(series, "trtllm_kv_cache_max_blocks")
        usage = used / total if used is not None and total else None
        if usage is not None and total is not None and not math.isfinite(total):
            usage = NOT_FINITE  # not 0: used blocks over an infinite pool are no figure
    return _reading(
        "trtllm",
        side,
        prompt_tokens=_counter(series, "trtllm_prompt_tokens"),
        cached_prompt_tokens=_counter(series, "trtllm_prompt_cached_tokens"),
        generation_tokens=_counter(series, "trtllm_generation_tokens"),
        requests=_counter(series, "trtllm_request_success"),
        kv_usage_ratio=usage,
        ttft=_histogram(series, "trtllm_time_to_first_token_seconds"),
        kv_reused_blocks=_counter(series, "trtllm_kv_cache_reused_blocks"),
        kv_missed_blocks=_counter(series, "trtllm_kv_cache_missed_blocks"),
    )


#: keys every TensorRT-LLM iteration-stats entry has some of (IterationStats' JSON)
_ITERATION_KEYS = frozenset(
    {"iter", "iterLatencyMS", "kvCacheStats", "numActiveRequests", "gpuMemUsage", "timestamp"}
)


def _trtllm_iterations_reading(text: str) -> EngineReading:
    """trtllm-serve's ``/metrics`` (``enable_iter_perf_stats``): a JSON list of the iteration
    stats queued since the last read, oldest first. ``kvCacheStats`` carries cumulative block
    counters (``reusedBlocks``, ``missedBlocks``) and the pool's block gauges; the newest
    iteration's are this scrape's. No iteration since the last read: nothing is known."""
    try:
        data = json_text.loads(text)
    except ValueError as exc:
        raise ValueError(f"malformed TensorRT-LLM iteration stats: {exc}") from None
    entries = data if isinstance(data, list) else [data]
    if not all(isinstance(e, dict) for e in entries):
        raise ValueError("malformed TensorRT-LLM iteration stats: not a list of objects")
    if entries and not any(_ITERATION_KEYS & e.keys() for e in entries):
        raise UnknownEngine("JSON without TensorRT-LLM's iteration stats")
    # compared, not hashed: a rank that is a list or an object is another rank, not a crash
    ranks = [e.get("attentionDpRank", 0) for e in entries]
    if any(r != ranks[0] for r in ranks):
        # each rank counts its own blocks; one rank's latest entry would read as a reset
        raise ValueError(
            "iteration stats of several attention-DP ranks; scrape trtllm-serve's "
            "/prometheus/metrics instead"
        )
    with_kv = [e for e in entries if isinstance(e.get("kvCacheStats"), dict)]
    if not with_kv:
        return replace(_reading("trtllm", _SideFields()), missing_means_unread=True)
    kv: dict[str, Any] = with_kv[-1]["kvCacheStats"]
    used, total = _json_count(kv, "usedNumBlocks"), _json_count(kv, "maxNumBlocks")
    usage = None
    if used is not None and total is not None:
        # a bad count makes the ratio bad too (rejected by name), not unknown
        # (an infinite total too: used / inf would read as an empty cache, and be kept)
        usage = used / total if 0 < total < math.inf else (NOT_FINITE if total != 0 else None)
    reading = _reading(
        "trtllm",
        _SideFields(),
        kv_usage_ratio=usage,
        kv_reused_blocks=_json_count(kv, "reusedBlocks"),
        kv_missed_blocks=_json_count(kv, "missedBlocks"),
    )
    return replace(reading, missing_means_unread=True)


def _json_count(obj: Mapping[str, Any], key: str) -> float | None:
    """``obj[key]`` as a float; None where it is absent. A value that is not a count (a
    string, a boolean, NaN, below zero) is not a reason to drop the entry's other figures: it
    reads as exposed but not finite, or as the negative number it is, and the collector
    rejects that figure alone by name (``checked_engine``), as for Prometheus samples."""
    value = obj.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return NOT_FINITE
    try:
        return float(value)
    except OverflowError:  # an int past float's range
        return math.inf
