"""Replay a workload against real agents through the data plane, with real payload bytes.

For each request, in order (one thread, so the bookkeeping below is exact):

1. compute its chunk keys as an engine would (``KeyChainer``);
2. route it to a node of its home DC: round-robin, or prefix-aware (the node that already holds
   the longest prefix, asked with ``exists``, which counts nothing); or ask a ``kvctl router``
   (routing "router", any DC: see ``kvctl.workload.routed`` and "With a router" below);
3. ``lookup`` the chain there (counted by the agent), ``get`` the hit chunks and check each one's
   bytes (a hit its agent took from its pool or a peer is reuse or sharing by the owner of the
   pulled copy, learnt as with a router, below);
4. with peer fetch on, ask the other nodes for the rest of the chain (``exists``), ``get`` it
   from the one holding the most and store it on the home node. The peer is not asked a counted
   ``lookup``: the request's one lookup was the home node's (its misses included), as an agent
   pulling from its peers counts the request once, on itself; the peer's agent counts nothing
   and the replay tallies the chunks it served as ``served_to_peers``. Across DCs the transfer
   waits an *emulated* link delay: round trip over fiber (5 us per km each way) plus bytes over
   the link;
5. ``put`` the chunks that were computed (missing everywhere), with their parent links.

With a router the replay moves no chunk between nodes itself (no step 4, no emulated delay of
its own): the chosen agent's lookup decides fetch-or-recompute over its own tiers, its peers
and its pool, and its ``get`` pulls what it chose (each agent emulates its own link delays).
Hits there count in the agent's ``peer`` and ``remote`` tiers, as reuse or sharing by the tenant
that stored the source's copy; the replay learns that tenant from the pulled copy's metadata
(a FETCH without payload, which counts nothing). Where a counted copy never arrived, the owner
cannot be learnt, and that node's reuse/sharing split is not checked (``owners_known``).

The replay keeps its own tally per node: lookups, hits per tier, reuse (chunk stored by the same
tenant) vs sharing, bytes. Reuse vs sharing comes from its own ledger of which tenant stored each
chunk on each node (seeded from the node's key listing at the start, so chunks cached before the
replay count right), not from the agent's counters. At the end it reads every agent's counters
again and reports, per field, whether the agents counted exactly what the replay expects; an
agent that cannot be read then (gone, or answering garbage) is named in ``agents_unread``, its
check left undone and the replay's own figures kept.

Payloads are ``chunk_tokens x kv_bytes_per_token x kv_scale`` bytes: the model profile's KV size,
shrunk by ``kv_scale`` on small machines. Each payload repeats its own key, so a chunk served
for the wrong key or cut short is caught.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvctl.client import AgentClient, AgentError, DataClient
from kvctl.errors import InvalidArgument
from kvctl.profiles import FIBER_SECONDS_PER_KM, ModeledInputs
from kvctl.ratios import ratio
from kvctl.store.index import LookupResult
from kvctl.store.keys import ChunkKey, Namespace
from kvctl.workload.routed import (
    REMOTE_TIERS,
    PullTally,
    RouteAsker,
    RouterChooser,
    RoutingTally,
    SourceCounts,
    held_locally,
    link_name,
    pulls_between,
    read_pulls,
)
from kvctl.workload.tokens import KeyChainer
from kvctl.workload.trace import TraceRequest

ROUTINGS = ("prefix", "round-robin", "router")
#: emulated link bandwidth between DCs (100 Gb/s)
DEFAULT_LINK_BYTES_PER_SECOND = 12.5e9

#: listing more cached chunks than this to learn their owners takes too long (each page scans
#: the node's index)
OWNER_SEED_MAX_CHUNKS = 200_000
OWNER_SEED_PAGE = 10_000

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class ReplayNode:
    name: str
    dc: str
    control_url: str


@dataclass(frozen=True, slots=True)
class LinkEmulation:
    """An emulated DC-to-DC link: the replay sleeps this long for each transfer over it."""

    distance_km: float
    bytes_per_second: float = DEFAULT_LINK_BYTES_PER_SECOND

    @property
    def rtt_seconds(self) -> float:
        return 2 * self.distance_km * FIBER_SECONDS_PER_KM

    def transfer_seconds(self, nbytes: int) -> float:
        return self.rtt_seconds + nbytes / self.bytes_per_second

    def as_dict(self) -> dict[str, Any]:
        return {
            "basis": "emulated",
            "distance_km": self.distance_km,
            "rtt_seconds": self.rtt_seconds,
            "bytes_per_second": self.bytes_per_second,
        }


@dataclass
class NodeTally:
    """What the replay did on one node, in the agent's own counters' terms."""

    lookups: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    hit_tokens: int = 0
    reuse_hits: int = 0
    sharing_hits: int = 0
    hits_by_tier: Counter[str] = field(default_factory=Counter)
    bytes_fetched: int = 0
    bytes_stored: int = 0
    #: put outcomes: stored, declined (admission, or bypass_unreachable), no_room, ...
    puts: Counter[str] = field(default_factory=Counter)
    #: chunks that a lookup reported but were gone when fetched
    lost_chunks: int = 0
    #: chunks read from this node for another node's request (peer fetch): not a lookup here,
    #: so the agent counts none of them (the request's lookup counted on its home node)
    served_to_peers: int = 0

    def count_lookup(self, chunks: int, res: LookupResult, reuse: Sequence[bool]) -> None:
        """One counted lookup of ``chunks`` chunks, as the agent counts it; ``reuse``: per hit,
        whether the asking tenant stored it."""
        m = res.matched_chunks
        self.lookups += 1
        self.lookup_chunks += chunks
        self.hit_chunks += m
        self.hit_tokens += res.matched_tokens
        for tier in res.locations[:m]:
            self.hits_by_tier[tier] += 1  # type: ignore[index]
        self.reuse_hits += sum(reuse)
        self.sharing_hits += m - sum(reuse)

    def expected(self, owners_known: bool = True) -> dict[str, int]:
        """What the node's counters should have grown by, in ``CHECKED_COUNTERS`` terms; the
        reuse/sharing split only where the replay knew every cached chunk's owner."""
        out = {f: int(getattr(self, f)) for f in CHECKED_COUNTERS}
        if not owners_known:
            del out["reuse_hits"], out["sharing_hits"]
        out.update({f"hits[{tier}]": n for tier, n in self.hits_by_tier.items()})
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "lookups": self.lookups,
            "lookup_chunks": self.lookup_chunks,
            "hit_chunks": self.hit_chunks,
            "hit_tokens": self.hit_tokens,
            "hit_ratio": ratio(self.hit_chunks, self.lookup_chunks),
            "reuse_hits": self.reuse_hits,
            "sharing_hits": self.sharing_hits,
            "hits_by_tier": dict(self.hits_by_tier),
            "bytes_fetched": self.bytes_fetched,
            "bytes_stored": self.bytes_stored,
            "puts": dict(self.puts),
            "lost_chunks": self.lost_chunks,
            "served_to_peers": self.served_to_peers,
        }


