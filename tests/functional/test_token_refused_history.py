"""A node whose agent refuses the collector's token, read back from what the collector recorded
(SQLite and PostgreSQL, real agents): it is up (it answered, as `kvctl status` says) but its
figures are unread, and the views say so: a 'token refused' spell among its events (as down
spells are), its unread scrapes counted in the recorded figures and the dashboard's node table,
so it never reads as a healthy idle node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from dashboard.app import create_app, render
from kvctl.db.analytics.recorded import recorded
from kvctl.db.analytics.series import node_events
from kvctl.db.analytics.windows import Window
from kvctl.db.inventory import add_dc, add_node, list_nodes
from kvctl.db.models import Node
from tests.functional.agents import Agent, closed_port, running_agent
from tests.functional.test_dashboard_app import by_id, url_of

pytestmark = pytest.mark.slow

T0_S = 1_800_000_000.0
MINUTE_MS = 60_000


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[tuple[Agent, Agent]]:
    """An agent with a token of its own (the collector has none) and an open one."""
    with (
        running_agent(tmp_path / "locked", "--cpu", "8MiB", token="not-yours") as locked,
        running_agent(tmp_path / "open", "--cpu", "8MiB") as open_,
    ):
        yield locked, open_


def test_a_node_refusing_the_token_is_up_but_unread_in_events_figures_and_dashboard(
    db: Engine, agents: tuple[Agent, Agent]
) -> None:
    locked, open_ = agents
    dead = f"http://127.0.0.1:{closed_port()}"
    with db.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "n1", dc="fra", agent_url=locked.state.control_url)
        add_node(conn, "idle", dc="fra", agent_url=open_.state.control_url)
    with db.connect() as conn:
        ids = dict(conn.execute(select(Node.name, Node.id)).all())
    # n1's agent, scrape by scrape: refusing twice, away once, refusing once, then read twice
    urls = [locked.state.control_url] * 2 + [dead, locked.state.control_url]
    urls += [open_.state.control_url] * 2
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=60.0), clock=lambda: now[0])
    try:
        for url in urls:
            with db.begin() as conn:
                conn.execute(update(Node).where(Node.id == ids["n1"]).values(agent_url=url))
            assert collector.collect_once().written
            now[0] += 60
    finally:
        collector.close()

    t0 = int(T0_S * 1000)
    win = Window("1h", t0 - MINUTE_MS, t0 + 10 * MINUTE_MS, MINUTE_MS)
    with db.connect() as conn:
        events = node_events(conn, win, ids["n1"])
        idle_events = node_events(conn, win, ids["idle"])
        rec = {n.name: row for n, row in recorded(conn, win, list_nodes(conn)).nodes}
    spells = [(e.ts_ms, e.kind, e.detail) for e in events if e.kind != "evictions"]
    assert [(ts, kind) for ts, kind, _ in spells] == [
        (t0 + 3 * MINUTE_MS, "token refused"),
        (t0 + 2 * MINUTE_MS, "down"),
        (t0, "token refused"),
    ]
    # up but unreadable, with the agent's own words; over, not "still"
    for _, _, detail in (spells[0], spells[2]):
        assert detail.startswith("up but unreadable for ") and "token" in detail, detail
        assert "still" not in detail
    assert "for 2 scrapes" in spells[2][2] and "for 1 scrape," in spells[0][2]
    assert spells[1][2].startswith("unreachable for 1 scrape: ")
    assert idle_events == []
    # up 5 of 6 scrapes (it answered all but the one to a closed port), 3 of them unread;
    # the idle node answered and was read every time
    assert (rec["n1"].samples, rec["n1"].up_samples, rec["n1"].unread_samples) == (6, 5, 3)
    assert (rec["idle"].up_samples, rec["idle"].unread_samples) == (6, 0)
    assert recorded_json(db, win)["n1"]["unread_samples"] == 3

    app = create_app(
        url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: int(now[0] * 1000)
    )
    try:
        page, _ = render(app, "/detail", "?dc=fra", "1h", None, None)
        nodes = {r["node"]: r for r in by_id(page, "table-nodes").data}
        page, _ = render(app, "/detail", "?dc=fra&node=n1", "1h", None, None)
        shown = by_id(page, "table-events").data
    finally:
        app.server.extensions["kvctl"].engine.dispose()
    # both up, both with 0 lookups: only n1's unread scrapes tell them apart
    assert (nodes["n1"]["unread scrapes"], nodes["idle"]["unread scrapes"]) == (3, 0)
    assert [e["event"] for e in shown if e["event"] != "evictions"] == [
        "token refused",
        "down",
        "token refused",
    ]


def recorded_json(db: Engine, win: Window) -> dict[str, Any]:
    with db.connect() as conn:
        doc = recorded(conn, win, list_nodes(conn)).as_dict()
    return {row["node"]: row for row in doc["nodes"]}
