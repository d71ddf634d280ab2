"""An agent that trickles its /v1/stats answer, a byte well within each read's timeout but the
whole far beyond the collector's request timeout, on a real SQLite and PostgreSQL: the scrape
gives up on it at its request timeout (a total deadline, not httpx's per-read one), records it
as not answering (down), and the cycle keeps the other agents' figures. The request given
up has its connection shut down then (test_collector_abandoned_requests), so the next cycle
asks again, and gives up again at the deadline. The same for a link probe's answer
(POST /v1/probe), at the probe's own deadline.

The trickling agent is a loopback stand-in; the healthy one is the impossible-values tests'.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig, probe_deadline_s
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.models import Node
from tests.functional.hung import HANG_GUARD_S, guarded
from tests.functional.test_collector_impossible_values import StandIn, _rows
from tests.not_an_agent import send

pytestmark = pytest.mark.slow

#: a byte every this long: far within any read timeout, so only a total deadline ends the wait
TRICKLE_BYTE_S = 0.2
#: the answer's length: trickled, it takes far longer than the hang guard (2,000 s)
TRICKLE_BYTES = 10_000


class Trickler:
    """An agent's control API that answers every request a byte every TRICKLE_BYTE_S, until
    closed, but those of ``answers`` (by path: answered at once, as JSON); ``asked`` counts
    the requests it trickled."""

    def __init__(self, answers: dict[str, Any] | None = None) -> None:
        self.asked = 0
        self.stop = threading.Event()
        self.answers = answers or {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.command == "POST":
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path in outer.answers:
                    body = json.dumps(outer.answers[self.path]).encode()
                    send(self, body)
                    return
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

            do_POST = do_GET

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
    # the first request cut at its deadline, the second cycle asked again (before: it asked
    # nothing while the first still trickled, "still unanswered")
    for report in (first, second):
        assert "no full answer to GET /v1/stats within 5 s" in report.down["n1"]
    assert trickler.asked == 2
    n1 = _rows(db, "node_sample", ids["n1"])
    assert [(r["up"], r["error"]) for r in n1] == [
        (False, first.down["n1"]),
        (False, second.down["n1"]),
    ]
    # the other agent's figures are recorded, both cycles
    assert len({r["ts_ms"] for r in _rows(db, "cache_sample", ids["n2"])}) == 2


def test_an_agent_trickling_its_probe_answer_is_cut_at_the_probes_deadline(db: Engine) -> None:
    """n1 trickles its answer to the link probe the collector asks of it (its /v1/info is
    sound); n2 answers its own at once. Before, the link round waited as long as n1 trickled
    (2,000 s, the hang guard failing the test first): httpx's timeout is per read (33 s for a
    probe), and each byte came in time."""
    n1 = Trickler({"/v1/info": {"name": "n1", "dataplane": {"tcp": "127.0.0.1:9"}}})
    n2 = StandIn("n2")
    n2.answers["/v1/probe"] = {"ok": True, "rtt_s": 0.001, "loss_ratio": 0.0, "error": None}
    try:
        with db.begin() as conn:
            add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
            add_dc(conn, "ams", region="eu", carbon_g_per_kwh=300, pue=1.3)
            add_node(conn, "n1", dc="fra", agent_url=n1.url)
            add_node(conn, "n2", dc="ams", agent_url=n2.url)
        with db.connect() as conn:
            ids = {name: id_ for name, id_ in conn.execute(select(Node.name, Node.id))}
        # a probe of pings and no bytes, each step within 0.1 s: its answer's deadline is
        # 5.6 s, far within the hang guard
        config = CollectorConfig(interval_s=600.0, pings=1, probe_bytes=0, probe_timeout_s=0.1)
        deadline_s = probe_deadline_s(1, 0, 0.1)
        assert deadline_s < HANG_GUARD_S
        collector = Collector(db, config)
        try:
            first = guarded(collector.probe_links_once)
            second = guarded(collector.probe_links_once)
        finally:
            collector.close()
    finally:
        n1.close()
        n2.close()

    for report in (first, second):
        assert report.up == ["n2->n1"] and report.written
        assert report.down["n1->n2"].startswith("not answering: ")
    # the first probe cut at its deadline, the second round asked again
    for report in (first, second):
        assert f"no full answer to POST /v1/probe within {deadline_s:g} s" in report.down["n1->n2"]
    assert n1.asked == 2
    links = _rows(db, "link_sample", ids["n1"], key="src_node_id")
    assert [(r["ok"], r["error"]) for r in links] == [
        (False, first.down["n1->n2"]),
        (False, second.down["n1->n2"]),
    ]
    # the other link's probes are recorded, both rounds
    assert [r["ok"] for r in _rows(db, "link_sample", ids["n2"], key="src_node_id")] == [
        True,
        True,
    ]
