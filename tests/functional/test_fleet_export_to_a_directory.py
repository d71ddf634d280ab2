"""`kvctl fleet export -o DIR` says the option names a directory. It said "cannot tell the
format of 'adir' from its suffix" (a format was not the problem), with --format "is a directory
writing adir", and -o '' (which the option reads as '.') the same of '.'."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize("fmt", [[], ["--format", "toml"]])
def test_export_to_a_directory_names_the_option(tmp_path: Path, fmt: list[str]) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    target = tmp_path / "out"
    target.mkdir()
    result = runner.invoke(app, ["fleet", "export", "-o", str(target), *fmt, "--db", db])
    assert result.exit_code == 2, result.output
    assert f"--output {target} is a directory" in result.output
    assert not list(target.iterdir())


def test_export_to_an_empty_path_names_the_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["fleet", "export", "-o", "", "--db", "sqlite:///kvctl.db"])
    assert result.exit_code == 2, result.output
    assert "--output . is a directory" in result.output
