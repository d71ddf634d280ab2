"""`kvctl bench reopen` for real, small: a disk tier of real chunk files opened after a clean
close and after a crash. The JSON's shape and what it says it measured; no assertion on speed."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()


def test_the_command_prints_both_opens_per_cache_state_as_json(tmp_path: Path) -> None:
    args = ["bench", "reopen", "--chunks", "300", "--repeats", "2", "--dir", str(tmp_path)]
    out = runner.invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    assert (result["benchmark"], result["chunks"], result["repeats"]) == ("reopen", 300, 2)
    # the index held every chunk: its 24-byte head, one (empty) tenant name, 300 entries of 82
    # bytes, 10 bytes for each fan-out directory holding any (of 256) and its checksum
    dirs, rest = divmod(result["index_bytes"] - (24 + 2 + 300 * 82 + 4), 10)
    assert rest == 0 and 100 < dirs <= 256, result["index_bytes"]
    assert set(result["figures"]) == {"warm", "cold"}  # cold_all is asked for
    for fig in result["figures"].values():
        assert len(fig["samples_index_seconds"]) == len(fig["samples_scan_seconds"]) == 2
        assert fig["index_open_seconds"] > 0 and fig["scan_open_seconds"] > 0
        ratio = fig["scan_open_seconds"] / fig["index_open_seconds"]
        assert abs(fig["scan_over_index_ratio"] - ratio) < 1e-9
    assert result["close_seconds"] > 0
    assert list(tmp_path.iterdir()) == []  # its temporary directory is gone
    table = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    assert "after a clean close" in table.output and "after a crash (scan)" in table.output


def test_a_bad_count_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = runner.invoke(app, ["bench", "reopen", "--chunks", "0", "--dir", str(tmp_path)])
    assert out.exit_code == 2, out.output
    assert "chunks, chunk size and repeats must be at least 1" in out.output
    assert "Traceback" not in out.output
