"""A connection the data plane fails to take for any reason (MemoryError building its
Connection, or starting its thread) costs that connection only. Found in review: the accept
loop survived a thread that failed to start with RuntimeError, but any other exception there
ended the loop, and every connection after sat unanswered in the backlog until the agent
restarted. Served in this process, so the failure can be injected where it happens."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvctl.agent.dataplane as dataplane
from kvctl.agent.settings import AgentSettings
from kvctl.store.tiers.cpu import CpuTier
from kvctl.wire.protocol import HEADER, HEADER_BYTES, Op
from tests.functional.inprocess_node import InProcessNode
from tests.functional.raw_sockets import hello_answer_op, recv_or_eof


@pytest.fixture
def node(tmp_path: Path) -> Iterator[InProcessNode]:
    settings = AgentSettings(name="take", data_dir=str(tmp_path), cpu_bytes=16 << 20)
    # two connections at most: a slot the failed one kept would refuse the second served
    n = InProcessNode(tmp_path, settings, [CpuTier(16 << 20)], max_connections=2)
    try:
        yield n
    finally:
        n.close()


class _NoThread:
    """A thread that cannot start for want of memory (not RuntimeError, which was handled)."""

    def start(self) -> None:
        raise MemoryError("no memory for a thread (injected)")


@pytest.mark.parametrize("fails", ["building", "starting"])
def test_a_connection_that_cannot_be_taken_costs_that_connection_only(
    node: InProcessNode,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fails: str,
) -> None:
    real = dataplane.Connection
    failures = [1]  # the first connection fails, the next are served

    def flaky(*args: Any, **kwargs: Any) -> Any:
        if failures and fails == "building":
            failures.pop()
            raise MemoryError("no memory for a Connection (injected)")
        conn = real(*args, **kwargs)
        if failures:
            failures.pop()
            conn.thread = _NoThread()
        return conn

    monkeypatch.setattr(dataplane, "Connection", flaky)
    with caplog.at_level(logging.ERROR, logger="kvctl.agent.dataplane"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as first:
            first.settimeout(20.0)
            first.connect(node.unix)
            # refused (BUSY) and closed, unasked: never served, never left hanging
            head = recv_or_eof(first, HEADER_BYTES)
            assert not head or HEADER.unpack(head)[2] == Op.ERROR, head
            while first.recv(1 << 16):  # then closed (a timeout here: left open)
                pass
        # the loop lives on, and the failed one kept no slot: two served, both held open
        with contextlib.ExitStack() as held:
            for _ in range(2):
                sock = held.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
                sock.settimeout(20.0)
                sock.connect(node.unix)
                assert hello_answer_op(sock, "take") == Op.HELLO | 0x80
    lines = [r.getMessage() for r in caplog.records if "could not take" in r.getMessage()]
    assert len(lines) == 1 and "MemoryError" in lines[0], lines


def test_an_accept_that_fails_for_want_of_memory_does_not_end_the_loop(
    node: InProcessNode, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """MemoryError from accept itself (making the new socket's object): only OSError was
    caught there, so it ended the loop too. Each listening socket's next accept fails once."""
    real_accept = socket.socket.accept
    failed: set[int] = set()

    # this node's listening sockets only: another agent still serving in this process (one an
    # earlier test left, in a full-suite run) would fill ``failed`` past 2
    ours = {node.unix, tuple(node.tcp)}

    def accept_once_short(self: socket.socket) -> tuple[socket.socket, Any]:
        name = self.getsockname()
        if (name if isinstance(name, str) else tuple(name[:2])) in ours and id(self) not in failed:
            failed.add(id(self))
            raise MemoryError("no memory for the accepted socket (injected)")
        return real_accept(self)

    with caplog.at_level(logging.ERROR, logger="kvctl.agent.dataplane"):
        monkeypatch.setattr(socket.socket, "accept", accept_once_short)
        # both loops (Unix, TCP) failed once before the client comes: each wakes to accept
        # again every 0.25 s
        for _ in range(400):
            if len(failed) == 2:
                break
            time.sleep(0.05)
        assert len(failed) == 2, "the accept loops never called accept again"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20.0)
            sock.connect(node.unix)
            assert hello_answer_op(sock, "take") == Op.HELLO | 0x80
    lines = [r.getMessage() for r in caplog.records if "accept failed" in r.getMessage()]
    assert lines and "no memory for the accepted socket" in lines[0], lines
