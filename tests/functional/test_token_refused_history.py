"""A node whose agent refuses the collector's token, read back from what the collector recorded
(SQLite and PostgreSQL, real agents): it is up (it answered, as `kvctl status` says) but its
figures are unread, and the views say so: a 'token refused' spell among its events (as down
spells are), its unread scrapes counted in the recorded figures and the dashboard's node table,
so it never reads as a healthy idle node. A node whose agent answers "starting" (its tiers still
opening) is up and unread too, in a 'starting' spell of its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from dashboard.app import create_app, render
from kvctl.agent_starting import STARTING_PREFIX, says_starting
from kvctl.client import AgentClient, AgentStarting
from kvctl.db.analytics.recorded import recorded
from kvctl.db.analytics.series import node_events
from kvctl.db.analytics.windows import Window
from kvctl.db.inventory import add_dc, add_node, list_nodes
from kvctl.db.models import Node, NodeSample
from tests.functional.agents import Agent, closed_port, running_agent
from tests.functional.test_dashboard_app import by_id, url_of
from tests.not_an_agent import answering_url
from tests.starting_agent import starting_url

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


def _fra(db: Engine, **agent_urls: str) -> dict[str, int]:
    """DC fra with these nodes (name -> agent URL): their ids."""
    with db.begin() as conn:
        add_dc(conn, "fra")
        for name, url in agent_urls.items():
            add_node(conn, name, dc="fra", agent_url=url)
    with db.connect() as conn:
        return dict(conn.execute(select(Node.name, Node.id)).all())


def _window() -> tuple[int, Window]:
    """The scrapes' first instant (ms) and a window of minutes around them."""
    t0 = int(T0_S * 1000)
    return t0, Window("1h", t0 - MINUTE_MS, t0 + 10 * MINUTE_MS, MINUTE_MS)


def test_a_node_refusing_the_token_is_up_but_unread_in_events_figures_and_dashboard(
    db: Engine, agents: tuple[Agent, Agent]
) -> None:
    locked, open_ = agents
    dead = f"http://127.0.0.1:{closed_port()}"
    ids = _fra(db, n1=locked.state.control_url, idle=open_.state.control_url)
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

    t0, win = _window()
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


def test_a_starting_node_is_up_but_unread_in_a_starting_spell_of_its_own(
    db: Engine, agents: tuple[Agent, Agent]
) -> None:
    locked, open_ = agents
    dead = f"http://127.0.0.1:{closed_port()}"
    n1 = _fra(db, n1=dead)["n1"]
    now = [T0_S]
    reports = []
    collector = Collector(db, CollectorConfig(interval_s=60.0), clock=lambda: now[0])
    try:
        with starting_url() as starting:
            # n1's agent, scrape by scrape: starting twice, refusing the token, away, then read
            urls = [starting] * 2 + [locked.state.control_url, dead]
            urls += [open_.state.control_url] * 2
            for url in urls:
                with db.begin() as conn:
                    conn.execute(update(Node).where(Node.id == n1).values(agent_url=url))
                reports.append(collector.collect_once())
                assert reports[-1].written
                now[0] += 60
    finally:
        collector.close()

    # starting: neither down nor token refused, with the agent's own words and its URL
    first = reports[0]
    assert (first.up, first.down, first.token_refused) == ([], {}, {}), first
    assert list(first.starting) == ["n1"] and starting in first.starting["n1"]
    assert first.starting["n1"].startswith(STARTING_PREFIX)
    assert first.as_dict()["starting"] == first.starting
    assert [list(r.starting) for r in reports] == [["n1"], ["n1"], [], [], [], []]
    assert list(reports[2].token_refused) == ["n1"] and list(reports[3].down) == ["n1"]
    with db.connect() as conn:
        samples = conn.execute(
            select(NodeSample).where(NodeSample.node_id == n1).order_by(NodeSample.ts_ms)
        ).all()
    # it answered: up, timed, the error saying it is starting; no figures made up
    assert [(s.up, says_starting(s.error)) for s in samples[:2]] == [(True, True)] * 2
    assert all(s.scrape_seconds is not None and s.agent_started_s is None for s in samples[:2])
    assert [says_starting(s.error) for s in samples[2:]] == [False] * 4

    t0, win = _window()
    with db.connect() as conn:
        events = node_events(conn, win, n1)
        rec = {n.name: row for n, row in recorded(conn, win, list_nodes(conn)).nodes}
    spells = [(e.ts_ms, e.kind, e.detail) for e in events if e.kind != "evictions"]
    assert [(ts, kind) for ts, kind, _ in spells] == [
        (t0 + 3 * MINUTE_MS, "down"),
        (t0 + 2 * MINUTE_MS, "token refused"),
        (t0, "starting"),
    ]
    started = spells[2][2]
    assert started.startswith("starting for 2 scrapes, no figures recorded: "), started
    assert STARTING_PREFIX in started and "still" not in started
    assert spells[1][2].startswith("up but unreadable for 1 scrape,")
    # up 5 of 6 scrapes, 3 of them unread (twice starting, once refusing the token)
    assert (rec["n1"].samples, rec["n1"].up_samples, rec["n1"].unread_samples) == (6, 5, 3)

    app = create_app(
        url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: int(now[0] * 1000)
    )
    try:
        page, _ = render(app, "/detail", "?dc=fra&node=n1", "1h", None, None)
        shown = by_id(page, "table-events").data
    finally:
        app.server.extensions["kvctl"].engine.dispose()
    assert [e["event"] for e in shown if e["event"] != "evictions"] == [
        "down",
        "token refused",
        "starting",
    ]


