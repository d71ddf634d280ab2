"""RedisIndex against a real Redis: it equals EmbeddedIndex on the same event stream, keeps
tenant isolation, replaces a node's holding atomically for a concurrent reader, and fails with
IndexUnavailable (then recovers) when its server goes away. Skipped without Redis outside CI."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, given, settings

from kvctl.index import redis_index
from kvctl.index.events import ChunkEvent
from kvctl.index.model import EmbeddedIndex, FleetIndex, Holding, NodeCheck
from kvctl.index.open import open_index
from kvctl.index.redis_index import (
    MAX_CHUNK_HASH_BYTES,
    MAX_HOLDERS_PER_CHUNK,
    RedisIndex,
    encode_entry,
)
from kvctl.index.remote import IndexUnavailable
from tests.conftest import RedisServer, _free_port, _redis_binary
from tests.functional.index_before_counts import IndexBeforeCounts
from tests.unit.test_fleet_index import (
    KEYS,
    NODES,
    TENANTS,
    Op,
    check_against_model,
    key,
    model_step,
    ops,
    removed,
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


@pytest.mark.parametrize(
    "value",
    [b"not an entry", b"1 2 0 x tier", b"1 2 0 3 \xff\xfe\xfd", b"1 2 0 " + b"9" * 5000 + b" x"],
    ids=["no-counts", "tier-length", "tier-utf8", "tier-length-digits"],
)
def test_an_entry_not_written_by_an_index_is_no_holder_not_a_failed_index(
    fresh: RedisIndex, redis_url: str, value: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """One field under a chunk's hash that no index wrote (a prefix shared by mistake, or any
    client of the server) failed every lookup over that key (IndexUnavailable: the router
    answered 503 and said its index was down); it is skipped, said, and the key's sound
    holders stand."""
    fresh.apply("n", [stored(0)])
    client = redis.Redis.from_url(redis_url)
    try:
        client.hset(f"{fresh.prefix}k:{key(0).hex()}", "intruder", value)
    finally:
        client.close()
    with caplog.at_level(logging.WARNING, logger="kvctl.index.redis_index"):
        rows = fresh.holders([key(0), key(1)], tenant="acme")
    assert [[h.node for h in row] for row in rows] == [["n"], []]
    assert fresh.malformed_entries == 1
    assert "malformed entry" in caplog.text and "intruder" in caplog.text


@pytest.mark.parametrize(
    ("fields", "tenant_bytes", "read"),
    [
        (MAX_HOLDERS_PER_CHUNK, 10, True),
        (MAX_HOLDERS_PER_CHUNK + 1, 10, False),
        (2, 2 * MAX_CHUNK_HASH_BYTES, False),
    ],
    ids=["at-the-holders-bound", "past-the-holders-bound", "past-the-bytes-bound"],
)
def test_a_chunk_hash_past_what_a_fleet_writes_is_not_read(
    fresh: RedisIndex,
    redis_url: str,
    fields: int,
    tenant_bytes: int,
    read: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A chunk's hash was read whole (HGETALL) at every lookup over its key: one planted with
    thousands of entries that parse (or a few megabytes long) made every router pull it from the
    server and plan every entry as a holder, at every lookup. Past MAX_HOLDERS_PER_CHUNK fields
    or MAX_CHUNK_HASH_BYTES it is skipped whole, its entries counted as malformed; other keys'
    holders stand, and a hash at the bound is read as written."""
    fresh.apply("n", [stored(0), stored(1)])
    planted = {
        f"node-{i:05d}".encode(): encode_entry(stored(0, tenant="t" * tenant_bytes))
        for i in range(fields - 1)
    }
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.hset(f"{fresh.prefix}k:{key(0).hex()}", mapping=planted)
    finally:
        raw.close()
    with caplog.at_level(logging.WARNING, logger="kvctl.index.redis_index"):
        for _ in range(2):  # every lookup over the key meets it again: said once
            rows = fresh.holders([key(0), key(1)], tenant="acme")
    assert [h.node for h in rows[1]] == ["n"]
    said = [r.getMessage() for r in caplog.records]
    if read:
        assert len(rows[0]) == fields and fresh.malformed_entries == 0 and not said
    else:
        assert rows[0] == [] and fresh.malformed_entries == 2 * fields
        assert len(said) == 1 and key(0).hex() in said[0] and "skipped whole" in said[0], said


