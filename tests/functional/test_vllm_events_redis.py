"""A vLLM event subscriber writing into a real Redis index that goes away mid-run: what the
engine stored and removed while the index failed reaches it once it is back, and a server that
came back empty is filled again with what the engine still holds."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Iterable
from itertools import pairwise

import pytest
import redis

from kvctl.index.events import ChunkEvent
from kvctl.index.redis_index import RedisIndex
from kvctl.index.vllm_events import INDEX_CHECK_S, INDEX_RETRY_MAX_S, INDEX_RETRY_S
from tests.conftest import RedisServer
from tests.functional.test_vllm_events_zmq import (
    KEYS,
    FakeVllmPublisher,
    joined,
    stored,
    subscriber,
    wait_for,
)


def _holders(index: RedisIndex) -> list[list[str]]:
    return [[h.node for h in held] for held in index.holders(KEYS, tenant="t")]


def test_an_index_outage_is_caught_up_when_the_index_is_back(private_redis: RedisServer) -> None:
    index = RedisIndex(private_redis.url, timeout_s=0.5)
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub).start()  # type: ignore[arg-type]
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3, 4, 5, 6, 7], None, 0)])  # chunks 0 and 1
        wait_for(lambda: _holders(index)[:2] == [["engine-a"]] * 2, "two chunks")
        private_redis.kill()
        # while the index is away: chunk 1 goes, chunk 2 comes (after a chunk 1 stored again)
        pub.publish([["BlockRemoved", [5], "GPU"]])
        wait_for(lambda: sub.status()["errors"] >= 1, "the failed write counted")
        pub.publish([stored([5], 4, 5), stored([8, 9, 10, 11], 7, 8)])
        wait_for(lambda: sub.status()["errors"] >= 2, "the second failed write counted")
        private_redis.start()  # no persistence: back empty
        # the engine holds chunks 0, 1 and 2: the index says so once it is back, with no new
        # batch from the engine needed
        wait_for(lambda: _holders(index) == [["engine-a"]] * 3, "the engine's chunks again")
        # counted once the write is done: status() no longer waits for the resync in progress
        # (50a7e79), so the count may follow the entries by a moment
        wait_for(lambda: sub.status()["index_resyncs"] >= 1, "the resync counted")
        assert sub.status()["index_resyncs"] == 1
        pub.publish([["BlockRemoved", [9], "GPU"]])  # and the stream goes on from there
        wait_for(lambda: _holders(index) == [["engine-a"]] * 2 + [[]], "chunk 2 gone")
    finally:
        sub.stop()
        pub.close()
        index.close()


def test_an_index_that_hangs_does_not_hold_up_the_engines_stream() -> None:
    """An index server that takes connections and never answers (a hung Redis, a dropped route)
    costs each write its timeout. While it fails, the subscriber does not try it at every batch
    (the engine sends one per step; the socket's queue would overflow and lose batches the
    translator needs): the next write replaces the engine's entries anyway."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    index = RedisIndex(f"redis://127.0.0.1:{hung.getsockname()[1]}/0", timeout_s=0.5)
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub).start()  # type: ignore[arg-type]
    try:
        joined(pub, sub)  # (its empty batches write nothing)
        before = sub.status()["messages"]
        started = time.monotonic()
        for i in range(10):
            hashes = [1000 + 4 * i + j for j in range(4)]
            pub.publish([stored(hashes, None, 0)])  # a whole chunk each: a write each
        wait_for(lambda: sub.status()["messages"] == before + 10, "every batch read", 20.0)
        assert time.monotonic() - started < 3.0  # not 10 timeouts of 0.5 s
        assert sub.status()["errors"] >= 1
    finally:
        sub.stop()
        pub.close()
        index.close()
        hung.close()


