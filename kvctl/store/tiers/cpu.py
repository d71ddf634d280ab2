"""Host-DRAM tier: one preallocated arena with its own allocator.

The arena is an anonymous memory map sized to the tier's capacity, so the capacity is enforced to
the byte and the memory is committed once rather than per chunk. The agent will back it with a
shared-memory segment so a local engine can read chunks without a socket copy.

Allocation is first-fit over a free list kept sorted by offset, with neighbours coalesced on free.
When the free bytes suffice but no hole is large enough, the arena is compacted (live chunks slide
down with memmove) instead of evicting more than the capacity requires.
"""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Iterator

from kvctl.store.errors import CapacityError, InvalidArgument, KeyNotFound, TierUnavailable
from kvctl.store.tiers.base import (
    Buffer,
    ChunkMeta,
    Tier,
    check_capacity,
    check_put,
    check_resize,
)


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

    def reset(self, size_bytes: int, used_prefix_bytes: int) -> None:
        """State after compaction: ``[0, used_prefix_bytes)`` in use, the rest one hole."""
        self.size_bytes = size_bytes
        rest = size_bytes - used_prefix_bytes
        self._offsets = [used_prefix_bytes] if rest else []
        self._sizes = [rest] if rest else []
        self.free_bytes = rest

    @property
    def holes(self) -> int:
        return len(self._offsets)

    @property
    def largest_hole_bytes(self) -> int:
        return max(self._sizes, default=0)


class CpuTier(Tier):
    """Chunks in one host-memory arena. ``capacity_bytes`` is the arena size."""

    def __init__(self, capacity_bytes: int, *, name: str = "cpu") -> None:
        check_capacity(capacity_bytes, f"{name} capacity")
        self.name = name
        self._capacity_bytes = capacity_bytes
        self._arena = _new_arena(capacity_bytes)
        self._view = memoryview(self._arena)
        self._alloc = ArenaAllocator(capacity_bytes)
        self._slots: dict[bytes, tuple[int, int]] = {}  # key -> (offset, size)
        self._used_bytes = 0
        self.compactions = 0
        self._closed = False

    # --- Tier interface -------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

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
        off = self._alloc.alloc(n)
        if off is None:  # enough free bytes (check_put), but fragmented
            self._compact(self._capacity_bytes)
            off = self._alloc.alloc(n)
            if off is None:  # pragma: no cover - compaction leaves one hole of free_bytes
                raise CapacityError(f"tier {self.name!r}: no room for {n} bytes after compaction")
        assert data is not None  # check_put guarantees it for payload tiers
        self._view[off : off + n] = data
        self._slots[meta.key] = (off, n)
        self._used_bytes += n

    def read_into(self, key: bytes, out: memoryview) -> int:
        self._check_open()
        off, n = self._slot(key)
        if out.nbytes < n:
            raise InvalidArgument(f"buffer of {out.nbytes} bytes is smaller than the chunk ({n})")
        out[:n] = self._view[off : off + n]
        return n

    def delete(self, key: bytes) -> int:
        self._check_open()
        off, n = self._slot(key)
        del self._slots[key]
        self._alloc.free(off, n)
        self._used_bytes -= n
        return n

    def resize(self, capacity_bytes: int) -> None:
        self._check_open()
        check_resize(self, capacity_bytes)
        self._compact(capacity_bytes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._view.release()
        self._arena.close()
        self._slots.clear()
        self._used_bytes = 0

    # --- internals --------------------------------------------------------------------------
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
        """Pack live chunks at the start of an arena of ``capacity_bytes`` (new if resized)."""
        order = sorted(self._slots.items(), key=lambda kv: kv[1][0])
        if capacity_bytes == self._capacity_bytes:
            cursor = 0
            for key, (off, n) in order:
                if off != cursor:
                    self._arena.move(cursor, off, n)  # memmove: regions may overlap
                    self._slots[key] = (cursor, n)
                cursor += n
        else:
            arena = _new_arena(capacity_bytes)
            view = memoryview(arena)
            cursor = 0
            for key, (off, n) in order:
                view[cursor : cursor + n] = self._view[off : off + n]
                self._slots[key] = (cursor, n)
                cursor += n
            self._view.release()
            self._arena.close()
            self._arena, self._view = arena, view
            self._capacity_bytes = capacity_bytes
        self._alloc.reset(capacity_bytes, cursor)
        self.compactions += 1


def _new_arena(capacity_bytes: int) -> mmap.mmap:
    # mmap refuses length 0; a one-byte map stands in for an empty tier and is never used
    return mmap.mmap(-1, max(capacity_bytes, 1))


def _hex(key: object) -> str:
    return key.hex() if isinstance(key, bytes | bytearray) else repr(key)
