"""Collectors against real agents on loopback and a real database: nodes up and down, counter
increases that match the agents' own counters, an agent killed and restarted mid-run, link
probes through the data plane, engine metrics, the collector's own /metrics, several collectors
on one PostgreSQL, and `kvctl collect` itself."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, text, update
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from collectors.collector import Collector, CollectorConfig
from dashboard.app import create_app, render
from kvctl.cli.main import app
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import CacheSample, EngineSample, LinkSample, Node, NodeSample, PowerSample
from tests.functional.agents import (
    Agent,
    closed_port,
    key,
    payload,
    running_agent,
    start_agent,
    traffic,
)
from tests.functional.test_dashboard_app import by_id, text_of
from tests.not_an_agent import send
from tests.starting_agent import starting_url

pytestmark = pytest.mark.slow


def _register(db: Engine, nodes: dict[str, tuple[str, str]], **extra: Any) -> None:
    """nodes: name -> (dc, agent url)."""
    with db.begin() as conn:
        for dc in sorted({dc for dc, _ in nodes.values()}):
            add_dc(conn, dc, region="eu", carbon_g_per_kwh=300, pue=1.3)
        for name, (dc, url) in nodes.items():
            add_node(conn, name, dc=dc, agent_url=url, **extra.get(name, {}))


def _rows(db: Engine, model: Any, **where: Any) -> list[Any]:
    q = select(model)
    for k, v in where.items():
        q = q.where(getattr(model, k) == v)
    with db.connect() as conn:
        return [r._mapping for r in conn.execute(q.order_by(model.ts_ms))]


def _node_id(db: Engine, name: str) -> int:
    with db.connect() as conn:
        return conn.execute(select(Node.id).where(Node.name == name)).scalar_one()


@pytest.fixture
def two_agents(tmp_path: Path) -> Iterator[tuple[Agent, Agent]]:
    with (
        running_agent(tmp_path / "a1", "--name", "n1", "--dc", "fra") as a1,
        running_agent(tmp_path / "a2", "--name", "n2", "--dc", "ams") as a2,
    ):
        yield a1, a2


@pytest.fixture
def sqlite_db(sqlite_url: str) -> Iterator[Engine]:
    engine = open_db(sqlite_url)
    yield engine
    engine.dispose()


def test_scrapes_record_up_down_and_exact_increases(
    sqlite_db: Engine, two_agents: tuple[Agent, Agent]
) -> None:
    a1, a2 = two_agents
    dead = f"http://127.0.0.1:{closed_port()}"
    _register(
        sqlite_db,
        {
            "n1": ("fra", a1.state.control_url),
            "n2": ("ams", a2.state.control_url),
            "n3": ("fra", dead),
        },
    )
    collector = Collector(sqlite_db, CollectorConfig(interval_s=2.0))
    try:
        first = collector.collect_once()
        assert sorted(first.up) == ["n1", "n2"]
        assert "n3" in first.down and "127.0.0.1" in first.down["n3"]
        before = a1.control().stats()["stats"]
        traffic(a1, 5, space=1)
        after = a1.control().stats()["stats"]
        collector.collect_once()
    finally:
        collector.close()

    n1, n3 = _node_id(sqlite_db, "n1"), _node_id(sqlite_db, "n3")
    down = _rows(sqlite_db, NodeSample, node_id=n3)
    assert [r["up"] for r in down] == [False, False] and down[0]["error"]
    up = _rows(sqlite_db, NodeSample, node_id=n1)
    assert all(r["up"] for r in up) and up[0]["agent_started_s"] > 0
    # no GPU here: NVML is recorded as unavailable and no power figure is invented
    assert up[0]["nvml_available"] is False
    assert _rows(sqlite_db, PowerSample) == []

    totals = _rows(sqlite_db, CacheSample, node_id=n1, tier="all")
    assert len(totals) == 2
    assert totals[0]["lookups"] == 0  # the first scrape is the baseline
    second = totals[1]
    assert second["lookups"] == after["lookup_chunks"] - before["lookup_chunks"] == 6
    assert second["hits"] == after["hit_chunks"] - before["hit_chunks"] == 5
    assert second["sharing_hits"] == 5 and second["reuse_hits"] == 0  # stored by t1, read by t2
    assert second["items"] == 5 and second["used_bytes"] == 5 * 4096
    tiers = {r["tier"] for r in _rows(sqlite_db, CacheSample, node_id=n1)}
    assert {"all", "cpu"} <= tiers


def test_each_tiers_reuse_and_sharing_are_the_agents_own_counts(
    sqlite_url: str, sqlite_db: Engine, tmp_path: Path
) -> None:
    """Per tier, the reuse and sharing hits `kvctl status --window --json` reports (the read
    model's, as the dashboard's) are the increases of the agent's own per-tier counters, over
    the increase of its lookups; the tiers add up to the node's."""
    chunk = 256 << 10
    # cpu holds 4 chunks: the older ones go down to disk, so both tiers serve hits
    with running_agent(tmp_path / "a", "--name", "n1", "--cpu", "1MiB", "--disk", "64MiB") as a:
        _register(sqlite_db, {"n1": ("fra", a.state.control_url)})
        collector = Collector(sqlite_db, CollectorConfig(interval_s=2.0))
        try:
            collector.collect_once()  # the baseline
            before = a.control().stats()["stats"]
            keys = [key(i, 77) for i in range(10)]
            with a.data() as dc:
                for k in keys:
                    dc.put(k, payload(k, chunk), tenant="t1")
                dc.lookup(keys[:3], tenant="t1")  # reuse: t1's own chunks
                dc.lookup([*keys[3:], key(10_000, 77)], tenant="t2")  # sharing, and a miss
            after = a.control().stats()["stats"]
            collector.collect_once()
        finally:
            collector.close()

    lookups = after["lookup_chunks"] - before["lookup_chunks"]
    assert lookups == 11

    def grew(tier: str, counter: str) -> int:
        return after["tiers"][tier][counter] - before["tiers"][tier][counter]

    out = CliRunner().invoke(app, ["status", "--db", sqlite_url, "--window", "15m", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    (node,) = doc["nodes"]
    for scope in (node, doc["total"]):
        assert scope["lookups"] == lookups
        served = [t for t in scope["tiers"] if scope["tiers"][t]["hits"]]
        assert sorted(served) == ["cpu", "disk"], scope["tiers"]  # both tiers served hits
        for tier, got in scope["tiers"].items():
            reuse, sharing = grew(tier, "reuse_hits"), grew(tier, "sharing_hits")
            assert (got["hits"], got["reuse_hits"], got["sharing_hits"]) == (
                grew(tier, "hits"),
                reuse,
                sharing,
            ), tier
            assert got["reuse_hit_ratio"] == pytest.approx(reuse / lookups), tier
            assert got["sharing_hit_ratio"] == pytest.approx(sharing / lookups), tier
        tiers = scope["tiers"].values()
        assert sum(t["reuse_hits"] for t in tiers) == scope["reuse_hits"] == 3
        assert sum(t["sharing_hits"] for t in tiers) == scope["sharing_hits"] == 7
        assert sum(t["reuse_hit_ratio"] for t in tiers) == pytest.approx(scope["reuse_hit_ratio"])
        assert sum(t["sharing_hit_ratio"] for t in tiers) == pytest.approx(
            scope["sharing_hit_ratio"]
        )


def test_reads_of_chunks_gone_since_their_lookup_are_recorded(
    sqlite_url: str, sqlite_db: Engine, tmp_path: Path
) -> None:
    """The chunks the agent's reads asked for, and those not there, are recorded as the
    increases of its own counts (``/v1/stats`` dataplane) and reported beside the hits a
    lookup counted: a hit whose chunk was evicted before the engine read it is one of them."""
    with running_agent(tmp_path / "a", "--name", "n1", "--cpu", "16MiB", "--disk", "0") as a:
        _register(sqlite_db, {"n1": ("fra", a.state.control_url)})
        collector = Collector(sqlite_db, CollectorConfig(interval_s=2.0))
        try:
            collector.collect_once()  # the baseline
            keys = [key(i, 78) for i in range(6)]
            with a.data() as dc:
                dc.put_many([(k, payload(k, 64 << 10)) for k in keys], tenant="t1")
                assert dc.lookup(keys, tenant="t1").matched_chunks == 6  # 6 hits counted
                a.control().evict(keys[4:])  # gone before the engine reads them
                got = dc.get_many(keys, tenant="t1")
            assert sum(g is None for g in got) == 2
            collector.collect_once()
        finally:
            collector.close()
    with sqlite_db.connect() as conn:
        recorded = conn.execute(
            text("SELECT tier, read_chunks, read_missing_chunks FROM cache_sample ORDER BY ts_ms")
        ).all()
    # the first scrape is the baseline; tier rows carry no read counts
    assert [tuple(r) for r in recorded if r[0] == "all"][-1] == ("all", 6, 2)
    assert all(r[1] is None and r[2] is None for r in recorded if r[0] != "all")
    out = CliRunner().invoke(app, ["status", "--db", sqlite_url, "--window", "15m", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    for scope in (doc["nodes"][0], doc["total"]):
        assert (scope["hits"], scope["read_chunks"], scope["read_missing_chunks"]) == (6, 6, 2)
        assert scope["read_missing_ratio"] == pytest.approx(2 / 6)
    out = CliRunner().invoke(app, ["status", "--db", sqlite_url, "--window", "15m"])
    assert out.exit_code == 0, out.output
    assert "reads gone" in out.stdout and "33.3%" in out.stdout, out.stdout
    dash = create_app(sqlite_url, model="llama-3.1-8b", default_gpu="a100")
    try:
        page, _updated = render(dash, "/", "", "1h", None, "llama-3.1-8b")
        note = " ".join(text_of(by_id(page, "card-tokens")).split())
        assert "of 6 chunks read, 2 (33.3%) were gone" in note, note
    finally:
        dash.server.extensions["kvctl"].engine.dispose()


def test_agent_killed_and_restarted_mid_run(tmp_path: Path, sqlite_db: Engine) -> None:
    a1 = start_agent(tmp_path / "a1", "--name", "n1")
    a2 = start_agent(tmp_path / "a2", "--name", "n2")
    try:
        _register(
            sqlite_db, {"n1": ("fra", a1.state.control_url), "n2": ("fra", a2.state.control_url)}
        )
        collector = Collector(
            sqlite_db,
            CollectorConfig(interval_s=0.3, link_interval_s=3600, maintenance_interval_s=3600),
        )
        stop = threading.Event()
        cycles: list[Any] = []
        loop = threading.Thread(
            target=collector.run, args=(stop,), kwargs={"on_cycle": lambda k, r: cycles.append(r)}
        )
        loop.start()
        # n2's first reading is the baseline its increases count from: traffic before it is
        # never recorded, and on a loaded machine the first cycles' scrapes can all time out
        _wait(lambda: _scraped_up(sqlite_db, "n2"))
        traffic(a2, 3, space=2)
        # the traffic recorded before the kill: counts no scrape read before a kill -9 are gone
        # with the process (waiting for cycles was not enough: on a loaded machine a scrape can
        # time out and its cycle still complete)
        _wait(lambda: _lookups_recorded(sqlite_db, "n2") == 3 + 1)
        a2.kill9()
        _wait(lambda: any("n2" in getattr(c, "down", {}) for c in cycles[5:]))
        n_after_kill = len(cycles)
        # restart on new ports: counters start again from zero, under a new epoch
        a2 = start_agent(tmp_path / "a2b", "--name", "n2")
        with sqlite_db.begin() as conn:
            conn.execute(
                update(Node).where(Node.name == "n2").values(agent_url=a2.state.control_url)
            )
        traffic(a2, 4, space=3)
        _wait(lambda: any("n2" in getattr(c, "up", []) for c in cycles[n_after_kill:]))
        # and the restarted agent's traffic recorded (an increase from zero, under a new epoch)
        _wait(lambda: _lookups_recorded(sqlite_db, "n2") >= (3 + 1) + (4 + 1))
        stop.set()
        loop.join(10)
        assert not loop.is_alive()
        collector.close()
    finally:
        for a in (a1, a2):
            if a.proc.poll() is None:
                a.stop()

    n1, n2 = _node_id(sqlite_db, "n1"), _node_id(sqlite_db, "n2")
    states = [r["up"] for r in _rows(sqlite_db, NodeSample, node_id=n2)]
    assert True in states and False in states
    assert states.index(False) < len(states) - 1 - states[::-1].index(True)  # down, then up
    # the loop never stopped: n1 was scraped in every cycle
    assert len(_rows(sqlite_db, NodeSample, node_id=n1)) == len(states)
    epochs = {r["agent_started_s"] for r in _rows(sqlite_db, NodeSample, node_id=n2) if r["up"]}
    assert len(epochs) == 2
    # exact totals across the restart: 3 stores + lookups before, 4 after (increase from zero)
    all_rows = _rows(sqlite_db, CacheSample, node_id=n2, tier="all")
    assert sum(r["lookups"] for r in all_rows) == (3 + 1) + (4 + 1)
    assert sum(r["hits"] for r in all_rows) == 3 + 4


def _scraped_up(engine: Engine, node: str) -> bool:
    """Whether the database holds a reading of ``node`` up (its counters' baseline)."""
    return any(r["up"] for r in _rows(engine, NodeSample, node_id=_node_id(engine, node)))


def _lookups_recorded(engine: Engine, node: str) -> int:
    """Lookups the database holds for ``node`` (its all-tiers rows)."""
    rows = _rows(engine, CacheSample, node_id=_node_id(engine, node), tier="all")
    return sum(r["lookups"] for r in rows)


def _wait(cond: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_link_probes_between_dcs(sqlite_db: Engine, two_agents: tuple[Agent, Agent]) -> None:
    a1, a2 = two_agents
    _register(sqlite_db, {"n1": ("fra", a1.state.control_url), "n2": ("ams", a2.state.control_url)})
    collector = Collector(sqlite_db, CollectorConfig(probe_bytes=256 << 10, pings=3))
    try:
        report = collector.probe_links_once()
    finally:
        collector.close()
    assert sorted(report.up) == ["n1->n2", "n2->n1"], report.down
    rows = _rows(sqlite_db, LinkSample)
    assert len(rows) == 2
    for r in rows:
        assert r["ok"] and r["rtt_s"] > 0 and r["loss_ratio"] == 0
        assert r["bandwidth_bytes_per_s"] > 0 and r["probe_bytes"] == 256 << 10


def test_link_probes_keep_their_rtt_basis(sqlite_db: Engine, tmp_path: Path) -> None:
    """n2 emulates 0.8 ms on its link to n1 (``--link n1:delay_ms=0.8``): its probe of n1, named
    by the collector, is recorded emulated with that delay; n1's probe of n2 is measured."""
    with running_agent(tmp_path / "a1", "--name", "n1", "--dc", "fra") as a1:
        target = a1.state.data_tcp
        assert target is not None
        link = ("--peer", f"n1={target}", "--link", "n1:delay_ms=0.8")
        with running_agent(tmp_path / "a2", "--name", "n2", "--dc", "ams", *link) as a2:
            _register(
                sqlite_db,
                {"n1": ("fra", a1.state.control_url), "n2": ("ams", a2.state.control_url)},
            )
            collector = Collector(sqlite_db, CollectorConfig(probe_bytes=64 << 10, pings=2))
            try:
                report = collector.probe_links_once()
            finally:
                collector.close()
    assert sorted(report.up) == ["n1->n2", "n2->n1"], report.down
    with sqlite_db.connect() as conn:
        ids = dict(conn.execute(select(Node.name, Node.id)).all())
    rows = {r["src_node_id"]: r for r in _rows(sqlite_db, LinkSample)}
    emulated, measured = rows[ids["n2"]], rows[ids["n1"]]
    assert (emulated["rtt_basis"], emulated["emulated_delay_s"]) == ("emulated", 0.0008)
    assert emulated["rtt_s"] >= 0.0008
    assert (measured["rtt_basis"], measured["emulated_delay_s"]) == ("measured", None)


def test_link_probe_to_a_dead_node_is_recorded_as_failed(sqlite_db: Engine, tmp_path: Path) -> None:
    with running_agent(tmp_path / "a1", "--name", "n1") as a1:
        dead = f"http://127.0.0.1:{closed_port()}"
        _register(sqlite_db, {"n1": ("fra", a1.state.control_url), "n9": ("ams", dead)})
        collector = Collector(sqlite_db, CollectorConfig(pings=2))
        try:
            report = collector.probe_links_once()
        finally:
            collector.close()
    assert set(report.down) == {"n1->n9", "n9->n1"}
    assert all(not r["ok"] and r["error"] for r in _rows(sqlite_db, LinkSample))


VLLM_TEXT = """# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{model_name="m"}} {prompt}
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{model_name="m"}} {prompt}
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{model_name="m"}} {hits}
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{model_name="m"}} {gen}
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="m"}} 0.25
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{le="0.1",model_name="m"}} {fast}
vllm:time_to_first_token_seconds_bucket{{le="1.0",model_name="m"}} {count}
vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {count}
vllm:time_to_first_token_seconds_count{{model_name="m"}} {count}
vllm:time_to_first_token_seconds_sum{{model_name="m"}} {ttft_sum}
"""


class _Exposition:
    """An HTTP endpoint serving Prometheus text: stands in for an inference engine, which
    needs a GPU this machine lacks; the text follows the engine's documented metrics."""

    def __init__(self) -> None:
        self.text = ""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = outer.text.encode()
                send(self, body, content_type="text/plain; version=0.0.4")

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_engine_metrics_become_interval_samples(sqlite_db: Engine, tmp_path: Path) -> None:
    engine = _Exposition()
    try:
        with running_agent(tmp_path / "a1", "--name", "n1") as a1:
            _register(
                sqlite_db,
                {"n1": ("fra", a1.state.control_url)},
                n1={"engine_url": engine.url},
            )
            collector = Collector(sqlite_db, CollectorConfig())
            try:
                values = {"prompt": 1000, "hits": 400, "gen": 50, "fast": 8, "count": 10}
                engine.text = VLLM_TEXT.format(**values, ttft_sum=1.5)
                collector.collect_once()
                values = {"prompt": 1600, "hits": 700, "gen": 90, "fast": 9, "count": 20}
                engine.text = VLLM_TEXT.format(**values, ttft_sum=6.0)
                collector.collect_once()
                engine.text = "# only process metrics\nprocess_cpu_seconds_total 1.0\n"
                unknown = collector.collect_once()
            finally:
                collector.close()
    finally:
        engine.close()
    rows = _rows(sqlite_db, EngineSample)
    assert len(rows) == 2  # the unknown exposition is skipped, not stored
    assert any(
        "no vLLM, SGLang, TensorRT-LLM, LMCache or KVBM metrics" in w for w in unknown.warnings
    )
    base, r = rows
    assert base["engine"] == "vllm" and base["prompt_tokens"] == 0 and base["ttft_p50_s"] is None
    assert r["prompt_tokens"] == 600 and r["cached_prompt_tokens"] == 300
    assert r["generation_tokens"] == 40 and r["ttft_count"] == 10
    assert r["ttft_sum_s"] == pytest.approx(4.5)
    # of the interval's 10 requests, 1 was under 0.1 s: the median lies in (0.1, 1.0]
    assert 0.1 < r["ttft_p50_s"] <= 1.0
    assert r["kv_usage_ratio"] == 0.25


def test_kvbm_and_trtllm_block_counters_become_interval_samples(
    sqlite_db: Engine, tmp_path: Path
) -> None:
    """Dynamo KVBM's exposition on n1, trtllm-serve's JSON iteration stats on n2: their
    counters' increases per interval (a restart counted from zero, an idle JSON scrape
    unknown), summed as they are by the hourly rollup."""
    from kvctl.db.models import ROLLUPS
    from kvctl.db.rollup import HOUR_MS, rollup_all
    from tests.unit.test_engine_metrics_nvidia import KVBM, KVBM_1, trtllm_iterations

    kvbm, trtllm = _Exposition(), _Exposition()
    kvbm_scrapes = [
        KVBM_1,
        {"matched": 90112, "d2h": 2304, "h2d_off": 700, "d2d_off": 4, "h2d_on": 1300, "d2d_on": 86},
        {"matched": 512, "d2h": 16, "h2d_off": 2, "d2d_off": 0, "h2d_on": 9, "d2d_on": 1},
    ]
    trtllm_scrapes = [
        trtllm_iterations((150, 4, 3121, 3)),
        "[]",
        trtllm_iterations((151, 40, 3200, 9), (152, 100, 3300, 12)),
    ]
    clock = iter(1_700_000_000.0 + 10 * i for i in range(3))
    try:
        with (
            running_agent(tmp_path / "a1", "--name", "n1") as a1,
            running_agent(tmp_path / "a2", "--name", "n2") as a2,
        ):
            _register(
                sqlite_db,
                {"n1": ("fra", a1.state.control_url), "n2": ("fra", a2.state.control_url)},
                n1={"engine_url": kvbm.url},
                n2={"engine_url": trtllm.url},
            )
            collector = Collector(sqlite_db, CollectorConfig(), clock=lambda: next(clock))
            try:
                for values, text in zip(kvbm_scrapes, trtllm_scrapes, strict=True):
                    kvbm.text, trtllm.text = KVBM.format(**values), text
                    report = collector.collect_once()
                    assert not report.warnings, report.warnings
            finally:
                collector.close()
    finally:
        kvbm.close()
        trtllm.close()
    n1 = _rows(sqlite_db, EngineSample, node_id=_node_id(sqlite_db, "n1"))
    assert [r["engine"] for r in n1] == ["kvbm"] * 3
    assert [r["kvbm_matched_tokens"] for r in n1] == [0, 8192, 512]
    assert [r["kvbm_offload_disk_blocks"] for r in n1] == [0, 64, 2]
    assert [r["kvbm_onboard_host_blocks"] for r in n1] == [0, 100, 9]
    assert all(r["prompt_tokens"] is None and r["kv_reused_blocks"] is None for r in n1)
    n2 = _rows(sqlite_db, EngineSample, node_id=_node_id(sqlite_db, "n2"))
    assert [r["engine"] for r in n2] == ["trtllm"] * 3
    assert [r["kv_reused_blocks"] for r in n2] == [0, None, 96]
    assert [r["kv_missed_blocks"] for r in n2] == [0, None, 179]
    assert n2[2]["kv_usage_ratio"] == 12 / 101256
    rollup_all(sqlite_db.begin, 1_700_000_000_000 + 2 * HOUR_MS)
    with sqlite_db.connect() as conn:
        hourly = {r.node_id: r for r in conn.execute(select(ROLLUPS["engine_sample", "1h"]))}
    assert hourly[_node_id(sqlite_db, "n1")].kvbm_matched_tokens == 8704
    assert hourly[_node_id(sqlite_db, "n2")].kv_reused_blocks == 96


def _metrics_after_one_cycle(db: Engine) -> str:
    """The collector's own /metrics text after one scrape of the inventory."""
    collector = Collector(db, CollectorConfig())
    server, port = collector.metrics.serve("127.0.0.1", 0)
    try:
        collector.collect_once()
        return httpx.get(f"http://127.0.0.1:{port}/metrics").text
    finally:
        server.shutdown()
        collector.close()


def test_collector_serves_its_own_metrics(sqlite_db: Engine, tmp_path: Path) -> None:
    with running_agent(tmp_path / "a1", "--name", "n1") as a1:
        _register(sqlite_db, {"n1": ("fra", a1.state.control_url)})
        text = _metrics_after_one_cycle(sqlite_db)
    assert 'kvctl_collector_rows_written_total{table="cache_sample"}' in text
    assert "kvctl_collector_scrape_duration_seconds_bucket" in text
    assert 'kvctl_collector_nodes{state="up"} 1.0' in text


def test_collector_metrics_count_starting_nodes_apart(sqlite_db: Engine) -> None:
    """A node answering "starting" is counted as such in kvctl_collector_nodes, neither down
    nor token refused (it answered; its tiers are still opening)."""
    with starting_url() as url:
        _register(sqlite_db, {"n1": ("fra", url)})
        text = _metrics_after_one_cycle(sqlite_db)
    assert 'kvctl_collector_nodes{state="starting"} 1.0' in text
    for state in ("up", "down", "token_refused"):
        assert f'kvctl_collector_nodes{{state="{state}"}} 0.0' in text


def test_several_collectors_write_one_postgresql(
    pg_url: str, two_agents: tuple[Agent, Agent]
) -> None:
    a1, a2 = two_agents
    db = open_db(pg_url, auto_upgrade=True)
    try:
        _register(db, {"n1": ("fra", a1.state.control_url), "n2": ("ams", a2.state.control_url)})
        collectors = [Collector(db, CollectorConfig(dc=dc)) for dc in ("fra", "ams")]
        errors: list[BaseException] = []

        def work(c: Collector) -> None:
            try:
                for _ in range(5):
                    assert c.collect_once().written
                    c.maintain()
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(c,)) for c in collectors]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for c in collectors:
            c.close()
        assert errors == []
        for name in ("n1", "n2"):
            samples = _rows(db, NodeSample, node_id=_node_id(db, name))
            assert len(samples) == 5 and all(s["up"] for s in samples)
    finally:
        db.dispose()


def test_collect_once_cli(sqlite_url: str, tmp_path: Path) -> None:
    db = open_db(sqlite_url)
    with running_agent(tmp_path / "a1", "--name", "n1") as a1:
        dead = f"http://127.0.0.1:{closed_port()}"
        _register(db, {"n1": ("fra", a1.state.control_url), "n2": ("ams", dead)})
        db.dispose()
        result = CliRunner().invoke(app, ["collect", "--once", "--json", "--db", sqlite_url])
        assert result.exit_code == 1, result.output  # a node is down
        out = json.loads(result.stdout)
        assert out["scrape"]["up"] == ["n1"] and "n2" in out["scrape"]["down"]
        assert out["scrape"]["rows"]["node_sample"] == 2
        assert out["links"]["down"]  # n1 <-> n2 cannot be probed while n2 is down

        env = {**os.environ, "KVCTL_DB_URL": sqlite_url}
        proc = subprocess.run(
            [sys.executable, "-m", "kvctl", "collect", "--once", "--no-links"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    assert proc.returncode == 1, proc.stderr
    assert "n1" in proc.stdout and "down" in proc.stdout and "rows written" in proc.stdout


def test_collect_with_an_empty_inventory_says_what_to_do(sqlite_url: str) -> None:
    from kvctl.db.migrate import open_db

    open_db(sqlite_url).dispose()  # an inventory with no nodes (a missing one is its own error)
    result = CliRunner().invoke(app, ["collect", "--once", "--db", sqlite_url])
    assert result.exit_code == 2
    assert "no nodes" in result.output and "kvctl fleet add-node" in result.output


def test_a_refused_batch_is_kept_and_written_later(pg_url: str, tmp_path: Path) -> None:
    """The database refuses writes for a while (a table lock held elsewhere, with a short lock
    timeout for the collector): nothing is lost, the rows land on the next cycle."""
    from sqlalchemy import create_engine, text

    from kvctl.db.engine import resolve_url

    open_db(pg_url, auto_upgrade=True).dispose()
    db = create_engine(resolve_url(pg_url), connect_args={"options": "-c lock_timeout=300"})
    blocker = create_engine(resolve_url(pg_url))
    try:
        with running_agent(tmp_path / "a1", "--name", "n1") as a1:
            _register(db, {"n1": ("fra", a1.state.control_url)})
            collector = Collector(db, CollectorConfig())
            try:
                collector.collect_once()
                with blocker.connect() as lock_conn:
                    lock_conn.execute(text("LOCK TABLE cache_sample IN ACCESS EXCLUSIVE MODE"))
                    traffic(a1, 2, space=5)
                    refused = collector.collect_once()
                    lock_conn.rollback()
                assert not refused.written and any("retry" in w for w in refused.warnings)
                ok = collector.collect_once()
            finally:
                collector.close()
        assert ok.written and ok.rows["node_sample"] == 2  # the refused cycle's and its own
        n1 = _node_id(db, "n1")
        assert len(_rows(db, NodeSample, node_id=n1)) == 3
        assert sum(r["hits"] for r in _rows(db, CacheSample, node_id=n1, tier="all")) == 2
    finally:
        db.dispose()
        blocker.dispose()


def test_collect_runs_and_serves_its_metrics_until_stopped(sqlite_url: str, tmp_path: Path) -> None:
    """The long-running `kvctl collect` (not --once) scrapes on its interval, serves its own
    /metrics where --metrics-listen says, and stops cleanly on SIGTERM."""
    import re
    import signal

    db = open_db(sqlite_url)
    with running_agent(tmp_path / "a1", "--name", "n1") as a1:
        _register(db, {"n1": ("fra", a1.state.control_url)})
        db.dispose()
        env = {**os.environ, "KVCTL_DB_URL": sqlite_url}
        argv = ["collect", "--interval", "0.5", "--no-links", "--metrics-listen", "127.0.0.1:0"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()
            found = re.search(r"collector metrics on (http://\S+/metrics)", line)
            assert found, line + proc.stderr.read(2000)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                text = httpx.get(found.group(1), timeout=5).text
                if re.search(r"^kvctl_collector_\w+_total\S* [1-9]", text, re.M):
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"no scrape counted on /metrics:\n{text[:2000]}")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    assert proc.returncode == 0


def test_the_loop_with_links_off_probes_none(
    sqlite_db: Engine, two_agents: tuple[Agent, Agent]
) -> None:
    """`kvctl collect --no-links` (an infinite link interval) probes no link, not even once as
    the loop starts: a review's collector, restarted with --no-links, sent each pair of DCs a
    probe (pings and 1 MiB each way) at every start."""
    a1, a2 = two_agents
    _register(sqlite_db, {"n1": ("fra", a1.state.control_url), "n2": ("ams", a2.state.control_url)})
    collector = Collector(sqlite_db, CollectorConfig(interval_s=0.2, link_interval_s=math.inf))
    kinds: list[str] = []
    stop = threading.Event()

    def on_cycle(kind: str, report: object) -> None:
        kinds.append(kind)
        if kinds.count("scrape") == 2:
            stop.set()  # the loop ends after this cycle's links and maintenance

    try:
        collector.run(stop, on_cycle=on_cycle)
    finally:
        collector.close()
    assert kinds.count("scrape") == 2 and "links" not in kinds, kinds
    assert _rows(sqlite_db, LinkSample) == []


def test_a_database_that_goes_away_does_not_end_the_loop(pg_url: str, tmp_path: Path) -> None:
    """The database refuses every connection for a while (as when it restarts): the cycles in
    between say so and keep their rows; none raises, and the increases land once it is back."""
    from sqlalchemy import create_engine, text

    from kvctl.db.engine import resolve_url

    name = pg_url.rsplit("/", 1)[1]
    db = open_db(pg_url, auto_upgrade=True)
    admin = create_engine(resolve_url(pg_url).rsplit("/", 1)[0] + "/postgres",
                          isolation_level="AUTOCOMMIT")  # fmt: skip

    def allow(yes: bool) -> None:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(yes).lower()}'))
            if not yes:
                conn.execute(
                    text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                         "WHERE datname = :n AND pid <> pg_backend_pid()"),
                    {"n": name},
                )  # fmt: skip

    try:
        with running_agent(tmp_path / "a1", "--name", "n1", "--dc", "fra") as a1, \
                running_agent(tmp_path / "a2", "--name", "n2", "--dc", "ams") as a2:  # fmt: skip
            _register(
                db, {"n1": ("fra", a1.state.control_url), "n2": ("ams", a2.state.control_url)}
            )
            collector = Collector(db, CollectorConfig(pings=1))
            try:
                collector.collect_once()
                allow(False)
                traffic(a1, 3, space=7)
                away = [collector.collect_once(), collector.probe_links_once()]
                allow(True)
                back = collector.collect_once()
            finally:
                collector.close()
        for report in away:
            assert not report.written
            assert any("database unavailable" in w for w in report.warnings), report.warnings
        assert sorted(away[0].up) == ["n1", "n2"]  # scraped the nodes it read before
        assert back.written
        n1 = _node_id(db, "n1")
        assert len(_rows(db, NodeSample, node_id=n1)) == 3  # none of the cycles lost
        assert sum(r["hits"] for r in _rows(db, CacheSample, node_id=n1, tier="all")) == 3
    finally:
        allow(True)
        admin.dispose()
        db.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_two_collectors_on_the_same_nodes_count_each_increase_once(
    backend: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two collectors scrape one node by mistake (no --dc, or DCs that overlap): each save is
    checked against the state the other saved, so the hits in the database are the agent's,
    not twice them; the one whose save lost counts its cycle again from the other's state,
    writes it, and says why."""
    url = request.getfixturevalue("pg_url" if backend == "postgresql" else "sqlite_url")
    db = open_db(url, auto_upgrade=True)
    try:
        with running_agent(tmp_path / "a1", "--name", "n1") as a1:
            _register(db, {"n1": ("fra", a1.state.control_url)})
            c1, c2 = Collector(db, CollectorConfig()), Collector(db, CollectorConfig())
            try:
                assert c1.collect_once().written  # the baseline
                time.sleep(0.01)  # each save is stamped by its own millisecond
                assert c2.collect_once().written
                traffic(a1, 3, space=11)
                rebased = c1.collect_once()  # refused: counted from c2's state again, +3
                assert rebased.written
                assert any("another collector" in w for w in rebased.warnings), rebased.warnings
                assert c1.collect_once().written
                traffic(a1, 2, space=12)
                time.sleep(0.01)
                assert c2.collect_once().written  # +2, counted again from c1's state
                assert c2.collect_once().written
            finally:
                c1.close()
                c2.close()
        n1 = _node_id(db, "n1")
        assert sum(r["hits"] for r in _rows(db, CacheSample, node_id=n1, tier="all")) == 5
    finally:
        db.dispose()


def test_collect_once_says_so_when_upkeep_fails(
    pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The samples are written but the upkeep cannot run (a rollup table locked elsewhere):
    one warning and exit 1, not a traceback."""
    from sqlalchemy import create_engine, text

    from kvctl.db import engine as engine_module
    from kvctl.db.engine import resolve_url

    monkeypatch.setattr(engine_module, "PG_LOCK_TIMEOUT_MS", 300)
    db = open_db(pg_url, auto_upgrade=True)
    blocker = create_engine(resolve_url(pg_url))
    try:
        with running_agent(tmp_path / "a1", "--name", "n1") as a1:
            _register(db, {"n1": ("fra", a1.state.control_url)})
            with blocker.connect() as lock_conn:
                lock_conn.execute(text("LOCK TABLE node_1m IN ACCESS EXCLUSIVE MODE"))
                args = ["collect", "--once", "--no-links", "--db", pg_url]
                result = CliRunner().invoke(app, args)
                as_json = CliRunner().invoke(app, [*args, "--json"])
                lock_conn.rollback()
        assert result.exit_code == 1, result.output
        assert "rollup/retention failed" in result.output and "Traceback" not in result.output
        assert as_json.exit_code == 1
        out = json.loads(as_json.stdout)
        assert "lock timeout" in out["maintenance"]["error"]
        assert out["scrape"]["rows"]["node_sample"] == 1  # the samples went in all the same
    finally:
        blocker.dispose()
        db.dispose()
