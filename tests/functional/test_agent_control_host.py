"""An agent without a token (loopback only) answers only requests addressed to this host: a
page in a browser on the same host whose domain was pointed at 127.0.0.1 (DNS rebinding) sends
its own domain as the Host, and must not reach the control API. Checked on a real agent with
the default settings."""

from __future__ import annotations

from pathlib import Path

import httpx

from .agents import key, payload, running_agent


def test_a_request_naming_another_host_is_refused_and_local_names_are_served(
    tmp_path: Path,
) -> None:
    with running_agent(tmp_path / "a", "--cpu", "16MiB", "--disk", "0") as agent:
        url = agent.state.control_url
        port = url.rsplit(":", 1)[1]
        with agent.data() as c:
            c.put(key(1), payload(key(1), 4096))

        # what a rebinding page sends: before, the flush ran
        r = httpx.post(url + "/v1/flush", json={"tier": "cpu"}, headers={"Host": "evil.example"})
        assert r.status_code == 403, r.text
        assert "'evil.example'" in r.json()["detail"] and "set a token" in r.json()["detail"]
        with agent.data() as c:
            assert c.exists([key(1)]) == ["cpu"]  # not flushed
        r = httpx.get(url + "/v1/health", headers={"Host": f"evil.example:{port}"})
        assert r.status_code == 403, r.text

        # what local clients send: the address or name they connected to
        for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", f"[::1]:{port}"):
            r = httpx.get(url + "/v1/health", headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
        assert agent.control().health()["status"] == "ok"  # kvctl's own client
