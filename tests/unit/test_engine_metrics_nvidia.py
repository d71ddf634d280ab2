"""NVIDIA engines' KV-cache metrics: TensorRT-LLM (Prometheus at trtllm-serve's
/prometheus/metrics, and the JSON iteration stats of its /metrics) and Dynamo's KV block manager
(KVBM, its own /metrics) read into one reading; the engines' hit-rate gauges are never read.
test_engine_rows_nvidia.py turns these readings' counters into increases."""

# Exposition lines are fixtures in the engines' output format and cannot be wrapped.
# ruff: noqa: E501

from __future__ import annotations

import json
import math

import pytest

from collectors.collector import checked_engine
from collectors.engines import KNOWN_ENGINES, Histogram, UnknownEngine, parse_engine_metrics
from kvctl.db.sample_checks import Rejections

# KVBM as dynamo-llm 1.1.1 serves it on DYN_KVBM_METRICS_PORT: Rust prometheus, no labels, no
# _total, integer counters; the sliding-window hit rates are gauges.
KVBM = """\
# HELP kvbm_disk_cache_hit_rate Disk cache hit rate (0.0-1.0) from the sliding window
# TYPE kvbm_disk_cache_hit_rate gauge
kvbm_disk_cache_hit_rate 0.125
# HELP kvbm_host_cache_hit_rate Host cache hit rate (0.0-1.0) from the sliding window
# TYPE kvbm_host_cache_hit_rate gauge
kvbm_host_cache_hit_rate 0.6
# HELP kvbm_matched_tokens The number of matched tokens
# TYPE kvbm_matched_tokens counter
kvbm_matched_tokens {matched}
# HELP kvbm_object_cache_hit_rate Object storage cache hit rate (0.0-1.0) from the sliding window
# TYPE kvbm_object_cache_hit_rate gauge
kvbm_object_cache_hit_rate 0
# HELP kvbm_object_read_failures The number of failed object storage read operations (blocks)
# TYPE kvbm_object_read_failures counter
kvbm_object_read_failures 0
# HELP kvbm_offload_blocks_d2d The number of offload blocks from device to disk (bypassing host memory)
# TYPE kvbm_offload_blocks_d2d counter
kvbm_offload_blocks_d2d {d2d_off}
# HELP kvbm_offload_blocks_d2h The number of offload blocks from device to host
# TYPE kvbm_offload_blocks_d2h counter
kvbm_offload_blocks_d2h {d2h}
# HELP kvbm_offload_blocks_d2o The number of offload blocks from device to object storage
# TYPE kvbm_offload_blocks_d2o counter
kvbm_offload_blocks_d2o 0
# HELP kvbm_offload_blocks_h2d The number of offload blocks from host to disk
# TYPE kvbm_offload_blocks_h2d counter
kvbm_offload_blocks_h2d {h2d_off}
# HELP kvbm_onboard_blocks_d2d The number of onboard blocks from disk to device
# TYPE kvbm_onboard_blocks_d2d counter
kvbm_onboard_blocks_d2d {d2d_on}
# HELP kvbm_onboard_blocks_h2d The number of onboard blocks from host to device
# TYPE kvbm_onboard_blocks_h2d counter
kvbm_onboard_blocks_h2d {h2d_on}
# HELP kvbm_onboard_blocks_o2d The number of onboard blocks from object storage to device
# TYPE kvbm_onboard_blocks_o2d counter
kvbm_onboard_blocks_o2d 0
"""
KVBM_1 = {"matched": 81920, "d2h": 2048, "h2d_off": 640, "d2d_off": 0, "h2d_on": 1200, "d2d_on": 80}

# An earlier KVBM (before direct device -> disk offload and the object tier): fewer counters.
KVBM_EARLY = """\
# HELP kvbm_matched_tokens The number of matched tokens
# TYPE kvbm_matched_tokens counter
kvbm_matched_tokens 4096
# HELP kvbm_offload_blocks_d2h The number of offload blocks from device to host
# TYPE kvbm_offload_blocks_d2h counter
kvbm_offload_blocks_d2h 512
# HELP kvbm_offload_blocks_h2d The number of offload blocks from host to disk
# TYPE kvbm_offload_blocks_h2d counter
kvbm_offload_blocks_h2d 128
# HELP kvbm_onboard_blocks_h2d The number of onboard blocks from host to device
# TYPE kvbm_onboard_blocks_h2d counter
kvbm_onboard_blocks_h2d 200
# HELP kvbm_onboard_blocks_d2d The number of onboard blocks from disk to device
# TYPE kvbm_onboard_blocks_d2d counter
kvbm_onboard_blocks_d2d 56
# HELP kvbm_host_cache_hit_rate Host cache hit rate (0.0-1.0) from the sliding window
# TYPE kvbm_host_cache_hit_rate gauge
kvbm_host_cache_hit_rate 0.4
"""

