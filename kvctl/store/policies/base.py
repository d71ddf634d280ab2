"""The eviction policy interface, and ``HeapPolicy``: smallest rank first over a lazy heap."""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

from kvctl.store.index import Entry


class EvictionPolicy(ABC):
    """Tracks one tier's unpinned entries and picks victims."""

    name: ClassVar[str]
    #: whether ``on_access`` may be called later than the access (``DeferredAccesses``): it
    #: reads of the entry only what the store changes with another call to the policy or
    #: another access (key, sizes, lineage, ticks, access count, whether it has children)
    accesses_deferrable: bool = False

    @abstractmethod
    def on_insert(self, entry: Entry) -> None: ...

    @abstractmethod
    def on_access(self, entry: Entry) -> None: ...

    @abstractmethod
    def on_remove(self, entry: Entry) -> None: ...

    def on_children_changed(self, entry: Entry) -> None:  # noqa: B027 - only lineage cares
        """The entry's cached-children count changed."""

    def set_max_entries(self, n: int | None) -> None:  # noqa: B027 - only shadow caches care
        """The most chunks its tier holds (``Tier.max_chunks``; None: no limit), told by the
        store at start and on each resize: a policy that keeps entries of its own for chunks
        the tier does not hold (``lineage-adaptive``'s shadow caches) keeps to it too."""

    @abstractmethod
    def victim(self, now_s: float) -> Entry | None:
        """The entry to evict next (not removed: the store calls ``on_remove``), or None."""

    def victims(self, now_s: float) -> Iterator[Entry]:
        """Every tracked entry, in the order ``victim`` would name them, changing nothing: the
        store reads as far as it needs to decide, before evicting anything, whether (and with
        which victims) room can be made. Nothing may change the policy while this is read.

        This generic version takes the victims out and puts them back, which keeps the order
        only for policies whose ``on_insert`` restores an entry's rank; the built-in policies
        walk their own order instead."""
        taken: list[Entry] = []
        try:
            while (e := self.victim(now_s)) is not None:
                self.on_remove(e)
                taken.append(e)
        finally:
            for e in taken:
                self.on_insert(e)
        return iter(taken)

    def on_victim(self, entry: Entry) -> None:  # noqa: B027 - only aging policies care
        """The store evicts ``entry`` to make room, having chosen it from ``victims`` (not
        through ``victim``): a policy that ages on each victim does it here."""

    def admit(self, entry: Entry, now_s: float) -> bool:
        """Whether a newcomer should displace anything at all on a full tier (bypass)."""
        return True

    def status(self) -> dict[str, Any]:
        """What an operator sees of this policy (``/v1/stats`` ``policies``): its name, and
        whatever state explains its choices now."""
        return {"policy": self.name}

    @abstractmethod
    def __len__(self) -> int: ...


class HeapPolicy(EvictionPolicy):
    """Smallest ``rank`` among eligible entries goes first; a heap with lazy invalidation.

    A heap record is live while it carries the entry's current rank; every change pushes a new
    record and leaves the old one to be skipped, which keeps each update O(log n).
    """

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._ranks: dict[bytes, tuple[float, ...]] = {}
        self._heap: list[tuple[tuple[float, ...], int, bytes]] = []
        # every entry, eligible or not: the fallback when none is eligible, without an O(n)
        # scan per eviction (a lineage tier whose chunks all have children in a lower tier)
        self._all: list[tuple[tuple[float, ...], int, bytes]] = []
        self._seq = 0

    @abstractmethod
    def rank(self, entry: Entry) -> tuple[float, ...]: ...

    def eligible(self, entry: Entry) -> bool:
        return True

    def _push(self, entry: Entry) -> None:
        r = self.rank(entry)
        self._ranks[entry.key] = r
        self._seq += 1
        heapq.heappush(self._heap, (r, self._seq, entry.key))
        heapq.heappush(self._all, (r, self._seq, entry.key))
        if len(self._all) > 4 * len(self._entries) + 64:
            self._rebuild()

    def _rebuild(self) -> None:
        self._all = [(self._ranks[k], i, k) for i, k in enumerate(self._entries)]
        heapq.heapify(self._all)
        self._heap = [rec for rec in self._all if self.eligible(self._entries[rec[2]])]
        heapq.heapify(self._heap)

    def on_insert(self, entry: Entry) -> None:
        self._entries[entry.key] = entry
        self._push(entry)

    def on_access(self, entry: Entry) -> None:
        self._push(entry)

    def on_remove(self, entry: Entry) -> None:
        self._entries.pop(entry.key, None)
        self._ranks.pop(entry.key, None)

    def on_children_changed(self, entry: Entry) -> None:
        if entry.key in self._entries and self.eligible(entry):
            self._push(entry)  # records dropped while it was ineligible must come back

    def victim(self, now_s: float) -> Entry | None:
        heap = self._heap
        while heap:
            r, _, key = heap[0]
            e = self._entries.get(key)
            if e is not None and self._ranks.get(key) == r and self.eligible(e):
                return e
            heapq.heappop(heap)
        # No eligible entry (lineage: every chunk here has children cached in another tier).
        # Take the lowest rank anyway so the tier can always make room.
        everyone = self._all
        while everyone:
            r, _, key = everyone[0]
            e = self._entries.get(key)
            if e is not None and self._ranks.get(key) == r:
                return e
            heapq.heappop(everyone)
        return None

    def victims(self, now_s: float) -> Iterator[Entry]:
        """Eligible entries by rank, then the others by rank (``victim``'s fallback), each
        once. Walks the heaps in order without popping: O(log n) per entry read, no copy."""
        # drop the dead records on top first, as ``victim`` does (the walk cannot pop them,
        # and a put that needs one victim would otherwise step over them every time)
        for heap, check in ((self._heap, True), (self._all, False)):
            while heap:
                r, _, key = heap[0]
                e = self._entries.get(key)
                if e is not None and self._ranks.get(key) == r and (not check or self.eligible(e)):
                    break
                heapq.heappop(heap)
        seen: set[bytes] = set()
        for heap, check in ((self._heap, True), (self._all, False)):
            for r, _, key in _heap_in_order(heap):
                e = self._entries.get(key)
                if e is None or key in seen or self._ranks.get(key) != r:
                    continue
                if check and not self.eligible(e):
                    continue
                seen.add(key)
                yield e

    def __len__(self) -> int:
        return len(self._entries)


_HeapRecord = tuple[tuple[float, ...], int, bytes]


def _heap_in_order(heap: list[_HeapRecord]) -> Iterator[_HeapRecord]:
    """The items of a binary heap, smallest first, without changing it: a second, small heap
    holds the frontier of the walk (the children of what was yielded)."""
    if not heap:
        return
    n = len(heap)
    frontier: list[tuple[_HeapRecord, int]] = [(heap[0], 0)]
    while frontier:
        item, i = heapq.heappop(frontier)
        yield item
        for child in (2 * i + 1, 2 * i + 2):
            if child < n:
                heapq.heappush(frontier, (heap[child], child))
