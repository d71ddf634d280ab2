"""The dashboard against what a browser never sends and a database should not hold: callbacks
posted with inputs of the wrong type (a crafted POST to /_dash-update-component) answer 200 with
the page drawn as for no choice, not a 500 and an ERROR traceback in the log; probe rows whose
RTT is not a finite number (PostgreSQL's 'Infinity', SQLite's 9e999: written by hand or by an
older collector) leave the fleet page drawn, that link said to be unreadable; a slow PostgreSQL
query is cancelled, not left holding a worker; a name a spreadsheet would run as a formula is
exported as text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from dash import Dash
from sqlalchemy import text
from sqlalchemy.engine import Engine, make_url

from dashboard.app import create_app, render
from tests.functional.dashboard_history import NOW, fill_history
from tests.functional.test_dashboard_app import by_id, card_value, text_of, url_of, walk
from tests.functional.test_dashboard_failures import PAGE, page_inputs, post_callback


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Dash]:
    from kvctl.db.migrate import open_db

    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    db = open_db(url, auto_upgrade=True)
    fill_history(db)
    db.dispose()
    app = create_app(url, now_ms=lambda: NOW)
    yield app
    app.server.extensions["kvctl"].engine.dispose()


WRONG_TYPES: list[tuple[str, Any]] = [
    ("url.pathname", 5),
    ("url.pathname", ["/"]),
    ("url.search", {"dc": "fra"}),
    ("url.search", 7),
    ("window.value", ["1h"]),
    ("window.value", {"a": 1}),
    ("dc-filter.value", 5),
    ("dc-filter.value", "fra"),
    ("dc-filter.value", [{"a": 1}, None, 3]),
    ("model.value", ["llama-3.1-8b"]),
    ("model.value", {"a": 1}),
]


@pytest.mark.parametrize(("key", "value"), WRONG_TYPES)
def test_a_page_callback_with_an_input_of_the_wrong_type_draws_the_page(
    app: Dash, key: str, value: Any
) -> None:
    inputs = page_inputs("/")
    inputs[key] = value
    status, answer = post_callback(app, PAGE, inputs)
    assert status == 200, answer
    shown = json.dumps(answer["response"]["page"])
    assert "could not be drawn" not in shown
    assert "card-hit-ratio" in shown  # the fleet page, as for no choice


@pytest.mark.parametrize(
    ("dc", "node", "search"),
    [({"a": 1}, None, 5), ("fra", ["fra-a"], ["?dc=fra"]), (["fra"], {"n": 1}, None)],
)
def test_the_detail_picker_with_inputs_of_the_wrong_type_answers(
    app: Dash, dc: Any, node: Any, search: Any
) -> None:
    body = {
        "output": "url.search",
        "outputs": {"id": "url", "property": "search"},
        "inputs": [
            {"id": "detail-dc", "property": "value", "value": dc},
            {"id": "detail-node", "property": "value", "value": node},
        ],
        "state": [{"id": "url", "property": "search", "value": search}],
        "changedPropIds": [],
    }
    resp = app.server.test_client().post("/_dash-update-component", json=body)
    assert resp.status_code in (200, 204), resp.get_data(as_text=True)[:300]


def test_an_rtt_that_is_not_finite_leaves_the_fleet_page_drawn(db: Engine) -> None:
    fill_history(db)
    infinity = "'Infinity'" if db.dialect.name == "postgresql" else "9e999"
    with db.begin() as conn:
        conn.execute(text(f"UPDATE link_sample SET rtt_s = {infinity} WHERE ok"))
    app = create_app(url_of(db), now_ms=lambda: NOW)
    try:
        page, updated = render(app, "/", "", "1h", None, None)
        shown = text_of(page)
        assert "could not be drawn" not in shown
        assert updated.startswith("updated ")
        assert card_value(page, "card-hit-ratio") == "52.6%"
        figure = by_id(page, "fig-schematic").figure
        labels = " ".join(str(t.hovertext) for t in figure.data if t.hovertext)
        assert "ams↔fra: 100 km, RTT not a finite number" in labels
    finally:
        app.server.extensions["kvctl"].engine.dispose()


def test_a_query_postgresql_takes_too_long_to_answer_fails_the_page_not_a_worker(
    pg_url: str,
) -> None:
    """A page's query that PostgreSQL is slow to answer (a huge window, a crafted filter, a
    busy server) is cancelled after the dashboard's query timeout and the page says so, instead
    of holding one of the server's few worker threads for as long as it takes. Here the DC
    table is a view that sleeps a second per row."""
    from kvctl.db.migrate import open_db

    db = open_db(pg_url, auto_upgrade=True)
    fill_history(db)
    with db.begin() as conn:
        conn.execute(text("ALTER TABLE dc RENAME TO dc_rows"))
        conn.execute(
            text(
                "CREATE FUNCTION slow_row() RETURNS boolean LANGUAGE sql AS "
                "'SELECT pg_sleep(1); SELECT true'"
            )
        )
        conn.execute(text("CREATE VIEW dc AS SELECT * FROM dc_rows WHERE slow_row()"))
    db.dispose()
    app = create_app(pg_url, now_ms=lambda: NOW, query_timeout_s=0.2)
    try:
        page, updated = render(app, "/", "", "1h", None, None)
        shown = text_of(page)
        assert "The database cannot be read: canceling statement due to statement timeout" in (
            shown
        )
        assert updated.startswith("not updated")
    finally:
        app.server.extensions["kvctl"].engine.dispose()


#: what a spreadsheet runs when it opens the table's CSV export: a cell starting =, @, + or -
#: (not a number), tab or CR is a formula
FORMULAS = ['=HYPERLINK("http://evil.example","hi")', "@SUM(1+1)", "-cmd|' /C calc'!A0"]


def test_the_csv_export_of_a_table_runs_no_formula_a_name_holds(db: Engine) -> None:
    """DC and node names are any printable text (the inventory's rule): in a table's data (what
    its CSV export writes) a cell that a spreadsheet would run as a formula is quoted with a
    leading apostrophe; numbers, signed figures and ordinary names are left as they are."""
    from kvctl.db.inventory import add_dc, add_node

    fill_history(db)
    with db.begin() as conn:
        add_dc(conn, FORMULAS[0])
        for i, name in enumerate(FORMULAS[1:]):
            add_node(conn, name, dc=FORMULAS[0], agent_url=f"http://127.0.0.1:{9 + i}")
    app = create_app(url_of(db), now_ms=lambda: NOW)
    try:
        fleet, _ = render(app, "/", "", "1h", None, None)
        detail, _ = render(app, "/detail", "?" + urlencode({"dc": FORMULAS[0]}), "1h", None, None)
        cells = [
            v
            for page, table_id in [(fleet, "table-dcs"), (detail, "table-nodes")]
            for row in by_id(page, table_id).data
            for v in row.values()
        ]
        texts = [c for c in cells if isinstance(c, str)]
        for formula in FORMULAS:
            assert formula not in texts
            assert "'" + formula in texts, formula
        assert not [c for c in texts if c[:1] in ("=", "@", "\t", "\r")]
        assert "fra" in texts and "ams" in texts  # names are shown as they are
    finally:
        app.server.extensions["kvctl"].engine.dispose()


def test_inert_leaves_figures_and_plain_text_alone() -> None:
    from dashboard.components import inert

    for kept in ("+1.2 pts", "-3", "-0.5 ms", "-.5", "fra-a", "52.6%", "", "N/A", "-", 5, None):
        assert inert(kept) == kept
    for formula in [*FORMULAS, "+cmd", "--", "\t=1", "\r=1"]:
        assert inert(formula) == "'" + formula


def test_a_password_in_the_database_urls_query_is_not_shown_on_the_page() -> None:
    """libpq takes the password (and the SSL key's) in the URL's query too: the page naming
    the database it cannot read must not show them to whoever opens the dashboard."""
    from tests.functional.agents import closed_port

    port = closed_port()
    url = f"postgresql://kvctl@127.0.0.1:{port}/kvctl?password=s3cret&sslpassword=k3y"
    app = create_app(url, now_ms=lambda: NOW)
    try:
        status, answer = post_callback(app, PAGE, page_inputs("/"))
        assert status == 200
        shown = json.dumps(answer["response"])
        assert "The database cannot be read" in shown
        assert f"kvctl@127.0.0.1:{port}/kvctl" in shown
        assert "s3cret" not in shown and "k3y" not in shown
    finally:
        app.server.extensions["kvctl"].engine.dispose()


def _schema_behind_of(engine: Any) -> str:
    """What ``schema_behind`` says of ``engine``'s database on a read of a newer table."""
    from sqlalchemy.exc import SQLAlchemyError

    from kvctl.db.migrate import schema_behind

    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT count(*) FROM removed_node"))
    except SQLAlchemyError as exc:
        said = schema_behind(engine, exc)
        assert said is not None
        return said
    raise AssertionError("removed_node is read at revision 0007")


def test_a_schema_behind_the_code_says_which_revision_and_to_upgrade(empty_db_url: str) -> None:
    """A database left at an older revision (PostgreSQL is upgraded only by `kvctl db upgrade`;
    one restored from a backup) fails the pages that read newer tables: each says where the
    schema is, what this dashboard needs and the command, rather than only 'relation ... does
    not exist'; a revision this kvctl does not know says kvctl is the older one."""
    from sqlalchemy import create_engine

    from kvctl.db.engine import resolve_url
    from kvctl.db.migrate import head_revision, upgrade

    raw = create_engine(resolve_url(empty_db_url))
    upgrade(raw, "0007")
    app = create_app(empty_db_url, now_ms=lambda: NOW)
    try:
        for path in ("/", "/routing"):
            page, updated = render(app, path, "", "1h", None, None)
            shown = text_of(page)
            # the words of schema_behind (the collector's, open_db's): one message, one place
            said = _schema_behind_of(raw)
            assert said.startswith("the database at ") and "is at schema revision 0007, " in said
            assert f"this kvctl needs {head_revision()}: run `kvctl db upgrade --db " in said
            assert f"{said[:1].upper()}{said[1:]}." in shown, shown
            assert updated.startswith("not updated")
        with raw.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
        page, _ = render(app, "/", "", "1h", None, None)
        said = _schema_behind_of(raw)
        assert "at schema revision 9999, which this kvctl does not know" in said
        assert f"{said[:1].upper()}{said[1:]}." in text_of(page), text_of(page)
    finally:
        app.server.extensions["kvctl"].engine.dispose()
        raw.dispose()


def test_a_database_path_that_stops_answering_fails_the_page_not_a_worker(pg_url: str) -> None:
    """PostgreSQL reached through something that keeps the connection and stops passing bytes
    (a hung pgbouncer or proxy, a half-dead NAT): the server's statement timeout never reaches
    the dashboard, so each callback waited for as long as the path stayed stuck, until every
    waitress thread did. The page says the database did not answer within its time, then
    draws again once the path passes bytes again."""
    import threading

    from kvctl.db.migrate import open_db
    from tests.functional.test_pool_outage import TcpProxy

    db = open_db(pg_url, auto_upgrade=True)
    fill_history(db)
    db.dispose()
    proxy = TcpProxy(("127.0.0.1", make_url(pg_url).port or 5432))
    app = create_app(
        str(make_url(pg_url).set(host="127.0.0.1", port=proxy.port)),
        now_ms=lambda: NOW,
        query_timeout_s=0.5,
    )
    try:
        page, _ = render(app, "/", "", "1h", None, None)
        assert card_value(page, "card-hit-ratio") == "52.6%"
        proxy.stall()
        answers: list[tuple[list[Any], str]] = []
        worker = threading.Thread(
            target=lambda: answers.append(render(app, "/", "", "1h", None, None)), daemon=True
        )
        worker.start()
        worker.join(60)  # a hang guard only
        assert answers, "the page still waits on a database that does not answer"
        page, updated = answers[0]
        assert "The database did not answer within" in text_of(page)
        assert updated.startswith("not updated")
        proxy.restore()
        page, _ = render(app, "/", "", "1h", None, None)
        assert card_value(page, "card-hit-ratio") == "52.6%"
    finally:
        proxy.restore()
        app.server.extensions["kvctl"].engine.dispose()
        proxy.close()


@pytest.mark.parametrize("prefix", ["//evil.example/", "/a b/", '/a"b/', "/kvctl/?x=1/", "/#/"])
def test_a_url_prefix_that_is_not_a_plain_path_is_refused(tmp_path: Path, prefix: str) -> None:
    """The prefix is written into the page's script URLs: '//evil.example/' made the page at
    /evil.example/ load every script from evil.example (a protocol-relative URL), a typo of
    '//kvctl/' from a host named kvctl."""
    with pytest.raises(ValueError, match="URL prefix"):
        create_app(f"sqlite:///{tmp_path / 'metrics.db'}", url_prefix=prefix)


def test_the_cli_reads_repeated_slashes_in_the_prefix_as_one(tmp_path: Path) -> None:
    """`--url-prefix //kvctl` (a typo) is /kvctl/, not a page whose scripts come from a host
    named kvctl; a prefix with characters a path segment should not hold is refused before
    anything listens."""
    from typer.testing import CliRunner

    from kvctl.cli.dashboard import url_prefix_of
    from kvctl.cli.main import app as cli
    from kvctl.db.migrate import open_db

    assert url_prefix_of("//kvctl") == "/kvctl/"
    assert url_prefix_of("kvctl//ops/") == "/kvctl/ops/"
    assert url_prefix_of("/") == "/"
    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    open_db(url, auto_upgrade=True).dispose()
    result = CliRunner().invoke(cli, ["dashboard", "--db", url, "--url-prefix", "/a b"])
    assert result.exit_code != 0
    assert "URL prefix" in result.output


def test_a_callback_body_far_larger_than_the_browser_sends_is_refused(app: Dash) -> None:
    """A page callback's body is a few kB; a crafted one of megabytes (a DC filter of 300,000
    names) was parsed, held in memory and turned into a query: it is refused (413) first."""
    inputs = page_inputs("/")
    inputs["dc-filter.value"] = [f"dc-{i}" for i in range(300_000)]
    status, _ = post_callback(app, PAGE, inputs)
    assert status == 413
    status, answer = post_callback(app, PAGE, page_inputs("/"))  # the browser's still served
    assert status == 200 and "card-hit-ratio" in json.dumps(answer)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)


def test_markup_in_a_name_is_shown_as_text_in_the_charts(db: Engine) -> None:
    """Plotly reads tags in a chart's text (axis categories, labels, legend and hover): a DC
    named <a href="https://evil.example/">...</a> was a link in the managers' charts, and <br>
    or <span style=...> re-laid them out. Names reach the charts with < and > as entities,
    which plotly shows as the characters."""
    from kvctl.db.inventory import add_dc, add_link, add_node

    link = '<a href="https://evil.example/">fra2</a>'
    fill_history(db)
    with db.begin() as conn:
        add_dc(conn, link)
        add_node(conn, "<b>big</b>", dc=link, agent_url="http://127.0.0.1:9")
        add_link(conn, "fra", link, distance_km=10.0)
    app = create_app(url_of(db), now_ms=lambda: NOW)
    try:
        graphs = []
        for path in ("/", "/links"):
            page, _ = render(app, path, "", "1h", None, None)
            graphs += [c for c in walk(page) if getattr(c, "figure", None) is not None]
        assert graphs
        shown = [s for g in graphs for s in _strings(g.figure.to_plotly_json()["data"])]
        assert not [s for s in shown if "<" in s or ">" in s]
        assert '&lt;a href="https://evil.example/"&gt;fra2&lt;/a&gt;' in shown
    finally:
        app.server.extensions["kvctl"].engine.dispose()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "", "127.example.com"])
def test_the_cli_serves_beyond_loopback_only_with_a_password(
    tmp_path: Path, host: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Security by default: any address but loopback needs --auth-user, and --auth-user needs
    $KVCTL_DASHBOARD_PASSWORD (never a password on the command line); both are refused before
    the database is opened or anything listens. A guard on existing behaviour."""
    from typer.testing import CliRunner

    from kvctl.cli.main import app as cli

    monkeypatch.delenv("KVCTL_DASHBOARD_PASSWORD", raising=False)
    url = f"sqlite:///{tmp_path / 'none.db'}"
    result = CliRunner().invoke(cli, ["dashboard", "--db", url, "--host", host])
    assert result.exit_code != 0
    assert "without authentication" in result.output
    result = CliRunner().invoke(cli, ["dashboard", "--db", url, "--host", host, "--auth-user", "u"])
    assert result.exit_code != 0
    assert "KVCTL_DASHBOARD_PASSWORD" in result.output
    assert not (tmp_path / "none.db").exists()
