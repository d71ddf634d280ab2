"""A control-API request's body must all arrive within a deadline of its headers (review of the
agent's resource use): a client that sent its head with a Content-Length, then trickled the body
a byte every few seconds, held its connection (one of 256) for ever, also where the server had
answered already without reading the body (a 401 for a missing token). Now the first gets 408,
then the connection closes; the second is closed.

Checked on the daemons' own uvicorn settings (``http_serving.serving_config``) served in this
process with short deadlines, and on the router, whose server uses them too."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvctl import http_serving
from kvctl.http_guards import Receive, Scope, Send
from kvctl.index.model import EmbeddedIndex
from kvctl.remote.fetchplan import PrefillModel
from kvctl.router.app import RouterServer
from kvctl.router.score import Costs
from kvctl.router.service import Router
from kvctl.router.topology import Node, Topology

from .waiting import wait_until

#: the head has longer than the body: an idle kept-alive connection is not what is tested
HEADER_TIMEOUT_S = 5.0
BODY_TIMEOUT_S = 1.0
#: the trickler gives up (and the test fails) after this
TRICKLE_FOR_S = BODY_TIMEOUT_S + 10
TOKEN = "body-deadline-token"


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    """Reads the whole body, then 200 and its length; on /early, 401 without reading it."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/early":
        reply, status = b"no", 401
    else:
        n = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            n += len(message.get("body", b""))
            if not message.get("more_body"):
                break
        reply, status = str(n).encode(), 200
    headers = [(b"content-length", str(len(reply)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": reply})


@pytest.fixture
def api() -> Iterator[tuple[str, int]]:
    """``_app`` served with the daemons' uvicorn settings on loopback; yields (host, port)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    config = http_serving.serving_config(
        _app, "warning", header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    try:
        wait_until("uvicorn to serve", lambda: server.started, 10)
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(20)
        sock.close()


def _trickle_body(sock: socket.socket) -> tuple[bool, bytes]:
    """Send a body byte every 0.2 s (each well within any idle timeout) until the server closes
    the connection, or TRICKLE_FOR_S pass; (whether it closed, all it answered)."""
    answer = b""
    deadline = time.monotonic() + TRICKLE_FOR_S
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"x")
            got = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset, or a send after the close
            return True, answer
        if not got:
            return True, answer
        answer += got
    return False, answer


def _post_head(path: str, length: int, token: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_a_trickled_body_is_answered_408_and_closed(api: tuple[str, int]) -> None:
    slow = socket.create_connection(api, timeout=5)
    slow.sendall(_post_head("/", 1000))
    closed, answer = _trickle_body(slow)
    assert closed, f"still open after {TRICKLE_FOR_S} s of trickling"
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in answer.lower()
    assert f"request body not all received within {BODY_TIMEOUT_S:g} s".encode() in answer
    slow.close()


def test_a_body_trickled_after_an_early_answer_is_closed(api: tuple[str, int]) -> None:
    slow = socket.create_connection(api, timeout=5)
    slow.sendall(_post_head("/early", 1000))
    closed, answer = _trickle_body(slow)
    assert closed, f"still open after {TRICKLE_FOR_S} s of trickling"
    assert answer.startswith(b"HTTP/1.1 401"), answer  # its answer came, then the close
    slow.close()


def test_whole_bodies_are_served_on_a_kept_connection(api: tuple[str, int]) -> None:
    conn = socket.create_connection(api, timeout=5)
    for size in (10, 200_000):  # a large one arrives in many reads
        conn.sendall(_post_head("/", size) + b"y" * size)
        reply = b""
        while not reply.endswith(b"\r\n\r\n" + str(size).encode()):
            got = conn.recv(65536)
            assert got, f"closed; got {reply!r}"
            reply += got
        assert reply.startswith(b"HTTP/1.1 200"), reply
    conn.close()


def test_the_router_answers_a_trickled_body_408(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_serving, "BODY_TIMEOUT_SECONDS", BODY_TIMEOUT_S)
    router = Router(
        EmbeddedIndex(),
        Topology.build([Node("a1", "fra")]),
        Costs(PrefillModel(1e-4, 0.0, "configured: test")),
    )
    with RouterServer(router, listen="127.0.0.1:0", token=TOKEN) as server:
        host, port = server.url.removeprefix("http://").split(":")
        for token, status in ((TOKEN, b"408"), (None, b"401")):
            slow = socket.create_connection((host, int(port)), timeout=5)
            slow.sendall(_post_head("/v1/route", 1000, token) + b'{"keys": [')
            closed, answer = _trickle_body(slow)
            assert closed, f"still open after {TRICKLE_FOR_S} s of trickling"
            assert answer.startswith(b"HTTP/1.1 " + status), answer
            slow.close()
