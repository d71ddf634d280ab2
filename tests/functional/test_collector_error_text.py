"""An agent's error answer is recorded as one line of at most MAX_ERROR_CHARS, as a link
probe's error was: a node whose agent (or a proxy in front of it) answers 500 with a long
JSON detail had all of it stored in node_sample.error at every scrape (7 MB a row: at the
default 10 s interval, 60 MB a minute), printed whole by `kvctl collect --once` and in
`--json`, over as many lines as it held. Its GPUs' error alike. The other nodes' samples are
written as ever."""

from __future__ import annotations

import http.server
import json
from pathlib import Path

import pytest
from sqlalchemy import select

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import Node, NodeSample
from kvctl.db.sample_checks import MAX_ERROR_CHARS
from tests.functional.agents import running_agent
from tests.hostile_servers import Hostile, handler_class
from tests.not_an_agent import send, serving

pytestmark = pytest.mark.slow

#: an error's detail far past any message, on several lines
DETAIL = "the upstream said: " + "boom " * 200_000 + "\nand a second line"


def _fails(handler: http.server.BaseHTTPRequestHandler, path: str) -> bool:
    send(handler, json.dumps({"detail": DETAIL}).encode(), status=500)
    return True


def test_a_long_error_answer_is_recorded_as_one_short_line(sqlite_url: str, tmp_path: Path) -> None:
    db = open_db(sqlite_url)
    try:
        with (
            running_agent(tmp_path / "a1", "--name", "n1") as a1,
            serving(handler_class(Hostile(), _fails)) as failing,
        ):
            with db.begin() as conn:
                add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
                add_node(conn, "n1", dc="fra", agent_url=a1.state.control_url)
                add_node(conn, "bad", dc="fra", agent_url=failing)
            collector = Collector(db, CollectorConfig())
            try:
                report = collector.collect_once()
            finally:
                collector.close()
        assert report.written and report.up == ["n1"]
        said = report.down["bad"]
        assert said.startswith("500: the upstream said: boom") and "\n" not in said
        assert len(said) <= MAX_ERROR_CHARS, len(said)
        with db.connect() as conn:
            rows = conn.execute(
                select(Node.name, NodeSample.up, NodeSample.error).join(
                    Node, Node.id == NodeSample.node_id
                )
            ).all()
        by_name = {r.name: r for r in rows}
        assert by_name["n1"].up and by_name["n1"].error is None
        assert by_name["bad"].error == said
    finally:
        db.dispose()
