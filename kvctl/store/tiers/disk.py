"""Local-SSD tier: one file per chunk, written atomically, checked on every read.

Layout under the tier directory::

    .lock                      flock'd while a DiskTier has the directory open
    .clean-index               what a clean close found, read by the next open instead of every
                               chunk file's header, and removed by it (``disk_index``)
    ab/abcdef...(32 hex).kv    one chunk: header + payload
    ab/.abcdef....<pid>.<n>.tmp  a write in progress (removed at the next open if left behind)

Chunks fan out into 256 subdirectories by the first key byte, so each directory holds 1/256 of
the chunks and name lookups, creates and the scan at open stay fast. Files are created 0600 and
directories 0700 whatever the umask (chunks hold prompts' KV); ones an older build made readable
by others are tightened at open.

File format (little-endian), version 1::

    magic "KVCD" | version u16 | flags u16 | header_len u32 | checksum_kind u8 | reserved 3 bytes
    key 16 bytes | payload_size u64 | payload_checksum u64 | tokens u64 | priority i64
    created_s f64 | parent 16 bytes (zeros when flags lacks HAS_PARENT) | tenant_len u16
    tenant (utf-8, tenant_len bytes) | header_crc32 u32 (over every header byte before it)
    payload (payload_size bytes)

``checksum_kind`` names the payload checksum algorithm; ``payload_checksum`` holds its value,
zero-extended to 64 bits::

    1  CRC-32 (zlib), 32 bits. Written by older builds; still read and verified.
    2  XXH3-64 (``xxhash.xxh3_64``, seed 0), the full 64 bits. Written by this build.

We need torn/corrupt detection, not cryptographic strength. The payload is checked after every
read, so the checksum's speed bounds warm (page-cache) read bandwidth: on one core CRC-32 ran at
~4.1-4.5 GB/s and XXH3-64 at ~22-27 GB/s on 4 and 32 MiB buffers, and a 64-bit digest lets fewer
random corruptions through than 32 bits. Any other kind is dropped at open as corrupt (its payload
cannot be verified). The header is always guarded by ``header_crc32`` (CRC-32): it is small, so its
check costs nothing worth trading for a format change.

Writes go to a temp file in the chunk's own subdirectory and are renamed into place, so a process
killed at any instant leaves either no chunk or the complete one. Whatever a crashed kernel or a
bad disk leaves behind is dropped at open (header, length) or on read (payload checksum).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import logging
import os
import re
import resource
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

from kvctl.format import format_bytes
from kvctl.store.errors import (
    CapacityError,
    CorruptChunk,
    DirectoryInUse,
    DiskFullError,
    InvalidArgument,
    KeyNotFound,
    PayloadSizeError,
    TierUnavailable,
)
from kvctl.store.tiers import disk_index
from kvctl.store.tiers.base import (
    Buffer,
    ChunkMeta,
    ReadPlan,
    Tier,
    WriteSlot,
    byte_view,
    check_capacity,
    check_put,
    check_resize,
    check_room,
)
from kvctl.store.tiers.disk_index import IndexedChunk

log = logging.getLogger(__name__)

KEY_BYTES = 16
MAGIC = b"KVCD"
FORMAT_VERSION = 1
# Payload checksum kinds (header ``checksum_kind``); see the module docstring.
CHECKSUM_CRC32 = 1
CHECKSUM_XXH3_64 = 2
CHECKSUM_KIND = CHECKSUM_XXH3_64  # what new writes use

_FLAG_ISOLATED = 0x1
_FLAG_HAS_PARENT = 0x2
_KNOWN_FLAGS = _FLAG_ISOLATED | _FLAG_HAS_PARENT

# Everything up to and including tenant_len; the tenant bytes and the header CRC follow.
_FIXED = struct.Struct("<4sHHIB3x16sQQQqd16sH")
_CRC = struct.Struct("<I")
MAX_TENANT_BYTES = 0xFFFF


class _Hasher(Protocol):
    def update(self, data: Buffer, /) -> None: ...
    def intdigest(self) -> int: ...


class _Crc32Hasher:
    """zlib.crc32 behind the update/intdigest interface of xxhash's hashers."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Buffer, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def intdigest(self) -> int:
        return self._value


# kind -> (one-shot checksum of a whole buffer, factory of a streaming hasher giving the same value)
_CHECKSUMS: dict[int, tuple[Callable[[Buffer], int], Callable[[], _Hasher]]] = {
    CHECKSUM_CRC32: (zlib.crc32, _Crc32Hasher),
    CHECKSUM_XXH3_64: (xxhash.xxh3_64_intdigest, xxhash.xxh3_64),
}

# Errors that mean "the filesystem is out of room for this write", not "the tier is broken".
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

_LOCK_NAME = ".lock"
_TMP_SUFFIX = ".tmp"
_CHUNK_SUFFIX = ".kv"
_CHUNK_NAME = re.compile(r"[0-9a-f]{32}\.kv")
_FANOUT_NAME = re.compile(r"[0-9a-f]{2}")

# Reads at open (header probe) get the whole header in one syscall for any tenant under ~4 KiB.
_HEADER_PROBE_BYTES = 4096
# verify_on_open streams payloads through a buffer this size so large chunks do not cost memory.
_VERIFY_BUFFER_BYTES = 8 << 20
# The reasons list is for a human reading a status line; the count stays exact beyond it.
_MAX_REASONS = 50
# The scan at open logs how far it got this often: 160k chunk files took over 30 s on a VM, and
# until it ends the agent does not serve.
_SCAN_PROGRESS_S = 5.0
# The scan's actions on a file of a fan-out directory (``DiskTier._classify``).
_SKIP, _REMOVE, _INDEXED, _LOAD = "skip", "remove", "indexed", "load"
# The scan reads headers on one thread while they come from the page cache (threads only contend
# for the GIL there: 100,000 warm files took 1.2 s on one, 1.9-4.3 s on 2-16 here), and on
# _SCAN_THREADS once at least half of the first _SCAN_SAMPLE_FILES had to be read from the
# device (the thread's block reads, getrusage: timing would mistake a busy CPU for a slow disk),
# where reads overlap: cold, 4 threads took 15.3 s to 7.2 s on this VM's virtio disk, and an
# NVMe drive serves far more reads at once than one at a time.
_SCAN_SAMPLE_FILES = 256
_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)  # Linux
_SCAN_THREADS = 8
_SCAN_BATCH_FILES = 32  # files per task: one future per file cost more than its read
# Linux caps a single read/write at this many bytes; larger requests come back short.
_MAX_IO_BYTES = 0x7FFFF000
# Longest a put waits for a clean-up thread to finish unlinking a file delete_later renamed away
# (milliseconds normally); after it the put goes ahead, and a full disk is a DiskFullError.
_TRASH_WAIT_S = 5.0

