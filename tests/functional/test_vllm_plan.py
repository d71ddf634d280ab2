"""The vLLM connector's plan against a real agent: one "engine" saves a prompt's chunks from its
paged blocks, another finds them through the scheduler-side lookup and its worker scatters
exactly those bytes into fresh blocks. vLLM is not involved (it needs a GPU machine); what the
connector adds on top of this is the translation of vLLM's objects."""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvctl.client import AgentTimeout, AgentUnreachable, NoRoom
from kvctl.engines import vllm_connector
from kvctl.engines.kvformat import ChunkFormat
from kvctl.engines.vllm_paged import (
    CacheLayout,
    PagedKV,
)
from kvctl.engines.vllm_plan import (
    AgentLink,
    ConnectorSettings,
    LoadSpec,
    SchedulerPlan,
    StepPlan,
    WorkerPlan,
)
from kvctl.store.keys import KVLayout, keys_for, parents_of
from kvctl.wire.protocol import ErrorCode
from tests.functional.agents import Agent, closed_port, running_agent, start_agent
from tests.functional.hung import guarded, stopped
from tests.functional.waiting import wait_until

CHUNK = 32
BLOCK = 16
LAYOUT_DIMS = (3, 2, 8)  # layers, kv heads (GQA), head dim
MODEL = "test/llama-tiny"


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    root = tmp_path_factory.mktemp("vllm-agent")
    config = root / "agent.toml"
    config.write_text(f'[agent]\nchunk_tokens = {CHUNK}\nisolated_tenants = ["acme"]\n')
    with running_agent(root / "a", "--config", str(config), "--cpu", "64MiB", "--disk", "0") as a:
        yield a


def address(agent: Agent, transport: str) -> str:
    found = agent.state.data_tcp if transport == "tcp" else agent.state.data_unix
    assert found is not None
    return found if transport == "tcp" else f"unix://{found}"


def tcp_link(agent: Agent, *, block_size: int = BLOCK, retry_seconds: float = 60.0) -> AgentLink:
    """A link of the default tenant to ``agent``'s TCP data plane."""
    return AgentLink(
        address(agent, "tcp"), tenant="default", model_id=MODEL,
        layout=KVLayout(*LAYOUT_DIMS, "bfloat16"), block_size=block_size,
        retry_seconds=retry_seconds,
    )  # fmt: skip


class Engine:
    """The connector's two halves for one engine: a scheduler plan and a worker with paged
    caches (FlashAttention layout unless told otherwise), as vLLM would hold them."""

    def __init__(
        self,
        agent_address: str,
        *,
        tenant: str = "default",
        dtype: str = "bfloat16",
        blocks: int = 32,
        cache_layout: CacheLayout = CacheLayout.KV_FIRST,
        device: str = "cpu",
        retry_seconds: float = 60.0,
        timeout_seconds: float = 5.0,
    ) -> None:
        self.layout = KVLayout(*LAYOUT_DIMS, dtype)

        def link() -> AgentLink:
            return AgentLink(
                agent_address,
                tenant=tenant,
                model_id=MODEL,
                layout=self.layout,
                block_size=BLOCK,
                retry_seconds=retry_seconds,
                timeout_seconds=timeout_seconds,
            )

        # two links, as vLLM runs the halves in two processes
        self.scheduler = SchedulerPlan(link(), BLOCK)
        self.worker = WorkerPlan(link(), BLOCK)
        fmt = ChunkFormat(self.layout, 1)
        h, d = self.layout.kv_heads, self.layout.head_dim
        shape = {
            CacheLayout.KV_FIRST: (2, blocks, BLOCK, h, d),
            CacheLayout.BLOCKS_FIRST: (blocks, 2, BLOCK, h, d),
            CacheLayout.PACKED: (blocks, h, BLOCK, 2 * d),
        }[cache_layout]
        caches = {
            f"model.layers.{i}.self_attn.attn": torch.full(
                shape, -7.0, dtype=fmt.dtype, device=device
            )
            for i in reversed(range(self.layout.layers))  # dict order is not model order
        }
        self.paged: PagedKV = self.worker.register(caches)

    def close(self) -> None:
        self.scheduler.link.close()
        self.worker.link.close()


def true_kv(engine: Engine, tokens: int, seed: int) -> torch.Tensor:
    """What the model would compute for the prompt: ``[layers, 2, heads, tokens, dim]``."""
    g = torch.Generator().manual_seed(seed)
    lay = engine.layout
    kv = torch.randn(lay.layers, 2, lay.kv_heads, tokens, lay.head_dim, generator=g)
    return kv.to(engine.paged.dtype)


