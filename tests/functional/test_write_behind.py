"""Storing behind the request, against real agents: the hand-over returns before the write, jobs
land in order on their own connection, a full queue drops (counted) instead of blocking, an
agent that dies costs the chunks and not the writer, and an engine killed mid-write leaves the
agent with whole chunks only (every acknowledged one, none corrupt)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from kvctl.engines.writebehind import StoreJob, WriteBehind
from kvctl.store.tiers.hostreg import buffer_address
from tests.functional.agents import key, payload, running_agent
from tests.functional.child_report import child_report
from tests.functional.hung import SOCKET_TIMEOUT_S, guarded, stopped

SIZE = 64 << 10


def _job(keys: list[bytes], *, prepare: threading.Event | None = None) -> StoreJob:
    return StoreJob(
        tenant="t",
        keys=keys,
        indices=list(range(len(keys))),
        parents=[None, *keys[:-1]],
        chunk_tokens=16,
        chunk_bytes=SIZE,
        pack=lambda i: payload(keys[i], SIZE),
        prepare=None if prepare is None else (lambda: prepare.wait(30)),  # type: ignore[misc]
    )


def test_hand_over_returns_before_the_write_and_the_write_lands(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent, agent.data("unix") as client:
        writer = WriteBehind(client)
        gate = threading.Event()
        keys = [key(i) for i in range(6)]
        future = writer.submit(_job(keys, prepare=gate))
        # the writer is held at its gate: the caller already has its future, nothing stored yet
        assert not future.done()
        assert client.exists(keys, tenant="t") == [None] * 6
        gate.set()
        stored = future.result(timeout=30)
        assert (stored.chunks, stored.bytes, stored.skipped) == (6, 6 * SIZE, "")
        assert all(bytes(client.get(k, tenant="t")) == payload(k, SIZE) for k in keys)
        # chunks the agent holds are not sent again
        again = writer.submit(_job(keys)).result(timeout=30)
        assert again.chunks == 0
        assert agent.control().stats()["stats"]["tiers"]["cpu"]["puts"] == 6
        # the writer has its own connection: this one's reads never waited on its puts
        assert writer._client is not None and writer._client is not client
        writer.close()


def test_a_full_queue_drops_the_new_job_instead_of_blocking(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent, agent.data("unix") as client:
        writer = WriteBehind(client, max_pending_jobs=1)
        gate = threading.Event()
        first = writer.submit(_job([key(0)], prepare=gate))
        deadline = time.monotonic() + 10
        while writer._jobs.qsize() and time.monotonic() < deadline:  # the writer took it
            time.sleep(0.01)
        second = writer.submit(_job([key(1)]))  # waits in the queue
        t0 = time.monotonic()
        third = writer.submit(_job([key(2)]))  # no room: dropped at once
        assert time.monotonic() - t0 < 5 and third.done()
        assert third.result().skipped == "write-behind queue full" and writer.dropped_jobs == 1
        gate.set()
        assert first.result(timeout=30).chunks == 1 and second.result(timeout=30).chunks == 1
        assert writer.flush(30)
        assert client.exists([key(0), key(1), key(2)], tenant="t")[2] is None
        writer.close()


def test_an_agent_that_dies_costs_the_chunks_not_the_writer(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        client = agent.data("unix")
        writer = WriteBehind(client)
        assert writer.submit(_job([key(0)])).result(timeout=30).chunks == 1
        agent.kill9()
        lost = writer.submit(_job([key(1)])).result(timeout=30)
        assert lost.chunks == 0 and lost.skipped  # the reason, not an exception
        assert writer._thread is not None and writer._thread.is_alive()
        assert writer.failed_jobs == 1
        writer.close()
        client.close()


def test_a_hung_agent_costs_a_job_a_short_deadline_not_the_socket_timeout(tmp_path: Path) -> None:
    """A stopped agent (SIGSTOP: its sockets accept, nothing answers) fails the writer's call
    at its deadline and drops its connection; the next job's connection waits a short HELLO,
    not the socket timeout (10 minutes here); once the agent answers again jobs land."""
    with running_agent(tmp_path) as agent:
        client = agent.data("unix", timeout_s=SOCKET_TIMEOUT_S)
        writer = WriteBehind(client)
        assert writer.submit(_job([key(0)])).result(timeout=30).chunks == 1
        with stopped(agent):
            lost = guarded(lambda: writer.submit(_job([key(1)])).result())
            assert lost.chunks == 0 and "did not answer EXISTS" in lost.skipped
            assert writer._client is None  # dropped
            unreached = guarded(lambda: writer.submit(_job([key(2)])).result())
            assert unreached.chunks == 0 and "did not answer HELLO" in unreached.skipped
            assert writer.failed_jobs == 2
        assert writer.submit(_job([key(3)])).result(timeout=30).chunks == 1
        writer.close()
        client.close()


_ENGINE = textwrap.dedent(
    """
    import sys
    from kvctl.client import DataClient
    from kvctl.engines.writebehind import StoreJob, WriteBehind
    from tests.functional.agents import key, payload

    size = int(sys.argv[2])
    client = DataClient.connect(sys.argv[1])
    writer = WriteBehind(client, max_pending_jobs=64)
    i = 0
    while True:
        keys = [key(n, space=7) for n in range(i, i + 8)]
        job = StoreJob("t", keys, list(range(8)), [None] * 8, 16, size,
                       pack=lambda j, keys=keys: payload(keys[j], size))
        fut = writer.submit(job)
        if fut.result().chunks == 8:  # acknowledged by the agent: say so
            print(i, flush=True)
        i += 8
    """
)


def test_an_engine_killed_mid_write_leaves_only_whole_chunks(tmp_path: Path) -> None:
    size = 1 << 20
    with running_agent(tmp_path, "--cpu", str(2 << 30)) as agent:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.Popen(
            [sys.executable, "-c", _ENGINE, str(agent.state.data_unix), str(size)],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        acked: list[int] = []
        assert proc.stdout is not None
        for line in proc.stdout:  # let it write a while, then kill it between anything
            acked.append(int(line))
            if len(acked) >= 12:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        with agent.data("unix") as client:
            probe = [key(n, space=7) for n in range(0, acked[-1] + 8 + 64)]
            where = client.exists(probe, tenant="t")
            held = [k for k, t in zip(probe, where, strict=True) if t is not None]
            # every acknowledged chunk is there
            for start in acked:
                assert all(where[start + j] is not None for j in range(8))
            # and every chunk the agent holds is whole and right, acknowledged or not
            for k in held:
                assert bytes(client.get(k, tenant="t")) == payload(k, size)
            assert len(held) >= len(acked) * 8


def test_a_job_packs_straight_into_the_staging_segment(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent, agent.data("unix") as client:
        heard: list[bool] = []
        writer = WriteBehind(client, on_staging=lambda seg: heard.append(seg is not None))
        keys = [key(i, 3) for i in range(5)]
        where: list[bool] = []
        runs: list[tuple[int, int]] = []

        def pack_into(first: int, count: int, out: memoryview) -> None:
            staging = writer._client._staging if writer._client is not None else None
            assert staging is not None and out.nbytes == count * SIZE
            runs.append((first, count))
            with memoryview(staging) as seg:  # the chunks' place is inside the segment
                lo = buffer_address(seg)
                where.append(lo <= buffer_address(out) < lo + seg.nbytes)
            for n in range(count):
                out[n * SIZE : (n + 1) * SIZE] = payload(keys[first + n], SIZE)

        def no_pack(i: int) -> bytes:
            raise AssertionError("pack_into is set: pack must not run")

        job = _job(keys)
        job.pack, job.pack_into = no_pack, pack_into
        stored = writer.submit(job).result(timeout=30)
        assert (stored.chunks, stored.bytes, stored.skipped) == (5, 5 * SIZE, "")
        assert runs == [(0, 5)]  # consecutive chunks: one call packs them all
        assert where == [True] and heard == [True]  # the writer's connection's listener
        assert all(bytes(client.get(k, tenant="t")) == payload(k, SIZE) for k in keys)
        writer.close()
        assert heard == [True, False]  # told before its segment was unmapped


def _held_in_its_copy(keys: list[bytes]) -> tuple[StoreJob, threading.Event, threading.Event]:
    """A job whose copy into the staging segment sets ``inside`` and then waits for ``gate``."""
    inside, gate = threading.Event(), threading.Event()

    def pack_into(first: int, count: int, out: memoryview) -> None:
        inside.set()
        gate.wait(30)
        for n in range(count):
            out[n * SIZE : (n + 1) * SIZE] = payload(keys[first + n], SIZE)

    job = _job(keys)
    job.pack_into = pack_into
    return job, inside, gate


def test_a_close_that_times_out_leaves_the_writer_its_connection(tmp_path: Path) -> None:
    """A writer still copying into its staging segment when close() gives up waiting keeps its
    connection (closing it would unmap, and on CUDA unregister, the segment under the copy);
    the job still lands."""
    with running_agent(tmp_path) as agent, agent.data("unix") as client:
        writer = WriteBehind(client)
        keys = [key(i) for i in range(2)]
        job, inside, gate = _held_in_its_copy(keys)
        future = writer.submit(job)
        assert inside.wait(30)  # copying into the segment now
        writer.close(timeout_s=0.2)
        held = writer._client
        assert held is not None and not held.closed
        gate.set()
        assert future.result(timeout=30).chunks == 2
        assert all(bytes(client.get(k, tenant="t")) == payload(k, SIZE) for k in keys)
        # the thread ended since (it took the close's stop): the writer takes jobs again
        # (before, every later job was refused as 'write-behind closing' until another close)
        deadline = time.monotonic() + 30
        while writer._thread is not None and writer._thread.is_alive():
            assert time.monotonic() < deadline, "the writer's thread did not end"
            time.sleep(0.01)
        assert writer.submit(_job([key(7)])).result(timeout=30).chunks == 1
        assert writer.flush(30)
        writer.close()
        assert held.closed


def test_two_closes_at_once_never_close_the_connection_under_a_job(tmp_path: Path) -> None:
    """An engine dropped unclosed has its writer closed in the background by its finalizer
    (``close_in_background``), and the exit's close comes right after: the second waits for
    the first, so the job being written lands and the connection is closed after it. Before,
    the second found no thread left to wait for and closed the connection (unmapping the
    staging segment) under the job, which was lost. A job handed over meanwhile is refused,
    said so, not queued behind the thread's stop where nothing would write it."""
    with running_agent(tmp_path) as agent, agent.data("unix") as client:
        writer = WriteBehind(client)
        keys = [key(i) for i in range(2)]
        job, inside, gate = _held_in_its_copy(keys)
        future = writer.submit(job)
        assert inside.wait(30)  # copying into the staging segment now
        writer.close_in_background()
        # until the background close is stopping the writer (it then waits for it): a fixed
        # 0.2 s after its thread appeared was not always enough on a loaded machine
        deadline = time.monotonic() + 30
        while not writer._stopping:
            assert time.monotonic() < deadline, "the background close never began"
            time.sleep(0.01)
        refused = writer.submit(_job([key(5)])).result(timeout=30)
        assert (refused.chunks, refused.skipped) == (0, "write-behind closing")
        release = threading.Timer(0.3, gate.set)
        release.start()
        writer.close(timeout_s=30)  # the exit's close
        release.join()
        assert future.done() and future.result().chunks == 2
        assert writer._client is None
        assert all(bytes(client.get(k, tenant="t")) == payload(k, SIZE) for k in keys)
        assert client.exists([key(5)], tenant="t") == [None]
        # closed for good: a later job starts a writer again, as after any close
        assert writer.submit(_job([key(6)])).result(timeout=30).chunks == 1
        writer.close()


