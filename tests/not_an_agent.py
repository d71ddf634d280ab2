"""A web server that is not an agent: every GET or POST gets a small HTML page."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class _Html(http.server.BaseHTTPRequestHandler):
    def _html(self) -> None:
        body = b"<html>not an agent</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _html

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def web_page_url() -> Iterator[str]:
    """The URL of a loopback web server that answers everything with a web page."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
