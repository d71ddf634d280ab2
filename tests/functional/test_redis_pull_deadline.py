"""A pull from the Redis pool whose replies trickle (``TricklingProxy``: every read within the
read deadline, the whole transfer hopelessly slow) is abandoned at its deadline, sized from the
records' bytes and ``PULL_FLOOR_BYTES_PER_S`` as a peer's pull is: ``PullTooSlow``, counted in
``overdue``, a failure for the pool's breaker. Without it such a pool held the pull for as long
as it kept trickling. Runs against the machine's Redis (own key prefix) behind a loopback proxy."""

from __future__ import annotations

import contextlib
import hashlib
import select
import socket
import threading
from collections.abc import Iterator

import pytest

from kvctl.remote.pool import PullTooSlow
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.tiers.base import ChunkMeta
from tests.functional.test_pool_outage import TcpProxy, node

TENANT = "t1"
CHUNK_BYTES = 1 << 20
#: 16 KiB every 40 ms: each read well within the 0.5 s read deadline, but a 1 MiB record takes
#: 2.6 s, about 80 times longer than the deadline's floor rate allows
PIECE_BYTES = 16 << 10
PIECE_EVERY_S = 0.04


class TricklingProxy(TcpProxy):
    """``TcpProxy`` whose replies (Redis to client) go out ``PIECE_BYTES`` at a time, one piece
    per ``PIECE_EVERY_S``, while ``trickling`` is set."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.trickling = threading.Event()
        super().__init__(target)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            replies = src.getpeername()[1] == self.target[1]
        except OSError:
            replies = False
        if not replies:
            super()._pump(src, dst)
            return
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([src], [], [], 0.05)  # a socket closed under a
                if not ready:  # blocked recv would not wake it
                    continue
                data = src.recv(1 << 16)
                if not data:
                    break
                if not self.trickling.is_set():
                    dst.sendall(data)
                    continue
                for at in range(0, len(data), PIECE_BYTES):
                    if at and self._stop.wait(PIECE_EVERY_S):
                        return
                    dst.sendall(data[at : at + PIECE_BYTES])
        except (OSError, ValueError):
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()


def key(i: int, space: str) -> bytes:
    return hashlib.blake2b(f"{space}/{i}".encode(), digest_size=16).digest()


def chunks(space: str, n: int) -> list[tuple[ChunkMeta, bytes]]:
    return [
        (ChunkMeta(k, CHUNK_BYTES, tokens=256, tenant=TENANT), bytes([k[0]]) * CHUNK_BYTES)
        for k in (key(i, space) for i in range(n))
    ]


@pytest.fixture
def proxy(redis_url: str) -> Iterator[TricklingProxy]:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    p = TricklingProxy(("127.0.0.1", port))
    try:
        yield p
    finally:
        p.close()


def test_a_trickling_redis_pull_is_cut_at_its_deadline(
    redis_url: str, redis_prefix: str, proxy: TricklingProxy
) -> None:
    items = chunks(redis_prefix, 2)
    keys = [m.key for m, _ in items]
    pool = RedisPool(proxy.url, prefix=redis_prefix, capacity_bytes=64 << 20, streams=1)
    try:
        assert all(pool.put_many(items))
        proxy.trickling.set()
        with pytest.raises(PullTooSlow, match="abandoned"):
            pool.get_many(keys, tenant=TENANT)
        assert pool.overdue == 1 and pool.corrupt == 0

        proxy.trickling.clear()  # the same pool reads again once its replies come at speed
        got = pool.get_many(keys, tenant=TENANT)
        assert [bytes(c.data) if c else None for c in got] == [data for _, data in items]
        assert pool.overdue == 1
    finally:
        pool.close()


def test_a_node_counts_a_trickling_pool_pull_as_an_overdue_failure(
    redis_url: str, redis_prefix: str, proxy: TricklingProxy
) -> None:
    items = chunks(redis_prefix, 1)
    direct = RedisPool(redis_url, prefix=redis_prefix, capacity_bytes=64 << 20)
    try:
        assert all(direct.put_many(items))
    finally:
        direct.close()
    k = items[0][0].key
    with node(proxy.url, redis_prefix) as (remote, pool):
        assert remote.lookup([k], tenant=TENANT).matched_chunks == 1
        proxy.trickling.set()
        assert remote.fill([k], tenant=TENANT) == 0  # a miss, not a request held for 2.6 s
        status = pool.status()
        assert status["overdue"] == 1 and status["errors"] == 1
        assert "abandoned" in status["last_error"]
        assert status["breaker"]["opens"] == 1
        proxy.trickling.clear()  # the link monitor's bandwidth probe must not hold the close
