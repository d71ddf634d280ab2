"""A node's NVML (or emulated) energy over a window that is below zero or not a finite number
(rows written by hand, restored from a broken export, or PostgreSQL's 'NaN' and 'Infinity':
today's collector records none) is unknown for that node, not summed: before, one such row on
fra-b made the fleet's measured 'Energy used' card read 722 Wh where fra-a measured 1 kWh (or
N/A beside 'NVML, 2 node(s)'), and the node's and DCs' kWh used -0.2778, inf or NaN; a node's
impossible emulated energy likewise. SQLite and PostgreSQL."""

from __future__ import annotations

import math
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import Engine

from dashboard.app import create_app, render
from kvctl.db.analytics.series import time_series
from kvctl.db.analytics.windows import Window
from kvctl.db.models import Node
from kvctl.db.rollup import HOUR_MS, MINUTE_MS
from kvctl.format import format_number
from tests.functional.dashboard_history import NOW, T, fill_history
from tests.functional.test_dashboard_app import by_id, card_value, text_of, url_of

#: each backend's way of writing the value (SQLite stores a NaN as NULL: no NaN there)
BAD = {
    "negative": {"sqlite": "-1e6", "postgresql": "-1e6"},
    "infinity": {"sqlite": "9e999", "postgresql": "'Infinity'"},
    "nan": {"sqlite": None, "postgresql": "'NaN'"},
}


def _render(db: Engine, path: str, search: str = "") -> Any:
    app = create_app(url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: NOW)
    try:
        return render(app, path, search, "1h", None, None)[0]
    finally:
        app.server.extensions["kvctl"].engine.dispose()


@pytest.mark.parametrize("bad", list(BAD))
def test_a_nodes_impossible_nvml_energy_is_unknown_not_summed(db: Engine, bad: str) -> None:
    value = BAD[bad][db.dialect.name]
    if value is None:
        pytest.skip("SQLite stores a NaN as NULL")
    fill_history(db)  # fra-a: 3.6 MJ (1 kWh) of NVML energy in the window
    with db.begin() as conn:
        fra_b = conn.execute(select(Node.id).where(Node.name == "fra-b")).scalar_one()
        conn.execute(
            text(
                "INSERT INTO power_sample (node_id, gpu_index, ts_ms, power_w, energy_j) "
                f"VALUES (:node, 0, :ts, 300, {value})"
            ),
            {"node": fra_b, "ts": T},
        )
    page = _render(db, "/")
    # fra-a's kWh alone, from one node: fra-b's energy is unknown
    assert card_value(page, "card-energy-used") == "1 kWh"
    assert "NVML, 1 node(s)" in text_of(by_id(page, "card-energy-used"))
    rows = {r["DC"]: r for r in by_id(page, "table-dcs").data}
    assert rows["fra"]["kWh used (IT)"] == 1.0 and rows["fleet"]["kWh used (IT)"] == 1.0
    # fra-a's engine tokens over its own energy: 12,000 / 3.6 MJ
    assert card_value(page, "card-tokens-per-joule") == format_number(12_000 / 3.6e6)
    detail = _render(db, "/detail", "?dc=fra")
    nodes = {r["node"]: r for r in by_id(detail, "table-nodes").data}
    assert nodes["fra-b"]["kWh used (IT)"] is None  # unknown: an empty cell, as without NVML
    assert nodes["fra-a"]["kWh used (IT)"] == 1.0


@pytest.mark.parametrize("bad", list(BAD))
def test_a_nodes_impossible_emulated_energy_is_unknown_not_summed(db: Engine, bad: str) -> None:
    value = BAD[bad][db.dialect.name]
    if value is None:
        pytest.skip("SQLite stores a NaN as NULL")
    fill_history(db)
    with db.begin() as conn:
        ids = {name: node_id for name, node_id in conn.execute(select(Node.name, Node.id))}
        for node, energy in (("fra-b", "7200"), ("ams-a", value)):
            conn.execute(
                text(
                    "INSERT INTO emulated_power_sample (node_id, ts_ms, gpu_profile, model, "
                    f"energy_j, power_w, busy_s, lookup_tokens) VALUES (:node, :ts, 'a100', "
                    f"'llama-3.1-8b', {energy}, 12, 18, 2560)"
                ),
                {"node": ids[node], "ts": T},
            )
    page = _render(db, "/")
    rows = {r["DC"]: r for r in by_id(page, "table-dcs").data}
    assert rows["ams"]["kWh used (emulated, IT)"] is None
    assert rows["fra"]["kWh used (emulated, IT)"] == rows["fleet"]["kWh used (emulated, IT)"]
    assert rows["fleet"]["kWh used (emulated, IT)"] == 0.002  # fra-b's 7,200 J
    assert "GPU energy of 1 node(s) without NVML" in text_of(by_id(page, "card-energy-emulated"))
    value_shown = card_value(page, "card-tokens-per-joule-emulated")
    assert not value_shown.startswith("-") and value_shown != "N/A"
    assert math.isclose(float(value_shown.replace(",", "")), 2560 / 7200, rel_tol=0.01)


