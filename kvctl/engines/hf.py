"""Reference engine: a Hugging Face transformers causal LM that reuses KV through a kvctl agent.

Before prefill the adapter computes the request's chunk keys (namespace from the model config
and the agent's policy for the tenant), asks the agent for the longest cached prefix, reads those
chunks into the model's cache object layer by layer, prefills only the remaining tokens, and then
stores the new full chunks. At least one prompt token is always computed: the next token's
logits come from it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from kvctl.client import AgentError, DataClient
from kvctl.engines.kvformat import ChunkFormat, dtype_name
from kvctl.store.errors import InvalidArgument
from kvctl.store.keys import KVLayout, Namespace, keys_for, parents_of

log = logging.getLogger(__name__)


def layout_of(config: PretrainedConfig, dtype: torch.dtype) -> KVLayout:
    """The KV layout a Llama-architecture config writes: layers, kv heads, head dim, dtype."""
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return KVLayout(int(config.num_hidden_layers), int(kv_heads), int(head_dim), dtype_name(dtype))


def model_id_of(config: PretrainedConfig) -> str:
    name = getattr(config, "name_or_path", "") or ""
    if not name:
        raise InvalidArgument(
            "the model config has no name_or_path; pass model_id= (it must identify the weights: "
            "two models sharing an id would share KV)"
        )
    return str(name)


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
    stored_chunks: int
    fetched_bytes: int
    stored_bytes: int
    lookup_seconds: float
    fetch_seconds: float
    compute_seconds: float
    store_seconds: float
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens

    @property
    def ttft_seconds(self) -> float:
        """Lookup + fetch + prefill of the rest, up to the next token's logits. Storing the new
        chunks is not in it: an engine sends the token first. (``prefill`` itself returns after
        storing; ``store_seconds`` says how long that took.)"""
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
            "lookup_seconds": self.lookup_seconds,
            "fetch_seconds": self.fetch_seconds,
            "compute_seconds": self.compute_seconds,
            "store_seconds": self.store_seconds,
            "ttft_seconds": self.ttft_seconds,
            "next_token": self.next_token,
        }


class CachedLM:
    """A causal LM whose prefill reads and writes KV chunks through a kvctl agent.

    ``client`` is a data-plane connection (``DataClient.connect``); ``None`` runs plain full
    prefills (the baseline). Batch size 1: one request per call.

    ``chunked_prefill`` computes the prompt one chunk at a time. In floating point a chunk's KV
    depends, in its last bits, on how many tokens the prefill that produced it covered (the
    softmax and attention sums over masked rows group differently), so reuse after a one-pass
    prefill matches a one-pass full prefill closely but not bit for bit. Chunk-aligned steps
    make every chunk's KV a function of its prefix alone: reuse is then bit-exact.
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
    ) -> None:
        self.model = model
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
        #: host buffer chunks are read into, kept between requests (pinned for a GPU: pinning
        #: is slow, and a fresh buffer's first touch would be timed as fetch)
        self._staging: torch.Tensor | None = None

    @property
    def client(self) -> DataClient | None:
        return self._client

    @client.setter
    def client(self, client: DataClient | None) -> None:
        """A new connection (say, after the agent restarted); tenants' policies are asked anew."""
        self._client = client
        self._namespaces.clear()

    def namespace(self, tenant: str | None = None) -> Namespace:
        """Model id + KV layout + the tenant's salt (asked of the agent once per tenant)."""
        tenant = self.tenant if tenant is None else tenant
        ns = self._namespaces.get(tenant)
        if ns is None:
            client = self.client
            if client is None:
                ns = Namespace(self.model_id, self.layout)
            else:
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
        try:
            keys = self.chunk_keys(ids, tenant) if self.client is not None else []
        except AgentError as exc:  # the tenant's policy is asked of the agent on first use
            log.warning("kvctl agent unavailable, prefilling in full: %s", exc)
            keys = []
        # the last prompt token is always computed: its logits are the answer
        reusable = keys[: (len(ids) - 1) // self.chunk_tokens]

        t0 = time.perf_counter()
        matched, locations = self._lookup(reusable, tenant)
        tiers = [t for t in locations[:matched] if t is not None]
        t1 = time.perf_counter()
        cache, reused = self._fetch(reusable[:matched], tenant)
        tiers = tiers[:reused]
        self._sync()
        t2 = time.perf_counter()
        start = reused * self.chunk_tokens
        step = self.chunk_tokens if self.chunked_prefill else len(ids)
        for at in range(start, len(ids), step):
            part = torch.tensor([ids[at : at + step]], device=self.device)
            out = self.model(
                input_ids=part, past_key_values=cache, use_cache=True, logits_to_keep=1
            )
            cache = out.past_key_values
        logits = out.logits[0, -1].float().cpu()  # .cpu() waits for the device
        t3 = time.perf_counter()
        stored, stored_bytes = self._store(out.past_key_values, keys, reused, locations, tenant)
        t4 = time.perf_counter()
        return Prefill(
            logits=logits,
            next_token=int(logits.argmax()),
            cache=out.past_key_values,
            prompt_tokens=len(ids),
            reused_tokens=start,
            reused_chunks=reused,
            reused_tiers=list(tiers),
            stored_chunks=stored,
            fetched_bytes=reused * self.format.chunk_bytes,
            stored_bytes=stored_bytes,
            lookup_seconds=t1 - t0,
            fetch_seconds=t2 - t1,
            compute_seconds=t3 - t2,
            store_seconds=t4 - t3,
        )

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
            out = self.model(input_ids=step, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            new.append(int(out.logits[0, -1].argmax()))
        return new

    # --- steps ------------------------------------------------------------------------------
    def _lookup(self, keys: list[bytes], tenant: str) -> tuple[int, list[str | None]]:
        """Leading chunks cached, and the tier of every key looked up (None: not cached)."""
        if not keys or self.client is None:
            return 0, []
        try:
            found = self.client.lookup(keys, tenant=tenant)
        except AgentError as exc:
            log.warning("kvctl lookup failed, prefilling in full: %s", exc)
            return 0, []
        return found.matched_chunks, list(found.locations)

    def _fetch(self, keys: list[bytes], tenant: str) -> tuple[DynamicCache, int]:
        """The cache object holding the chunks' KV, and how many leading chunks it holds."""
        cache = DynamicCache()
        if not keys or self.client is None:
            return cache, 0
        size = self.format.chunk_bytes
        pinned = self.device.type == "cuda"
        host = self._staging
        if host is None or host.numel() < len(keys) * size:
            host = torch.empty(len(keys) * size, dtype=torch.uint8, pin_memory=pinned)
            self._staging = host
        flat = host.numpy()
        try:
            got = self.client.get_into(
                keys, [flat[i * size : (i + 1) * size] for i in range(len(keys))], tenant=tenant
            )
        except AgentError as exc:
            log.warning("kvctl fetch failed, prefilling in full: %s", exc)
            return cache, 0
        # use the leading run of whole chunks: a gap (evicted since the lookup) ends the prefix
        usable = 0
        for n in got:
            if n != size:
                if n >= 0:
                    log.warning("chunk of %d bytes where %d expected; not reused", n, size)
                break
            usable += 1
        if usable:
            data = host[: usable * size].to(self.device, non_blocking=pinned)
            staging = host.untyped_storage().data_ptr()
            for layer, (k, v) in enumerate(self.format.unpack(data, usable)):
                # the cache must own its tensors: the staging buffer serves the next request
                if k.untyped_storage().data_ptr() == staging:
                    k, v = k.clone(), v.clone()
                cache.update(k.contiguous(), v.contiguous(), layer)
        return cache, usable

    def _store(
        self,
        cache: DynamicCache,
        keys: list[bytes],
        reused: int,
        locations: list[str | None],
        tenant: str,
    ) -> tuple[int, int]:
        """Store the prompt's full chunks the agent does not hold yet."""
        client = self.client
        if not self.store or client is None or len(keys) <= reused:
            return 0, 0
        try:
            # the last chunk of a prompt that ends on a chunk boundary was not looked up
            rest = keys[len(locations) :]
            held = [*locations, *(client.exists(rest, tenant=tenant) if rest else [])]
            todo = [i for i in range(reused, len(keys)) if held[i] is None]
            if not todo:
                return 0, 0
            ks = [layer.keys for layer in cache.layers]
            vs = [layer.values for layer in cache.layers]
            parents = parents_of(keys)
            items = [(keys[i], self.format.pack(ks, vs, i).cpu().numpy()) for i in todo]
            outcomes = client.put_many(
                items, tenant=tenant, parents=[parents[i] for i in todo], tokens=self.chunk_tokens,
                depths=todo,
            )  # fmt: skip
        except AgentError as exc:
            log.warning("kvctl store failed; the next request will prefill again: %s", exc)
            return 0, 0
        stored = sum(o.status == "stored" for o in outcomes)
        return stored, stored * self.format.chunk_bytes

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
