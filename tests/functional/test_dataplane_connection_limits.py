"""What a data-plane client can make the agent hold before and after it authenticates (review
of the agent's resource use): connections (a cap per transport, a deadline for the first
frame), reads before the token (only a small HELLO), descriptors passed on the Unix socket
(none kept that the frame may not pass), lease records (a key named twice is leased once, a cap
per connection) and LOOKUP_MANY (empty chains are not counted, keys are capped per frame).

Served in this process by a real ``DataPlaneServer`` over a real store, with short limits."""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvctl.agent import dataplane
from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient, RequestError
from kvctl.store.tiers.cpu import CpuTier
from kvctl.wire.protocol import (
    HEADER,
    HEADER_BYTES,
    MAX_HELLO_META_BYTES,
    MAX_LOOKUP_MANY_KEYS,
    ErrorCode,
    MetaWriter,
    Op,
    pack_header,
    parse_error,
)
from tests.functional.agents import key, payload
from tests.functional.inprocess_node import InProcessNode
from tests.functional.raw_sockets import closed_within, recv_exactly
from tests.functional.waiting import wait_until

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="/proc and SCM_RIGHTS are Linux")

TOKEN = "t0ken-for-the-limits-test"
HELLO_TIMEOUT_S = 0.5
MAX_CONNECTIONS = 4
REPLY = 0x80


class Node(InProcessNode):
    def __init__(self, tmp_path: Path, **settings: Any) -> None:
        config = AgentSettings(
            name="limits", data_dir=str(tmp_path), cpu_bytes=4 << 20, token=TOKEN, **settings
        )
        super().__init__(
            tmp_path,
            config,
            [CpuTier(4 << 20, shared=True)],
            max_connections=MAX_CONNECTIONS,
            hello_timeout_s=HELLO_TIMEOUT_S,
        )

    def client(self, transport: str = "unix") -> DataClient:
        address = self.unix if transport == "unix" else f"{self.tcp[0]}:{self.tcp[1]}"
        return DataClient.connect(address, token=TOKEN)

    def raw(self, transport: str = "tcp") -> socket.socket:
        if transport == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(self.unix)
            return sock
        return socket.create_connection(self.tcp, timeout=10)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.close()


def _frame(sock: socket.socket) -> tuple[int, bytes]:
    """(op, meta) of the next frame (any payload read and dropped); ConnectionError at EOF."""
    head = recv_exactly(sock, HEADER_BYTES)
    _magic, _version, op, _rid, meta_len, payload_len = HEADER.unpack(head)
    meta = recv_exactly(sock, meta_len)
    recv_exactly(sock, payload_len)
    return op, meta


def _error(sock: socket.socket) -> tuple[int, str]:
    op, meta = _frame(sock)
    assert op == Op.ERROR, f"expected an ERROR frame, got op {op}"
    return parse_error(meta)


def _hello(sock: socket.socket, token: str = TOKEN) -> None:
    meta = MetaWriter().text(token).text("limits-test").build()
    sock.sendall(pack_header(Op.HELLO, 1, len(meta)) + meta)
    op, _ = _frame(sock)
    assert op == Op.HELLO | REPLY


def _ping(sock: socket.socket) -> int:
    sock.sendall(pack_header(Op.PING, 2, 0))
    return _frame(sock)[0]


# --- 1: connections -----------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_connection_that_sends_no_hello_is_closed_after_the_deadline(
    node: Node, transport: str
) -> None:
    silent = node.raw(transport)
    started = time.monotonic()
    code, message = _error(silent)
    assert code == ErrorCode.TIMEOUT and "HELLO" in message, message
    assert closed_within(silent)
    assert time.monotonic() - started < HELLO_TIMEOUT_S + 3
    # one that said HELLO in time may stay idle as long as it likes
    talker = node.raw(transport)
    _hello(talker)
    time.sleep(HELLO_TIMEOUT_S + 1.2)
    assert _ping(talker) == Op.PING | REPLY
    silent.close()
    talker.close()


def test_a_hello_trickled_past_the_deadline_is_cut_off(node: Node) -> None:
    sock = node.raw()
    meta = MetaWriter().text(TOKEN).text("slow").build()
    sock.sendall(pack_header(Op.HELLO, 1, len(meta)))
    deadline = time.monotonic() + HELLO_TIMEOUT_S + 3
    cut = False
    for byte in meta:  # one byte every 0.2 s: each arrives well within any per-read timeout
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            cut = True
            break
        time.sleep(0.2)
        if time.monotonic() > deadline:
            break
    assert cut or closed_within(sock)
    sock.close()


