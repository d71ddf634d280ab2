"""Host-DRAM tier: one preallocated arena with its own allocator.

The arena is a memory map sized to the tier's capacity, so the capacity is enforced to the byte
and the memory is committed once rather than per chunk. With ``shared=True`` the arena is a
memfd (Linux): it has no name anywhere, so nothing leaks when the agent is killed, and a local
client gets it only as a read-only file descriptor passed over the agent's Unix socket. The memfd
is sealed once the agent has mapped it (no new write access, no resize: ``ARENA_SEALS``), so a
client that reopens the descriptor read-write still cannot write or truncate it.
Its pages are huge (2 MiB) where the kernel allows it for shared memory (``hugepages``): an
engine copies out of 4 KiB pages measurably slower.

Leases let a reader use a chunk's bytes in place (a local client through its own mapping, or the
agent sending from the arena to a socket) without holding the store's lock. A leased region never
moves and is never reused until the lease ends: deleting a leased chunk leaves its bytes in place
(a "zombie" region) until the last lease is released or expires. Resizing replaces the arena
(a new generation); readers keep their mapping of the old one, so their leased bytes stay intact.
The store maps and fills the new arena without its lock (``ResizePlan``): a chunk deleted
meanwhile is marked, since its old bytes may be another chunk's by the time they are copied, and
whatever changed is copied again under the lock before the swap.

Allocation is first-fit over a free list kept sorted by offset, with neighbours coalesced on free.
When the free bytes suffice but no hole is large enough, the arena is compacted (live chunks slide
down with memmove) instead of evicting more than the capacity requires.

Reservations hold arena space for a chunk the store reads in from a slower tier without its lock
(straight into the arena, no copy): a reserved region is taken (counted in ``used_bytes``), stays
put when the arena is compacted, and is no chunk (not read, leased or listed) until ``commit``.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from kvctl.format import format_bytes
from kvctl.store.errors import (
    CapacityError,
    InvalidArgument,
    KeyNotFound,
    StoreError,
    TierUnavailable,
)
from kvctl.store.tiers import hugepages, memroom
from kvctl.store.tiers.base import (
    Buffer,
    ChunkMeta,
    Tier,
    V,
    byte_view,
    check_capacity,
    check_put,
    check_resize,
    check_room,
    copy_bytes,
)
from kvctl.store.tiers.prefault import Prefaulter

log = logging.getLogger(__name__)


class ArenaAllocator:
    """First-fit allocator over ``[0, size)`` with coalescing. Pure bookkeeping, no memory."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        # parallel sorted lists: hole offsets and their sizes
        self._offsets: list[int] = [0] if size_bytes else []
        self._sizes: list[int] = [size_bytes] if size_bytes else []
        self.free_bytes = size_bytes

    def alloc(self, n: int) -> int | None:
        """Offset of a hole of ``n`` bytes, or None if no single hole is large enough."""
        for i, hole in enumerate(self._sizes):
            if hole >= n:
                off = self._offsets[i]
                if hole == n:
                    del self._offsets[i], self._sizes[i]
                else:
                    self._offsets[i] = off + n
                    self._sizes[i] = hole - n
                self.free_bytes -= n
                return off
        return None

    def free(self, off: int, n: int) -> None:
        i = bisect.bisect_left(self._offsets, off)
        merge_prev = i > 0 and self._offsets[i - 1] + self._sizes[i - 1] == off
        merge_next = i < len(self._offsets) and off + n == self._offsets[i]
        if merge_prev and merge_next:
            self._sizes[i - 1] += n + self._sizes[i]
            del self._offsets[i], self._sizes[i]
        elif merge_prev:
            self._sizes[i - 1] += n
        elif merge_next:
            self._offsets[i] = off
            self._sizes[i] += n
        else:
            self._offsets.insert(i, off)
            self._sizes.insert(i, n)
        self.free_bytes += n

    def rebuild(self, size_bytes: int, used: list[tuple[int, int]]) -> None:
        """State after compaction: the (offset, size) regions in ``used`` (sorted) are taken,
        every gap between them is a hole."""
        self.size_bytes = size_bytes
        self._offsets, self._sizes = [], []
        cursor = 0
        for off, n in [*used, (size_bytes, 0)]:
            if off > cursor:
                self._offsets.append(cursor)
                self._sizes.append(off - cursor)
            cursor = max(cursor, off + n)
        self.free_bytes = sum(self._sizes)

    def fits(self, n: int) -> bool:
        """Whether one hole already holds ``n`` bytes (``alloc`` would succeed)."""
        return any(hole >= n for hole in self._sizes)

    @property
    def holes(self) -> int:
        return len(self._offsets)

    @property
    def largest_hole_bytes(self) -> int:
        return max(self._sizes, default=0)


