"""RedisIndex against a real Redis: it equals EmbeddedIndex on the same event stream, keeps
tenant isolation, replaces a node's holding atomically for a concurrent reader, and fails with
IndexUnavailable (then recovers) when its server goes away. Skipped without Redis outside CI."""

from __future__ import annotations

import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings

from kvctl.index.events import ChunkEvent
from kvctl.index.model import EmbeddedIndex, FleetIndex, Holding, NodeCheck
from kvctl.index.open import open_index
from kvctl.index.redis_index import RedisIndex
from kvctl.index.remote import IndexUnavailable
from tests.conftest import RedisServer, _free_port, _redis_binary
from tests.unit.test_fleet_index import (
    KEYS,
    NODES,
    TENANTS,
    Op,
    check_against_model,
    key,
    model_step,
    ops,
    run_op,
    stored,
)


@pytest.fixture
def fresh(redis_url: str, redis_prefix: str) -> Iterator[RedisIndex]:
    """A RedisIndex under this test's prefix (the fixture deletes its keys afterwards)."""
    index = RedisIndex(redis_url, prefix=f"{redis_prefix}:index:")
    yield index
    index.close()


def assert_same(a: FleetIndex, b: FleetIndex, keys: list[bytes]) -> None:
    for tenant in (*TENANTS, "outsider"):
        assert a.holders(keys, tenant=tenant) == b.holders(keys, tenant=tenant), tenant
    assert a.nodes() == b.nodes()
    assert len(a) == len(b)  # type: ignore[arg-type]


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(stream=ops)
def test_the_redis_index_equals_the_embedded_one_on_the_same_event_stream(
    redis_url: str, redis_prefix: str, stream: list[Op]
) -> None:
    # a prefix per example: hypothesis reuses the function's fixtures across examples
    index = RedisIndex(redis_url, prefix=f"{redis_prefix}:{uuid.uuid4().hex[:8]}:")
    reference = EmbeddedIndex()
    model: dict[tuple[str, bytes], ChunkEvent] = {}
    try:
        for op in stream:
            assert run_op(index, op) == run_op(reference, op), op
            model_step(model, op)
            assert_same(index, reference, list(KEYS))
            # the isolation property, against the Redis index itself
            check_against_model(index, model, KEYS)
            # nothing lost: the check (which resyncs a node when it says otherwise) agrees
            for node in NODES:
                assert index.check(node, limit=10_000).damage == "", (node, op)
    finally:
        index.clear()
        index.close()


def test_large_batches_span_several_scripts_and_still_agree(fresh: RedisIndex) -> None:
    reference = EmbeddedIndex()
    keys = [key(i) for i in range(3000)]
    events = [stored(i, "cpu", f"t{i % 3}", isolated=i % 2 == 0) for i in range(3000)]
    events += [ChunkEvent("removed", key(i)) for i in range(0, 3000, 7)]
    for index in (fresh, reference):
        assert index.apply("big", events) == len(events)
        assert index.apply("other", events[:1500]) == 1500
    assert_same(fresh, reference, keys)
    listing = [stored(i, "disk", "t1") for i in range(1000, 4000)]
    assert fresh.replace("big", listing) == reference.replace("big", listing) == 3000
    assert_same(fresh, reference, [*keys, *(key(i) for i in range(3000, 4000))])
    assert fresh.drop("big") == reference.drop("big") == 3000
    assert_same(fresh, reference, keys)


def test_a_reader_never_sees_a_node_half_replaced(fresh: RedisIndex, redis_url: str) -> None:
    # more chunks than one script call takes: the replace is several calls in one MULTI/EXEC
    half = 3000
    chain = [key(i) for i in range(2 * half)]
    first = [stored(i) for i in range(half)]
    second = [stored(i) for i in range(half, 2 * half)]
    fresh.replace("n", first)
    reader = RedisIndex(redis_url, prefix=fresh.prefix)
    stop = threading.Event()
    errors: list[BaseException] = []

    def replace_back_and_forth() -> None:
        try:
            for i in range(30):
                fresh.replace("n", second if i % 2 == 0 else first)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
        finally:
            stop.set()

    writer = threading.Thread(target=replace_back_and_forth)
    writer.start()
    seen: set[tuple[int, ...]] = set()
    try:
        while not stop.is_set() or not seen:
            rows = reader.holders(chain, tenant="acme")
            held = tuple(i for i, row in enumerate(rows) if row)
            assert held in (tuple(range(half)), tuple(range(half, 2 * half))), held[:3]
            seen.add(held)
    finally:
        writer.join()
        reader.close()
    assert not errors, errors
    assert fresh.nodes() == {"n": half}


