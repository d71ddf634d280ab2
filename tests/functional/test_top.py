"""`kvctl top` driven by Textual's pilot against real agents on loopback and a real inventory:
sorting, filtering, grouping, drill-down, actions with confirmation and their audit rows,
--readonly, an agent dying mid-view, agents by URL, 15 agents, a real router's decisions
(--router, and the router going away), and the command line."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from textual.pilot import Pilot
from textual.widgets import DataTable, Header, RichLog, Static
from typer.testing import CliRunner

from kvctl.cli.main import app as cli
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.fleet.audit import recent
from kvctl.format import compact_per_second, percent
from kvctl.index.follower import Followers
from kvctl.index.model import EmbeddedIndex
from kvctl.remote.fetchplan import PrefillModel
from kvctl.router.app import RouterServer
from kvctl.router.client import RouterClient
from kvctl.router.score import Costs
from kvctl.router.service import Router
from kvctl.router.topology import DcLink, Node, Topology
from kvctl.tui.app import TopApp, create_app
from kvctl.tui.dialogs import ConfirmScreen, HelpScreen, TierDialog
from kvctl.tui.fleet_screen import FleetScreen
from kvctl.tui.node_screen import NodeScreen
from kvctl.tui.sources import AgentSource, FleetSource, RouterWatch
from tests.functional.agents import Agent, closed_port, running_agent, start_agent

CHUNK_BYTES = 64 << 10
TOKENS = 256
ARGS = ("--cpu", "4MiB", "--disk", "8MiB")


def put_chain(agent: Agent, n: int, *, seed: int, tenant: str = "acme") -> list[bytes]:
    """``n`` chained chunks of a prompt whose keys the agent computes."""
    tokens = [seed * 100_000 + i for i in range(n * TOKENS)]
    found = agent.control().lookup(tokens=tokens, count=False)
    keys = [bytes.fromhex(c["key"]) for c in found["chunks"]]
    with agent.data() as c:
        parent = None
        for k in keys:
            c.put(k, bytes([k[0]]) * CHUNK_BYTES, tenant=tenant, parent=parent, tokens=TOKENS)
            parent = k
    return keys


def read(agent: Agent, key: bytes, times: int, tenant: str = "acme") -> None:
    with agent.data() as c:
        for _ in range(times):
            c.get(key, tenant=tenant)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Engine, dict[str, Agent]]]:
    """gpu-a and gpu-b in fra, gpu-c in ams (all live), gpu-down in ams (nothing listens)."""
    layout = {"gpu-a": "fra", "gpu-b": "fra", "gpu-c": "ams"}
    agents = {
        name: start_agent(tmp_path / name, "--name", name, "--dc", dc, *ARGS)
        for name, dc in layout.items()
    }
    engine = open_db(f"sqlite:///{tmp_path / 'metrics.db'}", auto_upgrade=True)
    try:
        with engine.begin() as conn:
            add_dc(conn, "fra")
            add_dc(conn, "ams")
            for name, dc in layout.items():
                add_node(conn, name, dc=dc, agent_url=agents[name].state.control_url)
            add_node(conn, "gpu-down", dc="ams", agent_url=f"http://127.0.0.1:{closed_port()}")
        yield engine, agents
    finally:
        engine.dispose()
        for a in agents.values():
            if a.proc.poll() is None:
                a.stop()


def drive(app: TopApp, script: Callable[[Pilot[None]], Awaitable[None]], size=(160, 50)) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await script(pilot)

    asyncio.run(main())


async def until(pilot: Pilot[None], cond: Callable[[], bool], what: str, timeout_s=15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


async def poll(pilot: Pilot[None], app: TopApp) -> None:
    """One poll applied to the screen."""
    before = app.refreshes
    app.tick()
    await until(pilot, lambda: app.refreshes > before, "a poll")
    await pilot.pause()


def row_keys(app: TopApp) -> list[str]:
    table = app.screen.query_one("#fleet", DataTable)
    return [str(r.key.value) for r in table.ordered_rows]


def cell(app: TopApp, row_key: str, column: str) -> str:
    table = app.screen.query_one("#fleet", DataTable)
    return str(table.get_cell(row_key, column))


def select_row(app: TopApp, table_id: str, key: str) -> None:
    table = app.screen.query_one(table_id, DataTable)
    table.move_cursor(row=table.get_row_index(key), animate=False)


# --- the fleet table ---------------------------------------------------------------------------
def test_fleet_table_sorts_filters_and_groups(fleet: tuple[Engine, dict[str, Agent]]) -> None:
    engine, agents = fleet
    a_keys = put_chain(agents["gpu-a"], 3, seed=1)
    put_chain(agents["gpu-b"], 1, seed=2)
    app = create_app(FleetSource(engine, timeout_s=2), audit_engine=engine, auto_poll=False)

    async def script(pilot: Pilot[None]) -> None:
        await poll(pilot, app)
        # between two polls: gpu-a 2 of 3 chunks hit per lookup, gpu-b misses, gpu-c idle
        tokens_a = [1 * 100_000 + i for i in range(3 * TOKENS)]
        for _ in range(4):
            agents["gpu-a"].control().lookup(tokens=tokens_a[: 2 * TOKENS], tenant="acme")
            agents["gpu-b"].control().lookup(tokens=[7] * TOKENS)
        await poll(pilot, app)
        assert isinstance(app.screen, FleetScreen)
        select_row(app, "#fleet", "node:gpu-b")
        # default: by DC then node
        assert row_keys(app) == ["node:gpu-c", "node:gpu-down", "node:gpu-a", "node:gpu-b"]
        assert cell(app, "node:gpu-a", "hit") == "100%"
        assert cell(app, "node:gpu-b", "hit") == "0%"
        assert cell(app, "node:gpu-c", "hit") == "idle"
        assert cell(app, "node:gpu-down", "state").startswith("DOWN")
        assert cell(app, "node:gpu-down", "hit") == "N/A"
        assert cell(app, "node:gpu-a", "split") == "100/0"  # read by the tenant that stored
        assert cell(app, "node:gpu-a", "tier:cpu").endswith("%")
        assert cell(app, "node:gpu-a", "power") == "N/A"  # no NVML on this machine
        summary = str(app.screen.query_one("#summary", Static).render())
        assert "3/4 up" in summary and "hit 67%" in summary  # 8 of 12 chunks fleet-wide

        # sort by hit ratio (a header click), then reverse with S; missing values stay last
        screen = app.screen
        assert isinstance(screen, FleetScreen)
        table = screen.query_one("#fleet", DataTable)
        table.post_message(
            DataTable.HeaderSelected(table, table.columns["hit"].key, 3, table.columns["hit"].label)
        )
        await pilot.pause()
        assert screen.sort == "hit" and not screen.reverse
        assert row_keys(app) == ["node:gpu-b", "node:gpu-a", "node:gpu-c", "node:gpu-down"]
        assert "HIT ▲" in str(table.columns["hit"].label)
        assert screen.selected_node().name == "gpu-b"  # type: ignore[union-attr]  # kept
        await poll(pilot, app)
        assert screen.selected_node().name == "gpu-b"  # type: ignore[union-attr]
        await pilot.press("S")
        assert row_keys(app) == ["node:gpu-a", "node:gpu-b", "node:gpu-c", "node:gpu-down"]
        await pilot.press("s")  # the next column
        assert screen.sort == "trend"

        # filter: only fra; then only the down node; Escape clears
        await pilot.press("slash")
        screen.query_one("#filter").value = "[/]"  # type: ignore[attr-defined]  # not markup
        await pilot.pause()
        assert row_keys(app) == [] and "[/]" in str(screen.query_one("#summary", Static).render())
        screen.query_one("#filter").value = ""  # type: ignore[attr-defined]
        await pilot.press(*"dc:fra")
        assert row_keys(app) == ["node:gpu-a", "node:gpu-b"]
        await pilot.press("enter")
        assert "filter 'dc:fra': 2 shown" in str(screen.query_one("#summary", Static).render())
        await pilot.press("slash")
        screen.query_one("#filter").value = "down"  # type: ignore[attr-defined]
        await pilot.pause()
        assert row_keys(app) == ["node:gpu-down"]
        await pilot.press("escape")
        assert len(row_keys(app)) == 4

        # grouped by DC: a header with the DC's totals before its nodes
        await pilot.press("g")
        assert row_keys(app)[0] == "dc:ams" and "dc:fra" in row_keys(app)
        assert cell(app, "dc:ams", "node") == "1/2 up"
        assert cell(app, "dc:fra", "hit") == "67%"  # 8 hits of 12 chunks looked up in fra
        # a DC header is not a node: actions ask for a node
        select_row(app, "#fleet", "dc:ams")
        await pilot.press("f")
        assert not isinstance(app.screen, TierDialog)

        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert isinstance(app.screen, FleetScreen)

    drive(app, script)
    assert a_keys  # the chain was stored


# --- drill-down -------------------------------------------------------------------------------
def test_node_view_shows_tiers_events_hot_prefixes_and_pinned(
    fleet: tuple[Engine, dict[str, Agent]],
) -> None:
    engine, agents = fleet
    a = agents["gpu-a"]
    keys = put_chain(a, 3, seed=3)
    read(a, keys[0], 5)
    read(a, keys[1], 2)
    a.control().pin([keys[2]])
    a.control().move([keys[1]], "disk")
    app = create_app(FleetSource(engine, timeout_s=2), audit_engine=engine, auto_poll=False)

    async def script(pilot: Pilot[None]) -> None:
        await poll(pilot, app)
        select_row(app, "#fleet", "node:gpu-a")
        await pilot.press("enter")
        assert isinstance(app.screen, NodeScreen)
        screen = app.screen
        top = screen.query_one("#top", DataTable)
        await until(pilot, lambda: top.row_count == 3, "the hot chunks")
        # hottest first, each with its cached prefix length in tokens
        assert [str(r.key.value) for r in top.ordered_rows] == [k.hex() for k in keys]
        assert str(top.get_cell(keys[0].hex(), top.ordered_columns[2].key)) == "5"
        assert str(top.get_cell(keys[2].hex(), top.ordered_columns[3].key)) == f"{3 * TOKENS} tok"
        assert str(top.get_cell(keys[1].hex(), top.ordered_columns[1].key)) == "disk"
        pinned = screen.query_one("#pinned", DataTable)
        assert [str(r.key.value) for r in pinned.ordered_rows] == [keys[2].hex()]
        log = screen.query_one("#events", RichLog)
        text = "\n".join(str(line.text) for line in log.lines)
        assert text.count(" store ") == 3 and " move " in text and "from cpu" in text
        tiers = screen.query_one("#tiers", DataTable)
        assert [str(r.key.value) for r in tiers.ordered_rows] == ["cpu", "disk"]
        summary = str(screen.query_one("#node-summary", Static).render())
        assert summary.startswith("up ") and "power N/A" in summary

        # new events arrive on the next fetch
        put_chain(a, 1, seed=4)
        screen.fetch_details()
        await until(
            pilot,
            lambda: "\n".join(str(ln.text) for ln in log.lines).count(" store ") == 4,
            "the new store event",
        )
        await pilot.press("escape")
        assert isinstance(app.screen, FleetScreen)

    drive(app, script)


def test_node_page_and_json_show_the_reads_gone_and_each_tiers_split(tmp_path: Path) -> None:
    """The node page says, since the agent started, the share of its engines' reads whose
    chunk was gone and each tier's reuse / sharing hits per lookup, as `kvctl status` does
    (tests/functional/test_read_misses.py builds the case: 6 reads, 2 gone; cpu 6 reuse and 2
    sharing hits of 8 lookups); `top --json` carries them under `kvctl status --json`'s names.
    An idle agent's reads are 0: the share is N/A, not 0%."""
    from tests.functional.test_read_misses import reads_gone_case

    small = ("--disk", "0", "--cpu", "16MiB")
    with (
        running_agent(tmp_path / "a", "--name", "busy", "--dc", "lab", *small) as a,
        running_agent(tmp_path / "b", "--name", "idle", "--dc", "lab", *small) as b,
    ):
        reads_gone_case(a)
        urls = [a.state.control_url, b.state.control_url]
        app = create_app(AgentSource(urls, timeout_s=2), readonly=True, auto_poll=False)
        said: dict[str, str] = {}

        async def script(pilot: Pilot[None]) -> None:
            await poll(pilot, app)
            for name in ("busy", "idle"):
                select_row(app, "#fleet", f"node:{name}")
                await pilot.press("enter")
                assert isinstance(app.screen, NodeScreen)
                summary = app.screen.query_one("#node-summary", Static)
                await until(pilot, lambda s=summary: "since start:" in str(s.render()), "the line")
                said[name] = str(summary.render())
                await pilot.press("escape")

        drive(app, script)
        out = runner.invoke(cli, ["top", "--json", "--interval", "0.2", "--agent", urls[0]])
    busy = " ".join(said["busy"].split())
    assert "reads gone 33.3% (2 of 6 chunks)" in busy, busy
    assert "per tier reuse / sharing: cpu 75.0% / 25.0%" in busy, busy
    idle = " ".join(said["idle"].split())
    assert "reads gone N/A (0 of 0 chunks)" in idle and "cpu N/A / N/A" in idle, idle
    assert out.exit_code == 0, out.output
    node = json.loads(out.stdout)["nodes"][0]
    assert (node["read_chunks"], node["read_missing_chunks"]) == (6, 2)
    assert node["read_missing_ratio"] == 2 / 6
    cpu = node["tiers"]["cpu"]
    assert (cpu["hits"], cpu["reuse_hits"], cpu["sharing_hits"]) == (8, 6, 2), cpu
    assert (cpu["reuse_hit_ratio"], cpu["sharing_hit_ratio"]) == (0.75, 0.25)
    assert cpu["capacity_bytes"] == 16 << 20  # beside its gauges, as before
    total = json.loads(out.stdout)["total"]
    assert (total["read_chunks"], total["read_missing_chunks"]) == (6, 2)