@dataclass(frozen=True, slots=True)
class Lease:
    """A reader's hold on a chunk's bytes in the arena, valid until ``deadline_s``
    (``time.monotonic()``, which is one clock for every process on a Linux host)."""

    lease_id: int
    generation: int
    offset: int
    size_bytes: int
    deadline_s: float


@dataclass(frozen=True, slots=True)
class Reservation:
    """Arena space held for ``key`` while its bytes are written in (``reserved_view``); it
    becomes the chunk on ``commit`` or is freed by ``abort``. A resize to another size replaces
    the arena: the reservation then belongs to the old one, whose bytes stay valid for whoever
    holds its view, and ``commit`` answers False."""

    key: bytes
    generation: int
    offset: int
    size_bytes: int


@dataclass(eq=False)
class ResizePlan:
    """A resize to another size in three steps, so that mapping and committing the new arena
    and copying the chunks into it run without the store's lock: ``begin_resize`` (under it:
    where each chunk goes), ``copy_resize`` (without it), ``finish_resize`` (under it: the chunks
    deleted, put or moved meanwhile, then the new arena replaces the old one)."""

    capacity_bytes: int
    generation: int
    #: the arena the chunks are copied from (the tier's at ``begin_resize``)
    source: memoryview
    #: (key, offset in the old arena, offset in the new one, size), packed from offset 0
    moves: list[tuple[bytes, int, int, int]]
    #: keys deleted since ``begin_resize`` (their old bytes may be another chunk's by now)
    dirty: set[bytes] = field(default_factory=set)
    #: held for each chunk's copy: a plan made stale waits out the copy under way
    lock: threading.Lock = field(default_factory=threading.Lock)
    valid: bool = True
    #: the new arena once ``copy_resize`` mapped it (the tier's once finished)
    arena: mmap.mmap | None = None
    view: memoryview | None = None
    fd: int = -1
    #: its bytes on huge pages as committed (``CpuTier.huge_page_bytes``)
    huge_bytes: int | None = None
    #: why ``copy_resize`` could not map the new arena
    error: BaseException | None = None
    #: the arena the finished resize replaced, released by ``release_resize``
    retired: tuple[mmap.mmap, memoryview, int] | None = None


