"""`kvctl --help` and each group's (`kvctl fleet --help`, `agent`, `router`, `db`, `bench`) end
with examples, as every command's does: they listed their commands only."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize("group", [[], ["fleet"], ["agent"], ["router"], ["db"], ["bench"]])
def test_each_group_help_ends_with_examples(group: list[str]) -> None:
    result = runner.invoke(app, [*group, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    tail = result.output.split("Examples:", 1)
    assert len(tail) == 2, result.output
    examples = [line.strip(" │") for line in tail[1].splitlines() if "kvctl " in line]
    assert examples, result.output
    prefix = " ".join(["kvctl", *group]) + " "
    assert all(e.startswith(prefix) for e in examples), examples
    for example in examples:  # each names a command that exists: its --help answers
        words = example.split()[1:]
        command = [w for w in words[: len(group) + 1] if not w.startswith("-")]
        assert runner.invoke(app, [*command, "--help"]).exit_code == 0, example