def prefill_and_save(
    engine: Engine, req_id: str, prompt: list[int], blocks: list[int], kv: torch.Tensor
) -> int:
    """A full prefill in two chunked-prefill steps; returns the chunks the agent stored."""
    assert engine.scheduler.match(req_id, prompt, 0) == 0  # a prompt the agent has not seen
    stored = 0
    split = 40
    step = StepPlan()
    engine.scheduler.scheduled_new(req_id, prompt, blocks, 0, split, step)
    engine.paged.scatter(blocks, 0, kv[:, :, :, :split])  # the forward pass writes its KV
    stored += sum(engine.worker.save(s) for s in step.saves)
    step = StepPlan()
    engine.scheduler.scheduled_again(req_id, [], False, split, len(prompt) - split, step)
    engine.paged.scatter(blocks, split, kv[:, :, :, split : len(prompt)])
    stored += sum(engine.worker.save(s) for s in step.saves)
    engine.scheduler.finished(req_id)
    return stored


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_chunks_saved_by_one_engine_are_loaded_into_anothers_blocks(
    agent: Agent, transport: str
) -> None:
    a, b = Engine(address(agent, transport)), Engine(address(agent, transport))
    try:
        base = 5000 if transport == "tcp" else 6000  # the agent is shared: distinct prompts
        prompt = list(range(base, base + 100))
        kv = true_kv(a, 100, seed=1)
        # 100 tokens: 3 full chunks stored, the partial 4th never
        assert prefill_and_save(a, "a1", prompt, list(range(7)), kv) == 3

        # the bytes in the agent are ChunkFormat's: what the transformers adapter reads
        fmt = ChunkFormat(a.layout, CHUNK)
        ks = [kv[i, 0].unsqueeze(0) for i in range(a.layout.layers)]
        vs = [kv[i, 1].unsqueeze(0) for i in range(a.layout.layers)]
        with agent.data(transport) as dc:
            keys = keys_for(prompt, dc.namespace(MODEL, a.layout, "default"), CHUNK)
            assert len(keys) == 3  # full chunks only
            stored = dc.get_many(keys)
        for i in range(3):
            got = stored[i]
            assert got is not None and bytes(got) == fmt.pack(ks, vs, i).numpy().tobytes()

        # engine B: same first 96 tokens, another ending; nothing local
        prompt_b = [*prompt[:96], *range(9000, 9030)]
        assert b.scheduler.match("b1", prompt_b, 0) == 96
        b.scheduler.allocated("b1", 96)
        step = StepPlan()
        blocks_b = [31, 3, 17, 8, 22, 11, 0, 5]  # fresh, scattered
        b.scheduler.scheduled_new("b1", prompt_b, blocks_b, 96, len(prompt_b) - 96, step)
        (load,) = step.loads
        assert (load.start_token, load.end_token, load.first_chunk) == (0, 96, 0)
        assert load.keys == tuple(keys) and load.block_ids == tuple(blocks_b[:6])
        assert step.saves == []  # chunks 0..2 are in the agent; the 4th is not full yet
        outcome = b.worker.load(load)
        assert outcome.failed_block_ids == frozenset() and outcome.loaded_tokens == 96
        assert outcome.fetched_bytes == 3 * fmt.chunk_bytes
        assert torch.equal(b.paged.gather(blocks_b, 0, 96), kv[:, :, :, :96])
        untouched = b.paged.gather(blocks_b[6:], 0, 2 * BLOCK)
        assert torch.equal(untouched, torch.full_like(untouched, -7.0))
    finally:
        a.close()
        b.close()


def test_the_last_token_and_the_local_prefix_limit_what_is_loaded(agent: Agent) -> None:
    a, b = Engine(address(agent, "tcp")), Engine(address(agent, "tcp"))
    try:
        prompt = list(range(7000, 7096))  # exactly 3 chunks
        kv = true_kv(a, 96, seed=2)
        assert prefill_and_save(a, "a2", prompt, list(range(6)), kv) == 3
        # the same 96-token prompt: its last token must be computed, so 2 chunks, not 3
        assert b.scheduler.match("b2", prompt, 0) == 64
        # vLLM already holds 48 tokens locally (3 blocks): 16 more up to chunk 2's end
        assert b.scheduler.match("b3", prompt, 48) == 16
        b.scheduler.allocated("b3", 16)
        blocks = [4, 9, 1, 12, 13, 14]
        local = true_kv(b, 48, seed=99)
        b.paged.scatter(blocks, 0, local)  # the local prefix (vLLM's own cache)
        step = StepPlan()
        b.scheduler.scheduled_new("b3", prompt, blocks, 64, 32, step)
        (load,) = step.loads
        assert (load.start_token, load.end_token, load.first_chunk) == (48, 64, 1)
        assert b.worker.load(load).loaded_tokens == 16
        assert torch.equal(b.paged.gather(blocks, 48, 64), kv[:, :, :, 48:64])
        assert torch.equal(b.paged.gather(blocks, 0, 48), local)  # local blocks untouched
        # all 3 chunks were already in the agent (the lookup saw them), none saved again
        assert step.saves == []
    finally:
        a.close()
        b.close()


def test_a_chunk_evicted_after_the_lookup_fails_only_its_blocks(agent: Agent) -> None:
    a, b = Engine(address(agent, "unix")), Engine(address(agent, "unix"))
    try:
        prompt = list(range(11000, 11100))
        kv = true_kv(a, 100, seed=3)
        assert prefill_and_save(a, "a4", prompt, list(range(7)), kv) == 3
        assert b.scheduler.match("b4", prompt, 0) == 96
        b.scheduler.allocated("b4", 96)
        step = StepPlan()
        blocks = [20, 21, 22, 23, 24, 25, 26]
        b.scheduler.scheduled_new("b4", prompt, blocks, 96, 4, step)
        (load,) = step.loads
        with agent.control() as ctl:
            assert ctl.evict([load.keys[2]])["done"] == 1
        outcome = b.worker.load(load)
        assert outcome.loaded_tokens == 64
        assert outcome.failed_block_ids == {24, 25}  # tokens 64..96: vLLM recomputes them
        assert torch.equal(b.paged.gather(blocks, 0, 64), kv[:, :, :, :64])
    finally:
        a.close()
        b.close()


