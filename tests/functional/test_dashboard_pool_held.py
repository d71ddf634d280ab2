"""A page that finds every connection of the dashboard's pool held (by earlier pages the
database has not answered: d5089c0's reading threads keep theirs until it answers) says so,
with what to check, instead of SQLAlchemy's 'QueuePool limit of size 5 overflow 10 reached,
connection timed out, timeout 30.00 (Background on this error at: https://sqlalche.me/...)'
under the hint of an unreachable database."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

from dashboard.app import create_app, render
from tests.functional.dashboard_history import NOW, fill_history
from tests.functional.test_dashboard_app import text_of


def test_a_page_that_finds_every_connection_held_says_so(tmp_path: Path) -> None:
    from kvctl.db.migrate import open_db

    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    db = open_db(url, auto_upgrade=True)
    fill_history(db)
    db.dispose()
    # the page waits longer than the pool's 30 s for a connection, as with the default 60 s
    app = create_app(url, now_ms=lambda: NOW, query_timeout_s=30)
    engine = app.server.extensions["kvctl"].engine
    # the pool gives up after 2 s instead of its 30: the page's words are under test, not the
    # wait (which was 30 s of the suite's time)
    engine.pool._timeout = 2
    try:
        with ExitStack() as held:  # as the reading threads of pages left unanswered hold them
            for _ in range(engine.pool.size() + engine.pool._max_overflow):
                held.enter_context(engine.connect())
            page, updated = render(app, "/", "", "1h", None, None)
        shown = text_of(page)
        assert "QueuePool" not in shown and "sqlalche.me" not in shown
        assert "Every connection the dashboard may open (15) is held" in shown
        assert updated.startswith("not updated")
        page, _ = render(app, "/", "", "1h", None, None)  # back once they are
        assert "Fleet overview" in text_of(page)
    finally:
        engine.dispose()
