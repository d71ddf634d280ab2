"""Rows kept through a database outage past the cap (``max_pending_rows``): the oldest cycles'
rows go, each cycle whole, and the collector says how many and that they are lost: in the
cycle's warnings, in its log once, and again when the database is back. They went silently, and
the first table's first: every node sample of the outage before any cache row. The database
refuses on its own here: a trigger that aborts every node sample's insert."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from sqlalchemy import select

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import CacheSample, NodeSample
from tests.functional.agents import running_agent

pytestmark = pytest.mark.slow

#: a cycle of one node: its node sample, its cache rows (all, cpu, disk) and its plan row
ROWS_PER_CYCLE = 5


def test_rows_past_the_cap_go_by_whole_cycles_and_are_said_lost(
    sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = open_db(sqlite_url)
    config = CollectorConfig(max_pending_rows=2 * ROWS_PER_CYCLE + 2)
    caplog.set_level(logging.INFO, logger="kvctl.collect")
    try:
        with running_agent(tmp_path / "a1", "--name", "n1") as a1:
            with db.begin() as conn:
                add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
                add_node(conn, "n1", dc="fra", agent_url=a1.state.control_url)
            collector = Collector(db, config)
            try:
                first = collector.collect_once()
                assert first.written and sum(first.rows.values()) == ROWS_PER_CYCLE
                with db.begin() as conn:
                    conn.exec_driver_sql(
                        "CREATE TRIGGER refuse BEFORE INSERT ON node_sample "
                        "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
                    )
                refused = [collector.collect_once() for _ in range(4)]
                with db.begin() as conn:
                    conn.exec_driver_sql("DROP TRIGGER refuse")
                back = collector.collect_once()
            finally:
                collector.close()
        assert not any(r.written for r in refused)
        # the third and fourth refused cycles each dropped the oldest cycle kept, whole
        for report in refused[2:]:
            assert "keeping 10 rows for retry" in report.warnings[0], report.warnings
            dropped = [w for w in report.warnings if "dropped" in w]
            assert dropped and dropped[0].startswith(f"{ROWS_PER_CYCLE} rows"), report.warnings
            assert "lost" in dropped[0]
        assert not any("dropped" in w for r in refused[:2] for w in r.warnings)
        assert back.written and sum(back.rows.values()) == 3 * ROWS_PER_CYCLE
        with db.connect() as conn:
            node_ts = set(conn.execute(select(NodeSample.ts_ms)).scalars())
            cache_ts = set(conn.execute(select(CacheSample.ts_ms)).scalars())
        kept = {first.ts_ms, refused[2].ts_ms, refused[3].ts_ms, back.ts_ms}
        assert node_ts == cache_ts == kept  # whole cycles, the oldest two gone
        said = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
        assert len(said) == 2, said  # once as it dropped, once when the database is back
        assert "database back" in said[1] and f"{2 * ROWS_PER_CYCLE} rows" in said[1], said
    finally:
        db.dispose()
