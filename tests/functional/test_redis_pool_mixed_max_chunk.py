"""Agents of one Redis pool with different max_chunk settings (each agent's pool takes its
own, ed80ef9): a reader whose max_chunk is smaller than a writer's deleted the writer's sound
records as 'corrupt' (9ec07fd's oversized-record path), so one agent configured for smaller
chunks wiped the larger chunks of every other agent of the pool as it read them. A sound record
of a chunk larger than the reader takes is a miss for that reader, left in place and not
counted corrupt; a record longer than its own header says (grown by APPEND, planted) is still
dropped. Real Redis (the machine's, a key prefix per test; a real 3-node Cluster); no mocks."""

from __future__ import annotations

import logging
import uuid

import pytest
import redis

from kvctl.remote import record
from kvctl.remote.redis_pool import RedisPool
from tests.functional.test_redis_pool import chunk


def _check_mixed(writer: RedisPool, reader: RedisPool, raw: redis.Redis | object) -> None:
    large = chunk(0, size=256 << 10)  # past 4096 + the largest header
    broken = chunk(1, size=1000)
    assert writer.put_many([large, broken]) == [True, True]
    large_name = writer._rec(large[0].key.hex())
    broken_name = writer._rec(broken[0].key.hex())
    # grown past its header's length and past the reader's bound: no writer made it
    raw.append(broken_name, bytes(256 << 10))  # type: ignore[attr-defined]

    got = reader.get_many([large[0].key, broken[0].key], tenant="a")
    assert got == [None, None]  # the larger chunk is no read of this agent's
    assert reader.probe_many([large[0].key], tenant="a") == [None]
    assert raw.exists(large_name) == 1  # type: ignore[attr-defined]
    assert raw.exists(broken_name) == 0  # type: ignore[attr-defined]
    assert reader.corrupt == 1  # the grown one only

    back = writer.get_many([large[0].key], tenant="a")[0]
    assert back is not None and back.data == large[1]
    usage = writer.usage()
    assert (usage.chunks, usage.used_bytes) == (1, 256 << 10)


def test_a_smaller_max_chunk_reader_leaves_a_larger_writers_records_in_place(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    writer = RedisPool(redis_url, prefix=redis_prefix, max_chunk_bytes=1 << 20)
    reader = RedisPool(redis_url, prefix=redis_prefix, max_chunk_bytes=4096)
    raw = redis.Redis.from_url(redis_url)
    try:
        with caplog.at_level(logging.DEBUG, logger="kvctl.remote.redis_pool"):
            _check_mixed(writer, reader, raw)
        said = [r for r in caplog.records if "max_chunk_bytes" in r.getMessage()]
        # the larger chunk is said as one (not as corrupt), below warning: every read meets it
        assert any(
            "left in place" in r.getMessage() and r.levelno == logging.DEBUG for r in said
        ), caplog.text
        assert sum("dropped corrupt chunk" in r.getMessage() for r in said) == 1, caplog.text
    finally:
        raw.close()
        reader.close()
        writer.close()


def test_a_cluster_reader_with_a_smaller_max_chunk_leaves_them_too(redis_cluster: str) -> None:
    """A Cluster's reads do not ask each record's length (their pipelines spread over the
    nodes): the server tells a sound record from a grown one when it is asked to drop it."""
    prefix = f"kvctl-test-{uuid.uuid4().hex[:8]}"
    writer = RedisPool(redis_cluster, prefix=prefix, max_chunk_bytes=1 << 20)
    reader = RedisPool(redis_cluster, prefix=prefix, max_chunk_bytes=4096)
    try:
        _check_mixed(writer, reader, writer._client())
    finally:
        writer.clear()
        reader.close()
        writer.close()


def test_a_newer_writers_longer_record_is_left_in_place(redis_url: str, redis_prefix: str) -> None:
    """A record of a version this reader does not know (a newer writer, mid-upgrade) is a miss
    left in place, however long: 9ec07fd's oversized path judged one longer than the reader's
    bound before its format, and deleted it as corrupt for every agent."""
    writer = RedisPool(redis_url, prefix=redis_prefix, max_chunk_bytes=1 << 20)
    reader = RedisPool(redis_url, prefix=redis_prefix, max_chunk_bytes=4096)
    raw = redis.Redis.from_url(redis_url)
    try:
        items = [chunk(0, size=256 << 10), chunk(1, size=256 << 10)]
        assert writer.put_many(items) == [True, True]
        names = [writer._rec(m.key.hex()) for m, _ in items]
        for name in names:
            raw.setrange(name, len(record.MAGIC), bytes([record.FORMAT_VERSION + 1]))
        assert reader.get_many([items[0][0].key], tenant="a") == [None]
        assert reader.probe_many([items[1][0].key], tenant="a") == [None]
        assert raw.exists(*names) == 2
        assert (reader.unknown_format, reader.corrupt) == (2, 0)
    finally:
        raw.close()
        reader.close()
        writer.close()


def test_a_larger_writers_sound_record_costs_a_smaller_reader_no_drop_call(
    redis_url: str, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sound, accounted record of a larger chunk whose length came with the read (plain
    Redis) needs no server-side length check: each read of it ran _DROP_IF_LONGER_LUA for
    nothing (it answered 'leave it', every time)."""
    from kvctl.remote import redis_pool

    writer = RedisPool(redis_url, prefix=redis_prefix, max_chunk_bytes=1 << 20)
    reader = RedisPool(redis_url, prefix=redis_prefix, max_chunk_bytes=4096)
    drops: list[object] = []
    real_eval = redis_pool._eval

    def counting_eval(target: object, script: str, *args: object, **kw: object) -> object:
        if script == redis_pool._DROP_IF_LONGER_LUA:
            drops.append(args)
        return real_eval(target, script, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(redis_pool, "_eval", counting_eval)
    try:
        large = chunk(0, size=256 << 10)
        assert writer.put_many([large]) == [True]
        for _ in range(3):
            assert reader.get_many([large[0].key], tenant="a") == [None]
        assert drops == []
        assert reader.corrupt == 0
        back = writer.get_many([large[0].key], tenant="a")[0]
        assert back is not None and back.data == large[1]
    finally:
        reader.close()
        writer.close()
