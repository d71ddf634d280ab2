"""A chunk's record that is an empty value (another client of the server wrote it: another
host's bug, or hostile). Since 9ec07fd a get reads records with GETRANGE, which answers an empty
value as it answers a missing key, so an empty record is a miss left in place, not a damaged
record deleted. A put's re-put of an accounted chunk writes the record only where it is absent,
and EXISTS called an empty value present: a chunk whose record was made empty was never written
again while it stayed accounted, and each re-put (a touch) kept its accounting from expiring, so
a hot chunk was lost for good, every put of it 'stored'. Real Redis (the machine's, a key prefix
per test); no mocks."""

from __future__ import annotations

import redis

from kvctl.remote.redis_pool import RedisPool
from tests.functional.test_redis_pool import chunk


def test_a_re_put_writes_a_record_made_empty_again(redis_url: str, redis_prefix: str) -> None:
    pool = RedisPool(redis_url, prefix=redis_prefix)
    raw = redis.Redis.from_url(redis_url)
    try:
        item = chunk(0, size=1000)
        name = pool._rec(item[0].key.hex())
        assert pool.put_many([item]) == [True]
        raw.set(name, b"")
        assert pool.get_many([item[0].key], tenant="a") == [None]
        assert pool.put_many([item]) == [True]  # a re-put: the chunk is still accounted
        got = pool.get_many([item[0].key], tenant="a")[0]
        assert got is not None and got.data == item[1]
        assert raw.strlen(name) > 0
        usage = pool.usage()
        assert (usage.chunks, usage.used_bytes) == (1, 1000)
    finally:
        raw.close()
        pool.close()


def test_a_re_put_writes_over_a_record_key_of_another_type(
    redis_url: str, redis_prefix: str
) -> None:
    """The same for a chunk's key holding another type (a list): EXISTS said it present too;
    a re-put now writes the record over it (SET replaces a key of any type)."""
    pool = RedisPool(redis_url, prefix=redis_prefix)
    raw = redis.Redis.from_url(redis_url)
    try:
        item = chunk(1, size=1000)
        name = pool._rec(item[0].key.hex())
        assert pool.put_many([item]) == [True]
        raw.delete(name)
        raw.rpush(name, b"x")
        assert pool.put_many([item]) == [True]
        got = pool.get_many([item[0].key], tenant="a")[0]
        assert got is not None and got.data == item[1]
    finally:
        raw.close()
        pool.close()
