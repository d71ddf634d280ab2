"""Link probes pick each DC's endpoint among the nodes its last scrape read: one dead node next to
a live one is no link failure (it made the link's ok ratio read about 50% on the dashboard), nor
is a DC whose only node refuses the token or is starting; a DC with no node answering is."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import LinkSample, Node
from tests.functional.agents import closed_port, running_agent
from tests.starting_agent import starting_url

pytestmark = pytest.mark.slow


def _register(db: Engine, nodes: dict[str, tuple[str, str]]) -> dict[str, int]:
    """nodes: name -> (dc, agent url), registered in this order; returns name -> id."""
    with db.begin() as conn:
        for dc in sorted({dc for dc, _ in nodes.values()}):
            add_dc(conn, dc, region="eu", carbon_g_per_kwh=300, pue=1.3)
        for name, (dc, url) in nodes.items():
            add_node(conn, name, dc=dc, agent_url=url)
        return dict(conn.execute(select(Node.name, Node.id)).all())


def test_links_are_probed_between_nodes_that_answer(sqlite_url: str, tmp_path: Path) -> None:
    db = open_db(sqlite_url)
    try:
        with (
            running_agent(tmp_path / "a1", "--name", "a1", "--dc", "dc1") as a1,
            running_agent(tmp_path / "b1", "--name", "b1", "--dc", "dc2") as b1,
            running_agent(tmp_path / "c1", "--name", "c1", "--dc", "dc3", token="s3cret") as c1,
            starting_url() as starting,
        ):
            ids = _register(
                db,
                {
                    "a1": ("dc1", a1.state.control_url),
                    # registered first: the first round's pick before, whatever its state
                    "ghost": ("dc2", f"http://127.0.0.1:{closed_port()}"),
                    "b1": ("dc2", b1.state.control_url),
                    "c1": ("dc3", c1.state.control_url),  # refuses the collector's (no) token
                    "s1": ("dc4", starting),
                },
            )
            collector = Collector(db, CollectorConfig(probe_bytes=64 << 10, pings=2))
            try:
                scrape = collector.collect_once()
                assert sorted(scrape.up) == ["a1", "b1"] and list(scrape.down) == ["ghost"]
                rounds = [collector.probe_links_once() for _ in range(3)]
            finally:
                collector.close()
        for r in rounds:
            assert sorted(r.up) == ["a1->b1", "b1->a1"], r.down
            assert r.down == {}
            # dc3 and dc4 answered: their links are not known to fail, and not recorded
            assert sorted(r.skipped) == sorted(
                f"{x}->{y}"
                for x in ("dc1", "dc2", "dc3", "dc4")
                for y in ("dc1", "dc2", "dc3", "dc4")
                if x != y and {x, y} & {"dc3", "dc4"}
            )
            assert "dc3" in r.skipped["dc1->dc3"] and "not probed" in r.skipped["dc4->dc2"]
        with db.connect() as conn:
            rows = conn.execute(select(LinkSample.src_node_id, LinkSample.ok)).all()
        assert len(rows) == 2 * 3 and all(ok for _src, ok in rows)
        assert {src for src, _ok in rows} == {ids["a1"], ids["b1"]}
    finally:
        db.dispose()


def test_a_dc_with_no_node_answering_is_a_failed_link(sqlite_url: str, tmp_path: Path) -> None:
    """Both of dc2's nodes are dead: the link cannot carry anything to it, so its probes are
    recorded failed, through each dead node in turn (not skipped as unreadable)."""
    db = open_db(sqlite_url)
    try:
        with running_agent(tmp_path / "a1", "--name", "a1", "--dc", "dc1") as a1:
            dead = {f"d{i}": ("dc2", f"http://127.0.0.1:{closed_port()}") for i in (1, 2)}
            _register(db, {"a1": ("dc1", a1.state.control_url), **dead})
            collector = Collector(db, CollectorConfig(probe_bytes=64 << 10, pings=2))
            try:
                assert sorted(collector.collect_once().down) == ["d1", "d2"]
                rounds = [collector.probe_links_once() for _ in range(2)]
            finally:
                collector.close()
        assert [sorted(r.down) for r in rounds] == [
            ["a1->d1", "d1->a1"],
            ["a1->d2", "d2->a1"],
        ]
        assert all(r.skipped == {} for r in rounds)
    finally:
        db.dispose()
