"""Routing policies compared on the same requests, the router's decision latency and the fleet
index's update rate, each figure beside a reference from the same run.

**Replay** (one process, no agents). A fleet of ``nodes`` nodes dealt over ``dcs`` DCs; each
node runs the real ``TieredStore`` over size-only tiers (``MeteredTier``: cpu and disk
capacities in bytes, chunks of ``tokens x`` the model's KV bytes per token), and every store
event goes through ``kvctl.index.events.from_agent_event`` into one ``EmbeddedIndex`` (the path
an agent's events take to a router), applied after each request as a follower would. Each
request comes from its tenant's home DC (``assign_home_dcs``). For each policy, a fresh fleet
gets the same requests in the same order:

1. the index answers which nodes hold the chain (for the tenant);
2. the policy chooses a node;
3. the chosen node executes the cost model's fetch plan *for that node* (``score_nodes``: its own
   tiers, pulls from other holders over the DC links, then recompute), so policies differ only
   in which node they pick, never in how a node fetches;
4. the node's store looks the chain up (counted by the store; its prefix is checked against the
   index's), and every chunk it did not hold (pulled or recomputed) is stored there.

Per policy: chunk hit ratio (hits per chunk looked up, split local / pulled), the share of
requests sent to a node already holding part of the prefix, bytes pulled per DC link
(holder's DC -> chosen node's DC), and the modeled time to first token (origin round trip +
fetch + prefill + queue) with its inputs (model and GPU profiles, MFU, link figures). The queue
is modeled on the trace's clock: each node prefills one request at a time, so a request waits
for the fetch + prefill seconds already routed to its node and not yet done (decode is not
modeled). Round-robin in the same run is the reference for the hit ratio and the TTFT.

**Decision latency.** After the first workload's replay under the cost policy, the index is
padded with entries of other chunks to ``index_entries``; requests of that workload are then
routed at a paced ``latency_rate_per_s`` (each call timed alone): index answer + ``decide``
(the cost policy, target p99 < 2 ms), index answer + prefix-only, and the reference: a plain
dict looked up for the same keys. Nothing changes the index while decisions are timed, so its
answers come from its answer cache; each request's first answer in the run (filling the
reference's dict) is timed too (``index_answer_first``). Then the same requests through
``Router.route`` (``router``): a router following ``latency_followers`` agents (the topology's
nodes and others up to that many, each polled once and up, from an in-process stand-in agent
that holds nothing), so a decision's cost includes the followers' node sets (up, down, pool).

**Index update rate.** ``EmbeddedIndex.apply`` of stored, then removed events in batches of
``index_batch`` (events per second), next to plain dict inserts/deletes of the same keys; and
``RedisIndex`` (when ``kvctl.index.redis_index`` exists and Redis answers) next to a raw Redis
pipeline of HSETs/HDELs of the same keys, every key of the run deleted at the end.

The result (JSON-safe)::

    {"benchmark": "route", "host": {...}, "config": {...}, "elapsed_s": float,
     "modeled_inputs": {"basis", "profiles", "prefill", "host_to_device_bytes_per_s",
                        "disk_read_bytes_per_s", "topology", "queue"},
     "workloads": [{"workload", "source", "requests", "chunks", "tenants", "sessions",
                    "reference": "round-robin",
                    "policies": {name: {"requests", "lookups", "hits", "local_hits",
                        "pulled_hits", "hit_ratio", "local_hit_ratio", "pulled_hit_ratio",
                        "token_hit_ratio", "recomputed_tokens", "to_holder_share",
                        "to_holder_share_of_indexed", "pulled_bytes", "pulled_bytes_by_link",
                        "ttft_modeled": {"mean_s", "p50_s", "p99_s", "max_s", "mean_<part>_s"},
                        "requests_per_node", "index_mismatches" (must be 0), ...,
                        "vs_reference": {"hit_ratio_minus_reference",
                                         "ttft_mean_ratio_to_reference", ...}}}}
                   | {"workload", "skipped": why}],
     "decision_latency": {"cost" | "prefix_only" | "reference": {"p50_s", "p99_s", ...,
                          "achieved_rate_per_s", "what"}, "index_entries", "meets_target", ...;
                          cost also "index_answer" and "index_answer_first": {"p50_s", ...};
                          "router": {"p50_s", ..., "followers", "p99_ratio_to_reference",
                          "what"} (absent with latency_followers 0)}
                         | None,
     "index_updates": {"embedded": {"stored_events_per_s", "removed_events_per_s",
                                    "reference": {...}, "meets_target"},
                       "redis": {... the same ...} | {"skipped": why}},
     "targets": {...}, "notes": [str, ...]}
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import http.server
import json
import math
import os
import random
import secrets
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvctl.bench.common import host_info
from kvctl.errors import InvalidArgument
from kvctl.index.events import ChunkEvent, from_agent_event
from kvctl.index.follower import Followers
from kvctl.index.model import EmbeddedIndex, Holding, owner
from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
from kvctl.quantiles import nearest_rank
from kvctl.ratios import ratio
from kvctl.remote.fetchplan import PrefillRate
from kvctl.router.policies import (
    POLICIES,
    REFERENCE_POLICY,
    CostPolicy,
    PrefixOnly,
    RouteRequest,
    RoutingPolicy,
    make_policy,
)
from kvctl.router.score import Costs, NodeScore, held_prefix, score_nodes
from kvctl.router.service import Router
from kvctl.router.topology import DcLink, Node, Topology
from kvctl.store.store import TieredStore
from kvctl.store.tiers.metered import MeteredTier
from kvctl.workload.generators import GENERATORS, generate
from kvctl.workload.replay import assign_home_dcs
from kvctl.workload.trace import (
    DEFAULT_TRACE_PATH,
    TraceRequest,
    assign_tenants,
    read_mooncake_trace,
)

if TYPE_CHECKING:
    from rich.console import Group

TRACE_WORKLOAD = "mooncake"
WORKLOADS = (TRACE_WORKLOAD, *sorted(GENERATORS))
TARGETS = {"decision_p99_s": 0.002, "index_events_per_s": 100_000}
#: host -> device copy the cost model assumes (PCIe Gen5 x16, configured: shown in the output)
HOST_TO_DEVICE_BYTES_PER_S = 50e9
#: tenants the shared trace's requests are dealt to (it has none)
TRACE_TENANTS = 8
DCS_MIN, DCS_MAX = 2, 4

Progress = Callable[[str], None]


@dataclass(frozen=True)
class RouteBenchConfig:
    workloads: tuple[str, ...] = (TRACE_WORKLOAD, "system-prompt", "chat", "rag")
    policies: tuple[str, ...] = POLICIES
    nodes: int = 9
    dcs: int = 3
    #: km between each pair of DCs, in pair order (0-1, 0-2, ..., 1-2, ...); one value: all pairs
    distances_km: tuple[float, ...] = (100.0, 1500.0, 1500.0)
    link_bytes_per_s: float = 12.5e9
    cpu_bytes: int = 64 << 30
    disk_bytes: int = 256 << 30
    #: requests per workload (None: all of the trace, the generator's default size)
    requests: int | None = None
    seed: int = 0
    model: str = "llama-3.1-8b"
    gpu: str = "h100"
    mfu: float = 0.5
    latency_requests: int = 2000
    latency_rate_per_s: float = 1000.0
    #: agents the router of the latency run's ``router`` figure follows (0: not measured)
    latency_followers: int = 1000
    index_entries: int = 500_000
    index_events: int = 200_000
    index_batch: int = 1000
    redis_events: int = 50_000
    repeats: int = 3
    redis_url: str | None = "redis://127.0.0.1:6379/0"
    trace_path: str = str(DEFAULT_TRACE_PATH)

    @classmethod
    def quick(cls, **overrides: Any) -> RouteBenchConfig:
        """A size that finishes in seconds (tests, smoke runs)."""
        base: dict[str, Any] = {
            "workloads": ("system-prompt", "chat"),
            "nodes": 4,
            "dcs": 2,
            "distances_km": (500.0,),
            "cpu_bytes": 4 << 30,
            "disk_bytes": 16 << 30,
            "requests": 60,
            "latency_requests": 100,
            "latency_followers": 50,
            "index_entries": 20_000,
            "index_events": 20_000,
            "redis_events": 5_000,
            "repeats": 1,
        }
        base.update(overrides)
        return cls(**base)

    def check(self) -> None:
        if not DCS_MIN <= self.dcs <= DCS_MAX:
            raise InvalidArgument(f"dcs must be {DCS_MIN} to {DCS_MAX}, got {self.dcs}")
        if self.nodes < self.dcs:
            raise InvalidArgument(
                f"need at least one node per DC: {self.nodes} nodes, {self.dcs} DCs"
            )
        pairs = self.dcs * (self.dcs - 1) // 2
        if len(self.distances_km) not in (1, pairs):
            raise InvalidArgument(
                f"give one distance for every DC pair or {pairs} (one per pair, in the order "
                f"{', '.join(f'{a}-{b}' for a, b in _pairs(self.dcs))}), "
                f"got {len(self.distances_km)}"
            )
        for km in self.distances_km:
            if not (math.isfinite(km) and km >= 0):
                raise InvalidArgument(f"distances must be finite and >= 0 km, got {km!r}")
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown or not self.workloads:
            raise InvalidArgument(
                f"unknown workload {unknown[0] if unknown else '(none)'!r}; choose from "
                f"{', '.join(WORKLOADS)}"
            )
        bad = [p for p in self.policies if p not in POLICIES]
        if bad or not self.policies:
            raise InvalidArgument(
                f"unknown policy {bad[0] if bad else '(none)'!r}; choose from {', '.join(POLICIES)}"
            )
        for what in ("cpu_bytes", "disk_bytes", "latency_requests", "index_events", "index_batch",
                     "repeats", "redis_events"):  # fmt: skip
            value = getattr(self, what)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"{what} must be an integer >= 1, got {value!r}")
        if self.requests is not None and self.requests < 1:
            raise InvalidArgument(f"requests must be >= 1, got {self.requests}")
        for what in ("index_entries", "latency_followers"):
            value = getattr(self, what)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"{what} must be an integer >= 0, got {value!r}")
        for what in ("link_bytes_per_s", "latency_rate_per_s"):
            value = getattr(self, what)
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"{what} must be finite and > 0, got {value!r}")

    def with_reference(self) -> tuple[str, ...]:
        """The asked policies, round-robin (the reference) first, each once."""
        return tuple(dict.fromkeys((REFERENCE_POLICY, *self.policies)))


def _pairs(dcs: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(dcs) for b in range(a + 1, dcs)]


def build_topology(config: RouteBenchConfig) -> Topology:
    """Nodes ``dc<i>-n<j>`` dealt round-robin over the DCs; fiber-modeled links between DCs."""
    names = [f"dc{i}" for i in range(config.dcs)]
    nodes = [Node(f"{names[i % config.dcs]}-n{i // config.dcs}", names[i % config.dcs])
             for i in range(config.nodes)]  # fmt: skip
    kms = config.distances_km * (len(_pairs(config.dcs)) if len(config.distances_km) == 1 else 1)
    links = {
        (names[a], names[b]): DcLink.fiber(km, bandwidth_bytes_per_s=config.link_bytes_per_s)
        for (a, b), km in zip(_pairs(config.dcs), kms, strict=True)
    }
    return Topology.build(nodes, links)


def build_costs(inputs: ModeledInputs) -> Costs:
    prefill = PrefillRate.modeled(inputs).as_model(
        model=inputs.model.name, gpu=inputs.gpu.name, mfu=inputs.mfu
    )
    return Costs(prefill=prefill, host_to_device_bytes_per_s=HOST_TO_DEVICE_BYTES_PER_S)


# --- workloads -------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    source: str
    requests: list[TraceRequest]
    keys: list[list[bytes]] = field(default_factory=list)
    sessions: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # block ids are prefix hashes: 16 bytes of the id is the chunk's key
        self.keys = [[b.to_bytes(16, "little") for b in r.block_ids] for r in self.requests]
        self.sessions = session_ids(self.requests)


def session_ids(requests: Sequence[TraceRequest]) -> list[str]:
    """A conversation id per request, as a chat front end would send: a request containing an
    earlier request's whole input (its next turn) continues that request's session; any other
    starts one. (Neither the trace nor the generators carry one.)"""
    session_of_end: dict[int, str] = {}
    out: list[str] = []
    for i, r in enumerate(requests):
        full = r.input_tokens // r.block_tokens
        session = next(
            (session_of_end[b] for b in reversed(r.block_ids[:full]) if b in session_of_end),
            f"s{i}",
        )
        if full:
            session_of_end[r.block_ids[full - 1]] = session
        out.append(session)
    return out


def load_workload(name: str, config: RouteBenchConfig) -> Workload | str:
    """The workload, or why it is skipped."""
    if name == TRACE_WORKLOAD:
        path = config.trace_path
        if not os.path.isfile(path):
            return (
                f"the shared trace is not on this machine ({path}); put the Mooncake "
                "synthetic trace there to include it"
            )
        requests = read_mooncake_trace(path, limit=config.requests)
        requests = assign_tenants(requests, TRACE_TENANTS, seed=config.seed)
        return Workload(name, f"trace: {path} (tenants: {TRACE_TENANTS}, assigned)", requests)
    requests = generate(name, config.seed, requests=config.requests)
    return Workload(name, f"generated: {name}, seed {config.seed}", requests)


# --- the replay ------------------------------------------------------------------------------


class _Backlog:
    """Modeled queue on the workload's clock: each node works through what was routed to it,
    one request at a time."""

    def __init__(self) -> None:
        self.busy_until_s: dict[str, float] = {}

    def queue_s(self, now_s: float) -> dict[str, float]:
        return {n: t - now_s for n, t in self.busy_until_s.items() if t > now_s}

    def add(self, node: str, now_s: float, seconds: float) -> None:
        self.busy_until_s[node] = max(self.busy_until_s.get(node, 0.0), now_s) + seconds


class _Fleet:
    """Every node's real store over size-only tiers, its events feeding one index."""

    def __init__(self, topology: Topology, config: RouteBenchConfig) -> None:
        self.index = EmbeddedIndex()
        self.now_s = 0.0
        self.stores: dict[str, TieredStore] = {}
        self.pending: dict[str, list[dict[str, Any]]] = {}
        self.events = 0
        for name in topology.nodes:
            store = TieredStore(
                [MeteredTier("cpu", config.cpu_bytes), MeteredTier("disk", config.disk_bytes)],
                eviction="lineage-lru",
                clock=lambda: self.now_s,  # the workload's clock, not wall time
            )
            pending: list[dict[str, Any]] = []
            store.subscribe(pending.append)
            self.stores[name] = store
            self.pending[name] = pending

    def publish(self) -> None:
        """Apply what the stores emitted since the last call (a follower's poll)."""
        for node, pending in self.pending.items():
            if not pending:
                continue
            events = [e for e in map(from_agent_event, pending) if e is not None]
            self.events += self.index.apply(node, events)
            pending.clear()

    def entries(self) -> int:
        return len(self.index)


