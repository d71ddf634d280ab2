"""The routing decision: which node serves a request fastest, counting what it would pull.

For each node that serves requests, the request's chain of chunks is planned as that node
would fetch it (``kvctl.remote.fetchplan.plan_fetch``): each chunk from the node's own tier when
it holds it (gpu free, cpu at the host -> device copy, disk at its read rate), else pulled from
another holder over the link between the two DCs, the chain stopping at the first chunk nobody
holds; the planner takes the prefix worth fetching and the rest is recomputed. A node's modeled
time to first token is::

    ttft_s = origin_rtt_s        (the request travels from its DC to the node's and back)
           + fetch_s             (the plan's pulls and reads, then the device copy)
           + prefill_s           (the tokens not fetched, after the fetched prefix)
           + queue_s             (work already routed to the node and not yet done)

and the node with the least ``score_s`` (``ttft_s``, plus the optional carbon weight times the
grams of CO2 its prefill emits) wins; ties go to the node holding more of the prefix itself,
then the shorter queue, then the name. Every figure is modeled from the inputs shown in the
decision (the link figures' basis, the prefill model's basis), so ``--explain`` shows why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvctl.errors import InvalidArgument
from kvctl.index.model import Holding, owner
from kvctl.remote.fetchplan import (
    DEVICE_TIERS,
    AnyLink,
    Candidate,
    FetchPlan,
    LocalLink,
    PrefillModel,
    plan_fetch,
)
from kvctl.remote.links import Link
from kvctl.router.topology import Node, Topology

#: an NVMe read's latency before its first byte, and a read rate for a disk nobody measured
DISK_READ_LATENCY_S = 1e-4
DISK_READ_BYTES_PER_S = 3e9
#: joules per kWh, for grams of CO2 from a carbon intensity
_J_PER_KWH = 3.6e6
#: the stage of pulls from other nodes (before the node's own reads), as the agent fills
_PULL_STAGE = 0
_LOCAL_STAGE = 1


@dataclass(frozen=True, slots=True)
class Costs:
    """What the router assumes about every node; each figure is reported with its basis."""

    prefill: PrefillModel
    #: host -> device copy; None: free (not reported, or a CPU engine)
    host_to_device_bytes_per_s: float | None = None
    disk_read_bytes_per_s: float = DISK_READ_BYTES_PER_S
    #: seconds of score per gram of CO2 (0: carbon is shown, not weighed)
    carbon_s_per_g: float = 0.0
    #: a node's GPU power while prefilling, for the carbon figure
    prefill_watts: float = 700.0

    def __post_init__(self) -> None:
        for what in ("disk_read_bytes_per_s", "prefill_watts"):
            value = getattr(self, what)
            if not value > 0:
                raise InvalidArgument(f"{what} must be > 0, got {value!r}")
        if not self.carbon_s_per_g >= 0:
            raise InvalidArgument(f"carbon_s_per_g must be >= 0, got {self.carbon_s_per_g!r}")


@dataclass(frozen=True, slots=True)
class Pull:
    """A run of consecutive chunks the chosen node takes from one place."""

    first: int
    chunks: int
    #: the holder ("" for the node itself) and its tier
    node: str
    tier: str
    size_bytes: int

    def as_dict(self) -> dict[str, object]:
        return {
            "first": self.first,
            "chunks": self.chunks,
            "from": self.node or "local",
            "tier": self.tier,
            "size_bytes": self.size_bytes,
        }


@dataclass(frozen=True)
class NodeScore:
    node: str
    dc: str
    #: chunks of the chain's prefix the node holds itself
    local_chunks: int
    #: chunks the plan takes (local reads and pulls) and the tokens they carry
    fetched_chunks: int
    fetched_tokens: int
    pulled_chunks: int
    pulled_bytes: int
    origin_s: float
    fetch_s: float
    prefill_s: float
    queue_s: float
    carbon_g: float | None
    ttft_s: float
    score_s: float
    pulls: tuple[Pull, ...]
    reason: str
    #: the plan's links (name -> figures with their basis)
    links: Mapping[str, Mapping[str, object]] = field(default_factory=dict)

    def as_dict(self, *, links: bool = True) -> dict[str, object]:
        out: dict[str, object] = {
            "node": self.node,
            "dc": self.dc,
            "local_chunks": self.local_chunks,
            "fetched_chunks": self.fetched_chunks,
            "fetched_tokens": self.fetched_tokens,
            "pulled_chunks": self.pulled_chunks,
            "pulled_bytes": self.pulled_bytes,
            "origin_s": self.origin_s,
            "fetch_s": self.fetch_s,
            "prefill_s": self.prefill_s,
            "queue_s": self.queue_s,
            "carbon_g": self.carbon_g,
            "ttft_s": self.ttft_s,
            "score_s": self.score_s,
            "pulls": [p.as_dict() for p in self.pulls],
            "plan_reason": self.reason,
        }
        if links:
            out["links"] = {k: dict(v) for k, v in self.links.items()}
        return out


@dataclass(frozen=True)
class Decision:
    node: str
    dc: str
    chunks: int
    tokens: int
    #: chunks at the head of the chain some node holds (visible to the tenant)
    indexed_chunks: int
    chosen: NodeScore
    #: every node scored, best first
    scores: tuple[NodeScore, ...]
    prefill: Mapping[str, object]

    def as_dict(self, *, explain: bool = False) -> dict[str, object]:
        out: dict[str, object] = {
            "node": self.node,
            "dc": self.dc,
            "chunks": self.chunks,
            "tokens": self.tokens,
            "indexed_chunks": self.indexed_chunks,
            **{
                k: v for k, v in self.chosen.as_dict(links=False).items() if k not in ("node", "dc")
            },
        }
        if explain:
            out["scores"] = [s.as_dict() for s in self.scores]
            out["prefill"] = dict(self.prefill)
        return out


def held_prefix(holdings: Sequence[Sequence[Holding]]) -> int:
    """Chunks at the head of the chain that some node holds."""
    n = 0
    for held in holdings:
        if not held:
            break
        n += 1
    return n


def local_prefix(holdings: Sequence[Sequence[Holding]], node: str) -> int:
    """Chunks at the head of the chain ``node`` holds itself."""
    n = 0
    for held in holdings:
        if not any(owner(h.node) == node for h in held):
            break
        n += 1
    return n


def score_nodes(
    holdings: Sequence[Sequence[Holding]],
    *,
    tokens: int,
    chunk_tokens: int,
    topology: Topology,
    costs: Costs,
    origin_dc: str | None = None,
    queue_s: Mapping[str, float] | None = None,
    up: frozenset[str] | set[str] | None = None,
    prune: bool = False,
) -> list[NodeScore]:
    """Every serving node's score for a chain whose chunks are held as ``holdings`` says (the
    index's answer, already filtered for the tenant), best first. ``up``: the nodes that may be
    chosen (default: all); a node whose DC has no known link from ``origin_dc`` is left out.

    ``prune``: plan only the nodes that could still win. A node's score is at least its origin
    RTT + queue + the prefill of the tokens past everything the fleet holds of the chain (as if
    all of it were fetched for free), so nodes are planned in order of that bound and the rest
    are skipped once a planned node scores below it: the best node is the same, the list holds
    the planned nodes only (what a decision needs; ``--explain`` plans them all)."""
    if tokens < 0 or chunk_tokens <= 0:
        raise InvalidArgument(
            f"tokens must be >= 0 and chunk_tokens > 0, got {tokens}, {chunk_tokens}"
        )
    queue = queue_s or {}
    k = held_prefix(holdings)
    chain = list(holdings[:k])
    device = LocalLink("device", 0.0, costs.host_to_device_bytes_per_s, "configured")
    if costs.host_to_device_bytes_per_s is None:
        device = LocalLink("device", 0.0, None, "unreported")
    shape = _Shape.of(chain, chunk_tokens)
    held_tokens = min(tokens, sum(shape.tokens))
    floor_prefill_s = costs.prefill.seconds(held_tokens, tokens)
    owners = {owner(h.node) for held in chain for h in held}
    bounded: list[tuple[float, str, Node, float]] = []
    for node in topology.nodes.values():
        if not node.serves or (up is not None and node.name not in up):
            continue
        origin_s = 0.0
        if origin_dc is not None:
            to_node = topology.link(origin_dc, node.dc)
            if to_node is None:
                continue
            origin_s = to_node.rtt_s
        node_queue_s = max(0.0, float(queue.get(node.name, 0.0)))
        # the same sum as _score's with nothing to fetch, so a bound is never above a score
        floor_s = origin_s + 0.0 + floor_prefill_s + node_queue_s
        floor_s += costs.carbon_s_per_g * (_carbon_g(node, floor_prefill_s, costs) or 0.0)
        bounded.append((floor_s, node.name, node, origin_s))
    if prune:
        bounded.sort(key=lambda b: (b[0], b[1]))
    # nodes that hold none of the chain plan alike within a DC: plan once per DC
    by_dc: dict[str, tuple[FetchPlan, dict[str, tuple[str, str]]]] = {}
    out: list[NodeScore] = []
    best_s = math.inf
    for floor_s, _, node, origin_s in bounded:
        if prune and floor_s > best_s:
            break  # every node left has a bound at least this one's
        own = node.name in owners
        if not own and node.dc in by_dc:
            plan, names = by_dc[node.dc]
        else:
            plan, names = _plan(chain, shape, node, topology, costs, device)
            if not own:
                by_dc[node.dc] = (plan, names)
        scored = _score(node, plan, names, chain, shape, tokens, costs, origin_s, queue)
        best_s = min(best_s, scored.score_s)
        out.append(scored)
    out.sort(key=lambda s: (s.score_s, -s.local_chunks, s.queue_s, s.node))
    return out


def _carbon_g(node: Node, prefill_s: float, costs: Costs) -> float | None:
    """Grams of CO2 the node's DC emits prefilling for ``prefill_s``; None when unknown."""
    if node.carbon_g_per_kwh is None:
        return None
    return prefill_s * costs.prefill_watts * node.pue / _J_PER_KWH * node.carbon_g_per_kwh


