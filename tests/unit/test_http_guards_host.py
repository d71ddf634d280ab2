"""``http_guards.BearerAuth`` and the Host a request names: checked only without a token,
where it must name this host (localhost, a loopback address, the address it listens on)."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import pytest

from kvctl.http_guards import BearerAuth, host_name, local_host

TOKEN = "t0ken-0123456789"


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _status(token: str | None, host: str | None, *, auth: str = "", server: Any = None) -> int:
    headers = [] if host is None else [(b"host", host.encode())]
    if auth:
        headers.append((b"authorization", f"Bearer {auth}".encode()))
    scope = {"type": "http", "path": "/v1/flush", "headers": headers, "server": server}
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> MutableMapping[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    asyncio.run(BearerAuth(_ok, lambda: token)(scope, receive, send))
    return int(sent[0]["status"])


@pytest.mark.parametrize(
    ("value", "name"),
    [
        ("127.0.0.1:7070", "127.0.0.1"),
        ("[::1]:7070", "::1"),
        ("[::1]", "::1"),
        ("LocalHost.:80", "localhost"),
        ("evil.example", "evil.example"),
    ],
)
def test_host_name(value: str, name: str) -> None:
    assert host_name(value) == name


def test_local_hosts() -> None:
    for value in ("localhost", "127.0.0.1", "127.9.8.7:1", "[::1]:1", "[::ffff:127.0.0.1]:1"):
        assert local_host(value, "127.0.0.1"), value
    for value in ("evil.example", "localhost.evil.example", "10.0.0.5", "[::2]:1", "", "0.0.0.0"):
        assert not local_host(value, "127.0.0.1"), value
    assert local_host("10.0.0.5:7070", "10.0.0.5")  # the address it listens on


def test_without_a_token_a_request_must_name_this_host() -> None:
    server = ("127.0.0.1", 7070)
    assert _status(None, "evil.example", server=server) == 403
    assert _status("", "evil.example:7070", server=server) == 403
    assert _status(None, "127.0.0.1:7070", server=server) == 200
    assert _status(None, "localhost", server=server) == 200
    assert _status(None, None, server=server) == 200  # HTTP/1.0 without a Host: no browser's
    # an in-process test client's server is its own name, and its Host that name
    assert _status(None, "testserver", server=("testserver", 80)) == 200


def test_with_a_token_the_token_decides_whatever_the_host() -> None:
    # an agent off loopback is reached by names of its own; a rebinding page lacks the token
    assert _status(TOKEN, "agent1.internal:7070", auth=TOKEN, server=("10.0.0.5", 7070)) == 200
    assert _status(TOKEN, "evil.example", auth=TOKEN, server=("127.0.0.1", 7070)) == 200
    assert _status(TOKEN, "127.0.0.1", auth="wrong", server=("127.0.0.1", 7070)) == 401
