"""Mooncake-format request traces: reading, validation and infinite-cache prefix statistics.

One JSON object per line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}``. ``hash_ids`` are prefix-block hashes (equal id at a position means the
whole prefix up to that block is equal), one per ``block_tokens`` tokens, the last possibly partial.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from kvctl import json_text
from kvctl.errors import InvalidArgument
from kvctl.store.index import check_tenant
from kvctl.workload.segments import Segment

if TYPE_CHECKING:
    from hashlib import _Hash

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# ../shared/data beside the checkout: the data set must never be copied into the repository.
DEFAULT_TRACE_PATH = REPO_ROOT.parent / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
DEFAULT_BLOCK_TOKENS = 512
_REQUIRED_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
#: the largest block id: the replay expands an id to tokens as a 64-bit content id, and the
#: simulator keys a block by its id's bytes; a bigger one failed there, mid-run
MAX_BLOCK_ID = 2**64 - 1
#: the largest timestamp (ms) or length: an int64, epoch nanoseconds included; a timestamp past
#: a float's range (10**400) failed kvctl replay --speed's wait in its division, mid-run
MAX_TRACE_COUNT = 2**63 - 1
#: the longest trace line read (bytes, its newline not counted): a record's longest line in the
#: shared Mooncake trace is 2,698 bytes (374 hash ids). Without a bound, input with no newline
#: (--trace /dev/zero, a binary file, a stream that never ends its line) was read forever and
#: held in memory whole
MAX_TRACE_LINE_BYTES = 64 * 1024 * 1024


def _blocks_for(input_tokens: int, block_tokens: int) -> int:
    return -(-input_tokens // block_tokens)  # ceil without floats


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One inference request: arrival time, sizes and the prefix-block ids of its input."""

    timestamp_ms: int
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    tenant: str = ""
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    #: the input as content runs (generated workloads); empty for a trace, where each block id
    #: stands for its own content (see ``content``)
    segments: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        # Cheap guard so block_token_counts can trust the shape, whoever built the request.
        if self.block_tokens <= 0:
            raise InvalidArgument(f"block_tokens must be positive, got {self.block_tokens}")
        expected = _blocks_for(self.input_tokens, self.block_tokens)
        if len(self.block_ids) != expected:
            raise InvalidArgument(
                f"{self.input_tokens} input tokens need {expected} blocks of {self.block_tokens}"
                f" tokens, got {len(self.block_ids)} block ids"
            )

    @property
    def block_token_counts(self) -> tuple[int, ...]:
        """Tokens in each block: full blocks, then the remainder in a partial last block."""
        full, rest = divmod(self.input_tokens, self.block_tokens)
        return (self.block_tokens,) * full + ((rest,) if rest else ())

    @property
    def content(self) -> tuple[Segment, ...]:
        """The input as segments. A trace's block id already names its whole prefix, so each
        block is one segment of its own content: equal ids give equal tokens at any chunk size."""
        if self.segments:
            return self.segments
        return tuple(zip(self.block_ids, self.block_token_counts, strict=True))


class TraceFormatError(InvalidArgument):
    """A trace line is not a valid Mooncake record; the message names the file and line."""

    def __init__(self, path: str | pathlib.Path, line_no: int, problem: str) -> None:
        self.path = str(path)
        self.line_no = line_no
        self.problem = problem
        super().__init__(f"{self.path}:{line_no}: {problem}")


def _is_count(value: Any) -> bool:
    # bool is an int subclass; true/false in a trace is a format error, not 1/0.
    return type(value) is int and value >= 0