def test_a_hung_index_slower_than_the_retry_interval_is_still_tried_only_every_interval() -> None:
    """The router's index timeout (2 s by default) is longer than INDEX_RETRY_S: the interval
    counts from the end of a failed try, or the next batch after a try (which outlasted the
    interval) tries again at once and the subscriber spends the whole outage blocked on the
    index, its socket's queue growing. Each try is a new connection to the hung server."""
    timeout_s = 1.5
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    tries: list[float] = []

    def accept() -> None:
        held = []  # kept open: the server never answers, nor closes
        while True:
            try:
                conn, _ = hung.accept()
            except OSError:  # closed: the test is over
                break
            tries.append(time.monotonic())
            held.append(conn)
        for conn in held:
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    index = RedisIndex(f"redis://127.0.0.1:{hung.getsockname()[1]}/0", timeout_s=timeout_s)
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub).start()  # type: ignore[arg-type]
    try:
        joined(pub, sub)
        # an engine step's batch every 50 ms for 6.5 s: a write wanted all the time
        for i in range(130):
            hashes = [5000 + 4 * i + j for j in range(4)]
            pub.publish([stored(hashes, None, 0)])
            time.sleep(0.05)
        assert len(tries) >= 3, tries
        gaps = [b - a for a, b in pairwise(tries)]
        # a try takes timeout_s, then the subscriber reads the engine for INDEX_RETRY_S
        assert min(gaps) >= timeout_s + INDEX_RETRY_S / 2, gaps  # not timeout_s apart
    finally:
        sub.stop()
        pub.close()
        index.close()
        hung.close()


def test_an_idle_engines_entries_flushed_from_the_index_are_written_again(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The index loses the engine's entries (a Redis restarted empty or flushed) while the
    engine sends nothing: no write fails, so only the subscriber's periodic look at the node's
    marker can notice. The test deletes its own prefix's keys (never FLUSHALL: Redis is shared)."""
    index = RedisIndex(redis_url, prefix=f"{redis_prefix}:index:")
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub).start()  # type: ignore[arg-type]
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3, 4, 5, 6, 7], None, 0)])  # chunks 0 and 1
        wait_for(lambda: _holders(index)[:2] == [["engine-a"]] * 2, "two chunks")
        wait_for(lambda: index.marker("engine-a") is not None, "the engine's marker")
        with caplog.at_level(logging.WARNING, logger="kvctl.index.vllm_events"):
            assert index.clear() > 0  # as FLUSHDB does, as far as this prefix goes
            # the engine stays idle: a hang guard, not a timing claim
            wait_for(lambda: _holders(index)[:2] == [["engine-a"]] * 2, "the chunks again")
        # counted a moment after its write (status() does not wait for the resync, 50a7e79)
        wait_for(lambda: sub.status()["index_resyncs"] >= 1, "the resync counted")
        status = sub.status()
        assert status["index_resyncs"] == 1 and status["index_lost"] == 1
        assert status["errors"] == 0
        assert any("lost the engine's entries" in r.getMessage() for r in caplog.records)
        assert index.nodes() == {"engine-a": 2}
        pub.publish([["BlockRemoved", [5], "GPU"]])  # the stream goes on from there
        wait_for(lambda: _holders(index)[:2] == [["engine-a"], []], "chunk 1 gone")
    finally:
        sub.stop()
        pub.close()
        index.close()


def test_a_redis_restarted_empty_between_two_writes_is_filled_again(
    private_redis: RedisServer,
) -> None:
    """A real restart with no persistence while the engine is idle: the client's one reconnect
    hides it from every call, so no failure is ever seen; the entries still come back."""
    index = RedisIndex(private_redis.url, timeout_s=0.5)
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub).start()  # type: ignore[arg-type]
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], None, 0)])  # chunks 0-2
        wait_for(lambda: _holders(index) == [["engine-a"]] * 3, "three chunks")
        wait_for(lambda: index.marker("engine-a") is not None, "the engine's marker")
        private_redis.kill()
        private_redis.start()  # back empty
        wait_for(lambda: _holders(index) == [["engine-a"]] * 3, "the chunks again")
        # one resync, whether a look at the index fell in the restart (index_back) or not;
        # counted a moment after its write (status() does not wait for it)
        wait_for(lambda: sub.status()["index_resyncs"] >= 1, "the resync counted")
        assert sub.status()["index_resyncs"] == 1
    finally:
        sub.stop()
        pub.close()
        index.close()


