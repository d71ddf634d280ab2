"""Reuse vs sharing per tier, on a real SQLite and PostgreSQL: each tier's reuse and sharing hit
ratios (the hits that tier served per lookup of the node, DC or fleet) in the read model, the
dashboard's fleet page, `kvctl status --window` (its table and --json) and `kvctl top --json`'s
recorded figures, each equal to the raw rows' sums over the window and to figures worked out
by hand; the tiers add up to the whole's hit ratio; N/A (null) where there were no lookups.

The history has the pool tier (``remote``) serving mostly sharing hits and the gpu tier mostly
reuse, as a manager would want to see it. No agent runs (test_collector.py checks the figures
against an agent's own counters)."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from dashboard.app import create_app, render
from kvctl.cli.main import app as cli
from kvctl.db.analytics.counts import Assumptions, Counts
from kvctl.db.analytics.overview import overview
from kvctl.db.analytics.windows import Window, window_for
from kvctl.db.ingest import insert_rows
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.models import raw_table
from kvctl.db.rollup import MINUTE_MS, rollup_all
from kvctl.format import percent
from kvctl.profiles import DEFAULT_GPU, DEFAULT_MFU, DEFAULT_MODEL, MODELS
from tests.functional.agents import closed_port
from tests.functional.test_dashboard_app import by_id, text_of, walk

runner = CliRunner()
ASSUME = Assumptions(MODELS[DEFAULT_MODEL], DEFAULT_GPU, DEFAULT_MFU)
NODES = {"fra-a": "fra", "fra-b": "fra", "ams-a": "ams", "lis-a": "lis"}
# (node, minutes before now, tier, lookups, hits, reuse hits, sharing hits); a node's tiers'
# hits add up to its 'all' row's, each split into reuse + sharing
ROWS = [
    ("fra-a", 5, "all", 100, 60, 40, 20),
    ("fra-a", 5, "gpu", 0, 30, 28, 2),
    ("fra-a", 5, "cpu", 0, 20, 10, 10),
    ("fra-a", 5, "remote", 0, 10, 2, 8),
    ("fra-a", 3, "all", 50, 20, 10, 10),
    ("fra-a", 3, "cpu", 0, 10, 8, 2),
    ("fra-a", 3, "remote", 0, 10, 2, 8),
    ("fra-b", 4, "all", 50, 30, 5, 25),
    ("fra-b", 4, "disk", 0, 10, 5, 5),
    ("fra-b", 4, "remote", 0, 20, 0, 20),
    ("ams-a", 6, "all", 200, 50, 35, 15),
    ("ams-a", 6, "gpu", 0, 40, 35, 5),
    ("ams-a", 6, "remote", 0, 10, 0, 10),
    # lis-a: up and idle, no lookups: every ratio of it (and of lis) is N/A, not 0
    ("lis-a", 5, "all", 0, 0, 0, 0),
    ("lis-a", 5, "cpu", 0, 0, 0, 0),
    # before the 15-minute window: counts nowhere
    ("fra-a", 30, "all", 9_000, 9_000, 0, 9_000),
    ("fra-a", 30, "remote", 0, 9_000, 0, 9_000),
]
TIERS = ["gpu", "cpu", "disk", "remote"]


def fill(db: Engine, now_ms: int) -> None:
    with db.begin() as conn:
        for dc in sorted(set(NODES.values())):
            add_dc(conn, dc)
        ids = {
            name: add_node(conn, name, dc=dc, agent_url=f"http://127.0.0.1:{closed_port()}")
            for name, dc in NODES.items()
        }
        cache, up = [], []
        for name, minutes, tier, lookups, hits, reuse, sharing in ROWS:
            ts = now_ms - minutes * MINUTE_MS
            cache.append(
                {"node_id": ids[name], "tier": tier, "ts_ms": ts, "lookups": lookups,
                 "lookup_tokens": lookups * 256, "hits": hits, "hit_tokens": hits * 256,
                 "reuse_hits": reuse, "sharing_hits": sharing, "evictions": 0, "promotions": 0,
                 "demotions": 0, "bytes_read": 0, "bytes_written": 0, "used_bytes": 0,
                 "capacity_bytes": 1000, "pinned_bytes": 0, "items": 0}
            )  # fmt: skip
            if tier == "all":
                up.append({"node_id": ids[name], "ts_ms": ts, "up": True, "scrape_seconds": 0.01})
        insert_rows(conn, raw_table("cache_sample"), cache)
        insert_rows(conn, raw_table("node_sample"), up)


def from_raw_rows(db: Engine, win: Window) -> dict[str | None, dict[str, Any]]:
    """Per DC (None: the fleet), summed straight from the raw rows in ``win``: lookups, and per
    tier [hits, reuse hits, sharing hits]."""
    t = raw_table("cache_sample")
    with db.connect() as conn:
        names = dict(conn.execute(select(raw_table("node").c.id, raw_table("node").c.name)).all())
        rows = conn.execute(
            select(
                t.c.node_id, t.c.tier, t.c.lookups, t.c.hits, t.c.reuse_hits, t.c.sharing_hits
            ).where(t.c.ts_ms >= win.start_ms, t.c.ts_ms < win.end_ms)
        ).all()
    out: dict[str | None, dict[str, Any]] = defaultdict(
        lambda: {"lookups": 0, "tiers": defaultdict(lambda: [0, 0, 0])}
    )
    for node_id, tier, lookups, hits, reuse, sharing in rows:
        for scope in (NODES[names[node_id]], None):
            if tier == "all":
                out[scope]["lookups"] += lookups
            else:
                counts = out[scope]["tiers"][tier]
                for i, v in enumerate((hits, reuse, sharing)):
                    counts[i] += v
    # plain dicts: a tier no row names stays absent
    return {dc: {"lookups": v["lookups"], "tiers": dict(v["tiers"])} for dc, v in out.items()}


def tier_counts(raw: dict[str, Any], tier: str) -> list[int]:
    """[hits, reuse hits, sharing hits] of ``tier`` in a scope's raw sums (0 without rows)."""
    return raw["tiers"].get(tier, [0, 0, 0])


