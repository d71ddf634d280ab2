"""A batch the database refuses leaves the counters' saved state as it was, so the next run
counts the increases that batch held. On SQLite the state's compare-and-set save (a
``WITH ... UPDATE``) ran outside the batch's transaction (pysqlite opens one only before a
statement whose first word it takes for a write) and was committed on its own: a
`kvctl collect --once` whose write failed (a full disk) lost its interval's increases for good.
The refusal here is the database's own: a trigger that aborts every sample row's insert."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import CacheSample
from tests.functional.agents import running_agent, traffic

pytestmark = pytest.mark.slow

REFUSE = {
    "sqlite": [
        "CREATE TRIGGER refuse BEFORE INSERT ON node_sample "
        "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
    ],
    "postgresql": [
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$",
        "CREATE TRIGGER refuse BEFORE INSERT ON node_sample EXECUTE FUNCTION refuse()",
    ],
}
ALLOW = {
    "sqlite": ["DROP TRIGGER refuse"],
    "postgresql": ["DROP TRIGGER refuse ON node_sample", "DROP FUNCTION refuse()"],
}


def _run(db: Engine, statements: list[str]) -> None:
    with db.begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement)


def _saved_state(db: Engine) -> list[tuple[str, str, int]]:
    with db.connect() as conn:
        return [tuple(r) for r in conn.execute(text("SELECT * FROM counter_state ORDER BY 1"))]


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_refused_batch_saves_no_counter_state(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = request.getfixturevalue("pg_url" if backend == "postgresql" else "sqlite_url")
    db = open_db(url, auto_upgrade=True)
    once = CollectorConfig()  # each closed after one cycle, as `kvctl collect --once` is
    try:
        with running_agent(tmp_path / "a1", "--name", "n1") as a1:
            with db.begin() as conn:
                add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
                add_node(conn, "n1", dc="fra", agent_url=a1.state.control_url)
            for _ in range(2):  # the baseline, then a save that updates the state
                first = Collector(db, once)
                try:
                    assert first.collect_once().written
                finally:
                    first.close()
            saved = _saved_state(db)
            traffic(a1, 3, space=7)
            _run(db, REFUSE[backend])
            refused = Collector(db, once)
            try:
                report = refused.collect_once()
            finally:
                refused.close()
            assert not report.written and "refused by the test" in report.warnings[0]
            assert _saved_state(db) == saved  # the whole batch rolled back, state too
            _run(db, ALLOW[backend])
            after = Collector(db, once)
            try:
                assert after.collect_once().written
            finally:
                after.close()
        with db.connect() as conn:
            hits = conn.execute(select(func.sum(CacheSample.hits)).where(CacheSample.tier == "all"))
            assert hits.scalar_one() == 3
    finally:
        db.dispose()
