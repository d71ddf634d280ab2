"""`kvctl replay` over agents that hold the same workload's chunks at another size (an earlier
replay at another --kv-scale stored them, under the same keys): the replay stops, naming the
chunk, and its hint says what happened and what to do, not to look for agents that do not
answer (they all do)."""

from __future__ import annotations

import os
from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.agents import fra_fleet, running_agent

runner = CliRunner()
REPLAY = ["replay", "--workload", "chat", "--limit", "10"]


def _run(*args: str) -> tuple[int, str]:
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    result = runner.invoke(app, list(args), env=clean | {"COLUMNS": "1000"})
    assert "Traceback" not in result.output, result.output
    return result.exit_code, " ".join(result.output.split())


def test_a_replay_at_another_kv_scale_says_the_chunks_are_another_replays(
    tmp_path: Path,
) -> None:
    with running_agent(tmp_path / "a", "--name", "fra-a", "--cpu", "64MiB", "--disk", "0") as a:
        db = fra_fleet(tmp_path, {"fra-a": a.state.control_url})
        code, out = _run(*REPLAY, "--kv-scale", "1/256", "--db", db, "--json")
        assert code == 0, out
        code, out = _run(*REPLAY, "--kv-scale", "1/128", "--db", db, "--json")
    assert code == 1, out
    said, _, hint = out.partition("hint:")
    assert "wrong bytes" in said, out
    assert "--kv-scale" in hint and "kvctl flush" in hint, out
    assert "shows which agents answer" not in hint, out
