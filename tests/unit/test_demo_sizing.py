"""The demo sizes its tiers from the workload, so its reuse shows: the nodes together and the
pool hold the unique KV of the requests the demo can reach, never below the defaults, memory
tiers capped."""

from __future__ import annotations

from pathlib import Path

from kvctl.fleet.demo import (
    MAX_CPU_BYTES,
    MAX_POOL_BYTES,
    MIB,
    DemoConfig,
    reachable,
    size_tiers,
    unique_kv_bytes,
)
from kvctl.units import parse_size
from kvctl.workload.generators import generate
from kvctl.workload.trace import TraceRequest

CONFIG = DemoConfig(Path("/nonexistent"))


def _request(ts_ms: int, blocks: list[int], tokens: int) -> TraceRequest:
    return TraceRequest(ts_ms, tokens, 10, tuple(blocks), block_tokens=512)


def test_unique_bytes_count_each_prefix_block_once_with_its_tokens() -> None:
    reqs = [_request(0, [1, 2], 1024), _request(1, [1, 2, 3], 1200)]
    # blocks 1 and 2 once, block 3 is a partial block of 176 tokens
    assert unique_kv_bytes(reqs, kv_bytes_per_token=10) == (512 + 512 + 176) * 10


def test_the_demo_reaches_the_requests_within_duration_times_speed() -> None:
    reqs = [_request(t, [t], 512) for t in range(0, 100_000, 10_000)]
    assert len(reachable(reqs, 3.0, 10.0)) == 4  # 30 s of the trace: 0, 10, 20, 30 s
    assert reachable(reqs, None, 10.0) == reqs and reachable(reqs, 3.0, None) == reqs


def test_a_small_workload_keeps_the_default_tiers() -> None:
    sized, why = size_tiers(CONFIG, generate("chat", 0, requests=20), 5.0)
    assert (sized.cpu, sized.disk, sized.pool_cpu) == ("64MiB", "256MiB", "256MiB")
    assert why.capped == () and why.requests == 20


def test_the_working_set_is_shared_between_the_nodes_and_held_by_the_pool() -> None:
    requests = generate("builtin", 0, requests=2000)
    sized, why = size_tiers(CONFIG, requests, None)
    per_token = round(12_288 * CONFIG.kv_scale)  # the demo's model, scaled as the agents store
    assert why.unique_bytes == unique_kv_bytes(requests, per_token)
    nodes = 2 * CONFIG.nodes_per_dc
    node_bytes = parse_size(sized.cpu) + parse_size(sized.disk)
    assert node_bytes * nodes >= why.unique_bytes  # nothing evicted for want of room
    assert node_bytes * nodes < why.unique_bytes + nodes * 2 * MIB  # and no more than that
    assert parse_size(sized.pool_cpu) == min(MAX_POOL_BYTES, -(-why.unique_bytes // MIB) * MIB)
    assert (why.cpu_bytes, why.disk_bytes) == (parse_size(sized.cpu), parse_size(sized.disk))


def test_memory_tiers_are_capped_and_say_so() -> None:
    # 400 requests of 100 blocks each, none shared: 1.9 GiB of KV as the agents store it
    requests = [
        TraceRequest(i, 51_200, 10, tuple(range(i * 100, i * 100 + 100)), block_tokens=512)
        for i in range(400)
    ]
    sized, why = size_tiers(CONFIG, requests, None)
    assert parse_size(sized.cpu) == MAX_CPU_BYTES and parse_size(sized.pool_cpu) == MAX_POOL_BYTES
    assert set(why.capped) >= {"cpu", "pool"}
