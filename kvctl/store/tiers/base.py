"""The tier interface every storage tier implements (cpu, disk, gpu now; remote, peer later).

A tier stores bytes under keys and enforces its byte capacity. It makes no eviction decisions:
the store picks victims with its policies and calls ``delete`` before ``put`` when room is short.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol, TypeVar

import numpy as np

from kvctl.format import format_bytes
from kvctl.store.errors import CapacityError, CorruptChunk, InvalidArgument, PayloadSizeError
from kvctl.store.keys import KEY_BYTES

Buffer = bytes | bytearray | memoryview

#: A tier holds at most one chunk per this many bytes of its capacity (``Tier.max_chunks``),
#: whatever the chunks' sizes: each chunk costs the agent memory for its index entry, its
#: eviction policy's and its tier's bookkeeping, which the capacity (payload bytes) does not
#: count. Measured with tracemalloc, per one-byte chunk: 0.7-1.2 KiB by eviction policy
#: (lineage-adaptive 3.9 KiB), 1.2 KiB under a 256-byte tenant name, 4.3-4.8 KiB once 8 other
#: tenants of 256-byte names have read it (``Entry.tenants``). So a tier of tiny chunks costs
#: at most about its capacity again in index memory; before, one-byte chunks cost ~3 KiB of
#: the agent's memory per byte of capacity. Chunks of this size or more never meet the limit.
MIN_CHARGED_BYTES = 4096
#: ... and at least this many chunks, whatever its capacity (small tiers; a few MiB of index)
MIN_CHUNK_SLOTS = 1024


def chunk_limit(capacity_bytes: int) -> int:
    """Most chunks a tier of ``capacity_bytes`` holds (``Tier.max_chunks``)."""
    return max(MIN_CHUNK_SLOTS, capacity_bytes // MIN_CHARGED_BYTES)


class Sized(Protocol):
    """What room planning needs of a chunk the store could evict (an index entry)."""

    @property
    def key(self) -> bytes: ...

    @property
    def size_bytes(self) -> int: ...


V = TypeVar("V", bound=Sized)


@dataclass(frozen=True, slots=True)
class ChunkMeta:
    """What a tier keeps beside the payload so the index can be rebuilt from a durable tier."""

    key: bytes
    size_bytes: int
    tokens: int = 0
    tenant: str = ""
    parent: bytes | None = None
    priority: int = 35
    isolated: bool = False
    created_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ReadPlan:
    """What a detached read of one chunk needs, taken under the store's lock (see
    ``Tier.plan_read``). ``source`` is the tier's own record of the copy being read: the read is
    still about that copy while ``Tier.plan_is_current`` says so."""

    key: bytes
    size_bytes: int
    source: object


@dataclass(eq=False, slots=True)
class WriteSlot:
    """A new chunk's room taken in a tier (``Tier.reserve_write``, under the store's lock) while
    its bytes are written without the lock (``write_reserved``), until ``commit_write`` makes it
    the tier's chunk or ``abort_write`` gives the room back (exactly one of them)."""

    meta: ChunkMeta
    #: where the tier writes the bytes first (a disk tier: a temp file's path)
    temp_path: str
    #: the tier's record of the written copy, once ``write_reserved`` succeeded
    written: object = None
    #: committed or aborted
    done: bool = False


