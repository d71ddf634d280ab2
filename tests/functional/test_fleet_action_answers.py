"""A control action's answer is checked before the node counts as done: a 200 with a JSON
object that is not an agent's answer (another service on the port, a proxy's own reply, an
agent of another shape) is that node's failure, audited as one, and never crashes the table.
Before, any JSON object passed: `kvctl pin` said ok and exited 0 for a node that pinned
nothing, the audit trail said ok, and an answer with a count that was not a number ended the
human output in a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.test_cli_failures_interrupt import KEY, _cli
from tests.not_an_agent import answering_url

runner = CliRunner()


def _refuse(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


@pytest.mark.parametrize(
    "body",
    [
        b'{"status": "ok"}',  # another JSON service, or a proxy's "accepted"
        b'{"done": 1, "skipped_pinned": 0, "missing": null, "failed": 0}',
        b'{"done": "1", "skipped_pinned": 0, "missing": 0, "failed": 0}',
        # NaN is no agent's (its JSON has none), and --json would pass it on as bare NaN
        b'{"done": 1, "skipped_pinned": 0, "missing": 0, "failed": 0, "usage": {"x": NaN}}',
    ],
)
@pytest.mark.parametrize("json_out", [False, True])
def test_an_answer_that_is_not_an_agents_is_that_nodes_failure(
    tmp_path: Path, body: bytes, json_out: bool
) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with answering_url(200, body, "application/json") as url:
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "odd", "--dc", "fra", "--agent-url", url)
        args = ["pin", "--node", "odd", "--key", KEY, "--db", db, *(["--json"] * json_out)]
        out = runner.invoke(app, args, env={"COLUMNS": "1000", "KVCTL_TOKEN": None})
    said = " ".join(out.output.split())
    assert out.exit_code == 1, said
    assert out.exception is None or isinstance(out.exception, SystemExit), said
    assert "not a kvctl agent's answer" in said, said
    if json_out:
        assert json.loads(out.stdout, parse_constant=_refuse)["failed"] == ["odd"]
    (row,) = json.loads(_cli(db, "audit", "--action", "pin", "--json"))
    assert row["ok"] is False and "not a kvctl agent's answer" in row["result"], row