# --- actions ------------------------------------------------------------------------------------
def test_pin_from_the_node_view_asks_first_and_is_audited(
    fleet: tuple[Engine, dict[str, Agent]],
) -> None:
    engine, agents = fleet
    a = agents["gpu-a"]
    keys = put_chain(a, 2, seed=5)
    read(a, keys[0], 3)
    app = create_app(
        FleetSource(engine, timeout_s=2), audit_engine=engine, auto_poll=False, actor="op@test"
    )

    async def script(pilot: Pilot[None]) -> None:
        await poll(pilot, app)
        select_row(app, "#fleet", "node:gpu-a")
        await pilot.press("enter")
        top = app.screen.query_one("#top", DataTable)
        await until(pilot, lambda: top.row_count == 2, "the hot chunks")
        # on the events tab no chunk is selected
        await pilot.press("p")
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("2")
        await pilot.press("p")
        assert isinstance(app.screen, ConfirmScreen)
        confirm = app.screen
        assert confirm.request.action == "pin" and confirm.node.name == "gpu-a"
        assert confirm.request.chunks is not None
        assert confirm.request.chunks.keys == (keys[0].hex(),)  # the hottest: first row
        await pilot.press("n")  # cancelled: nothing done, nothing audited
        assert isinstance(app.screen, NodeScreen)
        await pilot.press("p")
        await pilot.press("y")
        await until(pilot, lambda: len(app.actions_done) == 1, "the pin")
        pinned = app.screen.query_one("#pinned", DataTable)
        await until(pilot, lambda: pinned.row_count == 1, "the pinned list")

    drive(app, script)
    items = {i["key"]: i for i in a.control().keys(limit=10)["items"]}
    assert items[keys[0].hex()]["pinned"] and not items[keys[1].hex()]["pinned"]
    with engine.connect() as conn:
        rows = recent(conn, limit=10)
    assert [(r.action, r.target, r.ok, r.actor) for r in rows] == [
        ("pin", "gpu-a", True, "op@test")
    ]
    assert rows[0].args == {"keys": 1}


