"""A page whose query the query timeout stopped (PostgreSQL's statement_timeout, SQLite's
interruption) says how to get it drawn: a shorter window, fewer DCs, or a larger
--query-timeout. Its hint sent the operator to `kvctl db current` and `kvctl db upgrade`, which
say the database is reachable and current: nothing there explains or fixes a timeout."""

from __future__ import annotations

from sqlalchemy import text

from dashboard.app import create_app, render
from tests.functional.dashboard_history import NOW, fill_history
from tests.functional.test_dashboard_app import text_of
from tests.functional.test_dashboard_sqlite_query_timeout import SLOW_ROW


def test_a_page_the_query_timeout_stopped_says_how_to_get_it_drawn(empty_db_url: str) -> None:
    from kvctl.db.migrate import open_db

    db = open_db(empty_db_url, auto_upgrade=True)
    fill_history(db)
    with db.begin() as conn:
        conn.execute(text("ALTER TABLE dc RENAME TO dc_rows"))
        if db.dialect.name == "postgresql":
            conn.execute(
                text(
                    "CREATE FUNCTION slow_row() RETURNS boolean LANGUAGE sql AS "
                    "'SELECT pg_sleep(1); SELECT true'"
                )
            )
            conn.execute(text("CREATE VIEW dc AS SELECT * FROM dc_rows WHERE slow_row()"))
        else:
            conn.execute(text(f"CREATE VIEW dc AS SELECT * FROM dc_rows WHERE {SLOW_ROW}"))
    db.dispose()
    app = create_app(empty_db_url, now_ms=lambda: NOW, query_timeout_s=0.3)
    try:
        page, _ = render(app, "/", "", "1h", None, None)
        shown = text_of(page)
        assert "The database cannot be read" in shown
        assert "larger --query-timeout (now 0.3 s)" in shown
        assert "kvctl db upgrade" not in shown
    finally:
        app.server.extensions["kvctl"].engine.dispose()
