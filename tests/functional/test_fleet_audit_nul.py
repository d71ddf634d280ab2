"""A node's error text with a NUL character in it (a garbage answer quoted in the message) is
audited on PostgreSQL too, whose text columns refuse NUL: the audit write failed, which
stopped the fan-out mid-way and ended the command in a traceback, the other nodes' actions
unrecorded."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.test_cli_failures_interrupt import DONE, KEY, _cli
from tests.not_an_agent import answering_url

runner = CliRunner()


def test_an_error_with_a_nul_is_audited_on_postgresql(pg_url: str) -> None:
    _cli(pg_url, "db", "upgrade")
    with (
        answering_url(500, b"bad\x00answer", "text/plain") as odd,
        answering_url(200, DONE, "application/json") as good,
    ):
        _cli(pg_url, "fleet", "add-dc", "fra")
        _cli(pg_url, "fleet", "add-node", "odd", "--dc", "fra", "--agent-url", odd)
        _cli(pg_url, "fleet", "add-node", "good", "--dc", "fra", "--agent-url", good)
        args = ["pin", "--all", "--yes", "--key", KEY, "--db", pg_url, "--json"]
        out = runner.invoke(app, args, env={"KVCTL_TOKEN": None})
    said = " ".join(out.output.split())
    assert out.exit_code == 1, said
    assert json.loads(out.stdout)["failed"] == ["odd"], said
    trail = {r["target"]: r for r in json.loads(_cli(pg_url, "audit", "--action", "pin", "--json"))}
    assert trail["good"]["ok"] is True and trail["odd"]["ok"] is False, trail
    assert "bad" in trail["odd"]["result"], trail["odd"]


def test_unstorable_text_is_audited_on_both_databases(empty_db_url: str) -> None:
    # a lone surrogate (JSON "\ud800" in an agent's error detail) raised UnicodeEncodeError
    # from SQLite's driver, a ValueError no caller took for a database error; NUL is refused
    # by PostgreSQL. Both are stored as U+FFFD, as the collector stores them
    from kvctl.db.migrate import open_db
    from kvctl.fleet.audit import record

    engine = open_db(empty_db_url, auto_upgrade=True)
    try:
        with engine.begin() as conn:
            record(conn, action="pin", target="n\ud800", args={}, ok=False, result="x\ud800\x00y")
        with engine.connect() as conn:
            row = conn.exec_driver_sql("SELECT target, result FROM audit").one()
        assert tuple(row) == ("n\ufffd", "x\ufffd\ufffdy")
    finally:
        engine.dispose()