def test_holders_answer_where_the_acl_denies_memory(fresh: RedisIndex, redis_url: str) -> None:
    """holders() asks MEMORY USAGE of each chunk's hash (its bytes bound): a router whose Redis
    user may not run MEMORY (an ACL of read and write commands only) still gets its holders,
    each hash bound by its entries alone, rather than every lookup failing."""
    fresh.apply("n", [stored(0)])
    user = f"kvctl-test-{uuid.uuid4().hex[:12]}"
    admin = redis.Redis.from_url(redis_url)
    try:
        admin.acl_setuser(
            user, enabled=True, nopass=True, keys=["*"], commands=["+@all", "-memory"]
        )
        client = redis.Redis.from_url(redis_url, username=user)
        try:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.memory_usage(f"{fresh.prefix}k:{key(0).hex()}")
            denied = RedisIndex(prefix=fresh.prefix, client=client)
            rows = denied.holders([key(0), key(1)], tenant="acme")
            assert [[h.node for h in row] for row in rows] == [["n"], []]
        finally:
            client.close()
    finally:
        admin.acl_deluser(user)
        admin.close()


def test_where_the_acl_denies_memory_it_is_asked_once_and_the_bytes_bound_stands(
    fresh: RedisIndex, redis_url: str
) -> None:
    """Under an ACL without MEMORY, every lookup asked MEMORY USAGE of each key again: one
    denial per key in the server's ACL LOG and its error replies (100 lookups of 4 keys: 400
    of each, what an operator watching either sees as an attack), and a hash of a few entries
    megabytes long was read whole at every lookup, its bytes bound gone. MEMORY is asked once
    (again only after ``MEMORY_RETRY_S``), and the bound is taken on the bytes read in the
    script, so such a hash is still skipped, not sent."""
    fresh.apply("n", [stored(i) for i in range(4)])
    planted = {
        f"node-{i}".encode(): encode_entry(stored(0, tenant="t" * MAX_CHUNK_HASH_BYTES))
        for i in range(2)
    }
    user = f"kvctl-test-{uuid.uuid4().hex[:12]}"
    admin = redis.Redis.from_url(redis_url)
    try:
        admin.hset(f"{fresh.prefix}k:{key(0).hex()}", mapping=planted)
        admin.acl_setuser(
            user, enabled=True, nopass=True, keys=["*"], commands=["+@all", "-memory"]
        )
        client = redis.Redis.from_url(redis_url, username=user)
        try:
            denied = RedisIndex(prefix=fresh.prefix, client=client)
            for _ in range(50):
                rows = denied.holders([key(i) for i in range(4)], tenant="acme")
                assert [[h.node for h in row] for row in rows] == [[], ["n"], ["n"], ["n"]]
            logged = [e for e in admin.acl_log() if e.get("username") == user]
            assert [(e["object"], e["count"]) for e in logged] == [("memory|usage", 1)]
            assert denied.malformed_entries == 50 * 3  # the planted hash's, at each lookup
        finally:
            client.close()
    finally:
        admin.acl_deluser(user)
        admin.close()


def test_an_entry_with_counts_past_an_int64_is_not_a_holder(
    fresh: RedisIndex, redis_url: str
) -> None:
    """An entry a router stored before events were bounded (6a2fadc), from an agent listing a
    chunk of 10**400 tokens: skipped, not a holder whose counts fail every route over the key
    (OverflowError: a 500) until its node is resynced; the key's sound holders stand."""
    fresh.apply("n", [stored(0)])
    fresh.apply("m", [stored(0)])
    raw = redis.Redis.from_url(redis_url)
    try:
        field = f"{fresh.prefix}k:{key(0).hex()}"
        good = raw.hget(field, "m")
        assert good is not None
        _size, _tokens, rest = good.split(b" ", 2)
        raw.hset(field, "m", b"%d %d " % (4096, 10**400) + rest)
    finally:
        raw.close()
    assert [h.node for h in fresh.holders([key(0)], tenant="acme")[0]] == ["n"]


