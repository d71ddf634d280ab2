"""The vLLM connector's engine-independent logic on CPU tensors: paged-block <-> chunk copies in
vLLM's cache layouts, the scheduling arithmetic (whole chunks, the last-token rule, block
alignment), the connector's settings and its reading of vLLM's scheduler output. vLLM itself is
not installed here; the agent, where one is needed, is one that is down (a closed port)."""

from __future__ import annotations

import logging
import pickle
from types import SimpleNamespace

import pytest
import torch

from kvctl.engines import vllm_connector
from kvctl.engines.kvformat import ChunkFormat
from kvctl.engines.kvload import KVLoader
from kvctl.engines.vllm_connector import (
    KvctlConnectorMetadata,
    cached_requests,
    first_group,
    not_reusable,
)
from kvctl.engines.vllm_paged import (
    CacheLayout,
    PagedKV,
    check_geometry,
    detect_layout,
    kv_layout,
    loadable_chunks,
    order_layers,
    token_slots,
)
from kvctl.engines.vllm_plan import (
    AgentLink,
    BackgroundSaver,
    ConnectorSettings,
    LoadFailures,
    LoadSpec,
    SaveSpec,
    SchedulerPlan,
    StepPlan,
    WorkerPlan,
)
from kvctl.errors import InvalidArgument
from kvctl.ports import free_loopback_port
from kvctl.store.keys import KVLayout, Namespace, keys_for

BLOCK = 16
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def make_caches(
    cache_layout: CacheLayout, lay: KVLayout, blocks: int, block_size: int = BLOCK
) -> list[torch.Tensor]:
    """Per-layer paged caches in ``cache_layout``, filled with a sentinel (-7)."""
    dtype = ChunkFormat(lay, 1).dtype
    h, d = lay.kv_heads, lay.head_dim
    shape = {
        CacheLayout.KV_FIRST: (2, blocks, block_size, h, d),
        CacheLayout.BLOCKS_FIRST: (blocks, 2, block_size, h, d),
        CacheLayout.PACKED: (blocks, h, block_size, 2 * d),
    }[cache_layout]
    return [torch.full(shape, -7.0, dtype=dtype) for _ in range(lay.layers)]