def test_hits_count_only_the_chunks_a_load_brings_in(agent: Agent) -> None:
    """The agent's reuse/sharing hits are the chunks vLLM loads: not those it holds in its own
    prefix cache, nor repeats of the same question."""
    a, b = Engine(address(agent, "tcp")), Engine(address(agent, "tcp"))
    ctl = agent.control()  # closed with the engines

    def hits() -> int:
        st = ctl.stats()["stats"]
        return int(st["reuse_hits"] + st["sharing_hits"])

    try:
        prompt = list(range(60000, 60100))  # 3 full chunks + 4
        kv = true_kv(a, 100, seed=7)
        assert prefill_and_save(a, "a7", prompt, list(range(7)), kv) == 3
        before = hits()
        # vLLM holds 48 tokens: chunk 0 whole (not loaded), chunk 1 in part (loaded from 48)
        assert b.scheduler.match("b7", prompt, 48) == 48
        assert b.scheduler.match("b7", prompt, 48) == 48  # asked again while waiting
        counted = hits() - before
        b.scheduler.allocated("b7", 48)
        step = StepPlan()
        blocks = [3, 9, 1, 12, 13, 14, 15]
        b.scheduler.scheduled_new("b7", prompt, blocks, 96, 4, step)
        (load,) = step.loads
        outcome = b.worker.load(load)
        assert outcome.loaded_tokens == 48 and outcome.failed_block_ids == frozenset()
        loaded = outcome.fetched_bytes // ChunkFormat(b.layout, CHUNK).chunk_bytes
        assert counted == loaded == 2  # chunks 1 and 2; was 3 (chunk 0 counted too)
        # every loadable chunk held locally: nothing asked that counts
        before = hits()
        assert b.scheduler.match("b8", prompt, 96) == 0
        assert hits() == before
        # the agent lost chunk 0, which vLLM holds: chunks 1 and 2 are still offered
        with agent.data("tcp") as dc:
            keys = keys_for(prompt, dc.namespace(MODEL, a.layout, "default"), CHUNK)
        assert ctl.evict([keys[0]])["done"] == 1
        before = hits()
        assert b.scheduler.match("b9", prompt, 32) == 64
        assert hits() - before == 2
    finally:
        a.close()
        b.close()
        ctl.close()


def test_chunks_stored_by_the_transformers_adapter_layout_are_loaded(agent: Agent) -> None:
    """The other direction: chunks packed by ``ChunkFormat`` from contiguous caches (what the
    transformers adapter stores) and put under the same namespace are found and scattered."""
    b = Engine(address(agent, "tcp"), dtype="float16", cache_layout=CacheLayout.PACKED)
    try:
        lay = b.layout
        fmt = ChunkFormat(lay, CHUNK)
        prompt = list(range(20000, 20070))  # 2 full chunks + 6
        kv = true_kv(b, 64, seed=4)
        ks = [kv[i, 0].unsqueeze(0) for i in range(lay.layers)]
        vs = [kv[i, 1].unsqueeze(0) for i in range(lay.layers)]
        with agent.data("tcp") as dc:
            keys = keys_for(prompt, dc.namespace(MODEL, lay, "default"), CHUNK)
            outcomes = dc.put_many(
                [(k, fmt.pack(ks, vs, i).numpy()) for i, k in enumerate(keys)],
                tenant="default",
                parents=parents_of(keys),
                tokens=CHUNK,
            )
        assert [o.status for o in outcomes] == ["stored", "stored"]
        assert b.scheduler.match("b5", prompt, 0) == 64
        b.scheduler.allocated("b5", 64)
        step = StepPlan()
        blocks = [2, 30, 6, 9, 1]
        b.scheduler.scheduled_new("b5", prompt, blocks, 64, 6, step)
        assert b.worker.load(step.loads[0]).failed_block_ids == frozenset()
        assert torch.equal(b.paged.gather(blocks, 0, 64), kv)
    finally:
        b.close()


def test_an_isolated_tenants_chunks_are_found_by_that_tenant_only(agent: Agent) -> None:
    acme = Engine(address(agent, "tcp"), tenant="acme")
    other = Engine(address(agent, "tcp"))
    acme_again = Engine(address(agent, "tcp"), tenant="acme")
    try:
        prompt = list(range(30000, 30065))
        assert prefill_and_save(acme, "x", prompt, list(range(5)), true_kv(acme, 65, 5)) == 2
        assert other.scheduler.match("y", prompt, 0) == 0  # salted keys: not even visible
        assert acme_again.scheduler.match("z", prompt, 0) == 64
    finally:
        for e in (acme, other, acme_again):
            e.close()