def test_flush_and_resize_from_the_fleet_view(fleet: tuple[Engine, dict[str, Agent]]) -> None:
    engine, agents = fleet
    b = agents["gpu-b"]
    put_chain(b, 3, seed=6)
    app = create_app(FleetSource(engine, timeout_s=2), audit_engine=engine, auto_poll=False)

    async def script(pilot: Pilot[None]) -> None:
        await poll(pilot, app)
        select_row(app, "#fleet", "node:gpu-b")
        await pilot.press("f")
        assert isinstance(app.screen, TierDialog)
        await pilot.click("#ok")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(pilot, lambda: len(app.actions_done) == 1, "the flush")
        assert app.actions_done[0].ok

        # resize: a bad size is refused in the dialog, before anything is asked
        await pilot.press("z")
        assert isinstance(app.screen, TierDialog)
        await pilot.press(*"12 parsecs", "enter")
        assert isinstance(app.screen, TierDialog)
        assert "unknown size unit" in str(app.screen.query_one("#error", Static).render())
        app.screen.query_one("#size").value = "2MiB"  # type: ignore[attr-defined]
        await pilot.press("enter")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(pilot, lambda: len(app.actions_done) == 2, "the resize")
        await until(pilot, lambda: app.refreshes >= 3, "the poll after the action")
        row = app.view.row("gpu-b")  # type: ignore[union-attr]
        assert row is not None and row.tiers["cpu"].capacity_bytes == 2 << 20

    drive(app, script)
    usage = b.control().stats()["usage"]["cpu"]
    assert usage["used_bytes"] == 0 and usage["capacity_bytes"] == 2 << 20
    with engine.connect() as conn:
        rows = recent(conn, limit=10)
    assert [(r.action, r.target, r.ok) for r in rows] == [
        ("resize", "gpu-b", True),
        ("flush", "gpu-b", True),
    ]
    assert rows[0].args == {"tier": "cpu", "size": "2MiB"}
    assert rows[1].args == {"tier": "cpu", "demote": False}