@dataclass
class RequestTally:
    """What the requests got, whichever node served it: the engine's view."""

    requests: int = 0
    chunks: int = 0
    #: all input tokens, partial tail chunks included (what prefill would compute without cache)
    input_tokens: int = 0
    #: chunks served by the home node, by tier
    local_hits: Counter[str] = field(default_factory=Counter)
    #: chunks fetched from another node in the same DC / in another DC
    peer_hits: int = 0
    cross_dc_hits: int = 0
    hit_tokens: int = 0
    reuse_hits: int = 0
    sharing_hits: int = 0
    computed_chunks: int = 0
    emulated_delay_seconds: float = 0.0
    bytes_by_link: Counter[str] = field(default_factory=Counter)
    #: the replay fetched from other nodes itself (its peer_* counts apply)
    client_fetch: bool = True

    @property
    def hit_chunks(self) -> int:
        return sum(self.local_hits.values()) + self.peer_hits + self.cross_dc_hits

    def count(self, request: TraceRequest, chunks: int) -> None:
        """One more request of ``chunks`` chunks, whichever node serves it."""
        self.requests += 1
        self.chunks += chunks
        self.input_tokens += request.input_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "chunks": self.chunks,
            "input_tokens": self.input_tokens,
            "hit_chunks": self.hit_chunks,
            "hit_ratio": ratio(self.hit_chunks, self.chunks),
            "hit_tokens": self.hit_tokens,
            "token_hit_ratio": ratio(self.hit_tokens, self.input_tokens),
            # with a router, the agents' own tiers (``peer``, ``remote``: the pool) hold them all
            "hits_by_tier": {**self.local_hits}
            | (
                {"peer (same DC)": self.peer_hits, "peer (other DC)": self.cross_dc_hits}
                if self.client_fetch
                else {}
            ),
            "reuse_hits": self.reuse_hits,
            "sharing_hits": self.sharing_hits,
            "computed_chunks": self.computed_chunks,
            "emulated_link_delay_seconds": self.emulated_delay_seconds,
            "bytes_by_link": dict(self.bytes_by_link),
        }


