"""``lineage-gdsf``: leaf-first Greedy-Dual-Size-Frequency."""

from __future__ import annotations

from kvctl.store.index import Entry
from kvctl.store.policies.base import HeapPolicy


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
