"""End-to-end checksums on agent-to-agent pulls: a byte flipped in a FETCH reply's payload on
the way (a review's proxy flipped one bit and 4 of 4 chunks were served wrong, kept and served
again) is a counted miss, never stored; an old-style request gets the old reply."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import xxhash

from kvctl.remote.agent_source import AgentSource
from kvctl.store.tiers.base import ChunkMeta
from kvctl.wire.protocol import (
    FETCH_CHECKSUM,
    FETCH_CHECKSUM_NAME,
    FETCH_ITEM,
    HEADER,
    HEADER_BYTES,
    REPLY_BIT,
    MetaReader,
    MetaWriter,
    Op,
    Status,
    pack_header,
)
from tests.functional.agents import Agent, metric, payload, running_agent
from tests.functional.raw_sockets import recv_exactly
from tests.functional.test_remote import SLOW_GPU, SMALL, chain, link_costed, put_chain, remote
from tests.functional.waiting import wait_until

CHUNK_BYTES = 1 << 20


@dataclass
class FlippingRelay:
    """A loopback relay to an agent's data plane that, while ``flipping`` is set, flips one
    bit in the middle of each chunk of every FETCH reply's payload (1 MiB chunks); the
    metadata, HELLO and PROBE replies pass untouched."""

    target: tuple[str, int]
    flipping: threading.Event = field(default_factory=threading.Event)
    flipped_chunks: int = 0
    address: str = ""

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _upstream(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while data := client.recv(1 << 16):
                server.sendall(data)
        except OSError:
            pass
        finally:
            server.close()

    def _downstream(self, server: socket.socket, client: socket.socket) -> None:
        try:
            while True:
                head = recv_exactly(server, HEADER_BYTES)
                _magic, _ver, op, _rid, meta_len, payload_len = HEADER.unpack(head)
                client.sendall(head + recv_exactly(server, meta_len))
                body = bytearray(recv_exactly(server, payload_len))
                if op == Op.FETCH | REPLY_BIT and self.flipping.is_set():
                    for at in range(CHUNK_BYTES // 2, payload_len, CHUNK_BYTES):
                        body[at] ^= 0x01
                        self.flipped_chunks += 1
                client.sendall(body)
        except (OSError, ConnectionError):
            pass
        finally:
            client.close()

    def _serve(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            server = socket.create_connection(self.target)
            self._socks += [client, server]
            threading.Thread(target=self._upstream, args=(client, server), daemon=True).start()
            threading.Thread(target=self._downstream, args=(server, client), daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._listener.close()
        for s in self._socks:
            s.close()


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[Agent, FlippingRelay]]:
    """An agent holding chunks, behind a relay that flips bits when told to."""
    with running_agent(tmp_path / "b", "--name", "b", *SMALL) as b:
        host, port = str(b.state.data_tcp).rsplit(":", 1)
        relay = FlippingRelay((host, int(port)))
        try:
            yield b, relay
        finally:
            relay.close()


def test_a_bit_flipped_in_a_peers_reply_is_a_counted_miss_and_never_stored(
    tmp_path: Path, holder: tuple[Agent, FlippingRelay]
) -> None:
    b, relay = holder
    keys = chain(4, seed=41)
    put_chain(b, keys, tenant="t1")
    with running_agent(
        tmp_path / "a", "--name", "a", "--peer", f"pB={relay.address}", *SLOW_GPU, *SMALL
    ) as a:
        wait_until("a to measure its link to pB", link_costed(a, "pB"))
        # a measurement cut short on a loaded machine (the relay is Python) is an error of
        # the source before any flipping: only what the flipped pull adds is checked
        errors_before = remote(a)["peers"][0]["errors"]
        relay.flipping.set()
        with a.data() as d:
            got = d.get_many(keys, tenant="t1")
        assert relay.flipped_chunks >= len(keys)
        assert got == [None] * len(keys)  # misses, not wrong bytes
        peer = remote(a)["peers"][0]
        assert peer["corrupt"] == len(keys)
        # the source is fine; its bytes were not
        assert peer["errors"] == errors_before, peer["last_error"]
        assert metric(a, "kvctl_remote_source_corrupt_total", source="pB") == len(keys)
        with a.data() as d:  # nothing of it was kept here: still only on the peer
            assert d.exists(keys, tenant="t1") == ["peer"] * len(keys)
        assert a.control().stats()["usage"]["cpu"]["chunks"] == 0
        assert a.log().count("fails its checksum") == len(keys)  # once per chunk

        # the same pull, undamaged, verifies and lands: the checksums agree end to end
        relay.flipping.clear()
        with a.data() as d:
            got = d.get_many(keys, tenant="t1")
        assert [bytes(g) for g in got] == [payload(k, CHUNK_BYTES) for k in keys]  # type: ignore[arg-type]
        assert remote(a)["peers"][0]["corrupt"] == len(keys)
        with a.data() as d:
            assert d.exists(keys, tenant="t1") == ["cpu"] * len(keys)


def test_a_chunk_that_fails_its_checksum_gives_its_reserved_view_back(
    holder: tuple[Agent, FlippingRelay],
) -> None:
    """The puller's own path (as an agent's arena reservation uses it): every view ``into``
    gave for a damaged chunk goes to ``unused``, and only undamaged ones are handed over."""
    b, relay = holder
    keys = chain(3, seed=43)
    put_chain(b, keys, tenant="t1")
    source = AgentSource(relay.address, streams=1)
    try:
        for flip in (True, False):
            (relay.flipping.set if flip else relay.flipping.clear)()
            given: dict[int, memoryview] = {}
            freed: list[int] = []
            landed: list[int] = []

            def into(i: int, meta: ChunkMeta, given: dict[int, memoryview] = given) -> memoryview:
                given[i] = memoryview(bytearray(meta.size_bytes))
                return given[i]

            got = source.get_many(
                keys,
                tenant="t1",
                into=into,
                unused=freed.append,
                arrived=lambda i, _chunk, landed=landed: landed.append(i),  # type: ignore[misc]
            )
            if flip:
                assert got == [None] * len(keys) and landed == []
                assert sorted(freed) == sorted(given) == list(range(len(keys)))
                assert source.corrupt == len(keys)
            else:
                assert freed == [] and landed == list(range(len(keys)))
                assert [bytes(c.data) for c in got if c is not None] == [
                    payload(k, CHUNK_BYTES) for k in keys
                ]
                assert source.corrupt == len(keys)  # unchanged
    finally:
        source.close()


def _raw_fetch(address: str, keys: list[bytes], flags: int) -> tuple[bytes, bytes]:
    """(reply metadata, payload) of one FETCH sent as bytes, with the given flag byte."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        hello = MetaWriter().text("").text("raw-test").build()
        s.sendall(pack_header(Op.HELLO, 1, len(hello)) + hello)
        head = HEADER.unpack(recv_exactly(s, HEADER_BYTES))
        info = recv_exactly(s, head[4])
        assert FETCH_CHECKSUM_NAME.encode() in info  # advertised in HELLO
        meta = MetaWriter().text("t1").u8(flags).keys(keys).build()
        s.sendall(pack_header(Op.FETCH, 2, len(meta)) + meta)
        _m, _v, op, _rid, meta_len, payload_len = HEADER.unpack(recv_exactly(s, HEADER_BYTES))
        assert op == Op.FETCH | REPLY_BIT
        return recv_exactly(s, meta_len), recv_exactly(s, payload_len)


