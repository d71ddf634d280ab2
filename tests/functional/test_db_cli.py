"""`kvctl db upgrade|current|maintain` on a real SQLite and PostgreSQL."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db import migrate

runner = CliRunner()


def test_current_upgrade_current(empty_db_url: str) -> None:
    behind = runner.invoke(app, ["db", "current", "--json", "--db", empty_db_url])
    assert behind.exit_code == 1
    data = json.loads(behind.stdout)
    assert data["current"] is None and data["head"] == migrate.head_revision()
    assert data["up_to_date"] is False

    up = runner.invoke(app, ["db", "upgrade", "--json", "--db", empty_db_url])
    assert up.exit_code == 0, up.output
    assert json.loads(up.stdout) == {
        "database": data["database"],
        "from": None,
        "to": migrate.head_revision(),
    }
    again = runner.invoke(app, ["db", "upgrade", "--db", empty_db_url])
    assert again.exit_code == 0 and "already at" in again.stdout

    current = runner.invoke(app, ["db", "current", "--db", empty_db_url])
    assert current.exit_code == 0 and "up to date" in current.stdout


def test_passwords_are_masked(pg_url: str) -> None:
    from sqlalchemy.engine import make_url

    with_password = make_url(pg_url).set(password="s3cret-pw").render_as_string(hide_password=False)
    # trust auth ignores the password; the point is that it is never printed
    result = runner.invoke(app, ["db", "current", "--json", "--db", with_password])
    assert "s3cret-pw" not in result.output
    assert "***" in json.loads(result.stdout)["database"]


def test_upgrade_with_a_password_a_url_must_escape(pg_url: str) -> None:
    """A password with '@' (or '%', '/', ':') is %-escaped in the URL, and alembic's config
    read that % as interpolation: `kvctl db upgrade` failed with a ValueError quoting the
    URL, password and all. It upgrades, and never prints the password."""
    from sqlalchemy.engine import make_url

    url = make_url(pg_url).set(password="s3cret@pw%").render_as_string(hide_password=False)
    result = runner.invoke(app, ["db", "upgrade", "--json", "--db", url])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["to"] == migrate.head_revision()
    assert "s3cret" not in result.output


def test_maintain_on_an_empty_database(sqlite_url: str) -> None:
    missing = runner.invoke(app, ["db", "maintain", "--json", "--db", sqlite_url])
    assert missing.exit_code == 2 and "no fleet database at" in missing.output  # none made
    assert runner.invoke(app, ["db", "upgrade", "--db", sqlite_url]).exit_code == 0
    result = runner.invoke(app, ["db", "maintain", "--json", "--db", sqlite_url])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"rolled_up": {}, "deleted": {}}
    bad = runner.invoke(app, ["db", "maintain", "--raw-days", "0", "--db", sqlite_url])
    assert bad.exit_code == 2 and "positive" in bad.output


def test_unreachable_database_is_one_line_with_a_hint() -> None:
    result = runner.invoke(app, ["db", "current", "--db", "postgresql://x@127.0.0.1:1/none"])
    assert result.exit_code == 2
    assert "cannot use postgresql+psycopg://x@127.0.0.1:1/none" in result.output
    assert "KVCTL_DB_URL" in result.output
    assert "Traceback" not in result.output


def test_bad_upkeep_input_is_one_line_and_exit_2(empty_db_url: str) -> None:
    """Each of these was 'kvctl failed where it did not expect to: ...' (a bug's line, exit 1):
    a revision alembic does not know (CommandError), a retention of nan or inf days (int() of
    it), one past the database's 64-bit milliseconds, and an audit --limit past them."""
    assert runner.invoke(app, ["db", "upgrade", "--db", empty_db_url]).exit_code == 0
    cases = [
        (["db", "upgrade", "--revision", "nonsense"], "nonsense"),
        # past the newest, and none: alembic asserted (AssertionError, a bug's line)
        (["db", "upgrade", "--revision", "head+1"], "Can't resolve revision 'head+1' from"),
        (["db", "upgrade", "--revision", ""], "Can't resolve revision '' from"),
        (["db", "maintain", "--raw-days", "nan"], "retention periods must be"),
        (["db", "maintain", "--hour-days", "inf"], "retention periods must be"),
        (["db", "maintain", "--day-days", "1e300"], "retention periods must be"),
        (["audit", "--limit", str(2**64)], "--limit"),
    ]
    for args, said in cases:
        result = runner.invoke(app, [*args, "--db", empty_db_url])
        out = " ".join(result.output.split())
        assert result.exit_code == 2, (args, out)
        assert said in out and "did not expect" not in out, (args, out)
