"""The collector's loop on a SQLite file moved away, or replaced, while it runs. Its pooled
connections wrote to the file they had opened: after `mv metrics.db* /backup/` every cycle's
rows went on into the moved file (lost from the operator's view), said written; after a backup
was restored over the path with mv, into the file no longer there. Now a cycle with no file at
the path says so (logged once), creates none and keeps its rows for retry; the file back is
written with them; a file put in its place (a restored backup) is written from the next cycle,
its counters' saved state read anew: the file at the path holds each of the agent's increases
once. Against a real agent, on real SQLite files."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select
from typer.testing import CliRunner

from collectors.collector import Collector, CollectorConfig
from kvctl.cli.main import app as cli
from kvctl.db import migrate
from kvctl.db.engine import display_url
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import CacheSample, NodeSample
from tests.functional.agents import Agent, running_agent, traffic

pytestmark = pytest.mark.slow


def _move(path: Path, to: Path) -> None:
    """``mv metrics.db* to``: the file and SQLite's -wal and -shm beside it."""
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.rename(f"{path}{suffix}", f"{to}{suffix}")


def _recorded(path: Path) -> tuple[int, int, int]:
    """The file at ``path``'s node samples, and its lookups and hits (all tiers), summed."""
    engine = create_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            samples = len(conn.execute(select(NodeSample.up)).all())
            rows = conn.execute(
                select(CacheSample.lookups, CacheSample.hits).where(CacheSample.tier == "all")
            ).all()
    finally:
        engine.dispose()
    return samples, sum(r.lookups or 0 for r in rows), sum(r.hits or 0 for r in rows)


@contextlib.contextmanager
def _loop(path: Path, data_dir: Path) -> Iterator[tuple[Agent, Collector]]:
    """A real agent as node n1 of DC fra in the SQLite file at ``path``, and a collector loop's
    cycles on it, its engine opened as `kvctl collect` opens it (a connection pooled already)."""
    db = open_db(f"sqlite:///{path}", auto_upgrade=True)
    try:
        with running_agent(data_dir, "--name", "n1") as agent:
            with db.begin() as conn:
                add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
                add_node(conn, "n1", dc="fra", agent_url=agent.state.control_url)
            loop = Collector(db, CollectorConfig())
            try:
                yield agent, loop
            finally:
                loop.close()
    finally:
        db.dispose()


def _cycle(loop: Collector) -> tuple[bool, list[str]]:
    time.sleep(0.01)  # each save stamped by its own millisecond
    report = loop.collect_once()
    return report.written, report.warnings


def test_a_file_moved_away_is_said_gone_its_rows_kept_and_written_once_it_is_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, away = tmp_path / "metrics.db", tmp_path / "backup"
    away.mkdir()
    with _loop(path, tmp_path / "a1") as (a1, loop):
        assert _cycle(loop)[0]  # the baseline
        traffic(a1, 3, space=1)
        assert _cycle(loop)[0]

        _move(path, away / "metrics.db")
        with caplog.at_level(logging.INFO, logger="kvctl.collect"):
            for n in range(3):
                traffic(a1, 2, space=10 + n)
                written, warnings = _cycle(loop)
                assert not written, "written to a file no longer at the path"
                assert f"no database file at {path} (moved or deleted" in warnings[0], warnings
                assert any("rows for retry until a database" in w for w in warnings), warnings
                assert not path.exists(), "an empty database created at the path"
        said = [r for r in caplog.records if "no database file at" in r.getMessage()]
        assert len(said) == 1 and said[0].levelno == logging.ERROR, said
        assert loop.pending_rows > 0

        _move(away / "metrics.db", path)  # back where it was
        traffic(a1, 1, space=20)
        written, warnings = _cycle(loop)
        assert written, warnings
        assert loop.pending_rows == 0
        agent = a1.control().stats()["stats"]

    samples, lookups, hits = _recorded(path)
    assert samples == 6  # every cycle's, the three kept ones included
    # each increase once: what the agent counted, no more, no less
    assert (lookups, hits) == (agent["lookup_chunks"], agent["hit_chunks"]) == (15, 10)


def test_a_backup_restored_over_the_path_is_written_counted_from_its_own_state(
    tmp_path: Path,
) -> None:
    path, away = tmp_path / "metrics.db", tmp_path / "moved"
    away.mkdir()
    backup = tmp_path / "backup.db"
    with _loop(path, tmp_path / "a1") as (a1, loop):
        assert _cycle(loop)[0]  # the baseline
        traffic(a1, 3, space=1)
        assert _cycle(loop)[0]
        with (
            contextlib.closing(sqlite3.connect(path)) as live,
            contextlib.closing(sqlite3.connect(backup)) as copy,
        ):
            live.backup(copy)  # an operator's backup: 4 lookups and 3 hits
        traffic(a1, 2, space=2)
        assert _cycle(loop)[0]  # into the live file only: 3 lookups, 2 hits

        _move(path, away / "metrics.db")
        traffic(a1, 1, space=3)
        written, warnings = _cycle(loop)
        assert not written and f"no database file at {path}" in warnings[0], warnings

        os.rename(backup, path)  # the backup restored with mv
        traffic(a1, 4, space=4)
        written, warnings = _cycle(loop)
        assert written, warnings
        assert any(f"database file at {path} was replaced" in w for w in warnings), warnings
        assert not any("another collector" in w for w in warnings), warnings
        agent = a1.control().stats()["stats"]

    # the restored file: its own rows, then what the agent counted since its state was saved
    samples, lookups, hits = _recorded(path)
    assert (lookups, hits) == (agent["lookup_chunks"], agent["hit_chunks"]) == (4 + 3 + 2 + 5, 10)
    assert samples == 4  # its two, the kept one's and the last: never the moved file's
    # the moved file: what was written before it moved, nothing since
    assert _recorded(away / "metrics.db") == (3, 4 + 3, 3 + 2)


