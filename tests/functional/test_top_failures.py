"""`kvctl top` when agents misbehave, against real agents: a hung one (SIGSTOP: it takes the
connection and says nothing) costs its own row, not everyone's refresh, and reads "NO ANSWER",
not "DOWN"; one that refuses the token is up (restarting it would not help), not down, and so
is one still opening its tiers ("starting"). The view (Textual pilot) and --json say the same.
An agent whose GPUs hang still shows its figures. The fleet database going away leaves the
agents live, from the inventory as last read."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine, make_url
from textual.pilot import Pilot
from textual.widgets import Static
from typer.testing import CliRunner

from kvctl.agent_starting import STARTING_DETAIL
from kvctl.cli.main import app as cli
from kvctl.db.ingest import insert_rows
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import raw_table
from kvctl.tui.app import create_app
from kvctl.tui.model import Poll
from kvctl.tui.node_screen import NodeScreen
from kvctl.tui.sources import AgentSource, FleetSource
from tests.functional.agents import Agent, closed_port, running_agent, start_agent
from tests.functional.hung import HANG_GUARD_S, stopped
from tests.functional.test_top import cell, drive, poll, select_row, until
from tests.functional.waiting import wait_until
from tests.not_an_agent import answering_url, serving
from tests.starting_agent import starting_url

ARGS = ("--cpu", "4MiB", "--disk", "0")
runner = CliRunner()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Engine, Agent, Agent]]:
    """gpu-a and gpu-h in fra, both live (the tests stop gpu-h), in a SQLite inventory."""
    a = start_agent(tmp_path / "a", "--name", "gpu-a", "--dc", "fra", *ARGS)
    h = start_agent(tmp_path / "h", "--name", "gpu-h", "--dc", "fra", *ARGS)
    engine = open_db(f"sqlite:///{tmp_path / 'metrics.db'}", auto_upgrade=True)
    try:
        with engine.begin() as conn:
            add_dc(conn, "fra")
            add_node(conn, "gpu-a", dc="fra", agent_url=a.state.control_url)
            add_node(conn, "gpu-h", dc="fra", agent_url=h.state.control_url)
        yield engine, a, h
    finally:
        engine.dispose()
        for agent in (a, h):
            if agent.proc.poll() is None:
                agent.stop()


def test_a_hung_agent_costs_its_own_row_not_everyones_refresh(
    pair: tuple[Engine, Agent, Agent],
) -> None:
    engine, _a, h = pair
    # each agent may take far longer than the hang guard to answer: a poll that waited for the
    # stopped one would hold every row (and fail the guard); the view's polls must not
    source = FleetSource(engine, timeout_s=4 * HANG_GUARD_S)
    app = create_app(source, readonly=True, interval_s=1.0)

    async def script(pilot: Pilot[None]) -> None:
        await until(pilot, lambda: app.refreshes >= 1, "a first poll")
        await until(pilot, lambda: cell(app, "node:gpu-h", "state") == "up", "gpu-h up")
        with stopped(h):
            await until(
                pilot,
                lambda: cell(app, "node:gpu-h", "state").startswith("NO ANSWER"),
                "gpu-h not answering",
                timeout_s=HANG_GUARD_S,
            )
            seen = app.refreshes
            await until(
                pilot, lambda: app.refreshes >= seen + 3, "three more polls", timeout_s=HANG_GUARD_S
            )
            # the others go on refreshing as before
            await until(pilot, lambda: cell(app, "node:gpu-a", "state") == "up", "gpu-a up")
            assert cell(app, "node:gpu-h", "hit") == "N/A"
            row = app.view.row("gpu-h")  # type: ignore[union-attr]
            assert row is not None and row.silent and not row.up
            assert "hung or overloaded" in (row.error or "")
            assert app.view.as_dict()["nodes"][1]["state"] == "not answering"  # type: ignore[union-attr]
        # answering again: its answer, late or not, brings the row back
        await until(
            pilot,
            lambda: cell(app, "node:gpu-h", "state") == "up",
            "gpu-h up again",
            timeout_s=HANG_GUARD_S,
        )

    drive(app, script)


def test_top_json_says_a_hung_agent_is_not_answering(pair: tuple[Engine, Agent, Agent]) -> None:
    engine, _a, h = pair
    with stopped(h):
        out = runner.invoke(
            cli, ["top", "--db", str(engine.url), "--json", "--interval", "0.2", "--timeout", "1"]
        )
    assert out.exit_code == 0, out.output
    nodes = {n["node"]: n for n in json.loads(out.stdout)["nodes"]}
    hung, live = nodes["gpu-h"], nodes["gpu-a"]
    assert (hung["state"], hung["up"], hung["auth_refused"]) == ("not answering", False, False)
    assert "took the connection and said nothing for 1 s" in hung["error"]
    assert hung["lookups"] is None  # not read: unknown, not 0
    assert (live["state"], live["up"]) == ("up", True)


def test_an_agent_refusing_the_token_is_up_not_down(tmp_path: Path) -> None:
    with running_agent(tmp_path / "t", "--name", "locked", *ARGS, token="s3cret") as agent:
        url = agent.state.control_url
        app = create_app(AgentSource([url], token="wrong", timeout_s=2), auto_poll=False)

        async def script(pilot: Pilot[None]) -> None:
            await poll(pilot, app)
            await poll(pilot, app)
            key = "node:" + url.removeprefix("http://")
            assert cell(app, key, "state") == "up, token refused"
            assert cell(app, key, "hit") == "N/A"  # its figures were not read
            assert app.view is not None and app.view.total.up == 1

        drive(app, script)
        out = runner.invoke(
            cli, ["top", "--agent", url, "--json", "--interval", "0.2"], env={"KVCTL_TOKEN": "x"}
        )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    (node,) = doc["nodes"]
    # as `kvctl status --json` says it: up, auth_refused, no figures
    assert (node["up"], node["auth_refused"], node["state"]) == (True, True, "token refused")
    assert "refused the token" in node["error"]
    assert node["lookups"] is None and node["hit_ratio"] is None
    assert doc["total"]["up"] == 1 and doc["total"]["auth_refused"] == 1
    assert doc["total"]["lookups"] is None  # no node's figures read: unknown, not 0


def test_an_agent_that_is_starting_is_up_not_down() -> None:
    """An agent opening its tiers answers every call 503 "starting": up (a restart would only
    start it over), its figures not there yet, in the table, its node screen and --json."""
    with starting_url() as url:
        app = create_app(AgentSource([url], timeout_s=2), readonly=True, auto_poll=False)
        said = f"{STARTING_DETAIL} ({url})"

        async def script(pilot: Pilot[None]) -> None:
            await poll(pilot, app)
            await poll(pilot, app)
            key = "node:" + url.removeprefix("http://")
            assert cell(app, key, "state") == "up, starting"
            assert cell(app, key, "hit") == "N/A"  # nothing to read until its tiers are open
            assert app.view is not None and app.view.total.up == 1
            await pilot.press("enter")
            assert isinstance(app.screen, NodeScreen)
            screen = app.screen
            summary = screen.query_one("#node-summary", Static)
            assert str(summary.render()).startswith(f"up, starting: {said}")
            # its detail (events, hot chunks) is refused the same way: said once, not twice
            await until(pilot, lambda: screen.details_error is not None, "the detail's answer")
            await pilot.pause()
            assert screen.details_error == said
            assert str(summary.render()).count(said) == 1, str(summary.render())

        drive(app, script)
        out = runner.invoke(cli, ["top", "--agent", url, "--json", "--interval", "0.2"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    (node,) = doc["nodes"]
    assert (node["up"], node["starting"], node["auth_refused"]) == (True, True, False)
    assert (node["state"], node["error"]) == ("starting", said)
    assert node["lookups"] is None and node["down_for_s"] is None
    assert (doc["total"]["up"], doc["total"]["starting"]) == (1, 1)
    assert doc["total"]["lookups"] is None  # no node's figures read: unknown, not 0


def test_flushing_a_node_shown_up_without_figures_does_not_ask_whether_it_is_down(
    tmp_path: Path,
) -> None:
    """A tier action on a node opening its tiers, or refusing the token, has no tier to offer:
    the notice says why (time, or the token, is the fix), not "is it down?" of a node the
    table shows up."""
    engine = open_db(f"sqlite:///{tmp_path / 'metrics.db'}", auto_upgrade=True)
    refusing = b'{"detail": "invalid or missing bearer token"}'
    try:
        with (
            starting_url() as url,
            answering_url(401, refusing, "application/json") as locked,
        ):
            with engine.begin() as conn:
                add_dc(conn, "fra")
                add_node(conn, "gpu-s", dc="fra", agent_url=url)
                add_node(conn, "gpu-t", dc="fra", agent_url=locked)
            source = FleetSource(engine, timeout_s=2)
            app = create_app(source, audit_engine=engine, auto_poll=False)

            async def script(pilot: Pilot[None]) -> None:
                await poll(pilot, app)
                assert cell(app, "node:gpu-s", "state") == "up, starting"
                assert cell(app, "node:gpu-t", "state") == "up, token refused"
                for key in ("node:gpu-s", "node:gpu-t"):
                    select_row(app, "#fleet", key)
                    await pilot.press("f")
                said = [n.message for n in app._notifications]
                assert not any("is it down" in m for m in said), said
                assert any(m.startswith("gpu-s is starting") for m in said), said
                assert any(m.startswith("gpu-t refused the token") for m in said), said

            drive(app, script)
    finally:
        engine.dispose()


def test_the_agents_stay_live_when_the_fleet_database_goes_away(
    tmp_path: Path, pg_url: str, pg_admin: Engine
) -> None:
    """The fleet's PostgreSQL database dropped under the view (its sessions ended with it):
    the agents are still asked every poll, from the inventory as last read, and the header says
    what the database said instead of every row freezing at its last figures."""
    engine = open_db(pg_url, auto_upgrade=True)
    with running_agent(tmp_path / "a", "--name", "gpu-a", "--dc", "fra", *ARGS) as a:
        seen_ms = int(time.time() * 1000) - 100_000  # the collectors' last scrape of gpu-down
        with engine.begin() as conn:
            add_dc(conn, "fra")
            add_node(conn, "gpu-a", dc="fra", agent_url=a.state.control_url)
            down = add_node(
                conn, "gpu-down", dc="fra", agent_url=f"http://127.0.0.1:{closed_port()}"
            )
            insert_rows(
                conn, raw_table("node_sample"), [{"node_id": down, "ts_ms": seen_ms, "up": True}]
            )
        app = create_app(FleetSource(engine, timeout_s=2), readonly=True, auto_poll=False)

        async def script(pilot: Pilot[None]) -> None:
            await poll(pilot, app)
            assert cell(app, "node:gpu-a", "state") == "up"
            name = make_url(pg_url).database
            with pg_admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
            await poll(pilot, app)
            assert app.poll_error is None and app.view is not None
            assert f'database "{name}" does not exist' in (app.view.db_error or "")
            assert app.view.as_dict()["database_error"] == app.view.db_error
            summary = str(app.screen.query_one("#summary", Static).render())
            assert "database failed" in summary and "agents live" in summary
            assert cell(app, "node:gpu-a", "state") == "up"
            # a node down before keeps its downtime from the collectors' last scrape
            gone = app.view.row("gpu-down")
            assert gone is not None and gone.last_seen_ms == seen_ms
            # still asked live: an agent that dies now shows down at the next poll
            a.kill9()
            await poll(pilot, app)
            assert cell(app, "node:gpu-a", "state").startswith("DOWN")

        drive(app, script)


def test_an_agent_whose_gpus_hang_still_shows_its_figures(tmp_path: Path) -> None:
    """NVML hanging on a broken driver holds up an agent's /v1/gpus, not its stats: the row
    stays up with its figures at every poll, and only the power is unknown."""
    release = threading.Event()

    with running_agent(tmp_path / "g", "--name", "gpu-g", "--dc", "fra", *ARGS) as agent:
        upstream = agent.state.control_url

        class GpusHang(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.startswith("/v1/gpus"):
                    release.wait(HANG_GUARD_S)
                    self.send_error(503)
                    return
                r = httpx.get(upstream + self.path, timeout=10)
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers["content-type"])
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def log_message(self, *args: object) -> None:
                pass

        with serving(GpusHang) as url:
            source = AgentSource([url], timeout_s=4 * HANG_GUARD_S)
            # a poll waits 60% of the interval for the stats (through this proxy): 1 s left
            # 0.6 s, which a loaded run (three test workers beside a fresh-clone CI) overran
            app = create_app(source, readonly=True, interval_s=2.5)
            states: list[str] = []

            async def script(pilot: Pilot[None]) -> None:
                try:
                    # a freshly started agent's first answer can miss one poll's wait on a
                    # loaded machine: from the first poll that shows it up, three in a row must
                    await until(
                        pilot,
                        lambda: app.view is not None and app.view.rows[0].state == "up",
                        "a poll showing the agent up",
                        timeout_s=60,
                    )
                    first = app.refreshes
                    for n in range(first + 1, first + 4):
                        await until(
                            pilot, lambda n=n: app.refreshes >= n, f"poll {n}", timeout_s=30
                        )
                        assert app.view is not None
                        (row,) = app.view.rows
                        states.append(row.state)
                    assert states == ["up", "up", "up"]
                    assert cell(app, "node:gpu-g", "power") == "N/A"
                finally:
                    release.set()

            drive(app, script)


def test_top_json_does_not_wait_on_an_agent_trickling_its_answer() -> None:
    """An agent sending its stats a byte at a time (each within the socket timeout) held
    `kvctl top --json` for as long as it trickled; each poll now waits --timeout at most, and
    the agent reads as not answering."""
    stop = threading.Event()

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"name": "slow"}' * 64
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for i in range(len(body)):  # about 100 s in all, unless the test ends first
                if stop.wait(0.1):
                    return
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()

        def log_message(self, *args: object) -> None:
            pass

    with serving(Trickle) as url:
        try:
            out = runner.invoke(
                cli, ["top", "--agent", url, "--json", "--interval", "0.2", "--timeout", "1"]
            )
        finally:
            stop.set()
    assert out.exit_code == 0, out.output
    (row,) = json.loads(out.stdout)["nodes"]
    assert (row["state"], row["up"]) == ("not answering", False), row


class _StallingProxy:
    """A loopback TCP relay to PostgreSQL that can go silent: ``stall`` stops relaying bytes
    both ways, on open connections and new ones alike (a database host dropped off the
    network: nothing refused, nothing answered); ``resume`` relays again what was held."""

    def __init__(self, port: int) -> None:
        self.flowing = threading.Event()
        self.flowing.set()
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._upstream = port
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self.accepted += 1
            server = socket.create_connection(("127.0.0.1", self._upstream))
            self._socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._relay, args=(a, b), daemon=True).start()

    def _relay(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.flowing.set()
        self._listener.close()
        for s in self._socks:
            s.close()


def test_a_silent_database_host_does_not_slow_the_live_view(tmp_path: Path, pg_url: str) -> None:
    """The fleet's PostgreSQL host drops off the network (packets dropped, nothing refused):
    a query on a kept-open connection waits as long as TCP retransmits (minutes), a new one
    its connect timeout. The poll that meets it waits its database wait, then shows the agents
    live from the inventory as last read; the next polls do not wait and do not pile up reads;
    once the host answers again, the view reads the database again."""
    url = make_url(pg_url)
    proxy = _StallingProxy(url.port or 5432)
    engine = open_db(url.set(host="127.0.0.1", port=proxy.port), auto_upgrade=True)
    try:
        with running_agent(tmp_path / "a", "--name", "gpu-a", "--dc", "fra", *ARGS) as a:
            with engine.begin() as conn:
                add_dc(conn, "fra")
                add_node(conn, "gpu-a", dc="fra", agent_url=a.state.control_url)
            source = FleetSource(engine, timeout_s=2, db_wait_s=1.0)
            pool = ThreadPoolExecutor(1)

            def polled() -> Poll:  # a poll that waited on the silent host would fail the guard
                return pool.submit(source.poll).result(timeout=HANG_GUARD_S)

            try:
                first = polled()
                assert first.db_error is None and [r.up for r in first.readings] == [True]
                proxy.flowing.clear()
                late = polled()
                assert (late.db_error or "").startswith("no answer in"), late.db_error
                assert [(r.node.name, r.up) for r in late.readings] == [("gpu-a", True)]
                accepted = proxy.accepted
                for _ in range(3):  # the read is still out: none waits, none asks again
                    again = polled()
                    assert "still waiting" in (again.db_error or ""), again.db_error
                    assert [r.up for r in again.readings] == [True]
                assert proxy.accepted == accepted
                proxy.flowing.set()  # the host answers again: the read out ends
                wait_until("a poll with the database read again", lambda: polled().db_error is None)
            finally:
                proxy.flowing.set()  # what is held goes on: nothing is left waiting on it
                pool.shutdown(wait=False, cancel_futures=True)
                source.close()
    finally:
        proxy.close()
        engine.dispose()
