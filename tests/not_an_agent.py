"""Servers that are not an agent: a web server answering every GET or POST with a small HTML
page (or a status and body of the test's choosing), and a port that hangs up without a word."""

from __future__ import annotations

import contextlib
import http.server
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def send(
    handler: http.server.BaseHTTPRequestHandler,
    body: bytes,
    *,
    status: int = 200,
    content_type: str = "application/json",
) -> None:
    """Answer ``handler``'s request with ``status`` and ``body`` whole (its length given)."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class _Html(http.server.BaseHTTPRequestHandler):
    def _html(self) -> None:
        send(self, b"<html>not an agent</html>", content_type="text/html")

    do_GET = do_POST = _html

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """The URL of a loopback HTTP server running ``handler`` on its own thread until exit."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def web_page_url() -> contextlib.AbstractContextManager[str]:
    """The URL of a loopback web server that answers everything with a web page."""
    return serving(_Html)


def answering_url(
    status: int, body: bytes, content_type: str = "text/html"
) -> contextlib.AbstractContextManager[str]:
    """The URL of a loopback web server that answers every GET or POST with ``status`` and
    ``body``."""

    class _Answer(_Html):
        def _html(self) -> None:
            send(self, body, status=status, content_type=content_type)

        do_GET = do_POST = _html

    return serving(_Answer)


@contextmanager
def hang_up_url() -> Iterator[str]:
    """The URL of a loopback port that accepts each connection and closes it without an answer,
    as an agent's data plane does to an HTTP request."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(65536)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()
