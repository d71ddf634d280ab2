"""``lineage-lru2``: leaf-first LRU-2 with a history of recently seen keys."""

from __future__ import annotations

from collections import OrderedDict

from kvctl.store.errors import InvalidArgument
from kvctl.store.index import Entry
from kvctl.store.policies.base import HeapPolicy


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
    accesses_deferrable = True
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
            self._forget(self._history.popitem(last=False)[0])

    def _forget(self, key: bytes) -> None:
        """``key`` left the history (a subclass drops what it keeps per key with it)."""

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
