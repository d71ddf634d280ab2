"""Engine metrics reader: vLLM, SGLang and LMCache expositions map to one reading, counters are
found with or without ``_total``, label sets are summed, and histogram deltas and quantiles
behave as Prometheus's do."""

# Exposition lines are fixtures copied verbatim from the engines' output and cannot be wrapped.
# ruff: noqa: E501

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from collectors.engines import (
    KNOWN_ENGINES,
    EngineReading,
    Histogram,
    UnknownEngine,
    histogram_delta,
    histogram_quantile,
    parse_engine_metrics,
)

INF = math.inf

PROCESS = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 21873.0
python_gc_objects_collected_total{generation="1"} 4107.0
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 2.1474836e+09
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.73805118e+09
"""

# vLLM v1 (0.11-era names) with two data-parallel engines, as prometheus_client renders it.
# Per engine the sources obey vLLM's invariant: compute + hit + external - recomputed = prompt.
VLLM_V1 = (
    PROCESS
    + """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-8B"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-8B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-8B"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} 21000.0
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-8B"} 11000.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:prefix_cache_queries_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 9800.0
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-8B"} 4200.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:prefix_cache_hits_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 10000.0
vllm:prompt_tokens_total{engine="1",model_name="Qwen/Qwen3-8B"} 6000.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_created gauge
vllm:prompt_tokens_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:prompt_tokens_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="Qwen/Qwen3-8B",source="local_compute"} 4000.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="Qwen/Qwen3-8B",source="local_cache_hit"} 5500.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="Qwen/Qwen3-8B",source="external_kv_transfer"} 520.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="Qwen/Qwen3-8B",source="local_compute"} 3000.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="Qwen/Qwen3-8B",source="local_cache_hit"} 2000.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="Qwen/Qwen3-8B",source="external_kv_transfer"} 1010.0
# HELP vllm:prompt_tokens_by_source_created Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_created gauge
vllm:prompt_tokens_by_source_created{engine="0",model_name="Qwen/Qwen3-8B",source="local_compute"} 1.7380512e+09
vllm:prompt_tokens_by_source_created{engine="0",model_name="Qwen/Qwen3-8B",source="local_cache_hit"} 1.7380512e+09
vllm:prompt_tokens_by_source_created{engine="0",model_name="Qwen/Qwen3-8B",source="external_kv_transfer"} 1.7380512e+09
vllm:prompt_tokens_by_source_created{engine="1",model_name="Qwen/Qwen3-8B",source="local_compute"} 1.7380512e+09
vllm:prompt_tokens_by_source_created{engine="1",model_name="Qwen/Qwen3-8B",source="local_cache_hit"} 1.7380512e+09
vllm:prompt_tokens_by_source_created{engine="1",model_name="Qwen/Qwen3-8B",source="external_kv_transfer"} 1.7380512e+09
# HELP vllm:prompt_tokens_cached_total Number of cached prompt tokens (local + external).
# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{engine="0",model_name="Qwen/Qwen3-8B"} 6000.0
vllm:prompt_tokens_cached_total{engine="1",model_name="Qwen/Qwen3-8B"} 3000.0
# HELP vllm:prompt_tokens_cached_created Number of cached prompt tokens (local + external).
# TYPE vllm:prompt_tokens_cached_created gauge
vllm:prompt_tokens_cached_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:prompt_tokens_cached_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
# HELP vllm:prompt_tokens_recomputed_total Number of cached tokens recomputed for forward pass.
# TYPE vllm:prompt_tokens_recomputed_total counter
vllm:prompt_tokens_recomputed_total{engine="0",model_name="Qwen/Qwen3-8B"} 20.0
vllm:prompt_tokens_recomputed_total{engine="1",model_name="Qwen/Qwen3-8B"} 10.0
# HELP vllm:prompt_tokens_recomputed_created Number of cached tokens recomputed for forward pass.
# TYPE vllm:prompt_tokens_recomputed_created gauge
vllm:prompt_tokens_recomputed_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:prompt_tokens_recomputed_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-8B"} 25000.0
vllm:generation_tokens_total{engine="1",model_name="Qwen/Qwen3-8B"} 12000.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:generation_tokens_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-8B"} 90.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="Qwen/Qwen3-8B"} 8.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="Qwen/Qwen3-8B"} 2.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="Qwen/Qwen3-8B"} 45.0
vllm:request_success_total{engine="1",finished_reason="length",model_name="Qwen/Qwen3-8B"} 5.0
vllm:request_success_total{engine="1",finished_reason="abort",model_name="Qwen/Qwen3-8B"} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:request_success_created{engine="0",finished_reason="length",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:request_success_created{engine="0",finished_reason="abort",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:request_success_created{engine="1",finished_reason="stop",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:request_success_created{engine="1",finished_reason="length",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:request_success_created{engine="1",finished_reason="abort",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.02",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="Qwen/Qwen3-8B"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.06",model_name="Qwen/Qwen3-8B"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.08",model_name="Qwen/Qwen3-8B"} 25.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="Qwen/Qwen3-8B"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.25",model_name="Qwen/Qwen3-8B"} 80.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="Qwen/Qwen3-8B"} 95.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.75",model_name="Qwen/Qwen3-8B"} 98.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2.5",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="5.0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="7.5",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="10.0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="20.0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="40.0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="80.0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="160.0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="640.0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="2560.0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-8B"} 100.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-8B"} 20.76
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.001",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.005",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.01",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.02",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.04",model_name="Qwen/Qwen3-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.06",model_name="Qwen/Qwen3-8B"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.08",model_name="Qwen/Qwen3-8B"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="Qwen/Qwen3-8B"} 20.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.25",model_name="Qwen/Qwen3-8B"} 40.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.5",model_name="Qwen/Qwen3-8B"} 48.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.75",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="2.5",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="5.0",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="7.5",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="10.0",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="20.0",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="40.0",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="80.0",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="160.0",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="640.0",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="2560.0",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="Qwen/Qwen3-8B"} 50.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="Qwen/Qwen3-8B"} 10.1
# HELP vllm:time_to_first_token_seconds_created Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds_created gauge
vllm:time_to_first_token_seconds_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
vllm:time_to_first_token_seconds_created{engine="1",model_name="Qwen/Qwen3-8B"} 1.7380512e+09
"""
)

# vLLM 0.8-era v1 engine: gpu_-prefixed cache names, no prompt_tokens_by_source.
VLLM_OLD = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.375
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 52000.0
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 31200.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 48000.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9100.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 37.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
"""

