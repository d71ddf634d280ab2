"""Mooncake trace reading/validation, prefix-hit statistics and the built-in workload."""

from __future__ import annotations

import itertools
import json
import pathlib

import pytest

from kvctl.errors import InvalidArgument
from kvctl.workload.builtin import builtin_workload
from kvctl.workload.trace import (
    TraceFormatError,
    TraceRequest,
    find_default_trace,
    prefix_hit_blocks,
    read_mooncake_trace,
    trace_summary,
)


def _record(timestamp: int, input_length: int, hash_ids: list[int], **extra: object) -> str:
    fields = {"timestamp": timestamp, "input_length": input_length, "output_length": 7}
    return json.dumps({**fields, "hash_ids": hash_ids, **extra})


def _write(tmp_path: pathlib.Path, lines: list[str]) -> pathlib.Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_reads_small_trace(tmp_path: pathlib.Path) -> None:
    path = _write(
        tmp_path,
        [_record(0, 1000, [0, 1]), _record(250, 512, [0], tenant="acme"), _record(300, 0, [])],
    )
    requests = read_mooncake_trace(path)
    assert requests[0] == TraceRequest(0, 1000, 7, (0, 1))
    assert requests[0].block_token_counts == (512, 488)
    assert requests[1].tenant == "acme"
    assert requests[1].block_token_counts == (512,)
    assert requests[2].block_token_counts == ()
    assert read_mooncake_trace(path, limit=2) == requests[:2]


def test_block_tokens_changes_expected_id_count(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path, [_record(0, 300, [4, 5, 6])])
    (request,) = read_mooncake_trace(path, block_tokens=128)
    assert request.block_token_counts == (128, 128, 44)
    with pytest.raises(TraceFormatError, match="needs"):
        read_mooncake_trace(path)


def test_blank_lines_are_skipped(tmp_path: pathlib.Path) -> None:
    path = _write(tmp_path, ["", _record(0, 10, [0]), "   ", "", _record(5, 10, [0])])
    assert [r.timestamp_ms for r in read_mooncake_trace(path)] == [0, 5]


@pytest.mark.parametrize(
    ("bad_line", "problem"),
    [
        ('{"timestamp": 1, "input_length": ', "invalid JSON"),
        (
            json.dumps({"timestamp": 1, "input_length": 10, "output_length": 1}),
            "missing key.*hash_ids",
        ),
        (_record(1, 1100, [0, 1]), "needs"),
        (_record(-1, 10, [0]), "timestamp must be a non-negative integer"),
        # past a float's range: kvctl replay --speed failed dividing it (OverflowError), mid-run
        (_record(10**400, 10, [0]), "timestamp must be a non-negative integer below 2\\*\\*63"),
        (_record(1, 10, [0], output_length=2**63), "output_length must be .* below 2\\*\\*63"),
        (_record(1, 10, [-3]), "hash_ids must be non-negative integers"),
        (_record(1, 10, [True]), "hash_ids must be non-negative integers"),
        # an id past 64 bits crashed the simulator (int.to_bytes) and stopped a replay midway
        (_record(1, 10, [2**64]), "hash_ids must be non-negative integers below 2\\*\\*64"),
        ("[1, 2]", "expected a JSON object"),
        # read, then every agent refused it: kvctl replay stopped at that request, its
        # summary lost, naming no line of the trace
        (_record(1, 10, [0], tenant="x" * 300), "tenant name is 300 bytes in UTF-8; at most 256"),
        (_record(1, 10, [0], tenant=5), "tenant must be a string, got 5"),  # was dropped
    ],
)
def test_malformed_line_names_file_and_line(
    tmp_path: pathlib.Path, bad_line: str, problem: str
) -> None:
    # Line 4 is the bad one: a blank line still counts toward the line number.
    path = _write(tmp_path, [_record(0, 10, [0]), "", _record(1, 10, [0]), bad_line])
    with pytest.raises(TraceFormatError, match=problem) as excinfo:
        read_mooncake_trace(path)
    assert excinfo.value.line_no == 4
    assert f"{path}:4:" in str(excinfo.value)
    assert isinstance(excinfo.value, InvalidArgument)


