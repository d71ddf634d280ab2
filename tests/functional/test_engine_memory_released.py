"""What an engine or client maps of an agent (its shared arena: the cpu tier's whole capacity;
a writer's staging segment) is unmapped once they are done with it, even when they are not
closed in the order expected, or not closed at all: a long-running engine process (or a test
worker) must not keep a dead connection's arena committed. Checked against the process's own
mappings (``/proc/self/maps``)."""

from __future__ import annotations

import gc
import threading
import weakref
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
