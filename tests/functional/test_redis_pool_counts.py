"""The Redis pool's {P}:used counts: a count the scripts cannot add to is counted again from the
accounting entries (not restarted at 0), and counting costs the put script no extra reads."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
import redis

from kvctl.remote.redis_pool import RedisPool
from kvctl.store.tiers.base import ChunkMeta


def chunk(i: int, size: int = 300, tenant: str = "a") -> tuple[ChunkMeta, bytes]:
    k = hashlib.blake2b(f"counts/{i}".encode(), digest_size=16).digest()
    meta = ChunkMeta(
        key=k,
        size_bytes=size,
        tokens=16,
        tenant=tenant,
        parent=None,
        priority=40,
        isolated=False,
        created_s=1.7e9 + i,
    )
    return meta, bytes([i % 256]) * size


@pytest.fixture
def pools() -> Iterator[list[RedisPool]]:
    made: list[RedisPool] = []
    yield made
    for pool in made:
        pool.close()


def held(pool: RedisPool, items: list[tuple[ChunkMeta, bytes]]) -> list[bool]:
    return [pool.probe_many([m.key], tenant=m.tenant)[0] is not None for m, _ in items]


@pytest.mark.parametrize("count", [b"lots", b"1.5", str(2**63 - 1).encode()])
def test_a_used_count_the_scripts_cannot_add_to_is_counted_again_from_the_entries(
    pools: list[RedisPool], redis_url: str, redis_prefix: str, count: bytes
) -> None:
    """891c8e2 restarted such a count at 0: the chunks already held went uncounted, so the pool
    filled past its capacity (4 x 300 bytes in 900) and, as they went, the count went negative:
    usage() a BadUsageReport for as long as the pool held less than it had at the reset."""
    pool = RedisPool(redis_url, prefix=redis_prefix, capacity_bytes=900)
    pools.append(pool)
    items = [chunk(i, tenant="b" if i == 1 else "a") for i in range(4)]
    assert pool.put_many(items[:3]) == [True] * 3
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.hset(
            f"{{{redis_prefix}}}:used", mapping={"bytes": count, "chunks": count, "t:a": count}
        )
    finally:
        raw.close()
    assert pool.put_many(items[3:]) == [True]
    assert held(pool, items) == [False, True, True, True]  # room made: the oldest evicted
    usage = pool.usage()
    assert (usage.used_bytes, usage.chunks, usage.tenant_bytes) == (900, 3, {"a": 600, "b": 300})
    pool.delete_many([m.key for m, _ in items])
    usage = pool.usage()  # no BadUsageReport: nothing was left uncounted
    assert (usage.used_bytes, usage.chunks, usage.tenant_bytes) == (0, 0, {})


def test_an_evicting_put_reads_no_count_per_increment(
    pools: list[RedisPool], private_redis
) -> None:  # type: ignore[no-untyped-def]
    """891c8e2 read each count (HGET) before every HINCRBY: an evicting put's script ran 28
    commands an item instead of 22 (6 more HGETs: 3 counts accounted, 3 uncounted), on the
    one Redis every agent's puts and reads wait on. Counted, not timed: INFO commandstats."""
    pool = RedisPool(private_redis.url, prefix="c", capacity_bytes=3 * 300)
    pools.append(pool)
    items = [chunk(i) for i in range(13)]
    assert pool.put_many(items[:3]) == [True] * 3
    raw = redis.Redis.from_url(private_redis.url)
    try:
        raw.config_resetstat()
        assert pool.put_many(items[3:]) == [True] * 10  # each evicts one
        stats = raw.info("commandstats")
    finally:
        raw.close()
    assert stats["cmdstat_hincrby"]["calls"] == 10 * 6  # 3 counts up, 3 down, per item
    # per item: its meta entry, the room check's count, the victim's meta entry, the room
    # check again after the eviction; the capacity once (one script call)
    assert stats["cmdstat_hget"]["calls"] <= 10 * 4 + 1


@pytest.mark.parametrize("entry", [b"garbage", b"-300 1.7e9 0 a"])
def test_an_entry_no_writer_made_leaves_no_bytes_counted(
    pools: list[RedisPool], redis_url: str, redis_prefix: str, entry: bytes
) -> None:
    """8808107 drops a {P}:meta entry no writer made where met, but left the bytes its chunk
    counted counted for good: the pool's room shrunk by as much for every agent (here, a 900
    byte pool holding 300 bytes and evicting to stay there; past its capacity in such bytes,
    every put refused). The counts are counted again from the entries left."""
    pool = RedisPool(redis_url, prefix=redis_prefix, capacity_bytes=900)
    pools.append(pool)
    items = [chunk(i) for i in range(5)]
    assert pool.put_many(items[:3]) == [True] * 3
    raw = redis.Redis.from_url(redis_url)
    try:
        meta_key = f"{{{redis_prefix}}}:meta"
        raw.hset(meta_key, items[0][0].key.hex(), entry)  # the LRU's oldest
        raw.hset(meta_key, items[1][0].key.hex(), entry)
    finally:
        raw.close()
    assert pool.put_many([items[1]]) == [True]  # a re-put meets it: accounted anew
    usage = pool.usage()
    assert (usage.used_bytes, usage.chunks, usage.tenant_bytes) == (600, 2, {"a": 600})
    assert held(pool, items[1:3]) == [True, True]  # no room made that was not needed
    # the LRU's oldest (item 0, counted no more) goes as a victim, then item 2 makes the room
    assert pool.put_many(items[3:]) == [True] * 2
    usage = pool.usage()
    assert (usage.used_bytes, usage.chunks, usage.tenant_bytes) == (900, 3, {"a": 900})
    assert held(pool, items) == [False, True, False, True, True]


@pytest.mark.parametrize(
    ("field", "op"),
    [("chunks", "put"), ("bytes", "put"), ("bytes", "delete"), ("chunks", "delete")],
)
def test_a_count_broken_alone_is_counted_again_once_not_twice(
    pools: list[RedisPool], redis_url: str, redis_prefix: str, field: str, op: str
) -> None:
    """One broken count alone, met by a put's or a delete's increments (not the room check):
    the recount counted every count from the entries (the change included), then the
    increments after the broken one added the change again: a put's tenant bytes (and chunks)
    counted twice, a delete's chunks and tenant bytes taken away twice."""
    pool = RedisPool(redis_url, prefix=redis_prefix, capacity_bytes=3000)
    pools.append(pool)
    items = [chunk(i) for i in range(4)]
    assert pool.put_many(items[:3]) == [True] * 3
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.hset(f"{{{redis_prefix}}}:used", field, b"lots")
    finally:
        raw.close()
    if op == "put":
        assert pool.put_many(items[3:]) == [True]
        expected = (1200, 4, {"a": 1200})
    else:
        pool.delete_many([items[0][0].key])
        expected = (600, 2, {"a": 600})
    usage = pool.usage()
    assert (usage.used_bytes, usage.chunks, usage.tenant_bytes) == expected
