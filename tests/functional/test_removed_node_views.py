"""A node removed with `kvctl fleet rm` on a real SQLite and PostgreSQL: the dashboard and
`kvctl status --window` keep its history in the window's totals and list it as removed; the
live inventory (`kvctl fleet ls`) no longer has it."""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from dashboard.app import create_app, render
from kvctl.cli.main import app as cli
from kvctl.db.ingest import insert_rows
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.models import raw_table
from kvctl.db.rollup import MINUTE_MS
from tests.functional.agents import closed_port
from tests.functional.dashboard_history import NOW, _cache, fill_history
from tests.functional.test_dashboard_app import by_id, card_value, url_of

runner = CliRunner()


def _rm(url: str, *args: str) -> None:
    out = runner.invoke(cli, ["fleet", "rm", *args, "--yes", "--db", url])
    assert out.exit_code == 0, out.output


def _dc_rows(app: Any) -> tuple[str, dict[str, dict[str, Any]]]:
    page, _ = render(app, "/", "", "1h", None, "llama-3.1-8b")
    return card_value(page, "card-hit-ratio"), {r["DC"]: r for r in by_id(page, "table-dcs").data}


def test_the_dashboard_keeps_a_removed_nodes_history(db: Engine) -> None:
    fill_history(db)
    url = url_of(db)
    app = create_app(url, model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: NOW)
    try:
        ratio, rows = _dc_rows(app)
        assert ratio == "52.6%" and rows["fra"]["lookups"] == 150

        _rm(url, "node", "fra-a")
        ratio_after, rows_after = _dc_rows(app)
        assert ratio_after == ratio
        assert rows_after["fra"]["lookups"] == 150
        assert rows_after["fra"]["tokens saved"] == rows["fra"]["tokens saved"]
        assert rows_after["fra"]["kWh used (IT)"] == rows["fra"]["kWh used (IT)"] == 1.0
        assert rows_after["fra"]["nodes"] == "1 + 1 removed"
        # the DC's detail page lists it, marked, with its figures
        page, _ = render(app, "/detail", "?dc=fra", "1h", None, None)
        nodes = {r["node"]: r for r in by_id(page, "table-nodes").data}
        assert set(nodes) == {"fra-b", "fra-a (removed)"}
        assert nodes["fra-a (removed)"]["lookups"] == 100

        _rm(url, "dc", "fra", "--with-nodes")
        ratio_gone, rows_gone = _dc_rows(app)
        assert ratio_gone == ratio
        assert rows_gone["fra (removed)"]["lookups"] == 150
        assert "fra" not in rows_gone
    finally:
        app.server.extensions["kvctl"].engine.dispose()


def test_status_window_keeps_a_removed_nodes_history(db: Engine) -> None:
    now_ms = int(time.time() * 1000)
    with db.begin() as conn:
        add_dc(conn, "fra")
        ids = [
            add_node(conn, name, dc="fra", agent_url=f"http://127.0.0.1:{closed_port()}")
            for name in ("fra-a", "fra-b")
        ]
        insert_rows(
            conn,
            raw_table("cache_sample"),
            [
                _cache(ids[0], "all", now_ms - 5 * MINUTE_MS, lookups=100, hits=40),
                _cache(ids[1], "all", now_ms - 5 * MINUTE_MS, lookups=50, hits=10),
            ],
        )
    url = url_of(db)
    _rm(url, "node", "fra-a")
    out = runner.invoke(cli, ["status", "--db", url, "--window", "15m", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert (doc["total"]["lookups"], doc["total"]["hits"]) == (150, 50)
    assert [(n["node"], n["removed"]) for n in doc["nodes"]] == [
        ("fra-b", False),
        ("fra-a", True),
    ]
    table = runner.invoke(cli, ["status", "--db", url, "--window", "15m"])
    assert table.exit_code == 0, table.output
    assert "fra-a (removed)" in table.output and "1 + 1 removed" in table.output
    # a node asked for by name is the inventory's: the removed one is not counted
    one = runner.invoke(
        cli, ["status", "--db", url, "--window", "15m", "--node", "fra-b", "--json"]
    )
    assert one.exit_code == 0, one.output
    assert json.loads(one.stdout)["total"]["lookups"] == 50
    # the live inventory no longer has it
    ls = runner.invoke(cli, ["fleet", "ls", "--db", url, "--json"])
    assert "fra-a" not in ls.stdout
    helped = runner.invoke(cli, ["fleet", "rm", "--help"])
    said = " ".join(helped.output.replace("│", " ").split())
    assert "still count in the totals of the windows that hold them" in said
