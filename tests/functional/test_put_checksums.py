"""End-to-end checksums on chunks written to an agent: a chunk whose bytes changed after its
sender checksummed them (a bit flipped on the way, past TCP's weak checksum) is refused alone
and counted by the receiving agent, never stored nor served to the fleet from a pool agent; a
PUT without checksums (a client before them) is stored as it always was."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvctl.wire.protocol import (
    HEADER,
    HEADER_BYTES,
    PUT_CHECKSUM_NAME,
    REPLY_BIT,
    ErrorCode,
    MetaReader,
    MetaWriter,
    Op,
    Status,
    chunk_checksum,
    pack_header,
    put_item,
    put_meta,
)
from tests.functional.agents import Agent, key, metric, payload, running_agent
from tests.functional.raw_sockets import recv_exactly
from tests.functional.test_fetch_checksums import FlippingRelay
from tests.functional.test_remote import SMALL, chain, put_chain, remote
from tests.functional.waiting import wait_until

CHUNK_BYTES = 1 << 20
CORRUPT_PUTS = "kvctl_dataplane_corrupt_puts_total"


class RawConnection:
    """A data plane connection spoken byte by byte: frames built with the protocol helpers."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self._rid = 0
        _op, info = self.call(Op.HELLO, MetaWriter().text("").text("raw-test").build())
        self.info = info

    def call(self, op: int, meta: bytes, body: bytes = b"") -> tuple[int, bytes]:
        """(reply op, reply metadata) of one request; its reply's payload is dropped."""
        self._rid += 1
        self.sock.sendall(pack_header(op, self._rid, len(meta), len(body)) + meta + body)
        _m, _v, op, rid, meta_len, payload_len = HEADER.unpack(
            recv_exactly(self.sock, HEADER_BYTES)
        )
        assert rid == self._rid  # in step
        reply = recv_exactly(self.sock, meta_len)
        recv_exactly(self.sock, payload_len)
        return op, reply

    def put(self, meta: bytes, body: bytes) -> list[int]:
        """Each item's status in the PUT's reply."""
        op, reply = self.call(Op.PUT, meta, body)
        assert op == Op.PUT | REPLY_BIT, reply
        r = MetaReader(reply)
        raw = r.take(2 * r.count())
        return [raw[i] for i in range(0, len(raw), 2)]

    def put_refused(self, meta: bytes, body: bytes) -> tuple[int, str]:
        """(error code, message) of the ERROR a PUT gets."""
        op, reply = self.call(Op.PUT, meta, body)
        assert op == Op.ERROR, reply
        return struct.unpack("<H", reply[:2])[0], reply[2:].decode()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with running_agent(tmp_path / "a", "--name", "a", *SMALL) as a:
        yield a


@pytest.fixture
def raw(agent: Agent) -> Iterator[RawConnection]:
    conn = RawConnection(str(agent.state.data_tcp))
    try:
        yield conn
    finally:
        conn.close()


def _batch(seed: int, n: int = 3) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """(keys, chunks, packed items) of a PUT of ``n`` 1 MiB chunks."""
    keys = [key(i, seed) for i in range(n)]
    chunks = [payload(k, CHUNK_BYTES) for k in keys]
    return keys, chunks, [put_item(k, CHUNK_BYTES, tokens=256) for k in keys]


