"""`kvctl db current` and `kvctl db upgrade` on a PostgreSQL that is not there or has no such
database: the one line names the database tried (its password masked). `kvctl db current` is
what every other command's hint points to for "which database is used", and it said only
"database error: connection failed"."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.agents import closed_port

runner = CliRunner()


@pytest.mark.parametrize("command", ["current", "upgrade"])
@pytest.mark.parametrize("where", ["closed port", "no such database"])
def test_a_database_that_cannot_be_used_is_named(command: str, where: str) -> None:
    if where == "closed port":
        url = f"postgresql://kvctl:s3cret@127.0.0.1:{closed_port()}/kvctl"
    else:
        url = "postgresql://postgres:s3cret@127.0.0.1:5432/kvctl_no_such_database"
    result = runner.invoke(app, ["db", command, "--db", url], env={"COLUMNS": "1000"})
    said = " ".join(result.output.split())
    assert result.exit_code == 2, said
    shown = url.replace("postgresql:", "postgresql+psycopg:").replace("s3cret", "***")
    assert f"error: cannot use {shown}: connection failed" in said
    assert "s3cret" not in said and "Traceback" not in said
    assert "--db or $KVCTL_DB_URL" in said


@pytest.mark.parametrize(
    "url",
    [
        # libpq takes both in the query; the line printed the URL as given
        "postgresql://kvctl@127.0.0.1:{port}/kvctl?password=s3cret",
        "postgresql://kvctl@127.0.0.1:{port}/kvctl?sslmode=prefer&sslpassword=s3cret",
        # typed with a raw '@': the parser took 's3cret@127.0.0.1' for the host, and the
        # driver's error printed it ("failed to resolve host 's3cret@127.0.0.1'")
        "postgresql://kvctl:x@s3cret@127.0.0.1:{port}/kvctl",
    ],
)
def test_no_password_in_the_query_or_typed_with_an_at_is_shown(url: str) -> None:
    url = url.format(port=closed_port())
    result = runner.invoke(app, ["db", "current", "--db", url], env={"COLUMNS": "1000"})
    said = " ".join(result.output.split())
    assert result.exit_code == 2, said
    assert "s3cret" not in said and "Traceback" not in said, said
    assert "127.0.0.1" in said, said  # which database it was is still said


@pytest.mark.parametrize("command", [["db", "current"], ["audit"]])
@pytest.mark.parametrize(
    "url",
    [
        # the scheme's ':' left out: the line quoted the text as typed, password and all
        "postgresql//kvctl:s3cret@127.0.0.1/kvctl",
        # a port that is no number: a bug's message ("kvctl failed where it did not expect
        # to: ValueError"), exit 1
        "postgresql://kvctl:s3cret@127.0.0.1:54x2/kvctl",
        # libpq's keyword/value form (a psycopg DSN) where a URL is wanted: quoted as typed
        "host=127.0.0.1 user=kvctl password=s3cret dbname=kvctl",
        "host=127.0.0.1 sslpassword = 's3 cret' dbname=kvctl",
    ],
)
def test_a_url_that_does_not_parse_is_one_line_without_its_password(
    command: list[str], url: str
) -> None:
    result = runner.invoke(app, [*command, "--db", url], env={"COLUMNS": "1000"})
    said = " ".join(result.output.split())
    assert result.exit_code == 2, said
    assert "error: not a database URL: " in said, said
    assert "cret" not in said and "did not expect" not in said, said
    assert "127.0.0.1" in said, said  # which URL it was is still said


_HEAD, _TAIL = "Zq9Wv", "Xk7Jm"  # a password's two halves, around what may cut it


@pytest.mark.parametrize(
    "url",
    [
        # the userinfo's password holding '&password=': the query's redaction cut it there and
        # its head was shown as a user's ('postgresql//kvctl:Zq9Wv&password=***')
        "postgresql//kvctl:{pw}@127.0.0.1/kvctl",
        # libpq's keyword/value form: a quoted password with a stray quote in it showed its
        # tail after that quote; an unquoted one its tail after a tab or blank
        "host=127.0.0.1 port=1 password='{pw}' dbname=kvctl",
        "host=127.0.0.1 port=1 password={pw} dbname=kvctl",
        "host=127.0.0.1 port=1 password='{pw} dbname=kvctl",
        # a query's password with a raw '@': the parser took all before it for a userinfo and
        # the password's tail for the host, which the driver's error printed
        "postgresql://127.0.0.1:1/kvctl?user=k&password={pw}",
        "postgresql://127.0.0.1:1/kvctl?password={pw}&user=k",
    ],
)
@pytest.mark.parametrize("cut", ["&password=", "'", "\t", " ", "&", "@", "/", "#", "?", "%", "%4"])
def test_no_part_of_a_typed_password_is_shown(url: str, cut: str) -> None:
    url = url.format(pw=f"{_HEAD}{cut}{_TAIL}")
    result = runner.invoke(app, ["db", "current", "--db", url], env={"COLUMNS": "1000"})
    said = " ".join(result.output.split())
    assert result.exit_code == 2, said
    assert _HEAD not in said and _TAIL not in said, said
    assert "Traceback" not in said and "did not expect" not in said, said


@pytest.mark.parametrize("password", ["k3?Lm=Q", "k3?Lm=Q&x=y", "?a=b", "k3/Lm?Q=x"])
def test_a_password_typed_with_a_raw_question_mark_and_equals_sign_still_reads(
    pg_url: str, password: str
) -> None:
    """9305aa7 refuses a userinfo whose password holds '?key=' (its mark of a query's raw '@',
    read by the URL parser as ending a userinfo that runs from the host: '127.0.0.1:1/kvctl?
    user=k&password=pa@ss'). A password typed raw with '?' then '=' (a generated one: 'k3?Lm=Q')
    read as one before, and was refused as a query holding a raw '@'. It reads (trust auth
    ignores it) and is never shown."""
    from sqlalchemy.engine import make_url

    parsed = make_url(pg_url)
    url = f"postgresql://{parsed.username}:{password}@{parsed.host}:{parsed.port or 5432}/"
    url += str(parsed.database)
    result = runner.invoke(app, ["db", "current", "--db", url], env={"COLUMNS": "1000"})
    said = " ".join(result.output.split())
    assert result.exit_code == 1, said  # reached: an empty database is behind
    assert "revision empty" in said and "raw '@'" not in said, said
    assert "k3" not in said and "Lm=Q" not in said and "?a=b" not in said, said
    assert "Lm?Q" not in said, said


@pytest.mark.parametrize("command", [["db", "current"], ["fleet", "ls"]])
@pytest.mark.parametrize(
    "url",
    [
        "postgresql+asyncpg://kvctl:s3cret@127.0.0.1:5432/kvctl",
        "postgresql+psycopg2://kvctl:s3cret@127.0.0.1:5432/kvctl",
        "postgresql+pg8000://kvctl:s3cret@127.0.0.1:5432/kvctl",
        "sqlite+aiosqlite:////tmp/kvctl-no-such-dir/kvctl.db",
    ],
)
def test_a_driver_kvctl_does_not_use_is_refused_naming_the_ones_it_does(
    command: list[str], url: str
) -> None:
    """A driver kvctl does not install (asyncpg, psycopg2) was "a bug in kvctl:
    ModuleNotFoundError", exit 1; kvctl runs on psycopg 3 and Python's sqlite3 only."""
    result = runner.invoke(app, [*command, "--db", url], env={"COLUMNS": "1000"})
    said = " ".join(result.output.split())
    assert result.exit_code == 2, said
    driver = url.split("://")[0]
    assert f"error: unsupported database driver {driver!r}" in said, said
    assert "postgresql://" in said and "sqlite:///" in said
    assert "s3cret" not in said and "did not expect" not in said
