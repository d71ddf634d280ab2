"""A Redis pool pull retried on a new connection (the server dropped the kept one) still runs
under its deadline when the deadline passed while that connection was being made.

The deadline cuts a pull by shutting its socket down (``PullWatch``); while the retry's
connection is being made there is no socket, and a cut then was lost: the watch let go of the
pull, and the retry read on with no deadline, for as long as the server trickled (here it
returned the records after ~1.3 s of trickle, a deadline 0.5 s past; with a slower trickle, for
as long as it lasted). Now the retry checks, once connected, whether it was cut meanwhile.

The window is made wide on purpose with a real listener (``DropThenSlowAccept``): the kept
connection is closed after a silence within the read deadline, and the listener's accept queue is
full, so the reconnect waits for the kernel to send its SYN again (1 s on Linux); the deadline
passes in that second."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvctl.remote.pool import PullTooSlow
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.tiers.base import ChunkMeta
from tests.functional.test_redis_pull_deadline import PIECE_BYTES, PIECE_EVERY_S, key

TENANT = "t1"
CHUNK_BYTES = 256 << 10
#: the read deadline (and connect timeout): longer than the kernel's first SYN retry (1 s), so
#: the reconnect waits it out instead of failing
READ_TIMEOUT_S = 1.5
#: the kept connection's request is held this long, then the connection closed: silence within
#: the read deadline, and the pull's deadline (READ_TIMEOUT_S plus 2 records' allowance) passes
#: 0.5 s into the reconnect's 1 s wait
HOLD_S = 1.0
#: the accept queue is emptied this long after the close: after the reconnect's first SYN was
#: dropped, well before the kernel sends it again
RESUME_ACCEPT_AFTER_S = 0.3


class DropThenSlowAccept:
    """A loopback relay to ``target`` (accept queue of one). Once ``armed``, it holds the next
    request on a kept connection ``hold_s``, then closes that connection, and accepts again
    ``RESUME_ACCEPT_AFTER_S`` later (if it had stopped); with ``trickle``, the connections it
    accepts after that trickle their replies (``PIECE_BYTES`` every ``PIECE_EVERY_S``)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.accepting = threading.Event()
        self.accepting.set()
        self.armed = threading.Event()
        self.hold_s = HOLD_S
        self.trickle = True
        self._trickle_new = threading.Event()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=0)
        self.address = self._listener.getsockname()
        self.url = f"redis://127.0.0.1:{self.address[1]}/0"
        self._spawn(self._accept)

    def _spawn(self, target: Any, *args: Any) -> None:
        threading.Thread(target=target, args=args, daemon=True, name="test-relay").start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            if not self.accepting.wait(0.05):
                continue
            ready, _, _ = select.select([self._listener], [], [], 0.05)
            if not ready or not self.accepting.is_set():
                continue
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.target, timeout=5)
            except OSError:
                continue
            with self._lock:
                self._socks += [client, server]
            trickle = self._trickle_new.is_set()
            self._spawn(self._requests, client, server)
            self._spawn(self._replies, server, client, trickle)

    def _requests(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(1 << 16):
                if self.armed.is_set():
                    self.armed.clear()
                    if self.trickle:
                        self._trickle_new.set()
                    self._stop.wait(self.hold_s)  # silence, then the server "drops" the connection
                    self._close(client, server)
                    self._stop.wait(RESUME_ACCEPT_AFTER_S)
                    self.accepting.set()
                    return
                server.sendall(data)
        except OSError:
            pass
        self._close(client, server)

    def _replies(self, server: socket.socket, client: socket.socket, trickle: bool) -> None:
        try:
            while data := server.recv(1 << 16):
                for at in range(0, len(data), PIECE_BYTES if trickle else len(data)):
                    if at and self._stop.wait(PIECE_EVERY_S):
                        return
                    client.sendall(data[at : at + PIECE_BYTES] if trickle else data)
        except OSError:
            pass
        self._close(client, server)

    @staticmethod
    def _close(*socks: socket.socket) -> None:
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        self._stop.set()
        self.accepting.set()
        self._listener.close()
        with self._lock:
            socks, self._socks = self._socks, []
        self._close(*socks)


@pytest.fixture
def relay(private_redis: Any) -> Iterator[DropThenSlowAccept]:
    r = DropThenSlowAccept(("127.0.0.1", private_redis.port))
    try:
        yield r
    finally:
        r.close()


def test_a_pull_retried_after_its_deadline_passed_while_reconnecting_is_cut(
    private_redis: Any, relay: DropThenSlowAccept
) -> None:
    items = [
        (ChunkMeta(k, CHUNK_BYTES, tokens=256, tenant=TENANT), bytes([k[0]]) * CHUNK_BYTES)
        for k in (key(i, "reconnect") for i in range(2))
    ]
    keys = [m.key for m, _ in items]
    direct = RedisPool(private_redis.url, prefix="reconnect", capacity_bytes=64 << 20)
    try:
        assert all(direct.put_many(items))
    finally:
        direct.close()
    pool = RedisPool(
        relay.url, prefix="reconnect", read_timeout_s=READ_TIMEOUT_S, timeout_s=5.0, streams=1
    )
    dummy: socket.socket | None = None
    try:
        assert all(pool.get_many(keys, tenant=TENANT))  # its read connection is kept
        relay.accepting.clear()
        # the listener's accept queue (one place) taken: a new connection's SYN is dropped
        dummy = socket.create_connection(relay.address, timeout=5)
        with pytest.raises(OSError):  # (the premise: it is full)
            socket.create_connection(relay.address, timeout=0.2).close()
        relay.armed.set()
        with pytest.raises(PullTooSlow, match="abandoned"):
            pool.get_many(keys, tenant=TENANT)
        assert pool.overdue == 1
    finally:
        pool.close()
        if dummy is not None:
            dummy.close()


def test_a_pull_on_a_connection_the_server_dropped_is_retried_on_a_new_one(
    private_redis: Any, relay: DropThenSlowAccept
) -> None:
    """The healthy retry the check sits in: a connection dropped mid-pull costs it nothing."""
    items = [
        (ChunkMeta(k, CHUNK_BYTES, tokens=256, tenant=TENANT), bytes([k[0]]) * CHUNK_BYTES)
        for k in (key(i, "dropped") for i in range(2))
    ]
    keys = [m.key for m, _ in items]
    pool = RedisPool(relay.url, prefix="dropped", capacity_bytes=64 << 20, streams=1)
    try:
        assert all(pool.put_many(items))
        assert all(pool.get_many(keys, tenant=TENANT))  # its read connection is kept
        relay.hold_s, relay.trickle = 0.0, False
        relay.armed.set()  # closed when the pull's request arrives
        got = pool.get_many(keys, tenant=TENANT)
        assert not relay.armed.is_set()  # (the premise: it was)
        assert [bytes(c.data) if c else None for c in got] == [data for _, data in items]
        assert pool.overdue == 0
    finally:
        pool.close()
