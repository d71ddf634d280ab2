"""The remote tiers' benchmark: the shared pool on Redis and a pull from a peer agent, each figure
beside a reference measured in the same run.

**Pool** (``pool``). For each chunk size, ``chunks = max(2, bytes_per_size // chunk_bytes)``
chunks of random bytes (generated once per size, not timed) go through a
:class:`~kvctl.remote.redis_pool.RedisPool` under a prefix of this run alone, ``batch_chunks``
chunks per ``put_many`` / ``get_many`` call, and, as the reference, through a plain redis-py
pipeline (``transaction=False``) of as many ``SET`` / ``GET`` on the same server, same batches:

* ``put``: fresh keys each sample (a re-put of a present chunk stores nothing). kvctl: the
  accounting script and a STRLEN per chunk, then one ``SET`` of header + payload per chunk
  (two round trips per batch); reference: one round trip of ``SET``.
* ``get``: kvctl: the reads (a STRLEN and a GETRANGE per record) and the LRU-touch script,
  then the record's header CRC and XXH3-64 payload check; a batch of 8 MiB or more split into
  pipelines on up to ``streams`` pooled connections in parallel, and the same pool with
  ``streams=1`` beside it
  (``kvctl_one_stream_bytes_per_s``); reference: the plain ``GET`` s in one pipeline.

A sample is the sum of the timed calls (``time.perf_counter``); the bytes read back are compared
with what was written between calls, untimed, on every sample of both paths, and every chunk
that differs or is missing counts in ``mismatches`` (0, or the figures mean nothing). Each figure
is the median of ``repeats`` samples, the two paths swapping which goes first each repeat. The
pool's capacity is set above what one sample writes, so nothing is evicted while timing; every
key of the prefix (records, accounting, reference keys) is deleted at the end, also on errors
and Ctrl-C.

**Peer pull** (``peer_pull``). One real agent is started on loopback (``--disk 0``, a cpu tier
sized for the chunks) and ``pull_chunks`` chunks of ``pull_chunk_bytes``, parents chained, are
stored in it. This process pulls them all in one FETCH request through an
:class:`~kvctl.remote.agent_source.AgentSource` wrapped in a federation
:class:`~kvctl.remote.federation.Source` with an :class:`~kvctl.remote.links.EmulatedDelay` of
each emulated RTT, exactly as an agent pulls from a peer with a configured delay: one in-process
wait per request, inside the timed span. Timed from before ``Source.call``: the first chunk's
``arrived`` callback (``time_to_first_chunk_s``) and the call's return (``time_to_last_byte_s``).
Reference, same connection: ``lower_bound_s = ping_rtt_s + emulated_rtt_s + bytes /
bandwidth_bytes_per_s``, where ``ping_rtt_s`` is the median of data-plane PINGs and the bandwidth
comes from the agent's PROBE op (filler bytes down the same socket path; median of samples, the
ping RTT taken out as the link estimator does). ``ratio`` is time to last byte over the lower
bound. A raw loopback socket to a second Python process sending the same bytes from one buffer
(``raw_tcp_bytes_per_s``) shows what the PROBE path itself costs. The RTT runs pull over one
connection; ``streams`` then times the same pull (no emulated RTT) over one connection and split
over ``AgentSource``'s default streams, each beside its bound (``streams_lower_bound_s``: as many
PROBEs at once, one per connection). The agent is stopped at the
end (SIGTERM, then SIGKILL), also on errors and Ctrl-C.

Nothing here asserts a speed. The result is JSON-safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import math
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from kvctl.bench.common import host_info, parallel_probe_seconds, spawned_agent
from kvctl.store.errors import InvalidArgument, TierUnavailable
from kvctl.store.tiers.base import ChunkMeta

if TYPE_CHECKING:
    import redis
    from rich.console import Group

    from kvctl.remote.agent_source import AgentSource
    from kvctl.remote.pool import PoolChunk
    from kvctl.remote.redis_pool import RedisPool

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SIZES_BYTES: tuple[int, ...] = (4 << 20, 32 << 20)
DEFAULT_BYTES_PER_SIZE = 256 << 20
DEFAULT_REPEATS = 3
DEFAULT_BATCH_CHUNKS = 8
DEFAULT_PULL_CHUNKS = 64
DEFAULT_PULL_CHUNK_BYTES = 4 << 20
DEFAULT_RTTS_S: tuple[float, ...] = (0.0, 0.001, 0.005)
#: the tenant every chunk of the bench is stored and read as
TENANT = "bench"
#: socket timeout of the pool and the reference client: a batch of 8 x 32 MiB on a busy 2-core
#: VM can take seconds, and a timeout mid-measurement would only lose the run
REDIS_TIMEOUT_S = 30.0
#: the first contact: an unreachable server should fail the run quickly
REDIS_CONNECT_TIMEOUT_S = 5.0
#: headroom over one sample's bytes in the pool's capacity (nothing is evicted while timing)
POOL_CAPACITY_HEADROOM_BYTES = 64 << 20
#: the peer's PROBE download (the protocol's maximum) and how many samples, median taken
PROBE_BYTES = 64 << 20
PROBE_SAMPLES = 5
PING_SAMPLES = 50
PEER_CPU_MIN_BYTES = 256 << 20
PEER_TIMEOUT_S = 30.0
#: chunks per request while storing the pull set in the peer (not timed)
PEER_PUT_BATCH = 8
_GLOB_SPECIALS = "*?[]\\"


def parse_rtts_ms(text: str) -> list[float]:
    """``"0,1,5"`` (milliseconds) -> ``[0.0, 0.001, 0.005]`` seconds; InvalidArgument if bad."""
    out: list[float] = []
    for part in text.split(","):
        if not part.strip():
            continue
        try:
            ms = float(part)
        except ValueError:
            raise InvalidArgument(f"--rtts-ms: {part.strip()!r} is not a number") from None
        if not math.isfinite(ms) or ms < 0:
            raise InvalidArgument(f"--rtts-ms: {part.strip()!r} must be finite and >= 0")
        out.append(ms / 1000)
    if not out:
        raise InvalidArgument("--rtts-ms: give at least one RTT in milliseconds")
    return out


def run_remote_bench(
    sizes_bytes: Sequence[int] = DEFAULT_SIZES_BYTES,
    *,
    bytes_per_size: int = DEFAULT_BYTES_PER_SIZE,
    repeats: int = DEFAULT_REPEATS,
    batch_chunks: int = DEFAULT_BATCH_CHUNKS,
    redis_url: str = DEFAULT_REDIS_URL,
    prefix: str | None = None,
    pull_chunks: int = DEFAULT_PULL_CHUNKS,
    pull_chunk_bytes: int = DEFAULT_PULL_CHUNK_BYTES,
    rtts_s: Sequence[float] = DEFAULT_RTTS_S,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Measure the pool tier on Redis and a peer pull; see the module docstring. ``prefix``
    (default: ``kvctl-bench-<pid>-<random>``) is where every Redis key of the run lives; all of
    them are deleted before returning."""
    sizes = list(sizes_bytes)
    rtts = [float(r) for r in rtts_s]
    _check_args(sizes, bytes_per_size, repeats, batch_chunks, pull_chunks, pull_chunk_bytes, rtts)
    say = progress or (lambda _msg: None)
    prefix = prefix or f"kvctl-bench-{os.getpid()}-{secrets.token_hex(4)}"
    started_s = time.perf_counter()
    pool = _bench_pool(sizes, bytes_per_size, repeats, batch_chunks, redis_url, prefix, say)
    peer = _bench_peer(pull_chunks, pull_chunk_bytes, rtts, repeats, say)
    return {
        "benchmark": "remote",
        **host_info(),
        "repeats": repeats,
        "elapsed_seconds": time.perf_counter() - started_s,
        "pool": pool,
        "peer_pull": peer,
        "notes": _notes(repeats, pool, peer),
    }


