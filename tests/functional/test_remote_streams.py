"""Remote pulls split over several connections, against real sources: a real agent (FETCH over
its data plane) and the machine's Redis (or a throwaway redis-server for kills and hangs). Every
chunk's bytes and metadata exact, callbacks once per chunk in order within each stream, a source
killed or hung mid-pull ending as TierUnavailable (a miss in the federation) without hanging
past the timeout, and a corrupt chunk among many a counted miss. No mocks, no speed asserted."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvctl.remote.agent_source import AgentSource
from kvctl.remote.federation import PEER_TIER, POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.remote.pool import PoolChunk, stream_groups
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.errors import TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.agents import Agent, payload, running_agent

SMALL = ["--disk", "64MiB", "--cpu", "256MiB"]
#: a hung or dead source must end the pull within its timeout and this much more (a bound on a
#: hang, not a speed: the pull itself takes milliseconds)
HANG_SLACK_S = 10.0


def key(i: int, space: str = "") -> bytes:
    return hashlib.blake2b(f"{space}/{i}".encode(), digest_size=16).digest()


def chain_metas(n: int, size: int, space: str, tenant: str = "t1") -> list[ChunkMeta]:
    keys = [key(i, space) for i in range(n)]
    return [
        ChunkMeta(k, size, tokens=256, tenant=tenant, parent=keys[i - 1] if i else None)
        for i, k in enumerate(keys)
    ]


def store_in(agent: Agent, metas: list[ChunkMeta]) -> None:
    src = AgentSource(agent.state.data_tcp or "", streams=1)
    try:
        for lo in range(0, len(metas), 8):
            batch = metas[lo : lo + 8]
            assert all(src.put_many([(m, payload(m.key, m.size_bytes)) for m in batch]))
    finally:
        src.close()


class Arrivals:
    """What ``arrived`` saw: (index, thread) per call, and each chunk checked as it landed."""

    def __init__(self, metas: dict[bytes, ChunkMeta], on_first: object = None) -> None:
        self.metas = metas
        self.calls: list[tuple[int, int]] = []
        self.wrong: list[int] = []
        self.on_first = on_first
        self._lock = threading.Lock()

    def __call__(self, i: int, chunk: PoolChunk) -> None:
        with self._lock:
            self.calls.append((i, threading.get_ident()))
            first = len(self.calls) == 1
        want = self.metas.get(chunk.meta.key)
        if want is None or bytes(chunk.data) != payload(want.key, want.size_bytes):
            self.wrong.append(i)
        if first and callable(self.on_first):
            self.on_first()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with running_agent(tmp_path / "src", "--name", "src", *SMALL) as a:
        yield a


def test_a_split_pull_returns_every_chunk_with_its_metadata(agent: Agent) -> None:
    metas = chain_metas(24, 256 << 10, "split")
    store_in(agent, metas)
    # two keys the source lacks, amid the others
    keys = [m.key for m in metas[:10]] + [key(0, "absent"), key(1, "absent")]
    keys += [m.key for m in metas[10:]]
    by_key = {m.key: m for m in metas}
    results = {}
    for streams in (1, 4):
        src = AgentSource(agent.state.data_tcp or "", streams=streams, min_stream_bytes=1 << 20)
        try:
            seen = Arrivals(by_key)
            got = src.get_many(keys, tenant="t1", arrived=seen)
        finally:
            src.close()
        assert not seen.wrong
        found = [i for i, k in enumerate(keys) if k in by_key]
        assert sorted(i for i, _ in seen.calls) == found  # once per chunk that came
        # the first pull knows no chunk size: two keys per stream at least, so 4 groups here
        groups = stream_groups(
            len(keys), streams=streams, chunk_bytes_seen=0, min_stream_bytes=1 << 20
        )
        assert len(groups) == streams
        for lo, hi in groups:  # each contiguous group on one thread, in order
            calls = [(i, t) for i, t in seen.calls if lo <= i < hi]
            assert [i for i, _ in calls] == [i for i in found if lo <= i < hi]
            assert len({t for _, t in calls}) == 1
        if streams > 1:  # (a worker may serve two groups one after the other)
            assert len({t for _, t in seen.calls}) > 1
        for k, g in zip(keys, got, strict=True):
            want = by_key.get(k)
            if want is None:
                assert g is None
                continue
            assert g is not None and bytes(g.data) == payload(k, want.size_bytes)
            m = g.meta
            assert (m.key, m.size_bytes, m.tokens, m.tenant, m.parent, m.isolated) == (
                want.key, want.size_bytes, 256, "t1", want.parent, False,
            )  # fmt: skip
        results[streams] = [None if g is None else (g.meta, bytes(g.data)) for g in got]
        assert src.corrupt == 0
    assert results[1] == results[4]


def test_small_pulls_stay_on_one_connection(agent: Agent) -> None:
    metas = chain_metas(6, 64 << 10, "small")
    store_in(agent, metas)
    src = AgentSource(agent.state.data_tcp or "", streams=4)  # 8 MiB per stream at least
    try:
        src.probe_many([m.key for m in metas], tenant="t1")  # the chunk size is known now
        seen = Arrivals({m.key: m for m in metas})
        src.get_many([m.key for m in metas], tenant="t1", arrived=seen)
    finally:
        src.close()
    assert [i for i, _ in seen.calls] == list(range(6))
    assert len({t for _, t in seen.calls}) == 1


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_source_failing_mid_pull_is_a_miss_within_the_timeout(tmp_path: Path, how: str) -> None:
    metas = chain_metas(64, 1 << 20, how)
    timeout_s = 1.0
    with running_agent(tmp_path / how, "--name", how, *SMALL) as a:
        store_in(a, metas)
        backend = AgentSource(
            a.state.data_tcp or "", timeout_s=timeout_s, streams=4, min_stream_bytes=1 << 20
        )
        source = Source("peer", PEER_TIER, backend, LinkEstimator("peer"))

        def fail() -> None:  # once the first chunk is in: the rest is still on its way
            if how == "killed":
                a.kill9()
            else:
                os.kill(a.proc.pid, signal.SIGSTOP)

        seen = Arrivals({m.key: m for m in metas}, on_first=fail)
        keys = [m.key for m in metas]
        # each chunk received into a buffer of the caller's; the ones that did not land are
        # handed back (``unused``) by their own stream, once it reads no more
        buffers = {i: memoryview(bytearray(m.size_bytes)) for i, m in enumerate(metas)}
        given: dict[int, int] = {}
        handed_back: dict[int, int] = {}

        def into(i: int, meta: ChunkMeta) -> memoryview:
            given[i] = threading.get_ident()
            return buffers[i]

        def unused(i: int) -> None:
            handed_back[i] = threading.get_ident()

        try:
            start = time.monotonic()
            with pytest.raises(TierUnavailable, match=backend.address):
                backend.get_many(keys, tenant="t1", arrived=seen, into=into, unused=unused)
            assert time.monotonic() - start < timeout_s + HANG_SLACK_S
            n_calls = len(seen.calls)
            assert 1 <= n_calls < len(keys) and not seen.wrong  # what came, came whole
            landed = {i for i, _ in seen.calls}
            assert handed_back and set(handed_back) == set(given) - landed
            assert all(handed_back[i] == given[i] for i in handed_back)  # on its stream
            for i in landed:  # received in place
                assert bytes(buffers[i]) == payload(keys[i], metas[i].size_bytes)
            # in the federation the same failure is a miss and a counted error, not an exception
            start = time.monotonic()
            got = source.call(
                "fetch", lambda: backend.get_many(keys, tenant="t1"), moved_bytes=lambda _: 0
            )
            assert got is None and source.counters.errors == 1
            assert time.monotonic() - start < timeout_s + HANG_SLACK_S
            assert len(seen.calls) == n_calls  # no callback after get_many returned
        finally:
            backend.close()
            if how == "hung":
                os.kill(a.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("how", ["killed-with-a-peer", "hung-alone"])
def test_chunks_that_landed_before_a_stream_failed_count_once_and_are_not_pulled_again(
    tmp_path: Path, how: str
) -> None:
    """A split pull from the pool whose server dies (or hangs) mid-pull: the streams hand some
    chunks over and then fail. Those chunks are stored, so they are counted as arrived, read once
    (bytes, source counters) and not asked of the next source; the rest come from the peer."""
    n, size = 64, 1 << 20
    metas = chain_metas(n, size, how)
    keys = [m.key for m in metas]
    with contextlib.ExitStack() as stack:
        dying = stack.enter_context(running_agent(tmp_path / "pool", "--name", "pool", *SMALL))
        store_in(dying, metas)
        peers = []
        if how == "killed-with-a-peer":
            healthy = stack.enter_context(
                running_agent(tmp_path / "peer", "--name", "peer", "--cpu", "128MiB")
            )
            store_in(healthy, metas)
            peer_backend = AgentSource(healthy.state.data_tcp or "", streams=1)
            peers.append(Source("peer", PEER_TIER, peer_backend, LinkEstimator("peer")))
        backend = AgentSource(
            dying.state.data_tcp or "", timeout_s=1.0, streams=4, min_stream_bytes=1 << 20
        )
        pool = Source("pool", POOL_TIER, backend, LinkEstimator("pool"))
        store = TieredStore([CpuTier(2 * n * size)], chunk_tokens=256)
        stack.callback(store.close)
        remote = RemoteTiers(
            store, pool=pool, peers=peers, prefill=PrefillRate(1e4, "configured"),
            write_through=False,
        )  # fmt: skip
        stack.callback(remote.close)
        stored: list[str] = []

        def on_event(event: dict) -> None:  # the first chunk is in: fail the pool under the rest
            if event["type"] != "store":
                return
            stored.append(event["key"])
            if len(stored) == 1:
                if how.startswith("killed"):
                    dying.kill9()
                else:
                    os.kill(dying.proc.pid, signal.SIGSTOP)
                    stack.callback(os.kill, dying.proc.pid, signal.SIGCONT)

        store.subscribe(on_event)
        arrived = remote.fill(keys, tenant="t1")
        from_pool = pool.counters.chunks_in
        assert pool.counters.errors == 1 and 1 <= from_pool < n  # the failure came mid-pull
        local = [k for k, t in zip(keys, store.locate(keys, tenant="t1"), strict=True) if t]
        assert len(stored) == len(set(stored)) == len(local)  # each chunk stored once
        tiers = store.stats.tiers
        reads = {t: tiers[t].bytes_read for t in (POOL_TIER, PEER_TIER) if t in tiers}
        if peers:
            # the peer was asked for the rest only: every chunk crossed a link once
            assert peers[0].counters.chunks_in == n - from_pool
            assert len(local) == arrived == n
            assert reads == {POOL_TIER: from_pool * size, PEER_TIER: (n - from_pool) * size}
        else:
            assert arrived == len(local) == from_pool  # what landed is what fill reports
            assert reads == {POOL_TIER: from_pool * size}
        for k in local:
            data = bytearray(size)
            store.read_into(k, memoryview(data))
            assert data == payload(k, size)
        # the chunks were received in the arena: the ones cut mid-chunk gave their space back
        cpu = store.lease_tier
        assert cpu is not None and cpu.reserved_bytes == 0
        assert cpu.used_bytes == len(local) * size


def test_a_pull_receives_each_chunk_where_into_says(agent: Agent) -> None:
    """``into`` names each chunk's buffer: its bytes are read from the socket straight there
    and the chunk handed over is that memory; None (or a key it is not asked for) gets a
    buffer of the source's own."""
    size = 256 << 10
    metas = chain_metas(12, size, "into")
    store_in(agent, metas)
    keys = [m.key for m in metas[:6]] + [key(0, "absent")] + [m.key for m in metas[6:]]
    arena = bytearray(len(keys) * size)
    asked: list[int] = []

    def into(i: int, meta: ChunkMeta) -> memoryview | None:
        asked.append(i)
        if i == 2:
            return None  # this one in a buffer of the source's own
        return memoryview(arena)[i * size : (i + 1) * size]

    src = AgentSource(agent.state.data_tcp or "", streams=4, min_stream_bytes=1 << 20)
    try:
        seen = Arrivals({m.key: m for m in metas})
        got = src.get_many(keys, tenant="t1", arrived=seen, into=into)
    finally:
        src.close()
    assert not seen.wrong and sorted(asked) == [i for i in range(len(keys)) if i != 6]
    assert got[6] is None
    for i, k in enumerate(keys):
        if i == 6:
            continue
        chunk = got[i]
        assert chunk is not None and bytes(chunk.data) == payload(k, size)
        in_place = bytes(arena[i * size : (i + 1) * size]) == payload(k, size)
        assert in_place == (i != 2)
        if i != 2:  # the very memory into gave, not a copy of it
            chunk.data[:1] = b"\x00" if chunk.data[0] else b"\x01"
            assert arena[i * size] == chunk.data[0]


