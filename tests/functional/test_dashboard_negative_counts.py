"""Negative hit counts in a node's rows (written by hand, by an older collector, or restored from
a broken export: today's collector never records a decrease) are unknown, as more hits than
lookups already were: before, they were summed into the DC's and the fleet's figures, so one
bad row took the dashboard's fleet hit ratio (and `kvctl status --window`'s, the same read) from
46.7% to 31.6%, or its tokens saved below zero, labelled measured. SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.engine import Engine

from dashboard.app import create_app, render
from kvctl.db.analytics.recorded import recorded
from kvctl.db.analytics.series import time_series
from kvctl.db.analytics.summary import fleet_summary
from kvctl.db.analytics.windows import window_for
from kvctl.db.ingest import insert_rows
from kvctl.db.inventory import list_nodes
from kvctl.db.models import Node, raw_table
from tests.functional.dashboard_history import NOW, T, _cache, fill_history
from tests.functional.test_dashboard_app import by_id, card_value, text_of, url_of


def _pages_reading_fra_alone(db: Engine) -> Any:
    """The overview (returned) and ams' detail page, each checked to read fra alone (60 + 10
    hits of 100 + 50 lookups) with ams-a's counts unknown."""
    app = create_app(url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: NOW)
    try:
        page, _ = render(app, "/", "", "1h", None, None)
        detail, _ = render(app, "/detail", "?dc=ams", "1h", None, None)
    finally:
        app.server.extensions["kvctl"].engine.dispose()
    assert card_value(page, "card-hit-ratio") == "46.7%"
    rows: dict[str, Any] = {r["DC"]: r for r in by_id(page, "table-dcs").data}
    assert (rows["ams"]["lookups"], rows["ams"]["hit ratio"]) == (0, "N/A")
    nodes = by_id(detail, "table-nodes").data
    assert [(r["node"], r["hit ratio"]) for r in nodes] == [("ams-a", "N/A")]
    return page


@pytest.mark.parametrize(
    "bad",
    [
        {"hits": -40, "hit_tokens": -10240, "sharing_hits": -40},
        {"lookups": 5, "lookup_tokens": 1280, "hits": 2, "hit_tokens": -51200},
        {"lookups": 5, "lookup_tokens": 1280, "hits": 2, "reuse_hits": -3, "sharing_hits": 5},
    ],
    ids=["hits", "hit-tokens", "reuse-hits"],
)
def test_a_nodes_negative_hit_counts_are_unknown_not_summed(
    db: Engine, bad: dict[str, int]
) -> None:
    fill_history(db)
    with db.begin() as conn:
        ams_a = conn.execute(select(Node.id).where(Node.name == "ams-a")).scalar_one()
        insert_rows(conn, raw_table("cache_sample"), [_cache(ams_a, "all", T + 60_000, **bad)])
    page = _pages_reading_fra_alone(db)
    assert card_value(page, "card-tokens") == "17,920"  # fra's 10,240 + 5,120 + 2,560
    rows: dict[str, Any] = {r["DC"]: r for r in by_id(page, "table-dcs").data}
    assert (rows["fleet"]["lookups"], rows["fleet"]["hit ratio"]) == (150, "46.7%")
    # `kvctl status --window`'s figures are the same read
    win = window_for("1h", NOW)
    with db.connect() as conn:
        rec = recorded(conn, win, list_nodes(conn))
        series = time_series(conn, win, [ams_a])
    assert rec.fleet.hit_figures()["hit_ratio"] == pytest.approx(70 / 150)
    assert rec.dcs["ams"].hit_figures()["hit_ratio"] is None
    # the node's hit ratio over time: the bad bucket is no number, not a negative one
    assert all(v >= 0 for v in [*series.lookups, *series.hits, *series.reuse_hits])
    assert all(v >= 0 for v in series.sharing_hits)


