"""The data plane's byte counters count the bytes a frame really brought, not the lengths its
header declares: a frame refused before its body is read (a payload on an op that carries
none), or whose sender stopped short of its payload, counted all it declared as received, so
one 20-byte header added a terabyte to ``kvctl_dataplane_bytes_total{direction="in"}``, and a
few hundred of them put the counter past 2**53, where a float counter no longer counts real
traffic byte by byte."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvctl.wire.protocol import (
    HEADER_BYTES,
    ErrorCode,
    MetaWriter,
    Op,
    pack_header,
    parse_error,
    put_item,
    put_meta,
)

from .agents import key, metric, running_agent
from .raw_sockets import closed_within, recv_exactly

DECLARED = 1 << 40  # a payload no frame brings: within the agent's limit, never sent
CHUNK = 1 << 20


def _frame(sock: socket.socket) -> tuple[int, bytes]:
    head = recv_exactly(sock, HEADER_BYTES)
    meta = recv_exactly(sock, int.from_bytes(head[8:12], "little"))
    return head[3], meta


@pytest.mark.parametrize("how", ["payload_on_get", "put_cut_short"])
def test_a_frame_counts_the_bytes_it_brought_not_those_it_declared(
    tmp_path: Path, how: str
) -> None:
    with running_agent(tmp_path / "a") as agent:
        assert agent.state.data_tcp is not None
        host, port = agent.state.data_tcp.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=20) as sock:
            hello = MetaWriter().text("").text("hostile").build()
            sock.sendall(pack_header(Op.HELLO, 1, len(hello)) + hello)
            sent = HEADER_BYTES + len(hello)
            assert _frame(sock)[0] == Op.HELLO | 0x80
            if how == "payload_on_get":
                sock.sendall(pack_header(Op.GET, 2, 0, DECLARED))
                sent += HEADER_BYTES
                op, meta = _frame(sock)
                assert op == Op.ERROR and parse_error(meta)[0] == ErrorCode.BAD_FRAME
                counted_op = "get"
            else:  # 1,000 chunks of 1 MiB declared, 100 bytes of the first sent
                items = [put_item(key(i, 7), CHUNK) for i in range(1000)]
                meta = put_meta("t", items)
                frame = pack_header(Op.PUT, 2, len(meta), CHUNK * len(items)) + meta
                sock.sendall(frame + bytes(100))
                sent += len(frame) + 100
                sock.shutdown(socket.SHUT_WR)
                counted_op = "put"
            assert closed_within(sock, 20)  # the request is counted before the agent closes
        counted = metric(agent, "kvctl_dataplane_requests_total", op=counted_op, outcome="error")
        assert counted == 1
        received = metric(agent, "kvctl_dataplane_bytes_total", direction="in", transport="tcp")
        assert received == sent, f"{received:.0f} bytes counted in, {sent} sent"