def test_a_fill_lands_every_chunk_in_the_arena_through_a_resize(tmp_path: Path) -> None:
    """A split pull into a store: each chunk received into reserved arena space and committed
    as it lands; an agent resize mid-pull (a new arena) loses nothing: chunks whose space went
    with the old arena are put from it. Nothing stays reserved, every byte is the source's."""
    n, size = 32, 1 << 20
    metas = chain_metas(n, size, "resize")
    keys = [m.key for m in metas]
    with running_agent(tmp_path / "pool", "--name", "pool", *SMALL) as a:
        store_in(a, metas)
        backend = AgentSource(a.state.data_tcp or "", streams=4, min_stream_bytes=1 << 20)
        pool = Source("pool", POOL_TIER, backend, LinkEstimator("pool"))
        store = TieredStore([CpuTier(n * size + size)], chunk_tokens=256)
        remote = RemoteTiers(
            store, pool=pool, prefill=PrefillRate(1e4, "configured"), write_through=False
        )
        stored: list[str] = []

        def on_event(event: dict) -> None:
            if event["type"] != "store":
                return
            stored.append(event["key"])
            if len(stored) == 1:  # the other streams are mid-chunk: their space is reserved
                store.resize("cpu", 2 * n * size)

        store.subscribe(on_event)
        try:
            assert remote.fill(keys, tenant="t1") == n
            assert pool.counters.chunks_in == n and pool.counters.errors == 0
            assert len(stored) == len(set(stored)) == n
            assert store.locate(keys, tenant="t1") == ["cpu"] * n
            cpu = store.lease_tier
            assert cpu is not None and cpu.reserved_bytes == 0 and cpu.used_bytes == n * size
            assert store.stats.tiers[POOL_TIER].bytes_read == n * size
            for m in metas:
                data = bytearray(size)
                store.read_into(m.key, memoryview(data), tenant="t1")
                assert data == payload(m.key, size)
                e = store.entry(m.key)
                assert (e.tenant, e.parent, e.tokens) == ("t1", m.parent, 256)
            assert remote.fill(keys, tenant="t1") == 0  # all local now: nothing pulled again
        finally:
            remote.close()
            store.close()
            backend.close()


