"""The agent benchmark: a real agent process driven by this process through the SDK.

For each chunk size, with references measured in the same run and interleaved with the figures
they are divided by:

* ``shm_get`` / ``shm_put``: the Unix socket with shared memory. A get takes a read lease, copies
  the chunk from the agent's arena into the caller's preallocated buffer and releases the lease;
  a put copies into the client's staging segment and the agent copies it into its arena.
  Reference ``memcpy``: the same chunks copied between buffers of this process on every core
  at once (each thread a share of the chunks; numpy's copies run without the GIL), since the
  agent and the client split a large copy over threads too.
* ``tcp_get`` / ``tcp_put``: the binary protocol over loopback TCP; the agent sends a chunk
  straight from its arena, the client reads it into a preallocated buffer. Reference ``socket``
  / ``socket_put``: the agent's own send/recv loop without the protocol and the store, so an
  upper bound for it: a second process (``raw_peer``) serving each connection from a thread, a
  get answered with one ``send_all`` (sendmsg) of a reply header and the chunk from a memfd
  arena holding as many distinct chunks as the agent's working set, a put read with
  ``recv_exactly`` into one reused buffer; this side uses the same calls on a socket set up as
  ``DataClient.connect`` sets up its own. Same chunk sizes, same bytes per sample. ``iperf3``
  (when installed): one C stream over loopback, the host's ceiling for a single connection.
* ``miss_store``: what an engine pays on a miss after prefilling: an EXISTS of the prompt's
  chunks, then one ``put_many`` of all of them (parents chained, fresh keys), over shared
  memory and over TCP. Reference: the same multi-threaded memcpy of the same bytes.
* ``reads_under_demotion``: a second agent whose small cpu tier sits over a disk tier; one
  client reads a few hot cpu chunks over shared memory, one get at a time, timing each, while
  another process puts fresh chunks over TCP as fast as it can, so every put demotes a chunk to
  disk. Reference: the same reads with no writer, in alternating phases of the same run
  (p50/p99 read latency of each, and the writer's put rate).
* ``reads_under_promotion``: the same, the other process leasing chunks that are on disk over
  shared memory, so each lease promotes a chunk into cpu and demotes another to make its room.
* ``reads_under_read_promotion``: the same with plain reads of those chunks over TCP (a remote
  engine's GET, a peer's pull), each promoting one.
* ``lookups_under_bulk``: lookups over the Unix socket, one after another, while an operator's
  ``flush --demote`` writes a full cpu tier to disk, then while a ``resize`` shrinks the refilled
  tier to an eighth: each lookup's wait next to the operation's own time (a lookup held for the
  whole batch waits as long as it), with a quiet phase of lookups as the reference.
* ``lookup``: longest-prefix lookups of a fully cached 512-chunk chain over the data plane, each
  a round trip (Unix socket and TCP), and batched, 32 chains a frame (``lookup_many``); and the
  p50 of a same-host engine's lookup that leases a 64-chunk prefix (``lookup_lease``, 5 ms
  apart, as prefills space them), beside a plain lookup of the same keys.
  Reference ``raw_round_trips``: a bare 20-byte ping-pong between two Python processes over a
  Unix socket pair, the ceiling for one-round-trip-per-lookup on this host.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvctl.bench.common import alternating, figure, host_info, spawned_agent
from kvctl.errors import InvalidArgument
from kvctl.ports import free_loopback_port
from kvctl.wire.protocol import HEADER_BYTES, PeerClosed, recv_exactly, send_all

DEFAULT_SIZES_BYTES = (4 << 20, 32 << 20)
DEFAULT_BYTES_PER_SIZE = 256 << 20
DEFAULT_REPEATS = 3
LOOKUP_CHAIN_CHUNKS = 512
LOOKUP_BATCH = 32
#: a leased lookup's prefix (a 16k-token prompt in 256-token chunks) and the pause after each
LEASE_PREFIX_CHUNKS = 64
LEASE_PAUSE_SECONDS = 0.005
TARGETS = {
    "shm_get_vs_memcpy_ratio": 0.8,
    "tcp_get_vs_socket_ratio": 0.7,
    "lookup_per_second": 20_000,
}
#: a raw-reference request: op, offset in the peer's arena (gets), bytes
_RAW_REQUEST = struct.Struct("<BQQ")
_RAW_GET, _RAW_PUT = 1, 2
#: the raw reference's client socket timeout: DataClient.connect's default, so both poll alike
RAW_TIMEOUT_S = 30.0
#: threads of the memcpy reference: every core (the copies run without the GIL)
MEMCPY_THREADS = max(1, os.cpu_count() or 1)
IPERF3_MAX_BLOCK_BYTES = 1 << 20
#: chunks of a miss-path store carry this many tokens, as an engine's default chunk does
MISS_CHUNK_TOKENS = 256
#: reads under demotion: chunk size, the cpu tier (in chunks) over the disk, the hot chunks read
DEMOTION_CHUNK_BYTES = 1 << 20
DEMOTION_CPU_CHUNKS = 32
DEMOTION_HOT_CHUNKS = 4
#: chunks the lease writer cycles through: three times the cpu tier, so most are on disk
DEMOTION_COLD_CHUNKS = 3 * DEMOTION_CPU_CHUNKS
#: cpu tier, in 1 MiB chunks, that ``lookups_under_bulk`` flushes and shrinks
BULK_CHUNKS = 128


def run_agent_bench(
    sizes_bytes: list[int],
    *,
    bytes_per_size: int = DEFAULT_BYTES_PER_SIZE,
    repeats: int = DEFAULT_REPEATS,
    lookup_seconds: float = 2.0,
    demotion_seconds: float = 1.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    if not sizes_bytes or any(s <= 0 for s in sizes_bytes):
        raise InvalidArgument("give at least one positive chunk size")
    if repeats < 1 or bytes_per_size <= 0 or lookup_seconds <= 0 or demotion_seconds <= 0:
        raise InvalidArgument("repeats, bytes per size and lookup seconds must be positive")
    say = progress or (lambda _msg: None)
    started_s = time.perf_counter()
    per_size = {s: max(2, bytes_per_size // s) for s in sizes_bytes}
    # room for one size's working set twice (puts of fresh keys land beside the get set)
    cpu_bytes = max(2 * n * s for s, n in per_size.items()) + (64 << 20)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-agent-") as tmp:
        say(f"starting an agent with a {cpu_bytes >> 20} MiB cpu tier")
        raw_arena_bytes = max(n * s for s, n in per_size.items())
        with (
            _agent(Path(tmp), cpu_bytes) as (state, token),
            raw_reference(raw_arena_bytes) as raw,
        ):
            from kvctl.client import AgentClient, DataClient

            assert state.data_unix is not None and state.data_tcp is not None
            with (
                DataClient.connect(state.data_unix, token=token) as shm,
                DataClient.connect(state.data_tcp, token=token) as tcp,
                AgentClient(state.control_url, token=token) as ctl,
                ThreadPoolExecutor(MEMCPY_THREADS) as workers,  # the memcpy reference's
            ):
                if not shm.shm:
                    raise RuntimeError("the agent did not offer shared memory")
                for size in sizes_bytes:
                    say(f"{size >> 20} MiB chunks: {per_size[size]} per sample")
                    results.append(
                        _bench_size(size, per_size[size], repeats, shm, tcp, ctl, raw, workers)
                    )
                say("lookups of a 512-chunk chain")
                lookups = _bench_lookups(shm, tcp, lookup_seconds)
        say("cpu reads while another client's puts demote to disk")
        under_demotion = _bench_reads_under_demotion(Path(tmp), repeats, demotion_seconds)
        say("cpu reads while another client's leases promote from disk (and demote)")
        under_promotion = _bench_reads_under_demotion(
            Path(tmp), repeats, demotion_seconds, writer="lease"
        )
        say("cpu reads while another client's plain reads promote from disk (and demote)")
        under_read_promotion = _bench_reads_under_demotion(
            Path(tmp), repeats, demotion_seconds, writer="get"
        )
        say("lookups while an operator flushes cpu to disk, then shrinks it")
        under_bulk = _bench_lookups_under_bulk(Path(tmp), demotion_seconds)
        largest = max(sizes_bytes)
        say("iperf3 over loopback (when installed)")
        iperf3 = iperf3_loopback(per_size[largest] * largest, largest)
    return {
        "benchmark": "agent",
        **host_info(),
        "bytes_per_size": bytes_per_size,
        "repeats": repeats,
        "elapsed_seconds": time.perf_counter() - started_s,
        "results": results,
        **lookups,
        "reads_under_demotion": under_demotion,
        "reads_under_promotion": under_promotion,
        "reads_under_read_promotion": under_read_promotion,
        "lookups_under_bulk": under_bulk,
        "iperf3": iperf3,
        "targets": TARGETS,
        "notes": [
            f"each bytes-per-second figure is the median of {repeats} samples, each moving "
            "bytes_per_size; figures and references alternate, so drift hits both alike",
            "gets read into preallocated buffers (get_into), as an engine filling its own "
            "buffers does; puts send from preallocated buffers",
            "socket / socket_put (the raw reference) run the agent's own send/recv loop with no "
            "protocol and no store: a second process serving each connection from a thread, "
            "sending a reply header and the chunk with one sendmsg from a memfd arena holding as "
            "many distinct chunks as the agent's working set, the client reading into the same "
            "preallocated buffers with recv_exactly on a socket set up as DataClient's",
            "miss_store_*: what an engine pays to store a prompt it just prefilled: one EXISTS of "
            "the chunks, then one put_many of all of them (parents chained, fresh keys), next "
            "to the memcpy reference of the same bytes",
            f"memcpy (the shm reference): the same chunks copied on {MEMCPY_THREADS} threads at "
            "once, each a share of them into buffers of its own; kvctl splits a copy of 4 MiB "
            "or more over up to 4 threads too (copy_bytes)",
            "the agent and this process share the host's cores: on a 2-core VM they compete "
            "with each other and with anything else running",
        ],
    }


# --- pieces -----------------------------------------------------------------------------------
@contextlib.contextmanager
def _agent(tmp: Path, cpu_bytes: int) -> Iterator[tuple[Any, str]]:
    argv = ["--cpu", str(cpu_bytes), "--disk", "0", "--log-level", "warning"]
    with spawned_agent(tmp / "agent", *argv) as state:
        yield state, ""


def raw_peer(arena_bytes: int) -> None:
    """The raw-socket reference's server process, laid out as the agent is: ``arena_bytes`` of
    written memory in a memfd mapping (as the cpu tier's arena), a listener on loopback and one
    thread per connection. A get sends a reply header and the asked arena bytes with one
    ``send_all`` (sendmsg of both, as the agent sends header, metadata and chunk from its arena);
    a put's bytes are read with ``recv_exactly`` into one reused buffer, as the agent reads them
    before its store copies them. No protocol, no store, no lock. It exits when its stdin closes
    (the benchmark went away)."""
    arena = _memfd_arena(arena_bytes)
    srv = socket.create_server(("127.0.0.1", 0))
    sys.stdout.write(f"{srv.getsockname()[1]}\n")
    sys.stdout.flush()
    threading.Thread(target=_exit_at_stdin_eof, daemon=True).start()
    while True:
        conn, _ = srv.accept()
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_raw_serve, args=(conn, arena), daemon=True).start()


def _exit_at_stdin_eof() -> None:
    sys.stdin.read()
    os._exit(0)


def _memfd_arena(size_bytes: int) -> mmap.mmap:
    """Committed, written shared memory, made as the cpu tier makes its arena."""
    fd = os.memfd_create("kvctl-bench-raw", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size_bytes)
        os.posix_fallocate(fd, 0, size_bytes)
        arena = mmap.mmap(fd, size_bytes)
    finally:
        os.close(fd)
    np.frombuffer(arena, dtype=np.uint8)[:] = 1  # real pages, as chunks put into an arena
    return arena


def _raw_serve(conn: socket.socket, arena: mmap.mmap) -> None:
    view = memoryview(arena)
    head = memoryview(bytearray(_RAW_REQUEST.size))
    reply = bytes(HEADER_BYTES)  # a reply is one frame header, as the agent's is at least
    buf = bytearray()
    try:
        while True:
            first = conn.recv_into(head, _RAW_REQUEST.size)  # idle wait, as the agent's
            if first == 0:
                return
            recv_exactly(conn, head[first:])
            op, offset, nbytes = _RAW_REQUEST.unpack(head)
            if op == _RAW_GET:
                send_all(conn, [reply, view[offset : offset + nbytes]])
                continue
            if len(buf) < nbytes:
                buf = bytearray(nbytes)
            recv_exactly(conn, memoryview(buf)[:nbytes])
            send_all(conn, [reply])
    except (PeerClosed, OSError):
        return
    finally:
        conn.close()


class RawClient:
    """This process's end of the raw-socket reference: a socket set up as ``DataClient.connect``
    sets up its own (timeout, TCP_NODELAY), the same ``send_all`` / ``recv_exactly`` calls."""

    def __init__(self, port: int, *, timeout_s: float = RAW_TIMEOUT_S) -> None:
        self.port = port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._head = memoryview(bytearray(HEADER_BYTES))

    def get_into(self, offset: int, out: memoryview) -> None:
        """The peer's arena bytes at ``offset``, ``out.nbytes`` of them, read into ``out``."""
        send_all(self.sock, [_RAW_REQUEST.pack(_RAW_GET, offset, out.nbytes)])
        recv_exactly(self.sock, self._head)
        recv_exactly(self.sock, out)

    def put(self, data: memoryview) -> None:
        send_all(self.sock, [_RAW_REQUEST.pack(_RAW_PUT, 0, data.nbytes), data])
        recv_exactly(self.sock, self._head)

    def close(self) -> None:
        self.sock.close()


class RawStreams:
    """Reads of one raw peer's arena split over ``streams`` connections at once, as a pull
    splits over its streams: the raw-socket bound of a parallel pull."""

    def __init__(self, first: RawClient, streams: int) -> None:
        self.clients = [first] + [RawClient(first.port) for _ in range(streams - 1)]
        self._workers = ThreadPoolExecutor(len(self.clients))

    def get_seconds(self, spans: list[tuple[int, int]], sink: memoryview) -> float:
        """Wall seconds to read the arena's ``[lo, hi)`` into ``sink[lo:hi]`` for each span,
        one connection per span, all at once."""
        if len(spans) > len(self.clients):
            raise ValueError(f"{len(spans)} spans for {len(self.clients)} connections")

        def one(i: int) -> None:
            lo, hi = spans[i]
            self.clients[i].get_into(lo, sink[lo:hi])

        started = time.perf_counter()
        list(self._workers.map(one, range(len(spans))))
        return max(time.perf_counter() - started, 1e-9)

    def close(self) -> None:
        self._workers.shutdown()
        for c in self.clients[1:]:  # the first is raw_reference's to close
            c.close()


@contextlib.contextmanager
def raw_reference(arena_bytes: int) -> Iterator[RawClient]:
    """A raw peer process (``raw_peer``) with an arena of ``arena_bytes``, and a client to it;
    the process is killed on the way out."""
    proc = subprocess.Popen(
        [sys.executable, "-c", f"from kvctl.bench.agent import raw_peer; raw_peer({arena_bytes})"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip():
            raise RuntimeError("the raw-socket reference process did not start")
        client = RawClient(int(line))
        try:
            yield client
        finally:
            client.close()
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def iperf3_loopback(nbytes: int, block_bytes: int, *, timeout_s: float = 60.0) -> dict[str, Any]:
    """One iperf3 TCP stream over loopback moving ``nbytes`` in writes of ``block_bytes`` (at
    most 1 MiB, iperf3's limit): C on both ends, the ceiling of one stream on this host. Skipped
    (with the reason) when iperf3 is not installed or does not run."""
    exe = shutil.which("iperf3")
    if exe is None:
        return {"skipped": "iperf3 is not installed"}
    block_bytes = max(1, min(block_bytes, IPERF3_MAX_BLOCK_BYTES))
    port = free_loopback_port()
    server = subprocess.Popen(
        [exe, "-s", "-1", "-B", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    argv = [exe, "-c", "127.0.0.1", "-p", str(port), "-n", str(nbytes), "-l", str(block_bytes)]
    try:
        deadline = time.monotonic() + 5.0
        while True:  # the server needs a moment to listen; a refused connection is retried
            try:
                done = subprocess.run(
                    [*argv, "-J"], capture_output=True, text=True, timeout=timeout_s, check=False
                )
                out = json.loads(done.stdout or "{}")
            except (subprocess.TimeoutExpired, ValueError) as exc:
                return {"skipped": f"iperf3 failed: {exc}"}
            error = out.get("error") or ("" if done.returncode == 0 else done.stderr.strip())
            if not error:
                break
            if time.monotonic() > deadline or server.poll() is not None:
                return {"skipped": f"iperf3 failed: {error}"}
            time.sleep(0.1)
    finally:
        server.kill()
        server.wait()
    got = out["end"]["sum_received"]
    return {
        "bytes_per_second": float(got["bytes"]) / max(float(got["seconds"]), 1e-9),
        "bytes": int(got["bytes"]),
        "block_bytes": block_bytes,
        "streams": 1,
    }


def _bench_size(
    size: int,
    n: int,
    repeats: int,
    shm: Any,
    tcp: Any,
    ctl: Any,
    raw: RawClient,
    workers: ThreadPoolExecutor,
) -> dict[str, Any]:
    # n distinct buffers, so memcpy reads as much distinct memory as the agent's arena holds
    # (a few reused buffers would stay in the CPU cache and flatter the reference)
    sources = [np.full(size, i % 251 + 1, dtype=np.uint8) for i in range(n)]
    sinks = [np.ones(size, dtype=np.uint8) for _ in range(2)]  # touched before timing
    threads = MEMCPY_THREADS
    # the reference's own sinks, two per thread (touched), and each thread's share of chunks
    thread_sinks = [[np.ones(size, dtype=np.uint8) for _ in range(2)] for _ in range(threads)]
    shares = [range(n * t // threads, n * (t + 1) // threads) for t in range(threads)]
    samples: dict[str, list[float]] = {}
    seq = [0]

    def timed(name: str, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            t = time.perf_counter()
            fn()
            samples.setdefault(name, []).append(time.perf_counter() - t)

        return run

    def fresh_keys(tag: str) -> list[bytes]:
        seq[0] += 1
        return [_key(f"{tag}:{size}:{seq[0]}:{i}") for i in range(n)]

    def memcpy_share(t: int) -> None:
        for i in shares[t]:
            np.copyto(thread_sinks[t][i % 2], sources[i])

    def memcpy() -> None:
        list(workers.map(memcpy_share, range(threads)))

    sink_views = [memoryview(s) for s in sinks]
    source_views = [memoryview(s) for s in sources]

    def raw_get() -> None:
        for i in range(n):  # chunk i from its own place in the peer's arena, as from the agent's
            raw.get_into(i * size, sink_views[i % 2])

    def raw_put() -> None:
        for view in source_views:
            raw.put(view)

    put_keys: dict[str, list[bytes]] = {}

    def put_with(client: Any, name: str) -> Callable[[], None]:
        def run() -> None:
            keys = put_keys[name]
            for k, src in zip(keys, sources, strict=True):
                client.put(k, src)

        return run

    def get_with(client: Any, keys: list[bytes]) -> Callable[[], None]:
        def run() -> None:
            for i, k in enumerate(keys):
                got = client.get_into([k], [sinks[i % 2]])
                if got[0] != size:
                    raise RuntimeError(f"chunk {k.hex()} missing from the agent")

        return run

    def miss_store_with(client: Any, name: str) -> Callable[[], None]:
        def run() -> None:  # what an engine does after prefilling a prompt nothing held
            keys = put_keys[name]
            held = client.exists(keys)
            todo = [i for i, tier in enumerate(held) if tier is None]
            parents = [None, *keys[:-1]]
            outcomes = client.put_many(
                [(keys[i], sources[i]) for i in todo],
                parents=[parents[i] for i in todo],
                tokens=MISS_CHUNK_TOKENS,
                depths=todo,
            )
            if len(todo) != n or any(o.status != "stored" for o in outcomes):
                raise RuntimeError(f"{name}: the agent did not store every chunk")

        return run

    for name, client in (("miss_store_shm", shm), ("miss_store_tcp", tcp)):
        put_keys[name] = fresh_keys(name)  # untimed first pass: staging segment, socket buffers
        miss_store_with(client, name)()
        ctl.evict(put_keys[name])
        for r in range(repeats):
            put_keys[name] = fresh_keys(name)
            pair = [timed("miss_store_memcpy", memcpy), timed(name, miss_store_with(client, name))]
            for step in pair if r % 2 == 0 else reversed(pair):
                step()
            ctl.evict(put_keys[name])

    put_cases = (("shm_put", shm, "memcpy_put", memcpy), ("tcp_put", tcp, "socket_put", raw_put))
    for name, client, ref_name, ref in put_cases:
        for r in range(repeats):  # fresh keys each sample: a second put of a key stores nothing
            put_keys[name] = fresh_keys(name)
            pair = [timed(ref_name, ref), timed(name, put_with(client, name))]
            for step in pair if r % 2 == 0 else reversed(pair):
                step()
            ctl.evict(put_keys[name])  # not timed: room for the next sample
    get_keys = fresh_keys("get")
    for k, src in zip(get_keys, sources, strict=True):
        shm.put(k, src)
    _check_round_trip(shm, tcp, get_keys[0], sources[0])
    for warm_up in (memcpy, raw_get, get_with(shm, get_keys), get_with(tcp, get_keys)):
        warm_up()  # not timed: page faults and socket buffer growth happen here
    alternating(repeats, timed("memcpy", memcpy), timed("shm_get", get_with(shm, get_keys)))
    alternating(repeats, timed("socket", raw_get), timed("tcp_get", get_with(tcp, get_keys)))
    ctl.evict(get_keys)

    def rate(name: str) -> float:
        return float(figure(samples[name], n, size)["bytes_per_second"])

    row: dict[str, Any] = {
        "chunk_bytes": size,
        "chunks_per_sample": n,
        "shm_get_bytes_per_second": rate("shm_get"),
        "shm_put_bytes_per_second": rate("shm_put"),
        "memcpy_bytes_per_second": rate("memcpy"),
        "memcpy_put_bytes_per_second": rate("memcpy_put"),
        "tcp_get_bytes_per_second": rate("tcp_get"),
        "tcp_put_bytes_per_second": rate("tcp_put"),
        "socket_bytes_per_second": rate("socket"),
        "socket_put_bytes_per_second": rate("socket_put"),
    }
    row["shm_get_vs_memcpy_ratio"] = (
        row["shm_get_bytes_per_second"] / row["memcpy_bytes_per_second"]
    )
    row["tcp_get_vs_socket_ratio"] = (
        row["tcp_get_bytes_per_second"] / row["socket_bytes_per_second"]
    )
    row["shm_put_vs_memcpy_ratio"] = (
        row["shm_put_bytes_per_second"] / row["memcpy_put_bytes_per_second"]
    )
    row["tcp_put_vs_socket_ratio"] = (
        row["tcp_put_bytes_per_second"] / row["socket_put_bytes_per_second"]
    )
    for transport in ("shm", "tcp"):
        store_s = statistics.median(samples[f"miss_store_{transport}"])
        row[f"miss_store_{transport}_seconds"] = store_s
        row[f"miss_store_{transport}_bytes_per_second"] = rate(f"miss_store_{transport}")
    row["miss_store_memcpy_seconds"] = statistics.median(samples["miss_store_memcpy"])
    row["miss_store_memcpy_bytes_per_second"] = rate("miss_store_memcpy")
    for transport in ("shm", "tcp"):
        row[f"miss_store_{transport}_vs_memcpy_ratio"] = (
            row[f"miss_store_{transport}_bytes_per_second"]
            / row["miss_store_memcpy_bytes_per_second"]
        )
    row["samples_seconds"] = samples
    return row


def _check_round_trip(shm: Any, tcp: Any, key: bytes, src: np.ndarray) -> None:
    """A benchmark of wrong bytes is worthless: check one chunk both ways before timing."""
    for client in (shm, tcp):
        out = np.zeros_like(src)
        client.get_into([key], [out])
        if not np.array_equal(out, src):
            raise RuntimeError("the agent returned different bytes than were put")


def _bench_reads_under_demotion(
    tmp: Path, repeats: int, seconds: float, writer: str = "put"
) -> dict[str, Any]:
    """p50/p99 latency of single-chunk shm gets of hot cpu chunks, with no writer (reference)
    and while a writer process demotes chunks to disk (``demotion_writer``), alternating
    phases of ``seconds``; the writer's operations per second while it ran. ``writer``: "put"
    (fresh chunks, each demoting one), "lease" or "get" (chunks on disk, each promoted into cpu
    and demoting one there to make its room; "get" reads them plainly, over TCP)."""
    from kvctl.client import AgentClient, DataClient
    from kvctl.quantiles import nearest_rank

    size = DEMOTION_CHUNK_BYTES
    argv = ["--cpu", str(DEMOTION_CPU_CHUNKS * size), "--disk", str(4 << 30)]
    argv += ["--log-level", "warning"]
    quiet: list[float] = []
    busy: list[float] = []
    writer_puts = 0
    writer_seconds = 0.0
    with spawned_agent(tmp / f"{writer}-demotion-agent", *argv) as state:
        assert state.data_unix is not None and state.data_tcp is not None
        with (
            DataClient.connect(state.data_unix) as shm,
            AgentClient(state.control_url) as ctl,
        ):
            hot = [_key(f"hot:{i}") for i in range(DEMOTION_HOT_CHUNKS)]
            src = np.full(size, 7, dtype=np.uint8)
            if writer != "put":  # the chunks it leases or reads, most of them on disk by now
                for n in range(DEMOTION_COLD_CHUNKS):
                    shm.put(_key(f"cold:{n}"), src)
            for k in hot:
                shm.put(k, src)
            sink = np.ones(size, dtype=np.uint8)

            def read_for(into: list[float]) -> None:
                end = time.perf_counter() + seconds
                i = 0
                while time.perf_counter() < end:
                    t = time.perf_counter()
                    if shm.get_into([hot[i % len(hot)]], [sink])[0] != size:
                        raise RuntimeError("a hot chunk left the cpu tier")
                    into.append(time.perf_counter() - t)
                    i += 1

            address = state.data_unix if writer == "lease" else state.data_tcp
            for r in range(repeats):
                for phase in ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet"):
                    if phase == "quiet":
                        read_for(quiet)
                        continue
                    code = (
                        "from kvctl.bench.agent import demotion_writer; "
                        f"demotion_writer({str(address)!r}, {size}, {r}, {writer!r})"
                    )
                    proc = subprocess.Popen(
                        [sys.executable, "-c", code],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    try:
                        assert proc.stdin is not None and proc.stdout is not None
                        if proc.stdout.readline().strip() != "ready":
                            raise RuntimeError("the demotion writer did not start")
                        read_for(busy)
                        proc.stdin.close()  # stop
                        puts, secs = proc.stdout.readline().split()
                        writer_puts += int(puts)
                        writer_seconds += float(secs)
                    finally:
                        proc.wait(30)
                        if proc.stdout is not None:
                            proc.stdout.close()
            tiers = ctl.stats()["stats"]["tiers"]
            demotions = tiers["disk"]["demotions"]
            promotions = tiers["cpu"]["promotions"]
    quiet.sort()
    busy.sort()
    return {
        "chunk_bytes": size,
        "cpu_tier_chunks": DEMOTION_CPU_CHUNKS,
        "hot_chunks": DEMOTION_HOT_CHUNKS,
        "phase_seconds": seconds,
        "reads_quiet": len(quiet),
        "reads_busy": len(busy),
        "read_p50_seconds_quiet": nearest_rank(quiet, 0.5),
        "read_p99_seconds_quiet": nearest_rank(quiet, 0.99),
        "read_p50_seconds_busy": nearest_rank(busy, 0.5),
        "read_p99_seconds_busy": nearest_rank(busy, 0.99),
        "writer": writer,
        f"writer_{writer}s_per_second": writer_puts / writer_seconds if writer_seconds else None,
        "demotions_to_disk": demotions,
        "promotions_to_cpu": promotions,
    }


def _bench_lookups_under_bulk(tmp: Path, quiet_seconds: float) -> dict[str, Any]:
    """p50/p99/max of back-to-back lookups (the store's lock, nothing else) with nothing else
    running, then during ``flush cpu --demote`` of a full cpu tier, then during a ``resize``
    of the refilled tier to an eighth of its size (both over the control API)."""
    from kvctl.client import AgentClient, DataClient
    from kvctl.quantiles import nearest_rank

    size, chunks = DEMOTION_CHUNK_BYTES, BULK_CHUNKS
    argv = ["--cpu", str(chunks * size), "--disk", str(4 * chunks * size)]
    out: dict[str, Any] = {"chunk_bytes": size, "cpu_tier_chunks": chunks}
    with spawned_agent(tmp / "bulk-agent", *argv, "--log-level", "warning") as state:
        assert state.data_unix is not None
        with (
            DataClient.connect(state.data_unix) as client,
            AgentClient(state.control_url) as ctl,
        ):
            probe = [_key(f"bulk:1:{i}") for i in range(8)]  # the chunks flushed
            src = np.full(size, 5, dtype=np.uint8)

            def fill(round_: int) -> None:
                """A cpu tier full of fresh chunks (a put of a cached key only refreshes it)."""
                for i in range(chunks):
                    client.put(_key(f"bulk:{round_}:{i}"), src)

            def timed(operation: Callable[[], Any] | None) -> tuple[list[float], float]:
                """Lookups back to back while ``operation`` runs (None: for quiet_seconds)."""
                waits: list[float] = []
                stop = threading.Event()

                def looker() -> None:
                    with DataClient.connect(state.data_unix) as mine:  # type: ignore[arg-type]
                        while not stop.is_set():
                            t = time.perf_counter()
                            mine.lookup(probe)
                            waits.append(time.perf_counter() - t)

                thread = threading.Thread(target=looker, daemon=True)
                thread.start()
                t0 = time.perf_counter()
                if operation is None:
                    time.sleep(quiet_seconds)
                else:
                    operation()
                took = time.perf_counter() - t0
                stop.set()
                thread.join(30)
                return sorted(waits), took

            phases = {
                "quiet": None,
                "flush": lambda: ctl.flush("cpu", demote=True),
                "resize": lambda: ctl.resize("cpu", chunks // 8 * size),
            }
            for round_, (name, operation) in enumerate(phases.items()):
                if name != "quiet":
                    fill(round_)
                waits, took = timed(operation)
                out[name] = {
                    "seconds": took,
                    "lookups": len(waits),
                    "lookup_p50_seconds": nearest_rank(waits, 0.5) if waits else None,
                    "lookup_p99_seconds": nearest_rank(waits, 0.99) if waits else None,
                    "lookup_max_seconds": waits[-1] if waits else None,
                }
            tiers = ctl.stats()["stats"]["tiers"]
            out["demotions_to_disk"] = tiers["disk"]["demotions"]
    return out


def demotion_writer(address: str, size: int, seed: int, kind: str = "put") -> None:
    """The busy phase's writer process until its stdin closes, then prints how many
    operations in how many seconds: "put" puts fresh chunks (over TCP), "lease" leases the
    cold chunks in turn (over the Unix socket), "get" reads them (over TCP, a plain read as a
    remote engine's or a peer's pull is): each one on disk promoted into cpu."""
    from kvctl.client import DataClient

    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    data = np.full(size, 3, dtype=np.uint8)
    cold = [_key(f"cold:{i}") for i in range(DEMOTION_COLD_CHUNKS)]
    n = 0
    with DataClient.connect(address) as client:
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        t = time.perf_counter()
        while not stop.is_set():
            if kind == "put":
                client.put(_key(f"demote:{seed}:{n}"), data)
            elif kind == "get":
                client.get_into([cold[n % len(cold)]], [data])
            else:
                with client.leased([cold[n % len(cold)]]):
                    pass
            n += 1
        sys.stdout.write(f"{n} {time.perf_counter() - t}\n")
        sys.stdout.flush()


def _bench_lookups(shm: Any, tcp: Any, seconds: float) -> dict[str, Any]:
    from kvctl.store.keys import parents_of

    keys = [_key(f"lookup:{i}") for i in range(LOOKUP_CHAIN_CHUNKS)]
    # one chain: each chunk's parent is the one before it, as an engine would store them
    small = np.zeros(1024, dtype=np.uint8)
    batch = 64
    parents = parents_of(keys)
    for i in range(0, len(keys), batch):
        tcp.put_many([(k, small) for k in keys[i : i + batch]], parents=parents[i : i + batch])
    out: dict[str, Any] = {"lookup_chain_chunks": LOOKUP_CHAIN_CHUNKS}
    for name, client in (("lookup_per_second", shm), ("tcp_lookup_per_second", tcp)):
        rates = []
        for _ in range(3):
            n = 0
            end = time.perf_counter() + seconds / 3
            t = time.perf_counter()
            while time.perf_counter() < end:
                res = client.lookup(keys)
                n += 1
            rates.append(n / (time.perf_counter() - t))
            if res.matched_chunks != LOOKUP_CHAIN_CHUNKS:
                raise RuntimeError(f"lookup matched {res.matched_chunks} of the chain")
        out[name] = statistics.median(rates)
    chains = [keys] * LOOKUP_BATCH
    n = 0
    t = time.perf_counter()
    while time.perf_counter() - t < seconds / 2:
        results = shm.lookup_many(chains)
        n += len(results)
    out["batched_lookup_per_second"] = n / (time.perf_counter() - t)
    out["lookup_batch"] = LOOKUP_BATCH
    if any(r.matched_chunks != LOOKUP_CHAIN_CHUNKS for r in results):
        raise RuntimeError("a batched lookup missed part of the chain")
    out.update(_bench_lookup_lease(shm, keys[:LEASE_PREFIX_CHUNKS], seconds / 2))
    out["ping_per_second"] = _rate(shm.ping, 0.5)
    out["raw_round_trips_per_second"] = raw_round_trips(0.5)
    return out


def _bench_lookup_lease(shm: Any, keys: list[bytes], seconds: float) -> dict[str, Any]:
    """p50 of a same-host engine's lookup that leases its matched prefix (LOOKUP_LEASE, the
    leases released after), beside a plain lookup of the same keys (same round trip, nothing
    held, no policy touched), alternating, with ``LEASE_PAUSE_SECONDS`` after each (the prefill
    an engine runs between its lookups; the agent finishes its bookkeeping then)."""
    from kvctl.quantiles import nearest_rank

    leased: list[float] = []
    plain: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or not leased:
        t = time.perf_counter()
        with shm.lookup_leased(keys, release_later=True) as (found, _leases):
            leased.append(time.perf_counter() - t)
        shm.release_pending()
        if found.matched_chunks != len(keys):
            raise RuntimeError(f"a leased lookup matched {found.matched_chunks} of {len(keys)}")
        time.sleep(LEASE_PAUSE_SECONDS)
        t = time.perf_counter()
        shm.lookup(keys)
        plain.append(time.perf_counter() - t)
        time.sleep(LEASE_PAUSE_SECONDS)
    return {
        "lookup_lease_chunks": len(keys),
        "lookup_lease_p50_seconds": nearest_rank(sorted(leased), 0.5),
        "lookup_p50_seconds": nearest_rank(sorted(plain), 0.5),
        "lookup_lease_samples": len(leased),
    }


def _rate(fn: Callable[[], object], seconds: float) -> float:
    n = 0
    t = time.perf_counter()
    while time.perf_counter() - t < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t)


def raw_round_trips(seconds: float) -> float:
    """Round trips per second of a 20-byte ping-pong between two Python processes over a Unix
    socket pair: the floor under any request/response data plane written in Python here."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # child: echo until the parent closes its end
        a.close()
        buf = bytearray(20)
        while (k := b.recv_into(buf)) > 0:
            b.sendall(memoryview(buf)[:k])
        os._exit(0)
    b.close()
    msg, buf = b"x" * 20, bytearray(20)
    try:
        return _rate(lambda: (a.sendall(msg), a.recv_into(buf)), seconds)
    finally:
        a.close()
        os.waitpid(pid, 0)


def _key(text: str) -> bytes:
    import hashlib

    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def render_agent_bench(result: dict[str, Any]) -> Any:
    """A rich table of the figures and their references (the CLI's non-JSON output)."""
    from rich.table import Table

    from kvctl.format import format_bytes, format_rate

    table = Table("chunk", "figure", "rate", "reference", "ref rate", "ratio", title="kvctl agent")
    pairs = (
        ("shm_get", "memcpy"),
        ("shm_put", "memcpy_put"),
        ("tcp_get", "socket"),
        ("tcp_put", "socket_put"),
    )
    for row in result["results"]:
        for fig, ref in pairs:
            rate = row[f"{fig}_bytes_per_second"]
            ref_rate = row[f"{ref}_bytes_per_second"]
            table.add_row(
                format_bytes(row["chunk_bytes"]),
                fig,
                format_rate(rate),
                ref,
                format_rate(ref_rate),
                f"{rate / ref_rate:.2f}",
            )
    for row in result["results"]:
        for transport in ("shm", "tcp"):
            store_s = row[f"miss_store_{transport}_seconds"]
            memcpy_s = row["miss_store_memcpy_seconds"]
            table.add_row(
                f"{row['chunks_per_sample']} x {format_bytes(row['chunk_bytes'])}",
                f"miss store ({transport})",
                f"{store_s * 1e3:.1f} ms",
                "memcpy",
                f"{memcpy_s * 1e3:.1f} ms",
                f"{memcpy_s / store_s:.2f}",
            )
    iperf3 = result.get("iperf3", {})
    if "bytes_per_second" in iperf3:
        table.add_row(
            format_bytes(iperf3["block_bytes"]),
            "iperf3 (1 stream, C)",
            format_rate(iperf3["bytes_per_second"]),
            "",
            "",
            "",
        )
    table.add_row(
        "512 keys",
        "lookup (1 round trip)",
        f"{result['lookup_per_second']:,.0f}/s",
        "raw round trip",
        f"{result['raw_round_trips_per_second']:,.0f}/s",
        "",
    )
    if "lookup_lease_p50_seconds" in result:
        table.add_row(
            f"{result['lookup_lease_chunks']} keys",
            "lookup + lease (p50)",
            f"{result['lookup_lease_p50_seconds'] * 1e3:.2f} ms",
            "lookup alone (p50)",
            f"{result['lookup_p50_seconds'] * 1e3:.2f} ms",
            "",
        )
    table.add_row(
        "512 keys",
        f"lookup (batch of {result['lookup_batch']})",
        f"{result['batched_lookup_per_second']:,.0f}/s",
        "",
        "",
        "",
    )
    return table