def _spread(values: Sequence[float]) -> dict[str, float]:
    s = sorted(values)
    return {
        "mean_s": statistics.fmean(s) if s else 0.0,
        "p50_s": nearest_rank(s, 0.50) or 0.0,
        "p99_s": nearest_rank(s, 0.99) or 0.0,
        "max_s": s[-1] if s else 0.0,
    }


@dataclass
class _Tally:
    requests: int = 0
    lookups: int = 0
    local_hits: int = 0
    pulled_hits: int = 0
    tokens: int = 0
    fetched_tokens: int = 0
    to_holder: int = 0
    indexed: int = 0
    index_mismatches: int = 0
    no_node: int = 0
    ttft_s: list[float] = field(default_factory=list)
    parts_s: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("origin_s", "fetch_s", "prefill_s", "queue_s"), 0.0)
    )
    pulled_bytes: Counter[str] = field(default_factory=Counter)
    pulled_chunks: Counter[str] = field(default_factory=Counter)
    per_node: Counter[str] = field(default_factory=Counter)


def replay_policy(
    workload: Workload,
    policy_name: str,
    topology: Topology,
    costs: Costs,
    config: RouteBenchConfig,
    *,
    keep: bool = False,
    sharing: bool = True,
) -> tuple[dict[str, Any], _Fleet, _Backlog]:
    """One policy over the workload on a fresh fleet; see the module. ``sharing`` False: no
    node pulls from another (no peers, no pool): each plans with its own chunks only, and the
    policy chooses among those plans (see :func:`_choose_alone`)."""
    started = time.perf_counter()
    fleet = _Fleet(topology, config)
    backlog = _Backlog()
    policy: RoutingPolicy = make_policy(policy_name, topology, costs)
    home = assign_home_dcs((r.tenant for r in workload.requests), topology.dcs)
    chunk_tokens = workload.requests[0].block_tokens if workload.requests else 512
    kv_bytes_per_token = model_profile(config.model).kv_bytes_per_token
    t0_ms = workload.requests[0].timestamp_ms if workload.requests else 0
    tally = _Tally()
    for r, keys, session in zip(workload.requests, workload.keys, workload.sessions, strict=True):
        now_s = (r.timestamp_ms - t0_ms) / 1000
        fleet.now_s = now_s
        holdings = fleet.index.holders(keys, tenant=r.tenant)
        request = RouteRequest(
            holdings,
            r.input_tokens,
            chunk_tokens,
            tenant=r.tenant,
            session=session,
            origin_dc=home[r.tenant],
            queue_s=backlog.queue_s(now_s),
        )
        if sharing:
            chosen = _choose(policy, request, topology, costs)
        else:
            chosen = _choose_alone(policy, request, topology, costs)
        tally.requests += 1
        tally.lookups += len(keys)
        tally.tokens += r.input_tokens
        if chosen is None:
            tally.no_node += 1
            continue
        _count(tally, chosen, topology, held_prefix(holdings) > 0)
        backlog.add(chosen.node, now_s, chosen.fetch_s + chosen.prefill_s)
        store = fleet.stores[chosen.node]
        looked = store.lookup(keys, tenant=r.tenant)
        if looked.matched_chunks != chosen.local_chunks:
            tally.index_mismatches += 1  # the index and the node's store disagree: a bug
        parent: bytes | None = None
        for depth, (key, tokens) in enumerate(zip(keys, r.block_token_counts, strict=True)):
            if key in store:
                store.touch(key, tenant=r.tenant)
            else:  # pulled or recomputed: the node keeps it, as an agent does
                store.put(
                    key,
                    None,
                    size_bytes=tokens * kv_bytes_per_token,
                    tokens=tokens,
                    tenant=r.tenant,
                    parent=parent,
                    depth=depth,
                )
            parent = key
        fleet.publish()
    result = _policy_result(tally, time.perf_counter() - started, fleet)
    if not keep:
        fleet.stores.clear()
    return result, fleet, backlog


