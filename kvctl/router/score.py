"""The routing decision: which node serves a request fastest, counting what it would pull.

For each node that serves requests, the request's chain of chunks is planned as that node
would fetch it (``kvctl.remote.fetchplan.plan_fetch``'s rules, worked out over runs of chunks
with the same holders: see ``_plan``): each chunk from the node's own tier when
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
    LocalLink,
    PrefillModel,
    Reason,
)
from kvctl.remote.links import Link
from kvctl.router.topology import Node, Topology
from kvctl.store.keys import most_tokens

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
        # refused here, not per request: an infinite rate failed every route's plan (a 400 that
        # blamed the caller) and an infinite weight made scores inf or NaN
        rates = ["disk_read_bytes_per_s", "prefill_watts"]
        if self.host_to_device_bytes_per_s is not None:
            rates.append("host_to_device_bytes_per_s")
        for what in rates:
            value = getattr(self, what)
            if not (math.isfinite(value) and value > 0):
                raise InvalidArgument(f"{what} must be finite and > 0, got {value!r}")
        if not (math.isfinite(self.carbon_s_per_g) and self.carbon_s_per_g >= 0):
            raise InvalidArgument(
                f"carbon_s_per_g must be finite and >= 0, got {self.carbon_s_per_g!r}"
            )


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


def held_tokens(h: Holding, chunk_tokens: int, *, exact: bool = False) -> int:
    """The tokens ``h``'s chunk counts for: what its holder says, at most what the chunk can
    hold, as the remote tiers bound a peer's claim (``RemoteTiers._token_bound``): the larger
    of ``chunk_tokens`` and its bytes at ``MIN_KV_BYTES_PER_TOKEN``. An event bounds tokens by
    an int64 only: a hostile or broken agent's chunk of 2**62 tokens made its holder look as if
    it held the whole prompt (nothing to prefill), and won it every such request. ``exact``:
    the chain's keys are the router's own, of ``chunk_tokens`` tokens each (a prompt routed by
    its token ids), so no chunk holds more, whatever its bytes."""
    if h.tokens <= chunk_tokens:
        return h.tokens
    if exact:
        return chunk_tokens
    return min(h.tokens, most_tokens(chunk_tokens, h.size_bytes))


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
    exact_chunks: bool = False,
) -> list[NodeScore]:
    """Every serving node's score for a chain whose chunks are held as ``holdings`` says (the
    index's answer, already filtered for the tenant), best first. ``up``: the nodes that may be
    chosen (default: all); a node whose DC has no known link from ``origin_dc`` is left out.

    ``prune``: plan only the nodes that could still win. A node's score is at least its origin
    RTT + queue + the prefill of the tokens past everything the fleet holds of the chain (as if
    all of it were fetched for free), so nodes are planned in order of that bound and the rest
    are skipped once a planned node scores below it: the best node is the same, the list holds
    the planned nodes only (what a decision needs; ``--explain`` plans them all).

    ``exact_chunks``: every key of the chain is of ``chunk_tokens`` tokens (the router computed
    them from the prompt's token ids): a holding claiming more counts ``chunk_tokens`` (see
    ``held_tokens``).

    Each plan is ``plan_fetch``'s for the chain on that node, worked out over runs of chunks
    with the same holders (``_Shape``) instead of one ``Candidate`` per chunk; a test checks
    that every figure equals the per-chunk planner's, bit for bit."""
    if tokens < 0 or chunk_tokens <= 0:
        raise InvalidArgument(
            f"tokens must be >= 0 and chunk_tokens > 0, got {tokens}, {chunk_tokens}"
        )
    queue = queue_s or {}
    device = LocalLink("device", 0.0, costs.host_to_device_bytes_per_s, "configured")
    if costs.host_to_device_bytes_per_s is None:
        device = LocalLink("device", 0.0, None, "unreported")
    shape = _Shape.of(holdings, chunk_tokens, costs.prefill, exact_chunks)
    held_tokens = min(tokens, shape.tokens[-1])
    floor_prefill_s = costs.prefill.seconds(held_tokens, tokens)
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
    by_dc: dict[str, _Plan] = {}
    out: list[NodeScore] = []
    best_s = math.inf
    for floor_s, _, node, origin_s in bounded:
        if prune and floor_s > best_s:
            break  # every node left has a bound at least this one's
        own = node.name in shape.all_owners
        plan = None if own else by_dc.get(node.dc)
        if plan is None:
            plan = _plan(shape, node, topology, costs, device)
            if not own:
                by_dc[node.dc] = plan
        scored = _score(node, plan, shape, tokens, costs, origin_s, queue)
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
    """The chain's figures every node's plan shares, worked out once per decision.

    Consecutive chunks with the same holders (node and tier), size and tokens get the same
    source on any node, so the chain is kept as runs of them: a chain of hundreds of chunks is
    mostly a few runs, and a node works out its sources once per holder set."""

    #: (first chunk, chunks, holder set, size_bytes, tokens) of each run, in chain order; a
    #: chunk's size and tokens are the largest any holder reports (tokens: ``held_tokens``'s,
    #: ``chunk_tokens`` when none reports any)
    runs: list[tuple[int, int, int, int, int]]
    #: each holder set's holdings (as its first chunk lists them) and the nodes owning them
    held: list[Sequence[Holding]]
    owners: list[frozenset[str]]
    all_owners: frozenset[str]
    #: tokens of the chain's first k chunks (index k, 0 to the chain's length)
    tokens: list[int]
    #: the prefill model's seconds for those tokens from an empty context (``plan_fetch``'s
    #: recompute time of the first k chunks, the same expression)
    recompute_s: list[float]

    @classmethod
    def of(
        cls,
        holdings: Sequence[Sequence[Holding]],
        chunk_tokens: int,
        prefill: PrefillModel,
        exact: bool = False,
    ) -> _Shape:
        """The shape of ``holdings``' held prefix (up to the first chunk nobody holds)."""
        alpha, beta = prefill.alpha_s_per_token, prefill.beta_s_per_token2
        starts: list[int] = []
        kinds: list[tuple[int, int, int]] = []
        held_sets: list[Sequence[Holding]] = []
        owners: list[frozenset[str]] = []
        ids: dict[tuple[tuple[str, str], ...], int] = {}
        cumulative = [0]
        recompute_s = [0.0]
        total = 0
        last: tuple[tuple[tuple[str, str], ...], int, int] | None = None
        holders: tuple[tuple[str, str], ...]
        for i, held in enumerate(holdings):
            if not held:
                break
            if len(held) == 1:
                h = held[0]
                size, tok, holders = h.size_bytes, h.tokens, ((h.node, h.tier),)
                if tok > chunk_tokens:  # (inline: most chunks are chunk_tokens long)
                    tok = held_tokens(h, chunk_tokens, exact=exact)
                tok = tok or chunk_tokens
            else:
                size = max([h.size_bytes for h in held])
                tok = max([h.tokens for h in held])
                if tok > chunk_tokens:  # (as above: bounded only where some holder claims more)
                    tok = max([held_tokens(h, chunk_tokens, exact=exact) for h in held])
                tok = tok or chunk_tokens
                holders = tuple([(h.node, h.tier) for h in held])
            total += tok
            cumulative.append(total)
            # plan_fetch's recompute_s(k) with start_tokens 0, written as it writes it
            recompute_s.append(total * (alpha + beta * total / 2))
            kind = (holders, size, tok)
            if kind == last:
                continue
            last = kind
            set_id = ids.get(holders)
            if set_id is None:
                set_id = ids[holders] = len(held_sets)
                held_sets.append(held)
                owners.append(frozenset([owner(h.node) for h in held]))
            starts.append(i)
            kinds.append((set_id, size, tok))
        ends = [*starts[1:], len(cumulative) - 1] if starts else []
        runs = [
            (first, end - first, set_id, size, tok)
            for first, end, (set_id, size, tok) in zip(starts, ends, kinds, strict=True)
        ]
        return cls(runs, held_sets, owners, frozenset().union(*owners), cumulative, recompute_s)

    def local_chunks(self, node: str) -> int:
        """Chunks at the head of the chain ``node`` holds itself (``local_prefix``)."""
        for first, _, set_id, _, _ in self.runs:
            if node not in self.owners[set_id]:
                return first
        return len(self.tokens) - 1


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a node's score takes from its fetch plan (``plan_fetch``'s figures)."""

    fetch_s: float
    reason: Reason
    #: each link the plan's candidates named: as_dict(), by name
    links: dict[str, dict[str, object]]
    fetched_chunks: int
    #: tokens of the fetched chunks (before the request's own count caps them)
    fetched_tokens: int
    pulled_chunks: int
    pulled_bytes: int
    pulls: tuple[Pull, ...]


def _plan(shape: _Shape, node: Node, topology: Topology, costs: Costs, device: LocalLink) -> _Plan:
    """``plan_fetch`` of the chain on ``node``, run by run (see ``score_nodes``).

    Candidates are the chunks up to the first that has no source on this node (or no bytes);
    each takes its cheapest source (``_cheapest``). Walking the chunks in order, the plan keeps
    plan_fetch's sums as it keeps them (each link's bytes, each stage's slowest link, the host
    -> device bytes), so its floats round alike, and the fetched prefix is the k that saves
    the most time (ties: the larger k; none unless it saves some). The router's links are
    all costed and none is overridden, so plan_fetch's override and uncosted cases never
    arise here."""
    links: dict[str, AnyLink] = {}
    names: dict[str, tuple[str, str]] = {}
    stages: dict[str, int] = {}
    sources_of: dict[int, tuple[str, ...]] = {}
    choice_of: dict[tuple[int, int], str | None] = {}
    named: set[str] = set()
    link_bytes: dict[str, int] = {}
    stage_s = [0.0, 0.0]  # the slowest link's time so far, by stage
    stages_total_s = 0.0
    device_bytes = 0
    device_rtt_s, device_bw = device.rtt_s, device.bandwidth_bytes_per_s
    recompute_s = shape.recompute_s
    k = best_k = 0
    best_saved_s = best_fetch_s = 0.0
    #: (first chunk, chunks, link, size_bytes) of each run of candidates
    used: list[tuple[int, int, str, int]] = []
    for first, count, set_id, size, _ in shape.runs:
        sources = sources_of.get(set_id)
        if sources is None:
            found = [
                _link_for(h, node, topology, costs, links, names, stages)
                for h in shape.held[set_id]
            ]
            sources = sources_of[set_id] = tuple([n for n in found if n is not None])
        if not sources or size <= 0:
            break
        choice = (set_id, size)
        if choice in choice_of:
            name = choice_of[choice]
        else:
            name = choice_of[choice] = _cheapest(sources, links, size)
        if name is None:  # only uncosted sources: _link_for builds none
            break
        named.update(sources)
        used.append((first, count, name, size))
        link = links[name]
        rtt_s, bw = link.rtt_s or 0.0, link.bandwidth_bytes_per_s
        stage = stages[name]
        slowest_s = stage_s[stage]
        nbytes = link_bytes.get(name, 0)
        crosses = name not in DEVICE_TIERS
        # the loop plan_fetch runs per candidate, with this run's figures held in locals
        for _ in range(count):
            nbytes += size
            link_s = rtt_s + (0.0 if bw is None else nbytes / bw)  # link.fetch_s(nbytes)
            grown_s = link_s - slowest_s
            if grown_s > 0:
                slowest_s = link_s
                stages_total_s += grown_s
            if crosses:
                device_bytes += size
            device_s = 0.0
            if device_bytes:
                device_s = device_rtt_s + (device_bytes / device_bw if device_bw else 0.0)
            fetch_s = stages_total_s + device_s
            k += 1
            saved_s = recompute_s[k] - fetch_s
            if saved_s > 0.0 and saved_s >= best_saved_s:
                best_k, best_saved_s, best_fetch_s = k, saved_s, fetch_s
        link_bytes[name] = nbytes
        stage_s[stage] = slowest_s
    reason: Reason = "fetch"
    if not used:
        reason = "no-candidates"
    elif best_k == 0:
        reason = "slower-than-recompute"
    # the fetched prefix as runs from one place each, and what it pulls from other nodes
    pulls: list[Pull] = []
    pulled_chunks = pulled_bytes = 0
    left = best_k
    for first, count, name, size in used:
        if left <= 0:
            break
        chunks = min(count, left)
        left -= chunks
        holder, tier = names[name]
        nbytes = chunks * size
        if holder:
            pulled_chunks += chunks
            pulled_bytes += nbytes
        if pulls and (pulls[-1].node, pulls[-1].tier) == (holder, tier):
            last = pulls[-1]
            pulls[-1] = Pull(
                last.first, last.chunks + chunks, holder, tier, last.size_bytes + nbytes
            )
        else:
            pulls.append(Pull(first, chunks, holder, tier, nbytes))
    return _Plan(
        fetch_s=best_fetch_s,
        reason=reason,
        links={name: links[name].as_dict() for name in sorted(named)},
        fetched_chunks=best_k,
        fetched_tokens=shape.tokens[best_k],
        pulled_chunks=pulled_chunks,
        pulled_bytes=pulled_bytes,
        pulls=tuple(pulls),
    )


def _cheapest(sources: Sequence[str], links: Mapping[str, AnyLink], size: int) -> str | None:
    """``plan_fetch``'s source for a chunk of ``size`` bytes: the least transfer time, then
    the smaller RTT, then the name; None when no source can be costed."""
    best: tuple[float, float, str] | None = None
    for name in sources:
        link = links[name]
        transfer_s = link.transfer_s(size)
        if transfer_s is None or link.rtt_s is None:
            continue
        key = (transfer_s, link.rtt_s, name)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]


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
    plan: _Plan,
    shape: _Shape,
    tokens: int,
    costs: Costs,
    origin_s: float,
    queue: Mapping[str, float],
) -> NodeScore:
    fetched_tokens = min(plan.fetched_tokens, tokens)
    prefill_s = costs.prefill.seconds(fetched_tokens, tokens)
    queue_s = max(0.0, float(queue.get(node.name, 0.0)))
    ttft_s = origin_s + plan.fetch_s + prefill_s + queue_s
    carbon_g = _carbon_g(node, prefill_s, costs)
    score_s = ttft_s + (costs.carbon_s_per_g * carbon_g if carbon_g else 0.0)
    return NodeScore(
        node=node.name,
        dc=node.dc,
        local_chunks=shape.local_chunks(node.name),
        fetched_chunks=plan.fetched_chunks,
        fetched_tokens=fetched_tokens,
        pulled_chunks=plan.pulled_chunks,
        pulled_bytes=plan.pulled_bytes,
        origin_s=origin_s,
        fetch_s=plan.fetch_s,
        prefill_s=prefill_s,
        queue_s=queue_s,
        carbon_g=carbon_g,
        ttft_s=ttft_s,
        score_s=score_s,
        pulls=plan.pulls,
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
