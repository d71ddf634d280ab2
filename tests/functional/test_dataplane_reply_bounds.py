"""What one GET or FETCH reply may cost the agent, found by experiment against a real agent:

- A chunk that cannot be leased in the arena (pinned on disk, no room) is sent as a copy. One
  GET naming such a chunk 400 times, never read, made the agent hold 400 copies (RSS 140 MiB
  -> 1742 MiB, until the client closed), and distinct keys copied a whole disk tier into memory
  before the first byte went out. Now a key named twice is copied once, and the copies all
  replies hold share a budget (``data_put_budget_bytes``): past it a chunk is answered missing.
- The stall cut-off credited a reply's bytes before they were sent, so a reader that never
  read a large reply held its connection and leases for as long as the reply's size bought
  (an 8000 MiB reply: over two hours). Now only bytes the kernel took earn time.

The data plane runs in the test's process, so memory is measured with tracemalloc and the stall
cut-off's grace is 1 s."""

from __future__ import annotations

import os
import socket
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from kvctl.wire.protocol import (
    FETCH_CHECKSUM,
    FETCH_CHECKSUMS,
    FETCH_ITEM,
    FETCH_PAYLOAD,
    GET_ITEM,
    HEADER,
    HEADER_BYTES,
    REPLY_BIT,
    MetaReader,
    MetaWriter,
    Op,
    Status,
    chunk_checksum,
    pack_header,
)
from tests.functional.agents import key, payload

CHUNK = 256 << 10
#: how long a test waits for what must happen before it calls it a hang
HANG_GUARD_S = 60.0


class Node:
    """A cpu and a disk tier and their data plane, served in the test's process."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        cpu_bytes: int = 1 << 20,
        max_chunk_bytes: int = 4 << 20,
        copy_budget_bytes: int | None = None,
        frame_timeout_s: float | None = None,
    ) -> None:
        settings = AgentSettings(
            name="rb", data_dir=str(tmp_path), cpu_bytes=cpu_bytes, max_chunk_bytes=max_chunk_bytes
        )
        self.store = TieredStore(
            [CpuTier(cpu_bytes, shared=True), DiskTier(tmp_path / "d", 64 << 20)]
        )
        self.runtime = AgentRuntime(settings, self.store)
        self.server = DataPlaneServer(
            self.runtime, copy_budget_bytes=copy_budget_bytes, frame_timeout_s=frame_timeout_s
        )
        self.address = self.server.listen_tcp("127.0.0.1", 0)[:2]
        self.server.start()

    def connect(self, rcvbuf_bytes: int | None = None) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf_bytes is not None:  # before connect, so the window starts small
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
        s.settimeout(HANG_GUARD_S)
        s.connect(self.address)
        # a first frame served, so a long reply is not taken for a connection that never spoke
        _send(s, Op.PING, b"")
        assert _read_reply(s, Op.PING) == (b"", b"")
        return s

    def close(self) -> None:
        self.server.stop()
        self.runtime.close()


@pytest.fixture
def tracing() -> Iterator[None]:
    tracemalloc.start()
    yield
    tracemalloc.stop()


def _on_disk(node: Node, keys: list[bytes]) -> None:
    """Store the chunks pinned on disk: a reply can only send copies of them."""
    for k in keys:
        node.store.put(k, payload(k, CHUNK))
    assert node.store.pin(keys, tier="disk").done == len(keys)
    assert node.store.locate(keys) == ["disk"] * len(keys)


def _send(s: socket.socket, op: Op, meta: bytes) -> None:
    s.sendall(pack_header(op, 7, len(meta), 0) + meta)


def _get_meta(keys: list[bytes]) -> bytes:
    return MetaWriter().text("").keys(keys).build()


def _wait_for_reply_start(s: socket.socket) -> None:
    """Until the reply's first byte has arrived: the reply is built and being sent."""
    assert len(s.recv(1, socket.MSG_PEEK)) == 1, "closed before replying"


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:])
        assert k, f"closed after {got} of {n} bytes"
        got += k
    return bytes(buf)


def _read_reply(s: socket.socket, op: Op) -> tuple[bytes, bytes]:
    _magic, _version, got_op, _rid, meta_len, payload_len = HEADER.unpack(
        _recv_exactly(s, HEADER_BYTES)
    )
    assert got_op == op | REPLY_BIT
    return _recv_exactly(s, meta_len), _recv_exactly(s, payload_len)


def _get_statuses(meta: bytes) -> list[tuple[int, int]]:
    r = MetaReader(memoryview(meta))
    return r.structs(GET_ITEM, r.count())


def _held_bytes(baseline: int) -> int:
    return tracemalloc.get_traced_memory()[0] - baseline


def test_a_get_naming_one_unleasable_chunk_many_times_holds_one_copy(
    tmp_path: Path, tracing: None
) -> None:
    node = Node(tmp_path)
    try:
        k = key(1, 61)
        _on_disk(node, [k])
        n = 200  # 50 MiB of reply
        with node.connect(rcvbuf_bytes=4096) as s:
            baseline = tracemalloc.get_traced_memory()[0]
            _send(s, Op.GET, _get_meta([k] * n))
            _wait_for_reply_start(s)
            held = _held_bytes(baseline)
            assert held < 3 * CHUNK, f"{held} bytes held for a reply of one chunk named {n} times"
            meta, data = _read_reply(s, Op.GET)
        assert _get_statuses(meta) == [(Status.OK, CHUNK)] * n
        assert data == payload(k, CHUNK) * n
        assert node.server.copy_budget.free_bytes == node.server.copy_budget.total_bytes
    finally:
        node.close()