def test_indexes_on_one_prefix_share_and_other_prefixes_are_apart(
    fresh: RedisIndex, redis_url: str, redis_prefix: str
) -> None:
    same = open_index(redis_url, prefix=fresh.prefix)
    apart = RedisIndex(redis_url, prefix=f"{redis_prefix}:other:")
    try:
        fresh.apply("a", [stored(0, "gpu")])
        assert same.holders([key(0)], tenant="x") == [[Holding("a", "gpu", 100, 16)]]
        assert apart.nodes() == {} and apart.holders([key(0)], tenant="x") == [[]]
        apart.apply("b", [stored(0)])
        assert apart.clear() == 3  # its chunk hash, node set and nodes hash
        assert same.nodes() == {"a": 1}
    finally:
        same.close()
        apart.close()


def test_a_given_client_is_used_and_left_open(redis_url: str, redis_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    index = RedisIndex(client=client, prefix=f"{redis_prefix}:given:")
    try:
        index.apply("n", [stored(1)])
        index.close()
        assert client.exists(f"{redis_prefix}:given:nodes".encode()) == 1
    finally:
        client.close()


@pytest.fixture
def private_unix_redis() -> Iterator[RedisServer]:
    """A redis-server of this test alone on a TCP port and a unix socket (short path: a socket
    path is limited to ~100 bytes)."""
    directory = Path(tempfile.mkdtemp(prefix="kvidx-"))
    server = RedisServer(
        _redis_binary("redis-server"),
        directory,
        _free_port(),
        "--unixsocket",
        str(directory / "r.sock"),
    )
    try:
        server.start()
        yield server
    finally:
        server.kill()
        shutil.rmtree(directory, ignore_errors=True)


def test_unix_socket_and_outage_then_recovery(private_unix_redis: RedisServer) -> None:
    sock = Path(private_unix_redis.directory) / "r.sock"
    index = open_index(f"unix://{sock}?db=0")
    try:
        index.apply("n", [stored(0)])
        assert index.nodes() == {"n": 1}
        private_unix_redis.kill()
        with pytest.raises(IndexUnavailable, match="index at unix://"):
            index.holders([key(0)], tenant="acme")
        with pytest.raises(IndexUnavailable):
            index.apply("n", [stored(1)])
        private_unix_redis.start()  # no persistence: the index starts empty
        assert index.nodes() == {}
        index.apply("n", [stored(1)])
        assert index.holders([key(0), key(1)], tenant="acme") == [
            [],
            [Holding("n", "cpu", 100, 16)],
        ]
    finally:
        index.close()


def test_nobody_listening_is_index_unavailable() -> None:
    index = RedisIndex(f"redis://:secret@127.0.0.1:{_free_port()}/0", timeout_s=1.0)
    try:
        with pytest.raises(IndexUnavailable) as err:
            index.nodes()
        assert "secret" not in str(err.value)
    finally:
        index.close()


def test_node_names_with_any_characters(fresh: RedisIndex) -> None:
    reference = EmbeddedIndex()
    names = [*NODES, "", "{tag}", "*?[]\\", "\ud800", "a:b"]
    for index in (fresh, reference):
        for i, name in enumerate(names):
            index.apply(name, [stored(i, tenant=name, isolated=True), stored(99)])
    assert_same(fresh, reference, [key(i) for i in (*range(len(names)), 99)])
    for name in names:
        assert fresh.holders([key(names.index(name))], tenant=name)[0][0].node == name
    assert fresh.drop("*?[]\\") == 2 and fresh.nodes()["a:b"] == 2


def test_an_entry_not_written_by_an_index_is_index_unavailable(
    fresh: RedisIndex, redis_url: str
) -> None:
    fresh.apply("n", [stored(0)])
    client = redis.Redis.from_url(redis_url)
    try:
        client.hset(f"{fresh.prefix}k:{key(0).hex()}", "intruder", "not an entry")
    finally:
        client.close()
    with pytest.raises(IndexUnavailable, match="malformed entry"):
        fresh.holders([key(0)], tenant="acme")


def test_a_marker_left_before_counts_were_kept_is_kept_and_gets_its_count(
    fresh: RedisIndex, redis_url: str
) -> None:
    """An index written by a version that kept a bare marker (no count beside it): the marker
    stays the node's, the check trusts the set until a write counts it, and then counts."""
    fresh.replace("n", [stored(i) for i in range(3)])
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.hset(f"{fresh.prefix}markers", "n", "0123abcd")
        assert fresh.marker("n") == "0123abcd"
        assert fresh.check("n", limit=100).damage == ""
        fresh.apply("n", [stored(3)])
        assert raw.hget(f"{fresh.prefix}markers", "n") == b"0123abcd 4"
        assert fresh.check("n", limit=100) == NodeCheck("0123abcd", "", 0, 4)
        assert fresh.nodes() == {"n": 4}
    finally:
        raw.close()
