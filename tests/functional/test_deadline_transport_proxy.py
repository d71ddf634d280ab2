"""A fan-out with a deadline reaches its agents as one without does: through the proxy the
environment names (HTTP_PROXY, ALL_PROXY, NO_PROXY), as httpx does for a client of its own.
The abandon-on-deadline transport (kvctl.deadline_transport) is a transport of kvctl's, and
httpx takes no proxy from the environment for a client given one: so since fan_out used it,
``kvctl fleet status``, lookups, doctor and actions went straight to agents reachable only
through the operator's proxy (and reported them down) while ``kvctl top`` went through it."""

from __future__ import annotations

import http.server
import json
from typing import Any

import pytest

from kvctl.client import AgentClient
from kvctl.db.inventory import NodeInfo
from kvctl.fleet.fanout import fan_out
from tests.not_an_agent import send, serving

#: a name that resolves nowhere (RFC 6761): only the proxy reaches it
AGENT_URL = "http://agent-behind-the-proxy.invalid:7070"
PROXY_VARS = ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy")


def _proxy(seen: list[str]) -> type[http.server.BaseHTTPRequestHandler]:
    class Proxy(http.server.BaseHTTPRequestHandler):
        """A forward proxy that answers for the agent behind it."""

        def do_GET(self) -> None:
            seen.append(self.path)  # the absolute URL a client asks a proxy for
            body = json.dumps({"status": "ok"}).encode()
            send(self, body)

        def log_message(self, *args: Any) -> None:
            pass

    return Proxy


@pytest.mark.parametrize("deadline_s", [None, 10.0], ids=["no deadline", "deadline"])
def test_a_fan_out_goes_through_the_proxy_the_environment_names(
    monkeypatch: pytest.MonkeyPatch, deadline_s: float | None
) -> None:
    seen: list[str] = []
    with serving(_proxy(seen)) as proxy_url:
        for var in PROXY_VARS:
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        node = NodeInfo(1, "behind", "fra", AGENT_URL, "", None)
        [r] = fan_out([node], AgentClient.health, token="", timeout_s=5.0, deadline_s=deadline_s)
    assert r.ok and r.value == {"status": "ok"}, r.error
    assert seen == ["http://agent-behind-the-proxy.invalid:7070/v1/health"]


def test_no_proxy_is_honoured_with_a_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent NO_PROXY names is asked directly, deadline or not."""
    seen: list[str] = []
    with serving(_proxy(seen)) as proxy_url, serving(_proxy([])) as agent_url:
        for var in PROXY_VARS:
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        node = NodeInfo(1, "direct", "fra", agent_url, "", None)
        [r] = fan_out([node], AgentClient.health, token="", timeout_s=5.0, deadline_s=10.0)
    assert r.ok, r.error
    assert seen == []