def test_a_fetch_naming_one_unleasable_chunk_many_times_holds_one_copy(
    tmp_path: Path, tracing: None
) -> None:
    node = Node(tmp_path)
    try:
        k = key(2, 61)
        _on_disk(node, [k])
        n = 200
        meta_out = MetaWriter().text("").u8(FETCH_PAYLOAD | FETCH_CHECKSUMS).keys([k] * n).build()
        with node.connect(rcvbuf_bytes=4096) as s:
            baseline = tracemalloc.get_traced_memory()[0]
            _send(s, Op.FETCH, meta_out)
            _wait_for_reply_start(s)
            held = _held_bytes(baseline)
            assert held < 3 * CHUNK, f"{held} bytes held for a reply of one chunk named {n} times"
            meta, data = _read_reply(s, Op.FETCH)
        r = MetaReader(memoryview(meta))
        assert r.count() == n
        for _ in range(n):
            assert r.structs(FETCH_ITEM, 1)[0][0] == Status.OK
            r.text()
        want = chunk_checksum(payload(k, CHUNK))
        assert r.structs(FETCH_CHECKSUM, n) == [(want,)] * n
        assert data == payload(k, CHUNK) * n
    finally:
        node.close()


def test_copies_of_distinct_unleasable_chunks_stay_within_the_budget(
    tmp_path: Path, tracing: None
) -> None:
    """32 chunks pinned on disk (8 MiB), a copy budget of four: a GET never read holds four
    copies; the rest of its batch is answered missing; once it is read, the budget is free."""
    node = Node(tmp_path, max_chunk_bytes=CHUNK, copy_budget_bytes=4 * CHUNK)
    try:
        keys = [key(i, 62) for i in range(32)]
        _on_disk(node, keys)
        with node.connect(rcvbuf_bytes=4096) as s:
            baseline = tracemalloc.get_traced_memory()[0]
            _send(s, Op.GET, _get_meta(keys))
            _wait_for_reply_start(s)
            held = _held_bytes(baseline)
            assert held < 5 * CHUNK, f"{held} bytes held for a reply within a 1 MiB budget"
            meta, data = _read_reply(s, Op.GET)
            assert _get_statuses(meta) == [(Status.OK, CHUNK)] * 4 + [(Status.MISSING, 0)] * 28
            assert data == b"".join(payload(k, CHUNK) for k in keys[:4])
            # sent, so its copies are gone: the next four come whole
            _send(s, Op.GET, _get_meta(keys[4:8]))
            meta, data = _read_reply(s, Op.GET)
        assert _get_statuses(meta) == [(Status.OK, CHUNK)] * 4
        assert data == b"".join(payload(k, CHUNK) for k in keys[4:8])
        assert node.server.copy_budget.free_bytes == node.server.copy_budget.total_bytes
    finally:
        node.close()


def test_a_reader_that_never_reads_a_large_reply_is_cut_off(tmp_path: Path) -> None:
    """A 4 MiB chunk named 2000 times: an 8000 MiB reply, which bought 8000 s before its first
    byte was sent. With a 1 s grace, the reader that never reads is cut off once the few MiB
    its socket buffers took stop earning time, and the reply's lease is released."""
    big = 4 << 20
    node = Node(tmp_path, cpu_bytes=16 << 20, frame_timeout_s=1.0)
    try:
        k = key(3, 63)
        node.store.put(k, os.urandom(big))
        assert node.store.locate([k]) == ["cpu"]  # leased and sent in place
        with node.connect(rcvbuf_bytes=4096) as s:
            _send(s, Op.GET, _get_meta([k] * 2000))
            _wait_for_reply_start(s)
            assert node.store.snapshot()["leases"] == 1
            deadline = time.monotonic() + HANG_GUARD_S
            while node.store.snapshot()["leases"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert node.store.snapshot()["leases"] == 0, "the stalled reader was not cut off"
            got = 0
            try:  # the connection is closed: what the socket buffers took, then its end
                while chunk := s.recv(1 << 20):
                    got += len(chunk)
            except ConnectionResetError:
                pass
            assert got < 2000 * big
    finally:
        node.close()


def test_a_reader_taking_a_large_reply_steadily_is_not_cut_off(tmp_path: Path) -> None:
    """Bytes sent still earn time: a 32 MiB reply read at about 8 MiB/s, four times the 1 s
    grace, arrives whole."""
    big = 4 << 20
    node = Node(tmp_path, cpu_bytes=16 << 20, frame_timeout_s=1.0)
    try:
        k = key(4, 63)
        data = os.urandom(big)
        node.store.put(k, data)
        n = 8
        with node.connect(rcvbuf_bytes=64 << 10) as s:
            _send(s, Op.GET, _get_meta([k] * n))
            got = bytearray()
            while len(got) < HEADER_BYTES + 4 + n * GET_ITEM.size + n * big:
                piece = s.recv(256 << 10)
                assert piece, f"cut off after {len(got)} bytes"
                got += piece
                time.sleep(1 / 32)
        assert got.endswith(data * n)
    finally:
        node.close()
