"""The router's HTTP API: routing decisions and the fleet index under ``/v1``, Prometheus text
on ``/metrics``.

``POST /v1/index/holders`` and ``GET /v1/index`` are what ``kvctl.index.remote.IndexClient``
(an agent asking the index instead of probing its peers) reads; ``POST /v1/route`` is a
scheduler's question, which node should serve this prompt. Every endpoint needs
``Authorization: Bearer <token>`` when the router has a token.

The bearer check and the body limit are the agent's own (``kvctl.http_guards``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from kvctl import __version__, http_serving
from kvctl.errors import InvalidArgument, KvctlError
from kvctl.http_errors import error_responses, install_error_handlers
from kvctl.http_guards import BearerAuth, BodyLimit
from kvctl.index.model import owners
from kvctl.index.remote import MAX_KEYS, IndexUnavailable
from kvctl.router.policies import POLICIES
from kvctl.router.service import MAX_TOKENS, NoNodeAvailable, Router
from kvctl.store.index import check_tenant
from kvctl.store.keys import KEY_TEXT_CHARS, key_text_schema, parse_key_text
from kvctl.wire.address import connect_host, split_host_port, url_host

#: a route request with MAX_TOKENS token ids of 10 digits is about 2.9 MB; 4 MiB admits it
DEFAULT_MAX_BODY_BYTES = 4 << 20
MAX_TOKEN = 2**32 - 1
#: how long /v1/health waits for the index (a liveness probe's timeout is often 1 s; a hung
#: Redis takes its own timeout, 2 s by default, to fail)
HEALTH_INDEX_WAIT_S = 0.5

log = logging.getLogger("kvctl.router.app")

_ERROR_STATUS: dict[type[KvctlError], int] = {
    InvalidArgument: 400,
    NoNodeAvailable: 503,
    IndexUnavailable: 503,
    KvctlError: 500,
}
_ERROR_TEXT: dict[int, str] = {
    400: "bad input the schema cannot express: a malformed key, too many keys or tokens, an "
    "unknown DC or policy, an empty prompt, a node to forget that the index does not hold or "
    "that the router follows",
    401: "missing or wrong bearer token (when the router has a token)",
    413: "request body over the router's limit",
    503: "no node can serve the request (none up or reachable from its DC), or the index did "
    "not answer",
}


# --- request and response models ------------------------------------------------------------

KeyText = Annotated[str, WithJsonSchema(key_text_schema())]
# fail_fast: a long list of wrongly typed items gives one error, not one per item
KeyList = Annotated[list[KeyText], Field(fail_fast=True, max_length=MAX_KEYS)]
TokenList = Annotated[
    list[Annotated[int, Field(ge=0, le=MAX_TOKEN)]], Field(fail_fast=True, max_length=MAX_TOKENS)
]
_KEYS_DESC = (
    f"a prefix chain of chunk keys, {KEY_TEXT_CHARS} hex characters each (at most {MAX_KEYS:,})"
)


class _Request(BaseModel):
    """JSON's own types only: no "5" for 5, no 1 for true; unknown fields are refused (a
    misspelt ``origin_dc`` must not be silently ignored)."""

    model_config = ConfigDict(strict=True, extra="forbid")


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return error_responses(_ERROR_TEXT, *codes)


class RouteRequest(_Request):
    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {"required": ["tokens"], "properties": {"tokens": {"type": "array"}}},
                {"required": ["keys"], "properties": {"keys": {"type": "array"}}},
            ]
        },
    )

    tenant: str = Field("", max_length=256, description="tenant the request belongs to")
    keys: KeyList | None = Field(None, description=_KEYS_DESC)
    tokens: TokenList | None = Field(
        None,
        description=f"prompt token ids (0..{MAX_TOKEN}, at most {MAX_TOKENS:,}); the router "
        "computes their chunk keys as an agent does (its model, chunk size and isolated tenants)",
    )
    prompt_tokens: int | None = Field(
        None,
        ge=0,
        le=MAX_TOKENS,
        description="with keys: the prompt's length in tokens (default: one full chunk per key)",
    )
    origin_dc: str | None = Field(
        None, max_length=256, description="DC the request comes from (its round trip is counted)"
    )
    policy: str = Field(
        "cost",
        max_length=64,  # an unknown name is echoed in the 400: bounded like the other strings
        description=f"routing policy: {', '.join(POLICIES)} (cost: least modeled TTFT; the "
        "others are the baselines it is compared with)",
    )
    session: str | None = Field(
        None, max_length=256, description="session or conversation id (session-affinity)"
    )
    explain: bool = Field(False, description="add every node's score with its link figures")


class HoldersRequest(_Request):
    keys: KeyList = Field(description=_KEYS_DESC)
    tenant: str = Field(
        "",
        max_length=256,
        description="tenant asking; isolated chunks of other tenants are never shown",
    )


class ForgetRequest(_Request):
    node: str = Field(
        min_length=1,
        max_length=1024,
        description="the node whose index entries to drop (NODE#ENGINE: that engine's only)",
    )


class HoldingOut(BaseModel):
    node: str
    tier: str
    size_bytes: int
    tokens: int


class HoldersResponse(BaseModel):
    holders: list[list[HoldingOut]] = Field(
        description="for each key, in order, the nodes holding it that the tenant may see"
    )


class Health(BaseModel):
    status: str = Field(
        description='always "ok" when the router answers (an index outage included: a restart '
        "would not fix it; see index_up)"
    )
    instance: str = Field(description="changes when the router restarts")
    uptime_seconds: float
    nodes: int = Field(description="nodes in the router's topology")
    followers_up: int = Field(description="agents whose event stream the router reads")
    followers: int = Field(description="agents the router follows")
    index: str = Field(description="the index's kind: embedded or redis")
    index_up: bool = Field(description="whether the index answered just now")
    index_error: str | None = Field(description="why it did not (no credentials)")
    index_malformed_entries: int = Field(
        description="index entries no index wrote, skipped as no holder since the router "
        "started (counted per lookup that met one; 0 for an index that keeps none)"
    )
    time_s: float = Field(description="the router's clock, unix seconds")


# --- helpers ---------------------------------------------------------------------------------


def _malformed_entries(router: Router) -> int:
    """Entries the router's index skipped as no index's (RedisIndex.malformed_entries): only the
    first is logged at warning, and an index holding garbage routes as if nobody held a chunk."""
    return int(getattr(router.index, "malformed_entries", 0))


def _parse_keys(texts: list[str]) -> list[bytes]:
    return [parse_key_text(t, f"keys[{i}]") for i, t in enumerate(texts)]


class _IndexProbe:
    """Whether the index answers, for /v1/health, waited on for at most ``wait_s``. The index
    is asked in a thread of this probe's own, one question at a time: a hung index holds one
    thread however often health is asked, and health answers on time whatever it does."""

    def __init__(self, router: Router, wait_s: float) -> None:
        self._router = router
        self._wait_s = wait_s
        self._lock = threading.Lock()
        self._asking: Future[dict[str, int] | None] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvctl-router-index-probe")

    async def up(self) -> tuple[bool, str | None]:
        """(whether the index answered, why not)."""
        with self._lock:
            if self._asking is None or self._asking.done():
                self._asking = self._pool.submit(self._router.index_nodes)
            asking = self._asking
        try:
            # shielded: the question stays asked for the next probe when this one stops waiting
            nodes = await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(asking)), self._wait_s
            )
        except TimeoutError:
            return False, f"the index did not answer in {self._wait_s:g} s"
        if nodes is None:
            return False, self._router.index_watch.error
        return True, None


# --- metrics ---------------------------------------------------------------------------------


class _RouterCollector:
    """One consistent read of the router's counts per scrape (names: kvctl_router_* and
    kvctl_index_*, base units, counters ending in _total, labels bounded by the fleet's nodes
    and DCs: never a key, tenant or request)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        r = self.router
        s = r.stats()
        up = CounterMetricFamily(
            "kvctl_router_decisions", "Routing decisions made, by chosen node", labels=["node"]
        )
        to_holder = CounterMetricFamily(
            "kvctl_router_decisions_to_holder",
            "Decisions whose chosen node held part of the request's prefix itself",
            labels=["node"],
        )
        queue = GaugeMetricFamily(
            "kvctl_router_queue_seconds",
            "Modeled seconds of routed work not yet done, per node (prefill and fetch, drained "
            "at wall-clock rate)",
            labels=["node"],
        )
        for node, row in s["nodes"].items():
            up.add_metric([node], row["decisions"])
            to_holder.add_metric([node], row["to_holder"])
            queue.add_metric([node], row["queue_s"])
        yield from (up, to_holder, queue)
        inventory = s.get("inventory")
        if inventory is not None:
            yield GaugeMetricFamily(
                "kvctl_router_inventory_read_timestamp_seconds",
                "When the router last read its inventory (fleet database or file), unix seconds",
                value=inventory["read_s"],
            )
            yield CounterMetricFamily(
                "kvctl_router_inventory_errors",
                "Inventory rereads that failed (the router kept what it read before)",
                value=inventory["errors"],
            )
        for name, key, doc in (
            ("kvctl_router_no_node", "no_node", "Requests no node could serve"),
            ("kvctl_router_requested_chunks", "requested_chunks", "Chunks in routed requests"),
            (
                "kvctl_router_indexed_chunks",
                "indexed_chunks",
                "Chunks at the head of routed requests that some node held (index hits)",
            ),
            (
                "kvctl_router_local_chunks",
                "local_chunks",
                "Chunks the chosen nodes read from their own tiers",
            ),
            ("kvctl_router_tokens", "tokens", "Tokens of routed requests"),
            (
                "kvctl_router_fetched_tokens",
                "fetched_tokens",
                "Tokens the chosen nodes' plans fetch instead of prefilling",
            ),
            (
                "kvctl_router_recomputed_tokens",
                "recomputed_tokens",
                "Tokens the chosen nodes' plans prefill",
            ),
            (
                "kvctl_index_holders_requests",
                "holders_requests",
                "Holder lookups answered (POST /v1/index/holders)",
            ),
            ("kvctl_index_holders_keys", "holders_keys", "Keys in holder lookups"),
        ):
            yield CounterMetricFamily(name, doc, value=s[key])
        pulled_chunks = CounterMetricFamily(
            "kvctl_router_pulled_chunks",
            "Chunks the chosen nodes' plans pull from another node, by the link's DCs",
            labels=["from_dc", "to_dc"],
        )
        pulled_bytes = CounterMetricFamily(
            "kvctl_router_pulled_bytes",
            "Bytes the chosen nodes' plans pull from another node, by the link's DCs",
            labels=["from_dc", "to_dc"],
        )
        for link in s["links"]:
            pulled_chunks.add_metric([link["from_dc"], link["to_dc"]], link["chunks"])
            pulled_bytes.add_metric([link["from_dc"], link["to_dc"]], link["bytes"])
        yield from (pulled_chunks, pulled_bytes)
        lat = s["latency"]
        cumulative, buckets = 0, []
        for bound, count in lat["buckets"]:
            cumulative += count
            buckets.append((repr(float(bound)), cumulative))
        buckets.append(("+Inf", lat["count"]))
        yield HistogramMetricFamily(
            "kvctl_router_decision_seconds",
            "Time to decide a route: the index lookup and the scoring (measured)",
            buckets=buckets,
            sum_value=lat["sum_s"],
        )
        # an index outage leaves these out and says so: every other series stays scraped
        nodes = r.index_nodes()
        yield GaugeMetricFamily(
            "kvctl_index_up",
            "1 when the fleet index answered this scrape, else 0 (then kvctl_index_entries is "
            "absent)",
            value=0.0 if nodes is None else 1.0,
        )
        entries = GaugeMetricFamily(
            "kvctl_index_entries", "Index entries (chunk copies) per node", labels=["node"]
        )
        for node, n in (nodes or {}).items():
            entries.add_metric([node], n)
        yield entries
        if nodes is not None:
            unknown = r.unknown_index_nodes(nodes)
            yield GaugeMetricFamily(
                "kvctl_index_unknown_nodes",
                "Nodes in the index that this router's inventory does not name (a node removed "
                "while no router ran; `kvctl router forget NODE` drops one; NODE#vllm, its "
                "engine's entries, goes with NODE)",
                value=float(len(owners(unknown))),
            )
        yield CounterMetricFamily(
            "kvctl_index_malformed_entries",
            "Index entries no index wrote (a prefix shared by mistake, another host's bug), "
            "skipped as no holder: counted per lookup that met one",
            value=float(_malformed_entries(r)),
        )
        followers = r.follower_status()
        follower_up = GaugeMetricFamily(
            "kvctl_index_follower_up",
            "1 when the router reads the agent's event stream, else 0",
            labels=["node"],
        )
        resyncs = CounterMetricFamily(
            "kvctl_index_follower_resyncs",
            "Resyncs of a node's index entries from its agent's listing, by reason: first, "
            "agent_back, agent_restarted, behind (its event buffer), index_back (after an index "
            "outage), index_lost (the node's marker), index_partial (entries the index lost, "
            "marker kept), index_count (the node's key set lost)",
            labels=["node", "reason"],
        )
        for f in followers:
            follower_up.add_metric([str(f["node"])], 1.0 if f.get("up") else 0.0)
            for reason, n in (f.get("resync_reasons") or {}).items():
                resyncs.add_metric([str(f["node"]), str(reason)], float(n))
        yield follower_up
        yield resyncs
        yield from _engine_feed_metrics(r.engine_status())


