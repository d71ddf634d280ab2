"""An agent that trickles its /v1/stats answer, a byte well within each read's timeout but the
whole far beyond the collector's request timeout, on a real SQLite and PostgreSQL: the scrape
gives up on it at its request timeout (a total deadline, not httpx's per-read one), records it
as not answering (down), and the cycle keeps the other agents' figures. While that request
still trickles, the next cycle does not ask again.

The trickling agent is a loopback stand-in; the healthy one is the impossible-values tests'.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.models import Node
from tests.functional.hung import HANG_GUARD_S, guarded
from tests.functional.test_collector_impossible_values import StandIn, _rows

pytestmark = pytest.mark.slow

#: a byte every this long: far within any read timeout, so only a total deadline ends the wait
TRICKLE_BYTE_S = 0.2
#: the answer's length: trickled, it takes far longer than the hang guard (2,000 s)
TRICKLE_BYTES = 10_000


class Trickler:
    """An agent's control API that answers every request a byte every TRICKLE_BYTE_S, until
    closed; ``asked`` counts the requests it took."""

    def __init__(self) -> None:
        self.asked = 0
        self.stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.asked += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(TRICKLE_BYTES))
                self.end_headers()
                try:
                    for _ in range(TRICKLE_BYTES):
                        if outer.stop.wait(TRICKLE_BYTE_S):
                            return
                        self.wfile.write(b" ")
                        self.wfile.flush()
                except OSError:  # the collector hung up
                    return

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    t = Trickler()
    try:
        yield t
    finally:
        t.close()


@pytest.fixture
def agent() -> Iterator[StandIn]:
    a = StandIn("n2")
    try:
        yield a
    finally:
        a.close()


def test_an_agent_trickling_its_answer_is_not_answering_and_the_cycle_keeps_the_others(
    db: Engine, trickler: Trickler, agent: StandIn
) -> None:
    """Before, the cycle waited for the trickling agent until 90% of the interval (here
    540 s, the hang guard failing the test first): httpx's timeout is per read, and each byte
    came in time."""
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=trickler.url)
        add_node(conn, "n2", dc="fra", agent_url=agent.url)
    with db.connect() as conn:
        ids = {name: id_ for name, id_ in conn.execute(select(Node.name, Node.id))}
    # the interval's own bound on a cycle (90% of it) far beyond the hang guard: only the
    # request's deadline ends the wait for n1
    config = CollectorConfig(interval_s=600.0, timeout_s=5.0)
    assert config.interval_s * 0.9 > HANG_GUARD_S
    collector = Collector(db, config)
    try:
        first = guarded(collector.collect_once)
        second = guarded(collector.collect_once)
    finally:
        collector.close()

    for report in (first, second):
        assert report.up == ["n2"] and report.written
        assert report.down["n1"].startswith("not answering: ")
    assert "no full answer to GET /v1/stats within 5 s" in first.down["n1"]
    # its request still trickling, the second cycle asked it nothing more
    assert "still unanswered" in second.down["n1"]
    assert trickler.asked == 1
    n1 = _rows(db, "node_sample", ids["n1"])
    assert [(r["up"], r["error"]) for r in n1] == [
        (False, first.down["n1"]),
        (False, second.down["n1"]),
    ]
    # the other agent's figures are recorded, both cycles
    assert len({r["ts_ms"] for r in _rows(db, "cache_sample", ids["n2"])}) == 2
