"""Answers too long for the collector to read, on a real SQLite and PostgreSQL: an agent's
``/v1/stats`` of 12 MiB (its length declared, or sent in chunks without one), or compressed
though asked for plain, and an engine's ``/metrics`` page of 9 MiB. Each fails that node's
scrape (or its engine's reading) with why, read no further than ``MAX_ANSWER_BYTES``; the
other node is read as ever. An adversarial review's 200 MB ``/v1/stats`` was mostly read and
parsed within the scrape's deadline: ``kvctl collect --once`` peaked at 1.57 GB.

The servers are loopback stand-ins: a real agent's answers are a few KB.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine

from collectors.capped_transport import MAX_ANSWER_BYTES
from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from tests.functional.test_collector_impossible_values import StandIn, _stats

pytestmark = pytest.mark.slow

#: a vLLM /metrics page's first lines, then comments to make it long
METRICS = "# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total 5\n"


class Long:
    """A loopback server answering every GET with ``body`` as ``how`` says: "declared" (its
    length in Content-Length), "chunked" (no length: read until it ends), "gzip" (compressed,
    whatever the request asked)."""

    def __init__(self, body: bytes, how: str, content_type: str) -> None:
        self.how = how

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                out = gzip.compress(body) if how == "gzip" else body
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                if how == "gzip":
                    self.send_header("Content-Encoding", "gzip")
                if how == "chunked":
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    try:
                        for i in range(0, len(out), 1 << 16):
                            part = out[i : i + (1 << 16)]
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                        self.wfile.write(b"0\r\n\r\n")
                    except OSError:  # the collector stopped reading: as it should
                        pass
                    return
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the collector stopped reading
                    self.wfile.write(out)

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def long_stats(request: pytest.FixtureRequest) -> Iterator[Long]:
    how = request.param
    answer: dict[str, Any] = _stats(10, 4, 1.0)
    if how != "gzip":  # 12 MiB; compressed, a small answer is refused as well
        answer["padding"] = "x" * (12 << 20)
    server = Long(json.dumps(answer).encode(), how, "application/json")
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("long_stats", ["declared", "chunked", "gzip"], indirect=True)
def test_an_agent_answer_too_long_fails_that_scrape_with_why(
    db: Engine, stand_ins: tuple[StandIn, StandIn], long_stats: Long
) -> None:
    _n1, n2 = stand_ins
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "big", dc="fra", agent_url=long_stats.url)
        add_node(conn, "n2", dc="fra", agent_url=n2.url)
    collector = Collector(db, CollectorConfig(interval_s=5.0))
    try:
        report = collector.collect_once()
    finally:
        collector.close()
    assert report.written and report.up == ["n2"] and list(report.down) == ["big"]
    why = report.down["big"]
    expected = {
        "declared": f"bytes, longer than the {MAX_ANSWER_BYTES:,} read: not read",
        "chunked": f"answer longer than the {MAX_ANSWER_BYTES:,} bytes read: not read",
        "gzip": "answer encoded 'gzip' though asked for plain: not read",
    }
    assert why.startswith("unreadable answer to GET /v1/stats: "), why[:300]
    assert expected[long_stats.how] in why and "xxx" not in why, why[:300]
    with db.connect() as conn:
        rows = conn.execute(text("SELECT up, error FROM node_sample ORDER BY node_id")).all()
    assert [r[0] for r in rows] == [False, True] and rows[0][1] == why


def test_an_engine_metrics_page_too_long_is_not_read(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    n1, _n2 = stand_ins
    page = (METRICS + "# padding " + "x" * 100 + "\n") * ((9 << 20) // 110)
    engine = Long(page.encode(), "chunked", "text/plain")
    try:
        with db.begin() as conn:
            add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
            add_node(conn, "n1", dc="fra", agent_url=n1.url, engine_url=f"{engine.url}/metrics")
        collector = Collector(db, CollectorConfig(interval_s=5.0))
        try:
            report = collector.collect_once()
        finally:
            collector.close()
    finally:
        engine.close()
    assert report.up == ["n1"]
    assert any(
        w.startswith(f"n1: engine at {engine.url}/metrics: answer longer than the")
        for w in report.warnings
    ), report.warnings
    with db.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM engine_sample")).scalar_one() == 0