#: agent counters (``/v1/stats``) the replay predicts exactly, named as the agent names them;
#: hits per tier come as ``hits[TIER]``
CHECKED_COUNTERS = ("lookups", "lookup_chunks", "hit_chunks", "hit_tokens", "reuse_hits",
                    "sharing_hits")  # fmt: skip


@dataclass
class ReplayReport:
    workload: str
    routing: str
    chunk_tokens: int
    chunk_bytes: int
    kv_scale: float
    speed: float | None
    peer_fetch: bool
    inputs: ModeledInputs
    requests_total: int
    requests: RequestTally
    nodes: dict[str, NodeTally]
    node_dc: dict[str, str]
    #: per node: whether the replay learnt the owner of every chunk cached before it started
    owners_known: dict[str, bool]
    links: dict[str, LinkEmulation]
    wall_seconds: float = 0.0
    #: the most a request started behind its (sped-up) timestamp
    max_lag_seconds: float = 0.0
    stopped_early: bool = False
    #: per node and counter: (replay's count, agent's increase); None when not read
    agent_counters: dict[str, dict[str, tuple[int, int]]] | None = None
    #: nodes whose counters could not be read after the run (gone, or garbage), and why: their
    #: ``agent_counters`` are empty, their own tallies stand
    agents_unread: dict[str, str] = field(default_factory=dict)
    #: the router's answers (routing "router" only)
    router: RoutingTally | None = None
    #: what the agents pulled from their pool and peers during the run (measured by them)
    pulls: PullTally | None = None

    @property
    def agents_agree(self) -> bool | None:
        """False when a read agent counted something else; None when not every agent was read
        (and none disagreed)."""
        if self.agent_counters is None:
            return None
        if not all(a == b for fields in self.agent_counters.values() for a, b in fields.values()):
            return False
        return None if self.agents_unread else True

    def modeled(self) -> dict[str, Any]:
        """Prefill time and energy the hits saved. Modeled: see ``inputs``."""
        hit = self.requests.hit_tokens
        total = self.requests.input_tokens
        return {
            "basis": "modeled",
            "inputs": self.inputs.as_dict(),
            "prefill_seconds_without_cache": self.inputs.prefill_seconds(total),
            "prefill_seconds_saved": self.inputs.prefill_seconds(hit),
            "prefill_joules_saved": self.inputs.prefill_joules(hit),
            "saved_ratio": ratio(hit, total),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "routing": self.routing,
            "chunk_tokens": self.chunk_tokens,
            "chunk_bytes": self.chunk_bytes,
            "kv_scale": self.kv_scale,
            "model": self.inputs.model.name,
            "speed": self.speed,
            "peer_fetch": self.peer_fetch,
            "requests_total": self.requests_total,
            "stopped_early": self.stopped_early,
            "wall_seconds": self.wall_seconds,
            "max_lag_seconds": self.max_lag_seconds,
            "requests": self.requests.as_dict(),
            "nodes": {
                name: {"dc": self.node_dc[name], **t.as_dict()} for name, t in self.nodes.items()
            },
            "links_emulated": {k: v.as_dict() for k, v in self.links.items()},
            "router": None if self.router is None else self.router.as_dict(),
            "pulls": None if self.pulls is None else self.pulls.as_dict(),
            "owners_known": dict(self.owners_known),
            "agents_agree": self.agents_agree,
            "agents_unread": dict(self.agents_unread),
            "agent_counters": None
            if self.agent_counters is None
            else {
                n: {k: {"replay": a, "agent": b} for k, (a, b) in f.items()}
                for n, f in self.agent_counters.items()
            },
            "modeled": self.modeled(),
        }


def payload_for(key: ChunkKey, size_bytes: int) -> bytes:
    """A chunk's bytes: its key repeated, so a wrong or truncated chunk is caught on read."""
    reps, rest = divmod(size_bytes, len(key))
    return key * reps + key[:rest]


def _intact(data: bytes | bytearray | None, key: ChunkKey, size_bytes: int) -> bool:
    if data is None or len(data) != size_bytes:
        return False
    n = len(key)
    tail = size_bytes - size_bytes % n
    return bytes(data[:n]) == key[: min(n, size_bytes)] and (
        tail < n or bytes(data[tail - n : tail]) == key
    )


