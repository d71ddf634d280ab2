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
import typer.rich_utils
from typer.testing import CliRunner

from kvctl.cli.main import app, prose_help

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


def test_prose_help_flows_paragraphs_and_keeps_example_lines() -> None:
    doc = """Do a thing.

    First sentence runs over
    two lines. Second one.

    Examples:

      kvctl thing --a 1
      kvctl thing --b 2
    """
    assert prose_help(doc) == (
        "Do a thing.\n\nFirst sentence runs over two lines. Second one.\n\nExamples:\n\n"
        "  kvctl thing --a 1\n  kvctl thing --b 2"
    )


@pytest.mark.parametrize("path", [" ".join(p) for p, _ in COMMANDS])
def test_help_paragraphs_hold_no_line_break_of_the_source(path: str) -> None:
    cmd = dict((" ".join(p), c) for p, c in COMMANDS)[path]
    for paragraph in cmd.help.split("\n\n"):
        if not paragraph[:1].isspace():  # indented: examples, one per line on purpose
            assert "\n" not in paragraph, f"kvctl {path}: {paragraph!r}"


@pytest.mark.parametrize(
    ("args", "source_line_break"),
    [
        (["simulate"], "all blocks before it in the request are cached"),
        (["status"], "A node that does not answer is shown down with the last time"),
        (["agent", "start"], "the data plane (TCP, Unix socket, shared memory) and /metrics"),
        (["bench", "db"], "next to the driver's plain bulk path"),
    ],
)
def test_rendered_help_reads_as_prose(
    args: list[str], source_line_break: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # wide enough that only a line break left in the text could split the sentence
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 1000)
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert source_line_break in result.output
    shown = {line.strip() for line in result.output.splitlines()}
    cmd = dict(COMMANDS)[tuple(args)]
    examples = [line.strip() for line in cmd.help.split("Examples:")[1].splitlines()]
    assert set(filter(None, examples)) <= shown  # still one per line


def _command_lines(text: str) -> list[str]:
    """The `kvctl ...` commands of a block of examples: one a line, past any VAR=value and
    sudo, cut at a comment, a pipe or a redirection (what the shell, not kvctl, reads)."""
    import re
    import shlex

    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"\$\([^)]*\)", "VALUE", line)  # a command substitution is one word
        line = re.split(r"\s#|\s\||\s[<>]|\s&&", " " + line.strip())[0].strip()
        if not re.match(r"^(?:[A-Z_]+=\S*\s+|sudo\s+)*kvctl\b", line):
            continue  # another program's command (vllm serve, promtool...)
        words = shlex.split(line)
        while words and (re.match(r"^[A-Z_]+=", words[0]) or words[0] == "sudo"):
            words = words[1:]
        if words[:1] == ["kvctl"]:
            out.append(shlex.join(words[1:]))
    return out


def _examples() -> list[str]:
    import re

    found = [
        line for _, cmd in COMMANDS for line in _command_lines(cmd.help.split("Examples:", 1)[1])
    ]
    readme = README.read_text(encoding="utf-8")
    for block in re.findall(r"```(?:console|bash|sh)\n(.*?)```", readme, re.DOTALL):
        found += _command_lines(block)
    return found


@pytest.mark.parametrize("example", _examples())
def test_every_example_names_options_that_exist(example: str) -> None:
    """Each `kvctl ...` line of the commands' examples and the README's console blocks parses:
    its subcommands, options and their values exist as written (a renamed or dropped flag
    fails here, not on an operator's terminal). Parsing runs no command."""
    import shlex

    words = shlex.split(example)
    cmd: Any = typer.main.get_command(app)
    while hasattr(cmd, "commands") and words and words[0] in cmd.commands:
        cmd = cmd.commands[words.pop(0)]
    if hasattr(cmd, "commands") or any(w in ("--help", "--install-completion") for w in words):
        pytest.skip("a group or a flag acted on while parsing: nothing to check")
    cmd.make_context("kvctl", list(words))  # a usage error fails the test with its message


def test_the_readmes_fleet_file_imports(tmp_path: Path) -> None:
    """The README's example fleet file (its ```toml block) is one `kvctl fleet import` takes:
    it linked fra to an `ams` it did not define, so the import refused it."""
    import json
    import re

    block = re.findall(r"```toml\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)
    assert len(block) == 1
    fleet_file = tmp_path / "fleet.toml"
    fleet_file.write_text(block[0])
    url = f"sqlite:///{tmp_path / 'kvctl.db'}"
    out = CliRunner().invoke(app, ["fleet", "import", str(fleet_file), "--json", "--db", url])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["counts"]["link"]["add"] == 1