def _engine_feed_metrics(feeds: list[dict[str, Any]]) -> Iterator[Metric]:
    """The engines' own KV event streams (vLLM's), one series per engine's index name."""
    connected = GaugeMetricFamily(
        "kvctl_index_engine_connected",
        "1 while the router's socket to the engine's KV event publisher is connected, else 0",
        labels=["node"],
    )
    counters = {
        key: CounterMetricFamily(f"kvctl_index_engine_{key}", doc, labels=["node"])
        for key, doc in (
            ("messages", "Event batches read from the engine"),
            ("chunks_stored", "Chunks the engine's blocks completed, stored in the index"),
            ("chunks_removed", "Chunks removed from the index by the engine's evictions"),
            ("gaps", "Jumps in the engine's sequence numbers"),
            ("unrecovered", "Batches lost in a gap that replay could not fill"),
            ("malformed", "Messages or events that could not be read"),
            ("restarts", "Engine restarts seen (its sequence starting over)"),
            (
                "oversized",
                "Messages over the feed's max_message_bytes refused (live or replayed)",
            ),
        )
    }
    for f in feeds:
        node = str(f["node"])
        connected.add_metric([node], 1.0 if f.get("connected") else 0.0)
        for key, family in counters.items():
            family.add_metric([node], float(f.get(key) or 0))
    yield connected
    yield from counters.values()


