"""A vLLM KV connector (v1 interface, ``KVConnectorBase_V1``) that uses a kvctl agent as its
store: a prompt whose prefix the agent holds skips that part of prefill, and every full prompt
chunk vLLM computes is stored for the next request, on this engine or another one.

NOT RUN AGAINST vLLM HERE: it needs a GPU machine with vLLM installed. It was written against
vLLM's v1 KV connector interface as it stands from vLLM 0.11 to the 2026 main branch (read for
it: the API docs of releases 0.9 to 0.32, and the main-branch sources
``kv_connector/v1/base.py`` at commit 003df296, ``kv_connector/factory.py`` at a4cd9d0d,
``v1/example_connector.py`` at 4c165421 and 00231834, ``v1/core/sched/output.py`` at
00e8f1fd). The engine-independent part (what to load and save: ``kvctl.engines.vllm_plan``;
the block <-> chunk copies: ``kvctl.engines.vllm_paged``) is tested on CPU tensors against a
real agent; this module only translates vLLM's objects into it.

Load it with ``--kv-transfer-config`` (vLLM imports ``kv_connector`` from
``kv_connector_module_path``)::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvctlConnector",
        "kv_connector_module_path": "kvctl.engines.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"agent": "unix:///var/lib/kvctl/agent.sock",
                                      "tenant": "acme"}}'

``kv_role``: ``kv_both`` loads and saves, ``kv_consumer`` only loads, ``kv_producer`` only saves.
``kv_connector_extra_config`` (all optional): ``agent`` (the data plane; default
127.0.0.1:7071, a ``unix://`` path reads through shared memory on the same host), ``tenant``
(default "default"), ``token`` (default $KVCTL_TOKEN), ``model_id`` (default vLLM's model name,
as the transformers adapter uses, so both share chunks), ``chunk_tokens`` (default the agent's;
a multiple of vLLM's ``--block-size``), ``retry_seconds``, ``timeout_seconds``,
``max_pending_save_bytes``, ``layerwise``. Unknown keys are refused.

Scope: one KV cache group (vLLM runs a connector without HMA support with its hybrid KV cache
manager off; pass ``--disable-hybrid-kv-cache-manager`` if a release asks for it), tensor and
pipeline parallel size 1, non-MLA attention with a bf16/fp16/fp32 cache in the
``[2, blocks, block_size, heads, dim]`` (FlashAttention before vLLM's 2026 layout refactor),
``[blocks, 2, block_size, heads, dim]`` (FlashInfer, Triton) or
``[blocks, heads, block_size, 2*dim]`` (after the refactor) per-layer layout; anything else is
refused at start-up with the reason. Requests with images, a LoRA adapter, a cache salt or
prompt embeddings are left alone (their KV is not a function of the token ids).

Behaviour: loads are synchronous in ``start_load_kv`` (all layers before the forward pass), or with
``layerwise`` (off by default; same host, shared memory) leased there and copied layer by layer:
each layer's blocks are written at ``wait_for_layer_load`` (on CUDA queued on the compute stream
after that layer's copies on a side stream, so the forward pass runs while later layers cross the
link), and the leases are checked and released after the forward pass (a lease that ran out reports
its blocks as failed loads, which vLLM recomputes, skipping that step's output); a step with a
chunk that cannot be read in place loads synchronously. Saves are gathered to host memory in
``wait_for_save`` and sent by a background thread. An unreachable agent means "nothing cached" and
skipped saves (logged, retried every ``retry_seconds``; a connection lost, as when the agent
restarts, is made again at the next call), never an engine error; so does a hung
one: each call has a deadline (``timeout_seconds``, 2 s by default, plus 4 s per GiB the call may
move), past which its connection is dropped, so a hung agent costs one step one call's deadline.
Blocks whose chunks vanished between the lookup and the read are reported through
``get_block_ids_with_load_errors`` so vLLM recomputes them (on a release that does not call it,
such blocks would be used unfilled); the chunks computed on top of them in that step are not
saved, and are saved once vLLM has recomputed them.
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kvctl.engines.identity import model_identity
from kvctl.engines.vllm_paged import kv_layout
from kvctl.engines.vllm_plan import (
    AgentLink,
    BackgroundSaver,
    ConnectorSettings,
    LoadSpec,
    SaveSpec,
    SchedulerPlan,
    StepPlan,
    WorkerPlan,
)
from kvctl.errors import InvalidArgument
from kvctl.store.keys import KVLayout

log = logging.getLogger("kvctl.engines.vllm")

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
    )

    _VLLM_MISSING: ImportError | None = None
except ImportError as exc:  # no vLLM: the module still imports; the connector cannot start
    _VLLM_MISSING = exc

    class KVConnectorBase_V1:  # type: ignore[no-redef]
        """Stand-in so this module imports without vLLM, with the little of the base class
        that the connector relies on (so its glue can be exercised without vLLM); the
        connector refuses to start while ``_VLLM_MISSING`` is set."""

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            self._vllm_config = vllm_config
            self._kv_transfer_config = vllm_config.kv_transfer_config
            self._role = role
            self._connector_metadata: Any = None

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            self._connector_metadata = connector_metadata

        def clear_connector_metadata(self) -> None:
            self._connector_metadata = None

    class KVConnectorMetadata:  # type: ignore[no-redef]
        """Stand-in so this module imports without vLLM."""

    class KVConnectorRole(enum.Enum):  # type: ignore[no-redef]
        SCHEDULER = 0
        WORKER = 1


@dataclass
class KvctlConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers: chunks to load before the forward pass, chunks to save
    after it."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# --- reading vLLM's scheduler output (duck-typed: the shapes changed across releases) -----------
def first_group(block_ids: Any) -> list[int] | None:
    """Block ids of the one KV cache group: vLLM passes one list per group
    (``tuple[list[int], ...]``); a flat list is taken as the one group. None when there is
    more than one group."""
    if block_ids is None:
        return None
    groups = list(block_ids)
    if groups and isinstance(groups[0], list | tuple):
        if len(groups) != 1:
            return None
        return [int(b) for b in groups[0]]
    return [int(b) for b in groups]


def cached_requests(cached: Any) -> Iterator[tuple[str, list[int] | None, bool, int]]:
    """(req id, new block ids, resumed after preemption, tokens computed before this step) of
    each running request in ``scheduler_output.scheduled_cached_reqs``: one object per request
    in vLLM 0.9, then one object of parallel lists (``resumed_from_preemption`` flags up to
    0.11.0, a ``resumed_req_ids`` set from 0.11.2)."""
    if isinstance(cached, list | tuple):
        for c in cached:
            blocks = first_group(c.new_block_ids)
            yield c.req_id, blocks, bool(c.resumed_from_preemption), int(c.num_computed_tokens)
        return
    resumed_ids = getattr(cached, "resumed_req_ids", None)
    if resumed_ids is None:
        flags = list(cached.resumed_from_preemption)
        resumed_ids = {r for r, flag in zip(cached.req_ids, flags, strict=True) if flag}
    for i, req_id in enumerate(cached.req_ids):
        resumed = req_id in resumed_ids
        yield (
            req_id,
            first_group(cached.new_block_ids[i]),
            resumed,
            int(cached.num_computed_tokens[i]),
        )


def not_reusable(request: Any) -> str | None:
    """Why a request's KV cannot be keyed by its prompt tokens alone, or None. Images, LoRA
    adapters, cache salts and prompt embeddings all change the KV of the same token ids, so
    such requests neither load nor save (sharing them would serve another input's KV)."""
    for name in ("mm_features", "mm_hashes", "mm_positions", "mm_inputs"):
        if getattr(request, name, None):
            return "multimodal inputs"
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    if getattr(request, "cache_salt", None):
        return "a cache salt"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    if not getattr(request, "prompt_token_ids", None):
        return "no prompt token ids"
    return None


def engine_layout(vllm_config: Any) -> KVLayout:
    """The kvctl KVLayout of the model vLLM serves, or a clear refusal."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if (
        getattr(parallel, "tensor_parallel_size", 1) != 1
        or getattr(parallel, "pipeline_parallel_size", 1) != 1
    ):
        raise InvalidArgument(
            "the kvctl connector supports tensor_parallel_size=1 and pipeline_parallel_size=1 "
            "only: a chunk holds every layer and head of a token, and a rank holds a slice"
        )
    if getattr(model, "use_mla", False):
        raise InvalidArgument("the kvctl connector does not support MLA models (no K/V heads)")
    return kv_layout(
        int(model.get_num_layers(parallel)),
        int(model.get_num_kv_heads(parallel)),
        int(model.get_head_size()),
        str(vllm_config.cache_config.cache_dtype),
        model.dtype,
    )


class KvctlConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by a kvctl agent (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if _VLLM_MISSING is not None:
            raise ImportError(
                "KvctlConnector runs inside vLLM, which is not installed here "
                f"({_VLLM_MISSING}); install vLLM on a GPU machine and load this connector "
                "with --kv-transfer-config"
            ) from _VLLM_MISSING
        # the base takes kv_cache_config since late 2025 (vLLM PR 27887; required later)
        if "kv_cache_config" in inspect.signature(KVConnectorBase_V1.__init__).parameters:
            super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        else:
            super().__init__(vllm_config, role)  # type: ignore[call-arg]
        transfer = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra(transfer.kv_connector_extra_config)
        layout = engine_layout(vllm_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        # the weights' identity too: a revision, or a local directory's weights fingerprint
        model_config = vllm_config.model_config
        revision = getattr(model_config, "revision", None)
        model_id = model_identity(str(model_config.model), revision=revision or None)

        def link() -> AgentLink:
            return AgentLink.from_settings(
                settings, model_id=model_id, layout=layout, block_size=self.block_size
            )

        self.link = link()
        # connect now, so a setting the agent cannot serve (chunk size, chunk bytes) stops
        # start-up with its reason; an agent that is merely down is retried later
        self.link.get()
        if self.link.disabled is not None:
            raise InvalidArgument(self.link.disabled)
        self._scheduler: SchedulerPlan | None = None
        self._worker: WorkerPlan | None = None
        self._saver: BackgroundSaver | None = None
        self._failed_blocks: set[int] = set()
        self._layerwise = settings.layerwise
        #: requests kept away from the agent (see not_reusable)
        self._skipped: set[str] = set()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerPlan(
                self.link,
                self.block_size,
                load=bool(transfer.is_kv_consumer),
                save=bool(transfer.is_kv_producer),
            )
        else:
            self._worker = WorkerPlan(self.link, self.block_size)
            if transfer.is_kv_producer:
                # its own connection: a load never waits behind a save
                self._saver = BackgroundSaver(self._worker, link(), settings.max_pending_save_bytes)
        log.info("kvctl connector (%s) for %s, tenant %r, agent %s", role, self.link.model_id,
                 settings.tenant, settings.agent)  # fmt: skip

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads write each layer at ``wait_for_layer_load``, which a full CUDA graph
        replay skips (vLLM then captures piecewise graphs around attention)."""
        return bool((extra_config or {}).get("layerwise") is True)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss, not a lost hand-off

    # --- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self._scheduler is not None
        reason = not_reusable(request)
        if reason is not None:
            if request.request_id not in self._skipped:
                log.debug("kvctl skips request %s: %s", request.request_id, reason)
            self._skipped.add(request.request_id)
            return 0, False
        try:
            tokens = self._scheduler.match(
                request.request_id, list(request.prompt_token_ids or ()), num_computed_tokens
            )
        except Exception:  # a lookup must never fail a request
            log.exception("kvctl lookup of request %s failed", request.request_id)
            tokens = 0
        return tokens, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        step = StepPlan()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._skipped or not_reusable(new) is not None:
                continue
            blocks = first_group(new.block_ids)
            if blocks is None:
                log.warning("kvctl skips request %s: more than one KV cache group", new.req_id)
                continue
            self._scheduler.scheduled_new(
                new.req_id, list(new.prompt_token_ids or ()), blocks,
                int(new.num_computed_tokens), int(scheduled.get(new.req_id, 0)), step,
            )  # fmt: skip
        for req_id, blocks, resumed, computed in cached_requests(
            scheduler_output.scheduled_cached_reqs
        ):
            self._scheduler.scheduled_again(
                req_id, blocks, resumed, computed, int(scheduled.get(req_id, 0)), step
            )
        return KvctlConnectorMetadata(step.loads, step.saves)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' report of the last step: blocks their loads could not fill mean the
        chunks from there on are not stored (the workers dropped those saves); they are saved
        when vLLM has recomputed them."""
        if self._scheduler is not None:
            self._scheduler.load_failed(getattr(connector_output, "invalid_block_ids", None) or ())

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.finished(request.request_id)
        self._skipped.discard(request.request_id)
        return False, None  # saves are taken as each chunk completes: free the blocks now

    # --- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        paged = self._worker.register(kv_caches)
        log.info("kvctl connector: %d layers, %s cache layout, block size %d (kernel %d)",
                 len(paged.layers), paged.cache_layout.value, self.block_size,
                 paged.kernel_block_size)  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._metadata()
        if meta is None or self._worker is None:
            return
        self._worker.failures.begin_step()
        self._finish_loads()  # a step that never reached wait_for_save or the error report
        if self._layerwise and meta.loads:
            try:
                if self._worker.queue_loads(meta.loads):
                    return  # each layer is written at wait_for_layer_load, checked after
            except Exception:  # loaded as below instead
                log.exception("kvctl could not queue this step's loads layer by layer")
        for spec in meta.loads:
            try:
                outcome = self._worker.load(spec)
                failed = set(outcome.failed_block_ids)
            except Exception:  # an unreadable chunk means recompute, not a dead engine
                log.exception("kvctl load of request %s failed", spec.req_id)
                failed = spec.blocks_of(spec.start_token, spec.end_token, self.block_size)
            self._load_failed(spec, failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # layer-wise: this layer's blocks are written now (on CUDA queued after its copies);
        # otherwise start_load_kv has written every layer before the forward pass
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # wait_for_save reads all layers at once from the registered caches

    def wait_for_save(self) -> None:
        self._finish_loads()  # a failed load's blocks are known before the saves are sorted
        meta = self._metadata()
        if meta is None or self._worker is None or self._saver is None:
            return
        for spec in self._worker.failures.sound(meta.saves):
            try:
                self._saver.submit(spec, self._worker.gather(spec))
            except Exception:
                log.exception("kvctl save of request %s failed", spec.req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_finished(
        self, finished_req_ids: set[str], *args: Any, **kwargs: Any
    ) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is not None:
            self._worker.failures.finished(finished_req_ids or ())
        return None, None  # loads are synchronous and saves never hold blocks

    def shutdown(self) -> None:
        self._finish_loads()
        if self._saver is not None:
            self._saver.drain()
            self._saver.close()
            self._saver = None
        if self._worker is not None:
            self._worker.close()  # its loaders' mapping of the arena too, not only the link
        self.link.close()

    def _finish_loads(self) -> None:
        """The step's layer-wise loads checked and their leases released, once the forward
        pass is over; blocks they could not fill are reported as a synchronous load's are."""
        if self._worker is None:
            return
        for spec, outcome in self._worker.finish_loads():
            self._load_failed(spec, set(outcome.failed_block_ids))

    def _load_failed(self, spec: LoadSpec, blocks: set[int]) -> None:
        """``spec``'s load left ``blocks`` unfilled: vLLM hears of them after the step, and this
        step's forward pass computes on them, so its saves of the request from there on are
        dropped (wait_for_save)."""
        assert self._worker is not None
        self._failed_blocks |= blocks
        self._worker.failures.failed(spec, blocks)

    def _metadata(self) -> KvctlConnectorMetadata | None:
        meta = getattr(self, "_connector_metadata", None)
        return meta if isinstance(meta, KvctlConnectorMetadata) else None
