"""Follower edge cases a real agent does not produce: bad arguments, malformed events and listed
chunks (counted and skipped, the rest applied), answers that are not an agent's (counted as no
answer: marked down after drop_after_s on the follower's clock), credentials kept out of status.
The agents' own behaviour is in tests/functional/test_index_follower.py."""

from __future__ import annotations

import http.server
import json
import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from kvctl.errors import InvalidArgument
from kvctl.index.events import ChunkEvent
from kvctl.index.follower import POOL_ROLE, Follower, Followers
from kvctl.index.model import EmbeddedIndex, Holding, NodeCheck
from kvctl.index.remote import IndexUnavailable
from kvctl.remote.fetchplan import PrefillModel
from kvctl.router.score import Costs
from kvctl.router.service import Router
from kvctl.router.topology import Node, Topology
from tests.functional.agents import closed_port
from tests.functional.waiting import wait_until
from tests.hostile_servers import Hostile, handler_class, send_json, trickle
from tests.not_an_agent import send, serving, web_page_url

K1, K2, K3 = (bytes([i]) * 16 for i in (1, 2, 3))


def _stored(k: bytes, tier: str = "cpu") -> dict[str, Any]:
    return {"key": k.hex(), "tier": tier, "size_bytes": 64, "tokens": 4, "tenant": "t"}


def _reasons(status: dict[str, Any]) -> dict[str, int]:
    """The reasons a follower's status counts resyncs for (0s left out)."""
    return {r: n for r, n in status["resync_reasons"].items() if n}


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers /v1/events/recent and /v1/keys from ``script`` (events carry their seq), and
    /v1/info with the script's ``role`` when it has one."""

    script: dict[str, Any]

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/v1/events/recent":
            after = int(query.get("after", 0))
            events = self.script["events"]
            last = events[-1]["seq"] if events else 0
            body: dict[str, Any] = {
                "events": [e for e in events if e["seq"] > after][: int(query["limit"])],
                "dropped": 0,
                "instance": self.script["instance"],
            }
            body["last_seq"] = body["events"][-1]["seq"] if body["events"] else min(after, last)
        elif url.path == "/v1/info" and "role" in self.script:
            body = {"role": self.script["role"]}
        elif url.path == "/v1/keys":
            self.script["listings"] = self.script.get("listings", 0) + 1
            # "next": a cursor the script fixes (a listing that does not advance)
            body = {"items": self.script["items"], "next": self.script.get("next")}
        else:
            self.send_error(404)
            return
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def scripted(script: dict[str, Any]) -> Iterator[str]:
    with serving(type("Scripted", (_Scripted,), {"script": script})) as url:
        yield url


@pytest.mark.parametrize(
    "kw",
    [
        {"node": ""},
        {"url": "ftp://127.0.0.1:1"},
        {"url": "127.0.0.1:8470"},
        {"drop_after_s": 0},
        {"drop_after_s": float("nan")},
        {"drop_after_s": True},
        {"page_limit": 0},
        {"page_limit": 10_001},
        {"page_limit": 10.0},
        {"timeout_s": -1.0},
    ],
)
def test_bad_arguments_are_refused(kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"node": "a", "url": "http://127.0.0.1:1", **kw}
    with pytest.raises(InvalidArgument):
        Follower(EmbeddedIndex(), args.pop("node"), args.pop("url"), **args)


@pytest.mark.parametrize("poll_s", [0, 1e300])
def test_followers_refuse_a_bad_poll_interval(poll_s: float) -> None:
    # 1e300 passed as finite, and the poll thread died at its first wait between rounds
    # (OverflowError: timestamp out of range), so the index followed no agent after one poll
    with pytest.raises(InvalidArgument, match="poll_s"):
        Followers(EmbeddedIndex(), poll_s=poll_s)


def test_malformed_events_and_listed_chunks_are_counted_and_skipped() -> None:
    script: dict[str, Any] = {
        "instance": "one",
        "events": [],
        "items": [_stored(K1), {"key": "zz", "tier": "cpu"}, {**_stored(K2), "tokens": "many"}],
    }
    index = EmbeddedIndex()
    with scripted(script) as url:
        follower = Follower(index, "a", url)
        assert follower.poll_once() == 1  # the resync: one good listed chunk
        assert index.nodes() == {"a": 1}
        script["events"] = [
            {"seq": 1, "type": "store", **_stored(K2)},
            {"seq": 2, "type": "store", "key": "not hex", "tier": "cpu"},
            {"seq": 3, "type": "fetch_plan", "fetch": 2},  # about something else: not counted
            {"seq": 4, "type": "evict", **_stored(K1)},
            {"seq": 5, "type": "store", **_stored(K3), "size_bytes": -1},
            {"seq": 6, "type": "move", **_stored(K2, "disk")},
        ]
        assert follower.poll_once() == 3
        status = follower.status()
    assert (status["malformed"], status["applied"], status["last_seq"]) == (4, 3, 6)
    assert index.holders([K1, K2, K3], tenant="t") == [[], [Holding("a", "disk", 64, 4)], []]


