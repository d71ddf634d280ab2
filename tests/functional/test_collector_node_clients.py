"""The collector keeps one HTTP client per node of the inventory as it is now: a node whose agent
URL changes while the loop runs (`kvctl fleet import` of a changed fleet file) gets a new client
and the old one is closed; a removed node's client is closed and dropped. A soak found both
left open (and kept, for the removed ones) for as long as the loop ran."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from collectors.collector import Collector, CollectorConfig
from kvctl.cli.main import app
from kvctl.client import AgentClient
from kvctl.db.inventory import add_dc, add_node, update_node
from kvctl.db.migrate import open_db
from tests.functional.agents import running_agent

pytestmark = pytest.mark.slow


def _open(clients: list[AgentClient]) -> list[str]:
    """The URLs of the clients not closed."""
    return [c.url for c in clients if not c._http.is_closed]


def test_a_node_moved_or_removed_leaves_no_client_open(sqlite_url: str, tmp_path: Path) -> None:
    db = open_db(sqlite_url)
    seen: list[AgentClient] = []  # every client the collector used, kept here to be counted

    def cycle(collector: Collector) -> list[str]:
        report = collector.collect_once()
        links = collector.probe_links_once()  # probes ask through the nodes' clients too
        assert report.written and links.written and not links.down, (report, links)
        seen.extend(c for c in collector._clients.values() if c not in seen)
        return sorted(report.up)

    try:
        with (
            running_agent(tmp_path / "a1", "--name", "n1") as a1,
            running_agent(tmp_path / "a2", "--name", "n2") as a2,
            running_agent(tmp_path / "a3", "--name", "n1-new") as a3,
        ):
            with db.begin() as conn:
                for dc in ("fra", "ams"):
                    add_dc(conn, dc, region="eu", carbon_g_per_kwh=300, pue=1.3)
                add_node(conn, "n1", dc="fra", agent_url=a1.state.control_url)
                add_node(conn, "n2", dc="ams", agent_url=a2.state.control_url)
            collector = Collector(db, CollectorConfig(pings=1))
            try:
                assert cycle(collector) == ["n1", "n2"]
                assert sorted(_open(seen)) == sorted([a1.state.control_url, a2.state.control_url])
                with db.begin() as conn:  # n1's agent moved to a new host
                    update_node(conn, "n1", agent_url=a3.state.control_url)
                assert cycle(collector) == ["n1", "n2"]
                assert sorted(_open(seen)) == sorted([a3.state.control_url, a2.state.control_url])
                removed = CliRunner().invoke(app, ["fleet", "rm", "node", "n2", "--db", sqlite_url])
                assert removed.exit_code == 0, removed.output
                assert cycle(collector) == ["n1"]
                assert _open(seen) == [a3.state.control_url]
                assert [c.url for c in collector._clients.values()] == [a3.state.control_url]
                assert collector._deadlines._running == {}  # no answer kept once read
            finally:
                collector.close()
            assert _open(seen) == []
    finally:
        db.dispose()
