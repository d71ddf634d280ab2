"""The routing policies compared on one fleet's own shape and workload: what the demo saves for
the dashboard's Routing page, beside the counts its real router made, and the value of sharing
measured the same way: the cost policy's replay again without sharing (requests stay in their
home DC, and no node pulls from another: no peers, no pool, each node serves what it holds
itself), and the hit ratio of an unlimited cache (the workload's own reuse, the ceiling of any
fleet).

The same replay as ``kvctl bench route`` (``replay_policy``: each node's real ``TieredStore``
over size-only tiers, every store event through the fleet index, the policy choosing the node,
the cost model's fetch plan executed for it), but over the given DCs, node names, link
distance and per-node tier sizes instead of the bench's generated fleet. Hit ratios are
replayed (counted by the stores), TTFT is modeled from the inputs the result carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvctl.bench.route import (
    RouteBenchConfig,
    Workload,
    _versus_reference,
    build_costs,
    replay_policy,
)
from kvctl.errors import InvalidArgument
from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
from kvctl.ratios import ratio
from kvctl.router.policies import POLICIES, REFERENCE_POLICY
from kvctl.router.topology import DcLink, Node, Topology
from kvctl.workload.trace import TraceRequest

BASIS = (
    "replayed: the same requests through each node's store on size-only tiers of the fleet's "
    "sizes (no shared pool) and the fleet index; hit ratios counted, TTFT modeled"
)
SHARING_POLICY = "cost"
SHARING_BASIS = (
    "replayed: the same requests under the cost policy on size-only tiers of the fleet's "
    "sizes, with sharing (any DC's node may serve a request and pull from the others) and "
    "without (requests stay in their home DC, each node serves only what it holds itself); "
    "hit ratios counted, TTFT modeled"
)


def unlimited_hit_ratio(keys: Sequence[Sequence[bytes]]) -> float | None:
    """Chunk hit ratio of one cache that never evicts, over requests' chunk chains in order:
    a chunk hits when it and every chunk before it in its request were seen before. The
    workload's own reuse: no fleet of any size or sharing scores more."""
    seen: set[bytes] = set()
    hits = chunks = 0
    for chain in keys:
        prefix = True
        for key in chain:
            prefix = prefix and key in seen
            hits += prefix
            seen.add(key)
        chunks += len(chain)
    return ratio(hits, chunks)


def _sharing_figures(result: dict[str, Any]) -> dict[str, Any]:
    ttft = result["ttft_modeled"]
    return {
        "hit_ratio": result["hit_ratio"],
        "local_hit_ratio": result["local_hit_ratio"],
        "pulled_hit_ratio": result["pulled_hit_ratio"],
        "token_hit_ratio": result["token_hit_ratio"],
        "hits": result["hits"],
        "lookups": result["lookups"],
        "ttft_mean_s": ttft["mean_s"],
        "index_mismatches": result["index_mismatches"],
    }


def compare_routing(
    requests: Sequence[TraceRequest],
    *,
    nodes: Sequence[tuple[str, str]],
    links_km: dict[tuple[str, str], float],
    cpu_bytes: int,
    disk_bytes: int,
    model: str,
    gpu: str = "h100",
    workload_name: str = "",
    policies: Sequence[str] = POLICIES,
    sharing: bool = True,
) -> dict[str, Any]:
    """Every policy (round-robin, the reference, always included) over ``requests`` on a fresh
    fleet of ``nodes`` ((name, DC) pairs) with ``cpu_bytes``/``disk_bytes`` per node in the
    model's real KV bytes, DCs linked by ``links_km`` of fiber. JSON-safe; ``basis`` says what
    each figure is. ``sharing``: also the cost policy without sharing, and the unlimited
    cache's hit ratio (``sharing`` in the result)."""
    if not nodes:
        raise InvalidArgument("compare_routing needs at least one node")
    if not requests:
        raise InvalidArgument("compare_routing needs at least one request")
    topology = Topology.build(
        [Node(name, dc) for name, dc in nodes],
        {pair: DcLink.fiber(km) for pair, km in links_km.items()},
    )
    inputs = ModeledInputs(model_profile(model), gpu_profile(gpu))
    costs = build_costs(inputs)
    config = RouteBenchConfig(
        cpu_bytes=cpu_bytes, disk_bytes=disk_bytes, model=model, gpu=gpu, mfu=inputs.mfu
    )
    workload = Workload(workload_name, "the fleet's own workload", list(requests))
    chosen = [REFERENCE_POLICY, *(p for p in policies if p != REFERENCE_POLICY)]
    results = {p: replay_policy(workload, p, topology, costs, config)[0] for p in chosen}
    _versus_reference(results)
    compared = None
    if sharing:
        shared = (
            results.get(SHARING_POLICY)
            or replay_policy(workload, SHARING_POLICY, topology, costs, config)[0]
        )
        alone = replay_policy(workload, SHARING_POLICY, topology, costs, config, sharing=False)[0]
        with_, without = shared["hit_ratio"], alone["hit_ratio"]
        compared = {
            "basis": SHARING_BASIS,
            "policy": SHARING_POLICY,
            "with_sharing": _sharing_figures(shared),
            "without_sharing": _sharing_figures(alone),
            "hit_ratio_gain": None if with_ is None or without is None else with_ - without,
            # the unit every hit ratio here counts: the workload's prefix blocks
            "block_tokens": workload.requests[0].block_tokens,
            "unlimited_cache_hit_ratio": unlimited_hit_ratio(workload.keys),
        }
    return {
        "basis": BASIS,
        "workload": workload_name,
        "requests": len(workload.requests),
        "chunks": sum(len(k) for k in workload.keys),
        "tenants": len({r.tenant for r in workload.requests}),
        "nodes": [{"name": n, "dc": dc} for n, dc in nodes],
        "links_km": [{"a": a, "b": b, "distance_km": km} for (a, b), km in links_km.items()],
        "tiers_bytes": {"cpu": cpu_bytes, "disk": disk_bytes},
        "reference": REFERENCE_POLICY,
        "policies": results,
        "sharing": compared,
        "modeled_inputs": {
            "basis": "modeled: TTFT = origin RTT + fetch plan + prefill + queue, from these inputs",
            "profiles": inputs.as_dict(),
            "prefill": costs.prefill.as_dict(),
            "host_to_device_bytes_per_s": costs.host_to_device_bytes_per_s,
        },
    }
