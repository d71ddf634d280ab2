"""The control actions' --timeout (flush, resize, move, prefetch, pin...) takes up to a day:
the agent answers a flush or a resize only once it has demoted every chunk it moves (a 4 TiB
cpu tier to a disk tier at 1 GB/s: over an hour), and the client waits that long for the
answer's first byte. 9f9562b capped every --timeout at an hour, refusing --timeout 7200 for
them though it had worked; the read-only commands (lookup, status, doctor, top) keep an hour."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db

runner = CliRunner()
KEY = "00" * 16


def _db(tmp_path: Path) -> str:
    """An inventory of one node whose agent URL refuses connections at once."""
    url = f"sqlite:///{tmp_path / 'kvctl.db'}"
    engine = open_db(url)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "fra-a", dc="fra", agent_url="http://127.0.0.1:1", check_agent=False)
    engine.dispose()
    return url


@pytest.mark.parametrize(
    "command",
    [
        ["flush", "--tier", "cpu", "--demote", "--all", "--yes"],
        ["resize", "--tier", "cpu", "--size", "1GiB", "--all", "--yes"],
        ["pin", "--key", KEY, "--all", "--yes"],
    ],
)
def test_an_action_waits_more_than_an_hour_when_asked(tmp_path: Path, command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--timeout", "7200", "--db", _db(tmp_path)])
    said = " ".join(result.output.replace("│", " ").split())
    # taken: the node is asked, and fails as unreachable (exit 1), not a usage error (exit 2)
    assert result.exit_code == 1, said
    assert "fra-a" in said and "'--timeout'" not in said


def test_an_action_timeout_past_a_day_is_refused_by_name(tmp_path: Path) -> None:
    args = ["flush", "--tier", "cpu", "--all", "--yes", "--timeout", "86401"]
    result = runner.invoke(app, [*args, "--db", _db(tmp_path)])
    said = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, said
    assert "'--timeout'" in said and "86400" in said.replace(",", "")
