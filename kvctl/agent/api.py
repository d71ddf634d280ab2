"""The agent's control API: HTTP/JSON under ``/v1``, Prometheus text on ``/metrics``.

Bulk KV bytes never travel here (that is the data plane); this API looks chunks up, moves, pins
and evicts them, resizes tiers, pages through the index and follows store events.

Store calls take the store's lock and may touch disk, so those endpoints are plain ``def``
(FastAPI runs them in its threadpool); only the event stream is async.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from heapq import nsmallest
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from starlette.routing import Match

from kvctl import __version__
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import tier_size_problem
from kvctl.errors import InvalidArgument, KvctlError
from kvctl.http_errors import error_responses, install_error_handlers
from kvctl.http_guards import (
    DEFAULT_MAX_BODY_BYTES,
    ASGIApp,
    BearerAuth,
    BodyLimit,
    Message,
    Receive,
    Scope,
    Send,
)
from kvctl.remote.probe import emulated_source, probe_link
from kvctl.store.errors import (
    CapacityError,
    DiskFullError,
    KeyNotFound,
    TierUnavailable,
)
from kvctl.store.keys import KEY_TEXT_CHARS, key_text_schema, keys_for, parse_key_text
from kvctl.units import parse_size
from kvctl.wire.address import tcp_target_problem
from kvctl.wire.protocol import MAX_PROBE_BYTES
from kvctl.wire.reports import LinkProbe

MAX_KEYS_PER_REQUEST = 100_000
MAX_PAGE = 10_000
#: the largest capacity a resize takes (a signed 64-bit byte count, as tiers and metrics keep it)
MAX_CAPACITY_BYTES = 2**63 - 1
#: event seqs and cursors are signed 64-bit like every other counter the agent exports
MAX_SEQ = 2**63 - 1
#: token ids are hashed as uint32 (kvctl.store.keys)
MAX_TOKEN = 2**32 - 1
#: most chunks one /v1/keys/top answers (each walks its prefix chain under the store's lock)
MAX_TOP = 1000
#: a comment line at least this often keeps proxies and idle timeouts from closing the stream
KEEPALIVE_SECONDS = 15.0
#: how long one blocking read of the event hub waits; bounds how late a disconnect is noticed
_EVENT_WAIT_SECONDS = 1.0
_EVENT_BATCH = 500
#: threads that wait on the event hub; separate from the endpoint threadpool so followers
#: cannot starve store calls (and vice versa)
_EVENT_THREADS = 64
#: link probes running at once (a collector's round asks each node for one per other DC)
_PROBE_THREADS = 8

log = logging.getLogger("kvctl.agent.api")

# Starlette picks the handler by walking the exception's MRO, so subclasses map with their base
_ERROR_STATUS: dict[type[KvctlError], int] = {
    InvalidArgument: 400,  # includes PayloadSizeError
    KeyNotFound: 404,  # includes CorruptChunk: to a reader a corrupt chunk is a miss
    CapacityError: 409,
    TierUnavailable: 503,
    DiskFullError: 507,
    KvctlError: 500,  # includes every StoreError not named above
}

#: what each error status means here, for the schema (every error body is ErrorDetail)
_ERROR_TEXT: dict[int, str] = {
    400: "bad input the schema cannot express: a malformed key, an unknown tier or model, too "
    "many keys, a size that is not a whole byte count, a body that is not JSON",
    401: "missing or wrong bearer token (when the agent has a token)",
    404: "a chunk could not be read back (corrupt or gone): to a reader it is a miss",
    409: "no room: pinned chunks exceed the size asked for, or the tier cannot hold it",
    413: "request body over the agent's limit",
    503: "a tier is unavailable (its directory is missing or not writable, or it was closed)",
    507: "the disk tier's filesystem is full",
}

# --- request and response models ------------------------------------------------------------

_KEYS_DESC = f"chunk keys, {KEY_TEXT_CHARS} hex characters each (at most {MAX_KEYS_PER_REQUEST:,})"
# Keys, tier and model names are checked by the handlers, which answer 400 naming the bad value;
# the schema still states them. Tier and model names differ per agent: the schema says
# x-kvctl-names and create_app's openapi() replaces it with the agent's names as an enum.
_NAMES_MARK = "x-kvctl-names"
KeyText = Annotated[str, WithJsonSchema(key_text_schema())]
TierName = Annotated[str, WithJsonSchema({"type": "string", _NAMES_MARK: "tiers"})]
ModelId = Annotated[str, WithJsonSchema({"type": "string", _NAMES_MARK: "models"})]
# fail_fast: a list of 2M wrongly typed items gives one error, not 2M (gigabytes of them)
KeyList = Annotated[list[KeyText], Field(fail_fast=True)]
TokenList = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN)]], Field(fail_fast=True)]
#: size text: ASCII digits, an optional fraction, an optional unit (B, K/KB/KiB ... T/TB/TiB)
_SIZE_TEXT = r"([0-9]{1,20}(?:\.[0-9]{1,20})?) ?((?:[bB]|[kKmMgGtT](?:[iI]?[bB])?)?)"
_SIZE_RE = re.compile(_SIZE_TEXT)
SizeText = Annotated[
    str, WithJsonSchema({"type": "string", "pattern": f"^{_SIZE_TEXT}$", "maxLength": 48})
]
CapacityBytes = Annotated[int, Field(ge=0, le=MAX_CAPACITY_BYTES)]
_LAST_EVENT_ID = re.compile(r"-?[0-9]{1,19}")


class _Request(BaseModel):
    """Request bodies take JSON's own types: no "5" for 5, no 1 or "yes" for true, no true
    for 1 (the schema's types are the API's)."""

    model_config = ConfigDict(strict=True)


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return error_responses(_ERROR_TEXT, *codes)


class Health(BaseModel):
    status: str = Field(description='always "ok" when the agent answers')
    name: str = Field(description="agent (node) name")
    dc: str = Field(description="data center the agent reports in")
    uptime_seconds: float = Field(description="seconds since the agent started")
    time_s: float = Field(description="the agent's clock, unix seconds (for clock-skew checks)")


class LookupRequest(_Request):
    model_config = ConfigDict(
        strict=True,
        # exactly one of tokens or keys (the validator below), in the schema's words
        json_schema_extra={
            "oneOf": [
                {"required": ["tokens"], "properties": {"tokens": {"type": "array"}}},
                {"required": ["keys"], "properties": {"keys": {"type": "array"}}},
            ]
        },
    )

    tenant: str = Field("", description="tenant asking; isolated tenants see only their chunks")
    model: ModelId | None = Field(
        None, description="model id for lookup by tokens (default: the agent's first model)"
    )
    tokens: TokenList | None = Field(
        None,
        description=f"prompt token ids (0..{MAX_TOKEN}); keys are computed over full chunks only",
    )
    keys: KeyList | None = Field(
        None,
        description=f"a prefix chain of {_KEYS_DESC}",
        json_schema_extra={"maxItems": MAX_KEYS_PER_REQUEST},
    )
    count: bool = Field(
        True,
        description="count in the hit statistics like an engine's lookup; false for operators' "
        "tools, which must not move the hit ratio they inspect",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> LookupRequest:
        if (self.tokens is None) == (self.keys is None):
            raise ValueError("give exactly one of tokens or keys")
        return self


class ChunkLocation(BaseModel):
    key: str = Field(description="chunk key (hex)")
    tier: str | None = Field(description="tier holding the chunk, or null when not cached")


class LookupResponse(BaseModel):
    total_chunks: int = Field(description="chunks in the request's key chain")
    matched_chunks: int = Field(description="leading chunks that are cached (usable prefix)")
    matched_tokens: int = Field(description="tokens covered by the matched prefix")
    chunks: list[ChunkLocation] = Field(description="every chunk of the chain, in order")


def _keys_field() -> Any:
    return Field(description=_KEYS_DESC, json_schema_extra={"maxItems": MAX_KEYS_PER_REQUEST})


class KeysRequest(_Request):
    keys: KeyList = _keys_field()


class KeysTierRequest(_Request):
    keys: KeyList = _keys_field()
    tier: TierName | None = Field(None, description="tier to act in (default depends on the call)")


class MoveRequest(_Request):
    keys: KeyList = _keys_field()
    tier: TierName = Field(description="destination tier")


class FlushRequest(_Request):
    tier: TierName = Field(description="tier to empty of unpinned chunks")
    demote: bool = Field(
        False,
        description="demote to the next tier instead of dropping; 400 for the bottom tier "
        "(nothing below it), which then keeps its chunks",
    )


class ResizeRequest(_Request):
    tier: TierName = Field(description="tier to resize")
    capacity: CapacityBytes | SizeText = Field(
        description=f"new capacity: bytes (0..{MAX_CAPACITY_BYTES}), or size text such as "
        '"512MiB", "64GiB", "8KiB", "1.5GiB" (a whole number of bytes)'
    )


class BulkResponse(BaseModel):
    done: int = Field(description="chunks the operation acted on")
    skipped_pinned: int = Field(0, description="chunks left alone because they are pinned")
    missing: int = Field(0, description="keys that are not cached")
    failed: int = Field(0, description="chunks that could not be moved (no room)")


class TierUsage(BaseModel):
    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    chunks: int


class ResizeResponse(BulkResponse):
    usage: TierUsage = Field(description="the tier's usage after the resize")


class TierRetryResponse(BaseModel):
    tier: str
    state: Literal["online", "absent", "offline"] = Field(
        description="the tier after the call: online; absent (still cannot be opened, the "
        "agent tries it again by itself); offline (it failed in service: puts go to the next "
        "tier, and the store tries it again on a put by itself)"
    )
    online: bool = Field(description="state is online")
    retried: bool = Field(
        description="this call tried to open the tier; false for a tier that was not absent"
    )
    reason: str | None = Field(description="why the tier is absent or offline; null online")
    tries: int | None = Field(
        description="tries since the agent started, this one included (null: a tier that "
        "was never absent)"
    )
    next_try_s: float | None = Field(
        description="unix time of the agent's own next try while absent; null otherwise"
    )
    usage: TierUsage | None = Field(description="the tier's usage once online; null otherwise")


class KeyItem(BaseModel):
    key: str = Field(description="chunk key (hex)")
    tier: str
    size_bytes: int
    tokens: int
    tenant: str = Field(description="tenant that stored the chunk")
    pinned: bool
    priority: int = Field(description="retention priority, 0..100")
    hit_count: int = Field(
        description="reads that served this chunk (get, lease, touch); lookups are not counted"
    )
    last_access_s: float = Field(description="unix time of the last access")
    isolated: bool = Field(description="visible only to its own tenant")


class KeysPage(BaseModel):
    items: list[KeyItem] = Field(description="chunks in ascending key order")
    next: str | None = Field(description="cursor for the next page (pass as after), null at end")


class HotKeyItem(KeyItem):
    prefix_chunks: int = Field(
        description="cached chunks in the prefix chain ending at this chunk, itself included"
    )
    prefix_tokens: int = Field(description="tokens of those chunks")
    prefix_complete: bool = Field(
        description="the chain reaches a first chunk; false when an ancestor is not cached, so "
        "the prefix is only partly known"
    )


class HotKeys(BaseModel):
    items: list[HotKeyItem] = Field(
        description="chunks by hits, most first; ties: the most recently accessed first"
    )


class ProbeRequest(_Request):
    model_config = ConfigDict(populate_by_name=True, strict=True)

    target: str = Field(description="data-plane TCP address of the agent to probe, HOST:PORT")
    name: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        description="the target node's name as the fleet names it: when this agent has a peer "
        "of that name (or a peer or pool at target) whose link has an emulated delay, the "
        "probe includes that delay (rtt_basis emulated)",
    )
    token: str | None = Field(
        None, description="the target's data-plane token (never logged, never echoed)"
    )
    pings: int = Field(5, ge=1, le=100, description="PING round trips to time")
    size_bytes: int = Field(
        1 << 20,
        alias="bytes",
        ge=0,
        le=MAX_PROBE_BYTES,
        description=f"bytes to upload, then to download (0..{MAX_PROBE_BYTES}; 0: no bandwidth)",
    )
    timeout_s: float = Field(
        2.0, gt=0, le=30, description="limit on each step: connect, each ping, each transfer"
    )

    @field_validator("target")
    @classmethod
    def _tcp_address(cls, v: str) -> str:
        problem = tcp_target_problem(v)  # the CLI checks with the same rule before asking
        if problem:
            raise ValueError(problem)
        return v


class ProbeResponse(BaseModel):
    target: str
    ok: bool = Field(description="the target answered and every step of the probe completed")
    rtt_s: float | None = Field(description="median PING round trip, null when none answered")
    rtt_min_s: float | None = Field(description="fastest PING round trip")
    loss_ratio: float = Field(description="lost pings / pings (an error or a timeout is a loss)")
    upload_bytes_per_s: float | None
    download_bytes_per_s: float | None
    bandwidth_bytes_per_s: float | None = Field(description="the lower of upload and download")
    probe_bytes: int = Field(description="bytes sent each way (the request's bytes)")
    error: str | None = Field(description="why ok is false")
    rtt_basis: Literal["measured", "emulated"] = Field(
        description="emulated: each ping and transfer included emulated_delay_s, the wait this "
        "agent's own fetches over the configured link to the target see; measured: the network "
        "alone",
    )
    emulated_delay_s: float | None = Field(
        description="the emulated wait per round trip; null when measured"
    )


class EventsResponse(BaseModel):
    events: list[dict[str, Any]] = Field(description="events oldest first, each with a seq")
    last_seq: int = Field(description="pass as after to continue")
    dropped: int = Field(description="events lost to the buffer before this read")
    instance: str = Field(
        description="the event stream's instance; it changes when the agent restarts, and a "
        "follower that sees it change must resync (page through /v1/keys) instead of resuming"
    )


# --- helpers ---------------------------------------------------------------------------------


def _parse_keys(texts: list[str]) -> list[bytes]:
    if len(texts) > MAX_KEYS_PER_REQUEST:
        raise InvalidArgument(
            f"{len(texts):,} keys in one request; the limit is {MAX_KEYS_PER_REQUEST:,}"
        )
    return [parse_key_text(t, f"keys[{i}]") for i, t in enumerate(texts)]


def _capacity_bytes(capacity: int | str) -> int:
    """A resize's capacity in bytes; size text is parsed exactly (no float rounding)."""
    if isinstance(capacity, int):
        return capacity  # bounds checked by the model
    shown = capacity if len(capacity) <= 40 else capacity[:40] + "..."
    m = _SIZE_RE.fullmatch(capacity)
    if m is None:
        raise InvalidArgument(f"not a size: {shown!r} (examples: 4096, 256KiB, 64GiB)")
    number, unit = m.groups()
    value = Decimal(number) * parse_size(f"1{unit}")  # parse_size knows the units
    if value != value.to_integral_value():
        raise InvalidArgument(f"{shown!r} is not a whole number of bytes")
    if value > MAX_CAPACITY_BYTES:
        raise InvalidArgument(
            f"{shown!r} is {value:,.0f} bytes, over the largest capacity, {MAX_CAPACITY_BYTES}"
        )
    return int(value)