def test_a_chunk_damaged_after_its_checksum_is_refused_alone_and_counted(
    agent: Agent, raw: RawConnection
) -> None:
    assert f'"put_checksum": "{PUT_CHECKSUM_NAME}"' in raw.info.decode()  # advertised in HELLO
    keys, chunks, items = _batch(seed=61)
    meta = put_meta("t1", items, [chunk_checksum(c) for c in chunks])
    damaged = bytearray(chunks[1])
    damaged[CHUNK_BYTES // 2] ^= 0x01  # after its checksum was computed: as if on the way
    assert raw.put(meta, chunks[0] + bytes(damaged) + chunks[2]) == [
        Status.OK,
        Status.CORRUPT,
        Status.OK,
    ]
    assert raw.call(Op.PING, b"")[0] == Op.PING | REPLY_BIT  # the connection is still in step
    with agent.data() as d:
        got = d.get_many(keys, tenant="t1")
    assert [None if g is None else bytes(g) for g in got] == [chunks[0], None, chunks[2]]
    assert metric(agent, CORRUPT_PUTS) == 1
    assert agent.log().count("did not match their sender's checksum") == 1

    # sent again undamaged, it is stored
    assert raw.put(put_meta("t1", items[1:2], [chunk_checksum(chunks[1])]), chunks[1]) == [
        Status.OK
    ]
    with agent.data() as d:
        assert bytes(d.get(keys[1], tenant="t1")) == chunks[1]
    assert metric(agent, CORRUPT_PUTS) == 1


def test_an_old_style_put_is_stored_and_a_malformed_tail_refused_in_step(
    agent: Agent, raw: RawConnection
) -> None:
    assert f'"put_checksum": "{PUT_CHECKSUM_NAME}"' in raw.info.decode()
    keys, chunks, items = _batch(seed=67)
    # what clients before checksums send: nothing after the items
    old = MetaWriter().text("t1").u32(len(items)).raw(b"".join(items)).build()
    assert old == put_meta("t1", items)
    assert raw.put(old, b"".join(chunks)) == [Status.OK] * 3
    with agent.data() as d:
        assert [bytes(g or b"") for g in d.get_many(keys, tenant="t1")] == chunks

    # a tail this agent does not know, or short of a checksum, refuses the PUT, and the
    # connection stays in step (the payload is read and dropped): nothing of it is stored
    keys2, chunks2, items2 = _batch(seed=71, n=2)
    sums = [chunk_checksum(c) for c in chunks2]
    for meta, why in (
        (put_meta("t1", items2) + bytes([2]), "unknown PUT flags 0x02"),
        (put_meta("t1", items2, sums)[:-1], "truncated"),
    ):
        code, message = raw.put_refused(meta, b"".join(chunks2))
        assert code == ErrorCode.BAD_REQUEST and why in message
        assert raw.call(Op.PING, b"")[0] == Op.PING | REPLY_BIT
    with agent.data() as d:
        assert d.exists(keys2, tenant="t1") == [None, None]
    assert metric(agent, CORRUPT_PUTS) == 0


@dataclass
class PutFlippingRelay(FlippingRelay):
    """``FlippingRelay`` that, while ``flipping_puts`` is set, flips one bit in the middle of
    each 1 MiB chunk of every PUT request's payload on its way to the agent."""

    flipping_puts: threading.Event = field(default_factory=threading.Event)
    flipped_puts: int = 0

    def _upstream(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while True:
                head = recv_exactly(client, HEADER_BYTES)
                _magic, _ver, op, _rid, meta_len, payload_len = HEADER.unpack(head)
                server.sendall(head + recv_exactly(client, meta_len))
                body = bytearray(recv_exactly(client, payload_len))
                if op == Op.PUT and self.flipping_puts.is_set():
                    for at in range(CHUNK_BYTES // 2, payload_len, CHUNK_BYTES):
                        body[at] ^= 0x01
                        self.flipped_puts += 1
                server.sendall(body)
        except (OSError, ConnectionError):
            pass
        finally:
            server.close()


def test_write_through_to_a_pool_agent_stores_only_verified_chunks(tmp_path: Path) -> None:
    with running_agent(tmp_path / "pool", "--role", "pool", "--name", "pool", *SMALL) as pool:
        host, port = str(pool.state.data_tcp).rsplit(":", 1)
        relay = PutFlippingRelay((host, int(port)))
        try:
            url = f"kvctl://{relay.address}"
            with running_agent(tmp_path / "a", "--name", "a", "--pool", url, *SMALL) as a:
                keys = chain(4, seed=73)
                relay.flipping_puts.set()
                put_chain(a, keys, tenant="t1")  # stored here; damaged on the way to the pool
                wait_until(
                    "the writer to hear the pool refuse them",
                    lambda: remote(a)["write"]["refused"] == len(keys),
                )
                assert relay.flipped_puts == len(keys)
                assert remote(a)["write"]["written"] == 0
                assert pool.control().stats()["usage"]["cpu"]["chunks"] == 0  # none kept
                assert metric(pool, CORRUPT_PUTS) == len(keys)
                assert "damaged on the way" in a.log()

                relay.flipping_puts.clear()
                fresh = chain(4, seed=79)
                put_chain(a, fresh, tenant="t1")
                wait_until(
                    "the write-through to reach the pool",
                    lambda: remote(a)["write"]["written"] == len(fresh),
                )
                assert remote(a)["write"]["refused"] == len(keys)
            with pool.data() as d:
                got = d.get_many([*keys, *fresh], tenant="t1")
            assert got[: len(keys)] == [None] * len(keys)
            assert [bytes(g or b"") for g in got[len(keys) :]] == [
                payload(k, CHUNK_BYTES) for k in fresh
            ]
            assert metric(pool, CORRUPT_PUTS) == len(keys)
        finally:
            relay.close()
