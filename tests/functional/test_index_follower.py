"""Followers keep the fleet index in step with real agent processes: chunks put on an agent show
up under its node name with their tier, size, tokens and tenant; moves and evictions follow; a
killed agent's entries are dropped; a restarted agent (a new event stream) and one whose event
buffer overflowed are resynced from its key listing; an isolated tenant's chunks never reach
another tenant through the index."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.index import follower as follower_module
from kvctl.index.follower import MAX_POLL_THREADS, Follower, Followers
from kvctl.index.model import EmbeddedIndex, Holding
from tests.functional.agents import Agent, closed_port, key, payload, running_agent, start_agent
from tests.functional.waiting import wait_until

CHUNK_BYTES = 4096
TOKENS = 16
SMALL = ["--cpu", "8MiB", "--disk", "0"]


def put(agent: Agent, keys: list[bytes], *, tenant: str = "t1", isolated: bool = False) -> None:
    with agent.data() as d:
        for i in range(0, len(keys), 500):
            part = keys[i : i + 500]
            outs = d.put_many(
                [(k, payload(k, CHUNK_BYTES)) for k in part],
                tenant=tenant,
                tokens=TOKENS,
                isolated=isolated,
            )
            assert {o.status for o in outs} == {"stored"}


def listing(agent: Agent) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        page = agent.control().keys(limit=1000, after=after)
        items += page["items"]
        after = page["next"]
        if not after:
            return items


def matches_listing(index: EmbeddedIndex, node: str, agent: Agent) -> bool:
    """Whether the index holds exactly the agent's listing for ``node`` (tier, size, tokens),
    each chunk seen by its own tenant."""
    items = listing(agent)
    if index.nodes().get(node, 0) != len(items):
        return False
    for item in items:
        [held] = index.holders([bytes.fromhex(item["key"])], tenant=item["tenant"])
        want = Holding(node, item["tier"], item["size_bytes"], item["tokens"])
        if want not in held:
            return False
    return True


def held_by(index: EmbeddedIndex, keys: list[bytes], tenant: str = "t1") -> list[list[Holding]]:
    return index.holders(keys, tenant=tenant)


@pytest.fixture
def index() -> Iterator[EmbeddedIndex]:
    idx = EmbeddedIndex()
    yield idx
    idx.close()


def test_chunks_put_on_an_agent_reach_the_index_under_its_node(
    tmp_path: Path, index: EmbeddedIndex, caplog: pytest.LogCaptureFixture
) -> None:
    token = "s3cret-follower-token"
    a_keys = [key(i, space=1) for i in range(40)]
    b_keys = [key(i, space=2) for i in range(10)]
    with (
        running_agent(tmp_path / "a", "--name", "a", *SMALL, token=token) as a,
        running_agent(tmp_path / "b", "--name", "b", *SMALL) as b,
        caplog.at_level(logging.DEBUG, logger="kvctl.index.follower"),
    ):
        put(b, b_keys, tenant="t2")  # before following: comes from b's listing
        followers = Followers(
            index,
            {"a": (a.state.control_url, token), "b": (b.state.control_url, None)},
            poll_s=0.05,
        )
        try:
            followers.poll_all()  # first contact: both resynced, a from an empty listing
            assert index.nodes() == {"b": len(b_keys)}
            followers.start()
            put(a, a_keys)  # while following: comes from a's events
            want = [[Holding("a", "cpu", CHUNK_BYTES, TOKENS)]] * len(a_keys)
            wait_until("a's chunks in the index", lambda: held_by(index, a_keys) == want)
            want_b = [[Holding("b", "cpu", CHUNK_BYTES, TOKENS)]] * len(b_keys)
            assert held_by(index, b_keys, tenant="t2") == want_b
            assert index.nodes() == {"a": len(a_keys), "b": len(b_keys)}
            status = {s["node"]: s for s in followers.status()}
            assert status["a"]["up"] and status["b"]["up"]
            assert status["a"]["applied"] >= len(a_keys)
            assert status["a"]["entries"] == len(a_keys)
            assert status["a"]["resyncs"] == 1 and status["a"]["errors"] == 0
            assert status["a"]["instance"] == a.control().events(limit=1)["instance"]
            assert token not in repr(followers.status())

            # removing a node forgets it; adding it again brings its chunks back
            followers.remove("b")
            assert index.nodes() == {"a": len(a_keys)}
            followers.add("b", b.state.control_url)
            wait_until("b resynced after being added again", lambda: "b" in index.nodes())
            assert held_by(index, b_keys, tenant="t2") == want_b
        finally:
            followers.close()
        followers.stop()  # stopping twice is fine
    assert token not in caplog.text


def test_moves_and_evictions_reach_the_index(tmp_path: Path, index: EmbeddedIndex) -> None:
    keys = [key(i, space=3) for i in range(12)]
    with running_agent(tmp_path / "a", "--name", "a", "--cpu", "8MiB", "--disk", "8MiB") as a:
        follower = Follower(index, "a", a.state.control_url)
        put(a, keys)
        follower.poll_once()
        assert held_by(index, keys) == [[Holding("a", "cpu", CHUNK_BYTES, TOKENS)]] * len(keys)

        moved, evicted, kept = keys[:4], keys[4:8], keys[8:]
        a.control().move(moved, "disk")
        a.control().evict(evicted)

        def reflected() -> bool:
            follower.poll_once()
            return (
                held_by(index, moved) == [[Holding("a", "disk", CHUNK_BYTES, TOKENS)]] * 4
                and held_by(index, evicted) == [[]] * 4
                and held_by(index, kept) == [[Holding("a", "cpu", CHUNK_BYTES, TOKENS)]] * 4
            )

        wait_until("the move and the eviction in the index", reflected)
        assert matches_listing(index, "a", a)
        assert follower.status()["resyncs"] == 1  # events alone, no resync needed


def test_a_killed_agent_is_dropped_and_resynced_when_it_comes_back(
    tmp_path: Path, index: EmbeddedIndex
) -> None:
    """Kill -9 (no goodbye): its entries leave the index once a poll finds its port refusing
    connections (or it has been silent for drop_after_s). Restarted on the same address, its
    new event stream (a new instance) is resynced: the index holds what it holds after the
    restart, not what it held before."""
    port = closed_port()
    args = ["--name", "a", "--listen", f"127.0.0.1:{port}", "--cpu", "8MiB", "--disk", "8MiB"]
    data_dir = tmp_path / "a"
    before = [key(i, space=4) for i in range(20)]
    after = [key(i, space=5) for i in range(7)]
    survivor = Follower(index, "other", "http://127.0.0.1:1", drop_after_s=0.5)  # never up
    followers = Followers(index, poll_s=0.05, drop_after_s=1.0)
    a = start_agent(data_dir, *args)
    try:
        followers.add("a", a.state.control_url)
        followers.start()
        put(a, before)
        wait_until("the chunks in the index", lambda: index.nodes().get("a") == len(before))
        first_instance = followers.status()[0]["instance"]

        a.kill9()
        wait_until("a's entries dropped", lambda: "a" not in index.nodes())
        [status] = followers.status()
        assert not status["up"] and status["errors"] >= 1
        assert "AgentUnreachable" in status["last_error"]

        a = start_agent(data_dir, *args)  # same address, same data directory
        put(a, after)
        wait_until("the restarted agent resynced", lambda: matches_listing(index, "a", a))
        [status] = followers.status()
        assert status["up"] and status["resyncs"] >= 2
        assert status["resync_reasons"]["agent_back"] >= 1  # marked down, then answering
        assert status["instance"] != first_instance
        assert held_by(index, after) == [[Holding("a", "cpu", CHUNK_BYTES, TOKENS)]] * len(after)
        # what the agent kept across the restart (its cpu tier is lost) is what the index says
        kept = {item["key"] for item in listing(a)}
        gone = [k for k in before if k.hex() not in kept]
        assert gone, "the cpu tier's chunks did not survive the restart"
        assert held_by(index, gone) == [[]] * len(gone)
    finally:
        followers.close()
        if a.proc.poll() is None:
            assert a.stop() == 0, a.log()[-3000:]
    # an agent never heard from (its port refusing) is marked down, and stays so
    wait_until("a never-reached agent marked down", lambda: _polled_down(survivor))
    assert survivor.status()["up"] is False and survivor.status()["last_ok_s"] is None


def test_an_agent_stopped_is_marked_down_at_its_first_refused_poll(
    tmp_path: Path, index: EmbeddedIndex
) -> None:
    """A stopped agent's port refuses the connection: nothing listens there, so no answer is
    on its way, and the follower marks it down at that poll instead of after drop_after_s of
    silence. A review's router, 10 routes a second, sent 28 (2.9 s of them) to an agent
    stopped for a restart before marking it down. (A poll that goes unanswered, a hung agent
    or a lost packet, still waits drop_after_s: the hung-agent tests.)"""
    now_s = [0.0]
    with running_agent(tmp_path / "a", *SMALL) as a:
        follower = Follower(index, "a", a.state.control_url, clock=lambda: now_s[0])
        put(a, [key(i, space=9) for i in range(5)])
        follower.poll_once()
        assert follower.status()["up"] and index.nodes().get("a") == 5
    now_s[0] += 0.1  # stopped cleanly: its port refuses, 0.1 s into a 3 s drop_after_s
    follower.poll_once()
    status = follower.status()
    assert status["up"] is False, status
    assert "refused" in status["last_error"]
    assert "a" not in index.nodes()  # an index of its own: the node's entries dropped
    follower.close()


def _polled_down(follower: Follower) -> bool:
    follower.poll_once()
    return follower.status()["errors"] > 0 and not follower.status()["up"]


def test_falling_behind_the_event_buffer_resyncs_to_the_listing(
    tmp_path: Path, index: EmbeddedIndex
) -> None:
    """More events between two polls than the agent buffers (8192): the follower learns how
    many it missed, resyncs from the listing, and the index ends equal to the agent's chunks."""
    # 2 MiB of cpu holds 512 of the 4 KiB chunks: 9,000 puts make 9,000 store events and
    # about 8,500 evictions
    keys = [key(i, space=6) for i in range(9000)]
    with running_agent(tmp_path / "a", "--name", "a", "--cpu", "2MiB", "--disk", "0") as a:
        follower = Follower(index, "a", a.state.control_url)
        follower.poll_once()  # first contact: an empty agent
        put(a, keys[:10])
        follower.poll_once()
        assert index.nodes() == {"a": 10}
        put(a, keys[10:])
        follower.poll_once()
        status = follower.status()
        assert status["gaps"] == 1 and status["dropped_events"] > 0
        assert status["resyncs"] == 2
        assert status["resync_reasons"]["behind"] == 1
        assert matches_listing(index, "a", a)
        assert 0 < index.nodes()["a"] < len(keys)


