"""The dashboard's queries on PostgreSQL read what they need, not whole tables: checked on the
server's own EXPLAIN ANALYZE (rows each scan read or filtered out), never on timings.

The sample tables' time indexes are BRIN there. A time-range EXISTS over a recent span, as the
default window's fitting asked, is planned as a scan from the table's oldest rows, which finds
the newest ones last: 2.7 s per page on 1,000 nodes' two days of raw scrapes (13 s once
collection had stopped three days before), on every page load and refresh."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from kvctl.db.analytics.windows import fitted_window
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.rollup import DAY_MS, HOUR_MS, MINUTE_MS
from kvctl.fleet.status import last_seen

NODES = 40
SCRAPE_MS = 30_000
END_MS = 1_767_225_600_000  # a UTC midnight
SAMPLE_TABLES = {"node_sample", "node_1h"}


@pytest.fixture
def scraped(pg_url: str) -> Iterator[Engine]:
    """NODES nodes scraped every 30 s for the day before END_MS, rows in time order as a
    collector writes them, and a month of hourly rollups before that; analyzed."""
    engine = open_db(pg_url, auto_upgrade=True)
    try:
        with engine.begin() as conn:
            add_dc(conn, "fra")
            for i in range(NODES):
                add_node(conn, f"n{i:02d}", dc="fra", agent_url=f"http://10.0.0.{i + 1}:7070")
            conn.execute(
                text(
                    "INSERT INTO node_sample (node_id, ts_ms, up, scrape_seconds) "
                    "SELECT node.id, t, true, 0.01 FROM generate_series(:a, :b, :step) t "
                    "CROSS JOIN node ORDER BY t"
                ),
                {"a": END_MS - DAY_MS, "b": END_MS - SCRAPE_MS, "step": SCRAPE_MS},
            )
            conn.execute(
                text(
                    "INSERT INTO node_1h (bucket_ms, node_id, samples, up, scrape_seconds_n) "
                    "SELECT t, node.id, 120, 120, 0 FROM generate_series(:a, :b, :step) t "
                    "CROSS JOIN node ORDER BY t"
                ),
                {"a": END_MS - 30 * DAY_MS, "b": END_MS - DAY_MS - HOUR_MS, "step": HOUR_MS},
            )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE node_sample"))
            conn.execute(text("ANALYZE node_1h"))
        yield engine
    finally:
        engine.dispose()


def statements(engine: Engine, run: Any) -> list[tuple[str, Any]]:
    """The SELECTs ``run()`` sends, with their parameters."""
    seen: list[tuple[str, Any]] = []

    def record(_conn: Any, _cur: Any, statement: str, params: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            seen.append((statement, params))

    event.listen(engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return seen


def rows_touched(engine: Engine, statement: str, params: Any) -> int:
    """Rows the statement's scans of the sample tables returned or filtered out, all loops."""
    with engine.connect() as conn:
        dbapi = conn.connection.driver_connection
        assert dbapi is not None
        with dbapi.cursor() as cur:
            cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, params)
            row = cur.fetchone()
            assert row is not None
            plan = row[0][0]["Plan"]
    touched = 0
    stack = [plan]
    while stack:
        node = stack.pop()
        stack += node.get("Plans", [])
        if node.get("Relation Name") not in SAMPLE_TABLES:
            continue
        per_loop = (
            node.get("Actual Rows", 0)
            + node.get("Rows Removed by Filter", 0)
            + node.get("Rows Removed by Index Recheck", 0)
        )
        touched += per_loop * node.get("Actual Loops", 1)
    return int(touched)


@pytest.mark.parametrize(
    "age_ms",
    [0, 30 * MINUTE_MS, 3 * DAY_MS],
    ids=["collecting", "stopped-30-min-ago", "stopped-3-days-ago"],
)
def test_fitting_the_default_window_probes_each_node_not_the_whole_table(
    scraped: Engine, age_ms: int
) -> None:
    now_ms = END_MS + age_ms
    with scraped.connect() as conn:
        sent = statements(scraped, lambda: fitted_window(conn, now_ms))
        win = fitted_window(conn, now_ms)
    assert win.fitted and win.name == "30d"  # the month of rollups and the day of scrapes
    assert win.end_ms == (now_ms if age_ms == 0 else END_MS - SCRAPE_MS + 1)
    raw_rows = NODES * DAY_MS // SCRAPE_MS
    assert sent
    for statement, params in sent:
        # a probe of each node's latest row reads a row or two per node, whatever the history
        touched = rows_touched(scraped, statement, params)
        assert touched <= 4 * NODES, (touched, raw_rows, statement)


def test_last_seen_reads_a_row_or_two_per_node_not_their_history(scraped: Engine) -> None:
    """``kvctl top`` and ``kvctl status`` ask, every poll, when each down node was last seen
    up: a grouped max over every up sample of those nodes read their whole history (3.1 s on
    PostgreSQL for 250 down nodes of 1,000 with two days of samples)."""
    with scraped.connect() as conn:
        ids = [int(i) for i in conn.execute(text("SELECT id FROM node ORDER BY id")).scalars()]
        # the last scrape of one node failed: it was last seen up the scrape before
        conn.execute(
            text("UPDATE node_sample SET up = false WHERE node_id = :n AND ts_ms = :t"),
            {"n": ids[0], "t": END_MS - SCRAPE_MS},
        )
        sent = statements(scraped, lambda: last_seen(conn, ids))
        seen = last_seen(conn, ids)
        conn.rollback()
    assert seen[ids[0]] == END_MS - 2 * SCRAPE_MS
    assert all(seen[i] == END_MS - SCRAPE_MS for i in ids[1:])
    assert sent
    for statement, params in sent:
        touched = rows_touched(scraped, statement, params)
        assert touched <= 4 * NODES, (touched, statement)
