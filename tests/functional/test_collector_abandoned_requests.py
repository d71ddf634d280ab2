"""A scrape request the collector gives up at its deadline (an agent or engine trickling its
answer, a byte every 100 ms, each within httpx's per-read timeout) stops reading soon after:
its connection is shut down from the waiting side, so its thread and its socket are gone
within a trickled byte or two, and the next cycle asks afresh and records what the target
answers then.

Before, the abandoned thread read on until the trickle ended (here 1,000 s), holding its thread
and its socket; the next cycle did not ask again ("still unanswered") for as long, so a target
that had recovered was recorded down all that while.

The trickling target is a raw loopback HTTP server: it trickles its whole answer, status line
and headers included, so the request is given up before httpx has a response to close.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from tests.functional.test_collector import VLLM_TEXT
from tests.functional.test_collector_impossible_values import StandIn, _stats

#: a byte every this long: far within any read timeout, so only the deadline ends the wait
TRICKLE_BYTE_S = 0.1
#: the trickled answer's body: 1,000 s of bytes at that rate
TRICKLE_BODY_BYTES = 10_000
#: the collector's request deadline in these tests
DEADLINE_S = 0.5
#: how soon after the deadline the thread and the socket must be gone: a few trickled bytes,
#: generous for a loaded machine; without the fix they stay for 1,000 s
GONE_WITHIN_S = 3.0


class Trickler:
    """Answers its first ``trickled`` requests a byte every TRICKLE_BYTE_S (the whole HTTP
    answer), the later ones at once from ``answers`` (path -> body, content type; 404 for
    another path); notes when each trickle found its reader gone (``hung_up_s``, monotonic)."""

    def __init__(self, answers: dict[str, tuple[bytes, str]], trickled: int = 1) -> None:
        self.asked = 0
        self.hung_up_s: list[float] = []
        self.stop = threading.Event()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                head = b""
                while b"\r\n\r\n" not in head:  # the request (GETs only: no body)
                    got = sock.recv(65536)
                    if not got:
                        return
                    head += got
                outer.asked += 1
                if outer.asked > trickled:
                    path = head.split(b" ", 2)[1].decode()
                    body, kind = answers.get(path, (b"not found", "text/plain"))
                    status = b"200 OK" if path in answers else b"404 Not Found"
                    sock.sendall(
                        b"HTTP/1.1 "
                        + status
                        + b"\r\nContent-Type: "
                        + kind.encode()
                        + b"\r\nContent-Length: "
                        + str(len(body)).encode()
                        + b"\r\nConnection: close\r\n\r\n"
                        + body
                    )
                    return
                answer = (
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {TRICKLE_BODY_BYTES}\r\n\r\n".encode()
                    + b" " * TRICKLE_BODY_BYTES
                )
                try:
                    for i in range(len(answer)):
                        if outer.stop.wait(TRICKLE_BYTE_S):
                            return
                        sock.sendall(answer[i : i + 1])
                except OSError:  # the reader hung up
                    outer.hung_up_s.append(time.monotonic())

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def _request_threads() -> int:
    return sum(t.name == "kvctl-request" and t.is_alive() for t in threading.enumerate())


def _established_with(port: int) -> int:
    """TCP connections of this machine to or from ``port`` on loopback still established
    (either end: the collector's socket, the trickler's)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            if port in (local_port, remote_port) and fields[3] == "01":  # ESTABLISHED
                count += 1
    return count


def _until(check: Callable[[], bool], within_s: float) -> float | None:
    """Seconds until ``check()`` held, polled; None if it did not within ``within_s``."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if check():
            return time.monotonic() - t0
        time.sleep(0.02)
    return None


@pytest.fixture
def sqlite_db(sqlite_url: str) -> Iterator[Engine]:
    engine = open_db(sqlite_url)
    yield engine
    engine.dispose()


def _assert_let_go(trickler: Trickler, given_up_s: float) -> None:
    """The abandoned request's thread and connection are gone soon after it was given up."""
    assert _until(lambda: _request_threads() == 0, GONE_WITHIN_S) is not None, (
        "the abandoned request's thread still reads"
    )
    assert _until(lambda: _established_with(trickler.port) == 0, GONE_WITHIN_S) is not None, (
        "the abandoned request's connection is still open"
    )
    assert _until(lambda: bool(trickler.hung_up_s), GONE_WITHIN_S) is not None
    assert trickler.hung_up_s[0] - given_up_s < GONE_WITHIN_S


def test_an_agent_scrape_given_up_at_its_deadline_lets_go_and_the_next_cycle_asks_again(
    sqlite_db: Engine,
) -> None:
    trickler = Trickler(
        {"/v1/stats": (json.dumps(_stats(10, 4, 0.0)).encode(), "application/json")}
    )
    try:
        with sqlite_db.begin() as conn:
            add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
            add_node(conn, "n1", dc="fra", agent_url=trickler.url)
        collector = Collector(sqlite_db, CollectorConfig(interval_s=600.0, timeout_s=DEADLINE_S))
        try:
            first = collector.collect_once()
            given_up_s = time.monotonic()
            assert f"no full answer to GET /v1/stats within {DEADLINE_S:g} s" in first.down["n1"]
            _assert_let_go(trickler, given_up_s)
            second = collector.collect_once()
        finally:
            collector.close()
        # asked again, and answered at once: up (before: "still unanswered", down)
        assert trickler.asked >= 2
        assert second.up == ["n1"], second.down
    finally:
        trickler.close()


def test_an_engine_scrape_given_up_at_its_deadline_lets_go_and_the_next_cycle_reads_it(
    sqlite_db: Engine,
) -> None:
    metrics = VLLM_TEXT.format(prompt=100, hits=40, gen=10, fast=1, count=2, ttft_sum=0.3)
    engine = Trickler({"/metrics": (metrics.encode(), "text/plain; version=0.0.4")})
    agent = StandIn("n1")
    try:
        with sqlite_db.begin() as conn:
            add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
            add_node(conn, "n1", dc="fra", agent_url=agent.url, engine_url=f"{engine.url}/metrics")
        collector = Collector(sqlite_db, CollectorConfig(interval_s=600.0, timeout_s=DEADLINE_S))
        try:
            first = collector.collect_once()
            given_up_s = time.monotonic()
            assert first.up == ["n1"]
            assert any("not answering" in w for w in first.warnings), first.warnings
            _assert_let_go(engine, given_up_s)
            second = collector.collect_once()
        finally:
            collector.close()
        assert engine.asked == 2
        assert not any("engine" in w for w in second.warnings), second.warnings
    finally:
        engine.close()
        agent.close()