class ReplayError(RuntimeError):
    """The replay cannot go on (an agent went away, a chunk came back corrupt); ``hint``, when
    given, says what to do about it."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint


#: a chunk of another size than this replay's under one of its keys: the keys depend on the
#: workload (its salt), the model and the chunk size, not on --kv-scale, so an earlier replay of
#: the same workload at another scale stored them
OTHER_SIZE_HINT = (
    "the agents hold this workload's chunks at another size, stored by a replay with another "
    "--kv-scale: replay at that scale, or empty the agents' tiers first (`kvctl flush --tier cpu "
    "--all --yes`, and --tier disk)"
)


class _Node:
    def __init__(self, node: ReplayNode, token: str | None, connect_timeout_s: float) -> None:
        self.node = node
        self.control = AgentClient(node.control_url, token=token, timeout_s=connect_timeout_s)
        try:
            self._open(token, connect_timeout_s)
        except BaseException:
            self.control.close()
            raise

    def _open(self, token: str | None, connect_timeout_s: float) -> None:
        node = self.node
        self.info = self.control.info()
        plane = self.info.get("dataplane") or {}
        address = plane.get("unix") or plane.get("tcp")
        if not address:
            raise ReplayError(f"{node.name} has no data plane listening (see its --data-listen)")
        try:
            self.data = DataClient.connect(address, token=token, timeout_s=connect_timeout_s)
        except Exception:
            if not plane.get("tcp") or address == plane.get("tcp"):
                raise
            # the socket path is on another host: go over TCP
            self.data = DataClient.connect(plane["tcp"], token=token, timeout_s=connect_timeout_s)
        #: chunk -> tenant that stored it: what the node held at the start, then what the
        #: replay stored
        self.owner: dict[ChunkKey, str] = {}
        try:
            self.owners_known = self._seed_owners()
        except BaseException:
            self.data.close()
            raise
        self.tally = NodeTally()

    def _seed_owners(self) -> bool:
        """Learn who stored the chunks the node already holds (an earlier replay, an engine),
        so a hit on one counts as reuse or sharing as the agent counts it. A node too big to
        list in reasonable time is left out: its reuse/sharing split is then not checked."""
        cached = sum(int(t.get("chunks", 0)) for t in self.info.get("tiers", []))
        if cached > OWNER_SEED_MAX_CHUNKS:
            return False
        after: str | None = None
        while True:
            page = self.control.keys(limit=OWNER_SEED_PAGE, after=after)
            for item in page["items"]:
                self.owner[bytes.fromhex(item["key"])] = item["tenant"]
            after = page.get("next")
            if not after:
                return True

    def counters(self) -> dict[str, int]:
        stats = self.control.stats()["stats"]
        out = {k: int(stats[k]) for k in CHECKED_COUNTERS}
        for tier, t in stats.get("tiers", {}).items():
            out[f"hits[{tier}]"] = int(t["hits"])
        return out

    def close(self) -> None:
        self.data.close()
        self.control.close()


def assign_home_dcs(tenants: Iterable[str], dcs: Sequence[str]) -> dict[str, str]:
    """Each tenant's home DC: tenants in sorted order dealt round-robin over the DCs."""
    return {t: dcs[i % len(dcs)] for i, t in enumerate(sorted(set(tenants)))}


def replay(
    requests: Sequence[TraceRequest],
    nodes: Sequence[ReplayNode],
    inputs: ModeledInputs,
    *,
    workload_name: str = "",
    kv_scale: float = 1.0,
    routing: str = "prefix",
    speed: float | None = None,
    peer_fetch: bool = True,
    links_km: Mapping[tuple[str, str], float] | None = None,
    link_bytes_per_second: float = DEFAULT_LINK_BYTES_PER_SECOND,
    token: str | None = None,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    connect_timeout_s: float = 10.0,
    salt: int = 0,
    router: RouteAsker | None = None,
    router_policy: str = "cost",
    source_dcs: Mapping[str, str] | None = None,
) -> ReplayReport:
    """Drive ``nodes`` with ``requests``; see the module docstring. ``speed`` None runs as fast
    as possible, else timestamps are honoured, ``speed`` times faster. ``links_km`` gives the
    distance between DC pairs (missing pairs across DCs count as 0 km). ``salt`` names the
    workload's content (``Workload.salt``), so different workloads never share tokens.
    Routing "router" asks ``router`` (a ``RouterClient``) with ``router_policy``
    (``peer_fetch`` and ``links_km`` are then the agents' business, not the replay's).
    ``source_dcs`` names the DC of pull sources that are not nodes of the replay (e.g.
    ``{"pool": "fra-1"}``), for the pulls by link."""
    if not nodes:
        raise InvalidArgument("give at least one node to replay against")
    if routing not in ROUTINGS:
        raise InvalidArgument(f"unknown routing {routing!r}; choose from {', '.join(ROUTINGS)}")
    if (routing == "router") != (router is not None):
        raise InvalidArgument("routing 'router' goes with a router to ask, and a router with it")
    if not 0 < kv_scale <= 1:
        raise InvalidArgument(f"--kv-scale must be in (0, 1], got {kv_scale}")
    if speed is not None and speed <= 0:
        raise InvalidArgument(f"--speed must be positive, got {speed}")
    if len({n.name for n in nodes}) != len(nodes):
        raise InvalidArgument("a node is named twice")
    chooser = None if router is None else RouterChooser(router, router_policy)
    live: list[_Node] = []
    try:
        for n in nodes:
            live.append(_Node(n, token, connect_timeout_s))
        return _run(
            requests, live, inputs, workload_name, kv_scale, routing, speed, peer_fetch,
            dict(links_km or {}), link_bytes_per_second, progress, stop or threading.Event(),
            salt, chooser, dict(source_dcs or {}),
        )  # fmt: skip
    finally:
        for opened in live:
            opened.close()


