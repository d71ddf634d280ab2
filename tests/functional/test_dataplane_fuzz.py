"""Fuzz the data plane of one real agent: thousands of random, mutated, truncated and oversized
frames (and hostile staging segments on the Unix socket) over many connections. After every
batch the agent must be alive, a well-behaved client's round trips exact, and the chunks stored
before the fuzzing either exact or gone (evicted), never wrong.

Bounded for CI: ``KVCTL_FUZZ_FRAMES`` frames (default 3000) from ``KVCTL_FUZZ_SEED`` (default
22). A long run: ``KVCTL_FUZZ_FRAMES=200000 pytest -s tests/functional/test_dataplane_fuzz.py``;
it prints the frames sent per second. A failure names the seed and the batch to replay."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvctl.wire.protocol import (
    CLOSING_ERROR_CODES,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    MAX_META_BYTES,
    RATE_SAMPLE,
    REPLY_BIT,
    VERSION,
    ErrorCode,
    MetaWriter,
    Op,
    pack_header,
    parse_error,
    put_item,
)

from .agents import Agent, key, payload
from .dataplane_hostile_agents import exit_description, hostile_agent

pytestmark = pytest.mark.skipif(
    sys.platform != "linux", reason="memfd staging segments and /proc are Linux"
)

FRAMES = int(os.environ.get("KVCTL_FUZZ_FRAMES", "3000"))
SEED = int(os.environ.get("KVCTL_FUZZ_SEED", "22"))
BATCH_FRAMES = 250
#: one connection's exchange must end within this (the agent answers or closes; a hang fails)
EXCHANGE_TIMEOUT_S = 60.0
#: errors after which the agent closes the connection
FATAL_CODES = CLOSING_ERROR_CODES
REQUEST_OPS = [op for op in Op if op != Op.ERROR]
#: a small key space, so fuzzed GETs, LEASEs and FETCHes hit what fuzzed PUTs stored
FUZZ_KEYS = [key(i, 9000) for i in range(24)]
REFERENCE_KEYS = [key(i, 9100) for i in range(16)]
SEGMENT_BYTES = 1 << 20


@dataclass
class Piece:
    """Bytes to send, with descriptors passed along with the first of them (Unix socket);
    ``then`` runs once the agent has answered this piece (one more reply frame arrived)."""

    data: bytes
    fds: list[int] = field(default_factory=list)
    then: Callable[[], None] | None = None


@dataclass
class Sequence:
    pieces: list[Piece]
    #: every frame is well-formed and none is fatal: the closing PING must be answered
    in_step: bool
    kinds: list[str]


# --- frame makers -----------------------------------------------------------------------------
def _tenant(rng: random.Random) -> str:
    return rng.choice(["", "t", "fuzz", "ü-tenant", "x" * rng.randint(0, 300)])


def _keys(rng: random.Random, most: int = 8) -> list[bytes]:
    return [
        rng.choice(FUZZ_KEYS) if rng.random() < 0.7 else rng.randbytes(16)
        for _ in range(rng.randint(0, most))
    ]


def _odd_float(rng: random.Random) -> float:
    return rng.choice(
        [0.0, -1.0, 0.5, 1e9, 1e308, float("nan"), float("inf"), -float("inf"), rng.random()]
    )


def _valid_meta(rng: random.Random, op: Op, unix: bool) -> tuple[bytes, bytes]:
    """(meta, payload) of a well-formed request of ``op``, its values random but never one
    that the protocol makes fatal."""
    w = MetaWriter()
    body = b""
    if op == Op.HELLO:
        w.text(rng.choice(["", "wrong-token"])).text("fuzz")
    elif op in (Op.PING, Op.MAP):
        pass
    elif op == Op.PUT:
        n = rng.randint(0, 4)
        w.text(_tenant(rng)).u32(n)
        parts = []
        for k in rng.sample(FUZZ_KEYS, n):
            size = rng.choice([0, 1, 100, 4096, 70_000])
            parent = rng.choice([None, rng.choice(FUZZ_KEYS)])
            w.raw(
                put_item(
                    k,
                    size,
                    tokens=rng.randint(0, 300),
                    priority=rng.randint(0, 255),
                    pinned=rng.random() < 0.2,
                    parent=parent,
                    depth=rng.randint(0, 5),
                    isolated=rng.random() < 0.1,
                )
            )
            parts.append(payload(k, size))
        body = b"".join(parts)
    elif op == Op.PUT_STAGED:
        n = rng.randint(0, 4)
        w.text(_tenant(rng)).u32(n)
        for k in rng.sample(FUZZ_KEYS, n):
            size = rng.choice([1, 4096, 8192, SEGMENT_BYTES, 0, 1 << 40, (1 << 64) - 1])
            offset = rng.choice([0, 0, 4096, 8192, SEGMENT_BYTES - 1, SEGMENT_BYTES, 1 << 63])
            w.raw(put_item(k, size, staging_offset=offset))
    elif op in (Op.GET, Op.EXISTS, Op.LOOKUP):
        w.text(_tenant(rng)).keys(_keys(rng))
    elif op == Op.LOOKUP_MANY:
        chains = rng.randint(0, 4)
        w.text(_tenant(rng)).u32(chains)
        for _ in range(chains):
            w.keys(_keys(rng))
    elif op in (Op.LEASE, Op.LOOKUP_LEASE, Op.LOOKUP_LEASE_LOCAL):
        w.text(_tenant(rng)).f64(_odd_float(rng)).keys(_keys(rng))
    elif op == Op.RELEASE:
        n = rng.randint(0, 5)
        w.u32(n)
        for _ in range(n):
            w.u64(rng.getrandbits(64))
    elif op == Op.ATTACH:  # no descriptor here: refused, not fatal
        w.u64(rng.choice([0, 1, SEGMENT_BYTES, 1 << 62]))
    elif op == Op.PROBE:
        w.u64(rng.randint(0, 256 << 10))
        body = bytes(rng.randint(0, 64 << 10))
    elif op == Op.FETCH:
        # payload, checksums, both, and bits no client sends (refused, not fatal)
        w.text(_tenant(rng)).u8(rng.choice([0, 1, 2, 3, 0x80, 0xFF])).keys(_keys(rng))
    elif op == Op.TENANT:
        w.text(_tenant(rng))
    elif op == Op.RATES:
        n = rng.randint(0, 6)
        w.text(rng.choice(["", "llama-3.1-8b", "no-such-model"])).f64(_odd_float(rng)).u32(n)
        for _ in range(n):
            w.raw(
                RATE_SAMPLE.pack(
                    rng.getrandbits(rng.choice([4, 20, 64])),
                    rng.getrandbits(rng.choice([4, 20, 64])),
                    _odd_float(rng),
                )
            )
    return w.build(), body


def _frame(op: int, meta: bytes, body: bytes = b"", rid: int = 1) -> bytes:
    return pack_header(op, rid, len(meta), len(body)) + meta + body


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """A few random byte flips, insertions, deletions or a cut, mostly in header and meta."""
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        how = rng.choice(["flip", "flip", "set", "insert", "delete", "cut", "length"])
        pos = rng.randrange(min(len(b), 200)) if b else 0
        if how == "flip" and b:
            b[pos] ^= 1 << rng.randrange(8)
        elif how == "set" and b:
            b[pos] = rng.choice([0, 0xFF, 0x7F, 0x80, rng.randrange(256)])
        elif how == "insert":
            b[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif how == "delete" and b:
            del b[pos : pos + rng.randint(1, 8)]
        elif how == "cut":
            del b[rng.randint(0, len(b)) :]
        elif how == "length" and len(b) >= HEADER_BYTES:  # meta_len or payload_len
            if rng.random() < 0.5:
                struct.pack_into("<I", b, 8, rng.choice([0, 1, 7, len(b), MAX_META_BYTES]))
            else:
                struct.pack_into("<Q", b, 12, rng.choice([0, 1, 100, 1 << 20, 1 << 30]))
    return bytes(b)


def _segment(rng: random.Random) -> tuple[int, list[int]]:
    """A staging segment to attach: (declared size, descriptors), hostile or not."""
    kind = rng.choice(["sealed", "sealed", "unsealed", "unsealed", "small", "pipe", "none", "two"])
    if kind == "none":
        return SEGMENT_BYTES, []
    if kind == "pipe":
        r, w = os.pipe()
        os.close(w)
        return SEGMENT_BYTES, [r]
    fds = []
    for _ in range(2 if kind == "two" else 1):
        sealed = kind != "unsealed"
        fd = os.memfd_create("fuzz-staging", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING * sealed))
        os.ftruncate(fd, SEGMENT_BYTES // (2 if kind == "small" else 1))
        os.pwrite(fd, payload(b"fuzz-seg", 8192), 0)
        if sealed:  # written in full and sealed against shrinking and holes, as agents ask
            os.pwrite(fd, bytes(os.fstat(fd).st_size - 8192), 8192)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | 0x10)  # F_SEAL_FUTURE_WRITE
        fds.append(fd)
    return SEGMENT_BYTES, fds


def make_sequence(rng: random.Random, unix: bool) -> Sequence:
    """One connection's frames (1-6 of them), ending with a PING when nothing ended it early."""
    pieces: list[Piece] = []
    kinds: list[str] = []
    in_step = True
    for _ in range(rng.randint(1, 6)):
        kind = rng.choices(
            ["valid", "mutated", "random_meta", "staged", "truncated", "oversized", "garbage"],
            weights=[30, 25, 15, 12 if unix else 0, 6, 6, 6],
        )[0]
        kinds.append(kind)
        if kind == "valid":
            op = rng.choice(REQUEST_OPS)
            meta, body = _valid_meta(rng, op, unix)
            pieces.append(Piece(_frame(op, meta, body, rng.getrandbits(32))))
        elif kind == "mutated":
            op = rng.choice(REQUEST_OPS)
            meta, body = _valid_meta(rng, op, unix)
            pieces.append(Piece(_mutate(rng, _frame(op, meta, body, rng.getrandbits(32)))))
            in_step = False
        elif kind == "random_meta":
            op = rng.randrange(256)
            meta = rng.randbytes(rng.choice([0, 1, 2, 5, 16, 40, 300]))
            body = rng.randbytes(rng.choice([0, 0, 3, 100]))
            pieces.append(Piece(_frame(op, meta, body, rng.getrandbits(32))))
            in_step = False  # an op that takes no payload but got one is fatal (BAD_FRAME)
        elif kind == "staged":
            size, fds = _segment(rng)
            shrink = None
            if fds and rng.random() < 0.7:  # the client shrinks its segment once attached

                def shrink(fd: int = fds[0], to: int = rng.choice([0, 0, 1, 4096])) -> None:
                    # a sealed segment cannot shrink (EPERM), a pipe not at all (EINVAL)
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, to)

            attach = _frame(Op.ATTACH, MetaWriter().u64(size).build())
            pieces.append(Piece(attach, fds, then=shrink))
            for _ in range(rng.randint(1, 3)):
                meta, _ = _valid_meta(rng, Op.PUT_STAGED, unix)
                pieces.append(Piece(_frame(Op.PUT_STAGED, meta)))
        elif kind == "truncated":
            op = rng.choice(REQUEST_OPS)
            meta, body = _valid_meta(rng, op, unix)
            whole = _frame(op, meta, body)
            pieces.append(Piece(whole[: rng.randrange(max(len(whole), 1))]))
            in_step = False
            break  # the connection ends mid-frame
        elif kind == "oversized":
            meta_len = rng.choice([0, MAX_META_BYTES + 1, 0xFFFFFFFF])
            payload_len = rng.choice([0, 1 << 50, (1 << 64) - 1]) if meta_len == 0 else 0
            op = rng.choice(REQUEST_OPS)
            pieces.append(Piece(HEADER.pack(MAGIC, VERSION, op, 7, meta_len, payload_len)))
            in_step = False
            break  # fatal: the agent closes
        else:
            pieces.append(Piece(rng.randbytes(rng.randint(1, 64))))
            in_step = False
            break
    else:
        pieces.append(Piece(_frame(Op.PING, b"", rid=0xFEED)))
    return Sequence(pieces, in_step, kinds)


