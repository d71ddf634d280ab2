"""The checks on what agents report (kvctl.db.sample_checks): whatever an agent answers, the
figures that reach rows are finite, in range and storable, a sound answer passes unchanged, and
each impossible figure is named once, by where it was, with why."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.collector import checked_engine
from collectors.engines import parse_engine_metrics
from collectors.rows import cache_rows, engine_rejected, engine_waits, plan_rows, power_rows
from kvctl.counters import CounterTracker
from kvctl.db.sample_checks import (
    MAX_MAGNITUDE,
    Rejections,
    checked_gpus,
    checked_probe,
    checked_stats,
    count,
    known,
    ratio,
)
from kvctl.wire.stats import cache_counters

#: what JSON from an agent may hold where a number belongs
ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(), max_size=2),
)


def _sound_stats() -> dict[str, Any]:
    tier = {
        "hits": 2,
        "hit_tokens": 512,
        "reuse_hits": 0,
        "sharing_hits": 2,
        "puts": 3,
        "bytes_written": 12288,
        "bytes_read": 0,
        "promotions": 0,
        "demotions": 0,
        "evictions": {"capacity": 1, "flush": 0},
    }
    return {
        "stats": {
            "lookups": 1,
            "lookup_chunks": 3,
            "lookup_tokens": 768,
            "hit_chunks": 2,
            "hit_tokens": 512,
            "reuse_hits": 0,
            "sharing_hits": 2,
            "hit_ratio": 0.67,
            "drops": 1,
            "tiers": {"cpu": tier, "disk": {**copy.deepcopy(tier), "hits": 0}},
        },
        "usage": {
            "cpu": {"capacity_bytes": 1 << 30, "used_bytes": 12288, "pinned_bytes": 0, "chunks": 3},
            "disk": {"capacity_bytes": 1 << 33, "used_bytes": 0, "pinned_bytes": 0, "chunks": 0},
        },
        "started_s": 1_795_960_450.1,
        "fetch_plans": {
            "plans": {"recompute_s": 0.5, "fetch_s": 0.1, "fetch_chunks": 2, "recompute_chunks": 1}
        },
    }


def _storable(v: object, *, high: float = MAX_MAGNITUDE) -> bool:
    return (
        isinstance(v, int | float)
        and not isinstance(v, bool)
        and (isinstance(v, int) or math.isfinite(v))
        and 0 <= v <= high
    )


@settings(max_examples=300)
@given(ANYTHING)
def test_a_count_is_storable_or_unknown_and_rejected(value: object) -> None:
    rejected = Rejections()
    out = count(value, "f", rejected)
    if value is None:
        assert out is None and not rejected
    elif out is None:
        assert list(rejected.fields) == ["f"]
    else:
        assert out == value and _storable(out) and not rejected


@settings(max_examples=300)
@given(ANYTHING)
def test_a_ratio_is_in_0_1_or_unknown_and_rejected(value: object) -> None:
    rejected = Rejections()
    out = ratio(value, "f", rejected)
    assert out is None or (_storable(out, high=1) and out == value)
    assert len(rejected) == (value is not None and out is None)


def test_the_reasons_say_why_never_the_value() -> None:
    rejected = Rejections()
    for i, v in enumerate([math.nan, math.inf, -1, 10**30, "12", True]):
        count(v, f"f{i}", rejected)
    ratio(3.5, "r", rejected)
    assert rejected.fields == {
        "f0": "not finite",
        "f1": "not finite",
        "f2": "negative",
        "f3": "beyond BIGINT",
        "f4": "not a number",
        "f5": "not a number",
        "r": "above 1",
    }
    assert rejected.summary(2) == "f0 (not finite), f1 (not finite) and 5 more"


def test_a_sound_answer_passes_unchanged() -> None:
    stats = _sound_stats()
    checked, rejected = checked_stats(copy.deepcopy(stats))
    assert not rejected
    assert cache_counters(checked) == cache_counters(stats)
    assert checked["usage"] == stats["usage"] and checked["started_s"] == stats["started_s"]
    assert checked["fetch_plans"] == stats["fetch_plans"]
    gpus = {"nvml": {"available": True}, "gpus": [{"index": 0, "power_w": 300.5, "energy_j": 9}]}
    checked_g, rejected = checked_gpus(gpus)
    assert not rejected and checked_g["gpus"][0]["power_w"] == 300.5


#: where a number sits in /v1/stats, as (path, how the collector reads it)
_STATS_LEAVES = [
    *((("stats", c), "count") for c in ("lookup_chunks", "lookup_tokens", "drops", "hit_tokens")),
    (("stats", "tiers", "cpu", "bytes_read"), "count"),
    (("stats", "tiers", "disk", "evictions", "capacity"), "count"),
    (("usage", "cpu", "used_bytes"), "count"),
    (("usage", "disk", "capacity_bytes"), "count"),
    (("fetch_plans", "plans", "recompute_s"), "count"),
    (("started_s",), "count"),
]


def _set(obj: dict[str, Any], path: tuple[str, ...], value: object) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


@settings(max_examples=300)
@given(st.lists(st.tuples(st.sampled_from(_STATS_LEAVES), ANYTHING), max_size=6))
def test_any_stats_answer_makes_finite_storable_rows(
    changes: list[tuple[tuple[tuple[str, ...], str], object]],
) -> None:
    """Rows from any answer (after a sound one: the counters' baseline) hold storable numbers
    or NULL, and each leaf set to an impossible value is rejected, by its path."""
    stats = _sound_stats()
    bad = set()
    for (path, _kind), value in changes:
        _set(stats, path, value)
        if value is None or not _storable(value):
            bad.add(".".join(path))
        else:
            bad.discard(".".join(path))
    # a JSON round trip, as the agent's answer takes (NaN and Infinity included)
    stats = json.loads(json.dumps(stats))
    tracker = CounterTracker()
    first, _ = checked_stats(_sound_stats())
    cache_rows(tracker, 1, 1_000, first)
    plan_rows(tracker, 1, 1_000, first)
    checked, rejected = checked_stats(stats)
    # a plan counter or the start time absent is unreported, not impossible
    absent_ok = {"fetch_plans.plans.recompute_s", "started_s"}
    want = {b for b in bad if not (b in absent_ok and _get(stats, b) is None)}
    assert set(rejected.fields) == want
    rows = cache_rows(tracker, 1, 2_000, checked) + plan_rows(tracker, 1, 2_000, checked)
    for row in rows:
        for k, v in row.items():
            assert v is None or isinstance(v, str) or (_storable(v) or k == "saved_s"), (k, v)
            if isinstance(v, float):
                assert math.isfinite(v)


def _get(obj: Any, dotted: str) -> Any:
    for k in dotted.split("."):
        obj = obj.get(k)
    return obj


@settings(max_examples=200)
@given(st.lists(st.dictionaries(st.sampled_from(["index", "power_w", "energy_j",
       "utilization_ratio", "memory_used_bytes"]), ANYTHING), max_size=3) | ANYTHING)  # fmt: skip
def test_any_gpus_answer_makes_storable_power_rows(readings: object) -> None:
    gpus, _rejected = checked_gpus({"nvml": {"available": True}, "gpus": readings})
    tracker = CounterTracker()
    for ts in (1_000, 2_000):
        for row in power_rows(tracker, 1, ts, gpus):
            for k in ("power_w", "energy_j", "memory_used_bytes"):
                assert row[k] is None or _storable(row[k])
            assert row["utilization_ratio"] is None or _storable(row["utilization_ratio"], high=1)


def test_a_tier_name_too_long_for_its_column_makes_the_node_total_wait() -> None:
    """PostgreSQL refuses a tier name past the column's 16 characters (the whole batch): the
    tier is rejected, and the node's total, which counted it, is unknown for this scrape."""
    stats = _sound_stats()
    stats["stats"]["tiers"]["x" * 40] = stats["stats"]["tiers"]["cpu"]
    stats["usage"]["x" * 40] = stats["usage"]["cpu"]
    checked, rejected = checked_stats(stats)
    assert "stats.tiers.xxxxxxxxxxxxxxxx..." in rejected.fields
    rows = cache_rows(CounterTracker(), 1, 1_000, checked)
    assert sorted(r["tier"] for r in rows) == ["cpu", "disk"]


def test_an_answer_missing_what_the_collector_reads_is_rejected_not_a_crash() -> None:
    checked, rejected = checked_stats({"stats": [], "usage": None})
    assert rejected.fields["stats"] == "not an object"
    assert rejected.fields["usage"] == "missing"
    assert rejected.fields["stats.lookup_chunks"] == "missing"
    assert cache_rows(CounterTracker(), 1, 1_000, checked) == []


def test_a_gpus_answer_of_the_wrong_shape_is_rejected_not_a_crash() -> None:
    gpus, rejected = checked_gpus({"nvml": 5, "gpus": [7, {"index": "0"}, {"index": 1}]})
    assert gpus == {"nvml": {}, "gpus": [{"index": 1, **dict.fromkeys(GPU_FIELDS)}]}
    assert rejected.fields == {
        "gpus.nvml": "not an object",
        "gpus[0]": "not an object",
        "gpus[1].index": "not a GPU index",
    }


GPU_FIELDS = ("power_w", "energy_j", "memory_used_bytes", "memory_total_bytes", "utilization_ratio")


def test_a_probe_and_an_engine_reading_are_checked_too() -> None:
    rejected = Rejections()
    probe = checked_probe(
        {"rtt_s": math.nan, "bandwidth_bytes_per_s": -1.0, "loss_ratio": 3.5}, rejected
    )
    assert probe == {
        "rtt_s": None,
        "bandwidth_bytes_per_s": None,
        "loss_ratio": None,
        "error": None,
    }
    assert set(rejected.fields) == {
        "probe.rtt_s",
        "probe.bandwidth_bytes_per_s",
        "probe.loss_ratio",
    }
    text = (
        "# TYPE vllm:prompt_tokens_total counter\n"
        'vllm:prompt_tokens_total{model_name="m"} -5\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 3.5\n'
    )
    rejected = Rejections()
    reading = checked_engine(parse_engine_metrics(text), rejected)
    assert reading.prompt_tokens is None and reading.kv_usage_ratio is None
    assert set(rejected.fields) == {"engine.prompt_tokens", "engine.kv_usage_ratio"}


def test_an_engine_figure_not_finite_is_rejected_not_taken_for_not_exposed() -> None:
    """Before, the parser read a NaN or Infinity counter as not exposed: nothing rejected,
    nothing waiting, and the counter counted from zero when it came back."""
    text = (
        "# TYPE vllm:prompt_tokens_total counter\n"
        'vllm:prompt_tokens_total{model_name="m"} 100\n'
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} NaN\n'
        "# TYPE vllm:generation_tokens_total counter\n"
        'vllm:generation_tokens_total{model_name="m"} +Inf\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{model_name="m"} NaN\n'
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 1\n'
        'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2\n'
        'vllm:time_to_first_token_seconds_count{model_name="m"} 2\n'
        'vllm:time_to_first_token_seconds_sum{model_name="m"} NaN\n'
    )
    rejected = Rejections()
    reading = checked_engine(parse_engine_metrics(text), rejected)
    assert reading.prompt_tokens == 100
    assert reading.cached_prompt_tokens is None and reading.generation_tokens is None
    assert reading.kv_usage_ratio is None and reading.ttft is None
    assert rejected.fields == {
        "engine.cached_prompt_tokens": "not finite",
        "engine.generation_tokens": "not finite",
        "engine.kv_usage_ratio": "not finite",
        "engine.ttft": "not finite",
    }
    # the counters and the histogram make the row's counters wait; not exposed is no rejection
    assert engine_waits(engine_rejected(rejected))
    quiet = Rejections()
    checked_engine(parse_engine_metrics('vllm:prompt_tokens_total{model_name="m"} 1\n'), quiet)
    assert not quiet


def test_known_reads_unknown_as_none() -> None:
    assert known(math.nan) is None and known(None) is None and known(3) == 3
