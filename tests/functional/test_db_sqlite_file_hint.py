"""`kvctl db current` and `kvctl db upgrade` on a SQLite URL whose file is no database (or is a
directory) hint at the file, not at a server: they said "check that its server is up, and the
URL's host, port, user and database name", which a SQLite file has none of."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()


def _said(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("command", [["db", "current"], ["db", "upgrade"]])
@pytest.mark.parametrize("kind", ["not-a-database", "directory"])
def test_a_sqlite_url_that_cannot_be_used_hints_at_its_file(
    tmp_path: Path, command: list[str], kind: str
) -> None:
    path = tmp_path / "kvctl.db"
    if kind == "directory":
        path.mkdir()
    else:
        path.write_bytes(b"\xff\xfe not a database, not even text\n" * 10)
    code, said = _said(*command, "--db", f"sqlite:///{path}")
    assert code == 2, said
    assert f"cannot use sqlite:///{path}" in said
    assert "server is up" not in said and "check the URL's path" in said


def test_a_server_that_does_not_answer_still_hints_at_the_server() -> None:
    code, said = _said("db", "current", "--db", "postgresql://nobody@127.0.0.1:1/x")
    assert code == 2, said
    assert "check that its server is up" in said


@pytest.mark.parametrize(
    "command",
    [["fleet", "ls"], ["status"], ["audit"], ["db", "maintain"], ["collect", "--once"]],
)
def test_every_command_names_the_sqlite_file_that_is_no_database(
    tmp_path: Path, command: list[str]
) -> None:
    """They said "database error: file is not a database", naming no file: with KVCTL_DB_URL
    set elsewhere, which file was it?"""
    path = tmp_path / "kvctl.db"
    path.write_bytes(b"\xff\xfe not a database, not even text\n" * 10)
    code, said = _said(*command, "--db", f"sqlite:///{path}")
    assert code == 2, said
    assert f"cannot use sqlite:///{path}: file is not a database" in said, said
    assert "did not expect" not in said
