"""The control port while the agent opens its tiers: each request is answered "starting" (503,
Retry-After) at once instead of waiting unanswered for the client's timeout; once stopped, the
socket is left listening, with what comes next waiting in its backlog for the API's server."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvctl.agent.starting import DETAIL, RETRY_AFTER_S, StartingResponder
from kvctl.client import AgentClient, AgentStarting


@pytest.fixture
def listening() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def _url(sock: socket.socket) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_each_request_is_answered_starting_until_stopped(listening: socket.socket) -> None:
    with StartingResponder(listening) as responder:
        with httpx.Client(timeout=10) as http:
            got = http.get(_url(listening) + "/v1/health")
            posted = http.post(_url(listening) + "/v1/pin", content=b"x" * (256 << 10))
        for answer in (got, posted):  # a body it does not read does not reset the answer
            assert answer.status_code == 503
            assert answer.headers["retry-after"] == str(RETRY_AFTER_S)
            assert answer.json() == {"detail": DETAIL, "starting": True}
        # what kvctl's own clients make of it: one line saying the agent is starting
        with AgentClient(_url(listening)) as client, pytest.raises(AgentStarting) as refused:
            client.info()
        assert refused.value.code == 503
        assert str(refused.value) == f"{DETAIL} ({_url(listening)})"
    assert responder.answered == 3


def test_a_client_that_sends_nothing_does_not_keep_the_next_unanswered(
    listening: socket.socket,
) -> None:
    responder = StartingResponder(listening)
    responder.start()
    silent = socket.create_connection(listening.getsockname())
    try:
        with httpx.Client(timeout=30) as http:
            assert http.get(_url(listening) + "/v1/stats").status_code == 503
        # the silent one, having asked nothing in its time, was closed
        silent.settimeout(30)
        assert silent.recv(12) == b""
    finally:
        silent.close()
        responder.stop()


def test_once_stopped_connections_wait_for_the_server_taking_the_socket_over(
    listening: socket.socket,
) -> None:
    responder = StartingResponder(listening)
    responder.start()
    responder.stop()
    assert listening.getblocking()  # as it was given
    taken: list[bytes] = []

    def serve_one() -> None:  # the API's server, in the agent uvicorn
        conn, _ = listening.accept()
        with conn:
            taken.append(conn.recv(4096))
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    server = threading.Thread(target=serve_one)
    server.start()
    with httpx.Client(timeout=10) as http:
        answer = http.get(_url(listening) + "/v1/health")
    server.join(10)
    assert answer.status_code == 200 and answer.text == "ok"
    assert taken and taken[0].startswith(b"GET /v1/health ")
    assert responder.answered == 0


def test_a_socket_closed_under_it_ends_it_quietly(
    listening: socket.socket, caplog: pytest.LogCaptureFixture
) -> None:
    responder = StartingResponder(listening)
    responder.start()
    thread = responder._thread
    assert thread is not None
    listening.close()
    responder.stop()
    assert not thread.is_alive()
    assert "failed" not in caplog.text


def test_a_head_request_gets_the_head_alone(listening: socket.socket) -> None:
    with StartingResponder(listening), socket.create_connection(listening.getsockname()) as conn:
        conn.sendall(b"HEAD /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.settimeout(30)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 503 ") and answer.endswith(b"\r\n\r\n")
    assert b"Content-Length: " in answer  # the GET's length, as HEAD says


def test_a_client_trickling_its_bytes_holds_it_a_bounded_time(listening: socket.socket) -> None:
    """A byte every half second, each within a per-read timeout: the client is cut at its
    overall deadline, and stop() (the API's start) never waits on it for longer."""
    responder = StartingResponder(listening)
    responder.start()
    trickler = socket.create_connection(listening.getsockname())
    trickler.settimeout(30)
    closed = threading.Event()

    def trickle() -> None:  # a head that never ends, a byte at a time
        try:
            trickler.sendall(b"GET /v1/health HTTP/1.1\r\nX-Slow: ")
            while not closed.wait(0.5):
                trickler.sendall(b"a")
        except OSError:
            return

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        # cut before its head is whole: closed, answered nothing (a reset where a byte it sent
        # after the responder's last read was still unread when the responder closed)
        try:
            said = trickler.recv(12)
        except ConnectionResetError:
            said = b""
        assert said == b""
    finally:
        closed.set()
        trickler.close()
        sender.join(30)
        responder.stop()
    assert responder.answered == 0


def test_agent_status_says_starting_with_a_hint(listening: socket.socket, tmp_path: Path) -> None:
    import json
    import os

    from typer.testing import CliRunner

    from kvctl.cli.main import app

    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    env |= {"XDG_CONFIG_HOME": str(tmp_path), "COLUMNS": "1000"}
    with StartingResponder(listening):
        said = CliRunner().invoke(app, ["agent", "status", "--url", _url(listening)], env=env)
        as_json = CliRunner().invoke(
            app, ["agent", "status", "--url", _url(listening), "--json"], env=env
        )
    assert said.exit_code == 1, said.output
    text = " ".join(said.output.split())
    assert f"starting: {DETAIL} ({_url(listening)})" in text
    assert "hint: it serves once its tiers are open" in text
    assert as_json.exit_code == 1
    report = json.loads(as_json.stdout)
    assert (report["up"], report["starting"], report["auth_refused"]) == (True, True, False)


def test_a_scrape_of_metrics_gets_the_starting_gauge_alone(listening: socket.socket) -> None:
    # Prometheus's up stays 1 for a start (an alert on the gauge says when it takes too long),
    # not 0 as for an agent that is down; anything else on /metrics is still "starting"
    from prometheus_client.parser import text_string_to_metric_families

    with StartingResponder(listening) as responder, httpx.Client(timeout=10) as http:
        scraped = http.get(_url(listening) + "/metrics?name[]=x")
        head = http.head(_url(listening) + "/metrics")
        posted = http.post(_url(listening) + "/metrics", content=b"x")
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    families = list(text_string_to_metric_families(scraped.text))
    assert [(f.name, f.type, [s.value for s in f.samples]) for f in families] == [
        ("kvctl_agent_starting", "gauge", [1.0])
    ]
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) == len(scraped.content)
    assert posted.status_code == 503 and posted.json()["starting"] is True
    assert responder.answered == 3
