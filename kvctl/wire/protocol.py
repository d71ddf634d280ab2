"""The data plane's wire format: binary, framed, versioned. Shared by the agent and the SDK.

Every frame is a 20-byte header, then ``meta_len`` bytes of metadata, then ``payload_len``
bytes of payload (chunk bytes in PUT requests and GET replies; filler bytes in PROBE requests
and replies)::

    magic "KV" | version u8 | op u8 | request_id u32 | meta_len u32 | payload_len u64

A reply carries the request's op with the high bit set (or ``ERROR``) and the same request id.
Metadata is packed little-endian binary: keys are 16 raw bytes, strings are u16-length-prefixed
UTF-8. Bulk bytes are never re-encoded: they travel as the payload, read with ``recv_into``
straight into preallocated buffers and sent with ``sendmsg`` from memoryviews.

A frame the agent cannot trust (bad magic or version, oversized, truncated metadata) gets an
``ERROR`` frame and the connection is closed, because the byte stream can no longer be framed.
A well-framed but invalid request gets an ``ERROR`` frame and the connection stays usable.

What a peer can do is negotiated by explicit flags, never by version numbers: the header's
``version`` is the framing's (it changes only when old and new cannot frame each other), and
the HELLO reply's JSON ``version`` is the agent's kvctl package version, for people and logs
(``kvctl doctor`` compares it across the fleet). Builds with and without a capability have
reported the same package version, so a client decides by the HELLO's capability fields
(``fetch_checksum``, ``put_checksum``: each names the checksum it takes, absent on agents
before it; ``get_counted``; ``shm``), and an agent by the request's own flags
(``FETCH_CHECKSUMS``, ``PUT_CHECKSUMS``, ``GET_COUNTED``), never by comparing versions.
"""

from __future__ import annotations

import array
import socket
import struct
import time
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any

import numpy as np
import xxhash

from kvctl.store.index import MAX_TENANT_BYTES
from kvctl.store.keys import KEY_BYTES

MAGIC = b"KV"
VERSION = 1
HEADER = struct.Struct("<2sBBIIQ")
HEADER_BYTES = HEADER.size
REPLY_BIT = 0x80
MAX_META_BYTES = 8 << 20
MAX_BATCH = 65536
#: most metadata a HELLO may carry (a token and a client name): a connection not yet
#: authenticated may send nothing larger, so it cannot make the agent hold megabytes
MAX_HELLO_META_BYTES = 64 << 10
#: most keys one LOOKUP_MANY frame may name over all its chains
MAX_LOOKUP_MANY_KEYS = MAX_BATCH
#: most file descriptors a frame may pass on the Unix socket: one, with an ATTACH (its staging
#: segment); any other frame passes none
MAX_FDS_PER_FRAME = 1
#: most bytes one PROBE may upload or ask for: enough to time a link, small enough that a probe
#: cannot be used to make an agent stream gigabytes
MAX_PROBE_BYTES = 64 << 20
#: PROBE filler is sent in pieces of this size, all views of one shared zero buffer
PROBE_PIECE_BYTES = 1 << 20
NO_TIER = 255
_KEY_DTYPE = np.dtype(f"V{KEY_BYTES}")

#: what an agent's refusal of a staging segment (ATTACH, BAD_REQUEST) says where it could not
#: map it, and what it adds where that was for want of descriptors: the error carries no cause,
#: so the SDK tells by these a refusal for memory, which a smaller segment may escape, from one
#: a smaller segment meets the same
SEGMENT_UNMAPPED_TEXT = "could not map a staging segment"
SEGMENT_NO_DESCRIPTORS_TEXT = "out of descriptors"
#: one put item: key, size, tokens, priority, flags, parent, depth
ITEM = struct.Struct("<16sQIBB16sI")
#: a put item whose bytes wait in the client's staging segment at this offset
STAGED_ITEM = struct.Struct("<16sQIBB16sIQ")
#: one lease in a LEASE reply: status, generation, lease id, offset, size, deadline
LEASE_ITEM = struct.Struct("<BQQQQd")
#: one GET reply item: status, size
GET_ITEM = struct.Struct("<BQ")

