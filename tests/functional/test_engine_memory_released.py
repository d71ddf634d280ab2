"""What an engine or client maps of an agent (its shared arena: the cpu tier's whole capacity;
a writer's staging segment) is unmapped once they are done with it, even when they are not
closed in the order expected, or not closed at all: a long-running engine process (or a test
worker) must not keep a dead connection's arena committed. Checked against the process's own
mappings (``/proc/self/maps``)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvctl.engines.writebehind import StoreJob, WriteBehind
from kvctl.store.tiers.hostreg import buffer_address
from tests.functional.agents import key, payload, running_agent
from tests.functional.waiting import wait_until

SIZE = 64 << 10
CHUNK = 64


def _memfd_mappings(name: str) -> set[int]:
    """Start addresses of this process's mappings of memfds named ``kvctl-<name>``."""
    starts = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            if f"/memfd:kvctl-{name} " in line:
                starts.add(int(line.split("-", 1)[0], 16))
    return starts


def test_a_closed_client_unmaps_its_arena_once_the_last_view_of_it_goes(tmp_path: Path) -> None:
    with running_agent(tmp_path, "--cpu", "64MiB") as agent:
        client = agent.data("unix")
        arena = client.shared_arena()
        assert arena is not None
        start = buffer_address(memoryview(arena))
        assert start in _memfd_mappings("cpu")
        # an engine's tensor over the arena, still held when the connection closes: the
        # client cannot unmap it then, and must not keep it mapped after the view goes
        held = memoryview(arena)
        del arena
        client.close()
        assert start in _memfd_mappings("cpu")  # the view is still good to read
        held.release()
        gc.collect()
        assert start not in _memfd_mappings("cpu"), "the closed client kept its arena mapped"
        assert client.closed  # (the client object itself is still alive here)


def _job(keys: list[bytes], pack_holds: object) -> StoreJob:
    return StoreJob(
        tenant="t",
        keys=keys,
        indices=list(range(len(keys))),
        parents=[None, *keys[:-1]],
        chunk_tokens=16,
        chunk_bytes=SIZE,
        pack=lambda i: (pack_holds, payload(keys[i], SIZE))[1],
    )


class _Engine:
    """Stands for whatever a job's packers hold: the engine, the request's KV cache."""


def test_the_writer_lets_go_of_a_job_once_it_is_written(tmp_path: Path) -> None:
    with running_agent(tmp_path, "--cpu", "64MiB") as agent, agent.data("unix") as client:
        writer = WriteBehind(client)
        engine = _Engine()
        gone = weakref.ref(engine)
        stored = writer.submit(_job([key(i) for i in range(3)], engine)).result(timeout=30)
        assert stored.chunks == 3
        del engine
        # the writer waits for its next job holding nothing of the last one
        wait_until("the written job to be let go of", lambda: gc.collect() >= 0 and not gone())
        writer.close()


def test_an_engine_dropped_unclosed_leaves_no_writer_mapping_or_thread(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvctl.engines.hf import CachedLM
    from kvctl.engines.models import build_model

    config = tmp_path / "agent.toml"
    config.write_text(f"[agent]\nchunk_tokens = {CHUNK}\n")
    staging_before = _memfd_mappings("staging")
    with (
        running_agent(tmp_path, "--config", str(config), "--cpu", "64MiB") as agent,
        agent.data("unix") as client,
    ):
        lm = CachedLM(build_model("tiny-llama", dtype=torch.float32), client, chunked_prefill=True)
        ids = [int(t) for t in torch.randint(0, 32000, (3 * CHUNK + 5,))]
        lm.prefill(ids, tenant="a")
        assert lm.flush(30)
        writer = lm._writer
        assert writer is not None and writer._thread is not None
        thread = writer._thread
        assert _memfd_mappings("staging") - staging_before  # the writer's segment is mapped
        del writer
        arena = client.shared_arena()
        assert arena is not None
        start = buffer_address(memoryview(arena))
        del arena
        # the engine goes without close(): its writer is closed as it is collected
        engine_gone = weakref.ref(lm)
        del lm
        gc.collect()
        assert engine_gone() is None, "something still holds the engine"
        wait_until("the dropped engine's writer thread to end", lambda: not thread.is_alive())
        wait_until(
            "the writer's staging segment to be unmapped",
            lambda: not _memfd_mappings("staging") - staging_before,
        )
        assert not [t for t in threading.enumerate() if t is thread]
        # the caller's client keeps its arena (it is the caller's) until it closes
        assert start in _memfd_mappings("cpu")
    gc.collect()
    assert start not in _memfd_mappings("cpu")


@contextmanager
def _no_collector() -> Iterator[None]:
    """Only reference counting frees anything inside: what a reference cycle holds stays."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _worker_plan(address: str) -> tuple[object, int]:
    """A vLLM worker-side plan connected to the agent, its arena mapped and attached (as at
    the worker's start); and where that mapping starts (the test holds no view of it)."""
    import torch  # (in the test: importorskip)

    from kvctl.engines.kvformat import ChunkFormat
    from kvctl.engines.vllm_plan import AgentLink, WorkerPlan
    from kvctl.store.keys import KVLayout

    before = _memfd_mappings("cpu")
    layout = KVLayout(2, 2, 8, "float32")
    link = AgentLink(address, tenant="t", model_id="m", layout=layout, block_size=16)
    plan = WorkerPlan(link, 16)
    dtype = ChunkFormat(layout, 1).dtype
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros((2, 4, 16, 2, 8), dtype=dtype)
              for i in range(2)}  # fmt: skip
    plan.register(caches)
    assert plan.attached is not None
    plan.attached.join(30)
    (loader,) = plan._loaders.values()
    assert len(loader._registered) == 1
    (start,) = _memfd_mappings("cpu") - before
    return plan, start


def test_a_worker_plan_let_go_of_unmaps_the_arena_without_the_garbage_collector(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    with running_agent(tmp_path, "--cpu", "64MiB") as agent:
        assert agent.state.data_unix is not None
        with _no_collector():
            plan, start = _worker_plan(agent.state.data_unix)
            gone = weakref.ref(plan)
            del plan
            assert gone() is None, "the plan is in a reference cycle (with its link)"
            # (a populate of the mapping under way, started as it was attached, ends first)
            wait_until("the arena to be unmapped", lambda: start not in _memfd_mappings("cpu"))


def test_a_closed_worker_plan_unmaps_the_arena(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    with running_agent(tmp_path, "--cpu", "64MiB") as agent:
        assert agent.state.data_unix is not None
        with _no_collector():
            plan, start = _worker_plan(agent.state.data_unix)
            plan.close()  # type: ignore[attr-defined]
            # the plan is still held here: closing it is what let go of the arena
            assert start not in _memfd_mappings("cpu")
