"""The data plane's wire format: headers, metadata, put items, errors and socket I/O."""

from __future__ import annotations

import array
import os
import random
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.store.keys import KEY_BYTES
from kvctl.wire.protocol import (
    FLAG_HAS_PARENT,
    FLAG_PINNED,
    HEADER_BYTES,
    ITEM,
    MAGIC,
    MAX_BATCH,
    MAX_META_BYTES,
    STAGED_ITEM,
    VERSION,
    ErrorCode,
    FrameError,
    MetaReader,
    MetaWriter,
    Op,
    PeerClosed,
    check_header,
    error_meta,
    pack_header,
    parse_error,
    put_item,
    recv_exactly,
    recv_with_fds,
    send_all,
)

LIMIT = 64 << 20


def key(i: int) -> bytes:
    return i.to_bytes(KEY_BYTES, "little")


# --- headers ----------------------------------------------------------------------------------


def test_header_round_trip() -> None:
    raw = pack_header(Op.PUT, 0xDEADBEEF, 1234, 5 << 20)
    assert len(raw) == HEADER_BYTES == 20
    assert check_header(raw, max_payload_bytes=LIMIT) == (Op.PUT, 0xDEADBEEF, 1234, 5 << 20)
    # the limits themselves are allowed
    edge = pack_header(Op.GET | 0x80, 1, MAX_META_BYTES, LIMIT)
    assert check_header(memoryview(edge), max_payload_bytes=LIMIT) == (
        Op.GET | 0x80,
        1,
        MAX_META_BYTES,
        LIMIT,
    )


def _raw_header(
    magic: bytes = MAGIC, version: int = VERSION, meta: int = 0, payload: int = 0
) -> bytes:
    return struct.pack("<2sBBIIQ", magic, version, Op.PING, 7, meta, payload)


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (_raw_header(magic=b"XV"), ErrorCode.BAD_FRAME),
        (_raw_header(magic=b"kv"), ErrorCode.BAD_FRAME),
        (_raw_header(version=0), ErrorCode.BAD_VERSION),
        (_raw_header(version=VERSION + 1), ErrorCode.BAD_VERSION),
        (_raw_header(meta=MAX_META_BYTES + 1), ErrorCode.TOO_LARGE),
        (_raw_header(meta=0xFFFFFFFF), ErrorCode.TOO_LARGE),
        (_raw_header(payload=LIMIT + 1), ErrorCode.TOO_LARGE),
        (_raw_header(payload=2**64 - 1), ErrorCode.TOO_LARGE),
    ],
)
def test_untrustworthy_headers_are_fatal(raw: bytes, code: ErrorCode) -> None:
    with pytest.raises(FrameError) as info:
        check_header(raw, max_payload_bytes=LIMIT)
    assert info.value.code == code
    assert info.value.fatal is True
    assert info.value.message == str(info.value)


def test_payload_limit_is_the_callers() -> None:
    raw = pack_header(Op.PUT, 1, 0, 100)
    assert check_header(raw, max_payload_bytes=100)[3] == 100
    with pytest.raises(FrameError) as info:
        check_header(raw, max_payload_bytes=99)
    assert info.value.code == ErrorCode.TOO_LARGE and info.value.fatal


# --- metadata -----------------------------------------------------------------------------------

_u8 = st.integers(0, 0xFF)
_u32 = st.integers(0, 0xFFFFFFFF)
_u64 = st.integers(0, 2**64 - 1)
_f64 = st.floats(allow_nan=False)
_text = st.text(max_size=200)
_keys = st.lists(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES), max_size=40)

_FIELDS: dict[str, st.SearchStrategy[object]] = {
    "u8": _u8,
    "u32": _u32,
    "u64": _u64,
    "f64": _f64,
    "text": _text,
    "keys": _keys,
}
_field = st.sampled_from(sorted(_FIELDS)).flatmap(
    lambda kind: _FIELDS[kind].map(lambda v: (kind, v))
)


