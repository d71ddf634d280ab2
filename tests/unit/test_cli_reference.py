"""Every command has help with examples and a row in the README's command reference; shell
completion answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main

from kvctl.cli.main import app

README = Path(__file__).resolve().parents[2] / "README.md"


def _leaves(cmd: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    # typer ships its own click: a group is whatever has subcommands
    if hasattr(cmd, "commands"):
        out = []
        for name, sub in sorted(cmd.commands.items()):
            out += _leaves(sub, (*path, name))
        return out
    return [(path, cmd)]


COMMANDS = _leaves(typer.main.get_command(app))


def _reference() -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index("## Commands")
    return text[start : text.index("\n## ", start + 1)]


def test_the_tree_is_what_the_issue_asks_for() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    for wanted in (
        "fleet add-dc", "fleet add-node", "fleet add-link", "fleet ls", "fleet rm",
        "fleet import", "fleet export", "status", "lookup", "pin", "unpin", "evict", "flush",
        "prefetch", "move", "resize", "doctor", "audit", "bench crash",
    ):  # fmt: skip
        assert wanted in names


@pytest.mark.parametrize("path", [" ".join(p) for p, _ in COMMANDS])
def test_every_command_has_help_with_examples_and_a_readme_row(path: str) -> None:
    cmd = dict((" ".join(p), c) for p, c in COMMANDS)[path]
    assert cmd.help and len(cmd.help.strip()) > 20, f"kvctl {path} has no help text"
    assert "Examples:" in cmd.help, f"kvctl {path} --help shows no examples"
    examples = cmd.help.split("Examples:", 1)[1]
    assert f"kvctl {path}" in examples, f"kvctl {path}: the examples do not run the command"
    assert f"| `kvctl {path}` |" in _reference(), f"kvctl {path} is missing from the README"


def test_readme_lists_no_command_that_does_not_exist() -> None:
    import re

    names = {" ".join(p) for p, _ in COMMANDS}
    listed = re.findall(r"^\| `kvctl ([a-z -]+)` \|", _reference(), re.MULTILINE)
    assert listed and set(listed) <= names, set(listed) - names


def test_shell_completion_completes_commands_and_options() -> None:
    # completion keys on the program name, so run the installed console script
    script = Path(sys.executable).with_name("kvctl")
    if not script.exists():
        pytest.skip(f"no kvctl console script next to {sys.executable}")

    def complete(words: str, cword: int) -> list[str]:
        env = {
            **os.environ,
            "_KVCTL_COMPLETE": "complete_bash",
            "COMP_WORDS": words,
            "COMP_CWORD": str(cword),
        }
        out = subprocess.run([script], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert complete("kvctl fle", 1) == ["fleet"]
    assert "--node" in complete("kvctl pin --n", 2)
    assert set(complete("kvctl fleet ", 2)) >= {"add-dc", "add-node", "ls", "import", "export"}