def test_a_down_agent_means_no_reuse_and_no_errors(caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(f"127.0.0.1:{closed_port()}")
    try:
        with caplog.at_level(logging.WARNING, logger="kvctl.engines.vllm"):
            assert engine.scheduler.match("r", list(range(500)), 0) == 0
            step = StepPlan()
            engine.scheduler.scheduled_new("r", list(range(500)), list(range(32)), 0, 500, step)
        # without the agent's chunk size nothing is planned: no loads, no saves to fail
        assert step.loads == [] and step.saves == []
        assert any("unreachable" in r.message for r in caplog.records)
    finally:
        engine.close()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_hung_agent_costs_a_step_its_short_deadline_then_loads_resume(
    tmp_path: Path, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A stopped agent (SIGSTOP: its sockets accept, nothing answers) costs the scheduler's
    lookup and the worker's load their deadline (the default ``timeout_seconds``, 1 s, where 5 s
    per wait was paid): the lookup offers nothing, the load reports every block failed (vLLM
    recomputes them), each link drops its connection; once the agent answers again and
    ``retry_seconds`` have passed, chunks are found and loaded again."""
    config = tmp_path / "agent.toml"
    config.write_text(f"[agent]\nchunk_tokens = {CHUNK}\n")
    with running_agent(tmp_path / "a", "--config", str(config), "--cpu", "64MiB") as agent:
        default_s = ConnectorSettings().timeout_seconds
        a = Engine(address(agent, transport))
        b = Engine(address(agent, transport), retry_seconds=0.2, timeout_seconds=default_s)
        try:
            prompt = list(range(100))
            kv = true_kv(a, 100, seed=12)
            assert prefill_and_save(a, "a12", prompt, list(range(7)), kv) == 3
            assert b.scheduler.match("b12", prompt, 0) == 96  # both links connected
            b.scheduler.allocated("b12", 96)
            step = StepPlan()
            blocks = [9, 2, 30, 4, 18, 6, 7]
            b.scheduler.scheduled_new("b12", prompt, blocks, 0, 100, step)
            (load,) = step.loads
            with stopped(agent), caplog.at_level(logging.WARNING, logger="kvctl.engines.vllm"):
                outcome = guarded(lambda: b.worker.load(load))
                assert outcome.loaded_tokens == 0
                assert outcome.failed_block_ids == frozenset(blocks[:6])
                assert guarded(lambda: b.scheduler.match("b13", prompt, 0)) == 0
                assert b.worker.link._client is None and b.scheduler.link._client is None
                reasons = [r.getMessage() for r in caplog.records]
                # each call ended at the default deadline (chunks' bytes add little here)
                assert any("did not answer LOOKUP within 2 s" in r for r in reasons), reasons
            wait_until(
                "the scheduler to find the chunks again",
                lambda: b.scheduler.match("b14", prompt, 0) == 96,
            )
            wait_until(
                "the worker to load them again",
                lambda: b.worker.load(load).loaded_tokens == 96,
            )
            assert torch.equal(b.paged.gather(blocks, 0, 96), kv[:, :, :, :96])
        finally:
            a.close()
            b.close()


def test_an_agent_restarted_costs_one_step_not_retry_seconds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent restarted under a running engine (an upgrade) drops its connections: the next
    call fails (that step recomputes), and the call after it connects again at once, where
    the engine used to leave the agent alone for ``retry_seconds`` (10 s of steps without
    reuse by default; 60 s here)."""
    config = tmp_path / "agent.toml"
    config.write_text(f"[agent]\nchunk_tokens = {CHUNK}\n")
    args = ("--config", str(config), "--cpu", "64MiB")
    agent = start_agent(tmp_path / "a", *args)
    try:
        b = Engine(address(agent, "unix"), retry_seconds=60.0)
        prompt = list(range(300, 400))
        assert b.scheduler.match("b1", prompt, 0) == 0  # connected, nothing stored yet
        first = b.scheduler.link._client
        assert first is not None
        assert agent.stop() == 0
        agent = start_agent(tmp_path / "a", *args)  # the same socket path
        a = Engine(address(agent, "unix"))
        kv = true_kv(a, 100, seed=21)
        assert prefill_and_save(a, "a21", prompt, list(range(7)), kv) == 3
        with caplog.at_level(logging.WARNING, logger="kvctl.engines.vllm"):
            assert b.scheduler.match("b2", prompt, 0) == 0  # the lost connection's call
        assert any("lookup failed" in r.getMessage() for r in caplog.records)
        assert b.scheduler.match("b3", prompt, 0) == 96  # made again at once
        assert b.scheduler.link._client is not first
        a.close()
        b.close()
    finally:
        assert agent.stop() == 0


def test_a_refused_call_keeps_the_connection_and_a_second_loss_waits(agent: Agent) -> None:
    """A refusal the agent answered (starting, out of room) leaves the connection as it
    was; a connection lost is made again at the next call once per ``retry_seconds``, a second
    loss within them waits them out (an agent that drops every connection is not asked at
    every step)."""
    link = tcp_link(agent)
    try:
        client = link.get()
        assert client is not None
        link.failed("save", NoRoom("no room for the chunk in any tier", ErrorCode.NO_ROOM))
        assert link.get() is client and not client.closed
        link.failed("lookup", AgentUnreachable("lost the connection to the agent"))
        assert client.closed
        again = link.get()
        assert again is not None and again is not client
        link.failed("lookup", AgentUnreachable("lost the connection to the agent"))
        assert link.get() is None  # for retry_seconds
        link.failed("lookup", AgentTimeout("the agent did not answer LOOKUP within 2 s"))
        assert link.get() is None
    finally:
        link.close()


def test_a_late_failure_on_a_replaced_connection_leaves_its_successor(agent: Agent) -> None:
    """Two threads on one link: one finds the connection lost and the link makes it again;
    the other's report of a failure on the old connection comes after. It must not close the
    new one (nor spend the once-per-retry_seconds quick reconnect)."""
    link = tcp_link(agent)
    try:
        old = link.get()
        assert old is not None
        link.failed("lookup", AgentUnreachable("lost the connection to the agent"), old)
        new = link.get()
        assert new is not None and new is not old
        link.failed("read", AgentUnreachable("lost the connection to the agent"), old)
        assert link.get() is new and not new.closed
    finally:
        link.close()


def test_the_agents_chunk_size_must_be_whole_blocks(agent: Agent) -> None:
    link = tcp_link(agent, block_size=64, retry_seconds=10.0)
    assert link.get() is None
    assert link.disabled is not None and "multiple of vLLM's block_size (64)" in link.disabled


# --- the connector class itself, driven the way vLLM drives it ---------------------------------
def vllm_config(agent_address: str, tenant: str, **extra: object) -> SimpleNamespace:
    """The attributes of vLLM's VllmConfig the connector reads (names as in vLLM's sources);
    ``extra``: more kvctl settings."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"agent": agent_address, "tenant": tenant, **extra},
            is_kv_producer=True,
            is_kv_consumer=True,
        ),
        model_config=SimpleNamespace(
            model=MODEL,
            use_mla=False,
            dtype=torch.bfloat16,
            get_num_layers=lambda parallel: LAYOUT_DIMS[0],
            get_num_kv_heads=lambda parallel: LAYOUT_DIMS[1],
            get_head_size=lambda: LAYOUT_DIMS[2],
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
    )


def layer(i: int) -> str:
    """Attention layer ``i``'s name, as vLLM keys its KV caches and asks for its loads."""
    return f"model.layers.{i}.self_attn.attn"


def connector_pair(cfg: SimpleNamespace) -> tuple[Any, Any, PagedKV]:
    """A scheduler and a worker connector as vLLM makes them (in two processes), and the
    worker's paged caches (bf16, FlashAttention layout), registered."""
    Connector, Role = vllm_connector.KvctlConnector, vllm_connector.KVConnectorRole
    sched, worker = Connector(cfg, Role.SCHEDULER), Connector(cfg, Role.WORKER)
    shape = (2, 16, BLOCK, LAYOUT_DIMS[1], LAYOUT_DIMS[2])
    caches = {layer(i): torch.full(shape, -7.0, dtype=torch.bfloat16)
              for i in range(LAYOUT_DIMS[0])}  # fmt: skip
    worker.register_kv_caches(caches)
    return sched, worker, PagedKV(list(caches.values()), KVLayout(*LAYOUT_DIMS, "bfloat16"), BLOCK)


def first_step(sched: Any, prompt: list[int]) -> tuple[Any, list[int]]:
    """Request "B" of a 160-token prompt whose first 3 chunks the agent holds, nothing local:
    one step loads chunks 0..2 and computes tokens 96..160 (chunks 3 and 4 become full)."""
    b = request("B", prompt)
    assert sched.get_num_new_matched_tokens(b, 0) == (96, False)
    sched.update_state_after_alloc(b, None, 96)
    blocks = [15, 1, 12, 0, 2, 13, 14, 10, 3, 4]
    meta = sched.build_connector_meta(scheduler_output([(b, blocks, 96)], {"B": 64}))
    assert [s.first_chunk for s in meta.saves] == [3]
    return meta, blocks


def request(req_id: str, prompt: list[int], **extra: object) -> SimpleNamespace:
    fields = {"mm_features": [], "lora_request": None, "cache_salt": None, "prompt_embeds": None}
    return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, **{**fields, **extra})


