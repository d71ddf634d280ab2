"""compare_routing: every policy over one fleet's own nodes, links and tier sizes, round-robin
the reference, each node's store checked against the index on every request."""

from __future__ import annotations

import json

import pytest

from kvctl.bench.route_compare import BASIS, compare_routing
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
