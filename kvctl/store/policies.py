"""Eviction and admission policies, pluggable per tier.

A policy tracks the unpinned entries of one tier and names the next victim; the store does the
moving. Pinned entries are withdrawn from their policy while pinned, so no policy can pick them.

Eviction policies:
- ``lru``: least recently used. The baseline.
- ``lineage-lru``: leaf-first LRU. A chunk is only reachable through its whole prefix, so a parent
  is never chosen while one of its children is cached; among leaves, least recently used first.
- ``priority``: lowest retention priority first (0..100, like TensorRT-LLM's KV retention config),
  LRU within a priority; a priority given with a retention duration reverts to the default (35)
  when the duration ends.
- ``lineage-gdsf``: our own. Leaf-first Greedy-Dual-Size-Frequency: a leaf's value is
  ``L + frequency x recompute_cost / size`` where ``L`` rises to each victim's value (so old
  popularity ages out), the recompute cost grows with prefix depth (attention over a longer
  prefix), and chunks hit by several tenants get a spread bonus. See ``LineageGDSFPolicy``.
- ``lineage-lru2``: our own, and the best of ours on the Mooncake trace. Leaf-first LRU-2: a leaf
  ranks by the time of its previous access (its second-to-last), so chunks used only once (within
  a remembered history of recently seen keys, evicted ones included) go before any reused chunk,
  and among reused chunks the one whose previous use is oldest goes first. A long scan of new
  chunks therefore cannot flush the reused working set. See ``LineageLRU2Policy``.
- ``belady``: the offline optimum (farthest next use first, with bypass), for simulation only: it
  needs an oracle of future accesses.

Admission policies gate a lower tier (``disk``): ``all`` admits everything, ``frequency`` admits a
chunk only once it was accessed at least ``min_accesses`` times (counting accesses from before an
earlier drop), so one-hit chunks do not wear the SSD.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import ClassVar, TypeVar

from kvctl.store.errors import InvalidArgument
from kvctl.store.index import DEFAULT_PRIORITY, Entry

T = TypeVar("T")


class EvictionPolicy(ABC):
    """Tracks one tier's unpinned entries and picks victims."""

    name: ClassVar[str]

    @abstractmethod
    def on_insert(self, entry: Entry) -> None: ...

    @abstractmethod
    def on_access(self, entry: Entry) -> None: ...

    @abstractmethod
    def on_remove(self, entry: Entry) -> None: ...

    def on_children_changed(self, entry: Entry) -> None:  # noqa: B027 - only lineage cares
        """The entry's cached-children count changed."""

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

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, Entry] = OrderedDict()

    def on_insert(self, entry: Entry) -> None:
        self._order[entry.key] = entry

    def on_access(self, entry: Entry) -> None:
        self._order.move_to_end(entry.key)

    def on_remove(self, entry: Entry) -> None:
        self._order.pop(entry.key, None)

    def victim(self, now_s: float) -> Entry | None:
        return next(iter(self._order.values()), None)

    def victims(self, now_s: float) -> Iterator[Entry]:
        return iter(self._order.values())

    def __len__(self) -> int:
        return len(self._order)


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


class LineageLRUPolicy(HeapPolicy):
    name = "lineage-lru"

    def rank(self, entry: Entry) -> tuple[float, ...]:
        return (entry.last_tick,)

    def eligible(self, entry: Entry) -> bool:
        return entry.children == 0


class PriorityPolicy(HeapPolicy):
    """Lowest effective priority first, LRU within a priority; retention expiry re-ranks."""

    name = "priority"

    def __init__(self) -> None:
        super().__init__()
        self._now_s = 0.0
        self._deadlines: list[tuple[float, bytes]] = []

    def rank(self, entry: Entry) -> tuple[float, ...]:
        return (entry.effective_priority(self._now_s), entry.last_tick)

    def _track_deadline(self, entry: Entry) -> None:
        self._now_s = max(self._now_s, entry.last_access_s)
        if entry.retention_until_s is not None and entry.retention_until_s > self._now_s:
            heapq.heappush(self._deadlines, (entry.retention_until_s, entry.key))

    def on_insert(self, entry: Entry) -> None:
        self._track_deadline(entry)
        super().on_insert(entry)

    def on_access(self, entry: Entry) -> None:
        self._track_deadline(entry)
        super().on_access(entry)

    def _expire(self, now_s: float) -> None:
        self._now_s = max(self._now_s, now_s)
        while self._deadlines and self._deadlines[0][0] <= self._now_s:
            until, key = heapq.heappop(self._deadlines)
            e = self._entries.get(key)
            if e is not None and e.retention_until_s == until:
                self._push(e)  # its priority just fell back to the default

    def victim(self, now_s: float) -> Entry | None:
        self._expire(now_s)
        return super().victim(now_s)

    def victims(self, now_s: float) -> Iterator[Entry]:
        self._expire(now_s)  # before the walk: it pushes onto the heap being walked
        return super().victims(now_s)