# --- routers before counts were kept, sharing the index (a rolling upgrade) -------------------
def _held_by_the_set(index: RedisIndex, raw: redis.Redis, node: str) -> int:
    return int(raw.scard(f"{index.prefix}n:{node.encode().hex()}"))


def test_routers_before_counts_sharing_the_index_see_no_loss_and_cause_no_damage(
    fresh: RedisIndex, redis_url: str
) -> None:
    """A router of the version before counts (its exact commands) and a current one write one
    node's events into one index, in either order, and resync it: the old router's marker, which
    it compares raw, never changes (it would resync the node at every poll), the current one's
    check finds no damage (it would purge and resync the node every 10 s), and both count what
    the set holds. A real loss is still found, whoever wrote last. (Another node has entries,
    as in any fleet: P nodes with no field for "a" then says the old router emptied it.)"""
    old = IndexBeforeCounts(redis_url, prefix=fresh.prefix)
    raw = redis.Redis.from_url(redis_url)
    try:
        fresh.apply("b", [stored(50)])
        fresh.replace("a", [stored(i) for i in range(4)])
        old.replace("a", [stored(i) for i in range(4)])
        marker = old.marker("a")
        assert marker is not None and fresh.marker("a") == marker
        batches: list[list[ChunkEvent]] = [
            [stored(4)],
            [ChunkEvent("removed", key(0))],
            [stored(5), stored(6), ChunkEvent("removed", key(4))],
            [ChunkEvent("cleared", b"")],
            [stored(7), stored(8)],
            [ChunkEvent("removed", key(7)), stored(9)],
        ]
        steps = 0
        for old_first in (True, False, True):
            for batch in batches:
                writers = (old, fresh) if old_first else (fresh, old)
                for index in writers:
                    index.apply("a", batch)
                    steps += 1
                    assert old.marker("a") == fresh.marker("a") == marker, steps
                    assert fresh.check("a", limit=10_000).damage == "", (steps, batch)
                    held = _held_by_the_set(fresh, raw, "a")
                    counts = {"a": held, "b": 1} if held else {"b": 1}
                    assert old.nodes() == fresh.nodes() == counts, steps
            old.replace("a", [stored(i) for i in range(10, 13)])  # the old router resyncs
            assert fresh.check("a", limit=10_000).damage == ""
            fresh.replace("a", [stored(i) for i in range(10, 14)])  # and the current one
            assert old.marker("a") == marker and fresh.check("a", limit=10_000).damage == ""
        # a lost key set is found, the old router having written last or the current one
        old.apply("a", [stored(20)])
        raw.delete(f"{fresh.prefix}n:{b'a'.hex()}")
        assert fresh.check("a", limit=10_000).damage == "count"
        fresh.replace("a", [stored(i) for i in range(5)])
        fresh.apply("a", [stored(5)])
        raw.delete(f"{fresh.prefix}n:{b'a'.hex()}")
        assert fresh.check("a", limit=10_000).damage == "count"
        fresh.replace("a", [stored(i) for i in range(5)])
        old.apply("a", [stored(5)])
        raw.delete(f"{fresh.prefix}k:{key(2).hex()}")  # a chunk's key evicted
        assert fresh.check("a", limit=10_000).damage == "entries"
        assert old.marker("a") == marker
    finally:
        raw.close()


def test_a_count_left_by_nobody_is_unknown_until_a_resync_counts_it(
    fresh: RedisIndex, redis_url: str
) -> None:
    """An index that routers before counts wrote (a bare marker, no count): the marker is kept
    as it is, the check finds no damage in the missing count, and a resync counts the node, so
    a set lost after it is found."""
    old = IndexBeforeCounts(redis_url, prefix=fresh.prefix)
    raw = redis.Redis.from_url(redis_url)
    try:
        old.replace("n", [stored(i) for i in range(3)])
        marker = old.marker("n")
        fresh.apply("n", [stored(3)])
        assert fresh.check("n", limit=100) == NodeCheck(marker, "", 0, 4)
        assert fresh.nodes() == old.nodes() == {"n": 4}
        fresh.replace("n", [stored(i) for i in range(5)])
        assert fresh.marker("n") == old.marker("n") == marker
        assert fresh.nodes() == old.nodes() == {"n": 5}
        raw.delete(f"{fresh.prefix}n:{b'n'.hex()}")
        assert fresh.check("n", limit=100).damage == "count"
    finally:
        raw.close()


