"""A token that cannot be a header value (CR from a CRLF file, other control characters,
whitespace at either end, non-ASCII) is refused by the agent and index clients with a message
that names the token's variable but never shows it: httpx's own refusal quoted the whole header,
token included, into screens and logs, and a non-ASCII token raised UnicodeEncodeError past
every caller's except. (The router's client: test_router_client.)"""

from __future__ import annotations

import http.server
from typing import Any

import pytest

from kvctl.client import AgentClient, AuthError
from kvctl.index.remote import IndexClient, IndexUnavailable
from tests.not_an_agent import answering_url, serving

SECRET = "hunter2-agent-token"
BAD = [f"{SECRET}\r", f"{SECRET} ", f"\t{SECRET}", f"{SECRET}\nx", f"{SECRET}\x00", f"{SECRET}é"]
IDS = ["cr", "trailing-space", "leading-tab", "newline", "nul", "non-ascii"]


@pytest.mark.parametrize("token", BAD, ids=IDS)
def test_the_agent_client_refuses_a_token_it_cannot_send(token: str) -> None:
    with (
        answering_url(200, b"{}", "application/json") as url,
        pytest.raises(AuthError) as raised,
    ):
        AgentClient(url, token=token, timeout_s=10).info()
    assert SECRET not in str(raised.value)
    assert "KVCTL_TOKEN" in str(raised.value)


@pytest.mark.parametrize("token", BAD, ids=IDS)
def test_the_index_client_refuses_a_token_it_cannot_send(token: str) -> None:
    with (
        answering_url(200, b"{}", "application/json") as url,
        pytest.raises(IndexUnavailable) as raised,
    ):
        IndexClient(url, token=token, timeout_s=10).holders([b"\x01" * 16], tenant="t")
    assert SECRET not in str(raised.value)
    assert "token" in str(raised.value)


def test_a_sound_token_is_sent() -> None:
    seen: list[str | None] = []

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    with serving(Refusing) as url, pytest.raises(AuthError, match="refused the token"):
        AgentClient(url, token=SECRET, timeout_s=10).info()
    assert seen == [f"Bearer {SECRET}"]