# trtllm-serve's /prometheus/metrics (tensorrt_llm/metrics/collector.py, prometheus_client with
# _created samples), labels as trtllm-serve sets them.
TRTLLM = """\
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds {start}
# HELP trtllm_request_success_total Count of successfully processed requests.
# TYPE trtllm_request_success_total counter
trtllm_request_success_total{{engine_type="trtllm",finished_reason="stop",model_name="Qwen/Qwen3-8B"}} {stop}
trtllm_request_success_total{{engine_type="trtllm",finished_reason="length",model_name="Qwen/Qwen3-8B"}} 6.0
# HELP trtllm_request_success_created Count of successfully processed requests.
# TYPE trtllm_request_success_created gauge
trtllm_request_success_created{{engine_type="trtllm",finished_reason="stop",model_name="Qwen/Qwen3-8B"}} 1.7947e+09
# HELP trtllm_time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE trtllm_time_to_first_token_seconds histogram
trtllm_time_to_first_token_seconds_bucket{{engine_type="trtllm",le="0.04",model_name="Qwen/Qwen3-8B"}} 10.0
trtllm_time_to_first_token_seconds_bucket{{engine_type="trtllm",le="0.1",model_name="Qwen/Qwen3-8B"}} 60.0
trtllm_time_to_first_token_seconds_bucket{{engine_type="trtllm",le="0.5",model_name="Qwen/Qwen3-8B"}} 100.0
trtllm_time_to_first_token_seconds_bucket{{engine_type="trtllm",le="+Inf",model_name="Qwen/Qwen3-8B"}} 106.0
trtllm_time_to_first_token_seconds_count{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} 106.0
trtllm_time_to_first_token_seconds_sum{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} 9.25
# HELP trtllm_prompt_tokens_total Cumulative number of prompt (input) tokens processed.
# TYPE trtllm_prompt_tokens_total counter
trtllm_prompt_tokens_total{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} {prompt}
# HELP trtllm_generation_tokens_total Cumulative number of generation (output) tokens produced.
# TYPE trtllm_generation_tokens_total counter
trtllm_generation_tokens_total{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} 21200.0
# HELP trtllm_prompt_cached_tokens_total Process-lifetime total prompt tokens served from KV cache.
# TYPE trtllm_prompt_cached_tokens_total counter
trtllm_prompt_cached_tokens_total{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} {cached}
# HELP trtllm_kv_cache_hit_rate KV cache hit rate
# TYPE trtllm_kv_cache_hit_rate gauge
trtllm_kv_cache_hit_rate{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} 0.97
# HELP trtllm_kv_cache_reused_blocks_total Cumulative number of KV cache blocks reused (cache hits)
# TYPE trtllm_kv_cache_reused_blocks_total counter
trtllm_kv_cache_reused_blocks_total{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} {reused}
# HELP trtllm_kv_cache_reused_blocks_created Cumulative number of KV cache blocks reused (cache hits)
# TYPE trtllm_kv_cache_reused_blocks_created gauge
trtllm_kv_cache_reused_blocks_created{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} 1.7947e+09
# HELP trtllm_kv_cache_missed_blocks_total Cumulative number of KV cache blocks missed (cache misses)
# TYPE trtllm_kv_cache_missed_blocks_total counter
trtllm_kv_cache_missed_blocks_total{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} {missed}
# HELP trtllm_kv_cache_utilization KV cache utilization
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} 0.3125
# HELP trtllm_kv_cache_max_blocks Maximum number of KV cache blocks
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} 4096.0
# HELP trtllm_kv_cache_used_blocks Number of used KV cache blocks
# TYPE trtllm_kv_cache_used_blocks gauge
trtllm_kv_cache_used_blocks{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} 1280.0
# HELP trtllm_kv_cache_tokens_per_block Number of tokens per KV cache block
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{{engine_type="trtllm",model_name="Qwen/Qwen3-8B"}} 32.0
"""
TRTLLM_1 = {
    "start": 1.7947e09,
    "stop": 100.0,
    "prompt": 409600.0,
    "cached": 380000.0,
    "reused": 11875.0,
    "missed": 925.0,
}

