"""Replay routing through a ``kvctl router``, and the agents' own pulls measured around a run.

With routing "router" the replay asks the router which node serves each request
(``RouterChooser``), serves it on that node, any DC, and leaves every transfer between nodes to
the agents: the chosen agent's lookup plans fetch-or-recompute over its own tiers, its peers and
the pool, and its gets pull what it chose. What crossed which link is then read from the agents'
own counters (``/v1/remote``: chunks and bytes each node took in from each peer and the pool),
before and after the run (``read_pulls``, ``PullTally``): measured, not the replay's estimate.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvctl.errors import KvctlError
from kvctl.ratios import ratio

if TYPE_CHECKING:
    from kvctl.client import AgentClient

#: the agent's tiers beyond the node itself (pool, peers): a hit there is pulled in by a get
REMOTE_TIERS = frozenset({"peer", "remote"})


def held_locally(tier: str | None) -> bool:
    """A location the node holds itself (a local tier), not a pool or peer it would pull from."""
    return tier is not None and tier not in REMOTE_TIERS


@dataclass
class RoutingTally:
    """The router's answers as the replay got them."""

    #: the router's policy asked for ("cost", or a baseline such as "round-robin")
    policy: str = "cost"
    #: requests the router named a serving node for
    decisions: int = 0
    #: decisions sent to a node already holding part of the prefix (the router's local_chunks)
    to_holder: int = 0
    #: decisions for a node outside the tenant's home DC
    other_dc: int = 0
    #: requests served on the home DC's round-robin node instead: the router failed or named
    #: no node the replay drives
    fallbacks: int = 0
    #: requests shorter than a chunk: no key to route by, served on the home DC's round-robin
    no_chunks: int = 0
    by_node: Counter[str] = field(default_factory=Counter)
    #: chunks the router's (modeled) plans said the chosen node would pull from elsewhere
    planned_pulled_chunks: int = 0
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "decisions": self.decisions,
            "to_holder": self.to_holder,
            "to_holder_ratio": ratio(self.to_holder, self.decisions),
            "other_dc": self.other_dc,
            "fallbacks": self.fallbacks,
            "no_chunks": self.no_chunks,
            "by_node": dict(self.by_node),
            "planned_pulled_chunks": self.planned_pulled_chunks,
            "planned_basis": "modeled by the router",
            "last_error": self.last_error,
        }


class RouteAsker(Protocol):
    """What the replay needs of a router: ``kvctl.router.client.RouterClient`` (the workload
    layer sits below the router and is handed one), raising a ``KvctlError`` when it fails."""

    def route(
        self,
        *,
        tenant: str = "",
        keys: Sequence[bytes | str] | None = None,
        prompt_tokens: int | None = None,
        origin_dc: str | None = None,
        policy: str = "cost",
    ) -> dict[str, Any]: ...


class RouterChooser:
    """Asks the router for each request's node; counts its answers in ``tally``."""

    def __init__(self, client: RouteAsker, policy: str = "cost") -> None:
        self.client = client
        self.tally = RoutingTally(policy=policy)

    def choose(
        self,
        keys: Sequence[bytes],
        *,
        tenant: str,
        home_dc: str,
        prompt_tokens: int,
        nodes: Mapping[str, str],
    ) -> str | None:
        """The node (a key of ``nodes``: node -> DC) the router names, or None (a fallback,
        counted) when it fails or names a node not in ``nodes``."""
        t = self.tally
        try:
            answer = self.client.route(
                keys=list(keys),
                tenant=tenant,
                origin_dc=home_dc,
                policy=t.policy,
                # the prompt's full length: a partial tail chunk is prefilled too
                prompt_tokens=max(prompt_tokens, 0),
            )
        except KvctlError as exc:  # the router failed or refused: the replay goes on
            t.fallbacks += 1
            t.last_error = str(exc)
            return None
        node = answer.get("node")
        if not isinstance(node, str) or node not in nodes:
            t.fallbacks += 1
            t.last_error = f"the router named {node!r}, not a node this replay drives"
            return None
        # a router's counts as it sent them: int() of "many", 1e400 or [1] failed the replay
        # at this request, the summary of all before it lost
        local, pulled = (answer.get(name, 0) for name in ("local_chunks", "pulled_chunks"))
        bad = next(
            ((n, v) for n, v in (("local_chunks", local), ("pulled_chunks", pulled))
             if v is not None and (type(v) is not int or v < 0)),
            None,
        )  # fmt: skip
        if bad is not None:
            t.fallbacks += 1
            t.last_error = f"the router's answer has {bad[0]} {bad[1]!r}, not a count of chunks"
            return None
        # a plan holds or pulls at most the chain's chunks: 10**400 was summed as it came
        over = next(
            ((n, v) for n, v in (("local_chunks", local), ("pulled_chunks", pulled))
             if v is not None and v > len(keys)),
            None,
        )  # fmt: skip
        if over is not None:
            t.fallbacks += 1
            t.last_error = (
                f"the router's answer has {over[0]} {over[1]!r:.40}, more than the "
                f"{len(keys):,} chunks asked about"
            )
            return None
        t.decisions += 1
        t.by_node[node] += 1
        if local:
            t.to_holder += 1
        if nodes[node] != home_dc:
            t.other_dc += 1
        t.planned_pulled_chunks += pulled or 0
        return node


