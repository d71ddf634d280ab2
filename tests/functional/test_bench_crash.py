"""`kvctl bench crash` for real, small: real agents killed with SIGKILL under write load and
restarted on their data directory. The JSON's shape and internal consistency, and what the disk
tier promises: no corrupt read, no chunk known on disk lost. No assertion on speed."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvctl.bench.crash import MUST_BE_ZERO, render_crash_bench, run_crash_bench
from kvctl.cli.main import app


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_crash_bench(
        trials=2,
        writers=2,
        chunk_bytes=64 << 10,
        cpu_bytes=1 << 20,
        disk_bytes=256 << 20,
        kill_after_s=(0.3, 0.6),
        seed=7,
        directory=tmp_path_factory.mktemp("crash"),
    )


def test_the_disk_tier_keeps_its_promise(result: dict[str, Any]) -> None:
    totals = result["totals"]
    assert result["benchmark"] == "crash" and result["trials"] == 2
    assert totals["corrupt_reads"] == 0
    assert totals["acked_disk_lost"] == 0 and totals["disk_files_not_served"] == 0
    assert result["ok"] is True and all(totals[name] == 0 for name in MUST_BE_ZERO)
    # the load was real: the cpu tier (16 chunks) overflowed into the disk tier in every trial
    for row in result["trials_detail"]:
        assert row["put_errors_before_kill"] == 0, row["put_error_examples"]
        assert row["puts_acked"] > 16 and row["disk_files_at_kill"] > 0
        assert row["disk_chunks_after_restart"] == row["disk_files_at_kill"]
        # every leftover a killed writer made is gone once the agent has opened the directory
        assert row["left_behind_dropped_at_restart"] == (
            row["temp_files_at_kill"] + row["damaged_files_at_kill"]
        )


def test_the_counts_add_up(result: dict[str, Any]) -> None:
    totals = result["totals"]
    for row in result["trials_detail"]:
        assert row["puts_acked"] == row["acked_on_disk_known"] + row["acked_cpu_last_seen"]
        assert row["acked_cpu_last_seen"] == row["acked_cpu_lost"] + row["acked_cpu_served"]
        assert row["puts_sent"] == row["puts_acked"] + row["unacked_in_flight"]
        assert row["reads"] == row["puts_sent"] and row["served"] <= row["reads"]
        assert row["disk_files_unknown_key"] == 0
        assert row["restart_seconds"] > 0 and row["fresh_start_seconds"] > 0
    for name, total in totals.items():
        assert total == sum(row[name] for row in result["trials_detail"]), name
    figures = result["figures"]
    assert figures["corrupt_reads"] == {
        "value": 0,
        "reference": 0,
        "of_reads": totals["reads"],
    }
    restart = figures["restart_seconds_median"]
    assert restart["ratio"] == pytest.approx(restart["value"] / restart["reference"])
    console = Console(file=io.StringIO(), width=200)
    console.print(render_crash_bench(result))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "corrupt reads" in text and "every must-be-zero figure is zero" in text


def test_cli_json_and_bad_input(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(
        app,
        ["bench", "crash", "--trials", "1", "--kill-after", "0.2,0.3", "--cpu", "1MiB",
         "--disk", "64MiB", "--chunk-size", "64KiB", "--dir", str(tmp_path), "--json"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    parsed = json.loads(out.stdout)
    assert parsed["trials"] == 1 and parsed["totals"]["corrupt_reads"] == 0
    assert list(tmp_path.iterdir()) == []  # trial directories removed
    bad = runner.invoke(app, ["bench", "crash", "--kill-after", "soon"])
    assert bad.exit_code == 2 and "--kill-after" in bad.output
    bad = runner.invoke(app, ["bench", "crash", "--trials", "0"])
    assert bad.exit_code == 2 and "trials" in bad.output
