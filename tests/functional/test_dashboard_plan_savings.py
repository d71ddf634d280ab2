"""GPU time saved from the agents' fetch-or-recompute plans (SQLite and PostgreSQL): a node whose
agent reported plans is credited prefill minus fetch time of the chunks taken, a node without
keeps hit tokens / the modeled rate, and the figure is called measured only when every second
of it came from a measured prefill rate."""

from __future__ import annotations

import math
from typing import Any

import pytest
from sqlalchemy.engine import Engine

from dashboard.app import create_app, render
from kvctl.db.analytics.counts import MEASURED, MODELED, node_counts
from kvctl.db.analytics.overview import overview
from kvctl.db.analytics.windows import window_for
from kvctl.db.ingest import insert_rows
from kvctl.db.models import raw_table
from kvctl.db.rollup import MINUTE_MS, rollup_all
from tests.functional.dashboard_history import (
    A100_RATE,
    ASSUME,
    H100_RATE,
    L4_RATE,
    NOW,
    OLD,
    T,
    fill_history,
)
from tests.functional.test_dashboard_app import by_id, card_value, text_of, url_of, walk


def _plan(
    node: int, ts: int, basis: str, recompute_s: float, fetch_s: float, chunks: int
) -> dict[str, Any]:
    return {
        "node_id": node,
        "ts_ms": ts,
        "prefill_basis": basis,
        "saved_s": recompute_s - fetch_s,
        "recompute_s": recompute_s,
        "fetch_s": fetch_s,
        "fetch_chunks": chunks,
        "recompute_chunks": 3,
    }


@pytest.fixture
def history(db: Engine) -> dict[str, int]:
    """The dashboard history, plus plans: fra-a's agent plans on a configured prefill rate,
    ams-a's on a measured one (after a first scrape on a modeled one that saved nothing);
    fra-b's agent reports none."""
    ids = fill_history(db)
    a, c = ids["fra-a"], ids["ams-a"]
    with db.begin() as conn:
        insert_rows(
            conn,
            raw_table("plan_sample"),
            [
                _plan(a, OLD, "configured", 100.0, 1.0, 500),  # before the window
                _plan(a, T, "configured", 3.0, 1.0, 40),
                _plan(a, T + 10 * MINUTE_MS, "configured", 1.0, 0.5, 20),
                _plan(c, T, "modeled", 0.0, 0.0, 0),
                _plan(c, T + 5 * MINUTE_MS, "measured", 0.5, 0.25, 30),
            ],
        )
    return ids


@pytest.mark.parametrize("rolled_up", [False, True], ids=["raw", "rolled-up"])
def test_gpu_time_saved_is_the_plans_figure_where_there_is_one(
    db: Engine, history: dict[str, int], rolled_up: bool
) -> None:
    if rolled_up:  # the prefill basis survives rollups as a series key
        rollup_all(db.begin, NOW)
    with db.connect() as conn:
        ov = overview(conn, window_for("1h", NOW), ASSUME)
        inv = ov.inventory
        nodes = node_counts(
            conn, T - MINUTE_MS, NOW, inv.nodes, {d.name: d for d in inv.dcs}, ASSUME
        )
    fra_a, fra_b, ams_a = (nodes[history[n]] for n in ("fra-a", "fra-b", "ams-a"))

    # fra-a: 2.5 s of plans, not its 15,360 hit tokens at the H100 rate, which ignored fetching
    assert fra_a.gpu_seconds_saved == pytest.approx(2.5)
    assert fra_a.gpu_seconds_saved != pytest.approx(15360 / H100_RATE)
    assert fra_a.it_joules_saved == pytest.approx(2.5 * 700)
    assert fra_a.facility_joules_saved == pytest.approx(2.5 * 700 * 1.5)
    assert (fra_a.plan_recompute_s, fra_a.plan_fetch_s) == (pytest.approx(4.0), pytest.approx(1.5))
    assert fra_a.plan_fetch_chunks == 60 and fra_a.plan_recompute_chunks == 6
    assert fra_a.plan_saved_s == {"configured": pytest.approx(2.5)}
    assert fra_a.gpu_time_basis == MODELED  # a configured rate is not a measurement
    # fra-b reported no plans: today's figure, and labelled so
    assert fra_b.gpu_seconds_saved == pytest.approx(2560 / A100_RATE)
    assert (fra_b.plan_nodes, fra_b.token_model_nodes) == (0, 1)
    assert fra_b.gpu_time_basis == MODELED
    # ams-a: measured prefill rate; its earlier modeled-rate scrape saved nothing
    assert ams_a.gpu_seconds_saved == pytest.approx(0.25)
    assert ams_a.plan_bases == ["measured"] and ams_a.gpu_time_basis == MEASURED
    assert ams_a.it_joules_saved == pytest.approx(0.25 * 72)  # L4 board power, no PUE

    fra, ams, fleet = ov.dcs["fra"], ov.dcs["ams"], ov.fleet
    assert fra.gpu_seconds_saved == pytest.approx(2.5 + 2560 / A100_RATE)
    assert (fra.plan_nodes, fra.token_model_nodes) == (1, 1) and fra.gpu_time_basis == MODELED
    assert ams.gpu_time_basis == MEASURED
    assert fleet.gpu_seconds_saved == pytest.approx(2.5 + 2560 / A100_RATE + 0.25)
    assert fleet.plan_bases == ["configured", "measured"] and fleet.gpu_time_basis == MODELED
    assert fleet.carbon_g_saved == pytest.approx(
        (2.5 * 700 + 2560 / A100_RATE * 400) * 1.5 / 3.6e6 * 400
    )
    # hit counts are untouched: plans change what a hit is worth, not how many there were
    assert fleet.hit_tokens == 25600