def random_kv(lay: KVLayout, tokens: int, seed: int = 0) -> torch.Tensor:
    """Contiguous KV of ``tokens`` tokens: ``[layers, 2, kv_heads, tokens, head_dim]``."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(lay.layers, 2, lay.kv_heads, tokens, lay.head_dim, generator=g)
    return kv.to(ChunkFormat(lay, 1).dtype)


# --- geometry and the last-token rule ------------------------------------------------------
def test_chunks_must_be_whole_blocks() -> None:
    check_geometry(256, 16)
    check_geometry(32, 32)
    for chunk, block in ((24, 16), (8, 16), (0, 16), (256, 0)):
        with pytest.raises(InvalidArgument, match="block_size"):
            check_geometry(chunk, block)


@pytest.mark.parametrize(
    ("prompt", "chunks"), [(0, 0), (1, 0), (32, 0), (33, 1), (64, 1), (65, 2), (100, 3)]
)
def test_the_last_prompt_token_is_never_loadable(prompt: int, chunks: int) -> None:
    assert loadable_chunks(prompt, 32) == chunks


def test_kv_layout_follows_vllms_cache_dtype_and_refuses_fp8() -> None:
    assert kv_layout(32, 8, 128, "auto", torch.bfloat16) == KVLayout(32, 8, 128, "bfloat16")
    assert kv_layout(2, 1, 64, "half", torch.float32).dtype == "float16"
    for quantized in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        with pytest.raises(InvalidArgument, match="fp8"):
            kv_layout(32, 8, 128, quantized, torch.bfloat16)


def test_layers_are_put_in_model_order() -> None:
    names = [f"model.layers.{i}.self_attn.attn" for i in (2, 0, 10, 1, 3, 4, 5, 6, 7, 8, 9)]
    assert order_layers(names) == [f"model.layers.{i}.self_attn.attn" for i in range(11)]
    with pytest.raises(InvalidArgument, match="layer number"):
        order_layers(["model.layers.0.attn", "mtp.3.layers.1.attn"])
    with pytest.raises(InvalidArgument, match="numbered"):
        order_layers(["model.layers.0.attn", "model.layers.2.attn"])


# --- layouts ---------------------------------------------------------------------------------
def test_layouts_are_told_apart_by_shape() -> None:
    assert detect_layout((2, 100, 16, 8, 128), 8, 128) == (CacheLayout.KV_FIRST, 16)
    assert detect_layout((100, 2, 16, 8, 128), 8, 128) == (CacheLayout.BLOCKS_FIRST, 16)
    assert detect_layout((100, 8, 32, 256), 8, 128) == (CacheLayout.PACKED, 32)


def test_mla_ambiguous_and_foreign_layouts_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="MLA"):
        detect_layout((100, 16, 576), 1, 576)  # one latent per token
    with pytest.raises(InvalidArgument, match="MLA"):
        detect_layout((100, 1, 16, 576), 1, 512)
    with pytest.raises(InvalidArgument, match="cannot tell"):
        detect_layout((2, 2, 16, 8, 128), 8, 128)  # two blocks: K/V-first or blocks-first
    with pytest.raises(InvalidArgument, match="unsupported KV cache shape"):
        detect_layout((2, 100, 16, 4, 128), 8, 128)  # a tensor-parallel slice of the heads


def test_token_slots_map_scheduler_blocks_onto_kernel_blocks() -> None:
    blk, off = token_slots([5, 2], 0, 64, 32, 32)
    assert blk.tolist() == [5] * 32 + [2] * 32 and off.tolist() == list(range(32)) * 2
    # kernel pages of 16 under scheduler blocks of 32: block b is kernel blocks 2b and 2b+1
    blk, off = token_slots([5, 2], 10, 50, 32, 16)
    assert blk.tolist() == [10] * 6 + [11] * 16 + [4] * 16 + [5] * 2
    assert off.tolist() == [*range(10, 16), *range(16), *range(16), 0, 1]
    with pytest.raises(InvalidArgument, match="blocks"):
        token_slots([5, 2], 0, 65, 32, 32)
    with pytest.raises(InvalidArgument, match="does not divide"):
        token_slots([5], 0, 8, 32, 12)


# --- gather / scatter --------------------------------------------------------------------------
@pytest.mark.parametrize("cache_layout", list(CacheLayout))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(2, 8), (1, 16), (4, 4)])
def test_scatter_then_gather_round_trips_exactly(
    cache_layout: CacheLayout, dtype: torch.dtype, kv_heads: int, head_dim: int
) -> None:
    lay = KVLayout(3, kv_heads, head_dim, NAMES[dtype])
    paged = PagedKV(make_caches(cache_layout, lay, blocks=20), lay, BLOCK)
    assert paged.cache_layout is cache_layout
    block_ids = [13, 2, 7, 19, 0]  # scattered, out of order
    kv = random_kv(lay, 5 * BLOCK)
    paged.scatter(block_ids, 0, kv)
    assert torch.equal(paged.gather(block_ids, 0, 5 * BLOCK), kv)
    # a sub-range is the same slice, and blocks the request does not own are untouched
    assert torch.equal(paged.gather(block_ids, 20, 50), kv[:, :, :, 20:50])
    others = [b for b in range(20) if b not in block_ids]
    assert torch.equal(
        paged.gather(others, 0, len(others) * BLOCK),
        torch.full((3, 2, kv_heads, len(others) * BLOCK, head_dim), -7.0, dtype=dtype),
    )


@pytest.mark.parametrize("cache_layout", list(CacheLayout))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_gathered_chunk_is_byte_identical_to_chunkformat_pack(
    cache_layout: CacheLayout, dtype: torch.dtype
) -> None:
    """The connector's chunk bytes are the transformers adapter's: ``ChunkFormat.pack`` of the
    same KV laid out contiguously (``[1, kv_heads, tokens, head_dim]`` per layer)."""
    lay = KVLayout(4, 2, 8, NAMES[dtype])  # GQA: 2 kv heads
    fmt = ChunkFormat(lay, 32)
    paged = PagedKV(make_caches(cache_layout, lay, blocks=12), lay, BLOCK)
    block_ids = [3, 9, 0, 11, 5, 6]  # 96 tokens = 3 chunks of 32
    kv = random_kv(lay, 96, seed=3)
    paged.scatter(block_ids, 0, kv)
    ks = [kv[i, 0].unsqueeze(0) for i in range(lay.layers)]
    vs = [kv[i, 1].unsqueeze(0) for i in range(lay.layers)]
    rows = paged.gather_chunks(block_ids, 0, 3, 32)
    assert rows.shape == (3, fmt.chunk_bytes) and rows.dtype == torch.uint8
    for chunk in range(3):
        assert torch.equal(rows[chunk], fmt.pack(ks, vs, chunk)), f"chunk {chunk}"
    # from chunk 1 on: the rows start at chunk 1
    assert torch.equal(paged.gather_chunks(block_ids, 1, 2, 32)[1], fmt.pack(ks, vs, 2))


def test_every_layout_yields_the_same_chunk_bytes() -> None:
    lay = KVLayout(2, 2, 8, "bfloat16")
    kv = random_kv(lay, 64, seed=5)
    chunks = []
    for cache_layout in CacheLayout:
        paged = PagedKV(make_caches(cache_layout, lay, blocks=6), lay, BLOCK)
        paged.scatter([4, 1, 5, 2], 0, kv)
        chunks.append(paged.gather_chunks([4, 1, 5, 2], 0, 2, 32))
    assert all(torch.equal(chunks[0], c) for c in chunks[1:])


@pytest.mark.parametrize("cache_layout", list(CacheLayout))
def test_chunk_bytes_scatter_into_fresh_blocks_only_in_range(cache_layout: CacheLayout) -> None:
    lay = KVLayout(3, 2, 8, "bfloat16")
    fmt = ChunkFormat(lay, 32)
    kv = random_kv(lay, 96, seed=7)
    ks = [kv[i, 0].unsqueeze(0) for i in range(3)]
    vs = [kv[i, 1].unsqueeze(0) for i in range(3)]
    data = torch.cat([fmt.pack(ks, vs, c) for c in (1, 2)])  # chunks 1 and 2, back to back
    loader = KVLoader(fmt, torch.device("cpu"))
    loaded = loader.alloc(2)
    loader.load(data, [0, fmt.chunk_bytes], loaded)
    paged = PagedKV(make_caches(cache_layout, lay, blocks=8), lay, BLOCK)
    block_ids = [7, 0, 3, 5, 6, 1]
    # vLLM holds tokens 0..48 locally: write 48..96 only
    paged.scatter_loaded(block_ids, loaded, 32, 1, 48, 96)
    assert torch.equal(paged.gather(block_ids, 48, 96), kv[:, :, :, 48:96])
    untouched = paged.gather(block_ids, 0, 48)
    assert torch.equal(untouched, torch.full_like(untouched, -7.0))
    with pytest.raises(InvalidArgument, match="not within chunks"):
        paged.scatter_loaded(block_ids, loaded, 32, 1, 16, 96)


def test_strided_hnd_storage_and_kernel_block_splitting() -> None:
    """FlashAttention's HND option permutes strides under the same logical shape; vLLM may
    page in kernel blocks smaller than its scheduler blocks."""
    lay = KVLayout(2, 2, 8, "float16")
    # physical [2, blocks, heads, 16, dim] seen as logical [2, blocks, 16, heads, dim]
    layers = [
        torch.full((2, 12, 2, 16, 8), -7.0, dtype=torch.float16).permute(0, 1, 3, 2, 4)
        for _ in range(2)
    ]
    paged = PagedKV(layers, lay, 32)  # scheduler blocks of 32 tokens = 2 kernel blocks
    assert (paged.kernel_block_size, paged.num_blocks) == (16, 6)
    kv = random_kv(lay, 64, seed=9)
    paged.scatter([4, 1], 0, kv)
    assert torch.equal(paged.gather([4, 1], 0, 64), kv)
    # token 40 is scheduler block 1 (the request's second), kernel block 2*1 + 0, offset 8
    assert torch.equal(layers[0][0, 2, 8], kv[0, 0, :, 40])
    with pytest.raises(InvalidArgument, match="block ids"):
        paged.gather([6], 0, 32)


def test_paged_caches_must_match_the_model() -> None:
    lay = KVLayout(3, 2, 8, "bfloat16")
    caches = make_caches(CacheLayout.KV_FIRST, lay, blocks=4)
    with pytest.raises(InvalidArgument, match="3 layers"):
        PagedKV(caches[:2], lay, BLOCK)
    with pytest.raises(InvalidArgument, match="layer 1"):
        PagedKV([caches[0], caches[1].float(), caches[2]], lay, BLOCK)
    paged = PagedKV(caches, lay, BLOCK)
    with pytest.raises(InvalidArgument, match="expected KV shaped"):
        paged.scatter([0], 0, torch.zeros(3, 2, 4, 16, 8, dtype=torch.bfloat16))


# --- scheduler side ------------------------------------------------------------------------
def closed_port() -> int:
    return free_loopback_port()


def down_link(lay: KVLayout, chunk_tokens: int = 32) -> AgentLink:
    """A link whose agent is down, with the namespace it would have had (keys still work)."""
    link = AgentLink(
        f"127.0.0.1:{closed_port()}", tenant="t", model_id="m", layout=lay,
        chunk_tokens=chunk_tokens, block_size=BLOCK, retry_seconds=60.0, timeout_seconds=1.0,
    )  # fmt: skip
    link.namespace = Namespace("m", lay)
    return link


def test_an_unreachable_agent_offers_nothing_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lay = KVLayout(2, 2, 8, "bfloat16")
    plan = SchedulerPlan(down_link(lay), BLOCK)
    with caplog.at_level(logging.WARNING, logger="kvctl.engines.vllm"):
        assert plan.match("r1", list(range(200)), 0) == 0
        assert plan.match("r2", list(range(300)), 16) == 0
    assert sum("unreachable" in r.message for r in caplog.records) == 1


def test_save_specs_follow_chunked_prefill_and_skip_partial_chunks() -> None:
    lay = KVLayout(2, 2, 8, "bfloat16")
    link = down_link(lay)
    plan = SchedulerPlan(link, BLOCK)
    prompt = list(range(1000, 1100))  # 100 tokens: 3 full chunks of 32 and a partial one
    keys = keys_for(prompt, link.namespace, 32)  # type: ignore[arg-type]
    step = StepPlan()
    plan.scheduled_new("r", prompt, [9, 8, 7], 0, 40, step)  # chunked prefill: 40 tokens
    assert step.loads == [] and len(step.saves) == 1
    first = step.saves[0]
    assert (first.keys, first.first_chunk, first.parent) == ((keys[0],), 0, None)
    assert first.block_ids == (9, 8) and first.parents == [None]
    step = StepPlan()
    plan.scheduled_again("r", [6, 5, 4, 3], False, 40, 60, step)  # the rest of the prompt
    (rest,) = step.saves
    assert rest.keys == (keys[1], keys[2]) and rest.first_chunk == 1 and rest.parent == keys[0]
    assert rest.parents == [keys[0], keys[1]] and rest.tokens == 64
    assert rest.block_ids == (9, 8, 7, 6, 5, 4)
    step = StepPlan()
    plan.scheduled_again("r", [2], False, 100, 1, step)  # decoding: the 4th chunk is never full
    assert step.saves == []
    plan.finished("r")
    assert plan.tracked_requests == 0


def test_a_resumed_request_replaces_its_blocks_and_does_not_save_twice() -> None:
    lay = KVLayout(2, 2, 8, "bfloat16")
    plan = SchedulerPlan(down_link(lay), BLOCK)
    prompt = list(range(64))
    step = StepPlan()
    plan.scheduled_new("r", prompt, [1, 2], 0, 32, step)
    assert [s.first_chunk for s in step.saves] == [0]
    step = StepPlan()
    plan.scheduled_again("r", [10, 11, 12, 13], True, 0, 64, step)  # preempted, recomputed
    (save,) = step.saves
    assert save.first_chunk == 1 and save.block_ids == (10, 11, 12, 13)


def test_producer_off_means_no_saves_and_consumer_off_means_no_loads() -> None:
    lay = KVLayout(2, 2, 8, "bfloat16")
    plan = SchedulerPlan(down_link(lay), BLOCK, save=False)
    step = StepPlan()
    plan.scheduled_new("r", list(range(64)), [1, 2, 3, 4], 0, 64, step)
    assert step.saves == [] and step.loads == []
    consumer_off = SchedulerPlan(down_link(lay), BLOCK, load=False)
    assert consumer_off.match("r", list(range(640)), 0) == 0


def test_chunks_are_saved_again_once_vllm_recomputes_after_a_failed_load() -> None:
    lay = KVLayout(2, 2, 8, "bfloat16")
    link = down_link(lay)
    plan = SchedulerPlan(link, BLOCK)
    prompt = list(range(2000, 2160))  # 5 full chunks
    blocks = list(range(10, 20))
    step = StepPlan()
    plan.scheduled_new("r", prompt, blocks, 0, 160, step)
    assert [(s.first_chunk, len(s.keys)) for s in step.saves] == [(0, 5)]
    # the worker reports block 13 (tokens 48..64, chunk 1) unfilled; another request's
    # blocks are not touched, nor is anything by blocks no request holds
    step = StepPlan()
    plan.scheduled_new("other", prompt, list(range(20, 30)), 0, 160, step)
    plan.load_failed({13})
    plan.load_failed({99})
    plan.load_failed(())
    # vLLM recomputes from the unfilled block: chunks 1..4 are saved again
    step = StepPlan()
    plan.scheduled_again("r", None, False, 48, 112, step)
    assert [(s.first_chunk, len(s.keys), s.parent) for s in step.saves] == [
        (1, 4, keys_for(prompt, link.namespace, 32)[0])  # type: ignore[arg-type]
    ]
    step = StepPlan()
    plan.scheduled_again("other", None, False, 160, 1, step)
    assert step.saves == []

    # a release that does not report to the scheduler side: vLLM taking tokens back is enough
    step = StepPlan()
    plan.scheduled_new("q", prompt, blocks, 0, 160, step)
    step = StepPlan()
    plan.scheduled_again("q", None, False, 64, 96, step)
    assert [s.first_chunk for s in step.saves] == [2]
    # tokens taken back past the prompt (rejected speculative tokens) re-save nothing
    step = StepPlan()
    plan.scheduled_again("q", [30], False, 160, 4, step)
    plan.scheduled_again("q", None, False, 162, 1, step)
    assert step.saves == []


def test_saves_computed_on_unfilled_blocks_are_dropped_until_replanned() -> None:
    keys = [bytes([i]) * 16 for i in range(8)]
    blocks = tuple(range(1, 17))
    failures = LoadFailures(BLOCK)
    failures.begin_step()
    # request a: chunk 0 arrived, chunks 1..2 (blocks 3..6) did not
    failures.failed(LoadSpec("a", tuple(keys[:3]), 0, 0, 96, blocks[:6], 32), {3, 4, 5, 6})
    failures.failed(LoadSpec("c", (keys[0],), 0, 0, 32, (40, 41), 32), set())
    save_a = SaveSpec("a", tuple(keys[3:5]), 3, keys[2], blocks[:10], 32)
    # b shares block 3 (vLLM's prefix cache, same step) as its 3rd block: chunk 0 is sound
    save_b = SaveSpec("b", tuple(keys[:3]), 0, None, (30, 31, 3, 4, 32, 33), 32)
    save_c = SaveSpec("c", tuple(keys[:1]), 0, None, (40, 41), 32)
    assert failures.sound([save_a, save_b, save_c]) == [
        SaveSpec("b", (keys[0],), 0, None, save_b.block_ids, 32),
        save_c,
    ]
    assert failures.dropped_chunks == 4 and failures.poisoned_requests == 2
    # the next step was planned before the failure was known (async scheduling): dropped
    failures.begin_step()
    assert failures.sound([SaveSpec("a", (keys[5],), 5, keys[4], blocks[:12], 32)]) == []
    # re-planned from the failed chunk (vLLM has recomputed it): saved, and a is clear
    failures.begin_step()
    again = SaveSpec("a", tuple(keys[1:6]), 1, keys[0], blocks[:12], 32)
    assert failures.sound([again]) == [again]
    later = SaveSpec("a", (keys[6],), 6, keys[5], blocks[:14], 32)
    assert failures.sound([later]) == [later]
    assert failures.poisoned_requests == 1
    failures.finished({"b", "unknown"})
    assert failures.poisoned_requests == 0
    # a cut that keeps everything keeps the spec itself
    assert save_a.before(5 * 32) is save_a and save_a.before(3 * 32 + 31) is None


def test_load_spec_blocks() -> None:
    spec = LoadSpec("r", (b"k" * 16,), 1, 48, 64, (5, 6, 7, 8), 32)
    assert spec.blocks_of(48, 64, BLOCK) == {8}
    assert spec.blocks_of(40, 64, BLOCK) == {7, 8}
    assert spec.blocks_of(64, 64, BLOCK) == set()


# --- worker side with the agent down ---------------------------------------------------------
def test_a_load_without_the_agent_reports_every_block_failed_and_writes_nothing() -> None:
    lay = KVLayout(2, 2, 8, "bfloat16")
    worker = WorkerPlan(down_link(lay), BLOCK)
    caches = make_caches(CacheLayout.KV_FIRST, lay, blocks=8)
    worker.register({f"model.layers.{i}.self_attn.attn": c for i, c in enumerate(caches)})
    spec = LoadSpec("r", (b"a" * 16, b"b" * 16), 0, 16, 64, (3, 4, 5, 6), 32)
    out = worker.load(spec)
    assert (out.loaded_tokens, out.fetched_bytes) == (0, 0)
    assert out.failed_block_ids == {4, 5, 6}
    assert all(torch.equal(c, torch.full_like(c, -7.0)) for c in caches)
    save = SaveSpec("r", (b"a" * 16,), 0, None, (3, 4), 32)
    assert worker.save(save) == 0


def test_the_background_saver_drops_what_does_not_fit() -> None:
    lay = KVLayout(2, 2, 8, "bfloat16")
    worker = WorkerPlan(down_link(lay), BLOCK)
    worker.register(
        {f"l.{i}": c for i, c in enumerate(make_caches(CacheLayout.KV_FIRST, lay, blocks=4))}
    )
    spec = SaveSpec("r", (b"a" * 16,), 0, None, (0, 1), 32)
    host = worker.gather(spec)
    assert host.shape == (1, ChunkFormat(lay, 32).chunk_bytes)
    saver = BackgroundSaver(worker, max_pending_bytes=host.numel() + 1)
    try:
        assert saver.submit(spec, host)
        saver.drain()
        assert saver.pending_bytes == 0 and saver.stored_chunks == 0  # the agent is down
        big = torch.zeros(2, host.shape[1], dtype=torch.uint8)
        assert not saver.submit(
            SaveSpec("r", (b"a" * 16, b"b" * 16), 0, None, (0, 1, 2, 3), 32), big
        )
        assert saver.dropped_chunks == 2
    finally:
        saver.close()


# --- connector settings and vLLM's objects ------------------------------------------------------
def test_settings_come_from_kv_connector_extra_config() -> None:
    assert ConnectorSettings.from_extra(None) == ConnectorSettings()
    s = ConnectorSettings.from_extra(
        {"agent": "unix:///run/kvctl/agent.sock", "tenant": "acme", "chunk_tokens": 64}
    )
    assert (s.agent, s.tenant, s.chunk_tokens, s.model_id) == (
        "unix:///run/kvctl/agent.sock", "acme", 64, None,
    )  # fmt: skip
    with pytest.raises(InvalidArgument, match="unknown kvctl connector setting"):
        ConnectorSettings.from_extra({"agnet": "x"})
    with pytest.raises(InvalidArgument, match="tenant"):
        ConnectorSettings.from_extra({"tenant": ""})
    with pytest.raises(InvalidArgument, match="chunk_tokens"):
        ConnectorSettings.from_extra({"chunk_tokens": -1})
    with pytest.raises(InvalidArgument, match="retry_seconds"):
        ConnectorSettings.from_extra({"retry_seconds": 0})
    with pytest.raises(InvalidArgument, match="HOST:PORT"):
        ConnectorSettings.from_extra({"agent": "localhost"})
    with pytest.raises(InvalidArgument, match="chunk_tokens"):
        ConnectorSettings.from_extra({"chunk_tokens": True})
    assert not ConnectorSettings().layerwise
    assert ConnectorSettings.from_extra({"layerwise": True}).layerwise
    with pytest.raises(InvalidArgument, match="layerwise must be true or false"):
        ConnectorSettings.from_extra({"layerwise": "yes"})
    link = AgentLink.from_settings(
        ConnectorSettings.from_extra({"tenant": "acme", "chunk_tokens": 64, "model_id": "x"}),
        model_id="vllm-name", layout=KVLayout(2, 2, 8), block_size=16,
    )  # fmt: skip
    assert (link.tenant, link.model_id, link.chunk_tokens) == ("acme", "x", 64)
    with pytest.raises(InvalidArgument, match="multiple"):
        AgentLink.from_settings(
            ConnectorSettings(chunk_tokens=40), model_id="m", layout=KVLayout(2, 2, 8),
            block_size=16,
        )  # fmt: skip


def test_requests_whose_kv_is_not_a_function_of_their_tokens_are_left_alone() -> None:
    plain = {"prompt_token_ids": [1, 2, 3], "mm_features": [], "lora_request": None,
             "cache_salt": None, "prompt_embeds": None}  # fmt: skip
    assert not_reusable(SimpleNamespace(**plain)) is None
    cases = {
        "multimodal": {"mm_features": ["image"]},
        "LoRA": {"lora_request": object()},
        "salt": {"cache_salt": "s"},
        "embeddings": {"prompt_embeds": torch.zeros(3, 4)},
        "token ids": {"prompt_token_ids": None},
    }
    for word, change in cases.items():
        reason = not_reusable(SimpleNamespace(**{**plain, **change}))
        assert reason is not None and word in reason, (word, reason)
    assert not_reusable(SimpleNamespace(prompt_token_ids=[1], mm_hashes=["h"])) is not None


def test_the_connector_module_imports_without_vllm_and_says_what_it_needs() -> None:
    if vllm_connector._VLLM_MISSING is None:
        pytest.skip("vLLM is installed here")
    assert vllm_connector.KvctlConnector.__name__ == "KvctlConnector"
    with pytest.raises(ImportError, match="vLLM"):
        vllm_connector.KvctlConnector(None, vllm_connector.KVConnectorRole.WORKER)


def test_block_ids_of_one_group_in_either_shape() -> None:
    assert first_group(([4, 5, 6],)) == [4, 5, 6]
    assert first_group([4, 5]) == [4, 5]  # before per-group lists
    assert first_group(([1], [2])) is None  # two groups: not supported
    assert first_group(None) is None


def test_cached_requests_in_each_release_shape() -> None:
    want = [("a", [7], False, 32), ("b", [1, 2], True, 0)]
    v09 = [
        SimpleNamespace(req_id="a", new_block_ids=[[7]], resumed_from_preemption=False,
                        num_computed_tokens=32),
        SimpleNamespace(req_id="b", new_block_ids=[[1, 2]], resumed_from_preemption=True,
                        num_computed_tokens=0),
    ]  # fmt: skip
    v011 = SimpleNamespace(
        req_ids=["a", "b"], resumed_from_preemption=[False, True],
        new_block_ids=[([7],), ([1, 2],)], num_computed_tokens=[32, 0],
    )  # fmt: skip
    v018 = SimpleNamespace(
        req_ids=["a", "b"], resumed_req_ids={"b"}, new_block_ids=[([7],), ([1, 2],)],
        num_computed_tokens=[32, 0],
    )  # fmt: skip
    for shape in (v09, v011, v018):
        assert list(cached_requests(shape)) == want
    none_new = SimpleNamespace(
        req_ids=["a"], resumed_req_ids=set(), new_block_ids=[None], num_computed_tokens=[5]
    )
    assert list(cached_requests(none_new)) == [("a", None, False, 5)]


def test_metadata_survives_pickling_to_the_workers() -> None:
    meta = KvctlConnectorMetadata(
        [LoadSpec("r", (b"k" * 16,), 0, 0, 32, (1, 2), 32)],
        [SaveSpec("s", (b"a" * 16, b"b" * 16), 2, b"p" * 16, (1, 2, 3, 4, 5, 6, 7, 8), 32)],
    )
    again = pickle.loads(pickle.dumps(meta))
    assert again.loads == meta.loads and again.saves == meta.saves
