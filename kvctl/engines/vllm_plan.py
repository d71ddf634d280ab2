"""The engine-independent half of the vLLM connector: what to load and save, and the copies
between vLLM's paged KV blocks and kvctl chunks.

Nothing here imports vLLM, so all of it runs (and is tested) on a CPU-only machine; the connector
in ``kvctl.engines.vllm_connector`` only translates vLLM's objects into these calls.

Scheduler side (``SchedulerPlan``): from a request's prompt and the tokens vLLM already holds
locally, compute the prompt's chunk keys, ask the agent for the longest cached prefix and offer
vLLM the whole chunks beyond its local prefix (never the last prompt token: vLLM must compute at
least one); then, each step, turn the request's blocks into a ``LoadSpec`` (chunks to read into
freshly allocated blocks) and ``SaveSpec`` s (full prompt chunks whose KV exists after the step).

Worker side (``WorkerPlan``, over ``kvctl.engines.vllm_paged.PagedKV``): gather a request's paged
blocks of every layer into chunk bytes, and scatter chunk bytes into blocks. Chunk bytes use the
shared layout of ``kvctl.engines.kvformat`` (``[layers, 2, kv_heads, T, head_dim]``, C order), so a
chunk stored by the transformers adapter is read here for the same model and vice versa.

Agent failures never raise out of this module: a failed lookup offers nothing, a failed read
reports the blocks it could not fill (vLLM recomputes them, and what the step computed on top
of them is not saved: ``LoadFailures``), a failed save is dropped. Each is logged; a refusal keeps
the connection, a lost one is made again at the next call (at most once per ``retry_seconds``),
and after any other failure the agent is retried after ``retry_seconds``. Every call to the
agent has a deadline (``kvctl.engines.deadlines``): ``timeout_seconds``, plus its bytes' time
where it may move chunks, so a hung agent costs a step one call's deadline, then nothing until
the retry.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

import torch

from kvctl.client import (
    AgentError,
    AgentNotAnswering,
    AgentTimeout,
    AgentUnreachable,
    ArenaLeases,
    AuthError,
    ChunkNotFound,
    DataClient,
    RequestError,
)
from kvctl.engines.deadlines import ANSWER_SECONDS, answer_seconds
from kvctl.engines.kvformat import ChunkFormat
from kvctl.engines.kvload import (
    KVLoader,
    LayerCopies,
    leased_whole,
    queue_leased_many,
    read_chunks,
    release_pending,
)
from kvctl.engines.vllm_paged import PagedKV, check_geometry, loadable_chunks, order_layers
from kvctl.errors import InvalidArgument
from kvctl.store.keys import KVLayout, Namespace, keys_for
from kvctl.wire.address import parse_address

log = logging.getLogger("kvctl.engines.vllm")

DEFAULT_AGENT = "127.0.0.1:7071"  # the agent's default data-plane address


# --- settings -----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The connector's ``kv_connector_extra_config``."""

    #: the agent's data plane: ``unix:///path/agent.sock`` (same host, shared memory) or HOST:PORT
    agent: str = DEFAULT_AGENT
    tenant: str = "default"
    #: data-plane token; None reads KVCTL_TOKEN
    token: str | None = None
    #: the id keys are made under; None uses vLLM's model name (the transformers adapter uses
    #: the same name, so both share chunks of the same weights)
    model_id: str | None = None
    #: None takes the agent's chunk size
    chunk_tokens: int | None = None
    #: how long an unreachable agent is left alone before the next connection attempt
    retry_seconds: float = 10.0
    #: how long a call to the agent that moves no chunk bytes (a lookup, a lease of chunks in
    #: its arena, the connection's HELLO) may take; one that may move chunks (a read, a lease
    #: that reads them from disk or pulls them, a save) gets its bytes' time on top
    #: (``deadlines.answer_seconds``). Past it the connection is dropped and the agent left
    #: alone for ``retry_seconds``: a hung agent costs one step this long, not every step
    timeout_seconds: float = ANSWER_SECONDS
    max_pending_save_bytes: int = 1 << 30
    #: copy loads layer by layer under the forward pass (``WorkerPlan.queue_loads``) instead
    #: of every layer before it
    layerwise: bool = False

    @classmethod
    def from_extra(cls, extra: Mapping[str, object] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidArgument(
                f"unknown kvctl connector setting(s) {unknown} in kv_connector_extra_config; "
                f"known: {sorted(known)}"
            )
        try:
            out = cls(**extra)  # type: ignore[arg-type]
        except TypeError as exc:
            raise InvalidArgument(f"bad kv_connector_extra_config: {exc}") from None
        for name in ("agent", "tenant"):
            if not isinstance(getattr(out, name), str) or not getattr(out, name):
                raise InvalidArgument(
                    f"kv_connector_extra_config {name!r} must be a non-empty string"
                )
        try:
            parse_address(out.agent)
        except ValueError as exc:
            raise InvalidArgument(f"kv_connector_extra_config 'agent': {exc}") from None
        if out.chunk_tokens is not None and (
            not isinstance(out.chunk_tokens, int)
            or isinstance(out.chunk_tokens, bool)
            or out.chunk_tokens <= 0
        ):
            raise InvalidArgument(
                f"chunk_tokens must be a positive integer, got {out.chunk_tokens!r}"
            )
        if not isinstance(out.layerwise, bool):
            raise InvalidArgument(f"layerwise must be true or false, got {out.layerwise!r}")
        for name in ("retry_seconds", "timeout_seconds", "max_pending_save_bytes"):
            value = getattr(out, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive number, got {value!r}")
        return out


# --- the agent ----------------------------------------------------------------------------
class AgentLink:
    """A lazily (re)connected data-plane client and the tenant's key namespace. ``get()`` is
    None while the agent is unreachable; a failure closes the client and waits
    ``retry_seconds`` before the next attempt, so a down agent costs one warning, not one per
    request."""

    def __init__(
        self,
        address: str,
        *,
        tenant: str,
        model_id: str,
        layout: KVLayout,
        token: str | None = None,
        chunk_tokens: int | None = None,
        block_size: int | None = None,
        retry_seconds: float = 10.0,
        timeout_seconds: float = ANSWER_SECONDS,
    ) -> None:
        self.address = address
        self.tenant = tenant
        self.model_id = model_id
        self.layout = layout
        self.token = token
        self.block_size = block_size
        self.retry_seconds = retry_seconds
        self.timeout_seconds = timeout_seconds
        #: fixed by the caller, or the agent's on first connect
        self.chunk_tokens = chunk_tokens
        if chunk_tokens is not None and block_size is not None:
            check_geometry(chunk_tokens, block_size)
        self.namespace: Namespace | None = None
        #: set when the agent's settings cannot work with this engine (logged once)
        self.disabled: str | None = None
        self._client: DataClient | None = None
        self._retry_at = 0.0
        #: when a lost connection was last made again at once (monotonic)
        self._quick_retry_at = -math.inf
        self._lock = threading.Lock()
        #: told of each new connection (the first, and each after the agent came back), on the
        #: thread that made it, once the link holds it; must not raise
        self.on_connect: Callable[[DataClient], None] | None = None

    @classmethod
    def from_settings(
        cls, settings: ConnectorSettings, *, model_id: str, layout: KVLayout, block_size: int
    ) -> AgentLink:
        return cls(
            settings.agent,
            tenant=settings.tenant,
            model_id=settings.model_id or model_id,
            layout=layout,
            token=settings.token,
            chunk_tokens=settings.chunk_tokens,
            block_size=block_size,
            retry_seconds=settings.retry_seconds,
            timeout_seconds=settings.timeout_seconds,
        )

    def get(self) -> DataClient | None:
        with self._lock:
            if self._client is not None and not self._client.closed:
                return self._client
            if self.disabled is not None or time.monotonic() < self._retry_at:
                return None
            try:
                client = DataClient.connect(
                    self.address, token=self.token, timeout_s=self.timeout_seconds
                )
            except AuthError as exc:  # a wrong token is a setting to fix, not an outage
                self.disabled = f"the kvctl agent at {self.address} refused the token: {exc}"
                log.error("kvctl connector disabled: %s", self.disabled)
                return None
            except (AgentError, OSError) as exc:
                self._retry_at = time.monotonic() + self.retry_seconds
                log.warning("kvctl agent at %s unreachable (%s); KV reuse is off for now",
                            self.address, exc)  # fmt: skip
                return None
            try:
                self._adopt(client)
            except InvalidArgument as exc:
                client.close()
                self.disabled = str(exc)
                log.error("kvctl connector disabled: %s", exc)
                return None
            except (AgentError, OSError) as exc:
                client.close()
                self._retry_at = time.monotonic() + self.retry_seconds
                log.warning("kvctl agent at %s failed (%s); retrying later", self.address, exc)
                return None
            self._client = client
        if self.on_connect is not None:
            self.on_connect(client)
        return client

    def _adopt(self, client: DataClient) -> None:
        agent_chunk = int(client.info["chunk_tokens"])
        chunk_tokens = self.chunk_tokens or agent_chunk
        if self.block_size is not None:
            check_geometry(chunk_tokens, self.block_size)
        fmt = ChunkFormat(self.layout, chunk_tokens)
        limit = int(client.info.get("max_chunk_bytes", fmt.chunk_bytes))
        if fmt.chunk_bytes > limit:
            raise InvalidArgument(
                f"a chunk of {chunk_tokens} tokens is {fmt.chunk_bytes} bytes for this model; the "
                f"agent takes at most {limit}: lower chunk_tokens or raise the agent's max_chunk"
            )
        with client.timeout(self.timeout_seconds):
            namespace = client.namespace(self.model_id, self.layout, self.tenant)
        self.chunk_tokens, self.namespace = chunk_tokens, namespace

    def failed(self, what: str, exc: BaseException, client: DataClient | None = None) -> None:
        """Report a failed call. A refusal the connection outlived (the agent starting, out
        of room, a chunk gone) costs only that call: the connection stays. A connection lost
        (the agent restarted, or closed it idle) is made again at the next call, at most once
        per ``retry_seconds``: an agent back at once costs one step, not ``retry_seconds`` of
        steps. Any other failure (a hung agent, a reply out of step) drops the connection and
        leaves the agent alone for ``retry_seconds``. ``client``: the connection the call
        failed on, if known: one the link has replaced since (another thread's call found it
        lost first) changes nothing, so a late report cannot close its successor."""
        with self._lock:
            if client is not None and client is not self._client:
                log.warning("kvctl %s failed (%s) on a connection made again since", what, exc)
                return
            client = self._client
            if (
                client is not None
                and not client.closed
                and isinstance(exc, (RequestError, ChunkNotFound))
            ):
                log.warning("kvctl %s refused (%s); the next call asks again", what, exc)
                return
            log.warning("kvctl %s failed (%s); continuing without the agent", what, exc)
            now_s = time.monotonic()
            self._retry_at = now_s + self.retry_seconds
            lost = isinstance(exc, AgentUnreachable) and not isinstance(
                exc, (AgentTimeout, AgentNotAnswering)
            )
            if client is not None:
                if lost and now_s >= self._quick_retry_at + self.retry_seconds:
                    self._retry_at = self._quick_retry_at = now_s
                client.close()
                self._client = None

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


def _weakly(method: Callable[[DataClient], None]) -> Callable[[DataClient], None]:
    """``method``, held without keeping its object alive: a link that held its worker plan
    (which holds the link) would make the two a cycle, and a plan let go of would keep its
    loaders' mapping of the agent's arena (the cpu tier's whole capacity) until the garbage
    collector's rare full pass found it."""
    ref = weakref.WeakMethod(method)

    def call(client: DataClient) -> None:
        bound = ref()
        if bound is not None:
            bound(client)

    return call


# --- scheduler side -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Read chunks into a request's new blocks: tokens ``start_token..end_token`` (the ones
    beyond vLLM's local prefix) from the chunks ``keys`` (chunk ``first_chunk`` onward)."""

    req_id: str
    keys: tuple[bytes, ...]
    first_chunk: int
    start_token: int
    end_token: int
    #: the request's blocks from its first token, enough to hold ``end_token`` tokens
    block_ids: tuple[int, ...]
    chunk_tokens: int

    def blocks_of(self, start: int, end: int, block_size: int) -> set[int]:
        """The request's blocks holding tokens ``start..end``."""
        if end <= start:
            return set()
        return set(self.block_ids[start // block_size : -(-end // block_size)])


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Store a request's full chunks ``first_chunk ..`` (keys ``keys``) from its blocks."""

    req_id: str
    keys: tuple[bytes, ...]
    first_chunk: int
    #: key of chunk ``first_chunk - 1`` (the prefix-chain link), None for the first chunk
    parent: bytes | None
    block_ids: tuple[int, ...]
    chunk_tokens: int

    @property
    def parents(self) -> list[bytes | None]:
        return [self.parent, *self.keys[:-1]]

    @property
    def tokens(self) -> int:
        return len(self.keys) * self.chunk_tokens

    def before(self, token: int) -> SaveSpec | None:
        """This save cut to its chunks that end by ``token``; None when none does."""
        keep = token // self.chunk_tokens - self.first_chunk
        if keep <= 0:
            return None
        if keep >= len(self.keys):
            return self
        return SaveSpec(
            self.req_id, self.keys[:keep], self.first_chunk, self.parent,
            self.block_ids, self.chunk_tokens,
        )  # fmt: skip


@dataclass(slots=True)
class _Match:
    keys: list[bytes]
    #: leading chunks of the prompt the agent holds (the last may not be loadable)
    cached_chunks: int
    local_tokens: int


@dataclass(slots=True)
class _Tracked:
    prompt_tokens: int
    keys: list[bytes]
    block_ids: list[int]
    #: leading chunks already in the agent or handed to a worker to save
    stored_chunks: int
    pending_load: tuple[int, int] | None = None
    #: tokens vLLM counts computed once the last planned step is done
    computed: int = 0


@dataclass(slots=True)
class StepPlan:
    """What one scheduler step asks the workers to do."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class SchedulerPlan:
    """Per-request bookkeeping of the scheduler-side connector."""

    def __init__(self, link: AgentLink, block_size: int, *, load: bool = True, save: bool = True):
        self.link = link
        self.block_size = block_size
        self.load = load
        self.save = save
        self._matches: dict[str, _Match] = {}
        self._asked: set[str] = set()
        self._requests: dict[str, _Tracked] = {}
        #: loads of requests not yet scheduled: (first token, end token)
        self._pending_new: dict[str, tuple[int, int]] = {}

    # vLLM asks this (maybe more than once per request; it must not change what is cached)
    def match(self, req_id: str, prompt: Sequence[int], local_tokens: int) -> int:
        """Tokens beyond ``local_tokens`` (vLLM's local prefix) that can be loaded."""
        client = self.link.get()
        namespace, chunk_tokens = self.link.namespace, self.link.chunk_tokens
        if client is None or namespace is None or chunk_tokens is None:
            self._matches.pop(req_id, None)
            return 0
        keys = keys_for(prompt, namespace, chunk_tokens)
        usable = loadable_chunks(len(prompt), chunk_tokens)
        # chunks vLLM holds in its own prefix cache: never loaded (one it holds in part is)
        local = min(local_tokens // chunk_tokens, usable)
        present = [False] * len(keys)
        ask = range(len(keys))  # the chunks whose presence ``exists`` is asked
        try:
            # the first question counts a hit (or miss) on the agent over the chunks a load
            # would bring in: not those vLLM holds already, nor the last one (kept to know
            # what not to save); repeats count nothing
            if self.load and local < usable and req_id not in self._asked:
                with client.timeout(self.link.timeout_seconds):
                    found = client.lookup(keys[local:usable], tenant=self.link.tenant)
                matched = found.matched_chunks
                present[local : local + matched] = [True] * matched
                self._asked.add(req_id)
                ask = [
                    *range(local),
                    *(range(usable, len(keys)) if local + matched == usable else ()),
                ]
            if ask:
                with client.timeout(self.link.timeout_seconds):
                    tiers = client.exists([keys[i] for i in ask], tenant=self.link.tenant)
                for i, tier in zip(ask, tiers, strict=True):
                    present[i] = tier is not None
        except AgentError as exc:
            self.link.failed("lookup", exc, client)
            present = [False] * len(keys)
        held = present.index(False) if False in present else len(present)
        self._matches[req_id] = _Match(keys, held, local_tokens)
        if not self.load:
            return 0
        # the agent's chunks from the local prefix on, up to the last loadable one
        reach = local + [*present[local:usable], False].index(False)
        return max(reach * chunk_tokens - local_tokens, 0)

    def allocated(self, req_id: str, external_tokens: int) -> None:
        """vLLM allocated blocks and will count ``external_tokens`` after the local prefix as
        computed: they must be loaded before the request's next forward pass."""
        m = self._matches.get(req_id)
        if m is None or external_tokens <= 0:
            return
        start = m.local_tokens
        tracked = self._requests.get(req_id)
        if tracked is not None:  # resumed after preemption: known already
            tracked.pending_load = (start, start + external_tokens)
        else:
            self._pending_new[req_id] = (start, start + external_tokens)

    def scheduled_new(
        self,
        req_id: str,
        prompt: Sequence[int],
        block_ids: Sequence[int],
        computed_tokens: int,
        scheduled_tokens: int,
        plan: StepPlan,
    ) -> None:
        """A request's first step: its blocks, and the tokens computed before and during it."""
        m = self._matches.pop(req_id, None)
        keys = m.keys if m is not None else self._keys(prompt)
        tracked = _Tracked(len(prompt), keys, list(block_ids), m.cached_chunks if m else 0)
        tracked.pending_load = self._pending_new.pop(req_id, None)
        self._requests[req_id] = tracked
        self._step(req_id, tracked, computed_tokens + scheduled_tokens, plan)

    def scheduled_again(
        self,
        req_id: str,
        new_block_ids: Sequence[int] | None,
        resumed: bool,
        computed_tokens: int,
        scheduled_tokens: int,
        plan: StepPlan,
    ) -> None:
        """A running (or resumed) request's step; ``new_block_ids`` are appended, or replace
        its blocks when it resumes after preemption."""
        tracked = self._requests.get(req_id)
        if tracked is None:
            return
        if resumed:
            tracked.block_ids = list(new_block_ids or ())
            m = self._matches.pop(req_id, None)
            if m is not None:
                tracked.stored_chunks = max(tracked.stored_chunks, m.cached_chunks)
        else:
            if computed_tokens < tracked.computed:
                # vLLM took back tokens it had counted computed: after a failed load it
                # recomputes from the first unfilled block, and the chunks from there on, whose
                # saves the worker dropped, are saved again once recomputed
                self._forget_from(tracked, computed_tokens)
            if new_block_ids:
                tracked.block_ids.extend(new_block_ids)
        self._step(req_id, tracked, computed_tokens + scheduled_tokens, plan)

    def load_failed(self, block_ids: Iterable[int]) -> None:
        """The workers could not fill ``block_ids`` (vLLM's ``invalid_block_ids``): the
        chunks from the first such block on were computed on garbage, and their saves were
        dropped by the worker, so they are not stored; they are saved once vLLM recomputes
        them."""
        bad = set(block_ids)
        if not bad:
            return
        for t in self._requests.values():
            first = next((i for i, b in enumerate(t.block_ids) if b in bad), None)
            if first is not None:
                self._forget_from(t, first * self.block_size)

    def _forget_from(self, t: _Tracked, token: int) -> None:
        chunk_tokens = self.link.chunk_tokens
        if chunk_tokens is not None:
            t.stored_chunks = min(t.stored_chunks, token // chunk_tokens)

    def finished(self, req_id: str) -> None:
        self._matches.pop(req_id, None)
        self._pending_new.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._asked.discard(req_id)

    @property
    def tracked_requests(self) -> int:
        return len(self._requests)

    def _keys(self, prompt: Sequence[int]) -> list[bytes]:
        ns, chunk_tokens = self.link.namespace, self.link.chunk_tokens
        return [] if ns is None or chunk_tokens is None else keys_for(prompt, ns, chunk_tokens)

    def _step(self, req_id: str, t: _Tracked, computed_after: int, plan: StepPlan) -> None:
        chunk_tokens = self.link.chunk_tokens
        t.computed = computed_after
        if chunk_tokens is None:
            return
        bs = self.block_size
        if t.pending_load is not None:
            start, end = t.pending_load
            t.pending_load = None
            first = start // chunk_tokens
            last = min(-(-end // chunk_tokens), len(t.keys))
            plan.loads.append(
                LoadSpec(req_id, tuple(t.keys[first:last]), first, start, end,
                         tuple(t.block_ids[: -(-end // bs)]), chunk_tokens)
            )  # fmt: skip
        if not self.save:
            return
        # full prompt chunks whose KV exists once this step's forward pass is done
        ready = min(computed_after, t.prompt_tokens, len(t.block_ids) * bs) // chunk_tokens
        ready = min(ready, len(t.keys))
        if ready <= t.stored_chunks:
            return
        first = t.stored_chunks
        parent = t.keys[first - 1] if first else None
        blocks = tuple(t.block_ids[: -(-ready * chunk_tokens // bs)])
        plan.saves.append(
            SaveSpec(req_id, tuple(t.keys[first:ready]), first, parent, blocks, chunk_tokens)
        )
        t.stored_chunks = ready


# --- worker side --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LoadOutcome:
    req_id: str
    #: tokens written into the request's blocks
    loaded_tokens: int
    #: blocks that should have been filled and were not (vLLM recomputes them)
    failed_block_ids: frozenset[int]
    fetched_bytes: int


class LoadFailures:
    """Keeps KV computed on top of blocks that a failed load left unfilled out of the agent.

    A chunk evicted between the scheduler's lookup and the worker's read leaves its blocks
    unfilled, and vLLM hears of it only after the step (``get_block_ids_with_load_errors``):
    the step's forward pass has computed the request's next tokens attending to garbage. Saved,
    those chunks would sit in the agent under correct keys and be served to every later request
    (of any tenant) sharing the prefix. So every chunk that ends past the first unfilled block
    of a request is dropped, in that step and later ones, until the scheduler plans a save of
    the request from that chunk or before it again: it does once vLLM has rolled the request
    back to recompute from there (``SchedulerPlan.load_failed``). A request whose blocks merely
    include an unfilled one (vLLM's prefix cache shares blocks within a step) is treated alike.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        #: chunks not saved for being computed on unfilled blocks
        self.dropped_chunks = 0
        #: request -> its first token that may have been computed on garbage
        self._poisoned: dict[str, int] = {}
        self._step: dict[str, int] = {}
        self._step_blocks: set[int] = set()

    def begin_step(self) -> None:
        self._step, self._step_blocks = {}, set()

    def failed(self, spec: LoadSpec, blocks: Set[int]) -> None:
        """This step's load ``spec`` left ``blocks`` unfilled."""
        first = next((i for i, b in enumerate(spec.block_ids) if b in blocks), None)
        if first is None:
            return
        self._step_blocks |= blocks
        token = first * self.block_size
        self._step[spec.req_id] = min(self._step.get(spec.req_id, token), token)

    def sound(self, saves: Iterable[SaveSpec]) -> list[SaveSpec]:
        """The step's saves, less every chunk that may have been computed on an unfilled block;
        ends the step."""
        out: list[SaveSpec] = []
        for spec in saves:
            bad = self._step.get(spec.req_id)
            if self._step_blocks:
                i = next((i for i, b in enumerate(spec.block_ids) if b in self._step_blocks), None)
                if i is not None:
                    token = i * self.block_size
                    bad = token if bad is None else min(bad, token)
                    self._step[spec.req_id] = bad
            earlier = self._poisoned.get(spec.req_id)
            if earlier is not None and spec.first_chunk * spec.chunk_tokens <= earlier:
                del self._poisoned[spec.req_id]  # re-planned from before it: recomputed since
            elif earlier is not None:
                bad = earlier if bad is None else min(bad, earlier)
            if bad is None:
                out.append(spec)
                continue
            kept = spec.before(bad)
            dropped = len(spec.keys) - (len(kept.keys) if kept is not None else 0)
            if dropped:
                self.dropped_chunks += dropped
                log.warning("kvctl does not save %d chunks of request %s: computed after a "
                            "failed load (vLLM recomputes them)", dropped, spec.req_id)  # fmt: skip
            if kept is not None:
                out.append(kept)
        for req_id, token in self._step.items():
            self._poisoned[req_id] = min(self._poisoned.get(req_id, token), token)
        self.begin_step()
        return out

    def finished(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._poisoned.pop(req_id, None)

    @property
    def poisoned_requests(self) -> int:
        return len(self._poisoned)


class WorkerPlan:
    """The worker-side connector's copies: chunks from the agent into paged blocks, and paged
    blocks into chunks for the agent."""

    def __init__(self, link: AgentLink, block_size: int) -> None:
        self.link = link
        self.block_size = block_size
        self.paged: PagedKV | None = None
        self.failures = LoadFailures(block_size)
        self._formats: dict[int, ChunkFormat] = {}
        self._loaders: dict[int, KVLoader] = {}
        #: the thread attaching the latest connection's arena (None before any)
        self.attached: threading.Thread | None = None
        #: this step's loads queued layer by layer (``queue_loads``)
        self._queued: list[_QueuedLoad] = []
        #: the connection holding their leases
        self._holder: DataClient | None = None
        #: layer name -> its place in the model
        self._layer_index: dict[str, int] = {}

    def loader(self, fmt: ChunkFormat) -> KVLoader:
        """One loader per chunk size: it keeps the arena's registration and a staging buffer."""
        got = self._loaders.get(fmt.chunk_tokens)
        if got is None:
            got = self._loaders[fmt.chunk_tokens] = KVLoader(fmt, self._paged().device)
        return got

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> PagedKV:
        names = order_layers(list(kv_caches))
        self._layer_index = {name: i for i, name in enumerate(names)}
        self.paged = PagedKV([kv_caches[n] for n in names], self.link.layout, self.block_size)
        # the arena mapped and registered when the worker connects (now, and again after the
        # agent comes back), off the request path: registering pins all of it (seconds)
        self.link.on_connect = _weakly(self._attach_later)
        client = self.link.get()
        if client is not None and self.attached is None:  # connected before: attach it too
            self._attach_later(client)
        return self.paged

    def _attach_later(self, client: DataClient) -> None:
        """Map and register ``client``'s arena in a background thread (a load meanwhile waits
        for it on the loader's lock, as it would have registered it itself)."""
        if self.paged is None or self.link.chunk_tokens is None:
            return
        loader = self.loader(self.format(self.link.chunk_tokens))
        self.attached = threading.Thread(
            target=loader.attach,
            args=(client,),
            kwargs={"answer_s": self.link.timeout_seconds},
            name="kvctl-arena-attach",
            daemon=True,
        )
        self.attached.start()

    def close(self) -> None:
        """Let go of the agent: each loader's mapping of its arena dropped (unregistered from
        CUDA first) and the connection closed. The connection alone cannot unmap the arena
        while a loader holds a tensor over it: a shut-down connector would keep the cpu tier's
        whole capacity mapped (pinned, on CUDA) for as long as its process lives."""
        attached = self.attached
        if attached is not None:  # else it could map the arena again once closed
            attached.join(self.link.timeout_seconds)
        for loader in self._loaders.values():
            loader.close()
        self.link.close()

    def format(self, chunk_tokens: int) -> ChunkFormat:
        fmt = self._formats.get(chunk_tokens)
        if fmt is None:
            fmt = self._formats[chunk_tokens] = ChunkFormat(self.link.layout, chunk_tokens)
        return fmt

    def load(self, spec: LoadSpec) -> LoadOutcome:
        """Fill the request's blocks from the agent. The leading chunks that arrive whole are
        written; the blocks of the rest are reported failed, never left half-trusted."""
        paged = self._paged()
        fmt = self.format(spec.chunk_tokens)
        size = fmt.chunk_bytes
        usable = 0
        client = self.link.get()
        kv: torch.Tensor | None = None
        if client is not None and spec.keys:
            loader = self.loader(fmt)
            kv = loader.alloc(len(spec.keys))
            try:
                usable, _path = read_chunks(
                    client, list(spec.keys), self.link.tenant, loader, kv,
                    answer_s=self.link.timeout_seconds,
                )  # fmt: skip
            except AgentError as exc:
                self.link.failed("read", exc, client)
        loaded_end = _loaded_end(spec, usable)
        if loaded_end > spec.start_token and kv is not None:
            paged.scatter_loaded(
                spec.block_ids, kv, spec.chunk_tokens, spec.first_chunk, spec.start_token,
                loaded_end,
            )  # fmt: skip
        return self._outcome(spec, usable, size)

    def _outcome(self, spec: LoadSpec, usable: int, chunk_bytes: int) -> LoadOutcome:
        """What a load of ``spec`` whose first ``usable`` chunks were written comes to."""
        loaded_end = max(_loaded_end(spec, usable), spec.start_token)
        # a block partly written (the range need not start on a block) is not trusted either
        failed = spec.blocks_of(loaded_end, spec.end_token, self.block_size)
        if failed:
            log.warning("kvctl loaded %d of %d tokens for request %s; %d blocks recomputed",
                        loaded_end - spec.start_token, spec.end_token - spec.start_token,
                        spec.req_id, len(failed))  # fmt: skip
        return LoadOutcome(
            spec.req_id, loaded_end - spec.start_token, frozenset(failed), usable * chunk_bytes
        )

    # --- layer by layer (``layerwise``) -----------------------------------------------------
    def queue_loads(self, specs: Sequence[LoadSpec]) -> bool:
        """Lease every chunk of a step's loads and queue their copies layer by layer
        (``KVLoader.load_layers``): each layer's blocks are written when the forward pass
        reaches its attention (``wait_layer``), and the leases are checked and released after
        the forward pass (``finish_loads``). False, with nothing held or queued, where that
        cannot be done: no shared memory, or a chunk that cannot be read in place (evicted
        since the lookup, pinned elsewhere, arena full); the caller then loads as ``load``
        does. A chunk on another node is pulled here before this returns, as ``load`` pulls
        it. Each load's KV stays on the device until the forward pass is over: memory beyond
        what vLLM budgets for."""
        if self._queued:
            raise InvalidArgument("the previous step's layer-wise loads were not finished")
        paged = self._paged()
        client = self.link.get()
        if client is None or not client.shm or any(not spec.keys for spec in specs):
            return False
        leased: list[tuple[LoadSpec, ArenaLeases]] = []
        used: list[KVLoader] = []
        queued: list[_QueuedLoad] = []
        ok = False
        try:
            # every request's chunks held before any copy is queued: a step that must load
            # synchronously has nothing queued to wait for (each hold keeps the earlier ones)
            for spec in specs:
                size = self.format(spec.chunk_tokens).chunk_bytes
                # the agent may read them from disk or pull them before it answers
                hold_s = answer_seconds(len(spec.keys) * size, self.link.timeout_seconds)
                with client.timeout(hold_s):
                    leases = client.hold(list(spec.keys), tenant=self.link.tenant)
                if leased_whole(leases.chunks, size) < len(spec.keys):
                    return False
                leased.append((spec, leases))
            # the loads of each chunk size queued together, layer-major: the first layer's
            # attention waits for every request's first layer, not for whole prefixes
            by_size: dict[int, list[int]] = {}  # one loader per chunk size
            for i, (spec, _) in enumerate(leased):
                by_size.setdefault(spec.chunk_tokens, []).append(i)
            made: dict[int, _QueuedLoad] = {}
            for chunk_tokens, group in by_size.items():
                loader = self.loader(self.format(chunk_tokens))
                used.append(loader)
                loads = [(leased[i][1], len(leased[i][0].keys)) for i in group]
                kvs = [loader.alloc(count) for _, count in loads]
                queued_copies = queue_leased_many(
                    [(leases, count, kv) for (leases, count), kv in zip(loads, kvs, strict=True)],
                    loader,
                )
                for i, kv, copies in zip(group, kvs, queued_copies, strict=True):
                    if copies is None:  # not reached: every chunk was leased whole above
                        return False
                    spec = leased[i][0]
                    slots = paged.slots(spec.block_ids, spec.start_token, _loaded_end(spec))
                    written = [False] * len(paged.layers)
                    made[i] = _QueuedLoad(spec, kv, copies, slots, written)
            queued = [made[i] for i in range(len(leased))]  # in the step's order
            ok = True
        except AgentError as exc:
            self.link.failed("read", exc, client)
            return False
        finally:
            if not ok:
                # copies queued so far (on CUDA: on the side stream) read the arena and write
                # their buffers: ended before the leases and the buffers go
                for loader in used:
                    loader.wait()
                release_pending(client, answer_s=self.link.timeout_seconds)
        self._queued, self._holder = queued, client
        return True

    def wait_layer(self, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: its blocks of every queued load written
        (on CUDA queued on the caller's stream after that layer's copies; the host does not
        wait)."""
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        for q in self._queued:
            self._write_layer(q, i)

    def finish_loads(self) -> list[tuple[LoadSpec, LoadOutcome]]:
        """After the forward pass: the copies waited for, the leases checked (a chunk whose
        lease ran out before its copies ended may hold another chunk's bytes: its blocks and
        those after are reported failed, for vLLM to recompute) and released. A load with a
        layer its attention never asked for is reported failed whole (that attention ran on
        unfilled blocks). Empty when nothing was queued; the queue is empty after."""
        queued, self._queued = self._queued, []
        holder, self._holder = self._holder, None
        if not queued:
            return []
        outcomes: list[tuple[LoadSpec, LoadOutcome]] = []
        try:
            for q in queued:
                held = 0
                try:
                    q.copies.done()
                    held = q.copies.held()
                except Exception:  # the request recomputes; the engine goes on
                    log.exception("kvctl layer-wise load of request %s failed", q.spec.req_id)
                    q.broken = True
                if not all(q.written) and not q.broken:
                    # an attention layer ran without its KV: its wait_for_layer_load was not
                    # called (a full CUDA graph replayed, which skips it)
                    log.warning("kvctl: %d of %d layers of request %s were never asked for "
                                "before their attention; its loaded blocks are recomputed",
                                q.written.count(False), len(q.written), q.spec.req_id)  # fmt: skip
                    q.broken = True
                fmt = self.format(q.spec.chunk_tokens)
                outcome = self._outcome(q.spec, 0 if q.broken else held, fmt.chunk_bytes)
                outcomes.append((q.spec, outcome))
        finally:
            for q in queued[len(outcomes) :]:
                q.copies.abandon()  # only on the way out of a BaseException
            release_pending(holder, answer_s=self.link.timeout_seconds)
        return outcomes

    def _write_layer(self, q: _QueuedLoad, layer: int) -> None:
        if q.written[layer]:
            return
        q.written[layer] = True
        if q.end <= q.spec.start_token:
            return
        try:
            q.copies.ready(layer)
            if q.kv.is_cuda:  # read on this stream, which may not be the one they came from
                stream = torch.cuda.current_stream(q.kv.device)
                for t in (q.kv, *q.slots):
                    t.record_stream(stream)
            self._paged().scatter_loaded(
                q.spec.block_ids, q.kv, q.spec.chunk_tokens, q.spec.first_chunk,
                q.spec.start_token, q.end, [layer], q.slots,
            )  # fmt: skip
        except Exception:  # the request recomputes; the engine goes on
            log.exception("kvctl layer-wise load of request %s failed", q.spec.req_id)
            q.broken = True

    def gather(self, spec: SaveSpec) -> torch.Tensor:
        """The spec's chunks copied to host memory, ``[chunks, chunk_bytes]`` uint8: the bytes
        to send, safe from vLLM reusing the blocks."""
        paged = self._paged()
        rows = paged.gather_chunks(
            spec.block_ids, spec.first_chunk, len(spec.keys), spec.chunk_tokens
        )
        host = _host_buffer(rows.numel(), paged.device).view(rows.shape)
        host.copy_(rows)  # synchronous: the bytes are the step's, whatever happens next
        return host

    def put(self, spec: SaveSpec, host: torch.Tensor, link: AgentLink | None = None) -> int:
        """Store gathered chunks; returns how many the agent stored (0 when it failed).
        ``link``: another connection to send through (the saver thread's own)."""
        link = link or self.link
        client = link.get()
        if client is None:
            return 0
        rows = host.numpy()
        try:
            with client.timeout(answer_seconds(host.numel(), link.timeout_seconds)):
                outcomes = client.put_many(
                    [(key, rows[i]) for i, key in enumerate(spec.keys)],
                    tenant=link.tenant,
                    parents=spec.parents,
                    tokens=spec.chunk_tokens,
                    depths=list(range(spec.first_chunk, spec.first_chunk + len(spec.keys))),
                )
        except AgentError as exc:
            link.failed("save", exc, client)
            return 0
        return sum(o.status == "stored" for o in outcomes)

    def save(self, spec: SaveSpec) -> int:
        return self.put(spec, self.gather(spec))

    def _paged(self) -> PagedKV:
        if self.paged is None:
            raise InvalidArgument("no KV caches registered with the kvctl connector")
        return self.paged


def _loaded_end(spec: LoadSpec, chunks: int | None = None) -> int:
    """The last token of ``spec``'s range that its first ``chunks`` chunks (all by default)
    cover."""
    n = len(spec.keys) if chunks is None else chunks
    return min(spec.end_token, (spec.first_chunk + n) * spec.chunk_tokens)


@dataclass(slots=True)
class _QueuedLoad:
    """A load whose copies run layer by layer under the forward pass (``queue_loads``)."""

    spec: LoadSpec
    #: the chunks' KV as they land (``KVLoader.alloc``), kept until every layer is written
    kv: torch.Tensor
    copies: LayerCopies
    #: the places in the paged caches of the tokens written (``spec.start_token..end``):
    #: ``PagedKV.slots``, made once
    slots: tuple[torch.Tensor, torch.Tensor]
    #: which layers' blocks are written
    written: list[bool]
    #: a layer's write failed: the whole load is reported failed
    broken: bool = False

    @property
    def end(self) -> int:
        """The last token written: every chunk is queued."""
        return _loaded_end(self.spec)


def _host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    # page-locked when the cache is on a GPU: copies to and from it skip a staging copy
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


class BackgroundSaver:
    """Sends gathered chunks to the agent off vLLM's step, through its own connection (so a
    load never queues behind a save). Bounded: beyond ``max_pending_bytes`` waiting, a save is
    dropped (a future miss, never a stall)."""

    def __init__(
        self, worker: WorkerPlan, link: AgentLink | None = None, max_pending_bytes: int = 1 << 30
    ) -> None:
        self.worker = worker
        self.link = link or worker.link
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.stored_chunks = 0
        self.dropped_chunks = 0
        self._queue: queue.Queue[tuple[SaveSpec, torch.Tensor] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvctl-saver", daemon=True)
        self._thread.start()

    def submit(self, spec: SaveSpec, host: torch.Tensor) -> bool:
        with self._lock:
            if self.pending_bytes + host.numel() > self.max_pending_bytes:
                self.dropped_chunks += len(spec.keys)
                log.warning("kvctl save queue full (%d bytes); dropped %d chunks of request %s",
                            self.pending_bytes, len(spec.keys), spec.req_id)  # fmt: skip
                return False
            self.pending_bytes += host.numel()
        self._queue.put((spec, host))
        return True

    def drain(self) -> None:
        """Wait until every submitted save has been sent (or failed)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        if self.link is not self.worker.link:
            self.link.close()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                spec, host = item
                try:
                    stored = self.worker.put(spec, host, self.link)
                except Exception:  # a save must never take the engine down
                    log.exception("kvctl save of request %s failed", spec.req_id)
                    stored = 0
                with self._lock:
                    self.pending_bytes -= host.numel()
                    self.stored_chunks += stored
            finally:
                self._queue.task_done()
