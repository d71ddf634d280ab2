"""Reference engine: a Hugging Face transformers causal LM that reuses KV through a kvctl agent.

Before prefill the adapter computes the request's chunk keys (namespace from the model config
and the agent's policy for the tenant), asks the agent for the longest cached prefix, reads those
chunks into the model's cache object layer by layer, prefills only the remaining tokens, and then
stores the new full chunks. At least one prompt token is always computed: the next token's
logits come from it.
"""

from __future__ import annotations

import inspect
import logging
import mmap
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from kvctl.client import AgentError, AgentTimeout, DataClient, RequestError
from kvctl.engines.deadlines import ANSWER_SECONDS, answer_seconds
from kvctl.engines.identity import model_identity
from kvctl.engines.kvformat import ChunkFormat, dtype_name
from kvctl.engines.kvload import (
    KVLoader,
    LayerCopies,
    copy_leased,
    copy_past_blocked,
    host_tensor,
    pull_leased_counted,
    queue_leased,
    read_chunks,
    read_socket,
    release_pending,
)
from kvctl.engines.writebehind import Stored, StoreJob, WriteBehind
from kvctl.errors import InvalidArgument
from kvctl.store.keys import KVLayout, Namespace, keys_for, parents_of
from kvctl.wire.protocol import ErrorCode

if TYPE_CHECKING:
    from kvctl.store.tiers.hostreg import HostRegistration

log = logging.getLogger(__name__)


#: prefill samples sent per report (the agent keeps a bounded window of its own)
REPORT_SAMPLES = 16
#: fetches smaller than this say more about a round trip than about the link
MIN_RATE_BYTES = 4 << 20
#: a lost agent connection is tried again at most this often (requests prefill meanwhile),
#: the wait doubling after each failed try that waited on the agent (a hung one) up to
#: RECONNECT_MAX_INTERVAL_SECONDS
RECONNECT_INTERVAL_SECONDS = 2.0
RECONNECT_MAX_INTERVAL_SECONDS = 60.0
#: a failed try quicker than this was refused at once (no agent listening: stopped, or
#: restarting): it cost the request nothing, so the next is not put off any longer
REFUSED_TRY_SECONDS = 0.25
#: how long such a try may wait on the agent: a hung one costs a request no more (the same
#: deadline as any call that moves no chunk bytes: ``deadlines.ANSWER_SECONDS``)
RECONNECT_HELLO_SECONDS = ANSWER_SECONDS


def layout_of(config: PretrainedConfig, dtype: torch.dtype) -> KVLayout:
    """The KV layout a Llama-architecture config writes: layers, kv heads, head dim, dtype."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVLayout(int(config.num_hidden_layers), int(kv_heads), int(head_dim), dtype_name(dtype))


def model_id_of(config: PretrainedConfig) -> str:
    """The id chunk keys are made from: the config's name or path, with the hub commit
    transformers loaded it at, or a fingerprint of a local directory's weights (identity)."""
    name = getattr(config, "name_or_path", "") or ""
    if not name:
        raise InvalidArgument(
            "the model config has no name_or_path; pass model_id= (it must identify the weights: "
            "two models sharing an id would share KV)"
        )
    commit = getattr(config, "_commit_hash", None)
    return model_identity(str(name), revision=str(commit) if commit else None)