def _fill_names(node: Any, names: dict[str, list[str]]) -> None:
    """Replace each ``x-kvctl-names`` mark in a schema with an enum of those names."""
    if isinstance(node, dict):
        kind = node.pop(_NAMES_MARK, None)
        if kind is not None:
            node["enum"] = list(names[kind])
        for v in node.values():
            _fill_names(v, names)
    elif isinstance(node, list):
        for v in node:
            _fill_names(v, names)


#: integer bounds the API declares; FastAPI's schema model holds bounds as floats, and 2**63-1
#: does not survive that (it rounds to 2**63)
_EXACT_BOUNDS = {
    float(b): b
    for b in (MAX_CAPACITY_BYTES, MAX_SEQ, MAX_TOKEN, MAX_PROBE_BYTES, MAX_KEYS_PER_REQUEST)
}


def _int_bounds(node: Any) -> None:
    """Give integer schemas their bounds back as exact integers."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                v = node.get(k)
                if isinstance(v, float) and v.is_integer():
                    node[k] = _EXACT_BOUNDS.get(v, int(v))
        for v in node.values():
            _int_bounds(v)
    elif isinstance(node, list):
        for v in node:
            _int_bounds(v)


def _no_null_params(schema: dict[str, Any]) -> None:
    """An optional query or header parameter is absent or a value, never null: drop pydantic's
    null branch (a client generating from the schema would send the text "null")."""
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            for param in op.get("parameters", ()):
                s = param.get("schema", {})
                branches = [b for b in s.get("anyOf", ()) if b.get("type") != "null"]
                if "anyOf" in s and len(branches) == 1:
                    del s["anyOf"]
                    s.pop("default", None)
                    s.update(branches[0])


def _sse(event: str, data: Any, seq: int | None = None) -> bytes:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


# --- middleware ------------------------------------------------------------------------------


class _HttpMetrics:
    """Times each request and reports (method, route template, status, seconds).

    Outermost, so 401s and 500s are counted too. The label is the route's template, never the
    raw path, so unknown paths cannot blow up label cardinality ("other").
    """

    def __init__(self, app: ASGIApp, runtime: AgentRuntime, api: FastAPI) -> None:
        self.app = app
        self.runtime = runtime
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        observe = getattr(self.runtime.metrics, "observe_http", None)
        if scope["type"] != "http" or observe is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            observe(scope["method"], self._route(scope), status, time.perf_counter() - start)

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")
        if route is None:  # routing never ran (e.g. auth refused): match it ourselves
            for r in self.api.router.routes:
                if r.matches(scope)[0] != Match.NONE:
                    route = r
                    break
        return getattr(route, "path", None) or "other"


# --- the app ---------------------------------------------------------------------------------


def create_app(runtime: AgentRuntime, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The control API over ``runtime``; request bodies over ``max_body_bytes`` get a 413."""
    app = FastAPI(
        title="kvctl agent",
        version=__version__,
        description="Control API of a kvctl agent: look up, move, pin and evict KV chunks, "
        "resize tiers, page through the index and follow store events. Send "
        "`Authorization: Bearer <token>` when the agent has a token.",
    )
    store = runtime.store
    event_threads = anyio.CapacityLimiter(_EVENT_THREADS)
    probe_threads = anyio.CapacityLimiter(_PROBE_THREADS)

    install_error_handlers(app, _ERROR_STATUS)

    # added last = outermost: metrics see the auth middleware's 401s; the body limit runs
    # after auth, so a client without the token learns nothing but the 401
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    app.add_middleware(BearerAuth, token=lambda: runtime.settings.token)
    app.add_middleware(_HttpMetrics, runtime=runtime, api=app)

    @app.get("/v1/health", response_model=Health, tags=["agent"], responses=_errors())
    async def health() -> Health:
        """Liveness: answers without touching the store (so a busy store never fails it)."""
        s, now_s = runtime.settings, time.time()
        return Health(
            status="ok",
            name=s.name,
            dc=s.dc,
            uptime_seconds=now_s - runtime.started_s,
            time_s=now_s,
        )

    @app.get("/v1/info", tags=["agent"], responses=_errors())
    def info() -> dict[str, Any]:
        """Name, version, tiers, models, data-plane addresses and whether auth is on."""
        return dict(runtime.info())  # as a TypedDict, FastAPI would validate and filter it

    @app.get("/v1/stats", tags=["agent"], responses=_errors())
    def stats() -> dict[str, Any]:
        """Store counters and tier usage, with the chunk hit ratio derived (hits / looked up)."""
        return dict(runtime.stats())

    @app.get("/v1/remote", tags=["agent"], responses=_errors())
    def remote() -> dict[str, Any]:
        """The shared pool and peers: reachability, errors, link figures (measured, configured
        or emulated), pool usage, fetch-or-recompute decisions and the pool writer's counts."""
        if runtime.remote is None:  # the local tiers' plans and rates all the same
            return {"configured": False, "role": runtime.settings.role, **runtime.planner.status()}
        return {"configured": True, "role": runtime.settings.role, **runtime.remote.status()}

    @app.get("/v1/gpus", tags=["agent"], responses=_errors())
    def gpus() -> dict[str, Any]:
        """NVML status (with the error and a hint when unavailable) and one reading per GPU."""
        status, readings = runtime.gpus()
        return {
            "nvml": dataclasses.asdict(status),
            "gpus": [dataclasses.asdict(r) for r in readings],
        }

    @app.post("/v1/probe", response_model=ProbeResponse, tags=["agent"], responses=_errors(400))
    async def probe(body: ProbeRequest) -> LinkProbe:
        """Probe the link from this agent to another agent's data plane: PING round trips
        (median, min, loss), then one upload and one download of `bytes` for bandwidth.

        200 whenever the request is valid, also when the target is down (`ok` false, `error`
        says why). Blocks for up to about (2 * pings + 4) * timeout_s.

        When the target (by `name`, or by address) is the far end of a configured link with an
        emulated delay, every round trip waits that delay too, as this agent's fetches over the
        link do, and `rtt_basis` says `emulated`.

        At most a few probes run at once; more wait their turn, without holding the threads
        the other endpoints are served on.
        """
        sources = runtime.remote.sources if runtime.remote is not None else ()
        link = emulated_source(sources, target=body.target, name=body.name)
        # threads of their own: a slow target holds a probe for minutes, and probes on the
        # shared pool starved every other request (/metrics, /v1/stats) of its threads
        out = await anyio.to_thread.run_sync(
            functools.partial(
                probe_link,
                body.target,
                token=body.token or "",
                pings=body.pings,
                size_bytes=body.size_bytes,
                timeout_s=body.timeout_s,
                delay=None if link is None else link.delay,
            ),
            limiter=probe_threads,
        )
        log.info(
            "probe of %s: ok=%s rtt_s=%s (%s%s) loss=%.2f bandwidth_bytes_per_s=%s error=%s",
            body.target,
            out["ok"],
            out["rtt_s"],
            out["rtt_basis"],
            "" if link is None else f" over link {link.name}",
            out["loss_ratio"],
            out["bandwidth_bytes_per_s"],
            out["error"],
        )
        return out

    @app.post(
        "/v1/lookup", response_model=LookupResponse, tags=["chunks"], responses=_errors(400, 503)
    )
    def lookup(body: LookupRequest) -> LookupResponse:
        """Longest cached prefix of a request, by prompt tokens or by a key chain.

        Counts as a lookup in the store's hit statistics, like an engine's lookup, unless
        `count` is false.
        """
        if body.model is not None:  # checked for key chains too: a wrong model is an error
            runtime.model(body.model)
        if body.tokens is not None:
            chunk = runtime.settings.chunk_tokens
            if len(body.tokens) // chunk > MAX_KEYS_PER_REQUEST:
                raise InvalidArgument(
                    f"{len(body.tokens):,} tokens make more than {MAX_KEYS_PER_REQUEST:,} chunks"
                )
            ns = runtime.namespace(body.model, body.tenant)
            keys = keys_for(body.tokens, ns, chunk, include_partial=False)
        else:
            keys = _parse_keys(body.keys or [])
        if body.count:
            res = runtime.lookup(keys, tenant=body.tenant)
        else:
            res = store.peek(keys, tenant=body.tenant)
            if runtime.remote is not None:  # where the rest are, counting nothing
                res = dataclasses.replace(
                    res, locations=tuple(runtime.locate(keys, tenant=body.tenant))
                )
        return LookupResponse(
            total_chunks=res.total_chunks,
            matched_chunks=res.matched_chunks,
            matched_tokens=res.matched_tokens,
            chunks=[
                ChunkLocation(key=k.hex(), tier=t) for k, t in zip(keys, res.locations, strict=True)
            ],
        )

    def _tier(name: str) -> str:
        """``name`` if the store has such a tier, else 400 (the store would take "" as its
        default tier in some calls and as no filter in others)."""
        return store.tier(name).name

    # moving or promoting a chunk writes it into another tier and reads it out of its own
    moving = (400, 404, 503, 507)

    @app.post(
        "/v1/pin", response_model=BulkResponse, tags=["chunks"], responses=_errors(409, *moving)
    )
    def pin(body: KeysTierRequest) -> dict[str, int]:
        """Pin chunks so they are never evicted, moving them to `tier` first when given.

        409 when the pins cannot fit the tier (nothing is pinned then).
        """
        tier = None if body.tier is None else _tier(body.tier)
        return store.pin(_parse_keys(body.keys), tier=tier).as_dict()

    @app.post("/v1/unpin", response_model=BulkResponse, tags=["chunks"], responses=_errors(400))
    def unpin(body: KeysRequest) -> dict[str, int]:
        """Make pinned chunks evictable again."""
        return store.unpin(_parse_keys(body.keys)).as_dict()

    @app.post(
        "/v1/evict", response_model=BulkResponse, tags=["chunks"], responses=_errors(400, 503)
    )
    def evict(body: KeysRequest) -> dict[str, int]:
        """Drop chunks from the store; pinned chunks are skipped."""
        return store.evict(_parse_keys(body.keys)).as_dict()

    @app.post("/v1/flush", response_model=BulkResponse, tags=["tiers"], responses=_errors(*moving))
    def flush(body: FlushRequest) -> dict[str, int]:
        """Empty a tier of unpinned chunks (dropped, or demoted with `demote`).

        400 with `demote` on the bottom tier: there is nowhere to demote to, and nothing is
        dropped.
        """
        return store.flush(_tier(body.tier), demote=body.demote).as_dict()

    @app.post(
        "/v1/prefetch", response_model=BulkResponse, tags=["chunks"], responses=_errors(*moving)
    )
    def prefetch(body: KeysTierRequest) -> dict[str, int]:
        """Bring chunks up to `tier` (default: the top tier); chunks already there stay."""
        tier = None if body.tier is None else _tier(body.tier)
        return store.prefetch(_parse_keys(body.keys), tier).as_dict()

    @app.post("/v1/move", response_model=BulkResponse, tags=["chunks"], responses=_errors(*moving))
    def move(body: MoveRequest) -> dict[str, int]:
        """Move chunks to `tier`, up or down, making room there by policy."""
        return store.move(_parse_keys(body.keys), _tier(body.tier)).as_dict()

    @app.post(
        "/v1/resize", response_model=ResizeResponse, tags=["tiers"], responses=_errors(409, *moving)
    )
    def resize(body: ResizeRequest) -> dict[str, Any]:
        """Change a tier's capacity live, demoting (or dropping) chunks down to the new size.

        409 when pinned chunks exceed the new size, or when the tier cannot hold it (a cpu
        tier's arena is mapped whole: more than the host can map); the tier keeps its capacity.
        400 for a cpu tier of 0 bytes, as `kvctl agent start --cpu 0` is refused (gpu and disk
        may be 0: off).
        """
        name = _tier(body.tier)
        capacity_bytes = _capacity_bytes(body.capacity)
        problem = tier_size_problem(name, capacity_bytes)  # the rule `kvctl agent start` keeps
        if problem:
            raise InvalidArgument(problem)
        # a tier that cannot map the new size raises CapacityError itself (409), unchanged
        result = store.resize(name, capacity_bytes).as_dict()
        return {**result, "usage": store.usage()[name]}

    @app.post(
        "/v1/tiers/{tier}/retry",
        response_model=TierRetryResponse,
        tags=["tiers"],
        responses=_errors(400, 503),
    )
    def retry_tier(tier: TierName) -> dict[str, Any]:
        """Try a tier that could not be opened at start (a disk tier whose directory was
        missing, a file, not mounted) once now, without waiting for the agent's own retries:
        after fixing its directory. Answers the tier's state after the try and the reason
        when it is still absent (200 either way).

        Blocks while a try already under way finishes (a large directory's scan) and while
        this one opens and indexes the tier. A tier that is not absent is not tried
        (`retried` false). 400 for a tier this agent does not have, a gpu tier this machine
        cannot have included.
        """
        return runtime.retry_tier(tier)

    # before any /v1/keys/{...} route could be added: Starlette matches in order
    @app.get("/v1/keys/top", response_model=HotKeys, tags=["chunks"], responses=_errors())
    def top_keys(
        limit: int = Query(20, ge=1, le=MAX_TOP, description="most chunks to return"),
        pinned: bool = Query(False, description="only pinned chunks"),
    ) -> HotKeys:
        """The most-hit chunks, each with the cached prefix it ends (for a live operator view).

        Sees every tenant's chunks and counts nothing, so it never moves the hit statistics.
        """
        hot = store.hottest(limit, pinned_only=pinned)
        return HotKeys(items=[HotKeyItem.model_validate(h.as_dict()) for h in hot])

    @app.get("/v1/keys", response_model=KeysPage, tags=["chunks"], responses=_errors(400))
    def list_keys(
        tier: TierName | None = Query(None, description="only chunks in this tier"),
        limit: int = Query(100, ge=1, le=MAX_PAGE, description="page size"),
        after: KeyText | None = Query(None, description="cursor: the previous page's next"),
    ) -> KeysPage:
        """Cached chunks in ascending key order, one page at a time."""
        cursor = "" if after is None else parse_key_text(after, "after").hex()
        # entries are read under the store's lock: a policy's deferred bookkeeping rewinds an
        # entry's access time and count for a moment while it replays an earlier access
        with store.locked():
            hexed = ((e.key.hex(), e) for e in store.entries(None if tier is None else _tier(tier)))
            # O(n log limit), not a full sort of the index per page
            page = nsmallest(limit + 1, (p for p in hexed if p[0] > cursor), key=lambda p: p[0])
            listed = [(k, e.listing()) for k, e in page[:limit]]
        items = [KeyItem(key=k, **fields) for k, fields in listed]
        return KeysPage(items=items, next=items[-1].key if len(page) > limit else None)

    @app.get(
        "/v1/events/recent", response_model=EventsResponse, tags=["events"], responses=_errors()
    )
    def recent_events(
        after: int = Query(0, ge=0, le=MAX_SEQ, description="return events with a larger seq"),
        limit: int = Query(1000, ge=1, le=MAX_PAGE, description="most events to return"),
    ) -> EventsResponse:
        """Buffered store events, without waiting (for polling clients)."""
        batch = runtime.events.read(after, limit=limit)
        return EventsResponse(
            events=batch.events,
            last_seq=batch.last_seq,
            dropped=batch.dropped,
            instance=batch.instance,
        )

    @app.get(
        "/v1/events",
        tags=["events"],
        response_class=StreamingResponse,
        responses={
            200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400),
        },
    )
    async def events(
        request: Request,
        after: int | None = Query(
            None, ge=-1, le=MAX_SEQ, description="resume after this seq; -1 or absent: from now"
        ),
        last_event_id: str | None = Header(
            None,
            description="standard SSE resume cursor; wins over `after`",
            json_schema_extra={"pattern": f"^{_LAST_EVENT_ID.pattern}$"},
        ),
    ) -> StreamingResponse:
        """Server-Sent Events: store, demote, promote, move and evict events as they happen.

        Each message has `id: <seq>`; an `event: dropped` message says how many events a slow
        follower missed. A `: keep-alive` comment comes at least every 15 seconds.
        """
        cursor = after if after is not None else -1
        if last_event_id is not None:
            # ASCII digits only: int() would take " 5", "1_0" and other scripts' digits
            if not _LAST_EVENT_ID.fullmatch(last_event_id):
                raise InvalidArgument(
                    f"Last-Event-ID must be an event seq, got {last_event_id[:40]!r}"
                )
            cursor = int(last_event_id)
        if cursor < 0:
            cursor = runtime.events.last_seq
        return StreamingResponse(
            _follow(request, cursor),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def _follow(request: Request, cursor: int) -> AsyncIterator[bytes]:
        hub = runtime.events
        last_write = time.monotonic()
        yield b": connected\n\n"  # headers and a first byte out at once, so clients see 200
        while not await request.is_disconnected():
            # the hub blocks on a threading.Condition: wait in a worker thread, never the loop
            batch = await anyio.to_thread.run_sync(
                functools.partial(
                    hub.read, cursor, limit=_EVENT_BATCH, timeout_s=_EVENT_WAIT_SECONDS
                ),
                # a cancelled stream need not wait out the hub's wait; the thread ends by itself
                abandon_on_cancel=True,
                limiter=event_threads,
            )
            out: list[bytes] = []
            if batch.dropped:
                out.append(_sse("dropped", {"dropped": batch.dropped}))
            out.extend(_sse(str(e.get("type", "event")), e, e.get("seq")) for e in batch.events)
            cursor = batch.last_seq
            # one hub wait may pass before the next check: start early enough to stay within 15 s
            if not out and time.monotonic() - last_write >= KEEPALIVE_SECONDS - _EVENT_WAIT_SECONDS:
                out.append(b": keep-alive\n\n")
            if out:
                last_write = time.monotonic()
                yield b"".join(out)

    @app.get(
        "/metrics",
        tags=["agent"],
        response_class=Response,
        responses={
            200: {
                "description": "Prometheus text, or OpenMetrics when `Accept` asks for it",
                "content": {
                    "text/plain": {"schema": {"type": "string"}},
                    "application/openmetrics-text": {"schema": {"type": "string"}},
                },
            },
            **_errors(),
        },
    )
    def metrics(request: Request) -> Response:
        """Prometheus text exposition of the agent's `kvctl_*` metrics (OpenMetrics when the
        `Accept` header asks for it)."""
        body, content_type = runtime.metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    schemas: dict[bool, dict[str, Any]] = {}

    def openapi() -> dict[str, Any]:
        """FastAPI's schema, made to say what the handlers check: this agent's tier and model
        names as enums, optional query parameters as absent rather than null, and bearer auth
        when the agent has a token (read per request, so one schema per setting is kept)."""
        authed = bool(runtime.settings.token)
        if authed not in schemas:
            app.openapi_schema = None  # FastAPI caches one; build afresh
            schema = FastAPI.openapi(app)
            app.openapi_schema = None
            names = {
                "tiers": list(store.tier_names),
                "models": [m.id for m in runtime.settings.models],
            }
            _fill_names(schema, names)
            _int_bounds(schema)
            _no_null_params(schema)
            if authed:
                components = schema.setdefault("components", {})
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
            schemas[authed] = schema
        return schemas[authed]

    # FastAPI's documented way to customize the schema; its stub declares openapi a method
    app.openapi = openapi  # type: ignore[method-assign]

    # bound the route label to our own templates: probes of random paths all count as "other"
    allow_routes = getattr(runtime.metrics, "allow_routes", None)
    if allow_routes is not None:
        allow_routes([*(getattr(r, "path", "") for r in app.router.routes), "other"])
    return app
