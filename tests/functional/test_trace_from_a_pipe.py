"""--trace from a pipe (`--trace <(zcat trace.jsonl.gz)`, a FIFO, /dev/stdin) or a device is
read as a stream. It was refused as "no such file: /dev/fd/63", though it was there (the check
took only regular files and directories), and /dev/null was "no such file" too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
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


@contextmanager
def _endless_fifo(tmp_path: Path, head: bytes, line_bytes: int) -> Iterator[Path]:
    """A FIFO that gives ``head``, then ``line_bytes`` zeros with no newline (a bounded
    /dev/zero: the test must end even if the reader does not stop)."""
    path = tmp_path / "zero.fifo"
    os.mkfifo(path)

    def write() -> None:
        chunk = b"0" * (1 << 20)
        try:
            with open(path, "wb") as out:
                out.write(head)
                for start in range(0, line_bytes, len(chunk)):
                    out.write(chunk[: line_bytes - start])
        except BrokenPipeError:  # the reader stopped at the bound: what is tested
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        if writer.is_alive():
            with open(path, "rb") as drain:
                drain.read()
        writer.join()


def test_a_line_past_the_bound_is_refused_with_its_number(tmp_path: Path) -> None:
    # --trace /dev/zero (no newline, ever) was read forever into memory; now the reading stops
    # at MAX_TRACE_LINE_BYTES (64 MiB) and names the line. 1 MiB past it, then the writer ends.
    head = _line(0, [0, 1]).encode()
    with _endless_fifo(tmp_path, head, (64 << 20) + (1 << 20)) as fifo:
        result = runner.invoke(app, ["simulate", "--trace", str(fifo)])
    assert result.exit_code == 2, result.output
    assert f"{fifo}:2: line longer than 64 MiB with no newline" in result.output


def test_the_line_bound_counts_bytes_before_the_newline(tmp_path: Path) -> None:
    from kvctl.errors import InvalidArgument
    from kvctl.workload.trace import read_mooncake_trace

    line = _line(0, [0, 1]).encode()
    at_bound = tmp_path / "at.jsonl"
    at_bound.write_bytes(line)
    requests = read_mooncake_trace(at_bound, max_line_bytes=len(line) - 1)  # newline not counted
    assert len(requests) == 1
    below = len(line) - 2
    with pytest.raises(InvalidArgument, match=rf"at\.jsonl:1: line longer than {below} bytes"):
        read_mooncake_trace(at_bound, max_line_bytes=below)


def _salt_of_a_fifo(tmp_path: Path, text: str) -> tuple[str, int]:
    from kvctl.workload.source import load_workload

    tmp_path.mkdir()
    with _fifo(tmp_path, text) as fifo:
        loaded = load_workload(fifo)
    assert loaded.name == str(fifo)  # said as given
    return loaded.content_name, loaded.salt


def test_a_streams_content_is_named_by_its_content_not_its_file_name(tmp_path: Path) -> None:
    # A pipe's name says nothing of its content (/dev/fd/63 for every `<(...)`), and the replay
    # salts a workload's tokens by its content name: two different traces each read from a pipe
    # were both "63" (here both "trace.fifo") and shared chunks in the agents.
    one = "".join(_line(i, [0, 1, 10 + i]) for i in range(3))
    two = "".join(_line(i, [0, 1, 20 + i]) for i in range(3))
    name_one, salt_one = _salt_of_a_fifo(tmp_path / "a", one)
    name_two, salt_two = _salt_of_a_fifo(tmp_path / "b", two)
    name_again, salt_again = _salt_of_a_fifo(tmp_path / "c", one)
    assert salt_one != salt_two and name_one != name_two
    assert name_one.startswith("stream sha256:")
    assert (name_again, salt_again) == (name_one, salt_one)  # the same content shares


def test_dev_fd_is_not_named_by_its_descriptor_number() -> None:
    from kvctl.workload.source import load_workload

    read_end, write_end = os.pipe()
    try:
        with os.fdopen(write_end, "w", encoding="utf-8") as out:
            out.write(_line(0, [0, 1]))
        loaded = load_workload(f"/dev/fd/{read_end}")
    finally:
        os.close(read_end)
    assert len(loaded.requests) == 1
    assert loaded.name == f"/dev/fd/{read_end}"
    assert loaded.content_name != str(read_end)
    assert loaded.content_name.startswith("stream sha256:")


def test_a_line_past_the_limit_is_neither_read_nor_refused(tmp_path: Path) -> None:
    # --limit N stops before line N+1 is read: 4637530 read it first, so a line past the
    # bound there (a trace whose tail is not JSONL) failed a read that had all it asked for
    from kvctl.workload.trace import read_mooncake_trace

    first = _line(0, [0, 1]).encode()
    trace = tmp_path / "tail.jsonl"
    trace.write_bytes(first + b"x" * (2 * len(first)))  # no newline, past the bound
    requests = read_mooncake_trace(trace, limit=1, max_line_bytes=len(first))
    assert [r.block_ids for r in requests] == [(0, 1)]


def test_a_descriptor_on_a_file_is_named_as_that_file(tmp_path: Path) -> None:
    # /dev/fd/N (or /dev/stdin) open on a regular file was named "N" ("stdin") whatever the
    # file: two different traces salted their tokens alike. Named as the file it is open on, as
    # --trace FILE names it, so it shares with that file and with no other.
    from kvctl.workload.source import load_workload

    salts = {}
    for stem, ids in (("a", [0, 1]), ("b", [0, 2])):
        file = tmp_path / f"{stem}.jsonl"
        file.write_text(_line(0, ids))
        fd = os.open(file, os.O_RDONLY)  # closed before the next: both get the same number
        try:
            loaded = load_workload(f"/dev/fd/{fd}")
        finally:
            os.close(fd)
        assert loaded.name == f"/dev/fd/{fd}"  # said as given
        assert loaded.content_name == f"{stem}.jsonl" == load_workload(file).content_name
        salts[stem] = loaded.salt
    assert salts["a"] != salts["b"]


def test_dev_stdin_redirected_from_a_file_is_named_as_that_file(tmp_path: Path) -> None:
    # `kvctl replay --trace /dev/stdin < a.jsonl`: every such file was "stdin"
    file = tmp_path / "a.jsonl"
    file.write_text(_line(0, [0, 1]))
    code = (
        "from kvctl.workload.source import load_workload; "
        "print(load_workload('/dev/stdin').content_name)"
    )
    with open(file, "rb") as stdin:
        out = subprocess.run(
            [sys.executable, "-c", code], stdin=stdin, capture_output=True, text=True, timeout=120
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "a.jsonl"


def test_a_descriptor_on_a_deleted_file_is_named_by_its_content(tmp_path: Path) -> None:
    # no name to read ("a.jsonl (deleted)" is no file): named as a stream, by a digest
    from kvctl.workload.source import load_workload

    file = tmp_path / "a.jsonl"
    file.write_text(_line(0, [0, 1]))
    fd = os.open(file, os.O_RDONLY)
    try:
        file.unlink()
        loaded = load_workload(f"/dev/fd/{fd}")
    finally:
        os.close(fd)
    assert len(loaded.requests) == 1
    assert loaded.content_name.startswith("stream sha256:"), loaded.content_name


def test_a_descriptor_on_a_deleted_file_is_not_named_as_a_file_called_deleted(
    tmp_path: Path,
) -> None:
    # the descriptor's link reads "a.jsonl (deleted)": a file of that name beside it, with
    # other content, is not the file the descriptor is open on, so it does not name it
    from kvctl.workload.source import load_workload

    file = tmp_path / "a.jsonl"
    file.write_text(_line(0, [0, 1]))
    (tmp_path / "a.jsonl (deleted)").write_text(_line(0, [7, 8]))
    fd = os.open(file, os.O_RDONLY)
    try:
        file.unlink()
        loaded = load_workload(f"/dev/fd/{fd}")
    finally:
        os.close(fd)
    assert len(loaded.requests) == 1
    assert loaded.content_name.startswith("stream sha256:"), loaded.content_name


@pytest.mark.parametrize("how", ["thread-self", "a link to /dev/stdin"])
def test_a_descriptor_reached_another_way_is_named_as_the_file_it_is_open_on(
    tmp_path: Path, how: str
) -> None:
    # /proc/thread-self/fd/N, or a link to /dev/stdin: named "N" or as the link, alike for
    # every file they were open on, so two different traces salted their tokens alike
    from kvctl.workload.source import load_workload

    file = tmp_path / "a.jsonl"
    file.write_text(_line(0, [0, 1]))
    fd = os.open(file, os.O_RDONLY)
    try:
        if how == "thread-self":
            trace = f"/proc/thread-self/fd/{fd}"
        else:
            (tmp_path / "in.jsonl").symlink_to(f"/dev/fd/{fd}")
            trace = str(tmp_path / "in.jsonl")
        loaded = load_workload(trace)
    finally:
        os.close(fd)
    assert len(loaded.requests) == 1
    assert loaded.content_name == "a.jsonl", loaded.content_name
