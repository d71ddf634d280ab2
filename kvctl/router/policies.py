"""Routing policies behind one interface: ours (``cost``) and the baselines it is compared with.

Every policy answers ``choose(request) -> node name`` (None when no node can serve) for a
request described by the index's answer for its chain (``holdings``, already filtered for the
tenant) and what the router knows about the fleet (queues, nodes up). Only serving nodes that
are up and reachable from the request's DC (a link is known) are ever chosen.

``round-robin``
    The next node in turn, as a DC's load balancer deals requests: among the serving nodes of
    the request's DC (all reachable nodes when it has none up, or no DC is given).
``session-affinity``
    The session's (conversation's) node, else the tenant's: rendezvous hashing of that id over
    the same nodes as round-robin, so an id keeps its node while that node is up, and a node
    going down moves only its own ids.
``prefix-only``
    The anchors' approach (llm-d's precise prefix-cache scorer, Dynamo's KV overlap): the node
    holding the longest prefix of the chain itself, over every reachable node; ties go to the
    shorter modeled queue, then the name. It ignores tiers, links and what other nodes hold.
``cost``
    ``kvctl.router.score.decide``: the least modeled time to first token, pulls over DC links
    and recompute included.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvctl.errors import InvalidArgument
from kvctl.index.model import Holding, owner
from kvctl.router.score import Costs, Decision, decide
from kvctl.router.topology import Node, Topology

POLICIES = ("round-robin", "session-affinity", "prefix-only", "cost")
#: the policy every comparison is measured against
REFERENCE_POLICY = "round-robin"


@dataclass(frozen=True)
class RouteRequest:
    """One request as a policy sees it."""

    #: for each chunk of the chain, the nodes holding it that the tenant may see
    holdings: Sequence[Sequence[Holding]]
    tokens: int
    chunk_tokens: int
    tenant: str = ""
    #: the session or conversation id, when the client sends one
    session: str | None = None
    #: the DC the request comes from (None: unknown, no origin round trip is counted)
    origin_dc: str | None = None
    #: modeled seconds of work already routed to each node and not yet done
    queue_s: Mapping[str, float] = field(default_factory=dict)
    #: the nodes that may be chosen (None: all)
    up: frozenset[str] | None = None


@runtime_checkable
class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest) -> str | None:
        """The node to send ``request`` to; None when no node can serve it."""
        ...


def reachable(topology: Topology, request: RouteRequest) -> list[Node]:
    """Serving nodes that are up and have a known link from the request's DC, by name."""
    out: list[Node] = []
    for node in topology.nodes.values():
        if not node.serves or (request.up is not None and node.name not in request.up):
            continue
        if request.origin_dc is not None and topology.link(request.origin_dc, node.dc) is None:
            continue
        out.append(node)
    out.sort(key=lambda n: n.name)
    return out


def _in_origin_dc(topology: Topology, request: RouteRequest) -> list[Node]:
    nodes = reachable(topology, request)
    local = [n for n in nodes if n.dc == request.origin_dc]
    return local or nodes


class RoundRobin:
    name = "round-robin"

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._turn = 0

    def choose(self, request: RouteRequest) -> str | None:
        nodes = _in_origin_dc(self.topology, request)
        if not nodes:
            return None
        node = nodes[self._turn % len(nodes)]
        self._turn += 1
        return node.name


class SessionAffinity:
    name = "session-affinity"

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def choose(self, request: RouteRequest) -> str | None:
        nodes = _in_origin_dc(self.topology, request)
        if not nodes:
            return None
        key = request.session if request.session else f"tenant:{request.tenant}"
        return max(nodes, key=lambda n: (_weight(key, n.name), n.name)).name


def _weight(key: str, node: str) -> bytes:
    """Rendezvous weight of ``node`` for ``key``: stable across processes (not ``hash()``)."""
    data = f"{len(key)}:{key}{node}".encode()
    return hashlib.blake2b(data, digest_size=8).digest()


class PrefixOnly:
    name = "prefix-only"

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def choose(self, request: RouteRequest) -> str | None:
        nodes = reachable(self.topology, request)
        if not nodes:
            return None
        depth = local_prefixes(request.holdings, [n.name for n in nodes])
        queue = request.queue_s
        best = min(nodes, key=lambda n: (-depth[n.name], max(0.0, queue.get(n.name, 0.0)), n.name))
        return best.name


def local_prefixes(holdings: Sequence[Sequence[Holding]], nodes: Sequence[str]) -> dict[str, int]:
    """For each of ``nodes``, the chunks at the head of the chain it holds itself (one walk of
    the chain for all nodes, stopping when none is left). A node's engine cache (indexed as
    ``NODE#ENGINE``) counts as the node's own, as the cost model counts it."""
    depth = dict.fromkeys(nodes, 0)
    alive = set(nodes)
    for i, held in enumerate(holdings):
        holding = {owner(h.node) for h in held} & alive
        for gone in alive - holding:
            depth[gone] = i
        alive = holding
        if not alive:
            return depth
    for node in alive:
        depth[node] = len(holdings)
    return depth


class CostPolicy:
    name = "cost"

    def __init__(self, topology: Topology, costs: Costs) -> None:
        self.topology = topology
        self.costs = costs

    def decide(self, request: RouteRequest, *, explain: bool = False) -> Decision | None:
        """The decision with the chosen node's plan, for callers that show or execute it;
        ``explain``: every node's plan, not only those that could win."""
        return decide(
            request.holdings,
            tokens=request.tokens,
            chunk_tokens=request.chunk_tokens,
            topology=self.topology,
            costs=self.costs,
            origin_dc=request.origin_dc,
            queue_s=request.queue_s,
            up=request.up,
            explain=explain,
        )

    def choose(self, request: RouteRequest) -> str | None:
        decision = self.decide(request)
        return None if decision is None else decision.node


def make_policy(name: str, topology: Topology, costs: Costs) -> RoutingPolicy:
    """A fresh policy by name (round-robin keeps its turn: one instance per replay)."""
    if name == "round-robin":
        return RoundRobin(topology)
    if name == "session-affinity":
        return SessionAffinity(topology)
    if name == "prefix-only":
        return PrefixOnly(topology)
    if name == "cost":
        return CostPolicy(topology, costs)
    raise InvalidArgument(f"unknown routing policy {name!r}; choose from {', '.join(POLICIES)}")
