"""Samples written below a rollup's watermark (the collector's clock stepped back after a
rollup ran ahead of it; a batch kept through a database outage while another collector rolled
the fleet up) on a real SQLite and PostgreSQL: they are rolled up, so window sums, which read
rollups below the watermark, count every increase the agent reported.

The agent is a stand-in answering over loopback HTTP.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.engine import create_db_engine
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.models import Node
from kvctl.db.rollup import DAY_MS, HOUR_MS, MINUTE_MS, maintain, series, watermark, window
from tests.functional.test_collector_impossible_values import T0_S, StandIn, _stats

pytestmark = pytest.mark.slow


@pytest.fixture
def agent() -> Iterator[StandIn]:
    a = StandIn("n1")
    try:
        yield a
    finally:
        a.close()


def _lookups(db: Engine, node_id: int, start_ms: int, end_ms: int) -> int:
    with db.connect() as conn:
        q = window(
            conn,
            series("cache_sample"),
            start_ms,
            end_ms,
            where={"node_id": node_id, "tier": "all"},
            columns=["lookups"],
        )
        return int(conn.execute(q).one()._mapping["lookups"])


def test_rows_stamped_below_the_watermark_are_rolled_up(db: Engine, agent: StandIn) -> None:
    """The clock jumps three hours ahead for one cycle and its upkeep, then back. Before, the
    scrapes after the jump back were stamped below the minute and hour rollups' watermarks:
    never rolled up, and the window read 20 lookups of the agent's 40."""
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url)
    with db.connect() as conn:
        node_id = int(conn.execute(select(Node.id).where(Node.name == "n1")).scalar_one())
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=10.0), clock=lambda: now[0])
    t0_ms = int(T0_S * 1000)
    try:
        for lookups, at_s in ((0, 0), (10, 10), (20, 3 * 3600), (30, 20), (40, 30)):
            now[0] = T0_S + at_s
            agent.answers["/v1/stats"] = _stats(lookups, 0, 0.0)
            assert collector.collect_once().written
            if at_s == 3 * 3600:  # the upkeep runs on the jumped clock: past both rows
                collector.maintain()
                with db.connect() as conn:
                    assert watermark(conn, "cache_sample", "1h") == t0_ms + 2 * HOUR_MS
        now[0] = T0_S + 5 * 3600
        collector.maintain()
    finally:
        collector.close()
    assert _lookups(db, node_id, t0_ms, t0_ms + DAY_MS) == 40
    assert _lookups(db, node_id, t0_ms, t0_ms + HOUR_MS) == 30


def _samples(db: Engine, node_id: int, start_ms: int, end_ms: int) -> int:
    with db.connect() as conn:
        q = window(conn, series("node_sample"), start_ms, end_ms, where={"node_id": node_id})
        return int(conn.execute(q).one()._mapping["samples"])


def test_late_rows_written_while_another_process_rolls_up_are_rolled_up(
    db: Engine, agent: StandIn
) -> None:
    """Another process's upkeep (kvctl db maintain, a second collector) reads the node rollup's
    watermark, and the collector's late rows (the clock stepped back) go in and lower it before
    that upkeep writes: the upkeep must not then raise the watermark past rows it never read.
    PostgreSQL's rollup lock orders the two; on SQLite the upkeep read its watermarks before
    its transaction began (pysqlite begins one at the first write), and the late scrape was
    counted in no window: 3 samples of 4."""
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=agent.url)
    with db.connect() as conn:
        node_id = int(conn.execute(select(Node.id).where(Node.name == "n1")).scalar_one())
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=10.0), clock=lambda: now[0])
    t0_ms = int(T0_S * 1000)
    other = create_db_engine(db.url.render_as_string(hide_password=False), create=False)
    late: list[threading.Thread] = []

    def late_scrape_first(_c: Any, _cur: Any, statement: str, *_rest: Any) -> None:
        # the other upkeep has read node_sample's watermark and is about to write its minutes
        if late or not statement.lstrip().upper().startswith("DELETE FROM NODE_1M"):
            return
        now[0] = T0_S + 20  # the clock stepped back
        late.append(threading.Thread(target=collector.collect_once))
        late[0].start()
        late[0].join(3.0)  # done on SQLite; on PostgreSQL it waits for this upkeep's lock

    try:
        for at_s in (0, 10, 3 * 3600):
            now[0] = T0_S + at_s
            assert collector.collect_once().written
        collector.maintain()  # on the jumped clock: the watermarks pass T0 + 20 s
        event.listen(other, "before_cursor_execute", late_scrape_first)
        maintain(other, t0_ms + 3 * HOUR_MS + 5 * MINUTE_MS)
        assert late, "the other upkeep rolled no minute up"
        late[0].join(20.0)
        now[0] = T0_S + 5 * 3600
        collector.maintain()
    finally:
        collector.close()
        other.dispose()
    assert _samples(db, node_id, t0_ms, t0_ms + DAY_MS) == 4
