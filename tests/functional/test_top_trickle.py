"""`kvctl top` (the live view, Textual pilot) with an agent whose answers trickle a byte at a
time: each read is within the client's timeout, so no timeout ends the call. The fleet table
shows that node NOT ANSWERING within the poll's wait and keeps refreshing the others, with one
call (one connection) per kind in flight to it, not one more each poll; its node page says its
detail is not answering, and opening it again and again asks it no second call and leaves no
thread stuck where the view's polls need one."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from textual.pilot import Pilot

from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.tui.app import create_app
from kvctl.tui.node_screen import NodeScreen
from kvctl.tui.sources import FleetSource
from tests.functional.agents import Agent, start_agent
from tests.functional.test_top import cell, drive, select_row, until
from tests.not_an_agent import serving

ARGS = ("--cpu", "4MiB", "--disk", "0")
#: far longer than any test here: a byte every 0.1 s (within the read timeout)
BODY = b'{"stats": {}, "pad": "' + b"x" * 1000 + b'"}'
#: the client's timeout of each read: far above the trickle's 0.1 s, so a server thread that a
#: loaded CI machine leaves unscheduled for a second does not end a call (the next poll would
#: then ask again, and the counts of calls below would read that as a call per poll)
READ_TIMEOUT_S = 10.0


class Trickler:
    """A loopback server answering every GET a byte every 0.1 s until ``stop``; counts the
    requests it took and those still trickling."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.asked = 0
        self.trickling = 0
        lock = threading.Lock()
        me = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with lock:
                    me.asked += 1
                    me.trickling += 1
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(BODY)))
                    self.end_headers()
                    for i in range(len(BODY)):
                        if me.stop.wait(0.1):
                            return
                        self.wfile.write(BODY[i : i + 1])
                        self.wfile.flush()
                except OSError:  # the client gave up
                    pass
                finally:
                    with lock:
                        me.trickling -= 1

            def log_message(self, *args: object) -> None:
                pass

        self.handler = Handler


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Engine, Agent, Trickler]]:
    """gpu-a (a live agent) and gpu-t (trickling) in fra, in a SQLite inventory."""
    trickler = Trickler()
    a = start_agent(tmp_path / "a", "--name", "gpu-a", "--dc", "fra", *ARGS)
    engine = open_db(f"sqlite:///{tmp_path / 'metrics.db'}", auto_upgrade=True)
    try:
        with serving(trickler.handler) as url:
            with engine.begin() as conn:
                add_dc(conn, "fra")
                add_node(conn, "gpu-a", dc="fra", agent_url=a.state.control_url)
                add_node(conn, "gpu-t", dc="fra", agent_url=url)
            try:
                yield engine, a, trickler
            finally:
                trickler.stop.set()
    finally:
        engine.dispose()
        a.stop()


def test_a_trickling_agent_costs_its_own_row(fleet: tuple[Engine, Agent, Trickler]) -> None:
    engine, _a, trickler = fleet
    app = create_app(FleetSource(engine, timeout_s=READ_TIMEOUT_S), readonly=True, interval_s=0.5)

    async def script(pilot: Pilot[None]) -> None:
        try:
            await until(
                pilot,
                lambda: app.refreshes >= 1 and cell(app, "node:gpu-t", "state") != "",
                "a first poll",
            )
            assert cell(app, "node:gpu-t", "state").startswith("NO ANSWER")
            # a loaded machine can leave the live agent's answer past one poll's wait (0.3 s)
            await until(pilot, lambda: cell(app, "node:gpu-a", "state") == "up", "gpu-a up", 60)
            threads, seen = threading.active_count(), app.refreshes
            # ten polls go by while the trickle's one answer takes 100 s: none waits for it
            await until(pilot, lambda: app.refreshes >= seen + 10, "ten more polls", 60)
            assert trickler.trickling >= 1  # still in flight, so no poll was held until its end
            await until(pilot, lambda: cell(app, "node:gpu-a", "state") == "up", "gpu-a up", 60)
            assert cell(app, "node:gpu-t", "state").startswith("NO ANSWER")
            row = app.view.row("gpu-t")  # type: ignore[union-attr]
            assert row is not None and row.silent and "still asking" in (row.error or "")
            # one call in flight to it (stats, and GPUs), not one more per poll
            assert trickler.trickling <= 2 and trickler.asked <= 2, trickler.asked
            assert threading.active_count() <= threads + 2
        finally:
            trickler.stop.set()

    drive(app, script)


def test_a_trickling_agents_node_page_says_so_and_holds_no_thread(
    fleet: tuple[Engine, Agent, Trickler],
) -> None:
    """The page's detail was fetched on a Textual thread worker with no bound: it never said
    the node was not answering, and each opening left a thread stuck in the trickle, in the
    event loop's default executor, which the fleet poll's worker shares: once that was full
    (cpus + 4 threads), no poll ran again and the whole view froze."""
    engine, _a, trickler = fleet
    app = create_app(FleetSource(engine, timeout_s=READ_TIMEOUT_S), readonly=True, interval_s=0.5)
    # one more than the threads of asyncio's default executor (ThreadPoolExecutor's default)
    opened = min(32, (os.cpu_count() or 1) + 4) + 1

    async def script(pilot: Pilot[None]) -> None:
        try:
            await until(pilot, lambda: app.refreshes >= 1, "a first poll")
            errors = []
            for _ in range(opened):
                select_row(app, "#fleet", "node:gpu-t")
                await pilot.press("enter")
                screen = app.screen
                assert isinstance(screen, NodeScreen)
                # the page waits 0.3 s (60% of the interval) for its detail, then says so; the
                # trickle's answer would take 100 s, so a page that waited for it fails here
                await until(
                    pilot, lambda s=screen: s.details_error is not None, "the page's error", 60
                )
                errors.append(screen.details_error)
                await pilot.press("escape")
            seen = app.refreshes
            await until(pilot, lambda: app.refreshes >= seen + 3, "three more polls", 60)
            assert all("still asking" in (e or "") for e in errors), errors
            # one detail call to it in flight all along, beside the poll's stats and GPUs
            assert trickler.asked <= 3, trickler.asked
            await until(pilot, lambda: cell(app, "node:gpu-a", "state") == "up", "gpu-a up", 60)
        finally:
            trickler.stop.set()

    drive(app, script)