def test_a_backup_at_an_older_schema_restored_under_the_loop_says_to_upgrade_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A backup taken before `kvctl db upgrade` (or made by an older kvctl) restored under the
    loop: each cycle's write failed with SQLite's own 'table cache_sample has no column named
    read_chunks', its rows kept, nothing saying what to do. The cycle's warning and the one log
    line say the file's revision, this kvctl's, and the command to run; the loop never upgrades
    it itself. Upgraded, the next cycle writes the kept rows: each of the agent's increases
    once, counted from the backup's own state."""
    path, away = tmp_path / "metrics.db", tmp_path / "moved"
    away.mkdir()
    backup = tmp_path / "backup.db"
    url = f"sqlite:///{path}"
    older, head = migrate.revisions()[-2], migrate.head_revision()
    with _loop(path, tmp_path / "a1") as (a1, loop):
        assert _cycle(loop)[0]  # the baseline
        traffic(a1, 3, space=1)
        assert _cycle(loop)[0]
        with (
            contextlib.closing(sqlite3.connect(path)) as live,
            contextlib.closing(sqlite3.connect(backup)) as copy,
        ):
            live.backup(copy)  # an operator's backup: 4 lookups and 3 hits
        old = create_engine(f"sqlite:///{backup}")
        try:
            migrate.downgrade(old, older)  # as a kvctl before the last revision left it
        finally:
            old.dispose()
        traffic(a1, 2, space=2)
        assert _cycle(loop)[0]  # into the live file only

        _move(path, away / "metrics.db")
        os.rename(backup, path)  # the backup restored with mv
        upgrade = f"run `kvctl db upgrade --db {url}`"
        said = f"the database at {path} is at schema revision {older}, this kvctl needs {head}"
        with caplog.at_level(logging.INFO, logger="kvctl.collect"):
            for n in range(3):
                traffic(a1, 1, space=3 + n)
                written, warnings = _cycle(loop)
                assert not written, warnings
                refused = [w for w in warnings if w.startswith("database refused the batch")]
                assert refused == [
                    f"database refused the batch, keeping {loop.pending_rows} rows for retry: "
                    f"{said}: {upgrade}"
                ], warnings
                assert not any("no column named" in w or "no such" in w for w in warnings)
        logged = [r for r in caplog.records if "is at schema revision" in r.getMessage()]
        assert len(logged) == 1 and logged[0].levelno == logging.ERROR, logged
        assert upgrade in logged[0].getMessage()
        check = create_engine(url)
        try:
            assert migrate.current_revision(check) == older  # never upgraded under the operator
        finally:
            check.dispose()

        out = CliRunner().invoke(cli, ["db", "upgrade", "--db", url])
        assert out.exit_code == 0, out.output
        traffic(a1, 1, space=9)
        written, warnings = _cycle(loop)
        assert written, warnings
        assert loop.pending_rows == 0
        agent = a1.control().stats()["stats"]

    # the restored file: its own rows, then what the agent counted since its state was saved
    _, lookups, hits = _recorded(path)
    assert (lookups, hits) == (agent["lookup_chunks"], agent["hit_chunks"])


def test_a_postgresql_database_behind_the_loop_is_said_so_too(tmp_path: Path, pg_url: str) -> None:
    """The same on PostgreSQL (a dump at an older schema restored under the loop): its words
    were psycopg's 'column "read_chunks" of relation "cache_sample" does not exist'."""
    older, head = migrate.revisions()[-2], migrate.head_revision()
    db = open_db(pg_url, auto_upgrade=True)
    try:
        with running_agent(tmp_path / "a1", "--name", "n1") as a1:
            with db.begin() as conn:
                add_dc(conn, "fra")
                add_node(conn, "n1", dc="fra", agent_url=a1.state.control_url)
            loop = Collector(db, CollectorConfig())
            try:
                assert _cycle(loop)[0]
                migrate.downgrade(db, older)
                traffic(a1, 1, space=1)
                written, warnings = _cycle(loop)
            finally:
                loop.close()
    finally:
        db.dispose()
    assert not written, warnings
    shown = display_url(pg_url)
    assert (
        f"the database at {shown} is at schema revision {older}, this kvctl needs {head}: "
        in (warnings[-1])
    ), warnings
    assert f"run `kvctl db upgrade --db {shlex.quote(shown)}`" in warnings[-1], warnings
