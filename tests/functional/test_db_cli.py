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
        (["db", "maintain", "--raw-days", "nan"], "must be a finite number, got nan"),
        (["db", "maintain", "--hour-days", "inf"], "must be a finite number, got inf"),
        (["db", "maintain", "--day-days", "1e300"], "retention periods must be"),
        (["audit", "--limit", str(2**64)], "--limit"),
    ]
    for args, said in cases:
        result = runner.invoke(app, [*args, "--db", empty_db_url])
        out = " ".join(result.output.split())
        assert result.exit_code == 2, (args, out)
        assert said in out and "did not expect" not in out, (args, out)


def _stamp(url: str, *revisions: str) -> None:
    """The database's alembic_version rows set to ``revisions``, as a newer kvctl (or a stamp
    by hand) leaves them."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM alembic_version"))
        for revision in revisions:
            conn.execute(text("INSERT INTO alembic_version VALUES (:r)"), {"r": revision})
    engine.dispose()


def _schema_behind_a_failed_read(url: str) -> str | None:
    """What ``migrate.schema_behind`` (the collector's and the dashboard's reading of a failed
    statement) says of a read, on ``url``, of a table its schema lacks."""
    from sqlalchemy import text
    from sqlalchemy.exc import SQLAlchemyError

    from kvctl.db.engine import create_db_engine

    engine = create_db_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT * FROM table_of_a_newer_kvctl"))
    except SQLAlchemyError as exc:
        return migrate.schema_behind(engine, exc)
    finally:
        engine.dispose()
    raise AssertionError("the read did not fail")


def test_a_database_a_newer_kvctl_migrated_is_said_to_be_so(empty_db_url: str) -> None:
    """A revision this kvctl does not know: `db current` said 'behind' and that SQLite upgrades
    itself, `db upgrade` alembic's "Can't locate revision"."""
    assert runner.invoke(app, ["db", "upgrade", "--db", empty_db_url]).exit_code == 0
    _stamp(empty_db_url, "ffff00000099")

    current = runner.invoke(app, ["db", "current", "--db", empty_db_url])
    said = " ".join(current.output.split())
    assert current.exit_code == 1, said
    assert "newer than this kvctl" in said and "behind" not in said
    assert "migrated by a newer kvctl; upgrade kvctl" in said
    assert "upgrades itself" not in said

    for args in (["db", "upgrade"], ["db", "upgrade", "--revision", "base"], ["status"]):
        result = runner.invoke(app, [*args, "--db", empty_db_url])
        said = " ".join(result.output.split())
        assert result.exit_code == 2, (args, said)
        assert "ffff00000099, which this kvctl does not know" in said, (args, said)
        assert "migrated by a newer kvctl" in said and "Can't locate" not in said, (args, said)
        assert "check that its server is up" not in said, (args, said)

    behind = _schema_behind_a_failed_read(empty_db_url)
    assert behind is not None and "migrated by a newer kvctl" in behind


def test_a_database_at_two_revisions_at_once_is_said_in_one_line(empty_db_url: str) -> None:
    """Two rows in alembic_version (a newer kvctl's branches): alembic's CommandError ('more
    than one head present') was a bug's line from every command, and escaped schema_behind
    (the collector's and the dashboard's reading of a failed statement) as a traceback."""
    assert runner.invoke(app, ["db", "upgrade", "--db", empty_db_url]).exit_code == 0
    head = migrate.head_revision()
    _stamp(empty_db_url, head, "ffff00000099")

    for args in (["db", "current"], ["db", "upgrade"], ["status"], ["audit"]):
        result = runner.invoke(app, [*args, "--db", empty_db_url])
        said = " ".join(result.output.split())
        assert result.exit_code == 2, (args, said)
        assert "at once" in said and "migrated by a newer kvctl" in said, (args, said)
        assert "did not expect" not in said and "more than one head" not in said, (args, said)

    behind = _schema_behind_a_failed_read(empty_db_url)
    assert behind is not None and "at once" in behind


def test_an_upgrade_to_base_or_an_older_revision_says_what_it_did(empty_db_url: str) -> None:
    """`db upgrade --revision base` said 'already at None'; to a revision the database is past,
    'already at <its revision>', as if that were the one asked."""
    head = migrate.head_revision()
    empty = runner.invoke(app, ["db", "upgrade", "--revision", "base", "--db", empty_db_url])
    assert empty.exit_code == 0 and "already at empty" in empty.stdout, empty.output
    assert "None" not in empty.stdout

    assert runner.invoke(app, ["db", "upgrade", "--db", empty_db_url]).exit_code == 0
    for older in ("base", migrate.revisions()[0]):
        result = runner.invoke(app, ["db", "upgrade", "--revision", older, "--db", empty_db_url])
        said = " ".join(result.stdout.split())
        assert result.exit_code == 0, said
        assert f"at {head}, already past --revision {older}; nothing done" in said, said
        assert "already at" not in said
    again = runner.invoke(app, ["db", "upgrade", "--revision", head, "--db", empty_db_url])
    assert f"already at {head}" in again.stdout


def test_the_doctor_says_a_database_at_two_revisions_is_reachable_and_its_schema_unknown(
    empty_db_url: str,
) -> None:
    """`kvctl doctor` on a database at two revisions at once (559c742's SchemaNotKnown) failed
    its 'database' check as unusable, with the fix of a database away: 'check that ... is a
    readable SQLite file' or 'start PostgreSQL at ... (pg_isready ...)'. The database answers;
    it is its schema this kvctl does not know, said as a single unknown revision is."""
    assert runner.invoke(app, ["db", "upgrade", "--db", empty_db_url]).exit_code == 0
    _stamp(empty_db_url, migrate.head_revision(), "ffff00000099")

    result = runner.invoke(app, ["doctor", "--json", "--db", empty_db_url])
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["database"]["status"] == "ok", checks["database"]
    schema = checks["database schema"]
    assert schema["status"] == "fail", schema
    assert "at once" in schema["detail"] and "ffff00000099" in schema["detail"], schema
    assert "readable SQLite file" not in result.stdout and "pg_isready" not in result.stdout


def test_a_database_stamped_at_two_known_revisions_is_not_said_to_need_a_newer_kvctl(
    empty_db_url: str,
) -> None:
    """Two rows of revisions this kvctl knows (a stamp by hand): the line says to check the
    alembic_version table, but its hint (and the doctor's fix, 45303d5) said 'run the kvctl
    that migrated it, or newer', a kvctl that does not exist."""
    assert runner.invoke(app, ["db", "upgrade", "--db", empty_db_url]).exit_code == 0
    _stamp(empty_db_url, migrate.head_revision(), migrate.revisions()[0])

    result = runner.invoke(app, ["status", "--db", empty_db_url])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "alembic_version" in said, said
    assert "run the kvctl that migrated it" not in said, said
    doctor = runner.invoke(app, ["doctor", "--json", "--db", empty_db_url])
    schema = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}["database schema"]
    assert schema["status"] == "fail" and "alembic_version" in schema["fix"], schema
    assert "run the kvctl that migrated it" not in schema["fix"], schema