def scheduler_output(
    new: list[tuple[SimpleNamespace, list[int], int]],
    scheduled: dict[str, int],
    cached: Sequence[tuple[str, list[int] | None, int]] = (),
) -> SimpleNamespace:
    """vLLM's SchedulerOutput (0.11.2+ shape) with new requests (request, blocks, computed) and
    running ones (request id, new blocks, computed)."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                block_ids=(blocks,),
                num_computed_tokens=computed,
                mm_features=r.mm_features,
                lora_request=r.lora_request,
                prompt_embeds=r.prompt_embeds,
            )
            for r, blocks, computed in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            resumed_req_ids=set(),
            new_block_ids=[None if b is None else (b,) for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
        ),
        num_scheduled_tokens=scheduled,
        finished_req_ids=set(),
    )


@pytest.mark.parametrize("layerwise", [False, True])
def test_the_connector_class_saves_and_loads_through_the_agent(
    agent: Agent, monkeypatch: pytest.MonkeyPatch, layerwise: bool
) -> None:
    monkeypatch.setattr(vllm_connector, "_VLLM_MISSING", None)  # vLLM's part: its objects below
    Connector, Role = vllm_connector.KvctlConnector, vllm_connector.KVConnectorRole
    cfg = vllm_config(address(agent, "unix"), "glue")
    cfg_b = vllm_config(address(agent, "unix"), "glue", layerwise=layerwise)
    dtype = torch.bfloat16
    layout = KVLayout(*LAYOUT_DIMS, "bfloat16")
    shape = (2, 16, BLOCK, LAYOUT_DIMS[1], LAYOUT_DIMS[2])

    def caches() -> dict[str, torch.Tensor]:
        return {f"model.layers.{i}.self_attn.attn": torch.full(shape, -7.0, dtype=dtype)
                for i in range(LAYOUT_DIMS[0])}  # fmt: skip

    prompt = list(range(40000, 40100)) if not layerwise else list(range(41000, 41100))
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(LAYOUT_DIMS[0], 2, LAYOUT_DIMS[1], 100, LAYOUT_DIMS[2], generator=g).to(dtype)

    # engine A computes the prompt and saves its 3 full chunks
    sched, worker = Connector(cfg, Role.SCHEDULER), Connector(cfg, Role.WORKER)
    caches_a = caches()
    worker.register_kv_caches(caches_a)
    a = request("A", prompt)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    sched.update_state_after_alloc(a, None, 0)
    image = request("I", prompt, mm_features=["image"])  # same tokens, other KV: left alone
    assert sched.get_num_new_matched_tokens(image, 0) == (0, False)
    blocks_a = [3, 4, 5, 6, 7, 8, 9]
    meta = sched.build_connector_meta(
        scheduler_output([(a, blocks_a, 0), (image, [10, 11], 0)], {"A": 100, "I": 100})
    )
    meta = pickle.loads(pickle.dumps(meta))  # as it travels to the worker process
    assert meta.loads == [] and [s.req_id for s in meta.saves] == ["A"]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    PagedKV(list(caches_a.values()), layout, BLOCK).scatter(blocks_a, 0, kv)  # the forward pass
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert sched.request_finished(a, blocks_a) == (False, None)
    worker.shutdown()  # drains the background saver

    # engine B: the same first 96 tokens, another ending, nothing local: 3 chunks offered
    sched_b, worker_b = Connector(cfg_b, Role.SCHEDULER), Connector(cfg_b, Role.WORKER)
    caches_b = caches()
    worker_b.register_kv_caches(caches_b)
    b = request("B", [*prompt[:96], *range(1, 30)])
    assert sched_b.get_num_new_matched_tokens(b, 0) == (96, False)
    sched_b.update_state_after_alloc(b, None, 96)
    blocks_b = [15, 1, 12, 0, 2, 13, 14, 10]
    meta = sched_b.build_connector_meta(scheduler_output([(b, blocks_b, 96)], {"B": 29}))
    worker_b.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
    worker_b.start_load_kv(None)
    paged_b = PagedKV(list(caches_b.values()), layout, BLOCK)
    for i, name in enumerate(caches_b):  # the forward pass: each attention layer in turn
        # layer-wise on a CPU, a layer's blocks are written when its attention asks, not before
        untouched = bool((paged_b.gather(blocks_b, 0, 96)[i] == -7.0).all())
        assert untouched == layerwise
        worker_b.wait_for_layer_load(name)
        assert torch.equal(paged_b.gather(blocks_b, 0, 96)[i], kv[i, :, :, :96])
    worker_b.wait_for_save()
    assert worker_b.get_block_ids_with_load_errors() == set()
    assert torch.equal(paged_b.gather(blocks_b, 0, 96), kv[:, :, :, :96])
    assert worker_b.link.get().pending_leases() == 0  # type: ignore[union-attr]  # leases released
    for c in (sched, sched_b, worker_b):
        c.shutdown()


def test_a_wrong_token_stops_start_up_instead_of_passing_for_an_outage(tmp_path: Path) -> None:
    with running_agent(tmp_path / "t", "--cpu", "8MiB", "--disk", "0", token="right") as a:
        link = AgentLink(
            address(a, "tcp"), tenant="default", model_id=MODEL,
            layout=KVLayout(*LAYOUT_DIMS, "bfloat16"), token="wrong",
        )  # fmt: skip
        assert link.get() is None
        assert link.disabled is not None and "refused the token" in link.disabled
        good = AgentLink(
            address(a, "tcp"), tenant="default", model_id=MODEL,
            layout=KVLayout(*LAYOUT_DIMS, "bfloat16"), token="right",
        )  # fmt: skip
        try:
            assert good.get() is not None and good.chunk_tokens == 256
        finally:
            good.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_nothing_computed_after_a_failed_load_is_saved_until_vllm_recomputes_it(
    agent: Agent, monkeypatch: pytest.MonkeyPatch, layerwise: bool
) -> None:
    """A chunk evicted between the lookup and the read leaves blocks unfilled; the step's
    forward pass computes the prompt's next chunks on them. Those must not reach the agent
    (under correct keys, for every later request sharing the prefix); once vLLM has recomputed
    from the first unfilled block (it reports them through get_block_ids_with_load_errors), the
    correct chunks are saved."""
    monkeypatch.setattr(vllm_connector, "_VLLM_MISSING", None)
    # layer-wise: the step cannot be read in place, so it loads synchronously, with the same
    # outcome
    cfg = vllm_config(address(agent, "unix"), "default", layerwise=layerwise)
    dtype, layout = torch.bfloat16, KVLayout(*LAYOUT_DIMS, "bfloat16")
    fmt = ChunkFormat(layout, CHUNK)
    start = 50000 if not layerwise else 51000
    prompt = list(range(start, start + 160))  # 5 full chunks
    a = Engine(address(agent, "unix"))
    kv = true_kv(a, 160, seed=8)
    try:  # chunks 0..2 in the agent (a 100-token prompt sharing the first 100 tokens)
        assert prefill_and_save(a, "a8", prompt[:100], list(range(7)), kv[:, :, :, :100]) == 3
    finally:
        a.close()
    with agent.data("unix") as dc:
        keys = keys_for(prompt, dc.namespace(MODEL, layout, "default"), CHUNK)

    def chunk_bytes(i: int) -> bytes:
        ks = [kv[j, 0].unsqueeze(0) for j in range(layout.layers)]
        vs = [kv[j, 1].unsqueeze(0) for j in range(layout.layers)]
        return bytes(fmt.pack(ks, vs, i).numpy().tobytes())

    def stored() -> list[bytes | None]:
        with agent.data("unix") as dc:
            return [None if c is None else bytes(c) for c in dc.get_many(keys)]

    sched, worker, paged = connector_pair(cfg)
    try:
        meta, blocks = first_step(sched, prompt)
        with agent.control() as ctl:
            assert ctl.evict([keys[1]])["done"] == 1  # between the lookup and the read
        worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
        worker.start_load_kv(None)
        # the forward pass: chunks 3 and 4 attend to unfilled blocks 2..5, so are wrong
        paged.scatter(blocks, 96, torch.randn(*kv[:, :, :, 96:].shape).to(dtype))
        worker.wait_for_save()
        worker.clear_connector_metadata()
        failed = worker.get_block_ids_with_load_errors()
        assert failed == set(blocks[2:6])  # tokens 32..96: chunk 0 arrived, chunk 1 did not
        worker._saver.drain()  # type: ignore[union-attr]
        after = stored()
        assert after[1] is None and after[3] is None and after[4] is None  # nothing poisoned
        assert after[0] == chunk_bytes(0) and after[2] == chunk_bytes(2)

        # vLLM: the blocks are reported, the request recomputes from the first one (token 32)
        sched.update_connector_output(SimpleNamespace(invalid_block_ids=failed))
        meta = sched.build_connector_meta(scheduler_output([], {"B": 128}, [("B", None, 32)]))
        assert meta.loads == [] and [(s.first_chunk, len(s.keys)) for s in meta.saves] == [(1, 4)]
        worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
        worker.start_load_kv(None)
        paged.scatter(blocks, 32, kv[:, :, :, 32:])  # recomputed, right this time
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert worker.get_block_ids_with_load_errors() == set()
        worker._saver.drain()  # type: ignore[union-attr]
        assert stored() == [chunk_bytes(i) for i in range(5)]
    finally:
        for c in (sched, worker):
            c.shutdown()


def test_the_worker_maps_its_agents_arena_when_it_connects_and_again_after(agent: Agent) -> None:
    """Registering the arena pins it (seconds for a few GiB on CUDA): the worker does it in the
    background when it connects, and again when the agent's connection is made anew (an agent
    restart), so no load pays it."""
    engine = Engine(address(agent, "unix"))
    try:
        first = engine.worker.attached
        assert first is not None
        first.join(30)
        (loader,) = engine.worker._loaders.values()
        client = engine.worker.link.get()
        assert client is not None
        assert [buf for buf, _, _ in loader._registered.values()] == [client._arena]
        client.close()  # the connection lost: the next get() makes a new one
        again = engine.worker.link.get()
        assert again is not None and again is not client
        second = engine.worker.attached
        assert second is not None and second is not first
        second.join(30)
        assert [buf for buf, _, _ in loader._registered.values()] == [again._arena]
    finally:
        engine.close()


# --- layer-wise loads ----------------------------------------------------------------------------
def one_load(
    a: Engine, b: Engine, prompt: list[int], blocks: list[int], seed: int
) -> tuple[torch.Tensor, LoadSpec]:
    """``a`` stores the prompt's 3 full chunks; ``b`` (nothing local) plans their load."""
    kv = true_kv(a, len(prompt), seed=seed)
    assert prefill_and_save(a, f"a{seed}", prompt, list(range(7)), kv) == 3
    req = f"b{seed}"
    assert b.scheduler.match(req, prompt, 0) == 96
    b.scheduler.allocated(req, 96)
    step = StepPlan()
    b.scheduler.scheduled_new(req, prompt, blocks, 96, len(prompt) - 96, step)
    (load,) = step.loads
    return kv, load