@dataclass(frozen=True, slots=True)
class _Shape:
    """The chain's figures every node's plan shares, worked out once per decision."""

    #: each chunk's size and tokens (the largest any holder reports)
    sizes: list[int]
    tokens: list[int]
    #: each chunk's holder set as a small number: chunks with the same holders (most of a
    #: chain) get the same sources, so a node works them out once per set
    sets: list[int]

    @classmethod
    def of(cls, chain: Sequence[Sequence[Holding]], chunk_tokens: int) -> _Shape:
        sizes: list[int] = []
        tokens: list[int] = []
        sets: list[int] = []
        ids: dict[tuple[tuple[str, str], ...], int] = {}
        for held in chain:
            sizes.append(max(h.size_bytes for h in held))
            tokens.append(max(h.tokens for h in held) or chunk_tokens)
            sets.append(ids.setdefault(tuple((h.node, h.tier) for h in held), len(ids)))
        return cls(sizes, tokens, sets)


def _plan(
    chain: Sequence[Sequence[Holding]],
    shape: _Shape,
    node: Node,
    topology: Topology,
    costs: Costs,
    device: LocalLink,
) -> tuple[FetchPlan, dict[str, tuple[str, str]]]:
    """The fetch plan of ``chain`` on ``node``, and each link name's (holder, tier)."""
    links: dict[str, AnyLink] = {}
    names: dict[str, tuple[str, str]] = {}
    stages: dict[str, int] = {}
    candidates: list[Candidate] = []
    by_set: dict[int, tuple[str, ...]] = {}
    trusted = Candidate.trusted
    for i, held in enumerate(chain):
        holders = shape.sets[i]
        sources = by_set.get(holders)
        if sources is None:
            found = (_link_for(h, node, topology, costs, links, names, stages) for h in held)
            sources = by_set[holders] = tuple(name for name in found if name is not None)
        size = shape.sizes[i]
        if not sources or size <= 0:
            break
        # figures the index already checked (ChunkEvent): no second check per chunk and node
        candidates.append(trusted(i, size, shape.tokens[i], sources))
    plan = plan_fetch(
        candidates,
        links,
        costs.prefill,
        stages=stages,
        device=device,
        on_device=DEVICE_TIERS,
    )
    return plan, names


