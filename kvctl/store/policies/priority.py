"""``priority``: lowest retention priority first, LRU within a priority."""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvctl.store.index import Entry
from kvctl.store.policies.base import HeapPolicy


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
