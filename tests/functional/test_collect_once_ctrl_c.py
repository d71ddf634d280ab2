"""A Ctrl-C during `kvctl collect --once` ends it at once, exit 130 with one line, recording
nothing of the cycle it cut. Before, the collector's scrape threads (concurrent.futures',
joined at exit) held the exit until the scrape under way ended: a hung agent's request
timeout. No option of the command sets that timeout (at most 5 s, below any hang guard), so
the run here raises the collector's setting for it far beyond the guard: without the fix only
the guard ends the wait."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from sqlalchemy import event, func, select
from sqlalchemy.engine import Connection
from typer.testing import CliRunner

from collectors.collector import Collector
from kvctl.cli.main import app
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import CacheSample, NodeSample
from tests.functional.agents import closed_port
from tests.functional.hung import ctrl_c, hung_http_agent

runner = CliRunner()
#: the collector's request timeout in the run: far beyond the guard
LONG_TIMEOUT_S = 300.0
#: `python -m kvctl`, with CollectorConfig.timeout_s (which the CLI leaves unset) raised
_KVCTL_WITH_LONG_TIMEOUT = (
    "import runpy; from collectors.collector import CollectorConfig; "
    f"CollectorConfig.request_timeout_s = property(lambda self: {LONG_TIMEOUT_S}); "
    "runpy.run_module('kvctl', run_name='__main__', alter_sys=True)"
)


def _cli(db: str, *args: str) -> None:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    result = runner.invoke(app, [*args, "--db", db], env=env)
    assert result.exit_code == 0, result.output


def test_ctrl_c_ends_collect_once_at_once_and_records_nothing_of_the_cycle(
    tmp_path: Path,
) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with hung_http_agent() as hung:
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "hung", "--dc", "fra", "--agent-url", hung.url)
        # --interval 1000: the cycle's deadline (0.9 x the interval) is far past the guard too
        code, said, _ = ctrl_c(
            ["-c", _KVCTL_WITH_LONG_TIMEOUT, "collect", "--once", "--no-links",
             "--interval", "1000", "--metrics-listen", "off", "--db", db],
            hung.asked,
        )  # fmt: skip
    assert code == 130, said
    assert said == "interrupted: nothing recorded, the scrapes under way dropped", said
    engine = open_db(db)
    try:
        with engine.connect() as conn:
            for table in (NodeSample, CacheSample):
                assert conn.execute(select(func.count()).select_from(table)).scalar_one() == 0
    finally:
        engine.dispose()


def test_a_ctrl_c_during_the_write_leaves_the_batch_in_whole_and_counted(tmp_path: Path) -> None:
    """A SIGINT as the cycle's batch is committed is raised once the batch is in and counted:
    the rows the Ctrl-C line says were recorded are those in the database. Before, the
    KeyboardInterrupt tore the commit (the batch rolled back, SQLite's write lock possibly
    kept)."""
    engine = open_db(f"sqlite:///{tmp_path / 'kvctl.db'}")
    with engine.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "gone", dc="fra", agent_url=f"http://127.0.0.1:{closed_port()}")
    collector = Collector(engine)
    interrupted: list[bool] = []

    def ctrl_c_at_commit(conn: Connection) -> None:
        if not interrupted:  # the cycle's write, once
            interrupted.append(True)
            signal.raise_signal(signal.SIGINT)

    event.listen(engine, "commit", ctrl_c_at_commit)
    try:
        with pytest.raises(KeyboardInterrupt):
            collector.collect_once()
        assert interrupted
        with engine.connect() as conn:
            samples = conn.execute(select(func.count()).select_from(NodeSample)).scalar_one()
        assert samples == collector.rows_written == 1  # the node, down
    finally:
        event.remove(engine, "commit", ctrl_c_at_commit)
        collector.close()
        engine.dispose()


def test_a_second_ctrl_c_stops_a_write_stuck_on_a_lock(pg_url: str) -> None:
    """The collector holds a Ctrl-C over its batch's write; a write blocked on a lock (here
    another session holding the raw table) held it for as long as the lock was held. A second
    Ctrl-C, FORCE_AFTER_SECONDS after the first, now stops it: the batch is not recorded, and
    the lock's holder never saw it."""
    import threading
    import time

    from sqlalchemy import text

    from kvctl.interrupts import FORCE_AFTER_SECONDS

    engine = open_db(pg_url, auto_upgrade=True)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "gone", dc="fra", agent_url=f"http://127.0.0.1:{closed_port()}")
    collector = Collector(engine)
    holder = engine.connect()
    holder.begin()
    holder.execute(text(f"LOCK TABLE {NodeSample.__tablename__} IN ACCESS EXCLUSIVE MODE"))
    main = threading.main_thread().ident
    assert main is not None

    released = threading.Event()

    def write_waits_on_the_lock() -> bool:
        with engine.connect() as conn:
            waiting = conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                )
            ).scalar_one()
        return bool(waiting)

    def press_twice() -> None:
        # once the write waits on the lock: a fixed 1 s was not always enough on a loaded
        # machine, and a first Ctrl-C before the write ends collect_once at once, the second
        # then landing in the test itself
        deadline = time.monotonic() + 60
        while not write_waits_on_the_lock() and time.monotonic() < deadline:
            time.sleep(0.05)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(FORCE_AFTER_SECONDS + 0.5)
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(5.0)  # then the lock goes (without the fix, only this ends the write)
        released.set()
        holder.rollback()

    presser = threading.Thread(target=press_twice, daemon=True)
    presser.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            collector.collect_once()
        assert not released.is_set()  # stopped by the second press, the lock still held
        presser.join()
        with engine.connect() as conn:
            samples = conn.execute(select(func.count()).select_from(NodeSample)).scalar_one()
        assert samples == 0
    finally:
        holder.close()
        collector.close()
        engine.dispose()