# Free space a disk tier leaves on its filesystem: the agent must write small files next to it
# to (re)start (agent.json, agent.log: a few KiB, each written to a temp
# file first), usually on the same filesystem (DATA_DIR/disk). A tier whose --disk is above the
# free space, or whose filesystem others fill, would otherwise take it to 0 bytes free and the
# agent could not start again. 1/64 of the filesystem, within [32 KiB, 64 MiB]: 64 MiB on any
# real disk (a long-running agent's log too; 0.1% of a 64 GiB disk), while the
# share keeps a tiny filesystem (a test tmpfs of 2 MiB: 32 KiB) mostly usable for chunks, and
# 32 KiB still holds those files with their temp copies and block rounding.
HEADROOM_MAX_BYTES = 64 << 20
HEADROOM_MIN_BYTES = 32 << 10
HEADROOM_FILESYSTEM_SHARE = 64  # 1/64 of the filesystem's size
# A write asks the filesystem its free space (statvfs, ~2.3 us here against ~100 us for the
# smallest 256 KiB chunk file) only when the last answer is older than this, or when that answer
# less what the tier wrote since comes within twice the headroom of the write: far from full,
# one statvfs a second; near it, every write is checked.
_FS_FREE_TTL_S = 1.0

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_EXCL: a temp name is never reused, so finding one means a bug, not a file to overwrite.
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC
# Chunks hold prompts' KV: owner-only whatever the umask (it can only take bits away) and
# whatever the mode of the directory they are in (one others can list still cannot read them).
FILE_MODE = 0o600
DIR_MODE = 0o700
# Group and others' bits: a file or fan-out directory with any of them is tightened at open.
_SHARED_BITS = 0o077


def _header_bytes(tenant_bytes: int) -> int:
    """The length of a chunk file's header whose tenant name is ``tenant_bytes`` long."""
    return _FIXED.size + tenant_bytes + _CRC.size


