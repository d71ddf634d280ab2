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

from sqlalchemy import create_engine
from textual.pilot import Pilot
from textual.widgets import Static

from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.fleet.audit import recent
from kvctl.tui.app import TopApp, create_app
from kvctl.tui.dialogs import ConfirmScreen, TierDialog
from kvctl.tui.sources import AgentSource, FleetSource
from tests.functional.agents import running_agent
from tests.functional.test_top import cell, drive, poll, put_chain, row_keys, select_row, until

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


def _audited(path: Path) -> list[tuple[str, str, bool]]:
    """The audit trail of the file at ``path``: (action, target, ok), newest first."""
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            return [(r.action, r.target, r.ok) for r in recent(conn, limit=10)]
    finally:
        engine.dispose()


def test_top_by_agent_url_audits_in_the_file_at_the_path_and_refuses_when_none_is_there(
    tmp_path: Path,
) -> None:
    """`kvctl top --agent URL --db FILE`: actions are audited in FILE (made if need be). Its
    pooled connection wrote the audit rows into the file it had opened: after `mv metrics.db*
    /backup/` a flush was shown "done (audited)", its row in the moved file, none at the path.
    Now an action with no file at the path is refused before the agent is asked (nothing done,
    no file created), and once a file is there again it is audited in it."""
    path, away = tmp_path / "metrics.db", tmp_path / "backup"
    away.mkdir()
    with running_agent(tmp_path / "a", "--name", "solo", "--dc", "lab", *ARGS) as a:
        # as `kvctl top --agent URL --db URL` opens it (open_engine(db, create=True))
        audit = open_db(f"sqlite:///{path}", create=True)
        app = create_app(
            AgentSource([a.state.control_url], timeout_s=2), audit_engine=audit, auto_poll=False
        )

        async def flush(pilot: Pilot[None]) -> None:
            select_row(app, "#fleet", "node:solo")
            await pilot.press("f")
            assert isinstance(app.screen, TierDialog)
            await pilot.click("#ok")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")

        async def script(pilot: Pilot[None]) -> None:
            await poll(pilot, app)
            await flush(pilot)
            await until(pilot, lambda: len(app.actions_done) == 1, "the first flush")

            _move(path, away / "metrics.db")
            put_chain(a, 2, seed=1)
            await poll(pilot, app)
            await flush(pilot)
            gone = f"no database file at {path} (moved or deleted while kvctl top ran)"
            said = (
                f"flush on solo: nothing done, the audit trail cannot be written: {gone}; put "
                "the database file back at that path to act (audited there at once)"
            )
            await until(
                pilot,
                lambda: any(n.message == said for n in app._notifications),
                "the refusal",
            )
            assert len(app.actions_done) == 1, "flushed, audited in the moved file"
            assert a.control().stats()["usage"]["cpu"]["used_bytes"] > 0, "the agent flushed"
            assert not path.exists(), "kvctl top created a database file at the path"

            _move(away / "metrics.db", path)  # back (a backup restored there)
            await flush(pilot)
            await until(pilot, lambda: len(app.actions_done) == 2, "the flush once it is back")
            assert a.control().stats()["usage"]["cpu"]["used_bytes"] == 0

        try:
            drive(app, script)
        finally:
            audit.dispose()
    assert _audited(path) == [("flush", "solo", True), ("flush", "solo", True)]