def _run(
    requests: Sequence[TraceRequest],
    live: list[_Node],
    inputs: ModeledInputs,
    workload_name: str,
    kv_scale: float,
    routing: str,
    speed: float | None,
    peer_fetch: bool,
    links_km: dict[tuple[str, str], float],
    link_bytes_per_second: float,
    progress: Progress | None,
    stop: threading.Event,
    salt: int,
    chooser: RouterChooser | None,
    source_dcs: dict[str, str],
) -> ReplayReport:
    chunk_sizes = {n.info["chunk_tokens"] for n in live}
    if len(chunk_sizes) != 1:
        detail = ", ".join(f"{n.node.name}={n.info['chunk_tokens']}" for n in live)
        raise ReplayError(f"the agents disagree on chunk_tokens ({detail}); replay needs one")
    chunk_tokens = chunk_sizes.pop()
    chunk_bytes = max(1, round(inputs.model.kv_bytes_per_token * kv_scale)) * chunk_tokens
    too_big = [n.node.name for n in live if chunk_bytes > n.info.get("max_chunk_bytes", 1 << 62)]
    if too_big:
        raise InvalidArgument(
            f"chunks of {chunk_bytes:,} bytes exceed max_chunk_bytes on {', '.join(too_big)}; "
            "lower --kv-scale"
        )
    isolated = {t for n in live for t in n.info.get("isolated_tenants", [])}
    model = inputs.model

    def namespace_of(tenant: str) -> Namespace:
        return Namespace(model.name, model.layout, tenant if tenant in isolated else "")

    chainer = KeyChainer(namespace_of, chunk_tokens, salt=salt)
    dcs = sorted({n.node.dc for n in live})
    by_dc = {dc: [n for n in live if n.node.dc == dc] for dc in dcs}
    home = assign_home_dcs((r.tenant for r in requests), dcs)
    rr = {dc: itertools.cycle(by_dc[dc]) for dc in dcs}
    by_name = {n.node.name: n for n in live}
    node_dc = {n.node.name: n.node.dc for n in live}
    if chooser is not None:
        peer_fetch = False  # the agents pull from each other: the replay moves nothing
        links_km = {}
    links = {
        link_name(a, b): LinkEmulation(links_km.get((a, b), links_km.get((b, a), 0.0)),
                                        link_bytes_per_second)
        for a, b in itertools.combinations(dcs, 2)
    }  # fmt: skip
    report = ReplayReport(
        workload=workload_name,
        routing=routing,
        chunk_tokens=chunk_tokens,
        chunk_bytes=chunk_bytes,
        kv_scale=kv_scale,
        speed=speed,
        peer_fetch=peer_fetch,
        inputs=inputs,
        requests_total=len(requests),
        requests=RequestTally(client_fetch=chooser is None and peer_fetch),
        nodes={n.node.name: n.tally for n in live},
        node_dc=node_dc,
        owners_known={n.node.name: n.owners_known for n in live},
        links=links if chooser is None else {},
        router=None if chooser is None else chooser.tally,
    )
    before = {n.node.name: n.counters() for n in live}
    pulls_before: dict[str, SourceCounts] = {n.node.name: read_pulls(n.control) for n in live}
    started = time.monotonic()
    t0_ms = requests[0].timestamp_ms if requests else 0
    for i, request in enumerate(requests):
        if stop.is_set():
            report.stopped_early = True
            break
        if speed is not None:
            due = started + (request.timestamp_ms - t0_ms) / 1000 / speed
            ahead = due - time.monotonic()
            if ahead > 0:
                # at most TIMEOUT_MAX (~292 years): past it the wait raised OverflowError, and
                # the replay so far was lost (a trace of epoch timestamps after a first at 0)
                if stop.wait(min(ahead, threading.TIMEOUT_MAX)):
                    report.stopped_early = True
                    break
            else:
                report.max_lag_seconds = max(report.max_lag_seconds, -ahead)
        keys = chainer.keys(request)
        dc = home[request.tenant]
        try:
            if chooser is None:
                target = _route(by_dc[dc], rr[dc], keys, request.tenant, routing)
                _serve(request, keys, target, live, chunk_bytes, chunk_tokens, peer_fetch, links,
                       report)  # fmt: skip
            else:
                name = None
                if keys:
                    name = chooser.choose(
                        keys, tenant=request.tenant, home_dc=dc,
                        prompt_tokens=request.input_tokens, nodes=node_dc,
                    )  # fmt: skip
                else:  # shorter than a chunk: nothing to route by, its home DC's turn
                    chooser.tally.no_chunks += 1
                target = by_name[name] if name else next(rr[dc])
                _serve_routed(request, keys, target, chunk_bytes, chunk_tokens, report)
        except AgentError as exc:
            raise ReplayError(_lost_agent(exc, live, i, len(requests))) from exc
        if progress is not None:
            progress(i + 1, len(requests))
    report.wall_seconds = time.monotonic() - started
    # the agents read again: one gone by now (or answering garbage) leaves its check unread,
    # not the replay's figures lost
    afters: dict[str, tuple[dict[str, int], SourceCounts]] = {}
    for n in live:
        try:
            afters[n.node.name] = (n.counters(), read_pulls(n.control))
        # garbage: a field missing, of another type (a list for a mapping), a count of inf
        except (AgentError, AttributeError, KeyError, OverflowError, TypeError, ValueError) as exc:
            report.agents_unread[n.node.name] = str(exc) or type(exc).__name__
    report.pulls = pulls_between(
        pulls_before, {name: pulls for name, (_, pulls) in afters.items()}, node_dc, source_dcs
    )
    # a pulled copy whose owner could not be learnt turns a node's split unchecked
    report.owners_known = {n.node.name: n.owners_known for n in live}
    report.agent_counters = {}
    for n in live:
        if n.node.name not in afters:
            report.agent_counters[n.node.name] = {}
            continue
        after = afters[n.node.name][0]
        # a tier the replay saw no hit in must have counted none either
        tiers = {k: 0 for k in after if k.startswith("hits[")}
        expected = tiers | n.tally.expected(n.owners_known)
        start = before[n.node.name]
        report.agent_counters[n.node.name] = {
            f: (v, after.get(f, 0) - start.get(f, 0)) for f, v in expected.items()
        }
    return report