class LineageGDSFPolicy(HeapPolicy):
    """Leaf-first Greedy-Dual-Size-Frequency, tuned for prefix KV caches.

    value = L + access_count x cost / size, with
      cost = tokens x (1 + depth_weight x depth)   recompute cost grows with the prefix it attends
      x (1 + spread_bonus x (tenants - 1))          chunks shared by tenants serve more requests
    ``L`` is raised to each victim's value, so a chunk must keep being used to stay (aging).
    """

    name = "lineage-gdsf"

    def __init__(self, *, depth_weight: float = 0.0, spread_bonus: float = 0.5) -> None:
        super().__init__()
        self.depth_weight = depth_weight
        self.spread_bonus = spread_bonus
        self._inflation = 0.0

    def rank(self, entry: Entry) -> tuple[float, ...]:
        cost = max(entry.tokens, 1) * (1.0 + self.depth_weight * entry.depth)
        spread = 1.0 + self.spread_bonus * max(len(entry.tenants) - 1, 0)
        value = entry.access_count * cost * spread / entry.size_bytes
        return (self._inflation + value, entry.last_tick)

    def eligible(self, entry: Entry) -> bool:
        return entry.children == 0

    def victim(self, now_s: float) -> Entry | None:
        e = super().victim(now_s)
        if e is not None:
            self.on_victim(e)
        return e

    def on_victim(self, entry: Entry) -> None:
        rank = self._ranks.get(entry.key)
        if rank is not None:
            self._inflation = max(self._inflation, rank[0])


class LineageLRU2Policy(HeapPolicy):
    """Leaf-first LRU-2 with a history of recently seen keys (O'Neil et al.'s LRU-K, K = 2).

    A leaf's rank is ``(previous access, last access)`` on the store's logical clock, lowest first:
    - a chunk with no earlier access in the history ranks below every reused chunk, so chunks seen
      once go first, least recently used first: a burst of new chunks only displaces other
      one-time chunks while any are left, and cannot flush the reused working set;
    - among reused chunks, the one whose previous access is oldest goes first: a short gap between
      its last two uses predicts an early next use (checked on the Mooncake trace: a block last
      reused within 1k block accesses is reused within 4k again about half the time, against
      about a fifth after a gap over 8k, and 6% for a block seen for the first time).
    Only leaves (no cached child) are eligible, as in ``lineage-lru``: a chunk is reachable only
    through its whole prefix, and a parent is accessed whenever a child is, so its rank is at
    least its children's anyway.

    The history maps a key to its last two access ticks and outlives the entry, because
    ``Entry.access_count`` restarts at 1 when a chunk returns after eviction. It keeps the most
    recently accessed ``history_factor`` x (most entries this tier has held) keys, at least
    ``min_history``: enough to recognise reuse over several cache lifetimes, bounded in memory,
    and it ages out old reuse on its own (a chunk whose previous access fell out of the history
    counts as seen once). Moves between tiers and unpinning are not accesses: a chunk whose last
    tick is unchanged keeps its record. The policy never bypasses (``admit`` stays True):
    refusing one-time chunks on a full tier measured worse, as they still serve reuse that comes
    soon after (a prompt resent, a follow-up turn). Every operation is O(log n) (the heap) or O(1).
    """

    name = "lineage-lru2"
    _NEVER = -1  # "no earlier access": below every tick (ticks start at 1)

    def __init__(self, *, history_factor: int = 8, min_history: int = 1024) -> None:
        super().__init__()
        if history_factor < 1 or min_history < 1:
            raise InvalidArgument("history_factor and min_history must be at least 1")
        self.history_factor = history_factor
        self.min_history = min_history
        # key -> (last access tick, previous access tick), least recently accessed first
        self._history: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._previous: dict[bytes, int] = {}  # tracked entries only
        self._peak = 0

    def _observe(self, entry: Entry) -> None:
        key = entry.key
        record = self._history.pop(key, None)
        if record is None:
            previous = self._NEVER
        elif record[0] == entry.last_tick:
            previous = record[1]  # moved between tiers or unpinned: not a new access
        else:
            previous = record[0]
        self._history[key] = (entry.last_tick, previous)
        self._previous[key] = previous
        limit = max(self.history_factor * self._peak, self.min_history)
        while len(self._history) > limit:
            self._history.popitem(last=False)

    def rank(self, entry: Entry) -> tuple[float, ...]:
        return (self._previous.get(entry.key, self._NEVER), entry.last_tick)

    def eligible(self, entry: Entry) -> bool:
        return entry.children == 0

    def on_insert(self, entry: Entry) -> None:
        self._observe(entry)
        super().on_insert(entry)
        self._peak = max(self._peak, len(self._entries))

    def on_access(self, entry: Entry) -> None:
        self._observe(entry)
        super().on_access(entry)

    def on_remove(self, entry: Entry) -> None:
        super().on_remove(entry)
        self._previous.pop(entry.key, None)


