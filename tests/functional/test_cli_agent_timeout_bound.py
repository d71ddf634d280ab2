"""--timeout (seconds to wait for each agent) takes at most an hour, refused by name (exit 2)
past it. 1e300 was taken: every node then failed with "OverflowError: timestamp out of range
for platform time_t", as if the agents had."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db

runner = CliRunner()
KEY = "00" * 16


@pytest.mark.parametrize(
    "command",
    [
        ["lookup", "--key", KEY, "--all"],
        ["status"],
        ["pin", "--key", KEY, "--all", "--yes"],
        ["doctor"],
        ["top", "--json"],
    ],
)
def test_a_timeout_past_an_hour_is_refused_by_name(tmp_path: Path, command: list[str]) -> None:
    url = f"sqlite:///{tmp_path / 'kvctl.db'}"
    engine = open_db(url)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "fra-a", dc="fra", agent_url="http://127.0.0.1:1", check_agent=False)
    engine.dispose()
    result = runner.invoke(app, [*command, "--timeout", "1e300", "--db", url])
    said = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, said
    assert "'--timeout'" in said and "OverflowError" not in said
