"""--trace from a pipe (`--trace <(zcat trace.jsonl.gz)`, a FIFO, /dev/stdin) or a device is
read as a stream. It was refused as "no such file: /dev/fd/63", though it was there (the check
took only regular files and directories), and /dev/null was "no such file" too."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()


def _line(i: int, ids: list[int]) -> str:
    record = {"timestamp": i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}
    return json.dumps(record) + "\n"


@contextmanager
def _fifo(tmp_path: Path, text: str) -> Iterator[Path]:
    """A FIFO a thread writes ``text`` into once a reader opens it."""
    path = tmp_path / "trace.fifo"
    os.mkfifo(path)

    def write() -> None:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        if writer.is_alive():  # nobody read it: open it once so the writer ends
            with open(path, "rb") as drain:
                drain.read()
        writer.join()


def test_a_trace_from_a_fifo_is_read(tmp_path: Path) -> None:
    text = "".join(_line(i, [0, 1, 10 + i]) for i in range(6))
    with _fifo(tmp_path, text) as fifo:
        result = runner.invoke(app, ["simulate", "--trace", str(fifo), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["requests"] == 6


def test_a_fifo_whose_ids_are_not_prefix_hashes_is_refused_without_reading_it_again(
    tmp_path: Path,
) -> None:
    # the message names the line that first had the id by reading the file again: a FIFO
    # opened again would wait for a writer that never comes
    text = _line(0, [0, 1]) + _line(1, [5, 1])
    with _fifo(tmp_path, text) as fifo:
        result = runner.invoke(app, ["simulate", "--trace", str(fifo)])
    assert result.exit_code == 2, result.output
    assert f"{fifo}:2:" in result.output and "on an earlier line" in result.output


def test_dev_null_is_an_empty_trace_not_a_missing_one() -> None:
    result = runner.invoke(app, ["simulate", "--trace", os.devnull])
    assert result.exit_code == 2
    assert "holds no requests" in result.output and "no such file" not in result.output


def test_a_missing_trace_is_still_no_such_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2 and "no such file" in result.output