def _choose(
    policy: RoutingPolicy, request: RouteRequest, topology: Topology, costs: Costs
) -> NodeScore | None:
    """The chosen node's score (its fetch plan and modeled TTFT)."""
    if isinstance(policy, CostPolicy):
        decision = policy.decide(request)
        return None if decision is None else decision.chosen
    node = policy.choose(request)
    return None if node is None else _plan_on(node, request.holdings, request, topology, costs)


def _plan_on(
    node: str,
    holdings: Sequence[Sequence[Holding]],
    request: RouteRequest,
    topology: Topology,
    costs: Costs,
) -> NodeScore | None:
    """``node``'s own plan for ``request`` over ``holdings``, scored exactly as the cost policy
    scores it."""
    scores = score_nodes(
        holdings,
        tokens=request.tokens,
        chunk_tokens=request.chunk_tokens,
        topology=topology,
        costs=costs,
        origin_dc=request.origin_dc,
        queue_s=request.queue_s,
        up={node},
    )
    return scores[0] if scores else None


def own_holdings(holdings: Sequence[Sequence[Holding]], node: str) -> list[list[Holding]]:
    """The index's answer as a node that shares with no other sees it: its own copies."""
    return [[h for h in held if owner(h.node) == node] for held in holdings]


def _choose_alone(
    policy: RoutingPolicy, request: RouteRequest, topology: Topology, costs: Costs
) -> NodeScore | None:
    """The choice in a fleet without sharing: requests stay in their home DC (no DC serves
    another's), and each node's plan covers only what it holds itself (no peers, no pool: the
    rest is recomputed). The cost policy takes the best of those plans, ranked as
    ``score_nodes`` ranks; another policy chooses among the home DC's nodes as it would, and
    its node plans alone."""
    home = frozenset(
        name
        for name, node in topology.nodes.items()
        if request.origin_dc is None or node.dc == request.origin_dc
    )
    if request.up is not None:
        home &= request.up

    def alone(node: str) -> NodeScore | None:
        return _plan_on(node, own_holdings(request.holdings, node), request, topology, costs)

    if not isinstance(policy, CostPolicy):
        node = policy.choose(dataclasses.replace(request, up=home))
        return None if node is None else alone(node)
    plans = [p for p in map(alone, sorted(home)) if p is not None]
    return min(plans, key=lambda s: (s.score_s, -s.local_chunks, s.queue_s, s.node), default=None)


