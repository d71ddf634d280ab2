"""A real agent (uvicorn) refuses a 120 MB control request with 413 and does not take it into
memory: declared by Content-Length it answers before any of the body is sent; streamed
(chunked) it answers once 4 MiB have come and stops reading."""

from __future__ import annotations

import select
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from kvctl.http_guards import DEFAULT_MAX_BODY_BYTES

from .agents import Agent, running_agent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads RSS from /proc")

BODY_BYTES = 120 * 1000 * 1000  # the size of the request that grew an agent by 686 MiB
PIECE_BYTES = 1 << 20


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    with running_agent(tmp_path_factory.mktemp("agent"), "--cpu", "4MiB", "--disk", "0") as a:
        yield a


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _connect(agent: Agent) -> socket.socket:
    url = urlsplit(agent.state.control_url)
    assert url.hostname is not None and url.port is not None
    return socket.create_connection((url.hostname, url.port), timeout=30)


def _head(agent: Agent, extra: str) -> bytes:
    url = urlsplit(agent.state.control_url)
    return (
        f"POST /v1/evict HTTP/1.1\r\nHost: {url.netloc}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def _read_answer(s: socket.socket) -> bytes:
    """Everything the agent sends until it closes the connection."""
    out = b""
    while True:
        try:
            piece = s.recv(65536)
        except ConnectionResetError:
            break
        if not piece:
            break
        out += piece
    return out


def test_declared_oversize_body_is_refused_before_it_is_sent(agent: Agent) -> None:
    rss_before = _rss_bytes(agent.state.pid)
    with _connect(agent) as s:
        s.sendall(_head(agent, f"Content-Length: {BODY_BYTES}\r\n"))
        answer = _read_answer(s)  # not one body byte sent: the agent answers and closes
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"request body over the agent's limit" in answer
    assert agent.control().health()["status"] == "ok"
    # the growth bound is far below the body: a body read into memory grew RSS ~6x its size
    assert _rss_bytes(agent.state.pid) - rss_before < BODY_BYTES // 4


def test_streamed_oversize_body_is_cut_off(agent: Agent) -> None:
    rss_before = _rss_bytes(agent.state.pid)
    piece = b" " * PIECE_BYTES
    frame = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    sent_bytes = 0
    answer = b""
    with _connect(agent) as s:
        s.sendall(_head(agent, "Transfer-Encoding: chunked\r\n") + b'5\r\n{"key\r\n')
        while sent_bytes < BODY_BYTES:
            readable, _, _ = select.select([s], [], [], 0)
            if readable:  # the agent answered: read it before a reset could drop it
                answer = _read_answer(s)
                break
            try:
                s.sendall(frame)
            except (BrokenPipeError, ConnectionResetError):
                answer = _read_answer(s)
                break
            sent_bytes += len(piece)
    assert answer.startswith(b"HTTP/1.1 413 "), (sent_bytes, answer[:200])
    # the agent stopped reading soon after the cap; the socket buffers took the rest sent
    assert sent_bytes < BODY_BYTES // 4, sent_bytes
    assert sent_bytes > DEFAULT_MAX_BODY_BYTES
    assert agent.control().health()["status"] == "ok"
    assert _rss_bytes(agent.state.pid) - rss_before < BODY_BYTES // 4


def test_the_body_cap_is_a_setting(tmp_path: Path) -> None:
    """``max_body_bytes`` in the config file (or KVCTL_MAX_BODY) sets the cap: a 64 KiB body,
    well under the default, is a 413 under a 16 KiB cap."""
    config = tmp_path / "agent.toml"
    config.write_text('[agent]\nmax_body_bytes = "16KiB"\n')
    with running_agent(
        tmp_path / "a", "--config", str(config), "--cpu", "4MiB", "--disk", "0"
    ) as a:
        body = b'{"keys": [' + b" " * (64 << 10) + b"]}"
        with _connect(a) as s:
            s.sendall(_head(a, f"Content-Length: {len(body)}\r\n") + body)
            answer = _read_answer(s)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