def test_readonly_refuses_every_action(fleet: tuple[Engine, dict[str, Agent]]) -> None:
    engine, agents = fleet
    a = agents["gpu-a"]
    keys = put_chain(a, 1, seed=7)
    app = create_app(FleetSource(engine, timeout_s=2), readonly=True, auto_poll=False)

    # each refusal noted as it is shown: a notification leaves after 5 s, which a loaded
    # machine can spend on this script (a fresh-clone CI run saw 5 of the 7 left at the end)
    refusals: dict[str, str] = {}

    def note_refusals() -> None:
        refusals.update(
            (n.identity, n.message) for n in app._notifications if "read-only" in n.message
        )

    async def script(pilot: Pilot[None]) -> None:
        await poll(pilot, app)
        assert "READ-ONLY" in app.screen.sub_title
        select_row(app, "#fleet", "node:gpu-a")
        for key in ("f", "z"):
            await pilot.press(key)
            note_refusals()
            assert isinstance(app.screen, FleetScreen)
        await pilot.press("enter")
        top = app.screen.query_one("#top", DataTable)
        await until(pilot, lambda: top.row_count == 1, "the hot chunks")
        await pilot.press("2")
        for key in ("p", "u", "e", "f", "z"):
            await pilot.press(key)
            note_refusals()
            assert isinstance(app.screen, NodeScreen), key
        assert len(refusals) == 7, refusals

    drive(app, script)
    assert app.actions_done == []
    with engine.connect() as conn:
        assert recent(conn, limit=10) == []
    assert a.control().keys(limit=5)["items"][0]["key"] == keys[0].hex()  # still there