def test_negative_plan_seconds_save_nothing(db: Engine) -> None:
    """A link overridden to "fetch" can take chunks slower than recompute: that is no saving,
    and not a negative one either."""
    ids = fill_history(db)
    with db.begin() as conn:
        insert_rows(
            conn, raw_table("plan_sample"), [_plan(ids["fra-b"], T, "measured", 1.0, 3.0, 10)]
        )
    with db.connect() as conn:
        ov = overview(conn, window_for("1h", NOW), ASSUME)
    # fra-b: its 2,560 hit tokens are not counted at the modeled rate either
    assert ov.dcs["fra"].gpu_seconds_saved == pytest.approx(15360 / H100_RATE)  # fra-a's only
    assert ov.dcs["fra"].plan_saved_s == {"measured": pytest.approx(-2.0)}


@pytest.fixture
def app(db: Engine, history: dict[str, int]):  # type: ignore[no-untyped-def]
    app = create_app(url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: NOW)
    yield app
    app.server.extensions["kvctl"].engine.dispose()


def test_the_card_says_which_basis_the_saving_has(app: Any) -> None:
    page, _ = render(app, "/", "", "1h", ["ams"], "llama-3.1-8b")
    card = text_of(by_id(page, "card-gpu-hours"))
    assert card_value(page, "card-gpu-hours") == "0.25 GPU-s"
    assert "measured" in card and "modeled" not in card
    assert "measured prefill rate" in card and "fetch" in card
    (row,) = [r for r in by_id(page, "table-dcs").data if r["DC"] == "ams"]
    assert row["GPU-h basis"] == "measured (plan)"

    page, _ = render(app, "/", "", "1h", ["fra"], "llama-3.1-8b")
    card = text_of(by_id(page, "card-gpu-hours"))
    found = walk(by_id(page, "card-gpu-hours"))
    badges = [c.children for c in found if getattr(c, "className", "").startswith("basis")]
    assert badges == [MODELED]
    assert "configured prefill rate: modeled from plan" in card
    assert "1 node(s) without plans: tokens / modeled prefill rate" in card
    (row,) = [r for r in by_id(page, "table-dcs").data if r["DC"] == "fra"]
    assert row["GPU-h basis"] == "modeled (plan) + modeled (tokens)"
    # 0.0007 GPU-h to four significant digits (fixed decimals made it 0.0007, or 0 if smaller)
    assert row["GPU-h saved"] == pytest.approx((2.5 + 2560 / A100_RATE) / 3600, rel=1e-3)


@pytest.mark.parametrize("rolled_up", [False, True], ids=["raw", "rolled-up"])
def test_plan_seconds_are_priced_at_the_plans_gpu_and_the_cards_name_it(
    db: Engine, rolled_up: bool
) -> None:
    """The review's case: ams-a is an L4 in the inventory, but its agent (started without
    --gpu) planned on llama-3.1-8b on h100. Its 2 s saved are H100-seconds: 700 W, not the
    L4's 72 W; the cards name the plans' inputs, the GPU mismatch, and that the page's model
    (qwen2.5-0.5b) does not apply to them."""
    ids = fill_history(db)
    plan = _plan(ids["ams-a"], T, "modeled", 3.0, 1.0, 40)
    with db.begin() as conn:
        insert_rows(
            conn,
            raw_table("plan_sample"),
            [{**plan, "prefill_model": "llama-3.1-8b", "prefill_gpu": "h100"}],
        )
    if rolled_up:  # the plan's GPU survives rollups as a series key
        rollup_all(db.begin, NOW)
    with db.connect() as conn:
        ov = overview(conn, window_for("1h", NOW), ASSUME)
    ams = ov.dcs["ams"]
    assert ams.gpu_seconds_saved == pytest.approx(2.0)
    assert ams.it_joules_saved == pytest.approx(2.0 * 700)  # H100 board power, not L4's 72 W
    assert ams.plan_energy_gpus == {"h100": pytest.approx(2.0)}
    assert ams.plan_gpu_mismatches == {"ams-a: plans on h100, inventory L4": 1}

    app = create_app(url_of(db), model="qwen2.5-0.5b", default_gpu="a100", now_ms=lambda: NOW)
    try:
        page, _ = render(app, "/", "", "1h", ["ams"], "qwen2.5-0.5b")
    finally:
        app.server.extensions["kvctl"].engine.dispose()
    gpu_card, energy_card = (text_of(by_id(page, i)) for i in ("card-gpu-hours", "card-energy"))
    assert "llama-3.1-8b on h100 (modeled)" in gpu_card
    assert "the page's model qwen2.5-0.5b applies only to nodes without plans" in gpu_card
    assert "h100 700 W" in energy_card and "ams-a: plans on h100, inventory L4" in energy_card
    assert "facility (x PUE)" in energy_card  # the card's title names its basis