class BeladyPolicy(HeapPolicy):
    """Offline optimum: evict the chunk whose next use is farthest; bypass a newcomer whose
    next use is farther than every cached chunk's. ``next_use`` is the oracle, kept by the
    simulator: key -> position of that key's next access (``math.inf`` if none), updated just
    before each access, so a chunk's rank changes only when it is accessed."""

    name = "belady"

    def __init__(self, next_use: Mapping[bytes, float]) -> None:
        super().__init__()
        self._next_use = next_use

    def rank(self, entry: Entry) -> tuple[float, ...]:
        return (-self._next_use[entry.key],)

    def admit(self, entry: Entry, now_s: float) -> bool:
        top = self.victim(now_s)
        return top is None or self._ranks[top.key][0] < -self._next_use[entry.key]


# --- admission --------------------------------------------------------------------------------


class AdmissionPolicy:
    """Admits everything. Subclasses gate which chunks may enter a tier."""

    name: ClassVar[str] = "all"

    def admit(self, entry: Entry) -> bool:
        return True

    def on_drop(self, entry: Entry) -> None:
        """A chunk left the store entirely (so a later return can be recognised)."""


class FrequencyAdmission(AdmissionPolicy):
    """Admit a chunk once it has been accessed ``min_accesses`` times, counting the accesses it
    had before an earlier drop (a bounded ghost list remembers them)."""

    name = "frequency"

    def __init__(self, min_accesses: int = 2, ghost_entries: int = 1 << 16) -> None:
        if min_accesses < 1:
            raise InvalidArgument("min_accesses must be at least 1")
        self.min_accesses = min_accesses
        self.ghost_entries = ghost_entries
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()
        self.refused = 0

    def admit(self, entry: Entry) -> bool:
        seen = entry.access_count + self._ghosts.get(entry.key, 0)
        if seen >= self.min_accesses:
            return True
        self.refused += 1
        return False

    def on_drop(self, entry: Entry) -> None:
        self._ghosts[entry.key] = self._ghosts.pop(entry.key, 0) + entry.access_count
        if len(self._ghosts) > self.ghost_entries:
            self._ghosts.popitem(last=False)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (LRUPolicy, LineageLRUPolicy, PriorityPolicy, LineageGDSFPolicy, LineageLRU2Policy)
}
ADMISSION_POLICIES: dict[str, type[AdmissionPolicy]] = {
    cls.name: cls for cls in (AdmissionPolicy, FrequencyAdmission)
}


def _make(registry: Mapping[str, type[T]], kind: str, name: str) -> T:
    try:
        return registry[name]()
    except KeyError:
        raise InvalidArgument(
            f"unknown {kind} policy {name!r}; choose from {', '.join(registry)}"
        ) from None


def make_eviction_policy(name: str) -> EvictionPolicy:
    return _make(EVICTION_POLICIES, "eviction", name)


def make_admission_policy(name: str) -> AdmissionPolicy:
    return _make(ADMISSION_POLICIES, "admission", name)


__all__ = [
    "ADMISSION_POLICIES",
    "DEFAULT_PRIORITY",
    "EVICTION_POLICIES",
    "AdmissionPolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "FrequencyAdmission",
    "HeapPolicy",
    "LRUPolicy",
    "LineageGDSFPolicy",
    "LineageLRU2Policy",
    "LineageLRUPolicy",
    "PriorityPolicy",
    "make_admission_policy",
    "make_eviction_policy",
]
