"""The dashboard app on a known history (SQLite and PostgreSQL): the page callback called
directly shows the hand-worked headline figures, filters and empty states; the server is
read-only, honours its URL prefix and, when asked, basic auth."""

from __future__ import annotations

import base64
import math
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from dashboard.app import create_app, render
from kvctl.db.plans import save_plan
from kvctl.format import format_number
from tests.functional.dashboard_history import NOW, fill_history


def url_of(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def walk(component: Any) -> Iterator[Any]:
    """Every component below ``component`` (lists, children), depth first."""
    if isinstance(component, list | tuple):
        for c in component:
            yield from walk(c)
        return
    if component is None or isinstance(component, str | int | float):
        return
    yield component
    yield from walk(getattr(component, "children", None))


def text_of(component: Any) -> str:
    if isinstance(component, list | tuple):
        return " ".join(text_of(c) for c in component)
    if isinstance(component, str | int | float):
        return str(component)
    if component is None:
        return ""
    return text_of(getattr(component, "children", None))


def by_id(page: Any, wanted: str) -> Any:
    for c in walk(page):
        if getattr(c, "id", None) == wanted:
            return c
    raise AssertionError(f"no component {wanted!r} on the page")


def card_value(page: Any, card_id: str) -> str:
    card = by_id(page, card_id)
    return next(c for c in walk(card) if getattr(c, "className", "") == "card-value").children


@pytest.fixture
def app(db: Engine):  # type: ignore[no-untyped-def]
    fill_history(db)
    app = create_app(url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: NOW)
    yield app
    app.server.extensions["kvctl"].engine.dispose()


def test_fleet_page_shows_the_hand_worked_headlines(app: Any) -> None:
    page, updated = render(app, "/", "", "1h", None, "llama-3.1-8b")
    assert card_value(page, "card-hit-ratio") == "52.6%"  # 100 hits of 190 lookups
    assert card_value(page, "card-sharing") == "26.3%"  # 50 of 190
    assert card_value(page, "card-tokens") == "25,600"
    assert "counted at lookup" in text_of(by_id(page, "card-tokens"))  # not "served"
    assert card_value(page, "card-energy-used") == "1 kWh"
    assert card_value(page, "card-carbon").endswith(" g CO2")  # well under a kg
    assert card_value(page, "card-tokens-per-joule") == format_number(12_000 / 3.6e6)
    assert card_value(page, "card-ttft").startswith("200.0 ms vs ")
    assert "measured" in text_of(by_id(page, "card-hit-ratio"))
    assert "modeled" in text_of(by_id(page, "card-carbon"))
    # TTFT without cache is modeled (measured TTFT + modeled prefill): the badge says both
    assert text_of(by_id(page, "card-ttft")).startswith(
        "TTFT with vs without cache measured vs modeled"
    )
    table = by_id(page, "table-dcs")
    rows = {r["DC"]: r for r in table.data}
    assert rows["fra"]["hit ratio"] == "46.7%" and rows["ams"]["hit ratio"] == "75.0%"
    assert rows["fleet"]["lookups"] == 190
    assert table.export_format == "csv"
    assert "updated" in updated
    # every section says its basis and window
    for section in (c for c in walk(page) if getattr(c, "className", "") == "section"):
        label = text_of(section)
        assert "measured" in label or "modeled" in label


def test_dc_filter_narrows_the_headlines(app: Any) -> None:
    page, _ = render(app, "/", "", "1h", ["ams"], "llama-3.1-8b")
    assert card_value(page, "card-hit-ratio") == "75.0%"
    assert [r["DC"] for r in by_id(page, "table-dcs").data] == ["ams", "selected"]
    # ams has no NVML, no engine, no grid intensity: said so, not zero
    assert card_value(page, "card-ttft") == "N/A"
    assert "no engine metrics" in text_of(by_id(page, "card-ttft"))
    assert "without intensity left out" in text_of(by_id(page, "card-carbon"))
    assert card_value(page, "card-carbon") == "N/A"  # unknown, not zero


def test_model_profile_changes_modeled_figures_only(app: Any) -> None:
    small, _ = render(app, "/", "", "1h", None, "qwen2.5-0.5b")
    big, _ = render(app, "/", "", "1h", None, "llama-3.1-70b")
    assert card_value(small, "card-hit-ratio") == card_value(big, "card-hit-ratio")
    small_s = float(card_value(small, "card-gpu-hours").removesuffix(" GPU-s"))
    big_s = float(card_value(big, "card-gpu-hours").removesuffix(" GPU-s"))
    assert big_s / small_s == pytest.approx(70.6 / 0.494, rel=0.01)


def test_detail_page_for_a_dc_and_a_node(app: Any) -> None:
    page, _ = render(app, "/detail", "?dc=fra", "1h", None, None)
    assert "Detail: DC fra" in text_of(page)
    by_id(page, "fig-occupancy")
    nodes = {r["node"]: r for r in by_id(page, "table-nodes").data}
    assert set(nodes) == {"fra-a", "fra-b"} and nodes["fra-a"]["evictions"] == 7
    page, _ = render(app, "/detail", "?dc=fra&node=fra-a", "1h", None, None)
    events = by_id(page, "table-events").data
    kinds = [e["event"] for e in events]
    assert "restart" in kinds and "down" in kinds and "evictions" in kinds
    down = next(e for e in events if e["event"] == "down")
    assert "connection refused" in down["detail"]
    by_id(page, "fig-power")
    page, _ = render(app, "/detail", "?dc=ams", "1h", None, None)
    assert "NVML unavailable" in text_of(page)


def test_links_page(app: Any) -> None:
    page, _ = render(app, "/links", "", "1h", None, None)
    by_id(page, "fig-rtt-matrix")
    (row,) = by_id(page, "table-links").data
    assert row["link"] == "ams↔fra" and row["probes"] == 3 and row["ok"] == "66.7%"
    assert row["RTT mean"] == "3.0 ms" and row["Gb/s"] == 16.0
    assert row["verdict"] in ("fetch", "recompute")


def test_capacity_page_empty_then_with_a_saved_plan(app: Any, db: Engine) -> None:
    page, _ = render(app, "/capacity", "", "1h", None, None)
    assert "No capacity plan saved" in text_of(page)
    from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
    from kvctl.workload.plan import plan
    from kvctl.workload.source import load_workload

    w = load_workload(None, seed=0, limit=60, workload="chat")
    report = plan(
        w.requests,
        tiers_bytes={"cpu": 2**30, "disk": 2**33, "remote": 2**36},
        inputs=ModeledInputs(model_profile("llama-3.1-8b"), gpu_profile("h100")),
        curve_points=4,
        workload_name=w.name,
    ).as_dict()
    with db.begin() as conn:
        save_plan(conn, report, dc="fra", now_ms=NOW)
    page, _ = render(app, "/capacity", "", "1h", None, None)
    by_id(page, "fig-mrc-fra")
    rows = by_id(page, "table-plan-fra").data
    assert [r["configuration"] for r in rows] == [c["name"] for c in report["candidates"]]
    assert (
        rows[0]["hit ratio (simulated)"]
        == f"{report['candidates'][0]['simulated']['hit_ratio'] * 100:.1f}%"
    )


def test_empty_window_and_unknown_page(app: Any) -> None:
    page, _ = render(app, "/", "", "15m", None, None)  # the last samples are 30 min old
    assert card_value(page, "card-hit-ratio") == "N/A"
    # no lookups: what the cache saved is unknown, like the hit ratio, not "0 GPU-s" or "0 J"
    for card_id in ("card-tokens", "card-gpu-hours", "card-energy", "card-carbon"):
        assert card_value(page, card_id) == "N/A", card_id
    for row in by_id(page, "table-dcs").data:
        saved = [v for k, v in row.items() if "saved" in k]
        assert saved and all(v is None for v in saved), row
    assert "No cache lookups recorded" in text_of(page)
    assert "kvctl collect" in text_of(page)
    page, _ = render(app, "/nope", "", "1h", None, None)
    assert "No page at /nope" in text_of(page)


def test_the_server_is_read_only(app: Any, db: Engine) -> None:
    engine = app.server.extensions["kvctl"].engine
    before = _count(db, "cache_sample")
    with pytest.raises(DBAPIError, match=r"(?i)read.?only"), engine.begin() as conn:
        conn.execute(text("DELETE FROM cache_sample"))  # no constraint stands in the way
    assert _count(db, "cache_sample") == before > 0


def _count(db: Engine, table: str) -> int:
    with db.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


@pytest.mark.parametrize(
    ("host", "served"),
    [
        ("127.0.0.1:8050", True),
        ("localhost:8050", True),
        ("[::1]:8050", True),
        ("evil.example", False),
        ("127.0.0.1.nip.io:8050", False),
    ],
)
def test_without_a_password_only_requests_naming_this_host_are_served(
    db: Engine, host: str, served: bool
) -> None:
    """DNS rebinding: a page whose domain points at 127.0.0.1 sends its own name as the Host.
    Before, it got the fleet's pages (200) from a dashboard served without a password."""
    app = create_app(url_of(db), now_ms=lambda: NOW)
    client = app.server.test_client()
    for path in ("/", "/_dash-layout"):
        got = client.get(path, headers={"Host": host})
        assert (got.status_code == 200) == served, (path, got.status_code)
        if not served:
            assert got.status_code == 403 and b"--auth-user" in got.data
    # with a password, any name: it is what a page cannot send
    guarded = create_app(url_of(db), basic_auth=("ops", "s3cret"), now_ms=lambda: NOW)
    good = {"Authorization": "Basic " + base64.b64encode(b"ops:s3cret").decode()}
    assert guarded.server.test_client().get("/", headers={"Host": host, **good}).status_code == 200
    for made in (app, guarded):
        made.server.extensions["kvctl"].engine.dispose()


def test_url_prefix_and_basic_auth(db: Engine) -> None:
    fill_history(db)
    app = create_app(
        url_of(db), url_prefix="/kvctl/", basic_auth=("ops", "s3cret"), now_ms=lambda: NOW
    )
    client = app.server.test_client()
    assert client.get("/kvctl/").status_code == 401
    bad = base64.b64encode(b"ops:wrong").decode()
    assert client.get("/kvctl/", headers={"Authorization": f"Basic {bad}"}).status_code == 401
    good = {"Authorization": "Basic " + base64.b64encode(b"ops:s3cret").decode()}
    assert client.get("/kvctl/", headers=good).status_code == 200
    assert client.get("/kvctl/_dash-layout", headers=good).status_code == 200
    assert client.get("/_dash-layout", headers=good).status_code == 404
    page, _ = render(app, "/kvctl/links", "", "1h", None, None)
    by_id(page, "table-links")
    bad = {"Authorization": "Basic é"}  # not ASCII: refused, not an error
    assert client.get("/kvctl/", headers=bad).status_code == 401
    app.server.extensions["kvctl"].engine.dispose()


@pytest.mark.parametrize(
    "ttft_sum_s", [math.nan, math.inf, -1.0], ids=["nan", "infinite", "negative"]
)
def test_a_nodes_impossible_ttft_seconds_are_unknown_not_zero(
    db: Engine, ttft_sum_s: float
) -> None:
    """An engine row written by hand with 5 first tokens and a TTFT sum of NaN: SQLite stores
    the NaN as NULL, so the sum read as 0 s and the card's mean fell from fra-a's 200.0 ms to
    133.3 ms (2 s over 15 tokens); PostgreSQL's NaN or an Infinity showed N/A for the whole
    fleet, inf in `kvctl status --json`. The node's TTFT is unknown, left out with the reason;
    fra-a's is shown, on both backends."""
    from sqlalchemy import select

    from kvctl.db.analytics.counts import UNKNOWN_TTFT
    from kvctl.db.models import Node
    from tests.functional.dashboard_history import T

    fill_history(db)
    with db.begin() as conn:
        fra_b = conn.execute(select(Node.id).where(Node.name == "fra-b")).scalar_one()
        conn.execute(
            text(
                "INSERT INTO engine_sample (node_id, ts_ms, engine, prompt_tokens, requests, "
                "ttft_count, ttft_sum_s) VALUES (:node, :ts, 'vllm', 100, 5, 5, :sum_s)"
            ),
            {"node": fra_b, "ts": T, "sum_s": ttft_sum_s},
        )
    app = create_app(url_of(db), model="llama-3.1-8b", default_gpu="a100", now_ms=lambda: NOW)
    try:
        page, _ = render(app, "/", "", "1h", None, None)
    finally:
        app.server.extensions["kvctl"].engine.dispose()
    assert card_value(page, "card-ttft").startswith("200.0 ms vs "), card_value(page, "card-ttft")
    assert f"1 node(s) left out, unknown: {UNKNOWN_TTFT}" in text_of(by_id(page, "card-ttft"))
