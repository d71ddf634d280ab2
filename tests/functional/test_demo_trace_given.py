"""`kvctl demo --trace PATH` falls back to the built-in workload only where PATH is missing (as
`make demo` relies on). A trace from a pipe (`--trace <(zcat t.jsonl.gz)`) was "not found" too,
and a directory: the demo ran the built-in workload, saying the trace given was not there."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()


def _demo(trace: Path, tmp_path: Path) -> tuple[int, str]:
    args = ["demo", "--trace", str(trace), "--no-dashboard", "--workdir", str(tmp_path / "w")]
    result = runner.invoke(app, args)
    return result.exit_code, result.output


def test_a_trace_from_a_pipe_is_read_not_replaced(tmp_path: Path) -> None:
    # a broken line: the demo stops on reading it, before any agent starts
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "w", encoding="utf-8") as out:
            out.write("{not json}\n")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    code, out = _demo(fifo, tmp_path)
    if writer.is_alive():  # not read: let the writer end
        with open(fifo, "rb") as drain:
            drain.read()
    writer.join()
    assert code == 2, out
    assert f"{fifo}:1:" in out and "not found" not in out


def test_a_directory_given_as_the_trace_is_an_error_not_replaced(tmp_path: Path) -> None:
    code, out = _demo(tmp_path, tmp_path)
    assert code == 2, out
    assert "is a directory" in out and "not found" not in out
