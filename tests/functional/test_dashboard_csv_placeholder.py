"""The tables' own placeholder '-' (no RTT measured, nothing not worth fetching, no reference
figure) is shown and exported as '-': alone it is no formula in any spreadsheet, and the
CSV-injection quoting of 34a9f1d made it read "'-" on screen."""

from __future__ import annotations

from sqlalchemy.engine import Engine

from dashboard.app import create_app, render
from dashboard.components import inert
from tests.functional.dashboard_history import NOW, fill_history
from tests.functional.test_dashboard_app import by_id, url_of


def test_the_tables_placeholder_dash_is_shown_as_it_is(db: Engine) -> None:
    from kvctl.db.inventory import add_dc, add_link

    fill_history(db)
    with db.begin() as conn:
        add_dc(conn, "par")
        add_link(conn, "fra", "par", distance_km=500.0)  # never probed: its RTT basis is '-'
    app = create_app(url_of(db), now_ms=lambda: NOW)
    try:
        page, _ = render(app, "/links", "", "1h", None, None)
        rows = [r for r in by_id(page, "table-links").data if "par" in str(r["link"])]
        assert rows, "the unprobed link is listed"
        assert rows[0]["RTT basis"] == "-"
    finally:
        app.server.extensions["kvctl"].engine.dispose()
    assert inert("-") == "-"
    assert inert("-cmd") == "'-cmd"  # a formula still is quoted
