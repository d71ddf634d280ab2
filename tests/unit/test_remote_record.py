"""The pool record format: round trips, and every kind of damage is a CorruptChunk."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.errors import InvalidArgument
from kvctl.remote import record
from kvctl.store.errors import CorruptChunk, PayloadSizeError
from kvctl.store.tiers.base import ChunkMeta

KEY = bytes(range(16))
PARENT = bytes(range(100, 116))


def _meta(**kw) -> ChunkMeta:  # type: ignore[no-untyped-def]
    fields = dict(key=KEY, size_bytes=64, tokens=256, tenant="acme", created_s=1.7e9 + 0.25)
    fields.update(kw)
    return ChunkMeta(**fields)  # type: ignore[arg-type]


def _record(meta: ChunkMeta, payload: bytes) -> bytes:
    return record.encode_header(meta, payload) + payload


@pytest.mark.parametrize(
    "meta",
    [
        _meta(),
        _meta(parent=PARENT),
        _meta(tenant="租户-ü 🚀 with spaces", isolated=True, parent=PARENT),
        _meta(tenant="", priority=0, tokens=0),
        _meta(priority=255, tokens=2**32 - 1, created_s=0.0, isolated=True),
    ],
)
def test_round_trip(meta: ChunkMeta) -> None:
    payload = bytes((i * 7) & 0xFF for i in range(meta.size_bytes))
    rec = _record(meta, payload)
    got, data = record.decode(rec, key=KEY)
    assert got == meta
    assert bytes(data) == payload
    header = record.decode_header(rec, key=KEY)
    assert header.meta == meta
    assert header.record_bytes == len(rec)
    assert record.header_length(rec[: record.FIXED_BYTES]) == header.header_bytes


def test_payload_is_a_view_not_a_copy() -> None:
    meta = _meta()
    rec = bytearray(_record(meta, b"x" * 64))
    _, data = record.decode(rec, key=KEY)
    assert isinstance(data, memoryview)
    assert data.obj is rec  # a slice of the buffer passed in


def test_header_length_counts_the_tenant() -> None:
    short = record.encode_header(_meta(tenant=""), b"x" * 64)
    long = record.encode_header(_meta(tenant="t" * 1000), b"x" * 64)
    assert len(short) == record.MIN_HEADER_BYTES
    assert len(long) == record.MIN_HEADER_BYTES + 1000
    assert record.header_length(long[:100]) == len(long)


def test_encode_accepts_any_contiguous_buffer() -> None:
    import array

    words = array.array("I", range(16))  # 64 bytes as 16 uint32
    meta = _meta()
    rec = record.encode_header(meta, words) + words.tobytes()
    _, data = record.decode(rec, key=KEY)
    assert bytes(data) == words.tobytes()


@pytest.mark.parametrize(
    ("meta", "payload", "error"),
    [
        (_meta(size_bytes=65), b"x" * 64, PayloadSizeError),
        (_meta(key=b"short"), b"x" * 64, InvalidArgument),
        (_meta(parent=b"short"), b"x" * 64, InvalidArgument),
        (_meta(priority=256), b"x" * 64, InvalidArgument),
        (_meta(tokens=-1), b"x" * 64, InvalidArgument),
        (_meta(tenant="t" * 0x10000), b"x" * 64, InvalidArgument),
    ],
)
def test_encode_refuses_what_does_not_fit(meta: ChunkMeta, payload: bytes, error: type) -> None:
    with pytest.raises(error):
        record.encode_header(meta, payload)


def _corrupt(rec: bytes, at: int) -> bytes:
    damaged = bytearray(rec)
    damaged[at] ^= 0x40
    return bytes(damaged)


REC = _record(_meta(parent=PARENT, isolated=True), bytes(range(64)))
HEADER_BYTES = len(REC) - 64


@pytest.mark.parametrize(
    ("damaged", "reason"),
    [
        (b"", "too short"),
        (REC[:10], "too short"),
        (REC[: HEADER_BYTES - 1], "too short for its header"),
        (b"XXXX" + REC[4:], "bad magic"),
        (REC[:4] + b"\x02" + REC[5:], "unknown record version"),
        (_corrupt(REC, 15), "header checksum mismatch"),  # size_bytes
        (_corrupt(REC, HEADER_BYTES - 1), "header checksum mismatch"),  # the crc itself
        (_corrupt(REC, HEADER_BYTES - 6), "header checksum mismatch"),  # the payload checksum
        (_corrupt(REC, HEADER_BYTES + 3), "payload checksum mismatch"),
        (_corrupt(REC, len(REC) - 1), "payload checksum mismatch"),
        (REC[:-1], "payload is 63 bytes"),
        (REC + b"\0", "payload is 65 bytes"),
        (REC[:HEADER_BYTES], "payload is 0 bytes"),
    ],
)
def test_damage_is_detected(damaged: bytes, reason: str) -> None:
    with pytest.raises(CorruptChunk, match=reason):
        record.decode(damaged, key=KEY)


def test_wrong_key_is_detected() -> None:
    other = bytes(16)
    with pytest.raises(CorruptChunk, match=f"holds key {KEY.hex()}, not {other.hex()}"):
        record.decode(REC, key=other)
    with pytest.raises(CorruptChunk, match="holds key"):
        record.decode_header(REC, key=other)


def test_a_valid_crc_over_bad_fields_is_still_refused() -> None:
    """Fields past the CRC are checked too: unknown flags, an empty payload, bad utf-8."""

    def resealed(**fields: object) -> bytes:
        header = bytearray(record.encode_header(_meta(tenant="ab"), b"x" * 64))
        if "flags" in fields:
            header[5] = fields["flags"]  # type: ignore[assignment]
        if "size" in fields:
            struct.pack_into("<Q", header, 11, fields["size"])
        if "tenant" in fields:
            header[record.FIXED_BYTES : record.FIXED_BYTES + 2] = fields["tenant"]  # type: ignore[index]
        import zlib

        struct.pack_into("<I", header, len(header) - 4, zlib.crc32(header[:-4]))
        return bytes(header) + b"x" * 64

    with pytest.raises(CorruptChunk, match="unknown record flags"):
        record.decode(resealed(flags=0x80), key=KEY)
    with pytest.raises(CorruptChunk, match="empty payload"):
        record.decode(resealed(size=0), key=KEY)
    with pytest.raises(CorruptChunk, match="not utf-8"):
        record.decode(resealed(tenant=b"\xff\xfe"), key=KEY)


# --- properties -----------------------------------------------------------------------------
keys = st.binary(min_size=16, max_size=16)
metas = st.builds(
    lambda key, size, tokens, tenant, parent, priority, isolated, created_s: ChunkMeta(
        key=key,
        size_bytes=size,
        tokens=tokens,
        tenant=tenant,
        parent=parent,
        priority=priority,
        isolated=isolated,
        created_s=created_s,
    ),
    keys,
    st.integers(1, 300),
    st.integers(0, 2**32 - 1),
    st.text(max_size=40),
    st.none() | keys,
    st.integers(0, 255),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=True),
)


@settings(max_examples=200, deadline=None)
@given(meta=metas, data=st.data())
def test_property_round_trip_and_any_byte_flip_is_detected(meta: ChunkMeta, data) -> None:  # type: ignore[no-untyped-def]
    payload = data.draw(st.binary(min_size=meta.size_bytes, max_size=meta.size_bytes))
    rec = _record(meta, payload)
    got, view = record.decode(rec, key=meta.key)
    assert got == meta
    assert view.tobytes() == payload

    at = data.draw(st.integers(0, len(rec) - 1))
    flip = data.draw(st.integers(1, 255))
    damaged = bytearray(rec)
    damaged[at] ^= flip
    with pytest.raises(CorruptChunk):
        record.decode(bytes(damaged), key=meta.key)