def test_a_corrupt_chunk_among_many_is_a_miss(agent: Agent) -> None:
    metas = chain_metas(16, 256 << 10, "corrupt")
    store_in(agent, metas)
    bad = metas[9]
    with agent.control() as ctl:
        ctl.move([bad.key], "disk")
    path = agent.data_dir / "disk" / bad.key.hex()[:2] / f"{bad.key.hex()}.kv"
    with open(path, "r+b") as f:  # a payload byte flipped on the disk
        f.seek(-1000, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1000, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    src = AgentSource(agent.state.data_tcp or "", streams=4, min_stream_bytes=1 << 20)
    try:
        seen = Arrivals({m.key: m for m in metas})
        got = src.get_many([m.key for m in metas], tenant="t1", arrived=seen)
    finally:
        src.close()
    assert got[9] is None and 9 not in {i for i, _ in seen.calls}
    assert not seen.wrong and len(seen.calls) == 15
    for m, g in zip(metas, got, strict=True):
        if m is not bad:
            assert g is not None and bytes(g.data) == payload(m.key, m.size_bytes)
    with agent.control() as ctl:  # the source counted it and dropped it
        assert ctl.stats()["stats"]["corrupt_dropped"] == 1


# --- the pool on Redis --------------------------------------------------------------------------
@pytest.fixture
def pool(redis_url: str, redis_prefix: str) -> Iterator[RedisPool]:
    p = RedisPool(redis_url, prefix=redis_prefix, streams=4, min_stream_bytes=256 << 10)
    yield p
    p.close()


def pool_chunks(n: int, size: int, space: str) -> list[tuple[ChunkMeta, bytes]]:
    out = []
    for i, m in enumerate(chain_metas(n, size, space)):
        iso = ChunkMeta(
            m.key, m.size_bytes, tokens=m.tokens, tenant=f"t{i % 3}", parent=m.parent,
            priority=30 + i, isolated=i % 5 == 0, created_s=1.7e9 + i,
        )  # fmt: skip
        out.append((iso, payload(m.key, size)))
    return out


def test_a_split_pool_get_returns_every_chunk_and_touches_all_in_order(
    pool: RedisPool, redis_url: str, redis_prefix: str
) -> None:
    items = pool_chunks(24, 128 << 10, "pool")
    assert all(pool.put_many(items))
    keys = [m.key for m, _ in items]
    for tenant in ("t0", "t1"):
        got = pool.get_many(keys, tenant=tenant)
        for (m, data), g in zip(items, got, strict=True):
            if m.isolated and m.tenant != tenant:
                assert g is None  # another tenant's isolated chunk stays hidden
                continue
            assert g is not None and g.meta == m and bytes(g.data) == data
        # one LRU script for the whole get: the keys it may see touched in the order asked
        client = redis.Redis.from_url(redis_url)
        try:
            scores = dict(client.zrange("{" + redis_prefix + "}:lru", 0, -1, withscores=True))
        finally:
            client.close()
        visible = [m.key.hex().encode() for m, _ in items if not m.isolated or m.tenant == tenant]
        touched = [scores[h] for h in visible]
        assert touched == sorted(touched) and len(set(touched)) == len(touched)
    assert pool.corrupt == 0


def test_a_corrupt_record_among_many_is_a_counted_miss(
    pool: RedisPool, redis_url: str, redis_prefix: str
) -> None:
    items = pool_chunks(20, 128 << 10, "pool-corrupt")
    assert all(pool.put_many(items))
    bad = items[13][0]
    name = f"{redis_prefix}:c:{bad.key.hex()}"
    client = redis.Redis.from_url(redis_url)
    try:
        client.setrange(name, client.strlen(name) - 500, b"\xff\x00")
        got = pool.get_many([m.key for m, _ in items], tenant=bad.tenant)
        assert got[13] is None and pool.corrupt == 1
        assert client.exists(name) == 0  # dropped, accounting too
    finally:
        client.close()
    for i, ((m, data), g) in enumerate(zip(items, got, strict=True)):
        if i != 13 and (not m.isolated or m.tenant == bad.tenant):
            assert g is not None and bytes(g.data) == data
    assert pool.usage().chunks == len(items) - 1


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_pool_server_failing_under_a_split_get_raises_tier_unavailable(
    private_redis, how: str
) -> None:  # type: ignore[no-untyped-def]
    timeout_s = 0.5
    p = RedisPool(
        private_redis.url, prefix="p", timeout_s=timeout_s, streams=4, min_stream_bytes=64 << 10
    )
    try:
        items = pool_chunks(16, 128 << 10, how)
        assert all(p.put_many(items))
        if how == "killed":
            private_redis.kill()
        else:
            os.kill(private_redis.proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(TierUnavailable, match=f"pool {private_redis.url}"):
            p.get_many([m.key for m, _ in items], tenant="t0")
        # a hung server: every stream times out at once, not one after another (and retries of
        # a refused connection back off well under a second each)
        assert time.monotonic() - start < 4 * timeout_s + HANG_SLACK_S
    finally:
        if how == "hung":
            os.kill(private_redis.proc.pid, signal.SIGCONT)
        p.close()


def test_stream_groups() -> None:
    assert stream_groups(0, streams=4, chunk_bytes_seen=0, min_stream_bytes=1) == []
    assert stream_groups(1, streams=4, chunk_bytes_seen=0, min_stream_bytes=1) == [(0, 1)]
    # unknown chunk size: at least two keys per stream
    assert stream_groups(5, streams=4, chunk_bytes_seen=0, min_stream_bytes=1) == [(0, 2), (2, 5)]
    # known size: one stream per min_stream_bytes, at most `streams`, sizes within one
    groups = stream_groups(10, streams=4, chunk_bytes_seen=4 << 20, min_stream_bytes=8 << 20)
    assert groups == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert stream_groups(3, streams=4, chunk_bytes_seen=1 << 20, min_stream_bytes=8 << 20) == [
        (0, 3)
    ]
    assert stream_groups(64, streams=1, chunk_bytes_seen=0, min_stream_bytes=1) == [(0, 64)]
