"""The dashboard's one factory, used by `kvctl dashboard`, the demo and the tests.

Read-only by construction: SQLite connections run with ``query_only``, PostgreSQL sessions
are read-only transactions, and no page writes. Optional HTTP basic auth guards every route;
a URL prefix lets it sit behind a reverse proxy that passes the path through unchanged.
"""

from __future__ import annotations

import base64
import hmac
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar
from urllib.parse import parse_qs, urlencode

import dash
from dash import Input, Output, State, dcc, html
from sqlalchemy import event
from sqlalchemy.engine import Engine

from dashboard.components import empty
from dashboard.pages import PAGES, PageContext
from kvctl.db.analytics.counts import Assumptions
from kvctl.db.analytics.windows import (
    DEFAULT_WINDOW,
    FIT,
    WINDOWS,
    Window,
    collection_stopped,
    fitted_window,
    window_for,
)
from kvctl.db.engine import follow_the_path
from kvctl.format import compact_duration, format_utc_minute
from kvctl.profiles import DEFAULT_GPU, DEFAULT_MFU, DEFAULT_MODEL, GPUS, MODELS

T = TypeVar("T")
DEFAULT_REFRESH_SECONDS: Final = 30
#: a page's query stopped after this long (PostgreSQL's statement_timeout; on SQLite the
#: dashboard interrupts it): a slow server, a huge window or a crafted filter otherwise holds
#: one of the server's few worker threads (or a reading thread) for as long as it takes
DEFAULT_QUERY_TIMEOUT_S: Final = 60.0
#: the longest query timeout: PostgreSQL's statement_timeout is at most 2^31-1 ms (a larger one
#: fails every connection), and a page cannot wait an infinite time ('inf': an OverflowError)
MAX_QUERY_TIMEOUT_S: Final = 2_147_483.0
#: SQLite virtual-machine steps between two looks at a query's deadline (a few ms of work)
SQLITE_STEPS_PER_CHECK: Final = 10_000
#: the largest request body served: a callback's is a few kB (a path, a window, the DCs
#: picked); a crafted one of megabytes would be parsed, held and queried before anything else
MAX_REQUEST_BYTES: Final = 1 << 20
#: a page not drawn this long after its query timeout says the database did not answer: a path
#: that keeps the connection and passes no byte (a hung proxy or pgbouncer) never delivers the
#: server's cancellation, and would hold the callback's worker for as long as it stays stuck
PAGE_GRACE_S: Final = 5.0
log = logging.getLogger("kvctl.dashboard")
CSS: Final = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 0; color: #1b2733;
       background: #f5f7fa; }
header { background: #1f3b57; color: #fff; padding: 10px 20px; display: flex; gap: 24px;
         align-items: center; flex-wrap: wrap; }
