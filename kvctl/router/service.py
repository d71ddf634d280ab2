"""The router as a library: the index, the topology, the costs and the load, and each decision
counted.

``Router.route`` asks the index which nodes hold a request's chain of chunk keys (as the
requesting tenant may see them), scores every node that is up (``kvctl.router.score.decide``)
and queues the chosen node's modeled work on the ``LoadTally``. A request may give its prompt's
token ids instead of keys: ``KeySpace`` computes the keys exactly as an agent does (the chain
hash under a namespace of model id, KV layout and, for an isolated tenant, the tenant's own
salt), so the router finds what the agents stored.

The HTTP app over a ``Router`` is ``kvctl.router.app.create_app`` (also reachable here as
``create_app``, imported on first use so the library does not load the web framework).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvctl.errors import InvalidArgument, KvctlError
from kvctl.index.model import ENGINE_SEPARATOR, ClaimingIndex, FleetIndex, Holding, owner
from kvctl.index.remote import MAX_KEYS, IndexUnavailable
from kvctl.profiles import model_profile
from kvctl.quantiles import nearest_rank
from kvctl.router.load import BASIS as LOAD_BASIS
from kvctl.router.load import LoadTally
from kvctl.router.policies import POLICIES, RouteRequest, RoutingPolicy, make_policy
from kvctl.router.score import Costs, Decision, decision_for, score_nodes
from kvctl.router.topology import Topology
from kvctl.store.keys import DEFAULT_CHUNK_TOKENS, KVLayout, Namespace, keys_for

if TYPE_CHECKING:
    from fastapi import FastAPI

#: token ids one request may carry (a 256k-token context; the body limit bounds it too)
MAX_TOKENS = 262_144
#: decision latency samples kept for the quantiles in ``stats`` (the newest)
MAX_LATENCY_SAMPLES = 4096
#: the decision-latency histogram's upper bounds, seconds: 10 µs .. 1 s
LATENCY_BUCKETS_S = (
    1e-5, 2.5e-5, 5e-5,
    1e-4, 2.5e-4, 5e-4,
    1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0,
)  # fmt: skip


log = logging.getLogger("kvctl.router")

#: at most one warning per this many seconds while the index keeps failing (each names how many
#: failures it stands for): a router under load fails every request during an outage
INDEX_WARNING_INTERVAL_S = 30.0
#: how often a router claims the nodes it knows in a shared index (``ClaimingIndex``)
CLAIM_INTERVAL_S = 10.0
#: a claim older than this is one of a router that stopped (it missed 6): a router whose
#: inventory does not name the node may drop it then
CLAIM_STALE_S = 60.0
#: how long stopping waits for a claim in flight (the index's socket timeout, and a retry)
CLAIM_STOP_WAIT_S = 5.0


class IndexWatch:
    """Whether the index answered last time anyone asked, and a rate-limited warning when it
    does not (the router keeps serving what it can: health, metrics, stats)."""

    def __init__(
        self,
        *,
        interval_s: float = INDEX_WARNING_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self.up = True
        self.error = ""
        self.failures = 0
        self._unlogged = 0
        self._logged_s: float | None = None

    def failed(self, exc: Exception) -> None:
        now_s = self._clock()
        with self._lock:
            self.up = False
            self.error = str(exc)[:300]
            self.failures += 1
            self._unlogged += 1
            if self._logged_s is not None and now_s - self._logged_s < self._interval_s:
                return
            count, self._unlogged, self._logged_s = self._unlogged, 0, now_s
        log.warning("the fleet index failed (%d times since the last warning): %s", count, exc)

    def answered(self) -> None:
        with self._lock:
            if self.up:
                return
            self.up, self._logged_s, self._unlogged = True, None, 0
        log.warning("the fleet index answers again")


class NoNodeAvailable(KvctlError):
    """No node can serve the request: none is up, or none is reachable from its DC."""


class FollowerSet(Protocol):
    """What the router needs of ``kvctl.index.follower.Followers``."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def status(self) -> list[dict[str, Any]]: ...

    def nodes(self) -> list[str]: ...

    def up_nodes(self) -> frozenset[str]: ...

    def down_nodes(self) -> frozenset[str]: ...

    def pool_nodes(self) -> frozenset[str]: ...