# vLLM 0.10-era: prefix_cache_* without the gpu_ prefix, still no prompt_tokens_by_source.
VLLM_PREFIX_ONLY = """\
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 900.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 640.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 800.0
"""

# LMCache inside vLLM (LMCacheConnectorV1, TP=2): both processes write to one multiprocess
# directory, so counters carry _total without _created and gauges lose the pid label.
LMCACHE_IN_VLLM = """\
# HELP lmcache:num_requested_tokens_total Total number of tokens requested from lmcache
# TYPE lmcache:num_requested_tokens_total counter
lmcache:num_requested_tokens_total{model_name="Qwen/Qwen3-8B",role="worker",served_model_name="Qwen/Qwen3-8B",worker_id="0"} 16000.0
lmcache:num_requested_tokens_total{model_name="Qwen/Qwen3-8B",role="worker",served_model_name="Qwen/Qwen3-8B",worker_id="1"} 16000.0
# HELP lmcache:num_hit_tokens_total Total number of tokens hit in lmcache
# TYPE lmcache:num_hit_tokens_total counter
lmcache:num_hit_tokens_total{model_name="Qwen/Qwen3-8B",role="worker",served_model_name="Qwen/Qwen3-8B",worker_id="0"} 1530.0
lmcache:num_hit_tokens_total{model_name="Qwen/Qwen3-8B",role="worker",served_model_name="Qwen/Qwen3-8B",worker_id="1"} 1530.0
# HELP lmcache:retrieve_hit_rate Hit rate of lmcache retrieve requests since last log
# TYPE lmcache:retrieve_hit_rate gauge
lmcache:retrieve_hit_rate{model_name="Qwen/Qwen3-8B",role="worker",served_model_name="Qwen/Qwen3-8B",worker_id="0"} 0.09
# HELP lmcache:local_cache_usage Local cache usage (bytes) of lmcache
# TYPE lmcache:local_cache_usage gauge
lmcache:local_cache_usage{model_name="Qwen/Qwen3-8B",role="worker",served_model_name="Qwen/Qwen3-8B",worker_id="0"} 1.073741824e+09
lmcache:local_cache_usage{model_name="Qwen/Qwen3-8B",role="worker",served_model_name="Qwen/Qwen3-8B",worker_id="1"} 5.36870912e+08
"""