def expected(raw: dict[str, Any], tier: str) -> dict[str, float | None]:
    """A tier's ratios from raw sums: per lookup of the whole, None without lookups."""
    lookups = raw["lookups"]
    hits, reuse, sharing = tier_counts(raw, tier)
    per_lookup = (lambda n: n / lookups) if lookups else (lambda n: None)
    return {
        "hit_ratio": per_lookup(hits),
        "reuse_hit_ratio": per_lookup(reuse),
        "sharing_hit_ratio": per_lookup(sharing),
        "sharing_share_of_hits": sharing / hits if lookups and hits else None,
    }


def approx(value: float | None) -> Any:
    return None if value is None else pytest.approx(value)


@pytest.mark.parametrize("rolled_up", [False, True], ids=["raw", "rolled-up"])
def test_the_read_model_splits_each_tier_as_the_raw_rows_do(db: Engine, rolled_up: bool) -> None:
    now_ms = int(time.time() * 1000)
    fill(db, now_ms)
    win = window_for("15m", now_ms)
    raw = from_raw_rows(db, win)
    if rolled_up:  # the same figures whether read from raw samples or from rollups
        rollup_all(db.begin, now_ms)
    with db.connect() as conn:
        ov = overview(conn, win, ASSUME)
    scopes: dict[str | None, Counts] = {None: ov.fleet, **ov.dcs}
    assert set(scopes) == {None, "fra", "ams", "lis"}
    for dc, c in scopes.items():
        for tier in TIERS:
            want = expected(raw[dc], tier)
            t = c.tier_hit_counts(tier)
            got = {name: getattr(t, name) for name in want}
            assert got == {k: approx(v) for k, v in want.items()}, (dc, tier)
    # by hand: the pool tier's hits are mostly sharing, the gpu tier's mostly reuse
    fleet = ov.fleet
    assert fleet.lookups == 400
    pool, gpu = fleet.tier_hit_counts("remote"), fleet.tier_hit_counts("gpu")
    assert (pool.hits, pool.reuse_hits, pool.sharing_hits) == (50, 4, 46)
    assert pool.sharing_hit_ratio == pytest.approx(46 / 400)
    assert pool.sharing_share_of_hits == pytest.approx(46 / 50)
    assert (gpu.hits, gpu.reuse_hits, gpu.sharing_hits) == (70, 63, 7)
    assert gpu.reuse_hit_ratio == pytest.approx(63 / 400)
    fra = ov.dcs["fra"]
    assert fra.tier_hit_counts("remote").sharing_hit_ratio == pytest.approx(36 / 200)
    assert fra.tier_hit_counts("disk").reuse_hit_ratio == pytest.approx(5 / 200)
    # the tiers add up to the whole: reuse to reuse, sharing to sharing, both to the hit ratio
    for dc, c in scopes.items():
        if dc == "lis":
            continue
        split = [c.tier_hit_counts(t) for t in c.tiers]
        assert sum(t.reuse_hit_ratio or 0 for t in split) == pytest.approx(c.reuse_hit_ratio)
        assert sum(t.sharing_hit_ratio or 0 for t in split) == pytest.approx(c.sharing_hit_ratio)
        for t in split:
            assert (t.reuse_hit_ratio or 0) + (t.sharing_hit_ratio or 0) == pytest.approx(
                t.hit_ratio or 0
            )
    # no lookups: N/A, not 0
    lis = ov.dcs["lis"].tier_hit_counts("cpu")
    assert (lis.hit_ratio, lis.reuse_hit_ratio, lis.sharing_hit_ratio) == (None, None, None)