def _lost_agent(exc: AgentError, live: Sequence[_Node], done: int, total: int) -> str:
    """An agent's failure mid-replay, naming the node: the one whose data-plane connection
    closed under it (the SDK's error does not say which agent it was talking to)."""
    lost = [n.node.name for n in live if n.data.closed]
    who = f"node {', '.join(lost)}" if lost else "an agent"
    return (
        f"{who} failed at request {done + 1} of {total} ({done} served before it): {exc}; no "
        "summary: a replay cut short by a failure cannot be checked against the agents' counts"
    )


def _prefix_len(tiers: Sequence[str | None]) -> int:
    return tiers.index(None) if None in tiers else len(tiers)


def _route(
    candidates: list[_Node],
    cycle: Iterable[_Node],
    keys: list[ChunkKey],
    tenant: str,
    routing: str,
) -> _Node:
    turn = next(iter(cycle))
    if routing == "round-robin" or len(candidates) == 1 or not keys:
        return turn
    # prefix-aware: the longest cached prefix wins; ties go to the round-robin turn (spread load)
    best, best_len = turn, _prefix_len(turn.data.exists(keys, tenant=tenant))
    for node in candidates:
        if node is turn:
            continue
        n = _prefix_len(node.data.exists(keys, tenant=tenant))
        if n > best_len:
            best, best_len = node, n
    return best


def _fetch(
    node: _Node, keys: Sequence[ChunkKey], tenant: str, chunk_bytes: int, *, for_peer: bool = False
) -> int:
    """``get`` chunks from ``node``, checking each; returns how many leading ones arrived.
    Those gone count as ``lost_chunks`` (hits of the node's lookup never read), unless read
    ``for_peer``: found with ``exists``, they were no counted lookup's hits."""
    if not keys:
        return 0
    got = node.data.get_many(list(keys), tenant=tenant)
    for n, (key, data) in enumerate(zip(keys, got, strict=True)):
        if data is None:
            if not for_peer:
                node.tally.lost_chunks += got[n:].count(None)
            return n
        if not _intact(data, key, chunk_bytes):
            raise ReplayError(
                f"{node.node.name} served chunk {key.hex()} with wrong bytes "
                f"({len(data)} bytes, expected {chunk_bytes} beginning with the key)",
                hint=OTHER_SIZE_HINT if len(data) != chunk_bytes else None,
            )
        node.tally.bytes_fetched += chunk_bytes
    return len(keys)


