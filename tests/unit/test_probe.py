"""The PROBE op's wire format: request metadata, size limits and the zero filler."""

from __future__ import annotations

import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.wire.protocol import (
    HEADER_BYTES,
    MAX_PROBE_BYTES,
    PROBE_PIECE_BYTES,
    REPLY_BIT,
    ErrorCode,
    FrameError,
    MetaReader,
    MetaWriter,
    Op,
    check_header,
    pack_header,
    parse_probe,
    probe_meta,
    recv_exactly,
    send_all,
    zero_pieces,
)


def test_probe_op_code_is_13_and_its_reply_keeps_the_reply_bit() -> None:
    assert Op.PROBE == 13
    assert len({op.value for op in Op}) == len(Op)  # no op shares PROBE's code
    assert MAX_PROBE_BYTES == 64 << 20
    raw = pack_header(Op.PROBE | REPLY_BIT, 9, 8, MAX_PROBE_BYTES)
    assert check_header(raw, max_payload_bytes=MAX_PROBE_BYTES) == (
        Op.PROBE | REPLY_BIT,
        9,
        8,
        MAX_PROBE_BYTES,
    )


@given(
    want=st.integers(0, MAX_PROBE_BYTES) | st.sampled_from([0, 1, MAX_PROBE_BYTES]),
    upload=st.integers(0, MAX_PROBE_BYTES),
)
@settings(max_examples=200)
def test_probe_meta_round_trip(want: int, upload: int) -> None:
    meta = probe_meta(want)
    assert len(meta) == 8  # one u64
    assert parse_probe(MetaReader(meta), upload) == want


@pytest.mark.parametrize("want", [-1, MAX_PROBE_BYTES + 1, 1 << 40])
def test_probe_meta_refuses_sizes_outside_the_limit(want: int) -> None:
    with pytest.raises(ValueError, match="probe downloads"):
        probe_meta(want)


def test_oversized_upload_is_fatal_before_the_metadata_is_read() -> None:
    # metadata that would itself be wrong: the size check must come first
    with pytest.raises(FrameError) as exc:
        parse_probe(MetaReader(b""), MAX_PROBE_BYTES + 1)
    assert exc.value.code == ErrorCode.TOO_LARGE
    assert exc.value.fatal
    assert str(MAX_PROBE_BYTES + 1) in exc.value.message


def test_oversized_download_is_too_large_and_fatal() -> None:
    meta = MetaWriter().u64(MAX_PROBE_BYTES + 1).build()  # what a writer other than ours sends
    with pytest.raises(FrameError) as exc:
        parse_probe(MetaReader(meta), 0)
    assert exc.value.code == ErrorCode.TOO_LARGE
    assert exc.value.fatal
    assert "download" in exc.value.message


@pytest.mark.parametrize(
    "meta", [b"", b"\x01\x02\x03", probe_meta(5) + b"\x00"], ids=["empty", "short", "trailing"]
)
def test_malformed_probe_meta_is_a_non_fatal_bad_request(meta: bytes) -> None:
    with pytest.raises(FrameError) as exc:
        parse_probe(MetaReader(meta), 10)
    assert exc.value.code == ErrorCode.BAD_REQUEST
    assert not exc.value.fatal  # the frame's lengths are known: the stream stays in step


@pytest.mark.parametrize(
    "n_bytes",
    [0, 1, PROBE_PIECE_BYTES - 1, PROBE_PIECE_BYTES, PROBE_PIECE_BYTES + 1, 3 * PROBE_PIECE_BYTES],
)
def test_zero_pieces_are_views_of_one_buffer(n_bytes: int) -> None:
    zeros = bytes(PROBE_PIECE_BYTES)
    pieces = zero_pieces(zeros, n_bytes)
    assert sum(p.nbytes for p in pieces) == n_bytes
    assert all(0 < p.nbytes <= PROBE_PIECE_BYTES for p in pieces)
    assert all(p.obj is zeros for p in pieces)  # nothing of size n_bytes was allocated
    assert len(pieces) == -(-n_bytes // PROBE_PIECE_BYTES)


def test_zero_pieces_of_a_small_buffer_and_an_empty_one() -> None:
    assert [p.nbytes for p in zero_pieces(bytearray(4), 10)] == [4, 4, 2]
    assert zero_pieces(b"", 0) == []
    with pytest.raises(ValueError, match="empty"):
        zero_pieces(b"", 1)


def test_zero_pieces_cross_a_socket_as_zero_bytes() -> None:
    n_bytes = 2 * PROBE_PIECE_BYTES + 12345
    a, b = socket.socketpair()
    got = bytearray(n_bytes + HEADER_BYTES)
    with a, b:
        head = pack_header(Op.PROBE | REPLY_BIT, 1, 0, n_bytes)
        zeros = bytes(PROBE_PIECE_BYTES)
        sender = threading.Thread(target=send_all, args=(a, [head, *zero_pieces(zeros, n_bytes)]))
        sender.start()
        recv_exactly(b, memoryview(got))
        sender.join(10)
    assert check_header(got[:HEADER_BYTES], max_payload_bytes=MAX_PROBE_BYTES)[3] == n_bytes
    assert got[HEADER_BYTES:].count(0) == n_bytes