def test_counts_past_an_int64_are_malformed_not_a_route_that_fails() -> None:
    """JSON carries integers of any size: a chunk an agent lists or publishes with a size or a
    token count past any int64 (a buggy or hostile agent) is skipped and counted. Indexed, it
    failed every route over its key with OverflowError (the plan's bytes / bandwidth, its
    tokens' prefill seconds): a 500, and the router dropped the client's connection."""
    huge = 10**400
    script: dict[str, Any] = {
        "instance": "one",
        "events": [],
        "items": [
            {**_stored(K1, "disk"), "size_bytes": huge},
            {**_stored(K2), "tokens": huge},
            _stored(K3),
        ],
    }
    index = EmbeddedIndex()
    topology = Topology.build([Node("a", "fra"), Node("b", "fra")])
    router = Router(index, topology, Costs(PrefillModel(1e-4, 1e-9, "configured: test")))
    with scripted(script) as url:
        follower = Follower(index, "a", url)
        assert follower.poll_once() == 1  # the resync: the one chunk with sane counts
        script["events"] = [
            {"seq": 1, "type": "store", **_stored(K1), "size_bytes": 2**63},
            {"seq": 2, "type": "move", **_stored(K3, "disk"), "tokens": 2**63},
        ]
        assert follower.poll_once() == 0
        assert follower.status()["malformed"] == 4
    assert index.holders([K1, K2, K3], tenant="t") == [[], [], [Holding("a", "cpu", 64, 4)]]
    for k in (K1, K2, K3):
        assert router.route([k], tenant="t").node in ("a", "b")


def test_a_key_listing_that_does_not_advance_is_an_error_not_a_loop_for_ever() -> None:
    """An agent (or a cache in front of it that ignores the query) answering every page of
    /v1/keys with the same page and cursor must fail the resync, not hold the follower (and
    stop() waiting on it) for ever while its chunk list grows."""
    script: dict[str, Any] = {"instance": "one", "events": [], "items": [_stored(K1)]}
    script["next"] = K1.hex()
    index = EmbeddedIndex()
    with scripted(script) as url:
        follower = Follower(index, "a", url)
        done: list[int] = []
        poll = threading.Thread(target=lambda: done.append(follower.poll_once()), daemon=True)
        poll.start()
        poll.join(10)
        assert done == [0], "the resync did not end"
        status = follower.status()
        assert status["errors"] == 1 and "did not advance" in status["last_error"]
        script["next"] = None  # a listing that ends: the next poll resyncs
        assert follower.poll_once() == 1
    assert index.nodes() == {"a": 1}


def test_a_page_of_events_that_is_full_is_followed_by_another_read() -> None:
    script: dict[str, Any] = {"instance": "one", "events": [], "items": []}
    index = EmbeddedIndex()
    with scripted(script) as url:
        follower = Follower(index, "a", url, page_limit=2)
        follower.poll_once()
        keys = [bytes([i]) * 16 for i in range(1, 6)]
        script["events"] = [
            {"seq": i + 1, "type": "store", **_stored(k)} for i, k in enumerate(keys)
        ]
        assert follower.poll_once() == 5  # pages of 2, 2 and 1 in one poll
    assert index.nodes() == {"a": 5}


class _CountingChecks(EmbeddedIndex):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def check(self, node: str, *, cursor: int = 0, limit: int = 0) -> NodeCheck:
        self.checks += 1
        return super().check(node, cursor=cursor, limit=limit)


def test_a_poll_that_reads_many_pages_checks_the_index_once() -> None:
    """The index check (a script on a Redis server, auditing a slice of the node's entries) is
    one per poll, as its audit rate assumes, however many pages of events the poll reads."""
    script: dict[str, Any] = {"instance": "one", "events": [], "items": []}
    index = _CountingChecks()
    with scripted(script) as url:
        follower = Follower(index, "a", url, page_limit=2)
        follower.poll_once()  # the first resync
        script["events"] = [
            {"seq": i + 1, "type": "store", **_stored(bytes([i + 1]) * 16)} for i in range(9)
        ]
        assert follower.poll_once() == 9  # 5 pages
    assert index.checks == 1


def test_a_new_instance_replaces_what_the_old_one_held() -> None:
    script: dict[str, Any] = {"instance": "one", "events": [], "items": [_stored(K1)]}
    index = EmbeddedIndex()
    with scripted(script) as url:
        follower = Follower(index, "a", url)
        follower.poll_once()
        script.update(instance="two", items=[_stored(K2)])
        follower.poll_once()
        status = follower.status()
    assert index.holders([K1, K2], tenant="t") == [[], [Holding("a", "cpu", 64, 4)]]
    assert (status["resyncs"], status["instance"], status["gaps"]) == (2, "two", 0)
    assert _reasons(status) == {"first": 1, "agent_restarted": 1}


def test_not_an_agent_counts_as_silence_and_the_node_is_dropped_after_drop_after_s() -> None:
    now = [100.0]
    index = EmbeddedIndex()
    index.apply("a", [ChunkEvent("stored", K1, "cpu")])  # what it held when it last answered
    with web_page_url() as page:
        secret_url = page.replace("http://", "http://ops:hunter2@")
        follower = Follower(
            index, "a", secret_url, token="tok-123", drop_after_s=3.0, clock=lambda: now[0]
        )
        assert follower.poll_once() == 0
        now[0] += 2.9
        assert follower.poll_once() == 0
        assert index.nodes() == {"a": 1}  # silent, but not for drop_after_s yet
        now[0] += 0.2
        follower.poll_once()
        status = follower.status()
    assert index.nodes() == {}
    assert status["up"] is False and status["errors"] == 3 and status["last_ok_s"] is None
    assert "did not answer with JSON" in status["last_error"]
    shown = repr(status)
    assert "hunter2" not in shown and "tok-123" not in shown and "ops:" not in shown
    assert status["url"] == page


def test_adding_a_node_again_at_its_address_keeps_its_follower() -> None:
    script: dict[str, Any] = {"instance": "one", "events": [], "items": [_stored(K1)]}
    index = EmbeddedIndex()
    with scripted(script) as url:
        followers = Followers(index, {"a": (url, None)})
        followers.poll_all()
        followers.add("a", url + "/")  # the same agent: no resync
        followers.poll_all()
        [status] = followers.status()
        assert status["resyncs"] == 1
        followers.add("a", url, "another-token")  # another agent as far as we know: anew
        followers.poll_all()
        [status] = followers.status()
        assert status["resyncs"] == 1 and status["applied"] == 0  # a new follower's count
        followers.remove("a")
        followers.remove("a")  # removing twice is fine
        assert followers.status() == [] and index.nodes() == {}
        followers.close()