def _link_for(
    h: Holding,
    node: Node,
    topology: Topology,
    costs: Costs,
    links: dict[str, AnyLink],
    names: dict[str, tuple[str, str]],
    stages: dict[str, int],
) -> str | None:
    if owner(h.node) == node.name:  # its agent's tiers, or its engine's own cache
        name = h.tier
        if name not in links:
            if h.tier in DEVICE_TIERS or h.tier == "cpu":
                links[name] = LocalLink(
                    name, 0.0, None, "host memory" if h.tier == "cpu" else "device"
                )
            else:
                links[name] = LocalLink(
                    name, DISK_READ_LATENCY_S, costs.disk_read_bytes_per_s, "configured"
                )
            names[name] = ("", h.tier)
            stages[name] = _LOCAL_STAGE
        return name
    if h.engine_cache:  # another engine's GPU memory: nothing can pull from it
        return None
    name = f"{h.node}/{h.tier}"
    if name in links:
        return name
    holder = topology.nodes.get(h.node)
    if holder is None:  # the index knows a node the topology does not: cannot cost it
        return None
    dc_link = topology.link(node.dc, holder.dc)
    if dc_link is None:
        return None
    bw = dc_link.bandwidth_bytes_per_s
    rtt_s = dc_link.rtt_s
    if h.tier not in DEVICE_TIERS and h.tier != "cpu":  # the holder reads it from its disk
        bw = min(bw, costs.disk_read_bytes_per_s)
        rtt_s += DISK_READ_LATENCY_S
    links[name] = Link(name, rtt_s, bw, "measured" if dc_link.basis == "measured" else "configured")
    names[name] = (h.node, h.tier)
    stages[name] = _PULL_STAGE
    return name


