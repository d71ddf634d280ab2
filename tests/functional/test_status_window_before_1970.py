"""`kvctl status --window` longer than the time since 1970 reads everything recorded, from the
epoch. 3000000d reached back before year 1, and rendering the window's start date failed with
a bug's line ("ValueError: year -6187 is out of range", exit 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db

runner = CliRunner()


@pytest.mark.parametrize("window", ["3000000d", "99999999999d"])
def test_a_window_reaching_back_before_1970_starts_there(tmp_path: Path, window: str) -> None:
    url = f"sqlite:///{tmp_path / 'kvctl.db'}"
    engine = open_db(url)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "fra-a", dc="fra", agent_url="http://127.0.0.1:1", check_agent=False)
    engine.dispose()
    result = runner.invoke(app, ["status", "--window", window, "--db", url])
    assert result.exit_code == 0, result.output
    assert "did not expect" not in result.output and "1970-01-01" in result.output
