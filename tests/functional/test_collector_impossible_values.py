"""Agents answering figures that cannot be true (NaN, Infinity, a negative counter, a ratio of
3.5, a count past BIGINT, a counter going back), on a real SQLite and PostgreSQL: the
collector keeps running, stores those fields as unknown (NULL, never 0 and never NaN), keeps
every other figure, counts increases exactly across the bad scrape, and says per node which
fields it rejected; rollups and the dashboard's fleet figures stay finite.

The agents are stand-ins (a loopback HTTP server answering /v1/stats, /v1/gpus, /v1/info and
/v1/probe): a real agent never says NaN, and one on another host, buggy, old or hostile, can.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from collectors.collector import Collector, CollectorConfig
from kvctl.cli.main import app
from kvctl.db.analytics.counts import Assumptions
from kvctl.db.analytics.overview import overview
from kvctl.db.analytics.summary import fleet_summary
from kvctl.db.analytics.windows import Window
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import Node
from kvctl.db.rollup import HOUR_MS, Retention, maintain
from kvctl.profiles import MODELS
from tests.not_an_agent import send

pytestmark = pytest.mark.slow

#: a minute boundary: the scrapes are 10 s apart within one minute, rolled up two hours later
T0_S = 1_800_000_000.0
STARTED_S = 1_799_990_000.0


def _tier(**over: int) -> dict[str, Any]:
    counters = {
        "hits": 0,
        "hit_tokens": 0,
        "reuse_hits": 0,
        "sharing_hits": 0,
        "puts": 0,
        "bytes_written": 0,
        "bytes_read": 0,
        "promotions": 0,
        "demotions": 0,
    }
    return {**counters, **over, "evictions": {"capacity": 0, "flush": 0}}


def _stats(lookups: int, hits: int, recompute_s: float) -> dict[str, Any]:
    """A sound /v1/stats: ``lookups`` chunks looked up, ``hits`` of them found in cpu."""
    return {
        "stats": {
            "lookups": lookups,
            "lookup_chunks": lookups,
            "lookup_tokens": lookups * 256,
            "hit_chunks": hits,
            "hit_tokens": hits * 256,
            "reuse_hits": 0,
            "sharing_hits": hits,
            "hit_ratio": hits / lookups if lookups else None,
            "drops": 0,
            "tiers": {
                "cpu": _tier(hits=hits, hit_tokens=hits * 256, sharing_hits=hits, bytes_read=hits),
                "disk": _tier(),
            },
        },
        "usage": {
            "cpu": {"capacity_bytes": 1 << 30, "used_bytes": 4096, "pinned_bytes": 0, "chunks": 1},
            "disk": {"capacity_bytes": 1 << 33, "used_bytes": 0, "pinned_bytes": 0, "chunks": 0},
        },
        "started_s": STARTED_S,
        "fetch_plans": {
            "prefill": {"kind": "modeled", "inputs": {"model": "llama-3.1-8b", "gpu": "h100"}},
            "plans": {
                "recompute_s": recompute_s,
                "fetch_s": 0.0,
                "fetch_chunks": hits,
                "recompute_chunks": 0,
            },
        },
    }


def _gpus(power_w: Any, energy_j: Any, utilization: Any, memory: Any) -> dict[str, Any]:
    reading = {
        "index": 0,
        "power_w": power_w,
        "energy_j": energy_j,
        "utilization_ratio": utilization,
        "memory_used_bytes": memory,
        "memory_total_bytes": 80 << 30,
    }
    return {"nvml": {"available": True}, "gpus": [reading]}


class StandIn:
    """An agent's control API answering what the test sets, NaN and Infinity included (as
    Python's json writes them, and reads them back); a text answer is sent as is (an engine's
    /metrics beside the agent)."""

    def __init__(self, name: str) -> None:
        self.answers: dict[str, Any] = {
            "/v1/stats": _stats(0, 0, 0.0),
            "/v1/gpus": _gpus(300.0, 1000.0, 0.5, 1 << 30),
            "/v1/info": {"name": name, "dataplane": {"tcp": "127.0.0.1:9"}},
            "/v1/probe": {
                "ok": True,
                "rtt_s": math.nan,
                "bandwidth_bytes_per_s": -1.0,
                "loss_ratio": 3.5,
                "error": None,
            },
        }
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                if self.command == "POST":
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                answer = outer.answers[self.path]
                # text (an engine's /metrics) as is; the rest as JSON
                text = isinstance(answer, str)
                body = (answer if text else json.dumps(answer)).encode()
                send(self, body, content_type="text/plain" if text else "application/json")

            do_GET = do_POST = _answer

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _rows(db: Engine, table: str, node_id: int, key: str = "node_id") -> list[dict[str, Any]]:
    with db.connect() as conn:
        q = text(f"SELECT * FROM {table} WHERE {key} = :n ORDER BY ts_ms")
        return [dict(r._mapping) for r in conn.execute(q, {"n": node_id})]


def _finite(value: Any, where: str = "") -> None:
    """Every number in ``value`` (a row, a figure's as_dict) is finite."""
    if isinstance(value, dict):
        for k, v in value.items():
            _finite(v, f"{where}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _finite(v, f"{where}[{i}]")
    elif isinstance(value, float):
        assert math.isfinite(value), where


def test_impossible_figures_are_rejected_by_field_and_the_rest_kept(
    db: Engine, stand_ins: tuple[StandIn, StandIn], caplog: pytest.LogCaptureFixture
) -> None:
    n1, n2 = stand_ins
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_dc(conn, "ams", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=n1.url, gpu_model="H100")
        add_node(conn, "n2", dc="ams", agent_url=n2.url, gpu_model="H100")
    with db.connect() as conn:
        ids = dict(conn.execute(select(Node.name, Node.id)).all())
    now = [T0_S]
    collector = Collector(db, CollectorConfig(interval_s=5.0), clock=lambda: now[0])
    try:
        # 1: sound (the counters' baseline)
        n1.answers["/v1/stats"] = _stats(10, 4, 1.0)
        assert collector.collect_once().rejected == {}

        # 2: n1 answers the impossible in nearly every field the collector reads
        hostile = _stats(20, 9, 2.0)
        hostile["stats"]["lookup_tokens"] = math.nan
        hostile["stats"]["hit_tokens"] = math.inf
        hostile["stats"]["drops"] = -1
        hostile["stats"]["lookup_chunks"] = 1e300
        hostile["usage"]["cpu"]["used_bytes"] = math.nan
        hostile["started_s"] = math.nan
        hostile["fetch_plans"]["plans"]["recompute_s"] = -math.inf
        n1.answers["/v1/stats"] = hostile
        n1.answers["/v1/gpus"] = _gpus(math.nan, math.inf, 3.5, -1)
        now[0] += 10
        with caplog.at_level(logging.WARNING, logger="kvctl.collect"):
            bad = collector.collect_once()
        links = collector.probe_links_once()

        # 3: sound again: counters moved on from scrape 1, GPU energy by 100 J
        n1.answers["/v1/stats"] = _stats(30, 12, 3.5)
        n1.answers["/v1/gpus"] = _gpus(310.0, 1100.0, 0.6, 1 << 30)
        now[0] += 10
        good = collector.collect_once()

        # 4: a counter went back (the agent restarted under the same start time): a restart,
        # counted from zero as before, not a rejection
        back = _stats(35, 2, 3.5)
        n1.answers["/v1/stats"] = back
        now[0] += 10
        restarted = collector.collect_once()
    finally:
        collector.close()

    assert bad.written and sorted(bad.up) == ["n1", "n2"] and not bad.down
    fields = bad.as_dict()["rejected"]["n1"]["fields"]
    assert fields == {
        "stats.lookup_chunks": "beyond BIGINT",
        "stats.lookup_tokens": "not finite",
        "stats.hit_tokens": "not finite",
        "stats.drops": "negative",
        "usage.cpu.used_bytes": "not finite",
        "started_s": "not finite",
        "fetch_plans.plans.recompute_s": "not finite",
        "gpus[0].power_w": "not finite",
        "gpus[0].energy_j": "not finite",
        "gpus[0].memory_used_bytes": "negative",
        "gpus[0].utilization_ratio": "above 1",
    }
    assert bad.as_dict()["rejected"]["n1"]["count"] == 11 and "n2" not in bad.rejected
    assert any(w.startswith("n1: 11 value(s) rejected") for w in bad.warnings)
    assert good.rejected == {} and restarted.rejected == {}
    # the log names the node and the fields, never the values
    (logged,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("n1:")]
    assert logged.startswith("n1: 11 value(s) rejected") and "stats.lookup_chunks" in logged
    assert "nan" not in logged.lower().replace("not finite", "") and "1e+300" not in logged
    # both probes answered NaN, -1 and 3.5: the links are up, their figures unknown
    assert sorted(links.up) == ["n1->n2", "n2->n1"]
    assert links.rejected["n1->n2"] == {
        "probe.rtt_s": "not finite",
        "probe.bandwidth_bytes_per_s": "negative",
        "probe.loss_ratio": "above 1",
    }
    for link in _rows(db, "link_sample", ids["n1"], key="src_node_id"):
        assert (link["rtt_s"], link["bandwidth_bytes_per_s"], link["loss_ratio"]) == (None,) * 3

    t1, t2, t3, t4 = (int((T0_S + 10 * i) * 1000) for i in range(4))
    node = {r["ts_ms"]: r for r in _rows(db, "node_sample", ids["n1"])}
    assert node[t2]["up"] and node[t2]["agent_started_s"] is None
    assert node[t3]["agent_started_s"] == STARTED_S

    power = {r["ts_ms"]: r for r in _rows(db, "power_sample", ids["n1"])}
    unknown = {k: power[t2][k] for k in ("power_w", "energy_j", "utilization_ratio")}
    assert unknown == {"power_w": None, "energy_j": None, "utilization_ratio": None}
    assert power[t2]["memory_used_bytes"] is None and power[t2]["memory_total_bytes"] == 80 << 30
    # the energy the bad reading hid is counted at the next reading: none lost, none invented
    assert power[t3]["energy_j"] == pytest.approx(100.0) and power[t3]["power_w"] == 310.0

    cache = _rows(db, "cache_sample", ids["n1"])
    total = {r["ts_ms"]: r for r in cache if r["tier"] == "all"}
    cpu = {r["ts_ms"]: r for r in cache if r["tier"] == "cpu"}
    # the cpu tier's bytes in use were NaN: no row says 0 bytes; its counters and the node's
    # total wait for the next scrape, which counts them exactly from scrape 1
    assert t2 not in total and t2 not in cpu
    assert [r["tier"] for r in cache if r["ts_ms"] == t2] == ["disk"]
    assert (total[t3]["lookups"], total[t3]["lookup_tokens"]) == (20, 20 * 256)
    assert (total[t3]["hits"], total[t3]["hit_tokens"], cpu[t3]["hits"]) == (8, 8 * 256, 8)
    assert total[t3]["evictions"] == 0 and total[t3]["used_bytes"] == 4096
    # the counter that went back: counted from zero, as a restart always was
    assert (total[t4]["hits"], total[t4]["lookups"]) == (2, 5)

    plan = {r["ts_ms"]: r for r in _rows(db, "plan_sample", ids["n1"])}
    assert plan[t2]["recompute_s"] is None and plan[t2]["saved_s"] is None
    # the plan's counters wait with recompute_s (saved_s is taken from the pair), and catch up
    assert plan[t2]["fetch_s"] is None and plan[t2]["fetch_chunks"] is None
    assert plan[t3]["fetch_s"] == 0.0 and plan[t3]["fetch_chunks"] == 12 - 4
    assert plan[t3]["recompute_s"] == pytest.approx(2.5)  # 3.5 - 1.0, across the bad one

    # nothing impossible reached the database, on either backend
    for table in ("node_sample", "cache_sample", "power_sample", "plan_sample"):
        for row in _rows(db, table, ids["n1"]):
            _finite(row, table)
            counts = [v for k, v in row.items() if isinstance(v, int) and not isinstance(v, bool)]
            assert all(v >= 0 for v in counts), row

    # rolled up and read as the dashboard does: every fleet figure finite
    maintain(db, int(T0_S * 1000) + 2 * HOUR_MS, Retention())
    win = Window("1h", t1 - 60_000, t1 + HOUR_MS, 60_000)
    with db.connect() as conn:
        summary = fleet_summary(conn, win.start_ms, win.end_ms)
        ov = overview(conn, win, Assumptions(MODELS["llama-3.1-8b"], default_gpu="h100", mfu=0.5))
    fleet = summary.total
    # n1's lookups counted exactly: 20 by scrape 3, 5 more by scrape 4 (n2's stayed at 0)
    assert (fleet.lookups, fleet.hits) == (25, 8 + 2) and fleet.energy_j == pytest.approx(100.0)
    # the NaN reading is no reading: n1's mean is over 300, 310 and 310; n2 read 300 throughout
    assert fleet.power_w == pytest.approx((300 + 310 + 310) / 3 + 300)
    _finite(ov.as_dict(), "overview")
    _finite({k: getattr(fleet, k) for k in ("used_bytes", "capacity_bytes", "energy_j", "power_w")})


def test_a_sound_fleet_rejects_nothing(db: Engine, stand_ins: tuple[StandIn, StandIn]) -> None:
    n1, _n2 = stand_ins
    n1.answers["/v1/stats"] = copy.deepcopy(_stats(3, 1, 0.5))
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=n1.url)
    collector = Collector(db, CollectorConfig(interval_s=5.0))
    try:
        report = collector.collect_once()
    finally:
        collector.close()
    assert report.as_dict()["rejected"] == {} and report.warnings == []


def test_collect_once_says_which_fields_it_rejected(
    sqlite_url: str, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """`kvctl collect --once`: the rejections in --json (per node: a count and each field with
    why) and as a warning line naming the node and fields, not the values."""
    n1, _n2 = stand_ins
    n1.answers["/v1/gpus"] = _gpus(math.nan, 1e300, 3.5, 100)
    db = open_db(sqlite_url, auto_upgrade=True)
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=n1.url)
    db.dispose()
    args = ["collect", "--once", "--no-links", "--db", sqlite_url]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    rejected = json.loads(result.stdout)["scrape"]["rejected"]
    assert rejected == {
        "n1": {
            "count": 3,
            "fields": {
                "gpus[0].power_w": "not finite",
                "gpus[0].energy_j": "beyond BIGINT",
                "gpus[0].utilization_ratio": "above 1",
            },
        }
    }
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "n1: 3 value(s) rejected as impossible" in result.output
    assert "gpus[0].power_w (not finite)" in result.output and "1e+300" not in result.output


def test_a_refused_cycle_says_why_before_what_it_rejected(
    pg_url: str, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """The loop's line shows a cycle's first warning as why it was not written: that stays
    the database's refusal, with the rejections after it (a table lock held elsewhere, a short
    lock timeout for the collector)."""
    from sqlalchemy import create_engine

    from kvctl.db.engine import resolve_url

    n1, _n2 = stand_ins
    n1.answers["/v1/gpus"] = _gpus(math.nan, 1000.0, 0.5, 100)
    open_db(pg_url, auto_upgrade=True).dispose()
    db = create_engine(resolve_url(pg_url), connect_args={"options": "-c lock_timeout=300"})
    blocker = create_engine(resolve_url(pg_url))
    try:
        with db.begin() as conn:
            add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
            add_node(conn, "n1", dc="fra", agent_url=n1.url)
        collector = Collector(db, CollectorConfig(interval_s=5.0))
        try:
            with blocker.connect() as lock_conn:
                lock_conn.execute(text("LOCK TABLE power_sample IN ACCESS EXCLUSIVE MODE"))
                refused = collector.collect_once()
                lock_conn.rollback()
        finally:
            collector.close()
    finally:
        db.dispose()
        blocker.dispose()
    assert not refused.written and "retry" in refused.warnings[0]
    assert refused.warnings[1].startswith("n1: 1 value(s) rejected")
    assert refused.rejected == {"n1": {"gpus[0].power_w": "not finite"}}


def test_a_probe_error_that_is_not_text_does_not_hold_the_batch(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """A probe answering an ``error`` object: both databases refused it, and with it every
    later batch (kept for retry). Now the error is rejected, the link row written as failed."""
    n1, n2 = stand_ins
    for s in (n1, n2):
        s.answers["/v1/probe"] = {"ok": False, "rtt_s": 0.001, "error": {"nested": [1, 2]}}
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_dc(conn, "ams", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=n1.url)
        add_node(conn, "n2", dc="ams", agent_url=n2.url)
    collector = Collector(db, CollectorConfig(interval_s=5.0))
    try:
        links = collector.probe_links_once()
        after = collector.collect_once()
    finally:
        collector.close()
    assert links.written and after.written, (links.warnings, after.warnings)
    assert links.rejected["n1->n2"] == {"probe.error": "not text"}
    assert sorted(links.down) == ["n1->n2", "n2->n1"]
    with db.connect() as conn:
        rows = conn.execute(text("SELECT ok, error, rtt_s FROM link_sample")).all()
    assert sorted(rows) == [(False, None, 0.001)] * 2


def test_an_info_of_another_shape_fails_that_link_not_the_round(
    db: Engine, stand_ins: tuple[StandIn, StandIn]
) -> None:
    """n2's /v1/info says ``"dataplane": 5``: the probes of n2 fail, the round goes on (the
    AttributeError ended probe_links_once, and with it `kvctl collect`'s loop)."""
    n1, n2 = stand_ins
    n2.answers["/v1/info"] = {"name": "n2", "dataplane": 5}
    for s in (n1, n2):
        s.answers["/v1/probe"] = {"ok": True, "rtt_s": 0.001, "loss_ratio": 0.0}
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_dc(conn, "ams", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url=n1.url)
        add_node(conn, "n2", dc="ams", agent_url=n2.url)
    collector = Collector(db, CollectorConfig(interval_s=5.0))
    try:
        links = collector.probe_links_once()
    finally:
        collector.close()
    assert links.written
    assert "no TCP data plane" in links.down["n1->n2"] and links.up == ["n2->n1"]