def test_two_adds_of_a_node_at_once_leave_one_follower_and_close_the_other() -> None:
    """The first add waits for the old follower's poll in progress (its lock) while a second
    add of the node finds no follower and puts its own in: the first then replaces that one,
    which must be closed, not left polling unfollowed."""
    script: dict[str, Any] = {"instance": "one", "events": [], "items": [_stored(K1)]}
    index = EmbeddedIndex()
    with scripted(script) as url:
        followers = Followers(index, {"a": (url, None)})
        followers.poll_all()
        old = followers._followers["a"]
        with old._lock:  # a poll of the old follower in progress
            first = threading.Thread(target=followers.add, args=("a", url, "token-1"))
            first.start()
            wait_until("the first add takes the old follower out", lambda: followers.nodes() == [])
            followers.add("a", url, "token-2")  # finds none: its follower goes in at once
            second = followers._followers["a"]
            assert not second._closed
        first.join(timeout=10)
        assert not first.is_alive()
        assert followers.nodes() == ["a"]
        winner = followers._followers["a"]
        assert winner is not second and winner.follows(url, "token-1") and not winner._closed
        assert second._closed and old._closed
        followers.poll_all()
        assert followers.up_nodes() == frozenset({"a"})
        followers.close()


class _Flaky(EmbeddedIndex):
    """An index that fails with IndexUnavailable while ``failing`` (a Redis outage), and says
    whether it is shared."""

    def __init__(self, *, shared: bool = False) -> None:
        super().__init__()
        self.shared = shared  # type: ignore[misc]
        self.failing = False

    def _check(self) -> None:
        if self.failing:
            raise IndexUnavailable("index at redis://127.0.0.1:1/0: connection refused")

    def apply(self, node: str, events: Any) -> int:
        self._check()
        return super().apply(node, events)

    def replace(self, node: str, chunks: Any) -> int:
        self._check()
        return super().replace(node, chunks)

    def drop(self, node: str) -> int:
        self._check()
        return super().drop(node)

    def marker(self, node: str) -> str | None:
        self._check()
        return super().marker(node)

    def nodes(self) -> dict[str, int]:
        self._check()
        return super().nodes()

    def holders(self, keys: Any, *, tenant: str) -> list[list[Holding]]:
        self._check()
        return super().holders(keys, tenant=tenant)


def test_a_node_whose_entries_the_index_lost_is_resynced_at_the_next_poll() -> None:
    script: dict[str, Any] = {"instance": "one", "events": [], "items": [_stored(K1)]}
    index = EmbeddedIndex()
    with scripted(script) as url:
        follower = Follower(index, "a", url)
        follower.poll_once()
        follower.poll_once()  # nothing new: no resync
        assert follower.status()["resyncs"] == 1
        index.drop("a")  # what a Redis restarted empty (or flushed) does to the node
        assert follower.poll_once() == 1
        status = follower.status()
    assert index.nodes() == {"a": 1}
    assert (status["resyncs"], status["index_lost"]) == (2, 1)
    assert _reasons(status) == {"first": 1, "index_lost": 1}


def test_an_index_outage_is_not_the_agents_and_every_node_resyncs_when_it_is_back() -> None:
    now = [100.0]
    script: dict[str, Any] = {"instance": "one", "events": [], "items": [_stored(K1)]}
    index = _Flaky()
    with scripted(script) as url:
        follower = Follower(index, "a", url, drop_after_s=3.0, clock=lambda: now[0])
        follower.poll_once()
        index.failing = True
        for _ in range(5):  # well past drop_after_s: the agent answers all along
            now[0] += 1.0
            assert follower.poll_once() == 0
        status = follower.status()
        assert status["up"] is True and status["errors"] == 0 and status["entries"] is None
        assert status["index_errors"] == 5 and "connection refused" in status["index_error"]
        # what the outage lost (a Redis back empty), and what the agent stored meanwhile
        index.failing = False
        index.drop("a")
        index.replace("other", [])  # another node's marker is no business of "a"'s
        script["items"] = [_stored(K1), _stored(K2)]
        script["events"] = [{"seq": 1, "type": "store", **_stored(K2)}]
        follower.poll_once()
        status = follower.status()
    assert index.holders([K1, K2], tenant="t") == [[Holding("a", "cpu", 64, 4)]] * 2
    assert status["resyncs"] == 2 and status["up"] is True
    assert _reasons(status) == {"first": 1, "index_back": 1}


def test_a_shared_index_keeps_a_down_agents_entries_and_a_private_one_drops_them() -> None:
    """Down is this router's view: with a shared index another router may reach the agent."""
    topology = Topology.build([Node("a", "fra"), Node("b", "fra")])
    for shared in (True, False):
        index = _Flaky(shared=shared)
        index.replace("b", [ChunkEvent("stored", K1, "cpu", "t", False, 64, 4)])
        followers = Followers(index, drop_after_s=0.05)
        followers.add("b", f"http://127.0.0.1:{closed_port()}")
        followers.poll_all()
        time.sleep(0.1)
        followers.poll_all()
        [status] = followers.status()
        assert status["up"] is False and followers.down_nodes() == {"b"}
        assert status["drops_when_down"] is (not shared)
        assert index.nodes() == ({"b": 1} if shared else {}), shared
        # either way this router neither answers nor pulls from the node it cannot reach
        router = Router(
            index, topology, Costs(PrefillModel(1e-4, 0.0, "configured: test")), followers=followers
        )
        assert router.holders([K1], tenant="t") == [[]]
        followers.close()