def test_an_isolated_tenants_chunks_never_reach_another_tenant(
    tmp_path: Path, index: EmbeddedIndex
) -> None:
    own = [key(i, space=7) for i in range(8)]
    shared = [key(i, space=8) for i in range(8)]
    early = [key(i, space=9) for i in range(4)]
    with running_agent(tmp_path / "a", "--name", "a", *SMALL) as a:
        put(a, early, tenant="acme", isolated=True)  # reaches the index through the listing
        follower = Follower(index, "a", a.state.control_url)
        follower.poll_once()
        put(a, own, tenant="acme", isolated=True)  # through events
        put(a, shared, tenant="t2")
        follower.poll_once()
        here = [Holding("a", "cpu", CHUNK_BYTES, TOKENS)]
        for tenant in ("globex", "t2", ""):
            assert held_by(index, early + own, tenant=tenant) == [[]] * 12
            assert held_by(index, shared, tenant=tenant) == [here] * 8
        assert held_by(index, early + own + shared, tenant="acme") == [here] * 20


class _Hanging(http.server.BaseHTTPRequestHandler):
    """An agent that has stopped answering: each request waits until the test releases it."""

    release: threading.Event
    requests: list[str]

    def do_GET(self) -> None:
        self.requests.append(self.path)
        self.release.wait(60)
        self.send_error(503)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_hung_agent_does_not_hold_up_the_others(tmp_path: Path, index: EmbeddedIndex) -> None:
    release = threading.Event()
    requests: list[str] = []
    handler = type("Hanging", (_Hanging,), {"release": release, "requests": requests})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hung_url = f"http://127.0.0.1:{server.server_address[1]}"
    keys = [key(i, space=10) for i in range(10)]
    # the hung agent's request times out long after the test is done: only a round that does
    # not wait for it lets the live agent's chunks in
    followers = Followers(index, poll_s=0.05, drop_after_s=120, timeout_s=60)
    try:
        with running_agent(tmp_path / "a", "--name", "a", *SMALL) as a:
            followers.add("hung", hung_url)
            followers.add("a", a.state.control_url)
            followers.start()
            wait_until("the hung agent asked", lambda: len(requests) == 1)
            put(a, keys)
            wait_until("a's chunks in the index", lambda: index.nodes() == {"a": len(keys)})
            status = {s["node"]: s for s in followers.status()}
            assert status["a"]["up"] and not status["hung"]["up"]
            assert status["hung"]["errors"] == 0  # its first poll is still waiting
            assert requests == ["/v1/events/recent?after=0&limit=1000"]
            release.set()
            followers.stop()
    finally:
        release.set()
        followers.close()
        server.shutdown()
        server.server_close()