@dataclass(frozen=True, slots=True)
class _Looked:
    matched: int
    #: tier of every key (None: absent on that node)
    tiers: tuple[str | None, ...]
    #: per matched chunk: did the asking tenant store it (reuse) or another (sharing)
    reuse: tuple[bool, ...]


def _lookup(
    node: _Node, keys: list[ChunkKey], tenant: str, chunk_bytes: int
) -> tuple[_Looked, int]:
    """A counted lookup and the ``get`` of its hits, tallied as the agent counts it; returns
    the lookup and how many leading hits arrived. A hit the node's lookup took from its pool
    or a peer is reuse or sharing by the tenant that stored the source's copy (maybe through
    another node, which this node's ledger never saw): learnt from the pulled copy, as with a
    router."""
    res = node.data.lookup(keys, tenant=tenant)
    m = res.matched_chunks
    got = _fetch(node, keys[:m], tenant, chunk_bytes)
    _learn_pulled_owners(node, keys, res.locations, m, tenant)
    reuse = tuple(node.owner.get(key) == tenant for key in keys[:m])
    node.tally.count_lookup(len(keys), res, reuse)
    for key, tier in zip(keys[m:], res.locations[m:], strict=True):
        if tier is None:
            node.owner.pop(key, None)  # evicted since the replay stored it
    return _Looked(m, tuple(res.locations), reuse), got


def _store(
    node: _Node, keys: list[ChunkKey], idx: list[int], tenant: str, chunk_bytes: int,
    chunk_tokens: int,
) -> None:  # fmt: skip
    """Put ``keys[i]`` for ``i`` in ``idx`` on ``node``, linked to their parents. Only absent
    chunks are put: a put of a cached chunk keeps its first owner, and so must the ledger."""
    if not idx:
        return
    outcomes = node.data.put_many(
        [(keys[i], payload_for(keys[i], chunk_bytes)) for i in idx],
        tenant=tenant,
        parents=[keys[i - 1] if i else None for i in idx],
        tokens=chunk_tokens,
        depths=idx,
    )
    for i, out in zip(idx, outcomes, strict=True):
        node.tally.puts[out.status] += 1
        if out.status == "stored":
            node.owner[keys[i]] = tenant
            node.tally.bytes_stored += chunk_bytes


def _credit(rq: RequestTally, reuse: Sequence[bool], got: int, chunk_tokens: int) -> None:
    """Count the ``got`` chunks a request received (lost ones are recomputed, not hits);
    ``reuse``: per chunk, whether the asking tenant stored it."""
    rq.hit_tokens += got * chunk_tokens
    rq.reuse_hits += sum(reuse[:got])
    rq.sharing_hits += got - sum(reuse[:got])


def _serve(
    request: TraceRequest,
    keys: list[ChunkKey],
    home: _Node,
    live: list[_Node],
    chunk_bytes: int,
    chunk_tokens: int,
    peer_fetch: bool,
    links: dict[str, LinkEmulation],
    report: ReplayReport,
) -> None:
    tenant = request.tenant
    rq = report.requests
    rq.count(request, len(keys))
    if not keys:
        return
    looked, got = _lookup(home, keys, tenant, chunk_bytes)
    for tier in looked.tiers[:got]:
        rq.local_hits[tier] += 1  # type: ignore[index]
    _credit(rq, looked.reuse, got, chunk_tokens)
    start = got
    if peer_fetch and start < len(keys):
        start = _from_peers(request, keys, start, home, live, chunk_bytes, chunk_tokens, links, rq)
    # what no node had is computed by the engine; everything the home node lacks is stored there
    rq.computed_chunks += len(keys) - start
    absent = [i for i in range(looked.matched, len(keys)) if looked.tiers[i] is None]
    if got < looked.matched:
        # chunks lost between lookup and get: put back only those really gone, since a put of
        # a cached chunk keeps its first owner (and the ledger must too)
        lost = list(range(got, looked.matched))
        tiers = home.data.exists([keys[i] for i in lost], tenant=tenant)
        absent = [i for i, t in zip(lost, tiers, strict=True) if t is None] + absent
    _store(home, keys, absent, tenant, chunk_bytes, chunk_tokens)