def test_a_line_that_is_not_utf8_names_file_and_line(tmp_path: pathlib.Path) -> None:
    # Python's own decode error named neither the file nor the line of the bad byte
    path = tmp_path / "trace.jsonl"
    good = _record(0, 10, [0]).encode()
    path.write_bytes(good + b"\n\n" + b'{"timestamp": 1, "tenant": "caf\xe9"}\n' + good + b"\n")
    with pytest.raises(TraceFormatError, match="not UTF-8") as excinfo:
        read_mooncake_trace(path)
    assert excinfo.value.line_no == 3
    assert f"{path}:3:" in str(excinfo.value)
    assert "(byte 0xe9 at column 32)" in str(excinfo.value)


@pytest.mark.parametrize(
    ("kind", "tool"), [("gzip", "zcat"), ("bzip2", "bzcat"), ("xz", "xzcat"), ("zstd", "zstdcat")]
)
def test_a_compressed_trace_is_named_with_the_tool_that_reads_it(
    tmp_path: pathlib.Path, kind: str, tool: str
) -> None:
    """A trace shipped compressed and given as is failed with 'not UTF-8 text (byte 0x8b ...)',
    which does not say what to do."""
    import bz2
    import gzip
    import lzma

    text = (_record(0, 10, [0]) + "\n").encode() * 50
    packed = {
        "gzip": gzip.compress,
        "bzip2": bz2.compress,
        "xz": lzma.compress,
        # no zstd in the standard library: its frame's magic number, then what follows it
        "zstd": lambda data: b"\x28\xb5\x2f\xfd" + bytes(range(128, 256)),
    }[kind](text)
    path = tmp_path / "trace.jsonl.packed"
    path.write_bytes(packed)
    with pytest.raises(TraceFormatError) as excinfo:
        read_mooncake_trace(path)
    assert excinfo.value.line_no == 1
    assert str(excinfo.value).endswith(
        f"the file is {kind}-compressed: give --trace <({tool} FILE)"
    )