def test_many_hung_agents_do_not_hold_up_the_agents_that_answer(
    tmp_path: Path, index: EmbeddedIndex
) -> None:
    """More hung agents than a pool has threads (a DC partitioned while its hosts still take
    connections): their polls wait on a pool of their own. With one pool they held every
    thread for a request timeout each round, and a live agent's chunks waited behind them."""
    release = threading.Event()
    requests: list[str] = []
    handler = type("Hanging", (_Hanging,), {"release": release, "requests": requests})
    hung = [f"h{i}" for i in range(MAX_POLL_THREADS + 4)]
    ports = {node: closed_port() for node in hung}
    servers: list[http.server.ThreadingHTTPServer] = []
    keys = [key(i, space=11) for i in range(10)]
    # a hung request holds its thread for a minute: only polls kept off those threads let
    # the live agent's chunks in within wait_until's bound
    followers = Followers(index, poll_s=0.05, drop_after_s=120, timeout_s=60)
    try:
        with running_agent(tmp_path / "a", "--name", "a", *SMALL) as a:
            for node in hung:  # first in each round's queue
                followers.add(node, f"http://127.0.0.1:{ports[node]}")
            followers.add("a", a.state.control_url)
            followers.start()
            # nothing listens yet: each is refused (marked down, its poll failed), then its
            # host takes connections and never answers
            wait_until("the hung agents refused", lambda: followers.down_nodes() == set(hung))
            for node in hung:
                server = http.server.ThreadingHTTPServer(("127.0.0.1", ports[node]), handler)
                threading.Thread(target=server.serve_forever, daemon=True).start()
                servers.append(server)
            wait_until("a pool's worth of hung polls", lambda: len(requests) >= MAX_POLL_THREADS)
            put(a, keys)
            wait_until("a's chunks in the index", lambda: index.nodes() == {"a": len(keys)})
            assert followers.up_nodes() == {"a"}
    finally:
        release.set()
        followers.close()
        for server in servers:
            server.shutdown()
            server.server_close()