# --- the app ---------------------------------------------------------------------------------


def create_app(
    router: Router, *, token: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
) -> FastAPI:
    """The router's API over ``router``; every request needs ``token`` when one is given."""
    app = FastAPI(
        title="kvctl router",
        version=__version__,
        description="Routes requests to the node that serves them fastest (modeled from the "
        "fleet's KV index, its tiers and the links between DCs), and serves the index to "
        "agents. Send `Authorization: Bearer <token>` when the router has a token.",
    )
    registry = CollectorRegistry()
    registry.register(_RouterCollector(router))

    install_error_handlers(app, _ERROR_STATUS)
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes, server="router")
    # without a token too: it then checks the Host (a DNS-rebinding page must not steer it)
    app.add_middleware(BearerAuth, token=lambda: token)

    index_probe = _IndexProbe(router, HEALTH_INDEX_WAIT_S)

    @app.get("/v1/health", response_model=Health, tags=["router"], responses=_errors())
    async def health() -> Health:
        """Liveness, how many agents the router reads, and whether its index answers within
        half a second (200 either way: an index outage is not the router's to fix by
        restarting)."""
        # async, on the event loop: requests waiting on a hung index can fill the threadpool
        # sync endpoints run in, and health asks the index only through the probe's deadline
        index_up, index_error = await index_probe.up()
        followers_up, followers = router.follower_counts()
        now_s = time.time()
        return Health(
            status="ok",
            instance=router.instance,
            uptime_seconds=now_s - router.started_s,
            nodes=len(router.topology.nodes),
            followers_up=followers_up,
            followers=followers,
            index=str(getattr(router.index, "kind", type(router.index).__name__)),
            index_up=index_up,
            index_error=index_error,
            index_malformed_entries=_malformed_entries(router),
            time_s=now_s,
        )

    @app.get("/v1/info", tags=["router"], responses=_errors())
    def info() -> dict[str, Any]:
        """The key space (model, chunk size, isolated tenants), topology and cost model."""
        return router.info()

    @app.get("/v1/stats", tags=["router"], responses=_errors())
    def stats() -> dict[str, Any]:
        """Decisions (per node, to a holder, no node), index hits, pulls per DC link, tokens
        fetched and recomputed, modeled queues and the measured decision latency."""
        return router.stats()

    @app.post("/v1/route", tags=["router"], responses=_errors(400, 503))
    def route(body: RouteRequest) -> dict[str, Any]:
        """The node that serves this request fastest (modeled), what it would pull from where,
        and its modeled TTFT next to `full_prefill_ttft_s` (the same node prefilling every
        token); with `explain`, every node's score and the DC links' figures."""
        check_tenant(body.tenant)  # bytes of UTF-8, as an agent counts them, not characters
        if (body.keys is None) == (body.tokens is None):
            raise InvalidArgument("give exactly one of keys or tokens")
        if body.tokens is not None:
            if body.prompt_tokens is not None:
                raise InvalidArgument("prompt_tokens goes with keys; tokens give their own length")
            decision = router.route_tokens(
                body.tokens,
                tenant=body.tenant,
                origin_dc=body.origin_dc,
                policy=body.policy,
                session=body.session,
                explain=body.explain,
            )
        else:
            assert body.keys is not None
            decision = router.route(
                _parse_keys(body.keys),
                tenant=body.tenant,
                tokens=body.prompt_tokens,
                origin_dc=body.origin_dc,
                policy=body.policy,
                session=body.session,
                explain=body.explain,
            )
        out = decision.as_dict(explain=body.explain)
        out["decision_id"] = router.next_id()
        # the chosen node's modeled TTFT had it prefilled every token: what the plan saves
        chosen = decision.chosen
        out["full_prefill_ttft_s"] = (
            chosen.origin_s + chosen.queue_s + router.costs.prefill.seconds(0, decision.tokens)
        )
        out["policy"] = body.policy
        if body.explain:  # the DC links' figures and their basis (distance, measured...)
            topo = router.topology.as_dict()
            out["dc_links"] = topo["links"]
            out["intra_dc"] = topo["intra_dc"]
        return out

    @app.post(
        "/v1/index/holders",
        response_model=HoldersResponse,
        tags=["index"],
        responses=_errors(400, 503),
    )
    def holders(body: HoldersRequest) -> dict[str, Any]:
        """For each key, the nodes holding it (tier, size, tokens) that the tenant may see:
        what an agent asks instead of probing every peer."""
        check_tenant(body.tenant)
        rows = router.holders(_parse_keys(body.keys), tenant=body.tenant)
        return {
            "holders": [
                [
                    {"node": h.node, "tier": h.tier, "size_bytes": h.size_bytes, "tokens": h.tokens}
                    for h in row
                ]
                for row in rows
            ]
        }

    @app.get("/v1/index", tags=["index"], responses=_errors(503))
    def index() -> dict[str, Any]:
        """The index's kind, each node's entries, each followed agent's state and each
        engine event feed's (vLLM's KV events)."""
        nodes = router.index_nodes()
        if nodes is None:
            raise IndexUnavailable(router.index_watch.error)
        return {
            "kind": getattr(router.index, "kind", type(router.index).__name__),
            "nodes": nodes,
            "not_in_inventory": router.unknown_index_nodes(nodes),
            "malformed_entries": _malformed_entries(router),
            "followers": router.follower_status(),
            "engines": router.engine_status(),
        }

    @app.post("/v1/index/forget", tags=["index"], responses=_errors(400, 503))
    def forget(body: ForgetRequest) -> dict[str, Any]:
        """Drop every index entry of a node that left the fleet, its engines' (NODE#vllm) with
        them (or one engine's, given NODE#ENGINE): a node removed while no router ran stays in a
        shared index otherwise. 400 for a node in this router's inventory or one another running
        router follows (it would be written again at once), or one the index holds no entry
        of."""
        dropped = router.forget(body.node)
        return {"node": body.node, "dropped": dropped, "entries": sum(dropped.values())}

    @app.get("/metrics", tags=["router"], responses=_errors())
    def metrics(request: Request) -> Response:
        """Prometheus text: kvctl_router_* and kvctl_index_*."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), media_type=content_type)

    return app


# --- serving ---------------------------------------------------------------------------------

#: the router's default control port (agents: 7070, collector metrics: 9470)
DEFAULT_PORT = 9480


def _bind(listen: str) -> socket.socket:
    try:
        host, port = split_host_port(listen, DEFAULT_PORT)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    return http_serving.listen_tcp(
        host,
        port,
        cannot_bind=lambda exc: RouterError(
            f"cannot listen on {listen} for the router: {exc.strerror}"
        ),
    )


class RouterError(KvctlError):
    """The router cannot start (its address is taken, its index does not answer)."""


class RouterServer:
    """The router's API served by uvicorn on ``listen`` (port 0: any free port; ``url`` says
    which). ``run`` serves in this thread until SIGTERM/SIGINT; ``start``/``stop`` serve in a
    background thread (tests, embedding). Either way the router's followers run while it
    serves, and the router is closed after."""

    def __init__(
        self,
        router: Router,
        *,
        listen: str = f"127.0.0.1:{DEFAULT_PORT}",
        token: str | None = None,
        log_level: str = "warning",
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        header_timeout_s: float = http_serving.HEADER_TIMEOUT_SECONDS,
    ) -> None:
        import uvicorn

        self.router = router
        self._socket = _bind(listen)
        host, port = self._socket.getsockname()[:2]
        self.url = f"http://{url_host(connect_host(host))}:{port}"
        # the agent's limits against clients that hold connections (slow heads, floods)
        http_serving.throttle_accept_errors(what="router API")
        config = http_serving.serving_config(
            create_app(router, token=token, max_body_bytes=max_body_bytes),
            log_level,
            header_timeout_s=header_timeout_s,
            graceful_shutdown_s=5,
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    def run(self, on_serving: Callable[[], None] | None = None) -> None:
        """Serve until uvicorn is told to stop (a signal, or ``stop`` from another thread).
        ``on_serving`` is called once the router's followers and engine feeds started, before
        requests are served; an error starting them closes the router and is raised."""
        previous: dict[int, Any] = {}

        def stop_serving(_signum: int, _frame: object) -> None:
            # before uvicorn takes the signal over (the followers starting, the serving line
            # printed) a no-op here lost it: the router served on; set, uvicorn starts and
            # stops at once. After, it is uvicorn's re-raise of the signal it handled.
            self._server.should_exit = True

        if threading.current_thread() is threading.main_thread():
            # uvicorn handles SIGTERM/SIGINT while it runs (stops accepting, finishes what is in
            # flight), then re-raises the signal to the handler it found: this one, so the
            # router closes below and the process exits 0
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, stop_serving)
        try:
            # in the try: a feed that cannot start leaves no follower or feed thread running
            self.router.start()
            if on_serving is not None:
                on_serving()
            self._server.run(sockets=[self._socket])
        finally:
            self.router.close()
            self._socket.close()
            for signum, handler in previous.items():  # run() may be part of a longer process
                if handler is not None:
                    signal.signal(signum, handler)

    def start(self, timeout_s: float = 10.0) -> None:
        """Serve in a background thread; returns once it accepts connections."""
        self._thread = threading.Thread(target=self.run, name="kvctl-router", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RouterError(f"the router at {self.url} did not start")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> RouterServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
