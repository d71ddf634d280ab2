"""FETCH checksums on the wire: the request's flag byte, the reply's trailing checksums, the
client asking only an agent that offers them (one before them reads the byte as a boolean), and
the puller's check of what landed."""

from __future__ import annotations

import json
import logging
import socket
import threading

import pytest
import xxhash

from kvctl.client import AgentError, DataClient
from kvctl.remote.agent_source import AgentSource
from kvctl.store.tiers.base import ChunkMeta
from kvctl.wire.protocol import (
    FETCH_CHECKSUM,
    FETCH_CHECKSUM_NAME,
    FETCH_CHECKSUMS,
    FETCH_ITEM,
    FETCH_PAYLOAD,
    HEADER,
    HEADER_BYTES,
    REPLY_BIT,
    ErrorCode,
    FrameError,
    MetaReader,
    MetaWriter,
    Op,
    Status,
    fetch_checksum,
    fetch_flags,
    pack_header,
    parse_fetch_checksums,
    parse_fetch_flags,
    recv_exactly,
)

KEYS = [bytes([i]) * 16 for i in range(1, 4)]
CHUNKS = {k: bytes([k[0]]) * 4096 for k in KEYS[:2]}  # the third key is missing


@pytest.mark.parametrize(
    ("payload", "checksums", "byte"),
    [(False, False, 0), (True, False, 1), (True, True, FETCH_PAYLOAD | FETCH_CHECKSUMS)],
)
def test_flags_round_trip(payload: bool, checksums: bool, byte: int) -> None:
    assert fetch_flags(payload=payload, checksums=checksums) == byte
    assert parse_fetch_flags(byte) == (payload, checksums)


def test_checksums_need_the_payload_and_unknown_bits_are_refused() -> None:
    # an agent before checksums would read a lone FETCH_CHECKSUMS as "send the payload"
    with pytest.raises(ValueError, match="ask for both"):
        fetch_flags(payload=False, checksums=True)
    for byte in (FETCH_CHECKSUMS, 4, 0x80, 0xFF):
        with pytest.raises(FrameError) as exc:
            parse_fetch_flags(byte)
        assert exc.value.code == ErrorCode.BAD_REQUEST and not exc.value.fatal


def test_the_checksum_is_xxh3_64_of_any_buffer() -> None:
    data = bytes(range(256)) * 17
    want = xxhash.xxh3_64_intdigest(data)  # the disk tier's, seed 0
    assert fetch_checksum(data) == fetch_checksum(bytearray(data)) == want
    assert fetch_checksum(memoryview(data)) == want
    assert fetch_checksum(b"") == xxhash.xxh3_64_intdigest(b"")


def test_trailing_checksums_parse_exactly() -> None:
    sums = [0, 1, (1 << 64) - 1]
    raw = b"".join(FETCH_CHECKSUM.pack(s) for s in sums)
    assert parse_fetch_checksums(MetaReader(raw), 3) == sums
    with pytest.raises(FrameError, match="truncated"):
        parse_fetch_checksums(MetaReader(raw[:-1]), 3)
    with pytest.raises(FrameError, match="unexpected metadata"):
        parse_fetch_checksums(MetaReader(raw + b"\0"), 3)


class FakeAgent:
    """One end of a socket pair answering HELLO and FETCH as an agent would: ``offers``
    whether its HELLO advertises checksums; ``old`` reads the flag byte as the agents before
    checksums did (truthy: send the payload) and never appends them. ``damage`` flips a bit
    of each chunk sent; ``cut_sums`` drops the last byte of the checksums."""

    def __init__(
        self, sock: socket.socket, *, offers: bool, old: bool, damage: bool = False
    ) -> None:
        self.sock, self.offers, self.old, self.damage = sock, offers, old, damage
        self.cut_sums = False
        self.flags_seen: list[int] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _reply(self, op: int, rid: int, meta: bytes, payload: bytes = b"") -> None:
        self.sock.sendall(
            pack_header(op | REPLY_BIT, rid, len(meta), len(payload)) + meta + payload
        )

    def _serve(self) -> None:
        try:
            while True:
                head = bytearray(HEADER_BYTES)
                recv_exactly(self.sock, memoryview(head))
                _m, _v, op, rid, meta_len, _n = HEADER.unpack(head)
                meta = bytearray(meta_len)
                recv_exactly(self.sock, memoryview(meta))
                if op == Op.HELLO:
                    info = {"tiers": ["cpu"], "max_chunk_bytes": 1 << 20}
                    if self.offers:
                        info["fetch_checksum"] = FETCH_CHECKSUM_NAME
                    self._reply(op, rid, json.dumps(info).encode())
                elif op == Op.FETCH:
                    self._fetch(rid, MetaReader(meta))
        except Exception:  # the client closed its end: the test is over
            self.sock.close()

    def _fetch(self, rid: int, r: MetaReader) -> None:
        r.text()
        flags = r.u8()
        keys = r.keys()
        self.flags_seen.append(flags)
        want_payload, want_sums = (bool(flags), False) if self.old else parse_fetch_flags(flags)
        w = MetaWriter().u32(len(keys))
        body = b""
        sums = b""
        for k in keys:
            data = CHUNKS.get(k)
            if data is None:
                w.raw(FETCH_ITEM.pack(Status.MISSING, 0, 0, 0, 0, bytes(16), 0.0)).text("")
                sums += FETCH_CHECKSUM.pack(0)
                continue
            w.raw(FETCH_ITEM.pack(Status.OK, len(data), 16, 35, 0, bytes(16), 0.0)).text("t")
            sums += FETCH_CHECKSUM.pack(fetch_checksum(data))
            if want_payload:
                body += bytes([data[0] ^ 1]) + data[1:] if self.damage else data
        if want_sums:
            w.raw(sums[:-1] if self.cut_sums else sums)
        self._reply(Op.FETCH, rid, w.build(), body)


