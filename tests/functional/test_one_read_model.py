"""One read model, one meaning per ratio: for the same window of the same database, the
dashboard (its queries and its fleet page), `kvctl status --window --json` and `kvctl top
--json`'s recorded figures report the same hit ratio, sharing hit ratio and sharing share of
hits, each equal to the figure worked out by hand here.

The counts are chosen so that the three formulas "sharing ratio" once had (sharing hits per
hit, per lookup, and per reuse + sharing hit) give three different numbers: a view that used
another formula fails here. No agent runs: the recorded figures come from the database."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dashboard.app import create_app, render
from kvctl.cli.main import app as cli
from kvctl.db.analytics.counts import Assumptions
from kvctl.db.analytics.overview import overview
from kvctl.db.analytics.windows import window_for
from kvctl.db.ingest import insert_rows
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from kvctl.db.models import raw_table
from kvctl.db.rollup import MINUTE_MS
from kvctl.format import percent
from kvctl.profiles import DEFAULT_GPU, DEFAULT_MFU, DEFAULT_MODEL, MODELS
from tests.functional.agents import closed_port
from tests.functional.test_dashboard_app import by_id, card_value, text_of

runner = CliRunner()

# (node, dc, minutes before now, lookups, hits, reuse hits, sharing hits); hits also count
# chunks whose owner is unknown, so reuse + sharing < hits, as a database may hold
ROWS = [
    ("fra-a", "fra", 5, 100, 40, 20, 10),
    ("fra-b", "fra", 10, 50, 30, 10, 15),
    ("ams-a", "ams", 5, 200, 50, 25, 5),
]
#: before the 15-minute window: must not count anywhere
OLD_ROW = ("fra-a", "fra", 30, 9_999, 9_999, 9_999, 9_999)


def expected(dc: str | None) -> dict[str, float]:
    """The figures of a DC (None: the fleet), by hand."""
    rows = [r for r in ROWS if dc is None or r[1] == dc]
    lookups, hits, reuse, sharing = (sum(r[i] for r in rows) for i in (3, 4, 5, 6))
    return {
        "hit_ratio": hits / lookups,
        "sharing_hit_ratio": sharing / lookups,
        "sharing_share_of_hits": sharing / hits,
        # the formula `kvctl status` and `kvctl top` once called sharing_share_ratio
        "old_share": sharing / (reuse + sharing),
    }


FIGURES = ("hit_ratio", "sharing_hit_ratio", "sharing_share_of_hits")


def fill(url: str, now_ms: int) -> None:
    engine = open_db(url)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        add_dc(conn, "ams")
        ids = {
            name: add_node(conn, name, dc=dc, agent_url=f"http://127.0.0.1:{closed_port()}")
            for name, dc, *_ in ROWS
        }
        cache, node = [], []
        for name, _dc, minutes, lookups, hits, reuse, sharing in [*ROWS, OLD_ROW]:
            ts = now_ms - minutes * MINUTE_MS
            cache.append(
                {
                    "node_id": ids[name],
                    "tier": "all",
                    "ts_ms": ts,
                    "lookups": lookups,
                    "lookup_tokens": lookups * 256,
                    "hits": hits,
                    "hit_tokens": hits * 256,
                    "reuse_hits": reuse,
                    "sharing_hits": sharing,
                    "evictions": 0,
                    "promotions": 0,
                    "demotions": 0,
                    "bytes_read": 0,
                    "bytes_written": 0,
                    "used_bytes": 0,
                    "capacity_bytes": 0,
                    "pinned_bytes": 0,
                    "items": 0,
                }
            )
            node.append({"node_id": ids[name], "ts_ms": ts, "up": True, "scrape_seconds": 0.01})
        insert_rows(conn, raw_table("cache_sample"), cache)
        insert_rows(conn, raw_table("node_sample"), node)
    engine.dispose()


def by_dc(doc: dict[str, Any]) -> dict[str | None, dict[str, Any]]:
    """A status or recorded document's DC rows by name, and the fleet's under None."""
    return {**{d["dc"]: d for d in doc["dcs"]}, None: doc["total"]}


def test_dashboard_status_and_top_agree_on_every_ratio(tmp_path: Path) -> None:
    for dc in ("fra", "ams", None):  # the data tells the formulas apart
        e = expected(dc)
        assert len({e["sharing_hit_ratio"], e["sharing_share_of_hits"], e["old_share"]}) == 3
    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    now_ms = int(time.time() * 1000)
    fill(url, now_ms)

    # the dashboard's read model over its 15-minute window
    engine = open_db(url)
    assume = Assumptions(MODELS[DEFAULT_MODEL], DEFAULT_GPU, DEFAULT_MFU)
    with engine.connect() as conn:
        ov = overview(conn, window_for("15m", now_ms), assume)
    engine.dispose()
    dashboard = {None: ov.fleet, **ov.dcs}
    for dc, counts in dashboard.items():
        for name in FIGURES:
            assert getattr(counts, name) == pytest.approx(expected(dc)[name]), (dc, name)

    # the dashboard's fleet page shows the same figures
    dash = create_app(url, now_ms=lambda: now_ms)
    page, _ = render(dash, "/", "", "15m", None, DEFAULT_MODEL)
    dash.server.extensions["kvctl"].engine.dispose()
    fleet = expected(None)
    assert card_value(page, "card-hit-ratio") == percent(fleet["hit_ratio"])
    assert card_value(page, "card-sharing") == percent(fleet["sharing_hit_ratio"])
    sharing_card = text_of(by_id(page, "card-sharing"))
    # the same words for the same number in every view: the card names its ratio as
    # kvctl/ratios.py does, and gives the share of hits (what status shows) by its own name
    assert sharing_card.startswith("Sharing hit ratio")
    assert f"sharing (of hits) {percent(fleet['sharing_share_of_hits'])}" in sharing_card
    dc_rows = {r["DC"]: r for r in by_id(page, "table-dcs").data}
    for dc, row in dc_rows.items():
        e = expected(None if dc == "fleet" else dc)
        assert row["sharing hit ratio"] == percent(e["sharing_hit_ratio"]), dc
        assert row["sharing (of hits)"] == percent(e["sharing_share_of_hits"]), dc
        assert "sharing" not in row and "reuse" not in row  # no bare, ambiguous column
    bars = by_id(page, "fig-reuse-sharing").figure
    assert [t.name for t in bars.data] == ["reuse hit ratio", "sharing hit ratio"]

    # `kvctl status --window`: no agent is asked (they are all down)
    out = runner.invoke(cli, ["status", "--db", url, "--window", "15m", "--json"])
    assert out.exit_code == 0, out.output
    status = json.loads(out.stdout)
    assert status["window"]["name"] == "15m"
    assert {n["node"] for n in status["nodes"]} == {"fra-a", "fra-b", "ams-a"}

    # `kvctl top --json`: live figures from the (down) agents, recorded ones from the database
    args = ["--json", "--interval", "0.2", "--timeout", "0.5", "--window", "15m"]
    out = runner.invoke(cli, ["top", "--db", url, *args])
    assert out.exit_code == 0, out.output
    top = json.loads(out.stdout)
    assert top["total"]["up"] == 0

    status_dcs, top_dcs = by_dc(status), by_dc(top["recorded"])
    for dc in ("fra", "ams", None):
        for name in FIGURES:
            want = expected(dc)[name]
            assert status_dcs[dc][name] == pytest.approx(want), ("status", dc, name)
            assert top_dcs[dc][name] == pytest.approx(want), ("top", dc, name)
            assert getattr(dashboard[dc], name) == pytest.approx(status_dcs[dc][name])

    # the table for people says the same
    table = runner.invoke(cli, ["status", "--db", url, "--window", "15m"])
    assert table.exit_code == 0, table.output
    assert percent(fleet["hit_ratio"]) in table.output
    assert percent(fleet["sharing_share_of_hits"]) in table.output
    assert "reuse / sharing (of hits)" in table.output  # the header says which ratio


def test_status_window_refuses_a_bad_duration(tmp_path: Path) -> None:
    out = runner.invoke(cli, ["status", "--db", f"sqlite:///{tmp_path / 'm.db'}", "-w", "soon"])
    assert out.exit_code == 2
    assert "not a duration" in out.output
