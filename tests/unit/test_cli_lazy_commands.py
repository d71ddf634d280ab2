"""`kvctl NAME ...` builds only the command or group NAME (kvctl.cli.main.build_app): it must
answer exactly as the whole CLI does, and must not import the other command modules."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvctl.cli.control import COMMANDS as CONTROL_COMMANDS
from kvctl.cli.main import _ENTRIES, CONTROL, app, build_app

NAMES = [name for name, *_ in _ENTRIES if name != CONTROL] + list(CONTROL_COMMANDS)
runner = CliRunner()


@pytest.mark.parametrize("name", NAMES)
def test_one_command_alone_answers_as_in_the_whole_cli(name: str) -> None:
    for args in ([name, "--help"], [name, "--no-such-option"]):
        whole = runner.invoke(app, args, terminal_width=100)
        alone = runner.invoke(build_app(name), args, terminal_width=100)
        assert (alone.exit_code, alone.output) == (whole.exit_code, whole.output), args


def test_every_command_of_the_whole_cli_is_known_by_name() -> None:
    import typer.main

    whole = typer.main.get_command(app)
    assert sorted(whole.commands) == sorted(NAMES)  # type: ignore[attr-defined]


def test_an_unknown_name_builds_the_whole_cli_for_its_suggestions() -> None:
    out = runner.invoke(build_app("stauts"), ["stauts"])
    assert out.exit_code == 2 and "status" in out.output


def test_an_agent_start_imports_no_other_command_module() -> None:
    code = (
        "import sys\n"
        "sys.argv = ['kvctl', 'agent', 'start', '--help']\n"
        "from kvctl.cli.main import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('kvctl.cli.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    loaded = set(out.stdout.strip().splitlines()[-1].split())
    assert "kvctl.cli.agent" in loaded
    for other in ("kvctl.cli.top", "kvctl.cli.dashboard", "kvctl.cli.demo", "kvctl.cli.bench"):
        assert other not in loaded, loaded
