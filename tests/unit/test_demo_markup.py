"""The demo's console lines quote paths, URLs and errors that are not kvctl's: read as rich
markup, a "[/...]" in them was a MarkupError traceback that ended the demo (its fleet left to
the stop handler), and a "[word]" vanished from the line."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli.demo import _print_db_check, _say
from kvctl.cli.main import app
from kvctl.cli.output import console, err_console

#: a closing tag with no opening one, and a style
TEXT = "boom [/oops] [red]x [agent] y"


def test_the_demo_steps_are_shown_as_they_are() -> None:
    with console.capture() as cap:
        _say(f"agent fra-1 at /tmp/{TEXT}")
    assert f"agent fra-1 at /tmp/{TEXT}" in cap.get()


def test_the_database_check_is_shown_as_it_is() -> None:
    for check in ({"agree": None, "detail": TEXT}, {"agree": False, "detail": TEXT}):
        with err_console.capture() as cap:
            _print_db_check(check)
        assert f"database: {TEXT}" in cap.get()


def test_a_missing_trace_named_like_markup_is_named_as_it_is(tmp_path: Path) -> None:
    trace = tmp_path / "t[/x]race [bold].jsonl"
    # an unknown GPU ends the demo before anything starts, just after the trace is looked for
    result = CliRunner().invoke(
        app,
        ["demo", "--no-dashboard", "--trace", str(trace), "--gpu", "no-such-gpu"],
        env={"COLUMNS": "1000"},
    )
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert f"{trace} not found" in said and "MarkupError" not in said, said