@pytest.mark.parametrize(
    "bad",
    [
        {"hits": -40, "hit_tokens": -10240, "sharing_hits": -40},
        {"lookups": 5, "lookup_tokens": 1280, "hits": 2, "hit_tokens": -51200},
        {"lookups": 5, "lookup_tokens": 1280, "hits": 2, "reuse_hits": -3, "sharing_hits": 5},
    ],
    ids=["hits", "hit-tokens", "reuse-hits"],
)
def test_the_sql_fleet_summary_leaves_them_out_as_the_read_model_does(
    db: Engine, bad: dict[str, int]
) -> None:
    """kvctl.db.analytics.summary (the benches' per-DC totals summed in SQL, "its totals are
    the read model's") summed the negative row the read model leaves out: the fleet read
    31.6% (and ams 44.4%) where the dashboard read 46.7%."""
    fill_history(db)
    with db.begin() as conn:
        ams_a = conn.execute(select(Node.id).where(Node.name == "ams-a")).scalar_one()
        insert_rows(conn, raw_table("cache_sample"), [_cache(ams_a, "all", T + 60_000, **bad)])
    win = window_for("1h", NOW)
    with db.connect() as conn:
        summary = fleet_summary(conn, win.start_ms, win.end_ms)
    dcs = {d.dc: d for d in summary.dcs}
    assert (summary.total.lookups, summary.total.hits) == (150, 70)
    assert summary.total.hit_ratio == pytest.approx(70 / 150)
    assert summary.total.hit_tokens == 17_920
    assert (dcs["ams"].lookups, dcs["ams"].hits, dcs["ams"].hit_ratio) == (0, 0, None)


@pytest.mark.parametrize("rolled_up", [False, True], ids=["raw", "rolled-up"])
def test_a_nodes_counts_past_64_bits_are_unknown_not_a_failed_page(
    db: Engine, rolled_up: bool
) -> None:
    """Rows written by hand near 2**63 (an import, an operator): SQLite's SUM raised "integer
    overflow", so every page, `kvctl status --window` and the SQL fleet summary failed on the
    whole window (PostgreSQL summed them into a numeric, a 'hit ratio' over 9e18 lookups).
    Now the node's counts are unknown on both backends, with the reason on the card, and the
    rest of the fleet is read; rolled up too (a minute's sum past 64 bits failed the rollup)."""
    from kvctl.db.analytics.counts import beyond_counts_reason
    from kvctl.db.analytics.summary import node_cache_counters
    from kvctl.db.rollup import MINUTE_MS, rollup_all

    fill_history(db)
    big = 2**62 + 5
    with db.begin() as conn:
        ams_a = conn.execute(select(Node.id).where(Node.name == "ams-a")).scalar_one()
        bad = dict(lookups=big, lookup_tokens=big, hits=2, hit_tokens=512)
        # two in one minute (its rollup's sum is past 64 bits), one in the next
        rows = [_cache(ams_a, "all", T + ms, **bad) for ms in (60_000, 61_000, 2 * MINUTE_MS)]
        insert_rows(conn, raw_table("cache_sample"), rows)
    if rolled_up:
        rollup_all(db.begin, NOW)
    page = _pages_reading_fra_alone(db)  # as for a negative count
    reason = beyond_counts_reason("cache_sample")
    assert f"1 node(s) left out, unknown: {reason}" in text_of(by_id(page, "card-hit-ratio"))
    win = window_for("1h", NOW)
    with db.connect() as conn:
        rec = recorded(conn, win, list_nodes(conn))
        series = time_series(conn, win, [ams_a])
        summary = fleet_summary(conn, win.start_ms, win.end_ms)
        sums = node_cache_counters(conn, win.start_ms, win.end_ms)
    assert rec.fleet.hit_figures()["hit_ratio"] == pytest.approx(70 / 150)
    assert rec.dcs["ams"].unknown_figures == {reason: 1}
    assert rec.as_dict()["total"]["unknown_figures"] == {reason: 1}
    assert all(v < 2**63 - 1 for v in [*series.lookups, *series.hits])  # a bucket: under it
    assert (summary.total.lookups, summary.total.hits) == (150, 70)
    # the exact sums per node: at or past the limit, not a failure
    assert sums["ams-a"]["all"]["lookups"] >= 2**63 - 1
    assert sums["fra-a"]["all"]["lookups"] == 100
