"""A subscriber on real ZMQ sockets: a publisher in the test speaks vLLM's protocol (a PUB socket
sending ``[topic, seq, msgpack batch]`` and a ROUTER answering replay requests from a buffer, as
``vllm/distributed/kv_events.py``'s ``ZmqEventPublisher`` does) and the subscriber keeps an
``EmbeddedIndex`` in step. Every wait polls a condition up to a deadline."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import zmq

from kvctl.index.model import EmbeddedIndex
from kvctl.index.vllm_events import VllmEventSubscriber, VllmEventTranslator
from kvctl.store.keys import KVLayout, Namespace, keys_for

NS = Namespace("test-model", KVLayout(layers=2, kv_heads=2, head_dim=4))
BLOCK = 4
CHUNK = 16
TOPIC = "kv-events"
TOKENS = list(range(5000, 5000 + 3 * CHUNK))
KEYS = keys_for(TOKENS, NS, CHUNK)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class FakeVllmPublisher:
    """vLLM's publisher, as far as a subscriber can tell: seq from 0, every batch kept for
    replay, the replay ROUTER served on its own thread."""

    def __init__(self, *, replay: bool) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self._thread: threading.Thread | None = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()

    def publish(self, events: list[Any], *, send: bool = True, payload: bytes | None = None) -> int:
        """One batch with the next seq; ``send=False`` keeps it for replay only (as if the PUB
        socket dropped it)."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            if payload is None:
                payload = msgpack.packb([time.time(), events, 0])
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([TOPIC.encode(), seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            with self._lock:
                buffered = [(s, p) for s, p in self.buffer if s >= first]
            for s, p in buffered:
                self.router.send_multipart([client, b"", s.to_bytes(8, "big"), p])
            self.router.send_multipart([client, b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self.router.close(linger=0)
        self.pub.close(linger=0)
        self.ctx.term()


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def stored(hashes: list[int], parent: int | None, first_block: int) -> list[Any]:
    tokens = TOKENS[first_block * BLOCK : (first_block + len(hashes)) * BLOCK]
    return ["BlockStored", hashes, parent, tokens, BLOCK, None, "GPU"]


def holders(index: EmbeddedIndex) -> list[list[str]]:
    return [[h.node for h in held] for held in index.holders(KEYS, tenant="t")]


def joined(pub: FakeVllmPublisher, sub: VllmEventSubscriber) -> None:
    """Wait until the subscription reached the publisher: a PUB socket drops what it sends
    before then, so empty batches are sent until one arrives. Counted from now: batches read
    from the replay socket before (a catch-up) say nothing about the subscription."""
    wait_for(lambda: sub.status()["connected"], "the SUB socket to connect")
    before = sub.status()["messages"]

    def arrived() -> bool:
        if sub.status()["messages"] > before:
            return True
        pub.publish([])
        return False

    wait_for(arrived, "the first message through")


@pytest.fixture
def index() -> Iterator[EmbeddedIndex]:
    yield EmbeddedIndex()


def subscriber(index: EmbeddedIndex, pub: FakeVllmPublisher, **kw: Any) -> VllmEventSubscriber:
    t = VllmEventTranslator("engine-a", namespace=NS, chunk_tokens=CHUNK, tenant="t")
    return VllmEventSubscriber(
        index, t, pub.endpoint, topic=TOPIC, replay_endpoint=pub.replay_endpoint, **kw
    )


def test_published_blocks_become_the_engines_chunks_in_the_index(index: EmbeddedIndex) -> None:
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub).start()
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3, 4, 5], None, 0)])  # a chunk and a half
        pub.publish([stored([6, 7], 5, 6), stored([8, 9, 10, 11], 7, 8)])  # chunks 2 and 3
        wait_for(lambda: holders(index) == [["engine-a"]] * 3, "three chunks in the index")
        assert index.holders(KEYS, tenant="t")[0][0].tier == "gpu"
        pub.publish([["BlockRemoved", [9], "GPU"]])  # a block of the third chunk
        wait_for(lambda: holders(index) == [["engine-a"]] * 2 + [[]], "the third chunk gone")
        # garbage between good batches is counted, never the end of the stream
        pub.publish([], payload=b"\xc1 not msgpack")
        pub.pub.send_multipart([TOPIC.encode(), b"short", b""])
        pub.pub.send_multipart([b"kv-events-other", (99).to_bytes(8, "big"), b""])
        pub.publish([["AllBlocksCleared"]])
        wait_for(lambda: index.nodes() == {}, "the clear applied")
        status = sub.status()
        assert status["malformed"] == 2 and status["other_topic"] == 1
        assert (status["chunks_stored"], status["chunks_removed"]) == (3, 3)
        assert status["gaps"] == 0 and status["last_seq"] == pub.seq - 1
        assert status["endpoint"] == pub.endpoint and status["running"]
    finally:
        sub.stop()
        pub.close()
    assert not sub.status()["running"]


