"""``belady``: the offline optimum, for simulation only (it needs an oracle of future accesses)."""

from __future__ import annotations

from collections.abc import Mapping

from kvctl.store.index import Entry
from kvctl.store.policies.base import HeapPolicy


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
