"""A record longer than a reader's bound that only looks like another agent's (45827cb,
60c18b0): a sound header declaring a larger chunk, or a newer format's magic and version, is
no proof (anyone can write one, CRC included). Left in place however long, a planted one was
kept for good and every get by the smaller reader pulled up to its whole bound (256 MiB by
default) for a miss, every time. Such a record is kept only where the pool's accounting
({P}:meta) accounts it (at the size its header declares, for a larger chunk); otherwise it is
counted corrupt and deleted, as before 45827cb. Real Redis (a key prefix per test); no mocks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis

from kvctl.remote import record
from kvctl.remote.redis_pool import RedisPool
from tests.functional.test_redis_pool import chunk


def _plant_newer_format(writer: RedisPool, raw: redis.Redis, i: int) -> bytes:
    """Magic, a version past this reader's, and 32 MiB of zeros: no writer's, unaccounted."""
    key = chunk(i)[0].key
    raw.set(
        writer._rec(key.hex()), record.MAGIC + bytes([record.FORMAT_VERSION + 1]) + bytes(32 << 20)
    )
    return key


def _plant_sound_header_unaccounted(writer: RedisPool, raw: redis.Redis, i: int) -> bytes:
    """A valid header of a larger chunk over a garbage payload, with no accounting."""
    meta, _ = item = chunk(i, size=256 << 10)
    assert writer.put_many([item]) == [True]
    name = writer._rec(meta.key.hex())
    raw.setrange(name, raw.strlen(name) - 1000, b"\xa5" * 1000)  # garbage; the header kept
    raw.hdel(writer._acct_keys[1], meta.key.hex())
    return meta.key


def _plant_sound_header_other_size(writer: RedisPool, raw: redis.Redis, i: int) -> bytes:
    """A valid header of a larger chunk, its key accounted at another size than it declares."""
    meta, _ = item = chunk(i, size=256 << 10)
    assert writer.put_many([item]) == [True]
    h = meta.key.hex()
    entry = raw.hget(writer._acct_keys[1], h)
    assert entry is not None
    raw.hset(writer._acct_keys[1], h, b"8000" + entry[entry.index(b" ") :])
    return meta.key


@pytest.mark.parametrize(
    "plant",
    [_plant_newer_format, _plant_sound_header_unaccounted, _plant_sound_header_other_size],
    ids=["newer-format", "sound-header-unaccounted", "sound-header-other-size"],
)
@pytest.mark.parametrize("read", ["get", "probe"])
def test_a_planted_long_record_is_deleted_as_corrupt(
    redis_url: str,
    redis_prefix: str,
    plant: Callable[[RedisPool, redis.Redis, int], bytes],
    read: str,
) -> None:
    writer = RedisPool(redis_url, prefix=redis_prefix, max_chunk_bytes=1 << 20)
    reader = RedisPool(redis_url, prefix=redis_prefix, max_chunk_bytes=4096)
    raw = redis.Redis.from_url(redis_url)
    try:
        key = plant(writer, raw, 0)
        name = writer._rec(key.hex())
        # a real larger chunk beside it, accounted: still left to its agent
        real_meta, real_data = real = chunk(1, size=256 << 10)
        assert writer.put_many([real]) == [True]
        keys = [key, real_meta.key]
        if read == "get":
            assert reader.get_many(keys, tenant="a") == [None, None]
        else:
            assert reader.probe_many(keys, tenant="a") == [None, None]
        assert raw.exists(name) == 0, "the planted record was left in place"
        assert (reader.corrupt, reader.unknown_format) == (1, 0)
        back = writer.get_many([real_meta.key], tenant="a")[0]
        assert back is not None and back.data == real_data
        # a second read finds nothing to pull or count
        assert reader.get_many(keys, tenant="a") == [None, None]
        assert reader.corrupt == 1
    finally:
        raw.close()
        reader.close()
        writer.close()


def test_an_accounted_newer_format_record_is_left_in_place(
    redis_url: str, redis_prefix: str
) -> None:
    """A newer writer's real chunk is accounted (its put accounted it before writing it)."""
    writer = RedisPool(redis_url, prefix=redis_prefix, max_chunk_bytes=1 << 20)
    reader = RedisPool(redis_url, prefix=redis_prefix, max_chunk_bytes=4096)
    raw = redis.Redis.from_url(redis_url)
    try:
        meta, _ = item = chunk(0, size=256 << 10)
        assert writer.put_many([item]) == [True]
        name = writer._rec(meta.key.hex())
        raw.setrange(name, len(record.MAGIC), bytes([record.FORMAT_VERSION + 1]))
        assert reader.get_many([meta.key], tenant="a") == [None]
        assert reader.probe_many([meta.key], tenant="a") == [None]
        assert raw.exists(name) == 1
        assert (reader.unknown_format, reader.corrupt) == (2, 0)
    finally:
        raw.close()
        reader.close()
        writer.close()