class InventorySource(Protocol):
    """What the router needs of ``kvctl.router.inventory.InventoryReloader``."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def status(self) -> dict[str, Any]: ...


class EngineFeed(Protocol):
    """What the router needs of an engine's own KV event stream
    (``kvctl.index.vllm_events.VllmEventSubscriber``): it writes into the router's index itself."""

    def start(self) -> object: ...

    def stop(self, timeout_s: float = ...) -> None: ...

    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class KeySpace:
    """How an agent turns a tenant's prompt into chunk keys: its model's namespace (model id
    and KV layout), its chunk size, and which tenants are isolated (salted into a namespace of
    their own). Give the router the agents' own settings, or its keys will match nothing."""

    model_id: str
    layout: KVLayout
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    isolated_tenants: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise InvalidArgument("the key space needs a model id")
        if isinstance(self.chunk_tokens, bool) or self.chunk_tokens <= 0:
            raise InvalidArgument(f"chunk_tokens must be > 0, got {self.chunk_tokens!r}")
        object.__setattr__(self, "isolated_tenants", frozenset(self.isolated_tenants))

    @classmethod
    def of_model(
        cls,
        model: str,
        *,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        isolated_tenants: Iterable[str] = (),
    ) -> KeySpace:
        """The key space of a profiled model (``kvctl.profiles``), as an agent configured
        with that model computes it."""
        profile = model_profile(model)
        return cls(profile.name, profile.layout, chunk_tokens, frozenset(isolated_tenants))

    def is_isolated(self, tenant: str) -> bool:
        return tenant in self.isolated_tenants

    def namespace(self, tenant: str) -> Namespace:
        """Isolated tenants get their own salt; everyone else shares the common namespace."""
        return Namespace(self.model_id, self.layout, tenant if self.is_isolated(tenant) else "")

    def keys(self, tokens: Sequence[int], tenant: str) -> list[bytes]:
        """The chain of keys of ``tokens``' full chunks (the partial tail has none)."""
        return keys_for(tokens, self.namespace(tenant), self.chunk_tokens, include_partial=False)

    def as_dict(self) -> dict[str, object]:
        return {
            "model": self.model_id,
            "layout": {
                "layers": self.layout.layers,
                "kv_heads": self.layout.kv_heads,
                "head_dim": self.layout.head_dim,
                "dtype": self.layout.dtype,
            },
            "chunk_tokens": self.chunk_tokens,
            "isolated_tenants": sorted(self.isolated_tenants),
        }


@dataclass
class _NodeCounts:
    decisions: int = 0
    to_holder: int = 0


@dataclass
class _LinkCounts:
    chunks: int = 0
    bytes: int = 0


@dataclass
class _Counts:
    decisions: int = 0
    no_node: int = 0
    to_holder: int = 0
    requested_chunks: int = 0
    indexed_chunks: int = 0
    local_chunks: int = 0
    pulled_chunks: int = 0
    pulled_bytes: int = 0
    tokens: int = 0
    fetched_tokens: int = 0
    recomputed_tokens: int = 0
    nodes: dict[str, _NodeCounts] = field(default_factory=dict)
    links: dict[tuple[str, str], _LinkCounts] = field(default_factory=dict)
    latency_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    latency_sum_s: float = 0.0
    latency_count: int = 0
    latency_samples: deque[float] = field(default_factory=lambda: deque(maxlen=MAX_LATENCY_SAMPLES))
    holders_requests: int = 0
    holders_keys: int = 0
    policies: dict[str, int] = field(default_factory=dict)


