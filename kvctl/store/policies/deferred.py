"""Access bookkeeping taken off the read path: a policy's ``on_access`` calls queued, and replayed
in order before anything else is asked of it.

A read (a lease batch, a get) touches every chunk it serves, and the default policy
(``lineage-adaptive``) spends ~10 us per touch on its shadows and candidate orders: on a 2-core
VM a 64-chunk lookup-and-lease took ~1.0 ms with them and ~0.4 ms without. ``DeferredAccesses``
queues those calls instead; the store's settler thread replays them once the read is answered
(or the next other call to the policy does, whichever comes first). The policy sees exactly the
calls, in the order, it would have seen at once, each reading the entry as it was, so it decides
the same: each queued access keeps the entry's tick, access count and time as that access left
them, and they are put back for its replay where a later access changed them; and a policy may
only be wrapped if its ``on_access`` reads nothing else the store changes without telling the
policy (``EvictionPolicy.accesses_deferrable``: not ``lineage-gdsf``, which reads the tenants a
read adds after the touch, nor ``priority``, which reads retention deadlines). A replay puts an
entry's older values back for a moment: read ``Entry`` fields under the store's lock.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from kvctl.store.index import Entry
from kvctl.store.policies.base import EvictionPolicy

log = logging.getLogger(__name__)

#: queued accesses past which the queue is replayed in the read that adds one more (bounds the
#: memory, and what that read pays: ~10 ms for lineage-adaptive, when the settler falls behind)
MAX_QUEUED = 1024
#: accesses the settler replays per hold of the store's lock, so reads wait for no more
SETTLE_SLICE = 128
#: how often an idle settler thread checks whether its store is gone
IDLE_CHECK_SECONDS = 5.0


class DeferredAccesses(EvictionPolicy):
    """``inner`` with its ``on_access`` calls queued; see the module docstring. Not thread-safe:
    like every policy, called under the store's lock only."""

    name = "deferred"

    def __init__(
        self,
        inner: EvictionPolicy,
        *,
        wake: Callable[[], None] | None = None,
        max_queued: int = MAX_QUEUED,
    ) -> None:
        self.inner = inner
        #: called when the queue stops being empty (the store wakes its settler)
        self._wake = wake
        self._max_queued = max(1, max_queued)
        #: (entry, its tick, access count and access time as the access left them)
        self._queue: deque[tuple[Entry, int, int, float]] = deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def flush(self, limit: int | None = None) -> int:
        """Replay the queued accesses in order, at most ``limit`` of them; how many are left."""
        queue = self._queue
        on_access = self.inner.on_access
        for _ in range(len(queue) if limit is None else min(limit, len(queue))):
            e, tick, count, at_s = queue.popleft()
            if e.last_tick == tick:
                on_access(e)
                continue
            now = e.last_tick, e.access_count, e.last_access_s  # accessed again since
            e.last_tick, e.access_count, e.last_access_s = tick, count, at_s
            try:
                on_access(e)
            finally:
                e.last_tick, e.access_count, e.last_access_s = now
        return len(queue)

    def on_access(self, entry: Entry) -> None:
        if len(self._queue) >= self._max_queued:
            self.flush()
        self._queue.append((entry, entry.last_tick, entry.access_count, entry.last_access_s))
        if len(self._queue) == 1 and self._wake is not None:
            self._wake()

    def on_insert(self, entry: Entry) -> None:
        self.flush()
        self.inner.on_insert(entry)

    def on_remove(self, entry: Entry) -> None:
        self.flush()
        self.inner.on_remove(entry)

    def on_children_changed(self, entry: Entry) -> None:
        self.flush()
        self.inner.on_children_changed(entry)

    def on_victim(self, entry: Entry) -> None:
        self.flush()
        self.inner.on_victim(entry)

    def set_max_entries(self, n: int | None) -> None:
        self.inner.set_max_entries(n)

    def victim(self, now_s: float) -> Entry | None:
        self.flush()
        return self.inner.victim(now_s)

    def victims(self, now_s: float) -> Iterator[Entry]:
        self.flush()
        return self.inner.victims(now_s)

    def admit(self, entry: Entry, now_s: float) -> bool:
        self.flush()
        return self.inner.admit(entry, now_s)

    def status(self) -> dict[str, Any]:
        self.flush()
        return self.inner.status()

    def __len__(self) -> int:  # an access never changes which entries a policy tracks
        return len(self.inner)


class Settler:
    """Wraps a store's deferrable policies and replays their queued accesses from one thread,
    under ``lock`` (the store's), as soon as a read has queued some and let the lock go: the
    reader's reply does not wait for them. The thread starts with the first queued access; it
    holds the settler only weakly, so a store dropped without ``close`` is still freed."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        #: id(inner policy) -> its wrapper: a policy shared by tiers gets one queue, in order
        self._wrapped: dict[int, DeferredAccesses] = {}
        self._wanted = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def wrap(self, policy: EvictionPolicy) -> EvictionPolicy:
        """``policy``, its accesses deferred where it allows that."""
        if not policy.accesses_deferrable:
            return policy
        deferred = self._wrapped.get(id(policy))
        if deferred is None:
            deferred = self._wrapped[id(policy)] = DeferredAccesses(policy, wake=self._wake)
        return deferred

    def settle(self, limit: int | None = None) -> int:
        """Under the lock: replay queued accesses now, at most ``limit`` per policy; how many
        are left."""
        return sum(p.flush(limit) for p in self._wrapped.values())

    @property
    def queued(self) -> int:
        return sum(p.queued for p in self._wrapped.values())

    def close(self) -> None:
        self._closed = True
        self._wanted.set()

    def _wake(self) -> None:  # under the lock (a policy call)
        if self._thread is None and not self._closed:
            thread = threading.Thread(
                target=_settle,
                args=(weakref.ref(self), self._wanted),
                name="kvctl-policy-settler",
                daemon=True,
            )
            try:
                thread.start()
            except RuntimeError as exc:  # e.g. at interpreter exit: the next policy call replays
                log.warning("no thread to replay cache accesses in (%s); replayed inline", exc)
                return
            self._thread = thread
        self._wanted.set()

    def _replay(self) -> None:
        left = True
        while left and not self._closed:  # the lock goes between slices
            with self._lock:
                left = self.settle(SETTLE_SLICE) > 0


def _settle(ref: weakref.ReferenceType[Settler], wanted: threading.Event) -> None:
    """The settler's thread: replays when woken; ends when it is closed or gone."""
    while True:
        woken = wanted.wait(IDLE_CHECK_SECONDS)
        settler = ref()
        if settler is None or settler._closed:
            return
        if woken:
            wanted.clear()
            try:
                settler._replay()
            except Exception:  # what is left is replayed by the next policy call or wake
                log.exception("replaying queued cache accesses failed")
        del settler
