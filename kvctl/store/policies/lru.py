"""``lru`` (least recently used, the baseline) and ``lineage-lru`` (leaf-first LRU)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvctl.store.index import Entry
from kvctl.store.policies.base import EvictionPolicy, HeapPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"
    accesses_deferrable = True

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


class LineageLRUPolicy(HeapPolicy):
    name = "lineage-lru"
    accesses_deferrable = True

    def rank(self, entry: Entry) -> tuple[float, ...]:
        return (entry.last_tick,)

    def eligible(self, entry: Entry) -> bool:
        return entry.children == 0
