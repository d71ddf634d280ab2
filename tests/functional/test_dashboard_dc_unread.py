"""The overview's per-DC table counts each DC's unread scrapes (the agent answered, its figures
were not recorded: token refused), as the detail page's node table does: a DC whose node
refuses the token reads as up with fewer lookups, not as an idle one (real agents, SQLite and
PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from dashboard.app import create_app, render
from kvctl.db.inventory import add_dc, add_node
from tests.functional.agents import running_agent
from tests.functional.test_dashboard_app import by_id, url_of

pytestmark = pytest.mark.slow

T0_S = 1_800_000_000.0


def test_the_per_dc_table_counts_each_dcs_unread_scrapes(db: Engine, tmp_path: Path) -> None:
    with (
        running_agent(tmp_path / "locked", "--cpu", "8MiB", token="not-yours") as locked,
        running_agent(tmp_path / "open", "--cpu", "8MiB") as open_,
    ):
        with db.begin() as conn:
            add_dc(conn, "fra")
            add_dc(conn, "ams")
            add_node(conn, "refusing", dc="fra", agent_url=locked.state.control_url)
            add_node(conn, "read", dc="ams", agent_url=open_.state.control_url)
        now = [T0_S]
        collector = Collector(db, CollectorConfig(interval_s=60.0), clock=lambda: now[0])
        try:
            for _ in range(2):
                report = collector.collect_once()
                assert report.written and list(report.token_refused) == ["refusing"], report
                now[0] += 60
        finally:
            collector.close()
    app = create_app(
        url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: int(now[0] * 1000)
    )
    try:
        page, _ = render(app, "/", "", "1h", None, None)
    finally:
        app.server.extensions["kvctl"].engine.dispose()
    rows = {r["DC"]: r for r in by_id(page, "table-dcs").data}
    # both DCs up every scrape; only fra's were unread
    assert {dc: (r["up"], r["unread scrapes"]) for dc, r in rows.items()} == {
        "fra": ("100.0%", 2),
        "ams": ("100.0%", 0),
        "fleet": ("100.0%", 2),
    }
