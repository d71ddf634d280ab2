"""`kvctl lookup` checks each node's answer: a 200 with a JSON object that is not an agent's
lookup answer is that node's failure (exit 1, named in the error column and in --json), never
a traceback and never "the prompt has no full chunk". Before, `{}` passed as a node holding
nothing (exit 0), and a chunk without its tier or a count that was not a number ended the
command in a traceback, for every node asked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.test_cli_failures_interrupt import KEY, _cli
from tests.not_an_agent import answering_url

runner = CliRunner()


@pytest.mark.parametrize(
    "body",
    [
        b"{}",
        b'{"total_chunks": 1, "matched_chunks": 0, "matched_tokens": 0, "chunks": [{"key": "ab"}]}',
        b'{"total_chunks": "x", "matched_chunks": 0, "matched_tokens": 0, "chunks": []}',
        b'{"total_chunks": 1, "matched_chunks": 1, "matched_tokens": 256,'
        b' "chunks": [{"key": "ab", "tier": 5}]}',
    ],
)
@pytest.mark.parametrize("json_out", [False, True])
def test_a_lookup_answer_that_is_not_an_agents_is_that_nodes_failure(
    tmp_path: Path, body: bytes, json_out: bool
) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    with answering_url(200, body, "application/json") as url:
        _cli(db, "fleet", "add-dc", "fra")
        _cli(db, "fleet", "add-node", "odd", "--dc", "fra", "--agent-url", url)
        args = ["lookup", "--node", "odd", "--key", KEY, "--db", db, *(["--json"] * json_out)]
        out = runner.invoke(app, args, env={"COLUMNS": "1000", "KVCTL_TOKEN": None})
    said = " ".join(out.output.split())
    assert out.exit_code == 1, said
    assert out.exception is None or isinstance(out.exception, SystemExit), said
    assert "not a kvctl agent's answer" in said, said
    if json_out:
        (node,) = json.loads(out.stdout)["nodes"]
        assert node["ok"] is False and "not a kvctl agent's answer" in node["error"]
