"""Servers that hold their client: an answer trickled a byte at a time (each byte well within a
read timeout, the whole far past any sensible deadline), its headers or its body, or an answer
far longer than any real one. Each counts what it did, so a test can tell whether the client
read it all."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.not_an_agent import send


class Hostile:
    """What a hostile handler did: requests per path, and answers it finished whole."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.finished: dict[str, int] = {}

    def note(self, table: dict[str, int], path: str) -> None:
        with self.lock:
            table[path] = table.get(path, 0) + 1


def trickle(
    handler: http.server.BaseHTTPRequestHandler,
    body: bytes,
    *,
    every_s: float = 0.05,
    seconds: float = 4.0,
    headers_too: bool = False,
) -> bool:
    """Answer 200 with ``body`` (JSON, whole and valid in the end) after ``seconds`` of spaces
    (or, with ``headers_too``, of a header's value) a byte every ``every_s``; False when the
    client hung up first."""
    try:
        handler.wfile.write(b"HTTP/1.1 200 OK\r\n")
        handler.wfile.flush()
        if headers_too:
            handler.wfile.write(b"X-Slow: ")
        else:
            handler.wfile.write(b"Content-Type: application/json\r\n")
            handler.wfile.write(
                f"Content-Length: {len(body) + round(seconds / every_s)}\r\n\r\n".encode()
            )
        handler.wfile.flush()
        for _ in range(round(seconds / every_s)):
            time.sleep(every_s)
            handler.wfile.write(b"a" if headers_too else b" ")
            handler.wfile.flush()
        if headers_too:
            handler.wfile.write(b"\r\nContent-Type: application/json\r\n")
            handler.wfile.write(f"Content-Length: {len(body)}\r\n\r\n".encode())
        handler.wfile.write(body)
        handler.wfile.flush()
    except OSError:
        return False
    return True


def handler_class(
    hostile: Hostile, answer: Callable[[http.server.BaseHTTPRequestHandler, str], bool | None]
) -> type[http.server.BaseHTTPRequestHandler]:
    """A handler whose every request is ``answer(handler, path)`` (True: it finished whole)."""

    class _Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _any(self) -> None:
            n = int(self.headers.get("content-length") or 0)
            if n:
                self.rfile.read(n)
            path = self.path.split("?", 1)[0]
            hostile.note(hostile.requests, path)
            if answer(self, path):
                hostile.note(hostile.finished, path)

        do_GET = do_POST = _any

        def log_message(self, *args: Any) -> None:
            pass

    return _Handler


def send_json(handler: http.server.BaseHTTPRequestHandler, body: bytes) -> bool:
    """Answer 200 with ``body`` whole; False when the client hung up first."""
    try:
        send(handler, body)
    except OSError:  # the client gave the answer up (one too long for it, say)
        return False
    return True