#: source name (the pool, a peer) -> (chunks_in, bytes_in) so far
SourceCounts = dict[str, tuple[int, int]]


def read_pulls(control: AgentClient) -> SourceCounts:
    """What the node has taken in from each source so far (its pool and peers), by name."""
    report = control.remote()
    sources = [report["pool"]] if report.get("pool") else []
    sources += report.get("peers") or []
    return {
        str(s["name"]): (int(s.get("chunks_in", 0)), int(s.get("bytes_in", 0))) for s in sources
    }


def link_name(a: str, b: str) -> str:
    return "<->".join(sorted((a, b)))


@dataclass
class LinkPulls:
    cross_dc: bool
    chunks: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"cross_dc": self.cross_dc, "chunks": self.chunks, "bytes": self.bytes}


@dataclass
class PullTally:
    """Chunks the agents pulled from their pool and peers during the run, measured by the
    agents (``/v1/remote`` chunks_in/bytes_in increases), by DC link and by node and source."""

    #: link -> pulls: ``A<->B`` between two DCs, the DC's own name within one
    by_link: dict[str, LinkPulls] = field(default_factory=dict)
    #: node -> source -> {chunks, bytes, dc}
    by_node: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    #: sources whose DC the replay did not know (their pulls are under ``?NAME`` links)
    unknown_dc: set[str] = field(default_factory=set)

    @property
    def cross_dc_bytes(self) -> int:
        return sum(p.bytes for p in self.by_link.values() if p.cross_dc)

    @property
    def within_dc_bytes(self) -> int:
        return sum(p.bytes for p in self.by_link.values() if not p.cross_dc)

    def add(self, node: str, node_dc: str, source: str, source_dc: str | None,
            chunks: int, nbytes: int) -> None:  # fmt: skip
        if chunks <= 0 and nbytes <= 0:
            return
        self.by_node.setdefault(node, {})[source] = {
            "chunks": chunks,
            "bytes": nbytes,
            "dc": source_dc,
        }
        if source_dc is None:
            self.unknown_dc.add(source)
            name, cross = link_name(f"?{source}", node_dc), True
        elif source_dc == node_dc:
            name, cross = node_dc, False
        else:
            name, cross = link_name(source_dc, node_dc), True
        link = self.by_link.setdefault(name, LinkPulls(cross))
        link.chunks += chunks
        link.bytes += nbytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "basis": "measured: the agents' /v1/remote chunks_in and bytes_in",
            "by_link": {k: v.as_dict() for k, v in sorted(self.by_link.items())},
            "cross_dc_bytes": self.cross_dc_bytes,
            "within_dc_bytes": self.within_dc_bytes,
            "by_node": self.by_node,
            "unknown_dc_sources": sorted(self.unknown_dc),
        }


def pulls_between(
    before: Mapping[str, SourceCounts],
    after: Mapping[str, SourceCounts],
    node_dc: Mapping[str, str],
    source_dcs: Mapping[str, str],
) -> PullTally:
    """The pulls between two readings of every node (``read_pulls``). A source's DC is its
    node's (a peer is named as in the fleet) or given in ``source_dcs`` (e.g. the pool)."""
    out = PullTally()
    for node, counts in after.items():
        start = before.get(node, {})
        for source, (chunks, nbytes) in sorted(counts.items()):
            c0, b0 = start.get(source, (0, 0))
            dc = source_dcs.get(source, node_dc.get(source))
            out.add(node, node_dc[node], source, dc, chunks - c0, nbytes - b0)
    return out