header a { color: #cfe3f5; margin-right: 14px; text-decoration: none; }
header a:hover { color: #fff; }
header h1 { font-size: 18px; margin: 0; }
.controls { display: flex; gap: 16px; align-items: center; padding: 10px 20px;
            background: #fff; border-bottom: 1px solid #dde3ea; flex-wrap: wrap; }
.controls label { font-size: 12px; color: #556; margin-right: 4px; }
main { padding: 10px 20px 40px; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(210px, 1fr)); gap: 12px; }
.card { background: #fff; border: 1px solid #dde3ea; border-radius: 6px; padding: 10px 12px; }
.card-title { font-size: 13px; color: #556; margin-right: 6px; }
.card-value { font-size: 24px; font-weight: 600; margin: 4px 0; }
.card-note, .section-note, .window, .inputs-note { font-size: 12px; color: #667; }
.window { margin-right: 12px; }
.basis { font-size: 11px; padding: 1px 6px; border-radius: 8px; margin-right: 8px; }
.basis-measured { background: #dff0d8; color: #2d6a2d; }
.basis-modeled { background: #fcefd8; color: #8a5a00; }
.basis-emulated { background: #f3e3f7; color: #6a2c7a; }
.basis-replayed { background: #dcebf7; color: #1f4f7a; }
.basis-measured-emulated { background: #f3e3f7; color: #2d6a2d; }
.basis-measured-modeled { background: #fcefd8; color: #2d6a2d; }
.section { background: #fff; border: 1px solid #dde3ea; border-radius: 6px; padding: 10px 14px;
           margin-top: 14px; }
.section h3 { margin: 0 0 4px; font-size: 15px; }
.empty { padding: 16px; background: #fffbe8; border: 1px dashed #e0c872; border-radius: 6px;
         margin-top: 12px; }
.stale { padding: 12px 16px; background: #fdecea; border: 1px solid #e0a39b; border-radius: 6px;
         margin-top: 12px; }
.empty-hint { font-size: 13px; color: #665; margin-top: 4px; font-family: ui-monospace, monospace; }
.pickers { display: flex; gap: 16px; }
.picker { min-width: 220px; }
.error { color: #a00; }
"""


@dataclass(frozen=True, slots=True)
class DashboardConfig:
    engine: Engine
    assume: Assumptions
    refresh_seconds: float
    now_ms: Callable[[], int]
    #: how long a page (or the DC filter) may wait on the database in all
    page_timeout_s: float = DEFAULT_QUERY_TIMEOUT_S + PAGE_GRACE_S
    #: how long one of its queries may run before it is stopped
    query_timeout_s: float = DEFAULT_QUERY_TIMEOUT_S


#: a URL prefix the page's script URLs can start with: a path, never '//host/' (a
#: protocol-relative URL: every script from that host) nor a query, fragment, quote, space, '&'
#: or '%'; its segments hold letters of any script, digits and what RFC 3986 allows in one
_URL_PREFIX: Final = re.compile(r"/(?:[\w.~:@+,;=!$*()-]+/)*")


def read_only(engine: Engine, query_timeout_s: float = DEFAULT_QUERY_TIMEOUT_S) -> Engine:
    """Make every connection of ``engine`` refuse writes: the dashboard only reads. Its
    statements are stopped after ``query_timeout_s``: PostgreSQL's statement_timeout (over the
    URL's own); SQLite has none, so a progress handler interrupts a statement past its deadline
    (set as each one starts), else its page's reading thread would run it to the end."""
    sqlite = engine.dialect.name == "sqlite"

    @event.listens_for(engine, "connect")
    def _read_only(dbapi_conn: Any, record: Any) -> None:
        cur = dbapi_conn.cursor()
        if sqlite:
            cur.execute("PRAGMA query_only = ON")
            deadline = [math.inf]  # monotonic seconds; no statement running yet
            record.info["kvctl_deadline"] = deadline
            dbapi_conn.set_progress_handler(
                lambda: time.monotonic() > deadline[0], SQLITE_STEPS_PER_CHECK
            )
        else:
            cur.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            cur.execute(f"SET SESSION statement_timeout = {max(int(query_timeout_s * 1000), 1)}")
            dbapi_conn.commit()
        cur.close()

    if sqlite:

        @event.listens_for(engine, "before_cursor_execute")
        def _deadline(conn: Any, *_args: Any) -> None:
            deadline = conn.connection.info.get("kvctl_deadline")
            if deadline is not None:
                deadline[0] = time.monotonic() + query_timeout_s

        # a file moved away or replaced while it runs is said gone, or read anew: never its
        # ghost, and no empty database made at its path (kvctl.db.engine.follow_the_path)
        follow_the_path(engine, "the dashboard")
    return engine


def _wall_ms() -> int:
    return int(time.time() * 1000)


def create_app(
    db_url: str,
    *,
    url_prefix: str = "/",
    refresh_seconds: float = DEFAULT_REFRESH_SECONDS,
    model: str = DEFAULT_MODEL,
    default_gpu: str = DEFAULT_GPU,
    mfu: float = DEFAULT_MFU,
    basic_auth: tuple[str, str] | None = None,
    now_ms: Callable[[], int] = _wall_ms,
    query_timeout_s: float = DEFAULT_QUERY_TIMEOUT_S,
) -> dash.Dash:
    """The dashboard on the database at ``db_url``, through an engine of its own whose
    connections refuse writes. ``url_prefix`` must start and end with ``/``; ``basic_auth`` is
    (user, password); ``now_ms`` is the clock windows end at; a query is stopped after
    ``query_timeout_s`` (its page says so)."""
    from kvctl.db.engine import create_db_engine, resolve_url

    if not (url_prefix.startswith("/") and url_prefix.endswith("/")):
        raise ValueError(f"the URL prefix must start and end with '/': {url_prefix!r}")
    if not _URL_PREFIX.fullmatch(url_prefix):
        raise ValueError(
            "the URL prefix must be a plain path (letters, digits and -._~:@+,;=!$*() between "
            f"single '/'): {url_prefix!r}"
        )
    if not 0 < query_timeout_s <= MAX_QUERY_TIMEOUT_S:  # NaN too
        raise ValueError(
            f"the query timeout must be more than 0 and at most {MAX_QUERY_TIMEOUT_S:,.0f} s "
            f"(about 24 days): {query_timeout_s!r}"
        )
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    if default_gpu not in GPUS:
        raise ValueError(f"unknown GPU {default_gpu!r}; choose from {', '.join(GPUS)}")
    config = DashboardConfig(
        engine=read_only(create_db_engine(resolve_url(db_url)), query_timeout_s),
        assume=Assumptions(MODELS[model], default_gpu, mfu),
        refresh_seconds=refresh_seconds,
        now_ms=now_ms,
        page_timeout_s=query_timeout_s + PAGE_GRACE_S,
        query_timeout_s=query_timeout_s,
    )
    app = dash.Dash(
        __name__,
        title="kvctl dashboard",
        requests_pathname_prefix=url_prefix,
        routes_pathname_prefix=url_prefix,
        suppress_callback_exceptions=True,
        update_title=None,
    )
    app.index_string = app.index_string.replace("{%css%}", "{%css%}<style>" + CSS + "</style>")
    app.server.extensions["kvctl"] = config
    app.server.config["MAX_CONTENT_LENGTH"] = MAX_REQUEST_BYTES
    if basic_auth is not None:
        _require_basic_auth(app, *basic_auth)
    else:
        _require_local_host(app)
    app.layout = _layout(app, config)
    _register(app, config)
    return app


def _require_basic_auth(app: dash.Dash, user: str, password: str) -> None:
    from flask import Response, request

    expected = base64.b64encode(f"{user}:{password}".encode()).decode()

    @app.server.before_request
    def _check() -> Response | None:
        header = request.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        given_bytes = given.strip().encode("utf-8", "replace")
        if scheme.lower() == "basic" and hmac.compare_digest(given_bytes, expected.encode()):
            return None
        return Response(
            "authentication required\n",
            401,
            {"WWW-Authenticate": 'Basic realm="kvctl dashboard", charset="UTF-8"'},
        )


def _require_local_host(app: dash.Dash) -> None:
    """Without a password (served on loopback only), requests must name this host: a page in
    a browser on the same host whose domain was pointed at 127.0.0.1 (DNS rebinding) sends
    that domain as the Host, and would otherwise read the fleet's names and figures, as the
    agent and the router refuse it too (``kvctl.http_guards.local_host``)."""
    from flask import Response, request

    from kvctl.http_guards import local_host

    @app.server.before_request
    def _check() -> Response | None:
        host = request.host
        if local_host(host, request.environ.get("SERVER_NAME")):
            return None
        shown = host[:100]
        return Response(
            f"the dashboard serves requests addressed to this host only (Host: {shown!r}); to "
            "serve it under another name, give it --auth-user\n",
            403,
            {"Content-Type": "text/plain; charset=utf-8"},
        )


def _layout(app: dash.Dash, config: DashboardConfig) -> html.Div:
    nav = [dcc.Link(title, href=app.get_relative_path(path)) for path, (title, _) in PAGES.items()]
    return html.Div(
        [
            dcc.Location(id="url"),
            html.Header([html.H1("kvctl · KV-cache efficiency"), html.Nav(nav)]),
            html.Div(
                [
                    html.Div(
                        [
                            html.Label("Window"),
                            dcc.RadioItems(
                                [{"label": "fit the data", "value": FIT}, *WINDOWS],
                                DEFAULT_WINDOW,
                                id="window",
                                inline=True,
                            ),
                        ]
                    ),
                    html.Div(
                        [
                            html.Label("DCs"),
                            dcc.Dropdown(
                                id="dc-filter",
                                multi=True,
                                placeholder="every DC",
                                style={"minWidth": "220px"},
                            ),
                        ]
                    ),
                    html.Div(
                        [
                            html.Label("Model profile"),
                            dcc.Dropdown(
                                list(MODELS),
                                config.assume.model.name,
                                id="model",
                                clearable=False,
                                style={"minWidth": "180px"},
                            ),
                        ]
                    ),
                    html.Span(id="updated", className="window"),
                    dcc.Interval(id="refresh", interval=int(config.refresh_seconds * 1000)),
                ],
                className="controls",
            ),
            html.Main(id="page"),
        ]
    )


def render(
    app: dash.Dash,
    pathname: str | None,
    search: str | None,
    window: str | None,
    dcs: list[str] | None,
    model: str | None,
) -> tuple[list[Any], str]:
    """The page at ``pathname`` for these controls, and the "updated" line: the callback
    behind every page, callable directly (the tests do)."""
    config: DashboardConfig = app.server.extensions["kvctl"]
    # what the browser sends, checked: a crafted POST's other types are taken as no choice
    pathname, search, window, model = (_text(v) for v in (pathname, search, window, model))
    dcs = [d for d in dcs if isinstance(d, str)] if isinstance(dcs, list) else None
    path = "/" + (app.strip_relative_path(pathname or "/") or "")
    page = PAGES.get(path.rstrip("/") or "/")
    if page is None:
        return [empty(f"No page at {path}.", hint="Pick a page from the header.")], ""
    query = parse_qs((search or "").lstrip("?"))
    assume = config.assume
    if model and model != assume.model.name and model in MODELS:
        assume = Assumptions(MODELS[model], assume.default_gpu, assume.mfu)
    now = config.now_ms()
    stamp = time.strftime("%H:%M:%S", time.gmtime(now / 1000))

    def draw() -> tuple[list[Any], int | None]:
        with config.engine.connect() as conn:
            ctx = PageContext(
                conn=conn,
                window=_window(conn, window, now),
                assume=assume,
                dcs=tuple(dcs or ()),
                href=app.get_relative_path,
                dc=(query.get("dc") or [None])[0],
                node=(query.get("node") or [None])[0],
            )
            return page[1](ctx), collection_stopped(conn, now)

    try:
        body, stopped_ms = within(config.page_timeout_s, draw)
    except Exception as exc:
        # a page that raised would leave the manager a blank page (or Dash's error overlay):
        # say what failed instead, and keep the traceback for the server's log
        return [_failed(config, path, exc)], f"not updated: the page failed at {stamp} UTC"
    if stopped_ms is not None:
        body = [_stopped(stopped_ms, now), *body]
    return body, f"updated {stamp} UTC, every {config.refresh_seconds:g} s"


class NoAnswer(Exception):
    """The database did not answer a page within its time."""


def within(seconds: float, fn: Callable[[], T]) -> T:
    """``fn()``, run on a thread of its own so that the caller (a waitress worker) waits at
    most ``seconds``: then :class:`NoAnswer`, and ``fn`` finishes (its connection back to the
    pool) whenever the database answers or its connection fails."""
    done = threading.Event()
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # handed to the caller, who reports it
            outcome.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name="kvctl-dashboard-read", daemon=True).start()
    if not done.wait(seconds):
        raise NoAnswer(f"The database did not answer within {seconds:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def _text(value: object) -> str | None:
    """A callback input that must be text (a path, a query, a choice's name), else None."""
    return value if isinstance(value, str) else None


def _stopped(last_ms: int, now_ms: int) -> html.Div:
    """A page whose figures end where collection stopped says so first: refreshed every few
    seconds, it would otherwise pass for live."""
    ago = compact_duration((now_ms - last_ms) / 1000)
    return html.Div(
        [
            html.Div(
                f"No scrape recorded since {format_utc_minute(last_ms)} ({ago} ago): the "
                "collectors stopped, or cannot write to this database. The figures below end "
                "there.",
                className="empty-message",
            ),
            html.Div(
                "Check `kvctl collect` (its service and its log) on the collector hosts.",
                className="empty-hint",
            ),
        ],
        className="stale",
        id="collection-stopped",
    )


def _failed(config: DashboardConfig, path: str, exc: Exception) -> Any:
    """What a page that failed shows: the database's failure and what to check, or a bug's."""
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    unanswered_hint = (
        f"The dashboard reads {shown_url(config.engine)}: a server or a proxy in front of it "
        "(pgbouncer) that holds connections without answering; `kvctl db current --db URL` says "
        "whether it answers."
    )
    if isinstance(exc, NoAnswer):
        log.warning("page %s: %s", path, exc)
        return empty(f"{exc}: the page is asked again at the next refresh.", hint=unanswered_hint)
    if isinstance(exc, PoolTimeout):
        # the pool's words (QueuePool limit ... sqlalche.me) say nothing to an operator: the
        # connections are held by earlier pages' reading threads the database has not answered
        log.warning("page %s: no connection free: %s", path, exc)
        pool = config.engine.pool
        most = pool.size() + max(getattr(pool, "_max_overflow", 0), 0)
        return empty(
            f"Every connection the dashboard may open ({most}) is held by an earlier page the "
            "database has not answered yet: the page is asked again at the next refresh.",
            hint=unanswered_hint,
        )
    if isinstance(exc, SQLAlchemyError):
        log.warning("page %s: the database failed: %s", path, exc)
        msg = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        sqlite = config.engine.dialect.name == "sqlite"
        if msg == "interrupted" and sqlite:  # read_only's limit
            msg = (
                f"a query ran longer than the query timeout ({config.query_timeout_s:g} s) and "
                "was stopped"
            )
        where = shown_url(config.engine)
        if (sqlite and msg.startswith("a query ran longer")) or "statement timeout" in msg:
            # the database is fine: the database commands' hint below would not help
            return empty(
                f"The database cannot be read: {msg}",
                hint=f"The dashboard reads {where}: pick a shorter window or fewer DCs, or start "
                f"it with a larger --query-timeout (now {config.query_timeout_s:g} s).",
            )
        schema = _schema_behind(config.engine, exc)
        if schema is not None:
            return empty(schema, hint=f"The dashboard reads {where}. ({msg})")
        return empty(
            f"The database cannot be read: {msg}",
            hint=f"The dashboard reads {where}: `kvctl db current --db URL` says whether it is "
            "reachable and at the current schema (`kvctl db upgrade` brings it there).",
        )
    log.exception("page %s failed", path)
    return empty(
        f"This page could not be drawn: {type(exc).__name__}: {exc}",
        hint="The other pages may still work. This is a bug in the dashboard, or data it does "
        "not expect; the dashboard's log has the traceback.",
    )


def _schema_behind(engine: Engine, exc: Exception) -> str | None:
    """``kvctl.db.migrate.schema_behind``'s words (the collector's and ``open_db``'s) as a
    page's sentence: one message for a schema behind this kvctl, wherever it is found."""
    from kvctl.db.migrate import schema_behind

    said = schema_behind(engine, exc)
    return None if said is None else f"{said[:1].upper()}{said[1:]}."


def shown_url(engine: Engine) -> str:
    """The database's URL as a page may show it: libpq also takes secrets in the query
    (password, sslpassword), which a page read by managers must not show; the rest of the
    query (a socket directory, sslmode) helps tell which database it is."""
    from kvctl.redact import redact_url

    url = engine.url
    secret = [k for k in url.query if any(w in k.lower() for w in ("pass", "token", "secret"))]
    return redact_url(url.difference_update_query(secret).render_as_string(hide_password=True))


def _window(conn: Any, name: str | None, now_ms: int) -> Window:
    """The window the user picked by name; else (the default) the one fitted to the data."""
    if name in WINDOWS:
        return window_for(name, now_ms)
    return fitted_window(conn, now_ms)


def dc_names(app: dash.Dash) -> list[str]:
    from sqlalchemy import select

    from kvctl.db.models import DataCenter

    config: DashboardConfig = app.server.extensions["kvctl"]
    with config.engine.connect() as conn:
        return list(conn.execute(select(DataCenter.name).order_by(DataCenter.name)).scalars())


def dc_options(app: dash.Dash) -> list[str] | Any:
    """The DC filter's choices; when the database cannot say, the ones it had (the page says
    why), not a failed callback."""
    config: DashboardConfig = app.server.extensions["kvctl"]
    try:
        return within(config.page_timeout_s, lambda: dc_names(app))
    except Exception as exc:
        log.warning("the DC filter's choices could not be read: %s", exc)
        return dash.no_update


def _register(app: dash.Dash, config: DashboardConfig) -> None:
    @app.callback(
        Output("page", "children"),
        Output("updated", "children"),
        Input("url", "pathname"),
        Input("url", "search"),
        Input("window", "value"),
        Input("dc-filter", "value"),
        Input("model", "value"),
        Input("refresh", "n_intervals"),
    )
    def _page(
        pathname: str | None,
        search: str | None,
        window: str | None,
        dcs: list[str] | None,
        model: str | None,
        _n: int | None,
    ) -> tuple[list[Any], str]:
        return render(app, pathname, search, window, dcs, model)

    @app.callback(Output("dc-filter", "options"), Input("refresh", "n_intervals"))
    def _dc_options(_n: int | None) -> list[str] | Any:
        return dc_options(app)

    @app.callback(
        Output("url", "search"),
        Input("detail-dc", "value"),
        Input("detail-node", "value"),
        State("url", "search"),
        prevent_initial_call=True,
    )
    def _detail_pick(dc: str | None, node: str | None, search: str | None) -> str:
        dc, node, search = _text(dc), _text(node), _text(search)
        query = parse_qs((search or "").lstrip("?"))
        if not dc:
            return ""
        if (query.get("dc") or [None])[0] != dc or not node:
            return "?" + urlencode({"dc": dc})  # another DC: its nodes differ, drop the node
        return "?" + urlencode({"dc": dc, "node": node})
