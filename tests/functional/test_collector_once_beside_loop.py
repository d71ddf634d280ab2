"""`kvctl collect --once` while a `kvctl collect` loop runs: the --once run saves the counters'
state the loop also writes, and the loop's next save is refused (compare-and-set). The loop used
to drop that whole batch (`batch of 13 rows dropped`: its node and cache samples of the cycle);
now it counts that cycle's increases again from the state the other saved and writes it, so
nothing is lost and nothing counted twice. Against a real agent, on SQLite and PostgreSQL."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import delete, select
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from collectors.collector import Collector, CollectorConfig
from kvctl.cli.main import app
from kvctl.counters import CountersMoved, CounterTracker
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import CacheSample, CounterState, NodeSample
from tests.functional.agents import Agent, key, payload, running_agent

pytestmark = pytest.mark.slow


def _traffic(agent: Agent, n: int, space: int) -> None:
    """``n`` chunks stored, then looked up with one miss: n + 1 lookups, n hits."""
    keys = [key(i, space) for i in range(n)]
    with agent.data() as dc:
        for k in keys:
            dc.put(k, payload(k, 4096), tenant="t1")
        dc.lookup([*keys, key(10_000, space)], tenant="t2")


def _db(request: pytest.FixtureRequest, backend: str) -> tuple[str, Engine]:
    url = request.getfixturevalue("pg_url" if backend == "postgresql" else "sqlite_url")
    return url, open_db(url, auto_upgrade=True)


@contextlib.contextmanager
def _loop_on_one_node(db: Engine, data_dir: Path) -> Iterator[tuple[Agent, Collector]]:
    """A real agent registered as node n1 of DC fra, and a collector loop's cycles on it."""
    with running_agent(data_dir, "--name", "n1") as agent:
        with db.begin() as conn:
            add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
            add_node(conn, "n1", dc="fra", agent_url=agent.state.control_url)
        loop = Collector(db, CollectorConfig())
        try:
            yield agent, loop
        finally:
            loop.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_the_loop_keeps_its_batch_when_collect_once_runs_beside_it(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url, db = _db(request, backend)
    try:
        with _loop_on_one_node(db, tmp_path / "a1") as (a1, loop):
            assert loop.collect_once().written  # the baseline
            _traffic(a1, 3, space=1)
            time.sleep(0.01)  # each save is stamped by its own millisecond
            once = CliRunner().invoke(app, ["collect", "--once", "--no-links", "--db", url])
            assert once.exit_code == 0, once.output
            _traffic(a1, 2, space=2)
            time.sleep(0.01)
            cycle = loop.collect_once()  # counted from the state before --once's save
            assert cycle.written, cycle.warnings
            assert cycle.rows["node_sample"] == 1 and cycle.rows["cache_sample"] >= 2
            assert any("another collector" in w for w in cycle.warnings), cycle.warnings
            _traffic(a1, 1, space=3)
            assert loop.collect_once().written
            agent = a1.control().stats()["stats"]
        with db.connect() as conn:
            ups = conn.execute(select(NodeSample.up)).scalars().all()
            sums = conn.execute(
                select(CacheSample.lookups, CacheSample.hits).where(CacheSample.tier == "all")
            ).all()
        assert ups == [True] * 4  # the loop's three cycles and --once's, none dropped
        # each increase once: what the agent counted since the baseline, no more, no less
        assert sum(r.lookups for r in sums) == agent["lookup_chunks"] == 4 + 3 + 2
        assert sum(r.hits for r in sums) == agent["hit_chunks"] == 3 + 2 + 1
    finally:
        db.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_sample_older_than_the_other_writers_counts_nothing(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """The loop scraped (9 lookups), then --once scraped later (12) and saved first: the loop's
    sample, counted again from --once's state, is older than it (same epoch, fewer lookups). It
    counts nothing, and --once's newer state stays, rather than 9 < 12 read as a restart that
    counted all 9 again."""
    _url, db = _db(request, backend)
    try:
        loop, once = CounterTracker(), CounterTracker()
        with db.begin() as conn:
            loop.load(conn, ())
            assert loop.increase("cache:1:all", {"lookups": 5}, epoch=100.0, ts_ms=1_000) == {
                "lookups": 0.0
            }
            loop.save(conn)
        with db.begin() as conn:
            once.load(conn, ())
        # the loop's sample of the next cycle, taken first
        assert loop.increase("cache:1:all", {"lookups": 9}, epoch=100.0, ts_ms=2_000) == {
            "lookups": 4.0
        }
        # --once's, taken after it, saved first
        with db.begin() as conn:
            assert once.increase("cache:1:all", {"lookups": 12}, epoch=100.0, ts_ms=2_001) == {
                "lookups": 7.0
            }
            once.save(conn)
        with pytest.raises(CountersMoved) as moved, db.begin() as conn:
            loop.save(conn)
        with db.connect() as conn:
            loop.rebase(conn, moved.value.series)
        assert loop.increase("cache:1:all", {"lookups": 9}, epoch=100.0, ts_ms=2_000) == {
            "lookups": 0.0
        }
        with db.begin() as conn:
            loop.save(conn)  # nothing to save: --once's state is the newer
        assert loop.increase("cache:1:all", {"lookups": 15}, epoch=100.0, ts_ms=3_000) == {
            "lookups": 3.0
        }
        with db.begin() as conn:
            loop.save(conn)
        # from 5 to 15: 7 counted by --once, then 3 by the loop; the loop's refused 4 never
    finally:
        db.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_database_emptied_under_the_loop_is_said_so_not_blamed_on_another_collector(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The counters' saved state deleted under a running loop (a database emptied or made anew):
    the loop's next save is refused as when another collector saves, but its warning says the
    state is gone; before, it said "another collector saved ..." with no other collector."""
    _url, db = _db(request, backend)
    try:
        with _loop_on_one_node(db, tmp_path / "a1") as (a1, loop):
            assert loop.collect_once().written  # the baseline: its series inserted
            _traffic(a1, 2, space=1)
            time.sleep(0.01)
            assert loop.collect_once().written  # and updated
            with db.begin() as conn:
                conn.execute(delete(CounterState))
            _traffic(a1, 1, space=2)
            time.sleep(0.01)
            cycle = loop.collect_once()
            assert cycle.written, cycle.warnings
            assert any("gone from the database" in w for w in cycle.warnings), cycle.warnings
            assert not any("another collector" in w for w in cycle.warnings)
    finally:
        db.dispose()
