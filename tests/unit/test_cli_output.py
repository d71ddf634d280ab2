"""Tables written to a pipe keep their rows whole: rich would wrap them at 80 columns."""

from __future__ import annotations

import io
import sys

import pytest
from rich.console import Console
from rich.table import Table

from kvctl.cli import output


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_a_wide_console_unless_columns_or_a_terminal_say_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert output._piped_width() == output.PIPED_WIDTH
    monkeypatch.setenv("COLUMNS", "100")
    assert output._piped_width() is None
    monkeypatch.delenv("COLUMNS")
    monkeypatch.setattr(sys, "stdout", _Terminal())
    assert output._piped_width() is None


def test_a_row_of_twelve_columns_stays_on_one_line_at_that_width() -> None:
    table = Table()
    for i in range(12):
        table.add_column(f"column {i}")
    table.add_row(*(f"value-{i:08d}" for i in range(12)))
    written = io.StringIO()
    Console(file=written, width=output.PIPED_WIDTH).print(table)
    assert any(
        all(f"value-{i:08d}" in ln for i in range(12)) for ln in written.getvalue().split("\n")
    )
    narrow = io.StringIO()
    Console(file=narrow, width=80).print(table)  # what a pipe got before
    assert not any(
        "value-00000011" in ln and "value-00000000" in ln for ln in narrow.getvalue().split("\n")
    )


def test_json_output_is_json_any_parser_reads(capsys: pytest.CaptureFixture[str]) -> None:
    # a broken agent's NaN or Infinity passed on by a command was printed as bare NaN: not JSON
    # for jq or any parser but Python's
    import json

    def strict(text: str) -> object:
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in the output"))

    data = {"a": float("nan"), "b": [1.5, float("inf"), {"c": -float("inf")}], "d": (2, "x")}
    output.print_json(data)
    assert strict(capsys.readouterr().out) == {
        "a": None,
        "b": [1.5, None, {"c": None}],
        "d": [2, "x"],
    }
    assert strict(output.json_text({"fine": 0.25})) == {"fine": 0.25}


def test_json_to_a_closed_stdout_goes_nowhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvctl ... --json >&-`: Python's sys.stdout is None; the output goes nowhere, as rich's
    console's does, instead of failing as a bug in kvctl."""
    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.delenv("COLUMNS", raising=False)
    output.print_json({"a": 1})
    assert output._piped_width() == output.PIPED_WIDTH
