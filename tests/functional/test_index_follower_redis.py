"""Followers over a real Redis index: a node's entries come back after the index loses them (a
flush, a server restarted empty) without the agent changing, two routers resyncing one node
agree on its marker (no resync ping-pong), and a router that cannot reach an agent never
empties the shared index of that agent's entries for the other routers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvctl.index.follower import Follower, Followers
from kvctl.index.model import Holding
from kvctl.index.redis_index import RedisIndex
from tests.conftest import RedisServer
from tests.functional.agents import closed_port
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