def _parse_record(line: str, block_tokens: int) -> TraceRequest:
    """Parse one non-blank line; raise ValueError with a description of the problem."""
    try:
        record = json_text.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg} at column {exc.colno}") from None
    except json_text.NestedTooDeep:
        raise ValueError("invalid JSON: nested too deep to read (no record is)") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    missing = [key for key in _REQUIRED_KEYS if key not in record]
    if missing:
        raise ValueError(f"missing key(s): {', '.join(missing)}")
    for key in ("timestamp", "input_length", "output_length"):
        if not _is_count(record[key]) or record[key] > MAX_TRACE_COUNT:
            said = repr(record[key])
            said = said if len(said) <= 40 else f"{said[:37]}..."
            raise ValueError(f"{key} must be a non-negative integer below 2**63, got {said}")
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise ValueError(f"hash_ids must be a list, got {type(hash_ids).__name__}")
    expected = _blocks_for(record["input_length"], block_tokens)
    if len(hash_ids) != expected:
        raise ValueError(
            f"hash_ids has {len(hash_ids)} ids but input_length {record['input_length']}"
            f" needs ceil(/{block_tokens}) = {expected}"
        )
    bad = next((h for h in hash_ids if not _is_count(h) or h > MAX_BLOCK_ID), None)
    if bad is not None:
        raise ValueError(f"hash_ids must be non-negative integers below 2**64, got {bad!r}")
    tenant = record.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise ValueError(f"tenant must be a string, got {tenant!r}")
    if tenant:
        check_tenant(tenant)  # what every agent and router refuses, refused here with its line
    return TraceRequest(
        timestamp_ms=record["timestamp"],
        input_tokens=record["input_length"],
        output_tokens=record["output_length"],
        block_ids=tuple(hash_ids),
        tenant=tenant or "",
        block_tokens=block_tokens,
    )


