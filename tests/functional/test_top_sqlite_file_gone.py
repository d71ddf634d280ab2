"""`kvctl top` on a SQLite file that is moved away, or replaced, while it runs (`--db` on a
file; the dashboard and the collector follow theirs: kvctl.db.engine.follow_the_path). Before,
its pooled connection read the file it had opened: after `mv metrics.db* /backup/` the view
went on reading the moved file's inventory, saying nothing, and a file put at the path (a
restored backup, a new inventory) was never read. Now a poll says the file is gone, in the view
and its JSON, the agents still asked from the inventory as last read, and no file is created
at the path; a file put there is read from then on. Real agents, real files, Textual's pilot."""

from __future__ import annotations

import os
from pathlib import Path

from textual.pilot import Pilot
from textual.widgets import Static

from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.tui.app import TopApp, create_app
from kvctl.tui.sources import FleetSource
from tests.functional.agents import running_agent
from tests.functional.test_top import cell, drive, poll, row_keys

ARGS = ("--cpu", "4MiB", "--disk", "0")


def _move(path: Path, to: Path) -> None:
    """``mv metrics.db* elsewhere``: the file and SQLite's -wal and -shm beside it."""
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.rename(f"{path}{suffix}", f"{to}{suffix}")


def _inventory(url: str, agents: dict[str, str]) -> None:
    """A database at ``url`` whose inventory is ``agents`` (name: control URL), all in fra."""
    engine = open_db(url, auto_upgrade=True)
    try:
        with engine.begin() as conn:
            add_dc(conn, "fra")
            for name, agent_url in agents.items():
                add_node(conn, name, dc="fra", agent_url=agent_url)
    finally:
        engine.dispose()


def _summary(app: TopApp) -> str:
    return str(app.screen.query_one("#summary", Static).render())


def test_top_says_a_moved_sqlite_file_is_gone_and_reads_the_one_put_there(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.db"
    url = f"sqlite:///{path}"
    with (
        running_agent(tmp_path / "a", "--name", "gpu-a", "--dc", "fra", *ARGS) as a,
        running_agent(tmp_path / "b", "--name", "gpu-b", "--dc", "fra", *ARGS) as b,
    ):
        _inventory(url, {"gpu-a": a.state.control_url})
        # as `kvctl top --db URL` opens it (open_engine: open_db, the file must be there)
        source = FleetSource(open_db(url), timeout_s=2)
        app = create_app(source, readonly=True, auto_poll=False)

        async def script(pilot: Pilot[None]) -> None:
            await poll(pilot, app)
            assert row_keys(app) == ["node:gpu-a"] and cell(app, "node:gpu-a", "state") == "up"
            assert app.view is not None and app.view.db_error is None

            _move(path, tmp_path / "moved.db")
            for _ in range(3):  # the pooled connection, and new ones
                await poll(pilot, app)
                assert app.poll_error is None and app.view is not None
                gone = f"no database file at {path} (moved or deleted while kvctl top ran)"
                assert app.view.db_error == gone, app.view.db_error
                assert app.view.as_dict()["database_error"] == gone
                summary = _summary(app)
                assert "database failed: no database file at" in summary, summary
                # the agents are still asked, from the inventory as last read
                assert cell(app, "node:gpu-a", "state") == "up"
            assert not path.exists(), "kvctl top created a database file at the path"

            # a database put at the path (a restore, a new inventory) is read from then on
            _inventory(url, {"gpu-a": a.state.control_url, "gpu-b": b.state.control_url})
            for _ in range(4):  # the failing read is retried at one poll, looked at the next
                await poll(pilot, app)
                if app.view.db_error is None:
                    break
            assert app.view.db_error is None, app.view.db_error
            assert "database failed" not in _summary(app)
            await poll(pilot, app)
            assert sorted(row_keys(app)) == ["node:gpu-a", "node:gpu-b"]
            assert cell(app, "node:gpu-b", "state") == "up"

        try:
            drive(app, script)
        finally:
            source.close()


def test_top_reads_a_file_restored_over_the_path(tmp_path: Path) -> None:
    """A backup restored with `mv backup.db metrics.db` while top runs (the path never empty):
    before, the view went on with the replaced file's inventory for good."""
    path = tmp_path / "metrics.db"
    url = f"sqlite:///{path}"
    with (
        running_agent(tmp_path / "a", "--name", "gpu-a", "--dc", "fra", *ARGS) as a,
        running_agent(tmp_path / "b", "--name", "gpu-b", "--dc", "fra", *ARGS) as b,
    ):
        _inventory(url, {"gpu-a": a.state.control_url})
        backup = tmp_path / "backup.db"
        _inventory(f"sqlite:///{backup}", {"gpu-b": b.state.control_url})
        source = FleetSource(open_db(url), timeout_s=2)
        app = create_app(source, readonly=True, auto_poll=False)

        async def script(pilot: Pilot[None]) -> None:
            await poll(pilot, app)
            assert row_keys(app) == ["node:gpu-a"]
            os.replace(backup, path)
            await poll(pilot, app)
            assert app.view is not None and app.view.db_error is None, app.view
            assert row_keys(app) == ["node:gpu-b"], "the replaced file's inventory"
            assert cell(app, "node:gpu-b", "state") == "up"

        try:
            drive(app, script)
        finally:
            source.close()
