"""Text that is not kvctl's own (the inventory's names, an agent's or a proxy's error, the audit
trail's records) printed as it is by every table: read as rich markup, a "[/...]" in it was a
MarkupError traceback instead of the fleet's status, and once such an error was audited,
`kvctl audit` failed until the row aged out; a "[word]" in it vanished from the output."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.not_an_agent import answering_url

runner = CliRunner()
#: what a proxy or a broken agent might answer: a closing tag with no opening one, and a style
DETAIL = "boom [/oops] [red]x [agent] y"
KEY = "3f2a9c0d1e4b5a697887766554433221"
#: a node and a DC whose names look like markup
NODE, DC = "gpu[/]1", "fra[bold]"


def _run(db: str, *args: str) -> tuple[int, str]:
    result = runner.invoke(app, [*args, "--db", db], env={"COLUMNS": "1000", "KVCTL_TOKEN": None})
    assert "Traceback" not in result.output and "MarkupError" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fleet database with one node, named like markup, whose "agent" answers every call
    500 with DETAIL."""
    db = f"sqlite:///{tmp_path_factory.mktemp('markup') / 'kvctl.db'}"
    body = json.dumps({"detail": DETAIL}).encode()
    with answering_url(500, body, "application/json") as url:
        assert _run(db, "fleet", "add-dc", DC)[0] == 0
        assert _run(db, "fleet", "add-node", NODE, "--dc", DC, "--agent-url", url)[0] == 0
        yield db


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["status"], 0),
        (["lookup", "--all", "--text", "a b c"], 1),
        (["collect", "--once", "--no-links", "--metrics-listen", "off"], 1),
        (["pin", "--all", "--yes", "--key", KEY], 1),
    ],
    ids=["status", "lookup", "collect", "pin"],
)
def test_names_and_errors_are_shown_as_they_are(fleet: str, args: list[str], code: int) -> None:
    exit_code, out = _run(fleet, *args)
    assert exit_code == code, out
    assert NODE in out and DETAIL in out, out


def test_the_audit_trail_shows_an_audited_error_as_it_is(fleet: str) -> None:
    assert _run(fleet, "pin", "--node", NODE, "--key", KEY)[0] == 1  # audited, failed
    code, out = _run(fleet, "audit")
    assert code == 0, out
    assert NODE in out and "boom [/oops]" in out and "fleet.add-node" in out


def test_an_agent_named_like_markup_is_shown_as_it_is(tmp_path: Path) -> None:
    # an agent's name has no "/", but "[agent]" or "[bold]" in it vanished from the table
    config = tmp_path / "agent.toml"
    config.write_text('[agent]\nname = "gpu[agent]1"\ndc = "fra[bold]"\n')
    result = runner.invoke(
        app, ["agent", "config", "--config", str(config)], env={"COLUMNS": "1000"}
    )
    assert result.exit_code == 0, result.output
    assert "gpu[agent]1" in result.output and "fra[bold]" in result.output, result.output


@pytest.mark.parametrize(
    "args",
    [["simulate"], ["simulate", "--sweep"], ["plan", "--curve-points", "0"]],
    ids=["simulate", "sweep", "plan"],
)
def test_a_trace_path_is_shown_as_it_is(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "runs[").mkdir()
    trace = tmp_path / "runs[" / "]1.jsonl"  # the path reads "runs[/]1.jsonl"
    rows = [
        {"timestamp": i, "input_length": 2048, "output_length": 1, "hash_ids": [0, 1, 2, 10 + i]}
        for i in range(40)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = runner.invoke(app, [*args, "--trace", str(trace)], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    assert f"{trace}:" in "".join(result.output.split())  # a title wraps where it likes
