"""Emulated GPU energy (nodes without NVML) is never mixed with NVML's measured energy: on a
known history (SQLite and PostgreSQL) with both, every figure the read model and the dashboard
show of one holds none of the other, raw or rolled up; and the default window fits the data."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import Engine

from dashboard.app import create_app, render
from kvctl.db.analytics.counts import EMULATED
from kvctl.db.analytics.overview import overview
from kvctl.db.analytics.series import time_series
from kvctl.db.analytics.summary import fleet_summary
from kvctl.db.analytics.windows import fitted_window, window_for
from kvctl.db.ingest import insert_rows
from kvctl.db.models import ROLLUPS, raw_table
from kvctl.db.rollup import DAY_MS, MINUTE_MS, rollup_all
from kvctl.format import format_number
from tests.functional.dashboard_history import ASSUME, NOW, T, fill_history
from tests.functional.test_dashboard_app import by_id, card_value, text_of, url_of, walk

HOUR = 60 * MINUTE_MS

#: far from the measured history's 1.8 MJ samples: a sum of both could not pass for either
EMULATED_J = 7.0


@pytest.fixture
def both(db: Engine) -> dict[str, int]:
    """The known history (fra-a has NVML: 3.6 MJ in the hour) plus emulated energy on every
    node: also on fra-a, at the same times, which the collector never writes, so any query
    adding the two would show it."""
    ids = fill_history(db)
    rows = [
        {"node_id": node, "gpu_profile": "l4", "model": "qwen2.5-0.5b", "ts_ms": T + i * MINUTE_MS,
         "lookup_tokens": 1_000, "busy_s": 0.1, "energy_j": EMULATED_J, "power_w": 7.0}
        for node in ids.values()
        for i in range(2)
    ]  # fmt: skip
    with db.begin() as conn:
        insert_rows(conn, raw_table("emulated_power_sample"), rows)
    return ids


@pytest.mark.parametrize("rolled_up", [False, True], ids=["raw", "rolled-up"])
def test_measured_and_emulated_energy_are_never_summed(
    db: Engine, both: dict[str, int], rolled_up: bool
) -> None:
    if rolled_up:
        rollup_all(db.begin, NOW)
        with db.connect() as conn:  # the rollups really hold the emulated rows, apart
            hourly = conn.execute(ROLLUPS["emulated_power_sample", "1h"].select()).all()
        assert sum(r.energy_j for r in hourly) == pytest.approx(6 * EMULATED_J)
    win = window_for("1h", NOW)
    with db.connect() as conn:
        ov = overview(conn, win, ASSUME)
        s = time_series(conn, win, [both["fra-a"]])
        summary = fleet_summary(conn, win.start_ms, win.end_ms)
    fra, fleet = ov.dcs["fra"], ov.fleet
    # measured: NVML's 2 x 1.8 MJ on fra-a alone, as before any emulation
    assert fra.energy_j == fleet.energy_j == pytest.approx(3.6e6) and fleet.energy_nodes == 1
    assert fleet.tokens_per_joule == pytest.approx(12_000 / 3.6e6)
    # emulated: 2 samples of 7 J on each of the 3 nodes, and its own tokens per joule
    assert fleet.emulated_energy_j == pytest.approx(6 * EMULATED_J)
    assert fleet.emulated_energy_nodes == 3 and fleet.emulated_busy_s == pytest.approx(0.6)
    assert fleet.emulated_tokens_per_joule == pytest.approx(6_000 / (6 * EMULATED_J))
    assert fleet.emulated_profiles == {"l4/qwen2.5-0.5b": 3}
    # the series: each bucket's energy is one kind's
    assert sum(e for e in s.energy_j if e is not None) == pytest.approx(3.6e6)
    assert sum(e for e in s.emulated_energy_j if e is not None) == pytest.approx(2 * EMULATED_J)
    assert max(p for p in s.power_w if p is not None) == pytest.approx(700.0)
    assert max(p for p in s.emulated_power_w if p is not None) == pytest.approx(7.0)
    # the benches' fleet summary reads NVML only
    assert summary.total.energy_j == pytest.approx(3.6e6)


def test_the_dashboard_shows_each_on_its_own_cards(db: Engine, both: dict[str, int]) -> None:
    app = create_app(url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: NOW)
    try:
        page, _ = render(app, "/", "", "1h", None, "llama-3.1-8b")
        detail, _ = render(app, "/detail", "?dc=fra", "1h", None, None)
    finally:
        app.server.extensions["kvctl"].engine.dispose()
    assert card_value(page, "card-energy-used") == "1 kWh"
    assert card_value(page, "card-tokens-per-joule") == format_number(12_000 / 3.6e6)
    emulated = by_id(page, "card-energy-emulated")
    # the energy cards read in one unit (the largest figure's), never kWh beside J
    assert card_value(page, "card-energy-emulated") == "0.0000117 kWh"
    assert "IT" in text_of(emulated) and "IT" in text_of(by_id(page, "card-energy-used"))
    assert "emulated" in text_of(emulated) and "NVIDIA L4 datasheet: 72 W" in text_of(emulated)
    # the busy seconds shown are capped at each scrape interval (collectors.rows): the card
    # says so, not that they are all the modeled prefill of the tokens not served
    assert "at most each scrape interval" in text_of(emulated)
    assert card_value(page, "card-tokens-per-joule-emulated") == format_number(1_000 / 7.0)
    rows = {r["DC"]: r for r in by_id(page, "table-dcs").data}
    assert rows["fleet"]["kWh used (IT)"] == 1.0
    assert rows["fleet"]["kWh used (emulated, IT)"] == pytest.approx(
        6 * EMULATED_J / 3.6e6, rel=1e-3
    )
    # the detail page: NVML's plot and the emulated one, each labelled
    by_id(detail, "fig-power")
    assert EMULATED in text_of(by_id(detail, "fig-power-emulated").figure.data[0].name)
    assert "at most each scrape interval" in text_of(detail)


def test_emulated_energy_alone_takes_the_measured_cards_place(db: Engine) -> None:
    """A fleet without NVML anywhere: no N/A "Energy used" beside the emulated one."""
    ids = fill_history(db)
    with db.begin() as conn:
        conn.execute(raw_table("power_sample").delete())
        insert_rows(
            conn,
            raw_table("emulated_power_sample"),
            [{"node_id": ids["ams-a"], "gpu_profile": "l4", "model": "qwen2.5-0.5b", "ts_ms": T,
              "lookup_tokens": 700, "busy_s": 0.1, "energy_j": 7.0, "power_w": 7.0}],
        )  # fmt: skip
    app = create_app(url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: NOW)
    try:
        page, _ = render(app, "/", "", "1h", None, "llama-3.1-8b")
    finally:
        app.server.extensions["kvctl"].engine.dispose()
    ids_on_page = {getattr(c, "id", None) for c in walk(page)}
    assert "card-energy-used" not in ids_on_page and "card-tokens-per-joule" not in ids_on_page
    assert card_value(page, "card-tokens-per-joule-emulated") == format_number(100.0)


def test_the_default_window_fits_the_collected_data(db: Engine) -> None:
    """The history's scrapes run from 40 to 10 minutes before NOW: the 1-hour span holds them
    and nothing lies beyond it, ending just after the last one (two days on too). Ten days of
    hourly rollups leading up to them (their raw samples pruned) stretch it to the 30-day
    span. An empty database has nothing to fit: the named 1-hour window."""
    with db.connect() as conn:
        assert fitted_window(conn, NOW) == window_for("1h", NOW)
    ids = fill_history(db)
    last = T + 30 * MINUTE_MS  # the history's last scrape
    with db.connect() as conn:
        win = fitted_window(conn, NOW)
        # the scrapes stopped ten minutes ago: the window ends just after the last one
        assert (win.name, win.fitted, win.end_ms) == ("1h", True, last + 1)
        assert fitted_window(conn, NOW + 2 * DAY_MS).end_ms == last + 1
    hourly = [
        {"bucket_ms": b, "node_id": ids["fra-a"], "samples": 1, "up": 1,
         "scrape_seconds_sum": 0.01, "scrape_seconds_max": 0.01, "scrape_seconds_n": 1}
        for b in range(NOW // HOUR * HOUR - 10 * DAY_MS, NOW - 2 * HOUR, HOUR)
    ]  # fmt: skip
    with db.begin() as conn:
        insert_rows(conn, ROLLUPS["node_sample", "1h"], hourly)
    with db.connect() as conn:
        assert fitted_window(conn, NOW).name == "30d"