def _score(
    node: Node,
    plan: FetchPlan,
    names: Mapping[str, tuple[str, str]],
    chain: Sequence[Sequence[Holding]],
    shape: _Shape,
    tokens: int,
    costs: Costs,
    origin_s: float,
    queue: Mapping[str, float],
) -> NodeScore:
    fetched_tokens = 0
    pulled_chunks = pulled_bytes = 0
    pulls: list[Pull] = []
    for index, link in plan.fetch:
        holder, tier = names[link]
        size = shape.sizes[index]
        fetched_tokens += shape.tokens[index]
        if holder:
            pulled_chunks += 1
            pulled_bytes += size
        last = pulls[-1] if pulls else None
        if last is not None and (last.node, last.tier) == (holder, tier):
            pulls[-1] = Pull(last.first, last.chunks + 1, holder, tier, last.size_bytes + size)
        else:
            pulls.append(Pull(index, 1, holder, tier, size))
    fetched_tokens = min(fetched_tokens, tokens)
    prefill_s = costs.prefill.seconds(fetched_tokens, tokens)
    queue_s = max(0.0, float(queue.get(node.name, 0.0)))
    ttft_s = origin_s + plan.fetch_s + prefill_s + queue_s
    carbon_g = _carbon_g(node, prefill_s, costs)
    score_s = ttft_s + (costs.carbon_s_per_g * carbon_g if carbon_g else 0.0)
    return NodeScore(
        node=node.name,
        dc=node.dc,
        local_chunks=local_prefix(chain, node.name),
        fetched_chunks=len(plan.fetch),
        fetched_tokens=fetched_tokens,
        pulled_chunks=pulled_chunks,
        pulled_bytes=pulled_bytes,
        origin_s=origin_s,
        fetch_s=plan.fetch_s,
        prefill_s=prefill_s,
        queue_s=queue_s,
        carbon_g=carbon_g,
        ttft_s=ttft_s,
        score_s=score_s,
        pulls=tuple(pulls),
        reason=plan.reason,
        links=plan.links,
    )


def decide(
    holdings: Sequence[Sequence[Holding]],
    *,
    tokens: int,
    chunk_tokens: int,
    topology: Topology,
    costs: Costs,
    origin_dc: str | None = None,
    queue_s: Mapping[str, float] | None = None,
    up: frozenset[str] | set[str] | None = None,
    explain: bool = False,
) -> Decision | None:
    """The best node (see the module); None when no node can serve. Only the nodes that could
    win are planned (``score_nodes(prune=True)``) unless ``explain``."""
    scores = score_nodes(
        holdings,
        tokens=tokens,
        chunk_tokens=chunk_tokens,
        topology=topology,
        costs=costs,
        origin_dc=origin_dc,
        queue_s=queue_s,
        up=up,
        prune=not explain,
    )
    if not scores:
        return None
    return decision_for(scores[0], scores, holdings, tokens=tokens, costs=costs)


def decision_for(
    chosen: NodeScore,
    scores: Sequence[NodeScore],
    holdings: Sequence[Sequence[Holding]],
    *,
    tokens: int,
    costs: Costs,
) -> Decision:
    """The decision that ``chosen`` (the best of ``scores``, or a baseline policy's pick)
    serves the request."""
    return Decision(
        node=chosen.node,
        dc=chosen.dc,
        chunks=len(holdings),
        tokens=tokens,
        indexed_chunks=held_prefix(holdings),
        chosen=chosen,
        scores=tuple(scores),
        prefill=costs.prefill.as_dict(),
    )