# --- liveness -----------------------------------------------------------------------------------
def test_an_agent_dying_mid_view_stays_on_screen_as_down(
    fleet: tuple[Engine, dict[str, Agent]],
) -> None:
    engine, agents = fleet
    app = create_app(FleetSource(engine, timeout_s=1), readonly=True, interval_s=0.3)

    async def script(pilot: Pilot[None]) -> None:
        await until(pilot, lambda: app.refreshes >= 2, "two polls")
        assert cell(app, "node:gpu-c", "state") == "up"
        agents["gpu-c"].kill9()
        seen = app.refreshes
        await until(
            pilot, lambda: cell(app, "node:gpu-c", "state").startswith("DOWN"), "gpu-c down"
        )
        # the view goes on refreshing, the others stay up
        await until(pilot, lambda: app.refreshes >= seen + 3, "more polls")
        assert cell(app, "node:gpu-a", "state") == "up"
        assert cell(app, "node:gpu-c", "hit") == "N/A"
        assert len(row_keys(app)) == 4
        row = app.view.row("gpu-c")  # type: ignore[union-attr]
        assert row is not None and "cannot reach" in (row.error or "")
        # its page says so too
        select_row(app, "#fleet", "node:gpu-c")
        await pilot.press("enter")
        summary = app.screen.query_one("#node-summary", Static)
        await until(pilot, lambda: "DOWN for" in str(summary.render()), "the node page")

    drive(app, script)


def test_agents_by_url_without_a_database(tmp_path: Path) -> None:
    with running_agent(tmp_path / "x", "--name", "solo", "--dc", "lab", *ARGS) as x:
        down = f"http://127.0.0.1:{closed_port()}"
        source = AgentSource([x.state.control_url, down], timeout_s=1)
        app = create_app(source, auto_poll=False)  # no database: actions refused

        async def script(pilot: Pilot[None]) -> None:
            await poll(pilot, app)
            assert row_keys(app) == ["node:127.0.0.1:" + down.rsplit(":", 1)[1], "node:solo"]
            assert cell(app, "node:solo", "dc") == "lab"
            assert cell(app, "node:solo", "rtt") == "N/A"  # no link probes without the db
            select_row(app, "#fleet", "node:solo")
            await pilot.press("f")
            assert isinstance(app.screen, FleetScreen)
            assert any("no database" in n.message for n in app._notifications)

        drive(app, script)
    with pytest.raises(ValueError, match="not an agent URL"):
        AgentSource(["ftp://x"])


#: agents started at once: 16 on a 2-core CI runner loaded by the other test workers left one
#: agent's log silent for the 30 s its start allows (each start imports kvctl), so it failed
STARTS_AT_ONCE = 4


#: agents in the many-agents test: its scale (50 and more) is `kvctl bench top`'s to measure;
#: here every row up and polls completing in a fleet of several DCs. 50 cost two minutes of a
#: CPU-bound test run (each agent about 2 s of CPU), 15 about 35 s
MANY_AGENTS = 15


@pytest.mark.slow
def test_many_agents_keep_the_view_refreshing(tmp_path: Path) -> None:
    """Functional only: every row up and polls completing; `kvctl bench top` times them."""
    from concurrent.futures import ThreadPoolExecutor

    names = [f"n{i:02d}" for i in range(MANY_AGENTS)]
    with ThreadPoolExecutor(STARTS_AT_ONCE) as pool:
        started = list(
            pool.map(
                lambda n: start_agent(tmp_path / n, "--name", n, "--cpu", "4MiB", "--disk", "0"),
                names,
            )
        )
    engine = open_db(f"sqlite:///{tmp_path / 'metrics.db'}", auto_upgrade=True)
    try:
        with engine.begin() as conn:
            for dc in ("d0", "d1", "d2", "d3", "d4"):
                add_dc(conn, dc)
            for i, (name, agent) in enumerate(zip(names, started, strict=True)):
                add_node(conn, name, dc=f"d{i % 5}", agent_url=agent.state.control_url)
        # 2.5 s: a poll waits 60% of the interval for the agents, and 50 agents on a loaded
        # 2-core runner did not all answer in 0.6 s (33 of 50 up in a fresh-clone run)
        app = create_app(FleetSource(engine, timeout_s=2), readonly=True, interval_s=2.5)

        async def script(pilot: Pilot[None]) -> None:
            await until(pilot, lambda: app.refreshes >= 4, "four polls", timeout_s=60)
            # every row up in a poll: on a runner loaded with other tests, 9 of 50 answered
            # within one poll's wait, so the view is given later polls to show them all
            await until(
                pilot,
                lambda: app.view is not None and app.view.total.up == MANY_AGENTS,
                "every agent up in one poll",
                timeout_s=90,
            )
            assert len(row_keys(app)) == MANY_AGENTS
            await pilot.press("g")
            assert len(row_keys(app)) == MANY_AGENTS + 5  # a header row per DC

        drive(app, script, size=(200, 70))
    finally:
        engine.dispose()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda a: a.stop(), started))