class DiskTier(Tier):
    """Chunks as files under ``directory``; survives restarts (``recover`` lists them).

    ``capacity_bytes`` and ``used_bytes`` count payload bytes only. Each file also carries a
    header of 94 bytes plus the tenant name, and the filesystem rounds files up to its block
    size, so provision the disk with a few percent of headroom above ``capacity_bytes``. The
    tier also keeps ``headroom_bytes`` free on its filesystem whatever its capacity (see
    ``HEADROOM_MAX_BYTES``): a write that would leave less raises DiskFullError, as ENOSPC does.

    ``fsync=True`` makes every put durable against power loss (file and directory are fsynced
    before put returns). Without it a put survives a process crash, but a power loss or kernel
    crash may lose the last seconds of puts or leave them damaged; damaged chunks are dropped at
    open or on read, never returned. Deletes are never fsynced: a deleted chunk that reappears
    after a power loss is still a valid chunk.
    """

    name = "disk"
    holds_payload = True
    durable = True
    detached_reads = True
    detached_writes = True

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        fsync: bool = False,
        verify_on_open: bool = False,
        name: str = "disk",
    ) -> None:
        check_capacity(capacity_bytes, f"{name} capacity")
        self.name = name
        self.directory = os.path.abspath(os.fspath(directory))
        self.fsync = fsync
        self.verify_on_open = verify_on_open
        self._capacity_bytes = capacity_bytes
        self._used_bytes = 0
        #: what the clean-close index records of each chunk file is what the tier keeps
        self._index: dict[bytes, IndexedChunk] = {}
        #: chunks being written without the store's lock (``reserve_write``): counted in
        #: ``used_bytes``, not yet in the index
        self._writing: dict[bytes, WriteSlot] = {}
        self._dir_fd_lock = threading.Lock()  # detached writes open directory fds too
        self._recovered: list[ChunkMeta] = []
        self._dir_fds: dict[str, int] = {}  # only used with fsync=True
        self._tmp_seq = 0
        # Files delete_later renamed away whose unlink has not finished: their blocks are still
        # taken, so a put near capacity unlinks them first (``_free_trash``). The clean-up
        # calls run without the store's lock, hence a lock of their own.
        self._trash: dict[str, int] = {}  # path -> payload bytes, unlink not yet begun
        self._trash_bytes = 0  # payload bytes of every such file until its unlink has finished
        self._trash_cv = threading.Condition(threading.Lock())
        self._lock_fd = -1
        self._closed = True  # until the directory is locked
        self.dropped_on_open = 0
        self.dropped_reasons: list[str] = []
        #: chunk files (or fan-out directories) the scan at open could not read (an I/O
        #: error): left in place, not served; ``unreadable_reasons`` says which and why
        self.unreadable_on_open = 0
        self.unreadable_reasons: list[str] = []
        #: free bytes kept on the filesystem for the agent's own files (``HEADROOM_*``); a
        #: write that would leave less raises DiskFullError (the store makes room, as on ENOSPC)
        self.headroom_bytes = HEADROOM_MIN_BYTES
        # the last statvfs answer (free bytes, when) and what this tier wrote since
        self._fs_lock = threading.Lock()  # detached writes check the headroom too
        self._fs_free_seen: tuple[int, float] | None = None
        self._fs_written_since = 0

        self._open_directory()
        self.headroom_bytes = self._headroom_for_filesystem()
        self._closed = False
        try:
            self._scan()
        except BaseException:
            self._close(keep_index=False)
            raise

    # --- Tier interface -------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        self._check_open()
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Payload bytes stored; file headers and filesystem block rounding are extra, and so
        are files ``delete_later`` renamed away until they are unlinked (``pending_unlink_bytes``;
        a put that needs their room unlinks them first)."""
        self._check_open()
        return self._used_bytes

    @property
    def pending_unlink_bytes(self) -> int:
        """Payload bytes of deleted chunks whose files still wait for their unlink."""
        with self._trash_cv:
            return self._trash_bytes

    def __contains__(self, key: object) -> bool:
        self._check_open()
        return key in self._index

    def __len__(self) -> int:
        self._check_open()
        return len(self._index)

    def keys(self) -> Iterator[bytes]:
        """A snapshot, so callers may delete while iterating (eviction loops do)."""
        self._check_open()
        return iter(list(self._index))

    def size_of(self, key: bytes) -> int:
        self._check_open()
        return self._entry(key).meta.size_bytes

    def meta_of(self, key: bytes) -> ChunkMeta:
        """The ChunkMeta stored with ``key`` (from memory; no disk I/O)."""
        self._check_open()
        return self._entry(key).meta

    def put(self, meta: ChunkMeta, data: Buffer | None) -> None:
        self._check_open()
        check_put(self, meta, data)
        assert data is not None  # check_put guarantees it for payload tiers
        payload = byte_view(data)
        key = meta.key
        if len(key) != KEY_BYTES:
            raise InvalidArgument(f"disk tier keys are {KEY_BYTES} bytes, got {len(key)}")
        # a detached write of an older copy of this key may be under way: it writes only its
        # own temp file until its commit, which the store refuses once this copy is current
        self._free_trash(meta.size_bytes)
        entry = self._write_file(meta, payload, self._temp_path(key.hex()))
        self._index[key] = entry
        self._used_bytes += meta.size_bytes

    # --- detached writes: reserved under the store's lock, written without it ----------------
    def reserve_write(self, meta: ChunkMeta) -> WriteSlot:
        self._check_open()
        key = meta.key
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidArgument(f"disk tier keys are {KEY_BYTES} bytes, got {key!r:.60}")
        if meta.size_bytes <= 0:
            raise InvalidArgument(f"chunk size must be positive, got {meta.size_bytes}")
        if key in self._writing:
            raise InvalidArgument(f"key {key.hex()} is being written to tier {self.name!r}")
        check_room(self, meta)
        slot = WriteSlot(meta, self._temp_path(key.hex()))
        self._writing[key] = slot
        self._used_bytes += meta.size_bytes  # its room is taken from now on
        return slot

    def write_reserved(self, slot: WriteSlot, data: Buffer) -> None:
        """Write the chunk's temp file (fsynced with ``fsync``); ``commit_write`` renames it
        into place. Touches nothing of the tier's state but ``slot``, and no file another copy
        of the key may own. Raises DiskFullError or TierUnavailable with nothing left on
        disk."""
        if slot.done or slot.written is not None:
            raise InvalidArgument("this write slot was written, committed or aborted already")
        payload = byte_view(data)
        if payload.nbytes != slot.meta.size_bytes:
            raise PayloadSizeError(
                f"payload is {payload.nbytes} bytes but the chunk declares {slot.meta.size_bytes}"
            )
        self._free_trash(0)  # its own room is counted already
        slot.written = self._write_file(slot.meta, payload, slot.temp_path, rename=False)

    def commit_write(self, slot: WriteSlot) -> bool:
        if slot.done:
            raise InvalidArgument("this write slot was committed or aborted already")
        written = slot.written
        if self._closed or not isinstance(written, IndexedChunk):
            self.abort_write(slot)
            return False
        key = slot.meta.key
        if key in self._index:  # another copy was put meanwhile: it stays, this one goes
            self.abort_write(slot)
            return False
        try:
            self._place(key, slot.temp_path)  # a rename (metadata only), then the dir fsync
        except TierUnavailable:
            self.abort_write(slot)
            raise
        slot.done = True
        del self._writing[key]
        self._index[key] = written
        return True

    def abort_write(self, slot: WriteSlot) -> None:
        if slot.done:
            return
        slot.done = True
        key = slot.meta.key
        if self._writing.get(key) is slot:
            del self._writing[key]
            if not self._closed:
                self._used_bytes -= slot.meta.size_bytes
        if slot.written is not None:  # its temp file only: the final name is never its own
            _unlink_quietly(slot.temp_path)

    def _write_file(
        self, meta: ChunkMeta, payload: memoryview, tmp: str, *, rename: bool = True
    ) -> IndexedChunk:
        """Write ``meta``'s chunk to ``tmp``, then rename it into place (with ``fsync``: file
        and directory synced; ``rename=False``: left at ``tmp``, fsynced, for ``_place``);
        what the tier's index will hold for it. Raises DiskFullError or TierUnavailable, with
        nothing left on disk. Changes none of the tier's state, so it may run without the
        store's lock."""
        key = meta.key
        checksum = _CHECKSUMS[CHECKSUM_KIND][0](payload)
        header = _encode_header(meta, CHECKSUM_KIND, checksum)

        key_hex = key.hex()
        subdir = key_hex[:2]
        path = f"{self.directory}/{subdir}/{key_hex}{_CHUNK_SUFFIX}"
        self._keep_headroom(meta, len(header))
        fd = -1
        renamed = False
        try:
            try:
                fd = os.open(tmp, _TMP_FLAGS, FILE_MODE)
            except FileNotFoundError:
                # First chunk under this prefix, or the subdirectory was removed behind our back;
                # trying the open first saves a mkdir syscall on every other put.
                self._make_subdir(subdir)
                fd = os.open(tmp, _TMP_FLAGS, FILE_MODE)
            _write_all(fd, header, payload)
            if self.fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            if not rename:
                return IndexedChunk(meta, len(header), CHECKSUM_KIND, checksum)
            os.replace(tmp, path)
            renamed = True
            if self.fsync:
                os.fsync(self._dir_fd(subdir))
        except BaseException as exc:
            if fd >= 0:
                _close_quietly(fd)
            # After the rename the chunk is visible; take it back so a failed put changes nothing.
            _unlink_quietly(path if renamed else tmp)
            if isinstance(exc, OSError):
                if exc.errno in _FULL_ERRNOS:
                    free = self.filesystem_free_bytes()
                    full = DiskFullError(
                        exc.errno,
                        f"disk tier {self.name!r} is out of space: writing chunk {key_hex} "
                        f"({meta.size_bytes} payload + {len(header)} header bytes) under "
                        f"{self.directory} failed: {exc.strerror} (its filesystem has "
                        f"{'an unknown number of' if free is None else f'{free:,}'} bytes free)",
                    )
                    # room is made for the headroom too, not only for this file
                    full.need_bytes = meta.size_bytes + len(header) + self.headroom_bytes
                    full.free_bytes = free
                    full.headroom_bytes = self.headroom_bytes
                    raise full from exc
                raise TierUnavailable(
                    f"disk tier {self.name!r} cannot write {exc.filename or tmp}: {exc.strerror}"
                ) from exc
            raise
        return IndexedChunk(meta, len(header), CHECKSUM_KIND, checksum)

    def read_into(self, key: bytes, out: memoryview) -> int:
        """Read the payload into ``out`` and verify it.

        On CorruptChunk the chunk is gone from disk and from the tier, and ``out`` holds
        garbage up to the chunk size.
        """
        plan = self.plan_read(key)
        n = plan.size_bytes
        dest = byte_view(out)
        if dest.readonly:
            raise InvalidArgument("read_into needs a writable buffer")
        if dest.nbytes < n:
            raise InvalidArgument(f"buffer of {dest.nbytes} bytes is smaller than the chunk ({n})")
        why = self.read_planned(plan, dest[:n])
        if why is not None:
            raise self.drop_unreadable(key, why)
        return n

    # --- detached reads: planned under the store's lock, read without it ----------------------
    def plan_read(self, key: bytes) -> ReadPlan:
        self._check_open()
        entry = self._entry(key)
        return ReadPlan(key, entry.meta.size_bytes, entry)

    def read_planned(self, plan: ReadPlan, out: memoryview) -> str | None:
        """Read and verify one chunk; touches nothing of the tier's state, so any number of
        threads may read at once while the store goes on (a file deleted or replaced meanwhile
        is a failed or a correct read, never wrong bytes: the checksum is the one planned)."""
        entry = plan.source
        assert isinstance(entry, IndexedChunk)
        dest = byte_view(out)
        n = plan.size_bytes
        if dest.readonly or dest.nbytes != n:
            raise InvalidArgument(f"a planned read needs a writable buffer of exactly {n} bytes")
        path = self._path(plan.key)
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        except FileNotFoundError:
            return "its file is missing"
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot open {path}: {exc.strerror}"
            ) from exc
        # No posix_fadvise(SEQUENTIAL): on a virtio ext4 disk it made cold 32 MiB batches ~15%
        # slower (2.1 vs 2.4 GB/s); the default readahead with parallel readers does better.
        try:
            got = _read_exact(fd, dest, entry.header_bytes)
        except OSError as exc:
            if exc.errno == errno.EIO:  # a bad sector: this chunk is lost, the tier is not
                return "an I/O error while reading it"
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot read {path}: {exc.strerror}"
            ) from exc
        finally:
            os.close(fd)
        if got != n:
            return f"its file is short ({got} of {n} payload bytes)"
        if _CHECKSUMS[entry.checksum_kind][0](dest) != entry.checksum:
            return "its payload failed the checksum"
        return None

    def plan_is_current(self, plan: ReadPlan) -> bool:
        return not self._closed and self._index.get(plan.key) is plan.source

    def drop_unreadable(self, key: bytes, why: str) -> CorruptChunk:
        path = self._path(key)
        _unlink_quietly(path)
        entry = self._index.pop(key, None)
        if entry is not None:
            self._used_bytes -= entry.meta.size_bytes
        return CorruptChunk(
            f"chunk {key.hex()} in disk tier {self.name!r} was dropped: {why} ({path})"
        )

    def delete(self, key: bytes) -> int:
        return self._forget_file(key, os.unlink)[0]

    def delete_later(self, key: bytes) -> Callable[[], None] | None:
        """Forget ``key`` now and rename its file out of the way (a metadata change); the
        unlink, which frees the file's blocks (milliseconds for a large chunk), is the returned
        call's. The new name is a temp file's, so one left by a crash is removed at the next
        open. Not for making room: the blocks are only free once the call has run. Until then
        the file's bytes still count against the capacity for puts: a put they would take over
        it unlinks the file itself first (the call then has nothing left to do)."""
        trash = self._temp_path(key.hex())
        n, found = self._forget_file(key, lambda path: os.rename(path, trash))
        if not found:
            return None
        with self._trash_cv:
            self._trash[trash] = n
            self._trash_bytes += n
        return functools.partial(self._unlink_trash, trash)

    def resize(self, capacity_bytes: int) -> None:
        self._check_open()
        check_resize(self, capacity_bytes)
        room = self.room_bytes()
        if capacity_bytes > self._capacity_bytes and room is not None and capacity_bytes > room:
            # a size the filesystem cannot hold is accepted silently otherwise, and every
            # demotion past its free space then fails
            raise CapacityError(
                f"disk tier {self.name!r} cannot grow to {format_bytes(capacity_bytes)} "
                f"({capacity_bytes:,} bytes): it "
                f"holds {format_bytes(self.used_bytes)} and {self.directory} has "
                f"{format_bytes(room - self.used_bytes)} free; free space or ask for less"
            )
        self._capacity_bytes = capacity_bytes

    def room_bytes(self) -> int | None:
        """The most this tier could hold now: what it holds plus its filesystem's free space
        (for an unprivileged writer); None where the filesystem cannot be asked."""
        free = self.filesystem_free_bytes()
        return None if free is None else self.used_bytes + free

    def filesystem_free_bytes(self) -> int | None:
        """The free bytes of the tier's filesystem for an unprivileged writer; None where the
        filesystem cannot be asked."""
        try:
            fs = os.statvfs(self.directory)
        except OSError:
            return None
        free = fs.f_bavail * fs.f_frsize
        with self._fs_lock:
            self._fs_free_seen = (free, time.monotonic())
            self._fs_written_since = 0
        return free

    def _headroom_for_filesystem(self) -> int:
        try:
            fs = os.statvfs(self.directory)
        except OSError:
            return HEADROOM_MIN_BYTES
        share = fs.f_blocks * fs.f_frsize // HEADROOM_FILESYSTEM_SHARE
        return max(HEADROOM_MIN_BYTES, min(HEADROOM_MAX_BYTES, share))

    def _keep_headroom(self, meta: ChunkMeta, header_bytes: int) -> None:
        """Before writing a chunk file of ``meta``'s payload and ``header_bytes``: raise
        DiskFullError (ENOSPC, ``need_bytes`` including the headroom) when the filesystem would
        be left with less than ``headroom_bytes`` free, after unlinking files deleted chunks
        left waiting for their unlink (their blocks are still taken). The store then makes room
        by the tier's policy as for a real ENOSPC (``TieredStore._write_making_room``)."""
        need = meta.size_bytes + header_bytes
        with self._fs_lock:
            seen = self._fs_free_seen
            if seen is not None:
                free_seen, at_s = seen
                estimate = free_seen - self._fs_written_since - need
                if time.monotonic() - at_s < _FS_FREE_TTL_S and estimate >= 2 * self.headroom_bytes:
                    self._fs_written_since += need
                    return
        free = self.filesystem_free_bytes()
        if free is not None and free - need < self.headroom_bytes and self._unlink_all_trash():
            free = self.filesystem_free_bytes()
        if free is None or free - need >= self.headroom_bytes:
            with self._fs_lock:
                self._fs_written_since += need
            return
        full = DiskFullError(
            errno.ENOSPC,
            f"disk tier {self.name!r} keeps {self.headroom_bytes:,} bytes free on its "
            f"filesystem for the agent's own files: writing chunk {meta.key.hex()} "
            f"({meta.size_bytes} payload + {header_bytes} header bytes) under {self.directory} "
            f"would leave {max(free - need, 0):,} (its filesystem has {free:,} bytes free)",
        )
        full.need_bytes = need + self.headroom_bytes
        full.free_bytes = free
        full.headroom_bytes = self.headroom_bytes
        raise full

    def _unlink_all_trash(self) -> bool:
        """Unlink every file deleted chunks left waiting for their unlink (any thread); whether
        there was any."""
        with self._trash_cv:
            mine = list(self._trash.items())
            self._trash.clear()
        if not mine:
            return False
        try:
            for path, _ in mine:
                _unlink_quietly(path)
        finally:
            with self._trash_cv:
                self._trash_bytes -= sum(n for _, n in mine)
                self._trash_cv.notify_all()
        return True

    def _list_dir(self, path: str) -> list[os.DirEntry[str]]:
        try:
            return list(os.scandir(path))
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot list {path}: {exc.strerror}"
            ) from exc

    def recover(self) -> list[ChunkMeta]:
        """Every valid chunk found at open, oldest first (``created_s``), minus those deleted
        or dropped since.

        The chunks may add up to more than ``capacity_bytes`` (the capacity was lowered, or
        headers were counted differently by an older build); they are all kept and ``free_bytes``
        goes negative so the store evicts down before the next put.
        """
        self._check_open()
        index = self._index
        return [index[m.key].meta for m in self._recovered if m.key in index]

    def close(self) -> None:
        """Close the tier, leaving its index (``disk_index``) for the next open to read instead
        of every chunk file's header, when no write is under way."""
        self._close(keep_index=True)

    def _close(self, *, keep_index: bool) -> None:
        if self._closed and self._lock_fd < 0:
            return
        if keep_index and not self._closed and self._lock_fd >= 0 and not self._writing:
            # every indexed chunk's file is in place (puts and commits rename before indexing),
            # and the directory is still locked: nothing else can change it before this is in
            self._write_index()
        self._closed = True
        for fd in self._dir_fds.values():
            _close_quietly(fd)
        self._dir_fds.clear()
        if self._lock_fd >= 0:
            _close_quietly(self._lock_fd)  # closing the only descriptor drops the flock
            self._lock_fd = -1
        self._index.clear()
        self._used_bytes = 0

    def _write_index(self) -> None:
        """Leave the index for the next open (``disk_index``), with each fan-out directory's
        mtime now; not where it would take the filesystem's free space below the headroom
        (kept for the agent's own files: it is only a shortcut)."""
        entries = self._index.values()
        dirs: dict[str, int] = {}
        for subdir in sorted({e.meta.key.hex()[:2] for e in entries}):
            try:
                dirs[subdir] = os.stat(f"{self.directory}/{subdir}").st_mtime_ns
            except OSError:
                continue  # its entries are read from their files next time
        tenants = {e.meta.tenant for e in entries}
        need = disk_index.size_bytes(len(self._index), tenants, len(dirs))
        free = self.filesystem_free_bytes()
        if free is not None and free - need < self.headroom_bytes:
            log.info(
                "disk tier %s: no index left for the next open (%s would leave less than the "
                "%s headroom free): it will read every chunk file's header",
                self.name,
                format_bytes(need),
                format_bytes(self.headroom_bytes),
            )
            return
        disk_index.write(self.directory, entries, dirs, fsync=self.fsync)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A tier dropped without close() must not keep the directory locked for the process;
        # no index is left (a tier abandoned mid-use is treated as a crash: the next open scans)
        if getattr(self, "_lock_fd", -1) >= 0:
            self._close(keep_index=False)

    # --- internals --------------------------------------------------------------------------
    def _forget_file(self, key: bytes, remove: Callable[[str], object]) -> tuple[int, bool]:
        """``delete``'s and ``delete_later``'s common part: forget ``key`` once ``remove`` (an
        unlink, a rename) took its file's path away. Returns the payload bytes freed and whether
        the file was there (one already gone, someone cleaned the directory: the map is what
        matters)."""
        self._check_open()
        entry = self._entry(key)
        path = self._path(key)
        found = True
        try:
            remove(path)
        except FileNotFoundError:
            found = False
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot delete {path}: {exc.strerror}"
            ) from exc
        del self._index[key]
        self._used_bytes -= entry.meta.size_bytes
        return entry.meta.size_bytes, found

    def check_writable(self) -> bool:
        """A page written, fsynced and removed in the tier's directory. A full filesystem
        passes: the tier is not broken, and puts make room (DiskFullError until they can)."""
        self._check_open()
        try:
            _write_probe(str(self.directory), bytes(4096), sync=True)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                return True
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot write in {self.directory}: {exc.strerror}"
            ) from exc
        return True

    def _temp_path(self, key_hex: str) -> str:
        """A new temp file's name beside the chunk's (a crash's leftovers go at the next open).
        The pid only tells an operator whose file it was; the directory lock makes it unique."""
        self._tmp_seq += 1
        name = f".{key_hex}.{os.getpid()}.{self._tmp_seq}{_TMP_SUFFIX}"
        return f"{self.directory}/{key_hex[:2]}/{name}"

    def _unlink_trash(self, path: str) -> None:
        """The clean-up ``delete_later`` returns (any thread, no store lock): unlink ``path``
        unless a put already did."""
        with self._trash_cv:
            n = self._trash.pop(path, None)
        if n is None:
            return
        try:
            _unlink_quietly(path)
        finally:
            with self._trash_cv:
                self._trash_bytes -= n
                self._trash_cv.notify_all()

    def _free_trash(self, need: int) -> None:
        """Before a put of ``need`` bytes: when the chunks plus the files waiting for their
        unlink leave less than that of the capacity, unlink those files here (and wait, bounded,
        for any a clean-up thread is unlinking), so their blocks are free before the write:
        near a full disk it would hit ENOSPC otherwise."""
        cv = self._trash_cv

        def fits() -> bool:
            return self._capacity_bytes - self._used_bytes - self._trash_bytes >= need

        with cv:
            room = self._capacity_bytes - self._used_bytes - self._trash_bytes
            if room >= need:
                return
            mine: list[tuple[str, int]] = []
            while self._trash and room < need:
                path, n = next(iter(self._trash.items()))
                del self._trash[path]
                mine.append((path, n))
                room += n
        try:
            for path, _ in mine:
                _unlink_quietly(path)
        finally:
            with cv:
                self._trash_bytes -= sum(n for _, n in mine)
                cv.notify_all()
                cv.wait_for(fits, _TRASH_WAIT_S)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"disk tier {self.name!r} ({self.directory}) is closed")

    def _entry(self, key: bytes) -> IndexedChunk:
        try:
            return self._index[key]
        except (KeyError, TypeError):
            raise KeyNotFound(f"key {_hex(key)} is not in tier {self.name!r}") from None

    def _place(self, key: bytes, tmp: str) -> None:
        """Rename a written temp file into ``key``'s place, durably with ``fsync`` (the
        directory synced). Raises TierUnavailable with nothing of it left on disk."""
        path = self._path(key)
        renamed = False
        try:
            os.replace(tmp, path)
            renamed = True
            if self.fsync:
                os.fsync(self._dir_fd(key.hex()[:2]))
        except OSError as exc:
            _unlink_quietly(path if renamed else tmp)
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot place {exc.filename or path}: {exc.strerror}"
            ) from exc

    def _path(self, key: bytes) -> str:
        key_hex = key.hex()
        return f"{self.directory}/{key_hex[:2]}/{key_hex}{_CHUNK_SUFFIX}"

    def _open_directory(self) -> None:
        d = self.directory
        try:
            with contextlib.suppress(FileExistsError):
                os.makedirs(d, mode=DIR_MODE)
            if not os.path.isdir(d):  # a file in the way; makedirs only said "exists"
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), d)
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot use directory {d}: {exc.strerror or exc}"
            ) from exc
        lock_path = f"{d}/{_LOCK_NAME}"
        try:
            self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot create lock file {lock_path}: {exc.strerror}"
            ) from exc
        _tighten(self._lock_fd)  # one an older build made 0644
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            _close_quietly(self._lock_fd)
            self._lock_fd = -1
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DirectoryInUse(
                    f"disk tier directory {d} is in use by another DiskTier "
                    f"(lock {lock_path} is held)"
                ) from exc
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot lock {lock_path}: {exc.strerror}"
            ) from exc
        # The lock file may already exist on a read-only filesystem: prove we can create files.
        # A full filesystem passes: its chunks can still be read and evicted to make room, and
        # puts report DiskFullError until then.
        try:
            _write_probe(d, b"", sync=False)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                return
            _close_quietly(self._lock_fd)
            self._lock_fd = -1
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot write in {d}: {exc.strerror}"
            ) from exc

    def _take_index(self) -> disk_index.Index | None:
        """The index the last clean close left, removed from the directory before the scan
        (``disk_index.take``); None where there is none to believe, or ``verify_on_open``
        asks for every payload to be read anyway, or where an entry is one the header check
        at open refuses (another build's checksum kind: believed, each read of it would raise).
        Raises TierUnavailable where it cannot be removed (believed after a later crash, it
        could be stale)."""
        try:
            index = disk_index.take(self.directory)
        except OSError as exc:
            raise TierUnavailable(
                f"disk tier {self.name!r} cannot remove its index "
                f"{self.directory}/{disk_index.INDEX_NAME}: {exc.strerror or exc}"
            ) from exc
        if index is None or self.verify_on_open:
            return None
        header_bytes_of: dict[str, int] = {}  # by tenant: few tenants, many chunks
        for c in index.chunks.values():
            tenant = c.meta.tenant
            header_bytes = header_bytes_of.get(tenant)
            if header_bytes is None:
                header_bytes = _header_bytes(len(tenant.encode("utf-8")))
                header_bytes_of[tenant] = header_bytes
            if (
                c.checksum_kind not in _CHECKSUMS
                or c.meta.size_bytes <= 0
                or c.header_bytes != header_bytes
            ):
                log.warning(
                    "disk index %s/%s ignored (chunk %s: checksum kind %d, %d payload and %d "
                    "header bytes, not a header this build reads): scanning every chunk file",
                    self.directory,
                    disk_index.INDEX_NAME,
                    c.meta.key.hex(),
                    c.checksum_kind,
                    c.meta.size_bytes,
                    c.header_bytes,
                )
                return None
        return index

    def _make_subdir(self, subdir: str) -> None:
        with self._dir_fd_lock:
            stale_fd = self._dir_fds.pop(subdir, None)  # a removed directory's fd syncs nothing
        if stale_fd is not None:
            _close_quietly(stale_fd)
        try:
            os.mkdir(f"{self.directory}/{subdir}", DIR_MODE)
        except FileExistsError:
            return
        if self.fsync:  # the new directory entry must survive for its chunks to
            _fsync_path(self.directory)

    def _dir_fd(self, subdir: str) -> int:
        with self._dir_fd_lock:
            fd = self._dir_fds.get(subdir)
            if fd is None:
                path = f"{self.directory}/{subdir}"
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
                self._dir_fds[subdir] = fd
            return fd

    def _note_drop(self, rel_path: str, why: str) -> None:
        self.dropped_on_open += 1
        if len(self.dropped_reasons) < _MAX_REASONS:
            self.dropped_reasons.append(f"{rel_path}: {why}")

    def _note_unreadable(self, rel_path: str, exc: BaseException | None) -> None:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        self.unreadable_on_open += 1
        if len(self.unreadable_reasons) < _MAX_REASONS:
            self.unreadable_reasons.append(f"{rel_path}: {why}")
        log.warning(
            "disk tier %s: cannot read %s/%s at open (%s): skipped, left in place and not "
            "served; the tier starts without it",
            self.name,
            self.directory,
            rel_path,
            why,
        )

    def _remove(self, path: str, rel_path: str, why: str) -> None:
        _unlink_quietly(path)
        self._note_drop(rel_path, why)

    def _scan(self) -> None:
        """Rebuild the index from the directory, deleting everything that is not a whole chunk.

        The directory is locked, so any temp file here belongs to a writer that died.
        """
        loader = _HeaderLoader(verify=self.verify_on_open)
        try:
            self._scan_with(loader)
        finally:
            loader.close()

    def _classify(
        self, subdir: str, f: os.DirEntry[str], indexed: dict[bytes, IndexedChunk]
    ) -> tuple[str, Any]:
        """What the scan does with file ``f`` of fan-out directory ``subdir``: skip it, remove
        it (and why), take its entry from the index, or read its header (its key)."""
        if not f.is_file(follow_symlinks=False):
            return _SKIP, None
        if f.name.endswith(_TMP_SUFFIX):
            return _REMOVE, "leftover temp file"
        if not _CHUNK_NAME.fullmatch(f.name):
            return _REMOVE, "not a chunk file name"
        if not f.name.startswith(subdir):
            return _REMOVE, "in the wrong fan-out directory"
        key = bytes.fromhex(f.name[: 2 * KEY_BYTES])
        known = indexed.pop(key, None)
        if known is not None:
            return _INDEXED, known
        return _LOAD, key

    def _scan_with(self, loader: _HeaderLoader) -> None:
        recovered: list[ChunkMeta] = []
        started_s = time.monotonic()
        files = 0  # files looked at in the fan-out directories
        index = self._take_index()
        from_index = 0  # chunks whose header the index gave instead of their file
        next_progress_s = started_s + _SCAN_PROGRESS_S
        log.info(
            "disk tier %s: scanning %s for chunks%s",
            self.name,
            self.directory,
            " (verifying payloads)" if self.verify_on_open else "",
        )
        for entry in self._list_dir(str(self.directory)):
            if entry.name.endswith(_TMP_SUFFIX) and entry.is_file(follow_symlinks=False):
                self._remove(entry.path, entry.name, "leftover temp file")
                continue
            if not (_FANOUT_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue  # the lock file, or something an operator put here: not ours to judge
            mtime_ns = None
            with contextlib.suppress(OSError):  # older builds made them 0755
                st = entry.stat(follow_symlinks=False)
                mtime_ns = st.st_mtime_ns
                mode = stat.S_IMODE(st.st_mode)
                if mode & _SHARED_BITS:  # the owner's bits stay (a read-only one stays so)
                    os.chmod(entry.path, mode & ~_SHARED_BITS)
            # a directory changed since the index was written (a file added, removed or
            # renamed while the agent was down) has each of its files read, as after a crash
            indexed = (
                index.chunks
                if index is not None
                and mtime_ns is not None
                and index.dir_mtimes_ns.get(entry.name) == mtime_ns
                else {}
            )
            try:
                listed = self._list_dir(entry.path)
            except TierUnavailable as exc:  # one bad directory: its chunks are lost, not all
                self._note_unreadable(entry.name, exc.__cause__)
                continue
            plan = [self._classify(entry.name, f, indexed) for f in listed]
            todo = [(f.path, a[1]) for f, a in zip(listed, plan, strict=True) if a[0] == _LOAD]
            loaded = iter(loader.load(todo))
            for f, action in zip(listed, plan, strict=True):
                files += 1
                now_s = time.monotonic()
                if now_s >= next_progress_s:
                    next_progress_s = now_s + _SCAN_PROGRESS_S
                    log.info(
                        "disk tier %s: scan of %s: %d files so far, %d chunks (%s), %.0f s",
                        self.name,
                        self.directory,
                        files - 1,
                        len(recovered),
                        format_bytes(self._used_bytes),
                        now_s - started_s,
                    )
                rel = f"{entry.name}/{f.name}"
                kind, detail = action
                if kind == _SKIP:
                    continue
                if kind == _REMOVE:
                    self._remove(f.path, rel, detail)
                    continue
                if kind == _INDEXED:  # its file is listed under its name: the index holds
                    known = detail
                    from_index += 1
                else:
                    known = next(loaded)
                    if isinstance(known, OSError):
                        # a bad sector under one file: that chunk is lost, the tier is not (as
                        # on a read in service). Left in place, not deleted: the error may pass
                        # (a flaky device), and the file is the operator's evidence until then.
                        self._note_unreadable(rel, known)
                        continue
                    if isinstance(known, str):
                        self._remove(f.path, rel, known)
                        continue
                self._index[known.meta.key] = known
                self._used_bytes += known.meta.size_bytes
                recovered.append(known.meta)
        recovered.sort(key=lambda m: (m.created_s, m.key))
        self._recovered = recovered
        log.info(
            "disk tier %s: scanned %s in %.1f s: %d files, %d chunks (%s)%s%s%s",
            self.name,
            self.directory,
            time.monotonic() - started_s,
            files,
            len(recovered),
            format_bytes(self._used_bytes),
            f", {from_index} of them from its clean-close index" if from_index else "",
            f", {self.dropped_on_open} dropped (torn, corrupt or leftover)"
            if self.dropped_on_open
            else "",
            f", {self.unreadable_on_open} unreadable (skipped)" if self.unreadable_on_open else "",
        )


class _HeaderLoader:
    """Reads chunk files' headers for the scan at open (``_load_chunk``), on the calling thread
    while they come from memory, on a few once they come from the device (``_SCAN_THREADS``). Each
    result comes back in the order asked: the entry, the reason the file is no chunk, or the
    OSError reading it raised."""

    def __init__(self, *, verify: bool) -> None:
        self._verify = verify
        self._local = threading.local()  # each reading thread's own verify buffer
        self._pool: ThreadPoolExecutor | None = None
        self._files = 0  # read on the calling thread, for the sample
        self._blocks = 0  # its block reads meanwhile

    def load(self, todo: list[tuple[str, bytes]]) -> list[IndexedChunk | str | OSError]:
        if self._pool is not None:
            batches = [
                todo[i : i + _SCAN_BATCH_FILES] for i in range(0, len(todo), _SCAN_BATCH_FILES)
            ]
            return [r for done in self._pool.map(self._load_batch, batches) for r in done]
        who = _RUSAGE_THREAD
        if who is None or self._files >= _SCAN_SAMPLE_FILES:  # (sampled: from memory)
            return self._load_batch(todo)
        blocks_before = resource.getrusage(who).ru_inblock
        out = self._load_batch(todo)
        self._files += len(todo)
        self._blocks += resource.getrusage(who).ru_inblock - blocks_before
        if self._files >= _SCAN_SAMPLE_FILES and 2 * self._blocks >= self._files:
            self._pool = ThreadPoolExecutor(_SCAN_THREADS, thread_name_prefix="kvctl-disk-scan")
        return out

    def close(self) -> None:
        if self._pool is not None:  # (a scan cut short, by Ctrl-C say, reads no more)
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _load_batch(self, todo: list[tuple[str, bytes]]) -> list[IndexedChunk | str | OSError]:
        buf: bytearray | None = None
        if self._verify:
            buf = getattr(self._local, "buf", None)
            if buf is None:
                buf = self._local.buf = bytearray(_VERIFY_BUFFER_BYTES)
        return [_load_or_error(path, key, buf) for path, key in todo]


def _load_or_error(
    path: str, key: bytes, verify_buf: bytearray | None
) -> IndexedChunk | str | OSError:
    """``_load_chunk``, its OSError returned instead of raised."""
    try:
        return _load_chunk(path, key, verify_buf)
    except OSError as exc:
        return exc


@dataclass(frozen=True, slots=True)
class DirectoryAudit:
    """What a DiskTier opening ``directory`` would find, seen without opening one (so without
    its lock, and without deleting or changing anything): for checking a directory a killed
    writer left behind before anything repairs it."""

    #: keys of the files that are whole chunks (header and length; payloads too when verified)
    chunk_keys: frozenset[bytes]
    #: payload bytes of those chunks
    chunk_bytes: int
    #: relative paths of temp files: writes that never finished (an open drops them)
    temp_files: tuple[str, ...]
    #: "relative path: reason" of chunk files an open would drop (torn, corrupt, misnamed)
    invalid_files: tuple[str, ...]


def audit_directory(directory: str | os.PathLike[str], *, verify: bool = True) -> DirectoryAudit:
    """Judge every file of a disk tier directory as DiskTier's open does (``verify``: payload
    checksums too, as ``verify_on_open``), changing nothing. Raises OSError when the directory
    cannot be listed or a file cannot be read (an unhealthy disk is not a verdict on chunks)."""
    root = os.path.abspath(os.fspath(directory))
    keys: set[bytes] = set()
    chunk_bytes = 0
    temps: list[str] = []
    invalid: list[str] = []
    verify_buf = bytearray(_VERIFY_BUFFER_BYTES) if verify else None
    with os.scandir(root) as top:
        entries = sorted(top, key=lambda e: e.name)
    for entry in entries:
        if entry.name.endswith(_TMP_SUFFIX) and entry.is_file(follow_symlinks=False):
            temps.append(entry.name)
            continue
        if not (_FANOUT_NAME.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)):
            continue
        with os.scandir(entry.path) as sub:
            files = sorted(sub, key=lambda f: f.name)
        for f in files:
            rel = f"{entry.name}/{f.name}"
            if not f.is_file(follow_symlinks=False):
                continue
            if f.name.endswith(_TMP_SUFFIX):
                temps.append(rel)
            elif not _CHUNK_NAME.fullmatch(f.name):
                invalid.append(f"{rel}: not a chunk file name")
            elif not f.name.startswith(entry.name):
                invalid.append(f"{rel}: in the wrong fan-out directory")
            else:
                key = bytes.fromhex(f.name[: 2 * KEY_BYTES])
                loaded = _load_chunk(f.path, key, verify_buf, tighten=False)
                if isinstance(loaded, str):
                    invalid.append(f"{rel}: {loaded}")
                else:
                    keys.add(key)
                    chunk_bytes += loaded.meta.size_bytes
    return DirectoryAudit(frozenset(keys), chunk_bytes, tuple(temps), tuple(invalid))


