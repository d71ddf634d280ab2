"""The agent benchmark: a real agent process driven by this process through the SDK.

For each chunk size, with references measured in the same run and interleaved with the figures
they are divided by:

* ``shm_get`` / ``shm_put``: the Unix socket with shared memory. A get takes a read lease, copies
  the chunk from the agent's arena into the caller's preallocated buffer and releases the lease;
  a put copies into the client's staging segment and the agent copies it into its arena.
  Reference ``memcpy``: the same copies between two buffers of this process.
* ``tcp_get`` / ``tcp_put``: the binary protocol over loopback TCP; the agent sends a chunk
  straight from its arena, the client reads it into a preallocated buffer. Reference ``socket``:
  a raw request/response loopback socket between this process and a second one that sends (or
  receives into) a preallocated buffer, with no protocol, store or lock.
* ``lookup``: longest-prefix lookups of a fully cached 512-chunk chain over the data plane, each
  a round trip (Unix socket and TCP), and batched, 32 chains a frame (``lookup_many``).
  Reference ``raw_round_trips``: a bare 20-byte ping-pong between two Python processes over a
  Unix socket pair, the ceiling for one-round-trip-per-lookup on this host.
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvctl.bench.common import alternating, figure, host_info, spawned_agent
from kvctl.store.errors import InvalidArgument

DEFAULT_SIZES_BYTES = (4 << 20, 32 << 20)
DEFAULT_BYTES_PER_SIZE = 256 << 20
DEFAULT_REPEATS = 3
LOOKUP_CHAIN_CHUNKS = 512
LOOKUP_BATCH = 32
TARGETS = {
    "shm_get_vs_memcpy_ratio": 0.8,
    "tcp_get_vs_socket_ratio": 0.7,
    "lookup_per_second": 20_000,
}
_RAW_REQUEST = struct.Struct("<BQ")  # op (1 get, 2 put), bytes


def run_agent_bench(
    sizes_bytes: list[int],
    *,
    bytes_per_size: int = DEFAULT_BYTES_PER_SIZE,
    repeats: int = DEFAULT_REPEATS,
    lookup_seconds: float = 2.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    if not sizes_bytes or any(s <= 0 for s in sizes_bytes):
        raise InvalidArgument("give at least one positive chunk size")
    if repeats < 1 or bytes_per_size <= 0 or lookup_seconds <= 0:
        raise InvalidArgument("repeats, bytes per size and lookup seconds must be positive")
    say = progress or (lambda _msg: None)
    started_s = time.perf_counter()
    per_size = {s: max(2, bytes_per_size // s) for s in sizes_bytes}
    # room for one size's working set twice (puts of fresh keys land beside the get set)
    cpu_bytes = max(2 * n * s for s, n in per_size.items()) + (64 << 20)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-agent-") as tmp:
        say(f"starting an agent with a {cpu_bytes >> 20} MiB cpu tier")
        with _agent(Path(tmp), cpu_bytes) as (state, token), _raw_peer() as peer:
            from kvctl.client import AgentClient, DataClient

            assert state.data_unix is not None and state.data_tcp is not None
            with (
                DataClient.connect(state.data_unix, token=token) as shm,
                DataClient.connect(state.data_tcp, token=token) as tcp,
                AgentClient(state.control_url, token=token) as ctl,
            ):
                if not shm.shm:
                    raise RuntimeError("the agent did not offer shared memory")
                for size in sizes_bytes:
                    say(f"{size >> 20} MiB chunks: {per_size[size]} per sample")
                    results.append(_bench_size(size, per_size[size], repeats, shm, tcp, ctl, peer))
                say("lookups of a 512-chunk chain")
                lookups = _bench_lookups(shm, tcp, lookup_seconds)
    return {
        "benchmark": "agent",
        **host_info(),
        "bytes_per_size": bytes_per_size,
        "repeats": repeats,
        "elapsed_seconds": time.perf_counter() - started_s,
        "results": results,
        **lookups,
        "targets": TARGETS,
        "notes": [
            f"each bytes-per-second figure is the median of {repeats} samples, each moving "
            "bytes_per_size; figures and references alternate, so drift hits both alike",
            "gets read into preallocated buffers (get_into), as an engine filling its own "
            "buffers does; puts send from preallocated buffers",
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


def raw_peer() -> None:
    """The raw-socket reference's second process: serve get/put requests from one buffer."""
    srv = socket.create_server(("127.0.0.1", 0))
    sys.stdout.write(f"{srv.getsockname()[1]}\n")
    sys.stdout.flush()
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(1))
    head = bytearray(_RAW_REQUEST.size)
    while True:
        if not _recv_into(conn, memoryview(head)):
            return
        op, n = _RAW_REQUEST.unpack(head)
        if buf.nbytes < n:
            buf = memoryview(bytearray(b"\x01" * n))  # written: real pages, as an arena has
        if op == 1:
            conn.sendall(buf[:n])
        else:
            _recv_into(conn, buf[:n])
            conn.sendall(b"k")


@contextlib.contextmanager
def _raw_peer() -> Iterator[socket.socket]:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from kvctl.bench.agent import raw_peer; raw_peer()"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with sock:
            yield sock
    finally:
        proc.kill()
        proc.wait()


def _recv_into(sock: socket.socket, view: memoryview) -> bool:
    got = 0
    while got < view.nbytes:
        k = sock.recv_into(view[got:])
        if k == 0:
            return False
        got += k
    return True


def _bench_size(
    size: int, n: int, repeats: int, shm: Any, tcp: Any, ctl: Any, peer: socket.socket
) -> dict[str, Any]:
    # n distinct buffers, so memcpy reads as much distinct memory as the agent's arena holds
    # (a few reused buffers would stay in the CPU cache and flatter the reference)
    sources = [np.full(size, i % 251 + 1, dtype=np.uint8) for i in range(n)]
    sinks = [np.ones(size, dtype=np.uint8) for _ in range(2)]  # touched before timing
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

    def memcpy() -> None:
        for i, src in enumerate(sources):
            sinks[i % 2][:] = src

    def raw_get() -> None:
        for i in range(n):
            peer.sendall(_RAW_REQUEST.pack(1, size))
            _recv_into(peer, memoryview(sinks[i % 2]))

    def raw_put() -> None:
        ack = memoryview(bytearray(1))
        for src in sources:
            peer.sendall(_RAW_REQUEST.pack(2, size))
            peer.sendall(memoryview(src))
            _recv_into(peer, ack)

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
    row["samples_seconds"] = samples
    return row


def _check_round_trip(shm: Any, tcp: Any, key: bytes, src: np.ndarray) -> None:
    """A benchmark of wrong bytes is worthless: check one chunk both ways before timing."""
    for client in (shm, tcp):
        out = np.zeros_like(src)
        client.get_into([key], [out])
        if not np.array_equal(out, src):
            raise RuntimeError("the agent returned different bytes than were put")


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
    out["ping_per_second"] = _rate(shm.ping, 0.5)
    out["raw_round_trips_per_second"] = raw_round_trips(0.5)
    return out


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

    from kvctl.units import format_bytes, format_rate

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
    table.add_row(
        "512 keys",
        "lookup (1 round trip)",
        f"{result['lookup_per_second']:,.0f}/s",
        "raw round trip",
        f"{result['raw_round_trips_per_second']:,.0f}/s",
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