def test_a_bad_byte_past_the_first_line_gets_no_compression_hint(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes((_record(0, 10, [0]) + "\n").encode() + b"\x1f\x8b\n")
    with pytest.raises(TraceFormatError) as excinfo:
        read_mooncake_trace(path)
    assert excinfo.value.line_no == 2 and "compressed" not in str(excinfo.value)


def test_the_column_of_a_bad_byte_counts_characters(tmp_path: pathlib.Path) -> None:
    """The column an editor shows: each 'é' before the bad byte is two bytes, one column (it
    said column 17 here, the byte's offset)."""
    path = tmp_path / "trace.jsonl"
    path.write_bytes('{"tenant": "éé'.encode() + b'\xff"}\n')
    with pytest.raises(TraceFormatError, match=r"\(byte 0xff at column 15\)"):
        read_mooncake_trace(path)


@pytest.mark.parametrize(
    ("lines", "line_no", "said"),
    [
        # id 1 after 0, then after 2: ids of each block's own content, not of its prefix; the
        # simulator counted the second request's block 1 a prefix hit (its prefix differs)
        ([[0, 1], [2, 1]], 2, "hash id 1 at block 2 follows id 2 here, id 0 on line 1"),
        ([[0, 1], [1]], 2, "hash id 1 at block 1 follows no id here, id 0 on line 1"),
        ([[7, 7]], 1, "hash id 7 at block 2 follows id 7 here, no id on line 1"),
    ],
)
def test_hash_ids_that_are_no_prefix_hashes_are_refused(
    tmp_path: pathlib.Path, lines: list[list[int]], line_no: int, said: str
) -> None:
    path = _write(tmp_path, [_record(i, 512 * len(ids), ids) for i, ids in enumerate(lines)])
    with pytest.raises(TraceFormatError, match="not prefix hashes") as excinfo:
        read_mooncake_trace(path)
    assert excinfo.value.line_no == line_no
    assert said in str(excinfo.value)


def test_the_prefix_check_holds_little_more_than_a_parent_per_id(tmp_path: pathlib.Path) -> None:
    """Bytes, not time: the check's (id, line) tuple per id doubled the memory of reading a
    trace (a 20-fold copy of the shared trace: a peak of 187 MiB, not 98) and took 70% longer
    (the garbage collector tracks tuples). A dict of ids to their parents is ~50 bytes an id."""
    import tracemalloc

    from kvctl.workload.trace import _PrefixCheck

    check = _PrefixCheck(tmp_path / "unread.jsonl")
    requests = [tuple(range(k * 50, k * 50 + 50)) for k in range(4_000)]  # 200,000 ids, made
    tracemalloc.start()
    try:
        assert all(check.problem(ids, n) is None for n, ids in enumerate(requests, start=1))
        held_bytes, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held_bytes / 200_000 < 80, held_bytes


def test_traces_numbered_apart_and_joined_are_said_to_be(tmp_path: pathlib.Path) -> None:
    """Two traces, each numbered from 0, joined into one: their ids clash (the simulator would
    count one's blocks as the other's prefixes), refused as no prefix hashes; the line said only
    'not its block's own content', which these are not, and no way out."""
    first = [_record(0, 1024, [0, 1]), _record(1, 1024, [0, 2])]
    second = [_record(2, 1024, [0, 1]), _record(3, 512, [2])]  # its own 0, 1 and 2
    with pytest.raises(TraceFormatError, match="traces numbered apart were joined") as excinfo:
        read_mooncake_trace(_write(tmp_path, first + second))
    assert excinfo.value.line_no == 4


def test_a_directory_is_said_to_be_one(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidArgument, match="is a directory"):
        read_mooncake_trace(tmp_path)


def test_prefix_hits_on_hand_built_example() -> None:
    requests = [
        TraceRequest(0, 1300, 1, (0, 1, 2)),  # 512+512+276 tokens, all new
        TraceRequest(10, 1100, 1, (0, 1, 3)),  # 512+512+76: blocks 0, 1 hit (1024 tokens)
        # 0 hits; 4 misses; 2 was seen but follows a miss, so it misses too (512 tokens hit).
        TraceRequest(2010, 1536, 1, (0, 4, 2)),
    ]
    assert prefix_hit_blocks(requests) == [0, 2, 1]
    summary = trace_summary(requests)
    assert summary["requests"] == 3
    assert summary["duration_seconds"] == pytest.approx(2.01)
    assert summary["total_blocks"] == 9
    assert summary["unique_blocks"] == 5
    assert summary["max_input_tokens"] == 1536
    assert summary["mean_input_tokens"] == pytest.approx(3936 / 3)
    assert summary["block_hit_ratio"] == pytest.approx(3 / 9)
    assert summary["token_hit_ratio"] == pytest.approx((1024 + 512) / 3936)


def test_summary_of_empty_trace() -> None:
    assert trace_summary([])["block_hit_ratio"] == 0.0


def test_request_rejects_inconsistent_block_count() -> None:
    with pytest.raises(InvalidArgument):
        TraceRequest(0, 1025, 1, (0, 1))


def test_shared_mooncake_trace_matches_readme() -> None:
    path = find_default_trace()
    if path is None:
        pytest.skip("shared Mooncake trace ../shared/data/mooncake_synthetic_trace.jsonl absent")
    summary = trace_summary(read_mooncake_trace(path))
    assert summary["requests"] == 3993
    assert summary["max_input_tokens"] == 191_378
    assert round(summary["mean_input_tokens"]) == 15_325
    assert round(summary["block_hit_ratio"], 3) == 0.640
    assert round(summary["token_hit_ratio"], 3) == 0.651


def test_builtin_workload_is_deterministic_per_seed() -> None:
    assert builtin_workload(3, requests=300) == builtin_workload(3, requests=300)
    assert builtin_workload(3, requests=300) != builtin_workload(4, requests=300)


def test_builtin_workload_shape() -> None:
    requests = builtin_workload(requests=500, block_tokens=256)
    assert len(requests) == 500
    timestamps = [r.timestamp_ms for r in requests]
    assert all(a < b for a, b in itertools.pairwise(timestamps))
    assert len({r.tenant for r in requests}) > 1
    assert all(r.block_tokens == 256 for r in requests)


def test_builtin_block_ids_are_prefix_hashes() -> None:
    # Same id at a position only with the same whole prefix: one prefix (and position) per id.
    prefix_of: dict[int, tuple[int, ...]] = {}
    for request in builtin_workload(requests=2000):
        for i, block_id in enumerate(request.block_ids):
            prefix = request.block_ids[: i + 1]
            assert prefix_of.setdefault(block_id, prefix) == prefix


def test_builtin_infinite_cache_hit_ratio_is_partial() -> None:
    summary = trace_summary(builtin_workload())
    assert 0.0 < summary["block_hit_ratio"] < 1.0
    assert 0.0 < summary["token_hit_ratio"] < 1.0


def test_builtin_workload_is_the_same_stream_as_before_open_chats_were_indexed() -> None:
    # Digest of the workload generated with the open chats in a plain list (before _OpenChats):
    # a seed's workload must not change with how its open chats are kept.
    import hashlib

    requests = builtin_workload(42, requests=2000, block_tokens=16)
    digest = hashlib.sha256(repr(requests).encode()).hexdigest()
    assert digest == "e44e05bb27b0d3db81644135ec1392b1b5d355b34ee8262ec65e66c055d52ab1"


def test_builtin_open_chats_draw_and_remove_as_a_list_does() -> None:
    import random

    from kvctl.workload.builtin import _Chat, _OpenChats

    ops = random.Random(5)
    picks_from_list, picks_from_open = random.Random(9), random.Random(9)
    plain: list[_Chat] = []
    indexed = _OpenChats()
    for n in range(5000):
        if not plain or ops.random() < 0.55:
            chat = _Chat(f"t{n}", [], turns_left=1)
            plain.append(chat)
            indexed.append(chat)
        else:
            chat = picks_from_list.choice(plain)
            assert picks_from_open.choice(indexed) is chat
            if ops.random() < 0.5:
                plain.remove(chat)
                indexed.remove(chat)
        assert len(indexed) == len(plain)
        assert bool(indexed) == bool(plain)
    assert [indexed[i] for i in range(len(indexed))] == plain
    with pytest.raises(IndexError):
        indexed[len(plain)]


def test_builtin_workload_never_compares_chats_to_find_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Ending a chat once scanned the open chats with list.remove, comparing each (field by field)
    # until it found it: quadratic in the requests (100k requests took 11.6 s).
    from kvctl.workload import builtin

    compared = []

    def counting_eq(self: object, other: object) -> bool:
        compared.append(1)
        return self is other

    monkeypatch.setattr(builtin._Chat, "__eq__", counting_eq)
    assert len(builtin_workload(1, requests=3000)) == 3000
    assert compared == []


def test_a_workload_being_generated_or_read_is_said_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    # 100k generated requests (or a big trace) take seconds before simulate/plan/replay show
    # anything: a transient line on stderr says what is going on, and --json (quiet) says nothing.
    import io

    from rich.console import Console

    from kvctl.cli import output
    from kvctl.cli.options import load_workload_said

    said = io.StringIO()
    monkeypatch.setattr(output, "err_console", Console(file=said, force_terminal=True, width=120))
    loaded = load_workload_said(None, seed=1, limit=300, workload="builtin")
    assert len(loaded.requests) == 300
    assert "generating the builtin workload (seed 1, 300 requests)" in said.getvalue()
    trace = _write(tmp_path, [_record(1, 512, [0])])
    load_workload_said(trace, seed=0, limit=None, workload="builtin")
    assert f"reading {trace}" in said.getvalue()

    quiet = io.StringIO()
    monkeypatch.setattr(output, "err_console", Console(file=quiet, force_terminal=True))
    load_workload_said(None, seed=1, limit=300, workload="builtin", quiet=True)
    assert quiet.getvalue() == ""


def test_a_trace_whose_lines_end_in_a_lone_cr_is_refused_naming_the_cause(
    tmp_path: pathlib.Path,
) -> None:
    # Lone \r line endings (classic Mac) make the whole file one line: it was refused as
    # "invalid JSON: Extra data at column 76", which says nothing of why.
    from typer.testing import CliRunner

    from kvctl.cli.main import app

    records = [_record(i, 512, [i]) for i in range(3)]
    lone = tmp_path / "cr.jsonl"
    lone.write_bytes("\r".join(records).encode() + b"\r")
    with pytest.raises(TraceFormatError, match=r":1: .*lone \\r .*tr '\\r' '\\n'"):
        read_mooncake_trace(lone)
    result = CliRunner().invoke(app, ["simulate", "--trace", str(lone)])
    said = " ".join(result.output.split())
    assert result.exit_code == 2 and "carriage return" in said and "Traceback" not in said

    # \r\n endings, and a \r as JSON's own whitespace inside a line, read as before
    crlf = tmp_path / "crlf.jsonl"
    crlf.write_bytes("\r\n".join(records).encode() + b"\r\n")
    assert len(read_mooncake_trace(crlf)) == 3
    spaced = tmp_path / "spaced.jsonl"
    spaced.write_bytes(b"\n".join(r.replace(", ", ",\r").encode() for r in records) + b"\n")
    assert len(read_mooncake_trace(spaced)) == 3
