"""`kvctl dashboard`: serve the managers' dashboard (plotly-dash) on the metrics database."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from kvctl.cli.extras import needs_extra
from kvctl.cli.options import MFU_DEFAULT, DbOpt, MfuOpt, open_engine
from kvctl.cli.output import console, fail
from kvctl.wire.address import is_loopback

PASSWORD_ENV = "KVCTL_DASHBOARD_PASSWORD"


def url_prefix_of(given: str) -> str:
    """``--url-prefix`` as a path that starts and ends with one '/': '//kvctl' (a typo) is
    '/kvctl/', never '//kvctl/', which the page would read as scripts from a host 'kvctl'."""
    return "/" + "".join(f"{part}/" for part in given.split("/") if part)


def dashboard_command(
    db: DbOpt = None,
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", help="Port to listen on.", min=1, max=65535)
    ] = 8050,
    url_prefix: Annotated[
        str,
        typer.Option(
            "--url-prefix",
            help="Path the dashboard is served under, e.g. /kvctl/ behind a reverse proxy "
            "that passes the path through.",
        ),
    ] = "/",
    refresh: Annotated[
        float, typer.Option("--refresh", help="Seconds between live refreshes.", min=1.0)
    ] = 30.0,
    model: Annotated[
        str, typer.Option("--model", help="Model profile of modeled figures (changeable there).")
    ] = "llama-3.1-8b",
    gpu: Annotated[
        str, typer.Option("--gpu", help="GPU profile of nodes whose GPU model is unknown.")
    ] = "h100",
    mfu: MfuOpt = MFU_DEFAULT,
    auth_user: Annotated[
        str | None,
        typer.Option(
            "--auth-user",
            help=f"Require HTTP basic auth as this user (password: ${PASSWORD_ENV}).",
        ),
    ] = None,
    threads: Annotated[int, typer.Option("--threads", help="Worker threads.", min=1)] = 8,
    query_timeout: Annotated[
        float,
        typer.Option(
            "--query-timeout",
            help="Seconds a page's query may take before it is stopped and the page says so "
            "(PostgreSQL and SQLite alike; a page unanswered 5 s longer says so too).",
            min=0.1,
            max=2_147_483.0,  # dashboard.app.MAX_QUERY_TIMEOUT_S: PostgreSQL's limit
        ),
    ] = 60.0,
) -> None:
    """Serve the dashboard: fleet efficiency across DCs, DC and node detail, links, capacity.

    Read-only: its connections refuse writes (a SQLite file whose schema is behind is upgraded
    once before serving, as every kvctl command does; PostgreSQL must be current). It listens
    on loopback by default; any other address needs --auth-user (with the password in
    $KVCTL_DASHBOARD_PASSWORD, never on the command line). Every figure says whether it is
    measured or modeled.

    Examples:

      kvctl dashboard

      kvctl dashboard --db postgresql://kvctl@db.internal/kvctl --port 8080

      kvctl dashboard --host 0.0.0.0 --auth-user ops --url-prefix /kvctl/
    """
    needs_extra("kvctl dashboard", "dashboard")
    url_prefix = url_prefix_of(url_prefix)
    basic_auth = None
    if auth_user is not None:
        password = os.environ.get(PASSWORD_ENV)
        if not password:
            fail(f"--auth-user needs a password in ${PASSWORD_ENV}")
        basic_auth = (auth_user, password)
    elif not is_loopback(host):
        fail(
            f"refusing to serve the dashboard on {host} without authentication",
            hint=f"add --auth-user USER with ${PASSWORD_ENV} set, or listen on 127.0.0.1 "
            "behind an authenticating proxy",
        )
    from waitress import create_server

    from dashboard.app import MAX_REQUEST_BYTES, create_app

    checked = open_engine(db)  # the schema must be current (SQLite upgrades itself)
    url = checked.url.render_as_string(hide_password=False)
    checked.dispose()
    try:
        app = create_app(
            url,
            url_prefix=url_prefix,
            refresh_seconds=refresh,
            model=model,
            default_gpu=gpu,
            mfu=mfu,
            basic_auth=basic_auth,
            query_timeout_s=query_timeout,
        )
    except ValueError as exc:
        fail(str(exc), hint="see `kvctl dashboard --help`")
    try:
        server = create_server(
            app.server,
            host=host,
            port=port,
            threads=threads,
            max_request_body_size=MAX_REQUEST_BYTES,  # refused before it is read
        )
    except OSError as exc:
        fail(f"cannot listen on {host}:{port}: {exc.strerror}", hint="pick another --port")
    shown_host = f"[{host}]" if ":" in host else host
    console.print(
        f"dashboard: http://{shown_host}:{port}{url_prefix}  (Ctrl-C stops it)", soft_wrap=True
    )
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        app.server.extensions["kvctl"].engine.dispose()