def test_a_gap_without_replay_is_counted_and_the_stream_goes_on(index: EmbeddedIndex) -> None:
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub).start()
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3], None, 0)], send=False)  # lost
        pub.publish([stored([100, 101, 102, 103], None, 0)])
        wait_for(lambda: holders(index)[0] == ["engine-a"], "the chunk after the gap")
        status = sub.status()
        assert (status["gaps"], status["missed"], status["unrecovered"]) == (1, 1, 1)
    finally:
        sub.stop()
        pub.close()


def test_a_gap_is_filled_from_the_replay_socket(index: EmbeddedIndex) -> None:
    pub = FakeVllmPublisher(replay=True)
    sub = subscriber(index, pub).start()
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3], None, 0)], send=False)  # only the replay has these
        pub.publish([stored([4, 5, 6, 7], 3, 4)], send=False)
        pub.publish([stored([8, 9, 10, 11], 7, 8)])
        wait_for(lambda: holders(index) == [["engine-a"]] * 3, "the replayed chunks")
        status = sub.status()
        assert (status["gaps"], status["missed"], status["replayed"]) == (1, 2, 2)
        assert status["unrecovered"] == 0 and status["replay_failures"] == 0
    finally:
        sub.stop()
        pub.close()


def test_catch_up_reads_what_was_published_before_the_subscriber(index: EmbeddedIndex) -> None:
    pub = FakeVllmPublisher(replay=True)
    pub.publish([stored([0, 1, 2, 3, 4, 5, 6, 7], None, 0)])  # nobody listening yet
    sub = subscriber(index, pub).start()
    try:
        wait_for(lambda: holders(index)[:2] == [["engine-a"]] * 2, "the chunks from the replay")
        joined(pub, sub)
        pub.publish([stored([8, 9, 10, 11], 7, 8)])
        wait_for(lambda: holders(index)[2] == ["engine-a"], "the next chunk")
        # (empty batches sent while the subscription travelled may have been replayed too)
        status = sub.status()
        assert status["restarts"] == 0 and status["unrecovered"] == 0
        assert status["replayed"] >= 1
    finally:
        sub.stop()
        pub.close()


def test_an_engine_restart_removes_its_chunks(index: EmbeddedIndex) -> None:
    pub = FakeVllmPublisher(replay=False)
    sub = subscriber(index, pub).start()
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3, 4, 5, 6, 7], None, 0)])
        wait_for(lambda: holders(index)[:2] == [["engine-a"]] * 2, "two chunks")
        pub.restart()  # seq starts over at 0: the new engine's cache is empty
        pub.publish([stored([0, 1, 2, 3], None, 0)])
        wait_for(lambda: sub.status()["restarts"] == 1, "the restart noticed")
        wait_for(lambda: holders(index)[:2] == [["engine-a"], []], "only the new chunk")
        assert sub.status()["last_seq"] == 0
    finally:
        sub.stop()
        pub.close()


