"""One source address cannot fill the data plane's TCP connection cap with connections that
never authenticate (review of the agent's resource use): each is cut off by the HELLO deadline,
but reopened at once they held every slot, and engines and peers from other addresses were
refused. Such connections count against their address's ``data_max_unauthenticated_per_source``;
authenticated ones and the Unix socket do not.

Served in this process by a real ``DataPlaneServer`` over a real store. 127.0.0.2 is a source
address of its own on Linux's loopback."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.settings import AgentSettings
from kvctl.store.tiers.cpu import CpuTier
from kvctl.wire.protocol import (
    HEADER,
    HEADER_BYTES,
    ErrorCode,
    MetaWriter,
    Op,
    pack_header,
    parse_error,
)
from tests.functional.inprocess_node import InProcessNode
from tests.functional.raw_sockets import closed_within, recv_exactly

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 is Linux's loopback")

TOKEN = "t0ken-for-the-per-source-test"
MAX_CONNECTIONS = 4
PER_SOURCE = 2
#: long enough that the held connections are not cut off while the test runs
HELLO_TIMEOUT_S = 60.0
REPLY = 0x80


@pytest.fixture
def node(tmp_path: Path) -> Iterator[InProcessNode]:
    settings = AgentSettings(
        name="per-source",
        data_dir=str(tmp_path),
        cpu_bytes=4 << 20,
        token=TOKEN,
        data_max_unauthenticated_per_source=PER_SOURCE,
    )
    n = InProcessNode(
        tmp_path,
        settings,
        [CpuTier(4 << 20, shared=True)],
        max_connections=MAX_CONNECTIONS,
        hello_timeout_s=HELLO_TIMEOUT_S,
    )
    yield n
    n.close()


def _tcp_from(node: InProcessNode, source: str) -> socket.socket:
    return socket.create_connection(node.tcp, timeout=10, source_address=(source, 0))


def _unix(node: InProcessNode) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(node.unix)
    return sock


def _reply(sock: socket.socket) -> tuple[int, bytes]:
    """(op, meta) of the next frame; ConnectionError at EOF."""
    _magic, _version, op, _rid, meta_len, payload_len = HEADER.unpack(
        recv_exactly(sock, HEADER_BYTES)
    )
    meta = recv_exactly(sock, meta_len)
    recv_exactly(sock, payload_len)
    return op, meta


def _hello_and_ping(sock: socket.socket) -> None:
    """Authenticate, then one request: the connection is served."""
    meta = MetaWriter().text(TOKEN).text("per-source-test").build()
    sock.sendall(pack_header(Op.HELLO, 1, len(meta)) + meta)
    op, reply = _reply(sock)
    assert op == Op.HELLO | REPLY, parse_error(reply) if op == Op.ERROR else op
    sock.sendall(pack_header(Op.PING, 2, 0))
    assert _reply(sock)[0] == Op.PING | REPLY


def _refused(sock: socket.socket) -> str:
    """The BUSY error a refused connection gets, before it is closed; its message."""
    op, meta = _reply(sock)
    assert op == Op.ERROR, f"expected a refusal, got op {op}"
    code, message = parse_error(meta)
    assert code == ErrorCode.BUSY, message
    assert closed_within(sock)
    return message


def test_one_address_holds_its_share_of_unauthenticated_slots_not_all(
    node: InProcessNode,
) -> None:
    # an address opens as many silent connections as the whole TCP cap
    flood = [_tcp_from(node, "127.0.0.1") for _ in range(MAX_CONNECTIONS)]
    held, over = flood[:PER_SOURCE], flood[PER_SOURCE:]
    for sock in over:
        message = _refused(sock)
        assert f"at most {PER_SOURCE} connections that have not authenticated" in message
    refusals = node.server.refused_connections.by_reason
    assert refusals == {"data_max_unauthenticated_per_source": MAX_CONNECTIONS - PER_SOURCE}
    # another address still gets a slot, and authenticates
    other = _tcp_from(node, "127.0.0.2")
    _hello_and_ping(other)
    # the held ones were served all along: they authenticate, and then no longer count, so
    # their address may open more (up to the transport's cap) and authenticate those too
    for sock in held:
        _hello_and_ping(sock)
    more = _tcp_from(node, "127.0.0.1")
    _hello_and_ping(more)
    assert node.server.refused_connections.total == MAX_CONNECTIONS - PER_SOURCE
    for sock in [*flood, other, more]:
        sock.close()


def test_the_unix_socket_has_no_per_source_cap(node: InProcessNode) -> None:
    local = [_unix(node) for _ in range(PER_SOURCE + 1)]  # silent, past the TCP share
    for sock in local:
        _hello_and_ping(sock)
    assert node.server.refused_connections.total == 0
    for sock in local:
        sock.close()
