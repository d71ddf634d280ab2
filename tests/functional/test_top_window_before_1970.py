"""`kvctl top --window` longer than the time since 1970 reads everything recorded, from the
epoch, as `kvctl status --window` does (cf8d0de): 3000000d reported a window starting in year
-6187, and 99999999999999999d failed with a bug's line ('OverflowError: Python int too large to
convert to SQLite INTEGER')."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db.analytics.windows import window_of
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from tests.functional.agents import closed_port

runner = CliRunner()


@pytest.mark.parametrize("window", ["3000000d", "99999999999999999d"])
def test_a_window_reaching_back_before_1970_starts_there(tmp_path: Path, window: str) -> None:
    url = f"sqlite:///{tmp_path / 'kvctl.db'}"
    engine = open_db(url)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        agent_url = f"http://127.0.0.1:{closed_port()}"
        add_node(conn, "fra-a", dc="fra", agent_url=agent_url, check_agent=False)
    engine.dispose()
    args = ["top", "--json", "--window", window, "--db", url, "--timeout", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "did not expect" not in result.output
    win = json.loads(result.stdout)["recorded"]["window"]
    assert win["start_ms"] == 0 and win["name"] == window, win


def test_a_window_within_the_epoch_is_as_long_as_asked() -> None:
    now_ms = 1_796_000_000_000
    assert window_of("1h", now_ms).start_ms == now_ms - 3_600_000
    assert window_of("3000000d", now_ms).start_ms == 0
