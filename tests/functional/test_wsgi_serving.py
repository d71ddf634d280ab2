"""The dashboard tests' in-process waitress server stops whole: no thread of it left, and a
connection a browser kept alive closed, so no later request can make it write to a descriptor
number the test process has reused (see tests/wsgi_serving.py)."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from tests.wsgi_serving import serving_wsgi

pytest.importorskip("waitress")

REQUEST = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n"


def _app(environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
    start("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
    return [b"ok"]


def _answer(conn: socket.socket) -> bytes:
    got = b""
    while not got.endswith(b"ok"):
        piece = conn.recv(4096)
        if not piece:
            break
        got += piece
    return got


def test_a_stopped_server_leaves_no_thread_and_no_kept_alive_connection() -> None:
    before = set(threading.enumerate())
    with serving_wsgi(_app) as url:
        port = int(url.rsplit(":", 1)[1])
        conn = socket.create_connection(("127.0.0.1", port), timeout=30)
        conn.sendall(REQUEST)
        assert _answer(conn).startswith(b"HTTP/1.1 200")  # kept alive by the server
    try:
        left = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
        assert left == []
        r, w = os.pipe()  # likely the numbers of the server's closed wake-up pipe
        try:
            os.set_blocking(r, False)
            conn.settimeout(5)
            with pytest.raises(OSError):  # reset, or closed at once: nothing answers
                conn.sendall(REQUEST)
                if conn.recv(4096) == b"":
                    raise ConnectionResetError("closed by the stopped server")
            with pytest.raises(BlockingIOError):
                os.read(r, 1)  # no stray byte written by the stopped server
        finally:
            os.close(r)
            os.close(w)
    finally:
        conn.close()