# --- the command ------------------------------------------------------------------------------
runner = CliRunner()


def test_top_json_prints_two_polls_worth(fleet: tuple[Engine, dict[str, Agent]]) -> None:
    engine, agents = fleet
    url = str(engine.url)
    out = runner.invoke(cli, ["top", "--db", url, "--json", "--interval", "0.3"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    nodes = {n["node"]: n for n in doc["nodes"]}
    assert set(nodes) == {"gpu-a", "gpu-b", "gpu-c", "gpu-down"}
    assert nodes["gpu-a"]["up"] and not nodes["gpu-down"]["up"]
    # the measured time between the two samples: the interval, plus a poll's own time (which a
    # loaded machine stretches)
    assert 0.25 <= nodes["gpu-a"]["window_seconds"] < 3.0
    assert doc["polls"] == 2 and doc["total"]["up"] == 3
    # the database's record of the default 15 minutes, per DC of the nodes watched
    assert doc["recorded"]["window"]["name"] == "15m"
    assert [d["dc"] for d in doc["recorded"]["dcs"]] == ["ams", "fra"]
    assert doc["recorded"]["total"]["nodes"] == 4
    only = json.loads(runner.invoke(cli, ["top", "--db", url, "--json", "--dc", "ams"]).stdout)
    assert {n["node"] for n in only["nodes"]} == {"gpu-c", "gpu-down"}
    assert [d["dc"] for d in only["recorded"]["dcs"]] == ["ams"]
    solo = runner.invoke(
        cli, ["top", "--agent", agents["gpu-a"].state.control_url, "--json", "--interval", "0.2"]
    )
    assert solo.exit_code == 0, solo.output
    assert [n["node"] for n in json.loads(solo.stdout)["nodes"]] == ["gpu-a"]
    assert json.loads(solo.stdout)["recorded"] is None  # no database with --agent


def test_top_refuses_bad_input_clearly(tmp_path: Path) -> None:
    from kvctl.db.migrate import open_db

    missing = f"sqlite:///{tmp_path / 'none.db'}"
    url = f"sqlite:///{tmp_path / 'm.db'}"
    open_db(url).dispose()  # an empty inventory
    cases = [
        (["top", "--db", missing], "no fleet database at"),
        (["top", "--db", url, "--dc", "nowhere"], "no DC named"),
        (["top", "--db", url], "no nodes"),
        (["top", "--agent", "ftp://x"], "not an agent URL"),
        (["top", "--agent", "http://127.0.0.1:1", "--dc", "fra"], "use one way"),
        (["top", "--db", url, "--json", "--window", "soon"], "not a duration"),
        # the runner's standard streams are not a terminal: no escape codes into a pipe
        (["top", "--agent", "http://127.0.0.1:1", "--readonly"], "needs a terminal"),
    ]
    for args, message in cases:
        out = runner.invoke(cli, args)
        assert out.exit_code == 2, (args, out.output)
        assert message in " ".join(out.output.split()), (args, out.output)


# --- the router's decisions (--router) ----------------------------------------------------------
ROUTER_TOKEN = "top-router-token"


@pytest.fixture
def router(fleet: tuple[Engine, dict[str, Agent]]) -> Iterator[RouterServer]:
    """A real router in this process following the three live agents' store events (gpu-a and
    gpu-b in fra, gpu-c in ams, 80 km apart), behind a bearer token."""
    _engine, agents = fleet
    index = EmbeddedIndex()
    followers = Followers(
        index, {n: (a.state.control_url, None) for n, a in agents.items()}, poll_s=0.05
    )
    dcs = {"gpu-a": "fra", "gpu-b": "fra", "gpu-c": "ams"}
    topology = Topology.build(
        [Node(n, dc) for n, dc in dcs.items()], {("fra", "ams"): DcLink.fiber(80)}
    )
    # a slow prefill (1 ms a token): any chunk held anywhere is worth fetching
    costs = Costs(PrefillModel(1e-3, 0.0, "configured: test"))
    server = RouterServer(
        Router(index, topology, costs, followers=followers),
        listen="127.0.0.1:0",
        token=ROUTER_TOKEN,
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def indexed(server: RouterServer, node: str, chunks: int) -> None:
    deadline = time.monotonic() + 15
    while server.router.index.nodes().get(node, 0) < chunks:
        assert time.monotonic() < deadline, f"{node}'s chunks never reached the router's index"
        time.sleep(0.05)


def test_routing_columns_and_lines_from_a_real_router(
    fleet: tuple[Engine, dict[str, Agent]], router: RouterServer
) -> None:
    engine, agents = fleet
    keys_a = put_chain(agents["gpu-a"], 3, seed=21)
    keys_c = put_chain(agents["gpu-c"], 2, seed=22)
    indexed(router, "gpu-a", 3)
    indexed(router, "gpu-c", 2)
    watch = RouterWatch(router.url, token=ROUTER_TOKEN, timeout_s=2)
    app = create_app(FleetSource(engine, timeout_s=2, router=watch), auto_poll=False)
    decisions: list[dict[str, object]] = []

    async def script(pilot: Pilot[None]) -> None:
        await poll(pilot, app)  # the baseline: the router has decided nothing yet
        assert cell(app, "node:gpu-a", "routed") == "N/A"  # no window yet: N/A, not 0
        with RouterClient(router.url, token=ROUTER_TOKEN) as rc:
            for _ in range(3):
                decisions.append(rc.route(keys=keys_a, tenant="acme", origin_dc="fra"))
            decisions.append(rc.route(keys=keys_c, tenant="acme", origin_dc="ams"))
            fresh = [bytes([i]) * 16 for i in range(1, 3)]  # held by nobody
            decisions.append(rc.route(keys=fresh, tenant="acme", origin_dc="fra"))
        await poll(pilot, app)
        view = app.view
        assert view is not None and view.routing is not None and view.routing.up
        # the holders got their prefixes; the fresh prompt went to a node holding none of it
        assert [d["node"] for d in decisions[:4]] == ["gpu-a"] * 3 + ["gpu-c"]
        assert all(d["local_chunks"] == d["chunks"] for d in decisions[:4])
        assert decisions[4]["local_chunks"] == 0 and decisions[4]["indexed_chunks"] == 0
        seconds = view.routing.recent.seconds
        assert seconds > 0
        for name in ("gpu-a", "gpu-b", "gpu-c"):
            mine = [d for d in decisions if d["node"] == name]
            held = sum(1 for d in mine if d["local_chunks"])
            assert cell(app, f"node:{name}", "routed") == compact_per_second(len(mine) / seconds)
            holder = percent(held / len(mine), digits=0) if mine else "idle"
            assert cell(app, f"node:{name}", "holder") == holder
        assert cell(app, "node:gpu-down", "routed") == "N/A"  # not in the router's topology
        t = view.routing.total  # since the router started: exactly what it decided
        assert (t.decisions, t.to_holder) == (5, 4)
        assert (t.requested_chunks, t.indexed_chunks, t.local_chunks) == (13, 11, 11)
        assert t.pulled_chunks == 0 and view.routing.links == []
        lines = str(app.screen.query_one("#routing", Static).render()).splitlines()
        assert lines[0].startswith(
            "routing since the router started: 5 decisions · 80% to a holder · index hit 85% "
            "of 13 chunks · reused 85%: 11 local, 0 pulled"
        )
        assert lines[1].endswith("pulled between DCs since the router started: none")
        assert ROUTER_TOKEN not in app.screen.query_one(Header).screen_sub_title
        # the router goes away: its cells turn N/A with the reason, the agents' stay live
        router.stop()
        await poll(pilot, app)
        assert app.view is not None and app.view.routing is not None
        assert not app.view.routing.up
        text = str(app.screen.query_one("#routing", Static).render())
        assert text.startswith(f"router down: the router at {router.url} did not answer")
        assert cell(app, "node:gpu-a", "routed") == "N/A"
        assert cell(app, "node:gpu-a", "holder") == "N/A"
        assert cell(app, "node:gpu-a", "state") == "up"
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert any("TO HOLDER" in str(s.render()) for s in app.screen.query(Static))

    drive(app, script)


def test_top_json_with_a_router_and_with_one_that_is_down(
    fleet: tuple[Engine, dict[str, Agent]], router: RouterServer, tmp_path: Path
) -> None:
    engine, agents = fleet
    keys = put_chain(agents["gpu-b"], 2, seed=23)
    indexed(router, "gpu-b", 2)
    with RouterClient(router.url, token=ROUTER_TOKEN) as rc:
        assert rc.route(keys=keys, tenant="acme", origin_dc="fra")["node"] == "gpu-b"
    token_file = tmp_path / "router.token"
    token_file.write_text(ROUTER_TOKEN + "\n")
    args = ["top", "--db", str(engine.url), "--json", "--interval", "0.2"]
    out = runner.invoke(
        cli, [*args, "--router", router.url, "--router-token-file", str(token_file)]
    )
    assert out.exit_code == 0, out.output
    assert ROUTER_TOKEN not in out.stdout
    doc = json.loads(out.stdout)
    routing = doc["routing"]
    assert routing["up"] and routing["router"] == router.url
    assert routing["since_router_start"]["decisions"] == 1
    assert routing["since_router_start"]["to_holder_share"] == 1.0
    nodes = {n["node"]: n for n in doc["nodes"]}
    assert nodes["gpu-b"]["routing"]["decisions"] == 1
    assert nodes["gpu-down"]["routing"] is None
    # $KVCTL_ROUTER_URL is the default; without the token the router refuses, and says so
    out = runner.invoke(cli, args, env={"KVCTL_ROUTER_URL": router.url, "KVCTL_ROUTER_TOKEN": ""})
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["routing"]["up"] is False and "401" in doc["routing"]["error"]
    assert all(n["routing"] is None for n in doc["nodes"])
    assert doc["total"]["up"] == 3  # the agents are read all the same


def test_top_refuses_a_bad_router_clearly() -> None:
    cases = [
        (
            ["top", "--agent", "http://127.0.0.1:1", "--router", "127.0.0.1:9480"],
            "not a router URL",
        ),
        (
            ["top", "--agent", "http://127.0.0.1:1", "--router-token-file", "x.token"],
            "needs a router",
        ),
        (
            [
                "top",
                "--agent",
                "http://127.0.0.1:1",
                "--router",
                "http://h:1",
                "--router-token-file",
                "/nonexistent/t",
            ],
            "cannot read the token file",
        ),
    ]
    for args, message in cases:
        out = runner.invoke(cli, args, env={"KVCTL_ROUTER_URL": ""})
        assert out.exit_code == 2, (args, out.output)
        assert message in " ".join(out.output.split()), (args, out.output)


def test_fleet_source_reads_each_links_rtt_basis(tmp_path: Path) -> None:
    """RTTs come with their basis from the collectors' probes: an agent-emulated delay is in
    the RTT, so top must not pass it off as measured."""
    from kvctl.db.ingest import insert_rows
    from kvctl.db.models import raw_table

    engine = open_db(f"sqlite:///{tmp_path / 'metrics.db'}", auto_upgrade=True)
    now_s = time.time()
    try:
        with engine.begin() as conn:
            for dc in ("fra", "ams", "lon"):
                add_dc(conn, dc)
            ids = {
                name: add_node(conn, name, dc=dc, agent_url=f"http://127.0.0.1:{closed_port()}")
                for name, dc in (("a", "fra"), ("b", "ams"), ("c", "lon"))
            }

            def probe(src: str, dst: str, basis: str | None, ago_s: float) -> dict[str, object]:
                return {"src_node_id": ids[src], "dst_node_id": ids[dst],
                        "ts_ms": int((now_s - ago_s) * 1000), "rtt_s": 0.002,
                        "bandwidth_bytes_per_s": 1e9, "loss_ratio": 0.0, "probe_bytes": 1,
                        "ok": True, "error": None, "rtt_basis": basis,
                        "emulated_delay_s": 0.001 if basis == "emulated" else None}  # fmt: skip

            insert_rows(
                conn,
                raw_table("link_sample"),
                [
                    probe("a", "b", "emulated", 60),
                    probe("a", "c", "emulated", 60),
                    probe("c", "a", None, 120),  # before bases were recorded: measured
                    probe("b", "c", "measured", 60),
                ],
            )
        source = FleetSource(engine, clock=lambda: now_s)
        rtt, basis = source.rtt()
        assert rtt[("fra", "ams")] == pytest.approx(0.002)
        assert basis[("fra", "ams")] == basis[("ams", "fra")] == "emulated"
        assert basis[("fra", "lon")] == "mixed" and basis[("ams", "lon")] == "measured"
    finally:
        engine.dispose()


def test_top_json_counts_downtime_from_the_collectors_last_scrape(
    fleet: tuple[Engine, dict[str, Agent]],
) -> None:
    """gpu-down was last scraped 47 s before top opens: top says down for 47 s, as `kvctl
    status` says last seen 47 s ago, not the second or so since top started."""
    from sqlalchemy import select

    from kvctl.db.ingest import insert_rows
    from kvctl.db.models import Node, raw_table

    engine, _ = fleet
    seen_ms = int(time.time() * 1000) - 47_000
    with engine.begin() as conn:
        down_id = conn.execute(select(Node.id).where(Node.name == "gpu-down")).scalar_one()
        insert_rows(
            conn,
            raw_table("node_sample"),
            [{"node_id": down_id, "ts_ms": seen_ms, "up": True, "scrape_seconds": 0.01,
              "agent_started_s": 1.0, "nvml_available": False, "error": None}],
        )  # fmt: skip
    out = runner.invoke(cli, ["top", "--db", str(engine.url), "--json", "--interval", "0.2"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    nodes = {n["node"]: n for n in doc["nodes"]}
    down = nodes["gpu-down"]
    assert down["last_seen_ms"] == seen_ms
    assert down["down_for_s"] == pytest.approx((doc["ts_ms"] - seen_ms) / 1000, abs=0.01)
    assert 47 <= down["down_for_s"] < 60
    assert down["lookups"] is None and down["hits"] is None  # not read: unknown, not 0
    assert nodes["gpu-a"]["last_seen_ms"] == doc["ts_ms"]  # up: seen at this poll
