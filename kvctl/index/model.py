"""The index's interface and its in-process implementation.

Both implementations keep, per chunk key, which nodes hold it and in which tier, with the
holder's tenant and isolation; ``holders`` answers for a chain of keys, filtered for the asking
tenant. Applying an event is idempotent (a stored event sets the node's entry, a removed one
deletes it), so replaying events a resync already reflects changes nothing.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from kvctl.index.events import ChunkEvent

#: ``NODE#ENGINE``: an engine's own cache on NODE, indexed beside NODE's agent (see ``owner``)
ENGINE_SEPARATOR = "#"


def engine_index_name(node: str, engine: str = "vllm") -> str:
    """The index name of ``engine``'s own cache on ``node`` (its KV events' publisher)."""
    return f"{node}{ENGINE_SEPARATOR}{engine}"


def owner(index_name: str) -> str:
    """The serving node an index name belongs to: ``gpu-07#vllm`` -> ``gpu-07``."""
    return index_name.partition(ENGINE_SEPARATOR)[0]


def owners(index_names: Iterable[str]) -> set[str]:
    """The serving nodes ``index_names`` belong to (``gpu-07`` and ``gpu-07#vllm``: one)."""
    return {owner(name) for name in index_names}


@dataclass(frozen=True, slots=True)
class Holding:
    """One node's copy of a chunk, as the index last heard of it."""

    node: str
    tier: str
    size_bytes: int
    tokens: int

    @property
    def engine_cache(self) -> bool:
        """Held in an engine's own memory (``NODE#ENGINE``): only NODE can use it."""
        return ENGINE_SEPARATOR in self.node


#: ``NodeCheck.damage``: some entries the node's key set lists are gone (evicted or deleted)
DAMAGE_ENTRIES = "entries"
#: ``NodeCheck.damage``: the node's entry count disagrees with its key set (the set, or the
#: count, was evicted or deleted): entries the set no longer lists may linger
DAMAGE_COUNT = "count"


class NodeCheck(NamedTuple):
    """One look at whether the index still holds a node's entries whole (``FleetIndex.check``)."""

    #: the node's marker (see ``FleetIndex.marker``)
    marker: str | None
    #: "" when nothing is wrong in what was looked at, else ``DAMAGE_ENTRIES`` or
    #: ``DAMAGE_COUNT``: the index lost part of the node's entries, though not its marker
    damage: str
    #: where the next check's audit resumes (0: a pass over the node's entries starts again)
    cursor: int
    #: entries this check audited
    audited: int


class _Entry(NamedTuple):
    """A node's copy of a chunk. A tuple, not a frozen dataclass: one is made per stored
    event, and a tuple builds in about a third of the time (the index's update rate)."""

    tier: str
    tenant: str
    isolated: bool
    size_bytes: int
    tokens: int

    def visible_to(self, tenant: str) -> bool:
        return not self.isolated or self.tenant == tenant


