"""RedisPool against real servers: the machine's Redis (own key prefix per test), throwaway
redis-server processes (kill/restart), and a 3-node Redis Cluster. No mocks."""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.errors import InvalidArgument
from kvctl.remote import record
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.remote.pool import BadUsageReport
from kvctl.remote.redis_pool import DEFAULT_CAPACITY_BYTES, RedisPool
from kvctl.store.errors import TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.test_redis_index import _inject_into_next_pipeline, _scripts


def key(i: int, salt: str = "") -> bytes:
    return hashlib.blake2b(f"{salt}/{i}".encode(), digest_size=16).digest()


def payload_of(k: bytes, size: int, tag: int = 0) -> bytes:
    """Bytes that differ per key, size and tag, so a mix-up cannot go unnoticed."""
    seed = hashlib.blake2b(k + size.to_bytes(8, "little") + bytes([tag]), digest_size=32).digest()
    return (seed * (size // 32 + 1))[:size]


def chunk(
    i: int, size: int = 300, *, tenant: str = "a", isolated: bool = False, salt: str = ""
) -> tuple[ChunkMeta, bytes]:
    k = key(i, salt)
    meta = ChunkMeta(
        key=k,
        size_bytes=size,
        tokens=16,
        tenant=tenant,
        parent=key(i - 1, salt) if i else None,
        priority=40,
        isolated=isolated,
        created_s=1.7e9 + i,
    )
    return meta, payload_of(k, size)


def present(pool: RedisPool, items: list[tuple[ChunkMeta, bytes]]) -> list[bool]:
    """Which chunks the pool still holds (as seen by their own tenant), without touching them."""
    return [pool.probe_many([m.key], tenant=m.tenant)[0] is not None for m, _ in items]


@pytest.fixture
def make_pool(redis_url: str, redis_prefix: str) -> Iterator:  # type: ignore[type-arg]
    pools: list[RedisPool] = []

    def make(**kw) -> RedisPool:  # type: ignore[no-untyped-def]
        kw.setdefault("prefix", redis_prefix)
        pool = RedisPool(kw.pop("url", redis_url), **kw)
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


# --- basics ---------------------------------------------------------------------------------
def test_round_trip_many_chunks(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(capacity_bytes=64 << 20)
    items = [chunk(i, size=100 + 997 * i) for i in range(150)]
    items.append(chunk(150, size=4 << 20, tenant="租户 ü"))  # a big one, a unicode tenant
    assert pool.put_many(items) == [True] * len(items)

    got = pool.get_many([m.key for m, _ in items], tenant="a")
    for (meta, data), c in zip(items, got, strict=True):
        assert c is not None
        assert c.meta == meta
        assert c.data == data
        assert isinstance(c.data, memoryview)
    usage = pool.usage()
    assert usage.used_bytes == sum(m.size_bytes for m, _ in items)
    assert usage.chunks == len(items)
    assert usage.capacity_bytes == 64 << 20
    assert usage.tenant_bytes == {"a": usage.used_bytes - (4 << 20), "租户 ü": 4 << 20}
    assert pool.get_many([], tenant="a") == []
    assert pool.put_many([]) == []


def test_get_and_probe_of_missing_keys(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    meta, data = chunk(1)
    pool.put_many([(meta, data)])
    got = pool.get_many([key(99), meta.key, key(98)], tenant="a")
    assert got[0] is None and got[2] is None
    assert got[1] is not None and got[1].data == data
    assert pool.probe_many([key(99), meta.key], tenant="a") == [None, meta]
    assert pool.corrupt == 0


def test_probe_reads_the_header_only(private_redis) -> None:  # type: ignore[no-untyped-def]
    pool = RedisPool(private_redis.url, prefix="p")
    big = chunk(1, size=8 << 20)
    long_tenant = chunk(2, size=1000, tenant="t" * 3000)  # header longer than one probe read
    assert pool.put_many([big, long_tenant]) == [True, True]
    server = redis.Redis(port=private_redis.port)

    def sent_bytes() -> int:
        return int(server.info("stats")["total_net_output_bytes"])

    before = sent_bytes()
    metas = pool.probe_many([big[0].key, long_tenant[0].key, key(5)], tenant="t" * 3000)
    assert metas == [big[0], long_tenant[0], None]
    assert sent_bytes() - before < 64 << 10  # the 8 MiB payload did not move
    pool.close()
    server.close()


def test_url_schemes_and_masked_address(make_pool, redis_url: str) -> None:  # type: ignore[no-untyped-def]
    for bad in (
        "http://127.0.0.1:6379",
        "127.0.0.1:6379",
        "redis://",
        "redis://h:notaport/0",
        "redis://h:6379/x",
        "redis+cluster://h:7000/3",
        "memcached://h",
    ):
        with pytest.raises(InvalidArgument, match="pool URL"):
            RedisPool(bad)
    with pytest.raises(InvalidArgument, match="prefix"):
        RedisPool(redis_url, prefix="a{b}")
    with pytest.raises(InvalidArgument):
        RedisPool(redis_url, capacity_bytes=-1)

    masked = RedisPool("redis://user:s3cret@127.0.0.1:1/0")
    assert masked.address == "redis://user:***@127.0.0.1:1/0"
    assert "s3cret" not in repr(masked)
    assert RedisPool("rediss://:pw@h:6380").address == "rediss://:***@h:6380"
    with pytest.raises(TierUnavailable) as err:
        masked.usage()  # nothing listens on port 1
    assert "s3cret" not in str(err.value) and "redis://user:***@127.0.0.1:1/0" in str(err.value)

    pool = make_pool(url=redis_url.replace("redis://", "valkey://", 1))
    meta, data = chunk(1)
    assert pool.put_many([(meta, data)]) == [True]
    assert pool.get_many([meta.key], tenant="a")[0].data == data  # type: ignore[union-attr]


def test_sizes_must_match_the_meta(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    meta, data = chunk(1, size=300)
    with pytest.raises(InvalidArgument):
        pool.put_many([(meta, data[:-1])])
    with pytest.raises(InvalidArgument):
        pool.get_many([b"short"], tenant="a")
    assert pool.usage().chunks == 0


# --- tenants ----------------------------------------------------------------------------------
def test_isolated_chunks_exist_only_for_their_tenant(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    secret = chunk(1, tenant="a", isolated=True)
    shared = chunk(2, tenant="a")
    assert pool.put_many([secret, shared]) == [True, True]
    keys = [secret[0].key, shared[0].key]

    b_got = pool.get_many(keys, tenant="b")
    assert b_got[0] is None
    assert b_got[1] is not None and b_got[1].data == shared[1]
    assert pool.probe_many(keys, tenant="b") == [None, shared[0]]

    a_got = pool.get_many(keys, tenant="a")
    assert [c.data for c in a_got] == [secret[1], shared[1]]  # type: ignore[union-attr]
    assert pool.probe_many(keys, tenant="a") == [secret[0], shared[0]]

    # another tenant's put of the same key does not replace or reveal it
    assert pool.put_many([(ChunkMeta(key=secret[0].key, size_bytes=300, tenant="b"), b"x" * 300)])
    assert pool.get_many([secret[0].key], tenant="b") == [None]
    assert pool.get_many([secret[0].key], tenant="a")[0].data == secret[1]  # type: ignore[union-attr]
    assert pool.usage().chunks == 2


# --- capacity, quotas, eviction -----------------------------------------------------------------
def test_capacity_eviction_is_lru_by_access(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(capacity_bytes=1000)
    a, b, c, d = (chunk(i) for i in range(4))
    assert pool.put_many([a, b, c]) == [True] * 3
    assert pool.get_many([a[0].key], tenant="a")[0] is not None  # a is now the newest
    assert pool.put_many([d]) == [True]
    assert present(pool, [a, b, c, d]) == [True, False, True, True]
    assert pool.get_many([b[0].key], tenant="a") == [None]
    usage = pool.usage()
    assert (usage.used_bytes, usage.chunks) == (900, 3)

    # a read by a tenant that may not see a chunk does not keep it alive
    e = chunk(4, tenant="z", isolated=True)
    assert pool.put_many([e]) == [True]  # evicts c, the oldest
    pool.get_many([e[0].key], tenant="a")  # invisible to a: no refresh
    pool.get_many([a[0].key, d[0].key], tenant="a")
    assert pool.put_many([chunk(5)]) == [True]
    assert present(pool, [a, c, d, e]) == [True, False, True, False]


def test_batch_larger_than_the_pool_keeps_its_newest(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(capacity_bytes=1000)
    items = [chunk(i) for i in range(5)]
    assert pool.put_many(items) == [True] * 5  # stored, the first two evicted by the last two
    assert present(pool, items) == [False, False, True, True, True]
    assert (pool.usage().used_bytes, pool.usage().chunks) == (900, 3)


def test_large_batch_is_written_in_groups(make_pool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from kvctl.remote import redis_pool

    monkeypatch.setattr(redis_pool, "_WRITE_GROUP_BYTES", 1000)  # ~2 records per group
    pool = make_pool(capacity_bytes=1500)
    old = [chunk(i, salt="old") for i in range(4)]
    assert pool.put_many(old) == [True] * 4
    items = [chunk(i) for i in range(7)]
    assert pool.put_many(items) == [True] * 7  # evicts the 4 old ones and the first 2 new
    assert present(pool, old) == [False] * 4
    assert present(pool, items) == [False, False] + [True] * 5
    got = pool.get_many([m.key for m, _ in items[2:]], tenant="a")
    assert [c.data for c in got] == [d for _, d in items[2:]]  # type: ignore[union-attr]
    assert (pool.usage().used_bytes, pool.usage().chunks) == (1500, 5)


def test_tenant_quota_evicts_the_tenants_own_oldest(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(capacity_bytes=10_000, tenant_quotas={"a": 600}, tenant_quota_bytes=5000)
    b1 = chunk(0, tenant="b")  # the oldest chunk of the pool
    a1, a2, a3 = (chunk(i, tenant="a") for i in (1, 2, 3))
    assert pool.put_many([b1, a1, a2]) == [True] * 3
    assert pool.put_many([a3]) == [True]
    assert present(pool, [b1, a1, a2, a3]) == [True, False, True, True]
    usage = pool.usage()
    assert usage.tenant_bytes == {"a": 600, "b": 300}
    assert usage.tenant_quota_bytes == {"a": 600, "b": 5000}

    # over the quota on its own: refused, nothing evicted
    assert pool.put_many([chunk(4, size=601, tenant="a")]) == [False]
    assert present(pool, [b1, a2, a3]) == [True, True, True]

    # the pool-wide LRU still applies across tenants when the pool is full
    pool.resize(900)
    assert pool.put_many([chunk(5, tenant="c")]) == [True]
    assert present(pool, [b1, a2, a3]) == [False, True, True]


def test_oversize_is_refused(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(capacity_bytes=1000)
    small = chunk(1)
    assert pool.put_many([small, chunk(2, size=1001), chunk(3)]) == [True, False, True]
    assert present(pool, [small]) == [True]
    assert pool.get_many([key(2)], tenant="a") == [None]
    assert pool.usage().used_bytes == 600


def test_reput_is_a_touch_not_a_second_accounting(make_pool, raw) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(capacity_bytes=1000)
    a, b, c = (chunk(i) for i in range(3))
    assert pool.put_many([a, b, a]) == [True, True, True]
    assert pool.put_many([a]) == [True]
    usage = pool.usage()
    assert (usage.used_bytes, usage.chunks) == (600, 2)
    # the re-put refreshed a: b is now the LRU victim
    assert pool.put_many([c]) == [True]
    assert pool.put_many([chunk(3)]) == [True]
    assert present(pool, [a, b, c]) == [True, False, True]

    # a re-put of a chunk whose record vanished writes it again
    raw.delete(f"{pool.prefix}:c:{c[0].key.hex()}")
    assert pool.put_many([c]) == [True]
    assert pool.get_many([c[0].key], tenant="a")[0].data == c[1]  # type: ignore[union-attr]
    assert pool.usage().chunks == 3


def test_ttl_expiry_frees_the_accounting_on_read(make_pool, raw) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(ttl_s=0.3)
    meta, data = chunk(1)
    assert pool.put_many([(meta, data)]) == [True]
    assert 0 < raw.pttl(f"{pool.prefix}:c:{meta.key.hex()}") <= 300
    time.sleep(0.7)
    assert pool.usage().chunks == 1  # expired, not read yet: still accounted
    assert pool.get_many([meta.key], tenant="a") == [None]
    usage = pool.usage()
    assert (usage.used_bytes, usage.chunks, usage.tenant_bytes) == (0, 0, {})
    assert pool.put_many([(meta, data)]) == [True]  # and it can be stored again
    assert pool.get_many([meta.key], tenant="a")[0].data == data  # type: ignore[union-attr]


def test_missing_record_of_a_fresh_put_keeps_its_accounting(make_pool, raw) -> None:  # type: ignore[no-untyped-def]
    """Without a TTL a vanished record is only forgotten after the write grace (a write of
    another agent may still be on its way)."""
    pool = make_pool()
    meta, data = chunk(1)
    pool.put_many([(meta, data)])
    raw.delete(f"{pool.prefix}:c:{meta.key.hex()}")
    assert pool.get_many([meta.key], tenant="a") == [None]
    assert pool.usage().chunks == 1


def test_resize_down_evicts_lru(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(capacity_bytes=2000)
    items = [chunk(i) for i in range(5)]
    pool.put_many(items)
    pool.get_many([items[0][0].key], tenant="a")
    pool.resize(600)
    assert present(pool, items) == [True, False, False, False, True]
    usage = pool.usage()
    assert (usage.capacity_bytes, usage.used_bytes, usage.chunks) == (600, 600, 2)
    with pytest.raises(InvalidArgument):
        pool.resize(-5)


def test_capacity_is_shared_and_defaults(make_pool) -> None:  # type: ignore[no-untyped-def]
    first = make_pool()
    assert first.usage().capacity_bytes == DEFAULT_CAPACITY_BYTES
    make_pool(capacity_bytes=5000).usage()  # a later agent sets it: last one wins
    assert first.usage().capacity_bytes == 5000
    first.clear()
    assert first.usage().capacity_bytes == DEFAULT_CAPACITY_BYTES  # first never set one


def test_configured_capacity_survives_a_server_restarted_empty(private_redis) -> None:  # type: ignore[no-untyped-def]
    # The capacity lives in {P}:cfg on the server; a server restarted empty loses it. An agent
    # configured with a capacity must enforce (and write back) its own, not fall back to the
    # 1 GiB default: a 512 GiB pool used to shrink to 1 GiB until every agent restarted.
    big = RedisPool(private_redis.url, prefix="p", capacity_bytes=4 << 30, timeout_s=1.0)
    small = RedisPool(private_redis.url, prefix="q", capacity_bytes=1000, timeout_s=1.0)
    bystander = RedisPool(private_redis.url, prefix="p", timeout_s=1.0)  # configured none
    raw = redis.Redis.from_url(private_redis.url)
    try:
        assert big.put_many([chunk(1)]) == [True]
        assert small.put_many([chunk(1)]) == [True]
        private_redis.kill()
        private_redis.start()  # empty: no {p}:cfg, no {q}:cfg
        time.sleep(0.2)
        # the agent's own view before its next put: its configured capacity, not the default
        assert big.usage().capacity_bytes == 4 << 30
        assert bystander.usage().capacity_bytes == DEFAULT_CAPACITY_BYTES  # nothing to go by
        # an agent that configured none puts first: the default applies, and is not written
        # (it would then override the configured agents' capacity)
        assert bystander.put_many([chunk(2)]) == [True]
        assert raw.hget("{p}:cfg", "capacity_bytes") is None
        assert big.put_many([chunk(3)]) == [True]
        assert raw.hget("{p}:cfg", "capacity_bytes") == str(4 << 30).encode()
        assert bystander.usage().capacity_bytes == 4 << 30  # every agent sees it again
        # and it is enforced: 4 x 300 bytes do not fit in 1000 (the default would take them)
        items = [chunk(i, salt="after") for i in range(4)]
        assert small.put_many(items) == [True] * 4  # each stored, the oldest then evicted
        assert small.usage().used_bytes == 900
        assert present(small, items) == [False, True, True, True]
        assert raw.hget("{q}:cfg", "capacity_bytes") == b"1000"
    finally:
        raw.close()
        for pool in (big, small, bystander):
            pool.close()


def test_two_agents_share_chunks_and_accounting(make_pool) -> None:  # type: ignore[no-untyped-def]
    one = make_pool(capacity_bytes=1200)
    two = make_pool()
    a, b, c = chunk(1), chunk(2, tenant="b"), chunk(3, tenant="b", isolated=True)
    assert one.put_many([a]) == [True]
    assert two.put_many([b, c]) == [True, True]
    assert two.get_many([a[0].key], tenant="b")[0].data == a[1]  # type: ignore[union-attr]
    assert one.get_many([c[0].key], tenant="b")[0].data == c[1]  # type: ignore[union-attr]
    assert one.get_many([c[0].key], tenant="a") == [None]
    assert one.usage() == two.usage()
    assert two.usage().used_bytes == 900 and two.usage().capacity_bytes == 1200
    # b is the LRU chunk (a and c were read since): two agents' puts evict pool-wide
    assert one.put_many([chunk(4), chunk(5)]) == [True, True]
    assert present(two, [a, b, c]) == [True, False, True]
    assert one.delete_many([a[0].key, key(99)]) == 1
    assert two.get_many([a[0].key], tenant="a") == [None]
    assert two.usage().chunks == 3


def test_delete_many(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    items = [chunk(i, tenant="t" + str(i % 2)) for i in range(4)]
    pool.put_many(items)
    assert pool.delete_many([items[0][0].key, items[0][0].key, items[3][0].key]) == 2
    assert present(pool, items) == [False, True, True, False]
    usage = pool.usage()
    assert (usage.chunks, usage.tenant_bytes) == (2, {"t0": 300, "t1": 300})
    assert pool.delete_many([]) == 0


# --- corruption -------------------------------------------------------------------------------
def test_corrupt_records_are_misses_counted_and_removed(make_pool, raw) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    items = [chunk(i) for i in range(4)]
    pool.put_many(items)
    names = [f"{pool.prefix}:c:{m.key.hex()}" for m, _ in items]
    hb = len(record.encode_header(items[0][0], items[0][1]))
    raw.setrange(names[0], hb + 10, b"\xff")  # payload byte
    raw.setrange(names[1], 20, b"\xff")  # header byte
    raw.set(names[2], raw.get(names[2])[:-5])  # cut short

    got = pool.get_many([m.key for m, _ in items], tenant="a")
    assert got[:3] == [None, None, None]
    assert got[3] is not None and got[3].data == items[3][1]
    assert pool.corrupt == 3
    assert raw.exists(*names[:3]) == 0
    usage = pool.usage()
    assert (usage.chunks, usage.used_bytes) == (1, 300)

    # probe checks the header and the record's length
    raw.set(names[3], raw.get(names[3])[:-1])
    assert pool.probe_many([items[3][0].key], tenant="a") == [None]
    assert pool.corrupt == 4
    assert raw.exists(names[3]) == 0
    assert pool.usage().chunks == 0


def _damage_replies_in_transit(pool: RedisPool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """From now on every record (and probed header) this pool reads arrives with one byte
    flipped, as a bad NIC or link on this reader's path would deliver it; the server's copy is
    intact."""
    client = pool._client()  # the read client: gets, probes and their repairs
    real_pipeline = client.pipeline

    def flip(value: bytes) -> bytes:
        damaged = bytearray(value)
        damaged[min(20, len(value) - 1)] ^= 0x10  # header (key bytes) or, if short, its end
        damaged[-1] ^= 0x01  # and the payload's last byte
        return bytes(damaged)

    def damaging(*args, **kwargs):  # type: ignore[no-untyped-def]
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        def execute(*a, **kw):  # type: ignore[no-untyped-def]
            out = []
            for reply in real_execute(*a, **kw):
                if isinstance(reply, bytes) and len(reply) > 64:  # a GET of a record
                    reply = flip(reply)
                elif isinstance(reply, list) and reply and isinstance(reply[0], bytes):
                    reply = [flip(reply[0]), *reply[1:]]  # a probe's header
                out.append(reply)
            return out

        pipe.execute = execute
        return pipe

    monkeypatch.setattr(client, "pipeline", damaging)
    real_pull = pool._pull  # gets: their replies are read one by one under a pull deadline

    def damaging_pull(*args, **kwargs):  # type: ignore[no-untyped-def]
        replies = real_pull(*args, **kwargs)
        return [flip(r) if isinstance(r, bytes) and len(r) > 64 else r for r in replies]

    monkeypatch.setattr(pool, "_pull", damaging_pull)


def test_a_record_damaged_in_transit_is_a_miss_and_stays(make_pool, raw, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # A review flipped one bit on the wire and the reader deleted 4 good records from Redis:
    # every agent lost them. The reader must delete only what the server itself holds damaged.
    pool = make_pool()
    items = [chunk(i, size=4000) for i in range(4)]
    assert pool.put_many(items) == [True] * 4
    names = [f"{pool.prefix}:c:{m.key.hex()}" for m, _ in items]
    with monkeypatch.context() as patch:
        _damage_replies_in_transit(pool, patch)
        assert pool.get_many([m.key for m, _ in items], tenant="a") == [None] * 4
        assert pool.probe_many([m.key for m, _ in items], tenant="a") == [None] * 4
    assert pool.corrupt == 8  # counted: this reader did receive damaged bytes
    assert raw.exists(*names) == 4
    assert (pool.usage().chunks, pool.usage().used_bytes) == (4, 16000)
    got = pool.get_many([m.key for m, _ in items], tenant="a")
    assert [c.data if c else None for c in got] == [d for _, d in items]


def test_a_record_of_an_unknown_version_or_flags_is_a_miss_and_stays(make_pool, raw) -> None:  # type: ignore[no-untyped-def]
    # A fleet mid-upgrade: a newer writer's record (another version, or a flag this reader does
    # not know) is not damage; the first old reader used to delete it for every agent.
    import zlib

    pool = make_pool()
    items = [chunk(i, size=2000) for i in range(3)]
    assert pool.put_many(items) == [True] * 3
    names = [f"{pool.prefix}:c:{m.key.hex()}" for m, _ in items]
    newer = bytearray(raw.get(names[0]))
    newer[4] = record.FORMAT_VERSION + 1  # a layout this reader cannot check at all
    raw.set(names[0], bytes(newer))
    flagged = bytearray(raw.get(names[1]))
    flagged[5] |= 0x80  # an unknown flag in an intact header (its CRC recomputed, as written)
    hb = len(record.encode_header(items[1][0], items[1][1]))
    flagged[hb - 4 : hb] = zlib.crc32(bytes(flagged[: hb - 4])).to_bytes(4, "little")
    raw.set(names[1], bytes(flagged))

    keys = [m.key for m, _ in items]
    assert pool.probe_many(keys, tenant="a")[:2] == [None, None]
    got = pool.get_many(keys, tenant="a")
    assert got[:2] == [None, None]
    assert got[2] is not None and got[2].data == items[2][1]
    assert raw.exists(*names) == 3
    assert pool.corrupt == 0 and pool.unknown_format == 4
    assert (pool.usage().chunks, pool.usage().used_bytes) == (3, 6000)  # still accounted


def test_unaccounted_record_is_accounted_when_read(make_pool, raw) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool()
    meta, data = chunk(1)
    pool.put_many([(meta, data)])
    name = f"{pool.prefix}:c:{meta.key.hex()}"
    value = raw.get(name)
    pool.delete_many([meta.key])
    raw.set(name, value)  # an orphan: a record without accounting
    assert pool.usage().chunks == 0
    assert pool.get_many([meta.key], tenant="a")[0].data == data  # type: ignore[union-attr]
    assert (pool.usage().chunks, pool.usage().used_bytes) == (1, 300)


def test_a_record_key_of_the_wrong_type_is_a_miss_not_a_failed_pool(
    make_pool, raw, redis_prefix: str
) -> None:  # type: ignore[no-untyped-def]
    """A chunk's key holding something other than a string (another host's bug, or hostile):
    its GET, STRLEN and GETRANGE fail WRONGTYPE. That failed the whole get or probe (a
    TierUnavailable: a failure of the pool, whose breaker then turned away every read of the
    node) over one key; it is now a miss counted corrupt, the other chunks read, and the key is
    deleted with its accounting, as a corrupt record is (a put then writes it anew)."""
    pool = make_pool(capacity_bytes=64 << 20)
    items = [chunk(i) for i in range(3)]
    assert pool.put_many(items) == [True] * 3
    bad = items[1][0].key
    raw.delete(f"{redis_prefix}:c:{bad.hex()}")
    raw.hset(f"{redis_prefix}:c:{bad.hex()}", "not", "a record")
    keys = [m.key for m, _ in items]
    got = pool.get_many(keys, tenant="a")
    assert [None if c is None else bytes(c.data) for c in got] == [items[0][1], None, items[2][1]]
    probed = pool.probe_many(keys, tenant="a")
    assert [m is not None for m in probed] == [True, False, True]
    assert pool.corrupt == 1  # the get deleted it: the probe found none
    assert raw.exists(f"{redis_prefix}:c:{bad.hex()}") == 0
    usage = pool.usage()
    assert (usage.chunks, usage.used_bytes) == (2, 600)
    assert pool.put_many([items[1]]) == [True]
    assert bytes(pool.get_many([bad], tenant="a")[0].data) == items[1][1]  # type: ignore[union-attr]
    # a probe meets one first: the same
    raw.delete(f"{redis_prefix}:c:{keys[2].hex()}")
    raw.rpush(f"{redis_prefix}:c:{keys[2].hex()}", "not a record")
    assert [m is not None for m in pool.probe_many(keys, tenant="a")] == [True, True, False]
    assert pool.corrupt == 2
    assert raw.exists(f"{redis_prefix}:c:{keys[2].hex()}") == 0
    assert pool.usage().chunks == 2


@pytest.mark.parametrize("entry", [b"garbage", b"300 x 0 a", b"-300 1.7e9 0 a", b"1e300 1.7e9 0 a"])
def test_an_accounting_entry_no_writer_made_fails_no_put(
    make_pool, raw, redis_prefix: str, entry: bytes
) -> None:  # type: ignore[no-untyped-def]
    """A chunk's {P}:meta entry that is not "size put_s isolated tenant" (another host's bug, or
    hostile): the scripts raised on it (arithmetic on nil), so every put that met it failed, a
    failed call of the pool: its re-put, and once it was the LRU's oldest, every put that
    needed room, for as long as it stayed. It is now dropped where met (the chunk accounted
    anew on a re-put), and the puts go on."""
    pool = make_pool(capacity_bytes=900)
    items = [chunk(i) for i in range(3)]
    assert pool.put_many(items) == [True] * 3
    meta_key = f"{{{redis_prefix}}}:meta"
    raw.hset(meta_key, items[0][0].key.hex(), entry)  # the oldest: the next victim
    raw.hset(meta_key, items[1][0].key.hex(), entry)
    # a re-put meets it, and room is made past the oldest's (their sizes unknown: the counts
    # are counted again from the entries left, test_redis_pool_counts)
    assert pool.put_many([items[1]]) == [True]
    assert present(pool, [items[1]]) == [True]
    assert pool.put_many([chunk(3)]) == [True]
    assert present(pool, [chunk(3)]) == [True]
    assert pool.put_many([chunk(4)]) == [True]  # room made: the oldest (item 0's) met
    assert present(pool, [chunk(4)]) == [True]
    held = raw.hgetall(meta_key).values()
    assert entry not in held
    # a read that finds the record gone drops such an entry too (no put_s to judge it by)
    k3 = chunk(3)[0].key
    raw.hset(meta_key, k3.hex(), entry)
    raw.delete(f"{redis_prefix}:c:{k3.hex()}")
    assert pool.get_many([k3], tenant="a") == [None]
    assert raw.hexists(meta_key, k3.hex()) == 0


@pytest.mark.parametrize("clock", [b"garbage", b"inf", b"1e300"])
def test_a_clock_that_is_no_number_fails_no_put(
    make_pool, raw, redis_prefix: str, clock: bytes
) -> None:  # type: ignore[no-untyped-def]
    """{P}:clock (the last LRU timestamp handed out) holding no number (another host's bug, or
    hostile) made every script compare a number with nil: every put, and every get's LRU
    touch, failed for as long as it stayed. It counts as no timestamp handed out yet. So does
    one no server time reaches (inf, 1e300: Lua reads both as numbers): every timestamp after
    it was the same, for good, the LRU order lost (victims taken by key name)."""
    pool = make_pool(capacity_bytes=900)
    raw.set(f"{{{redis_prefix}}}:clock", clock)
    items = [chunk(i) for i in range(4)]
    assert pool.put_many(items[:3]) == [True] * 3
    assert pool.get_many([items[0][0].key], tenant="a")[0] is not None  # touched: the newest
    assert pool.put_many([items[3]]) == [True]
    assert present(pool, items) == [True, False, True, True]  # the LRU order kept
    assert float(raw.get(f"{{{redis_prefix}}}:clock")) < time.time() + 3600


@pytest.mark.parametrize("count", [b"lots", b"1.5", str(2**63 - 1).encode()])
def test_a_used_count_the_scripts_cannot_add_to_fails_no_put(
    make_pool, raw, redis_prefix: str, count: bytes
) -> None:  # type: ignore[no-untyped-def]
    """A {P}:used count that HINCRBY cannot add to (no integer, or one at 2**63 - 1: another
    host's bug, or hostile) failed every put that counted into it (and the room check's
    arithmetic on nil before it), a failed call of the pool each. It is counted again from the
    accounting entries and the puts go on; the usage is shown again."""
    pool = make_pool(capacity_bytes=900)
    items = [chunk(i) for i in range(4)]
    assert pool.put_many(items[:2]) == [True] * 2
    used_key = f"{{{redis_prefix}}}:used"
    raw.hset(used_key, mapping={"bytes": count, "chunks": count, "t:a": count})
    assert pool.put_many(items[2:]) == [True] * 2
    # counted again from the accounting entries (not restarted at 0, which let all 4 in 900
    # bytes): the oldest evicted to make room
    assert present(pool, items) == [False, True, True, True]
    pool.delete_many([items[1][0].key])
    usage = pool.usage()
    assert (usage.used_bytes, usage.chunks, usage.tenant_bytes) == (600, 2, {"a": 600})


# --- usage: counts another host writes --------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("used", "bytes", b"-4096"),
        ("used", "chunks", b"-1"),
        ("used", "t:a", b"-300"),
        ("cfg", "capacity_bytes", b"-1"),
        # not whole numbers: int() raised ValueError out of usage (a failed call of the pool,
        # whose breaker then left it alone)
        ("used", "bytes", b"1.5"),
        ("used", "chunks", b"lots"),
        ("cfg", "capacity_bytes", b"1e9"),
        ("used", "bytes", b""),
        # past an int64: shown, it failed `kvctl agent remote` (OverflowError formatting it)
        pytest.param("used", "bytes", str(2**63).encode(), id="used-bytes-2**63"),
        pytest.param("cfg", "capacity_bytes", str(10**400).encode(), id="capacity-10**400"),
        # past int()'s 4300 digits: ValueError too
        pytest.param("used", "chunks", b"9" * 5000, id="chunks-5000-digits"),
    ],
)
def test_a_usage_count_that_is_not_one_is_a_bad_usage_report(  # type: ignore[no-untyped-def]
    make_pool, raw, redis_prefix: str, name: str, field: str, value: bytes
) -> None:
    """The pool's usage is read from keys every agent writes: a count there that is not a whole
    number in 0..2**63 - 1 (a broken or hostile host) is refused whole, as a pool agent's HELLO
    is (BadUsageReport: the pool answered, so no failure of it), naming the key and the field.
    Its chunks are served all the same."""
    pool = make_pool(capacity_bytes=64 << 20)
    items = [chunk(0)]
    assert pool.put_many(items) == [True]
    raw.hset(f"{{{redis_prefix}}}:{name}", field, value)
    with pytest.raises(
        BadUsageReport, match=re.escape(f"{{{redis_prefix}}}:{name} has {field} ")
    ) as told:
        pool.usage()
    assert "not a count in 0..2**63 - 1" in str(told.value)
    assert len(str(told.value)) < 300  # the value is cut, whatever its length
    assert pool.get_many([items[0][0].key], tenant="a")[0].data == items[0][1]  # type: ignore[union-attr]


def test_a_usage_key_of_the_wrong_type_is_a_bad_usage_report(  # type: ignore[no-untyped-def]
    make_pool, raw, redis_prefix: str
) -> None:
    """A usage key holding something other than a hash (WRONGTYPE) is a bad report, not a
    failed pool: its chunks are still read."""
    pool = make_pool()
    items = [chunk(0)]
    assert pool.put_many(items) == [True]
    for name in ("used", "cfg"):
        acct = f"{{{redis_prefix}}}:{name}"
        held = raw.dump(acct)
        raw.delete(acct)
        raw.set(acct, b"not a hash")
        with pytest.raises(
            BadUsageReport, match=re.escape(f"{{{redis_prefix}}}:{name} is not a hash")
        ):
            pool.usage()
        raw.delete(acct)
        if held is not None:
            raw.restore(acct, 0, held)
    assert pool.usage().chunks == 1
    assert pool.get_many([items[0][0].key], tenant="a")[0].data == items[0][1]  # type: ignore[union-attr]


def test_sound_usage_counts_are_read_as_written(make_pool, raw, redis_prefix: str) -> None:  # type: ignore[no-untyped-def]
    """The bounds themselves are counts: 0 and 2**63 - 1 pass."""
    pool = make_pool()
    raw.hset(
        f"{{{redis_prefix}}}:used",
        mapping={"bytes": str(2**63 - 1), "chunks": "0", "t:a": str(2**63 - 1)},
    )
    raw.hset(f"{{{redis_prefix}}}:cfg", "capacity_bytes", "0")
    usage = pool.usage()
    assert (usage.capacity_bytes, usage.used_bytes, usage.chunks) == (0, 2**63 - 1, 0)
    assert usage.tenant_bytes == {"a": 2**63 - 1}


def test_a_node_whose_redis_pool_reports_a_bad_usage_keeps_using_it(  # type: ignore[no-untyped-def]
    make_pool, raw, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Through a node's link monitor: the bad report is not shown and is said once, the pool's
    breaker stays closed and its chunks are pulled; a sound report is shown again. A count
    that was not a number raised ValueError out of the usage read, a failure of the pool: its
    breaker (one failure opens it) turned away every read and write of the node, each 5 s."""
    pool = make_pool(capacity_bytes=64 << 20)
    meta, data = chunk(0)
    assert pool.put_many([(meta, data)]) == [True]
    raw.hset(f"{{{redis_prefix}}}:used", "chunks", b"lots")
    source = Source("pool", POOL_TIER, pool, LinkEstimator("pool", override="fetch"))
    node = RemoteTiers(
        TieredStore([CpuTier(1 << 20)], chunk_tokens=16),
        pool=source,
        prefill=PrefillRate(1e4, "configured"),
        usage_every_s=0.05,
    )
    said = f"{{{redis_prefix}}}:used has chunks 'lots'"
    reads: list[float] = []
    read_usage = pool.usage

    def counted_usage():  # type: ignore[no-untyped-def]
        reads.append(time.monotonic())
        return read_usage()

    pool.usage = counted_usage

    def told() -> int:
        return sum(said in r.getMessage() for r in caplog.records)

    try:
        with caplog.at_level(logging.DEBUG, logger="kvctl.remote"):
            node.start()  # its monitor reads the pool's usage at once, then every 0.05 s
            guard_s = time.monotonic() + 30
            while not told():
                assert time.monotonic() < guard_s, "the pool's usage was never read"
                time.sleep(0.05)
            refused = len(reads)
            while len(reads) < refused + 3:  # read again, refused again
                assert time.monotonic() < guard_s, "the pool's usage was not read again"
                time.sleep(0.05)
            assert told() == 1
            assert source.breaker.state == "closed"
            assert node.status()["pool_usage"] is None  # not shown: no figure is better
            assert node.fill([meta.key], tenant="a") == 1
            raw.hset(f"{{{redis_prefix}}}:used", "chunks", b"1")  # mended
            while node.status()["pool_usage"] is None:
                assert time.monotonic() < guard_s, "a sound report was not shown again"
                time.sleep(0.05)
            assert node.status()["pool_usage"]["chunks"] == 1
    finally:
        node.close()


# --- server failures --------------------------------------------------------------------------
def test_dead_server_raises_tier_unavailable_and_recovers(private_redis) -> None:  # type: ignore[no-untyped-def]
    pool = RedisPool(private_redis.url, prefix="p", capacity_bytes=1 << 20, timeout_s=1.0)
    items = [chunk(i, size=4000) for i in range(20)]
    assert pool.put_many(items) == [True] * 20
    expected = {m.key: d for m, d in items}

    wrong: list[str] = []
    stop = threading.Event()

    def reader() -> None:  # reads through the kill: an error or verified bytes, nothing else
        while not stop.is_set():
            try:
                for c in pool.get_many(list(expected), tenant="a"):
                    if c is not None and c.data != expected[c.meta.key]:
                        wrong.append(c.meta.key.hex())
            except TierUnavailable:
                time.sleep(0.01)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        time.sleep(0.2)
        private_redis.kill()
        calls = {
            "put_many": lambda: pool.put_many([chunk(100)]),
            "get_many": lambda: pool.get_many([key(1)], tenant="a"),
            "probe_many": lambda: pool.probe_many([key(1)], tenant="a"),
            "delete_many": lambda: pool.delete_many([key(1)]),
            "usage": pool.usage,
            "resize": lambda: pool.resize(1 << 20),
            "clear": pool.clear,
        }
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(TierUnavailable, match=f"pool {private_redis.url}"):
                call()
            assert time.monotonic() - start < 10, name

        private_redis.start()  # an empty server on the same port
        time.sleep(0.2)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not wrong
    # the next calls reconnect
    assert pool.get_many([m.key for m, _ in items], tenant="a") == [None] * 20
    assert pool.put_many(items[:3]) == [True] * 3
    assert (
        [c.data for c in pool.get_many([m.key for m, _ in items[:3]], tenant="a")]
        == [  # type: ignore[union-attr]
            d for _, d in items[:3]
        ]
    )
    assert pool.usage().chunks == 3
    pool.close()
    with pytest.raises(TierUnavailable, match="closed"):
        pool.usage()


def test_hung_server_times_out(private_redis) -> None:  # type: ignore[no-untyped-def]
    import os
    import signal

    pool = RedisPool(private_redis.url, prefix="p", timeout_s=0.5)
    pool.put_many([chunk(1)])
    os.kill(private_redis.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(TierUnavailable):
            pool.get_many([key(1)], tenant="a")
        assert time.monotonic() - start < 5
    finally:
        os.kill(private_redis.proc.pid, signal.SIGCONT)
    assert pool.get_many([key(1)], tenant="a")[0] is not None
    pool.close()


def test_server_refusing_writes_is_a_put_failure(private_redis) -> None:  # type: ignore[no-untyped-def]
    server = redis.Redis(port=private_redis.port)
    pool = RedisPool(private_redis.url, prefix="p", capacity_bytes=64 << 20)
    small = chunk(1)
    assert pool.put_many([small]) == [True]
    server.config_set("maxmemory-policy", "noeviction")
    server.config_set("maxmemory", int(server.info("memory")["used_memory"]) + (1 << 20))
    big = [chunk(i, size=3 << 20) for i in (2, 3)]
    assert pool.put_many(big) == [False, False]
    usage = pool.usage()
    assert (usage.chunks, usage.used_bytes) == (1, 300)
    assert pool.get_many([m.key for m, _ in big], tenant="a") == [None, None]
    assert pool.corrupt == 0
    pool.close()
    server.close()


def test_concurrent_threads_share_one_pool(make_pool) -> None:  # type: ignore[no-untyped-def]
    pool = make_pool(capacity_bytes=1 << 20)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            items = [chunk(i, size=1000, salt=str(t)) for i in range(50)]
            for i in range(0, 50, 10):
                assert pool.put_many(items[i : i + 10]) == [True] * 10
                got = pool.get_many([m.key for m, _ in items[i : i + 10]], tenant="a")
                assert [c.data for c in got] == [d for _, d in items[i : i + 10]]  # type: ignore[union-attr]
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert pool.usage().chunks == 400


# --- Cluster ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_cluster_round_trip_eviction_and_tenants(redis_cluster: str) -> None:
    prefix = f"kvctl-test-{uuid.uuid4().hex[:8]}"
    pool = RedisPool(redis_cluster, prefix=prefix, capacity_bytes=30_000)
    try:
        assert pool.cluster
        items = [chunk(i, size=1000 + i) for i in range(20)]
        assert pool.put_many(items) == [True] * 20
        got = pool.get_many([m.key for m, _ in items], tenant="a")
        assert [(c.meta, c.data) for c in got] == items  # type: ignore[union-attr]

        # the records spread over the nodes; the accounting keys share one slot
        client = pool._client()
        assert isinstance(client, redis.RedisCluster)
        nodes = {client.get_node_from_key(pool._rec(m.key.hex())).name for m, _ in items}
        assert len(nodes) > 1
        assert len({client.keyslot(k) for k in pool._acct_keys}) == 1

        # eviction: LRU by access
        pool.get_many([items[0][0].key], tenant="a")
        more = [chunk(i, size=1000, salt="more") for i in range(10)]
        assert pool.put_many(more) == [True] * 10
        assert pool.usage().used_bytes <= 30_000
        alive = present(pool, items)
        assert alive[0] and not alive[1]

        # tenants
        secret = chunk(50, tenant="x", isolated=True)
        assert pool.put_many([secret]) == [True]
        assert pool.get_many([secret[0].key], tenant="y") == [None]
        assert pool.probe_many([secret[0].key], tenant="y") == [None]
        assert pool.get_many([secret[0].key], tenant="x")[0].data == secret[1]  # type: ignore[union-attr]
        assert pool.delete_many([secret[0].key]) == 1

        # a damaged record is deleted by a script on its own node (not the accounting's slot)
        victim = more[-1]
        name = pool._rec(victim[0].key.hex())
        client.append(name, b"!")  # one byte too many: damaged on the server
        chunks_before = pool.usage().chunks
        assert pool.get_many([victim[0].key], tenant="a") == [None]
        assert client.exists(name) == 0 and pool.usage().chunks == chunks_before - 1

        pool.resize(5000)
        assert pool.usage().used_bytes <= 5000
        pool.clear()
        assert not [
            k
            for node in client.get_primaries()
            for k in client.scan_iter(match=f"*{prefix}*", target_nodes=node)
        ]
    finally:
        pool.clear()
        pool.close()


def test_cluster_url_unreachable() -> None:
    pool = RedisPool("redis+cluster://127.0.0.1:1", timeout_s=0.5)
    with pytest.raises(TierUnavailable, match=r"redis\+cluster://127\.0\.0\.1:1"):
        pool.usage()


# --- property ---------------------------------------------------------------------------------
TENANTS = ("a", "b", "c")
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"),
            st.lists(
                st.tuples(
                    st.integers(0, 7),  # key
                    st.sampled_from(TENANTS),
                    st.booleans(),  # isolated
                    st.integers(1, 700),  # size
                    st.integers(0, 3),  # content tag
                ),
                min_size=1,
                max_size=4,
            ),
        ),
        st.tuples(
            st.sampled_from(["get", "probe"]),
            st.lists(st.integers(0, 7), min_size=1, max_size=5),
            st.sampled_from(TENANTS),
        ),
        st.tuples(st.just("delete"), st.lists(st.integers(0, 7), max_size=3)),
    ),
    max_size=25,
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(script=ops)
def test_property_tenants_never_see_others_isolated_chunks(redis_url: str, script) -> None:  # type: ignore[no-untyped-def]
    pool = RedisPool(
        redis_url,
        prefix=f"kvctl-test-prop-{uuid.uuid4().hex[:8]}",
        capacity_bytes=2000,
        tenant_quotas={"b": 900},
    )
    # everything ever put under a key: (tenant, isolated, bytes)
    stored: dict[bytes, set[tuple[str, bool, bytes]]] = {}
    try:
        for op in script:
            if op[0] == "put":
                batch = []
                for i, tenant, isolated, size, tag in op[1]:
                    k = key(i)
                    data = payload_of(k, size, tag)
                    meta = ChunkMeta(key=k, size_bytes=size, tenant=tenant, isolated=isolated)
                    batch.append((meta, data))
                    stored.setdefault(k, set()).add((tenant, isolated, data))
                results = pool.put_many(batch)
                for (meta, _), ok in zip(batch, results, strict=True):
                    assert ok == (meta.tenant != "b" or meta.size_bytes <= 900)
            elif op[0] == "delete":
                pool.delete_many([key(i) for i in op[1]])
            else:
                name, idx, reader = op
                keys = [key(i) for i in idx]
                if name == "get":
                    for k, c in zip(keys, pool.get_many(keys, tenant=reader), strict=True):
                        if c is not None:
                            m = c.meta
                            assert m.key == k
                            assert not m.isolated or m.tenant == reader
                            assert (m.tenant, m.isolated, bytes(c.data)) in stored[k]
                else:
                    for k, m in zip(keys, pool.probe_many(keys, tenant=reader), strict=True):
                        if m is not None:
                            assert m.key == k
                            assert not m.isolated or m.tenant == reader
                            assert any(
                                (t, iso, len(d)) == (m.tenant, m.isolated, m.size_bytes)
                                for t, iso, d in stored[k]
                            )
            usage = pool.usage()
            assert usage.used_bytes <= 2000
            assert usage.tenant_bytes.get("b", 0) <= 900
            assert sum(usage.tenant_bytes.values()) == usage.used_bytes
        assert pool.corrupt == 0
    finally:
        pool.clear()
        pool.close()


# --- the scripts go by SHA (EVALSHA); NOSCRIPT sends them again as EVAL ------------------------
def test_the_scripts_go_by_sha(private_redis) -> None:  # type: ignore[no-untyped-def]
    """Every call sent its script's whole text (EVAL: the put's 10.7 KB, the get's LRU touch
    7.5 KB, hashed again by the server), most of a small put's or get's bytes on the wire.
    Once the server holds a script, only its SHA goes."""
    pool = RedisPool(private_redis.url, prefix="p", capacity_bytes=1 << 20)
    raw = redis.Redis.from_url(private_redis.url)
    items = [chunk(i) for i in range(3)]
    keys = [m.key for m, _ in items]
    try:
        # once each, so that the server holds every script of the calls counted below
        assert pool.put_many(items[:1]) == [True]
        pool.get_many(keys[:1], tenant="a")
        pool.probe_many(keys[:1], tenant="a")
        pool.delete_many(keys[:1])
        pool.resize(1 << 20)
        raw.config_resetstat()
        assert pool.put_many(items[1:]) == [True, True]  # one script call
        got = pool.get_many(keys[1:], tenant="a")  # one (the LRU touch)
        assert [(c.meta, c.data) for c in got] == items[1:]  # type: ignore[union-attr]
        assert pool.probe_many(keys[1:], tenant="a") == [m for m, _ in items[1:]]  # one a key
        assert pool.delete_many(keys[1:2]) == 1  # one
        pool.resize(1 << 20)  # one
        assert _scripts(raw) == (0, 6, 0)
    finally:
        raw.close()
        pool.close()


def test_a_script_flush_between_pool_calls_changes_no_answer(private_redis) -> None:  # type: ignore[no-untyped-def]
    """Scripts the server no longer holds (SCRIPT FLUSH, as after a restart or a failover) are
    sent again as EVAL, each once: the pool answers and accounts as before, nothing twice."""
    pool = RedisPool(private_redis.url, prefix="p", capacity_bytes=1 << 20)
    raw = redis.Redis.from_url(private_redis.url)
    items = [chunk(i) for i in range(4)]
    keys = [m.key for m, _ in items]

    def flushed(expected: tuple[int, int, int]) -> None:
        assert _scripts(raw) == expected
        raw.script_flush()
        raw.config_resetstat()

    try:
        assert pool.put_many(items[:1]) == [True]
        flushed((1, 1, 1))  # the first call: NOSCRIPT, then EVAL
        assert pool.put_many(items[1:]) == [True] * 3
        flushed((1, 1, 1))
        got = pool.get_many(keys, tenant="a")
        assert [(c.meta, c.data) for c in got] == items  # type: ignore[union-attr]
        flushed((1, 1, 1))
        assert pool.probe_many(keys, tenant="a") == [m for m, _ in items]
        flushed((4, 4, 4))
        assert pool.delete_many(keys[:1]) == 1
        assert int(raw.info("commandstats")["cmdstat_del"]["calls"]) == 1  # not sent again
        flushed((1, 1, 1))
        usage = pool.usage()
        assert (usage.used_bytes, usage.chunks, usage.tenant_bytes) == (900, 3, {"a": 900})
        pool.resize(600)  # evicts the least recently used one
        flushed((1, 1, 1))
        usage = pool.usage()
        assert (usage.capacity_bytes, usage.used_bytes, usage.chunks) == (600, 600, 2)
        assert present(pool, items) == [False, False, True, True]
        assert pool.corrupt == 0
    finally:
        raw.close()
        pool.close()


def test_a_script_flush_inside_a_pool_batch_sends_again_only_what_failed(
    private_redis, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A SCRIPT FLUSH landing inside one pipeline: a put's script before its STRLENs, a probe
    between its per-key scripts, a delete between its DELs and its accounting script. Only the
    script calls the server refused NOSCRIPT (they ran nothing) go again, as EVAL: the others
    and the plain commands run once."""
    pool = RedisPool(private_redis.url, prefix="p", capacity_bytes=1 << 20)
    raw = redis.Redis.from_url(private_redis.url)
    items = [chunk(i) for i in range(4)]
    keys = [m.key for m, _ in items]
    try:
        assert pool.put_many(items[:1]) == [True]  # the server holds the put's script
        pool.probe_many(keys[:1], tenant="a")
        pool.delete_many(keys[:1])
        writer, reader = pool._client(write=True), pool._client()

        _inject_into_next_pipeline(writer, monkeypatch, (0, ("SCRIPT", "FLUSH")))
        raw.config_resetstat()
        assert pool.put_many(items) == [True] * 4
        assert _scripts(raw) == (1, 1, 1)
        usage = pool.usage()
        assert (usage.used_bytes, usage.chunks, usage.tenant_bytes) == (1200, 4, {"a": 1200})

        pool.probe_many(keys[:1], tenant="a")  # loads the probe's script again
        _inject_into_next_pipeline(reader, monkeypatch, (1, ("SCRIPT", "FLUSH")))
        raw.config_resetstat()
        assert pool.probe_many(keys, tenant="a") == [m for m, _ in items]
        assert _scripts(raw) == (3, 4, 3)  # the first ran; the three after it again

        pool.delete_many([chunk(99)[0].key])  # loads the delete's script again
        _inject_into_next_pipeline(writer, monkeypatch, (1, ("SCRIPT", "FLUSH")))
        raw.config_resetstat()
        assert pool.delete_many(keys[:2]) == 2
        assert int(raw.info("commandstats")["cmdstat_del"]["calls"]) == 2
        assert _scripts(raw) == (1, 1, 1)
        usage = pool.usage()
        assert (usage.used_bytes, usage.chunks, usage.tenant_bytes) == (600, 2, {"a": 600})
        assert present(pool, items) == [False, False, True, True]
    finally:
        raw.close()
        pool.close()


def test_after_a_script_flush_a_full_server_refuses_a_put_as_before(private_redis, caplog) -> None:  # type: ignore[no-untyped-def]
    """Over maxmemory (noeviction) a put's script is refused (OOM: a put failure, nothing
    accounted) and a get's LRU touch (allow-oom) still runs, by SHA too: alike when the server
    had to be sent the scripts again."""
    pool = RedisPool(private_redis.url, prefix="p", capacity_bytes=64 << 20)
    raw = redis.Redis.from_url(private_redis.url)
    small = chunk(1)
    try:
        assert pool.put_many([small]) == [True]
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", 1)
        raw.script_flush()
        with caplog.at_level(logging.INFO, logger="kvctl.remote.redis_pool"):
            assert pool.put_many([chunk(2)]) == [False]
            assert [r.message for r in caplog.records if "refused a put batch" in r.message]
            raw.script_flush()
            raw.config_resetstat()
            for _ in range(2):  # the touch sent again as EVAL, then by SHA: both run
                got = pool.get_many([small[0].key], tenant="a")
                assert [(c.meta, c.data) for c in got] == [small]  # type: ignore[union-attr]
            assert _scripts(raw) == (1, 2, 1)
        assert not [r.message for r in caplog.records if "touch failed" in r.message]
        usage = pool.usage()
        assert (usage.chunks, usage.used_bytes) == (1, 300)
    finally:
        raw.config_set("maxmemory", 0)
        raw.close()
        pool.close()


def test_a_user_the_acl_allows_eval_only_still_uses_the_pool(private_redis, caplog) -> None:  # type: ignore[no-untyped-def]
    """A Redis user made for the pool before its scripts went by SHA needed EVAL only: its
    EVALSHA is refused NOPERM (it ran nothing), and every put, get, probe, delete and resize
    failed (TierUnavailable). Such a call goes again as EVAL, and the pool sends its scripts
    whole from then on: one denial (one ACL LOG entry), said once at warning."""
    admin = redis.Redis.from_url(private_redis.url)
    admin.acl_setuser(
        "evalonly", enabled=True, nopass=True, keys=["*"], commands=["+@all", "-evalsha"]
    )
    url = f"redis://evalonly@127.0.0.1:{private_redis.port}/0"
    pool = RedisPool(url, prefix="p", capacity_bytes=1 << 20)
    items = [chunk(i) for i in range(3)]
    keys = [m.key for m, _ in items]
    try:
        with caplog.at_level(logging.INFO, logger="kvctl.remote.redis_pool"):
            assert pool.put_many(items) == [True] * 3
            got = pool.get_many(keys, tenant="a")
            assert [(c.meta, c.data) for c in got] == items  # type: ignore[union-attr]
            assert pool.probe_many(keys, tenant="a") == [m for m, _ in items]
            assert pool.delete_many(keys[:1]) == 1
            pool.resize(300)  # evicts the least recently used one
            usage = pool.usage()
            assert (usage.capacity_bytes, usage.used_bytes, usage.chunks) == (300, 300, 1)
            assert present(pool, items) == [False, False, True]
        said = [r for r in caplog.records if "may not run EVALSHA" in r.message]
        assert [r.levelno for r in said] == [logging.WARNING]
        assert not [r.message for r in caplog.records if "failed" in r.message]
        logged = [e for e in admin.acl_log() if e.get("username") == "evalonly"]
        assert [(e["object"], e["count"]) for e in logged] == [("evalsha", 1)]
    finally:
        pool.close()
        admin.close()


def test_a_cluster_pool_after_a_script_flush_on_every_node(redis_cluster: str, caplog) -> None:  # type: ignore[no-untyped-def]
    """A Cluster's pipelines (spread over the nodes) and its calls routed by key: the scripts a
    node no longer holds are sent again as EVAL to that node, each once."""
    prefix = f"kvctl-test-{uuid.uuid4().hex[:8]}"
    pool = RedisPool(redis_cluster, prefix=prefix, capacity_bytes=1 << 20)
    client = pool._client()
    assert isinstance(client, redis.RedisCluster)
    nodes = [redis.Redis(host=n.host, port=n.port) for n in client.get_primaries()]

    def flush() -> None:
        for node in nodes:
            node.script_flush()
            node.config_resetstat()

    def scripts() -> tuple[int, int, int]:
        counts = [_scripts(node) for node in nodes]
        return tuple(sum(c[i] for c in counts) for i in range(3))  # type: ignore[return-value]

    items = [chunk(i, salt="flush") for i in range(8)]
    keys = [m.key for m, _ in items]
    try:
        with caplog.at_level(logging.INFO, logger="kvctl.remote.redis_pool"):
            flush()
            assert pool.put_many(items) == [True] * 8
            assert scripts() == (1, 1, 1)
            flush()
            got = pool.get_many(keys, tenant="a")
            assert [(c.meta, c.data) for c in got] == items  # type: ignore[union-attr]
            assert scripts() == (1, 1, 1)
            flush()
            assert pool.probe_many(keys, tenant="a") == [m for m, _ in items]
            assert scripts() == (8, 8, 8)
            flush()
            assert pool.delete_many(keys[:2]) == 2
            assert scripts() == (1, 1, 1)
            flush()
            pool.resize(300)
            assert scripts() == (1, 1, 1)
            usage = pool.usage()
            assert (usage.capacity_bytes, usage.used_bytes, usage.chunks) == (300, 300, 1)
        assert not [r.message for r in caplog.records if "failed" in r.message]
    finally:
        pool.clear()
        pool.close()
        for node in nodes:
            node.close()


def test_a_cluster_get_keeps_its_reads_when_its_touch_cannot_be_sent_again(
    redis_cluster: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get's LRU touch is best effort on a Cluster as on a single server: the scripts
    flushed on every node (EVALSHA answers NOSCRIPT), the touch's EVAL sent again fails, and
    the get still returns the chunks it read, the touch said failed; a put whose script
    cannot be sent again still fails. The failure is injected at the client (its pipelines of
    EVAL calls only, the round trip that sends scripts again, raise ConnectionError on
    execute): the servers answer that round trip, and a connection failing just then, between
    the reads' round trip and it, cannot be brought about from outside on cue."""
    prefix = f"kvctl-test-{uuid.uuid4().hex[:8]}"
    pool = RedisPool(redis_cluster, prefix=prefix, capacity_bytes=1 << 20)
    client = pool._client()
    assert isinstance(client, redis.RedisCluster)
    nodes = [redis.Redis(host=n.host, port=n.port) for n in client.get_primaries()]
    resends: list[int] = []

    def failing_resends(client: redis.RedisCluster) -> None:
        """``client``'s pipelines holding only EVAL calls raise ConnectionError on execute."""
        real_pipeline = client.pipeline

        def pipeline(*args: object, **kwargs: object) -> object:
            pipe = real_pipeline(*args, **kwargs)  # type: ignore[arg-type]
            real_queue, real_execute = pipe.execute_command, pipe.execute
            names: list[str] = []

            def execute_command(*a: object, **kw: object) -> object:
                names.append(str(a[0]).upper())
                return real_queue(*a, **kw)

            def execute(*a: object, **kw: object) -> list[object]:
                if names and all(name == "EVAL" for name in names):
                    resends.append(len(names))
                    pipe.reset()
                    raise redis.exceptions.ConnectionError("injected: the EVAL resend failed")
                return real_execute(*a, **kw)  # type: ignore[arg-type]

            pipe.execute_command = execute_command  # type: ignore[method-assign]
            pipe.execute = execute  # type: ignore[method-assign]
            return pipe

        monkeypatch.setattr(client, "pipeline", pipeline)

    items = [chunk(i, salt="touch") for i in range(3)]
    keys = [m.key for m, _ in items]
    try:
        assert pool.put_many(items) == [True] * 3
        failing_resends(client)
        failing_resends(pool._client(write=True))  # type: ignore[arg-type]
        with caplog.at_level(logging.INFO, logger="kvctl.remote.redis_pool"):
            for node in nodes:
                node.script_flush()
            got = pool.get_many(keys, tenant="a")
            assert [(c.meta, c.data) for c in got] == items  # type: ignore[union-attr]
            assert resends == [1]
            assert [r.message for r in caplog.records if "LRU touch failed" in r.message]
            with pytest.raises(TierUnavailable, match="the EVAL resend failed"):
                pool.put_many([chunk(9, salt="touch")])
            assert resends == [1, 1]
        monkeypatch.undo()
        assert pool.get_many(keys, tenant="a")[0] is not None
    finally:
        pool.clear()
        pool.close()
        for node in nodes:
            node.close()
