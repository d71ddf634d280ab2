"""No number option takes inf or nan (kvctl.cli.main._finite_numbers_only): `--timeout inf`
was accepted by lookup and doctor (wait for ever), and nan by options without a minimum."""

from __future__ import annotations

import pathlib

import pytest
import typer.main
from typer.testing import CliRunner

from kvctl.cli.main import app, build_app

runner = CliRunner()

KEY = "3f2a9c0d1e4b5a697887766554433221"


@pytest.mark.parametrize(
    "args",
    [
        ["lookup", "--all", "--key", KEY, "--timeout"],
        ["doctor", "--timeout"],
        ["top", "--timeout"],
        ["simulate", "--limit", "10", "--capacity-fraction"],
        ["db", "maintain", "--raw-days"],
        ["agent", "stop", "--timeout"],
    ],
)
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400", "Infinity"])
def test_a_number_that_is_not_finite_is_refused_in_one_line(
    args: list[str], value: str, tmp_path: pathlib.Path
) -> None:
    db = f"sqlite:///{tmp_path / 'none.db'}"
    for cli in (app, build_app(args[0])):
        out = runner.invoke(cli, [*args, value], env={"KVCTL_DB_URL": db})
        assert out.exit_code == 2, out.output
        assert out.exception is None or isinstance(out.exception, SystemExit)
        assert "Traceback" not in out.output
        option = args[-1]
        assert f"Invalid value for '{option}'" in out.output, out.output
        # nan or -inf under a minimum is refused by the minimum first; else as not finite
        assert "must be a finite number" in out.output or (
            value in ("nan", "-inf") and "greater than or equal" in out.output
        ), out.output
    assert not (tmp_path / "none.db").exists()


def test_a_finite_timeout_is_still_taken(tmp_path: pathlib.Path) -> None:
    db = f"sqlite:///{tmp_path / 'none.db'}"
    out = runner.invoke(
        app, ["lookup", "--all", "--key", KEY, "--timeout", "0.5"], env={"KVCTL_DB_URL": db}
    )
    assert out.exit_code == 2
    assert "no fleet database" in out.output  # past the option, at the database


def test_every_option_of_every_command_is_guarded() -> None:
    def params(command: object) -> list[object]:
        found = list(getattr(command, "params", []))
        for sub in getattr(command, "commands", {}).values():
            found += params(sub)
        return found

    root = typer.main.get_command(app)  # its own flags (shell completion) are typer's
    every = [p for sub in root.commands.values() for p in params(sub)]  # type: ignore[attr-defined]
    assert len(every) > 100
    assert all(getattr(p, "_finite_only", False) for p in every)