class _ReplaceFails(EmbeddedIndex):
    """An index whose replace fails while ``failing`` (a replace the server runs for longer than
    its client waits), every other call answering; counts the replaces sent."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = True
        self.sent_s: list[float] = []
        self.clock = [100.0]

    def replace(self, node: str, chunks: Any) -> int:
        self.sent_s.append(self.clock[0])
        if self.failing:
            raise IndexUnavailable("index at redis://127.0.0.1:1/0: Timeout reading from socket")
        return super().replace(node, chunks)


def test_a_replace_that_keeps_failing_is_sent_again_less_and_less_often() -> None:
    """Resent at every poll (0.2 s), a replace longer than the index client's timeout held the
    server for its whole length at each try, for ever: a failed replace waits 1 s, then twice as
    long each time (up to 30 s); one done resets the wait."""
    index = _ReplaceFails()
    now = index.clock
    script: dict[str, Any] = {"instance": "one", "events": [], "items": [_stored(K1)]}
    with scripted(script) as url:
        follower = Follower(index, "a", url, drop_after_s=60.0, clock=lambda: now[0])
        for _ in range(50):  # 10 s of polls every 0.2 s
            follower.poll_once()
            now[0] = round(now[0] + 0.2, 1)
        assert index.sent_s == [100.0, 101.0, 103.0, 107.0]
        now[0] = 200.0
        index.failing = False
        follower.poll_once()
        assert index.nodes() == {"a": 1}
        index.failing = True
        index.drop("a")  # lost again: resynced at once (the wait was reset), then 1 s after
        sent = len(index.sent_s)
        for _ in range(6):
            now[0] = round(now[0] + 0.2, 1)
            follower.poll_once()
        assert index.sent_s[sent:] == [200.2, 201.2]


def test_an_agent_that_goes_down_while_a_failed_replace_waits_is_marked_down_in_time() -> None:
    """The wait after a failed replace (up to 30 s) skipped the whole poll, the agent's too: an
    agent gone meanwhile stayed up (routed to, its copies answered) for the rest of the wait,
    far past drop_after_s. The replace still waits; the agent is still asked whether it
    answers, so it is marked down drop_after_s after its last answer."""
    index = _ReplaceFails()
    now = index.clock
    script: dict[str, Any] = {"instance": "one", "events": [], "items": [_stored(K1)]}
    with scripted(script) as url:
        follower = Follower(index, "a", url, drop_after_s=3.0, clock=lambda: now[0])
        for _ in range(50):  # replaces at 100, 101, 103, 107; the next one waits until 115
            follower.poll_once()
            now[0] = round(now[0] + 0.2, 1)
        assert follower.up
    gone_s = now[0]  # the agent is gone from here on
    while now[0] < gone_s + 4.0:
        follower.poll_once()
        now[0] = round(now[0] + 0.2, 1)
    assert follower.down
    assert follower.status()["up"] is False
    assert index.sent_s == [100.0, 101.0, 103.0, 107.0]  # still no replace sent meanwhile
    follower.close()


def test_an_agent_restarted_as_a_pool_agent_while_a_failed_replace_waits_is_known_as_one() -> None:
    """While a failed replace waits (up to 30 s) the agent is only asked whether it answers, and
    called up: one restarted meanwhile with --role pool at the same URL (a new event stream)
    was called up with its old role, and routed requests until the wait was over. Its role is
    read from that answer's stream too, before it is called up."""
    index = _ReplaceFails()
    now = index.clock
    script: dict[str, Any] = {
        "instance": "one",
        "events": [],
        "items": [_stored(K1)],
        "role": "node",
    }
    with scripted(script) as url:
        follower = Follower(index, "a", url, drop_after_s=60.0, clock=lambda: now[0])
        follower.poll_once()  # its role read, then the replace fails: waits 1 s
        assert follower.role == "node" and index.sent_s == [100.0]
        script.update(instance="two", role="pool")  # restarted as a pool agent
        now[0] = 100.2
        follower.poll_once()
        assert index.sent_s == [100.0]  # still waiting: no replace sent
        assert follower.up and follower.role == "pool"
        follower.close()


def test_a_role_read_that_failed_is_asked_again_within_seconds_then_less_often() -> None:
    """The agent's events answered but its /v1/info did not (a timeout at the router's start):
    the agent was called up with its role unknown, so a pool agent was routed requests, and
    its role was asked again only 30 s later. It is asked again 1 s later, then twice as long
    each time (up to 30 s), and no more once read."""
    index = EmbeddedIndex()
    now = [100.0]
    script: dict[str, Any] = {"instance": "one", "events": [], "items": []}
    asked_s: list[float] = []

    class _Counting(_Scripted):
        def do_GET(self) -> None:
            if self.path.startswith("/v1/info"):
                asked_s.append(now[0])
            super().do_GET()

    with serving(type("Scripted", (_Counting,), {"script": script})) as url:
        follower = Follower(index, "a", url, drop_after_s=60.0, clock=lambda: now[0])
        for _ in range(20):  # 4 s of polls every 0.2 s: /v1/info answers 404
            follower.poll_once()
            now[0] = round(now[0] + 0.2, 1)
        assert follower.up and follower.role is None
        assert asked_s == [100.0, 101.0, 103.0]
        script["role"] = "pool"  # /v1/info answers now
        while follower.role is None and now[0] < 200.0:
            follower.poll_once()
            now[0] = round(now[0] + 0.2, 1)
        assert follower.role == "pool" and asked_s[-1] == 107.0
        for _ in range(20):
            follower.poll_once()
            now[0] = round(now[0] + 0.2, 1)
        assert len(asked_s) == 4  # read: not asked again for this stream
        follower.close()