# --- nodes no resync wrote (an engine's own events): counted from the set -------------------
@pytest.mark.parametrize("lost", ["count", "set"])
def test_a_node_without_a_marker_is_counted_by_its_set_after_a_loss(
    fresh: RedisIndex, redis_url: str, lost: str
) -> None:
    """A node whose events an engine sends (no resync, no marker) has its P nodes count, or its
    key set, lost (evicted or deleted): the next writes count it from the set again, never
    below 0, and ``nodes()`` shows it while it holds entries."""
    raw = redis.Redis.from_url(redis_url)
    lose = f"{fresh.prefix}nodes" if lost == "count" else f"{fresh.prefix}n:{b'eng'.hex()}"
    try:
        fresh.apply("eng", [stored(i) for i in range(1, 5)])
        assert fresh.marker("eng") is None
        assert raw.delete(lose) == 1
        fresh.apply("eng", [stored(5)])
        listed = _held_by_the_set(fresh, raw, "eng")
        assert listed == (5 if lost == "count" else 1)
        assert fresh.nodes() == {"eng": listed}
        fresh.apply("eng", [ChunkEvent("removed", key(5)), ChunkEvent("removed", key(4))])
        listed = _held_by_the_set(fresh, raw, "eng")
        assert listed == (3 if lost == "count" else 0)
        assert fresh.nodes() == ({"eng": listed} if listed else {})
        assert raw.hget(f"{fresh.prefix}nodes", "eng") == (str(listed).encode() if listed else None)
        fresh.apply("eng", [stored(6)])
        assert fresh.nodes() == {"eng": listed + 1}
    finally:
        raw.close()


def test_a_replace_that_outlasts_the_client_timeout_but_lands_counts_as_done(
    tmp_path: Path,
) -> None:
    """A replace the server runs only after the client's socket timeout (a large node, or
    others' replaces ahead of it) still lands whole (MULTI/EXEC): the index reads back the
    replace's id and reports it done, so its caller does not send it again (each try holding
    the server for its whole length, and timing out again: a storm). The server is made late
    here by DEBUG SLEEP from another client."""
    server = RedisServer(
        _redis_binary("redis-server"), tmp_path, _free_port(), "--enable-debug-command", "yes"
    )
    server.start()
    raw = redis.Redis.from_url(server.url)
    probe = redis.Redis.from_url(server.url, socket_timeout=0.1)
    index = RedisIndex(server.url, timeout_s=0.5)
    sleeper = threading.Thread(target=raw.execute_command, args=("DEBUG", "SLEEP", "1.0"))
    try:
        index.apply("n", [stored(0), stored(1)])
        index.apply("other", [stored(0)])
        connections = int(raw.info("stats")["total_connections_received"])
        scripts_before = _script_calls(raw)
        sleeper.start()
        for _ in range(100):  # until the server sleeps (a hang guard)
            try:
                probe.ping()
            except redis.exceptions.TimeoutError:
                break
            threading.Event().wait(0.01)
        else:
            pytest.fail("the server never started sleeping")
        assert index.replace("n", [stored(2), stored(3), stored(4)]) == 3
        sleeper.join(10)
        scripts_after = _script_calls(raw)
        # the replace timed out client-side: its connection was dropped, the read back went
        # on a new one (else this test proves nothing)
        assert int(raw.info("stats")["total_connections_received"]) > connections + 1
        # sent once (its one script group), not again after the timeout
        assert scripts_after == scripts_before + 1
        assert index.nodes() == {"n": 3, "other": 1}
        assert index.holders([key(1), key(2)], tenant="acme") == [
            [],
            [Holding("n", "cpu", 100, 16)],
        ]
    finally:
        if sleeper.is_alive():
            sleeper.join(10)
        index.close()
        probe.close()
        raw.close()
        server.kill()