def untouched(paged: PagedKV, blocks: list[int], i: int) -> bool:
    return bool((paged.gather(blocks, 0, 96)[i] == -7.0).all())


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ),
    ],
)
def test_a_layerwise_load_writes_each_layer_when_its_attention_asks(
    agent: Agent, device: str
) -> None:
    """On CUDA the copies start at once on a side stream (held back here by a sleep queued
    ahead of them), and a layer's blocks are written on the compute stream once its attention
    asks, after that layer's copies: reading them then gives the chunks' bytes."""
    a, b = Engine(address(agent, "unix")), Engine(address(agent, "unix"), device=device)
    if device == "cuda":
        assert b.worker.attached is not None
        b.worker.attached.join(60)  # the arena registered, as a serving worker has it
    try:
        blocks = [20, 21, 22, 23, 24, 25, 26]
        seed, base = (11, 12000) if device == "cpu" else (21, 16000)
        kv, load = one_load(a, b, list(range(base, base + 100)), blocks, seed=seed)
        kv = kv.to(device)
        if device == "cuda":
            side = b.worker.loader(b.worker.format(CHUNK))._stream
            with torch.cuda.stream(side):
                torch.cuda._sleep(200_000_000)  # ~0.1 s: the copies land well after the ask
        assert b.worker.queue_loads([load])
        client = b.worker.link.get()
        assert client is not None and client.pending_leases()  # held under the forward pass
        assert all(untouched(b.paged, blocks, i) for i in range(3))  # nothing written yet
        b.worker.wait_layer(layer(1))  # asked out of order: only that layer is written
        got = b.paged.gather(blocks, 0, 96)
        assert torch.equal(got[1], kv[1, :, :, :96])
        assert untouched(b.paged, blocks, 0) and untouched(b.paged, blocks, 2)
        b.worker.wait_layer("not.a.layer")  # a name that is not an attention layer: nothing
        for i in (0, 2):
            b.worker.wait_layer(layer(i))
        ((spec, outcome),) = b.worker.finish_loads()
        assert spec is load and outcome.loaded_tokens == 96 and not outcome.failed_block_ids
        assert torch.equal(b.paged.gather(blocks, 0, 96), kv[:, :, :, :96])
        assert client.pending_leases() == 0 and b.worker.finish_loads() == []
        # a forward pass that skipped a layer's ask (a full CUDA graph replayed) ran that
        # attention on unfilled blocks: the load is failed whole, for vLLM to recompute
        blocks2 = [0, 1, 2, 3, 4, 5, 6]
        _, load2 = one_load(a, b, list(range(base + 1000, base + 1100)), blocks2, seed + 1)
        assert b.worker.queue_loads([load2])
        b.worker.wait_layer(layer(0))
        ((_, outcome),) = b.worker.finish_loads()
        assert outcome.loaded_tokens == 0 and outcome.failed_block_ids == set(blocks2[:6])
        assert untouched(b.paged, blocks2, 1) and client.pending_leases() == 0
    finally:
        a.close()
        b.close()


