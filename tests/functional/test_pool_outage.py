"""A node whose Redis pool goes away and comes back (issue 22, item 6).

The pool is the machine's Redis reached through a TCP forwarder this test controls
(``TcpProxy``): ``stall`` keeps every connection open and forwards nothing (a hung server or a
partition: the case that used to block reads for the whole socket timeout), ``cut`` resets
every connection and refuses new ones (a dead server), ``restore`` brings it back. Reads during
the outage must be misses that answer well within a request's budget, and after the pool is
back reads must hit again within a few seconds, even after a burst of concurrent failures.

The bounds asserted are generous (a hang or a 30 s backoff, not a speed): the figures themselves
come from ``measure_outage``, which ``python -m tests.functional.test_pool_outage`` prints as
JSON."""

from __future__ import annotations

import contextlib
import hashlib
import json
import select
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvctl.remote.agent_source import AgentSource
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.errors import TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.agents import running_agent

TENANT = "t1"
CHUNK_BYTES = 4 << 10
#: a read that takes longer than this during an outage blocked (the old timeouts: 2 s, 5 s)
READ_BOUND_S = 1.5
#: reads must hit again within this after the pool is back (the old backoff: up to 30 s)
RECOVERY_BOUND_S = 10.0
#: concurrent reads that meet the outage first: one burst
BURST = 8
AGENT_SMALL = ["--disk", "0", "--cpu", "64MiB"]


class TcpProxy:
    """A loopback TCP forwarder to ``target`` that a test can ``stall`` (connections and new
    accepts kept, no byte forwarded), ``cut`` (every connection closed, new ones refused) and
    ``restore`` (on the same port)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._forwarding = threading.Event()
        self._forwarding.set()
        self._stop = threading.Event()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        self.port = self._listen(0)
        self._spawn(self._accept)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _listen(self, port: int) -> int:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        with self._lock:
            self._listener = s
        return int(s.getsockname()[1])

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="test-proxy")
        t.start()
        self._threads.append(t)

    def _accept(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                listener = self._listener
            if listener is None:  # cut: nothing listens
                time.sleep(0.01)
                continue
            try:
                ready, _, _ = select.select([listener], [], [], 0.05)
                if not ready:
                    continue
                client, _ = listener.accept()
            except (OSError, ValueError):  # closed by cut()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                if not self._forwarding.wait(0.05):
                    continue  # stalled: bytes wait in the kernel's buffers
                ready, _, _ = select.select([src], [], [], 0.05)
                if not ready:
                    continue
                data = src.recv(1 << 16)
                if not data:
                    break
                # stalled while this was read: it waits too (a stall holds every byte after it)
                while not self._forwarding.wait(0.05):
                    if self._stop.is_set():
                        return
                dst.sendall(data)
        except (OSError, ValueError):
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def stall(self) -> None:
        self._forwarding.clear()

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            pairs, self._pairs = self._pairs, []
        if listener is not None:
            listener.close()
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()

    def restore(self) -> None:
        with self._lock:
            listening = self._listener is not None
        if not listening:
            self._listen(self.port)
        self._forwarding.set()

    def close(self) -> None:
        self._stop.set()
        self._forwarding.set()
        self.cut()
        for t in self._threads:
            t.join(timeout=5)


def key(i: int, space: str) -> bytes:
    return hashlib.blake2b(f"{space}/{i}".encode(), digest_size=16).digest()


def fill_pool(redis_url: str, prefix: str, keys: list[bytes]) -> None:
    """Every key as one chunk in the pool, written straight to Redis (not through the proxy)."""
    direct = RedisPool(redis_url, prefix=prefix, capacity_bytes=64 << 20)
    try:
        for lo in range(0, len(keys), 64):
            batch = [
                (ChunkMeta(k, CHUNK_BYTES, tokens=256, tenant=TENANT), bytes([k[0]]) * CHUNK_BYTES)
                for k in keys[lo : lo + 64]
            ]
            assert all(direct.put_many(batch))
    finally:
        direct.close()


@contextlib.contextmanager
def node(pool_url: str, prefix: str) -> Iterator[tuple[RemoteTiers, Source]]:
    """One node's store and remote tiers on the pool at ``pool_url``, with its background work
    (link monitor: it probes a source whose backoff ran out) started. The link is forced to
    fetch: the test is about reaching the pool, not about whether fetching pays."""
    backend = RedisPool(pool_url, prefix=prefix)
    pool = Source("pool", POOL_TIER, backend, LinkEstimator("pool", override="fetch"))
    store = TieredStore([CpuTier(64 << 20)], chunk_tokens=256)
    remote = RemoteTiers(
        store, pool=pool, prefill=PrefillRate(1e4, "configured"), write_through=False
    )
    remote.start()
    try:
        yield remote, pool
    finally:
        remote.close()
        store.close()


def read(remote: RemoteTiers, k: bytes) -> tuple[bool, float, float]:
    """One chunk read the way an engine reads it: a lookup, then a fill of what is missing.
    Returns (hit, lookup seconds, fill seconds)."""
    t0 = time.perf_counter()
    res = remote.lookup([k], tenant=TENANT)
    t1 = time.perf_counter()
    arrived = remote.fill([k], tenant=TENANT)
    t2 = time.perf_counter()
    return res.matched_chunks == 1 and arrived == 1, t1 - t0, t2 - t1


def _spread(samples: list[float]) -> dict[str, float | int]:
    return {
        "n": len(samples),
        "median_s": statistics.median(samples),
        "max_s": max(samples),
    }


def measure_outage(
    redis_url: str, prefix: str, *, mode: str, outage_s: float = 3.0
) -> dict[str, Any]:
    """Reads through one outage of the pool (``mode``: ``stall`` or ``cut``) and its end: the
    latency of the lookups and fills that met it (a burst of ``BURST`` concurrent reads, then
    one at a time for ``outage_s``), whether any hit, the breaker's state at its end, and the
    seconds from the pool's return to the first hit (None: none within ``RECOVERY_BOUND_S``)."""
    keys = [key(i, f"{prefix}/{mode}") for i in range(BURST + 1200)]
    fill_pool(redis_url, prefix, keys)
    fresh = iter(keys)
    proxy = TcpProxy(("127.0.0.1", int(redis_url.rsplit(":", 1)[1].split("/")[0])))
    try:
        with node(proxy.url, prefix) as (remote, pool):
            before = read(remote, next(fresh))
            getattr(proxy, mode)()
            with ThreadPoolExecutor(BURST) as readers:
                burst = list(
                    readers.map(lambda k: read(remote, k), [next(fresh) for _ in range(BURST)])
                )
            during = list(burst)
            end = time.monotonic() + outage_s
            while time.monotonic() < end:
                during.append(read(remote, next(fresh)))
                time.sleep(0.05)
            state_during = pool.status().get("breaker")
            proxy.restore()
            back = time.monotonic()
            recovery_s: float | None = None
            while time.monotonic() - back < RECOVERY_BOUND_S:
                if read(remote, next(fresh))[0]:
                    recovery_s = time.monotonic() - back
                    break
                time.sleep(0.05)
            status = pool.status()
    finally:
        proxy.close()
    return {
        "mode": mode,
        "outage_s": outage_s,
        "hit_before": before[0],
        "reads_during": len(during),
        "hits_during": sum(hit for hit, _, _ in during),
        "lookup_during": _spread([lk for _, lk, _ in during]),
        "fill_during": _spread([f for _, _, f in during]),
        "burst_fill_max_s": max(f for _, _, f in burst),
        "breaker_during": state_during,
        "recovery_s": recovery_s,
        "breaker_after": status.get("breaker"),
        "errors": status["errors"],
        "skipped": status["skipped"],
    }


