"""`kvctl collect --interval`/`--link-interval` take at most a day and `kvctl router serve
--chunk-tokens` at most 65,536 (as `kvctl keys`), refused by name past them (exit 2).
`collect --once --interval 1e300` failed with a bug's line (OverflowError: timestamp out of
range for platform time_t); the router took 10**20 tokens a chunk and started."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize("option", ["--interval", "--link-interval"])
def test_collect_refuses_an_interval_past_a_day(tmp_path: Path, option: str) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    result = runner.invoke(app, ["collect", "--once", option, "1e300", "--db", db])
    said = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, said
    assert f"'{option}'" in said and "did not expect" not in said


def test_router_serve_refuses_a_chunk_no_engine_has() -> None:
    args = ["router", "serve", "--agent", "a=http://127.0.0.1:1@fra", "--listen", "127.0.0.1:0"]
    result = runner.invoke(app, [*args, "--chunk-tokens", "99999999999999999999"])
    said = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 2, said
    assert "'--chunk-tokens'" in said