# TensorRT-LLM 1.1 behind Dynamo's worker endpoint: its five basic metrics, no KV counters.
TRTLLM_IN_DYNAMO = """\
# HELP trtllm_request_success_total Count of successfully processed requests.
# TYPE trtllm_request_success_total counter
trtllm_request_success_total{dynamo_component="tensorrt_llm",finished_reason="stop",model_name="Qwen/Qwen3-0.6B"} 12
# HELP trtllm_time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE trtllm_time_to_first_token_seconds histogram
trtllm_time_to_first_token_seconds_bucket{dynamo_component="tensorrt_llm",model_name="Qwen/Qwen3-0.6B",le="0.1"} 11
trtllm_time_to_first_token_seconds_bucket{dynamo_component="tensorrt_llm",model_name="Qwen/Qwen3-0.6B",le="+Inf"} 12
trtllm_time_to_first_token_seconds_sum{dynamo_component="tensorrt_llm",model_name="Qwen/Qwen3-0.6B"} 0.61
trtllm_time_to_first_token_seconds_count{dynamo_component="tensorrt_llm",model_name="Qwen/Qwen3-0.6B"} 12
# HELP dynamo_component_requests_total Total requests processed
# TYPE dynamo_component_requests_total counter
dynamo_component_requests_total{dynamo_component="backend",dynamo_endpoint="generate"} 12
"""


def trtllm_iterations(*entries: tuple[int, int, int, int]) -> str:
    """trtllm-serve's /metrics: (iter, reusedBlocks, missedBlocks, usedNumBlocks) per entry,
    each shaped as its documented IterationStats JSON."""
    return json.dumps(
        [
            {
                "cpuMemUsage": 0,
                "gpuMemUsage": 76665782272,
                "inflightBatchingStats": {
                    "avgNumDecodedTokensPerIter": 1.0,
                    "microBatchId": 0,
                    "numContextRequests": 0,
                    "numCtxTokens": 0,
                    "numGenRequests": 1,
                    "numPausedRequests": 0,
                    "numScheduledRequests": 1,
                },
                "iter": it,
                "iterLatencyMS": 7.00688362121582,
                "kvCacheStats": {
                    "allocNewBlocks": missed + 5,
                    "allocTotalBlocks": reused + missed + 5,
                    "cacheHitRate": reused / (reused + missed) if reused + missed else 0.0,
                    "freeNumBlocks": 101256 - used,
                    "maxNumBlocks": 101256,
                    "missedBlocks": missed,
                    "reusedBlocks": reused,
                    "tokensPerBlock": 32,
                    "usedNumBlocks": used,
                },
                "maxBatchSizeRuntime": 2048,
                "maxNumActiveRequests": 2048,
                "newActiveRequestsQueueLatencyMS": 0.0,
                "numActiveRequests": 1,
                "numCompletedRequests": 0,
                "numNewActiveRequests": 0,
                "numQueuedRequests": 0,
                "pinnedMemUsage": 0,
                "staticBatchingStats": None,
                "timestamp": "01-27-2026 10:15:42",
            }
            for it, reused, missed, used in entries
        ],
        indent=4,
    )


def test_the_engines_known() -> None:
    assert KNOWN_ENGINES == ("vllm", "sglang", "trtllm", "lmcache", "kvbm")


# --- KVBM -----------------------------------------------------------------------------------


def test_kvbm_alone() -> None:
    r = parse_engine_metrics(KVBM.format(**KVBM_1))
    assert r.engine == "kvbm"
    assert r.kvbm_matched_tokens == 81920
    assert (r.kvbm_offload_host_blocks, r.kvbm_offload_disk_blocks) == (2048, 640)
    assert (r.kvbm_onboard_host_blocks, r.kvbm_onboard_disk_blocks) == (1200, 80)
    # the serving engine's figures are not KVBM's to report
    assert (r.prompt_tokens, r.cached_prompt_tokens, r.requests, r.ttft) == (None,) * 4
    assert r.kv_usage_ratio is None and r.process_start_s is None


def test_kvbm_disk_offload_counts_both_paths_to_disk() -> None:
    r = parse_engine_metrics(KVBM.format(**{**KVBM_1, "h2d_off": 640, "d2d_off": 96}))
    assert r.kvbm_offload_disk_blocks == 736  # host -> disk and device -> disk


def test_an_earlier_kvbm_without_direct_disk_offload() -> None:
    r = parse_engine_metrics(KVBM_EARLY)
    assert r.engine == "kvbm"
    assert (r.kvbm_matched_tokens, r.kvbm_offload_host_blocks) == (4096, 512)
    assert r.kvbm_offload_disk_blocks == 128
    assert (r.kvbm_onboard_host_blocks, r.kvbm_onboard_disk_blocks) == (200, 56)


