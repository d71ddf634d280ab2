"""--query-timeout beyond what can be waited for is refused up front. 'inf' (a natural way to
ask for no limit: the option took it) or 1e10 s made every page of the dashboard read 'This
page could not be drawn: OverflowError ... a bug in the dashboard' (the page's wait cannot be
that long), and on PostgreSQL anything over 2,147,483 s failed every connection
(statement_timeout's range); now the CLI and create_app refuse it, naming the range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dashboard.app import create_app


@pytest.mark.parametrize("seconds", [float("inf"), float("nan"), 1e10, 2_200_000.0, 0.0, -1.0])
def test_create_app_refuses_a_query_timeout_it_cannot_keep(tmp_path: Path, seconds: float) -> None:
    with pytest.raises(ValueError, match="query timeout"):
        create_app(f"sqlite:///{tmp_path / 'metrics.db'}", query_timeout_s=seconds)


@pytest.mark.parametrize("given", ["inf", "1e10", "nan"])
def test_the_cli_refuses_such_a_query_timeout_before_serving(tmp_path: Path, given: str) -> None:
    from typer.testing import CliRunner

    from kvctl.cli.main import app as cli
    from kvctl.db.migrate import open_db

    url = f"sqlite:///{tmp_path / 'metrics.db'}"
    open_db(url, auto_upgrade=True).dispose()
    with socket.socket() as taken:  # were it not refused, it would fail to listen, not serve
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = CliRunner().invoke(
            cli, ["dashboard", "--db", url, "--port", port, "--query-timeout", given]
        )
    assert result.exit_code != 0
    assert "cannot listen" not in result.output
    assert "query-timeout" in result.output or "query timeout" in result.output


def test_the_largest_query_timeout_still_draws_pages(empty_db_url: str) -> None:
    from dashboard.app import MAX_QUERY_TIMEOUT_S, render
    from kvctl.db.migrate import open_db
    from tests.functional.dashboard_history import NOW, fill_history
    from tests.functional.test_dashboard_app import card_value

    url = empty_db_url
    db = open_db(url, auto_upgrade=True)
    fill_history(db)
    db.dispose()
    app = create_app(url, now_ms=lambda: NOW, query_timeout_s=MAX_QUERY_TIMEOUT_S)
    try:
        page, _ = render(app, "/", "", "1h", None, None)
        assert card_value(page, "card-hit-ratio") == "52.6%"
    finally:
        app.server.extensions["kvctl"].engine.dispose()