class Router:
    """Routes requests over a fleet index (see the module). Thread-safe: the HTTP app calls it
    from its threadpool."""

    def __init__(
        self,
        index: FleetIndex,
        topology: Topology,
        costs: Costs,
        *,
        keyspace: KeySpace | None = None,
        followers: FollowerSet | None = None,
        engine_feeds: Sequence[EngineFeed] = (),
        load: LoadTally | None = None,
        clock: Callable[[], float] = time.perf_counter,
        claim_interval_s: float = CLAIM_INTERVAL_S,
    ) -> None:
        self.index = index
        #: the topology in use: the inventory's (``_given_topology``) with the pool agents the
        #: followers found (``_pool_nodes``, from each agent's /v1/info) serving nothing
        self.topology = topology
        self._given_topology = topology
        self._pool_nodes: frozenset[str] = frozenset()
        self.costs = costs
        self.keyspace = keyspace or KeySpace.of_model("llama-3.1-8b")
        self.followers = followers
        self.engine_feeds = tuple(engine_feeds)
        self.load = load or LoadTally()
        #: changes every time a router starts: decision ids are unique across restarts
        self.instance = uuid.uuid4().hex[:12]
        self.started_s = time.time()
        self._clock = clock
        self._lock = threading.Lock()
        self._counts = _Counts()
        self.index_watch = IndexWatch()
        self._seq = 0
        # one instance each: round-robin keeps its turn across requests
        self._policies: dict[str, RoutingPolicy] = {
            name: make_policy(name, topology, costs) for name in POLICIES
        }
        self._policy_lock = threading.Lock()
        #: rereads the fleet's inventory while the router runs (None: read once, at start)
        self.inventory: InventorySource | None = None
        self.claim_interval_s = float(claim_interval_s)
        self._claims_stop = threading.Event()
        self._claims_thread: threading.Thread | None = None
        #: why the last claim, or read of the claims, failed ("" when it did not)
        self.claim_error = ""

    @property
    def chunk_tokens(self) -> int:
        return self.keyspace.chunk_tokens

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start following the agents (when the router has followers) and the engines' own
        KV events (when it has feeds), and, in a shared index, claiming the nodes it knows
        (before its followers write any: a router dropping what no router claims never takes
        them for a node that left)."""
        if isinstance(self.index, ClaimingIndex) and self._claims_thread is None:
            self._claims_stop.clear()
            self._claims_thread = threading.Thread(
                target=self._claim_loop, name="kvctl-index-claims", daemon=True
            )
            self._claims_thread.start()
        if self.followers is not None:
            self.followers.start()
        for feed in self.engine_feeds:
            feed.start()
        if self.inventory is not None:
            self.inventory.start()

    def close(self) -> None:
        """Stop following and close the index."""
        if self.inventory is not None:
            self.inventory.stop()
        self.stop_claims()
        for feed in self.engine_feeds:
            feed.stop()
        if self.followers is not None:
            self.followers.stop()
        self.index.close()

    def set_topology(self, topology: Topology) -> bool:
        """Route over ``topology`` from now on (an inventory reread); returns whether it
        differs from the one in use (the policies are rebuilt only then: round-robin keeps its
        turn across rereads that change nothing). A removed node's modeled queue is dropped."""
        with self._policy_lock:
            self._given_topology = topology
            gone = self._use_locked(_serving_not(topology, self._pool_nodes))
        if gone is None:
            return False
        for node in gone:
            self.load.clear(node)
        return True

    def _use_locked(self, topology: Topology) -> set[str] | None:
        """Route over ``topology`` (under ``_policy_lock``); the nodes it no longer has, None
        when it is the one in use."""
        if topology == self.topology:
            return None
        gone = set(self.topology.nodes) - set(topology.nodes)
        self._policies = {name: make_policy(name, topology, self.costs) for name in POLICIES}
        self.topology = topology
        return gone

    def _follow_roles_locked(self) -> None:
        """Serve no request from the nodes whose agent says it is a pool agent (it runs no
        engine), as the followers last read each agent's role: one rule for nodes of the
        inventory and of --agent flags, asked once per agent start, not at every reread. Under
        ``_policy_lock``: two requests never apply the roles they read out of order."""
        if self.followers is None:
            return
        pool = self.followers.pool_nodes()
        # the same set as last time, mostly (the followers keep it): no comparison of members
        if pool is not self._pool_nodes and pool != self._pool_nodes:
            self._pool_nodes = pool
            self._use_locked(_serving_not(self._given_topology, pool))

    # --- what the router knows ---------------------------------------------------------------
    def follower_status(self) -> list[dict[str, Any]]:
        return [] if self.followers is None else self.followers.status()

    def follower_counts(self) -> tuple[int, int]:
        """(agents whose event stream is read, agents followed), asking the index nothing
        (``follower_status`` asks it each followed node's entries)."""
        if self.followers is None:
            return 0, 0
        followed = set(self.followers.nodes())
        return len(self.followers.up_nodes() & followed), len(followed)

    def engine_status(self) -> list[dict[str, Any]]:
        """Each engine event feed's state: connected, sequence, chunks, gaps, errors."""
        return [feed.status() for feed in self.engine_feeds]

    def up_nodes(self) -> frozenset[str] | None:
        """Nodes whose follower is up; None (every node) when the router follows no agent."""
        if self.followers is None:
            return None
        return self.followers.up_nodes()

    def holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
        """The index's answer for ``keys`` as ``tenant`` may see it, less the nodes this router
        marked down (see ``_usable``), counted."""
        _check_keys(keys)
        out = self._usable(self._holders(keys, tenant=tenant))
        with self._lock:
            self._counts.holders_requests += 1
            self._counts.holders_keys += len(keys)
        return list(out)

    def _holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
        try:
            out = self.index.holders(keys, tenant=tenant)
        except IndexUnavailable as exc:
            self.index_watch.failed(exc)
            raise
        self.index_watch.answered()
        return out

    def _chain_holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
        """``_holders`` for a chain, MAX_KEYS keys per lookup. Every plan stops at the first
        chunk nobody holds, so the parts after the one holding it are not looked up (their
        rows are empty)."""
        out: list[list[Holding]] = []
        for start in range(0, len(keys), MAX_KEYS):
            rows = self._holders(keys[start : start + MAX_KEYS], tenant=tenant)
            out.extend(rows)
            if not all(rows):
                break
        out.extend([] for _ in range(len(keys) - len(out)))
        return out

    def index_nodes(self) -> dict[str, int] | None:
        """The index's entries per node; None when it does not answer (noted and logged)."""
        try:
            nodes = self.index.nodes()
        except IndexUnavailable as exc:
            self.index_watch.failed(exc)
            return None
        self.index_watch.answered()
        return nodes

    def stop_claims(self) -> None:
        """Stop claiming (``start``): another router may drop the nodes this one knew once
        their claims are stale, if its inventory does not name them."""
        self._claims_stop.set()
        thread, self._claims_thread = self._claims_thread, None
        if thread is not None:
            # bounded: a claim in flight to a hung index waits out its socket timeout
            thread.join(timeout=CLAIM_STOP_WAIT_S)

    def _claim_loop(self) -> None:
        while True:
            self.claim_known()
            if self._claims_stop.wait(self.claim_interval_s):
                return

    def claim_known(self) -> bool:
        """Claim the nodes this router knows in a shared index (``ClaimingIndex``); False
        when the index has no claims or did not answer (``claim_error``)."""
        if not isinstance(self.index, ClaimingIndex):
            return False
        try:
            self.index.claim(self.instance, self.known_nodes())
        except IndexUnavailable as exc:
            self._claim_failed(exc)
            return False
        self.claim_error = ""
        return True

    def index_claims(self) -> dict[str, float] | None:
        """Each node another router claimed in a shared index, and how long ago (seconds); {}
        for an index without claims (private to this router); None when it did not answer
        (``claim_error``)."""
        if not isinstance(self.index, ClaimingIndex):
            return {}
        try:
            return self.index.claims(excluding=self.instance)
        except IndexUnavailable as exc:
            self._claim_failed(exc)
            return None

    def _claim_failed(self, exc: IndexUnavailable) -> None:
        # not index_watch's: claims are no route's and no health's (a Redis user whose ACL
        # refuses TIME must not have /v1/health flap); logged when the error changes
        error = str(exc)[:300]
        if error != self.claim_error:
            log.warning("the fleet index's claims failed: %s", error)
        self.claim_error = error

    def known_nodes(self) -> frozenset[str]:
        """The nodes this router knows: its inventory's (the topology), those it follows, and
        those whose engine's own KV events it reads (an index name owned by none of them is
        another router's, or a node's that left the fleet)."""
        names = set(self.topology.nodes)
        if self.followers is not None:
            names.update(self.followers.nodes())
        names.update(self._fed_nodes())
        return frozenset(names)

    def unknown_index_nodes(self, nodes: Mapping[str, int]) -> dict[str, int]:
        """Of the index's ``nodes`` (name -> entries), those whose node this router does not
        know (``known_nodes``; ``NODE#vllm`` goes with NODE)."""
        known = self.known_nodes()
        return {name: n for name, n in nodes.items() if owner(name) not in known}

    def forget(self, node: str) -> dict[str, int]:
        """Drop every index entry of ``node``, one that left the fleet: its own and its
        engines' (``NODE#vllm``); or only ``NODE#ENGINE``'s when given that name. Returns the
        entries dropped per index name. InvalidArgument for a node this router knows (it would
        write them again at once: remove it from the inventory first) or one the index holds
        no entry of, and for one another running router claims (``ClaimingIndex``: it follows
        the node and would write its entries again, its follower resyncing)."""
        if not isinstance(node, str) or not node:
            raise InvalidArgument("give the node whose index entries to drop")
        known = self.known_nodes()
        engine = ENGINE_SEPARATOR in node
        if (node in known) if not engine else (owner(node) in self._fed_nodes()):
            raise InvalidArgument(
                f"{node!r} is in this router's inventory: it follows it and would write its "
                "entries again at once; remove the node from the inventory first (`kvctl fleet "
                "rm node`, the fleet file, or the router's --agent flags)"
                if not engine
                else f"this router reads {node!r}'s KV events (--vllm-events): its entries "
                "would be written again at once"
            )
        # another running router that follows it would write its entries again at once (its
        # follower resyncs): claims that do not answer refuse nothing (the drop is the word)
        age_s = (self.index_claims() or {}).get(owner(node))
        if age_s is not None and age_s < CLAIM_STALE_S:
            raise InvalidArgument(
                f"another running router follows {owner(node)!r} (it claimed the node "
                f"{age_s:.0f} s ago in the shared index) and would write its entries again at "
                "once; remove the node from that router's inventory first"
            )
        nodes = self.index_nodes()
        if nodes is None:
            raise IndexUnavailable(self.index_watch.error)
        names = [n for n in nodes if (n == node if engine else owner(n) == node)]
        if not names:
            unknown = sorted(self.unknown_index_nodes(nodes))
            listed = ", ".join(unknown[:10]) + (", ..." if len(unknown) > 10 else "")
            raise InvalidArgument(
                f"the index holds no entry of {node!r}; "
                + (
                    f"nodes in the index that this router's inventory does not name: {listed}"
                    if unknown
                    else "every node in the index is in this router's inventory"
                )
            )
        dropped: dict[str, int] = {}
        try:
            for name in names:
                dropped[name] = self.index.drop(name)
        except IndexUnavailable as exc:
            self.index_watch.failed(exc)
            raise
        log.warning(
            "forgot %s: %d index entries dropped (%s)",
            node,
            sum(dropped.values()),
            ", ".join(f"{n} {c}" for n, c in dropped.items()),
        )
        return dropped

    def _fed_nodes(self) -> frozenset[str]:
        """The nodes whose engine's KV events this router reads."""
        return frozenset(owner(str(feed.status().get("node", ""))) for feed in self.engine_feeds)

    def _usable(self, holdings: list[list[Holding]]) -> list[list[Holding]]:
        """``holdings`` without the copies of nodes whose agent this router marked down (an
        engine's cache ``NODE#vllm`` goes with NODE). A shared index keeps a down node's
        entries (another router may reach it); an embedded one drops them: either way this
        router neither routes to nor pulls from a node it cannot reach."""
        if self.followers is None:
            return holdings
        down = self.followers.down_nodes()
        if not down:
            return holdings
        return [[h for h in row if owner(h.node) not in down] for row in holdings]

    # --- the decision ------------------------------------------------------------------------
    def keys_for(self, tokens: Sequence[int], *, tenant: str) -> list[bytes]:
        """The chunk keys an agent computes for ``tenant``'s prompt ``tokens``."""
        if len(tokens) > MAX_TOKENS:
            raise InvalidArgument(
                f"{len(tokens):,} tokens in one request; the limit is {MAX_TOKENS:,}"
            )
        return self.keyspace.keys(tokens, tenant)

    def route_tokens(
        self,
        tokens: Sequence[int],
        *,
        tenant: str,
        origin_dc: str | None = None,
        policy: str = "cost",
        session: str | None = None,
        explain: bool = False,
    ) -> Decision:
        """``route`` for a prompt given as token ids (its keys computed as an agent does)."""
        keys = self.keys_for(tokens, tenant=tenant)
        # not route(): MAX_KEYS bounds the keys a caller sends; this chain is bounded by
        # MAX_TOKENS and may be longer (chunks under 64 tokens), so it is looked up in parts
        return self._route(
            keys,
            tenant=tenant,
            tokens=len(tokens),
            origin_dc=origin_dc,
            policy=policy,
            session=session,
            explain=explain,
            exact_chunks=True,  # its own keys: chunk_tokens tokens each
        )

    def route(
        self,
        keys: Sequence[bytes],
        *,
        tenant: str,
        tokens: int | None = None,
        origin_dc: str | None = None,
        policy: str = "cost",
        session: str | None = None,
        explain: bool = False,
    ) -> Decision:
        """The node ``policy`` picks for a request whose prompt is the chain ``keys``
        (``tokens`` long: default one full chunk per key). With "cost" that is the least modeled
        time to first token; a baseline policy (``kvctl.router.policies``) picks its own node,
        and the decision shows that node's modeled plan. The decision is counted and its
        modeled work queued on the node. Raises ``NoNodeAvailable`` when no node can serve.
        ``explain``: every node's plan in ``scores`` (else, for "cost", only the nodes that could
        win are planned: see ``score_nodes(prune=...)``)."""
        _check_keys(keys)
        return self._route(
            keys,
            tenant=tenant,
            tokens=tokens,
            origin_dc=origin_dc,
            policy=policy,
            session=session,
            explain=explain,
        )

    def _route(
        self,
        keys: Sequence[bytes],
        *,
        tenant: str,
        tokens: int | None,
        origin_dc: str | None,
        policy: str,
        session: str | None,
        explain: bool,
        exact_chunks: bool = False,
    ) -> Decision:
        if policy not in POLICIES:
            raise InvalidArgument(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
        if tokens is None:
            tokens = len(keys) * self.chunk_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise InvalidArgument(f"tokens must be an int >= 0, got {tokens!r}")
        if not keys and tokens == 0:
            # nothing to route: counting it as a decision would skew every figure
            raise InvalidArgument("the prompt is empty: give at least one key or token id")
        # the nodes up before the roles: a follower reads an agent's role before it calls it
        # up, so a pool agent up by now is known as one; read after, one called up between
        # the two reads was scored, its role not yet applied
        up = self.up_nodes()
        # one topology and the policies built on it for the whole request: the reloader's
        # thread may swap both meanwhile, and a baseline's node must be among the scores
        with self._policy_lock:
            self._follow_roles_locked()
            topology, policies = self.topology, self._policies
        if origin_dc is not None and origin_dc not in topology.dcs:
            known = ", ".join(topology.dcs) or "none"
            raise InvalidArgument(f"unknown origin DC {origin_dc!r}; the fleet's DCs: {known}")
        start_s = self._clock()
        holdings = self._usable(self._chain_holders(keys, tenant=tenant))
        queue_s = self.load.queue_s()
        scores = score_nodes(
            holdings,
            tokens=tokens,
            chunk_tokens=self.chunk_tokens,
            topology=topology,
            costs=self.costs,
            origin_dc=origin_dc,
            queue_s=queue_s,
            up=up,
            # a baseline's node must be among the scores, whatever its bound
            prune=policy == "cost" and not explain,
            exact_chunks=exact_chunks,
        )
        chosen = scores[0] if scores else None
        if chosen is not None and policy != "cost":
            request = RouteRequest(
                holdings, tokens, self.chunk_tokens, tenant, session, origin_dc, queue_s, up
            )
            with self._policy_lock:  # round-robin's turn is shared state
                name = policies[policy].choose(request)
            chosen = next((s for s in scores if s.node == name), None)
        elapsed_s = self._clock() - start_s
        if chosen is None:
            with self._lock:
                self._counts.no_node += 1
            if up is not None and not up:
                raise NoNodeAvailable("no node is up: the router reaches none of the agents")
            where = f" from DC {origin_dc!r}" if origin_dc is not None else ""
            raise NoNodeAvailable(f"no serving node is up and reachable{where}")
        decision = decision_for(chosen, scores, holdings, tokens=tokens, costs=self.costs)
        self.load.add(decision.node, chosen.prefill_s + chosen.fetch_s)
        self._count(decision, topology, policy, elapsed_s)
        return decision

    def next_id(self) -> str:
        """A decision id unique to this router instance."""
        with self._lock:
            self._seq += 1
            return f"{self.instance}-{self._seq}"

    def _count(self, d: Decision, topology: Topology, policy: str, elapsed_s: float) -> None:
        chosen = d.chosen
        links: list[tuple[tuple[str, str], int, int]] = []
        for pull in chosen.pulls:
            if not pull.node:  # read from the node's own tiers
                continue
            holder = topology.nodes.get(pull.node)
            from_dc = holder.dc if holder is not None else "unknown"
            links.append(((from_dc, d.dc), pull.chunks, pull.size_bytes))
        with self._lock:
            c = self._counts
            c.decisions += 1
            c.policies[policy] = c.policies.get(policy, 0) + 1
            node = c.nodes.setdefault(d.node, _NodeCounts())
            node.decisions += 1
            if chosen.local_chunks > 0:
                c.to_holder += 1
                node.to_holder += 1
            c.requested_chunks += d.chunks
            c.indexed_chunks += d.indexed_chunks
            c.local_chunks += chosen.fetched_chunks - chosen.pulled_chunks
            c.pulled_chunks += chosen.pulled_chunks
            c.pulled_bytes += chosen.pulled_bytes
            c.tokens += d.tokens
            c.fetched_tokens += chosen.fetched_tokens
            c.recomputed_tokens += max(0, d.tokens - chosen.fetched_tokens)
            for pair, chunks, nbytes in links:
                link = c.links.setdefault(pair, _LinkCounts())
                link.chunks += chunks
                link.bytes += nbytes
            i = bisect.bisect_left(LATENCY_BUCKETS_S, elapsed_s)
            if i < len(c.latency_buckets):
                c.latency_buckets[i] += 1
            c.latency_sum_s += elapsed_s
            c.latency_count += 1
            c.latency_samples.append(elapsed_s)

    # --- reports -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Every count since the router started, the modeled queues and the measured decision
        latency (p50/p99 of the newest samples)."""
        queue = self.load.queue_s()
        with self._lock:
            c = self._counts
            samples = sorted(c.latency_samples)
            nodes: dict[str, dict[str, float]] = {
                name: {"decisions": n.decisions, "to_holder": n.to_holder}
                for name, n in sorted(c.nodes.items())
            }
            links = [
                {"from_dc": a, "to_dc": b, "chunks": link.chunks, "bytes": link.bytes}
                for (a, b), link in sorted(c.links.items())
            ]
            buckets = list(c.latency_buckets)
            out: dict[str, Any] = {
                "decisions": c.decisions,
                "policies": dict(sorted(c.policies.items())),
                "no_node": c.no_node,
                "to_holder": c.to_holder,
                "requested_chunks": c.requested_chunks,
                "indexed_chunks": c.indexed_chunks,
                "local_chunks": c.local_chunks,
                "pulled_chunks": c.pulled_chunks,
                "pulled_bytes": c.pulled_bytes,
                "tokens": c.tokens,
                "fetched_tokens": c.fetched_tokens,
                "recomputed_tokens": c.recomputed_tokens,
                "holders_requests": c.holders_requests,
                "holders_keys": c.holders_keys,
                "latency": {
                    "count": c.latency_count,
                    "sum_s": c.latency_sum_s,
                    "buckets": list(zip(LATENCY_BUCKETS_S, buckets, strict=True)),
                },
            }
        for name in self.topology.nodes:
            nodes.setdefault(name, {"decisions": 0, "to_holder": 0})
        for name, row in nodes.items():
            row["queue_s"] = queue.get(name, 0.0)
        out["nodes"] = dict(sorted(nodes.items()))
        out["links"] = links
        out["queue_basis"] = LOAD_BASIS
        if self.inventory is not None:
            out["inventory"] = self.inventory.status()
        out["decision_s"] = {
            "p50": nearest_rank(samples, 0.50),
            "p99": nearest_rank(samples, 0.99),
            "samples": len(samples),
            "basis": "measured: the index lookup and the scoring, in this process",
        }
        return out

    def info(self) -> dict[str, Any]:
        """What the router routes with: the key space, the topology, the cost model."""
        return {
            "instance": self.instance,
            "started_s": self.started_s,
            "index": getattr(self.index, "kind", type(self.index).__name__),
            "keyspace": self.keyspace.as_dict(),
            "topology": self.topology.as_dict(),
            "prefill": self.costs.prefill.as_dict(),
            "host_to_device_bytes_per_s": self.costs.host_to_device_bytes_per_s,
            "disk_read_bytes_per_s": self.costs.disk_read_bytes_per_s,
            "carbon_s_per_g": self.costs.carbon_s_per_g,
            "policies": list(POLICIES),
        }


def _check_keys(keys: Collection[bytes]) -> None:
    if len(keys) > MAX_KEYS:
        raise InvalidArgument(f"{len(keys):,} keys in one request; the limit is {MAX_KEYS:,}")


def create_app(router: Router, *, token: str | None = None, **kw: Any) -> FastAPI:
    """The router's HTTP API (``kvctl.router.app.create_app``)."""
    from kvctl.router.app import create_app as _create_app

    return _create_app(router, token=token, **kw)


def _serving_not(topology: Topology, pool: Collection[str]) -> Topology:
    """``topology`` with the nodes of ``pool`` (pool agents: no engine) serving no request;
    kept, as sources of the chunks they hold. ``topology`` itself when none of them serves."""
    if not any(node.serves for name, node in topology.nodes.items() if name in pool):
        return topology
    nodes = {
        name: dataclasses.replace(node, serves=False) if name in pool else node
        for name, node in topology.nodes.items()
    }
    return dataclasses.replace(topology, nodes=nodes)