def test_kvbm_hit_rate_gauges_are_not_read() -> None:
    text = "# TYPE kvbm_host_cache_hit_rate gauge\nkvbm_host_cache_hit_rate 0.6\n"
    r = parse_engine_metrics(text)
    assert r.engine == "kvbm"
    figures = set(r.__dataclass_fields__) - {"engine", "missing_means_unread", "ttft_not_finite"}
    values = [getattr(r, f) for f in sorted(figures)]
    assert values == [None] * len(values)


def test_kvbm_counters_with_total_as_a_federating_proxy_writes_them() -> None:
    text = "kvbm_matched_tokens_total 10\nkvbm_offload_blocks_h2d_total 3\n"
    r = parse_engine_metrics(text)
    assert (r.kvbm_matched_tokens, r.kvbm_offload_disk_blocks) == (10, 3)


def test_kvbm_nan_disk_counter_makes_the_disk_offload_unknown() -> None:
    text = KVBM.format(**KVBM_1).replace("kvbm_offload_blocks_d2d 0", "kvbm_offload_blocks_d2d NaN")
    r = parse_engine_metrics(text)
    # not h2d alone (that would read as a reset): not finite, so the collector rejects it
    assert r.kvbm_offload_disk_blocks is not None and math.isnan(r.kvbm_offload_disk_blocks)
    assert r.kvbm_offload_host_blocks == 2048
    rejected = Rejections()
    assert checked_engine(r, rejected).kvbm_offload_disk_blocks is None
    assert rejected.fields == {"engine.kvbm_offload_disk_blocks": "not finite"}


def test_kvbm_next_to_vllm_on_one_endpoint() -> None:
    text = (
        'vllm:prompt_tokens_total{engine="0",model_name="m"} 5000\n'
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 1000\n'
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 4000\n'
        + KVBM.format(**KVBM_1)
    )
    r = parse_engine_metrics(text)
    assert (r.engine, r.prompt_tokens, r.cached_prompt_tokens) == ("vllm", 5000, 4000)
    assert (r.kvbm_matched_tokens, r.kvbm_onboard_host_blocks) == (81920, 1200)


# --- TensorRT-LLM, Prometheus -----------------------------------------------------------------


def test_trtllm_prometheus() -> None:
    r = parse_engine_metrics(TRTLLM.format(**TRTLLM_1))
    assert r.engine == "trtllm"
    assert (r.prompt_tokens, r.cached_prompt_tokens) == (409600, 380000)
    assert (r.generation_tokens, r.requests) == (21200, 106)
    assert (r.kv_reused_blocks, r.kv_missed_blocks) == (11875, 925)
    assert r.kv_usage_ratio == 0.3125  # the utilization gauge, not the hit rate's 0.97
    assert r.ttft == Histogram(
        buckets=((0.04, 10.0), (0.1, 60.0), (0.5, 100.0), (math.inf, 106.0)), sum=9.25, count=106.0
    )
    assert r.process_start_s == 1.7947e09
    assert r.kvbm_matched_tokens is None and r.lmcache_hit_tokens is None


def test_trtllm_usage_from_the_block_gauges_without_utilization() -> None:
    text = "\n".join(
        line
        for line in TRTLLM.format(**TRTLLM_1).splitlines()
        if "kv_cache_utilization" not in line
    )
    assert parse_engine_metrics(text).kv_usage_ratio == 1280 / 4096


def test_trtllm_behind_dynamo_reports_what_it_exposes() -> None:
    r = parse_engine_metrics(TRTLLM_IN_DYNAMO)
    assert (r.engine, r.requests) == ("trtllm", 12)
    assert r.ttft is not None and r.ttft.count == 12
    assert (r.prompt_tokens, r.kv_reused_blocks, r.kv_usage_ratio) == (None, None, None)


def test_trtllm_with_kvbm_on_one_endpoint() -> None:
    r = parse_engine_metrics(TRTLLM.format(**TRTLLM_1) + KVBM.format(**KVBM_1))
    assert (r.engine, r.kv_reused_blocks, r.kvbm_onboard_disk_blocks) == ("trtllm", 11875, 80)


def test_trtllm_next_to_another_serving_engine_is_refused() -> None:
    text = TRTLLM.format(**TRTLLM_1) + 'sglang:prompt_tokens_total{model_name="m"} 5\n'
    with pytest.raises(ValueError, match="sglang and trtllm present; scrape one engine"):
        parse_engine_metrics(text)


# --- TensorRT-LLM, JSON iteration stats -------------------------------------------------------