def test_a_node_still_starting_at_the_windows_end_is_still_starting(db: Engine) -> None:
    n1 = _fra(db, n1="http://127.0.0.1:9")["n1"]
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=60.0), clock=lambda: now[0])
    try:
        with starting_url() as starting:
            with db.begin() as conn:
                conn.execute(update(Node).where(Node.id == n1).values(agent_url=starting))
            for _ in range(3):
                assert list(collector.collect_once().starting) == ["n1"]
                now[0] += 60
    finally:
        collector.close()
    t0, win = _window()
    with db.connect() as conn:
        events = node_events(conn, win, n1)
    assert [(e.ts_ms, e.kind) for e in events] == [(t0, "starting")]
    assert events[0].detail.startswith("starting for 3 scrapes (still starting), no figures")


def test_a_starting_answer_in_other_words_is_recorded_as_starting(db: Engine) -> None:
    """The SDK knows a starting agent by its answer's flag (503, starting: true), the records by
    their error's words: an agent wording its detail otherwise (another version's) is still a
    'starting' spell in the node's events, not 'token refused' as the collector's report says."""
    body = b'{"detail": "warming up its disk tier", "starting": true}'
    n1 = _fra(db, n1="http://127.0.0.1:9")["n1"]
    collector = Collector(db, CollectorConfig(interval_s=60.0), clock=lambda: T0_S)
    try:
        with answering_url(503, body, "application/json") as url:
            with AgentClient(url) as client, pytest.raises(AgentStarting) as raised:
                client.health()
            with db.begin() as conn:
                conn.execute(update(Node).where(Node.id == n1).values(agent_url=url))
            report = collector.collect_once()
    finally:
        collector.close()
    said = str(raised.value)
    assert says_starting(said) and "warming up its disk tier" in said and url in said
    assert list(report.starting) == ["n1"] and says_starting(report.starting["n1"])
    t0, win = _window()
    with db.connect() as conn:
        events = node_events(conn, win, n1)
    assert [(e.ts_ms, e.kind) for e in events] == [(t0, "starting")]
    assert "warming up its disk tier" in events[0].detail


def recorded_json(db: Engine, win: Window) -> dict[str, Any]:
    with db.connect() as conn:
        doc = recorded(conn, win, list_nodes(conn)).as_dict()
    return {row["node"]: row for row in doc["nodes"]}