# --- file format ----------------------------------------------------------------------------
def _encode_header(meta: ChunkMeta, checksum_kind: int, checksum: int) -> bytes:
    tenant = meta.tenant.encode("utf-8")
    if len(tenant) > MAX_TENANT_BYTES:
        raise InvalidArgument(
            f"tenant name is {len(tenant)} bytes in utf-8; the disk tier stores at most "
            f"{MAX_TENANT_BYTES}"
        )
    parent = meta.parent
    flags = _FLAG_ISOLATED if meta.isolated else 0
    if parent is None:
        parent = bytes(KEY_BYTES)
    else:
        if len(parent) != KEY_BYTES:
            raise InvalidArgument(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
        flags |= _FLAG_HAS_PARENT
    header_len = _header_bytes(len(tenant))
    try:
        fixed = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            flags,
            header_len,
            checksum_kind,
            meta.key,
            meta.size_bytes,
            checksum,
            meta.tokens,
            meta.priority,
            float(meta.created_s),
            parent,
            len(tenant),
        )
    except (struct.error, TypeError) as exc:
        raise InvalidArgument(f"chunk metadata does not fit the disk format: {exc}") from None
    body = fixed + tenant
    return body + _CRC.pack(zlib.crc32(body))


def _load_chunk(
    path: str, key: bytes, verify_buf: bytearray | None, *, tighten: bool = True
) -> IndexedChunk | str:
    """The chunk's index entry, or the reason the file is not a valid chunk. ``tighten`` takes
    group's and others' bits off the file.

    OSErrors other than the file vanishing propagate: they say the disk is unhealthy, which
    is not a reason to delete chunks.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    except FileNotFoundError:
        return "vanished during the scan"
    try:
        st = os.fstat(fd)
        file_bytes = st.st_size
        if tighten and st.st_mode & _SHARED_BITS:  # written 0644 by an older build
            with contextlib.suppress(OSError):
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~_SHARED_BITS)
        head = os.pread(fd, _HEADER_PROBE_BYTES, 0)
        if len(head) < _FIXED.size + _CRC.size:
            return f"too short for a header ({len(head)} bytes)"
        (
            magic,
            version,
            flags,
            header_len,
            checksum_kind,
            stored_key,
            payload_bytes,
            checksum,
            tokens,
            priority,
            created_s,
            parent,
            tenant_len,
        ) = _FIXED.unpack_from(head)
        if magic != MAGIC:
            return "bad magic"
        if version != FORMAT_VERSION:
            return f"unknown format version {version}"
        if header_len != _header_bytes(tenant_len):
            return f"inconsistent header length {header_len}"
        if len(head) < header_len:
            head += os.pread(fd, header_len - len(head), len(head))
            if len(head) < header_len:
                return "header cut short"
        (header_crc,) = _CRC.unpack_from(head, header_len - _CRC.size)
        if zlib.crc32(memoryview(head)[: header_len - _CRC.size]) != header_crc:
            return "header checksum mismatch"
        # Only a header that passed its checksum is trusted past this point.
        if checksum_kind not in _CHECKSUMS:
            return f"unknown checksum kind {checksum_kind}"
        if flags & ~_KNOWN_FLAGS:
            return f"unknown flags {flags:#x}"
        if stored_key != key:
            return f"holds key {stored_key.hex()}, not the one in its name"
        if payload_bytes <= 0:
            return "empty payload"
        if file_bytes != header_len + payload_bytes:
            return f"torn: file is {file_bytes} bytes, header says {header_len + payload_bytes}"
        try:
            tenant = head[_FIXED.size : _FIXED.size + tenant_len].decode("utf-8")
        except UnicodeDecodeError:
            return "tenant is not utf-8"
        if verify_buf is not None and not _payload_matches(
            fd, header_len, payload_bytes, checksum_kind, checksum, verify_buf
        ):
            return "payload checksum mismatch"
    finally:
        os.close(fd)
    meta = ChunkMeta(
        key=key,
        size_bytes=payload_bytes,
        tokens=tokens,
        tenant=tenant,
        parent=parent if flags & _FLAG_HAS_PARENT else None,
        priority=priority,
        isolated=bool(flags & _FLAG_ISOLATED),
        created_s=created_s,
    )
    return IndexedChunk(meta, header_len, checksum_kind, checksum)


def _payload_matches(
    fd: int, offset: int, payload_bytes: int, checksum_kind: int, checksum: int, buf: bytearray
) -> bool:
    view = memoryview(buf)
    hasher = _CHECKSUMS[checksum_kind][1]()
    remaining = payload_bytes
    while remaining:
        want = min(remaining, len(buf))
        got = os.preadv(fd, [view[:want]], offset)
        if got <= 0:
            return False
        hasher.update(view[:got])
        offset += got
        remaining -= got
    return hasher.intdigest() == checksum


# --- low-level I/O ----------------------------------------------------------------------------
def _write_all(fd: int, header: bytes, payload: memoryview) -> None:
    """Header and payload in one writev; loops only when the kernel writes short."""
    total = len(header) + payload.nbytes
    written = os.writev(fd, [header, payload])
    while written < total:
        if written < len(header):
            parts = [memoryview(header)[written:], payload]
        else:
            parts = [payload[written - len(header) : written - len(header) + _MAX_IO_BYTES]]
        step = os.writev(fd, parts)
        if step <= 0:  # a regular file never does this; do not spin if one does
            raise OSError(errno.EIO, "write made no progress")
        written += step


def _read_exact(fd: int, dest: memoryview, offset: int) -> int:
    """Fill ``dest`` from ``offset``; return bytes read (fewer only at end of file)."""
    n = dest.nbytes
    got = os.preadv(fd, [dest], offset) if n <= _MAX_IO_BYTES else 0
    while got < n:
        step = os.preadv(fd, [dest[got : got + _MAX_IO_BYTES]], offset + got)
        if step <= 0:
            break
        got += step
    return got


def _write_probe(directory: str, data: bytes, *, sync: bool) -> None:
    """Create a temp file in ``directory``, write ``data`` (and fsync it), remove it: raises the
    OSError of what failed, the file gone either way. Named by pid and thread, so tries at once
    never meet; one a crash leaves is a leftover temp file at the next open."""
    probe = f"{directory}/.probe.{os.getpid()}.{threading.get_ident()}{_TMP_SUFFIX}"
    fd = -1
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC, FILE_MODE)
        if data:
            _write_all(fd, b"", memoryview(data))
        if sync:
            os.fsync(fd)
    finally:
        if fd >= 0:
            _close_quietly(fd)
        _unlink_quietly(probe)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tighten(fd: int) -> None:
    """Take group's and others' bits off an open file, keeping the owner's; quietly, since a
    read-only filesystem or another owner's file still serves (the agent and doctor warn about
    the directory)."""
    with contextlib.suppress(OSError):
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        if mode & _SHARED_BITS:
            os.fchmod(fd, mode & ~_SHARED_BITS)


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _hex(key: object) -> str:
    return key.hex() if isinstance(key, bytes | bytearray) else repr(key)