def _write(fields: Sequence[tuple[str, object]]) -> bytes:
    w = MetaWriter()
    for kind, value in fields:
        getattr(w, kind)(value)
    return w.build()


def _read(r: MetaReader, fields: Sequence[tuple[str, object]]) -> list[object]:
    return [getattr(r, kind)() for kind, _ in fields]


@given(st.lists(_field, max_size=12))
@settings(max_examples=200, deadline=None)
def test_meta_round_trip(fields: list[tuple[str, object]]) -> None:
    raw = _write(fields)
    r = MetaReader(raw)
    assert _read(r, fields) == [v for _, v in fields]
    r.done()


@given(st.lists(_field, min_size=1, max_size=8), st.data())
@settings(max_examples=200, deadline=None)
def test_truncated_meta_is_a_non_fatal_bad_request(
    fields: list[tuple[str, object]], data: st.DataObject
) -> None:
    raw = _write(fields)
    if not raw:
        return
    cut = data.draw(st.integers(0, len(raw) - 1))
    r = MetaReader(memoryview(raw)[:cut])
    with pytest.raises(FrameError) as info:
        _read(r, fields)
        r.done()
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert info.value.fatal is False


def test_meta_values_at_their_limits() -> None:
    raw = (
        MetaWriter()
        .u8(255)
        .u32(2**32 - 1)
        .u64(2**64 - 1)
        .f64(float("inf"))
        .text("")
        .text("é€😀" * 3)
        .text("x" * 0xFFFF)
        .raw(b"\x00\x01")
        .keys([])
        .build()
    )
    r = MetaReader(bytearray(raw))
    assert (r.u8(), r.u32(), r.u64(), r.f64()) == (255, 2**32 - 1, 2**64 - 1, float("inf"))
    assert (r.text(), r.text(), r.text()) == ("", "é€😀" * 3, "x" * 0xFFFF)
    assert r.rest() == b"\x00\x01\x00\x00\x00\x00"  # the raw bytes, then an empty key list
    r.done()


def test_text_too_long_is_refused_by_the_writer() -> None:
    with pytest.raises(ValueError):
        MetaWriter().text("x" * 0x10000)
    with pytest.raises(ValueError):
        MetaWriter().text("é" * 0x8000)  # 65536 bytes in UTF-8


def test_text_that_is_not_utf8_is_a_bad_request() -> None:
    raw = struct.pack("<H", 2) + b"\xff\xfe"
    with pytest.raises(FrameError) as info:
        MetaReader(raw).text()
    assert info.value.code == ErrorCode.BAD_REQUEST and not info.value.fatal


def test_count_limit_and_trailing_bytes() -> None:
    with pytest.raises(FrameError) as info:
        MetaReader(struct.pack("<I", 11)).count(limit=10)
    assert info.value.code == ErrorCode.BAD_REQUEST and not info.value.fatal
    assert MetaReader(struct.pack("<I", 10)).count(limit=10) == 10
    # keys() applies MAX_BATCH before reading the keys
    with pytest.raises(FrameError) as info:
        MetaReader(struct.pack("<I", MAX_BATCH + 1)).keys()
    assert info.value.code == ErrorCode.BAD_REQUEST
    # a count that promises more keys than there are bytes
    with pytest.raises(FrameError, match="truncated"):
        MetaReader(struct.pack("<I", 3) + key(1) + key(2)).keys()

    r = MetaReader(MetaWriter().u32(5).u8(1).build())
    assert r.u32() == 5
    with pytest.raises(FrameError) as info:
        r.done()
    assert info.value.code == ErrorCode.BAD_REQUEST and not info.value.fatal
    assert r.u8() == 1
    r.done()


