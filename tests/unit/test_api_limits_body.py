"""The control API's request body cap: 413 from the Content-Length alone, or as soon as a
streamed (chunked) body passes the cap, without reading the rest."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fastapi.testclient import TestClient

from kvctl.agent.api import create_app
from kvctl.agent.runtime import AgentRuntime
from tests.unit.test_agent_api import _runtime, _settings

CAP_BYTES = 64 * 1024
TOKEN = "s3cret-token"


@pytest.fixture
def client(runtime: AgentRuntime) -> Iterator[TestClient]:
    with TestClient(
        create_app(runtime, max_body_bytes=CAP_BYTES), raise_server_exceptions=False
    ) as c:
        yield c


def _evict_body(size_bytes: int) -> bytes:
    """A valid /v1/evict body of about ``size_bytes`` bytes."""
    n = max(1, size_bytes // 36)
    return json.dumps({"keys": ["00" * 16] * n}).encode()


def test_body_over_the_cap_is_413_from_content_length(client: TestClient) -> None:
    body = _evict_body(CAP_BYTES + 1000)
    r = client.post("/v1/evict", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    detail = r.json()["detail"]
    assert str(CAP_BYTES) in detail and str(len(body)) in detail
    # under the cap the same request works
    ok = client.post(
        "/v1/evict",
        content=_evict_body(CAP_BYTES // 2),
        headers={"content-type": "application/json"},
    )
    assert ok.status_code == 200, ok.text


def test_default_cap_admits_the_largest_valid_key_list(runtime: AgentRuntime) -> None:
    from kvctl.agent.api import MAX_KEYS_PER_REQUEST

    with TestClient(create_app(runtime)) as c:
        keys = ["ab" * 16] * MAX_KEYS_PER_REQUEST
        r = c.post("/v1/evict", json={"keys": keys})
        assert r.status_code == 200, r.text[:200]
        assert r.json()["missing"] == MAX_KEYS_PER_REQUEST
        big = c.post("/v1/evict", content=b"[" + b" " * (8 << 20) + b"]")
        assert big.status_code == 413


def test_401_wins_over_413_without_a_token(tmp_path: Path) -> None:
    rt = _runtime(dataclasses.replace(_settings(tmp_path), token=TOKEN), tmp_path)
    with TestClient(create_app(rt, max_body_bytes=CAP_BYTES)) as c:
        r = c.post("/v1/evict", content=_evict_body(CAP_BYTES * 2))
        assert r.status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = c.post("/v1/evict", content=_evict_body(CAP_BYTES * 2), headers=auth)
        assert r.status_code == 413
    rt.close()


def test_bad_content_length_is_400(client: TestClient) -> None:
    for value in ("abc", "-1", "1e3", "\u0661"):
        r = client.post(
            "/v1/evict",
            content=b'{"keys": []}',
            headers={"content-type": "application/json", "content-length": value.encode()},
        )
        assert r.status_code == 400, (value, r.status_code, r.text)
        assert "Content-Length" in r.json()["detail"]


# --- at the ASGI level: what the middleware reads ----------------------------------------------


def _call(app: Any, headers: list[tuple[bytes, bytes]], chunks: list[bytes]) -> dict[str, Any]:
    """Drive one POST /v1/evict through ``app`` with ``chunks`` as a streamed body; returns the
    response status, body and how many chunks the app pulled."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/evict",
        "raw_path": b"/v1/evict",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 5000),
        "server": ("testserver", 80),
    }
    pulled = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal pulled
        if pulled < len(chunks):
            pulled += 1
            return {
                "type": "http.request",
                "body": chunks[pulled - 1],
                "more_body": pulled < len(chunks),
            }
        await anyio.sleep_forever()  # a client that never disconnects
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def main() -> None:
        with anyio.fail_after(30):
            await app(scope, receive, send)

    anyio.run(main)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return {"status": start["status"], "body": body, "pulled": pulled, "headers": start["headers"]}


def test_chunked_body_over_the_cap_is_413_without_reading_the_rest(
    runtime: AgentRuntime,
) -> None:
    app = create_app(runtime, max_body_bytes=CAP_BYTES)
    piece = 16 * 1024
    # 1,000 pieces of 16 KiB (16 MB) streamed without a Content-Length
    chunks = [b'{"keys": [' + b" " * (piece - 10)] + [b" " * piece] * 999
    out = _call(app, [(b"transfer-encoding", b"chunked")], chunks)
    assert out["status"] == 413
    assert json.loads(out["body"])["detail"].startswith("request body over")
    # the cap is 4 pieces: the fifth crosses it, and nothing after it is read
    assert out["pulled"] == CAP_BYTES // piece + 1
    assert (b"connection", b"close") in out["headers"]


def test_declared_length_over_the_cap_reads_nothing(runtime: AgentRuntime) -> None:
    app = create_app(runtime, max_body_bytes=CAP_BYTES)
    out = _call(app, [(b"content-length", str(CAP_BYTES + 1).encode())], [b" "] * 10)
    assert out["status"] == 413
    assert out["pulled"] == 0


def test_chunked_body_under_the_cap_passes(runtime: AgentRuntime) -> None:
    app = create_app(runtime, max_body_bytes=CAP_BYTES)
    body = json.dumps({"keys": ["00" * 16] * 100}).encode()
    chunks = [body[i : i + 100] for i in range(0, len(body), 100)]
    out = _call(app, [(b"transfer-encoding", b"chunked")], chunks)
    assert out["status"] == 200, out["body"]
    assert json.loads(out["body"])["missing"] == 100