def test_a_replay_socket_that_does_not_answer_is_counted(index: EmbeddedIndex) -> None:
    pub = FakeVllmPublisher(replay=False)
    nobody = pub.ctx.socket(zmq.ROUTER)  # a port that is bound and never answers
    port = nobody.bind_to_random_port("tcp://127.0.0.1")
    t = VllmEventTranslator("engine-a", namespace=NS, chunk_tokens=CHUNK, tenant="t")
    sub = VllmEventSubscriber(
        index,
        t,
        pub.endpoint,
        topic=TOPIC,
        replay_endpoint=f"tcp://127.0.0.1:{port}",
        replay_timeout_s=0.2,
        catch_up=False,
    ).start()
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3], None, 0)], send=False)
        pub.publish([stored([100, 101, 102, 103], None, 0)])
        wait_for(lambda: holders(index)[0] == ["engine-a"], "the chunk after the gap")
        status = sub.status()
        assert (status["gaps"], status["unrecovered"], status["replay_failures"]) == (1, 1, 1)
    finally:
        sub.stop()
        nobody.close(linger=0)
        pub.close()


@pytest.mark.parametrize("replayed", [6, 1])
def test_an_engine_restarted_right_after_the_catch_up_is_a_restart_not_duplicates(
    index: EmbeddedIndex, replayed: int
) -> None:
    """The catch-up leaves a window in which a seq at or below the replayed ones is a batch the
    SUB socket held already. An engine that restarts (its connection drops, its seq starts over
    at 0) before publishing past that window must be read as a restart: its old chunks removed,
    its new batches applied, not swallowed as duplicates."""
    pub = FakeVllmPublisher(replay=True)
    pub.publish([stored([0, 1, 2, 3, 4, 5, 6, 7], None, 0)])  # nobody listening yet
    for _ in range(replayed - 1):
        pub.publish([])
    sub = subscriber(index, pub).start()
    try:
        wait_for(lambda: holders(index)[:2] == [["engine-a"]] * 2, "the chunks from the replay")
        wait_for(lambda: sub.status()["connected"], "the SUB socket to connect")
        port = int(pub.endpoint.rpartition(":")[2])
        pub.close()  # the engine stops: its connection drops
        wait_for(lambda: not sub.status()["connected"], "the disconnect noticed")
        ctx: zmq.Context[Any] = zmq.Context()
        new = ctx.socket(zmq.PUB)
        new.setsockopt(zmq.LINGER, 0)
        try:
            new.bind(f"tcp://127.0.0.1:{port}")  # the restarted engine, at the same address
            wait_for(lambda: sub.status()["connected"], "the SUB socket to reconnect")
            before = sub.status()
            payload = msgpack.packb([time.time(), [stored([0, 1, 2, 3], None, 0)], 0])
            # batches until one arrives (a PUB drops what it sends before the subscription
            # reached it), all within the replayed seqs
            for seq in range(6):
                last = min(seq, replayed - 1)
                new.send_multipart([TOPIC.encode(), last.to_bytes(8, "big"), payload])
                time.sleep(0.1)
                status = sub.status()
                if (status["messages"], status["duplicates"]) != (
                    before["messages"],
                    before["duplicates"],
                ):
                    break
            assert status["duplicates"] == before["duplicates"]  # the new engine's batches
            assert status["restarts"] >= 1  # a seq sent again is another restart
            wait_for(lambda: holders(index)[:2] == [["engine-a"], []], "only the new chunk")
        finally:
            new.close(linger=0)
            ctx.term()
    finally:
        sub.stop()