class CpuTier(Tier):
    """Chunks in one host-memory arena. ``capacity_bytes`` is the arena size."""

    def __init__(self, capacity_bytes: int, *, name: str = "cpu", shared: bool = False) -> None:
        check_capacity(capacity_bytes, f"{name} capacity")
        if shared and not hasattr(os, "memfd_create"):
            raise TierUnavailable("a shared-memory cpu tier needs Linux (memfd_create)")
        self.name = name
        self.shared = shared
        self._capacity_bytes = capacity_bytes
        self._replaced_hooks: list[Callable[[], None]] = []
        #: told of a resize's new arena (and generation) once mapped, and again when it is
        #: given up, before it is unmapped (``on_arena_prepared``)
        self._prepared_hooks: list[Callable[[mmap.mmap, int, bool], None]] = []
        self._fd = -1
        self._arena, self._fd, self._huge_bytes = _new_arena(
            capacity_bytes, shared=shared, name=name
        )
        self._view = memoryview(self._arena)
        self._prefault = _prefaulter(self._arena, shared)
        self._alloc = ArenaAllocator(capacity_bytes)
        self._slots: dict[bytes, tuple[int, int]] = {}  # key -> (offset, size)
        self._used_bytes = 0
        self.compactions = 0
        #: bumped whenever the arena is replaced (resize); leases name the generation they hold
        self.generation = 0
        self._leases: dict[int, tuple[int, int, float]] = {}  # id -> (generation, offset, deadline)
        self._region_leases: dict[int, int] = {}  # offset -> live leases (current generation)
        self._zombies: dict[int, int] = {}  # offset -> size of deleted-but-leased regions
        self._reserved: dict[int, tuple[bytes, int]] = {}  # offset -> (key, size), uncommitted
        self._reserved_bytes = 0
        self._next_lease_id = 1
        self._closed = False
        #: the resize being copied without the store's lock, if any
        self._plan: ResizePlan | None = None

    # --- Tier interface -------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    def huge_page_bytes(self) -> int | None:
        """Bytes of the shared arena on huge pages as it was committed (None: a private arena,
        whose pages come as chunks are written, or smaps unreadable). Read from smaps once, when
        an arena is committed through the agent's mapping, which is then whole: a read walks
        every mapping's page tables under the process's memory map (150 ms for an 8 GiB arena on
        4 KiB pages), too dear for each /v1/info."""
        return self._huge_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes taken in the arena, including regions of deleted chunks still under lease."""
        return self._used_bytes

    @property
    def resident_bytes(self) -> int:
        # reservations are not kept by a resize (they stay with the old arena), so not counted
        return self._used_bytes - sum(self._zombies.values()) - self._reserved_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes held by reservations not yet committed or aborted."""
        return self._reserved_bytes

    def evictable(self, key: bytes) -> bool:
        slot = self._slots.get(key)
        return slot is None or slot[0] not in self._region_leases

    def plan_room(self, size_bytes: int, candidates: Iterable[V]) -> list[V] | None:
        """``Tier.plan_room`` for an arena that leased and reserved regions split: those never
        move, so they cut the arena into runs, and compaction packs each run's chunks at its
        start, leaving the run's free bytes as one hole. A chunk fits once one run's free bytes
        reach its size: victims are taken in the store's order, but only those in the first
        run to get there, so nothing is evicted on the other side of a leased region."""
        if self._alloc.fits(size_bytes):
            return []  # a hole holds it now: no need to map the runs (a put's common case)
        fixed = self._fixed_regions()
        if not fixed:  # compaction gathers all free bytes into one hole
            return super().plan_room(size_bytes, candidates)
        starts: list[int] = []
        ends: list[int] = []
        cursor = 0
        for off, n in fixed:
            if off > cursor:
                starts.append(cursor)
                ends.append(off)
            cursor = max(cursor, off + n)
        if self._capacity_bytes > cursor:
            starts.append(cursor)
            ends.append(self._capacity_bytes)
        free = [end - start for start, end in zip(starts, ends, strict=True)]
        for off, n in self._slots.values():
            if off not in self._region_leases:
                free[bisect.bisect_right(starts, off) - 1] -= n
        if max(free, default=0) >= size_bytes:
            return []
        if not any(end - start >= size_bytes for start, end in zip(starts, ends, strict=True)):
            return None  # no run is long enough, whatever is evicted
        chosen: dict[int, list[V]] = {}
        for c in candidates:
            slot = self._slots.get(c.key)
            if slot is None or slot[0] in self._region_leases:
                continue  # leased: evicting it frees nothing now
            run = bisect.bisect_right(starts, slot[0]) - 1
            if ends[run] - starts[run] < size_bytes:
                continue
            free[run] += slot[1]
            chosen.setdefault(run, []).append(c)
            if free[run] >= size_bytes:
                return chosen[run]
        return None

    def _fixed_regions(self) -> list[tuple[int, int]]:
        """(offset, size) of the regions compaction cannot move (leased, zombie, reserved),
        sorted by offset."""
        if not self._region_leases and not self._reserved:
            return []
        live = {off: n for off, n in self._slots.values() if off in self._region_leases}
        fixed = [(off, live.get(off) or self._zombies[off]) for off in self._region_leases]
        fixed += [(off, n) for off, (_, n) in self._reserved.items()]
        fixed.sort()
        return fixed

    @property
    def lease_count(self) -> int:
        return len(self._leases)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._slots))

    def size_of(self, key: bytes) -> int:
        return self._slot(key)[1]

    def put(self, meta: ChunkMeta, data: Buffer | None) -> None:
        self._check_open()
        check_put(self, meta, data)
        n = meta.size_bytes
        off = self._alloc_region(n)
        assert data is not None  # check_put guarantees it for payload tiers
        copy_bytes(self._view[off : off + n], data)
        self._slots[meta.key] = (off, n)
        self._used_bytes += n

    def read_into(self, key: bytes, out: memoryview) -> int:
        self._check_open()
        off, n = self._slot(key)
        dest = byte_view(out)  # a view: a slice of it is written in place (a bytearray's is not)
        if dest.nbytes < n:
            raise InvalidArgument(f"buffer of {dest.nbytes} bytes is smaller than the chunk ({n})")
        copy_bytes(dest[:n], self._view[off : off + n])
        return n

    def delete(self, key: bytes) -> int:
        self._check_open()
        off, n = self._slot(key)
        del self._slots[key]
        if self._plan is not None:
            self._plan.dirty.add(key)
        if off in self._region_leases:
            self._zombies[off] = n  # a reader still uses these bytes; free them when it is done
        else:
            self._alloc.free(off, n)
            self._used_bytes -= n
        return n

    def resize(self, capacity_bytes: int) -> None:
        self._check_open()
        check_resize(self, capacity_bytes)
        try:
            self._compact(capacity_bytes)
        except CapacityError as exc:  # more than the host can hold (memroom): checked first
            raise CapacityError(
                f"{exc}; it keeps its capacity of {format_bytes(self.capacity_bytes)}"
            ) from exc
        except (OverflowError, MemoryError, OSError) as exc:
            if isinstance(exc, StoreError):
                raise
            # the new arena is mapped whole before anything moves: the tier is as it was
            raise CapacityError(
                f"tier {self.name!r} cannot map {format_bytes(capacity_bytes)} ({exc}); it keeps "
                f"its capacity of {format_bytes(self.capacity_bytes)}"
            ) from exc

    # --- a resize copied without the store's lock (ResizePlan) ----------------------------
    def begin_resize(self, capacity_bytes: int) -> ResizePlan | None:
        """Under the store's lock: where each chunk goes in an arena of ``capacity_bytes``; None
        where ``resize`` must do it all (the same size, a resize under way, or the chunks held
        now would not fit)."""
        self._check_open()
        check_resize(self, capacity_bytes)
        if capacity_bytes == self._capacity_bytes or self._plan is not None:
            return None
        moves: list[tuple[bytes, int, int, int]] = []
        cursor = 0
        for key, (off, n) in sorted(self._slots.items(), key=lambda kv: kv[1][0]):
            moves.append((key, off, cursor, n))
            cursor += n
        if cursor > capacity_bytes:
            return None
        self._plan = ResizePlan(capacity_bytes, self.generation, self._view, moves)
        return self._plan

    def copy_resize(self, plan: ResizePlan) -> None:
        """Without the store's lock: map the new arena and copy the planned chunks into it.
        Stops early where the plan went stale; a failure to map is kept in ``plan.error``."""
        try:
            made = _new_arena(plan.capacity_bytes, shared=self.shared, name=self.name)
        except (OverflowError, MemoryError, OSError, CapacityError) as exc:
            plan.error = exc
            return
        try:
            with plan.lock:  # the plan owns it from here: release_resize unmaps it
                plan.arena, plan.fd, plan.huge_bytes = made
                plan.view = memoryview(made[0])
        except BaseException:
            if plan.arena is not made[0]:
                _release(made[0], memoryview(made[0]), made[1])
            raise
        self._tell(self._prepared_hooks, made[0], plan.generation + 1, False)
        for key, src, dst, n in plan.moves:
            with plan.lock:
                if not plan.valid:
                    return
                if key not in plan.dirty:
                    copy_bytes(plan.view[dst : dst + n], plan.source[src : src + n])

    def finish_resize(self, plan: ResizePlan) -> bool:
        """Under the store's lock: copy what changed since ``begin_resize`` (chunks put, or
        deleted and put again), then make the new arena the tier's. False, with nothing changed
        and the plan given up, where it went stale or failed: ``resize`` then does it all."""
        if (
            self._plan is not plan
            or not plan.valid
            or plan.view is None
            or plan.arena is None
            or self._closed
            or plan.generation != self.generation
        ):
            self.abort_resize(plan)
            return False
        planned = {key: (src, dst, n) for key, src, dst, n in plan.moves}
        new_slots: dict[bytes, tuple[int, int]] = {}
        todo: list[tuple[bytes, int, int]] = []
        for key, (off, n) in self._slots.items():
            p = planned.get(key)
            if p is not None and p[0] == off and p[2] == n and key not in plan.dirty:
                new_slots[key] = (p[1], n)  # copied, and its old bytes unchanged since
            else:
                todo.append((key, off, n))
        used = sorted(new_slots.values())
        alloc = ArenaAllocator(plan.capacity_bytes)
        alloc.rebuild(plan.capacity_bytes, used)
        placed: list[tuple[bytes, int, int, int]] = []
        for key, off, n in todo:
            dst = alloc.alloc(n)
            if dst is None:  # the holes the deleted chunks left are too small: pack anew
                self.abort_resize(plan)
                return False
            placed.append((key, off, dst, n))
        for key, off, dst, n in placed:
            copy_bytes(plan.view[dst : dst + n], self._view[off : off + n])
            new_slots[key] = (dst, n)
        self._plan = None
        arena, view, fd = plan.arena, plan.view, plan.fd
        plan.arena, plan.view, plan.fd = None, None, -1  # the tier's now
        self._slots = new_slots
        end = max((off + n for off, n in new_slots.values()), default=0)
        # unmapping the old arena frees its pages (30 ms per 128 MiB here): after the lock
        plan.retired = self._replace_arena(
            arena, view, fd, plan.capacity_bytes, end, keep=True, huge_bytes=plan.huge_bytes
        )
        self._alloc = alloc
        self.compactions += 1
        return True

    def abort_resize(self, plan: ResizePlan) -> None:
        """Under the store's lock: give a plan up (once finished: nothing to do); then
        ``release_resize``."""
        if self._plan is plan:
            self._plan = None
        with plan.lock:
            plan.valid = False

    def release_resize(self, plan: ResizePlan) -> None:
        """Without the store's lock, once the plan is finished or given up, by the thread that
        ran ``copy_resize``: unmap what it still holds (the new arena where it was given up,
        the old one where it finished)."""
        with plan.lock:
            plan.valid = False
            new = (plan.arena, plan.view, plan.fd)
            plan.arena, plan.view, plan.fd = None, None, -1
            old, plan.retired = plan.retired, None
        if new[0] is not None:  # given up: whoever registered it lets go first
            self._tell(self._prepared_hooks, new[0], plan.generation + 1, True)
            _release(new[0], new[1] if new[1] is not None else memoryview(new[0]), new[2])
        if old is not None:
            _release(*old)

    def _stale_plan(self) -> None:
        """The arena is compacted, replaced or closed under a plan: it is stale (waiting out a
        chunk's copy under way, so the old arena can be released)."""
        plan, self._plan = self._plan, None
        if plan is not None:
            with plan.lock:
                plan.valid = False

    def close(self) -> None:
        if self._closed:
            return
        self._stale_plan()
        self._closed = True
        self._slots.clear()
        self._leases.clear()
        self._reserved.clear()
        self._reserved_bytes = 0
        self._used_bytes = 0
        self._release_arena()

    # --- reservations -----------------------------------------------------------------------
    def reserve(self, meta: ChunkMeta) -> Reservation:
        """Hold ``meta.size_bytes`` of arena for ``meta.key``. Raises CapacityError like ``put``
        (the caller makes room first), InvalidArgument when the key is already here."""
        self._check_open()
        n = meta.size_bytes
        if n <= 0:
            raise InvalidArgument(f"chunk size must be positive, got {n}")
        check_room(self, meta)
        off = self._alloc_region(n)
        self._reserved[off] = (meta.key, n)
        self._reserved_bytes += n
        self._used_bytes += n
        return Reservation(meta.key, self.generation, off, n)

    def reserved_view(self, reservation: Reservation) -> memoryview:
        """The reserved bytes, writable, for the reader filling them. The view stays valid
        after a resize (it keeps the old arena mapped); only ``commit`` says whether it counts."""
        if not self._holds(reservation):
            raise TierUnavailable(f"tier {self.name!r} no longer holds this reservation")
        off = reservation.offset
        return self._view[off : off + reservation.size_bytes]

    def commit(self, reservation: Reservation) -> bool:
        """Make the reserved region the chunk of its key; False (nothing changes) when the
        reservation went with an older arena or the tier was closed."""
        if not self._holds(reservation):
            return False
        if reservation.key in self._slots:
            raise InvalidArgument(f"key {_hex(reservation.key)} is already in tier {self.name!r}")
        del self._reserved[reservation.offset]
        self._reserved_bytes -= reservation.size_bytes
        self._slots[reservation.key] = (reservation.offset, reservation.size_bytes)
        return True

    def abort(self, reservation: Reservation) -> None:
        """Give the reserved space back (nothing to do for a reservation that went stale)."""
        if not self._holds(reservation):
            return
        off, n = reservation.offset, reservation.size_bytes
        del self._reserved[off]
        self._reserved_bytes -= n
        self._alloc.free(off, n)
        self._used_bytes -= n

    def _holds(self, reservation: Reservation) -> bool:
        return (
            not self._closed
            and reservation.generation == self.generation
            and self._reserved.get(reservation.offset) == (reservation.key, reservation.size_bytes)
        )

    # --- leases -----------------------------------------------------------------------------
    def lease(self, key: bytes, ttl_s: float, *, now_s: float | None = None) -> Lease:
        """Hold ``key``'s bytes in place for ``ttl_s`` seconds (``math.inf``: until released)."""
        off, n = self._slot(key)
        now = time.monotonic() if now_s is None else now_s
        lease = Lease(self._next_lease_id, self.generation, off, n, now + ttl_s)
        self._next_lease_id += 1
        self._leases[lease.lease_id] = (lease.generation, off, lease.deadline_s)
        self._region_leases[off] = self._region_leases.get(off, 0) + 1
        return lease

    def release(self, lease_id: int) -> bool:
        """End a lease; False if it was unknown or had already expired."""
        held = self._leases.pop(lease_id, None)
        if held is None:
            return False
        generation, off, _ = held
        if generation == self.generation:
            self._unhold(off)
        return True

    def expire_leases(self, now_s: float | None = None) -> int:
        """End every lease past its deadline (a crashed client's), so its memory comes back."""
        now = time.monotonic() if now_s is None else now_s
        expired = [i for i, (_, _, deadline) in self._leases.items() if deadline <= now]
        for lease_id in expired:
            self.release(lease_id)
        return len(expired)

    def view(self, lease: Lease) -> memoryview:
        """The leased bytes, read in place (valid while the lease holds)."""
        if lease.generation != self.generation or lease.lease_id not in self._leases:
            raise TierUnavailable(f"lease {lease.lease_id} no longer holds its chunk")
        return self._view[lease.offset : lease.offset + lease.size_bytes].toreadonly()

    def reader_fd(self) -> int:
        """A new read-only descriptor of the shared arena, for a local client; the caller closes
        it. The arena is sealed (``ARENA_SEALS``), so even reopened read-write (through
        /proc/self/fd) it can be neither written, nor mapped writable, nor resized."""
        if not self.shared or self._fd < 0:
            raise TierUnavailable(f"tier {self.name!r} is not in shared memory")
        return os.open(f"/proc/self/fd/{self._fd}", os.O_RDONLY | os.O_CLOEXEC)

    # --- internals --------------------------------------------------------------------------
    def _alloc_region(self, n: int) -> int:
        """Offset of ``n`` free bytes (the caller checked they exist in all), compacting once
        when no single hole is large enough."""
        off = self._alloc.alloc(n)
        if off is None:  # enough free bytes, but fragmented
            self._compact(self._capacity_bytes)
            off = self._alloc.alloc(n)
            if off is None:  # leased or reserved regions that cannot move split the free space
                raise CapacityError(
                    f"tier {self.name!r}: no hole of {n} bytes while chunks are leased or "
                    f"being read in"
                )
        if self._prefault is not None:
            self._prefault.want(off + n)  # the pages past it, faulted in before they are needed
        return off

    def _unhold(self, off: int) -> None:
        left = self._region_leases[off] - 1
        if left:
            self._region_leases[off] = left
            return
        del self._region_leases[off]
        size = self._zombies.pop(off, None)
        if size is not None:
            self._alloc.free(off, size)
            self._used_bytes -= size

    def _slot(self, key: bytes) -> tuple[int, int]:
        self._check_open()
        try:
            return self._slots[key]
        except KeyError:
            raise KeyNotFound(f"key {_hex(key)} is not in tier {self.name!r}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"tier {self.name!r} is closed")

    def _compact(self, capacity_bytes: int) -> None:
        """Pack chunks toward the start of an arena of ``capacity_bytes`` (new if resized).
        In place, leased regions stay where they are and the others slide down around them."""
        self._stale_plan()  # chunks move: a resize being copied starts again, under the lock
        order = sorted(self._slots.items(), key=lambda kv: kv[1][0])
        if capacity_bytes == self._capacity_bytes:
            regions: list[tuple[int, int, bytes | None]] = [(off, n, k) for k, (off, n) in order]
            regions += [(off, n, None) for off, n in self._zombies.items()]
            # a reader is writing into a reserved region without the store's lock: it stays put
            regions += [(off, n, None) for off, (_, n) in self._reserved.items()]
            regions.sort(key=lambda r: r[0])
            used: list[tuple[int, int]] = []
            cursor = 0
            for off, n, key in regions:
                if key is None or off in self._region_leases:  # leased: stays put
                    used.append((off, n))
                    cursor = max(cursor, off + n)
                    continue
                # cursor <= off and every leased region below off is behind cursor, so the
                # chunk's new place overlaps nothing but its own old place
                if off != cursor:
                    self._arena.move(cursor, off, n)  # memmove: regions may overlap
                    self._slots[key] = (cursor, n)
                used.append((cursor, n))
                cursor += n
        else:
            # under the store's lock: committed the quick way, on small pages (a resize made
            # without the lock, the usual one, commits on huge pages where allowed)
            arena, fd, huge = _new_arena(
                capacity_bytes, shared=self.shared, name=self.name, huge=False
            )
            view = memoryview(arena)
            cursor = 0
            for key, (off, n) in order:
                copy_bytes(view[cursor : cursor + n], self._view[off : off + n])
                self._slots[key] = (cursor, n)
                cursor += n
            self._replace_arena(arena, view, fd, capacity_bytes, cursor, huge_bytes=huge)
            used = [(0, cursor)] if cursor else []
        self._alloc.rebuild(capacity_bytes, used)
        self.compactions += 1

    def _replace_arena(
        self,
        arena: mmap.mmap,
        view: memoryview,
        fd: int,
        capacity_bytes: int,
        used_end: int,
        *,
        keep: bool = False,
        huge_bytes: int | None = None,
    ) -> tuple[mmap.mmap, memoryview, int] | None:
        """``arena`` (holding every chunk at its place in ``_slots``, up to ``used_end``)
        becomes the tier's, a new generation; the old one is released (``keep``: returned,
        for the caller to release)."""
        old = (self._arena, self._view, self._fd)
        self._arena, self._view, self._fd = arena, view, fd
        self._huge_bytes = huge_bytes
        if self._prefault is not None:
            # waited for (one step at most), as in ``_release_arena``: its call in flight holds
            # an export of the old arena, and releasing it below would fail and leave it
            # mapped until that thread let go of it
            self._prefault.close()
        self._prefault = _prefaulter(arena, self.shared, used_end)
        self._capacity_bytes = capacity_bytes
        # leases of the old generation keep their readers' mappings; they no longer hold
        # anything here, and the zombies' bytes went with the old arena
        self.generation += 1
        self._used_bytes -= sum(self._zombies.values()) + self._reserved_bytes
        self._zombies.clear()
        # likewise reservations: their readers still write into the old arena, and their
        # commits will answer False
        self._reserved.clear()
        self._reserved_bytes = 0
        self._region_leases.clear()
        # while the old arena is still mapped: whoever holds it (a registration with CUDA)
        # lets go of it, then it is released
        self._tell(self._replaced_hooks)
        if keep:
            return old
        _release(*old)
        return None

    def _release_arena(self) -> None:
        if self._prefault is not None:
            # waited for: its call in flight holds an export of the arena, which would make
            # unmapping it fail and leave it mapped for as long as this tier object lives
            self._prefault.close()
        _release(self._arena, self._view, self._fd)
        self._fd = -1

    def on_arena_replaced(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Call ``hook`` each time a resize replaces the arena, with the new one in place
        (``arena_mapping``) and the old one still mapped; returns what removes the hook."""
        return _listen(self._replaced_hooks, hook)

    def on_arena_prepared(self, hook: Callable[[mmap.mmap, int, bool], None]) -> Callable[[], None]:
        """Call ``hook(arena, generation, False)`` when a resize has mapped the arena that will
        be this tier's at ``generation`` (without the store's lock, before its chunks are
        copied in), and ``hook(arena, generation, True)`` when that resize is given up, before
        the arena is unmapped; returns what removes the hook. A gpu tier registers the new
        arena with CUDA here, so the replacement under the lock does not pin it."""
        return _listen(self._prepared_hooks, hook)

    def _tell(self, hooks: list[Callable[..., None]], *args: object) -> None:
        for hook in list(hooks):
            try:
                hook(*args)
            except Exception:  # a listener's failure must not fail the resize
                log.exception("a listener of the %s arena's resize failed", self.name)

    def arena_mapping(self) -> tuple[mmap.mmap, int]:
        """The arena's mapping and its generation (a resize replaces both), for registering it
        with CUDA so a gpu tier copies to and from it directly (kvctl.store.tiers.hostreg)."""
        self._check_open()
        return self._arena, self.generation


#: fcntl's F_SEAL_FUTURE_WRITE (Linux 5.1; Python's fcntl module does not name it): no new
#: write access of any kind, while mappings made before stay writable
F_SEAL_FUTURE_WRITE = 0x10
#: the seals of a shared arena: nobody but the agent's own mapping (made before sealing) can
#: write it, and nobody can resize it (shrinking it would crash the agent with SIGBUS)
ARENA_SEALS = (
    F_SEAL_FUTURE_WRITE
    | getattr(fcntl, "F_SEAL_SHRINK", 0x2)
    | getattr(fcntl, "F_SEAL_GROW", 0x4)
    | getattr(fcntl, "F_SEAL_SEAL", 0x1)
)
#: fcntl's F_ADD_SEALS (Linux's value where Python does not name it)
_F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)


def _prefaulter(arena: mmap.mmap, shared: bool, used: int = 0) -> Prefaulter | None:
    """A shared arena's pages are committed at start (``_new_arena``), so faulting them into
    this mapping ahead of the puts costs page tables only: the pages past ``used`` are."""
    if not shared or len(arena) <= 1:
        return None
    prefault = Prefaulter(arena)
    prefault.want(used)
    return prefault


_Hook = TypeVar("_Hook")


def _listen(hooks: list[_Hook], hook: _Hook) -> Callable[[], None]:
    """Add ``hook`` to ``hooks``; returns what removes it (once, whenever)."""
    hooks.append(hook)
    return lambda: hooks.remove(hook) if hook in hooks else None


def _new_arena(
    capacity_bytes: int, *, shared: bool, name: str, huge: bool = True
) -> tuple[mmap.mmap, int, int | None]:
    """(the mapping, the memfd or -1, its bytes on huge pages: ``CpuTier.huge_page_bytes``).
    ``huge=False``: committed the quick way, on small pages (under the store's lock)."""
    # mmap refuses length 0; a one-byte map stands in for an empty tier and is never used
    size = max(capacity_bytes, 1)
    # a private arena faults in as chunks arrive, but a size past the host's memory is still
    # an out-of-memory kill later, under load
    _check_room(size, name)
    if not shared:
        private = mmap.mmap(-1, size)  # shmem too (MAP_SHARED): huge pages as they fault in
        hugepages.advise(private)
        return private, -1, None
    # A client gets the arena as a read-only descriptor, but it can reopen it read-write
    # through /proc/self/fd: only seals stop it writing into other tenants' chunks or resizing
    # it under the agent. A resize makes a new sealed memfd (``_compact``), never resizes one.
    fd = os.memfd_create(f"kvctl-{name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        arena = mmap.mmap(fd, size)  # the agent's writable mapping, made before the seals
        try:
            # commit the pages now: a short shm/RAM budget is a clear error at start, not
            # SIGBUS on some later write; on huge pages where the kernel allows (hugepages)
            started_s = time.perf_counter()
            mode = hugepages.shmem_mode()
            populated = hugepages.commit(arena, fd, size, mode=mode, huge=huge)
            huge_bytes = hugepages.committed_huge_bytes(arena, populated, mode)
            if populated:
                log.info(
                    "tier %s: %d bytes committed (shmem_enabled %s) in %.2f s, %s on huge pages",
                    name,
                    size,
                    mode,
                    time.perf_counter() - started_s,
                    huge_bytes,
                )
        except BaseException:
            arena.close()
            raise
        try:
            fcntl.fcntl(fd, _F_ADD_SEALS, ARENA_SEALS)
        except OSError as exc:
            arena.close()
            if exc.errno == errno.EINVAL:  # a kernel without F_SEAL_FUTURE_WRITE (< 5.1)
                raise TierUnavailable(
                    f"tier {name!r}: this kernel cannot seal shared memory against clients' "
                    f"writes (F_SEAL_FUTURE_WRITE needs Linux 5.1 or later); turn shared "
                    f"memory off (shm = false, KVCTL_SHM=0) to serve chunks over the socket"
                ) from exc
            raise
        return arena, fd, huge_bytes
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            raise CapacityError(
                f"cannot reserve {format_bytes(capacity_bytes)} of shared memory for tier "
                f"{name!r}: {exc.strerror}; lower its size or free memory"
            ) from exc
        raise
    except BaseException:
        os.close(fd)
        raise


def _check_room(size_bytes: int, name: str) -> None:
    """CapacityError where committing ``size_bytes`` would leave the host or the agent's cgroup
    without its reserve: shared memory short of RAM is not refused with ENOMEM, the kernel's
    out-of-memory killer ends some process instead (``memroom``)."""
    room = memroom.room()
    if room is None or size_bytes <= room.bytes:
        return
    raise CapacityError(
        f"cannot reserve {format_bytes(size_bytes)} of shared memory for tier {name!r}: "
        f"{format_bytes(max(room.bytes, 0))} can be committed ({room.source}, less a reserve "
        f"for the rest of the node); lower its size or free memory"
    )


def _hex(key: object) -> str:
    return key.hex() if isinstance(key, bytes | bytearray) else repr(key)


def _release(arena: mmap.mmap, view: memoryview, fd: int) -> None:
    # A sender may still hold a slice of the arena: then closing raises BufferError, and the map
    # is freed when the last slice goes instead.
    try:
        view.release()
        arena.close()
    except BufferError:
        pass
    if fd >= 0:
        os.close(fd)
