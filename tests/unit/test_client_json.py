"""The SDK tells an agent's answer from anything else at that URL: a web page, a proxy's text."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvctl.client import AgentClient, RequestError


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


@pytest.fixture
def web_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Html)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("call", ["health", "info", "stats", "remote", "gpus"])
def test_a_page_that_is_not_json_is_refused_not_returned(web_url: str, call: str) -> None:
    client = AgentClient(web_url, timeout_s=5.0)
    try:
        with pytest.raises(RequestError, match="did not answer with JSON"):
            getattr(client, call)()
    finally:
        client.close()
