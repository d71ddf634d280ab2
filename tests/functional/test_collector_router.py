"""The collector scraping a real router (in-process ``RouterServer`` following two real agents
in two DCs): exact increases of its decisions per node, its index hits and its pulls per DC
link; a router restart and a collector restart lose nothing; a router that is down or answers
garbage is reported, never fatal; and the routing read model sums what the router counted."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from collectors.collector import Collector, CollectorConfig, rtt_basis_of
from kvctl.db.analytics.routing import routing_summary
from kvctl.db.migrate import open_db
from kvctl.db.models import raw_table
from kvctl.index.follower import Followers
from kvctl.index.model import EmbeddedIndex
from kvctl.remote.fetchplan import PrefillModel
from kvctl.router.app import RouterServer
from kvctl.router.client import RouterClient
from kvctl.router.score import Costs
from kvctl.router.service import Router
from kvctl.router.topology import DcLink, Node, Topology
from tests.functional.agents import Agent, closed_port, key, running_agent
from tests.functional.test_agent_index import CHUNK_BYTES, SMALL, put_chain, wait_for
from tests.not_an_agent import web_page_url

TOKEN = "collector-router-token"
PLACEMENT = {"a1": "fra", "b1": "ams"}


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[dict[str, Agent]]:
    with (
        running_agent(tmp_path / "a1", "--name", "a1", "--dc", "fra", *SMALL) as a1,
        running_agent(tmp_path / "b1", "--name", "b1", "--dc", "ams", *SMALL) as b1,
    ):
        yield {"a1": a1, "b1": b1}


def start_router(agents: dict[str, Agent], port: int) -> RouterServer:
    index = EmbeddedIndex()
    followers = Followers(
        index, {n: (a.state.control_url, None) for n, a in agents.items()}, poll_s=0.05
    )
    router = Router(
        index,
        Topology.build(
            [Node(n, dc) for n, dc in PLACEMENT.items()],
            {("fra", "ams"): DcLink.fiber(100)},
        ),
        # 25.6 ms to prefill a 256-token chunk: pulling 64 KiB over 100 km is cheaper
        Costs(PrefillModel(1e-4, 0.0, "configured: test")),
        followers=followers,
    )
    server = RouterServer(router, listen=f"127.0.0.1:{port}", token=TOKEN)
    server.start()
    return server


def rows(db: Engine, table: str, ts_ms: int) -> list[dict[str, Any]]:
    t = raw_table(table)
    with db.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(t).where(t.c.ts_ms == ts_ms))]


def by_node(db: Engine, ts_ms: int) -> dict[str, dict[str, Any]]:
    return {r["node"]: r for r in rows(db, "route_sample", ts_ms)}


def test_router_scrapes_are_exact_increases_across_restarts(
    sqlite_url: str, agents: dict[str, Agent], caplog: pytest.LogCaptureFixture
) -> None:
    db = open_db(sqlite_url)
    port = closed_port()
    url = f"http://127.0.0.1:{port}"
    clock = iter(range(1_700_000_000, 1_700_001_000, 10))
    config = CollectorConfig(interval_s=5.0, routers=(url,), router_token=TOKEN)
    collector = Collector(db, config, clock=lambda: float(next(clock)))
    server = start_router(agents, port)
    try:
        first = collector.collect_once()  # the baseline: nothing attributed
        assert first.routers_up == [url] and not first.routers_down
        assert by_node(db, first.ts_ms)[""]["decisions"] == 0

        held = [key(i, space=81) for i in range(4)]
        put_chain(agents["b1"], held, tenant="t1")
        wait_for(
            "the router's index to place the chain on b1",
            lambda: all(
                [h.node for h in row] == ["b1"]
                for row in server.router.index.holders(held, tenant="t1")
            ),
        )
        with RouterClient(url, token=TOKEN) as client:
            # fra's only node pulls the chain from ams; prefix-only goes to the holder
            pulled = client.route(keys=held, tenant="t1", origin_dc="fra", policy="round-robin")
            assert pulled["node"] == "a1"
            assert client.route(keys=held, tenant="t1", policy="prefix-only")["node"] == "b1"
            unknown = [key(i, space=82) for i in range(2)]
            client.route(keys=unknown, tenant="t1", origin_dc="fra")
            stats = client.stats()
        second = collector.collect_once()
        got = by_node(db, second.ts_ms)
        fleet = got[""]
        assert fleet["decisions"] == stats["decisions"] == 3
        assert fleet["to_holder"] == stats["to_holder"] == 1
        for c in ("requested_chunks", "indexed_chunks", "local_chunks", "pulled_chunks",
                  "pulled_bytes", "tokens", "fetched_tokens", "recomputed_tokens"):  # fmt: skip
            assert fleet[c] == stats[c], c
        assert fleet["requested_chunks"] == 10 and fleet["indexed_chunks"] == 8
        assert fleet["decision_s"] == pytest.approx(stats["latency"]["sum_s"])
        assert {n: (r["decisions"], r["to_holder"]) for n, r in got.items() if n} == {
            n: (s["decisions"], s["to_holder"]) for n, s in stats["nodes"].items()
        }
        assert got["b1"]["to_holder"] == 1 and got["a1"]["to_holder"] == 0
        assert got["a1"]["requested_chunks"] is None  # node rows carry their own counts only
        (link,) = rows(db, "route_link_sample", second.ts_ms)
        assert (link["from_dc"], link["to_dc"]) == ("ams", "fra")
        assert link["pulled_chunks"] == 4 and link["pulled_bytes"] == 4 * CHUNK_BYTES

        idle = collector.collect_once()  # nothing decided: zero increases, not the totals
        assert by_node(db, idle.ts_ms)[""]["decisions"] == 0
        assert rows(db, "route_link_sample", idle.ts_ms)[0]["pulled_bytes"] == 0

        # the router restarts on the same address, its counts from zero
        server.stop()
        server = start_router(agents, port)
        with RouterClient(url, token=TOKEN) as client:
            client.route(keys=unknown, tenant="t1", origin_dc="ams")
        after_restart = collector.collect_once()
        assert by_node(db, after_restart.ts_ms)[""]["decisions"] == 1

        # a new collector on the same database goes on from the saved counter state
        collector.close()
        collector = Collector(db, config, clock=lambda: float(next(clock)))
        with RouterClient(url, token=TOKEN) as client:
            client.route(keys=unknown, tenant="t1", origin_dc="ams")
        resumed = collector.collect_once()
        assert by_node(db, resumed.ts_ms)[""]["decisions"] == 1

        with db.connect() as conn:
            summary = routing_summary(conn, first.ts_ms, resumed.ts_ms + 1)
        assert summary.routers == (url,) and summary.scrapes == 5
        assert summary.decisions == 5 and summary.to_holder == 1
        assert summary.index_hit_ratio == pytest.approx(8 / 14)
        assert sum(n.decisions for n in summary.nodes) == 5
        assert [(lk.from_dc, lk.to_dc, lk.pulled_bytes) for lk in summary.links] == [
            ("ams", "fra", 4 * CHUNK_BYTES)
        ]

        # the router goes away: reported and logged, the loop goes on
        server.stop()
        with caplog.at_level(logging.WARNING, logger="kvctl.collect"):
            down = collector.collect_once()
        assert list(down.routers_down) == [url] and "did not answer" in down.routers_down[url]
        assert down.written and not rows(db, "route_sample", down.ts_ms)
        assert TOKEN not in caplog.text and url in caplog.text
        errors = collector.metrics.registry.get_sample_value(
            "kvctl_collector_scrape_errors_total", {"kind": "router"}
        )
        assert errors == 1
    finally:
        server.stop()
        collector.close()
        db.dispose()


def test_garbage_and_credentials(sqlite_url: str) -> None:
    db = open_db(sqlite_url)
    secret_url = f"http://ops:hunter2@127.0.0.1:{closed_port()}"
    with web_page_url() as page:
        collector = Collector(db, CollectorConfig(interval_s=2.0, routers=(page, secret_url)))
        try:
            report = collector.collect_once()
        finally:
            collector.close()
    assert not report.routers_up
    assert "not answer as a kvctl router" in report.routers_down[page]
    (redacted,) = (r for r in report.routers_down if r != page)
    assert redacted.startswith("http://ops:***@") and "hunter2" not in str(report.as_dict())
    db.dispose()


@pytest.mark.parametrize(
    ("answer", "columns"),
    [
        ({"ok": True, "rtt_s": 0.001}, ("measured", None)),  # an agent older than the basis
        ({"rtt_basis": "measured"}, ("measured", None)),
        ({"rtt_basis": "emulated", "emulated_delay_s": 0.0008}, ("emulated", 0.0008)),
        ({"rtt_basis": "guessed", "emulated_delay_s": -1}, ("unknown", None)),
        # an int no float holds (JSON reads 400 digits so): it raised OverflowError
        ({"rtt_basis": "emulated", "emulated_delay_s": 10**400}, ("emulated", None)),
    ],
)
def test_probe_rtt_basis_columns(answer: dict[str, Any], columns: tuple[Any, Any]) -> None:
    got = rtt_basis_of(answer)
    assert (got["rtt_basis"], got["emulated_delay_s"]) == columns


def test_collect_once_with_a_router_from_the_cli(sqlite_url: str, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from kvctl.cli.main import app

    router = Router(
        EmbeddedIndex(),
        Topology.build([Node(n, dc) for n, dc in PLACEMENT.items()]),
        Costs(PrefillModel(1e-4, 0.0, "configured: test")),
    )
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    with RouterServer(router, listen="127.0.0.1:0", token=TOKEN) as server:
        args = ["collect", "--once", "--json", "--no-links", "--db", sqlite_url]
        ok = CliRunner().invoke(
            app, [*args, "--router", server.url, "--router-token-file", str(token_file)]
        )
        refused = CliRunner().invoke(app, [*args, "--router", server.url], env={})
    assert ok.exit_code == 0, ok.output
    out = json.loads(ok.stdout)
    assert out["scrape"]["routers"] == {"up": [server.url], "down": {}}
    assert out["scrape"]["rows"]["route_sample"] == 3  # the router's row and its two nodes
    # no token: the router refuses, the cycle reports it and the command exits 1
    assert refused.exit_code == 1
    assert "401" in json.loads(refused.stdout)["scrape"]["routers"]["down"][server.url]
    bad = CliRunner().invoke(app, [*args, "--router", "127.0.0.1:9480"])
    assert bad.exit_code == 2 and "--router takes the router's URL" in bad.output
