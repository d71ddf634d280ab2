"""`kvctl replay --json` (and `kvctl demo --json`, which loads its workload the same way) say
nothing on a terminal's stderr while the workload is generated or read, as `kvctl simulate
--json` and `kvctl plan --json` do: replay's "generating the ... workload" spinner still drew
there, garbling the log of a script that keeps stderr on the terminal."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvctl.cli import output
from kvctl.cli.main import app
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from tests.functional.agents import closed_port

runner = CliRunner()


def _one_node_fleet(tmp_path: Path) -> str:
    """A fleet database of one node whose agent is away: the replay loads its workload, then
    fails on the first request (exit 1), having shown whatever it shows while loading."""
    url = f"sqlite:///{tmp_path / 'kvctl.db'}"
    engine = open_db(url)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        away = f"http://127.0.0.1:{closed_port()}"
        add_node(conn, "fra-a", dc="fra", agent_url=away, check_agent=False)
    engine.dispose()
    return url


@pytest.mark.parametrize("json_out", [False, True])
def test_replay_loads_its_workload_silently_with_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, json_out: bool
) -> None:
    url = _one_node_fleet(tmp_path)
    said = io.StringIO()  # stderr as a terminal: what the decision sees, not a real TTY
    monkeypatch.setattr(output, "err_console", Console(file=said, force_terminal=True, width=200))
    args = ["replay", "--limit", "20", "--db", url] + (["--json"] if json_out else [])
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output  # the agent is away
    spinner = "generating the builtin workload (seed 0, 20 requests)"
    if json_out:
        assert spinner not in said.getvalue()
    else:  # the same terminal without --json shows it: the check above can see it
        assert spinner in said.getvalue()
