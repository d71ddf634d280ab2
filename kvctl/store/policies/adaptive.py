"""``lineage-adaptive``: follow whichever leaf-first policy would be winning on this workload now.

No single policy wins everywhere: ``lineage-lru2`` leads when one-time chunks flood the cache
(the Mooncake trace at 1%, the rag generator), ``lineage-lru`` when recency is everything (the
chat generator), ``lineage-arc`` in between. This policy runs each candidate on a *shadow* cache:
metadata only (an ``Entry`` per chunk, no bytes), of the real tier's capacity, fed the same
accesses (every ``on_insert`` that is a new access, and every ``on_access``), evicting on its own
with leaf-first lineage like the store. A hit in a shadow scores the chunk's recompute cost
(``tokens x (1 + prefix tokens / attention_tokens)``: a deep chunk saves more prefill), decayed
so that the last ``window_factor`` x (capacity in chunks) accesses count (set dueling with
exponential forgetting). The real tier follows the *leader*, the shadow with the highest score;
another shadow takes the lead only when it beats the leader by ``margin`` (hysteresis, so noise
does not make the real cache thrash between orders).

The real tier's victims are, in order:

1. leaves the leader's shadow does not hold (oldest eviction from the shadow first): the leader
   already evicted them, so the real cache converges to the leader's shadow after a switch, and
   then holds what that policy alone would have held;
2. leaves in the order the leader's shadow would evict them next;
3. the chunk stored or read last (the parent of the chunk being stored next in the same request:
   taking it would orphan that chunk), then the chunks with children (the fallback, oldest first).

A chunk is never a victim while it has a cached child unless nothing else is left, as in the other
lineage policies. The tier's capacity is not known to a policy: it is taken as the bytes tracked
when the store first asks for victims (as ``lineage-arc`` does), raised if more is tracked later;
until then the shadows evict nothing, so they hold what the real tier holds. A chunk that left
without an eviction (pinned, read without the lock, moved) and comes back with the same tick is
not a new access. Cost per access: one update of each candidate's shadow (O(log n) each) and O(1)
for the real tier's bookkeeping; per eviction, O(log n) while the first victims hold.
Deterministic: no randomness, ties go to the earlier candidate.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from kvctl.store.errors import InvalidArgument
from kvctl.store.index import Entry
from kvctl.store.policies.arc import LineageARCPolicy
from kvctl.store.policies.base import EvictionPolicy
from kvctl.store.policies.lru import LineageLRUPolicy
from kvctl.store.policies.lru2 import LineageLRU2Policy

#: the candidates, in tie-break order: the agent's former default first
DEFAULT_CANDIDATES: tuple[Callable[[], EvictionPolicy], ...] = (
    LineageLRU2Policy,
    LineageARCPolicy,
    LineageLRUPolicy,
)
#: away keys remembered before the tier's size is known, and at least ever after
_MIN_AWAY = 64
#: leaves read from the front of the "not in the leader's shadow" list per victims walk: it is in
#: shadow-eviction order, so its front holds leaves unless the real tier kept a chain the shadow
#: dropped whole (its parents come first); past this many, the leader's own order takes over
_DIFF_SCAN = 64
#: scores are kept multiplied by a growing scale instead of decaying each one per access; they
#: are divided back down when the scale passes this
_RESCALE_AT = 1e150


class _Shadow:
    """One candidate policy over a metadata-only cache of the real tier's capacity."""

    __slots__ = ("bytes", "entries", "evicted", "orphans", "policy", "score")

    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        self.entries: dict[bytes, Entry] = {}
        self.bytes = 0
        #: cached-children counts of keys not held here (a child outlived its parent)
        self.orphans: dict[bytes, int] = {}
        self.score = 0.0
        #: keys evicted by the last ``access`` (only read for the leader)
        self.evicted: list[bytes] = []

    def access(self, entry: Entry, capacity_bytes: int) -> bool:
        """Replay one access of ``entry``; whether it was a hit here."""
        s = self.entries.get(entry.key)
        if s is not None:
            s.last_tick = entry.last_tick
            s.access_count += 1
            self.policy.on_access(s)
            return True
        self.evicted.clear()
        if capacity_bytes:
            while self.entries and self.bytes + entry.size_bytes > capacity_bytes:
                v = self.policy.victim(0.0)
                if v is None:
                    break
                self.policy.on_victim(v)
                self._drop(v)
                self.evicted.append(v.key)
        s = Entry(
            key=entry.key,
            tier="shadow",
            size_bytes=entry.size_bytes,
            tokens=entry.tokens,
            tenant=entry.tenant,
            parent=entry.parent,
            last_tick=entry.last_tick,
            depth=entry.depth,
        )
        s.children = self.orphans.pop(entry.key, 0)
        self.entries[entry.key] = s
        self.bytes += entry.size_bytes
        self._link(s.parent, +1)
        self.policy.on_insert(s)
        return False

    def _drop(self, v: Entry) -> None:
        self.policy.on_remove(v)
        del self.entries[v.key]
        self.bytes -= v.size_bytes
        if v.children:  # evicted with children (the fallback): they still count on return
            self.orphans[v.key] = v.children
        self._link(v.parent, -1)

    def _link(self, parent: bytes | None, delta: int) -> None:
        if parent is None:
            return
        p = self.entries.get(parent)
        if p is None:
            n = self.orphans.get(parent, 0) + delta
            if n > 0:
                self.orphans[parent] = n
            else:
                self.orphans.pop(parent, None)
            return
        p.children += delta
        if p.children == 0 or p.children == delta:  # became a leaf, or stopped being one
            self.policy.on_children_changed(p)


