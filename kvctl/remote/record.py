"""The record format of the shared remote pool: one chunk = header + payload in ONE value.

One value per chunk, so a reader sees the whole record or nothing (a record is written in one
SET, or one MULTI/EXEC of SET + APPEND). Layout, little-endian, version 1::

    magic "KVR1" | version u8 | flags u8 | priority u8 | tokens u32 | size_bytes u64
    key 16 bytes | parent 16 bytes (zeros when flags lacks HAS_PARENT) | created_s f64
    tenant_len u16 | tenant (utf-8, tenant_len bytes) | payload_xxh3_64 u64
    header_crc32 u32 (CRC-32 of every header byte before it)
    payload (size_bytes bytes)

As in the disk tier (``kvctl.store.tiers.disk``): the payload is checked with XXH3-64 (fast
enough not to bound read bandwidth, 64 bits so random damage is caught), the small header with
CRC-32. Only a header that passed its CRC is trusted, so the reported reasons past that point
(wrong key, wrong length) describe what the record claims, not noise.

The fixed part comes first, so a reader can ask for ``HEADER_PROBE_BYTES`` with GETRANGE, learn
the full header length from it (``header_length``) and verify the header alone
(``decode_header``) without moving the payload.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

from kvctl.store.errors import CorruptChunk, InvalidArgument, PayloadSizeError
from kvctl.store.keys import KEY_BYTES
from kvctl.store.tiers.base import Buffer, ChunkMeta

MAGIC = b"KVR1"
FORMAT_VERSION = 1

FLAG_ISOLATED = 0x1
FLAG_HAS_PARENT = 0x2
_KNOWN_FLAGS = FLAG_ISOLATED | FLAG_HAS_PARENT

# Everything up to and including tenant_len; the tenant, payload checksum and header CRC follow.
_FIXED = struct.Struct("<4sBBBIQ16s16sdH")
_TAIL = struct.Struct("<QI")  # payload xxh3_64, header crc32
FIXED_BYTES = _FIXED.size
MIN_HEADER_BYTES = _FIXED.size + _TAIL.size
MAX_TENANT_BYTES = 0xFFFF
MAX_PRIORITY = 0xFF
MAX_TOKENS = 0xFFFFFFFF
# A probe reading this much gets the whole header of any tenant name up to ~440 utf-8 bytes in
# one round trip; longer names take a second GETRANGE (``header_length`` says how much).
HEADER_PROBE_BYTES = 512


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """A verified header: the chunk's metadata, the header's length, the payload checksum."""

    meta: ChunkMeta
    header_bytes: int
    payload_xxh3_64: int

    @property
    def record_bytes(self) -> int:
        return self.header_bytes + self.meta.size_bytes


def encode_header(meta: ChunkMeta, payload: Buffer) -> bytes:
    """The header for ``payload`` stored as ``meta``; raises InvalidArgument when the metadata
    does not fit the format or the payload is not ``meta.size_bytes`` long."""
    view = byte_view(payload)
    if view.nbytes != meta.size_bytes:
        raise PayloadSizeError(
            f"payload is {view.nbytes} bytes but the chunk declares {meta.size_bytes}"
        )
    if not isinstance(meta.key, bytes) or len(meta.key) != KEY_BYTES:
        raise InvalidArgument(f"a key is {KEY_BYTES} bytes, got {meta.key!r:.60}")
    tenant = meta.tenant.encode("utf-8")
    if len(tenant) > MAX_TENANT_BYTES:
        raise InvalidArgument(
            f"tenant name is {len(tenant)} bytes in utf-8; a pool record stores at most "
            f"{MAX_TENANT_BYTES}"
        )
    if not 0 <= meta.priority <= MAX_PRIORITY:
        raise InvalidArgument(
            f"priority must be 0..{MAX_PRIORITY} in the pool, got {meta.priority}"
        )
    if not 0 <= meta.tokens <= MAX_TOKENS:
        raise InvalidArgument(f"tokens must be 0..{MAX_TOKENS} in the pool, got {meta.tokens}")
    flags = FLAG_ISOLATED if meta.isolated else 0
    parent = meta.parent
    if parent is None:
        parent = bytes(KEY_BYTES)
    else:
        if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
            raise InvalidArgument(f"parent key must be {KEY_BYTES} bytes, got {parent!r:.60}")
        flags |= FLAG_HAS_PARENT
    try:
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            flags,
            meta.priority,
            meta.tokens,
            meta.size_bytes,
            meta.key,
            parent,
            float(meta.created_s),
            len(tenant),
        )
    except (struct.error, TypeError) as exc:
        raise InvalidArgument(f"chunk metadata does not fit the pool record: {exc}") from None
    body = fixed + tenant + xxhash.xxh3_64_intdigest(view).to_bytes(8, "little")
    return body + zlib.crc32(body).to_bytes(4, "little")


def header_length(prefix: Buffer) -> int:
    """Full header length announced by a record's first bytes (at least FIXED_BYTES of them).

    Checks magic and version only, since the CRC needs the whole header: use it to know how much
    to read, then ``decode_header`` to trust it. Raises CorruptChunk."""
    view = byte_view(prefix)
    if view.nbytes < FIXED_BYTES:
        raise CorruptChunk(f"record too short for a header ({view.nbytes} bytes)")
    magic, version = view[:4].tobytes(), view[4]
    if magic != MAGIC:
        raise CorruptChunk(f"bad magic {magic!r} (not a pool record)")
    if version != FORMAT_VERSION:
        raise CorruptChunk(f"unknown record version {version}")
    tenant_len: int = struct.unpack_from("<H", view, FIXED_BYTES - 2)[0]
    return MIN_HEADER_BYTES + tenant_len


def decode_header(record: Buffer, *, key: bytes) -> RecordHeader:
    """Verify and parse the header at the start of ``record`` (the payload may be absent).

    Raises CorruptChunk when the header is short, damaged, or names another key."""
    view = byte_view(record)
    header_bytes = header_length(view)
    if view.nbytes < header_bytes:
        raise CorruptChunk(
            f"record too short for its header ({view.nbytes} of {header_bytes} bytes)"
        )
    crc_at = header_bytes - 4
    (stored_crc,) = struct.unpack_from("<I", view, crc_at)
    if zlib.crc32(view[:crc_at]) != stored_crc:
        raise CorruptChunk("header checksum mismatch")
    # Only a header that passed its CRC is trusted past this point.
    (_, _, flags, priority, tokens, size_bytes, stored_key, parent, created_s, tenant_len) = (
        _FIXED.unpack_from(view)
    )
    if flags & ~_KNOWN_FLAGS:
        raise CorruptChunk(f"unknown record flags {flags:#x}")
    if stored_key != key:
        raise CorruptChunk(f"record holds key {stored_key.hex()}, not {bytes(key).hex()}")
    if size_bytes <= 0:
        raise CorruptChunk("record declares an empty payload")
    try:
        tenant = view[FIXED_BYTES : FIXED_BYTES + tenant_len].tobytes().decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptChunk("tenant is not utf-8") from None
    (payload_xxh3_64,) = struct.unpack_from("<Q", view, FIXED_BYTES + tenant_len)
    meta = ChunkMeta(
        key=stored_key,
        size_bytes=size_bytes,
        tokens=tokens,
        tenant=tenant,
        parent=parent if flags & FLAG_HAS_PARENT else None,
        priority=priority,
        isolated=bool(flags & FLAG_ISOLATED),
        created_s=created_s,
    )
    return RecordHeader(meta, header_bytes, payload_xxh3_64)


def decode(record: Buffer, *, key: bytes) -> tuple[ChunkMeta, memoryview]:
    """The metadata and the payload (a slice of ``record``, not a copy) of a whole record.

    Raises CorruptChunk for a short record, a bad magic/version, a header CRC mismatch, another
    key, a payload whose length is not the declared size, or a payload checksum mismatch."""
    view = byte_view(record)
    header = decode_header(view, key=key)
    payload = view[header.header_bytes :]
    if payload.nbytes != header.meta.size_bytes:
        raise CorruptChunk(
            f"payload is {payload.nbytes} bytes, the header declares {header.meta.size_bytes}"
        )
    if xxhash.xxh3_64_intdigest(payload) != header.payload_xxh3_64:
        raise CorruptChunk("payload checksum mismatch")
    return header.meta, payload


def byte_view(data: Buffer) -> memoryview:
    """A flat unsigned-byte view (no copy), so lengths and slices count bytes."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise InvalidArgument("a chunk payload must be a contiguous buffer")
        view = view.cast("B")
    return view
