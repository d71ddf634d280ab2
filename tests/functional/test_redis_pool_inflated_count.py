"""A pool count another client of the server inflated (a whole number, so no recount: another
host's bug, or hostile): {P}:used's bytes, or a tenant's t:<tenant>, set far past what the pool
holds. The capacity or quota loop evicted every chunk it could and then refused every put for
good ('no room'), as no eviction brings such a count down: one HSET stopped the pool, or a
tenant, until someone deleted the key. With nothing left to evict and the count still over, the
count is counted again from {P}:meta (once a script call) and the put goes on. Real Redis (the
machine's, a key prefix per test); no mocks."""

from __future__ import annotations

import pytest
import redis

from kvctl.remote.redis_pool import RedisPool
from tests.functional.test_redis_pool import chunk, present


@pytest.mark.parametrize("field", ["bytes", "t:a"])
def test_an_inflated_count_stops_no_put_for_good(
    redis_url: str, redis_prefix: str, field: str
) -> None:
    pool = RedisPool(redis_url, prefix=redis_prefix, capacity_bytes=1000, tenant_quota_bytes=600)
    raw = redis.Redis.from_url(redis_url)
    try:
        a, b, c = (chunk(i) for i in range(3))
        assert pool.put_many([a]) == [True]
        raw.hset("{" + redis_prefix + "}:used", field, 10**17)
        assert pool.put_many([b]) == [True]
        assert pool.put_many([c]) == [True]
        assert present(pool, [b, c]) == [True, True]
        usage = pool.usage()
        # counted again: what the pool holds (a may have gone to make room meanwhile)
        held = 2 + present(pool, [a])[0]
        assert (usage.chunks, usage.used_bytes, usage.tenant_bytes) == (
            held,
            300 * held,
            {"a": 300 * held},
        )
    finally:
        raw.close()
        pool.close()
