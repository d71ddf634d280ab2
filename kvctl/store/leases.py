"""A store's lease book: zero-copy reads held in place in the lease tier (the store's first cpu
tier), one by one or in batches whose disk chunks are read in parallel without the store's lock.

A batch moves each chunk not yet in the lease tier into it in three steps (see the store's module
docstring): under the lock its place in the tier's arena is reserved and the chunk marked in
flight (a ``_Flight``); the bytes are read and checksummed outside the lock, in a small thread
pool; back under the lock each flight lands: it is committed and leased, or undone (moved or
evicted meanwhile: resolved again; a bad copy: dropped and answered as a miss). The book owns the
pool, the flights and the set of keys on their way up; the store it serves (a ``LeaseHost``)
does the placement: visibility, recency, room, promotion and the index.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvctl.store.accounting import Accounting, busy_seconds
from kvctl.store.errors import (
    CapacityError,
    CorruptChunk,
    InvalidArgument,
    KeyNotFound,
    TierUnavailable,
)
from kvctl.store.index import Entry
from kvctl.store.relock import relocked
from kvctl.store.tiers.base import Buffer, ReadPlan, Tier
from kvctl.store.tiers.cpu import CpuTier, Lease, Reservation

#: one key's answer from ``lease_many``: a lease, None (cannot be held in the lease tier: read it
#: with ``read_into``), or the KeyNotFound (CorruptChunk for a dropped copy) ``lease`` would raise
LeaseResult = Lease | None | KeyNotFound

#: rounds of demotions written without the store's lock that a put or a lease batch makes room
#: in the lease tier with; after them (other threads kept taking the room freed) it demotes
#: under the lock, so it always ends
DETACHED_DEMOTION_ROUNDS = 4


@dataclass(slots=True)
class _Rooms:
    """Room a lease round makes in the lease tier by demotions written without the lock: the
    demotions begun, and the chunks waiting for them with their place in the batch (each out of
    its tier's policy and marked as being brought up until they end, so no other batch makes
    room for it again and nothing evicts it meanwhile); asked for again then."""

    demotions: list[object] = field(default_factory=list)
    waiting: list[tuple[int, Entry]] = field(default_factory=list)


# A flight's state (``_Flight.state``), changed only under the book's ``_flight_lock``:
_PLANNED = "planned"  # its read has not begun (queued in the pool, or never handed to it)
_READING = "reading"  # a thread is reading into the reserved bytes
_READ = "read"  # the read is over: ``why``/``error`` say how it went
_DROPPED = "dropped"  # no read will write into the reserved bytes (given up before it began, or
#                      cut short by an interrupt); whoever lands it gives the space back
_ABANDONED = "abandoned"  # landed (given up) while still reading: the reader gives the reserved
#                          space back when it is done


@dataclass(slots=True, eq=False)
class _Flight:
    """One chunk of a lease batch on its way from a detached-read tier into the lease tier."""

    index: int  # its place in the batch
    entry: Entry
    src: Tier
    plan: ReadPlan
    home: CpuTier
    reservation: Reservation
    view: memoryview  # the reserved arena bytes the read fills
    state: str = _PLANNED
    why: str | None = None  # the read failed: why the copy cannot be trusted
    error: BaseException | None = None  # the read raised (the tier is unusable)
    started_s: float = 0.0  # when its own read began (perf_counter), not when it was queued
    ended_s: float = 0.0


class LeaseHost(Protocol):
    """What the lease book needs of the store that owns it (``TieredStore``): placement and
    reads, each called with the store's lock held."""

    promote_on_hit: bool
    _clock: Callable[[], float]

    @property
    def tier_names(self) -> list[str]: ...

    def locked(self) -> threading.RLock: ...

    def _get_visible(self, key: bytes, tenant: str) -> Entry: ...

    def _holds(self, e: Entry) -> bool: ...

    def _tier_of(self, e: Entry) -> Tier: ...

    def _access(self, e: Entry, now: float) -> None: ...

    def _usable(self, tier: Tier) -> bool: ...

    def _may_place(self, e: Entry, dst: Tier) -> bool: ...

    def _make_room(self, tier: Tier, size: int) -> bool: ...

    def _room_later(self, tier: Tier, size: int) -> Sequence[object] | None: ...

    def _finish_demotions(self, later: Sequence[Any]) -> None: ...

    def _promote(self, e: Entry, data: Buffer | None, lease_to: Tier | None = None) -> None: ...

    def _begin_read(self, e: Entry) -> None: ...

    def _end_read(self, e: Entry) -> None: ...

    def _is_current(self, e: Entry, src: Tier, plan: ReadPlan) -> bool: ...

    def _drop_unreadable(self, e: Entry, src: Tier, why: str) -> CorruptChunk: ...

    def _delete_copy(self, tier: Tier, key: bytes) -> None: ...

    def _commit_promotion(self, e: Entry, src: Tier, dst: Tier) -> None: ...