FLAG_PINNED = 1
#: the chunk belongs to an isolated tenant: never served to another (set by agents that pass
#: chunks on, e.g. to a pool agent, whose own settings do not know the tenant)
FLAG_ISOLATED = 2
FLAG_HAS_PARENT = 4
#: one FETCH reply item: status, size, tokens, priority, flags, parent, created_s
FETCH_ITEM = struct.Struct("<BQIBB16sd")
#: FETCH request flags (the u8 after the tenant). Agents before checksums read that byte as a
#: boolean "send the payload": given FETCH_CHECKSUMS they send the old reply, and given it
#: alone they would send the payload. So a client sets FETCH_CHECKSUMS only beside
#: FETCH_PAYLOAD, and only to an agent whose HELLO advertises ``fetch_checksum``.
FETCH_PAYLOAD = 1
#: the reply ends with each item's checksum (``FETCH_CHECKSUM``) of the bytes sent for it
FETCH_CHECKSUMS = 2
#: the checksum a FETCH reply carries per chunk; HELLO's ``fetch_checksum`` names it
FETCH_CHECKSUM_NAME = "xxh3_64"
#: one item's checksum at the end of a FETCH reply: XXH3-64 (seed 0) of its bytes, 0 when
#: the item is missing
FETCH_CHECKSUM = struct.Struct("<Q")
#: PUT request flags: an optional u8 after the items. Agents before them refuse any metadata
#: past the items (BAD_REQUEST for the whole PUT), so a client sends it only to an agent whose
#: HELLO advertises ``put_checksum``; a PUT without it is the old request, stored unchecked.
#: PUT_CHECKSUMS: n x PUT_CHECKSUM follow, each item's checksum of the bytes sent for it
PUT_CHECKSUMS = 1
#: the checksum a PUT may carry per chunk; HELLO's ``put_checksum`` names it
PUT_CHECKSUM_NAME = FETCH_CHECKSUM_NAME
#: one item's checksum at the end of a PUT request: XXH3-64 (seed 0) of its bytes
PUT_CHECKSUM = FETCH_CHECKSUM
#: GET request flags: an optional u8 after the keys. GET_COUNTED: a re-read of chunks a LEASE
#: of the same read counted as served already (a lease that ran out during the client's copy,
#: a chunk cached but not leasable): the agent sends them and counts no access again (a
#: chunk's hit_count, its eviction policy's recency and frequency), so each read counts once.
#: Agents before it refuse metadata past the keys (BAD_REQUEST: the connection stays usable),
#: so a client sets it only for an agent whose HELLO says ``get_counted``; to an older agent
#: it sends the plain GET, and that agent counts the re-read a second time.
GET_COUNTED = 1
#: the data plane's capabilities, as an agent's HELLO and its /v1/info (``dataplane.features``)
#: name them, each with what readers call it. Every agent this kvctl builds has all of them; one
#: without ``features`` in /v1/info predates that report (it may still offer some in its HELLO)
DATA_PLANE_FEATURES: dict[str, object] = {
    "fetch_checksum": FETCH_CHECKSUM_NAME,
    "put_checksum": PUT_CHECKSUM_NAME,
    "get_counted": True,
}
FEATURE_NAMES = {
    "fetch_checksum": "FETCH checksums",
    "put_checksum": "PUT checksums",
    "get_counted": "GET_COUNTED",
}
_NO_PARENT = bytes(KEY_BYTES)