def _count(tally: _Tally, chosen: NodeScore, topology: Topology, indexed: bool) -> None:
    tally.per_node[chosen.node] += 1
    tally.indexed += indexed
    tally.to_holder += chosen.local_chunks > 0
    tally.fetched_tokens += chosen.fetched_tokens
    tally.ttft_s.append(chosen.ttft_s)
    for part in tally.parts_s:
        tally.parts_s[part] += getattr(chosen, part)
    for pull in chosen.pulls:
        if not pull.node:
            tally.local_hits += pull.chunks
            continue
        tally.pulled_hits += pull.chunks
        link = f"{topology.nodes[pull.node].dc}->{chosen.dc}"
        tally.pulled_bytes[link] += pull.size_bytes
        tally.pulled_chunks[link] += pull.chunks


def _policy_result(tally: _Tally, seconds: float, fleet: _Fleet) -> dict[str, Any]:
    hits = tally.local_hits + tally.pulled_hits
    served = len(tally.ttft_s)
    return {
        "requests": tally.requests,
        "no_node": tally.no_node,
        "lookups": tally.lookups,
        "hits": hits,
        "local_hits": tally.local_hits,
        "pulled_hits": tally.pulled_hits,
        "hit_ratio": ratio(hits, tally.lookups),
        "local_hit_ratio": ratio(tally.local_hits, tally.lookups),
        "pulled_hit_ratio": ratio(tally.pulled_hits, tally.lookups),
        "token_hit_ratio": ratio(tally.fetched_tokens, tally.tokens),
        "recomputed_tokens": tally.tokens - tally.fetched_tokens,
        "to_holder_requests": tally.to_holder,
        "to_holder_share": ratio(tally.to_holder, served),
        "indexed_requests": tally.indexed,
        "to_holder_share_of_indexed": ratio(tally.to_holder, tally.indexed),
        "pulled_bytes": sum(tally.pulled_bytes.values()),
        "pulled_bytes_by_link": dict(sorted(tally.pulled_bytes.items())),
        "pulled_chunks_by_link": dict(sorted(tally.pulled_chunks.items())),
        "ttft_modeled": {
            **_spread(tally.ttft_s),
            **{f"mean_{k}": v / served if served else 0.0 for k, v in tally.parts_s.items()},
        },
        "requests_per_node": dict(sorted(tally.per_node.items())),
        "index_mismatches": tally.index_mismatches,
        "index_entries_at_end": fleet.entries(),
        "index_events_applied": fleet.events,
        "replay_s": seconds,
    }