class _GatedReplay(FakeVllmPublisher):
    """Answers a replay request only once ``gate`` is set."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        super().__init__(replay=True)

    def _serve_replay(self) -> None:
        while not self.gate.wait(0.05):
            if self._stop.is_set():
                return
        super()._serve_replay()


def test_duplicates_queued_at_the_engines_disconnect_are_read_and_the_thread_still_stops(
    index: EmbeddedIndex,
) -> None:
    """Batches the SUB socket holds from inside the catch-up's window when the engine's
    disconnect is noticed are read as duplicates first, and reading them never leaves the thread
    waiting on an empty socket: it still stops."""
    pub = _GatedReplay()
    pub.publish([stored([0, 1, 2, 3], None, 0)])  # nobody listening yet
    sub = subscriber(index, pub, replay_timeout_s=10.0).start()  # its catch-up waits
    try:
        # (its connection is noted once the catch-up ends: the socket connects meanwhile)
        time.sleep(0.5)  # the subscription reaches the publisher
        # a long batch: reading it from the replay keeps the thread busy while the disconnect
        # comes, so the socket holds these live copies and the disconnect at once
        n = 100_000
        pub.publish([["BlockStored", list(range(10**6, 10**6 + n)), None, [7] * (4 * n), 4]])
        pub.publish([stored([4, 5, 6, 7], 3, 4)])
        pub.gate.set()
        time.sleep(0.1)  # the replay answered
        pub.pub.close(linger=0)  # the engine's stream goes
        wait_for(lambda: holders(index)[:2] == [["engine-a"]] * 2, "the replayed chunks")
        wait_for(lambda: sub.status()["duplicates"] == 2, "the live copies read as duplicates")
    finally:
        sub.stop(timeout_s=5)
        pub.pub = pub.ctx.socket(zmq.PUB)  # for close()
        pub.close()
    assert not sub.running


def test_an_oversized_batch_is_refused_counted_and_the_feed_goes_on(
    index: EmbeddedIndex, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch over max_message_bytes never reaches the subscriber (libzmq refuses it at its
    header and drops the connection, which it never makes again by itself): it is counted, a
    warning names the endpoint and the limit, the subscriber connects again and the batches
    after it still reach the index (the gap is replayed, the oversized batch skipped)."""
    cap_bytes = 64 * 1024
    pub = FakeVllmPublisher(replay=True)
    sub = subscriber(index, pub, max_message_bytes=cap_bytes, catch_up=False).start()
    try:
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3], None, 0)])
        wait_for(lambda: holders(index)[0] == ["engine-a"], "the first chunk")
        n = 100_000  # blocks of 4 tokens: a batch of several MB, far over the cap
        huge = [["BlockStored", list(range(10**6, 10**6 + n)), 3, [7] * (4 * n), BLOCK]]
        huge_seq = pub.publish(huge)
        assert len(pub.buffer[huge_seq][1]) > 10 * cap_bytes
        pub.publish([stored([4, 5, 6, 7], 3, 4)])  # may go with the dropped connection

        def third_chunk_through() -> bool:
            if holders(index)[2] == ["engine-a"]:
                return True
            if sub.status()["oversized"]:  # connected again: batches until one arrives
                pub.publish([stored([8, 9, 10, 11], 7, 8)])
            return False

        with caplog.at_level("WARNING", logger="kvctl.index.vllm_events"):
            wait_for(third_chunk_through, "a batch after the oversized one", timeout_s=30)
        status = sub.status()
        # refused twice: live, and again from the replay socket (which then went on from the
        # batch after it, so the batch sent behind it on the dropped connection came back)
        assert status["oversized"] == 2 and status["max_message_bytes"] == cap_bytes
        assert holders(index)[1] == ["engine-a"]
        # the oversized batch itself was never read: its blocks are not tracked, and it is
        # the one batch lost
        assert status["translator"]["blocks_stored"] < n and status["malformed"] == 0
        assert (status["gaps"], status["unrecovered"], status["replay_failures"]) == (1, 1, 0)
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(pub.endpoint in m and str(cap_bytes) in m for m in warned), warned
        assert any(str(pub.replay_endpoint) in m for m in warned), warned
    finally:
        sub.stop()
        pub.close()


def _zmtp_pub_greeting(conn: socket.socket) -> None:
    """ZMTP 3.0's greeting and READY of a PUB socket (NULL mechanism), then the peer's greeting
    read: what libzmq needs before it reads messages from this connection."""
    conn.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32))
    ready = b"\x05READY\x0bSocket-Type" + (3).to_bytes(4, "big") + b"PUB"
    conn.sendall(b"\x04" + bytes([len(ready)]) + ready)
    got = b""
    while len(got) < 64:
        chunk = conn.recv(4096)
        assert chunk, "the subscriber closed during the handshake"
        got += chunk