def _check_args(
    sizes: list[int],
    bytes_per_size: int,
    repeats: int,
    batch_chunks: int,
    pull_chunks: int,
    pull_chunk_bytes: int,
    rtts: list[float],
) -> None:
    if not sizes or any(s <= 0 for s in sizes):
        raise InvalidArgument(f"give at least one positive chunk size, got {sizes}")
    if bytes_per_size <= 0:
        raise InvalidArgument(f"bytes per size must be positive, got {bytes_per_size}")
    if repeats < 1:
        raise InvalidArgument(f"repeats must be at least 1, got {repeats}")
    if batch_chunks < 1:
        raise InvalidArgument(f"batch must be at least 1 chunk, got {batch_chunks}")
    if pull_chunks < 1:
        raise InvalidArgument(f"pull chunks must be at least 1, got {pull_chunks}")
    if pull_chunk_bytes <= 0:
        raise InvalidArgument(f"pull chunk size must be positive, got {pull_chunk_bytes}")
    if not rtts or any(not math.isfinite(r) or r < 0 for r in rtts):
        raise InvalidArgument(f"give at least one emulated RTT, each finite and >= 0, got {rtts}")


# --- the pool on Redis ------------------------------------------------------------------------
def _bench_pool(
    sizes: list[int],
    bytes_per_size: int,
    repeats: int,
    batch_chunks: int,
    url: str,
    prefix: str,
    say: Callable[[str], None],
) -> dict[str, Any]:
    from redis.exceptions import RedisError

    from kvctl.format import format_bytes
    from kvctl.remote.redis_pool import RedisPool

    chunks_of = {s: max(2, bytes_per_size // s) for s in sizes}
    # one sample's chunks are in the pool at a time (the previous sample's are deleted first)
    capacity_bytes = max(s * n for s, n in chunks_of.items()) + POOL_CAPACITY_HEADROOM_BYTES
    # the constructor checks the URL and the prefix and does no I/O
    # max_chunk_bytes: the largest size asked; the pool's default (an agent's default
    # max_chunk, 256 MiB) refused larger chunks, and the run failed blaming the capacity
    max_chunk_bytes = max(sizes)
    pool = RedisPool(
        url,
        prefix=prefix,
        capacity_bytes=capacity_bytes,
        timeout_s=REDIS_TIMEOUT_S,
        read_timeout_s=REDIS_TIMEOUT_S,
        max_chunk_bytes=max_chunk_bytes,
    )
    # the same pool read over one connection: what the split over streams gains
    pool_one = RedisPool(
        url,
        prefix=prefix,
        timeout_s=REDIS_TIMEOUT_S,
        read_timeout_s=REDIS_TIMEOUT_S,
        streams=1,
        max_chunk_bytes=max_chunk_bytes,
    )
    masked = pool.address
    client = _reference_client(url, masked)
    try:
        try:
            client.ping()
            server = client.info("server")
        except RedisError as exc:
            raise InvalidArgument(f"Redis is not reachable at {masked}: {exc}") from None
        # from here on the run may have written keys: delete them however it ends
        with _cleanup(pool, client, prefix):
            rows = []
            try:
                for size in sizes:
                    n = chunks_of[size]
                    say(f"pool: {n} chunks of {format_bytes(size)} per sample")
                    rows.append(
                        _pool_size(pool, pool_one, client, prefix, size, n, repeats, batch_chunks)
                    )
            except RedisError as exc:
                raise TierUnavailable(f"Redis {masked}: {exc}") from exc
    finally:
        pool.close()
        pool_one.close()
        client.close()
    return {
        "redis_url": masked,
        "redis_version": server.get("redis_version"),
        "redis_py_hiredis": importlib.util.find_spec("hiredis") is not None,
        "prefix": prefix,
        "capacity_bytes": capacity_bytes,
        "bytes_per_size": bytes_per_size,
        "batch_chunks": batch_chunks,
        "streams": pool.streams,
        "min_stream_bytes": pool.min_stream_bytes,
        "sizes": rows,
    }


def _reference_client(url: str, masked: str) -> redis.Redis:
    """A plain redis-py client to the pool's server (the reference pipeline)."""
    import redis

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme.endswith("+cluster"):
        raise InvalidArgument(
            f"{masked}: the remote bench measures one server; give a redis:// URL, not a Cluster"
        )
    # RedisPool accepted the URL; redis-py knows valkey:// as redis://
    client_scheme = {"valkey": "redis", "valkeys": "rediss"}.get(scheme, scheme)
    return redis.Redis.from_url(
        urlunsplit(parts._replace(scheme=client_scheme)),
        socket_timeout=REDIS_TIMEOUT_S,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
    )


@contextlib.contextmanager
def _cleanup(pool: RedisPool, client: redis.Redis, prefix: str) -> Iterator[None]:
    """Every key of the prefix deleted on the way out: records and accounting (``pool.clear``)
    and the reference's keys. A cleanup failure is raised unless an error is already leaving."""
    failed = True
    try:
        yield
        failed = False
    finally:
        try:
            pool.clear()
            escaped = "".join("\\" + c if c in _GLOB_SPECIALS else c for c in prefix)
            names = list(client.scan_iter(match=f"{escaped}:*", count=500))
            for i in range(0, len(names), 500):
                client.delete(*names[i : i + 500])
        except Exception:
            if not failed:
                raise


def _pool_size(
    pool: RedisPool,
    pool_one: RedisPool,
    client: redis.Redis,
    prefix: str,
    size: int,
    n: int,
    repeats: int,
    batch_chunks: int,
) -> dict[str, Any]:
    # one block of random bytes for all chunks: each chunk distinct, so a mix-up is caught
    payload = np.random.default_rng(size).bytes(size * n)
    src = memoryview(payload)
    chunks = [src[i * size : (i + 1) * size] for i in range(n)]
    batches = [range(i, min(n, i + batch_chunks)) for i in range(0, n, batch_chunks)]
    seconds: dict[str, list[float]] = {}
    mismatches = [0]
    seq = [0]

    def fresh() -> tuple[list[bytes], list[str]]:
        seq[0] += 1
        tag = f"{size}:{seq[0]}"
        keys = [_key(f"{prefix}:{tag}:{i}") for i in range(n)]
        return keys, [f"{prefix}:ref:{tag}:{i}" for i in range(n)]

    def kvctl_put(keys: list[bytes]) -> float:
        elapsed_s = 0.0
        for b in batches:
            items = [(ChunkMeta(keys[i], size, tenant=TENANT), chunks[i]) for i in b]
            t = time.perf_counter()
            stored = pool.put_many(items)
            elapsed_s += time.perf_counter() - t
            if not all(stored):
                raise RuntimeError(
                    f"the pool refused {stored.count(False)} of {len(stored)} chunks of a batch "
                    "(its capacity is set above one sample; another writer under the prefix?)"
                )
        return elapsed_s

    def reference_put(names: list[str]) -> float:
        elapsed_s = 0.0
        for b in batches:
            pipe = client.pipeline(transaction=False)
            for i in b:
                pipe.set(names[i], chunks[i])
            t = time.perf_counter()
            pipe.execute()
            elapsed_s += time.perf_counter() - t
        return elapsed_s

    def kvctl_get(keys: list[bytes], reader: RedisPool = pool) -> float:
        elapsed_s = 0.0
        for b in batches:
            t = time.perf_counter()
            got = reader.get_many([keys[i] for i in b], tenant=TENANT)
            elapsed_s += time.perf_counter() - t
            # checked between calls, untimed; freed here too (not at the next call's assignment,
            # inside its timed span)
            views = [None if c is None else c.data for c in got]
            mismatches[0] += _count_bad(views, [chunks[i] for i in b])
            del got, views
        return elapsed_s

    def reference_get(names: list[str]) -> float:
        elapsed_s = 0.0
        for b in batches:
            pipe = client.pipeline(transaction=False)
            for i in b:
                pipe.get(names[i])
            t = time.perf_counter()
            got = pipe.execute()
            elapsed_s += time.perf_counter() - t
            mismatches[0] += _count_bad(got, [chunks[i] for i in b])
            del got
        return elapsed_s

    def alternate(r: int, *halves: tuple[str, Callable[[Any], float], list[Any]]) -> None:
        # the reference first on even repeats, kvctl first on odd ones
        for name, fn, arg in halves if r % 2 == 0 else reversed(halves):
            seconds.setdefault(name, []).append(fn(arg))

    try:
        keys: list[bytes] = []
        names: list[str] = []
        for r in range(repeats):
            if keys:  # untimed: the previous sample's chunks make room for this one's
                pool.delete_many(keys)
                client.delete(*names)
            keys, names = fresh()
            alternate(r, ("reference_put", reference_put, names), ("kvctl_put", kvctl_put, keys))
        # the last put sample's chunks are the get set; one untimed pass of each path first
        # (and a first check of the bytes, also counted)
        kvctl_get(keys)
        kvctl_get(keys, pool_one)
        reference_get(names)
        for r in range(repeats):
            alternate(
                r,
                ("reference_get", reference_get, names),
                ("kvctl_get", kvctl_get, keys),
                ("kvctl_get_one_stream", lambda ks: kvctl_get(ks, pool_one), keys),
            )
        pool.delete_many(keys)
        client.delete(*names)
    finally:
        for c in chunks:
            c.release()
        src.release()

    nbytes = size * n

    def rates(name: str) -> list[float]:
        # perf_counter can tick 0 for a tiny sample on a coarse clock; keep the rate finite
        return [nbytes / max(s, 1e-9) for s in seconds[name]]

    def pair(op: str) -> dict[str, Any]:
        kvctl, reference = rates(f"kvctl_{op}"), rates(f"reference_{op}")
        k, ref = statistics.median(kvctl), statistics.median(reference)
        return {
            "kvctl_bytes_per_s": k,
            "redis_pipeline_bytes_per_s": ref,
            "ratio": k / ref,
            "kvctl_samples_bytes_per_s": kvctl,
            "redis_pipeline_samples_bytes_per_s": reference,
        }

    return {
        "chunk_bytes": size,
        "chunks": n,
        "bytes": nbytes,
        "put": pair("put"),
        "get": {
            **pair("get"),
            "streams": pool.streams,
            "kvctl_one_stream_bytes_per_s": statistics.median(rates("kvctl_get_one_stream")),
            "kvctl_one_stream_samples_bytes_per_s": rates("kvctl_get_one_stream"),
            "streams_speedup": statistics.median(rates("kvctl_get"))
            / statistics.median(rates("kvctl_get_one_stream")),
        },
        "mismatches": mismatches[0],
    }


def _count_bad(got: Sequence[bytes | memoryview | None], want: Sequence[memoryview]) -> int:
    """Chunks missing or not byte-for-byte what was written."""
    return sum(g is None or not _same(g, w) for g, w in zip(got, want, strict=True))


def _same(got: bytes | memoryview, want: memoryview) -> bool:
    """Byte-for-byte equality without copying either side."""
    a = np.frombuffer(got, dtype=np.uint8)
    b = np.frombuffer(want, dtype=np.uint8)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _key(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


# --- the peer pull ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Peer:
    pid: int
    data_tcp: str


@contextlib.contextmanager
def _peer_agent(tmp: Path, cpu_bytes: int) -> Iterator[_Peer]:
    """One agent on loopback (ephemeral ports, no disk tier), stopped on the way out whatever
    happened: SIGTERM, then SIGKILL after a grace period."""
    argv = [
        "--name",
        "bench-peer",
        "--cpu",
        str(cpu_bytes),
        "--disk",
        "0",
        "--log-level",
        "warning",
    ]
    with spawned_agent(tmp / "peer", *argv) as state:
        if state.data_tcp is None:
            raise RuntimeError("the peer agent serves no TCP data plane")
        yield _Peer(state.pid, state.data_tcp)


def _bench_peer(
    n: int, size: int, rtts: list[float], repeats: int, say: Callable[[str], None]
) -> dict[str, Any]:
    from kvctl.remote.agent_source import AgentSource

    total = n * size
    cpu_bytes = max(PEER_CPU_MIN_BYTES, total + (64 << 20))
    payload = np.random.default_rng(n * size + 1).bytes(total)
    keys = [_key(f"peer:{i}") for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-remote-") as tmp:
        say(f"peer pull: starting an agent with a {cpu_bytes >> 20} MiB cpu tier")
        with _peer_agent(Path(tmp), cpu_bytes) as peer:
            # the RTT runs pull in ONE FETCH on one connection; the streams block splits it
            backend = AgentSource(
                peer.data_tcp, timeout_s=PEER_TIMEOUT_S, read_timeout_s=PEER_TIMEOUT_S, streams=1
            )
            backend_n = AgentSource(
                peer.data_tcp, timeout_s=PEER_TIMEOUT_S, read_timeout_s=PEER_TIMEOUT_S
            )
            try:
                say(f"peer pull: storing {n} chunks of {size} bytes, parents chained")
                _store_chain(backend, keys, payload, size)
                say("peer pull: ping RTT, PROBE bandwidth, raw socket")
                for _ in range(5):  # untimed: the connection is open and warm
                    backend.ping()
                ping_rtt_s = statistics.median(backend.ping() for _ in range(PING_SAMPLES))
                probe_bytes = PROBE_BYTES
                backend.probe_transfer(probe_bytes)  # untimed: socket buffers grow here
                probe_s = statistics.median(
                    backend.probe_transfer(probe_bytes) for _ in range(PROBE_SAMPLES)
                )
                # the round trip taken out, as LinkEstimator.observe_transfer does, so that
                # rtt + bytes / bandwidth reproduces what a transfer costs
                bandwidth = probe_bytes / max(probe_s - ping_rtt_s, 1e-9)
                raw_tcp = _raw_tcp_bytes_per_s(total, repeats)
                alloc_s = _alloc_seconds(n, size, repeats)
                runs = []
                _pull(backend, keys, payload, size, 0.0)  # untimed warm-up (buffers, pages)
                for rtt_s in rtts:
                    say(f"peer pull: {n} chunks at an emulated RTT of {rtt_s * 1000:g} ms")
                    samples = [_pull(backend, keys, payload, size, rtt_s) for _ in range(repeats)]
                    runs.append(_run_row(samples, rtt_s, ping_rtt_s, bandwidth, total, size))
                say(f"peer pull: one stream vs {backend_n.streams}")
                streams = _streams_row(
                    backend, backend_n, keys, payload, size, repeats, ping_rtt_s, bandwidth
                )
            finally:
                backend.close()
                backend_n.close()
            say("peer pull: stopping the agent")
    return {
        "chunks": n,
        "chunk_bytes": size,
        "bytes": total,
        "tenant": TENANT,
        "peer_address": peer.data_tcp,
        "peer_pid": peer.pid,
        "transport": "tcp (loopback, no shared memory)",
        "ping_rtt_s": ping_rtt_s,
        "ping_samples": PING_SAMPLES,
        "bandwidth_bytes_per_s": bandwidth,
        "probe_bytes": probe_bytes,
        "probe_samples": PROBE_SAMPLES,
        "probe_seconds_median": probe_s,
        "raw_tcp_bytes_per_s": raw_tcp,
        "bandwidth_vs_raw_tcp_ratio": bandwidth / raw_tcp,
        "client_buffers_alloc_s": alloc_s,
        "rtt_basis": "emulated",
        "runs": runs,
        "streams": streams,
    }


def _store_chain(backend: AgentSource, keys: list[bytes], payload: bytes, size: int) -> None:
    view = memoryview(payload)
    try:
        for start in range(0, len(keys), PEER_PUT_BATCH):
            items = [
                (
                    ChunkMeta(keys[i], size, tenant=TENANT, parent=keys[i - 1] if i else None),
                    view[i * size : (i + 1) * size],
                )
                for i in range(start, min(len(keys), start + PEER_PUT_BATCH))
            ]
            stored = backend.put_many(items)
            if not all(stored):
                raise RuntimeError(
                    f"the peer agent did not store {stored.count(False)} of {len(stored)} chunks"
                )
    finally:
        view.release()


@dataclass(frozen=True, slots=True)
class _PullSample:
    first_chunk_s: float
    last_byte_s: float
    mismatches: int


def _pull(
    backend: AgentSource, keys: list[bytes], payload: bytes, size: int, rtt_s: float
) -> _PullSample:
    """One pull of every key in one request, as an agent pulls from a peer: through
    ``Source.call`` with the emulated delay inside the timed span."""
    from kvctl.remote.federation import PEER_TIER, Source
    from kvctl.remote.links import EmulatedDelay, LinkEstimator

    name = f"bench-peer-rtt-{rtt_s * 1000:g}ms"
    source = Source(
        name,
        PEER_TIER,
        backend,
        LinkEstimator(name, emulated_delay_s=rtt_s),
        EmulatedDelay(rtt_s),
    )
    first: list[float] = []

    def arrived(_i: int, _chunk: PoolChunk) -> None:
        if not first:
            first.append(time.perf_counter())

    def moved_bytes(got: list[PoolChunk | None]) -> int:
        return sum(c.data.nbytes for c in got if c is not None)

    t0 = time.perf_counter()
    got = source.call(
        "fetch",
        lambda: backend.get_many(keys, tenant=TENANT, arrived=arrived),
        moved_bytes=moved_bytes,
    )
    t_end = time.perf_counter()
    if got is None:  # Source.call turns a failure into a miss; here it ends the run
        raise TierUnavailable(f"the pull from the peer failed: {source.last_error}")
    if not first:
        raise RuntimeError("the peer returned none of the chunks it was given")
    view = memoryview(payload)
    want = [view[i * size : (i + 1) * size] for i in range(len(keys))]
    try:
        bad = _count_bad([None if c is None else c.data for c in got], want)
    finally:
        for w in want:
            w.release()
        view.release()
    return _PullSample(first[0] - t0, t_end - t0, bad)


def _streams_row(
    one: AgentSource,
    many: AgentSource,
    keys: list[bytes],
    payload: bytes,
    size: int,
    repeats: int,
    ping_rtt_s: float,
    bandwidth: float,
) -> dict[str, Any]:
    """The same pull (no emulated RTT) over one connection and split over ``many.streams``,
    alternating, beside both lower bounds: one connection's PROBE bandwidth and that of as many
    PROBEs at once, one per connection, moving the same bytes in all."""
    from concurrent.futures import ThreadPoolExecutor

    n = many.streams
    total = len(keys) * size
    each_bytes = max(1, PROBE_BYTES // n)
    with ThreadPoolExecutor(n) as workers:
        parallel_probe_seconds(many, each_bytes, n, workers)  # untimed: connections open
        probe_s = statistics.median(
            parallel_probe_seconds(many, each_bytes, n, workers) for _ in range(PROBE_SAMPLES)
        )
    bandwidth_n = each_bytes * n / max(probe_s - ping_rtt_s, 1e-9)
    _pull(many, keys, payload, size, 0.0)  # untimed warm-up of the other connections
    samples: dict[str, list[_PullSample]] = {"one": [], "many": []}
    for r in range(repeats):
        order = [("one", one), ("many", many)]
        for name, backend in order if r % 2 == 0 else reversed(order):
            samples[name].append(_pull(backend, keys, payload, size, 0.0))
    one_s = statistics.median(s.last_byte_s for s in samples["one"])
    many_s = statistics.median(s.last_byte_s for s in samples["many"])
    lower_bound_s = ping_rtt_s + total / bandwidth
    streams_lower_bound_s = ping_rtt_s + total / bandwidth_n
    return {
        "streams": n,
        "min_stream_bytes": many.min_stream_bytes,
        "one_stream_time_to_last_byte_s": one_s,
        "streams_time_to_last_byte_s": many_s,
        "one_stream_bytes_per_s": total / one_s,
        "streams_bytes_per_s": total / many_s,
        "speedup": one_s / many_s,
        "lower_bound_s": lower_bound_s,
        "one_stream_ratio": one_s / lower_bound_s,
        "parallel_probe_bandwidth_bytes_per_s": bandwidth_n,
        "streams_lower_bound_s": streams_lower_bound_s,
        "streams_ratio": many_s / streams_lower_bound_s,
        "mismatches": sum(s.mismatches for v in samples.values() for s in v),
        "samples_one_stream_time_to_last_byte_s": [s.last_byte_s for s in samples["one"]],
        "samples_streams_time_to_last_byte_s": [s.last_byte_s for s in samples["many"]],
    }


def _run_row(
    samples: list[_PullSample],
    rtt_s: float,
    ping_rtt_s: float,
    bandwidth: float,
    total: int,
    size: int,
) -> dict[str, Any]:
    first = [s.first_chunk_s for s in samples]
    last = [s.last_byte_s for s in samples]
    lower_bound_s = ping_rtt_s + rtt_s + total / bandwidth
    ttlb = statistics.median(last)
    return {
        "emulated_rtt_s": rtt_s,
        "rtt_basis": "emulated",
        "time_to_first_chunk_s": statistics.median(first),
        "time_to_last_byte_s": ttlb,
        "first_chunk_lower_bound_s": ping_rtt_s + rtt_s + size / bandwidth,
        "lower_bound_s": lower_bound_s,
        "ratio": ttlb / lower_bound_s,
        "mismatches": sum(s.mismatches for s in samples),
        "samples_time_to_first_chunk_s": first,
        "samples_time_to_last_byte_s": last,
    }


def _alloc_seconds(n: int, size: int, repeats: int) -> float:
    """What a FETCH's client pays before the first byte: ``DataClient.fetch`` makes a zeroed
    ``bytearray`` per chunk, all of them before reading the payload. Median of ``repeats``."""
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        bufs = [bytearray(size) for _ in range(n)]
        samples.append(time.perf_counter() - t)
        del bufs
    return statistics.median(samples)


def _raw_tcp_bytes_per_s(nbytes: int, repeats: int) -> float:
    """``nbytes`` in one request from a second Python process over a raw loopback socket
    (``kvctl.bench.agent.raw_reference``: the data plane's send/recv calls, no protocol, no
    store), into a preallocated, touched buffer; median of ``repeats`` after one untimed pass."""
    from kvctl.bench.agent import raw_reference

    sink = memoryview(bytearray(b"\x01" * nbytes))  # written: real pages
    rates = []
    try:
        with raw_reference(nbytes) as raw:
            for r in range(repeats + 1):
                t = time.perf_counter()
                raw.get_into(0, sink)
                elapsed_s = time.perf_counter() - t
                if r:
                    rates.append(nbytes / max(elapsed_s, 1e-9))
    finally:
        sink.release()
    return statistics.median(rates)


# --- notes and the table ----------------------------------------------------------------------
def _notes(repeats: int, pool: dict[str, Any], peer: dict[str, Any]) -> list[str]:
    notes = [
        f"each figure is the median of {repeats} samples; kvctl and its reference alternate "
        "which goes first, so drift hits both alike",
        "pool put: kvctl makes two round trips per batch (the accounting script + EXISTS, then "
        "one SET of header + payload per chunk); the reference one (SETs). pool "
        "get: kvctl's GETs + the LRU-touch script in one round trip, then a header CRC and an "
        "XXH3-64 check of every payload; the reference plain GETs",
        "a pool sample is the sum of its put_many/get_many (or pipeline) calls; the bytes read "
        "back are compared with what was written between calls (untimed) on every sample of "
        "both paths, and mismatches counts chunks that differed or were missing",
        "peer pull: the RTT is emulated, an in-process wait (EmulatedDelay) once per request "
        "inside Source.call as the agent applies a configured link delay; the kernel's netem is "
        "not used, so there is no bandwidth limit, jitter or loss on the path",
        "peer lower bound: median data-plane ping + the emulated RTT + bytes / the PROBE "
        "bandwidth (filler bytes down the same socket, read into one reused scratch buffer; a "
        "FETCH also sends each chunk's metadata first and lands each chunk in a new buffer)",
        "peer streams: the same pull (no emulated RTT) over one connection and split into "
        f"{peer['streams']['streams']} contiguous groups of keys, one FETCH per connection in "
        "parallel (AgentSource's default for large pulls); streams_lower_bound_s uses as many "
        "PROBEs at once, one per connection, moving the same bytes as the one-connection PROBE",
        "pool get: kvctl splits a batch of 8 MiB or more into pipelines on up to "
        f"{pool['streams']} pooled connections in parallel; kvctl_one_stream_bytes_per_s is "
        "the same pool over one (streams=1)",
        "time_to_first_chunk_s includes the client making a zeroed buffer for every chunk of "
        "the request before it reads the first payload byte (DataClient.fetch); "
        "client_buffers_alloc_s is that allocation alone, timed in this process",
        "Redis, the peer agent and this process share the host's cores: on a 2-core VM they "
        "compete with each other and with anything else running",
    ]
    if not pool["redis_py_hiredis"]:
        notes.append(
            "redis-py runs without hiredis (pure-Python reply parser) for kvctl and the "
            "reference alike; memoryview payloads are sent without a copy"
        )
    bad = sum(r["mismatches"] for r in pool["sizes"]) + sum(r["mismatches"] for r in peer["runs"])
    bad += peer["streams"]["mismatches"]
    if bad:
        notes.append(f"{bad} chunks read back differed or were missing: the figures are void")
    return notes


def render_remote_bench(result: dict[str, Any]) -> Group:
    """Two tables for people: the pool beside the plain pipeline, the pull beside its bound."""
    from rich.console import Group
    from rich.table import Table

    from kvctl.format import format_bytes, format_rate

    pool = result["pool"]
    t1 = Table(
        title=f"pool tier on Redis {pool['redis_version']} (median of {result['repeats']})",
        caption=(
            f"{pool['redis_url']}, {pool['batch_chunks']} chunks per call or pipeline; "
            "ratio = kvctl / redis-py pipeline"
        ),
    )
    for col, justify in (
        ("chunk", "right"),
        ("op", "left"),
        ("kvctl", "right"),
        ("kvctl, 1 stream", "right"),
        ("redis pipeline", "right"),
        ("ratio", "right"),
        ("mismatches", "right"),
    ):
        t1.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in pool["sizes"]:
        for op in ("put", "get"):
            fig = row[op]
            t1.add_row(
                f"{format_bytes(row['chunk_bytes'])} x {row['chunks']}",
                op,
                format_rate(fig["kvctl_bytes_per_s"]),
                format_rate(fig["kvctl_one_stream_bytes_per_s"]) if op == "get" else "",
                format_rate(fig["redis_pipeline_bytes_per_s"]),
                f"{fig['ratio']:.2f}",
                str(row["mismatches"]),
            )
    peer = result["peer_pull"]
    t2 = Table(
        title=(
            f"peer pull: {peer['chunks']} x {format_bytes(peer['chunk_bytes'])} in one request "
            "(emulated RTT)"
        ),
        caption=(
            f"lower bound = ping {peer['ping_rtt_s'] * 1e3:.3f} ms + emulated RTT + bytes / "
            f"PROBE {format_rate(peer['bandwidth_bytes_per_s'])} (raw socket "
            f"{format_rate(peer['raw_tcp_bytes_per_s'])}); ratio = last byte / lower bound; "
            f"the client allocates every chunk's buffer before the first byte "
            f"({peer['client_buffers_alloc_s'] * 1e3:.1f} ms here)"
        ),
    )
    for col in ("emulated RTT", "first chunk", "last byte", "lower bound", "ratio", "mismatches"):
        t2.add_column(col, justify="right")
    for run in peer["runs"]:
        t2.add_row(
            f"{run['emulated_rtt_s'] * 1e3:g} ms",
            f"{run['time_to_first_chunk_s'] * 1e3:.2f} ms",
            f"{run['time_to_last_byte_s'] * 1e3:.2f} ms",
            f"{run['lower_bound_s'] * 1e3:.2f} ms",
            f"{run['ratio']:.2f}",
            str(run["mismatches"]),
        )
    st = peer["streams"]
    for label, last_s, bound_s in (
        ("1 stream", st["one_stream_time_to_last_byte_s"], st["lower_bound_s"]),
        (
            f"{st['streams']} streams",
            st["streams_time_to_last_byte_s"],
            st["streams_lower_bound_s"],
        ),
    ):
        t2.add_row(
            f"0 ms, {label}",
            "",
            f"{last_s * 1e3:.2f} ms",
            f"{bound_s * 1e3:.2f} ms",
            f"{last_s / bound_s:.2f}",
            str(st["mismatches"]),
        )
    return Group(t1, t2)