@runtime_checkable
class FleetIndex(Protocol):
    """What the router, the followers and the agents use; see the module."""

    def apply(self, node: str, events: Iterable[ChunkEvent]) -> int:
        """Apply ``node``'s events in order; returns how many were applied."""
        ...

    def replace(self, node: str, chunks: Iterable[ChunkEvent]) -> int:
        """Make ``chunks`` (stored events) the node's whole holding (a resync); returns its
        entries. Leaves the node a marker (see ``marker``) when it has none."""
        ...

    def drop(self, node: str) -> int:
        """Forget everything ``node`` held (it left the fleet, or, in an index private to one
        router, stopped answering), its marker too; returns the entries dropped."""
        ...

    def marker(self, node: str) -> str | None:
        """The marker the node's last ``replace`` left (kept, not renewed, by later ones: two
        routers resyncing one node into a shared index agree on it). None: no resync wrote the
        node, or the index lost it (a Redis restarted empty, flushed, or evicting): a follower
        that saw another marker at its own resync then knows the entries it wrote are gone."""
        ...

    def check(self, node: str, *, cursor: int = 0, limit: int = 0) -> NodeCheck:
        """Whether the index still holds the node's entries whole, in one cheap call: its
        marker, whether its entry count agrees with its key set, and (a rolling audit) whether
        up to about ``limit`` of the entries its set lists, from ``cursor`` on, are still there.
        Catches what the marker cannot: part of a node's entries evicted or deleted."""
        ...

    def purge(self, node: str) -> int:
        """Forget everything ``node`` held without trusting its key set (which a ``DAMAGE_COUNT``
        says was lost): a scan of the whole index. Keeps its marker; returns entries dropped."""
        ...

    def holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
        """For each key, the nodes holding it that ``tenant`` may see (node name order)."""
        ...

    def nodes(self) -> dict[str, int]:
        """Each node with entries, and how many."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ClaimingIndex(Protocol):
    """A shared index (Redis) in which every router claims the nodes it knows, again and again:
    a node no router claimed for a while is one no running router follows, so one that a
    router whose inventory does not name it may drop (``kvctl.router.inventory``). Without it,
    a router on a stale copy of the fleet database, or a developer's with one node of its own,
    dropped every node the others follow, at each of its rereads."""

    def claim(self, claimant: str, nodes: Iterable[str]) -> None:
        """Say that the running router ``claimant`` (its instance id) knows ``nodes`` now (the
        index's clock), in place of what it claimed before."""
        ...

    def claims(self, *, excluding: str = "") -> dict[str, float]:
        """Each node a router other than ``excluding`` claimed, and how long ago that router's
        last claim was, in seconds (the index's clock; its youngest of them)."""
        ...


class EmbeddedIndex:
    """The index in this process's memory (the default): dicts under one lock."""

    kind = "embedded"
    #: private to this process: a router may drop what it alone reads (``Follower``)
    shared = False

    def __init__(self) -> None:
        self._by_key: dict[bytes, dict[str, _Entry]] = {}
        self._by_node: dict[str, set[bytes]] = {}
        #: each looked-up key's holders in node order, with the entry that says who may see
        #: them: a router asks for the same prefixes again and again, and building the sorted
        #: Holdings is most of an answer's time. Dropped whenever the key's entries change.
        self._answers: dict[bytes, tuple[tuple[Holding, _Entry], ...]] = {}
        self._markers: dict[str, str] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Entries (one per node and chunk)."""
        with self._lock:
            return sum(len(keys) for keys in self._by_node.values())

    def apply(self, node: str, events: Iterable[ChunkEvent]) -> int:
        n = 0
        with self._lock:
            # stored events, most of a stream, inline with their lookups hoisted: the router
            # applies every agent's events on one lock
            by_key, answers, entry = self._by_key, self._answers, _Entry
            held_here: set[bytes] | None = None
            for e in events:
                n += 1
                if e.kind == "stored":
                    key = e.key
                    answers.pop(key, None)
                    held = by_key.get(key)
                    if held is None:
                        held = by_key[key] = {}
                    held[node] = entry(e.tier, e.tenant, e.isolated, e.size_bytes, e.tokens)
                    if held_here is None:
                        held_here = self._by_node.setdefault(node, set())
                    held_here.add(key)
                else:
                    self._apply_locked(node, e)
                    held_here = None  # a removal or a clear may have dropped the node's set
        return n

    def _apply_locked(self, node: str, e: ChunkEvent) -> None:
        self._answers.pop(e.key, None)
        if e.kind == "stored":
            self._by_key.setdefault(e.key, {})[node] = _Entry(
                e.tier, e.tenant, e.isolated, e.size_bytes, e.tokens
            )
            self._by_node.setdefault(node, set()).add(e.key)
        elif e.kind == "removed":
            held = self._by_key.get(e.key)
            if held is not None and held.pop(node, None) is not None:
                if not held:
                    del self._by_key[e.key]
                keys = self._by_node[node]
                keys.discard(e.key)
                if not keys:
                    del self._by_node[node]
        else:
            self._drop_locked(node)

    def replace(self, node: str, chunks: Iterable[ChunkEvent]) -> int:
        with self._lock:
            self._drop_locked(node)
            for e in chunks:
                self._apply_locked(node, e)
            self._markers.setdefault(node, uuid.uuid4().hex)
            return len(self._by_node.get(node, ()))

    def drop(self, node: str) -> int:
        with self._lock:
            self._markers.pop(node, None)
            return self._drop_locked(node)

    def marker(self, node: str) -> str | None:
        with self._lock:
            return self._markers.get(node)

    def check(self, node: str, *, cursor: int = 0, limit: int = 0) -> NodeCheck:
        # in this process's memory nothing loses part of a node: only the marker to read
        return NodeCheck(self.marker(node), "", 0, 0)

    def purge(self, node: str) -> int:
        with self._lock:
            return self._drop_locked(node)

    def _drop_locked(self, node: str) -> int:
        keys = self._by_node.pop(node, set())
        answers = self._answers
        for key in keys:
            answers.pop(key, None)
            held = self._by_key[key]
            del held[node]
            if not held:
                del self._by_key[key]
        return len(keys)

    def holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]:
        out: list[list[Holding]] = []
        by_key, answers = self._by_key, self._answers
        with self._lock:
            for key in keys:
                answer = answers.get(key)
                if answer is None:
                    held = by_key.get(key)
                    if not held:
                        out.append([])
                        continue
                    answer = answers[key] = tuple(
                        (Holding(node, e.tier, e.size_bytes, e.tokens), e)
                        for node, e in sorted(held.items())
                    )
                # a fresh list each time: the caller may change it, the cached answer stays
                out.append([h for h, e in answer if not e.isolated or e.tenant == tenant])
        return out

    def nodes(self) -> dict[str, int]:
        with self._lock:
            return {node: len(keys) for node, keys in sorted(self._by_node.items())}

    def close(self) -> None:
        pass