def test_an_oversized_frame_is_refused_at_its_header(index: EmbeddedIndex) -> None:
    """The cap holds before anything is allocated: a publisher (ZMTP by hand) that declares a
    frame of four times max_message_bytes and sends only its header has the connection dropped
    at once (before the header, nothing; after it, no byte of the body ever came), and the
    subscriber connects again."""
    cap_bytes = 1 << 20
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(30)
    t = VllmEventTranslator("engine-a", namespace=NS, chunk_tokens=CHUNK, tenant="t")
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    sub = VllmEventSubscriber(index, t, endpoint, topic=TOPIC, max_message_bytes=cap_bytes).start()
    conns: list[socket.socket] = []
    try:
        conn, _ = listener.accept()
        conns.append(conn)
        _zmtp_pub_greeting(conn)
        conn.sendall(b"\x02" + (4 * cap_bytes).to_bytes(8, "big"))  # a long frame's header
        conn.settimeout(0.1)
        deadline = time.monotonic() + 30

        def dropped() -> bool:
            try:
                return conn.recv(4096) == b""  # the subscription's frames, then the close
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True

        while not dropped():
            assert time.monotonic() < deadline, "the connection was not dropped at the header"
        again, _ = listener.accept()  # it connects again rather than ending the feed
        conns.append(again)
        wait_for(lambda: sub.status()["oversized"] == 1, "the cut counted")
        assert sub.status()["messages"] == 0
    finally:
        sub.stop()
        for c in conns:
            c.close()
        listener.close()


def test_an_endpoint_that_is_not_a_pub_socket_is_said_once_not_counted_oversized(
    index: EmbeddedIndex, caplog: pytest.LogCaptureFixture
) -> None:
    """The events endpoint pointed at a ZMTP peer of another type (here a ROUTER, as the
    engine's replay port is): libzmq drops each connection at its handshake and never connects
    again, as at an oversized message, but no message was refused. The subscriber keeps trying
    (the port may change hands) and says so once, where it counted an oversized message and
    warned at every try."""
    ctx: zmq.Context[Any] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    accepted = router.get_monitor_socket(zmq.EVENT_ACCEPTED)
    t = VllmEventTranslator("engine-a", namespace=NS, chunk_tokens=CHUNK, tenant="t")
    sub = VllmEventSubscriber(index, t, f"tcp://127.0.0.1:{port}", topic=TOPIC)
    tries = 0

    def tried_thrice() -> bool:
        nonlocal tries
        while accepted.poll(0):
            accepted.recv_multipart()
            tries += 1
        return tries >= 3

    try:
        with caplog.at_level("WARNING", logger="kvctl.index.vllm_events"):
            sub.start()
            # the second and third made by the subscriber, each after its check had spoken
            wait_for(tried_thrice, "three connections to the ROUTER", timeout_s=30)
        status = sub.status()
        assert status["oversized"] == 0 and status["messages"] == 0
        assert "handshake" in str(status["last_error"])
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and "handshake" in warned[0], warned
    finally:
        sub.stop()
        router.disable_monitor()
        accepted.close(linger=0)
        router.close(linger=0)
        ctx.term()


def test_a_replay_endpoint_that_is_not_a_router_fails_the_replay_and_the_feed_goes_on(
    index: EmbeddedIndex,
) -> None:
    """The replay endpoint pointed at a ZMTP peer of another type (here the engine's PUB
    port): each replay connection is dropped at its handshake, which is a failed replay (as
    one not answered), not an oversized batch to ask past: the catch-up asked again from the
    next seq for ever, one a second, and never read the live feed."""
    pub = FakeVllmPublisher(replay=False)
    t = VllmEventTranslator("engine-a", namespace=NS, chunk_tokens=CHUNK, tenant="t")
    sub = VllmEventSubscriber(
        index, t, pub.endpoint, topic=TOPIC, replay_endpoint=pub.endpoint, catch_up=True
    ).start()
    try:
        wait_for(lambda: sub.status()["replay_failures"] == 1, "the catch-up's replay failed")
        joined(pub, sub)
        pub.publish([stored([0, 1, 2, 3], None, 0)])
        wait_for(lambda: holders(index)[0] == ["engine-a"], "a live batch in the index")
        status = sub.status()
        assert status["oversized"] == 0 and status["replay_failures"] >= 1
    finally:
        sub.stop()
        pub.close()