class Tier(ABC):
    """A byte store with a fixed capacity. Thread safety is the store's job (it holds a lock)."""

    name: str
    #: False for tiers that only account sizes (offline simulation): get/read_into are refused.
    holds_payload: bool = True
    #: True when chunks survive a restart and ``recover`` can list them.
    durable: bool = False
    #: True when ``plan_read``/``read_planned`` let the store read a chunk without its lock
    #: (slow tiers: a disk read must not stall every other reader of the store).
    detached_reads: bool = False
    #: True when ``reserve_write``/``write_reserved``/``commit_write`` let the store write a
    #: new chunk without its lock (slow tiers: a demotion's disk write must not stall readers).
    detached_writes: bool = False

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def resident_bytes(self) -> int:
        """Bytes of the chunks the tier holds: what a resize must keep room for. Differs from
        ``used_bytes`` where deleted chunks still take space for a while (leased cpu regions)."""
        return self.used_bytes

    #: files of chunks the tier's open could not read and skipped (a disk tier's I/O errors)
    unreadable_on_open: int = 0

    def max_chunks(self, capacity_bytes: int | None = None) -> int | None:
        """Most chunks the tier holds at ``capacity_bytes`` (default: its own capacity), None
        for no limit: the store evicts to keep to it as it does for bytes (``chunk_limit``)."""
        return chunk_limit(self.capacity_bytes if capacity_bytes is None else capacity_bytes)

    def evictable(self, key: bytes) -> bool:
        """False when evicting ``key`` would free nothing now (its bytes are leased)."""
        return True

    def plan_room(self, size_bytes: int, candidates: Iterable[V]) -> list[V] | None:
        """Which of ``candidates`` (chunks of this tier, in the order the store would evict
        them) to evict so that a new chunk of ``size_bytes`` can be put: [] when it fits now,
        None when evicting every candidate would still not make it fit. Changes nothing, and
        reads ``candidates`` only as far as it needs.

        Here: free bytes are room (a tier that can always pack its free space into one piece).
        Tiers whose free space can be split for good (the cpu tier's leased regions) decide
        by where the candidates lie."""
        short = size_bytes - self.free_bytes
        if short <= 0:
            return []
        chosen: list[V] = []
        for c in candidates:
            if not self.evictable(c.key):
                continue
            chosen.append(c)
            short -= c.size_bytes
            if short <= 0:
                return chosen
        return None

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:  # an empty tier is still a tier: `if tier:` is not "has data"
        return True

    @abstractmethod
    def keys(self) -> Iterator[bytes]: ...

    @abstractmethod
    def size_of(self, key: bytes) -> int:
        """Payload size of ``key``; raises KeyNotFound."""

    @abstractmethod
    def put(self, meta: ChunkMeta, data: Buffer | None) -> None:
        """Store ``data`` (exactly ``meta.size_bytes`` long) under ``meta.key``.

        Raises CapacityError when ``used + size > capacity`` (the caller makes room first),
        InvalidArgument for a size mismatch or a duplicate key. On any error nothing changes.
        ``data`` is None only for tiers that do not hold payloads.
        """

    @abstractmethod
    def read_into(self, key: bytes, out: memoryview) -> int:
        """Copy the payload into ``out``; return bytes copied. InvalidArgument if ``out`` is
        shorter than the chunk; CorruptChunk (after dropping it) if the copy cannot be trusted."""

    def plan_read(self, key: bytes) -> ReadPlan:
        """Under the store's lock: what ``read_planned`` needs to read ``key`` later. Raises
        KeyNotFound. Only for tiers with ``detached_reads``."""
        raise NotImplementedError(f"tier {self.name!r} has no detached reads")

    def read_planned(self, plan: ReadPlan, out: memoryview) -> str | None:
        """Without the store's lock, maybe in several threads at once: copy the planned chunk
        into ``out`` (exactly ``plan.size_bytes``, writable) and verify it. Returns None when
        ``out`` holds the chunk, else why the copy cannot be trusted (``out`` then holds garbage).
        Changes nothing in the tier: the store decides under its lock what a failure means."""
        raise NotImplementedError(f"tier {self.name!r} has no detached reads")

    def plan_is_current(self, plan: ReadPlan) -> bool:
        """Under the store's lock: whether ``plan`` still names the copy the tier holds (not
        deleted, nor replaced by a later put of the same key)."""
        raise NotImplementedError(f"tier {self.name!r} has no detached reads")

    def drop_unreadable(self, key: bytes, why: str) -> CorruptChunk:
        """Under the store's lock: delete a copy a detached read found untrustworthy; returns
        the CorruptChunk to raise (the caller raises it, keeping its own traceback)."""
        raise NotImplementedError(f"tier {self.name!r} has no detached reads")

    def reserve_write(self, meta: ChunkMeta) -> WriteSlot:
        """Under the store's lock: take room for a new chunk (counted in ``used_bytes`` from
        now on) to be written by ``write_reserved``. Raises as ``put`` does before writing
        (CapacityError, InvalidArgument: the key is here or being written already). Only for
        tiers with ``detached_writes``."""
        raise NotImplementedError(f"tier {self.name!r} has no detached writes")

    def write_reserved(self, slot: WriteSlot, data: Buffer) -> None:
        """Without the store's lock: write the reserved chunk's bytes. Changes nothing of the
        tier's state but ``slot``; raises DiskFullError or TierUnavailable with nothing left
        written (the caller then aborts the slot)."""
        raise NotImplementedError(f"tier {self.name!r} has no detached writes")

    def commit_write(self, slot: WriteSlot) -> bool:
        """Under the store's lock: the written chunk joins the tier; False (the slot aborted)
        when it was never written or the tier was closed meanwhile."""
        raise NotImplementedError(f"tier {self.name!r} has no detached writes")

    def abort_write(self, slot: WriteSlot) -> None:
        """Under the store's lock: give the slot's room back and remove whatever it wrote
        (nothing once it was committed or aborted)."""
        raise NotImplementedError(f"tier {self.name!r} has no detached writes")

    def get(self, key: bytes) -> bytes:
        buf = bytearray(self.size_of(key))
        n = self.read_into(key, memoryview(buf))
        return bytes(buf[:n])

    @abstractmethod
    def delete(self, key: bytes) -> int:
        """Remove ``key``; return the payload bytes freed. Raises KeyNotFound."""

    def delete_later(self, key: bytes) -> Callable[[], None] | None:
        """Under the store's lock: remove ``key`` as ``delete`` does, leaving any slow clean-up
        (freeing a large file's blocks) to the returned call, which the store makes later,
        without its lock and in another thread (so the call must be safe there); None when
        nothing is left to do. Raises KeyNotFound."""
        self.delete(key)
        return None

    @abstractmethod
    def resize(self, capacity_bytes: int) -> None:
        """Change capacity live. Raises CapacityError if ``used_bytes`` exceeds the new size
        (the store evicts down first)."""

    def recover(self) -> list[ChunkMeta]:
        """Chunks found at open (durable tiers); empty for volatile tiers."""
        return []

    def check_writable(self) -> bool:
        """Whether a write into this tier was tried now, without a chunk of its own: raises
        TierUnavailable where it failed (a tier taken offline by a failed put, tried again at
        an operator's word). False where the tier knows no test cheaper than a put (the next
        put tries it)."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing to release
        """Release resources. Further use raises TierUnavailable."""


def byte_view(data: Buffer) -> memoryview:
    """``data`` as flat bytes (a typed array's memory read byte for byte), no copy."""
    view = memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except TypeError as exc:  # non-contiguous arrays cannot be written or read in one piece
        raise InvalidArgument(f"chunk buffers must be C-contiguous: {exc}") from None


#: a copy of at least this many bytes runs without the GIL (``copy_bytes``); below it the
#: numpy call costs more than it frees
GIL_FREE_COPY_BYTES = 64 << 10
#: a copy is split over threads in parts of at least this many bytes (smaller parts measured
#: slower than one thread: on a 2-core VM 1 MiB over two threads ran at 0.7-0.8x, 4 MiB at
#: 1.35x and 32 MiB at 1.7x)
PARALLEL_COPY_PART_BYTES = 2 << 20
#: threads one copy is split over at most (the caller's included)
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


def copy_bytes(dst: memoryview, src: Buffer) -> None:
    """``dst[:] = src`` for byte buffers of one length, without holding the GIL while a large
    one copies (numpy releases it; a memoryview assignment does not), and a large one split
    over up to ``COPY_THREADS`` threads: a 32 MiB chunk takes milliseconds on one thread, in
    which the agent's other connections, and the thread that faults arena pages in ahead of
    puts, would otherwise wait."""
    source = byte_view(src)
    n = dst.nbytes
    if n != source.nbytes:
        raise ValueError(f"copying {source.nbytes} bytes into {n}")
    if n < GIL_FREE_COPY_BYTES:
        dst[:] = source
        return
    a, b = np.frombuffer(dst, dtype=np.uint8), np.frombuffer(source, dtype=np.uint8)
    parts = min(COPY_THREADS, n // PARALLEL_COPY_PART_BYTES)
    if parts < 2:
        np.copyto(a, b)
        return
    cuts = [n * i // parts for i in range(parts + 1)]
    pool = _copy_threads()
    # the others' parts on the pool, the first on this thread: it always makes progress, even
    # while the pool serves other copies
    rest = [pool.submit(np.copyto, a[lo:hi], b[lo:hi]) for lo, hi in pairwise(cuts[1:])]
    try:
        np.copyto(a[: cuts[1]], b[: cuts[1]])
    finally:
        for f in rest:
            f.result()


def _copy_threads() -> ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="kvctl-copy")
        return _copy_pool


def check_capacity(capacity_bytes: int, what: str = "capacity") -> int:
    """Validate a capacity value with a clear message."""
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise InvalidArgument(f"{what} must be an integer number of bytes, got {capacity_bytes!r}")
    if capacity_bytes < 0:
        raise InvalidArgument(f"{what} must not be negative, got {capacity_bytes}")
    return capacity_bytes


def check_resize(tier: Tier, capacity_bytes: int) -> None:
    """Checks every tier's resize makes: a valid size that still holds what is stored."""
    check_capacity(capacity_bytes, f"{tier.name} capacity")
    if tier.resident_bytes > capacity_bytes:
        raise CapacityError(
            f"tier {tier.name!r} holds {format_bytes(tier.resident_bytes)}; evict before "
            f"shrinking to {format_bytes(capacity_bytes)}"
        )


def check_put(tier: Tier, meta: ChunkMeta, data: Buffer | None) -> None:
    """Checks every tier's put makes before touching state."""
    if not isinstance(meta.key, bytes) or len(meta.key) != KEY_BYTES:
        raise InvalidArgument(f"a key is {KEY_BYTES} bytes, got {meta.key!r:.60}")
    if meta.size_bytes <= 0:
        raise InvalidArgument(f"chunk size must be positive, got {meta.size_bytes}")
    if tier.holds_payload:
        if data is None:
            raise InvalidArgument(f"tier {tier.name!r} needs payload bytes")
        n = memoryview(data).nbytes
        if n != meta.size_bytes:
            raise PayloadSizeError(f"payload is {n} bytes but the chunk declares {meta.size_bytes}")
    check_room(tier, meta)


def check_room(tier: Tier, meta: ChunkMeta) -> None:
    """``check_put``'s last checks, for any new chunk (a put, a reservation): its key is not
    in ``tier`` yet and its size fits the free bytes."""
    if meta.key in tier:
        raise InvalidArgument(f"key {meta.key.hex()} is already in tier {tier.name!r}")
    if meta.size_bytes > tier.free_bytes:
        raise CapacityError(
            f"tier {tier.name!r} has {tier.free_bytes} free bytes, chunk needs {meta.size_bytes}"
        )