class Op(IntEnum):
    HELLO = 1
    PING = 2
    #: chunks: meta tenant, u32 n, n x ITEM, then optionally u8 PUT flags (PUT_CHECKSUMS:
    #: n x PUT_CHECKSUM follow); the payload is the chunks in order; reply u32 n, then per item
    #: u8 Status and u8 tier code (NO_TIER when not stored; for NO_ROOM, the tier whose
    #: filesystem was full when that is part of why: older agents send NO_TIER, older clients
    #: read it as a tier name they do not use)
    PUT = 3
    #: chunks' bytes: meta tenant, keys, then optionally u8 GET flags (GET_COUNTED); reply
    #: u32 n, n x GET_ITEM; the payload is the found chunks in order
    GET = 4
    EXISTS = 5
    LOOKUP = 6
    MAP = 7
    LEASE = 8
    RELEASE = 9
    ATTACH = 10
    PUT_STAGED = 11
    #: many chains in one frame: amortizes the round trip for batch schedulers
    LOOKUP_MANY = 12
    #: link probe: the payload (upload) is read and dropped, the reply carries ``want_bytes``
    #: zero bytes (download); meta u64 want_bytes, reply meta u64 bytes received
    PROBE = 13
    #: chunks with their metadata, for other agents (a pool agent's clients, peers): meta
    #: tenant, u8 flags (FETCH_PAYLOAD, FETCH_CHECKSUMS), keys; reply u32 n, then per item
    #: FETCH_ITEM + owner tenant text, then (FETCH_CHECKSUMS only) n x FETCH_CHECKSUM; the
    #: payload (when wanted) is the found chunks in order
    FETCH = 14
    #: a tenant's sharing policy, so an engine salts its keys as the agent does: meta tenant;
    #: reply u8 isolated
    TENANT = 15
    #: an engine's measured rates for fetch-or-recompute: meta model text, f64 host -> device
    #: bytes/s (0: not measured), u32 n, n x RATE_SAMPLE (computed tokens, cached prefix
    #: tokens, seconds); reply u32 samples kept, f64 tokens/s, f64 attention term, basis text
    RATES = 16
    #: LOOKUP, then LEASE of the matched prefix, in one round trip (a same-host engine's reuse):
    #: meta tenant, f64 ttl, keys; reply the LOOKUP reply, then u32 n and n x LEASE_ITEM (n =
    #: the matched chunks)
    LOOKUP_LEASE = 17
    #: LOOKUP_LEASE that pulls nothing: the matched prefix is leased up to its first chunk held
    #: on another node (the pool, a peer), and that chunk and the rest get REMOTE items, for the
    #: engine to LEASE in slices (each LEASE pulls its slice) while it copies the slice before
    #: to its device. Same meta and reply as LOOKUP_LEASE
    LOOKUP_LEASE_LOCAL = 18
    ERROR = 0x7F


class ErrorCode(IntEnum):
    BAD_FRAME = 1
    BAD_VERSION = 2
    TOO_LARGE = 3
    UNAUTHORIZED = 4
    BAD_REQUEST = 5
    NOT_FOUND = 6
    NO_ROOM = 7
    UNAVAILABLE = 8
    INTERNAL = 9
    UNSUPPORTED = 10
    #: the request stopped moving bytes (or crawled) mid-frame; the agent closes the connection
    TIMEOUT = 11
    #: the agent's budget for bytes in flight stayed full; the agent closes the connection
    #: (the payload was never read); retry later
    BUSY = 12


#: error codes after which the agent closes the connection (clients close their end too)
CLOSING_ERROR_CODES = frozenset(
    {
        ErrorCode.BAD_FRAME,
        ErrorCode.BAD_VERSION,
        ErrorCode.TOO_LARGE,
        ErrorCode.UNAUTHORIZED,
        ErrorCode.INTERNAL,
        ErrorCode.TIMEOUT,
        ErrorCode.BUSY,
    }
)


class Status(IntEnum):
    """Per-item outcome in batch replies."""

    OK = 0
    MISSING = 1
    DECLINED = 2
    TOO_LARGE = 3
    #: no tier could take the chunk (pins, leased regions, larger than a tier, a filesystem
    #: full); the item's tier code names a tier whose filesystem was full, if one was
    NO_ROOM = 4
    BAD = 5
    #: the chunk exists but cannot be leased in shared memory; fetch it over the socket
    FALLBACK = 6
    #: matched on another node and not pulled (LOOKUP_LEASE_LOCAL): LEASE it to bring it here
    REMOTE = 7
    #: a PUT chunk whose bytes do not match the checksum its sender computed (damaged on the
    #: way): not stored. Only a PUT that carries checksums gets it
    CORRUPT = 8


