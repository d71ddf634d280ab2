"""The dashboard when something goes wrong, through its real server (Flask's test client posting
the callbacks as the browser does): a page whose code raises says so on the page instead of a
failed callback (a blank page, or Dash's error overlay); a database that cannot be reached is
named (password masked) on every page while the DC filter keeps its choices; figures that end
where collection stopped say so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dash import Dash

from dashboard.app import create_app, render
from dashboard.pages import PAGES
from kvctl.db.migrate import open_db
from kvctl.db.plans import save_plan
from kvctl.db.rollup import DAY_MS, MINUTE_MS
from kvctl.format import format_utc_minute
from tests.functional.agents import closed_port
from tests.functional.dashboard_history import NOW, T, fill_history
from tests.functional.test_dashboard_app import by_id, text_of

PAGE = "..page.children...updated.children.."


def post_callback(app: Dash, output: str, inputs: dict[str, Any]) -> tuple[int, Any]:
    """Post one callback as the browser does: its HTTP status and decoded answer."""
    outputs = [
        dict(zip(("id", "property"), o.split(".", 1), strict=True))
        for o in output.strip(".").split("...")
    ]
    body = {
        "output": output,
        "outputs": outputs if len(outputs) > 1 else outputs[0],
        "inputs": [
            {"id": k.split(".")[0], "property": k.split(".")[1], "value": v}
            for k, v in inputs.items()
        ],
        "changedPropIds": [],
        "state": [],
    }
    resp = app.server.test_client().post("/_dash-update-component", json=body)
    return resp.status_code, resp.get_json() if resp.is_json else resp.get_data(as_text=True)


def page_inputs(path: str) -> dict[str, Any]:
    return {
        "url.pathname": path,
        "url.search": "",
        "window.value": "1h",
        "dc-filter.value": None,
        "model.value": "llama-3.1-8b",
        "refresh.n_intervals": 1,
    }


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Dash]:
    """The known history in SQLite, with a capacity plan saved by a kvctl whose report lacks
    what this one reads (its candidates' simulated and modeled figures)."""
    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    db = open_db(url, auto_upgrade=True)
    fill_history(db)
    report = {
        "workload": "chat",
        "miss_ratio_curve": {"points": [{"capacity_bytes": 2**30, "lru_hit_ratio": 0.4}]},
        "candidates": [{"name": "more DRAM", "tiers_bytes": {"cpu": 2**31}}],
    }
    with db.begin() as conn:
        save_plan(conn, report, dc="fra", now_ms=NOW)
    db.dispose()
    app = create_app(url, now_ms=lambda: NOW)
    yield app
    app.server.extensions["kvctl"].engine.dispose()


def test_a_page_whose_code_raises_says_so_and_the_others_still_work(
    app: Dash, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(_ctx: Any) -> list[Any]:
        return [{}["simulated"]]

    # a page of the dashboard's own whose code raises: a bug, not the database
    monkeypatch.setitem(PAGES, "/capacity", ("Capacity", broken))
    page, updated = render(app, "/capacity", "", "1h", None, None)
    shown = text_of(page)
    assert "This page could not be drawn: KeyError: 'simulated'" in shown
    assert "the dashboard's log has the traceback" in shown
    assert updated.startswith("not updated: the page failed at ")
    # the browser's callback succeeds, with that message, instead of an HTTP 500
    status, answer = post_callback(app, PAGE, page_inputs("/capacity"))
    assert status == 200
    assert "This page could not be drawn" in json.dumps(answer["response"]["page"])
    # the other pages do not depend on it
    fleet, _ = render(app, "/", "", "1h", None, None)
    by_id(fleet, "card-hit-ratio")


def test_a_plan_saved_by_an_older_kvctl_says_to_save_it_again_and_the_others_show(
    app: Dash, tmp_path: Path
) -> None:
    """The fixture's plan for fra lacks what this kvctl's reports hold (its candidates'
    simulated and modeled figures): that plan says so and how to save it again, instead of
    the whole capacity page reading 'could not be drawn ... a bug in the dashboard'; a
    current plan for the fleet beside it is drawn."""
    from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
    from kvctl.workload.plan import plan
    from kvctl.workload.source import load_workload

    w = load_workload(None, seed=0, limit=40, workload="chat")
    report = plan(
        w.requests,
        tiers_bytes={"cpu": 2**30, "disk": 2**33},
        inputs=ModeledInputs(model_profile("llama-3.1-8b"), gpu_profile("h100")),
        curve_points=3,
        workload_name=w.name,
    ).as_dict()
    db = open_db(f"sqlite:///{tmp_path / 'metrics.db'}")
    with db.begin() as conn:
        save_plan(conn, report, dc=None, now_ms=NOW)
    db.dispose()
    page, updated = render(app, "/capacity", "", "1h", None, None)
    shown = text_of(page)
    assert "could not be drawn" not in shown
    assert updated.startswith("updated ")
    assert "The plan saved for DC fra has a shape this dashboard does not read" in shown
    assert "kvctl plan --trace TRACE --save --dc fra" in shown
    by_id(page, "fig-mrc-fleet")
    by_id(page, "table-plan-fleet")


def test_an_unreachable_database_is_named_and_the_dc_filter_keeps_its_choices() -> None:
    url = f"postgresql://kvctl:s3cret@127.0.0.1:{closed_port()}/kvctl"
    app = create_app(url, now_ms=lambda: NOW)
    try:
        # the DC filter's callback changes nothing (its choices stay), instead of failing (500)
        status, answer = post_callback(app, "dc-filter.options", {"refresh.n_intervals": 1})
        assert status == 200 and answer["response"] == {}
        status, answer = post_callback(app, PAGE, page_inputs("/"))
        assert status == 200
        shown = json.dumps(answer["response"]["page"])
        assert "The database cannot be read" in shown and "Connection refused" in shown
        assert f"127.0.0.1:{url.rsplit(':', 1)[1].split('/')[0]}/kvctl" in shown
        assert "s3cret" not in shown
    finally:
        app.server.extensions["kvctl"].engine.dispose()


def test_every_page_says_when_collection_stopped(tmp_path: Path) -> None:
    """The known history's last scrape is ten minutes before NOW: five minutes after it the
    pages are as they were; two days after it every page opens with when scrapes stopped,
    whatever its window (the fitted one ends there, a named one is empty)."""
    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    db = open_db(url, auto_upgrade=True)
    clock = [NOW]
    app = create_app(url, now_ms=lambda: clock[0])
    try:
        page, _ = render(app, "/", "", None, None, None)
        assert "No scrape recorded" not in text_of(page)  # an empty database: nothing stopped
        fill_history(db)
        last_ms = T + 30 * MINUTE_MS
        clock[0] = last_ms + 5 * MINUTE_MS
        page, _ = render(app, "/", "", None, None, None)
        assert "No scrape recorded" not in text_of(page)
        clock[0] = last_ms + 2 * DAY_MS
        for path, window in [("/", None), ("/detail", "1h"), ("/links", None), ("/routing", "15m")]:
            page, _ = render(app, path, "", window, None, None)
            banner = text_of(by_id(page, "collection-stopped"))
            assert banner.startswith(
                f"No scrape recorded since {format_utc_minute(last_ms)} (2d"
            ), (path, banner)
            assert "kvctl collect" in banner
            assert page[0].id == "collection-stopped"  # before the figures it qualifies
    finally:
        app.server.extensions["kvctl"].engine.dispose()
        db.dispose()