def test_a_role_read_that_keeps_failing_is_logged_once_and_shown_in_the_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A role read that kept failing (a token without access to /v1/info) was asked again
    every 30 s for ever, logged at debug only, and the status showed the role as it was and no
    error, while the agent was routed requests (a pool agent among them). The status says why
    (``role_error``) from the first failure; a warning after 3 in a row, once; info when read."""
    index = EmbeddedIndex()
    now = [100.0]
    script: dict[str, Any] = {"instance": "one", "events": [], "items": []}
    warnings: list[str] = []

    def poll_until(s: float) -> None:
        while now[0] < s:
            follower.poll_once()
            now[0] = round(now[0] + 0.2, 1)
            warnings[:] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    with scripted(script) as url, caplog.at_level(logging.INFO, logger="kvctl.index.follower"):
        follower = Follower(index, "a", url, drop_after_s=60.0, clock=lambda: now[0])
        poll_until(102.0)  # asked at 100 and 101: /v1/info answers 404
        status = follower.status()
        assert status["up"] and status["role"] is None
        assert "404" in status["role_error"], status
        assert warnings == []
        poll_until(120.0)  # asked again at 103 (the third), 107, 115: one warning
        assert len(warnings) == 1, warnings
        assert "3 times in a row" in warnings[0] and "token" in warnings[0], warnings
        assert "/v1/info" in warnings[0] and "404" in warnings[0], warnings
        script["role"] = "node"  # /v1/info answers now (asked at 131)
        poll_until(140.0)
        assert follower.role == "node" and follower.status()["role_error"] is None
        infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
        assert any("role read again" in m for m in infos), infos
        assert len(warnings) == 1
        follower.close()


@pytest.mark.parametrize(
    ("given", "token"),
    [
        (True, "tok-given-123"),
        (False, "tok-from-env-123"),
        # the answer's quote is cut at 80 characters, in the token: its head was shown
        (True, "tok-" + "0123456789abcdef" * 4),
    ],
)
def test_a_token_an_error_answer_echoes_is_kept_out_of_the_status_and_the_log(
    given: bool, token: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An answer that echoes the request's Authorization header (a proxy's error page in front
    of the agent) had the agent token in role_error (kvctl router status, for anyone with the
    router's token) and in the warning logged after 3 failed role reads, and in last_error when
    the events were refused so. ``given``: the router's token for the agent, else KVCTL_TOKEN
    (what the client sends without one)."""
    monkeypatch.setenv("KVCTL_TOKEN", "" if given else token)
    now = [100.0]
    script: dict[str, Any] = {"instance": "one", "events": [], "items": []}

    class _Echoing(_Scripted):
        def do_GET(self) -> None:
            if self.path.startswith("/v1/info") or script.get("refuse_events"):
                send(
                    self,
                    f"bad header: {self.headers['Authorization']}".encode(),
                    status=400,
                    content_type="text/plain",
                )
                return
            super().do_GET()

    with (
        serving(type("Scripted", (_Echoing,), {"script": script})) as url,
        caplog.at_level(logging.DEBUG, logger="kvctl.index.follower"),
    ):
        follower = Follower(
            EmbeddedIndex(),
            "a",
            url,
            token=token if given else None,
            drop_after_s=60.0,
            clock=lambda: now[0],
        )
        while now[0] < 104.0:  # role asked at 100, 101 and 103: a warning
            follower.poll_once()
            now[0] = round(now[0] + 0.2, 1)
        script["refuse_events"] = True
        follower.poll_once()
        status = follower.status()
        follower.close()
    assert "bad header: Bearer" in status["role_error"], status  # the answer is still quoted
    assert "bad header: Bearer" in status["last_error"], status
    assert any(r.levelname == "WARNING" for r in caplog.records)
    logged = [r.getMessage() for r in caplog.records]
    head = token[:8]  # of the token, at most 7 characters are shown
    assert head not in repr(status) and not any(head in m for m in logged), (status, logged)


def _wait_for(cond: Any, what: str, within_s: float = 30.0) -> None:
    stop = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < stop, f"not within {within_s} s: {what}"
        time.sleep(0.02)


def test_an_agent_trickling_its_answer_is_down_after_drop_after_s_and_its_poll_gives_up() -> None:
    """An agent that answered, then trickles its events answer a byte every 50 ms (each well
    within the read timeout) for 8 s before a valid answer: once it has been silent for
    drop_after_s on the follower's clock it is down while its poll is still in flight, and the
    poll gives up at its deadline (a failure, the node marked down and its entries dropped).
    Before, the follower called it up for as long as the poll ran, and the poll took the answer
    after 8 s as if nothing had happened."""
    hostile = Hostile()
    trickling = threading.Event()

    def answer(handler: http.server.BaseHTTPRequestHandler, path: str) -> bool:
        if path == "/v1/keys":
            body = {"items": [_stored(K1)], "next": None}
            return send_json(handler, json.dumps(body).encode())
        events = {"events": [], "last_seq": 0, "dropped": 0, "instance": "i1"}
        if trickling.is_set():
            return trickle(handler, json.dumps(events).encode(), seconds=8.0)
        return send_json(handler, json.dumps(events).encode())

    now = [100.0]
    index = EmbeddedIndex()
    with serving(handler_class(hostile, answer)) as url:
        follower = Follower(index, "a", url, drop_after_s=3.0, timeout_s=0.5, clock=lambda: now[0])
        follower.poll_once()
        assert follower.up and index.nodes() == {"a": 1}
        trickling.set()
        polls: list[int] = []
        poll = threading.Thread(target=lambda: polls.append(follower.poll_once()))
        asked = hostile.requests.get("/v1/events/recent", 0)
        poll.start()
        try:
            _wait_for(lambda: hostile.requests.get("/v1/events/recent", 0) > asked, "polled")
            now[0] += 3.5
            assert poll.is_alive()  # its answer is still coming
            assert not follower.up and follower.down
            assert follower.status()["up"] is False
        finally:
            poll.join(60)
        assert polls == [0]
        status = follower.status()
        assert status["errors"] == 1 and "no whole answer within 2 s" in status["last_error"]
        # said as the agent not answering in time, not as one that cannot be reached (before:
        # "cannot reach the agent ... is it running?")
        assert "took the connection but did not answer in time" in status["last_error"]
        assert "cannot reach" not in status["last_error"]
        assert index.nodes() == {}  # marked down by the failed poll: its entries dropped
        follower.close()