class FrameError(Exception):
    """A frame that breaks the protocol. ``fatal``: the connection cannot continue."""

    def __init__(self, code: ErrorCode, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal


class PeerClosed(Exception):
    """The other side closed the connection (cleanly between frames, or mid-frame)."""


def pack_header(op: int, request_id: int, meta_len: int, payload_len: int = 0) -> bytes:
    return HEADER.pack(MAGIC, VERSION, op, request_id, meta_len, payload_len)


def check_header(
    raw: bytes | bytearray | memoryview, *, max_payload_bytes: int
) -> tuple[int, int, int, int]:
    """(op, request_id, meta_len, payload_len) of a header, or FrameError (fatal)."""
    magic, version, op, request_id, meta_len, payload_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise FrameError(ErrorCode.BAD_FRAME, f"bad magic {bytes(magic)!r}", fatal=True)
    if version != VERSION:
        raise FrameError(
            ErrorCode.BAD_VERSION,
            f"protocol version {version} is not supported (this side speaks {VERSION})",
            fatal=True,
        )
    if meta_len > MAX_META_BYTES:
        raise FrameError(
            ErrorCode.TOO_LARGE, f"metadata of {meta_len} bytes > {MAX_META_BYTES}", fatal=True
        )
    if payload_len > max_payload_bytes:
        raise FrameError(
            ErrorCode.TOO_LARGE,
            f"payload of {payload_len} bytes exceeds this agent's limit of {max_payload_bytes}",
            fatal=True,
        )
    return op, request_id, meta_len, payload_len


# --- metadata ---------------------------------------------------------------------------------
class MetaWriter:
    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def u8(self, v: int) -> MetaWriter:
        self._parts.append(struct.pack("<B", v))
        return self

    def u32(self, v: int) -> MetaWriter:
        self._parts.append(struct.pack("<I", v))
        return self

    def u64(self, v: int) -> MetaWriter:
        self._parts.append(struct.pack("<Q", v))
        return self

    def f64(self, v: float) -> MetaWriter:
        self._parts.append(struct.pack("<d", v))
        return self

    def text(self, s: str) -> MetaWriter:
        raw = s.encode()
        if len(raw) > 0xFFFF:
            raise ValueError("a string in a frame is at most 65535 bytes")
        self._parts.append(struct.pack("<H", len(raw)) + raw)
        return self

    def raw(self, b: bytes) -> MetaWriter:
        self._parts.append(b)
        return self

    def keys(self, keys: Sequence[bytes]) -> MetaWriter:
        if len(keys) > MAX_BATCH:
            raise ValueError(f"at most {MAX_BATCH} keys per frame, got {len(keys)}")
        # checked in C (map/set) because engines send chains of hundreds of keys per request
        if keys and (set(map(type, keys)) != {bytes} or set(map(len, keys)) != {KEY_BYTES}):
            bad = next(k for k in keys if not isinstance(k, bytes) or len(k) != KEY_BYTES)
            raise ValueError(f"a key is {KEY_BYTES} bytes, got {bad!r:.60}")
        self._parts.append(struct.pack("<I", len(keys)) + b"".join(keys))
        return self

    def build(self) -> bytes:
        return b"".join(self._parts)


class MetaReader:
    """Reads packed metadata; anything short or malformed is a (non-fatal) FrameError, since
    the frame's length was already known and the stream stays in sync."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._b = bytes(data)
        self._pos = 0

    def take(self, n: int) -> bytes:
        """The next ``n`` raw bytes."""
        return self._take(n)

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._b):
            raise FrameError(ErrorCode.BAD_REQUEST, "metadata is truncated")
        out = self._b[self._pos : end]
        self._pos = end
        return out

    def u8(self) -> int:
        return self._take(1)[0]

    def u32(self) -> int:
        return int(struct.unpack("<I", self._take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self._take(8))[0])

    def f64(self) -> float:
        return float(struct.unpack("<d", self._take(8))[0])

    def text(self) -> str:
        n = int(struct.unpack("<H", self._take(2))[0])
        try:
            return self._take(n).decode()
        except UnicodeDecodeError:
            raise FrameError(ErrorCode.BAD_REQUEST, "a string is not valid UTF-8") from None

    def tenant(self) -> str:
        """A tenant name: ``text`` of at most ``MAX_TENANT_BYTES`` (the store's cap: each
        chunk's entry keeps its tenant's name), else a BAD_REQUEST for the whole request."""
        head = self._b[self._pos : self._pos + 2]  # its length, read again by ``text``
        n = int(struct.unpack("<H", head)[0]) if len(head) == 2 else 0
        if n > MAX_TENANT_BYTES:
            raise FrameError(
                ErrorCode.BAD_REQUEST,
                f"tenant name is {n} bytes in UTF-8; at most {MAX_TENANT_BYTES} are allowed",
            )
        return self.text()

    def count(self, limit: int = MAX_BATCH) -> int:
        n = self.u32()
        if n > limit:
            raise FrameError(ErrorCode.BAD_REQUEST, f"batch of {n} items > limit {limit}")
        return n

    def next_count(self) -> int:
        """The u32 that comes next (a count), left unread."""
        head = self._b[self._pos : self._pos + 4]
        if len(head) < 4:
            raise FrameError(ErrorCode.BAD_REQUEST, "metadata is truncated")
        return int(struct.unpack("<I", head)[0])

    def keys(self) -> list[bytes]:
        n = self.count()
        raw = self._take(n * KEY_BYTES)
        # numpy splits the run of keys into bytes objects in C, 8x faster than slicing
        return list(np.frombuffer(raw, dtype=_KEY_DTYPE).tolist()) if n else []

    def structs(self, st: struct.Struct, n: int) -> list[tuple[Any, ...]]:
        raw = self._take(n * st.size)
        return list(st.iter_unpack(raw))

    def left(self) -> int:
        """Bytes not read yet."""
        return len(self._b) - self._pos

    def rest(self) -> bytes:
        out = self._b[self._pos :]
        self._pos = len(self._b)
        return out

    def done(self) -> None:
        if self._pos != len(self._b):
            raise FrameError(
                ErrorCode.BAD_REQUEST, f"{len(self._b) - self._pos} unexpected metadata bytes"
            )


def put_item(
    key: bytes,
    size_bytes: int,
    *,
    tokens: int = 0,
    priority: int = 35,
    pinned: bool = False,
    parent: bytes | None = None,
    depth: int = 0,
    staging_offset: int | None = None,
    isolated: bool = False,
) -> bytes:
    flags = (
        (FLAG_PINNED if pinned else 0)
        | (FLAG_HAS_PARENT if parent is not None else 0)
        | (FLAG_ISOLATED if isolated else 0)
    )
    fields = (key, size_bytes, tokens, priority, flags, parent or _NO_PARENT, depth)
    if staging_offset is None:
        return ITEM.pack(*fields)
    return STAGED_ITEM.pack(*fields, staging_offset)


def put_meta(tenant: str, items: Sequence[bytes], checksums: Sequence[int] | None = None) -> bytes:
    """A PUT's (or PUT_STAGED's, without ``checksums``) metadata: the tenant, the items
    (``put_item``), then with ``checksums`` (``chunk_checksum`` of each item's bytes, in order)
    the PUT_CHECKSUMS flag and them."""
    if len(items) > MAX_BATCH:
        raise ValueError(f"at most {MAX_BATCH} chunks per PUT, got {len(items)}")
    w = MetaWriter().text(tenant).u32(len(items)).raw(b"".join(items))
    if checksums is not None:
        if len(checksums) != len(items):
            raise ValueError(f"{len(checksums)} checksums for {len(items)} chunks")
        w.u8(PUT_CHECKSUMS).raw(b"".join(map(PUT_CHECKSUM.pack, checksums)))
    return w.build()


def parse_put_checksums(meta: MetaReader, n_items: int) -> list[int] | None:
    """What may end a PUT's metadata after its ``n_items`` items: None where nothing does (a
    client before checksums, or one that sends none), else each item's checksum; nothing may
    follow. A flag byte this side does not know is a BAD_REQUEST (the connection stays in step:
    the frame's lengths are known)."""
    if not meta.left():
        return None
    flags = meta.u8()
    if flags != PUT_CHECKSUMS:
        raise FrameError(ErrorCode.BAD_REQUEST, f"unknown PUT flags {flags:#04x}")
    sums = [int(s) for (s,) in meta.structs(PUT_CHECKSUM, n_items)]
    meta.done()
    return sums


def get_meta(tenant: str, keys: Sequence[bytes], *, counted: bool = False) -> bytes:
    """A GET's metadata: the tenant, the keys, and with ``counted`` the GET_COUNTED flag (only
    for an agent whose HELLO says ``get_counted``)."""
    w = MetaWriter().text(tenant).keys(keys)
    if counted:
        w.u8(GET_COUNTED)
    return w.build()


def parse_get_flags(meta: MetaReader) -> bool:
    """Whether a GET's metadata, read up to its keys, ends with GET_COUNTED (nothing: a plain
    GET); nothing may follow. A flag this side does not know is a BAD_REQUEST, as for PUT: a
    client sends only the flags the agent's HELLO names."""
    if not meta.left():
        return False
    flags = meta.u8()
    meta.done()
    if flags != GET_COUNTED:
        raise FrameError(ErrorCode.BAD_REQUEST, f"unknown GET flags {flags:#04x}")
    return True


def fetch_flags(*, payload: bool, checksums: bool) -> int:
    """A FETCH request's flag byte. Checksums cover bytes sent, so they need the payload (and
    an agent before them would read a lone FETCH_CHECKSUMS as "send the payload")."""
    if checksums and not payload:
        raise ValueError("FETCH checksums are of the payload: ask for both")
    return (FETCH_PAYLOAD if payload else 0) | (FETCH_CHECKSUMS if checksums else 0)


def parse_fetch_flags(flags: int) -> tuple[bool, bool]:
    """(send the payload, append checksums) of a FETCH request's flag byte. Bits this side
    does not know, or checksums without the payload, are a BAD_REQUEST: no client sends them,
    and guessing would answer in a format the client may not parse."""
    if flags & ~(FETCH_PAYLOAD | FETCH_CHECKSUMS):
        raise FrameError(ErrorCode.BAD_REQUEST, f"unknown FETCH flags {flags:#04x}")
    if flags == FETCH_CHECKSUMS:
        raise FrameError(ErrorCode.BAD_REQUEST, "FETCH checksums without the payload")
    return bool(flags & FETCH_PAYLOAD), bool(flags & FETCH_CHECKSUMS)


def chunk_checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum FETCH replies and PUT requests carry for a chunk's bytes (XXH3-64, seed 0;
    the disk tier's too)."""
    return xxhash.xxh3_64_intdigest(data)


#: FETCH's name for ``chunk_checksum``
fetch_checksum = chunk_checksum


def parse_fetch_checksums(meta: MetaReader, n_items: int) -> list[int]:
    """The ``n_items`` checksums that end a FETCH reply that carries them; nothing may follow."""
    sums = [int(s) for (s,) in meta.structs(FETCH_CHECKSUM, n_items)]
    meta.done()
    return sums


def probe_meta(want_bytes: int) -> bytes:
    """A PROBE request's metadata: how many zero bytes the reply should carry."""
    if not 0 <= want_bytes <= MAX_PROBE_BYTES:
        raise ValueError(f"a probe downloads 0..{MAX_PROBE_BYTES} bytes, not {want_bytes}")
    return MetaWriter().u64(want_bytes).build()


def parse_probe(meta: MetaReader, upload_bytes: int) -> int:
    """``want_bytes`` of a PROBE request whose payload is ``upload_bytes``. An oversized upload
    is fatal (like any oversized frame: its bytes are never read, so the stream is lost); an
    oversized download is TOO_LARGE as well, fatal too, because clients close on TOO_LARGE."""
    if upload_bytes > MAX_PROBE_BYTES:
        raise FrameError(
            ErrorCode.TOO_LARGE,
            f"probe upload of {upload_bytes} bytes > {MAX_PROBE_BYTES}",
            fatal=True,
        )
    want_bytes = meta.u64()
    meta.done()
    if want_bytes > MAX_PROBE_BYTES:
        raise FrameError(
            ErrorCode.TOO_LARGE,
            f"probe download of {want_bytes} bytes > {MAX_PROBE_BYTES}",
            fatal=True,
        )
    return want_bytes


def zero_pieces(zeros: bytes | bytearray | memoryview, n_bytes: int) -> list[memoryview]:
    """``n_bytes`` of filler as views of ``zeros`` (reused, so nothing of size n is allocated)."""
    view = memoryview(zeros).cast("B")
    if view.nbytes == 0 and n_bytes:
        raise ValueError("an empty zero buffer cannot fill a probe")
    full, rest = divmod(n_bytes, view.nbytes or 1)
    return [view] * full + ([view[:rest]] if rest else [])


#: one prefill sample in a RATES request: computed tokens, cached prefix tokens, seconds
RATE_SAMPLE = struct.Struct("<QQd")
#: samples one RATES frame may carry
MAX_RATE_SAMPLES = 4096


def rates_meta(
    samples: Sequence[tuple[int, int, float]],
    host_to_device_bytes_per_s: float | None = None,
    model: str = "",
) -> bytes:
    """A RATES request's metadata. Values are checked by the agent, not here, so that every
    engine gets the same answer for a bad figure."""
    if len(samples) > MAX_RATE_SAMPLES:
        raise ValueError(f"at most {MAX_RATE_SAMPLES} samples per RATES frame, got {len(samples)}")
    packed = []
    for n, a, t in samples:
        if not (0 <= int(n) < 1 << 64 and 0 <= int(a) < 1 << 64):  # u64 on the wire
            raise ValueError(f"token counts are unsigned 64-bit integers, got {n!r}, {a!r}")
        packed.append(RATE_SAMPLE.pack(int(n), int(a), float(t)))
    w = MetaWriter().text(model).f64(host_to_device_bytes_per_s or 0.0).u32(len(samples))
    return w.raw(b"".join(packed)).build()


def parse_rates(meta: MetaReader) -> tuple[list[tuple[int, int, float]], float | None, str]:
    """(samples, host -> device bytes/s or None, model) of a RATES request; structure only."""
    model = meta.text()
    bandwidth = meta.f64()
    n = meta.count(MAX_RATE_SAMPLES)
    samples = [(int(c), int(a), float(t)) for c, a, t in meta.structs(RATE_SAMPLE, n)]
    meta.done()
    return samples, (None if bandwidth == 0.0 else bandwidth), model


def rates_reply(kept: int, tokens_per_s: float, beta_s_per_token2: float, basis: str) -> bytes:
    return MetaWriter().u32(kept).f64(tokens_per_s).f64(beta_s_per_token2).text(basis).build()


def parse_rates_reply(meta: bytes) -> dict[str, object]:
    r = MetaReader(meta)
    out: dict[str, object] = {
        "kept": r.u32(),
        "tokens_per_s": r.f64(),
        "beta_s_per_token2": r.f64(),
        "basis": r.text(),
    }
    r.done()
    return out


def error_meta(code: ErrorCode, message: str) -> bytes:
    return struct.pack("<H", code) + message.encode()[:4096]


def parse_error(meta: bytes) -> tuple[int, str]:
    if len(meta) < 2:
        return ErrorCode.BAD_FRAME, "malformed error frame"
    return struct.unpack("<H", meta[:2])[0], meta[2:].decode(errors="replace")


# --- socket I/O -------------------------------------------------------------------------------
def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket (``recv_into``, no intermediate copies)."""
    got = 0
    n = view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerClosed(f"connection closed after {got} of {n} bytes")
        got += k


_CMSG_SPACE = socket.CMSG_SPACE(4 * 4)


def recv_some_passing(sock: socket.socket, view: memoryview) -> tuple[int, list[int], bool]:
    """One ``recvmsg_into`` on a Unix socket: bytes read (0 at close), the descriptors passed
    with them (the caller owns each: it keeps or closes it) and whether the kernel dropped some
    that did not fit (MSG_CTRUNC)."""
    k, anc, flags, _addr = sock.recvmsg_into([view], _CMSG_SPACE)
    passed = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            passed.frombytes(data[: len(data) - len(data) % passed.itemsize])
    return int(k), passed.tolist(), bool(flags & socket.MSG_CTRUNC)


def recv_some_with_fds(sock: socket.socket, view: memoryview, fds: list[int]) -> int:
    """One ``recvmsg_into`` on a Unix socket: bytes read (0 at close), passed descriptors
    appended to ``fds``."""
    k, passed, _truncated = recv_some_passing(sock, view)
    fds.extend(passed)
    return k


def recv_with_fds(sock: socket.socket, view: memoryview, fds: list[int]) -> bool:
    """Like ``recv_exactly`` on a Unix socket, also collecting passed file descriptors.
    Returns False on a clean close before the first byte."""
    got = 0
    n = view.nbytes
    while got < n:
        k = recv_some_with_fds(sock, view[got:], fds)
        if k == 0:
            if got == 0:
                return False
            raise PeerClosed(f"connection closed after {got} of {n} bytes")
        got += k
    return True


#: the kernel takes at most this many buffers (IOV_MAX) in one sendmsg
SEND_MAX_BUFFERS = 512


def send_all(
    sock: socket.socket,
    parts: Sequence[bytes | bytearray | memoryview],
    fd: int = -1,
    *,
    slice_bytes: int | None = None,
    on_sent: Callable[[int], None] | None = None,
    end_s: float | None = None,
) -> int:
    """Send ``parts`` with as few syscalls as the kernel allows (``sendmsg`` gathers them),
    passing ``fd`` along with the first byte when given. ``slice_bytes``: at most that many
    bytes a syscall; ``on_sent`` is told each syscall's bytes once the kernel took them (a
    server counting a reply toward its stall deadline as its reader takes it). ``end_s``
    (``time.monotonic``): the whole send ends by then or raises TimeoutError (the socket's
    timeout is left changed); the socket's timeout alone bounds each wait, so a reader taking
    the bytes a little at a time would hold the sender for as long as it kept reading. Returns
    bytes sent."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
    total = sum(v.nbytes for v in views)
    anc = []
    if fd >= 0:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
    while views:
        batch = views[:SEND_MAX_BUFFERS]
        if slice_bytes is not None:
            batch, room = [], slice_bytes
            for v in views[:SEND_MAX_BUFFERS]:
                batch.append(v[:room])
                room -= batch[-1].nbytes
                if room <= 0:
                    break
        if end_s is not None:
            left_s = end_s - time.monotonic()
            if left_s <= 0:
                raise TimeoutError("timed out")
            sock.settimeout(left_s)
        sent = sock.sendmsg(batch, anc)
        anc = []
        if on_sent is not None:
            on_sent(sent)
        while sent:
            head = views[0]
            if sent >= head.nbytes:
                sent -= head.nbytes
                views.pop(0)
            else:
                views[0] = head[sent:]
                sent = 0
    return total