def test_a_step_of_two_requests_queues_both_or_neither(agent: Agent) -> None:
    """Both requests' chunks are held before any copy is queued; if one chunk cannot be read in
    place the step loads synchronously, with nothing held or queued."""
    a, b = Engine(address(agent, "unix")), Engine(address(agent, "unix"))
    try:
        blocks_1, blocks_2 = [20, 21, 22, 23, 24, 25, 26], [0, 1, 2, 3, 4, 5, 6]
        kv1, load1 = one_load(a, b, list(range(14000, 14100)), blocks_1, seed=13)
        kv2, load2 = one_load(a, b, list(range(14200, 14300)), blocks_2, seed=15)
        assert b.worker.queue_loads([load1, load2])
        for i in range(3):
            b.worker.wait_layer(layer(i))
        outcomes = b.worker.finish_loads()
        assert [(s.req_id, o.failed_block_ids) for s, o in outcomes] == [
            (load1.req_id, frozenset()), (load2.req_id, frozenset()),
        ]  # fmt: skip
        assert torch.equal(b.paged.gather(blocks_1, 0, 96), kv1[:, :, :, :96])
        assert torch.equal(b.paged.gather(blocks_2, 0, 96), kv2[:, :, :, :96])
        # the second request's chunk 2 is gone since the lookup: neither is queued
        blocks_3, blocks_4 = [7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 27]
        kv3, load3 = one_load(a, b, list(range(14400, 14500)), blocks_3, seed=17)
        kv4, load4 = one_load(a, b, list(range(14600, 14700)), blocks_4, seed=19)
        with agent.control() as ctl:
            assert ctl.evict([load4.keys[2]])["done"] == 1
        assert not b.worker.queue_loads([load3, load4])
        client = b.worker.link.get()
        assert client is not None and client.pending_leases() == 0
        assert b.worker.finish_loads() == []
        assert not b.worker.load(load3).failed_block_ids
        assert b.worker.load(load4).failed_block_ids == {blocks_4[4], blocks_4[5]}
        assert torch.equal(b.paged.gather(blocks_3, 0, 96), kv3[:, :, :, :96])
        assert torch.equal(b.paged.gather(blocks_4, 0, 64), kv4[:, :, :, :64])
    finally:
        a.close()
        b.close()


