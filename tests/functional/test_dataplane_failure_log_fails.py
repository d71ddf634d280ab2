"""The accept loop goes on where even the line saying a connection failed cannot be logged.
Found in review of 1ce37ca/9e2472b: a connection the agent could not take, or an accept that
failed, is logged with ``log.error``; short of memory (the case those commits handle), making
that record raises MemoryError too, and raised out of the failure's handling it ended the
loop: every connection after sat unanswered in the backlog until the agent restarted, and
the failed connection's socket was never closed. Served in this process, so the failures can
be injected where they happen."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvctl.agent.dataplane as dataplane
from kvctl.agent.settings import AgentSettings
from kvctl.store.tiers.cpu import CpuTier
from kvctl.wire.protocol import Op
from tests.functional.inprocess_node import InProcessNode
from tests.functional.raw_sockets import hello_answer_op


@pytest.fixture
def node(tmp_path: Path) -> Iterator[InProcessNode]:
    settings = AgentSettings(name="logfail", data_dir=str(tmp_path), cpu_bytes=16 << 20)
    n = InProcessNode(tmp_path, settings, [CpuTier(16 << 20)], max_connections=2)
    try:
        yield n
    finally:
        n.close()


@pytest.mark.parametrize("fails", ["taking", "accepting"])
def test_a_failure_whose_line_cannot_be_logged_does_not_end_the_loop(
    node: InProcessNode, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    first = [1]  # the first failure only; every line after is logged

    def error_short_of_memory(*args: Any, **kwargs: Any) -> None:
        if first:
            first.pop()
            raise MemoryError("no memory for the log record (injected)")

    monkeypatch.setattr(dataplane.log, "error", error_short_of_memory)
    if fails == "taking":
        real = dataplane.Connection
        building = [1]

        def flaky(*args: Any, **kwargs: Any) -> Any:
            if building:
                building.pop()
                raise MemoryError("no memory for a Connection (injected)")
            return real(*args, **kwargs)

        monkeypatch.setattr(dataplane, "Connection", flaky)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as failed:
            failed.settimeout(20.0)
            failed.connect(node.unix)
            # closed (BUSY first, where it could): never left open (a timeout here)
            while failed.recv(1 << 16):
                pass
    else:
        real_accept = socket.socket.accept
        short = [1]

        def accept_short(self: socket.socket) -> tuple[socket.socket, Any]:
            # this node's Unix socket only: accept is patched process-wide
            if short and self.family == socket.AF_UNIX and self.getsockname() == node.unix:
                short.pop()
                raise MemoryError("no memory for the accepted socket (injected)")
            return real_accept(self)

        monkeypatch.setattr(socket.socket, "accept", accept_short)
    # the loop lives on: two connections served, held open together (no slot kept)
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    try:
        for sock in socks:
            sock.settimeout(20.0)
            sock.connect(node.unix)
            # a timeout here: the loop ended
            assert hello_answer_op(sock, "logfail") == Op.HELLO | 0x80
    finally:
        for sock in socks:
            sock.close()
    assert not first, "the injected log failure never happened"
