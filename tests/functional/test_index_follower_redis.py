"""Followers over a real Redis index: a node's entries come back after the index loses them (a
flush, a server restarted empty) without the agent changing, and after it loses part of them
with the node's marker kept (chunk keys evicted, fields or the node's key set deleted), that node
alone resynced; two routers resyncing one node agree on its marker (no resync ping-pong), and a
router that cannot reach an agent never empties the shared index of that agent's entries for the
other routers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient

from kvctl.index.events import ChunkEvent
from kvctl.index.follower import DAMAGE_RESYNC_MIN_S, Follower, Followers
from kvctl.index.model import Holding
from kvctl.index.redis_index import RedisIndex
from kvctl.remote.fetchplan import PrefillModel
from kvctl.router.app import create_app
from kvctl.router.score import Costs
from kvctl.router.service import Router
from kvctl.router.topology import Node, Topology
from tests.conftest import RedisServer
from tests.functional.agents import closed_port
from tests.functional.index_before_counts import IndexBeforeCounts
from tests.unit.test_index_follower import K1, K2, _stored, scripted


@pytest.fixture
def shared(redis_url: str, redis_prefix: str) -> Iterator[RedisIndex]:
    index = RedisIndex(redis_url, prefix=f"{redis_prefix}:index:")
    yield index
    index.close()


@pytest.fixture
def agent() -> Iterator[tuple[str, dict[str, Any]]]:
    script: dict[str, Any] = {"instance": "one", "events": [], "items": [_stored(K1)]}
    with scripted(script) as url:
        yield url, script


def test_a_flushed_index_is_refilled_at_the_next_poll(
    shared: RedisIndex, agent: tuple[str, dict[str, Any]]
) -> None:
    url, _ = agent
    follower = Follower(shared, "a", url)
    follower.poll_once()
    assert shared.nodes() == {"a": 1}
    shared.clear()  # FLUSHDB, or keys evicted, as far as this prefix goes
    follower.poll_once()
    assert shared.holders([K1], tenant="t") == [[Holding("a", "cpu", 64, 4)]]
    assert follower.status()["index_lost"] == 1
    follower.close()


def test_a_redis_restarted_empty_is_refilled_and_its_outage_is_not_the_agents(
    private_redis: RedisServer, agent: tuple[str, dict[str, Any]]
) -> None:
    url, script = agent
    index = RedisIndex(private_redis.url, timeout_s=0.5)
    followers = Followers(index, {"a": (url, None)}, drop_after_s=0.2)
    try:
        followers.poll_all()
        private_redis.kill()
        for _ in range(3):  # past drop_after_s
            followers.poll_all()
            time.sleep(0.1)
        [status] = followers.status()
        assert status["up"] is True and status["errors"] == 0 and status["entries"] is None
        assert status["index_errors"] >= 1
        private_redis.start()  # no persistence: empty
        script["items"] = [_stored(K1), _stored(K2)]
        followers.poll_all()
        assert index.nodes() == {"a": 2}
        [status] = followers.status()
        assert status["resyncs"] == 2 and status["up"] is True
    finally:
        followers.close()
        index.close()


def test_an_index_outage_does_not_have_the_agent_listed_at_every_poll(
    private_redis: RedisServer, agent: tuple[str, dict[str, Any]]
) -> None:
    """While the index is down, each poll ended in a resync that paged through the agent's
    whole key listing (each page a scan of the agent's index) before failing to write it: every
    router listed every agent several times a second for as long as Redis was away."""
    url, script = agent
    index = RedisIndex(private_redis.url, timeout_s=0.5)
    follower = Follower(index, "a", url)
    try:
        follower.poll_once()
        assert script["listings"] == 1
        private_redis.kill()
        for _ in range(5):
            assert follower.poll_once() == 0
        status = follower.status()
        assert status["index_errors"] == 5 and status["errors"] == 0
        assert script["listings"] == 1  # the agent was not listed for an index that is away
        private_redis.start()  # back, empty: the next poll lists the agent and refills it
        assert follower.poll_once() == 1
        assert script["listings"] == 2 and index.nodes() == {"a": 1}
    finally:
        follower.close()
        index.close()


def test_two_routers_resyncing_one_node_agree_and_then_poll_quietly(
    shared: RedisIndex, redis_url: str, agent: tuple[str, dict[str, Any]]
) -> None:
    url, _ = agent
    other = RedisIndex(redis_url, prefix=shared.prefix)
    mine, theirs = Follower(shared, "a", url), Follower(other, "a", url)
    try:
        for _ in range(3):
            mine.poll_once()
            theirs.poll_once()
        # the second one's resync kept the first one's marker: nobody saw a loss
        assert (mine.status()["resyncs"], theirs.status()["resyncs"]) == (1, 1)
        shared.clear()
        for _ in range(3):
            mine.poll_once()
            theirs.poll_once()
        assert (mine.status()["resyncs"], theirs.status()["resyncs"]) == (2, 2)
        assert shared.nodes() == {"a": 1}
    finally:
        mine.close()
        theirs.close()
        other.close()


def test_a_router_that_cannot_reach_an_agent_leaves_its_shared_entries_alone(
    shared: RedisIndex, redis_url: str, agent: tuple[str, dict[str, Any]]
) -> None:
    url, _ = agent
    reaching = Follower(shared, "b", url)
    reaching.poll_once()
    partitioned_index = RedisIndex(redis_url, prefix=shared.prefix)
    partitioned = Followers(partitioned_index, drop_after_s=0.05)
    partitioned.add("b", f"http://127.0.0.1:{closed_port()}")  # a wrong URL, or a partition
    try:
        partitioned.poll_all()
        time.sleep(0.1)
        partitioned.poll_all()
        assert partitioned.down_nodes() == {"b"}
        partitioned.close()  # and stops, as a router does
        assert shared.nodes() == {"b": 1}
        assert reaching.poll_once() == 0  # nothing lost: no resync
        assert reaching.status()["resyncs"] == 1
    finally:
        reaching.close()
        partitioned_index.close()


# --- part of a node's entries lost, its marker kept -------------------------------------------
CHAIN_A = [bytes([0xA0, i]) * 8 for i in range(40)]  # what agent "a" holds
CHAIN_B = [bytes([0xB0, i]) * 8 for i in range(40)]  # what agent "b" holds


@pytest.fixture
def two_agents() -> Iterator[tuple[dict[str, Any], dict[str, tuple[str, None]]]]:
    """Scripted agents "a" and "b" holding CHAIN_A and CHAIN_B; (a's script, agents)."""
    script_a: dict[str, Any] = {"instance": "one", "events": [], "items": []}
    script_a["items"] = [_stored(k) for k in CHAIN_A]
    script_b = {"instance": "one", "events": [], "items": [_stored(k) for k in CHAIN_B]}
    with scripted(script_a) as url_a, scripted(script_b) as url_b:
        yield script_a, {"a": (url_a, None), "b": (url_b, None)}


def _router(index: RedisIndex, followers: Followers) -> Router:
    return Router(
        index,
        Topology.build([Node("a", "fra"), Node("b", "fra")]),
        Costs(PrefillModel(1e-4, 0.0, "configured: test")),
        followers=followers,
    )


def _nonzero(reasons: dict[str, int]) -> dict[str, int]:
    return {r: n for r, n in reasons.items() if n}


def _poll_until_resynced(followers: Followers, node: str, resyncs: int) -> dict[str, Any]:
    """Poll until ``node`` has resynced ``resyncs`` times (the audit may take a few polls to
    reach a lost entry; bounded by polls, not time); its status."""
    for _ in range(50):
        followers.poll_all()
        status = {str(s["node"]): s for s in followers.status()}[node]
        if status["resyncs"] >= resyncs:
            return status
    raise AssertionError(f"{node} was not resynced: {status}")


@pytest.mark.parametrize("how", ["evicted", "deleted"])
def test_part_of_a_nodes_entries_lost_with_its_marker_kept_resyncs_that_node_alone(
    shared: RedisIndex, redis_url: str, two_agents: tuple[dict[str, Any], Any], how: str
) -> None:
    """The head of a's chain gone from the index, a's marker kept: "evicted" DELs the chunks'
    keys (what a server evicting under maxmemory does), "deleted" HDELs a's field from them (an
    operator). The router then answers as if nobody held the prefix, until the check's audit
    finds the loss and a alone is resynced; b is left alone."""
    _, agents = two_agents
    followers = Followers(shared, agents)
    router = _router(shared, followers)
    raw = redis.Redis.from_url(redis_url)
    try:
        followers.poll_all()
        decision = router.route(CHAIN_A, tenant="t")
        assert (decision.node, decision.indexed_chunks) == ("a", 40)
        names = [f"{shared.prefix}k:{k.hex()}".encode() for k in CHAIN_A[:5]]
        for name in names:
            assert (raw.delete(name) if how == "evicted" else raw.hdel(name, "a")) == 1
        assert shared.marker("a") is not None  # what the marker check alone trusted
        assert router.route(CHAIN_A, tenant="t").indexed_chunks == 0  # wrong now
        status = _poll_until_resynced(followers, "a", 2)
        assert _nonzero(status["resync_reasons"]) == {"first": 1, "index_partial": 1}
        assert status["index_lost"] == 0
        decision = router.route(CHAIN_A, tenant="t")
        assert (decision.node, decision.indexed_chunks) == ("a", 40)
        assert shared.holders(CHAIN_A, tenant="t") == [[Holding("a", "cpu", 64, 4)]] * 40
        [status_b] = [s for s in followers.status() if s["node"] == "b"]
        assert _nonzero(status_b["resync_reasons"]) == {"first": 1}  # untouched
        assert shared.nodes() == {"a": 40, "b": 40}
        for _ in range(3):  # and once whole, the check finds nothing more
            followers.poll_all()
        assert [s["resyncs"] for s in followers.status()] == [2, 1]
        metrics = TestClient(create_app(router)).get("/metrics").text
        for node, reason, n in (("a", "index_partial", 1), ("a", "first", 1), ("b", "first", 1),
                                ("b", "index_partial", 0)):  # fmt: skip
            line = f'kvctl_index_follower_resyncs_total{{node="{node}",reason="{reason}"}} {n}.0'
            assert line in metrics
    finally:
        raw.close()
        followers.close()


def test_a_lost_key_set_is_repaired_so_entries_the_node_no_longer_lists_do_not_linger(
    shared: RedisIndex, redis_url: str, two_agents: tuple[dict[str, Any], Any]
) -> None:
    """a's key set gone (evicted or deleted), its entries and marker kept: the count no longer
    agrees with the set, and a is purged and resynced. Without that, a later resync (here: a
    restarted holding half its chain) drops what the set lists, nothing, and the index goes on
    naming a for chunks it no longer holds."""
    script_a, agents = two_agents
    followers = Followers(shared, agents)
    router = _router(shared, followers)
    raw = redis.Redis.from_url(redis_url)
    try:
        followers.poll_all()
        assert raw.delete(f"{shared.prefix}n:{b'a'.hex()}".encode()) == 1
        status = _poll_until_resynced(followers, "a", 2)
        assert _nonzero(status["resync_reasons"]) == {"first": 1, "index_count": 1}
        script_a["instance"], script_a["items"] = "two", [_stored(k) for k in CHAIN_A[:20]]
        _poll_until_resynced(followers, "a", 3)
        assert shared.holders(CHAIN_A, tenant="t") == (
            [[Holding("a", "cpu", 64, 4)]] * 20 + [[]] * 20
        )
        assert router.route(CHAIN_A, tenant="t").indexed_chunks == 20
        assert shared.nodes() == {"a": 20, "b": 40}
        [status_b] = [s for s in followers.status() if s["node"] == "b"]
        assert _nonzero(status_b["resync_reasons"]) == {"first": 1}
    finally:
        raw.close()
        followers.close()


def test_a_server_evicting_part_of_the_index_has_the_node_resynced_whole(
    private_redis: RedisServer,
) -> None:
    """A real eviction: the server's maxmemory lowered under what the index uses, with the
    allkeys-random policy, drops a random part of the index's keys (chunk hashes, the node's
    set, the count or marker hashes, whichever it draws); the follower puts the node back
    whole, for whichever reason its check gives."""
    chain = [i.to_bytes(16, "big") for i in range(2000)]
    script = {"instance": "one", "events": [], "items": [_stored(k) for k in chain]}
    index = RedisIndex(private_redis.url)
    raw = redis.Redis.from_url(private_redis.url)
    with scripted(script) as url:
        followers = Followers(index, {"a": (url, None)})
        try:
            followers.poll_all()
            used_bytes = int(raw.info("memory")["used_memory"])
            raw.config_set("maxmemory-policy", "allkeys-random")
            raw.config_set("maxmemory", used_bytes - 50_000)
            raw.set("a write that makes room", "x")  # the server evicts before it
            # nothing but the index's keys was there to evict
            assert int(raw.info("stats")["evicted_keys"]) > 0
            raw.config_set("maxmemory", 0)
            status = _poll_until_resynced(followers, "a", 2)
            reasons = set(_nonzero(status["resync_reasons"])) - {"first"}
            assert reasons <= {"index_lost", "index_partial", "index_count"} and reasons
            assert index.holders(chain, tenant="t") == [[Holding("a", "cpu", 64, 4)]] * 2000
            assert index.nodes() == {"a": 2000}
        finally:
            followers.close()
            raw.close()
            index.close()


def test_entries_lost_again_soon_after_a_repair_wait_before_the_next_one(
    shared: RedisIndex, redis_url: str, two_agents: tuple[dict[str, Any], Any]
) -> None:
    """A server that keeps evicting must not have the agent listed on every poll: a node
    repaired for lost entries is not again within DAMAGE_RESYNC_MIN_S (its clock's), and is
    once that has passed."""
    _, agents = two_agents
    now = [100.0]
    follower = Follower(shared, "a", agents["a"][0], clock=lambda: now[0])
    raw = redis.Redis.from_url(redis_url)

    def lose_the_head() -> None:
        for k in CHAIN_A[:5]:
            raw.delete(f"{shared.prefix}k:{k.hex()}")

    try:
        follower.poll_once()
        lose_the_head()
        follower.poll_once()
        assert follower.status()["resync_reasons"]["index_partial"] == 1
        lose_the_head()
        for _ in range(3):
            now[0] += DAMAGE_RESYNC_MIN_S / 4
            follower.poll_once()
        assert follower.status()["resync_reasons"]["index_partial"] == 1
        assert shared.holders(CHAIN_A[:1], tenant="t") == [[]]
        now[0] += DAMAGE_RESYNC_MIN_S / 4
        follower.poll_once()
        assert follower.status()["resync_reasons"]["index_partial"] == 2
        assert shared.holders(CHAIN_A, tenant="t") == [[Holding("a", "cpu", 64, 4)]] * 40
    finally:
        raw.close()
        follower.close()


# --- a router of the version before counts sharing the index (a rolling upgrade) --------------
@pytest.mark.parametrize("first", ["before_counts", "current"])
def test_routers_before_and_after_counts_follow_one_agent_into_one_index_quietly(
    shared: RedisIndex, redis_url: str, first: str
) -> None:
    """A router of the version before counts (its index commands and its marker-only check)
    and a current one follow one agent into one index, which hears each new event first in
    turn: neither resyncs after its first contact (the old one saw its marker change at every
    write of the current one; the current one saw the old one's writes as a lost key set, and
    purged and resynced). A chunk key then evicted is still found and repaired by the current
    one, the old one seeing nothing."""
    script: dict[str, Any] = {"instance": "one", "events": [], "items": []}
    held = list(CHAIN_A[:10])
    script["items"] = [_stored(k) for k in held]
    old_index = IndexBeforeCounts(redis_url, prefix=shared.prefix)
    shared.apply("b", [ChunkEvent("stored", CHAIN_B[0], "cpu", "t", False, 64, 4)])  # a fleet
    raw = redis.Redis.from_url(redis_url)
    with scripted(script) as url:
        old, new = Follower(old_index, "a", url), Follower(shared, "a", url)
        pollers = [old, new] if first == "before_counts" else [new, old]
        try:
            for follower in pollers:
                follower.poll_once()
            for round_ in range(14):  # CHAIN_A: 40 chunks
                # the agent stores two chunks and evicts one, or (once) evicts all it holds
                seq = len(script["events"])
                if round_ == 9:
                    gone, held = held, []
                    new_events = [{"type": "evict", **_stored(k)} for k in gone]
                else:
                    added = CHAIN_A[10 + 2 * round_ : 12 + 2 * round_]
                    new_events = [{"type": "store", **_stored(k)} for k in added]
                    new_events += [{"type": "evict", **_stored(held[0])}] if held else []
                    held = held[1:] + added
                script["events"] += [{"seq": seq + 1 + i, **e} for i, e in enumerate(new_events)]
                script["items"] = [_stored(k) for k in held]
                for follower in pollers if round_ % 2 == 0 else pollers[::-1]:
                    follower.poll_once()
                assert shared.check("a", limit=10_000).damage == "", round_
            assert _nonzero(old.status()["resync_reasons"]) == {"first": 1}
            assert _nonzero(new.status()["resync_reasons"]) == {"first": 1}
            assert old_index.nodes() == shared.nodes() == {"a": len(held), "b": 1}
            assert shared.holders(held, tenant="t") == [[Holding("a", "cpu", 64, 4)]] * len(held)
            raw.delete(f"{shared.prefix}k:{held[3].hex()}")  # evicted
            for _ in range(5):
                old.poll_once()
                new.poll_once()
            assert _nonzero(new.status()["resync_reasons"]) == {"first": 1, "index_partial": 1}
            assert _nonzero(old.status()["resync_reasons"]) == {"first": 1}
            assert shared.holders(held, tenant="t") == [[Holding("a", "cpu", 64, 4)]] * len(held)
            assert old_index.nodes() == shared.nodes() == {"a": len(held), "b": 1}
        finally:
            old.close()
            new.close()
            raw.close()
            old_index.close()