class _PrefixCheck:
    """That the ids are prefix hashes: an id names its whole prefix, so it follows the same id
    (or none, first in its request) wherever it appears. Ids of each block's own content break
    that, and the simulator and planner would count a block whose prefix differs as a prefix
    hit; said instead, with the line that first had the id."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self._path = path
        #: id -> the id before it (None at a request's start); no tuple with its line per id:
        #: that doubled the memory of reading a trace and took 70% longer (tracked objects for
        #: the garbage collector). The line is looked up again only when a problem is said.
        self._parent: dict[int, int | None] = {}

    def problem(self, block_ids: Sequence[int], line_no: int) -> str | None:
        seen = self._parent
        parent: int | None = None
        for i, block_id in enumerate(block_ids):
            first = seen.setdefault(block_id, parent)
            if first != parent:
                return (
                    f"hash id {block_id} at block {i + 1} follows {_id_said(parent)} here, "
                    f"{_id_said(first)} {self._first_line(block_id, line_no)}: hash_ids "
                    "are not prefix hashes (an id names its whole prefix, not its block's own "
                    "content), or traces numbered apart were joined (their ids clash: renumber "
                    "one past the other's)"
                )
            parent = block_id
        return None

    def _first_line(self, block_id: int, line_no: int) -> str:
        """``on line N``: the first line holding ``block_id``, read again: the lines up to
        ``line_no`` were read as sound, and the first holding it is the one that gave it its
        parent. A pipe cannot be read again (opening a FIFO again waits for a writer)."""
        if not pathlib.Path(self._path).is_file():
            return "on an earlier line (a pipe, not read again to say which)"
        with open(self._path, "rb") as lines:
            for n, raw in enumerate(lines, start=1):
                if n >= line_no:
                    break
                if raw.strip() and block_id in json.loads(raw)["hash_ids"]:
                    return f"on line {n}"
        return f"on line {line_no}"


def _id_said(block_id: int | None) -> str:
    return "no id" if block_id is None else f"id {block_id}"


def _parse_line(
    path: str | pathlib.Path, line_no: int, raw: bytes, block_tokens: int
) -> list[TraceRequest]:
    """The request on one line (none on a blank one); a bad line raises TraceFormatError."""
    try:
        line = raw.decode("utf-8")
        return [_parse_record(line, block_tokens)] if line.strip() else []
    except UnicodeDecodeError as exc:
        # the column in characters, as an editor shows it: what comes before it decodes
        column = len(raw[: exc.start].decode("utf-8")) + 1
        problem = f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {column})"
        raise TraceFormatError(path, line_no, problem + _compressed(raw, line_no)) from None
    except ValueError as exc:
        problem = str(exc) + _compressed(raw, line_no)
        if b"\r" in raw.rstrip(b"\r\n"):  # "Extra data at column 76" of a whole file
            problem += (
                "; the line holds a carriage return (\\r) with no newline after it: a file"
                " whose lines end in a lone \\r (classic Mac) reads as one line; give its"
                " lines \\n endings (e.g. tr '\\r' '\\n' < in.jsonl > out.jsonl)"
            )
        raise TraceFormatError(path, line_no, problem) from None


#: the magic numbers of what traces are shipped compressed as, and the tool that reads each
_COMPRESSED = (
    (b"\x1f\x8b", "gzip", "zcat"),
    (b"\x28\xb5\x2f\xfd", "zstd", "zstdcat"),
    (b"\xfd7zXZ\x00", "xz", "xzcat"),
    (b"BZh", "bzip2", "bzcat"),
)


def _compressed(raw: bytes, line_no: int) -> str:
    """A hint for a compressed file given as a trace (read as text, its first line fails)."""
    if line_no != 1:
        return ""
    for magic, kind, tool in _COMPRESSED:
        if raw.startswith(magic):
            return f"; the file is {kind}-compressed: give --trace <({tool} FILE)"
    return ""


def _bytes_said(n_bytes: int) -> str:
    mib, rest = divmod(n_bytes, 1024 * 1024)
    return f"{mib} MiB" if mib and not rest else f"{n_bytes:,} bytes"


def _read_line(
    lines: BinaryIO, max_line_bytes: int, path: str | pathlib.Path, line_no: int
) -> bytes:
    """Line ``line_no`` of ``lines`` (b"" at the end), read with at most ``max_line_bytes``
    bytes before its newline; a longer one raises TraceFormatError, once that much is read."""
    raw = lines.readline(max_line_bytes + 1)
    if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
        raise TraceFormatError(
            path,
            line_no,
            f"line longer than {_bytes_said(max_line_bytes)} with no newline: not a trace "
            "record (one is a few KiB: one JSON object per line); is this a JSONL trace?",
        )
    return raw


def read_mooncake_trace(
    path: str | pathlib.Path,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    limit: int | None = None,
    max_line_bytes: int | None = None,
    digest: _Hash | None = None,
) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace; blank lines are skipped, ``limit`` caps the requests read.
    A line longer than ``max_line_bytes`` (default :data:`MAX_TRACE_LINE_BYTES`) is refused.
    ``digest`` (a ``hashlib`` hash) is updated with each line read, for naming a stream by its
    content."""
    if block_tokens <= 0:
        raise InvalidArgument(f"block_tokens must be positive, got {block_tokens}")
    if limit is not None and limit < 0:
        raise InvalidArgument(f"limit must be non-negative, got {limit}")
    if max_line_bytes is None:
        max_line_bytes = MAX_TRACE_LINE_BYTES  # read at call time, so tests can lower it
    requests: list[TraceRequest] = []
    prefixes = _PrefixCheck(path)
    try:
        # read as bytes, decoded line by line: a bad byte is named with its line
        with open(path, "rb") as lines:
            # the limit is checked before a line is read: a line past it is not read (a pipe
            # gives no more than needed) nor refused (one past the bound is not what was asked)
            line_no = 0
            while limit is None or len(requests) < limit:
                line_no += 1
                raw = _read_line(lines, max_line_bytes, path, line_no)
                if not raw:
                    break
                if digest is not None:
                    digest.update(raw)
                for request in _parse_line(path, line_no, raw, block_tokens):
                    problem = prefixes.problem(request.block_ids, line_no)
                    if problem:
                        raise TraceFormatError(path, line_no, problem)
                    requests.append(request)
    except IsADirectoryError:
        raise InvalidArgument(f"{path} is a directory, not a trace file (JSONL)") from None
    return requests