def _items(r: MetaReader) -> list[tuple[int, int]]:
    """(status, size) of each item of a FETCH reply."""
    out = []
    for _ in range(r.count()):
        status, size, *_rest = r.structs(FETCH_ITEM, 1)[0]
        r.text()
        out.append((status, size))
    return out


def test_an_old_style_request_gets_the_old_reply_and_a_new_one_the_checksums(
    holder: tuple[Agent, FlippingRelay],
) -> None:
    b, _relay = holder
    keys = chain(2, seed=47)
    put_chain(b, keys, tenant="t1")
    asked = [*keys, bytes(16)]  # the last one is missing
    address = str(b.state.data_tcp)

    for old_flags in (0, 1):  # what clients before checksums send: no trailing field
        meta, body = _raw_fetch(address, asked, old_flags)
        r = MetaReader(meta)
        assert [st for st, _ in _items(r)] == [Status.OK, Status.OK, Status.MISSING]
        r.done()
        assert len(body) == (len(keys) * CHUNK_BYTES if old_flags else 0)

    meta, body = _raw_fetch(address, asked, 3)
    r = MetaReader(meta)
    items = _items(r)
    sums = [s for (s,) in r.structs(FETCH_CHECKSUM, len(items))]
    r.done()
    expected = [xxhash.xxh3_64_intdigest(payload(k, CHUNK_BYTES)) for k in keys]
    assert sums == [*expected, 0]
    assert body == b"".join(payload(k, CHUNK_BYTES) for k in keys)

    # a flag byte no client sends is refused, and the connection stays usable
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        hello = MetaWriter().text("").text("raw-test").build()
        s.sendall(pack_header(Op.HELLO, 1, len(hello)) + hello)
        head = HEADER.unpack(recv_exactly(s, HEADER_BYTES))
        recv_exactly(s, head[4])
        for rid, flags in enumerate((2, 0x81, 1), start=2):
            meta = MetaWriter().text("t1").u8(flags).keys(keys).build()
            s.sendall(pack_header(Op.FETCH, rid, len(meta)) + meta)
            _m, _v, op, _rid, meta_len, payload_len = HEADER.unpack(recv_exactly(s, HEADER_BYTES))
            reply = recv_exactly(s, meta_len)
            recv_exactly(s, payload_len)
            if flags == 1:
                assert op == Op.FETCH | REPLY_BIT
            else:
                assert op == Op.ERROR and struct.unpack("<H", reply[:2])[0] == 5  # BAD_REQUEST