def _all_busy(node: Node) -> bool:
    with node.server._lock:
        return all(c.busy_since is not None for c in node.server._conns)


def test_connections_past_the_cap_are_closed_at_once_and_logged_once(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    held = [node.raw() for _ in range(MAX_CONNECTIONS)]
    for sock in held:
        _hello(sock)
        # mid-frame (a header's first byte), not idle: an idle one would be closed to make
        # room (tests/functional/test_dataplane_idle_connections.py)
        sock.sendall(pack_header(Op.PING, 2, 0)[:1])
    wait_until("the held connections to be mid-frame", lambda: _all_busy(node), 10)
    caplog.set_level(logging.WARNING, logger="kvctl.agent.dataplane")
    refused = []
    for _ in range(3):
        sock = node.raw()
        code, message = _error(sock)
        assert code == ErrorCode.BUSY and f"at most {MAX_CONNECTIONS}" in message, message
        assert closed_within(sock)
        refused.append(sock)
    assert node.server.refused_connections.total == 3
    lines = [r for r in caplog.records if "data_max_connections" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    # the Unix socket has a cap of its own: a TCP flood does not lock local engines out
    with node.client("unix") as local:
        assert local.ping() >= 0
    # a slot comes back when a connection ends
    held.pop().close()
    wait_until("a slot to free", lambda: node.server._open["tcp"] < MAX_CONNECTIONS, 10)
    with node.client("tcp") as again:
        assert again.ping() >= 0
    for sock in held + refused:
        sock.close()


def test_silent_connections_cut_before_hello_are_logged_once(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvctl.agent.dataplane")
    socks = [node.raw() for _ in range(3)]
    for sock in socks:
        assert closed_within(sock)
        sock.close()
    wait_until("three cut-offs", lambda: node.server.hello_timeouts.total == 3, 10)
    lines = [r for r in caplog.records if "sent no first frame" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


# --- 4: before the token --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("op", "meta_len", "payload_len", "code"),
    [
        (Op.LOOKUP, 8 << 20, 0, ErrorCode.UNAUTHORIZED),  # its metadata was read first
        (99, 0, 1 << 30, ErrorCode.UNAUTHORIZED),  # an unknown op's payload was read and dropped
        (Op.PUT, 16, 1 << 30, ErrorCode.UNAUTHORIZED),
        (Op.HELLO, MAX_HELLO_META_BYTES + 1, 0, ErrorCode.TOO_LARGE),
        (Op.HELLO, 16, 1 << 20, ErrorCode.BAD_FRAME),
    ],
)
def test_before_the_token_only_a_small_hello_is_read(
    node: Node, op: int, meta_len: int, payload_len: int, code: ErrorCode
) -> None:
    """Each header alone, its body never sent: the answer must come without waiting for it."""
    sock = node.raw()
    sock.settimeout(HELLO_TIMEOUT_S * 0.8)  # sooner than the HELLO deadline could answer
    sock.sendall(pack_header(op, 7, meta_len, payload_len))
    got, message = _error(sock)
    assert got == code, message
    sock.settimeout(5)
    assert closed_within(sock)
    sock.close()
    with node.client("tcp") as fine:  # and with the token, all is as before
        k = key(1)
        assert fine.put(k, payload(k, 4096), tenant="t") == "cpu"


# --- 3: descriptors on the Unix socket -------------------------------------------------------
def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_descriptors_a_frame_may_not_pass_are_closed_as_they_arrive(node: Node) -> None:
    sock = node.raw("unix")
    _hello(sock)
    messages = 500
    sock.sendall(pack_header(Op.PING, 3, messages + 16))  # its metadata sent byte by byte
    devnull = os.open("/dev/null", os.O_RDONLY)
    before = _open_fds()
    fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("4i", *[devnull] * 4))]
    try:
        for _ in range(messages):
            sock.sendmsg([b"x"], fds)
        time.sleep(0.5)  # the agent reads each message as it comes
        # the agent's half of the test process: it held 4 per message, 2,000 in all
        assert _open_fds() - before < 50
        sock.sendall(bytes(16))  # the frame ends
        code, message = _error(sock)
        assert code == ErrorCode.BAD_REQUEST and "may pass none" in message, message
        assert _ping(sock) == Op.PING | REPLY  # refused, in step: the connection goes on
    finally:
        os.close(devnull)
        sock.close()


# --- 5: lease records -------------------------------------------------------------------------
def test_a_key_named_many_times_in_one_lease_is_leased_once(node: Node) -> None:
    with node.client("unix") as c:
        k = key(5)
        c.put(k, payload(k, 4096), tenant="t")
        leases = c.hold([k] * 4096, tenant="t")
        assert node.leases() == 1
        assert all(chunk is not None for chunk in leases.chunks) and not leases.missing
        assert bytes(leases.view(4095)) == payload(k, 4096)
        c.release_pending()
        wait_until("the leases to end", lambda: node.leases() == 0, 5)
        with c.leased([k, k], tenant="t") as held:
            assert node.leases() == 1
            assert bytes(held.view(0)) == bytes(held.view(1)) == payload(k, 4096)
        wait_until("the leases to end", lambda: node.leases() == 0, 5)


def test_a_connection_holds_at_most_its_share_of_leases(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dataplane, "MAX_LEASES_PER_CONNECTION", 8)
    keys = [key(i, 6) for i in range(9)]
    with node.client("unix") as c:
        for k in keys:
            c.put(k, payload(k, 1024), tenant="t")
        c.hold(keys[:8], tenant="t")
        with pytest.raises(RequestError) as err:
            c.hold(keys[8:], tenant="t")
        assert err.value.code == ErrorCode.BAD_REQUEST
        assert "limit of 8" in str(err.value) and "release" in str(err.value)
        assert node.leases() == 8
        c.release_pending()
        c.hold(keys[1:], tenant="t")  # released leases stop counting
        assert node.leases() == 8
        c.release_pending()
        # a RELEASE has no reply: another connection's call may overtake it (the CI saw 16)
        wait_until("the releases to land", lambda: node.leases() == 0)
        with node.client("unix") as other:  # the limit is per connection
            other.hold(keys[:8], tenant="t")
            assert node.leases() == 8


# --- 6: LOOKUP_MANY -------------------------------------------------------------------------
def test_empty_chains_in_lookup_many_are_misses_not_lookups(node: Node) -> None:
    with node.client("tcp") as c:
        k = key(7)
        c.put(k, payload(k, 1024), tenant="t")
        before = node.lookups()
        results = c.lookup_many([[]] * 1000 + [[k]], tenant="t")
        assert node.lookups() - before == 1
        assert [r.matched_chunks for r in results] == [0] * 1000 + [1]
        assert results[0].locations == ()


def test_lookup_many_caps_its_keys_in_all(node: Node) -> None:
    chains = [[key(i, 8)] * 1024 for i in range(MAX_LOOKUP_MANY_KEYS // 1024 + 1)]
    with node.client("tcp") as c, pytest.raises(ValueError, match="at most"):
        c.lookup_many(chains, tenant="t")  # refused before it is sent
    sock = node.raw()
    _hello(sock)
    w = MetaWriter().text("t").u32(len(chains))
    for chain in chains:
        w.keys(chain)
    meta = w.build()
    before = node.lookups()
    sock.sendall(pack_header(Op.LOOKUP_MANY, 4, len(meta)) + meta)
    code, message = _error(sock)
    assert code == ErrorCode.BAD_REQUEST and str(MAX_LOOKUP_MANY_KEYS) in message, message
    assert node.lookups() == before
    assert _ping(sock) == Op.PING | REPLY
    sock.close()


def test_lookup_many_reads_no_key_past_its_cap(node: Node) -> None:
    # a frame naming more keys than the cap is refused once its chains pass it, before the rest
    # is read: it was read whole first, every key a Python object, so a frame of 8 MiB of keys
    # (522,240 of them) took about 29 MiB to be refused, on each connection at once. Here the
    # chain past the cap is cut short: read, it would be refused as truncated instead
    sock = node.raw()
    _hello(sock)
    full = [[key(i, 9)] * 1024 for i in range(MAX_LOOKUP_MANY_KEYS // 1024)]
    w = MetaWriter().text("t").u32(len(full) + 2)
    for chain in full:
        w.keys(chain)
    meta = w.keys([key(0, 10)]).u32(1024).raw(key(1, 10)).build()  # the last chain: 1 key of 1024
    before = node.lookups()
    sock.sendall(pack_header(Op.LOOKUP_MANY, 5, len(meta)) + meta)
    code, message = _error(sock)
    assert code == ErrorCode.BAD_REQUEST and str(MAX_LOOKUP_MANY_KEYS) in message, message
    assert "truncated" not in message, message
    assert node.lookups() == before
    assert _ping(sock) == Op.PING | REPLY
    sock.close()