# --- one connection -----------------------------------------------------------------------------
def exchange(address: str | tuple[str, int], pieces: list[Piece]) -> bytes:
    """Send ``pieces`` (reading replies meanwhile, so neither side blocks on a full buffer),
    half-close, and return every byte the agent sent until it closed."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(address)
    sock.setblocking(False)
    got = bytearray()
    deadline = time.monotonic() + EXCHANGE_TIMEOUT_S
    try:
        queue = [(memoryview(p.data), list(p.fds), p.then) for p in pieces if p.data]
        writing = True
        #: (reply frames to wait for, then what, until when) once a piece with ``then`` is sent;
        #: an earlier mutated frame may have the agent waiting for bytes instead of answering
        waiting: tuple[int, Callable[[], None], float] | None = None
        while True:
            if waiting is not None and (
                _frames_in(got) >= waiting[0] or not writing or time.monotonic() > waiting[2]
            ):
                waiting[1]()
                waiting = None
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"the agent neither answered nor closed in {EXCHANGE_TIMEOUT_S} s"
                )
            want_write = [sock] if writing and waiting is None else []
            readable, writable, _ = select.select([sock], want_write, [], 0.1)
            if readable:
                try:
                    data = sock.recv(1 << 20)
                except (ConnectionResetError, BlockingIOError) as exc:
                    if isinstance(exc, BlockingIOError):
                        continue
                    return bytes(got)
                if not data:
                    return bytes(got)
                got += data
            if writable and writing and waiting is None:
                if not queue:
                    sock.shutdown(socket.SHUT_WR)
                    writing = False
                    continue
                view, fds, then = queue[0]
                try:
                    if fds:
                        anc = [
                            (
                                socket.SOL_SOCKET,
                                socket.SCM_RIGHTS,
                                struct.pack(f"{len(fds)}i", *fds),
                            )
                        ]
                        n = sock.sendmsg([view], anc)
                        fds.clear()  # they went with the first byte
                    else:
                        n = sock.send(view)
                except BlockingIOError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    writing = False  # the agent closed: read what it said
                    continue
                if n == view.nbytes:
                    queue.pop(0)
                    if then is not None:
                        waiting = (_frames_in(got) + 1, then, time.monotonic() + 0.5)
                else:
                    queue[0] = (view[n:], fds, then)
    finally:
        sock.close()
        for p in pieces:
            for fd in p.fds:
                os.close(fd)


def _frames_in(stream: bytes | bytearray) -> int:
    """Complete frames at the start of ``stream``."""
    n = pos = 0
    while len(stream) - pos >= HEADER_BYTES:
        *_, meta_len, payload_len = HEADER.unpack_from(stream, pos)
        end = pos + HEADER_BYTES + meta_len + payload_len
        if end > len(stream):
            break
        n, pos = n + 1, end
    return n


def check_replies(stream: bytes) -> list[tuple[int, int, int, str]]:
    """Parse the agent's reply stream: every frame well-formed, the stream ends on a frame
    boundary. Returns (op, request id, error code or 0, error message) per frame."""
    out = []
    pos = 0
    while pos < len(stream):
        assert len(stream) - pos >= HEADER_BYTES, f"a reply header cut at {len(stream) - pos} bytes"
        magic, version, op, rid, meta_len, payload_len = HEADER.unpack_from(stream, pos)
        assert magic == MAGIC and version == VERSION, f"reply with magic {magic!r} v{version}"
        end = pos + HEADER_BYTES + meta_len + payload_len
        assert end <= len(stream), "a reply frame cut short"
        meta = stream[pos + HEADER_BYTES : pos + HEADER_BYTES + meta_len]
        if op == Op.ERROR:
            code, message = parse_error(meta)
            assert code in set(ErrorCode), f"unknown error code {code}: {message}"
            out.append((op, rid, code, message))
        else:
            assert op & REPLY_BIT and (op & ~REPLY_BIT) in set(Op), f"reply op {op}"
            out.append((op, rid, 0, ""))
        pos = end
    return out


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# --- the well-behaved side ----------------------------------------------------------------------
def check_agent(agent: Agent, batch: int) -> None:
    where = f"(seed {SEED}, batch {batch})"
    assert agent.proc.poll() is None, (
        f"agent {exit_description(agent)} {where}:\n{agent.log()[-3000:]}"
    )
    for transport, shm in (("unix", True), ("unix", False), ("tcp", False)):
        with agent.data(transport, use_shm=shm) as c:
            keys = [key(batch * 10 + i, 9200 + 10 * shm + (transport == "tcp")) for i in range(3)]
            sizes = [1, 4096, 300_000]
            out = c.put_many([(k, payload(k, n)) for k, n in zip(keys, sizes, strict=True)])
            assert [o.status for o in out] == ["stored"] * 3, f"{out} {where}"
            for k, n, g in zip(keys, sizes, c.get_many(keys), strict=True):
                assert g is not None and bytes(g) == payload(k, n), f"round trip {where}"
            for k, g in zip(REFERENCE_KEYS, c.get_many(REFERENCE_KEYS, tenant="ref"), strict=True):
                assert g is None or bytes(g) == payload(k, 8192), f"reference chunk corrupt {where}"
    usage = agent.control().stats()["usage"]
    for tier, u in usage.items():
        assert 0 <= u["used_bytes"] <= u["capacity_bytes"], f"tier {tier}: {u} {where}"


def test_the_data_plane_survives_fuzzing(tmp_path: Path) -> None:
    with hostile_agent(
        tmp_path / "fuzz", "--cpu", "16MiB", "--disk", "64MiB", frame_timeout_s=5.0
    ) as agent:
        with agent.data("tcp") as c:
            refs = [(k, payload(k, 8192)) for k in REFERENCE_KEYS]
            assert {o.status for o in c.put_many(refs, tenant="ref")} == {"stored"}
        check_agent(agent, -1)
        fds_before = _open_fds(agent.proc.pid)
        assert agent.state.data_unix is not None and agent.state.data_tcp is not None
        host, port = agent.state.data_tcp.rsplit(":", 1)
        addresses: dict[bool, str | tuple[str, int]] = {
            True: agent.state.data_unix,
            False: (host, int(port)),
        }
        rng = random.Random(SEED)
        sent = 0
        batch = 0
        internal: list[str] = []
        counts: dict[str, int] = {}
        started = time.perf_counter()
        fuzzing_s = 0.0  # time spent sending frames and reading replies, checks excluded
        while sent < FRAMES:
            batch_end = min(sent + BATCH_FRAMES, FRAMES)
            while sent < batch_end:
                unix = rng.random() < 0.5
                seq = make_sequence(rng, unix)
                t = time.perf_counter()
                stream = exchange(addresses[unix], seq.pieces)
                fuzzing_s += time.perf_counter() - t
                replies = check_replies(stream)
                for _op, _rid, code, message in replies:
                    if code == ErrorCode.INTERNAL:
                        internal.append(f"{seq.kinds}: {message}")
                fatal = any(code in FATAL_CODES for *_, code, _m in replies)
                answered = bool(replies) and replies[-1][:2] == (Op.PING | REPLY_BIT, 0xFEED)
                if seq.in_step and not fatal and not answered:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        agent.proc.wait(2)  # a dying agent: let it be reaped, to say how
                    raise AssertionError(
                        f"no answer to the closing PING after {seq.kinds} (seed {SEED}, batch "
                        f"{batch}; agent {exit_description(agent)}): {replies}"
                    )
                for kind in seq.kinds:
                    counts[kind] = counts.get(kind, 0) + 1
                sent += len(seq.pieces)
            check_agent(agent, batch)
            batch += 1
        elapsed_s = time.perf_counter() - started
        assert not internal, f"internal errors (seed {SEED}): {internal[:5]}"
        # descriptors passed in (staging segments, stray ones) close with their frame or
        # connection; a few may still be closing (connections lingering up to a second)
        end = time.monotonic() + 10
        while _open_fds(agent.proc.pid) > fds_before + 4 and time.monotonic() < end:
            time.sleep(0.1)
        assert _open_fds(agent.proc.pid) <= fds_before + 4, f"descriptors leaked (seed {SEED})"
        print(
            f"\nfuzz: seed {SEED}, {sent} frames in {elapsed_s:.1f} s, {batch} batches checked; "
            f"{sent / fuzzing_s:.0f} frames/s while fuzzing ({fuzzing_s:.1f} s); kinds {counts}"
        )