# --- what a prefix shared by mistake (or a broken writer) left in the index's hashes ----------
@pytest.mark.parametrize(
    "value",
    [
        '{"ms": 1e400, "nodes": ["y"]}',  # int(inf): OverflowError out of claims()
        '{"ms": NOW, "nodes": "xy"}',  # a string: claimed nodes "x" and "y"
        '{"ms": NOW, "nodes": [["y"]]}',  # a list: claimed the node "['y']"
        '{"ms": 99999999999999999, "nodes": ["y"]}',  # far in the future: claimed for ever
        "[" * 5000 + "]" * 5000,  # nested past json's parser: RecursionError out of claims()
    ],
    ids=["ms-inf", "nodes-a-string", "nodes-not-names", "ms-in-the-future", "nested-deep"],
)
def test_a_claim_no_router_wrote_claims_nothing(
    fresh: RedisIndex, redis_url: str, value: str
) -> None:
    """claims() read any JSON under the claims hash as a claim: an "ms" of 1e400 raised
    OverflowError (not IndexUnavailable: out of a reread of the inventory, its thread ended
    for good), "nodes" of another shape claimed nodes no router named, and an "ms" ahead of
    the server's clock kept its nodes claimed for ever (its age 0 at every read; found by a
    review). Each is no claim; a router's own claim stands beside it."""
    fresh.claim("router-a", ["x"])
    raw = redis.Redis.from_url(redis_url)
    try:
        seconds, micros = raw.time()
        now_ms = seconds * 1000 + micros // 1000
        raw.hset(f"{fresh.prefix}claims", "intruder", value.replace("NOW", str(now_ms)))
    finally:
        raw.close()
    claims = fresh.claims()
    assert set(claims) == {"x"}


