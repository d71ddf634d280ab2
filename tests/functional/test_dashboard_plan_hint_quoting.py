"""The command the capacity page gives for saving an unreadable plan again runs as copied for
a DC whose name a shell would split (any printable text is a DC name): d837df5 wrote the name
bare, so `--dc fra 2` saved the plan for DC 'fra' with a stray argument, or failed."""

from __future__ import annotations

import shlex
from pathlib import Path

from dashboard.app import create_app, render
from kvctl.db.inventory import add_dc
from kvctl.db.migrate import open_db
from kvctl.db.plans import save_plan
from tests.functional.dashboard_history import NOW, fill_history
from tests.functional.test_dashboard_app import text_of

#: a report of a shape this kvctl does not read (as test_dashboard_failures' older plan)
OLD_REPORT = {
    "workload": "chat",
    "miss_ratio_curve": {"points": [{"capacity_bytes": 2**30, "lru_hit_ratio": 0.4}]},
    "candidates": [{"name": "more DRAM", "tiers_bytes": {"cpu": 2**31}}],
}


def test_the_save_again_command_quotes_the_dc_for_a_shell(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    db = open_db(url, auto_upgrade=True)
    fill_history(db)
    with db.begin() as conn:
        add_dc(conn, "fra 2")
        save_plan(conn, OLD_REPORT, dc="fra 2", now_ms=NOW)
    db.dispose()
    app = create_app(url, now_ms=lambda: NOW)
    try:
        page, _ = render(app, "/capacity", "", "1h", None, None)
        shown = text_of(page)
        assert "has a shape this dashboard does not read" in shown
        command = shown.split("`")[1]  # the hint's command, as the operator copies it
        assert shlex.split(command)[-2:] == ["--dc", "fra 2"], command
    finally:
        app.server.extensions["kvctl"].engine.dispose()