class LeaseBook:
    """Leases in ``home`` (the store's lease tier, or None: the store has none) for the store
    ``host``, counted in ``accounting``; ``read_threads`` bounds how many chunks of one batch
    are read at once."""

    def __init__(
        self,
        host: LeaseHost,
        home: CpuTier | None,
        accounting: Accounting,
        *,
        read_threads: int,
    ) -> None:
        self._host = host
        self._lock = host.locked()
        self.home = home
        self._accounting = accounting
        #: keys a lease batch is moving into the lease tier; another batch waits for them
        self._promoting: set[bytes] = set()
        self._promoted = threading.Condition(self._lock)
        self._read_threads = read_threads
        self._read_pool: ThreadPoolExecutor | None = None
        #: set by ``close``: no pool is started (again) after it
        self._closed = False
        #: guards every flight's ``state`` (a reader thread and the lander both change it)
        self._flight_lock = threading.Lock()

    # --- public (the store's lease API) -------------------------------------------------------
    def require_home(self) -> CpuTier:
        if self.home is None:
            raise TierUnavailable(
                f"no tier of this store supports leases (a cpu tier does; it has "
                f"{', '.join(self._host.tier_names)})"
            )
        return self.home

    @property
    def lease_count(self) -> int:
        return 0 if self.home is None else self.home.lease_count

    def lease_many(
        self, keys: Sequence[bytes], ttl_s: float, *, tenant: str, served: bool = True
    ) -> list[LeaseResult]:
        """``TieredStore.lease_many``."""
        host = self._host
        results: list[LeaseResult] = [None] * len(keys)
        try:
            with self._lock:
                home = self.require_home()
                now = host._clock()
                pending: list[tuple[int, bytes]] = []
                for i, key in enumerate(keys):
                    try:
                        e = host._get_visible(key, tenant)
                    except KeyNotFound as exc:
                        results[i] = exc
                        continue
                    if served:
                        host._access(e, now)
                        self._accounting.served(e, tenant)
                    if e.tier == home.name:  # leased now, so making room for the rest skips it
                        results[i] = self._grant(home, e, ttl_s)
                    else:
                        pending.append((i, key))
            rounds = 0
            while pending:
                # the last rounds make room by demoting under the lock, so the batch ends
                detach = rounds < DETACHED_DEMOTION_ROUNDS
                pending = self._lease_round(home, pending, ttl_s, tenant, results, detach)
                rounds += 1
        except BaseException:
            granted = [r.lease_id for r in results if isinstance(r, Lease)]
            if granted:
                self.release(granted)
            raise
        return results

    # --- under the store's lock: a key being brought up into the lease tier -----------------
    def bringing_up(self, key: bytes) -> bool:
        """Whether a lease batch (or a read's promotion) is bringing ``key`` up now."""
        return key in self._promoting

    def begin_bringing_up(self, key: bytes) -> None:
        """A read's promotion is making ``key``'s room: batches asking for it wait."""
        self._promoting.add(key)

    def end_bringing_up(self, key: bytes) -> None:
        self._promoting.discard(key)
        self._promoted.notify_all()

    def view(self, lease: Lease) -> memoryview:
        with self._lock:
            return self.require_home().view(lease)

    def release(self, lease_ids: Iterable[int]) -> int:
        with relocked(self._lock):  # a batch cut short releases here: through interrupts too
            home = self.home
            if home is None:
                return 0
            return sum(home.release(i) for i in lease_ids)

    def expire(self) -> int:
        with self._lock:
            home = self.home
            return 0 if home is None else home.expire_leases()

    def close(self) -> None:
        """Under the lock: start no reader after this; reads under way finish on their own."""
        self._closed = True
        pool, self._read_pool = self._read_pool, None
        if pool is not None:
            pool.shutdown(wait=False)

    # --- a batch's rounds ---------------------------------------------------------------------
    def _grant(self, home: CpuTier, e: Entry, ttl_s: float) -> Lease:
        lease = home.lease(e.key, ttl_s)
        self._accounting.count_read(home.name, e.size_bytes)
        return lease

    def _promote_and_grant(
        self, home: CpuTier, e: Entry, data: Buffer | None, ttl_s: float
    ) -> Lease | None:
        """Promote ``e`` into the lease tier under the lock and lease it there; None when it
        did not land there."""
        self._host._promote(e, data, home)
        if e.tier == home.name and self._host._holds(e):
            return self._grant(home, e, ttl_s)
        return None

    def _lease_round(
        self,
        home: CpuTier,
        pending: list[tuple[int, bytes]],
        ttl_s: float,
        tenant: str,
        results: list[LeaseResult],
        detach: bool = False,
    ) -> list[tuple[int, bytes]]:
        """One pass of ``lease_many`` over the keys not yet in the lease tier (their hits
        already counted): plan under the lock, read outside it, commit under it. Returns the
        keys to resolve again (moved or evicted mid-read, waited for, or whose room in the
        lease tier was being made by demotions). With ``detach``, room is made by demotions
        written without the lock (as a put's are) after the reads."""
        flights: list[_Flight] = []
        waiting: list[tuple[int, bytes]] = []
        again: list[tuple[int, bytes]] = []
        rooms = _Rooms() if detach else None
        try:
            with self._lock:
                for i, key in pending:
                    flight = self._resolve(i, key, home, ttl_s, tenant, results, waiting, rooms)
                    if flight is not None:
                        flights.append(flight)
            if flights:
                self._fly(flights)
        finally:
            try:
                # every flight planned lands, read or not (a failed plan's are undone, unread)
                with relocked(self._lock):
                    try:
                        again += self._land(flights, home, ttl_s, results)
                    finally:
                        if flights:
                            self._promoted.notify_all()
            finally:
                if rooms is not None:  # begun under the lock: each ends, whatever happened
                    self._end_rooms(rooms)
        if rooms is not None:
            again += [(i, e.key) for i, e in rooms.waiting]
        with self._lock:
            for i, key in waiting:
                while key in self._promoting:
                    self._promoted.wait()
                again.append((i, key))
        return again

    def _end_rooms(self, rooms: _Rooms) -> None:
        """Write a round's demotions without the lock and commit them, then let the chunks that
        waited for their room be asked for again (by this batch and any other)."""
        try:
            if rooms.demotions:
                self._host._finish_demotions(rooms.demotions)
        finally:
            if rooms.waiting:
                with relocked(self._lock):
                    for _, e in rooms.waiting:
                        self._promoting.discard(e.key)
                        self._host._end_read(e)
                    self._promoted.notify_all()

    def _resolve(
        self,
        i: int,
        key: bytes,
        home: CpuTier,
        ttl_s: float,
        tenant: str,
        results: list[LeaseResult],
        waiting: list[tuple[int, bytes]],
        rooms: _Rooms | None,
    ) -> _Flight | None:
        """Under the lock: answer one key of a lease batch now (a lease, None, a miss), queue
        it in ``waiting`` (another flight is bringing it up) or in ``rooms`` (demotions begun
        there are making its room), or return its flight."""
        try:
            e = self._host._get_visible(key, tenant)
        except KeyNotFound as exc:
            results[i] = exc
            return None
        if e.tier == home.name:
            results[i] = self._grant(home, e, ttl_s)
            return None
        if key in self._promoting:  # another batch (or this one) is bringing it up
            waiting.append((i, key))
            return None
        src = self._host._tier_of(e)
        if not src.detached_reads:  # a gpu tier above: moved under the lock as ever
            results[i] = self._promote_and_grant(home, e, None, ttl_s)
            return None
        return self._plan_flight(i, e, src, home, rooms)

    def _plan_flight(
        self, i: int, e: Entry, src: Tier, home: CpuTier, rooms: _Rooms | None
    ) -> _Flight | None:
        """Under the lock: reserve ``e``'s place in the lease tier and mark it in flight, or
        None when it cannot be held there (the checks the store makes for a promotion) or when
        its room is being made by demotions begun in ``rooms`` (written without the lock; None:
        demoted here, under it), where it waits."""
        host = self._host
        if not host.promote_on_hit or e.pinned or not host._usable(home):
            return None
        if not host._may_place(e, home):
            return None
        plan = src.plan_read(e.key)
        host._begin_read(e)  # first, so demotions made to make room can never pick it
        deferred = False
        try:
            if rooms is None:
                room = host._make_room(home, e.size_bytes)
            else:
                begun = host._room_later(home, e.size_bytes)
                room = begun is not None
                if begun:  # its room is free once they are written: asked again then
                    rooms.demotions += begun
                    deferred = True
            if not deferred:
                if not room:
                    raise CapacityError(f"no room for {e.size_bytes} bytes in tier {home.name!r}")
                reservation = home.reserve(e.meta())
        except (CapacityError, InvalidArgument):
            # InvalidArgument: the lease tier already has the key (a copy the index does not
            # place there): this key cannot be held there now, the batch goes on without it
            host._end_read(e)
            return None
        except BaseException:
            host._end_read(e)
            raise
        self._promoting.add(e.key)
        if deferred:
            assert rooms is not None
            rooms.waiting.append((i, e))  # still being read: ends with the demotions
            return None
        view = home.reserved_view(reservation)
        return _Flight(i, e, src, plan, home, reservation, view)

    # --- reads without the lock ---------------------------------------------------------------
    def _pool(self) -> ThreadPoolExecutor:
        """The readers' pool, started on first use; TierUnavailable once the store is closed."""
        with self._lock:
            if self._closed:
                raise TierUnavailable("the store is closed")
            pool = self._read_pool
            if pool is None:
                pool = self._read_pool = ThreadPoolExecutor(
                    self._read_threads, thread_name_prefix="kvctl-store-read"
                )
            return pool

    def _fly(self, flights: list[_Flight]) -> None:
        """Without the lock: read every flight's chunk into its reserved bytes, in parallel.
        Raises TierUnavailable (reading nothing) once the store is closed. Flights it leaves
        unread (an error, an interrupt) are sorted out by ``_land_one``."""
        if len(flights) == 1:
            if self._closed:
                raise TierUnavailable("the store is closed")
            self._read_one(flights[0])
        else:
            pool = self._pool()
            futures = []
            try:
                for f in flights:
                    futures.append(pool.submit(self._read_one, f))
            except RuntimeError:  # shut down by close() since _pool() answered
                raise TierUnavailable("the store is closed") from None
            wait_all(futures)
            for future in futures:
                future.result()  # a reader's BaseException (errors are in f.error)
        by_tier: dict[str, list[_Flight]] = {}
        for f in flights:
            if f.state is _READ and f.why is None and f.error is None:
                by_tier.setdefault(f.src.name, []).append(f)
        with self._lock:
            for tier, done in by_tier.items():
                nbytes = sum(f.reservation.size_bytes for f in done)
                busy_s = busy_seconds([(f.started_s, f.ended_s) for f in done])
                self._accounting.note_bandwidth(tier, nbytes, busy_s)

    def _read_one(self, f: _Flight) -> None:
        """A reader's part of a lease batch (a pool thread's, or the caller's for a batch of
        one): read and verify one chunk, touching no state but the flight's own (the store's
        lock is not held), unless the batch gave up on it: before the read begins, nothing is
        read; after, the reader gives the reserved space back."""
        with self._flight_lock:
            if f.state is not _PLANNED:  # the batch gave up on it before it began
                return
            f.state = _READING
        outcome = _DROPPED  # until the read is over: cut short, the bytes are not the chunk's
        f.started_s = time.perf_counter()
        try:
            f.why = f.src.read_planned(f.plan, f.view)
            outcome = _READ
        except Exception as exc:
            f.error = exc
            outcome = _READ
        finally:
            f.ended_s = time.perf_counter()
            with self._flight_lock:
                abandoned = f.state is _ABANDONED
                f.state = outcome
            if abandoned:  # nobody else will: give the reserved bytes back
                with relocked(self._lock):
                    f.home.abort(f.reservation)

    # --- landing ------------------------------------------------------------------------------
    def _land(
        self, flights: list[_Flight], home: CpuTier, ttl_s: float, results: list[LeaseResult]
    ) -> list[tuple[int, bytes]]:
        """Under the lock: commit every flight (or undo it), then raise the first error a read
        or a commit met. Returns the keys to resolve again."""
        again: list[tuple[int, bytes]] = []
        first_error: BaseException | None = None
        for f in flights:
            try:
                if self._land_one(f, home, ttl_s, results):
                    again.append((f.index, f.entry.key))
            except Exception as exc:  # the rest still land, so nothing stays reserved
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return again

    def _land_one(
        self, f: _Flight, home: CpuTier, ttl_s: float, results: list[LeaseResult]
    ) -> bool:
        """Commit one flight; True when its key must be resolved again."""
        host = self._host
        e, src, r = f.entry, f.src, f.reservation
        self._promoting.discard(e.key)
        with self._flight_lock:
            state = f.state
            if state is _READING:
                f.state = _ABANDONED
            elif state is _PLANNED:  # never begun (cut short, or the pool was shut down)
                f.state = state = _DROPPED
        if state is not _READ:
            # given up on (an interrupt cut this thread's wait short, or the store closed): a
            # read still going may write into the reserved bytes yet, so they stay reserved,
            # never handed out, until that reader gives them back (``_read_one``)
            if state is _DROPPED:
                home.abort(r)
            host._end_read(e)
            return False
        current = host._is_current(e, src, f.plan)
        if f.error is not None or f.why is not None or not current or e.pinned:
            home.abort(r)
            host._end_read(e)
            if f.error is not None:
                raise f.error
            if not current:  # evicted, moved or rewritten meanwhile: look again
                return True
            if f.why is not None:
                results[f.index] = host._drop_unreadable(e, src, f.why)
            # else pinned meanwhile: it stays where it is pinned
            return False
        if not home.commit(r):
            # the arena was replaced (resize) mid-read: the bytes, read and checked, are in
            # the old one; place them like any promotion
            host._end_read(e)
            self._accounting.count_read(src.name, e.size_bytes)
            results[f.index] = self._promote_and_grant(home, e, f.view, ttl_s)
            return False
        try:
            host._delete_copy(src, e.key)
        except BaseException as exc:
            home.delete(e.key)  # still one copy, in src
            host._end_read(e)
            if not isinstance(exc, TierUnavailable):
                raise
            # the disk copy cannot be removed (its disk went read-only, say): the chunk stays
            # there, and this key is a fallback (read it with read_into), not a failed batch
            self._accounting.count_read(src.name, e.size_bytes)
            return False
        host._commit_promotion(e, src, home)
        results[f.index] = self._grant(home, e, ttl_s)
        return False
