"""RedisPool against keys another client of the server wrote (any local client can write a
pool's keys: another host's bug, or hostile): a record far longer than any chunk, and recency
scores that are no timestamp. Real Redis (the machine's, a key prefix per test); no mocks."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from kvctl.remote import record, redis_pool
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.errors import TierUnavailable
from tests.functional.test_redis_pool import chunk, present

MakePool = Callable[..., RedisPool]


@pytest.fixture
def make_pool(redis_url: str, redis_prefix: str) -> Iterator[MakePool]:
    """RedisPools under this test's prefix (its keys deleted afterwards), closed after it."""
    pools: list[RedisPool] = []

    def make(**kw: Any) -> RedisPool:
        pool = RedisPool(redis_url, prefix=redis_prefix, **kw)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _spy_reply_bytes(pool: RedisPool, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every bytes reply the pool's gets read from now on (what came into this
    process's memory)."""
    seen: list[int] = []
    real_pull = pool._pull

    def pull(*args: Any, **kwargs: Any) -> list[Any]:
        replies = real_pull(*args, **kwargs)
        seen.extend(len(r) for r in replies if isinstance(r, bytes))
        return replies

    monkeypatch.setattr(pool, "_pull", pull)
    return seen


def test_a_record_longer_than_any_chunk_is_read_no_further_and_dropped(
    make_pool: MakePool,
    raw: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A get read each record whole with GET: a key planted (or grown by APPEND) up to Redis's
    512 MB came into the agent's memory before any check. It reads at most one byte past the
    longest record a chunk of the pool makes; a longer one is a broken record (a miss counted
    in ``corrupt``, the record deleted and its accounting dropped), as a damaged one is. A sound
    record of another writer configured for larger chunks is a miss too, left in place (see
    test_redis_pool_mixed_max_chunk)."""
    pool = make_pool(max_chunk_bytes=4096)
    assert pool.max_record_bytes < 4096 + 70_000  # the chunk and its largest header
    bigger = make_pool(max_chunk_bytes=1 << 20)  # another writer, configured for larger chunks
    items = [chunk(0, size=4096), chunk(1, size=300)]
    assert pool.put_many(items) == [True, True]
    large = chunk(2, size=1 << 20)
    assert bigger.put_many([large]) == [True]
    names = [f"{pool.prefix}:c:{m.key.hex()}" for m, _ in [*items, large]]
    raw.append(names[0], bytes(1 << 20))  # a sound record with 1 MiB after it

    seen = _spy_reply_bytes(pool, monkeypatch)
    keys = [m.key for m, _ in [*items, large]]
    with caplog.at_level(logging.WARNING, logger="kvctl.remote.redis_pool"):
        got = pool.get_many(keys, tenant="a")
    assert got[0] is None and got[2] is None
    assert got[1] is not None and got[1].data == items[1][1]
    assert max(seen) <= pool.max_record_bytes + 1, seen
    assert pool.corrupt == 1
    assert raw.exists(names[0]) == 0 and raw.exists(names[2]) == 1
    assert "dropped corrupt chunk" in caplog.text and "max_chunk_bytes" in caplog.text
    length = len(record.encode_header(*items[0])) + 4096 + (1 << 20)
    assert f"record of {length} bytes, over the {pool.max_record_bytes} bytes" in caplog.text
    usage = pool.usage()
    assert (usage.chunks, usage.used_bytes) == (2, 300 + (1 << 20))

    # a probe says the same of a record longer than a get would read
    raw.set(names[1], bytes(pool.max_record_bytes + 1))
    assert pool.probe_many([items[1][0].key], tenant="a") == [None]
    assert pool.corrupt == 2
    assert raw.exists(names[1]) == 0
    assert pool.usage().chunks == 1

    # and a put refuses a chunk it would not read back
    assert pool.put_many([chunk(3, size=4097), chunk(4)]) == [False, True]
    assert present(pool, [chunk(3, size=4097), chunk(4)]) == [False, True]
    assert pool.usage().used_bytes == 300 + (1 << 20)


def test_the_default_largest_chunk_is_the_agents_and_must_be_positive(
    make_pool: MakePool,
) -> None:
    pool = make_pool()
    assert pool.max_chunk_bytes == redis_pool.DEFAULT_MAX_CHUNK_BYTES == 256 << 20
    for bad in (0, -1, True, 1.5):
        with pytest.raises(Exception, match="max_chunk_bytes"):
            make_pool(max_chunk_bytes=bad)


# --- recency scores that are no timestamp ----------------------------------------------------
# Redis refuses NaN scores (ZADD: 'not a float'); inf and -inf it keeps. -inf is evicted first
# already (the lowest score): a guard of that order.
_NO_TIME = ["inf", "1e300", "-inf"]


@pytest.mark.parametrize("score", _NO_TIME)
def test_a_chunk_whose_lru_score_is_no_time_is_evicted_first(
    make_pool: MakePool, raw: redis.Redis, score: str
) -> None:
    """A score of inf (or one past the server's clock by more than a day: no writer's) under
    {P}:lru kept its chunk from eviction for good: every chunk read since went before it, and
    enough such entries left the pool room for nothing else. It goes first."""
    pool = make_pool(capacity_bytes=1000)
    a, b, c, d = (chunk(i) for i in range(4))
    assert pool.put_many([a, b, c]) == [True] * 3
    raw.zadd("{" + pool.prefix + "}:lru", {a[0].key.hex(): score})
    assert pool.put_many([d]) == [True]
    assert present(pool, [a, b, c, d]) == [False, True, True, True]
    assert (pool.usage().chunks, pool.usage().used_bytes) == (3, 900)


@pytest.mark.parametrize("score", _NO_TIME)
def test_a_chunk_whose_tenant_lru_score_is_no_time_goes_first_for_the_quota(
    make_pool: MakePool, raw: redis.Redis, score: str
) -> None:
    """The same under a tenant's own {P}:lru:t:<tenant>, which a tenant's quota evicts from."""
    pool = make_pool(tenant_quota_bytes=600)
    a, b, c = (chunk(i) for i in range(3))
    assert pool.put_many([a, b]) == [True, True]
    raw.zadd("{" + pool.prefix + "}:lru:t:a", {a[0].key.hex(): score})
    assert pool.put_many([c]) == [True]
    assert present(pool, [a, b, c]) == [False, True, True]
    assert pool.usage().tenant_bytes == {"a": 600}


@pytest.mark.parametrize("score", _NO_TIME)
def test_a_resize_evicts_a_chunk_whose_lru_score_is_no_time_first(
    make_pool: MakePool, raw: redis.Redis, score: str
) -> None:
    pool = make_pool(capacity_bytes=1000)
    a, b, c = (chunk(i) for i in range(3))
    assert pool.put_many([a, b, c]) == [True] * 3
    raw.zadd("{" + pool.prefix + "}:lru", {a[0].key.hex(): score})
    pool.resize(600)
    assert present(pool, [a, b, c]) == [False, True, True]


# --- accounting keys another client wrote ----------------------------------------------------
def _acct(pool: RedisPool, name: str) -> str:
    return "{" + pool.prefix + "}:" + name


@pytest.mark.parametrize("capacity", ["inf", "nan", "1e400", "-1", "1.5", "0x400"])
def test_a_capacity_no_agent_set_is_the_configured_one_again(
    make_pool: MakePool, raw: redis.Redis, capacity: str
) -> None:
    """{P}:cfg's capacity_bytes was taken as Lua's tonumber read it: inf or nan (and 1e400)
    stopped every eviction for good (the pool grew until Redis refused writes), a negative or
    fractional one refused every put ('larger than the pool'). Such a capacity is none: the
    configured one is written back, as when the key is gone; an agent configured with none
    deletes it (the default applies)."""
    pool = make_pool(capacity_bytes=1000)
    a, b, c, d = (chunk(i) for i in range(4))
    assert pool.put_many([a]) == [True]
    raw.hset(_acct(pool, "cfg"), "capacity_bytes", capacity)
    assert pool.put_many([b, c, d]) == [True] * 3
    assert present(pool, [a, b, c, d]) == [False, True, True, True]
    assert raw.hget(_acct(pool, "cfg"), "capacity_bytes") == b"1000"

    raw.hset(_acct(pool, "cfg"), "capacity_bytes", capacity)
    unconfigured = make_pool()
    assert unconfigured.put_many([chunk(5)]) == [True]
    assert raw.hget(_acct(pool, "cfg"), "capacity_bytes") is None


_ACCOUNTING = ["lru", "meta", "used", "cfg", "clock", "lru:t:a"]


@pytest.mark.parametrize("name", _ACCOUNTING)
def test_an_accounting_key_of_another_type_fails_no_put(
    make_pool: MakePool, raw: redis.Redis, name: str
) -> None:
    """An accounting key holding another type (a list here: another host's bug, or hostile)
    failed every script that met it with WRONGTYPE: every put of every agent (and with them the
    pool's breaker, which its reads share). It is deleted and made again from {P}:meta (the
    recency zsets, each entry scored by its last put; the counts); a {P}:meta of another type
    leaves nothing accounted (its records are accounted again as they are read)."""
    pool = make_pool(capacity_bytes=1000)
    a, b, c, d = (chunk(i) for i in range(4))
    assert pool.put_many([a, b, c]) == [True] * 3
    raw.delete(_acct(pool, name))
    raw.rpush(_acct(pool, name), "no accounting")
    assert pool.put_many([d]) == [True]
    if name == "meta":
        assert present(pool, [a, b, c, d]) == [True] * 4
        assert pool.usage().chunks == 1
        assert all(pool.get_many([m.key for m, _ in (a, b, c)], tenant="a"))
        assert (pool.usage().chunks, pool.usage().used_bytes) == (4, 1200)
    else:
        assert present(pool, [a, b, c, d]) == [False, True, True, True]
        assert (pool.usage().chunks, pool.usage().used_bytes) == (3, 900)
        assert pool.usage().tenant_bytes == {"a": 900}
    assert raw.type(_acct(pool, name)) != b"list"


def test_a_capacity_key_of_another_type_fails_no_read_of_a_new_agent(
    make_pool: MakePool, raw: redis.Redis
) -> None:
    """An agent configured with a capacity writes it before its first call: with {P}:cfg of
    another type that write failed, and so did every call it came before (each get and probe:
    the capacity still pending), for as long as the key stayed. The capacity is left pending;
    the next put makes the key a hash again and writes it."""
    writer = make_pool()
    a = chunk(0)
    assert writer.put_many([a]) == [True]
    raw.delete(_acct(writer, "cfg"))
    raw.rpush(_acct(writer, "cfg"), "no settings")
    pool = make_pool(capacity_bytes=1000)
    got = pool.get_many([a[0].key], tenant="a")
    assert got[0] is not None and got[0].data == a[1]
    assert pool.put_many([chunk(1)]) == [True]
    assert raw.hget(_acct(pool, "cfg"), "capacity_bytes") == b"1000"


@pytest.mark.parametrize("put_s", ["inf", "-inf", "nan"])
def test_an_accounting_entry_put_at_no_time_is_dropped_once_its_record_is_gone(
    make_pool: MakePool, raw: redis.Redis, put_s: str
) -> None:
    """A get that finds a record gone drops its accounting once its last put is older than the
    write grace: an entry whose put time is inf or nan was never older, so it held capacity
    for good (until LRU evicted it). It is an entry no writer made, dropped as such."""
    pool = make_pool()
    a = chunk(0)
    assert pool.put_many([a]) == [True]
    raw.delete(f"{pool.prefix}:c:{a[0].key.hex()}")
    raw.hset(_acct(pool, "meta"), a[0].key.hex(), f"300 {put_s} 0 a")
    assert pool.get_many([a[0].key], tenant="a") == [None]
    assert (pool.usage().chunks, pool.usage().used_bytes) == (0, 0)


def test_a_bandwidth_probe_reads_no_more_than_its_filler(
    make_pool: MakePool, raw: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The link probe read its filler key with GET: replaced meanwhile by a value of up to
    512 MB, all of it came into the agent's memory. It reads one byte past the filler's size."""
    pool = make_pool()
    pool.prepare_probe(1000)
    assert pool.probe_transfer(1000) >= 0
    raw.set(pool._probe_key(), bytes(1 << 20))
    seen = _spy_reply_bytes(pool, monkeypatch)
    with pytest.raises(TierUnavailable, match="probe filler"):
        pool.probe_transfer(1000)
    assert seen and max(seen) <= 1001, seen


@pytest.mark.parametrize("whose", ["another tenant's", "not accounted"])
def test_a_tenants_quota_evicts_no_chunk_it_does_not_hold(
    make_pool: MakePool, raw: redis.Redis, whose: str
) -> None:
    """A tenant's quota evicted the oldest entry of its own {P}:lru:t:<tenant>, whoever held
    that chunk: an entry put there naming another tenant's chunk (or a record nobody accounts)
    had that chunk evicted, and its record deleted, for this tenant's quota. Such an entry is
    dropped from the zset; the chunk stays."""
    pool = make_pool(tenant_quota_bytes=600)
    other = chunk(9, tenant="b")
    assert pool.put_many([other]) == [True]
    hexkey = other[0].key.hex()
    if whose == "not accounted":
        raw.hdel(_acct(pool, "meta"), hexkey)
        raw.zrem(_acct(pool, "lru"), hexkey)
        raw.zrem(_acct(pool, "lru:t:b"), hexkey)
    raw.zadd(_acct(pool, "lru:t:a"), {hexkey: 0})
    a0, a1, a2 = (chunk(i) for i in range(3))
    assert pool.put_many([a0, a1]) == [True, True]
    assert pool.put_many([a2]) == [True]
    assert present(pool, [other, a0, a1, a2]) == [True, False, True, True]
    assert raw.exists(f"{pool.prefix}:c:{hexkey}") == 1
    assert raw.zscore(_acct(pool, "lru:t:a"), hexkey) is None


def test_a_cluster_reads_no_further_than_the_largest_record_either(redis_cluster: str) -> None:
    """A Cluster's gets (their pipelines spread over the nodes) read a record with GETRANGE too,
    and drop one longer than any chunk of the pool on its own node."""
    prefix = f"kvctl-test-{uuid.uuid4().hex[:8]}"
    pool = RedisPool(redis_cluster, prefix=prefix, max_chunk_bytes=4096)
    try:
        items = [chunk(i, size=1000) for i in range(3)]
        assert pool.put_many(items) == [True] * 3
        client = pool._client()
        name = pool._rec(items[0][0].key.hex())
        client.append(name, bytes(1 << 20))
        got = pool.get_many([m.key for m, _ in items], tenant="a")
        assert got[0] is None
        assert [c.data if c else None for c in got[1:]] == [d for _, d in items[1:]]
        assert pool.corrupt == 1
        assert client.exists(name) == 0 and pool.usage().chunks == 2
    finally:
        pool.clear()
        pool.close()


@pytest.mark.parametrize("max_chunk_bytes", [1 << 20, 512 << 20])
def test_an_agents_pool_takes_its_max_chunk(
    redis_url: str, redis_prefix: str, max_chunk_bytes: int
) -> None:
    """The agent's Redis pool reads and stores chunks up to the agent's own max_chunk: a larger
    one put to the agent would be refused by its pool, a smaller limit would let records the
    agent never makes come whole into its memory."""
    from kvctl.agent.remote import open_pool
    from kvctl.agent.settings import AgentSettings

    settings = AgentSettings(
        pool=redis_url, pool_prefix=redis_prefix, max_chunk_bytes=max_chunk_bytes
    )
    pool = open_pool(settings)
    try:
        assert isinstance(pool, RedisPool)
        assert pool.max_chunk_bytes == max_chunk_bytes
    finally:
        pool.close()