def test_dashboard_status_and_top_show_the_split_per_tier(db: Engine) -> None:
    now_ms = int(time.time() * 1000)
    fill(db, now_ms)
    url = db.url.render_as_string(hide_password=False)
    raw = from_raw_rows(db, window_for("15m", now_ms))

    # the dashboard's fleet page: a chart for the fleet, a table per DC and tier
    dash = create_app(url, now_ms=lambda: now_ms)
    try:
        page, _ = render(dash, "/", "", "15m", None, DEFAULT_MODEL)
        narrowed, _ = render(dash, "/", "", "15m", ["fra"], DEFAULT_MODEL)
    finally:
        dash.server.extensions["kvctl"].engine.dispose()
    chart = by_id(page, "fig-tier-reuse-sharing").figure
    assert [t.name for t in chart.data] == ["reuse hit ratio", "sharing hit ratio"]
    for trace, name in zip(chart.data, ("reuse_hit_ratio", "sharing_hit_ratio"), strict=True):
        assert list(trace.x) == TIERS
        assert list(trace.y) == [approx(expected(raw[None], t)[name]) for t in TIERS]
    rows = {(r["DC"], r["tier"]): r for r in by_id(page, "table-tier-split").data}
    assert set(rows) == {(dc, t) for dc in ("fra", "ams", "lis", "fleet") for t in TIERS}
    for (dc, tier), row in rows.items():
        want = expected(raw[None if dc == "fleet" else dc], tier)
        assert row["hits"] == tier_counts(raw[None if dc == "fleet" else dc], tier)[0]
        for column, name in (
            ("hit ratio", "hit_ratio"),
            ("reuse hit ratio", "reuse_hit_ratio"),
            ("sharing hit ratio", "sharing_hit_ratio"),
            ("sharing (of hits)", "sharing_share_of_hits"),
        ):
            assert row[column] == percent(want[name]), (dc, tier, column)
    assert rows[("fleet", "remote")]["sharing hit ratio"] == "11.5%"  # 46 of 400 lookups
    assert rows[("fleet", "remote")]["sharing (of hits)"] == "92.0%"  # 46 of its 50 hits
    assert rows[("lis", "cpu")]["reuse hit ratio"] == "N/A"  # no lookups
    section = next(
        s for s in (c for c in walk(page) if getattr(c, "className", "") == "section")
        if "Reuse vs sharing by tier" in text_of(s)
    )  # fmt: skip
    assert "measured" in text_of(section) and "per lookup" in text_of(section)
    narrow_rows = by_id(narrowed, "table-tier-split").data
    assert {r["DC"] for r in narrow_rows} == {"fra", "selected"}
    narrow_chart = by_id(narrowed, "fig-tier-reuse-sharing").figure
    assert list(narrow_chart.data[1].y) == [
        approx(expected(raw["fra"], t)["sharing_hit_ratio"]) for t in TIERS
    ]

    # `kvctl status --window --json` and `kvctl top --json`: per node, DC and fleet, per tier
    out = runner.invoke(cli, ["status", "--db", url, "--window", "15m", "--json"])
    assert out.exit_code == 0, out.output
    status = json.loads(out.stdout)
    args = ["--json", "--interval", "0.2", "--timeout", "0.5", "--window", "15m"]
    out = runner.invoke(cli, ["top", "--db", url, *args])
    assert out.exit_code == 0, out.output
    recorded = json.loads(out.stdout)["recorded"]
    for doc in (status, recorded):
        scopes = {**{d["dc"]: d for d in doc["dcs"]}, None: doc["total"]}
        for dc, figures in scopes.items():
            # the tiers each has rows of (ams has no cpu tier), as its occupancy lists them
            assert set(figures["tiers"]) == set(raw[dc]["tiers"]), dc
            for tier in figures["tiers"]:
                got = figures["tiers"][tier]
                hits, reuse, sharing = tier_counts(raw[dc], tier)
                assert (got["hits"], got["reuse_hits"], got["sharing_hits"]) == (
                    hits,
                    reuse,
                    sharing,
                )
                assert "lookups" not in got  # the whole's, not the tier's
                for name, want in expected(raw[dc], tier).items():
                    assert got[name] == approx(want), (dc, tier, name)
    fra_a = next(n for n in status["nodes"] if n["node"] == "fra-a")["tiers"]["remote"]
    assert (fra_a["reuse_hit_ratio"], fra_a["sharing_hit_ratio"]) == (
        pytest.approx(4 / 150),
        pytest.approx(16 / 150),
    )
    assert status["total"]["tiers"]["cpu"]["reuse_hit_ratio"] == pytest.approx(18 / 400)
    lis = next(d for d in status["dcs"] if d["dc"] == "lis")["tiers"]["cpu"]
    assert lis["reuse_hit_ratio"] is None and lis["sharing_hit_ratio"] is None

    # the table for people: a row per DC, a column per tier, reuse / sharing per lookup
    out = runner.invoke(cli, ["status", "--db", url, "--window", "15m"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    title = next(i for i, line in enumerate(lines) if "hit ratio by tier" in line)
    assert "per lookup" in lines[title]
    body = lines[title:]
    fleet_line = next(line for line in body if " fleet " in line)
    assert [c.strip() for c in fleet_line.split("│")[1:-1]] == ["fleet"] + [
        f"{percent(expected(raw[None], t)['reuse_hit_ratio'])} / "
        f"{percent(expected(raw[None], t)['sharing_hit_ratio'])}"
        for t in TIERS
    ]
    lis_line = next(line for line in body if " lis " in line)
    assert [c.strip() for c in lis_line.split("│")[1:-1]][1:] == ["N/A"] * len(TIERS)