def _serve_routed(
    request: TraceRequest,
    keys: list[ChunkKey],
    node: _Node,
    chunk_bytes: int,
    chunk_tokens: int,
    report: ReplayReport,
) -> None:
    """Serve on the node the router chose: its lookup reaches its peers and pool, its get pulls
    what the lookup took; the rest is computed and stored there (see the module docstring)."""
    tenant = request.tenant
    rq = report.requests
    rq.count(request, len(keys))
    if not keys:
        return
    res = node.data.lookup(keys, tenant=tenant)
    m = res.matched_chunks
    tiers = res.locations
    got = _fetch(node, keys[:m], tenant, chunk_bytes)
    # the owners of pulled hits are known once their copies arrived: count after the get
    _learn_pulled_owners(node, keys, tiers, m, tenant)
    reuse = tuple(node.owner.get(key) == tenant for key in keys[:m])
    node.tally.count_lookup(len(keys), res, reuse)
    for tier in tiers[:got]:
        rq.local_hits[tier] += 1  # type: ignore[index]
    _credit(rq, reuse, got, chunk_tokens)
    rq.computed_chunks += len(keys) - got
    # past the plan's prefix, what the node does not hold itself (absent, or only in its pool
    # or a peer: the plan chose to recompute it) is stored there, as the engine would
    absent = [i for i in range(m, len(keys)) if not held_locally(tiers[i])]
    for i in absent:
        node.owner.pop(keys[i], None)
    if got < m:
        # lost between lookup and get (or a pull that failed): put back only what is not local
        lost = list(range(got, m))
        where = node.data.exists([keys[i] for i in lost], tenant=tenant)
        absent = [i for i, w in zip(lost, where, strict=True) if not held_locally(w)] + absent
    _store(node, keys, absent, tenant, chunk_bytes, chunk_tokens)


def _learn_pulled_owners(
    node: _Node, keys: list[ChunkKey], tiers: Sequence[str | None], matched: int, tenant: str
) -> None:
    """The owner tenant of each hit the lookup took from the pool or a peer: the agent counted
    it as reuse or sharing by the source copy's owner, which its pulled copy keeps. A FETCH
    without payload reads it (counting nothing); a hit whose copy never arrived leaves the
    node's reuse/sharing split unchecked, never guessed."""
    pulled = [i for i in range(matched) if tiers[i] in REMOTE_TIERS]
    if not pulled:
        return
    metas = node.data.fetch([keys[i] for i in pulled], tenant=tenant, payload=False)
    for i, item in zip(pulled, metas, strict=True):
        if item is None:
            node.owner.pop(keys[i], None)
            node.owners_known = False
        else:
            node.owner[keys[i]] = item[0].tenant


def _from_peers(
    request: TraceRequest,
    keys: list[ChunkKey],
    start: int,
    home: _Node,
    live: list[_Node],
    chunk_bytes: int,
    chunk_tokens: int,
    links: dict[str, LinkEmulation],
    rq: RequestTally,
) -> int:
    """Fetch ``keys[start:]`` from the peer holding the longest run of it; returns the new
    start (the first chunk still missing)."""
    tenant = request.tenant
    rest = keys[start:]
    best: _Node | None = None
    best_len = 0
    for node in live:
        if node is home:
            continue
        n = _prefix_len(node.data.exists(rest, tenant=tenant))
        # on a tie a peer in the home DC wins: no link to cross
        if n > best_len or (
            n == best_len and n and best is not None
            and best.node.dc != home.node.dc and node.node.dc == home.node.dc
        ):  # fmt: skip
            best, best_len = node, n
    if best is None:
        return start
    # read with ``get`` alone (``exists`` found them, counting nothing): a counted lookup here
    # would count the request a second time, its misses at home already counted
    reuse = tuple(best.owner.get(key) == tenant for key in rest[:best_len])
    got = _fetch(best, rest[:best_len], tenant, chunk_bytes, for_peer=True)
    best.tally.served_to_peers += got
    _credit(rq, reuse, got, chunk_tokens)
    if not got:
        return start
    if best.node.dc == home.node.dc:
        rq.peer_hits += got
    else:
        link = link_name(best.node.dc, home.node.dc)
        nbytes = got * chunk_bytes
        delay = links[link].transfer_seconds(nbytes)
        time.sleep(delay)  # emulated: the link's round trip and transfer time
        rq.emulated_delay_seconds += delay
        rq.cross_dc_hits += got
        rq.bytes_by_link[link] += nbytes
    return start + got