def test_two_routers_following_one_engine_resync_once_each_after_a_flush(
    redis_url: str, redis_prefix: str
) -> None:
    """Two routers' subscribers to one engine share its node's marker: after the index lost it,
    each writes the engine's entries again once and both take the one marker the first left,
    rather than each taking the other's for another loss at every look."""
    prefix = f"{redis_prefix}:index:"
    index_a, index_b = RedisIndex(redis_url, prefix=prefix), RedisIndex(redis_url, prefix=prefix)
    pub = FakeVllmPublisher(replay=False)
    sub_a = subscriber(index_a, pub).start()  # type: ignore[arg-type]
    sub_b = subscriber(index_b, pub).start()  # type: ignore[arg-type]
    try:
        joined(pub, sub_a)
        joined(pub, sub_b)
        pub.publish([stored([0, 1, 2, 3, 4, 5, 6, 7], None, 0)])  # chunks 0 and 1
        wait_for(lambda: _holders(index_a)[:2] == [["engine-a"]] * 2, "two chunks")
        wait_for(lambda: index_a.marker("engine-a") is not None, "the engine's marker")
        time.sleep(3 * INDEX_CHECK_S)  # both have looked at it (a loaded machine: fewer looks)
        assert sub_a.status()["index_resyncs"] == sub_b.status()["index_resyncs"] == 0
        index_a.clear()
        wait_for(
            lambda: sub_a.status()["index_lost"] == sub_b.status()["index_lost"] == 1,
            "both subscribers to notice",
        )
        # noticed (index_lost) before the entries are written again
        wait_for(lambda: _holders(index_a)[:2] == [["engine-a"]] * 2, "the chunks again")
        time.sleep(3 * INDEX_CHECK_S)  # several looks each: no resync ping-pong
        assert sub_a.status()["index_resyncs"] == sub_b.status()["index_resyncs"] == 1
        assert index_a.nodes() == {"engine-a": 2}
    finally:
        sub_a.stop()
        sub_b.stop()
        pub.close()
        index_a.close()
        index_b.close()


