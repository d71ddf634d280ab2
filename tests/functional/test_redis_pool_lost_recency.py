"""A pool whose recency zset was lost while {P}:meta still holds its entries ({P}:lru, or a
tenant's {P}:lru:t:<tenant>, deleted by another client or evicted by the server's allkeys-*
maxmemory policy): nothing was left to evict, so once full every put was refused for good, and
each paid a recount of every entry (5991a48). The zset is made again from meta and the put
evicts as usual. Real Redis (the machine's, a key prefix per test); no mocks."""

from __future__ import annotations

import pytest
import redis

from kvctl.remote.redis_pool import RedisPool
from tests.functional.test_redis_pool import chunk, present


@pytest.mark.parametrize(
    ("zset", "capacity_bytes", "quota_bytes"),
    [("lru", 900, 0), ("lru:t:a", 100_000, 900)],
    ids=["capacity", "tenant-quota"],
)
def test_a_lost_recency_zset_stops_no_put_for_good(
    redis_url: str, redis_prefix: str, zset: str, capacity_bytes: int, quota_bytes: int
) -> None:
    # the capacity, or the tenant's quota, holds 3 chunks of 300 bytes (the other does not bind)
    pool = RedisPool(
        redis_url,
        prefix=redis_prefix,
        capacity_bytes=capacity_bytes,
        tenant_quota_bytes=quota_bytes,
    )
    raw = redis.Redis.from_url(redis_url)
    try:
        held = [chunk(i) for i in range(3)]
        assert pool.put_many(held) == [True] * 3
        assert raw.delete("{" + redis_prefix + "}:" + zset) == 1
        later = [chunk(10 + i) for i in range(3)]
        for item in later:
            assert pool.put_many([item]) == [True]
        assert present(pool, later) == [True] * 3
        assert present(pool, held) == [False] * 3  # the oldest made room, as ever
        usage = pool.usage()
        assert (usage.chunks, usage.used_bytes) == (3, 900)
    finally:
        raw.close()
        pool.close()