def test_a_step_that_cannot_be_queued_loads_in_place_and_counts_its_holds_twice(
    agent: Agent,
) -> None:
    """queue_loads leases each request's chunks (which counts them as served and read), gives
    up at a chunk evicted since the lookup, and the step loads as ``load`` does: in place,
    leased again, so the chunks the holds counted count twice. Reading them uncounted instead
    (GET_COUNTED) would take them through the socket and a staging buffer, far slower than the
    arena on a GPU host, on the step that already lost a hit: the counts pay, not the data
    path. Reads and missing chunks double alike, so the share of reads gone holds (1 of 6)."""
    a, b = Engine(address(agent, "unix")), Engine(address(agent, "unix"))
    try:
        blocks_1, blocks_2 = [7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18, 19, 27]
        kv1, load1 = one_load(a, b, list(range(16400, 16500)), blocks_1, seed=21)
        _kv2, load2 = one_load(a, b, list(range(16600, 16700)), blocks_2, seed=23)
        with agent.control() as ctl:
            assert ctl.evict([load2.keys[2]])["done"] == 1
            before = ctl.stats()["dataplane"]
        assert not b.worker.queue_loads([load1, load2])
        assert not b.worker.load(load1).failed_block_ids
        assert b.worker.load(load2).failed_block_ids == {blocks_2[4], blocks_2[5]}
        assert torch.equal(b.paged.gather(blocks_1, 0, 96), kv1[:, :, :, :96])
        with agent.control() as ctl:
            after = ctl.stats()["dataplane"]
        read = after["read_chunks"] - before["read_chunks"]
        missing = after["read_missing_chunks"] - before["read_missing_chunks"]
        assert (read, missing) == (12, 2)
        assert missing / read == 1 / 6
    finally:
        a.close()
        b.close()


def test_a_lease_that_runs_out_under_the_forward_pass_fails_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes copied after a lease ran out may be another chunk's: the load's blocks are
    reported for vLLM to recompute, and the step's saves computed on them are dropped."""
    config = tmp_path / "agent.toml"
    config.write_text(f"[agent]\nchunk_tokens = {CHUNK}\nlease_seconds = 0.3\n")
    with running_agent(
        tmp_path / "a", "--config", str(config), "--cpu", "64MiB", "--disk", "0"
    ) as ag:
        monkeypatch.setattr(vllm_connector, "_VLLM_MISSING", None)
        cfg = vllm_config(address(ag, "unix"), "default", layerwise=True)
        a = Engine(address(ag, "unix"))
        prompt = list(range(15000, 15160))  # 5 full chunks
        kv = true_kv(a, 160, seed=14)
        try:
            assert prefill_and_save(a, "a14", prompt[:100], list(range(7)), kv[:, :, :, :100]) == 3
        finally:
            a.close()
        sched, worker, paged = connector_pair(cfg)
        try:
            meta, blocks = first_step(sched, prompt)
            worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
            worker.start_load_kv(None)
            worker.wait_for_layer_load(layer(0))
            time.sleep(0.6)  # a forward pass slower than the lease
            for i in (1, 2):
                worker.wait_for_layer_load(layer(i))
            paged.scatter(blocks, 96, kv[:, :, :, 96:])  # the step's new tokens
            worker.wait_for_save()
            worker.clear_connector_metadata()
            assert worker.get_block_ids_with_load_errors() == set(blocks[:6])
            worker._saver.drain()  # type: ignore[union-attr]
            assert worker._worker.failures.dropped_chunks == 2  # type: ignore[union-attr]
            assert worker.link.get().pending_leases() == 0  # type: ignore[union-attr]
        finally:
            for c in (sched, worker):
                c.shutdown()


def test_layerwise_loads_ask_vllm_for_piecewise_cuda_graphs() -> None:
    """A full CUDA graph replay skips wait_for_layer_load."""
    connector = vllm_connector.KvctlConnector
    assert connector.requires_piecewise_for_cudagraph({"layerwise": True})
    assert not connector.requires_piecewise_for_cudagraph({"agent": "unix:///x"})
    assert not connector.requires_piecewise_for_cudagraph({})