@dataclass
class Prefill:
    """One request's prefill: its output and where its KV came from."""

    #: logits of the last prompt position, float32 on the CPU
    logits: torch.Tensor
    next_token: int
    #: the model's cache after the prompt (None once a caller dropped it to free memory)
    cache: DynamicCache | None
    prompt_tokens: int
    #: tokens whose KV came from the agent
    reused_tokens: int
    reused_chunks: int
    #: tier of each reused chunk, as the agent's lookup reported it
    reused_tiers: list[str]
    fetched_bytes: int
    lookup_seconds: float
    fetch_seconds: float
    compute_seconds: float
    #: the new chunks' write, behind the request (resolved when the agent has them)
    stored: Future[Stored] = field(default_factory=Future)
    #: how the reused chunks travelled: "lease" (straight from the shared arena), "socket"
    fetch_path: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def stored_chunks(self) -> int:
        """Chunks the agent stored for this request (waits for the write behind it)."""
        return self.stored.result().chunks

    @property
    def stored_bytes(self) -> int:
        return self.stored.result().bytes

    @property
    def store_seconds(self) -> float:
        """From hand-over to the last put (off the request path; waits for the write)."""
        return self.stored.result().seconds

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    @property
    def ttft_seconds(self) -> float:
        """Lookup + fetch + prefill of the rest, up to the next token's logits. Storing the new
        chunks is not in it: ``prefill`` hands them to a writer and returns (``stored`` says
        when they landed)."""
        return self.lookup_seconds + self.fetch_seconds + self.compute_seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "computed_tokens": self.computed_tokens,
            "reused_chunks": self.reused_chunks,
            "reused_tiers": self.reused_tiers,
            "stored_chunks": self.stored_chunks,
            "fetched_bytes": self.fetched_bytes,
            "stored_bytes": self.stored_bytes,
            "fetch_path": self.fetch_path,
            "lookup_seconds": self.lookup_seconds,
            "fetch_seconds": self.fetch_seconds,
            "compute_seconds": self.compute_seconds,
            "store_seconds": self.store_seconds,
            "ttft_seconds": self.ttft_seconds,
            "next_token": self.next_token,
        }


