"""An agent started after the collector counted everything while the collector watched: its
first scrape counts from zero (a `kvctl status` over the run said 2,780 lookups where the agent
said 3,110: the first sample's ~330 were taken as a baseline). One already running when the
collector started keeps the baseline rule. Decided by durations (the agent's uptime by its own
clock against the collector's), so the hosts' clocks may differ: the collector's is skewed here
by an hour either way."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import CacheSample, Node
from tests.functional.agents import running_agent, traffic

pytestmark = pytest.mark.slow


def _recorded(db: Engine, name: str) -> tuple[int, int]:
    """(lookups, hits) the database holds for node ``name`` (its all-tiers rows)."""
    with db.connect() as conn:
        node_id = conn.execute(select(Node.id).where(Node.name == name)).scalar_one()
        rows = conn.execute(
            select(CacheSample.lookups, CacheSample.hits).where(
                CacheSample.node_id == node_id, CacheSample.tier == "all"
            )
        ).all()
    return sum(r.lookups for r in rows), sum(r.hits for r in rows)


@pytest.mark.parametrize("skew_s", [-3600.0, 0.0, 3600.0])
def test_an_agent_started_after_the_collector_counts_from_zero(
    sqlite_url: str, tmp_path: Path, skew_s: float
) -> None:
    db = open_db(sqlite_url)
    try:
        with running_agent(tmp_path / "old", "--name", "old") as old:
            # the collector's clock is off by skew_s: only its timestamps move with it
            collector = Collector(db, CollectorConfig(), clock=lambda: time.time() + skew_s)
            try:
                with running_agent(tmp_path / "new", "--name", "new") as new:
                    with db.begin() as conn:
                        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
                        add_node(conn, "old", dc="fra", agent_url=old.state.control_url)
                        add_node(conn, "new", dc="fra", agent_url=new.state.control_url)
                    # counted before either's first scrape
                    traffic(old, 3, space=1)
                    traffic(new, 4, space=2)
                    first = collector.collect_once()
                    assert sorted(first.up) == ["new", "old"] and first.written
                    after_new = new.control().stats()["stats"]
                    traffic(old, 2, space=3)
                    traffic(new, 2, space=4)
                    assert collector.collect_once().written
                    new_stats = new.control().stats()["stats"]
            finally:
                collector.close()
    finally:
        recorded_old, recorded_new = _recorded(db, "old"), _recorded(db, "new")
        db.dispose()
    # new: everything it counted, its first scrape's counts included (5 + 3 lookups)
    assert after_new["lookup_chunks"] == 4 + 1
    assert recorded_new == (new_stats["lookup_chunks"], new_stats["hit_chunks"]) == (8, 6)
    # old was running before the collector: its first scrape is the baseline, as ever
    assert recorded_old == (2 + 1, 2)