# SGLang's tokenizer-manager and scheduler collectors (docs/references/production_metrics.md
# shape), rendered by an older prometheus_client that keeps _created inside the family.
SGLANG = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.128902e+06
sglang:prompt_tokens_created{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7380512e+09
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.557572e+06
sglang:generation_tokens_created{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7380512e+09
# HELP sglang:cached_tokens_total Number of cached prompt tokens.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.021e+06
sglang:cached_tokens_created{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7380512e+09
# HELP sglang:num_requests_total Number of requests processed.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12000.0
sglang:num_requests_created{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7380512e+09
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.007507552643049313
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2550.0
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:time_to_first_token_seconds_bucket{le="0.2",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1000.0
sglang:time_to_first_token_seconds_bucket{le="0.4",model_name="meta-llama/Llama-3.1-8B-Instruct"} 6000.0
sglang:time_to_first_token_seconds_bucket{le="0.6",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9000.0
sglang:time_to_first_token_seconds_bucket{le="0.8",model_name="meta-llama/Llama-3.1-8B-Instruct"} 11000.0
sglang:time_to_first_token_seconds_bucket{le="1.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 11500.0
sglang:time_to_first_token_seconds_bucket{le="2.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 11900.0
sglang:time_to_first_token_seconds_bucket{le="4.0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 11990.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12000.0
sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12000.0
sglang:time_to_first_token_seconds_created{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7380512e+09
"""


def _ratio(a: float | None, b: float | None) -> float:
    assert a is not None and b is not None
    return a / b


# --- vLLM -----------------------------------------------------------------------------------


def test_vllm_v1_sums_engines_and_reads_cached_tokens_by_source() -> None:
    r = parse_engine_metrics(VLLM_V1)
    assert r.engine == "vllm"
    assert r.prompt_tokens == 16000.0  # 10000 + 6000 over the two engines
    # local_cache_hit + external_kv_transfer, not prefix_cache_hits (9800 + 4200)
    assert r.cached_prompt_tokens == 5500 + 520 + 2000 + 1010
    assert r.generation_tokens == 37000.0
    assert r.requests == 150.0  # every finished_reason on both engines
    assert r.kv_usage_ratio == pytest.approx(0.5)  # mean of 0.25 and 0.75, not their sum
    assert r.lmcache_hit_tokens is None and r.lmcache_local_cache_usage_bytes is None


def test_vllm_v1_ttft_buckets_are_summed_per_le() -> None:
    ttft = parse_engine_metrics(VLLM_V1).ttft
    assert ttft is not None
    assert ttft.count == 150.0 and ttft.sum == pytest.approx(30.86)
    assert len(ttft.buckets) == 23 and ttft.buckets[-1] == (INF, 150.0)
    by_le = dict(ttft.buckets)
    assert (by_le[0.04], by_le[0.1], by_le[0.25], by_le[1.0]) == (2.0, 60.0, 120.0, 150.0)
    # rank 75 falls in (0.1, 0.25] holding 60 of 75..120: 0.1 + 0.15 * 15/60
    assert histogram_quantile(ttft, 0.5) == pytest.approx(0.1375)


def test_vllm_prompt_tokens_fall_back_to_the_sources_less_recomputed() -> None:
    text = "\n".join(
        line for line in VLLM_V1.splitlines() if not line.startswith("vllm:prompt_tokens_total")
    )
    # 16030 tokens over the sources, 30 of them recomputed and counted twice
    assert parse_engine_metrics(text).prompt_tokens == 16000.0


def test_vllm_cached_tokens_select_only_the_cache_sources() -> None:
    text = VLLM_V1.replace(
        'source="external_kv_transfer"} 520.0', 'source="external_kv_transfer"} 0.0'
    )
    assert parse_engine_metrics(text).cached_prompt_tokens == 5500 + 2000 + 1010


def test_vllm_older_gpu_names() -> None:
    r = parse_engine_metrics(VLLM_OLD)
    assert r.engine == "vllm"
    assert r.cached_prompt_tokens == 31200.0  # gpu_prefix_cache_hits
    assert r.kv_usage_ratio == 0.375  # gpu_cache_usage_perc
    assert (r.prompt_tokens, r.generation_tokens, r.requests) == (48000.0, 9100.0, 40.0)
    assert r.ttft is None  # not in this exposition


def test_vllm_without_sources_uses_prefix_cache_hits() -> None:
    r = parse_engine_metrics(VLLM_PREFIX_ONLY)
    assert r.cached_prompt_tokens == 640.0 and r.prompt_tokens == 800.0
    assert r.generation_tokens is None and r.requests is None


def test_vllm_and_lmcache_on_one_endpoint() -> None:
    r = parse_engine_metrics(VLLM_V1 + LMCACHE_IN_VLLM)
    assert r.engine == "vllm"
    assert r.prompt_tokens == 16000.0
    assert r.lmcache_hit_tokens == 3060.0  # both TP workers
    assert r.lmcache_requested_tokens == 32000.0
    assert r.lmcache_local_cache_usage_bytes == 1.5 * 2**30


# --- SGLang and LMCache ---------------------------------------------------------------------


def test_sglang() -> None:
    r = parse_engine_metrics(PROCESS + SGLANG)
    assert r.engine == "sglang"
    assert r.prompt_tokens == 8_128_902.0
    assert r.cached_prompt_tokens == 5_021_000.0
    assert r.generation_tokens == 7_557_572.0
    assert r.requests == 12000.0
    assert r.kv_usage_ratio == 0.28
    assert r.ttft is not None and r.ttft.count == 12000.0 and r.ttft.sum == 2550.0
    # rank 6000 is the top of the (0.2, 0.4] bucket
    assert histogram_quantile(r.ttft, 0.5) == pytest.approx(0.4)
    assert r.lmcache_hit_tokens is None


def test_lmcache_alone() -> None:
    r = parse_engine_metrics(PROCESS + LMCACHE_IN_VLLM)
    assert r.engine == "lmcache"
    assert _ratio(r.lmcache_hit_tokens, r.lmcache_requested_tokens) == pytest.approx(0.095625)
    assert r.lmcache_local_cache_usage_bytes == 1.5 * 2**30
    assert (r.prompt_tokens, r.cached_prompt_tokens, r.kv_usage_ratio, r.ttft) == (None,) * 4


# --- exposition variants --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        # typed counter without the suffix (a hand-written or multiprocess exporter)
        '# TYPE lmcache:num_hit_tokens counter\nlmcache:num_hit_tokens{worker_id="0"} 42\n',
        # untyped, as a federating proxy may re-expose it
        'lmcache:num_hit_tokens{worker_id="0"} 42\n',
        # re-exposed as a gauge with the suffix kept
        '# TYPE lmcache:num_hit_tokens_total gauge\nlmcache:num_hit_tokens_total{worker_id="0"} 42\n',
        # untyped with the suffix
        'lmcache:num_hit_tokens_total{worker_id="0"} 40\nlmcache:num_hit_tokens_total{worker_id="1"} 2\n',
    ],
)
def test_counter_found_with_or_without_total(text: str) -> None:
    assert parse_engine_metrics(text).lmcache_hit_tokens == 42.0


def test_vllm_counters_without_total_untyped() -> None:
    text = """\
vllm:prompt_tokens{engine="0",model_name="m"} 100
vllm:prompt_tokens{engine="1",model_name="m"} 50
vllm:prompt_tokens_by_source{engine="0",model_name="m",source="local_compute"} 60
vllm:prompt_tokens_by_source{engine="0",model_name="m",source="local_cache_hit"} 40
vllm:prompt_tokens_by_source{engine="1",model_name="m",source="local_compute"} 50
vllm:generation_tokens{engine="0",model_name="m"} 7
vllm:request_success{engine="0",finished_reason="stop",model_name="m"} 3
vllm:request_success{engine="1",finished_reason="length",model_name="m"} 1
"""
    r = parse_engine_metrics(text)
    assert (r.prompt_tokens, r.cached_prompt_tokens) == (150.0, 40.0)
    assert (r.generation_tokens, r.requests) == (7.0, 4.0)


def test_engines_declared_with_prometheus_client_are_found() -> None:
    # Declared the way each engine declares them: vLLM and LMCache without _total, SGLang with.
    reg = CollectorRegistry()
    engine = ["model_name", "engine"]
    Counter("vllm:prompt_tokens", "Prefill tokens.", engine, registry=reg).labels("m", "0").inc(11)
    Gauge("vllm:kv_cache_usage_perc", "KV usage.", engine, registry=reg).labels("m", "0").set(0.4)
    worker = ["model_name", "worker_id"]
    Counter("lmcache:num_hit_tokens", "Hits.", worker, registry=reg).labels("m", "0").inc(5)
    r = parse_engine_metrics(generate_latest(reg).decode())
    assert (r.engine, r.prompt_tokens, r.kv_usage_ratio, r.lmcache_hit_tokens) == (
        "vllm",
        11.0,
        0.4,
        5.0,
    )

    reg = CollectorRegistry()
    Counter("sglang:prompt_tokens_total", "Prefill tokens.", ["model_name"], registry=reg).labels(
        "m"
    ).inc(9)
    sglang = parse_engine_metrics(generate_latest(reg).decode())
    assert (sglang.engine, sglang.prompt_tokens) == ("sglang", 9.0)


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_counter_not_finite_is_exposed_not_finite_not_absent(value: str) -> None:
    """Not None (not exposed): the collector rejects it, and the engine's counters wait."""
    text = VLLM_V1.replace(
        'vllm:generation_tokens_total{engine="1",model_name="Qwen/Qwen3-8B"} 12000.0',
        f'vllm:generation_tokens_total{{engine="1",model_name="Qwen/Qwen3-8B"}} {value}',
    )
    r = parse_engine_metrics(text)
    # not 25000 (half a sum would read as a reset), not None (not exposed)
    assert r.generation_tokens is not None and not math.isfinite(r.generation_tokens)
    assert r.prompt_tokens == 16000.0


def test_a_histogram_not_finite_is_said_so_not_absent() -> None:
    text = SGLANG.replace(
        'le="0.4",model_name="meta-llama/Llama-3.1-8B-Instruct"} 6000.0',
        'le="0.4",model_name="meta-llama/Llama-3.1-8B-Instruct"} NaN',
    )
    r = parse_engine_metrics(text)
    assert r.ttft is None and r.ttft_not_finite
    assert not parse_engine_metrics(SGLANG).ttft_not_finite


def test_histogram_sums_only_bounds_every_series_shares() -> None:
    text = """\
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.5",tp_rank="0"} 3
sglang:time_to_first_token_seconds_bucket{le="1.0",tp_rank="0"} 4
sglang:time_to_first_token_seconds_bucket{le="+Inf",tp_rank="0"} 5
sglang:time_to_first_token_seconds_sum{tp_rank="0"} 3.5
sglang:time_to_first_token_seconds_count{tp_rank="0"} 5
sglang:time_to_first_token_seconds_bucket{le="1.0",tp_rank="1"} 1
sglang:time_to_first_token_seconds_bucket{le="+Inf",tp_rank="1"} 2
sglang:time_to_first_token_seconds_sum{tp_rank="1"} 1.5
sglang:time_to_first_token_seconds_count{tp_rank="1"} 2
"""
    ttft = parse_engine_metrics(text).ttft
    assert ttft == Histogram(buckets=((1.0, 5.0), (INF, 7.0)), sum=5.0, count=7.0)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [PROCESS, "", "# just a comment\n"])
def test_unknown_engine(text: str) -> None:
    with pytest.raises(UnknownEngine):
        parse_engine_metrics(text)


def test_unknown_engine_is_a_value_error() -> None:
    assert issubclass(UnknownEngine, ValueError)
    assert KNOWN_ENGINES == ("vllm", "sglang", "trtllm", "lmcache", "kvbm")


@pytest.mark.parametrize(
    "text",
    [
        "<html><body><h1>502 Bad Gateway</h1></body></html>\n",
        'vllm:prompt_tokens_total{model_name="m" 5\n',
        "vllm:prompt_tokens_total many\n",
        "vllm:prompt_tokens_total{model_name} 5\n",
    ],
)
def test_malformed_text_is_a_value_error_not_unknown_engine(text: str) -> None:
    with pytest.raises(ValueError, match="malformed") as info:
        parse_engine_metrics(text)
    assert not isinstance(info.value, UnknownEngine)


def test_histogram_without_inf_bucket_is_malformed() -> None:
    text = "\n".join(line for line in SGLANG.splitlines() if 'le="+Inf"' not in line)
    with pytest.raises(ValueError, match=r"\+Inf"):
        parse_engine_metrics(text)


def test_mixed_engines_are_rejected() -> None:
    with pytest.raises(ValueError, match="one engine") as info:
        parse_engine_metrics(VLLM_OLD + SGLANG)
    assert not isinstance(info.value, UnknownEngine)


@pytest.mark.parametrize(
    "buckets",
    [(), ((1.0, 1.0),), ((1.0, 1.0), (0.5, 1.0), (INF, 2.0)), ((1.0, math.nan), (INF, 1.0))],
)
def test_histogram_rejects_bad_buckets(buckets: tuple[tuple[float, float], ...]) -> None:
    with pytest.raises(ValueError):
        Histogram(buckets=buckets, sum=0.0, count=1.0)


# --- histogram_delta and histogram_quantile -------------------------------------------------

PREV = Histogram(buckets=((0.1, 10.0), (1.0, 20.0), (INF, 25.0)), sum=5.0, count=25.0)


def test_delta_subtracts_per_le() -> None:
    cur = Histogram(buckets=((0.1, 14.0), (1.0, 30.0), (INF, 40.0)), sum=9.0, count=40.0)
    assert histogram_delta(cur, PREV) == Histogram(
        buckets=((0.1, 4.0), (1.0, 10.0), (INF, 15.0)), sum=4.0, count=15.0
    )


@pytest.mark.parametrize(
    "cur",
    [
        # the engine restarted: fewer observations than before
        Histogram(buckets=((0.1, 1.0), (1.0, 4.0), (INF, 5.0)), sum=1.0, count=5.0),
        # restarted and already past the old count, but a bucket went down
        Histogram(buckets=((0.1, 2.0), (1.0, 30.0), (INF, 30.0)), sum=9.0, count=30.0),
        # restarted with other buckets
        Histogram(buckets=((0.5, 20.0), (INF, 30.0)), sum=9.0, count=30.0),
    ],
)
def test_delta_after_a_reset_is_the_current_histogram(cur: Histogram) -> None:
    assert histogram_delta(cur, PREV) is cur


def test_delta_without_previous_is_the_current_histogram() -> None:
    assert histogram_delta(PREV, None) is PREV


H = Histogram(buckets=((0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (INF, 50.0)), sum=20.0, count=50.0)


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.0, 0.0),  # lower edge of the first non-empty bucket
        (0.1, 0.05),  # rank 5 of 10 in [0, 0.1]
        (0.5, 0.4),  # rank 25: 0.1 + 0.4 * (25 - 10) / 20
        (0.8, 1.0),  # rank 40 is the top of (0.5, 1.0]
        (0.9, 1.0),  # in the +Inf bucket: the highest finite bound
        (1.0, 1.0),
    ],
)
def test_quantile_hand_computed(q: float, expected: float) -> None:
    assert histogram_quantile(H, q) == pytest.approx(expected)


def test_quantile_skips_empty_leading_buckets() -> None:
    h = Histogram(buckets=((0.1, 0.0), (0.2, 0.0), (0.4, 4.0), (INF, 4.0)), sum=1.2, count=4.0)
    assert histogram_quantile(h, 0.0) == pytest.approx(0.2)
    assert histogram_quantile(h, 0.25) == pytest.approx(0.25)


def test_quantile_with_a_non_positive_first_bound() -> None:
    h = Histogram(buckets=((-1.0, 5.0), (0.0, 5.0), (1.0, 10.0), (INF, 10.0)), sum=0.0, count=10.0)
    assert histogram_quantile(h, 0.25) == -1.0
    assert histogram_quantile(h, 0.75) == pytest.approx(0.5)


def test_quantile_of_an_empty_histogram_is_none() -> None:
    empty = Histogram(buckets=((0.1, 0.0), (INF, 0.0)), sum=0.0, count=0.0)
    assert histogram_quantile(empty, 0.5) is None
    assert histogram_quantile(histogram_delta(PREV, PREV), 0.99) is None


def test_quantile_with_only_the_inf_bucket_is_none() -> None:
    assert histogram_quantile(Histogram(buckets=((INF, 3.0),), sum=1.0, count=3.0), 0.5) is None


@pytest.mark.parametrize("q", [-0.01, 1.01, math.nan, INF])
def test_quantile_outside_unit_interval(q: float) -> None:
    with pytest.raises(ValueError):
        histogram_quantile(H, q)


@st.composite
def histograms(draw: st.DrawFn) -> Histogram:
    bounds = sorted(
        draw(
            st.lists(
                st.floats(min_value=-100.0, max_value=1e4, allow_nan=False, allow_subnormal=False),
                min_size=1,
                max_size=12,
                unique=True,
            )
        )
    )
    increments = draw(
        st.lists(st.integers(0, 1000), min_size=len(bounds) + 1, max_size=len(bounds) + 1)
    )
    cumulative = [float(sum(increments[: i + 1])) for i in range(len(increments))]
    return Histogram(
        buckets=tuple(zip([*bounds, INF], cumulative, strict=True)),
        sum=0.0,
        count=cumulative[-1],
    )


@given(histograms(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_quantile_is_monotone_and_within_the_bucket_bounds(
    h: Histogram, q1: float, q2: float
) -> None:
    lo_q, hi_q = sorted((q1, q2))
    lo, hi = histogram_quantile(h, lo_q), histogram_quantile(h, hi_q)
    if h.count == 0:
        assert lo is None and hi is None
        return
    assert lo is not None and hi is not None
    assert lo <= hi + 1e-9 * max(1.0, abs(hi))
    finite = [le for le, _ in h.buckets[:-1]]
    floor = min(0.0, finite[0])
    for q, v in ((lo_q, lo), (hi_q, hi)):
        assert floor - 1e-9 <= v <= finite[-1] + 1e-9 * max(1.0, abs(finite[-1]))
        # v sits inside the bucket that holds rank q * count (or at the top finite bound)
        rank = q * h.count
        b = next(i for i, (_, c) in enumerate(h.buckets) if c >= rank and c > 0)
        if b < len(finite):
            lower = finite[b - 1] if b > 0 else min(0.0, finite[0])
            assert (
                lower - 1e-9 * max(1.0, abs(lower))
                <= v
                <= finite[b] + 1e-9 * max(1.0, abs(finite[b]))
            )
        else:
            assert v == finite[-1]


def test_reading_is_frozen() -> None:
    r = parse_engine_metrics(VLLM_OLD)
    assert isinstance(r, EngineReading)
    with pytest.raises(AttributeError):
        r.prompt_tokens = 0.0  # type: ignore[misc]