@pytest.mark.parametrize("saved_s", [math.inf, math.nan], ids=["infinite", "nan"])
def test_a_nodes_impossible_plan_seconds_are_unknown_not_the_fleets(
    db: Engine, saved_s: float
) -> None:
    """A plan row written by hand with seconds saved of Infinity (or NaN, or recompute seconds
    so): 'GPU time saved', 'Energy saved' and 'Carbon saved' read N/A for the whole fleet (inf
    summed), `kvctl status --json` inf. The node's plans are unknown, named on the card, and
    left out (not priced at the modeled rate either: its hits were planned); the other nodes'
    seconds are shown, on both backends."""
    from sqlalchemy import select

    from kvctl.db.analytics.counts import UNKNOWN_PLANS
    from kvctl.db.inventory import list_dcs, list_nodes
    from kvctl.db.models import Node

    fill_history(db)
    with db.begin() as conn:
        fra_b = conn.execute(select(Node.id).where(Node.name == "fra-b")).scalar_one()
        row = _plan(fra_b, T, "measured", saved_s, 1.0, 4) | {"saved_s": saved_s}
        insert_rows(conn, raw_table("plan_sample"), [row])
    win = window_for("1h", NOW)
    with db.connect() as conn:
        dcs = {d.name: d for d in list_dcs(conn)}
        counts = node_counts(conn, win.start_ms, win.end_ms, list_nodes(conn), dcs, ASSUME)
    b = counts[fra_b]
    assert (b.plan_nodes, b.token_model_nodes, b.gpu_seconds_saved) == (1, 0, 0.0)
    # SQLite keeps a NaN as NULL: the row reads as a rejected reading (seconds not known, as
    # collectors of 2026-11-24..29 wrote one), not as seconds that cannot be true
    stored_as_null = math.isnan(saved_s) and db.dialect.name == "sqlite"
    if stored_as_null:
        assert b.unknown_figures == {} and b.plan_saved_s == {"measured": 0.0}
    else:
        assert b.unknown_figures == {UNKNOWN_PLANS: 1} and not b.plan_saved_s
    fleet = sum(c.gpu_seconds_saved for c in counts.values())
    # fra-a (H100) and ams-a (L4) at the modeled rate: their hit tokens
    assert fleet == pytest.approx(15_360 / H100_RATE + 7_680 / L4_RATE)
    app = create_app(url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: NOW)
    try:
        page, _ = render(app, "/", "", "1h", None, None)
    finally:
        app.server.extensions["kvctl"].engine.dispose()
    for card_id in ("card-gpu-hours", "card-energy", "card-carbon"):
        shown = card_value(page, card_id)
        assert shown != "N/A" and "inf" not in shown and "nan" not in shown, (card_id, shown)
    note = text_of(by_id(page, "card-gpu-hours"))
    assert (f"1 node(s) left out, unknown: {UNKNOWN_PLANS}" in note) is not stored_as_null


def test_a_rejected_readings_plan_row_leaves_the_nodes_plans_known(db: Engine) -> None:
    """Collectors of 2026-11-24..29 wrote a plan row whose reading was rejected with its
    seconds NULL beside its chunks: a sound row. Read as a NaN it made the node's whole plan
    figure unknown ('not a finite number, or below zero', false) and dropped its other rows'
    seconds from the fleet's. The row adds no seconds; the node's other rows stand, on both
    backends."""
    from sqlalchemy import select

    from kvctl.db.inventory import list_dcs, list_nodes
    from kvctl.db.models import Node

    fill_history(db)
    with db.begin() as conn:
        fra_b = conn.execute(select(Node.id).where(Node.name == "fra-b")).scalar_one()
        rejected = _plan(fra_b, T, "measured", 0.0, 0.0, 4) | dict.fromkeys(
            ("saved_s", "recompute_s", "fetch_s")
        )
        insert_rows(
            conn,
            raw_table("plan_sample"),
            [_plan(fra_b, T - 60_000, "measured", 3.0, 1.0, 4), rejected],
        )
    win = window_for("1h", NOW)
    with db.connect() as conn:
        dcs = {d.name: d for d in list_dcs(conn)}
        counts = node_counts(conn, win.start_ms, win.end_ms, list_nodes(conn), dcs, ASSUME)
    b = counts[fra_b]
    assert b.unknown_figures == {}
    assert b.gpu_seconds_saved == pytest.approx(2.0)  # the sound row's 3.0 - 1.0