def _versus_reference(results: dict[str, dict[str, Any]]) -> None:
    ref = results[REFERENCE_POLICY]
    for result in results.values():
        hr, ref_hr = result["hit_ratio"], ref["hit_ratio"]
        mean, ref_mean = result["ttft_modeled"]["mean_s"], ref["ttft_modeled"]["mean_s"]
        result["vs_reference"] = {
            "reference": REFERENCE_POLICY,
            "hit_ratio_minus_reference": None if hr is None or ref_hr is None else hr - ref_hr,
            "ttft_mean_ratio_to_reference": ratio(mean, ref_mean),
            "ttft_p99_ratio_to_reference": ratio(
                result["ttft_modeled"]["p99_s"], ref["ttft_modeled"]["p99_s"]
            ),
        }


# --- decision latency ------------------------------------------------------------------------


def _pad_index(index: EmbeddedIndex, nodes: Sequence[str], entries: int, rng: random.Random) -> int:
    """Entries of other chunks, so the index is the size of a large fleet's."""
    added = 0
    batch: dict[str, list[ChunkEvent]] = {n: [] for n in nodes}
    need = entries - len(index)
    for i in range(max(0, need)):
        key = rng.randbytes(16)
        batch[nodes[i % len(nodes)]].append(
            ChunkEvent("stored", key, "disk", f"tenant-{i % 8}", False, 64 << 20, 512)
        )
    for node, events in batch.items():
        added += index.apply(node, events)
    return added


def _paced(calls: Sequence[Callable[[], None]], rate_per_s: float) -> tuple[list[float], float]:
    """Each call timed alone, started on a schedule of ``rate_per_s``; the achieved rate."""
    period_s = 1.0 / rate_per_s
    samples: list[float] = []
    start = time.perf_counter()
    for i, call in enumerate(calls):
        due = start + i * period_s
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        t = time.perf_counter()
        call()
        samples.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    return samples, len(calls) / elapsed if elapsed > 0 else 0.0


def decision_latency(
    workload: Workload,
    fleet: _Fleet,
    backlog: _Backlog,
    topology: Topology,
    costs: Costs,
    config: RouteBenchConfig,
) -> dict[str, Any]:
    rng = random.Random(config.seed)
    replayed = fleet.entries()
    padded = _pad_index(fleet.index, list(topology.nodes), config.index_entries, rng)
    index = fleet.index
    home = assign_home_dcs((r.tenant for r in workload.requests), topology.dcs)
    chunk_tokens = workload.requests[0].block_tokens
    picks = [i % len(workload.requests) for i in range(config.latency_requests)]
    end_s = (workload.requests[-1].timestamp_ms - workload.requests[0].timestamp_ms) / 1000
    queue = backlog.queue_s(end_s)
    cost, prefix = CostPolicy(topology, costs), PrefixOnly(topology)
    # the reference: the same keys looked up in a plain dict of the index's answers. These are
    # the index's first answers for the picked requests in this run, timed: later answers come
    # from its answer cache (nothing changes the index while decisions are timed)
    plain: dict[bytes, list[Holding]] = {}
    first_answers_s: list[float] = []
    for i in sorted(set(picks)):
        t = time.perf_counter()
        answer = index.holders(workload.keys[i], tenant="")
        first_answers_s.append(time.perf_counter() - t)
        for key, held in zip(workload.keys[i], answer, strict=True):
            plain[key] = held
    holders_s: list[float] = []

    def routed(policy: CostPolicy | PrefixOnly, i: int) -> Callable[[], None]:
        r, keys = workload.requests[i], workload.keys[i]

        def call() -> None:
            t = time.perf_counter()
            holdings = index.holders(keys, tenant=r.tenant)
            if policy is cost:
                holders_s.append(time.perf_counter() - t)
            request = RouteRequest(
                holdings, r.input_tokens, chunk_tokens, tenant=r.tenant,
                session=workload.sessions[i], origin_dc=home[r.tenant], queue_s=queue,
            )  # fmt: skip
            if policy.choose(request) is None:
                raise RuntimeError("no node could serve a request in the latency run")

        return call

    def looked_up(i: int) -> Callable[[], None]:
        keys = workload.keys[i]

        def call() -> None:
            for key in keys:
                plain.get(key)

        return call

    gc.collect()
    figures: dict[str, Any] = {}
    for name, calls in (
        ("reference", [looked_up(i) for i in picks]),
        ("prefix_only", [routed(prefix, i) for i in picks]),
        ("cost", [routed(cost, i) for i in picks]),
    ):
        samples, achieved = _paced(calls, config.latency_rate_per_s)
        figures[name] = {**_spread(samples), "achieved_rate_per_s": achieved}
    if config.latency_followers:
        figures["router"] = _router_latency(workload, index, topology, costs, config, picks, home)
    figures["cost"]["index_answer"] = _spread(holders_s)
    figures["cost"]["index_answer_first"] = {
        **_spread(first_answers_s),
        "what": "each picked request's first index answer in this run (keys unchanged since "
        "an earlier lookup, in the replay or by a shared prefix, answer from the index's cache)",
    }
    figures["reference"]["what"] = "a plain dict looked up for the same keys (no decision)"
    figures["prefix_only"]["what"] = "index answer + the longest local prefix (prefix-only)"
    figures["cost"]["what"] = (
        "index answer (from its answer cache: the index does not change while timed) + "
        "score.decide (plans of the nodes that could win)"
    )
    p99 = figures["cost"]["p99_s"]
    if "router" in figures:
        figures["router"]["p99_ratio_to_reference"] = ratio(
            figures["router"]["p99_s"], figures["reference"]["p99_s"]
        )
    return {
        "workload": workload.name,
        "requests": len(picks),
        "rate_per_s": config.latency_rate_per_s,
        "chain_chunks_mean": statistics.fmean(len(workload.keys[i]) for i in picks),
        "nodes": len(topology.nodes),
        "index_entries": len(index),
        "index_entries_from_replay": replayed,
        "index_entries_padded": padded,
        **figures,
        "p99_ratio_to_reference": ratio(p99, figures["reference"]["p99_s"]),
        "target_p99_s": TARGETS["decision_p99_s"],
        "meets_target": p99 < TARGETS["decision_p99_s"],
    }