def test_trtllm_iteration_stats_read_the_newest_iteration() -> None:
    r = parse_engine_metrics(trtllm_iterations((153, 3, 3120, 2), (154, 4, 3121, 3)))
    assert r.engine == "trtllm"
    assert (r.kv_reused_blocks, r.kv_missed_blocks) == (4, 3121)
    assert r.kv_usage_ratio == 3 / 101256
    # no token counts in the iteration stats: not derived from blocks x tokensPerBlock
    assert (r.prompt_tokens, r.cached_prompt_tokens, r.requests, r.ttft) == (None,) * 4


def test_trtllm_iteration_stats_of_one_iteration_as_an_object() -> None:
    entry = json.loads(trtllm_iterations((7, 1, 2, 3)))[0]
    r = parse_engine_metrics(json.dumps(entry))
    assert (r.kv_reused_blocks, r.kv_missed_blocks) == (1, 2)


def test_trtllm_no_iteration_since_the_last_read_is_unknown_not_zero() -> None:
    r = parse_engine_metrics("[]")
    assert r.engine == "trtllm"
    assert (r.kv_reused_blocks, r.kv_missed_blocks, r.kv_usage_ratio) == (None, None, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[{"iter": 1, "kvCacheStats": {"reusedBlocks": 3', "malformed TensorRT-LLM"),
        ("[1, 2]", "not a list of objects"),
        (
            '[{"iter": 1, "attentionDpRank": 0, "kvCacheStats": {"reusedBlocks": 3}},'
            ' {"iter": 1, "attentionDpRank": 1, "kvCacheStats": {"reusedBlocks": 5}}]',
            "several attention-DP ranks",
        ),
    ],
)
def test_bad_iteration_stats_are_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_engine_metrics(text)
    assert not isinstance(info.value, UnknownEngine)


@pytest.mark.parametrize(
    ("bad", "field", "why"),
    [
        ('"reusedBlocks": -1', "engine.kv_reused_blocks", "negative"),
        ('"reusedBlocks": "7"', "engine.kv_reused_blocks", "not finite"),
        ('"reusedBlocks": true', "engine.kv_reused_blocks", "not finite"),
        ('"reusedBlocks": NaN', "engine.kv_reused_blocks", "not finite"),
        ('"reusedBlocks": 1' + "0" * 400, "engine.kv_reused_blocks", "not finite"),
        ('"usedNumBlocks": -3', "engine.kv_usage_ratio", "negative"),
        ('"maxNumBlocks": "x"', "engine.kv_usage_ratio", "not finite"),
        # an infinite pool made the ratio 0.0, an empty cache, and kept it
        ('"maxNumBlocks": 1e400', "engine.kv_usage_ratio", "not finite"),
        ('"maxNumBlocks": 1' + "0" * 400, "engine.kv_usage_ratio", "not finite"),
    ],
)
def test_one_bad_iteration_figure_is_rejected_alone(bad: str, field: str, why: str) -> None:
    """A value that is not a count costs that figure only (the collector names it), not the
    scrape's other figures: before, the whole reading was dropped."""
    good = {"reusedBlocks": 4, "missedBlocks": 3121, "usedNumBlocks": 3, "maxNumBlocks": 100}
    key = bad.split(":")[0].strip('"')
    figures = ", ".join(f'"{k}": {v}' for k, v in good.items() if k != key)
    text = f'[{{"iter": 1, "kvCacheStats": {{{figures}, {bad}}}}}]'
    rejected = Rejections()
    r = checked_engine(parse_engine_metrics(text), rejected)
    assert rejected.fields == {field: why}
    kept = {
        "engine.kv_reused_blocks": (r.kv_reused_blocks, 4),
        "engine.kv_missed_blocks": (r.kv_missed_blocks, 3121),
        "engine.kv_usage_ratio": (r.kv_usage_ratio, 3 / 100),
    }
    assert getattr(r, field.removeprefix("engine.")) is None
    assert all(got == want for name, (got, want) in kept.items() if name != field)


def test_iteration_stats_of_an_empty_block_pool_have_no_usage() -> None:
    text = '[{"iter": 1, "kvCacheStats": {"usedNumBlocks": 0, "maxNumBlocks": 0}}]'
    assert parse_engine_metrics(text).kv_usage_ratio is None


@pytest.mark.parametrize("text", ['{"status": "ok"}', '[{"name": "a", "up": true}]'])
def test_other_json_is_no_known_engine(text: str) -> None:
    with pytest.raises(UnknownEngine):
        parse_engine_metrics(text)