@pytest.mark.parametrize("mode", ["stall", "cut"])
def test_reads_miss_fast_while_the_pool_is_away_and_hit_again_soon_after(
    redis_url: str, redis_prefix: str, mode: str
) -> None:
    got = measure_outage(redis_url, redis_prefix, mode=mode)
    print(json.dumps(got))  # the figures, for whoever runs with -s
    assert got["hit_before"] is True
    assert got["hits_during"] == 0 and got["reads_during"] > BURST
    slowest = max(got["lookup_during"]["max_s"], got["fill_during"]["max_s"])
    assert slowest < READ_BOUND_S, f"a read blocked {slowest:.2f} s while the pool was away"
    assert got["recovery_s"] is not None, (
        f"no read hit within {RECOVERY_BOUND_S} s of the pool's return: {got['breaker_after']}"
    )
    assert got["breaker_during"]["state"] in ("open", "half_open")
    assert got["breaker_after"]["state"] == "closed"
    assert got["errors"] >= 1 and got["skipped"] >= 1


def test_an_agent_answers_through_a_pool_outage_and_shows_its_breaker(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """The same through a real agent: its data plane answers lookups and gets during a stalled
    pool within the bound (the agent's own defaults: no timeout configured), ``/v1/remote``
    shows the pool's breaker open, then closed once the pool is back and reads hit again."""
    keys = [key(i, f"{redis_prefix}/agent") for i in range(600)]
    fill_pool(redis_url, redis_prefix, keys)
    fresh = iter(keys)
    proxy = TcpProxy(("127.0.0.1", int(redis_url.rsplit(":", 1)[1].split("/")[0])))
    args = ["--pool", proxy.url, "--pool-prefix", redis_prefix, "--link", "pool:override=fetch"]
    try:
        with (
            running_agent(tmp_path / "b", "--name", "b", *args, *AGENT_SMALL) as b,
            b.data() as d,
            b.control() as ctl,
        ):

            def agent_read(k: bytes) -> tuple[bool, float]:
                t0 = time.perf_counter()
                matched = d.lookup([k], tenant=TENANT).matched_chunks
                got = d.get_many([k], tenant=TENANT)[0]
                hit = matched == 1 and got is not None
                if hit:
                    assert bytes(got) == bytes([k[0]]) * CHUNK_BYTES  # type: ignore[arg-type]
                return hit, time.perf_counter() - t0

            assert agent_read(next(fresh))[0]
            proxy.stall()
            during = [agent_read(next(fresh)) for _ in range(3)]
            shown = ctl.remote()["pool"]
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                during.append(agent_read(next(fresh)))
                time.sleep(0.05)
            assert not any(hit for hit, _ in during)
            slowest = max(s for _, s in during)
            assert slowest < READ_BOUND_S, f"a request blocked {slowest:.2f} s"
            assert shown["breaker"]["state"] in ("open", "half_open") and shown["up"] is False
            # the read's socket timeout, or the pull's deadline (0.5 s plus its bytes' time)
            # when that ends it first: either says the stall
            assert any(w in shown["last_error"] for w in ("Timeout", "past its deadline"))
            proxy.restore()
            back = time.monotonic()
            while not agent_read(next(fresh))[0]:
                assert time.monotonic() - back < RECOVERY_BOUND_S, ctl.remote()["pool"]
                time.sleep(0.05)
            after = ctl.remote()["pool"]
            assert after["breaker"]["state"] == "closed" and after["up"] is True
            assert after["breaker"]["opens"] >= 1
            # and on /metrics: the state now, and the opening counted
            text = ctl.metrics_text()
            assert 'kvctl_remote_source_breaker_state{source="pool",state="closed",' in text
            opens = [
                ln
                for ln in text.splitlines()
                if ln.startswith("kvctl_remote_source_breaker_opens_total{")
            ]
            assert opens and float(opens[0].rsplit(" ", 1)[1]) >= 1
    finally:
        proxy.close()


def test_reads_of_a_stalled_agent_pool_give_up_within_the_read_deadline(tmp_path: Path) -> None:
    """A pool agent (``kvctl://``) that stops answering: probes, gets and pings fail as
    ``TierUnavailable`` after the read deadline (default settings), not the 5 s socket timeout;
    the same source reads again once it answers."""
    with running_agent(tmp_path / "pool", "--role", "pool", "--name", "pool", *AGENT_SMALL) as p:
        host, port = (p.state.data_tcp or "").rsplit(":", 1)
        proxy = TcpProxy((host, int(port)))
        src = AgentSource(f"127.0.0.1:{proxy.port}")
        meta = ChunkMeta(key(0, "agent-pool"), CHUNK_BYTES, tokens=256, tenant=TENANT)
        try:
            assert src.put_many([(meta, b"x" * CHUNK_BYTES)]) == [True]
            proxy.stall()
            reads: list[Callable[[], object]] = [
                lambda: src.probe_many([meta.key], tenant=TENANT),
                lambda: src.get_many([meta.key], tenant=TENANT),
                src.ping,
            ]
            for read_once in reads:
                t0 = time.perf_counter()
                with pytest.raises(TierUnavailable):
                    read_once()
                blocked_s = time.perf_counter() - t0
                assert blocked_s < READ_BOUND_S, f"a read blocked {blocked_s:.2f} s"
            proxy.restore()
            got = src.get_many([meta.key], tenant=TENANT)[0]
            assert got is not None and bytes(got.data) == b"x" * CHUNK_BYTES
        finally:
            src.close()
            proxy.close()


if __name__ == "__main__":  # figures: python -m tests.functional.test_pool_outage [REDIS_URL]
    import sys
    import uuid

    import redis

    url = sys.argv[1] if len(sys.argv) > 1 else "redis://127.0.0.1:6379/0"
    results = []
    for m in ("stall", "cut"):
        p = f"kvctl-outage-bench-{uuid.uuid4().hex[:8]}"
        try:
            results.append(measure_outage(url, p, mode=m))
        finally:
            c = redis.Redis.from_url(url)
            for pattern in (f"{p}:*", "{" + p + "}:*"):
                names = list(c.scan_iter(match=pattern, count=1000))
                if names:
                    c.delete(*names)
            c.close()
    print(json.dumps(results, indent=2))
