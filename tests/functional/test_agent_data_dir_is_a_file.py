"""`kvctl agent status|stop --data-dir PATH` where PATH is a file (or runs through one): said as
such, with a hint to name the agent's data directory, not 'run this as the agent's user' (no
user can read an agent's record under a file)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()


def _run(tmp_path: Path, *args: str) -> Any:
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    env["COLUMNS"] = "1000"
    return runner.invoke(app, list(args), env=env)


@pytest.mark.parametrize(
    "command", ["status", "stop", "remote", "probe http://127.0.0.1:9", "retry-tier disk"]
)
@pytest.mark.parametrize("below", [False, True], ids=["the-file", "a-path-through-it"])
def test_a_data_dir_that_is_a_file_is_named_with_the_right_hint(
    tmp_path: Path, command: str, below: bool
) -> None:
    file = tmp_path / "afile"
    file.write_text("")
    data_dir = file / "sub" if below else file
    out = _run(tmp_path, "agent", *command.split(), "--data-dir", str(data_dir))
    said = " ".join(out.output.split())
    # a usage error (2), as `kvctl agent start --data-dir FILE` has it: it was 1, the code of
    # "no agent runs there now", though no agent can ever run from a file
    assert out.exit_code == 2 and "Traceback" not in said, said
    assert f"no agent has run from {data_dir}: {file} is a file, not a directory" in said, said
    assert "give --data-dir the agent's data directory" in said, said
    assert "agent's user" not in said and "Not a directory" not in said, said
    assert file.read_text() == ""
