"""``lineage-arc``: Adaptive Replacement Cache (Megiddo and Modha, FAST'03) over prefix chains.

ARC keeps two lists: T1, chunks seen once recently, and T2, chunks seen at least twice. It evicts
from T1 while T1 holds more than a target share ``p`` of the tier, else from T2, least recently
used first in each. Two ghost lists remember the keys each list evicted: a chunk that comes back
from T1's ghosts would have been a hit had T1 been larger, so ``p`` grows (by the ghosts'
size ratio, at least one chunk); one from T2's ghosts shrinks it. The split between recency and
frequency therefore follows the workload as it changes, with O(1) work per access, where
``lru`` (all recency) and ``lineage-lru2`` (all frequency) each win on some workloads and
capacities and lose on others.

What changes for a KV prefix cache:

- leaf-first: only chunks with no cached child are candidates (a chunk is reachable only through
  its whole prefix), the chosen list's leaves first, then the other list's, then anything (as
  ``lineage-lru`` does when every chunk here has children in another tier);
- the chunk stored or read last is taken only when no other leaf is left: it is the parent of
  the chunk being stored next in the same request, and evicting it would orphan that chunk;
- sizes are bytes, so ``p`` and the lists' shares hold for chunks of any size;
- a chunk that left without being evicted (pinned, read without the lock, moved between tiers,
  deleted) comes back to the list it left, and a ghost is only recorded for an eviction.

The tier's capacity is not known to a policy: it is taken as the bytes tracked when the store first
asks for victims (the tier is full then), raised if more is tracked later. ``p`` starts at
``initial_t1_ratio`` of it: 0 as in ARC, so the tier starts out like ``lineage-lru2`` (chunks seen
once go first) until ghost hits say otherwise (on the Mooncake trace 0 measured better than half at
2-50% of the unique blocks, and half better on the chat generator at 5-20%). Ghost lists together
hold at most ``2 x ghost_factor`` times as many keys as the tier held chunks at most.
Deterministic: no randomness, so the simulator and the agent make the same decisions on the same
sequence of calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvctl.store.errors import InvalidArgument
from kvctl.store.index import Entry
from kvctl.store.policies.base import EvictionPolicy
from kvctl.store.policies.lru import LineageLRUPolicy

#: the lists: chunks seen once recently, and chunks seen at least twice
T1, T2 = 1, 2
#: ghosts kept before the tier's size is known, and at least ever after
_MIN_GHOSTS = 64


class LineageARCPolicy(EvictionPolicy):
    """Leaf-first ARC; see the module docstring."""

    name = "lineage-arc"
    accesses_deferrable = True

    def __init__(self, *, ghost_factor: float = 1.0, initial_t1_ratio: float = 0.0) -> None:
        if not ghost_factor > 0:
            raise InvalidArgument(f"ghost_factor must be positive, got {ghost_factor}")
        if not 0 <= initial_t1_ratio <= 1:
            raise InvalidArgument(f"initial_t1_ratio must be in [0, 1], got {initial_t1_ratio}")
        self.ghost_factor = ghost_factor
        self.initial_t1_ratio = initial_t1_ratio
        # each list is leaf-first LRU over its own chunks
        self._lists = {T1: LineageLRUPolicy(), T2: LineageLRUPolicy()}
        self._bytes = {T1: 0, T2: 0}
        self._member: dict[bytes, int] = {}  # tracked key -> T1 or T2
        self._ghosts: dict[int, OrderedDict[bytes, None]] = {T1: OrderedDict(), T2: OrderedDict()}
        #: keys that left without an eviction -> (the list they were in, their last tick)
        self._away: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._target_t1_bytes = 0.0
        self._capacity_bytes = 0
        self._peak_entries = 0
        self._newest_tick = 0

    # --- what the store tells the policy ---------------------------------------------------
    def on_insert(self, entry: Entry) -> None:
        key = entry.key
        self._newest_tick = max(self._newest_tick, entry.last_tick)
        away = self._away.pop(key, None)
        if key in self._ghosts[T1]:
            self._adapt(T1, key)
            lst = T2
        elif key in self._ghosts[T2]:
            self._adapt(T2, key)
            lst = T2
        elif away is not None:
            # back from a pin, a read or another tier: the same list, unless it was accessed
            lst = away[0] if away[1] == entry.last_tick else T2
        else:
            lst = T1
        self._track(entry, lst)
        self._peak_entries = max(self._peak_entries, len(self._member))

    def on_access(self, entry: Entry) -> None:
        self._newest_tick = max(self._newest_tick, entry.last_tick)
        lst = self._member.get(entry.key)
        if lst == T1:  # seen twice now
            self._untrack(entry)
            self._track(entry, T2)
        elif lst == T2:
            self._lists[T2].on_access(entry)

    def on_remove(self, entry: Entry) -> None:
        lst = self._untrack(entry)
        if lst is not None and entry.key not in self._ghosts[lst]:  # not an eviction
            self._away[entry.key] = (lst, entry.last_tick)
            while len(self._away) > max(self._peak_entries, _MIN_GHOSTS):
                self._away.popitem(last=False)

    def on_children_changed(self, entry: Entry) -> None:
        lst = self._member.get(entry.key)
        if lst is not None:
            self._lists[lst].on_children_changed(entry)

    def on_victim(self, entry: Entry) -> None:
        lst = self._member.get(entry.key)
        if lst is None:
            return
        ghosts = self._ghosts[lst]
        ghosts[entry.key] = None
        other = self._ghosts[T2 if lst == T1 else T1]
        other.pop(entry.key, None)
        limit = max(int(2 * self.ghost_factor * self._peak_entries), _MIN_GHOSTS)
        while len(self._ghosts[T1]) + len(self._ghosts[T2]) > limit:
            longer = T1 if len(self._ghosts[T1]) > len(self._ghosts[T2]) else T2
            self._ghosts[longer].popitem(last=False)

    # --- victims ---------------------------------------------------------------------------
    def victim(self, now_s: float) -> Entry | None:
        return next(self.victims(now_s), None)

    def victims(self, now_s: float) -> Iterator[Entry]:
        """The chosen list's leaves (least recently used first), then the other list's, then
        the newest chunk, then the chunks with children (the fallback)."""
        tracked = self._bytes[T1] + self._bytes[T2]
        if tracked > self._capacity_bytes:  # asked for room: the tier is full
            if not self._capacity_bytes:
                self._target_t1_bytes = self.initial_t1_ratio * tracked
            self._capacity_bytes = tracked
        first = T1 if self._bytes[T1] and self._bytes[T1] > self._target_t1_bytes else T2
        if not self._bytes[first]:
            first = T1 if first == T2 else T2
        second = T2 if first == T1 else T1
        return self._walk(first, second, now_s)

    def _walk(self, first: int, second: int, now_s: float) -> Iterator[Entry]:
        newest: list[Entry] = []
        fallback: list[Iterator[Entry]] = []
        for lst in (first, second):
            walk = self._lists[lst].victims(now_s)  # leaves first, then the others
            for e in walk:
                if e.children:  # this list's leaves are done
                    fallback.append(_prepend(e, walk))
                    break
                if e.last_tick >= self._newest_tick:
                    newest.append(e)
                    continue
                yield e
        yield from newest
        for walk in fallback:
            yield from walk

    def __len__(self) -> int:
        return len(self._member)

    # --- helpers ---------------------------------------------------------------------------
    def _track(self, entry: Entry, lst: int) -> None:
        self._member[entry.key] = lst
        self._bytes[lst] += entry.size_bytes
        self._lists[lst].on_insert(entry)

    def _untrack(self, entry: Entry) -> int | None:
        lst = self._member.pop(entry.key, None)
        if lst is not None:
            self._bytes[lst] -= entry.size_bytes
            self._lists[lst].on_remove(entry)
        return lst

    def _adapt(self, hit_ghost: int, key: bytes) -> None:
        """``key`` came back from ``hit_ghost``: move the target toward the list that lost it,
        by the other ghost list's size over this one's (ARC's step), at least one chunk, in
        bytes of the mean tracked chunk."""
        g1, g2 = len(self._ghosts[T1]), len(self._ghosts[T2])
        tracked = self._bytes[T1] + self._bytes[T2]
        chunk_bytes = tracked / len(self._member) if self._member else 1.0
        cap = float(self._capacity_bytes or tracked)
        if hit_ghost == T1:
            step = max(g2 / g1, 1.0) if g1 else 1.0
            self._target_t1_bytes = min(self._target_t1_bytes + step * chunk_bytes, cap)
        else:
            step = max(g1 / g2, 1.0) if g2 else 1.0
            self._target_t1_bytes = max(self._target_t1_bytes - step * chunk_bytes, 0.0)
        del self._ghosts[hit_ghost][key]


def _prepend(first: Entry, rest: Iterator[Entry]) -> Iterator[Entry]:
    yield first
    yield from rest