@pytest.mark.parametrize(
    ("field", "count"),
    [
        (b"intruder", b"many"),
        (b"intruder", b"-3"),
        (b"intruder", b"1.5"),
        (b"intruder", b"inf"),
        (b"intruder", b" 12"),
        (b"intruder", b"1_000"),
        (b"intruder", b"9223372036854775808"),  # 2**63
        (b"intruder", b"9" * 5000),  # past int()'s digit limit
        (b"\xc3\x28", b"4"),  # a name no router writes (no UTF-8)
    ],
    ids=[
        "word",
        "negative",
        "fraction",
        "inf",
        "space",
        "underscore",
        "2**63",
        "5000-digits",
        "name",
    ],
)
def test_a_count_not_written_by_an_index_leaves_out_its_node_alone(
    fresh: RedisIndex,
    redis_url: str,
    field: bytes,
    count: bytes,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """nodes() read every count of the nodes hash at once: one that is no count (no number, a
    negative, a fraction, past an int64, read by int() as one with a space or an underscore)
    failed it for every router (IndexUnavailable: status, the inventory's rereads, kvctl
    router forget), or was taken (len(index) then failed OverflowError). Only that node is
    left out, and said (once while it stays); the others are read as written."""
    fresh.apply("n", [stored(0), stored(1)])
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.hset(f"{fresh.prefix}nodes", field, count)
    finally:
        raw.close()
    with caplog.at_level(logging.WARNING, logger="kvctl.index.redis_index"):
        assert fresh.nodes() == {"n": 2}
        assert fresh.nodes() == {"n": 2}
        assert len(fresh) == 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert "left out" in said[0]
    assert fresh.malformed_entries == 1  # counted as said: once while it stays


def test_a_node_left_out_for_its_count_is_counted_once_while_it_stays(
    fresh: RedisIndex, redis_url: str
) -> None:
    """A node nodes() left out for a count that is none was logged but not counted: an operator
    reading index_malformed_entries (/v1/health, /metrics, router status) saw 0 while a node was
    missing from the index's nodes. It is counted once while it stays (nodes() is read on every
    status and inventory reread: counting each read would count reads, not what the index
    holds), and again when it comes back after it was repaired."""
    fresh.apply("n", [stored(0)])
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.hset(f"{fresh.prefix}nodes", b"x", b"garbage")
        for _ in range(3):
            assert fresh.nodes() == {"n": 1}
        assert fresh.malformed_entries == 1
        raw.hset(f"{fresh.prefix}nodes", b"y", b"-1")
        assert fresh.nodes() == {"n": 1}
        assert fresh.malformed_entries == 2
        raw.hdel(f"{fresh.prefix}nodes", b"x", b"y")  # repaired
        assert fresh.nodes() == {"n": 1}
        raw.hset(f"{fresh.prefix}nodes", b"x", b"garbage")  # and planted again
        assert fresh.nodes() == {"n": 1}
        assert fresh.malformed_entries == 3
    finally:
        raw.close()


def test_a_count_kept_for_a_node_that_is_no_count_is_not_counted_on(
    fresh: RedisIndex, redis_url: str
) -> None:
    """A node with a marker has its count moved by each write from the one kept in P markers:
    one no script wrote (inf, with P nodes' count no longer the set's size: read as a router's
    that keeps no count otherwise) made every later count inf, written to P nodes (the node
    left out of nodes()) until a resync. The next write counts it from the node's set again, as
    after a router that keeps no count."""
    fresh.replace("n", [stored(0)])
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.hset(f"{fresh.prefix}markers", b"\xffn", b"inf")
        raw.hset(f"{fresh.prefix}nodes", b"n", b"inf")
    finally:
        raw.close()
    fresh.apply("n", [stored(1)])
    assert fresh.nodes() == {"n": 2}
    assert fresh.check("n", limit=10).damage == ""
    fresh.apply("n", [stored(2)])
    assert fresh.nodes() == {"n": 3}
    raw = redis.Redis.from_url(redis_url)
    try:
        assert raw.hget(f"{fresh.prefix}markers", b"\xffn") == b"3"
    finally:
        raw.close()


def test_a_claim_under_a_field_that_is_no_utf8_name_is_read_as_any_other(
    fresh: RedisIndex, redis_url: str
) -> None:
    """claims() decoded each field (a router's instance id) to compare it with ``excluding``:
    one that is no UTF-8 raised UnicodeDecodeError out of it (not IndexUnavailable: a reread
    of the inventory failed with it, and `kvctl router forget` answered 500)."""
    fresh.claim("router-a", ["x"])
    raw = redis.Redis.from_url(redis_url)
    try:
        seconds, micros = raw.time()
        now_ms = seconds * 1000 + micros // 1000
        claim = json.dumps({"ms": now_ms, "nodes": ["y"]})
        raw.hset(f"{fresh.prefix}claims", b"\xc3\x28", claim)
    finally:
        raw.close()
    assert set(fresh.claims(excluding="router-a")) == {"y"}
    assert set(fresh.claims()) == {"x", "y"}


# --- the scripts go by SHA (EVALSHA); NOSCRIPT sends them again as EVAL ------------------------
def _script_calls(raw: redis.Redis) -> int:
    """EVAL and EVALSHA calls the server ran (INFO commandstats)."""
    stats = raw.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("eval", "evalsha"))


def _scripts(raw: redis.Redis) -> tuple[int, int, int]:
    """(EVAL calls, EVALSHA calls, EVALSHA calls failed: NOSCRIPT here) since the server's last
    CONFIG RESETSTAT. INFO commandstats is the server's: a server of the test's own."""
    stats = raw.info("commandstats")
    ev, sha = stats.get("cmdstat_eval", {}), stats.get("cmdstat_evalsha", {})
    return int(ev.get("calls", 0)), int(sha.get("calls", 0)), int(sha.get("failed_calls", 0))


def _inject_into_next_pipeline(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch, *injected: tuple[int, tuple[str, ...]]
) -> None:
    """The next pipeline made of ``client`` runs each injected command right after its first
    ``i`` commands (on the server, between them), their replies dropped: a real SCRIPT FLUSH (or
    SCRIPT LOAD by another client) landing inside a batch the index sent whole."""
    real_pipeline = client.pipeline

    def pipeline(*args: object, **kwargs: object) -> object:
        monkeypatch.setattr(client, "pipeline", real_pipeline)  # this one only
        pipe = real_pipeline(*args, **kwargs)  # type: ignore[arg-type]
        real_execute = pipe.execute
        at = [i + n for n, (i, _) in enumerate(sorted(injected))]

        def execute(*a: object, **kw: object) -> list[object]:
            for (_, command), j in zip(sorted(injected), at, strict=True):
                pipe.command_stack.insert(j, (command, {}))
            replies = real_execute(*a, **kw)  # type: ignore[arg-type]
            return [r for j, r in enumerate(replies) if j not in at]

        pipe.execute = execute  # type: ignore[method-assign]
        return pipe

    monkeypatch.setattr(client, "pipeline", pipeline)