class _LinkDrops(http.server.BaseHTTPRequestHandler):
    """An empty agent whose link goes down: it answers as one (no chunks, no events) until
    ``hang`` is set, then takes each request and answers none until ``release`` is set."""

    hang: threading.Event
    release: threading.Event
    hung: list[str]

    def do_GET(self) -> None:
        if self.hang.is_set():
            self.hung.append(self.path)
            self.release.wait(60)
            self.send_error(503)
            return
        if self.path.startswith("/v1/events/recent"):
            answer: dict[str, Any] = {"events": [], "last_seq": 0, "dropped": 0, "instance": "i1"}
        elif self.path.startswith("/v1/keys"):
            answer = {"items": [], "next": None}
        else:
            self.send_error(404)
            return
        body = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_agents_that_all_hang_at_once_do_not_hold_up_the_others_first_round(
    tmp_path: Path, index: EmbeddedIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DC's link goes down: 40 agents that answered all take their next poll and answer
    nothing. Their last polls had not failed, so those first hung polls went to the pool of
    the agents that answer (4 threads here, 16 in a router) and every other agent's poll
    waited in its queue behind them, a request timeout for each 4 of them (10 here, a minute
    each). A poll now waits for a thread at most a round: a and b's chunks reach the index
    while every hung poll is still held, before the hung servers are let go."""
    monkeypatch.setattr(follower_module, "MAX_POLL_THREADS", 4)
    hang, release = threading.Event(), threading.Event()
    hung: list[str] = []
    handler = type("LinkDrops", (_LinkDrops,), {"hang": hang, "release": release, "hung": hung})
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(40)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    far = [f"h{i}" for i in range(len(servers))]
    a_keys = [key(i, space=12) for i in range(10)]
    b_keys = [key(i, space=13) for i in range(10)]
    # a hung request is held for a minute: only a poll that does not wait for its thread
    # behind them lets a's and b's chunks in within wait_until's bound
    followers = Followers(index, poll_s=0.05, drop_after_s=120, timeout_s=60)
    try:
        with (
            running_agent(tmp_path / "a", "--name", "a", *SMALL) as a,
            running_agent(tmp_path / "b", "--name", "b", *SMALL) as b,
        ):
            for node, server in zip(far, servers, strict=True):  # first in each round's queue
                followers.add(node, f"http://127.0.0.1:{server.server_address[1]}")
            followers.add("a", a.state.control_url)
            followers.add("b", b.state.control_url)
            followers.start()

            def all_followed() -> bool:
                status = followers.status()
                return len(status) == 42 and all(s["up"] and s["resyncs"] for s in status)

            wait_until("every agent followed", all_followed)
            hang.set()
            wait_until("a pool's worth of hung polls", lambda: len(hung) >= 4)
            put(a, a_keys)
            put(b, b_keys)
            wait_until(
                "a's and b's chunks in the index", lambda: index.nodes() == {"a": 10, "b": 10}
            )
            assert not release.is_set()
            status = {s["node"]: s for s in followers.status()}
            # every hung agent's first hung poll is still held: none failed yet
            assert [status[n]["errors"] for n in far] == [0] * len(far)
            assert status["a"]["up"] and status["b"]["up"] and status["a"]["errors"] == 0
    finally:
        release.set()
        followers.close()
        for server in servers:
            server.shutdown()
            server.server_close()
