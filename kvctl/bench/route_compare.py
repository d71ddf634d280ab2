"""The routing policies compared on one fleet's own shape and workload: what the demo saves for
the dashboard's Routing page, beside the counts its real router made.

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
from kvctl.router.policies import POLICIES, REFERENCE_POLICY
from kvctl.router.topology import DcLink, Node, Topology
from kvctl.workload.trace import TraceRequest

BASIS = (
    "replayed: the same requests through each node's store on size-only tiers of the fleet's "
    "sizes (no shared pool) and the fleet index; hit ratios counted, TTFT modeled"
)


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
) -> dict[str, Any]:
    """Every policy (round-robin, the reference, always included) over ``requests`` on a fresh
    fleet of ``nodes`` ((name, DC) pairs) with ``cpu_bytes``/``disk_bytes`` per node in the
    model's real KV bytes, DCs linked by ``links_km`` of fiber. JSON-safe; ``basis`` says what
    each figure is."""
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
        "modeled_inputs": {
            "basis": "modeled: TTFT = origin RTT + fetch plan + prefill + queue, from these inputs",
            "profiles": inputs.as_dict(),
            "prefill": costs.prefill.as_dict(),
            "host_to_device_bytes_per_s": costs.host_to_device_bytes_per_s,
        },
    }
