"""compare_routing: every policy over one fleet's own nodes, links and tier sizes, round-robin
the reference, each node's store checked against the index on every request."""

from __future__ import annotations

import json

import pytest

from kvctl.bench.route_compare import BASIS, SHARING_BASIS, compare_routing, unlimited_hit_ratio
from kvctl.errors import InvalidArgument
from kvctl.router.policies import POLICIES
from kvctl.workload.generators import generate

NODES = [("fra-1-a", "fra-1"), ("fra-1-b", "fra-1"), ("ams-1-a", "ams-1"), ("ams-1-b", "ams-1")]
LINKS = {("fra-1", "ams-1"): 80.0}


def test_every_policy_replays_the_same_requests_on_the_fleets_own_nodes() -> None:
    requests = generate("chat", 3, requests=80)
    out = compare_routing(
        requests, nodes=NODES, links_km=LINKS, cpu_bytes=1 << 30, disk_bytes=4 << 30,
        model="llama-3.1-8b", workload_name="chat",
    )  # fmt: skip
    assert out["basis"] == BASIS and out["reference"] == "round-robin"
    assert set(out["policies"]) == set(POLICIES)
    assert out["requests"] == len(requests)
    for name, p in out["policies"].items():
        assert p["index_mismatches"] == 0, name
        assert p["requests"] == len(requests)
        assert set(p["requests_per_node"]) <= {n for n, _ in NODES}
        assert sum(p["requests_per_node"].values()) == len(requests) - p["no_node"]
        assert p["hits"] == p["local_hits"] + p["pulled_hits"] <= p["lookups"]
        assert set(p["pulled_bytes_by_link"]) <= {"fra-1->ams-1", "ams-1->fra-1",
                                                  "fra-1->fra-1", "ams-1->ams-1"}  # fmt: skip
    rr = out["policies"]["round-robin"]["vs_reference"]
    assert rr["hit_ratio_minus_reference"] == 0 and rr["ttft_mean_ratio_to_reference"] == 1.0
    # round-robin visits every node; the chat workload has repeated turns, so something hits
    assert len(out["policies"]["round-robin"]["requests_per_node"]) == len(NODES)
    assert out["policies"]["cost"]["hits"] > 0
    json.dumps(out)  # saved as a JSON document


def test_nothing_to_compare_is_an_error() -> None:
    with pytest.raises(InvalidArgument, match="request"):
        compare_routing(
            [], nodes=NODES, links_km=LINKS, cpu_bytes=1, disk_bytes=1, model="llama-3.1-8b"
        )
    with pytest.raises(InvalidArgument, match="node"):
        compare_routing(
            generate("chat", 0, requests=5), nodes=[], links_km={}, cpu_bytes=1, disk_bytes=1,
            model="llama-3.1-8b",
        )  # fmt: skip


def test_sharing_is_worth_the_difference_between_two_replays_of_the_same_requests() -> None:
    """The cost policy replayed again with every node on its own chunks: the pulls vanish, the
    hits drop to what each node reuses itself, and an unlimited cache bounds both."""
    requests = generate("builtin", 1, requests=150)
    out = compare_routing(
        requests, nodes=NODES, links_km=LINKS, cpu_bytes=64 << 20, disk_bytes=256 << 20,
        model="qwen2.5-0.5b", gpu="l4", workload_name="builtin",
    )  # fmt: skip
    s = out["sharing"]
    assert s["basis"] == SHARING_BASIS and s["policy"] == "cost"
    shared, alone = s["with_sharing"], s["without_sharing"]
    # the same replay as the policy table's cost row
    assert shared["hit_ratio"] == out["policies"]["cost"]["hit_ratio"]
    assert shared["lookups"] == alone["lookups"] == out["chunks"]
    assert alone["pulled_hit_ratio"] == 0 and alone["index_mismatches"] == 0
    assert shared["pulled_hit_ratio"] > 0  # system prompts shared across tenants and nodes
    assert shared["hit_ratio"] > alone["hit_ratio"]
    assert s["hit_ratio_gain"] == pytest.approx(shared["hit_ratio"] - alone["hit_ratio"])
    assert shared["hit_ratio"] <= s["unlimited_cache_hit_ratio"] <= 1


def test_the_unlimited_cache_counts_prefix_hits_only() -> None:
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    # second request: a hits, c misses, b hits but after a miss: not a prefix hit
    assert unlimited_hit_ratio([[a, b], [a, c, b]]) == pytest.approx(1 / 5)
    assert unlimited_hit_ratio([]) is None


def test_without_the_sharing_replay_the_result_says_none() -> None:
    out = compare_routing(
        generate("chat", 0, requests=20), nodes=NODES, links_km=LINKS, cpu_bytes=1 << 30,
        disk_bytes=1 << 30, model="llama-3.1-8b", policies=("round-robin",), sharing=False,
    )  # fmt: skip
    assert out["sharing"] is None and set(out["policies"]) == {"round-robin"}
