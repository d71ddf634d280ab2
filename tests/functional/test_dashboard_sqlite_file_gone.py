"""The dashboard on a SQLite file that is moved away, or replaced, while it runs: its pooled
connections read the file they opened, so before, its pages went on drawing the figures of a
file no longer at its path (refreshed as if live), and a connection opened after that created
an empty database there (the read-only dashboard writing a file) and said to upgrade its
schema. Now a page says the file is gone and creates nothing; a new file at the path is read."""

from __future__ import annotations

import os
from pathlib import Path

from dashboard.app import create_app, render
from kvctl.db.migrate import open_db
from tests.functional.dashboard_history import NOW, fill_history
from tests.functional.test_dashboard_app import card_value, text_of
from tests.functional.test_dashboard_failures import PAGE, page_inputs, post_callback


def _move(path: Path, to: Path) -> None:
    """``mv metrics.db* elsewhere``: the file and SQLite's -wal and -shm beside it."""
    for suffix in ("", "-wal", "-shm"):
        if Path(f"{path}{suffix}").exists():
            os.rename(f"{path}{suffix}", f"{to}{suffix}")


def test_a_sqlite_file_moved_away_or_replaced_is_said_or_read_never_its_ghost(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.db"
    url = f"sqlite:///{path}"
    db = open_db(url, auto_upgrade=True)
    fill_history(db)
    db.dispose()
    app = create_app(url, now_ms=lambda: NOW)
    try:
        page, _ = render(app, "/", "", "1h", None, None)
        assert card_value(page, "card-hit-ratio") == "52.6%"  # the known history

        _move(path, tmp_path / "moved.db")
        for _ in range(3):  # every connection the pool has, and new ones
            page, updated = render(app, "/", "", "1h", None, None)
            shown = text_of(page)
            assert "52.6%" not in shown, "the figures of a file no longer at the path"
            assert f"no database file at {path} (moved or deleted" in shown, shown
            assert "kvctl db upgrade --db" not in shown  # nothing to upgrade: it is gone
            assert updated.startswith("not updated: the page failed at ")
        # the browser's callback answers so too (no error 500)
        status, answer = post_callback(app, PAGE, page_inputs("/detail"))
        assert status == 200 and "no database file at" in str(answer["response"]["page"])
        assert not path.exists(), "the read-only dashboard created a database file"

        # another database put at the path (a restore, a new one) is the one read
        open_db(url, auto_upgrade=True).dispose()
        page, updated = render(app, "/", "", "1h", None, None)
        assert "The fleet inventory is empty." in text_of(page)
        assert updated.startswith("updated ")
    finally:
        app.server.extensions["kvctl"].engine.dispose()
