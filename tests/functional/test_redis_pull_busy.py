"""A pull of many small records from a busy shared Redis (every record answered a little late,
each well within the read deadline) is not judged too slow: its deadline allows each record
``PULL_ALLOWANCE_PER_RECORD_S`` besides its bytes at ``PULL_FLOOR_BYTES_PER_S``. Before, it was
sized by bytes alone, so 400 records of 4 KiB answered 2 ms apart each (0.8 s in all, against a
0.53 s deadline) were cut as ``PullTooSlow``, and a node's pool breaker (it opens on one failure)
cut the whole pool off. A server that sends each record far slower than that allowance is still
cut. Runs against a redis-server of the test's own, behind a loopback proxy that holds back each
reply that carries a record (``LateRepliesProxy``)."""

from __future__ import annotations

import contextlib
import hashlib
import select
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvctl.remote.pool import PULL_ALLOWANCE_PER_RECORD_S, PullTooSlow
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.tiers.base import ChunkMeta
from tests.functional.test_pool_outage import TcpProxy, node

TENANT = "t1"
CHUNK_BYTES = 4 << 10
#: 400 records answered 2 ms apart: 0.8 s at least, past the 0.5 s read deadline plus the
#: records' bytes (1.6 MiB, 0.05 s at the floor rate) but well within 400 allowances
BUSY_RECORDS = 400
BUSY_DELAY_S = 0.002


def _reply_end(buf: bytes | bytearray, at: int) -> int | None:
    """Where the RESP2 reply starting at ``at`` ends, or None when ``buf`` holds only part."""
    line_end = buf.find(b"\r\n", at)
    if line_end < 0:
        return None
    kind, head = buf[at : at + 1], bytes(buf[at + 1 : line_end])
    end = line_end + 2
    if kind == b"$":
        n = int(head)
        if n < 0:
            return end
        return end + n + 2 if len(buf) >= end + n + 2 else None
    if kind == b"*":
        for _ in range(max(int(head), 0)):
            got = _reply_end(buf, end)
            if got is None:
                return None
            end = got
        return end
    return end  # + - : one line


class LateRepliesProxy(TcpProxy):
    """``TcpProxy`` that, while ``late`` is set, holds each reply carrying a value (a bulk
    string: a GET that found its record) for ``delay_s`` before forwarding it: a server busy
    with other clients, answering each record a little late."""

    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self.late = threading.Event()
        self.delay_s = delay_s
        super().__init__(target)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            replies = src.getpeername()[1] == self.target[1]
        except OSError:
            replies = False
        if not replies:
            super()._pump(src, dst)
            return
        buf = bytearray()
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([src], [], [], 0.05)
                if not ready:
                    continue
                data = src.recv(1 << 16)
                if not data:
                    break
                buf += data
                at = 0
                while (end := _reply_end(buf, at)) is not None:
                    valued = buf[at : at + 1] == b"$" and not buf.startswith(b"$-1", at)
                    if valued and self.late.is_set() and self._stop.wait(self.delay_s):
                        return
                    dst.sendall(buf[at:end])
                    at = end
                del buf[:at]
        except (OSError, ValueError):
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()


def _key(i: int, space: str) -> bytes:
    return hashlib.blake2b(f"{space}/{i}".encode(), digest_size=16).digest()


def _chunks(space: str, n: int) -> list[tuple[ChunkMeta, bytes]]:
    return [
        (ChunkMeta(k, CHUNK_BYTES, tokens=16, tenant=TENANT), bytes([k[0]]) * CHUNK_BYTES)
        for k in (_key(i, space) for i in range(n))
    ]


@contextlib.contextmanager
def _proxy(server: Any, delay_s: float) -> Iterator[LateRepliesProxy]:
    p = LateRepliesProxy(("127.0.0.1", server.port), delay_s)
    try:
        yield p
    finally:
        p.close()


def test_a_busy_redis_answering_each_record_late_is_not_cut(private_redis: Any) -> None:
    items = _chunks("busy", BUSY_RECORDS)
    keys = [m.key for m, _ in items]
    with _proxy(private_redis, BUSY_DELAY_S) as proxy:
        pool = RedisPool(proxy.url, prefix="busy", capacity_bytes=64 << 20)
        try:
            assert all(pool.put_many(items))
            # a read at speed first: the pool learns its chunks are small, and reads them all
            # in one stream from then on (several connections pay only for big reads)
            assert all(pool.get_many(keys[:2], tenant=TENANT))
            proxy.late.set()
            got = pool.get_many(keys, tenant=TENANT)
            assert [bytes(c.data) if c else None for c in got] == [data for _, data in items]
            assert pool.overdue == 0
        finally:
            pool.close()


def test_a_node_keeps_a_busy_pool(private_redis: Any) -> None:
    """The operator's view: the pool stays in use (no error, no breaker opening)."""
    items = _chunks("node", BUSY_RECORDS)
    keys = [m.key for m, _ in items]
    with _proxy(private_redis, BUSY_DELAY_S) as proxy:
        direct = RedisPool(private_redis.url, prefix="node", capacity_bytes=64 << 20)
        try:
            assert all(direct.put_many(items))
        finally:
            direct.close()
        with node(proxy.url, "node") as (remote, pool):
            assert remote.lookup(keys, tenant=TENANT).matched_chunks == BUSY_RECORDS
            assert remote.fill(keys[:2], tenant=TENANT) == 2  # at speed (see above)
            proxy.late.set()
            assert remote.fill(keys, tenant=TENANT) == BUSY_RECORDS - 2  # pulled: the rest
            status = pool.status()
            assert status["overdue"] == 0 and status["errors"] == 0
            assert status["breaker"]["opens"] == 0
            proxy.late.clear()


def test_a_redis_sending_each_record_far_slower_than_its_allowance_is_still_cut(
    private_redis: Any,
) -> None:
    """20 records, each held 20 allowances: 2 s at least, against a deadline of the read
    deadline plus 20 allowances and the bytes."""
    items = _chunks("slow", 20)
    keys = [m.key for m, _ in items]
    with _proxy(private_redis, 20 * PULL_ALLOWANCE_PER_RECORD_S) as proxy:
        pool = RedisPool(proxy.url, prefix="slow", capacity_bytes=64 << 20, streams=1)
        try:
            assert all(pool.put_many(items))
            proxy.late.set()
            with pytest.raises(PullTooSlow, match="abandoned"):
                pool.get_many(keys, tenant=TENANT)
            assert pool.overdue == 1
        finally:
            pool.close()
