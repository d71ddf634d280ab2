"""The agents' fetch-or-recompute figures through a collector into the database: a lookup that
a real agent planned over a real pool link lands as increases of prefill, fetch and saved
seconds (saved = prefill - fetch of the chunks taken), with its prefill basis, and the totals
stay exact across an agent restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.migrate import open_db
from kvctl.db.models import Node, PlanSample
from tests.functional.agents import Agent, running_agent, start_agent
from tests.functional.test_collector import _node_id, _register, _rows
from tests.functional.test_remote import (
    SLOW_GPU,
    SMALL,
    chain,
    link_costed,
    pool_holds,
    put_chain,
    wait_for,
)

pytestmark = pytest.mark.slow

PLAN_COUNTERS = ("recompute_s", "fetch_s", "saved_s", "fetch_chunks", "recompute_chunks")


@pytest.fixture
def sqlite_db(sqlite_url: str) -> Iterator[Engine]:
    engine = open_db(sqlite_url)
    yield engine
    engine.dispose()


def _plans(agent: Agent) -> dict[str, Any]:
    return agent.control().stats()["fetch_plans"]


def _lookup_through_pool(reader: Agent, keys: list[bytes]) -> None:
    wait_for("the reader to measure its link to the pool", link_costed(reader, "pool"))
    with reader.data() as d:
        res = d.lookup(keys, tenant="t2")
    if res.matched_chunks != len(keys):  # failed once in CI, not reproduced: say why next time
        stats = reader.control().stats()
        why = {"fetch_plans": stats["fetch_plans"], "remote": stats.get("remote")}
        raise AssertionError(f"{res}: the reader's plans and links: {why}")
    assert set(res.locations) == {"remote"}


def test_planned_lookups_land_as_saved_seconds_across_a_restart(
    tmp_path: Path, sqlite_db: Engine
) -> None:
    first, second = chain(4, seed=11), chain(3, seed=12)
    with (
        running_agent(tmp_path / "pool", "--role", "pool", "--name", "pool", *SMALL) as pool,
        running_agent(
            tmp_path / "w", "--name", "w", "--pool", f"kvctl://{pool.state.data_tcp}", *SMALL
        ) as writer,
    ):
        reader_args = ("--name", "r", "--pool", f"kvctl://{pool.state.data_tcp}", *SLOW_GPU)
        reader = start_agent(tmp_path / "r", *reader_args, *SMALL)
        collector = Collector(sqlite_db, CollectorConfig(interval_s=2.0))
        try:
            _register(sqlite_db, {"r": ("fra", reader.state.control_url)})
            put_chain(writer, [*first, *second], tenant="t1")
            wait_for("the write-through", pool_holds(pool, len(first) + len(second)))
            collector.collect_once()  # the baseline
            before = _plans(reader)["plans"]
            _lookup_through_pool(reader, first)
            after = _plans(reader)
            collector.collect_once()
            # restarted on new ports: its counters start again from zero under a new epoch
            assert reader.stop() == 0
            reader = start_agent(tmp_path / "r2", *reader_args, *SMALL)
            with sqlite_db.begin() as conn:
                conn.execute(
                    update(Node).where(Node.name == "r").values(agent_url=reader.state.control_url)
                )
            _lookup_through_pool(reader, second)
            restarted = _plans(reader)["plans"]
            collector.collect_once()
        finally:
            collector.close()
            if reader.proc.poll() is None:
                assert reader.stop() == 0

    rows = _rows(sqlite_db, PlanSample, node_id=_node_id(sqlite_db, "r"))
    assert len(rows) == 3
    base, planned, after_restart = rows
    assert all(base[c] == 0 for c in PLAN_COUNTERS)  # the first scrape only sets the baseline
    plans = after["plans"]
    # the agent's own figures, as increases: a fetch over the pool link costs time
    assert planned["fetch_chunks"] == plans["fetch_chunks"] - before["fetch_chunks"] == len(first)
    assert planned["recompute_chunks"] == 0
    assert planned["fetch_s"] == pytest.approx(plans["fetch_s"] - before["fetch_s"])
    assert planned["fetch_s"] > 0
    assert planned["recompute_s"] == pytest.approx(plans["recompute_s"] - before["recompute_s"])
    assert planned["saved_s"] == pytest.approx(plans["saved_s"] - before["saved_s"])
    assert planned["saved_s"] == pytest.approx(planned["recompute_s"] - planned["fetch_s"])
    assert 0 < planned["saved_s"] < planned["recompute_s"]
    # the reader models prefill on an L4 profile: the saving is modeled, and says so
    assert after["prefill"]["kind"] == "modeled"
    assert planned["prefill_basis"] == "modeled"
    # after the restart the whole of the new process's counters is the increase
    assert after_restart["fetch_chunks"] == restarted["fetch_chunks"] == len(second)
    assert after_restart["saved_s"] == pytest.approx(restarted["saved_s"])
    assert after_restart["fetch_s"] == pytest.approx(restarted["fetch_s"])
    total_s = sum(r["saved_s"] for r in rows)
    assert total_s == pytest.approx(plans["saved_s"] - before["saved_s"] + restarted["saved_s"])