@pytest.mark.parametrize(
    "bad",
    [
        [key(1), b"\x00" * (KEY_BYTES - 1)],
        [b"\x00" * (KEY_BYTES + 1)],
        [b""],
        [bytearray(KEY_BYTES)],
        ["0" * KEY_BYTES],
    ],
)
def test_writer_refuses_keys_of_the_wrong_size_or_type(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        MetaWriter().keys(bad)  # type: ignore[arg-type]


def test_writer_batch_limit() -> None:
    many = [key(i % 7) for i in range(MAX_BATCH)]
    raw = MetaWriter().keys(many).build()
    assert len(raw) == 4 + MAX_BATCH * KEY_BYTES
    assert MetaReader(raw).keys() == many
    with pytest.raises(ValueError):
        MetaWriter().keys([*many, key(0)])


# --- put items and errors -------------------------------------------------------------------


def test_put_items_round_trip_with_and_without_staging() -> None:
    items = [
        put_item(key(1), 4096, tokens=256, priority=10, depth=0),
        put_item(key(2), 1, tokens=1, priority=255, pinned=True, parent=key(1), depth=1),
    ]
    r = MetaReader(MetaWriter().raw(b"".join(items)).build())
    a, b = r.structs(ITEM, 2)
    r.done()
    assert a == (key(1), 4096, 256, 10, 0, bytes(KEY_BYTES), 0)
    assert b == (key(2), 1, 1, 255, FLAG_PINNED | FLAG_HAS_PARENT, key(1), 1)

    staged = put_item(key(3), 2**40, parent=key(2), staging_offset=2**63)
    assert len(staged) == STAGED_ITEM.size == ITEM.size + 8
    (c,) = MetaReader(staged).structs(STAGED_ITEM, 1)
    assert c == (key(3), 2**40, 0, 35, FLAG_HAS_PARENT, key(2), 0, 2**63)
    with pytest.raises(FrameError, match="truncated"):
        MetaReader(staged[:-1]).structs(STAGED_ITEM, 1)


def test_error_meta_round_trip() -> None:
    assert parse_error(error_meta(ErrorCode.NO_ROOM, "tier full")) == (
        ErrorCode.NO_ROOM,
        "tier full",
    )
    assert parse_error(error_meta(ErrorCode.INTERNAL, "")) == (ErrorCode.INTERNAL, "")
    code, msg = parse_error(error_meta(ErrorCode.BAD_REQUEST, "é" * 5000))
    assert code == ErrorCode.BAD_REQUEST
    assert len(msg.encode()) <= 4096 and msg.startswith("é" * 2000)
    assert parse_error(b"\x01") == (ErrorCode.BAD_FRAME, "malformed error frame")
    assert parse_error(b"")[0] == ErrorCode.BAD_FRAME


# --- socket I/O ----------------------------------------------------------------------------


def _run(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``target`` in a thread; its result (or exception) lands in the returned list."""
    out: list[object] = []

    def body() -> None:
        try:
            out.append(target())
        except BaseException as exc:  # surfaced by the test
            out.append(exc)

    th = threading.Thread(target=body, daemon=True)
    th.start()
    return th, out


def test_send_all_many_small_parts_arrives_byte_exact(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    rng = random.Random(1)
    parts: list[bytes | bytearray | memoryview] = []
    for i in range(1500):  # far more than the 512 buffers of one sendmsg
        n = rng.choice([0, 1, 3, 16, 100, 1000])
        raw = rng.randbytes(n)
        parts.append(raw if i % 3 == 0 else bytearray(raw) if i % 3 == 1 else memoryview(raw))
    expected = b"".join(bytes(p) for p in parts)
    th, result = _run(lambda: send_all(a, parts))
    got = bytearray(len(expected))
    recv_exactly(b, memoryview(got))
    th.join(20)
    assert result == [len(expected)]
    assert got == expected


def test_send_all_large_parts_with_partial_sends(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # force many partial sends
    rng = random.Random(2)
    ints = array.array("i", range(300_000))  # a non-byte format: sent as its raw bytes
    parts: list[bytes | bytearray | memoryview] = [
        rng.randbytes(3 << 20),
        bytearray(rng.randbytes((2 << 20) + 13)),
        memoryview(rng.randbytes(5 << 20))[7:-11],
        memoryview(ints),
        b"tail",
    ]
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    th, result = _run(lambda: send_all(a, parts))
    got = bytearray(len(expected))
    view = memoryview(got)
    # read it back in uneven pieces, so the receive side sees partial frames too
    pos = 0
    for step in (20, 1 << 20, 12345, 3 << 20):
        recv_exactly(b, view[pos : pos + step])
        pos += step
    recv_exactly(b, view[pos:])
    th.join(20)
    assert result == [len(expected)]
    assert got == expected


def test_send_all_passes_a_working_fd_to_recv_with_fds() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    received: list[int] = []
    with a, b, tempfile.TemporaryFile() as f:
        f.write(b"the arena's bytes")
        f.flush()
        body = [pack_header(Op.ATTACH | 0x80, 9, 3), b"abc"]
        assert send_all(a, body, f.fileno()) == HEADER_BYTES + 3
        send_all(a, [b"next"])  # a later send carries no fd

        buf = bytearray(HEADER_BYTES + 3)
        assert recv_with_fds(b, memoryview(buf), received) is True
        try:
            assert check_header(buf[:HEADER_BYTES], max_payload_bytes=0)[:3] == (
                Op.ATTACH | 0x80,
                9,
                3,
            )
            assert buf[HEADER_BYTES:] == b"abc"
            assert len(received) == 1
            fd = received[0]
            assert fd != f.fileno()
            assert os.pread(fd, 100, 0) == b"the arena's bytes"
            # it is the same open file: what the sender writes later shows through it
            f.write(b"!")
            f.flush()
            assert os.pread(fd, 100, 0) == b"the arena's bytes!"

            more = bytearray(4)
            assert recv_with_fds(b, memoryview(more), received) is True
            assert more == b"next" and len(received) == 1
        finally:
            for fd in received:
                os.close(fd)


def test_recv_with_fds_clean_close_and_mid_frame_close() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.close()
        fds: list[int] = []
        assert recv_with_fds(b, memoryview(bytearray(8)), fds) is False
        assert fds == []
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        a.sendall(b"abc")
        a.close()
        with pytest.raises(PeerClosed):
            recv_with_fds(b, memoryview(bytearray(8)), [])


def test_recv_exactly_raises_peer_closed_mid_buffer(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    a.sendall(b"12345")
    a.shutdown(socket.SHUT_WR)
    buf = bytearray(10)
    with pytest.raises(PeerClosed, match="5 of 10"):
        recv_exactly(b, memoryview(buf))
    assert buf[:5] == b"12345"


def test_recv_exactly_of_nothing_needs_no_bytes(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    recv_exactly(b, memoryview(bytearray(0)))  # returns without touching the socket
    a.close()
    with pytest.raises(PeerClosed, match="0 of 1"):
        recv_exactly(b, memoryview(bytearray(1)))


@pytest.mark.parametrize(
    ("error", "for_memory"),
    [
        (OSError(12, "Cannot allocate memory"), True),  # ENOMEM, RLIMIT_AS
        (OverflowError("cannot fit 'int' into an index-sized integer"), True),
        (OSError(24, "Too many open files"), False),  # EMFILE: a smaller one fails the same
        (OSError(23, "Too many open files in system"), False),  # ENFILE
    ],
)
def test_the_sdk_reads_an_agents_segment_refusal_as_the_agent_words_it(
    error: OSError | OverflowError, for_memory: bool
) -> None:
    """The protocol carries no cause with a refused staging segment: the SDK reads the agent's
    words (``_refused_for_memory``) to hold back, for want of memory, only segments as large.
    Both sides' real functions, so a change of wording on one side fails here, not in the
    field (where it would hold back every size, or retry smaller ones out of descriptors)."""
    from kvctl.agent.dataplane import _mapping_refused
    from kvctl.client import _refused_for_memory

    refusal = _mapping_refused(16 << 20, error)
    assert _refused_for_memory(refusal.message) is for_memory, refusal.message
    assert refusal.cause == ("memory" if for_memory else "open files")