def _client(
    pair: tuple[socket.socket, socket.socket], *, offers: bool, old: bool, damage: bool = False
) -> tuple[DataClient, FakeAgent]:
    agent = FakeAgent(pair[1], offers=offers, old=old, damage=damage)
    return DataClient(pair[0], "tcp", use_shm=False), agent


def test_an_agent_that_does_not_offer_checksums_is_not_asked_and_its_reply_parses(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, agent = _client(pair, offers=False, old=True)
    sums: list[int | None] = [123]
    got = client.fetch(KEYS, tenant="t", checksums=sums)
    assert agent.flags_seen == [FETCH_PAYLOAD]  # the old request, byte for byte
    assert sums == [None, None, None]
    assert [None if g is None else bytes(g[1] or b"") for g in got] == [
        CHUNKS[KEYS[0]],
        CHUNKS[KEYS[1]],
        None,
    ]


def test_an_agent_that_offers_them_is_asked_and_the_checksums_are_handed_over(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, agent = _client(pair, offers=True, old=False)
    sums: list[int | None] = []
    client.fetch(KEYS, tenant="t", checksums=sums)
    assert agent.flags_seen == [FETCH_PAYLOAD | FETCH_CHECKSUMS]
    assert sums == [fetch_checksum(CHUNKS[KEYS[0]]), fetch_checksum(CHUNKS[KEYS[1]]), None]
    # without the list, or without the payload, nothing new is asked
    client.fetch(KEYS, tenant="t")
    client.fetch(KEYS, tenant="t", payload=False, checksums=sums)
    assert agent.flags_seen[1:] == [FETCH_PAYLOAD, 0]
    assert sums == [None, None, None]  # metadata only: no checksum for any chunk


def test_a_reply_with_truncated_checksums_closes_the_connection(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, agent = _client(pair, offers=True, old=False)
    agent.cut_sums = True
    with pytest.raises(AgentError, match="does not speak"):
        client.fetch(KEYS, tenant="t", checksums=[])
    assert client.closed


def _meta(key: bytes, size: int) -> ChunkMeta:
    return ChunkMeta(key=key, size_bytes=size, tokens=16, tenant="t")


def test_the_puller_drops_a_chunk_whose_bytes_fail_the_checksum(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source = AgentSource("127.0.0.1:1")
    try:
        k, data = KEYS[0], CHUNKS[KEYS[0]]
        good = fetch_checksum(data)
        assert source._checked(k, _meta(k, len(data)), data, "t", good) is not None
        assert source._checked(k, _meta(k, len(data)), data, "t", None) is not None  # unsent
        with caplog.at_level(logging.WARNING, "kvctl.remote.agent_source"):
            assert source._checked(k, _meta(k, len(data)), data, "t", good ^ 1) is None
        assert source.corrupt == 1
        assert "fails its checksum" in caplog.text and k.hex() in caplog.text
        assert source.address in caplog.text
    finally:
        source.close()


def test_a_pull_from_an_agent_that_damages_chunks_is_all_misses_and_every_view_given_back(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    client, _agent = _client(pair, offers=True, old=False, damage=True)
    source = AgentSource("127.0.0.1:1", streams=1)
    source._idle[False].append(client)  # the kept read connection: this pair
    try:
        given: list[int] = []
        freed: list[int] = []

        def into(i: int, meta: ChunkMeta) -> memoryview:
            given.append(i)
            return memoryview(bytearray(meta.size_bytes))

        got = source.get_many(KEYS, tenant="t", into=into, unused=freed.append)
        assert got == [None, None, None]
        assert given == freed == [0, 1]
        assert source.corrupt == 2
    finally:
        source.close()


def test_an_agent_without_checksums_is_logged_once(
    pair: tuple[socket.socket, socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    client, _agent = _client(pair, offers=False, old=True)
    source = AgentSource("127.0.0.1:1", streams=1)
    source._idle[False].append(client)
    try:
        with caplog.at_level(logging.WARNING, "kvctl.remote.agent_source"):
            for _ in range(3):
                got = source.get_many(KEYS, tenant="t")
                assert [c is not None for c in got] == [True, True, False]  # unverified
        assert caplog.text.count("sends no chunk checksums") == 1
        assert source.corrupt == 0
    finally:
        source.close()