def test_a_healthy_agent_whose_poll_waits_for_a_thread_stays_up() -> None:
    """Only a request in flight is the agent's silence: a poll that waits in the pool behind
    other agents' hung polls (16 threads; 128 hung agents did it in a review's run), or the
    time the index takes, is not. Before, up meant "answered less than drop_after_s ago",
    so every healthy node went down while the pool was busy and routing stopped."""
    now = [100.0]
    index = EmbeddedIndex()
    script: dict[str, Any] = {"instance": "one", "events": [], "items": [_stored(K1)]}
    with scripted(script) as url:
        follower = Follower(index, "a", url, drop_after_s=3.0, clock=lambda: now[0])
        follower.poll_once()
        assert follower.up
        now[0] += 30.0  # no poll of this agent ran meanwhile: none was in flight
        assert follower.up and not follower.down
        assert follower.status()["up"] is True
        follower.poll_once()
        assert follower.up
        follower.close()


def test_an_agent_listing_without_end_is_failed_past_max_listing_chunks() -> None:
    """An agent whose /v1/keys pages never end (each a full page, its cursor advancing): the
    resync stops past max_listing_chunks, the poll failed with that reason and nothing
    written; before, it read on for as long as the agent listed (the review's router grew
    ~50 MB/s)."""
    hostile = Hostile()
    events = {"events": [], "last_seq": 0, "dropped": 0, "instance": "i1"}

    def answer(handler: http.server.BaseHTTPRequestHandler, path: str) -> bool:
        if path != "/v1/keys":
            return send_json(handler, json.dumps(events).encode())
        query = parse_qs(urlsplit(handler.path).query)
        start = int(query["after"][0], 16) + 1 if "after" in query else 0
        if start > 10**6:  # a bound for the test's sake: far past where the cap stops it
            return send_json(handler, b'{"items": [], "next": null}')
        items = [_stored((start + i).to_bytes(16, "big")) for i in range(10_000)]
        page = {"items": items, "next": items[-1]["key"]}
        return send_json(handler, json.dumps(page).encode())

    index = EmbeddedIndex()
    with serving(handler_class(hostile, answer)) as url:
        follower = Follower(index, "a", url, max_listing_chunks=25_000)
        assert follower.poll_once() == 0
        status = follower.status()
        follower.close()
    assert status["errors"] == 1 and status["resyncs"] == 0
    assert "listed over 25,000 chunks (max_listing_chunks)" in status["last_error"]
    assert hostile.requests["/v1/keys"] == 3
    assert index.nodes() == {}


def test_an_events_answer_too_long_fails_the_poll_unread() -> None:
    """An events answer of 3 MiB (300,000 'events' that are not, as the review's giant agent
    sent): over the 1 MiB an events page of 1000 may take, so the poll fails saying so and
    nothing of it is read (before, it was parsed whole and each bad event counted)."""
    hostile = Hostile()
    giant = json.dumps(
        {"events": [0] * 300_000 + [" " * (2 << 20)], "last_seq": 9, "dropped": 0, "instance": "i1"}
    ).encode()

    def answer(handler: http.server.BaseHTTPRequestHandler, path: str) -> bool:
        if path == "/v1/keys":
            return send_json(handler, b'{"items": [], "next": null}')
        query = parse_qs(urlsplit(handler.path).query)
        if int(query["after"][0]) >= 2**62:  # the resync's look at the newest seq
            small = {"events": [], "last_seq": 0, "dropped": 0, "instance": "i1"}
            return send_json(handler, json.dumps(small).encode())
        return send_json(handler, giant)

    with serving(handler_class(hostile, answer)) as url:
        follower = Follower(EmbeddedIndex(), "a", url)
        follower.poll_once()
        status = follower.status()
        follower.close()
    assert status["malformed"] == 0 and status["errors"] == 1
    assert "/v1/events/recent: answer of" in status["last_error"]
    assert "over the 1,048,576 taken" in status["last_error"]


def test_a_round_under_way_when_stop_is_called_leaves_no_poll_thread_behind() -> None:
    """stop() takes both pools, then waits for the round thread; a round that had begun before
    stop() took them made a new pool (the agent answering or not) and polled on it: that pool
    was shut by no one, its threads left running after stop() and close(), polling a router
    that had stopped. The round is held at its start here until stop() has taken the pools."""
    entered, release = threading.Event(), threading.Event()

    class HeldRound(Followers):
        def _poll_round(self, *args: Any) -> None:
            entered.set()
            release.wait(10)
            super()._poll_round(*args)

    before = {t.ident for t in threading.enumerate()}
    followers = HeldRound(EmbeddedIndex(), {"a": (f"http://127.0.0.1:{closed_port()}", None)})
    followers.start()
    try:
        assert entered.wait(10)
        stopper = threading.Thread(target=followers.stop)
        stopper.start()
        deadline_s = time.monotonic() + 10
        while not followers._stop.is_set():  # stop() has taken the pools
            assert time.monotonic() < deadline_s
            time.sleep(0.01)
        release.set()
        stopper.join(10)
        assert not stopper.is_alive()
        left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        assert left == []
    finally:
        release.set()
        followers.close()