class _StagingRegistrar:
    """``DataClient.on_staging`` for a CUDA engine's writer: keeps the writer's staging segment
    registered with CUDA. Apart from ``CachedLM`` so that the writer's thread, which calls it,
    does not keep the engine alive."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reg: HostRegistration | None = None
        self.failures = 0

    def __call__(self, segment: mmap.mmap | None) -> None:
        """The writer's connection attached ``segment`` (None: it is about to unmap the one it
        had): register it with CUDA, the old one unregistered first. A refusal leaves plain
        pageable copies (slower, as correct). Runs on the writer thread, between its copies,
        which are synchronous: none is in flight into a segment being unregistered."""
        if self.reg is not None:
            reg, self.reg = self.reg, None
            try:
                reg.close()
            except Exception as exc:  # the driver keeps it; the mapping goes with the client
                log.warning("could not unregister the staging segment from CUDA: %s", exc)
        if segment is None:
            return
        from kvctl.store.tiers.hostreg import register_host  # CUDA only; imported on first use

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        try:
            self.reg = register_host(segment, read_only=False, device=f"cuda:{index}")
        except Exception as exc:  # any refusal leaves a working, slower path
            self.failures += 1
            log.warning("could not register the staging segment with CUDA (stores slower): %s", exc)


class CachedLM:
    """A causal LM whose prefill reads and writes KV chunks through a kvctl agent.

    ``client`` is a data-plane connection (``DataClient.connect``); ``None`` runs plain full
    prefills (the baseline). Batch size 1: one request per call, one call at a time (buffers
    are reused between requests).

    New chunks are stored behind the request (``write_behind``, on by default): ``prefill``
    returns once the answer is ready, a writer thread on its own connection sends them, and
    ``flush()`` waits for it. Reused chunks come straight from the agent's shared arena under a
    lease when the connection has shared memory (same host), else over the socket.

    ``chunked_prefill`` computes the prompt one chunk at a time. In floating point a chunk's KV
    depends, in its last bits, on how many tokens the prefill that produced it covered (the
    softmax and attention sums over masked rows group differently), so reuse after a one-pass
    prefill matches a one-pass full prefill closely but not bit for bit. Chunk-aligned steps
    make every chunk's KV a function of its prefix alone: reuse is then bit-exact.

    ``reserve_tokens``: on a CPU, the buffer reused prefixes land in is sized for that many
    tokens and faulted in at start (else it grows, page faults and all, on the first request
    that reuses a longer prefix than any before).

    ``layerwise`` (off by default): a prefix leased whole from the shared arena is copied layer
    by layer under the forward pass instead of before it (``KVLoader.load_layers``): a hook
    before each decoder layer waits for that layer's KV only, so on a GPU the later layers'
    copies run while the first ones compute. Its leases are checked once the copies are done;
    where one ran out first, the request is prefilled again without it (``layerwise_redos``).
    Such a request's compute time holds copy time, so it is not reported as a prefill rate.

    Each call to the agent has a deadline (``kvctl.engines.deadlines``: 2 s, plus the time its
    bytes take at 256 MiB/s where it may move chunks): a request whose call fails or runs past
    it prefills in full (``agent_failures``), and a connection lost that way is made again
    later, with backoff (``client``), so a hung agent costs one request one call's deadline.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        client: DataClient | None,
        *,
        tenant: str = "default",
        model_id: str | None = None,
        chunk_tokens: int | None = None,
        store: bool = True,
        chunked_prefill: bool = False,
        write_behind: bool = True,
        reserve_tokens: int = 0,
        layerwise: bool = False,
    ) -> None:
        self.model = model
        self.write_behind = write_behind
        self.chunked_prefill = chunked_prefill
        self._client = client
        self.tenant = tenant
        self.store = store
        param = next(model.parameters())
        self.device = param.device
        self.layout = layout_of(model.config, param.dtype)
        self.model_id = model_id or model_id_of(model.config)
        agent_chunk = int(client.info["chunk_tokens"]) if client is not None else None
        self.chunk_tokens = int(chunk_tokens or agent_chunk or 256)
        self.format = ChunkFormat(self.layout, self.chunk_tokens)
        if client is not None and self.format.chunk_bytes > int(client.info["max_chunk_bytes"]):
            raise InvalidArgument(
                f"a chunk of {self.chunk_tokens} tokens is {self.format.chunk_bytes} bytes for "
                f"this model; the agent takes at most {client.info['max_chunk_bytes']}: lower "
                "chunk_tokens or raise the agent's max_chunk_bytes"
            )
        self._namespaces: dict[str, Namespace] = {}
        #: the earliest next try to connect again after the connection was lost (monotonic),
        #: and the wait after the next failed try (0: the first, RECONNECT_INTERVAL_SECONDS)
        self._next_reconnect_s = 0.0
        self._reconnect_wait_s = 0.0
        self.loader = KVLoader(self.format, self.device)
        self.loader.reserve(reserve_tokens // self.chunk_tokens)
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        #: send measured prefill rates to the agent (it plans fetch-or-recompute with them)
        self.report_rates = True
        #: the client whose agent predates LOOKUP_LEASE: looked up, then leased, as before
        self._no_lookup_lease: DataClient | None = None
        #: the client whose agent predates LOOKUP_LEASE_LOCAL: its lookup pulls all at once
        self._no_local_lease: DataClient | None = None
        self._samples: list[tuple[int, int, float]] = []
        self._h2d_bytes_per_s: float | None = None
        self._writer: WriteBehind | None = None
        #: closes the writer if this engine is collected without ``close``: its thread would
        #: otherwise wait for jobs forever, holding its connection and staging segment
        self._writer_finalizer: weakref.finalize[[WriteBehind], CachedLM] | None = None
        #: the CUDA stream the writer packs new chunks on (made on first store)
        self._pack_stream: Any = None
        #: registers the writer's staging segment with CUDA (so a new chunk's copy from the
        #: device into it is a DMA), while it has one
        self._staging = _StagingRegistrar(self.device)
        self.layerwise = layerwise
        #: the decoder layers a ``layerwise`` request hooks while its copies run
        self._layers = _decoder_layers(model, self.layout.layers) if layerwise else []
        #: requests prefilled again because a lease ran out before its layer-wise copy ended
        self.layerwise_redos = 0
        #: requests that gave up on the agent (a call failed, or ran past its deadline) and
        #: prefilled what it would have given
        self.agent_failures = 0
        #: seconds this engine took to map (and, on CUDA, register) the agent's shared arena
        #: when it connected; None without one
        self.arena_attach_seconds = self._attach()

    @property
    def client(self) -> DataClient | None:
        """The agent connection; one lost (the agent restarted, or failed a call, or did not
        answer one in time) is made again, tried at most every RECONNECT_INTERVAL_SECONDS, so
        reuse resumes by itself."""
        client = self._client
        if client is not None and client.closed:
            self._reconnect(client)
        return self._client

    def _reconnect(self, lost: DataClient) -> None:
        now_s = time.monotonic()
        if now_s < self._next_reconnect_s:
            return  # meanwhile requests prefill in full, as with no agent
        began_s = time.perf_counter()
        try:
            fresh = lost.reconnect(hello_timeout_s=RECONNECT_HELLO_SECONDS)
        except AgentError as exc:
            self._tried_in_vain(waited=time.perf_counter() - began_s >= REFUSED_TRY_SECONDS)
            log.info("kvctl agent still unreachable, prefilling in full: %s", exc)
            return
        self._reconnect_wait_s = 0.0
        log.info("kvctl agent connection made again: reusing KV")
        self.client = fresh

    def _tried_in_vain(self, *, waited: bool = True) -> None:
        """A try to reach the agent failed (a reconnect, or a call past its deadline): the
        next waits RECONNECT_INTERVAL_SECONDS from now, doubled after each failed try that
        waited on the agent, so a hung agent (each try waits out its deadline) costs a request
        RECONNECT_HELLO_SECONDS once a minute at most, not every few seconds. A try refused at
        once (``waited`` False: the agent stopped or restarting) cost nothing and starts the
        waits over, so reuse resumes within RECONNECT_INTERVAL_SECONDS of the agent's return
        however long it was away (doubled, a 10 s restart cost 5 s more without reuse, and a
        minute's up to a minute)."""
        if not waited:
            self._reconnect_wait_s = 0.0
        wait_s = self._reconnect_wait_s or RECONNECT_INTERVAL_SECONDS
        self._next_reconnect_s = time.monotonic() + wait_s  # from the try's end
        if waited:
            self._reconnect_wait_s = min(2 * wait_s, RECONNECT_MAX_INTERVAL_SECONDS)

    def _gave_up(self, what: str, exc: AgentError) -> None:
        """A request's call to the agent failed: it prefills in full (counted). A call past
        its deadline closed the connection, and counts as a failed try to reach the agent: the
        same request does not wait out another deadline to connect again."""
        self.agent_failures += 1
        log.warning("kvctl %s failed, prefilling in full: %s", what, exc)
        if isinstance(exc, AgentTimeout):
            self._tried_in_vain()

    @client.setter
    def client(self, client: DataClient | None) -> None:
        """A new connection (say, after the agent restarted); tenants' policies are asked anew."""
        self._close_writer()
        self._client = client
        self._namespaces.clear()
        self.arena_attach_seconds = self._attach()

    def _attach(self) -> float | None:
        """Map the agent's arena (registered with CUDA on a GPU) now, not in a request: pinning
        a few GiB takes seconds, which the first request to reuse anything would pay."""
        client = self._client
        return None if client is None else self.loader.attach(client)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every chunk handed to the writer has been sent; False on timeout."""
        return True if self._writer is None else self._writer.flush(timeout_s)

    def close(self) -> None:
        """Finish pending writes and stop the writer (the client stays the caller's)."""
        self._close_writer()
        self.loader.close()

    def _close_writer(self) -> None:
        writer, self._writer = self._writer, None
        if self._writer_finalizer is not None:
            self._writer_finalizer.detach()
            self._writer_finalizer = None
        if writer is not None:
            writer.close()

    @property
    def staging_register_failures(self) -> int:
        return self._staging.failures

    @property
    def _staging_reg(self) -> HostRegistration | None:
        return self._staging.reg

    def namespace(self, tenant: str | None = None) -> Namespace:
        """Model id + KV layout + the tenant's salt (asked of the agent once per tenant)."""
        tenant = self.tenant if tenant is None else tenant
        ns = self._namespaces.get(tenant)
        if ns is None:
            client = self.client
            if client is None:
                ns = Namespace(self.model_id, self.layout)
            else:
                with client.timeout(ANSWER_SECONDS):
                    ns = client.namespace(self.model_id, self.layout, tenant)
            self._namespaces[tenant] = ns
        return ns

    def chunk_keys(self, tokens: Sequence[int], tenant: str | None = None) -> list[bytes]:
        return keys_for(tokens, self.namespace(tenant), self.chunk_tokens)

    @torch.inference_mode()
    def prefill(
        self, tokens: Sequence[int] | torch.Tensor, *, tenant: str | None = None
    ) -> Prefill:
        ids = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
        if not ids:
            raise InvalidArgument("a prompt needs at least one token")
        tenant = self.tenant if tenant is None else tenant
        client = self.client  # (a lost connection is tried again here, when a try is due)
        try:
            # while the connection stays lost the agent is not called at all: the request
            # prefills in full as with no agent, neither failing a call nor logging one
            keys = self.chunk_keys(ids, tenant) if client is not None and not client.closed else []
        except AgentError as exc:  # the tenant's policy is asked of the agent on first use
            self._gave_up("tenant policy lookup", exc)
            keys = []
        return self._prefill(ids, keys, tenant, overlap=self.layerwise)

    def _prefill(
        self,
        ids: list[int],
        keys: list[bytes],
        tenant: str,
        *,
        overlap: bool,
        spent_s: float = 0.0,
        looked: tuple[int, list[str | None]] | None = None,
    ) -> Prefill:
        """``spent_s``: seconds an earlier try of this request took (``layerwise``'s redo),
        counted in this one's lookup time so the time to first token holds them; ``looked``:
        that try's lookup (chunks matched, their tiers), read again without a second lookup,
        which the agent would count as another request's hits."""
        # the last prompt token is always computed: its logits are the answer
        reusable = keys[: (len(ids) - 1) // self.chunk_tokens]

        self.loader.last_copy = None  # this request's copy only (none: its chunks came by socket)
        t0 = time.perf_counter()
        client = self.client
        copies: LayerCopies | None = None
        try:
            leased = None
            if (
                looked is None
                and client is not None
                and client.shm
                and reusable
                and client is not self._no_lookup_lease
            ):
                # same host: the lookup leases what it matched, one round trip less
                leased = self._lookup_leased(reusable, tenant, overlap=overlap)
            if leased is not None:
                matched, locations, cache, reused, path, t1, copies = leased
            else:
                matched, locations = looked or self._lookup(reusable, tenant)
                t1 = time.perf_counter()
                cache, reused, path = self._fetch(reusable[:matched], tenant)
            tiers = [t for t in locations[:reused] if t is not None]
            if copies is None:  # else each layer waits for its own copies, under the forward
                self._sync()
            t2 = time.perf_counter()
            start = reused * self.chunk_tokens
            step = self.chunk_tokens if self.chunked_prefill else len(ids)
            hooks = self._hook_layers(copies) if copies is not None else []
            try:
                for at in range(start, len(ids), step):
                    part = torch.tensor([ids[at : at + step]], device=self.device)
                    kv = self._kv(cache)
                    out = self.model(input_ids=part, use_cache=True, logits_to_keep=1, **kv)
                    cache = _cache_of(out)
            finally:
                for hook in hooks:
                    hook.remove()
            logits = out.logits[0, -1].float().cpu()  # .cpu() waits for the device
            lost = False
            if copies is not None:
                copies.done()
                lost = copies.held() < reused
            for layer in cache.layers:  # a cache that kept the loader's buffer must own a copy
                if self.loader.owns(layer.keys):
                    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            t3 = time.perf_counter()
        finally:  # the lookup's leases go once the first token is out, or the request failed
            try:
                if copies is not None:
                    copies.abandon()  # nothing may read the arena once its leases are gone
            finally:
                if client is not None and client.shm:
                    release_pending(client)
        if lost:  # what was read of a chunk whose lease ran out may be another chunk's bytes
            log.warning("a lease ran out before its layer-wise copy ended: prefilling again")
            self.layerwise_redos += 1
            spent_s += time.perf_counter() - t0
            return self._prefill(
                ids, keys, tenant, overlap=False, spent_s=spent_s, looked=(matched, locations)
            )
        # the copy out of the shared arena alone (what is left of the fetch is per request)
        copied = self.loader.last_copy
        if copies is not None and reused:
            copied = (reused * self.format.chunk_bytes, copies.seconds())
        timings = (
            {"copy_bytes": float(copied[0]), "copy_seconds": copied[1]}
            if copied is not None and reused
            else {}
        )
        if copies is not None and reused:
            timings["layerwise"] = 1.0  # the copies ran under compute: not in fetch_seconds
        if spent_s:
            timings["redo_seconds"] = spent_s
        if copies is None or not reused:
            self._measured(len(ids) - start, start, t3 - t2)
        # else nothing is reported: the compute time holds copies, and the copies' time
        # holds the layout kernels sharing the device with the forward pass
        stored = self._store(cache, keys, reused, locations, tenant)
        return Prefill(
            logits=logits,
            next_token=int(logits.argmax()),
            cache=cache,
            prompt_tokens=len(ids),
            reused_tokens=start,
            reused_chunks=reused,
            reused_tiers=list(tiers),
            fetched_bytes=reused * self.format.chunk_bytes,
            lookup_seconds=spent_s + t1 - t0,
            fetch_seconds=t2 - t1,
            compute_seconds=t3 - t2,
            stored=stored,
            fetch_path=path if reused else "",
            timings=timings,
        )

    def _hook_layers(self, copies: LayerCopies) -> list[Any]:
        """Hooks that make each decoder layer wait for its own copies (``layerwise``), for one
        request: the caller removes them (no engine stays hooked to a shared model)."""
        return [
            layer.register_forward_pre_hook(lambda _m, _a, i=i: copies.ready(i))
            for i, layer in enumerate(self._layers)
        ]

    @torch.inference_mode()
    def continue_prefill(
        self, cache: DynamicCache, tokens: Sequence[int], start: int
    ) -> torch.Tensor:
        """The last position's logits (float32, on the CPU) of ``tokens[start:]`` prefilled on
        top of the first ``start`` positions of ``cache`` (left as it was); nothing is looked
        up or stored. On a full prefill's cache this is what a reuse of exactly those KV bytes
        must answer: the reference that tells a transport error from the rounding of a
        two-pass prefill."""
        prefix = _cache_holding(
            [(layer.keys[:, :, :start], layer.values[:, :, :start]) for layer in cache.layers]
        )
        part = torch.tensor([list(tokens[start:])], device=self.device)
        out = self.model(input_ids=part, use_cache=True, logits_to_keep=1, **self._kv(prefix))
        return out.logits[0, -1].float().cpu()

    @torch.inference_mode()
    def generate(
        self, tokens: Sequence[int], max_new_tokens: int, *, tenant: str | None = None
    ) -> list[int]:
        """Greedy decoding after a cache-assisted prefill; returns the new tokens."""
        first = self.prefill(tokens, tenant=tenant)
        new = [first.next_token]
        cache = first.cache
        for _ in range(max_new_tokens - 1):
            step = torch.tensor([[new[-1]]], device=self.device)
            out = self.model(input_ids=step, use_cache=True, **self._kv(cache))
            cache = _cache_of(out)
            new.append(int(out.logits[0, -1].argmax()))
        return new

    # --- steps ------------------------------------------------------------------------------
    def _lookup(self, keys: list[bytes], tenant: str) -> tuple[int, list[str | None]]:
        """Leading chunks cached, and the tier of every key looked up (None: not cached)."""
        client = self.client
        if not keys or client is None:
            return 0, []
        try:
            with client.timeout(ANSWER_SECONDS):
                found = client.lookup(keys, tenant=tenant)
        except AgentError as exc:
            self._gave_up("lookup", exc)
            return 0, []
        return found.matched_chunks, list(found.locations)

    def _lookup_leased(
        self, keys: list[bytes], tenant: str, *, overlap: bool = False
    ) -> tuple[int, list[str | None], DynamicCache, int, str, float, LayerCopies | None] | None:
        """``_lookup`` and ``_fetch`` through a lookup that leases its matched prefix: the
        lookup's answer, the cache, chunks reused, their path, when the lookup's answer came
        (the fetch's start), and the copies still running (``overlap``: a prefix leased whole
        in the arena is copied layer by layer under the forward pass; None: all copied). None
        when the agent predates LOOKUP_LEASE (asked once)."""
        client = self.client
        assert client is not None
        local_only = client is not self._no_local_lease
        copies: LayerCopies | None = None
        try:
            # released after the first token: the copies are done, and the release need not
            # be in the time to it. Chunks on other nodes are pulled here in slices, each
            # copied while the next is pulled (``pull_leased``), not all before the reply
            # the lookup leases its local prefix, reading any of it on disk into the arena first
            lookup_s = answer_seconds(len(keys) * self.format.chunk_bytes)
            with (
                client.timeout(lookup_s),
                client.lookup_leased(
                    keys, tenant=tenant, release_later=True, local_only=local_only
                ) as (found, leases),
            ):
                lookup_end_s = time.perf_counter()
                m = found.matched_chunks
                kv = self.loader.alloc(m, reuse=True) if m else None
                if overlap and kv is not None:
                    copies = queue_leased(leases, m, self.loader, kv)
                if copies is not None:
                    usable, blocked = m, False
                else:
                    usable, blocked = (
                        (0, False) if kv is None else copy_leased(leases, m, self.loader, kv)
                    )
            counted = 0  # chunks from ``usable`` on a lease of this request counted
            if blocked and kv is not None:
                # the lookup's lease counted its local chunks as served: from the blocked one
                # on, those it holds are copied from it and the others read uncounted
                usable += copy_past_blocked(
                    client, keys[:m], tenant, self.loader, kv, 0, leases, usable
                )
                blocked = False  # stopped short, or at a chunk missing or on another node
            if kv is not None and usable < m and usable in leases.remote:
                pulled = pull_leased_counted(
                    client, keys[usable:m], tenant, self.loader, kv, usable
                )
                counted = pulled.counted - pulled.held  # from the chunk it stopped at on
                usable += pulled.held
                blocked = pulled.blocked
            if blocked and kv is not None:
                usable += read_socket(
                    client, keys[usable:m], tenant, self.loader, kv, usable, counted=counted
                )
        except AgentError as exc:
            if copies is not None:  # queued before the failure: they read the arena
                copies.abandon()
            if isinstance(exc, RequestError) and exc.code == ErrorCode.UNSUPPORTED:
                if local_only:  # an agent that predates LOOKUP_LEASE_LOCAL
                    self._no_local_lease = client
                    return self._lookup_leased(keys, tenant, overlap=overlap)
                self._no_lookup_lease = client  # a lookup, then a lease, from now on
                return None
            self._gave_up("lookup or fetch", exc)
            return 0, [], DynamicCache(), 0, "", time.perf_counter(), None
        except BaseException:
            if copies is not None:  # the caller never learns of them: they end here
                copies.abandon()
            raise
        cache = DynamicCache() if kv is None else self._cache_of(kv, usable)
        path = "lease" if usable else ""
        return m, list(found.locations), cache, usable, path, lookup_end_s, copies

    def _cache_of(self, kv: torch.Tensor, chunks: int) -> DynamicCache:
        """A cache holding the first ``chunks`` chunks of the loader's buffer ``kv``."""
        if not chunks:
            return DynamicCache()
        return _cache_holding(self.loader.layer_views(kv, chunks))

    def _fetch(self, keys: list[bytes], tenant: str) -> tuple[DynamicCache, int, str]:
        """The cache object holding the chunks' KV, how many leading chunks it holds, and the
        path they took ("lease" or "socket")."""
        cache = DynamicCache()
        client = self.client
        if not keys or client is None:
            return cache, 0, ""
        # reused between requests: the cache's first step concatenates onto new tensors, so
        # nothing refers to this buffer once prefill returns (checked after the forward pass)
        kv = self.loader.alloc(len(keys), reuse=True)
        try:
            usable, path = read_chunks(client, keys, tenant, self.loader, kv)
        except AgentError as exc:
            self._gave_up("fetch", exc)
            return cache, 0, ""
        return self._cache_of(kv, usable), usable, path

    def _store(
        self,
        cache: DynamicCache,
        keys: list[bytes],
        reused: int,
        locations: list[str | None],
        tenant: str,
    ) -> Future[Stored]:
        """Hand the prompt's full chunks the agent may not hold to the writer (or write them
        now, with ``write_behind`` off); the future says what was stored."""
        client = self.client
        report = self._take_report()
        # chunks the lookup saw cached are skipped; those past it are asked about by the writer
        todo = [i for i in range(reused, len(keys)) if i >= len(locations) or locations[i] is None]
        if not self.store:
            todo = []
        if client is None or client.closed or (not todo and report is None):
            done: Future[Stored] = Future()
            done.set_result(Stored(0, 0, 0.0))
            return done
        # the cache's tensors are replaced, not written, as it grows: holding them is enough
        ks = [layer.keys for layer in cache.layers]
        vs = [layer.values for layer in cache.layers]
        job = StoreJob(
            tenant=tenant,
            keys=keys,
            indices=todo,
            parents=parents_of(keys),
            chunk_tokens=self.chunk_tokens,
            chunk_bytes=self.format.chunk_bytes,
            pack=lambda i: self.format.pack(ks, vs, i).cpu().numpy(),
            # packed straight into the writer's staging segment (one copy, no chunk of its own),
            # a run of chunks in one kernel
            pack_into=lambda i, n, out: self.format.pack_into(ks, vs, i, host_tensor(out), n),
            report=report,
        )
        if self.device.type == "cuda":
            # packed on the writer's own stream once the forward pass that wrote them is done
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            if self._pack_stream is None:
                self._pack_stream = torch.cuda.Stream(self.device)
            stream = self._pack_stream
            pack = job.pack

            def on_stream(i: int) -> Any:
                with torch.cuda.stream(stream):
                    return pack(i)

            def into_on_stream(i: int, n: int, out: memoryview) -> None:
                # packed on the device (a batch's run: at most the writer's BATCH_BYTES), then
                # one copy into the staging segment: a DMA when it is registered
                # (``_staging_changed``); synchronous, so the bytes are there when the put is sent
                with torch.cuda.stream(stream):
                    host_tensor(out).copy_(self.format.pack(ks, vs, i, n))

            job.prepare = lambda: stream.wait_event(ready)
            job.pack = on_stream
            job.pack_into = into_on_stream
        if self._writer is None:
            # nothing the writer's thread holds between jobs may lead back to this engine (the
            # registrar does not): then an engine dropped unclosed is collected, and so closes it
            on_staging = self._staging if self.device.type == "cuda" else None
            self._writer = WriteBehind(client, on_staging=on_staging)
            self._writer_finalizer = weakref.finalize(
                self, WriteBehind.close_in_background, self._writer
            )
            self._writer_finalizer.atexit = False  # at exit the writers' own atexit closes it
        stored = self._writer.submit(job)
        if not self.write_behind:
            stored.result()
        return stored

    # --- what this engine measured, for the agent's fetch-or-recompute plan ---------------------
    def _measured(self, computed: int, cached: int, compute_s: float) -> None:
        """Keep a prefill sample (and, on a GPU, the rate the last copy from the arena crossed
        the link): the writer sends them with its next job, off the request path."""
        if self.client is None or not self.report_rates:
            return
        if computed > 0 and compute_s > 0:
            self._samples.append((computed, cached, compute_s))
            del self._samples[:-REPORT_SAMPLES]
        copied, self.loader.last_copy = self.loader.last_copy, None
        if self.device.type == "cuda" and copied and copied[0] >= MIN_RATE_BYTES and copied[1] > 0:
            self._h2d_bytes_per_s = copied[0] / copied[1]

    def _take_report(self) -> Callable[[DataClient], None] | None:
        samples, self._samples = self._samples, []
        h2d, self._h2d_bytes_per_s = self._h2d_bytes_per_s, None
        if not samples and h2d is None:
            return None
        model = self.model_id

        def send(client: DataClient) -> None:
            try:
                client.report_rates(samples, host_to_device_bytes_per_s=h2d, model=model)
            except RequestError as exc:  # an agent without the op: stop asking
                self.report_rates = False
                log.info("the agent takes no engine rates (%s); not reporting them", exc)

        return send

    def _kv(self, cache: DynamicCache) -> dict[str, DynamicCache]:
        """The cache argument under the name this transformers release takes (``cache`` from
        5.x; ``past_key_values`` before, deprecated after)."""
        return {self._cache_arg: cache}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _decoder_layers(model: PreTrainedModel, layers: int) -> Sequence[torch.nn.Module]:
    """The model's decoder layers in order (``model.model.layers``, as Llama, Mistral and Qwen
    have them), which ``layerwise`` hooks."""
    found = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(found, torch.nn.ModuleList) or len(found) != layers:
        raise InvalidArgument(
            f"layerwise copies need the model's {layers} decoder layers at model.model.layers; "
            f"this {type(model).__name__} has none there"
        )
    return list(found)


def _cache_holding(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    """A cache whose layers are these (keys, values) tensors as they are: its own update would
    copy them, and its first step past them makes new tensors, so they are never written."""
    cache = DynamicCache()
    make = getattr(cache, "layer_class_to_replicate", None) or DynamicLayer
    for k, v in layers:
        # what a layer holds after its first update, set directly: update's two allocations and
        # concatenations per layer took ~70 us a layer on a CPU, in every fetch's time
        layer = make()
        layer.device, layer.keys, layer.values, layer.is_initialized = k.device, k, v, True
        cache.layers.append(layer)
    return cache


def _cache_of(out: Any) -> DynamicCache:
    cache = getattr(out, "cache", None)
    return out.past_key_values if cache is None else cache