@pytest.mark.parametrize("bad", list(BAD))
def test_a_nodes_impossible_energy_is_left_out_of_the_energy_over_time(
    db: Engine, bad: str
) -> None:
    """The DC page's power chart: a node's bucket of impossible energy is unknown, as the cards
    and tables have it, not summed into the DC's bar (-1e6 J took fra's bucket from fra-a's
    1.8 MJ to 0.8 MJ, an Infinity or NaN made it inf or nan, drawn or dropped by the chart)."""
    value = BAD[bad][db.dialect.name]
    if value is None:
        pytest.skip("SQLite stores a NaN as NULL")
    ids = fill_history(db)
    with db.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO power_sample (node_id, gpu_index, ts_ms, power_w, energy_j) "
                f"VALUES (:node, 0, :ts, 300, {value})"
            ),
            {"node": ids["fra-b"], "ts": T},
        )
        for node, energy in (("fra-a", "7200"), ("fra-b", value)):
            conn.execute(
                text(
                    "INSERT INTO emulated_power_sample (node_id, ts_ms, gpu_profile, model, "
                    f"energy_j, power_w, busy_s, lookup_tokens) VALUES (:node, :ts, 'a100', "
                    f"'llama-3.1-8b', {energy}, 12, 18, 2560)"
                ),
                {"node": ids[node], "ts": T},
            )
    win = Window("1h", NOW - HOUR_MS, NOW, MINUTE_MS)
    with db.connect() as conn:
        s = time_series(conn, win, [ids["fra-a"], ids["fra-b"]])
    at = s.bucket_ms.index(T)
    assert s.energy_j[at] == 1.8e6  # fra-a's alone
    assert s.emulated_energy_j[at] == 7200.0
    # the GPU's power is a reading of its own, kept as before
    assert s.power_w[at] == 500.0 + 300.0
    for joules in (*s.energy_j, *s.emulated_energy_j):
        assert joules is None or (math.isfinite(joules) and joules >= 0)


@pytest.mark.parametrize("joules", [-1.0e6, math.inf], ids=["negative", "infinite"])
def test_one_gpus_impossible_energy_is_not_hidden_by_its_nodes_sound_total(
    db: Engine, joules: float
) -> None:
    """Energy was checked per node, over its GPUs summed: fra-a's GPU 0 measured 3.6 MJ, and a
    row written by hand for its GPU 1 of -1 MJ made a node total of 2.6 MJ that can be true,
    so the 'Energy used' card read 722 Wh, measured. One GPU's energy that cannot be true makes
    the node's unknown, with the reason on the card; the power chart's bucket likewise."""
    from kvctl.db.analytics.counts import UNKNOWN_ENERGY

    ids = fill_history(db)
    with db.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO power_sample (node_id, gpu_index, ts_ms, power_w, energy_j) "
                "VALUES (:node, 1, :ts, 300, :joules)"
            ),
            {"node": ids["fra-a"], "ts": T, "joules": joules},
        )
    page = _render(db, "/")
    assert card_value(page, "card-energy-used") == "N/A"  # fra-a was the only NVML node
    assert f"1 node(s) left out, unknown: {UNKNOWN_ENERGY}" in text_of(
        by_id(page, "card-energy-used")
    )
    rows = {r["DC"]: r for r in by_id(page, "table-dcs").data}
    assert rows["fra"]["kWh used (IT)"] is None
    detail = _render(db, "/detail", "?dc=fra")
    nodes = {r["node"]: r for r in by_id(detail, "table-nodes").data}
    assert nodes["fra-a"]["kWh used (IT)"] is None
    win = Window("1h", NOW - HOUR_MS, NOW, MINUTE_MS)
    with db.connect() as conn:
        s = time_series(conn, win, [ids["fra-a"]])
    assert s.energy_j[s.bucket_ms.index(T)] is None