def test_a_poll_of_every_agent_that_stop_cuts_short_ends_quietly() -> None:
    """stop() shuts the pools (DaemonPool.shutdown cancels the polls not started) while
    poll_all waits for its polls: poll_all raised CancelledError from the cancelled ones
    (found by a review). Every thread is held at a gate, one more poll queued behind them,
    until stop() has run; the poll then ends with the changes of the polls that ran."""
    from kvctl.index.follower import MAX_POLL_THREADS

    entered, release = threading.Semaphore(0), threading.Event()
    port = closed_port()
    agents = {f"n{i}": (f"http://127.0.0.1:{port}", None) for i in range(MAX_POLL_THREADS + 1)}
    # a round's wait for a thread (overflow) far past the test: the last poll stays queued
    followers = Followers(EmbeddedIndex(), agents, poll_s=3600.0, drop_after_s=3600.0)
    for follower in followers._followers.values():

        def held(follower: Follower = follower) -> int:
            entered.release()
            release.wait(30)
            return 1

        follower.poll_once = held  # type: ignore[method-assign]
    out: list[object] = []
    poller = threading.Thread(target=lambda: out.append(_outcome(followers.poll_all)))
    poller.start()
    try:
        for _ in range(MAX_POLL_THREADS):  # every thread holds a poll; the last one waits
            assert entered.acquire(timeout=10)
        pool = followers._pool
        assert pool is not None
        deadline_s = time.monotonic() + 10
        while pool.queued < 1:  # the last poll submitted, waiting for a thread
            assert time.monotonic() < deadline_s
            time.sleep(0.01)
        followers.stop()  # cancels the queued poll
        release.set()
        poller.join(10)
        assert not poller.is_alive()
        assert out == [MAX_POLL_THREADS]  # the polls that ran; the cancelled one, none
    finally:
        release.set()
        followers.close()


def _outcome(call: Any) -> object:
    try:
        return call()
    except BaseException as exc:
        return exc


