"""--query-timeout on SQLite, the default database: a page's query that runs longer is stopped
and the page says so, as PostgreSQL's statement_timeout does, and its reading thread comes back.
Before, SQLite had no limit at all: the page said only that the database did not answer within
the timeout + 5 s, while its reading thread went on running the query (a core and a pooled
connection each), one more at every refresh of every open tab, for as long as the query took."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sqlalchemy import text

from dashboard.app import create_app, render
from tests.functional.dashboard_history import NOW, fill_history
from tests.functional.test_dashboard_app import text_of

#: a correlated count SQLite takes minutes over: each DC row looks slow
SLOW_ROW = (
    "(WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 2000000000) "
    "SELECT count(*) FROM c) > 0"
)


def readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvctl-dashboard-read"]


def test_a_sqlite_query_longer_than_the_query_timeout_is_stopped_and_its_thread_returns(
    tmp_path: Path,
) -> None:
    from kvctl.db.migrate import open_db

    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    db = open_db(url, auto_upgrade=True)
    fill_history(db)
    with db.begin() as conn:
        conn.execute(text("ALTER TABLE dc RENAME TO dc_rows"))
        conn.execute(text(f"CREATE VIEW dc AS SELECT * FROM dc_rows WHERE {SLOW_ROW}"))
    db.dispose()
    app = create_app(url, now_ms=lambda: NOW, query_timeout_s=0.3)
    try:
        page, updated = render(app, "/", "", "1h", None, None)
        shown = text_of(page)
        assert "The database cannot be read: a query ran longer than the query timeout" in shown
        assert "did not answer within" not in shown
        assert updated.startswith("not updated")
        deadline = time.monotonic() + 10  # a hang guard only
        while readers() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not readers(), "the page's reading thread still runs its query"
    finally:
        app.server.extensions["kvctl"].engine.dispose()
