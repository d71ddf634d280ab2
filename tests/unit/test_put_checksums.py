"""PUT checksums on the wire: the optional flag byte and checksums after a PUT's items, and the
client sending them only to an agent that offers them (one before them refuses any metadata past
the items, and with it the whole PUT)."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from kvctl.client import DataClient, RequestError
from kvctl.wire.protocol import (
    HEADER,
    HEADER_BYTES,
    ITEM,
    NO_TIER,
    PUT_CHECKSUM,
    PUT_CHECKSUM_NAME,
    PUT_CHECKSUMS,
    REPLY_BIT,
    ErrorCode,
    FrameError,
    MetaReader,
    MetaWriter,
    Op,
    Status,
    chunk_checksum,
    error_meta,
    pack_header,
    parse_put_checksums,
    put_item,
    put_meta,
    recv_exactly,
)

KEYS = [bytes([i]) * 16 for i in range(1, 4)]
CHUNKS = [bytes([i]) * 4096 + bytes(range(i, 200)) for i in range(1, 4)]


def test_put_meta_round_trips_with_and_without_checksums() -> None:
    items = [put_item(k, len(c)) for k, c in zip(KEYS, CHUNKS, strict=True)]
    sums = [chunk_checksum(c) for c in CHUNKS]

    r = MetaReader(put_meta("t", items))
    assert r.text() == "t" and len(r.structs(ITEM, r.count())) == 3
    assert parse_put_checksums(r, 3) is None  # the old request: nothing after the items

    raw = put_meta("t", items, sums)
    r = MetaReader(raw)
    r.text()
    r.structs(ITEM, r.count())
    assert parse_put_checksums(r, 3) == sums
    assert raw.endswith(bytes([PUT_CHECKSUMS]) + b"".join(map(PUT_CHECKSUM.pack, sums)))

    with pytest.raises(ValueError, match="2 checksums for 3 chunks"):
        put_meta("t", items, sums[:2])


@pytest.mark.parametrize(
    ("tail", "error"),
    [
        (bytes([2]) + PUT_CHECKSUM.pack(0), "unknown PUT flags 0x02"),
        (bytes([0]), "unknown PUT flags 0x00"),
        (bytes([PUT_CHECKSUMS]) + PUT_CHECKSUM.pack(0)[:-1], "truncated"),
        (bytes([PUT_CHECKSUMS]) + PUT_CHECKSUM.pack(0) * 2, "unexpected metadata"),
    ],
)
def test_a_malformed_tail_is_a_bad_request_that_keeps_the_connection(
    tail: bytes, error: str
) -> None:
    with pytest.raises(FrameError, match=error) as exc:
        parse_put_checksums(MetaReader(tail), 1)
    assert exc.value.code == ErrorCode.BAD_REQUEST and not exc.value.fatal


class FakeAgent:
    """One end of a socket pair answering HELLO and PUT. ``offers``: its HELLO advertises put
    checksums, and it checks them (CORRUPT on a mismatch); without, it reads a PUT as the agents
    before checksums did: anything past the items refuses the whole PUT (BAD_REQUEST)."""

    def __init__(self, sock: socket.socket, *, offers: bool) -> None:
        self.sock, self.offers = sock, offers
        #: per PUT: the bytes of its metadata after the items
        self.tails: list[bytes] = []
        #: flip a bit of chunk i's bytes as they arrive (before any check)
        self.damage: set[int] = set()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _reply(self, op: int, rid: int, meta: bytes) -> None:
        self.sock.sendall(pack_header(op, rid, len(meta)) + meta)

    def _serve(self) -> None:
        try:
            while True:
                head = bytearray(HEADER_BYTES)
                recv_exactly(self.sock, memoryview(head))
                _m, _v, op, rid, meta_len, payload_len = HEADER.unpack(head)
                meta = bytearray(meta_len)
                recv_exactly(self.sock, memoryview(meta))
                payload = bytearray(payload_len)
                recv_exactly(self.sock, memoryview(payload))
                if op == Op.HELLO:
                    info: dict[str, object] = {"tiers": ["cpu"], "max_chunk_bytes": 1 << 20}
                    if self.offers:
                        info["put_checksum"] = PUT_CHECKSUM_NAME
                    self._reply(op | REPLY_BIT, rid, json.dumps(info).encode())
                elif op == Op.PUT:
                    self._put(rid, MetaReader(meta), payload)
        except Exception:  # the client closed its end: the test is over
            self.sock.close()

    def _put(self, rid: int, r: MetaReader, payload: bytearray) -> None:
        r.text()
        items = r.structs(ITEM, r.count())
        tail = r.rest()
        self.tails.append(tail)
        if tail and not self.offers:  # what the agents before checksums answered
            self._reply(Op.ERROR, rid, error_meta(ErrorCode.BAD_REQUEST, "unexpected metadata"))
            return
        sums = parse_put_checksums(MetaReader(tail), len(items)) if tail else None
        out = MetaWriter().u32(len(items))
        off = 0
        for i, item in enumerate(items):
            data = payload[off : off + item[1]]
            off += item[1]
            if i in self.damage:
                data[0] ^= 1
            ok = sums is None or chunk_checksum(data) == sums[i]
            out.raw(bytes((Status.OK, 0) if ok else (Status.CORRUPT, NO_TIER)))
        self._reply(Op.PUT | REPLY_BIT, rid, out.build())


def _client(
    pair: tuple[socket.socket, socket.socket], *, offers: bool, transport: str = "tcp"
) -> tuple[DataClient, FakeAgent]:
    agent = FakeAgent(pair[1], offers=offers)
    return DataClient(pair[0], transport, use_shm=False), agent


def test_an_agent_that_does_not_offer_put_checksums_gets_none_and_stores_the_chunks(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, agent = _client(pair, offers=False)
    assert not client.takes_put_checksums
    for asked in (True, None):  # asked for, or the TCP default: neither sends them here
        outs = client.put_many(list(zip(KEYS, CHUNKS, strict=True)), tenant="t", checksums=asked)
        assert [o.status for o in outs] == ["stored"] * 3
    assert agent.tails == [b"", b""]  # the old request, byte for byte


def test_an_agent_that_offers_them_gets_each_chunks_checksum_over_tcp(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, agent = _client(pair, offers=True)
    assert client.takes_put_checksums
    items = list(zip(KEYS, CHUNKS, strict=True))
    sums = b"".join(PUT_CHECKSUM.pack(chunk_checksum(c)) for c in CHUNKS)
    assert [o.status for o in client.put_many(items, tenant="t")] == ["stored"] * 3
    assert [o.status for o in client.put_many(items, checksums=False)] == ["stored"] * 3
    assert agent.tails == [bytes([PUT_CHECKSUMS]) + sums, b""]


def test_over_the_unix_socket_they_are_sent_only_when_asked_for(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, agent = _client(pair, offers=True, transport="unix")
    items = list(zip(KEYS, CHUNKS, strict=True))
    client.put_many(items)
    client.put_many(items, checksums=True)
    assert agent.tails[0] == b"" and agent.tails[1].startswith(bytes([PUT_CHECKSUMS]))


def test_a_chunk_refused_as_corrupt_is_a_failed_put(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, agent = _client(pair, offers=True)
    agent.damage = {1}
    outs = client.put_many(list(zip(KEYS, CHUNKS, strict=True)), tenant="t")
    assert [o.status for o in outs] == ["stored", "corrupt", "stored"]
    assert outs[1].tier is None
    agent.damage = {0}
    with pytest.raises(RequestError, match="corrupt"):
        client.put(KEYS[0], CHUNKS[0])