class _SeqPastAny(_Scripted):
    """``_Scripted``, answering ``last_seq`` past an int64 while ``script["broken"]``, and
    refusing a cursor past it as an agent does (422: its ``after`` is at most 2**63 - 1)."""

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/v1/events/recent" and int(query.get("after", 0)) > 2**63 - 1:
            self.send_error(422)
            return
        if url.path == "/v1/events/recent" and self.script.get("broken"):
            data = json.dumps(
                {"events": [], "last_seq": 2**64, "dropped": 0, "instance": "i"}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        super().do_GET()


def test_an_events_answer_past_any_seq_does_not_wedge_the_follower() -> None:
    """An agent answered last_seq 2**64 once (broken): the follower took it as its cursor,
    and every later read asked for events after it, which the agent refuses (422): the node
    was down for good, its new chunks never indexed, until the router restarted (found by a
    review). Such an answer is no events answer: the cursor stays, and the next poll reads on."""
    script: dict[str, Any] = {"events": [], "items": [], "instance": "i", "broken": True}
    index = EmbeddedIndex()
    with serving(type("SeqPastAny", (_SeqPastAny,), {"script": script})) as url:
        follower = Follower(index, "a", url)
        try:
            follower.poll_once()
            script["broken"] = False
            follower.poll_once()  # (a resync: nothing listed yet)
            script["events"] = [
                {"seq": 1, "type": "store", **_stored(K1)},
                {"seq": 2, "type": "store", **_stored(K2)},
            ]
            follower.poll_once()
            assert index.nodes() == {"a": 2}
            assert follower.status()["up"] is True
        finally:
            follower.close()


# --- the node sets a routing decision asks for ------------------------------------------------


def _by_pass(followers: Followers) -> tuple[frozenset[str], ...]:
    """(up, down, pool nodes) as a pass over every follower makes them: their definition, which
    ``Followers`` answered with before it kept them as the followers' state changes."""
    with followers._lock:
        each = dict(followers._followers)
    return (
        frozenset(n for n, f in each.items() if f.up),
        frozenset(n for n, f in each.items() if f.down),
        frozenset(n for n, f in each.items() if f.role == POOL_ROLE),
    )


def _asking(followers: Followers, nodes: str) -> bool:
    """Whether a request to any of ``nodes`` (one letter each) is in flight."""
    with followers._lock:
        each = dict(followers._followers)
    return any(each[n]._asking_since_s is not None for n in nodes)


def _kept(followers: Followers) -> tuple[frozenset[str], ...]:
    return followers.up_nodes(), followers.down_nodes(), followers.pool_nodes()


def _sets_are(followers: Followers, up: str, down: str, pool: str) -> None:
    """The kept sets are the pass's, and these (node names of one letter each)."""
    kept = _kept(followers)
    assert kept == _by_pass(followers)
    assert kept == (frozenset(up), frozenset(down), frozenset(pool))


class _Held(_Scripted):
    """``_Scripted``, holding an events answer while ``script["hold"]`` (an Event) is unset
    (``script["held"]``: the answers held so far)."""

    def do_GET(self) -> None:
        hold = self.script.get("hold")
        if hold is not None and self.path.startswith("/v1/events/recent"):
            self.script["held"] = self.script.get("held", 0) + 1
            hold.wait(60)
        super().do_GET()


def _agent_at(port: int, script: dict[str, Any]) -> http.server.ThreadingHTTPServer:
    """A scripted agent listening on ``port`` (0: any) until its ``shutdown``."""
    handler = type("Held", (_Held,), {"script": script})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _url(server: http.server.ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def _stop(server: http.server.ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()  # its port refuses connections from now on


def test_the_node_sets_follow_each_change_of_a_followers_state() -> None:
    """``up_nodes``, ``down_nodes`` and ``pool_nodes`` were a pass over every follower per
    call (three per routed request); they are kept as each follower's state changes. Through
    every change (first answer, refused, back, restarted with another role, removed, replaced,
    a request in flight for drop_after_s and its answer, close) they are what a pass over the
    followers gives."""

    def script(instance: str, role: str) -> dict[str, Any]:
        return {"instance": instance, "events": [], "items": [], "role": role}

    scripts = {"a": script("a1", "node"), "b": script("b1", "node"), "p": script("p1", "pool")}
    scripts["d"] = script("d1", "node")
    servers = {n: _agent_at(0, scripts[n]) for n in "abp"}
    d_port = closed_port()
    agents = {n: (_url(s), None) for n, s in servers.items()}
    agents["d"] = (f"http://127.0.0.1:{d_port}", None)
    # long request timeouts: a held request is the agent's silence, not a timed-out poll
    followers = Followers(EmbeddedIndex(), agents, drop_after_s=1.0, timeout_s=30.0)
    polls: list[threading.Thread] = []
    try:
        _sets_are(followers, up="", down="", pool="")  # none heard from yet
        followers.poll_all()
        _sets_are(followers, up="abp", down="d", pool="p")  # d refused: nothing listens
        servers["d"] = _agent_at(d_port, scripts["d"])
        followers.poll_all()
        _sets_are(followers, up="abpd", down="", pool="p")  # d answers
        _stop(servers.pop("a"))
        followers.poll_all()
        _sets_are(followers, up="bpd", down="a", pool="p")  # a refused
        scripts["p"].update(instance="p2", role="node")  # restarted with another role
        scripts["b"].update(instance="b2", role="pool")
        followers.poll_all()
        _sets_are(followers, up="bpd", down="a", pool="b")
        followers.remove("a")
        _sets_are(followers, up="bpd", down="", pool="b")
        servers["B"] = _agent_at(0, script("B1", "node"))
        followers.add("b", _url(servers["B"]))  # another agent: a new follower, not heard yet
        _sets_are(followers, up="pd", down="", pool="")
        followers.poll_all()
        _sets_are(followers, up="bpd", down="", pool="")
        hold = scripts["d"]["hold"] = threading.Event()
        polls.append(threading.Thread(target=followers.poll_all))
        polls[-1].start()
        # (kept a request in flight for drop_after_s: down, no longer up). b's and p's polls
        # of this round ended first: one slower than drop_after_s (a loaded host) has them
        # down while in flight, and one in flight may pass it between the sets and the pass
        wait_until(
            "d's request in flight for drop_after_s, b's and p's answered",
            lambda: "d" in followers.down_nodes() and not _asking(followers, "bp"),
        )
        _sets_are(followers, up="bp", down="d", pool="")
        hold.set()
        polls[-1].join(60)
        _sets_are(followers, up="bpd", down="", pool="")  # it answered
        # d replaced while its poll is held: add() waits for it, d followed by none meanwhile
        hold = scripts["d"]["hold"] = threading.Event()
        polls.append(threading.Thread(target=followers.poll_all))
        polls[-1].start()
        wait_until(  # (b's and p's polls of this round ended: see above)
            "d's poll held, b's and p's answered",
            lambda: scripts["d"].get("held") == 2 and not _asking(followers, "bp"),
        )
        servers["D"] = _agent_at(0, script("D1", "node"))
        polls.append(threading.Thread(target=followers.add, args=("d", _url(servers["D"]))))
        polls[-1].start()
        wait_until("d no longer followed", lambda: "d" not in followers.nodes())
        _sets_are(followers, up="bp", down="", pool="")
        hold.set()  # the old follower's poll ends: it answered, and is followed no longer
        for poll in polls[-2:]:
            poll.join(60)
        _sets_are(followers, up="bp", down="", pool="")
        followers.poll_all()
        _sets_are(followers, up="bpd", down="", pool="")
        followers.close()
        _sets_are(followers, up="bpd", down="", pool="")  # close keeps the state as it was
    finally:
        for s in scripts.values():
            if s.get("hold") is not None:
                s["hold"].set()
        for poll in polls:
            poll.join(60)
        followers.close()
        for server in servers.values():
            _stop(server)


@pytest.mark.parametrize("seed", range(4))
def test_the_node_sets_are_a_pass_over_the_followers_after_any_change(seed: int) -> None:
    """Random changes of the followers' state as their polls make them (called up or down,
    a role read, a request sent and answered, time passing a request's drop_after_s), nodes
    added, removed and replaced, and a follower no longer followed still changing: after each,
    the kept sets are what a pass over the followers gives. The followers share one clock (as
    they do in a router: the monotonic clock), stepped by the test."""
    rng = random.Random(seed)
    now = [100.0]
    nodes = [f"n{i}" for i in range(12)]
    followers = Followers(EmbeddedIndex(), drop_after_s=3.0)
    gone: list[Follower] = []

    def follow(node: str) -> None:
        followers.add(node, f"http://127.0.0.1:1/{rng.randrange(3)}")  # maybe a new follower
        followers._followers[node]._clock = lambda: now[0]

    for node in nodes:
        follow(node)
    for _ in range(1500):
        node = rng.choice(nodes)
        f = followers._followers.get(node)
        if f is None or rng.random() < 0.05:
            f = rng.choice(gone) if gone and rng.random() < 0.3 else f
        op = rng.randrange(8)
        if f is None or op == 0:
            if node in followers._followers and rng.random() < 0.5:
                gone.append(followers._followers[node])
                followers.remove(node)
            else:
                follow(node)
        elif op == 1:
            f._up = rng.choice([None, True, False])
        elif op == 2:
            f.role = rng.choice([None, "node", POOL_ROLE])
        elif op in (3, 4):
            f._set_asking(rng.random() < 0.6)
        else:
            now[0] += rng.choice([0.0, 0.5, 1.0, 2.9, 3.0, 5.0])
        asked = [followers.up_nodes, followers.down_nodes, followers.pool_nodes]
        rng.shuffle(asked)  # each may be the first asked since a request's drop_after_s passed
        answers = {ask.__name__: ask() for ask in asked}
        kept = tuple(answers[n] for n in ("up_nodes", "down_nodes", "pool_nodes"))
        assert kept == _by_pass(followers)
    followers.close()