def test_an_index_that_stopped_answering_a_while_and_lost_nothing_is_not_written_again(
    private_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis that hangs a while (SIGSTOP: a stall, a failover pause) and comes back with its
    data, the engine idle meanwhile: the look at the node's marker failed, but no write did and
    nothing was missed, so nothing is written again. Replacing every engine's entries each time
    one read timed out would load the index with a resync per engine (each a whole engine's
    chunks) just as it comes back."""
    index = RedisIndex(private_redis.url, timeout_s=0.5)
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub).start()  # type: ignore[arg-type]
    assert private_redis.proc is not None
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3, 4, 5, 6, 7], None, 0)])  # chunks 0 and 1
        wait_for(lambda: _holders(index)[:2] == [["engine-a"]] * 2, "two chunks")
        wait_for(lambda: index.marker("engine-a") is not None, "the engine's marker")
        with caplog.at_level(logging.INFO, logger="kvctl.index.vllm_events"):
            private_redis.proc.send_signal(signal.SIGSTOP)
            try:
                wait_for(lambda: sub.status()["errors"] >= 1, "the failed look counted")
            finally:
                private_redis.proc.send_signal(signal.SIGCONT)
            wait_for(
                lambda: any("answers again" in r.getMessage() for r in caplog.records),
                "a look (or the write to come) answered",
            )
        # the stream goes on: written as it comes, not by a replace of the engine's entries
        pub.publish([["BlockRemoved", [5], "GPU"]])
        wait_for(lambda: _holders(index)[:2] == [["engine-a"], []], "chunk 1 gone")
        status = sub.status()
        assert (status["index_resyncs"], status["index_lost"]) == (0, 0)
        assert index.nodes() == {"engine-a": 1}
    finally:
        sub.stop()
        pub.close()
        index.close()


class _CountingIndex(RedisIndex):
    """The real index, counting the replaces the subscriber asks of it."""

    replaces = 0

    def replace(self, node: str, chunks: Iterable[ChunkEvent]) -> int:
        self.replaces += 1
        return super().replace(node, chunks)


def test_an_index_that_is_down_is_not_sent_the_engines_chunks_at_every_retry(
    private_redis: RedisServer,
) -> None:
    """While the index is down, each retry (every INDEX_RETRY_S) first asks it one cheap
    question: gathering and encoding every chunk the engine holds (up to 131,072) for a
    replace that a refused connection then fails cost the router's CPU, under the lock that
    status() takes, every second of the outage, for every engine it follows."""
    index = _CountingIndex(private_redis.url, timeout_s=0.5)
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub).start()  # type: ignore[arg-type]
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3, 4, 5, 6, 7], None, 0)])  # chunks 0 and 1
        wait_for(lambda: _holders(index)[:2] == [["engine-a"]] * 2, "two chunks")
        wait_for(lambda: index.marker("engine-a") is not None, "the engine's marker")
        private_redis.kill()
        pub.publish([["BlockRemoved", [5], "GPU"]])  # a write that fails: a resync is due
        wait_for(lambda: sub.status()["errors"] >= 1, "the failed write counted")
        before = index.replaces
        # several retries while it is down (a hang guard, not a timing claim)
        wait_for(lambda: sub.status()["errors"] >= 4, "three more failed retries")
        assert index.replaces == before  # none sent the engine's chunks to a down index
        private_redis.start()  # back empty: one replace fills it again
        wait_for(lambda: _holders(index)[:2] == [["engine-a"], []], "the engine's chunk again")
        wait_for(lambda: sub.status()["index_resyncs"] >= 1, "the resync counted")
        assert sub.status()["index_resyncs"] == 1
    finally:
        sub.stop()
        pub.close()
        index.close()


class _SteppingClock:
    """The subscriber's clock: virtual time that moves ``step_s`` each time it is read. Its
    thread alone reads it, so its tries land at the same virtual times however fast the
    machine runs (``now_s`` reads it without moving it)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.now_s = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now_s += self.step_s
            return self.now_s


class _ReplacesAt(RedisIndex):
    """The real index, noting the subscriber's time at each replace it asks of it."""

    def __init__(self, url: str, clock: _SteppingClock) -> None:
        super().__init__(url, timeout_s=2.0)
        self.clock = clock
        self.sent_s: list[float] = []

    def replace(self, node: str, chunks: Iterable[ChunkEvent]) -> int:
        self.sent_s.append(self.clock.now_s)
        return super().replace(node, chunks)


def _waits(sent_s: list[float]) -> list[float]:
    """The waits between replaces, to 0.1 s (a try reads the clock a step or two past its
    wait)."""
    return [round(b - a, 1) for a, b in pairwise(sent_s)]


def test_a_replace_that_keeps_failing_is_sent_again_less_and_less_often(
    private_redis: RedisServer,
) -> None:
    """A Redis over its maxmemory (noeviction) answers reads and refuses every write: the
    engine's entries cannot be replaced. A failed replace is sent again INDEX_RETRY_S later,
    then twice as long after each further failure, INDEX_RETRY_MAX_S at most (sent again every
    second, a replace the server runs longer than its client waits would hold it for its whole
    length at each try); once one is done, the next failure waits INDEX_RETRY_S again."""
    clock = _SteppingClock(0.02)
    index = _ReplacesAt(private_redis.url, clock)
    server = redis.Redis.from_url(private_redis.url)
    server.config_set("maxmemory-policy", "noeviction")
    server.config_set("maxmemory", 1)  # full: every write refused from here on
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub, clock=clock, poll_interval_s=0.001).start()  # type: ignore[arg-type]
    try:
        # the first look finds no marker: the engine's (empty) entries are written, refused
        wait_for(lambda: clock.now_s >= 100.0, "100 s of the subscriber's time", 120.0)
        first = [t for t in index.sent_s if t < 100.0]
        assert _waits(first) == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0], first
        assert INDEX_RETRY_S == 1.0 and INDEX_RETRY_MAX_S == 30.0  # what the waits say
        status = sub.status()
        assert status["index_replace_failures"] >= len(first), status
        assert 0 <= status["index_retry_in_s"] <= INDEX_RETRY_MAX_S, status
        server.config_set("maxmemory", 0)  # room again: the next replace is done
        wait_for(lambda: index.marker("engine-a") is not None, "the engine's marker", 120.0)
        # the failures are reset a moment after the marker is written
        wait_for(lambda: sub.status()["index_replace_failures"] == 0, "the failures reset")
        done = len(index.sent_s)
        server.config_set("maxmemory", 1)
        index.clear()  # the marker lost (DEL is not refused): the engine's entries rewritten
        lost_s = clock.now_s
        wait_for(lambda: clock.now_s >= lost_s + 20.0, "20 s more", 120.0)
        again = [t for t in index.sent_s[done:] if t < lost_s + 20.0]
        assert _waits(again) == [1.0, 2.0, 4.0, 8.0], again  # from 1 s again
    finally:
        sub.stop()
        pub.close()
        index.close()
        server.close()