def test_the_scripts_go_by_sha(private_redis: RedisServer) -> None:
    """Every call sent a script's whole text (EVAL: 0.8-2.5 KB, hashed again by the server),
    holders() once per routed lookup. Once the server holds a script, only its SHA goes."""
    index = RedisIndex(private_redis.url)
    raw = redis.Redis.from_url(private_redis.url)
    try:
        index.apply("n", [stored(0), stored(1)])
        index.holders([key(0)], tenant="acme")
        index.check("n", limit=10)
        raw.config_resetstat()
        for _ in range(10):
            rows = index.holders([key(0), key(1), key(2)], tenant="acme")
            assert [[h.node for h in row] for row in rows] == [["n"], ["n"], []]
        index.apply("n", [stored(2)])
        assert index.check("n", limit=10).damage == ""
        assert _scripts(raw) == (0, 12, 0)
    finally:
        raw.close()
        index.close()


def test_a_script_flush_between_calls_changes_no_answer(
    private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scripts the server no longer holds (SCRIPT FLUSH, as after a restart or a failover) are
    sent again as EVAL, each once (nothing applied twice), and every answer is the model's:
    an apply of three script groups, holders, check, a replace of three groups (one MULTI/EXEC),
    drop and purge, each right after a flush."""
    monkeypatch.setattr(redis_index, "_EVENTS_PER_SCRIPT", 2)
    index, model = RedisIndex(private_redis.url), EmbeddedIndex()
    raw = redis.Redis.from_url(private_redis.url)
    keys = [key(i) for i in range(8)]

    def flushed(expected: tuple[int, int, int]) -> None:
        assert _scripts(raw) == expected
        raw.script_flush()
        raw.config_resetstat()

    try:
        index.apply("m", [stored(7)])
        model.apply("m", [stored(7)])
        flushed((1, 1, 1))  # the first call: NOSCRIPT, then EVAL
        events = [stored(0), stored(1), removed(0), stored(2), stored(3)]
        assert index.apply("n", events) == model.apply("n", events) == 5
        flushed((3, 3, 3))  # three groups, each sent again once
        assert index.holders(keys, tenant="acme") == model.holders(keys, tenant="acme")
        flushed((1, 1, 1))
        assert index.check("n", limit=10) == NodeCheck(None, "", 0, 0)
        flushed((1, 1, 1))
        chunks = [stored(i) for i in range(3, 8)]
        assert index.replace("n", chunks) == model.replace("n", chunks) == 5
        # a MULTI/EXEC: its first group as EVAL, the two after it by SHA (nothing between them)
        flushed((1, 2, 0))
        assert index.check("n", limit=10).damage == ""
        flushed((1, 1, 1))
        assert index.drop("m") == model.drop("m") == 1  # one MULTI/EXEC: EVAL
        flushed((1, 0, 0))
        assert index.purge("m") == 0
        flushed((1, 1, 1))
        assert_same(index, model, keys)
        assert index.nodes() == {"n": 5}
    finally:
        raw.close()
        index.close()


@pytest.mark.parametrize("reloaded", [False, True], ids=["flushed", "flushed-then-reloaded"])
def test_a_script_flush_inside_an_apply_batch_applies_each_group_once_in_order(
    private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, reloaded: bool
) -> None:
    """An apply's groups go in one pipeline; a SCRIPT FLUSH lands after its first: the groups
    the server no longer held are sent again, in order, and the first is not. Where another
    client loads the script again between two of them (``reloaded``), the group after ran
    before the one that failed: both go again, in order (the last event of a key wins: here
    the key stored in the second group and removed in the third is not held)."""
    monkeypatch.setattr(redis_index, "_EVENTS_PER_SCRIPT", 2)
    client = redis.Redis.from_url(private_redis.url)
    index, model = RedisIndex(client=client), EmbeddedIndex()
    raw = redis.Redis.from_url(private_redis.url)
    keys = [key(i) for i in range(6)]
    try:
        index.apply("n", [stored(5)])  # the server holds the script
        model.apply("n", [stored(5)])
        injected: list[tuple[int, tuple[str, ...]]] = [(1, ("SCRIPT", "FLUSH"))]
        if reloaded:
            injected.append((2, ("SCRIPT", "LOAD", redis_index._APPLY_LUA)))
        _inject_into_next_pipeline(client, monkeypatch, *injected)
        raw.config_resetstat()
        events = [stored(0), stored(1), stored(2), stored(3), removed(2), stored(4)]
        assert index.apply("n", events) == model.apply("n", events) == 6
        # three by SHA: the first ran; the second failed (and the third, unless reloaded);
        # sent again as EVAL: the second and the third, once each
        assert _scripts(raw) == (2, 3, 1 if reloaded else 2)
        assert_same(index, model, keys)
        assert index.nodes() == {"n": 5}
        assert index.check("n", limit=10).damage == ""
    finally:
        raw.close()
        index.close()
        client.close()


def test_a_user_the_acl_allows_eval_only_still_uses_the_index(
    private_redis: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis user made for the index before its scripts went by SHA needed EVAL only: its
    EVALSHA is refused NOPERM (it ran nothing; in a MULTI/EXEC the whole replace is refused),
    and every lookup and write failed (IndexUnavailable: the router down). Such a call goes
    again as EVAL (a replace whole, once), and the index sends its scripts whole from then on:
    one refused call (the replace's two EVALSHAs in the ACL LOG), said once at warning; every
    answer is the model's."""
    monkeypatch.setattr(redis_index, "_EVENTS_PER_SCRIPT", 2)
    admin = redis.Redis.from_url(private_redis.url)
    admin.acl_setuser(
        "evalonly", enabled=True, nopass=True, keys=["*"], commands=["+@all", "-evalsha"]
    )
    index = RedisIndex(f"redis://evalonly@127.0.0.1:{private_redis.port}/0")
    model = EmbeddedIndex()
    keys = [key(i) for i in range(8)]
    try:
        with caplog.at_level(logging.INFO, logger="kvctl.index.redis_index"):
            chunks = [stored(i) for i in range(5)]  # three groups: EVAL, then EVALSHA twice
            assert index.replace("n", chunks) == model.replace("n", chunks) == 5
            events = [stored(5), removed(0), stored(6)]
            assert index.apply("n", events) == model.apply("n", events) == 3
            assert index.holders(keys, tenant="acme") == model.holders(keys, tenant="acme")
            assert index.check("n", limit=10).damage == ""
            assert index.drop("n") == model.drop("n") == 6
            assert index.purge("n") == 0
            assert_same(index, model, keys)
        said = [r for r in caplog.records if "may not run EVALSHA" in r.message]
        assert [r.levelno for r in said] == [logging.WARNING]
        logged = [e for e in admin.acl_log() if e.get("username") == "evalonly"]
        assert [(e["object"], e["count"]) for e in logged] == [("evalsha", 2)]
    finally:
        index.close()
        admin.close()


def test_after_a_script_flush_a_full_server_refuses_and_answers_as_before(
    private_redis: RedisServer,
) -> None:
    """Over maxmemory (noeviction) a write script is refused (OOM: IndexUnavailable) and a
    read-only one still runs: alike when the server had to be sent the script again (an
    EVALSHA of a script the server does not hold is refused NOSCRIPT, not OOM; its EVAL is
    judged by the script's flags)."""
    index = RedisIndex(private_redis.url)
    raw = redis.Redis.from_url(private_redis.url)
    try:
        index.apply("n", [stored(0)])
        index.apply("m", [stored(0)])
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", 1)
        raw.script_flush()
        with pytest.raises(IndexUnavailable, match="maxmemory"):
            index.apply("n", [stored(1)])
        raw.script_flush()
        rows = index.holders([key(0), key(1)], tenant="acme")
        assert [[h.node for h in row] for row in rows] == [["m", "n"], []]
        raw.config_set("maxmemory", 0)
        assert index.nodes() == {"m": 1, "n": 1}  # the refused apply left nothing
    finally:
        raw.config_set("maxmemory", 0)
        raw.close()
        index.close()