class LineageAdaptivePolicy(EvictionPolicy):
    """Leaf-first; follows the candidate whose shadow cache scores best. See the module
    docstring."""

    name = "lineage-adaptive"

    def __init__(
        self,
        *,
        candidates: Sequence[Callable[[], EvictionPolicy]] = DEFAULT_CANDIDATES,
        window_factor: float = 4.0,
        margin: float = 0.02,
        attention_tokens: float = 30_000.0,
        converge: bool = True,
    ) -> None:
        if not candidates:
            raise InvalidArgument("give at least one candidate policy")
        if not window_factor > 0:
            raise InvalidArgument(f"window_factor must be positive, got {window_factor}")
        if not margin >= 0:
            raise InvalidArgument(f"margin must be at least 0, got {margin}")
        if not attention_tokens > 0:
            raise InvalidArgument(f"attention_tokens must be positive, got {attention_tokens}")
        self.window_factor = window_factor
        self.margin = margin
        self.attention_tokens = attention_tokens
        self.converge = converge
        self._shadows = [_Shadow(make()) for make in candidates]
        #: each candidate also orders the real tier's chunks, ready to lead
        self._real = [make() for make in candidates]
        self._leader = 0
        self._tracked: dict[bytes, Entry] = {}
        self._tracked_bytes = 0
        #: tracked keys the leader's shadow does not hold, in the order it dropped them
        self._diff: OrderedDict[bytes, Entry] = OrderedDict()
        #: keys that left without an eviction -> their last tick (to tell a return from an access)
        self._away: OrderedDict[bytes, int] = OrderedDict()
        self._evicting: bytes | None = None
        self._capacity_bytes = 0
        self._peak_entries = 0
        self._newest_tick = 0
        self._scale = 1.0
        self._growth = 1.0  # per access, set once the capacity is known

    # --- what the store tells the policy ---------------------------------------------------
    @property
    def leader(self) -> str:
        """The name of the candidate the real tier follows now."""
        return self._shadows[self._leader].policy.name

    def scores(self) -> dict[str, float]:
        """Each candidate's decayed, cost-weighted shadow hits (relative: for comparisons)."""
        return {s.policy.name: s.score / self._scale for s in self._shadows}

    def on_insert(self, entry: Entry) -> None:
        key = entry.key
        away_tick = self._away.pop(key, None)
        self._tracked[key] = entry
        self._tracked_bytes += entry.size_bytes
        self._peak_entries = max(self._peak_entries, len(self._tracked))
        for p in self._real:
            p.on_insert(entry)
        if away_tick != entry.last_tick:  # a new access, not a return from a pin or a read
            self._observe(entry)
        if key not in self._shadows[self._leader].entries:
            self._diff[key] = entry

    def on_access(self, entry: Entry) -> None:
        if entry.key in self._tracked:
            for p in self._real:
                p.on_access(entry)
            self._observe(entry)

    def on_remove(self, entry: Entry) -> None:
        key = entry.key
        if self._tracked.pop(key, None) is None:
            return
        self._tracked_bytes -= entry.size_bytes
        self._diff.pop(key, None)
        for p in self._real:
            p.on_remove(entry)
        if key == self._evicting:
            self._evicting = None
            return
        self._away[key] = entry.last_tick
        while len(self._away) > max(self._peak_entries, _MIN_AWAY):
            self._away.popitem(last=False)

    def on_children_changed(self, entry: Entry) -> None:
        if entry.key in self._tracked:
            for p in self._real:
                p.on_children_changed(entry)

    def on_victim(self, entry: Entry) -> None:
        self._evicting = entry.key
        for p in self._real:
            p.on_victim(entry)

    # --- victims ---------------------------------------------------------------------------
    def victim(self, now_s: float) -> Entry | None:
        return next(self.victims(now_s), None)

    def victims(self, now_s: float) -> Iterator[Entry]:
        if self._tracked_bytes > self._capacity_bytes:  # asked for room: the tier is full
            self._capacity_bytes = self._tracked_bytes
            window = self.window_factor * max(len(self._tracked), 1)
            self._growth = 1.0 / (1.0 - 1.0 / max(window, 2.0))
        walks = [p.victims(now_s) for p in self._real]  # lineage-arc learns the capacity here
        return self._walk(now_s, walks[self._leader])

    def _walk(self, now_s: float, leader: Iterator[Entry]) -> Iterator[Entry]:
        newest = self._newest_tick
        yielded: set[bytes] = set()
        if self.converge:
            for e in itertools.islice(self._diff.values(), _DIFF_SCAN):
                if e.children == 0 and e.last_tick < newest:
                    yielded.add(e.key)
                    yield e
        if not yielded:
            yield from leader
            return
        for e in leader:
            if e.key not in yielded:
                yield e

    def __len__(self) -> int:
        return len(self._tracked)

    # --- helpers ---------------------------------------------------------------------------
    def _observe(self, entry: Entry) -> None:
        """One access: replay it in every shadow, score their hits, maybe change the leader."""
        self._newest_tick = max(self._newest_tick, entry.last_tick)
        weight = entry.tokens * (1.0 + (entry.depth + 0.5) * entry.tokens / self.attention_tokens)
        gain = max(weight, 1.0) * self._scale
        leader = self._shadows[self._leader]
        for s in self._shadows:
            if s.access(entry, self._capacity_bytes):
                s.score += gain
        for k in leader.evicted:
            e = self._tracked.get(k)
            if e is not None:
                self._diff[k] = e
        self._diff.pop(entry.key, None)  # the leader holds it now
        leader.evicted.clear()
        self._scale *= self._growth
        if self._scale > _RESCALE_AT:
            for s in self._shadows:
                s.score /= self._scale
            self._scale = 1.0
        self._maybe_switch()

    def _maybe_switch(self) -> None:
        best = max(range(len(self._shadows)), key=lambda i: self._shadows[i].score)
        if best == self._leader:
            return
        if self._shadows[best].score <= self._shadows[self._leader].score * (1.0 + self.margin):
            return
        self._leader = best
        held = self._shadows[best].entries
        diff = sorted(
            (e for k, e in self._tracked.items() if k not in held), key=lambda e: e.last_tick
        )
        self._diff = OrderedDict((e.key, e) for e in diff)