def test_runs_of_a_job_with_gaps_are_packed_apart_in_order(tmp_path: Path) -> None:
    """Chunks the agent holds already are skipped: the rest are packed run by run, each run in
    one call, back to back in the put."""
    with running_agent(tmp_path) as agent, agent.data("unix") as client:
        keys = [key(i, 4) for i in range(6)]
        for i in (2, 3):  # held already: the job's chunks 0-1 and 4-5 remain
            client.put(keys[i], payload(keys[i], SIZE), tenant="t")
        writer = WriteBehind(client)
        runs: list[tuple[int, int]] = []

        def pack_into(first: int, count: int, out: memoryview) -> None:
            runs.append((first, count))
            for n in range(count):
                out[n * SIZE : (n + 1) * SIZE] = payload(keys[first + n], SIZE)

        job = _job(keys)
        job.pack_into = pack_into
        stored = writer.submit(job).result(timeout=30)
        assert (stored.chunks, runs) == (4, [(0, 2), (4, 2)])
        assert all(bytes(client.get(k, tenant="t")) == payload(k, SIZE) for k in keys)
        writer.close()


def test_flush_and_close_keep_their_timeouts_behind_a_full_queue(tmp_path: Path) -> None:
    """The writer is stuck (a hung agent) and its queue is full: flush(t) and close(t) return
    within about t instead of first waiting for room in the queue (a review saw flush(5) take
    65 s and close() 39 s)."""
    with running_agent(tmp_path) as agent, agent.data("unix") as client:
        writer = WriteBehind(client, max_pending_jobs=1)
        gate = threading.Event()
        first = writer.submit(_job([key(0)], prepare=gate))  # the writer is stuck in it
        deadline = time.monotonic() + 10
        while writer._jobs.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        writer.submit(_job([key(1)]))  # fills the queue
        t0 = time.monotonic()
        assert writer.flush(0.5) is False
        flushed_s = time.monotonic() - t0
        t0 = time.monotonic()
        writer.close(timeout_s=0.5)
        closed_s = time.monotonic() - t0
        gate.set()
        assert first.result(timeout=30).chunks == 1
        assert flushed_s < 5 and closed_s < 5, (flushed_s, closed_s)
        writer.close()