class _IdleAgent(http.server.BaseHTTPRequestHandler):
    """Answers a follower as an agent holding nothing does (its events, /v1/info, /v1/keys):
    the ``router`` figure's followers are each polled once from it, and called up."""

    def do_GET(self) -> None:
        path = self.path.partition("?")[0]
        body: dict[str, Any]
        if path == "/v1/events/recent":
            body = {"events": [], "last_seq": 0, "dropped": 0, "instance": "bench"}
        elif path == "/v1/info":
            body = {"role": "node"}
        elif path == "/v1/keys":
            body = {"items": [], "next": None}
        else:
            self.send_error(404)
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


class _IdleAgentServer(http.server.ThreadingHTTPServer):
    # a round polls 16 followers at once: a backlog of 5 drops their connections
    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a follower that gave up on an answer is tried again (``_followed_router``)


@contextlib.contextmanager
def _followed_router(
    index: EmbeddedIndex, topology: Topology, costs: Costs, count: int
) -> Iterator[tuple[Router, int]]:
    """A router over ``index`` following ``count`` agents, the topology's nodes among them
    (all of them, if more), each up; and how many. They write to an index of their own (their
    listings are empty: ``index``'s entries of the topology's nodes stay) and poll no more once
    up (nothing changes while decisions are timed, as for the other figures)."""
    server = _IdleAgentServer(("127.0.0.1", 0), _IdleAgent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    names = list(topology.nodes)
    names += [f"followed-{i}" for i in range(count - len(names))]
    # long timeouts: a loaded host's slow answer must not fail a poll (no poll runs while
    # decisions are timed); poll_s long: a round's polls wait for the pool's 16 threads
    followers = Followers(
        EmbeddedIndex(),
        {n: (url, None) for n in names},
        poll_s=3600.0,
        drop_after_s=120.0,
        timeout_s=30.0,
    )
    try:
        for _ in range(3):  # a poll that timed out on a loaded host is tried again
            followers.poll_all()
            if len(followers.up_nodes()) == len(names):
                break
        else:
            raise RuntimeError(
                f"{len(names) - len(followers.up_nodes()):,} of {len(names):,} followers not "
                "up after 3 polls of the in-process agent"
            )
        yield Router(index, topology, costs, followers=followers), len(names)
    finally:
        followers.close()
        server.shutdown()
        server.server_close()


def _router_latency(
    workload: Workload,
    index: EmbeddedIndex,
    topology: Topology,
    costs: Costs,
    config: RouteBenchConfig,
    picks: Sequence[int],
    home: dict[str, str],
) -> dict[str, Any]:
    """``Router.route`` (cost) of the picked requests, paced, by a router following
    ``latency_followers`` agents (see ``_followed_router``)."""
    with _followed_router(index, topology, costs, config.latency_followers) as (router, count):

        def routed(i: int) -> Callable[[], None]:
            r, keys = workload.requests[i], workload.keys[i]

            def call() -> None:
                router.route(
                    keys, tenant=r.tenant, tokens=r.input_tokens,
                    origin_dc=home[r.tenant], session=workload.sessions[i],
                )  # fmt: skip

            return call

        calls = [routed(i) for i in picks]
        gc.collect()  # the followers' set-up, not the decisions'
        samples, achieved = _paced(calls, config.latency_rate_per_s)
    return {
        **_spread(samples),
        "achieved_rate_per_s": achieved,
        "followers": count,
        "what": f"Router.route, following {count:,} agents (all up): the followers' node sets "
        "+ index answer (from its answer cache) + score.decide + the router's own tally",
    }


# --- index update rate -----------------------------------------------------------------------


def _update_events(count: int, nodes: int, rng: random.Random) -> list[tuple[str, ChunkEvent]]:
    out = []
    for i in range(count):
        ev = ChunkEvent("stored", rng.randbytes(16), "cpu", f"tenant-{i % 8}", False, 64 << 20, 512)
        out.append((f"node-{i % nodes}", ev))
    return out


def _batches(
    events: Sequence[tuple[str, ChunkEvent]], size: int
) -> list[tuple[str, list[ChunkEvent]]]:
    """Per node, batches of ``size`` events in order (a follower applies one node's poll)."""
    by_node: dict[str, list[ChunkEvent]] = {}
    for node, ev in events:
        by_node.setdefault(node, []).append(ev)
    out: list[tuple[str, list[ChunkEvent]]] = []
    for node, evs in by_node.items():
        out.extend((node, evs[i : i + size]) for i in range(0, len(evs), size))
    return out


def index_update_rate(config: RouteBenchConfig, nodes: int) -> dict[str, Any]:
    rng = random.Random(config.seed + 1)
    stored = _batches(_update_events(config.index_events, nodes, rng), config.index_batch)
    removed = [
        (node, [dataclasses.replace(e, kind="removed", tier="") for e in evs])
        for node, evs in stored
    ]
    n = config.index_events
    samples: dict[str, list[float]] = {
        k: [] for k in ("stored", "removed", "ref_stored", "ref_removed")
    }
    for r in range(config.repeats):
        for which in ("measured", "reference") if r % 2 == 0 else ("reference", "measured"):
            gc.collect()
            if which == "measured":
                index = EmbeddedIndex()
                t = time.perf_counter()
                for node, evs in stored:
                    index.apply(node, evs)
                samples["stored"].append(time.perf_counter() - t)
                t = time.perf_counter()
                for node, evs in removed:
                    index.apply(node, evs)
                samples["removed"].append(time.perf_counter() - t)
                if len(index):
                    raise RuntimeError("the index kept entries after every chunk was removed")
            else:
                plain: dict[bytes, tuple[str, str, int, int]] = {}
                t = time.perf_counter()
                for _node, evs in stored:
                    for e in evs:
                        plain[e.key] = (e.tier, e.tenant, e.size_bytes, e.tokens)
                samples["ref_stored"].append(time.perf_counter() - t)
                t = time.perf_counter()
                for _node, evs in removed:
                    for e in evs:
                        del plain[e.key]
                samples["ref_removed"].append(time.perf_counter() - t)

    def rate(key: str) -> float:
        return n / max(statistics.median(samples[key]), 1e-9)

    out: dict[str, Any] = {
        "events": n,
        "batch_events": config.index_batch,
        "nodes": nodes,
        "repeats": config.repeats,
        "embedded": {
            "stored_events_per_s": rate("stored"),
            "removed_events_per_s": rate("removed"),
            "reference": {
                "what": "plain dict inserts / deletes of the same keys",
                "stored_events_per_s": rate("ref_stored"),
                "removed_events_per_s": rate("ref_removed"),
            },
            "stored_ratio_to_reference": rate("stored") / rate("ref_stored"),
        },
        "target_events_per_s": TARGETS["index_events_per_s"],
    }
    out["embedded"]["meets_target"] = (
        min(rate("stored"), rate("removed")) >= TARGETS["index_events_per_s"]
    )
    out["redis"] = _redis_rate(config, nodes)
    return out


def _redis_rate(config: RouteBenchConfig, nodes: int) -> dict[str, Any]:
    """RedisIndex.apply next to a raw pipeline of HSET/HDEL; {"skipped": why} when it cannot."""
    if not config.redis_url:
        return {"skipped": "no Redis URL given"}
    try:
        from kvctl.index.redis_index import RedisIndex  # written beside this bench; optional
    except ImportError as exc:
        return {"skipped": f"kvctl.index.redis_index is not available ({exc})"}
    try:
        import redis
    except ImportError:
        return {"skipped": "the redis package is not installed"}
    client = redis.Redis.from_url(config.redis_url, socket_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        client.close()
        return {"skipped": f"Redis at {config.redis_url} does not answer ({exc})"}
    prefix = f"kvctl-bench-route-{os.getpid()}-{secrets.token_hex(4)}:"
    rng = random.Random(config.seed + 2)
    stored = _batches(_update_events(config.redis_events, nodes, rng), config.index_batch)
    removed = [
        (node, [dataclasses.replace(e, kind="removed", tier="") for e in evs])
        for node, evs in stored
    ]
    n = config.redis_events
    try:
        index = RedisIndex(config.redis_url, prefix=prefix + "index:")
        try:
            t = time.perf_counter()
            for node, evs in stored:
                index.apply(node, evs)
            stored_s = time.perf_counter() - t
            t = time.perf_counter()
            for node, evs in removed:
                index.apply(node, evs)
            removed_s = time.perf_counter() - t
        finally:
            index.close()
        ref_prefix = prefix + "raw:"
        t = time.perf_counter()
        for node, evs in stored:
            pipe = client.pipeline(transaction=False)
            for e in evs:
                pipe.hset(
                    ref_prefix + e.key.hex(),
                    node,
                    f"{e.tier}|{e.tenant}|0|{e.size_bytes}|{e.tokens}",
                )
            pipe.execute()
        ref_stored_s = time.perf_counter() - t
        t = time.perf_counter()
        for node, evs in removed:
            pipe = client.pipeline(transaction=False)
            for e in evs:
                pipe.hdel(ref_prefix + e.key.hex(), node)
            pipe.execute()
        ref_removed_s = time.perf_counter() - t
        return {
            "url": config.redis_url,
            "events": n,
            "stored_events_per_s": n / max(stored_s, 1e-9),
            "removed_events_per_s": n / max(removed_s, 1e-9),
            "reference": {
                "what": "raw redis-py pipelines of HSET / HDEL of the same keys, one per batch",
                "stored_events_per_s": n / max(ref_stored_s, 1e-9),
                "removed_events_per_s": n / max(ref_removed_s, 1e-9),
            },
            "stored_ratio_to_reference": ref_stored_s / max(stored_s, 1e-9),
        }
    except Exception as exc:  # another helper's module: report it, never crash the bench
        return {"skipped": f"RedisIndex failed: {type(exc).__name__}: {exc}"}
    finally:
        for key in client.scan_iter(match=prefix + "*", count=1000):
            client.delete(key)
        client.close()


# --- the whole run ---------------------------------------------------------------------------


def run_route_bench(
    config: RouteBenchConfig, *, progress: Progress | None = None
) -> dict[str, Any]:
    config.check()
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    topology = build_topology(config)
    inputs = ModeledInputs(model_profile(config.model), gpu_profile(config.gpu), config.mfu)
    costs = build_costs(inputs)
    policies = config.with_reference()
    notes: list[str] = []
    workloads: list[dict[str, Any]] = []
    latency: dict[str, Any] | None = None
    for name in config.workloads:
        loaded = load_workload(name, config)
        if isinstance(loaded, str):
            say(f"{name}: skipped: {loaded}")
            notes.append(f"workload {name} skipped: {loaded}")
            workloads.append({"workload": name, "skipped": loaded})
            continue
        if not loaded.requests:
            workloads.append({"workload": name, "skipped": "no requests"})
            continue
        results: dict[str, dict[str, Any]] = {}
        for policy in policies:
            say(f"{name}: replaying {len(loaded.requests):,} requests with {policy}")
            keep = latency is None and policy == "cost"
            results[policy], fleet, backlog = replay_policy(
                loaded, policy, topology, costs, config, keep=keep
            )
            if keep:
                say(f"{name}: decision latency at {config.latency_rate_per_s:g} requests/s")
                latency = decision_latency(loaded, fleet, backlog, topology, costs, config)
            del fleet, backlog
        _versus_reference(results)
        workloads.append(
            {
                "workload": name,
                "source": loaded.source,
                "requests": len(loaded.requests),
                "chunks": sum(len(k) for k in loaded.keys),
                "tenants": len({r.tenant for r in loaded.requests}),
                "sessions": len(set(loaded.sessions)),
                "reference": REFERENCE_POLICY,
                "policies": results,
            }
        )
    if latency is None:
        notes.append("decision latency not measured: no workload ran with the cost policy")
    say(f"index updates: {config.index_events:,} events in batches of {config.index_batch:,}")
    updates = index_update_rate(config, len(topology.nodes))
    if "skipped" in updates["redis"]:
        notes.append(f"RedisIndex not measured: {updates['redis']['skipped']}")
    return {
        "benchmark": "route",
        "host": host_info(),
        "config": {
            **{k: v for k, v in dataclasses.asdict(config).items() if k != "redis_url"},
            "policies": list(policies),
        },
        "modeled_inputs": {
            "basis": "modeled: TTFT = origin RTT + fetch plan + prefill + queue, from these inputs",
            "profiles": inputs.as_dict(),
            "prefill": costs.prefill.as_dict(),
            "host_to_device_bytes_per_s": costs.host_to_device_bytes_per_s,
            "disk_read_bytes_per_s": costs.disk_read_bytes_per_s,
            "topology": topology.as_dict(),
            "queue": "modeled: each node prefills one request at a time on the workload's "
            "clock (fetch + prefill seconds); decode not modeled",
        },
        "workloads": workloads,
        "decision_latency": latency,
        "index_updates": updates,
        "targets": TARGETS,
        "notes": notes,
        "elapsed_s": time.perf_counter() - started,
    }


# --- for people ------------------------------------------------------------------------------


def render_route_bench(result: dict[str, Any]) -> Group:
    """Tables for people: per workload, each policy beside round-robin; then the decision
    latency and the index's update rate beside their references."""
    from rich.console import Group
    from rich.table import Table

    from kvctl.format import compact_bytes, percent

    parts: list[Any] = []
    prof = result["modeled_inputs"]["profiles"]
    for w in result["workloads"]:
        if "skipped" in w:
            parts.append(f"[yellow]{w['workload']}: skipped: {w['skipped']}[/]")
            continue
        table = Table(
            title=f"{w['workload']}: {w['requests']:,} requests, {w['chunks']:,} chunks",
            caption=f"hits: chunks served local / pulled per chunk looked up; holder: sent to a "
            f"node holding part of the prefix. TTFT modeled ({prof['model']['name']} on "
            f"{prof['gpu']['name']}, MFU {prof['mfu']:g}, fiber-modeled links, queue on the "
            f"workload's clock); vs RR: mean TTFT / {w['reference']}'s",
        )
        for col in ("policy", "hits", "local", "pulled", "holder", "pulled",
                    "TTFT mean", "p50", "p99", "vs RR"):  # fmt: skip
            table.add_column(col, justify="left" if col == "policy" else "right")
        for name, p in w["policies"].items():
            t = p["ttft_modeled"]
            vs = p["vs_reference"]["ttft_mean_ratio_to_reference"]
            table.add_row(
                name,
                percent(p["hit_ratio"]),
                percent(p["local_hit_ratio"]),
                percent(p["pulled_hit_ratio"]),
                percent(p["to_holder_share"], 0),
                compact_bytes(p["pulled_bytes"]),
                _secs(t["mean_s"]),
                _secs(t["p50_s"]),
                _secs(t["p99_s"]),
                "-" if vs is None else f"{vs:.2f}x",
            )
        parts.append(table)
    lat = result["decision_latency"]
    if lat is not None:
        table = Table(
            title=f"decision latency, paced at {lat['rate_per_s']:,.0f}/s",
            caption=f"{lat['requests']:,} requests of {lat['workload']} (mean "
            f"{lat['chain_chunks_mean']:.0f} chunks), {lat['nodes']} nodes, "
            f"{lat['index_entries']:,} index entries; target p99 < "
            f"{lat['target_p99_s'] * 1000:g} ms: " + ("met" if lat["meets_target"] else "MISSED"),
        )
        for col in ("decision", "p50", "p99", "max", "rate"):
            table.add_column(col, justify="left" if col == "decision" else "right")
        rows = [
            ("cost", "cost: index + decide"),
            ("prefix_only", "prefix-only: index + prefix"),
            ("reference", "reference: dict lookups"),
        ]
        if "router" in lat:
            rows.insert(1, ("router", f"router, {lat['router']['followers']:,} followers"))
        for key, label in rows:
            f = lat[key]
            table.add_row(
                label, _secs(f["p50_s"]), _secs(f["p99_s"]), _secs(f["max_s"]),
                f"{f['achieved_rate_per_s']:,.0f}/s",
            )  # fmt: skip
        parts.append(table)
    up = result["index_updates"]
    table = Table(
        title=f"index updates, events/s ({up['events']:,} events, batches of "
        f"{up['batch_events']:,})",
        caption=f"references: plain dict inserts/deletes, raw Redis HSET/HDEL pipelines of the "
        f"same keys; target >= {up['target_events_per_s']:,}/s",
    )
    for col in ("index", "stored", "removed", "ref stored", "ref removed"):
        table.add_column(col, justify="left" if col == "index" else "right")
    for name, fig in (("embedded", up["embedded"]), ("redis", up["redis"])):
        if "skipped" in fig:
            table.add_row(name, "skipped", "", "", "")
            continue
        ref = fig["reference"]
        table.add_row(
            name,
            f"{fig['stored_events_per_s']:,.0f}",
            f"{fig['removed_events_per_s']:,.0f}",
            f"{ref['stored_events_per_s']:,.0f}",
            f"{ref['removed_events_per_s']:,.0f}",
        )
    parts.append(table)
    parts.extend(f"[dim]note: {n}[/]" for n in result["notes"])
    return Group(*parts)


def _secs(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s"


def parse_distances(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise InvalidArgument(
            f"distances are km, comma separated (e.g. 100,1500,1500): {text!r}"
        ) from None


def parse_names(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())