def find_default_trace() -> pathlib.Path | None:
    """The shared Mooncake trace when this machine has it, else None (callers skip)."""
    return DEFAULT_TRACE_PATH if DEFAULT_TRACE_PATH.is_file() else None


def prefix_hit_blocks(requests: Iterable[TraceRequest]) -> list[int]:
    """Leading blocks of each request an unlimited cache already holds (in arrival order).

    A block hits only if an earlier request had it and every earlier block of this request hit:
    the KV cache is reused as a prefix, so after the first miss everything is recomputed.
    """
    seen: set[int] = set()
    hits: list[int] = []
    for request in requests:
        n_hit = 0
        for block_id in request.block_ids:
            if block_id not in seen:
                break
            n_hit += 1
        hits.append(n_hit)
        seen.update(request.block_ids)
    return hits


def trace_summary(requests: Sequence[TraceRequest]) -> dict[str, float | int]:
    """Sizes, duration and the infinite-cache prefix hit ratios (blocks and tokens)."""
    if not requests:
        return {
            "requests": 0,
            "duration_seconds": 0.0,
            "mean_input_tokens": 0.0,
            "mean_output_tokens": 0.0,
            "max_input_tokens": 0,
            "total_blocks": 0,
            "unique_blocks": 0,
            "block_hit_ratio": 0.0,
            "token_hit_ratio": 0.0,
        }
    total_blocks = sum(len(r.block_ids) for r in requests)
    total_tokens = sum(r.input_tokens for r in requests)
    hit_blocks = 0
    hit_tokens = 0
    for request, n_hit in zip(requests, prefix_hit_blocks(requests), strict=True):
        hit_blocks += n_hit
        # Only the last block can be partial, so hit tokens are whole blocks unless all hit.
        hit_tokens += min(n_hit * request.block_tokens, request.input_tokens)
    timestamps = [r.timestamp_ms for r in requests]
    return {
        "requests": len(requests),
        "duration_seconds": (max(timestamps) - min(timestamps)) / 1000,
        "mean_input_tokens": total_tokens / len(requests),
        "mean_output_tokens": sum(r.output_tokens for r in requests) / len(requests),
        "max_input_tokens": max(r.input_tokens for r in requests),
        "total_blocks": total_blocks,
        "unique_blocks": len({b for r in requests for b in r.block_ids}),
        "block_hit_ratio": hit_blocks / total_blocks if total_blocks else 0.0,
        "token_hit_ratio": hit_tokens / total_tokens if total_tokens else 0.0,
    }


def assign_tenants(
    requests: Sequence[TraceRequest], tenants: int = 8, *, seed: int = 0
) -> list[TraceRequest]:
    """Give tenant-less requests (a Mooncake trace has none) a tenant, so that replays count
    reuse and sharing: a request that contains an earlier request's whole input (a later turn
    of the same conversation) gets that request's tenant, any other a seeded random one of
    ``tenant-0..tenant-{tenants-1}``. Requests that have a tenant keep it."""
    if tenants < 1:
        raise InvalidArgument(f"tenants must be at least 1, got {tenants}")
    rng = random.Random(seed)
    # a request's last full block id names its whole input up to there (ids are prefix hashes)
    tenant_of_end: dict[int, str] = {}
    out: list[TraceRequest] = []
    for r in requests:
        full = r.input_tokens // r.block_tokens
        tenant = r.tenant
        if not tenant:
            tenant = (
                next(
                    (tenant_of_end[b] for b in reversed(r.block_ids[:full]) if b in tenant_of_end),
                    "",
                )
                or f"tenant-{rng.randrange(tenants)}"
            )
            r = dataclasses.replace(r, tenant=tenant)
        if full:
            tenant_of_end[r.block_ids[full - 1]] = tenant
        out.append(r)
    return out