_EXITS_AT_ONCE = textwrap.dedent(
    """
    import sys
    from kvctl.client import DataClient
    from kvctl.engines.writebehind import StoreJob, WriteBehind
    from tests.functional.agents import key, payload

    client = DataClient.connect(sys.argv[1])
    writer = WriteBehind(client, max_pending_jobs=8)
    for j in range(3):
        keys = [key(n, space=9) for n in range(j * 40, j * 40 + 40)]
        writer.submit(StoreJob("t", keys, list(range(40)), [None] * 40, 16, 65536,
                               pack=lambda i, keys=keys: payload(keys[i], 65536)))
    sys.exit(0)  # no flush, no close: what was handed over must still be written
    """
)


def test_what_an_engine_handed_over_is_written_when_it_exits(tmp_path: Path) -> None:
    with running_agent(tmp_path) as agent:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        proc = subprocess.run(
            [sys.executable, "-c", _EXITS_AT_ONCE, str(agent.state.data_unix)],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        with agent.data("unix") as client:
            keys = [key(n, space=9) for n in range(120)]
            assert all(t is not None for t in client.exists(keys, tenant="t"))
            assert all(bytes(client.get(k, tenant="t")) == payload(k, 65536) for k in keys[::17])


OUT_OF_MEMORY_WRITER = r"""
import json, resource, sys
from kvctl.client import DataClient
from kvctl.engines.writebehind import StoreJob, WriteBehind
from tests.functional.agents import key, payload

MiB = 1 << 20
SIZE = 16 * MiB  # 4 a batch: one 64 MiB buffer for the put over the socket

def job(keys):
    data = [payload(k, SIZE) for k in keys]  # allocated before any limit
    return StoreJob(tenant="t", keys=keys, indices=list(range(len(keys))),
                    parents=[None] * len(keys), chunk_tokens=16, chunk_bytes=SIZE,
                    pack=data.__getitem__)

writer = WriteBehind(DataClient.connect(sys.argv[1], use_shm=False))
first = writer.submit(job([key(0, 14)])).result(60)  # the thread and its connection are up
connection = writer._client
keys = [key(i, 15) for i in range(4)]
short = job(keys)
with open("/proc/self/status") as f:
    vm_bytes = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
# room for the put's small allocations, not for its 64 MiB buffer
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + 32 * MiB, resource.RLIM_INFINITY))
failed = writer.submit(short).result(60)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
report = {"first": first.chunks, "skipped": failed.skipped, "failed_jobs": writer.failed_jobs,
          "kept": writer._client is connection and not connection.closed}
again = writer.submit(job(keys)).result(60)
report["again"] = [again.chunks, again.skipped]
report["kept_after"] = writer._client is connection
writer.close()
print(json.dumps(report))
"""


def test_a_writer_short_of_memory_keeps_its_connection(tmp_path: Path) -> None:
    """A put over the socket that this process cannot allocate a buffer for fails before
    anything is sent (ClientOutOfMemory): the connection stays in step, so the writer keeps
    it (and its staging back-off) instead of dropping it as if the agent had gone, which cost
    a reconnect (HELLO, the arena mapped again, a new staging segment tried at once) on a
    process already short of memory. Memory is made short for real: RLIMIT_AS on a child
    process that is the engine."""
    with running_agent(tmp_path, "--cpu", "128MiB") as agent:
        report, _ = child_report(OUT_OF_MEMORY_WRITER, str(agent.state.data_unix))
    assert report["first"] == 1
    assert "could not allocate" in report["skipped"], report
    assert report["failed_jobs"] == 1
    assert report["kept"], "the writer dropped its connection for this process's memory"
    assert report["again"] == [4, ""] and report["kept_after"], report
