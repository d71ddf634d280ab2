"""``lineage-learned-arc``: ``lineage-arc`` whose victim among chunks seen once is picked by a reuse
model trained online from the tier's own history (``reuse_model.ReuseModel``, LRB-style).

ARC's ghost hits still decide whether the chunks seen once (T1) or the reused ones (T2) give up a
chunk. When T1 does, the model names, among the T1 leaves in a seeded sample of 64 leaves, the
one least likely to be reused within about a tier's worth of accesses, instead of the least
recently used one (none in the sample: least recently used, as ARC); T2 stays least recently
used first (the model measured worse there, as it did deciding alone: see ``reuse_model``).
Until the model's first fit (1,000 labelled samples) it is ``lineage-arc`` exactly. Leaf-first
lineage, the newest chunk last and the fallback to chunks with children are ``lineage-arc``'s.

Measured (issue 26): % of Belady's block hit ratio, ``kvctl simulate --sweep``, capacities 1, 2,
5, 10, 20 and 50% of the unique blocks, one run on the 2-core VM:

- Mooncake trace: 23.4 / 30.0 / 43.3 / 56.2 / 69.2 / 94.6 (22.7 / 30.7 / 43.1 / 55.7 / 69.2 /
  94.6 before its model stopped labelling a return past the boundary a reuse, 2026-12-02; the
  generators moved by 0.1 at most), the best policy from 5% to 50%
  (``lineage-arc`` 22.3 / 31.2 / 42.1 / 55.0 / 68.3 / 94.4; ``lineage-adaptive`` 41.6 at 5% and
  54.3 at 10%), but behind ``lineage-lru2`` at 1% (26.8) and ``lineage-arc`` at 2%;
- generators: at or above ``lineage-arc`` nearly everywhere (rag 77.8 against 74.9 at 5%, 89.9
  against 87.4 at 20%), with ``lineage-arc``'s losses: behind ``lineage-lru2`` on builtin at 1%
  (87.3 against 94.2) and ``lineage-lru`` on chat at 5-20%.

So it is not the default. Deterministic under ``seed`` (the simulator and the agent make the
same decisions on the same calls). Cost: ARC's O(1) per access plus the model's bookkeeping, a
64-leaf sample per eviction from T1, and a refit every 5,000 samples (6.4k decisions/s at 5% of
the trace against 33k for ``lineage-arc`` in one run).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvctl.store.errors import InvalidArgument
from kvctl.store.index import Entry
from kvctl.store.policies.arc import T1, LineageARCPolicy
from kvctl.store.policies.reuse_model import ReuseModel


class LineageLearnedARCPolicy(LineageARCPolicy):
    """``lineage-arc`` with a learned pick among chunks seen once; see the module docstring.
    ``model`` goes to ``ReuseModel`` (``seed``, ``sample_size``, ``retrain_every``, ...);
    ``reuse_model`` instead gives the model itself (a fresh one, not shared with another policy:
    the simulator's ``oracle-features`` passes one that records or one scored from a table)."""

    name = "lineage-learned-arc"
    accesses_deferrable = False  # its model reads the tenants a read adds after the touch

    def __init__(self, *, reuse_model: ReuseModel | None = None, **model: Any) -> None:
        super().__init__()
        if reuse_model is not None and model:
            raise InvalidArgument("give either reuse_model or its arguments, not both")
        self.model = reuse_model if reuse_model is not None else ReuseModel(**model)

    def on_insert(self, entry: Entry) -> None:
        super().on_insert(entry)
        self.model.on_insert(entry)

    def on_access(self, entry: Entry) -> None:
        super().on_access(entry)
        self.model.on_access(entry)

    def on_remove(self, entry: Entry) -> None:
        super().on_remove(entry)
        self.model.on_remove(entry)

    def on_children_changed(self, entry: Entry) -> None:
        super().on_children_changed(entry)
        self.model.on_children_changed(entry)

    def on_victim(self, entry: Entry) -> None:
        super().on_victim(entry)
        self.model.on_victim(entry)

    def victims(self, now_s: float) -> Iterator[Entry]:
        self.model.note_full()
        return super().victims(now_s)

    def _walk(self, first: int, second: int, now_s: float) -> Iterator[Entry]:
        chosen = None
        if first == T1:
            member = self._member
            chosen = self.model.pick(lambda k: member.get(k) == T1)
        if chosen is not None:
            yield chosen
        for e in super()._walk(first, second, now_s):
            if e is not chosen:
                yield e
