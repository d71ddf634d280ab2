"""Something at an agent's URL answering what the SDK cannot read (JSON that is not JSON,
JSON nested deeper than Python reads, a body its Content-Encoding does not decode), on a real
SQLite and PostgreSQL: that node is down with the reason, the cycle goes on, and the other
nodes' samples are written.

The agents are stand-ins answering over loopback HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from tests.functional.test_collector_impossible_values import T0_S, StandIn, _rows

pytestmark = pytest.mark.slow

#: what each broken agent sends to every request: its body and its headers
BROKEN = {
    "not-json": (b"{not json", {"Content-Type": "application/json"}),
    "deep": (b"[" * 100_000, {"Content-Type": "application/json"}),
    "bad-gzip": (
        b"this is not gzip",
        {"Content-Type": "application/json", "Content-Encoding": "gzip"},
    ),
}


class Broken:
    def __init__(self, body: bytes, headers: dict[str, str]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def agents() -> Iterator[tuple[StandIn, dict[str, Broken]]]:
    good = StandIn("good")
    broken = {name: Broken(*answer) for name, answer in BROKEN.items()}
    try:
        yield good, broken
    finally:
        good.close()
        for b in broken.values():
            b.close()


def test_an_agent_answering_unreadable_bodies_is_down_not_the_cycle(
    db: Engine, agents: tuple[StandIn, dict[str, Broken]]
) -> None:
    """Before, the SDK's ValueError, RecursionError or httpx.DecodingError escaped the
    node's scrape and collect_once: no node's samples were written, and the loop ended."""
    good, broken = agents
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "good", dc="fra", agent_url=good.url)
        for name, b in broken.items():
            add_node(conn, name, dc="fra", agent_url=b.url)
    collector = Collector(db, CollectorConfig(interval_s=5.0), clock=lambda: T0_S)
    try:
        report = collector.collect_once()
    finally:
        collector.close()
    assert report.written and report.up == ["good"], report.as_dict()
    assert set(report.down) == set(BROKEN), report.down
    # the SDK says a body it could not decode (bad gzip) and JSON it cannot parse (invalid,
    # nested too deep: NotAnAgent since 9ed94ae) each in its own words
    assert "unreadable answer" in report.down["bad-gzip"], report.down
    for name in ("not-json", "deep"):
        assert "answered JSON that cannot be read" in report.down[name], report.down
    assert len(_rows(db, "node_sample", 1)) == 1
