"""The tiered KV store: an index over ordered tiers (fastest first) with pluggable policies.

A chunk lives in exactly one tier (exclusive caching), so occupancy and "which tier holds it" are
unambiguous. New chunks land in the top tier; eviction from a tier demotes to the next tier when
that tier's admission policy allows, and drops otherwise.

Reads are served from the first cpu tier (the lease tier), which need not be the top one: under a
gpu tier, a reader in another process gets a cpu chunk with one copy fewer than a gpu one. So a
hit below the lease tier is promoted into it (the top tier where the store has no cpu tier), never
further up, and a hit above it stays where it is; a lease moves its chunk into the lease tier, up
from disk or down from gpu, counted as a promotion there either way. A gpu tier thus holds newly
written chunks and overflows into cpu.

A tier whose put raises TierUnavailable (a failed device) is taken offline: chunks that would go
there go to the next tier down (counted in ``rerouted_puts``) until ``offline_retry_s`` has passed,
when the next put tries it again (``retry_offline``: at once, for an operator who fixed it);
``offline_tiers`` says which and why. Chunks already in it are still read from it. A tier that could
not be opened at all (an ``AbsentTier``: a disk tier whose directory cannot be used) keeps its place
and name but takes nothing, as if the tier above were the bottom one, until ``adopt_tier`` swaps the
opened tier in (``absent_tiers`` says which and why). Every public method either completes or raises
before changing anything it would have to undo, and a failure while demoting (disk full) degrades to
a drop that is counted, never to lost or wrong bytes. A disk tier whose filesystem fills below its
capacity first makes room as at its capacity (``_write_making_room``: its own chunks, by its
policy).

Reads from a slow tier (disk: ``Tier.detached_reads``) run without the store's lock, so one disk
read never stalls every other reader. Under the lock the store marks the entry in flight
(withdrawn from its tier's eviction policy, like a pinned one) and, for a lease, reserves its
place in the lease tier's arena; the bytes are read (a batch's chunks in parallel, in a small
thread pool, straight into the arena) and checksummed outside it; back under the lock the read
is committed. Anything that happened meanwhile (the chunk evicted, moved, pinned, the arena
resized, the file replaced) is noticed at that point: the read is then retried, handed back as a
miss or a fallback, never served as wrong bytes, and its reserved space is given back. A batch
cut short while its reads are still running (an interrupt) gives up on them: each such read
gives its reserved space back itself when it ends. The slow part of deleting a promoted disk
chunk (the unlink) runs in a second, smaller pool, so it never queues ahead of reads. A closed
store starts no thread: a batch reaching its reads after ``close`` is refused (TierUnavailable).

Demotions a put (or ``reserve_put``, or a lease batch promoting a disk chunk) makes to find room in
the lease tier's arena are written to a slow tier (disk: ``Tier.detached_writes``) without the lock
too. Under the lock each victim's room below is taken (``reserve_write``) and its bytes held in
place by a lease: it stays cached where it was, readable, but out of its policy, so nothing else
picks it. The put writes the files without the lock, then commits each demotion under it (the
chunk's ``demote`` event comes once its file is in place) and plans again, so a put is answered
only once its demotions have landed. A victim evicted, moved or pinned meanwhile keeps its new
state (the written file is taken back); a write that fails drops the victim, counted as a failed
demotion, as under the lock. A lease batch whose key's room is being made so asks for that key
again once the demotions have landed; a plain read's promotion waits for them itself, then promotes
its chunk if its room is still free. An operator's move or flush down to disk, and a shrinking
resize, write the same way, taking the lock once per chunk (or batch); a put that lands on disk
itself (pinned or not) reserves its file under the lock and writes it without; a move up from disk
(``move``, ``prefetch``, ``pin`` into a tier) reads the file without it; a move down from a gpu
tier to disk copies the chunk to host memory under the lock (at the link's speed) and writes it
without. Still made under the lock: a resize's copy of what changed while its new arena was
filled without the lock, and the last of a put's rounds when others keep taking its room. Work
begun under the lock and done without it is ended under it again through ``relocked``: an
interrupt that lands while it waits for the lock is raised once that is done.

A caller may hold chunks (``holding``: a pull landing a chain) the same way: those cached and
those stored while the hold lasts stay out of their tier's policy, so making room never evicts
them; a put that finds no room beside them goes to a lower tier or fails, as beside pins.

This module is the index and placement (put, lookup, reads, eviction, moves) and the public API.
The store owns two parts it delegates to: its lease book (``leases.py``: leases and the lease
batches' reads into the lease tier) and its accounting (``accounting.py``: every counter, read
bandwidth included). Tiers beyond the node are counted by ``kvctl.remote``, which this package
never imports.
"""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from heapq import nlargest
from itertools import repeat
from operator import attrgetter
from typing import Any, TypeVar

from kvctl.store.accounting import Accounting
from kvctl.store.errors import (
    CapacityError,
    CorruptChunk,
    DiskFullError,
    InvalidArgument,
    KeyNotFound,
    PayloadSizeError,
    StoreError,
    TierUnavailable,
)
from kvctl.store.index import (
    DEFAULT_PRIORITY,
    MAX_PRIORITY,
    Entry,
    HotChunk,
    LookupResult,
    check_tenant,
)
from kvctl.store.keys import DEFAULT_CHUNK_TOKENS, KEY_BYTES
from kvctl.store.leases import DETACHED_DEMOTION_ROUNDS, LeaseBook, LeaseResult
from kvctl.store.policies import (
    AdmissionPolicy,
    EvictionPolicy,
    make_admission_policy,
    make_eviction_policy,
)
from kvctl.store.policies.deferred import Settler
from kvctl.store.ratelog import RateLimitedLog
from kvctl.store.relock import relocked
from kvctl.store.stats import StoreStats, TierStats
from kvctl.store.tiers.absent import AbsentTier
from kvctl.store.tiers.base import (
    MIN_CHARGED_BYTES,
    Buffer,
    ChunkMeta,
    ReadPlan,
    Tier,
    WriteSlot,
    byte_view,
)
from kvctl.store.tiers.cpu import CpuTier, Lease, Reservation

_R = TypeVar("_R")
#: chunks ``adopt_tier`` indexes per hold of the lock: 256 held it 0.7 ms at the median under
#: lineage-lru, 5.6 ms under lineage-adaptive (4 and 16 ms at most, GC pauses aside; 20,000
#: chunks in-process), where 4096 held it 14 and 210 ms
ADOPT_BATCH = 256
_TIER_OF = attrgetter("tier")
_TOKENS_OF = attrgetter("tokens")
#: "hottest" order: most hits, then the most recent access (ticks order accesses exactly)
_HEAT = attrgetter("hit_count", "last_tick")
#: most chunks one prefix walk visits under the lock (real chains are hundreds deep)
_MAX_PREFIX_WALK = 100_000
#: threads reading one batch's disk chunks at once (an SSD needs a queue depth above one)
DEFAULT_READ_THREADS = 8
#: threads unlinking the files of disk chunks promoted out (apart from the readers' threads)
UNLINK_THREADS = 2
#: victims a shrinking tier begins demoting per hold of the lock (``resize``)
RESIZE_BATCH = 64

Event = dict[str, Any]

log = logging.getLogger(__name__)
#: tries of a write into a tier whose filesystem is full, each after evicting more of that
#: tier's chunks (``_write_making_room``): a filesystem that others keep filling is not chased
FULL_FILESYSTEM_RETRIES = 3
#: free bytes asked for beyond a chunk file's own size on a full filesystem (directory blocks,
#: block rounding), doubled at each retry
FULL_FILESYSTEM_SLACK_BYTES = 64 << 10


@dataclass(eq=False, slots=True)
class PutSlot:
    """A new chunk's place reserved in the lease tier's arena (``TieredStore.reserve_put``):
    ``view`` is its writable bytes, filled by the caller without the store's lock, then
    committed (``commit_put``) or given back (``abort_put``)."""

    entry: Entry
    home: CpuTier
    reservation: Reservation
    view: memoryview
    #: committed or aborted (under the store's lock)
    done: bool = False


@dataclass(eq=False, slots=True)
class _Demotion:
    """A victim on its way down, written without the store's lock: its bytes stay in ``src``
    (readable there; in a cpu tier held in place by ``lease``: never moved by compaction, its
    room not yet free) while ``dst`` writes them into ``slot``; then committed or given up
    under the lock."""

    entry: Entry
    src: Tier
    dst: Tier
    slot: WriteSlot
    #: None: ``view`` is a copy of the bytes read under the lock (a move from a tier without
    #: leases, a gpu tier)
    lease: Lease | None
    view: memoryview
    #: the eviction it is counted as ("capacity", "flush"), or None: an operator's move
    reason: str | None = "capacity"
    error: BaseException | None = None
    #: a failed write leaves the chunk where it was instead of dropping it (``flush --demote``:
    #: an operator asked to demote, not to drop)
    keep: bool = False
    #: how it ended: "landed" (in ``dst``), "dropped" (its write failed: gone, counted) or
    #: "kept" (moved, evicted or pinned meanwhile, or a move whose write failed)
    outcome: str = ""


@dataclass(slots=True)
class _PutWrite:
    """A new chunk on its way into a tier with detached writes (disk): its room there taken
    and its write reserved under the lock, its file written without it, then committed and
    indexed under it (``TieredStore._land_put``)."""

    entry: Entry
    target: Tier
    slot: WriteSlot
    start: int  # the tier rank the put asked from, for ``_insert_new``
    skip: set[str]
    pinned: bool


@dataclass(eq=False, slots=True)
class Hold:
    """Chunks kept out of eviction while a caller needs them (``TieredStore.holding``): those
    of ``keys`` cached when it began, and those stored while it lasts."""

    keys: frozenset[bytes]
    #: the entries held (each counted once in the store's ``_reading``)
    entries: list[Entry] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class BulkResult:
    """Outcome of a bulk operation (evict, pin, move, prefetch, flush)."""

    done: int = 0
    skipped_pinned: int = 0
    missing: int = 0
    failed: int = 0
    #: payload bytes of the ``done`` chunks (flush counts them; the API does not show them)
    done_bytes: int = 0
    #: chunks not tried: a flush's deadline came first (``failed`` counts those tried)
    unfinished: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "done": self.done,
            "skipped_pinned": self.skipped_pinned,
            "missing": self.missing,
            "failed": self.failed,
        }


class TieredStore:
    """Chunks in ordered tiers, fastest first, e.g. ``[CpuTier(...), DiskTier(...)]`` or
    ``[GpuTier(...), CpuTier(...), DiskTier(...)]``.

    ``eviction`` names one policy for every tier or maps tier name -> policy name or instance.
    ``admission`` maps tier name -> admission policy (default: admit everything).
    ``chunk_bytes``, when set, is the only payload size accepted (a store serves one KV layout).
    ``read_threads`` bounds how many chunks of one lease batch are read from disk at once.
    ``isolated_tenants`` names the tenants that only ever see chunks they stored themselves
    (``set_isolated_tenants``). ``defer_accesses``: the policies' bookkeeping of each read is
    replayed from a thread once the read is done (``policies.deferred``; same decisions), as an
    agent wants; a simulation keeps it inline, so its decisions/s count all of it.
    ``bypass_unreachable``: an unpinned chunk deeper in its chain than every tier together can
    hold (``(depth + 1) x its size`` past their capacity) is not stored (see ``_unreachable``).
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        eviction: str | Mapping[str, str | EvictionPolicy] = "lineage-lru",
        admission: Mapping[str, str | AdmissionPolicy] | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        chunk_bytes: int | None = None,
        promote_on_hit: bool = True,
        offline_retry_s: float = 60.0,
        read_threads: int = DEFAULT_READ_THREADS,
        clock: Callable[[], float] = time.time,
        isolated_tenants: Iterable[str] = (),
        defer_accesses: bool = False,
        bypass_unreachable: bool = False,
    ) -> None:
        if not tiers:
            raise InvalidArgument("a store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"tier names must be unique, got {names}")
        if chunk_tokens <= 0:
            raise InvalidArgument(f"chunk_tokens must be positive, got {chunk_tokens}")
        if not offline_retry_s >= 0:  # NaN too
            raise InvalidArgument(f"offline_retry_s must not be negative, got {offline_retry_s}")
        if isinstance(read_threads, bool) or not isinstance(read_threads, int) or read_threads < 1:
            raise InvalidArgument(f"read_threads must be a positive integer, got {read_threads!r}")
        if chunk_bytes is not None:
            if chunk_bytes <= 0:
                raise InvalidArgument(f"chunk_bytes must be positive, got {chunk_bytes}")
            for t in tiers:
                if t.capacity_bytes < chunk_bytes:
                    raise InvalidArgument(
                        f"tier {t.name!r} capacity {t.capacity_bytes} bytes is smaller than one "
                        f"chunk ({chunk_bytes} bytes)"
                    )
        self.chunk_tokens = chunk_tokens
        self.chunk_bytes = chunk_bytes
        self.promote_on_hit = promote_on_hit
        #: whether puts of chunks no lookup of this store could reach are bypassed (may change)
        self.bypass_unreachable = bypass_unreachable
        self.offline_retry_s = offline_retry_s
        self._clock = clock
        self._tiers = list(tiers)
        self._tier_index = {t.name: i for i, t in enumerate(self._tiers)}
        # where leases hold bytes in place: the first cpu tier, wherever it sits
        lease_tier = next((t for t in self._tiers if isinstance(t, CpuTier)), None)
        #: where hits are promoted to: the lease tier, else the top tier
        self._hit_tier: Tier = self._tiers[0] if lease_tier is None else lease_tier
        #: tiers taken offline by a failed put: name -> (why, when to try it again)
        self._offline: dict[str, tuple[str, float]] = {}
        #: tiers not opened (an AbsentTier stands in until ``adopt_tier``): name -> why
        self._absent = {t.name: t.reason for t in self._tiers if isinstance(t, AbsentTier)}
        self._accounting = Accounting(names, chunk_tokens)
        self._policies = {t.name: self._policy_for(t.name, eviction) for t in self._tiers}
        admission = admission or {}
        unknown = set(admission) - set(names)
        if unknown:
            raise InvalidArgument(f"admission names unknown tiers: {sorted(unknown)}")
        self._admission: dict[str, AdmissionPolicy] = {
            name: _as_admission(admission.get(name, "all")) for name in names
        }
        self._index: dict[bytes, Entry] = {}
        #: owner tenant of each isolated chunk; lookups check visibility only when it is non-empty
        self._isolated_owner: dict[bytes, str] = {}
        #: tenants that see only chunks they stored themselves (``set_isolated_tenants``)
        self._isolated_tenants: frozenset[str] = frozenset()
        # cached-children counts of parents that are not cached themselves, so a parent that
        # comes back knows its children at once
        self._orphans: dict[bytes, int] = {}
        self._pinned_bytes = dict.fromkeys(names, 0)
        self._tick = 0
        self._lock = threading.RLock()
        #: replays the policies' access bookkeeping after a read instead of inside it
        self._settler: Settler | None = None
        if defer_accesses:
            self._settler = Settler(self._lock)
            self._policies = {n: self._settler.wrap(p) for n, p in self._policies.items()}
        for t in self._tiers:
            self._policies[t.name].set_max_entries(t.max_chunks())
        self.set_isolated_tenants(isolated_tenants)
        #: entries being read without the lock -> how many such reads; meanwhile they are out of
        #: their tier's eviction policy (like pinned ones), so pressure never picks them. Holds
        #: (``holding``) count here as reads do
        self._reading: dict[Entry, int] = {}
        self._hold_list: list[Hold] = []
        self._leases = LeaseBook(self, lease_tier, self._accounting, read_threads=read_threads)
        self._unlink_pool: ThreadPoolExecutor | None = None
        #: set by ``close``: no pool is started (again) after it
        self._closed = False
        self._listeners: list[Callable[[Event], None]] = []
        #: the store's log lines about failing tiers, a line a minute per kind at most
        self._say = RateLimitedLog(log)
        self._recover()

    # --- construction helpers -------------------------------------------------------------
    def _policy_for(
        self, tier: str, eviction: str | Mapping[str, str | EvictionPolicy]
    ) -> EvictionPolicy:
        spec: str | EvictionPolicy = (
            eviction if isinstance(eviction, str) else eviction.get(tier, "lineage-lru")
        )
        return make_eviction_policy(spec) if isinstance(spec, str) else spec

    def _recover(self) -> None:
        """Index the chunks that durable tiers found on open."""
        found: list[tuple[int, ChunkMeta]] = []
        for i, tier in enumerate(self._tiers):
            found.extend((i, m) for m in tier.recover())
        for tier in self._tiers:
            self._accounting.tier(tier.name).unreadable_on_open = tier.unreadable_on_open
        found.sort(key=lambda im: im[1].created_s)
        for i, meta in found:
            tier = self._tiers[i]
            if meta.key in self._index:  # a copy in two tiers (crash mid-move): keep the faster
                tier.delete(meta.key)
                continue
            self._tick += 1
            self._index[meta.key] = _found_entry(meta, tier.name, self._tick)
        for e in self._index.values():
            self._link_parent(e, +1, notify=False)
            if e.isolated:
                self._isolated_owner[e.key] = e.tenant
        for e in self._index.values():
            self._policies[e.tier].on_insert(e)
        for tier in self._tiers:  # recovered more than a smaller configured capacity
            self._shrink_to(tier, tier.capacity_bytes, reason="resize")

    # --- public API -------------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    @property
    def isolated_tenants(self) -> frozenset[str]:
        return self._isolated_tenants

    def set_isolated_tenants(self, tenants: Iterable[str]) -> None:
        """The tenants whose chunks are never shared (the agent's ``isolated_tenants``, kept in
        sync when its settings change). Such a tenant's chunks are stored isolated, and it sees
        only chunks it stored itself: lookups, reads and leases treat any other chunk under its
        keys as absent (its keys are predictable, so another tenant could store there first),
        and its put replaces such a chunk with its own (see ``put``)."""
        if isinstance(tenants, str):
            raise InvalidArgument("isolated tenants are a collection of names, not one string")
        names = frozenset(tenants)
        if not all(isinstance(t, str) for t in names):
            raise InvalidArgument(f"tenant names must be strings, got {sorted(map(repr, names))}")
        for name in names:  # a name over the cap could never be sent: a settings mistake
            try:
                check_tenant(name)
            except InvalidArgument as exc:
                raise InvalidArgument(f"isolated tenant {name[:40]!r}...: {exc}") from None
        with self._lock:
            self._isolated_tenants = names

    @property
    def external_tier_names(self) -> list[str]:
        """Tiers this store counts but does not hold (``add_external_tier``)."""
        return self._accounting.external_tier_names

    @property
    def lease_tier(self) -> CpuTier | None:
        """The tier read leases hold bytes in (the first cpu tier; under a gpu tier it is not
        the top one), or None when the store has no cpu tier."""
        return self._leases.home

    @property
    def accounting(self) -> Accounting:
        """The store's counters; change or read them under ``locked()``."""
        return self._accounting

    @property
    def stats(self) -> StoreStats:
        return self._accounting.stats

    @property
    def rerouted_puts(self) -> int:
        """Puts that landed below their tier because it was offline (or failed on that put)."""
        return self._accounting.rerouted_puts

    @property
    def spilled_puts(self) -> int:
        """Puts that landed below their tier because no room could be made there (pinned
        chunks, or leased regions splitting the cpu arena's free space)."""
        return self._accounting.spilled_puts

    @property
    def offline_tiers(self) -> dict[str, str]:
        """Tiers taken offline by a put that raised TierUnavailable: name -> the error. A tier
        stays listed until a put into it succeeds (one is tried ``offline_retry_s`` after each
        failure)."""
        with self._lock:
            return {name: why for name, (why, _retry_at) in self._offline.items()}

    def retry_offline(self, name: str) -> str | None:
        """Try offline tier ``name`` now, as an operator who fixed it would (``Tier.
        check_writable``: a disk tier writes a page, off the store's lock): None when it is
        online (it was, or the try landed), else why it is still offline (its next retry as
        after a failed put). A tier with no such test is left for the next put, at once."""
        tier = self.tier(name)
        with self._lock:
            if name not in self._offline:
                return None
        try:
            tried = tier.check_writable()
        except TierUnavailable as exc:
            with self._lock:
                self._take_offline(tier, exc)
                return self._offline[name][0]
        with self._lock:
            if tried:
                self._back_online(tier)
                return None
            off = self._offline.get(name)
            if off is None:  # a put landed meanwhile
                return None
            self._offline[name] = (off[0], self._clock())  # due: the next put tries it
            return off[0]

    @property
    def absent_tiers(self) -> dict[str, str]:
        """Tiers that could not be opened (an ``AbsentTier`` stands in): name -> why. They take
        nothing and are left out of ``usage`` until ``adopt_tier`` brings them in."""
        with self._lock:
            return dict(self._absent)

    def note_absent(self, name: str, reason: str) -> None:
        """Why absent tier ``name`` still cannot be opened (a later try's error)."""
        with self._lock:
            if name in self._absent:
                self._absent[name] = reason

    def adopt_tier(self, tier: Tier, *, batch: int = ADOPT_BATCH) -> int:
        """Bring in ``tier``, opened (and its files scanned) by the caller without the store's
        lock, in place of the absent tier of its name; returns the chunks it brought. Its
        chunks are indexed ``batch`` at a time, the lock taken once per batch, so a scan of
        many files never stalls puts and reads for long; the tier takes chunks (puts,
        demotions) once all are in. A chunk cached meanwhile in another tier keeps that copy
        (its file here is deleted), as at a restart. Each chunk brought in is published as an
        ``adopt`` event (a fleet index learns of it as of a put; the pool's write-through, which
        takes ``store`` events, does not write a whole directory out). Raises InvalidArgument
        when no absent tier has its name, TierUnavailable (nothing taken: the caller closes
        ``tier``) once the store is closed; closed meanwhile, the store closes ``tier`` itself.
        Anything else raised part way takes back what was brought in (``evict`` events) and
        puts the absent tier back, with the error as its reason: the caller closes ``tier``
        and may try again."""
        if batch < 1:
            raise InvalidArgument(f"batch must be positive, got {batch}")
        with self._lock:
            if self._closed:
                raise TierUnavailable("the store is closed")
            i = self._tier_index.get(tier.name)
            absent = self._tiers[i] if i is not None else None
            if i is None or not isinstance(absent, AbsentTier):
                raise InvalidArgument(f"no absent tier named {tier.name!r} to adopt")
            self._tiers[i] = tier  # still in _absent: nothing is written to it yet
            self._policies[tier.name].set_max_entries(tier.max_chunks())
            self._accounting.tier(tier.name).unreadable_on_open = tier.unreadable_on_open
        adopted = 0
        try:
            found = tier.recover()
            for start in range(0, len(found), batch):
                with self._lock:
                    if self._closed:
                        return adopted
                    adopted += self._adopt_chunks(tier, found[start : start + batch])
            with self._lock:
                if self._closed:
                    return adopted
                try:
                    self._shrink_to(tier, tier.capacity_bytes, reason="resize")
                except (CapacityError, TierUnavailable) as exc:  # over its size until puts evict
                    log.warning("%s tier online over its capacity: %s", tier.name, _reason(exc))
                del self._absent[tier.name]  # the caller says it (it knows how it got there)
        except BaseException as exc:
            with self._lock:
                if not self._closed:
                    self._unadopt(tier, i, absent, exc)
            raise
        absent.close()
        return adopted

    def _unadopt(self, tier: Tier, i: int, absent: AbsentTier, exc: BaseException) -> None:
        """Under the lock: take back what ``adopt_tier`` brought in of ``tier`` and put
        ``absent`` back in its place, the failure as its reason."""
        policy = self._policies[tier.name]
        for e in [e for e in self._index.values() if e.tier == tier.name]:
            del self._index[e.key]
            self._isolated_owner.pop(e.key, None)
            if e not in self._reading:  # one being read is in no policy (``_end_read``)
                policy.on_remove(e)
            self._link_parent(e, -1)
            if e.children:
                self._orphans[e.key] = e.children
            self._emit("evict", e)
        self._tiers[i] = absent
        policy.set_max_entries(absent.max_chunks())
        self._absent[tier.name] = f"bringing it online failed: {_reason(exc)}"

    def _adopt_chunks(self, tier: Tier, metas: Sequence[ChunkMeta]) -> int:
        """Under the lock: index ``tier``'s chunks found at its open, as ``_recover`` does,
        except that a key cached meanwhile elsewhere keeps that copy."""
        adopted = 0
        policy = self._policies[tier.name]
        for meta in metas:
            if meta.key not in tier:  # evicted by its own open (trimmed) or gone meanwhile
                continue
            if meta.key in self._index:  # put again while the tier was absent: that copy wins
                try:
                    tier.delete(meta.key)
                except TierUnavailable as exc:  # its file stays, unindexed, until a restart
                    log.warning("%s tier: a duplicate chunk's file stays: %s", tier.name, exc)
                continue
            self._tick += 1
            e = _found_entry(meta, tier.name, self._tick)
            self._index[e.key] = e
            if e.isolated:
                self._isolated_owner[e.key] = e.tenant
            self._link_parent(e, +1)
            policy.on_insert(e)
            for hold in self._hold_list:
                if e.key in hold.keys:
                    self._hold(hold, e)
            self._emit("adopt", e)
            adopted += 1
        return adopted

    def tier(self, name: str) -> Tier:
        return self._tiers[self._rank(name)]

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def subscribe(self, listener: Callable[[Event], None]) -> Callable[[], None]:
        """Call ``listener`` with every store/evict/move event; returns an unsubscribe function."""
        with self._lock:
            self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def put(
        self,
        key: bytes,
        data: Buffer | None,
        *,
        size_bytes: int | None = None,
        tokens: int | None = None,
        tenant: str = "",
        parent: bytes | None = None,
        depth: int = 0,
        priority: int = DEFAULT_PRIORITY,
        retention_seconds: float | None = None,
        pinned: bool = False,
        isolated: bool = False,
        tier: str | None = None,
    ) -> str | None:
        """Store a chunk; returns the tier it landed in, or None if a policy declined it (or
        ``bypass_unreachable`` turned it away: ``_unreachable``).

        ``data`` is None only for size-only (simulation) tiers, with ``size_bytes`` given.
        Storing a key that is already cached only refreshes it (KV for a key never changes).
        A put lands in the first tier (from ``tier``, default the top one) that can take it,
        evicting there only what makes room; an unpinned chunk goes on to the next tier when
        room cannot be made (pins, or leased regions splitting the cpu arena), a pinned one is
        pinned in the first usable tier or nowhere. Raises CapacityError, with the store
        unchanged, when no tier can take it.

        Isolation: a put by an isolated tenant (``isolated_tenants``) is isolated. A put over a
        chunk the putter may not see (another tenant's, where either is isolated) replaces it,
        so the put and the putter's later reads behave as for a new chunk.
        """
        size = _payload_size(data, size_bytes)
        self._check_new(key, size, priority=priority, parent=parent)
        check_tenant(tenant)
        parent = _own_parent_dropped(key, parent)
        if retention_seconds is not None and retention_seconds < 0:
            raise InvalidArgument(f"retention_seconds must not be negative: {retention_seconds}")

        def attempt(detach: bool) -> tuple[bool, str | _PutWrite | None, list[_Demotion]]:
            return self._put_locked(
                key,
                data,
                size,
                tokens=tokens,
                tenant=tenant,
                parent=parent,
                depth=depth,
                priority=priority,
                retention_seconds=retention_seconds,
                pinned=pinned,
                isolated=isolated,
                tier=tier,
                detach=detach,
            )

        result = self._in_rounds(attempt)
        if not isinstance(result, _PutWrite):
            return result
        assert data is not None  # a write is only detached with the bytes in hand
        if self._land_put(result, data):
            return result.target.name
        # stored by another put meanwhile (this one then refreshes it), or the write failed:
        # the put is made again, all under the lock (a failed tier is passed over as ever)
        with self._lock:
            done, again, _ = attempt(False)
        assert done and not isinstance(again, _PutWrite)
        return again

    def _land_put(self, w: _PutWrite, data: Buffer) -> bool:
        """Without the lock: write a put's chunk into its reserved slot, then commit and index
        it under the lock. False, with the slot given back, when it did not land (the key was
        stored meanwhile, the write or its commit failed, the store closed)."""
        error: BaseException | None = None
        try:
            w.target.write_reserved(w.slot, data)
        except BaseException as exc:
            error = exc
        with relocked(self._lock):
            if error is None and not self._closed and w.entry.key not in self._index:
                try:
                    landed = w.target.commit_write(w.slot)
                except StoreError as exc:
                    landed, error = False, exc
                if landed:
                    self._insert_new(w.entry, w.target, start=w.start, skip=w.skip, pinned=w.pinned)
                    return True
            w.target.abort_write(w.slot)
            if isinstance(error, TierUnavailable):
                self._take_offline(w.target, error)
        if error is not None and not isinstance(error, (StoreError, OSError)):
            raise error  # an interrupt, or a bug's error: not hidden as a failed write
        return False

    def _in_rounds(self, attempt: Callable[[bool], tuple[bool, _R, list[_Demotion]]]) -> _R:
        """``attempt(detach)`` under the lock until it is done. A round whose room is being
        made by demotions to a slow tier hands them back: they are written without the lock,
        then it looks again (the chunk may have been stored meanwhile). The last round demotes
        under the lock, so it always ends."""
        for round_ in range(DETACHED_DEMOTION_ROUNDS + 1):
            with self._lock:
                done, result, later = attempt(round_ < DETACHED_DEMOTION_ROUNDS)
            if done:
                return result
            self._finish_demotions(later)
        raise AssertionError("unreachable: the last round demotes under the lock")

    def _put_locked(
        self,
        key: bytes,
        data: Buffer | None,
        size: int,
        *,
        tokens: int | None,
        tenant: str,
        parent: bytes | None,
        depth: int,
        priority: int,
        retention_seconds: float | None,
        pinned: bool,
        isolated: bool,
        tier: str | None,
        detach: bool,
    ) -> tuple[bool, str | _PutWrite | None, list[_Demotion]]:
        """``put`` under the lock: (True, where it landed, []) once done, or (False, None,
        the demotions begun) when room is being made by demotions written without the lock
        (``detach``; nothing else has changed but evictions), for ``put`` to finish and retry.
        With ``detach``, a chunk bound for a tier with detached writes (disk: the cpu tier
        could not take it) is only reserved there: (True, its ``_PutWrite``, []), for ``put``
        to write without the lock."""
        now = self._clock()
        isolated = isolated or tenant in self._isolated_tenants
        existing = self._index.get(key)
        if (
            existing is not None
            and existing.tenant != tenant
            and not self._visible(existing, tenant)
        ):
            # The chunk under this key is one the putter may not see (an isolated tenant's,
            # or another tenant's under an isolated tenant's predictable key). It is
            # replaced: the putter's answer and its own later lookups are then exactly those
            # of a new chunk, so nothing about the other tenant's chunk shows, and an
            # isolated tenant only ever reads bytes it stored. The cost is the other
            # tenant's cached copy (a miss for it, never wrong bytes); a tenant able to
            # compute another's keys could evict those as it could by filling the cache.
            self._evict(existing, "replaced", demote=False)
            existing = None
        elif existing is not None:
            if existing.size_bytes != size:
                raise PayloadSizeError(
                    f"key {key.hex()} is cached with {existing.size_bytes} bytes, not {size}"
                )
            self._access(existing, now)
            if pinned:
                self._pin(existing)
            return True, existing.tier, []
        start = self._rank(tier) if tier else 0
        entry = self._new_entry(
            key,
            size,
            tier=self._tiers[start].name,
            tokens=tokens,
            tenant=tenant,
            parent=parent,
            priority=priority,
            isolated=isolated,
            now=now,
            depth=depth,
            retention_until_s=None if retention_seconds is None else now + retention_seconds,
        )
        # Where it goes is decided before anything is evicted: a tier that cannot take it
        # (too many pins, or leased regions splitting its free space) is passed over
        # untouched, and when no tier can, the put raises with the store as it was.
        skip: set[str] = set()  # tiers that failed this put after all (device, disk full)
        full: dict[str, str] = {}  # why, for each tier whose filesystem had no room for it
        while True:
            try:
                plan = self._plan_put(entry, start, pinned=pinned, now=now, skip=skip)
            except CapacityError as exc:
                if not full:
                    raise
                refused = CapacityError(f"{exc}; {'; '.join(full.values())}")
                refused.filesystem_full_tiers = tuple(full)  # the data plane says which
                raise refused from exc
            if plan is None:
                stats = self._accounting.stats
                stats.bypassed_puts += 1
                if not pinned and self._unreachable(entry):
                    stats.unreachable_puts += 1
                return True, None, []
            target, victims = plan
            entry.tier = target.name
            if detach and victims:
                later = self._evict_for_later(target, victims)
                if later:
                    return False, None, later
            else:
                self._evict_for(target, victims)
            try:
                if detach and target.detached_writes and data is not None:
                    try:
                        slot = target.reserve_write(entry.meta())
                    except InvalidArgument:
                        pass  # an older copy of the key is still being written: put at once
                    else:
                        # its room is taken: no other pin or put can have it meanwhile
                        return True, _PutWrite(entry, target, slot, start, skip, pinned), []
                self._write_making_room(target, size, partial(target.put, entry.meta(), data))
            except TierUnavailable as exc:
                self._take_offline(target, exc)
                skip.add(target.name)
                continue
            except DiskFullError as exc:
                # the filesystem under a disk tier is full of what is not its own: the next
                # tier down may take it
                skip.add(target.name)
                full[target.name] = str(exc)
                continue
            except CapacityError:
                skip.add(target.name)
                continue
            break
        self._insert_new(entry, target, start=start, skip=skip, pinned=pinned)
        return True, target.name, []

    # --- puts received in place -------------------------------------------------------------
    def reserve_put(
        self,
        key: bytes,
        size_bytes: int,
        *,
        tokens: int | None = None,
        tenant: str = "",
        parent: bytes | None = None,
        depth: int = 0,
        priority: int = DEFAULT_PRIORITY,
        isolated: bool = False,
    ) -> PutSlot | None:
        """Reserve the place a ``put`` of a new chunk would take, when that is the lease tier's
        arena, so its bytes can be written there straight from where they come from (a
        socket), without the store's lock and without a copy; then ``commit_put`` the slot,
        or ``abort_put`` it (exactly one of them, whatever happens: until then its bytes stay
        reserved). Room is made as ``put`` makes it. None when the chunk would not go there
        (cached already, or another tier would take it, or none could): ``put`` it instead.
        Raises what ``put`` raises for a bad key, size, priority or parent."""
        self._check_new(key, size_bytes, priority=priority, parent=parent)
        check_tenant(tenant)
        parent = _own_parent_dropped(key, parent)
        return self._in_rounds(
            lambda detach: self._reserve_put_locked(
                key,
                size_bytes,
                tokens=tokens,
                tenant=tenant,
                parent=parent,
                depth=depth,
                priority=priority,
                isolated=isolated,
                detach=detach,
            )
        )

    def _reserve_put_locked(
        self,
        key: bytes,
        size_bytes: int,
        *,
        tokens: int | None,
        tenant: str,
        parent: bytes | None,
        depth: int,
        priority: int,
        isolated: bool,
        detach: bool,
    ) -> tuple[bool, PutSlot | None, list[_Demotion]]:
        """``reserve_put`` under the lock, with demotions as ``_put_locked`` makes them."""
        home = self._leases.home
        if home is None or self._closed or key in self._index:
            return True, None, []
        now = self._clock()
        entry = self._new_entry(
            key,
            size_bytes,
            tier=home.name,
            tokens=tokens,
            tenant=tenant,
            parent=parent,
            priority=priority,
            isolated=isolated or tenant in self._isolated_tenants,
            now=now,
            depth=depth,
        )
        try:
            plan = self._plan_put(entry, 0, pinned=False, now=now, skip=set())
        except (CapacityError, TierUnavailable):
            return True, None, []
        if plan is None or plan[0] is not home:
            return True, None, []  # declined, or another tier takes it: put decides again
        if detach and plan[1]:
            later = self._evict_for_later(home, plan[1])
            if later:
                return False, None, later
        else:
            self._evict_for(home, plan[1])
        try:
            reservation = home.reserve(entry.meta())
        except (CapacityError, InvalidArgument, TierUnavailable):
            return True, None, []
        return True, PutSlot(entry, home, reservation, home.reserved_view(reservation)), []

    def commit_put(self, slot: PutSlot) -> str | None:
        """The slot's bytes, now written, become its chunk; returns the tier it is in (None:
        declined) like ``put``. If the key was stored meanwhile (another pull), or a resize
        replaced the arena under the slot, the bytes are ``put`` from the slot as any chunk's
        (the view stays mapped) and the reserved space goes back. Raises what ``put`` raises;
        the reserved space is given back then too."""
        with self._lock:
            if slot.done:
                raise InvalidArgument("this put slot was committed or aborted already")
            slot.done = True
            e, home = slot.entry, slot.home
            try:
                if e.key not in self._index and home.commit(slot.reservation):
                    self._insert_new(e, home, start=0, skip=set(), pinned=False)
                    return home.name
                return self.put(
                    e.key,
                    slot.view,
                    tokens=e.tokens,
                    tenant=e.tenant,
                    parent=e.parent,
                    depth=e.depth,
                    priority=e.priority,
                    isolated=e.isolated,
                )
            finally:
                home.abort(slot.reservation)  # nothing left to give back once committed

    def abort_put(self, slot: PutSlot) -> None:
        """Give a slot's reserved space back (nothing once it was committed or aborted)."""
        with self._lock:
            if not slot.done:
                slot.done = True
                slot.home.abort(slot.reservation)

    # --- holds ------------------------------------------------------------------------------
    @contextmanager
    def holding(self, keys: Iterable[bytes]) -> Iterator[Hold]:
        """Keep ``keys``' chunks out of eviction until the block ends: those cached now and
        those stored meanwhile (a pull landing them), as chunks being read are. No put,
        promotion or demotion makes room by evicting them: a put that cannot make room beside
        them goes to a lower tier or raises CapacityError, as beside pinned chunks. An
        operator's evict or flush still takes them."""
        hold = Hold(frozenset(keys))
        with self._lock:
            for key in hold.keys:
                e = self._index.get(key)
                if e is not None:
                    self._hold(hold, e)
            self._hold_list.append(hold)
        try:
            yield hold
        finally:
            with relocked(self._lock):
                self._hold_list.remove(hold)
                for e in hold.entries:
                    self._end_read(e)

    def _hold(self, hold: Hold, e: Entry) -> None:
        self._begin_read(e)
        hold.entries.append(e)

    def room_bytes(self) -> int:
        """Bytes of new chunks the usable tiers could take now if everything evictable went:
        their capacity less their pinned chunks and those held or being read. An upper bound
        (leased regions may split a cpu tier's free space, an admission policy may refuse)."""
        with self._lock:
            busy = dict.fromkeys(self._pinned_bytes, 0)
            for e in self._reading:
                if not e.pinned and self._holds(e):
                    busy[e.tier] += e.size_bytes
            return sum(
                max(0, t.capacity_bytes - self._pinned_bytes[t.name] - busy[t.name])
                for t in self._tiers
                if self._usable(t)
            )

    def _check_new(self, key: bytes, size: int, *, priority: int, parent: bytes | None) -> None:
        _check_key(key)
        if self.chunk_bytes is not None and size != self.chunk_bytes:
            raise PayloadSizeError(f"chunk is {size} bytes; this store holds {self.chunk_bytes}")
        if not 0 <= priority <= MAX_PRIORITY:
            raise InvalidArgument(f"priority must be in 0..{MAX_PRIORITY}, got {priority}")
        if parent is not None:
            _check_key(parent, "parent")

    def _new_entry(
        self,
        key: bytes,
        size: int,
        *,
        tier: str,
        tokens: int | None,
        tenant: str,
        parent: bytes | None,
        priority: int,
        isolated: bool,
        now: float,
        depth: int = 0,
        retention_until_s: float | None = None,
    ) -> Entry:
        entry = Entry(
            key=key,
            tier=tier,
            size_bytes=size,
            tokens=self.chunk_tokens if tokens is None else tokens,
            tenant=tenant,
            parent=parent,
            priority=priority,
            isolated=isolated,
            created_s=now,
            last_access_s=now,
            depth=depth,
            retention_until_s=retention_until_s,
        )
        entry.tenants.add(tenant)
        return entry

    def _insert_new(
        self, entry: Entry, target: Tier, *, start: int, skip: set[str], pinned: bool
    ) -> None:
        """Under the lock: a new chunk, whose bytes are in ``target`` now, joins the index
        (``put`` asked from tier rank ``start``, passing over ``skip``)."""
        entry.tier = target.name
        policy = self._policies[target.name]
        rank = self._tier_index[target.name]
        rerouted = False
        if rank > start:  # offline (or failed) above, else no room could be made there
            rerouted = any(t.name in skip or not self._usable(t) for t in self._tiers[start:rank])
            if not rerouted:
                self._accounting.spilled_puts += 1
        self._back_online(target)
        if rerouted:
            self._accounting.rerouted_puts += 1
        self._tick += 1
        entry.last_tick = self._tick
        self._index[entry.key] = entry
        if entry.isolated:
            self._isolated_owner[entry.key] = entry.tenant
        self._link_parent(entry, +1)
        if pinned:
            entry.pinned = True
            self._pinned_bytes[target.name] += entry.size_bytes
        else:
            policy.on_insert(entry)
        for hold in self._hold_list:  # a pull landing the chunks it holds
            if entry.key in hold.keys:
                self._hold(hold, entry)
        ts = self._accounting.tier(target.name)
        ts.puts += 1
        ts.bytes_written += entry.size_bytes
        self._emit("store", entry)

    def lookup(self, keys: Sequence[bytes], *, tenant: str = "") -> LookupResult:
        """Longest cached prefix of a key chain, and the tier of every key. Counts hits.

        Engines call this for every request with chains of hundreds of keys, so the work per key
        runs in C (``map``, ``list.count``, ``Counter``); a Python-level loop over the chain only
        runs in the rare mixed cases (isolated chunks of another tenant, a prefix over tiers
        with uneven token counts).
        """
        check_tenant(tenant)
        with self._lock:
            n = len(keys)
            entries: list[Entry | None] = list(map(self._index.get, keys))
            if tenant in self._isolated_tenants:  # its own chunks only
                entries = [e if e is not None and e.tenant == tenant else None for e in entries]
            elif self._isolated_owner:
                entries = self._hide_foreign(keys, entries, tenant)
            try:
                m = entries.index(None)
            except ValueError:
                m = n
            prefix: list[Entry] = entries[:m]  # type: ignore[assignment]
            tiers: list[str] = list(map(_TIER_OF, prefix))
            tokens: list[int] = list(map(_TOKENS_OF, prefix))
            matched_tokens = sum(tokens)
            if m:
                self._accounting.count_hits(prefix, tiers, tokens, tenant)
            self._accounting.count_lookup(n, m, matched_tokens, m, matched_tokens)
            if entries.count(None) == n - m:
                locations = (*tiers, *([None] * (n - m)))
            else:
                locations = (*tiers, *(None if e is None else e.tier for e in entries[m:]))
            return LookupResult(n, m, locations, matched_tokens)

    def locate(self, keys: Sequence[bytes], *, tenant: str = "") -> list[str | None]:
        """The tier of each key (None: not cached, or not visible to ``tenant``). Unlike
        ``lookup`` this counts nothing: it answers "is it there?" for tools and engines."""
        check_tenant(tenant)
        with self._lock:
            if tenant in self._isolated_tenants:  # its own chunks only
                return [
                    e.tier if e is not None and e.tenant == tenant else None
                    for e in map(self._index.get, keys)
                ]
            entries: list[Entry | None] = list(map(self._index.get, keys))
            if self._isolated_owner:
                entries = self._hide_foreign(keys, entries, tenant)
            return [None if e is None else e.tier for e in entries]

    def peek(self, keys: Sequence[bytes], *, tenant: str = "") -> LookupResult:
        """What :meth:`lookup` would answer, counting nothing and touching no recency: for
        operators' tools, which must not move the hit ratio they inspect."""
        with self._lock:
            tiers = self.locate(keys, tenant=tenant)
            m = tiers.index(None) if None in tiers else len(tiers)
            matched_tokens = sum(self._index[k].tokens for k in keys[:m])
            return LookupResult(len(keys), m, tuple(tiers), matched_tokens)

    def read_into(self, key: bytes, out: memoryview | bytearray, *, tenant: str = "") -> int:
        """Copy a chunk into ``out``; returns its size. Promotes a hit below the lease tier
        into it (never into a gpu tier above it). A disk chunk is read without the store's
        lock (see the module docstring)."""
        return self._read_chunk(key, tenant, byte_view(out))[0]

    def get(self, key: bytes, *, tenant: str = "") -> bytearray:
        """A chunk's bytes in a new buffer owned by the caller."""
        buf = self._read_chunk(key, tenant, None)[1]
        assert isinstance(buf, bytearray)  # _read_chunk's own buffer when given none
        return buf

    def get_uncounted(self, key: bytes, *, tenant: str = "") -> bytearray:
        """``get`` for a chunk a ``lease_many`` of the same request already counted as served
        (it answered None for it, or its lease lost its bytes to a resize): the same read (and
        promotion), without counting the access again, so the chunk's ``hit_count`` and its
        eviction policy's recency and frequency see one read per request. Its bytes read are
        counted (they are read)."""
        buf = self._read_chunk(key, tenant, None, served=False)[1]
        assert isinstance(buf, bytearray)
        return buf

    def touch(self, key: bytes, *, tenant: str = "") -> str:
        """Access a chunk without reading it (size-only simulation); returns its tier after."""
        check_tenant(tenant)
        with self._lock:
            e = self._get_visible(key, tenant)
            self._access(e, self._clock())
            self._accounting.served(e, tenant)
            self._promote(e, None)
            return e.tier

    def lease(self, key: bytes, ttl_s: float, *, tenant: str = "") -> Lease | None:
        """Hold a chunk's bytes in place in the lease tier (the first cpu tier), moving it there
        first (up from disk, or down from a gpu tier above: a promotion either way), so a reader
        can copy or send them without the store's lock. None when the chunk cannot be held
        there (pinned in another tier, no room, or ``promote_on_hit`` off): read it with
        ``read_into`` instead. Raises KeyNotFound like ``get`` (CorruptChunk when the disk copy
        failed its checksum and was dropped), TierUnavailable when the store has no cpu tier."""
        (result,) = self.lease_many([key], ttl_s, tenant=tenant)
        if isinstance(result, KeyNotFound):
            raise result
        return result

    def lease_many(
        self, keys: Sequence[bytes], ttl_s: float, *, tenant: str = "", served: bool = True
    ) -> list[LeaseResult]:
        """``lease`` for each key, in order, with the disk chunks among them read in parallel
        and without the store's lock. Each answer is a Lease, None (cannot be held in the lease
        tier: read it with ``read_into``), or the KeyNotFound that ``lease`` would raise (a
        CorruptChunk: the disk copy was bad and is gone), returned rather than raised so one
        miss does not cost the rest of the batch. Raises TierUnavailable when the store has no
        cpu tier (or a tier fails), holding no lease of the batch then.

        Every key counts as served up front, like ``lease`` does (``served=False``: not at all,
        neither its hit count nor its policy's access: a re-read of chunks a lease counted). A
        key another batch is moving into the lease tier is waited for rather than read twice,
        so do not call this with the store's lock held (``locked()``): waiting gives the lock
        up."""
        check_tenant(tenant)
        return self._leases.lease_many(keys, ttl_s, tenant=tenant, served=served)

    def leased_view(self, lease: Lease) -> memoryview:
        """The bytes a lease holds, read-only and in place (valid while the lease holds)."""
        return self._leases.view(lease)

    def release(self, lease_ids: Iterable[int]) -> int:
        """End leases; returns how many were still held (expired ones are not)."""
        return self._leases.release(lease_ids)

    def expire_leases(self) -> int:
        return self._leases.expire()

    def locked(self) -> threading.RLock:
        """The store's lock, for a caller that must read a tier's state consistently."""
        return self._lock

    def snapshot(self) -> dict[str, Any]:
        """Counters, usage, live leases and measured read bandwidth read together, for metrics
        and the stats API."""
        with self._lock:
            return {
                "stats": self._accounting.as_dict(),
                "usage": self.usage(),
                "leases": self._leases.lease_count,
                "queued_accesses": self.queued_accesses,
                "policies": self.policy_status(),
                "read_bandwidth_bytes_per_second": self._accounting.read_bandwidth(),
            }

    def read_bandwidth(self) -> dict[str, float | None]:
        """Measured read bandwidth of each tier of this store, bytes/s: a moving average over
        the reads the store made from it, counting only samples of at least
        MIN_BANDWIDTH_SAMPLE_BYTES. A lease batch's disk reads are one sample: their bytes over
        the time at least one of them was being read (the union of the reads' own intervals,
        each timed from its own start), so time the batch's reads spent queued in the pool,
        behind other batches' reads, with none of them running is not counted, while reads of
        the batch that ran at once count once (the parallel throughput the batch got). None for
        a tier not measured yet. For fetch-or-recompute: fetch when latency + bytes / bandwidth
        beats recomputing."""
        with self._lock:
            return self._accounting.read_bandwidth()

    def entry(self, key: bytes) -> Entry:
        with self._lock:
            try:
                return self._index[key]
            except KeyError:
                raise KeyNotFound(f"key {key.hex()} is not cached") from None

    def entries(self, tier: str | None = None) -> list[Entry]:
        with self._lock:
            if tier is None:
                return list(self._index.values())
            name = self.tier(tier).name
            return [e for e in self._index.values() if e.tier == name]

    def hottest(self, limit: int, *, pinned_only: bool = False) -> list[HotChunk]:
        """Up to ``limit`` chunks with the most hits, ties to the most recently accessed, each
        with the cached prefix chain it ends. For operators' views: counts and touches nothing.

        Like ``entries`` it sees every tenant's chunks (isolated ones say so). ``pinned_only``
        keeps to pinned chunks.
        """
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidArgument(f"limit must be a non-negative integer, got {limit!r}")
        with self._lock:
            pool: Iterable[Entry] = self._index.values()
            if pinned_only:
                pool = (e for e in pool if e.pinned)
            # O(n log limit), not a full sort of the index
            top = nlargest(limit, pool, key=_HEAT)
            memo: dict[bytes, tuple[int, int, bool]] = {}
            return [_hot(e, *self._prefix_of(e, memo)) for e in top]

    def pin(self, keys: Iterable[bytes], *, tier: str | None = None) -> BulkResult:
        """Pin chunks (never evicted), moving them to ``tier`` first when given (as ``move``
        does: disk reads and writes without the lock), then pinning those in it: one that could
        not be moved (no room, a failed read) counts ``failed``, one evicted meanwhile
        ``missing``.

        Raises CapacityError (TierUnavailable), before moving or pinning anything, when the
        pins cannot fit the tier (it is offline).
        """
        with self._lock:
            found, missing = self._split_known(keys)
            if tier is None:
                for e in found:
                    self._pin(e)
                return BulkResult(done=len(found), missing=missing)
            target = self.tier(tier)
            extra = sum(e.size_bytes for e in found if not e.pinned or e.tier != target.name)
            if self._pinned_bytes[target.name] + extra > target.capacity_bytes:
                raise CapacityError(
                    f"pinning {extra} more bytes in tier {target.name!r} exceeds its "
                    f"capacity ({target.capacity_bytes} bytes, "
                    f"{self._pinned_bytes[target.name]} already pinned)"
                )
            if not self._usable(target):
                raise TierUnavailable(self._unusable_message(target))
            away = [e for e in found if e.tier != target.name]
        # moved as ``move`` does (disk reads and writes without the lock), then pinned; one
        # that could not be moved (no room) is counted failed, one evicted meanwhile missing
        self._move_each(away, 0, target)
        done = failed = 0
        with self._lock:
            for e in found:
                if self._index.get(e.key) is not e:
                    missing += 1
                elif e.tier != target.name:
                    failed += 1
                else:
                    self._pin(e)
                    done += 1
        return BulkResult(done=done, missing=missing, failed=failed)

    def unpin(self, keys: Iterable[bytes]) -> BulkResult:
        with self._lock:
            found, missing = self._split_known(keys)
            for e in found:
                if e.pinned:
                    e.pinned = False
                    self._pinned_bytes[e.tier] -= e.size_bytes
                    if e not in self._reading:  # a read in flight puts it back when done
                        self._policies[e.tier].on_insert(e)
            return BulkResult(done=len(found), missing=missing)

    # The bulk operations below take the lock once per chunk, not once for the batch: an
    # operator's flush or move of thousands of chunks (each a disk write or unlink) must not
    # stall every reader until it ends. A chunk that went meanwhile counts as missing.

    def evict(self, keys: Iterable[bytes]) -> BulkResult:
        """Drop chunks from the store. Pinned chunks are skipped, never evicted."""
        with self._lock:
            found, missing = self._split_known(keys)
        done = pinned = 0
        for e in found:
            with self._lock:
                if self._index.get(e.key) is not e:
                    missing += 1
                elif e.pinned:
                    pinned += 1
                else:
                    self._evict(e, "explicit", demote=False)
                    done += 1
        return BulkResult(done=done, skipped_pinned=pinned, missing=missing)

    def flush(
        self,
        tier: str,
        *,
        demote: bool = False,
        into: str | None = None,
        hottest_first: bool = False,
        deadline_s: float | None = None,
        landed: set[bytes] | None = None,
    ) -> BulkResult:
        """Empty a tier of unpinned chunks (dropped, or demoted when ``demote``: from a cpu
        tier to disk, written without the lock). Chunks put there meanwhile may stay.
        ``demote`` of the bottom tier raises InvalidArgument: there is nowhere to demote to;
        with ``demote`` a chunk the tier below refuses, has no room for or fails to write stays
        where it is, counted ``failed``: an operator asked to demote, never to drop.

        ``into`` (with ``demote``): a tier further down to demote to, past the ones between (a
        gpu tier's chunks straight to disk, as ``move`` takes them). ``hottest_first``: in the
        reverse of the tier's eviction order, and once the tier below could only make room by
        evicting a chunk this flush put there (all the rest are colder), the rest stay
        (``failed``); a chunk no room can be made for at all fails alone. ``landed``: the keys
        earlier flushes of hotter tiers put below (kept like this flush's own, which are added
        to it). ``deadline_s`` (``time.monotonic``): no chunk is begun past it; the ones left
        are ``unfinished``."""
        with self._lock:
            name = self.tier(tier).name
            if demote and self._tier_index[name] == len(self._tiers) - 1:
                # demoting from the bottom tier would drop every chunk: refuse, drop nothing
                raise InvalidArgument(
                    f"cannot demote the {name} tier's chunks: no tier is below it (this "
                    f"store's tiers, top down: {', '.join(self._tier_index)}); nothing was "
                    "flushed. Flush without demote to drop them"
                )
            below = self._tiers[self._tier_index[name] + 1] if demote else None
            if below is not None and into is not None:
                below = self.tier(into)
                if self._rank(below.name) <= self._rank(name):
                    raise InvalidArgument(f"cannot demote the {name} tier's chunks up to {into}")
            if below is not None and below.name in self._absent:
                raise TierUnavailable(
                    f"cannot demote the {name} tier's chunks: {self._unusable_message(below)}; "
                    "nothing was flushed"
                )
            found = [e for e in self._index.values() if e.tier == name]
            if hottest_first:
                found = self._hottest_first(name, found)
        skip_next = below is not None and self._rank(below.name) > self._rank(name) + 1
        if landed is None:  # what this flush (and hotter ones) put below: hottest_first's stop
            landed = set()
        done = done_bytes = pinned = failed = 0
        for i, e in enumerate(found):
            if deadline_s is not None and time.monotonic() >= deadline_s:
                return BulkResult(
                    done=done,
                    skipped_pinned=pinned,
                    failed=failed,
                    done_bytes=done_bytes,
                    unfinished=len(found) - i,
                )
            with self._lock:
                if self._index.get(e.key) is not e or e.tier != name:
                    continue
                if e.pinned:
                    pinned += 1
                    continue
                if below is not None and hottest_first and self._evicts_any(below, e, landed):
                    # only this flush's hotter chunks would make room below: keep the rest
                    failed += sum(1 for c in found[i:] if self._holds(c) and not c.pinned)
                    pinned += sum(1 for c in found[i:] if self._holds(c) and c.pinned)
                    break
                src = self._tier_of(e)
                d = None
                # demote, not drop: a chunk the tier below cannot take stays here (failed)
                if below is not None and skip_next:
                    d, step = self._start_move(e, below)
                    if step == "failed":
                        failed += 1
                    if step in ("failed", "missing"):  # a copy found corrupt: dropped
                        continue
                elif demote and isinstance(src, CpuTier) and self._may_detach(e, src):
                    d = self._begin_demotion(e, src, reason="flush", keep=True)
                    if d is None and self._holds(e) and e.tier == name:
                        failed += 1
                        continue
                elif not self._evict(e, "flush", demote=demote, keep=demote):
                    failed += 1
                    continue
            if d is not None:
                self._finish_demotions([d])
                if d.outcome != "landed":  # pinned or moved meanwhile, or its write failed
                    with self._lock:
                        if self._holds(e) and e.tier == name:
                            if e.pinned:
                                pinned += 1
                            else:
                                failed += 1
                    continue
            done += 1
            done_bytes += e.size_bytes
            landed.add(e.key)
        return BulkResult(done=done, skipped_pinned=pinned, failed=failed, done_bytes=done_bytes)

    def _hottest_first(self, name: str, found: list[Entry]) -> list[Entry]:
        """Under the lock: ``found`` (chunks of tier ``name``) in the reverse of its policy's
        eviction order, the ones its policy does not track (pinned, being read) last."""
        order = list(self._policies[name].victims(self._clock()))
        order.reverse()
        ranked = {e.key for e in order}
        return order + [e for e in found if e.key not in ranked]

    def _evicts_any(self, tier: Tier, e: Entry, keys: set[bytes]) -> bool:
        """Under the lock: whether making room for ``e`` in ``tier`` would evict a chunk of
        ``keys``. Not when no room can be made for ``e`` at all (larger than the tier's unpinned
        room): that one fails alone, and a smaller chunk after it may still fit."""
        if not keys or self._fits_now(tier, e.size_bytes):
            return False
        victims = self._room_victims(tier, e.size_bytes)
        return victims is not None and any(v.key in keys for v in victims)

    def move(self, keys: Iterable[bytes], tier: str) -> BulkResult:
        """Move chunks to ``tier`` (up or down), making room there by policy; from a cpu tier
        down to disk, the write is made without the lock. Raises TierUnavailable, moving
        nothing, when ``tier`` is absent (could not be opened)."""
        with self._lock:
            target = self.tier(tier)
            if target.name in self._absent:
                raise TierUnavailable(self._unusable_message(target))
            found, missing = self._split_known(keys)
        return self._move_each(found, missing, target)

    def _move_each(
        self, found: list[Entry], missing: int, target: Tier, *, up_only: bool = False
    ) -> BulkResult:
        """``move`` of ``found`` (``missing`` keys were not cached), one chunk under the lock at
        a time; ``up_only`` (a prefetch): a chunk at or above ``target`` by then stays."""
        rank = self._rank(target.name)
        done = failed = 0
        for e in found:
            d = None
            read: tuple[Tier, ReadPlan] | None = None
            with self._lock:
                if self._index.get(e.key) is not e:
                    missing += 1
                    continue
                if e.tier == target.name or (up_only and self._rank(e.tier) < rank):
                    continue
                src = self._tier_of(e)
                if src.detached_reads and self._rank(e.tier) > rank and self._usable(target):
                    read = src, src.plan_read(e.key)  # up from disk: read without the lock
                    self._begin_read(e)
                else:
                    d, step = self._start_move(e, target)
                    failed += step == "failed"
                    missing += step == "missing"  # its copy was found corrupt: dropped
                    if step in ("failed", "missing"):
                        continue
            if read is not None:
                outcome = self._move_up(e, target, *read, up_only)
                done += outcome == "done"
                failed += outcome == "failed"
                missing += outcome == "missing"
                continue
            if d is not None:
                self._finish_demotions([d])
                if d.outcome != "landed":
                    with self._lock:  # one evicted meanwhile went, as one evicted before
                        if self._holds(e):
                            failed += 1
                        else:
                            missing += 1
                    continue
            done += 1
        return BulkResult(done=done, missing=missing, failed=failed)

    def _move_up(self, e: Entry, dst: Tier, src: Tier, plan: ReadPlan, up_only: bool) -> str:
        """``_move_each``'s move of ``e`` up from ``src`` (detached reads; ``_begin_read`` made
        under the lock): read without the lock, then placed in ``dst`` under it. "done",
        "missing" (evicted meanwhile, or unreadable: dropped), "failed" (no room, or the read
        failed: the chunk stays where it is) or "kept" (``up_only``: above ``dst`` by then)."""
        try:
            buf = bytearray(e.size_bytes)
        except BaseException:
            with relocked(self._lock):
                self._end_read(e)
            raise
        try:
            why, seconds = self._read_off_lock(e, src, plan, memoryview(buf))
        except (TierUnavailable, OSError):
            return "failed"  # as a read under the lock that raised it was counted
        with relocked(self._lock):
            current = self._is_current(e, src, plan)
            self._end_read(e)
            if not self._holds(e):
                return "missing"
            if current and why is not None:
                self._drop_unreadable(e, src, why)
                return "missing"
            if e.tier == dst.name:
                return "done"  # brought up meanwhile (a read's promotion)
            if up_only and self._rank(e.tier) < self._rank(dst.name):
                return "kept"  # moved above it meanwhile: a prefetch never moves one down
            data: bytearray | None = None
            if current:
                self._accounting.count_read(src.name, e.size_bytes)
                self._accounting.note_bandwidth(src.name, e.size_bytes, seconds)
                data = buf
            try:  # moved elsewhere meanwhile (rare): read again, under the lock, as before
                self._move(e, dst, data)
            except (CapacityError, DiskFullError, TierUnavailable):
                return "failed"
            return "done"

    def prefetch(self, keys: Iterable[bytes], tier: str | None = None) -> BulkResult:
        """Bring chunks up to ``tier`` (default: the tier hits are promoted to, the lease tier,
        which is the top tier unless a gpu tier sits above cpu); chunks already there or higher,
        and unknown keys, are left alone."""
        with self._lock:
            target = self.tier(tier) if tier else self._hit_tier
            rank = self._rank(target.name)
            found, missing = self._split_known(keys)
            up = [e for e in found if self._rank(e.tier) > rank]
        return self._move_each(up, missing, target, up_only=True)

    def resize(self, tier: str, capacity_bytes: int) -> BulkResult:
        """Change a tier's capacity live, evicting (demoting) down to the new size first.
        A cpu tier shrinking over disk demotes in batches written without the lock (a shrink
        by many GiB is that many GiB of disk writes). After at most twice the batches the
        shrink needed at first (plus a few: puts may keep filling the tier), the rest is
        evicted under the lock, so it always ends."""
        with self._lock:
            t = self.tier(tier)
            self._check_resize(t, capacity_bytes)
            evictions = self._accounting.tier(t.name).evictions
            before = evictions["resize"]
            over = t.resident_bytes - capacity_bytes
            size = self.chunk_bytes or 1
            rounds = 2 * DETACHED_DEMOTION_ROUNDS + 2 * -(-max(over, 0) // size // RESIZE_BATCH)
        for _ in range(rounds):
            with self._lock:
                self._check_resize(t, capacity_bytes)
                victims = self._resize_victims(t, capacity_bytes)
                if not victims:
                    break
                later = self._evict_for_later(t, victims, reason="resize")
            self._finish_demotions(later)
        plan = None
        arena = t if isinstance(t, CpuTier) else None  # a new arena: mapped and filled without
        try:  # the lock
            if arena is not None:
                with self._lock:
                    self._check_resize(t, capacity_bytes)
                    if t.resident_bytes <= capacity_bytes:
                        plan = arena.begin_resize(capacity_bytes)
            if arena is not None and plan is not None:
                arena.copy_resize(plan)
            with relocked(self._lock):
                self._check_resize(t, capacity_bytes)
                self._shrink_to(t, capacity_bytes, reason="resize")
                if arena is None or plan is None or not arena.finish_resize(plan):
                    t.resize(capacity_bytes)  # all of it under the lock, as before
                self._policies[t.name].set_max_entries(t.max_chunks())
                return BulkResult(done=evictions["resize"] - before)
        finally:
            if arena is not None and plan is not None:
                try:
                    with relocked(self._lock):
                        arena.abort_resize(plan)  # nothing to do once finished
                finally:
                    arena.release_resize(plan)  # unmapping is slow: not under the lock

    def _check_resize(self, t: Tier, capacity_bytes: int) -> None:
        if t.name in self._absent:  # its capacity is the one asked for when it opens
            raise TierUnavailable(self._unusable_message(t))
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise InvalidArgument(f"capacity must be an integer, got {capacity_bytes!r}")
        if capacity_bytes < 0:
            raise InvalidArgument(f"capacity must not be negative, got {capacity_bytes}")
        if self.chunk_bytes is not None and capacity_bytes < self.chunk_bytes:
            raise InvalidArgument(
                f"capacity {capacity_bytes} bytes is smaller than one chunk "
                f"({self.chunk_bytes} bytes)"
            )
        if capacity_bytes < self._pinned_bytes[t.name]:
            raise CapacityError(
                f"tier {t.name!r} has {self._pinned_bytes[t.name]} pinned bytes; unpin "
                f"before shrinking to {capacity_bytes}"
            )

    def _resize_victims(self, t: Tier, capacity_bytes: int) -> list[Entry]:
        """Under the lock: the next batch (at most ``RESIZE_BATCH``) of ``t``'s victims whose
        demotion can be written without the lock, toward ``capacity_bytes`` resident; [] when
        there is none (``t`` fits, or is no cpu tier over one with detached writes)."""
        over = t.resident_bytes - capacity_bytes
        if over <= 0 or not isinstance(t, CpuTier):
            return []
        out: list[Entry] = []
        for e in self._policies[t.name].victims(self._clock()):
            if over <= 0 or len(out) >= RESIZE_BATCH:
                break
            if self._may_detach(e, t):
                out.append(e)
                over -= e.size_bytes
        return out

    def usage(self) -> dict[str, dict[str, int]]:
        with self._lock:
            counts = dict.fromkeys(self._tier_index, 0)
            for e in self._index.values():
                counts[e.tier] += 1
            return {
                t.name: {
                    "capacity_bytes": t.capacity_bytes,
                    "used_bytes": t.used_bytes,
                    "pinned_bytes": self._pinned_bytes[t.name],
                    "chunks": counts[t.name],
                }
                for t in self._tiers
                if t.name not in self._absent  # not there (yet): no capacity to count
            }

    def add_external_tier(self, name: str) -> TierStats:
        """Count a tier this store does not hold (the remote pool, peers): its hits and reads
        join the store's counters, per tier like local ones (``kvctl.remote`` counts them
        through ``accounting``)."""
        with self._lock:
            return self._accounting.add_external_tier(name)

    def export(
        self, key: bytes, into: Callable[[int], memoryview | None] | None = None
    ) -> tuple[ChunkMeta, bytearray | memoryview] | None:
        """A copy of a chunk and its metadata for another store (the pool's write-behind),
        counting no hit and touching no recency; None when it is gone. ``into(size_bytes)``
        gives the view of exactly that size to copy it into (a buffer the caller reuses; None:
        a new bytearray); what it raises comes out of ``export`` with nothing read. A chunk on
        a detached-read tier (disk) is read without the store's lock, as ``read_into`` reads
        it: the pool writer reading one held every data-plane thread for the disk read."""
        buf: bytearray | memoryview | None = None
        while True:
            with self._lock:
                e = self._index.get(key)
                if e is None:
                    return None
                if buf is None or len(buf) != e.size_bytes:  # (a retry keeps its buffer)
                    out = None if into is None else into(e.size_bytes)
                    buf = bytearray(e.size_bytes) if out is None else out
                    if len(buf) != e.size_bytes:
                        raise ValueError(
                            f"export of {e.size_bytes} bytes into a view of {len(buf)}"
                        )
                tier = self._tier_of(e)
                meta = e.meta()
                if not tier.detached_reads:
                    try:
                        tier.read_into(key, memoryview(buf))
                    except CorruptChunk:
                        self._drop_corrupt(e)
                        return None
                    return meta, buf
                plan = tier.plan_read(key)
                self._begin_read(e)
            why, _ = self._read_off_lock(e, tier, plan, memoryview(buf))
            with relocked(self._lock):
                current = self._is_current(e, tier, plan)
                self._end_read(e)
                if why is None:  # passed its checksum: the chunk's bytes even if it went since
                    return meta, buf
                if current:
                    self._drop_unreadable(e, tier, why)
                    return None
            # it moved or went while it was read: look again

    def policy_status(self) -> dict[str, dict[str, Any]]:
        """Each tier's eviction policy as an operator sees it (``EvictionPolicy.status``)."""
        with self._lock:
            return {name: policy.status() for name, policy in self._policies.items()}

    @property
    def queued_accesses(self) -> int:
        """Reads whose policy bookkeeping waits to be replayed (``defer_accesses``; else 0)."""
        with self._lock:
            return 0 if self._settler is None else self._settler.queued

    def settle_policies(self) -> None:
        """Replay the policies' queued access bookkeeping now (``defer_accesses``), e.g. before
        reading a policy's state."""
        if self._settler is not None:
            with self._lock:
                self._settler.settle()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every tier. Reads under way finish on their own (their commits find the tiers
        closed), queued unlinks still run; no thread is started after this."""
        with self._lock:
            self._closed = True
            if self._settler is not None:
                self._settler.close()
            self._leases.close()
            pool, self._unlink_pool = self._unlink_pool, None
            if pool is not None:
                pool.shutdown(wait=False)
            for t in self._tiers:
                t.close()

    def count_lookup(self, keys: Sequence[bytes], *, limit: int, tenant: str = "") -> LookupResult:
        """:meth:`lookup` whose hits stop after ``limit`` chunks of the cached prefix: the
        fetch-or-recompute plan (``peek`` first) took only those, so the rest are recomputed and
        count as misses. The answer's ``matched_chunks`` is the truncated prefix; ``locations``
        still say where every chunk is."""
        with self._lock:
            seen = self.peek(keys, tenant=tenant)
            n, m = len(keys), min(seen.matched_chunks, max(limit, 0))
            prefix = [self._index[k] for k in keys[:m]]
            tiers, tokens = [e.tier for e in prefix], [e.tokens for e in prefix]
            if m:
                self._accounting.count_hits(prefix, tiers, tokens, tenant)
            hit_tokens = sum(tokens)
            # what was asked for does not depend on the plan: the whole cached prefix
            self._accounting.count_lookup(
                n, seen.matched_chunks, seen.matched_tokens, m, hit_tokens
            )
            return LookupResult(n, m, seen.locations, hit_tokens)

    # --- internals --------------------------------------------------------------------------
    def _usable(self, tier: Tier) -> bool:
        """False while ``tier`` is absent, or offline and its retry is not yet due."""
        if tier.name in self._absent:
            return False
        off = self._offline.get(tier.name)
        return off is None or self._clock() >= off[1]

    def _unusable_message(self, tier: Tier) -> str:
        absent = self._absent.get(tier.name)
        if absent is not None:
            return f"tier {tier.name!r} is unavailable: {absent}"
        return f"tier {tier.name!r} is offline: {self._offline[tier.name][0]}"

    def _take_offline(self, tier: Tier, exc: TierUnavailable) -> None:
        was_offline = tier.name in self._offline
        self._offline[tier.name] = (str(exc), self._clock() + self.offline_retry_s)
        if not was_offline:  # a retry that fails again is no news
            self._say.say(
                f"offline:{tier.name}",
                logging.WARNING,
                "tier %s taken offline: %s; its chunks go to the next tier down, and a write "
                "tries it again after %.0f s",
                tier.name,
                _reason(exc),
                self.offline_retry_s,
            )

    def _back_online(self, tier: Tier) -> None:
        """A write into ``tier`` landed: it is no longer offline (said when it was)."""
        if self._offline.pop(tier.name, None) is not None:
            self._say.say(f"online:{tier.name}", logging.WARNING, "tier %s back online", tier.name)

    def _demotion_failed(self, dst: Tier, why: BaseException | str) -> None:
        """Count (``demotion_failures``) and say a demotion (or a move down) into ``dst``
        that did not land: the chunk was dropped, or kept where it was (an operator's)."""
        self._accounting.stats.demotion_failures += 1
        self._say.say(
            f"demotion_failed:{dst.name}",
            logging.WARNING,
            "a chunk could not be demoted into tier %s (dropped, or kept where it was for an "
            "operator's move): %s",
            dst.name,
            why if isinstance(why, str) else _reason(why),
        )

    def _offline_message(self, tiers: Sequence[Tier]) -> str:
        why = "; ".join(f"{t.name}: {self._offline[t.name][0]}" for t in tiers)
        return f"no tier can take the chunk, all are offline ({why})"

    def _rank(self, name: str) -> int:
        try:
            return self._tier_index[name]
        except KeyError:
            raise InvalidArgument(
                f"unknown tier {name!r}; this store has {', '.join(self._tier_index)}"
            ) from None

    def _hide_foreign(
        self, keys: Sequence[bytes], entries: list[Entry | None], tenant: str
    ) -> list[Entry | None]:
        """``entries`` (``keys``' entries, in order) with another tenant's isolated chunks as
        None, the answer for "not cached", by the same work whether or not ``keys`` name any:
        all in C (maps of dict lookups), no Python-level step per hidden key. A loop run only
        where one was named made a lookup of 512 keys 40% slower (11 us), which told a tenant
        that another's isolated chunk exists under a key it named, though it answered a miss."""
        # True where the key is no isolated chunk or ``tenant``'s own, else False
        mine: dict[str | None, bool] = {None: True, tenant: True}
        shown = map(mine.get, map(self._isolated_owner.get, keys), repeat(False))
        hide: dict[bool, Entry | None] = {False: None}
        return list(map(hide.get, shown, entries))

    def _visible(self, e: Entry, tenant: str) -> bool:
        """An isolated chunk is its owner's only; an isolated tenant sees only its own."""
        if e.isolated or tenant in self._isolated_tenants:
            return e.tenant == tenant
        return True

    def _get_visible(self, key: bytes, tenant: str) -> Entry:
        e = self._index.get(key)
        if e is None or not self._visible(e, tenant):
            # the same answer for "absent" and "another tenant's isolated chunk"
            raise KeyNotFound(f"key {key.hex()} is not cached")
        return e

    def _holds(self, e: Entry) -> bool:
        """Whether ``e`` is still the index's entry for its key (not evicted or replaced)."""
        return self._index.get(e.key) is e

    def _tier_of(self, e: Entry) -> Tier:
        return self._tiers[self._tier_index[e.tier]]

    def _split_known(self, keys: Iterable[bytes]) -> tuple[list[Entry], int]:
        found: list[Entry] = []
        missing = 0
        for key in keys:
            e = self._index.get(key)
            if e is None:
                missing += 1
            else:
                found.append(e)
        return found, missing

    def _prefix_of(
        self, e: Entry, memo: dict[bytes, tuple[int, int, bool]]
    ) -> tuple[int, int, bool]:
        """(chunks, tokens, complete) of the cached chain ending at ``e``, by ``parent`` links.

        ``memo`` carries answers between the walks of one ``hottest``, so chains that share a
        prefix walk it once and no entry is visited twice. A walk stops, answering incomplete,
        at an uncached parent, after _MAX_PREFIX_WALK chunks, or on a cycle (only hand-made
        parents can make one).
        """
        walked: list[Entry] = []
        on_walk: set[bytes] = set()
        base = (0, 0, False)  # what lies above the walk: nothing known unless it ends well
        cur: Entry | None = e
        while cur is not None:
            known = memo.get(cur.key)
            if known is not None:
                base = known
                break
            if cur.key in on_walk or len(walked) >= _MAX_PREFIX_WALK:
                break
            walked.append(cur)
            on_walk.add(cur.key)
            if cur.parent is None:
                base = (0, 0, True)
                break
            cur = self._index.get(cur.parent)
        chunks, tokens, complete = base
        for w in reversed(walked):  # from the top of the walk down to e
            chunks += 1
            tokens += w.tokens
            memo[w.key] = (chunks, tokens, complete)
        return memo[e.key]

    def _access(self, e: Entry, now: float) -> None:
        self._tick += 1
        e.last_tick = self._tick
        e.last_access_s = now
        e.access_count += 1
        if not e.pinned and e not in self._reading:
            self._policies[e.tier].on_access(e)

    def _read(self, e: Entry, out: memoryview) -> None:
        tier = self._tier_of(e)
        started_s = time.perf_counter()
        try:
            n = tier.read_into(e.key, out)
        except CorruptChunk:
            self._drop_corrupt(e)  # and report a miss
            raise
        self._accounting.count_read(e.tier, n)
        self._accounting.note_bandwidth(tier.name, n, time.perf_counter() - started_s)

    def _drop_corrupt(self, e: Entry) -> None:
        """``e``'s tier dropped its copy as untrustworthy: count it, and forget ``e``."""
        self._accounting.stats.corrupt_dropped += 1
        self._accounting.tier(e.tier).evictions["corrupt"] += 1
        self._forget(e)

    # --- reads without the lock -------------------------------------------------------------
    def _begin_read(self, e: Entry) -> None:
        """Under the lock: ``e`` is about to be read without it; keep pressure off it."""
        n = self._reading.get(e, 0)
        if n == 0 and not e.pinned:
            self._policies[e.tier].on_remove(e)
        self._reading[e] = n + 1

    def _end_read(self, e: Entry) -> None:
        """Under the lock: a read of ``e`` is over. A chunk being read is in
        no policy (a move or promotion meanwhile puts it in none either): once its last read
        is over, the policy of the tier it is in now tracks it, unless it was evicted or
        pinned meanwhile."""
        n = self._reading[e] - 1
        if n:
            self._reading[e] = n
            return
        del self._reading[e]
        if not e.pinned and self._holds(e):
            self._policies[e.tier].on_insert(e)

    def _is_current(self, e: Entry, src: Tier, plan: ReadPlan) -> bool:
        """Whether a read planned from ``src`` read the copy the store still holds for ``e``."""
        return self._holds(e) and e.tier == src.name and src.plan_is_current(plan)

    def _drop_unreadable(self, e: Entry, src: Tier, why: str) -> CorruptChunk:
        """A detached read found ``e``'s copy untrustworthy: drop it like ``_read`` does."""
        exc = src.drop_unreadable(e.key, why)
        self._drop_corrupt(e)
        return exc

    def _read_chunk(
        self, key: bytes, tenant: str, out: memoryview | None, *, served: bool = True
    ) -> tuple[int, memoryview | bytearray]:
        """``read_into`` (into ``out``) and ``get`` (``out`` None: into a new bytearray, which
        is returned). Reads from a detached-read tier happen outside the lock. ``served``
        False: the access was counted already (``get_uncounted``)."""
        check_tenant(tenant)
        while True:
            with self._lock:
                e = self._get_visible(key, tenant)
                size = e.size_bytes
                buf: memoryview | bytearray
                if out is None:
                    buf = bytearray(size)
                    view = memoryview(buf)
                else:
                    if out.nbytes < size:
                        raise InvalidArgument(
                            f"buffer of {out.nbytes} bytes is smaller than the chunk ({size})"
                        )
                    buf = view = out[:size]
                src = self._tier_of(e)
                if not src.detached_reads:
                    self._read(e, view)
                    if served:
                        self._access(e, self._clock())
                        self._accounting.served(e, tenant)
                    self._promote(e, view)
                    return size, buf
                plan = src.plan_read(key)
                self._begin_read(e)
            why, seconds = self._read_off_lock(e, src, plan, view)
            later: list[_Demotion] = []
            try:
                with relocked(self._lock):
                    current = self._is_current(e, src, plan)
                    self._end_read(e)
                    if why is not None:
                        if current:
                            raise self._drop_unreadable(e, src, why)
                        continue  # it moved or went while we read: look again
                    self._accounting.count_read(src.name, size)
                    self._accounting.note_bandwidth(src.name, size, seconds)
                    # the bytes passed the checksum: they are the chunk's even if it went
                    if self._index.get(key) is e:
                        if served:
                            self._access(e, self._clock())
                            self._accounting.served(e, tenant)
                        if e.tier == src.name:
                            later = self._promote_read(e, view)
            finally:
                if later:  # begun: each demotion ends, and the chunk is brought up or not
                    self._finish_promotion(e, src.name, view, later)
            return size, buf

    def _read_off_lock(
        self, e: Entry, src: Tier, plan: ReadPlan, out: memoryview
    ) -> tuple[str | None, float]:
        """Without the lock: ``plan``'s detached read (``_begin_read(e)`` made under it) into
        ``out``: why the copy is unreadable (None: read and verified), and the seconds it took.
        Where the read raises, the read is ended under the lock, then the error raised."""
        try:
            started_s = time.perf_counter()
            why = src.read_planned(plan, out)
            return why, time.perf_counter() - started_s
        except BaseException:
            with relocked(self._lock):
                self._end_read(e)
            raise

    def _delete_copy(self, tier: Tier, key: bytes) -> None:
        """Under the lock: delete the copy a promotion left behind, its slow part (unlinking
        a large file) in the unlink pool: not under the lock, not in the reader's time, and
        never queued ahead of reads. Once the store is closed it is done here instead."""
        cleanup = tier.delete_later(key)
        if cleanup is None:
            return
        if self._closed:
            cleanup()
            return
        pool = self._unlink_pool
        if pool is None:
            pool = self._unlink_pool = ThreadPoolExecutor(
                UNLINK_THREADS, thread_name_prefix="kvctl-store-unlink"
            )
        try:
            pool.submit(cleanup)
        except RuntimeError:  # the interpreter is shutting down: do it here
            cleanup()

    def _plan_put(
        self, entry: Entry, start: int, *, pinned: bool, now: float, skip: set[str]
    ) -> tuple[Tier, list[Entry]] | None:
        """Changing nothing: the first tier from ``start`` down that can take the new chunk
        ``entry`` and the victims to evict there first, or None when that tier's policy
        declines it (bypass). A pinned chunk is pinned in the first usable tier or nowhere.
        Raises CapacityError (why, per tier) when no tier can take it, TierUnavailable when
        every tier is offline."""
        size = entry.size_bytes
        what = "pin" if pinned else "chunk"
        why: list[str] = []
        if not pinned and self._unreachable(entry):
            return None
        for target in self._tiers[start:]:
            if target.name in skip or not self._usable(target):
                continue
            pinned_bytes = self._pinned_bytes[target.name]
            if size > target.capacity_bytes - pinned_bytes:
                why.append(
                    f"{what} of {size} bytes cannot fit tier {target.name!r}: capacity "
                    f"{target.capacity_bytes} bytes, {pinned_bytes} pinned"
                )
            else:
                entry.tier = target.name
                policy = self._policies[target.name]
                fits = self._fits_now(target, size)
                if not pinned and not fits and not policy.admit(entry, now):
                    return None
                if fits and target.plan_room(size, ()) == []:
                    return target, []  # fits as is: no policy walk
                victims = target.plan_room(size, policy.victims(now))
                if victims is not None:
                    victims = self._count_room(target, victims, now)
                    if victims is not None:
                        return target, victims
                    why.append(
                        f"{what} cannot fit tier {target.name!r}: it holds its most chunks "
                        f"({target.max_chunks()}, one per {MIN_CHARGED_BYTES} bytes of "
                        f"capacity) and too few can be evicted"
                    )
                else:
                    why.append(
                        f"{what} of {size} bytes cannot fit tier {target.name!r}: no run of "
                        f"{size} bytes can be freed between its leased or reserved regions"
                    )
            if pinned:
                break
        if not why:
            offline = [t for t in self._tiers[start:] if t.name in self._offline]
            if offline:
                raise TierUnavailable(self._offline_message(offline))
            raise CapacityError(f"no tier could take a {what} of {size} bytes")
        raise CapacityError("; ".join(why))

    def _unreachable(self, entry: Entry) -> bool:
        """Whether ``entry`` (not stored yet) lies deeper in its chain than all the tiers together
        can hold, with ``bypass_unreachable`` set: a lookup matches a chunk only after every chunk
        before it, so with fewer than ``depth + 1`` chunks of room in all it can never be matched,
        and storing it would only evict what can (on the system-prompt generator at 5% of its
        unique blocks, every policy evicted the short prompts for the tails of the longest
        ones: lineage-lru 3.5% of Belady, 56.7% with this). A chunk's ancestors are never
        smaller than it (a partial chunk only ends a chain), so this never turns away a chunk
        a lookup could reach. The lookup must start at the chain's first chunk: an engine that
        keeps a prefix of its own and asks for the rest (vLLM's local prefix cache) or a peer
        holding the start does not, hence a setting."""
        if not self.bypass_unreachable or entry.depth <= 0:
            return False
        reach_bytes = sum(t.capacity_bytes for t in self._tiers)
        return (entry.depth + 1) * entry.size_bytes > reach_bytes

    def _evict_for(self, tier: Tier, victims: Sequence[Entry]) -> None:
        """Evict (demote) the victims ``Tier.plan_room`` chose to make room in ``tier``."""
        policy = self._policies[tier.name]
        for v in victims:
            # planned under this lock a moment ago; evicting one never takes out another
            if self._index.get(v.key) is not v or v.tier != tier.name or v.pinned:
                continue
            policy.on_victim(v)
            self._evict(v, "capacity", demote=True)

    # --- demotions written without the lock ---------------------------------------------------
    def _evict_for_later(
        self, tier: Tier, victims: Sequence[Entry], reason: str = "capacity"
    ) -> list[_Demotion]:
        """``_evict_for``, except that a victim bound for a tier with detached writes (disk)
        is only begun here: returned, for ``_finish_demotions`` to write without the lock. The
        others are evicted (dropped, or demoted under the lock) at once."""
        policy = self._policies[tier.name]
        later: list[_Demotion] = []
        try:
            for v in victims:
                if self._index.get(v.key) is not v or v.tier != tier.name or v.pinned:
                    continue
                policy.on_victim(v)
                if not isinstance(tier, CpuTier) or not self._may_detach(v, tier):
                    self._evict(v, reason, demote=True)
                    continue
                d = self._begin_demotion(v, tier, reason)
                if d is not None:
                    later.append(d)
        except BaseException:
            for d in later:  # begun, never to be written: given back, the chunks where they were
                self._end_demotion(d)
            raise
        return later

    def _may_detach(self, e: Entry, src: CpuTier) -> bool:
        """Whether ``e``'s demotion from ``src`` can be written without the lock: it goes from
        an arena (whose bytes a lease holds in place) to a usable tier with detached writes."""
        nxt = self._tier_index[src.name] + 1
        if nxt >= len(self._tiers) or self._closed:
            return False
        dst = self._tiers[nxt]
        return dst.detached_writes and self._usable(dst) and src.evictable(e.key)

    def _start_move(self, e: Entry, dst: Tier) -> tuple[_Demotion | None, str]:
        """Under the lock: ``e`` on its way into ``dst``: its demotion begun (to finish without
        the lock), or moved already ("moved"), or not: its copy found corrupt and dropped
        ("missing"), or no room or no tier there ("failed")."""
        try:
            d = self._begin_move(e, dst)
            if d is not None:
                return d, "begun"
            if not self._holds(e):
                return None, "missing"
            self._move(e, dst)
        except (CapacityError, DiskFullError, TierUnavailable):
            return None, "failed"
        return None, "moved"

    def _begin_move(self, e: Entry, dst: Tier) -> _Demotion | None:
        """Under the lock: what ``_move(e, dst)`` does up to the write, where ``e`` goes down
        into a tier with detached writes, from a cpu tier (its bytes leased in place) or from a
        tier above one (a gpu tier: its bytes copied to host memory now, at the link's speed)
        (else None: ``_move`` does it all under the lock). Raises as ``_move`` does, with
        nothing changed."""
        src = self._tier_of(e)
        if (
            e.pinned
            or e in self._reading
            or src.detached_reads
            or self._closed
            or self._rank(dst.name) <= self._rank(src.name)
            or not (dst.detached_writes and self._usable(dst) and src.evictable(e.key))
        ):
            return None
        if e.size_bytes > dst.capacity_bytes - self._pinned_bytes[dst.name]:
            return None  # ``_move`` says why
        if not self._may_place(e, dst):
            raise CapacityError(f"could not move {e.key.hex()} to tier {dst.name!r}")
        copy: memoryview | None = None
        if not isinstance(src, CpuTier):
            copy = memoryview(bytearray(e.size_bytes))
            try:
                src.read_into(e.key, copy)
            except CorruptChunk:  # the tier dropped its copy: so does the index
                self._drop_corrupt(e)
                return None
            except StoreError:
                return None  # ``_move`` reads it again, and raises as ever
        try:
            if not self._make_room(dst, e.size_bytes):
                raise CapacityError(f"no room for {e.size_bytes} bytes in tier {dst.name!r}")
            slot = dst.reserve_write(e.meta())
        except InvalidArgument:
            # dst is still writing an older copy of this key (evicted mid-write): ``_move``
            # puts this one at once (it replaces that one, whose commit is then refused)
            return None
        except (CapacityError, DiskFullError, TierUnavailable) as exc:
            self._demotion_failed(dst, exc)
            if isinstance(exc, TierUnavailable):  # as a put there that raised it would
                self._take_offline(dst, exc)
            raise
        self._policies[src.name].on_remove(e)
        self._reading[e] = 1  # out of its policy, as a chunk being read
        if copy is not None:
            return _Demotion(e, src, dst, slot, None, copy, reason=None)
        assert isinstance(src, CpuTier)
        lease = src.lease(e.key, math.inf)
        return _Demotion(e, src, dst, slot, lease, src.view(lease), reason=None)

    def _begin_demotion(
        self, e: Entry, src: CpuTier, reason: str = "capacity", *, keep: bool = False
    ) -> _Demotion | None:
        """Under the lock: what ``_evict(e, reason, demote=True)`` does up to the write
        into the next tier (``_may_detach`` said it is one with detached writes). Its room
        there is taken and ``e`` stays readable where it is, out of its policy (like a chunk
        being read) so nothing else picks it, its bytes held in place by a lease. None when it
        was dropped instead (refused, no room below), as ``_evict`` would drop it, or demoted
        under the lock at once (an older copy of its key is still being written below).
        ``keep`` (``_evict``'s): not dropped but left where it is, back in its policy, and the
        demotion that begins keeps it too if its write fails."""
        dst = self._tiers[self._tier_index[src.name] + 1]
        self._policies[src.name].on_remove(e)
        if not self._admission[dst.name].admit(e):
            self._accounting.stats.admission_refused += 1
        elif self._may_place(e, dst):
            try:
                if not self._make_room(dst, e.size_bytes):
                    raise CapacityError(f"no room for {e.size_bytes} bytes in tier {dst.name!r}")
                slot = dst.reserve_write(e.meta())
            except InvalidArgument:
                # dst is still writing an older copy of this key (evicted mid-write): a put of
                # this one goes at once, so it is demoted under the lock, as ``_evict`` does
                if self._try_place(e, src, dst):  # (a failure is counted there)
                    self._accounting.tier(src.name).evictions[reason] += 1
                    self._accounting.tier(dst.name).demotions += 1
                    self._emit("demote", e, src=src.name)
                    return None
            except (CapacityError, DiskFullError, TierUnavailable) as exc:
                self._demotion_failed(dst, exc)
                if isinstance(exc, TierUnavailable):
                    self._take_offline(dst, exc)
            else:
                lease = src.lease(e.key, math.inf)
                self._reading[e] = self._reading.get(e, 0) + 1  # out of its policy already
                return _Demotion(e, src, dst, slot, lease, src.view(lease), reason, keep=keep)
        if keep:
            self._policies[src.name].on_insert(e)
            return None
        # dropped at once: counted now (a begun demotion is counted when it ends, and only if
        # the chunk was still there to evict)
        self._accounting.tier(src.name).evictions[reason] += 1
        src.delete(e.key)
        self._forget(e)
        return None

    def _finish_demotions(self, later: Sequence[_Demotion]) -> None:
        """Without the lock: write the demotions ``_evict_for_later`` began, then, under the
        lock, commit each (the chunk is in the lower tier once its "demote" event is emitted,
        its file renamed into place) or give it up. Whatever happens, each one ends."""
        try:
            for d in later:
                try:
                    d.dst.write_reserved(d.slot, d.view)
                except BaseException as exc:
                    d.error = exc
                    if not isinstance(exc, Exception):
                        raise  # an interrupt: the rest are given up below
        finally:
            failed: BaseException | None = None
            # one hold of the lock each: a commit renames the file and syncs its directory,
            # and a resize's batch of 64 held every reader for all of them (~40 ms here)
            for d in later:
                try:
                    with relocked(self._lock):
                        self._end_demotion(d)
                except BaseException as exc:  # the others still end; then it is raised
                    failed = failed or exc
            if failed is not None:
                raise failed
        for d in later:
            if d.error is not None and not isinstance(d.error, (StoreError, OSError)):
                raise d.error  # a bug's error, not the disk's: not hidden as a counted drop

    def _end_demotion(self, d: _Demotion) -> None:
        """Under the lock: a demotion's write is over (or never ran). If the chunk is still
        where it was (not evicted, moved or pinned meanwhile) and the write landed, it is now
        in the lower tier; a failed write drops it (counted, as under the lock). Otherwise the
        written copy is taken back."""
        e, src, dst = d.entry, d.src, d.dst

        def still_there() -> bool:
            return (
                not self._closed
                and self._index.get(e.key) is e
                and e.tier == src.name
                and not e.pinned
                and e.key in src
            )

        current = still_there()
        if current and isinstance(d.error, DiskFullError) and d.slot.written is None:
            # the filesystem below filled up under the tier's capacity: room is made there by
            # its own policy and the write is made again, under the lock (rare: not worth a
            # round of its own)
            try:
                self._write_making_room(
                    dst, e.size_bytes, lambda: dst.write_reserved(d.slot, d.view), failed=d.error
                )
                d.error = None
            except StoreError as exc:
                d.error = exc
            current = still_there()
        d.view.release()
        if d.lease is not None:
            assert isinstance(src, CpuTier)
            src.release(d.lease.lease_id)
        if current and d.error is None and d.slot.written is not None:
            try:
                landed = dst.commit_write(d.slot)
            except StoreError:
                landed = False
            if landed:
                if d.reason is not None:
                    self._accounting.tier(src.name).evictions[d.reason] += 1
                src.delete(e.key)
                e.tier = dst.name  # before _end_read, which puts it in dst's policy
                self._end_read(e)
                self._back_online(dst)
                self._accounting.count_read(src.name, e.size_bytes)
                self._accounting.count_written(dst.name, e.size_bytes)
                if d.reason is not None:
                    self._accounting.tier(dst.name).demotions += 1
                self._emit("demote" if d.reason is not None else "move", e, src=src.name)
                d.outcome = "landed"
                return
        dst.abort_write(d.slot)
        if isinstance(d.error, TierUnavailable):
            self._take_offline(dst, d.error)
        self._end_read(e)
        d.outcome = "kept"
        if current and d.error is not None:  # the write failed (disk full, a failed device)
            self._demotion_failed(dst, d.error)
            if d.reason is None or d.keep:  # an operator's move or demotion: it stays where it was
                return
            self._accounting.tier(src.name).evictions[d.reason] += 1
            src.delete(e.key)
            self._forget(e)
            d.outcome = "dropped"

    def _write_making_room(
        self,
        tier: Tier,
        size: int,
        write: Callable[[], None],
        *,
        failed: DiskFullError | None = None,
    ) -> None:
        """Under the lock: ``write`` (a chunk of ``size`` payload bytes into ``tier``; already
        ``failed`` once with that error, when given). Where ``tier``'s filesystem is full below
        its capacity (others' files, a ``--disk`` larger than the free space), the tier makes
        room as at its capacity: its policy's victims are evicted (reason "filesystem") until
        the filesystem has the chunk file's size free, and the write is tried again, at most
        ``FULL_FILESYSTEM_RETRIES`` times. Each full filesystem met is counted in the tier's
        ``filesystem_full``. Raises DiskFullError, saying the filesystem is full and what it
        has free, when no room can be made (nothing of the tier's is left to evict: the rest is
        others' files, or pinned, or being read)."""
        for attempt in range(FULL_FILESYSTEM_RETRIES + 1):
            if failed is None:
                try:
                    write()
                    return
                except DiskFullError as exc:
                    failed = exc
            self._accounting.tier(tier.name).filesystem_full += 1
            free = failed.free_bytes
            want = failed.need_bytes + (FULL_FILESYSTEM_SLACK_BYTES << attempt)
            short = want - (free or 0)
            evicted, freed = (
                (0, 0) if attempt == FULL_FILESYSTEM_RETRIES else self._evict_for_fs(tier, short)
            )
            if evicted:
                self._say.say(
                    f"filesystem_full:{tier.name}",
                    logging.WARNING,
                    "tier %s: its filesystem is full below the tier's capacity (%s bytes free, "
                    "%s wanted for a chunk): evicted %d of its chunks (%s payload bytes) by its "
                    "policy to make room",
                    tier.name,
                    "an unknown number of" if free is None else f"{free:,}",
                    f"{want:,}",
                    evicted,
                    f"{freed:,}",
                )
                failed = None
                continue
            free_text = "an unknown number of" if free is None else f"{free:,}"
            error = DiskFullError(
                failed.errno,
                f"tier {tier.name!r}: its filesystem is full ({free_text} bytes free, a chunk "
                f"of {size:,} bytes needs {failed.need_bytes:,}"
                + (
                    f" with the {failed.headroom_bytes:,} it keeps free for the agent's files"
                    if failed.headroom_bytes
                    else ""
                )
                + ") and "
                + (
                    f"{FULL_FILESYSTEM_RETRIES} rounds of evicting its chunks did not make room "
                    f"(others keep filling it)"
                    if attempt
                    else "none of its chunks can be evicted for it (the rest is others' files, "
                    "or pinned, or being read)"
                )
                + f": {failed}",
            )
            error.need_bytes, error.free_bytes = failed.need_bytes, free
            error.headroom_bytes = failed.headroom_bytes
            self._say.say(f"filesystem_refused:{tier.name}", logging.WARNING, "%s", error.strerror)
            raise error from failed
        raise AssertionError("unreachable: the last attempt raises")

    def _evict_for_fs(self, tier: Tier, short_bytes: int) -> tuple[int, int]:
        """Evict ``tier``'s policy victims until their payload adds up to ``short_bytes`` (a
        file frees at least its payload), passing over those whose bytes are leased. Returns
        (chunks evicted, their payload bytes)."""
        policy = self._policies[tier.name]
        passed: list[Entry] = []
        evicted = freed = 0
        try:
            while freed < short_bytes:
                victim = policy.victim(self._clock())
                if victim is None:
                    break
                if not tier.evictable(victim.key):
                    policy.on_remove(victim)
                    passed.append(victim)
                    continue
                self._evict(victim, "filesystem", demote=True)
                evicted += 1
                freed += victim.size_bytes
        finally:
            for e in passed:
                policy.on_insert(e)
        return evicted, freed

    def _room_later(self, tier: Tier, size: int) -> list[_Demotion] | None:
        """``_make_room``, except that victims bound for a tier with detached writes are only
        begun (``_evict_for_later``): the demotions to finish without the lock, [] when the
        room is made already, None when it cannot be made (nothing evicted)."""
        victims = self._room_victims(tier, size)
        return None if victims is None else self._evict_for_later(tier, victims)

    def _make_room(self, tier: Tier, size: int) -> bool:
        """Make room for ``size`` bytes in ``tier``, or answer False having evicted nothing
        when it cannot be made there."""
        victims = self._room_victims(tier, size)
        if victims is None:
            return False
        self._evict_for(tier, victims)
        return True

    def _room_victims(self, tier: Tier, size: int) -> Sequence[Entry] | None:
        """What to evict from ``tier`` for ``size`` bytes (``Tier.plan_room``), or None when
        room cannot be made there (pinned chunks, leased regions)."""
        if size > tier.capacity_bytes - self._pinned_bytes[tier.name]:
            return None
        now = self._clock()
        victims = tier.plan_room(size, self._policies[tier.name].victims(now))
        return None if victims is None else self._count_room(tier, victims, now)

    def _fits_now(self, tier: Tier, size: int) -> bool:
        """Whether a new chunk of ``size`` bytes fits ``tier`` without evicting: its bytes are
        free and the tier holds fewer than its most chunks (``Tier.max_chunks``)."""
        if tier.free_bytes < size:
            return False
        limit = tier.max_chunks()
        return limit is None or len(tier) < limit

    def _count_room(self, tier: Tier, victims: list[Entry], now: float) -> list[Entry] | None:
        """``victims``, which make room for the bytes of one new chunk in ``tier``, with as
        many more of its policy's victims as keep it to its most chunks once the new one is in
        (``Tier.max_chunks``: tiny chunks cost index memory their bytes do not count); None
        when too few can be evicted."""
        limit = tier.max_chunks()
        over = 0 if limit is None else len(tier) + 1 - len(victims) - limit
        if over <= 0:
            return victims
        chosen = set(victims)
        out = list(victims)
        for c in self._policies[tier.name].victims(now):
            if c in chosen or not tier.evictable(c.key):
                continue
            out.append(c)
            over -= 1
            if over <= 0:
                return out
        return None

    def _shrink_to(self, tier: Tier, capacity_bytes: int, *, reason: str) -> int:
        """Evict from ``tier`` until its chunks fit ``capacity_bytes``: their bytes, and their
        number (``Tier.max_chunks``)."""
        limit = tier.max_chunks(capacity_bytes)
        return self._evict_while(
            tier,
            lambda: (
                tier.resident_bytes > capacity_bytes or (limit is not None and len(tier) > limit)
            ),
            reason=reason,
        )

    def _evict_while(self, tier: Tier, short: Callable[[], bool], *, reason: str) -> int:
        """Evict the policy's victims from ``tier`` while ``short()``. A victim whose bytes are
        leased would free nothing, so it is passed over (and keeps its place afterwards)."""
        policy = self._policies[tier.name]
        passed: list[Entry] = []
        evicted = 0
        try:
            while short():
                victim = policy.victim(self._clock())
                if victim is None:
                    leased = f", {len(passed)} leased" if passed else ""
                    raise CapacityError(
                        f"tier {tier.name!r}: nothing evictable left (pinned{leased})"
                    )
                if not tier.evictable(victim.key):
                    policy.on_remove(victim)
                    passed.append(victim)
                    continue
                self._evict(victim, reason, demote=True)
                evicted += 1
        finally:
            for e in passed:
                policy.on_insert(e)
        return evicted

    def _evict(self, e: Entry, reason: str, *, demote: bool, keep: bool = False) -> bool:
        """Take ``e`` out of its tier: demote it to the next tier if allowed, else drop it.
        ``keep``: one the tier below refuses or has no room for stays where it is instead
        (False), as an operator's ``flush --demote`` promises."""
        src = self._tier_of(e)
        self._policies[src.name].on_remove(e)
        nxt = self._tier_index[src.name] + 1
        if demote and nxt < len(self._tiers) and self._tiers[nxt].name not in self._absent:
            dst = self._tiers[nxt]
            if not self._admission[dst.name].admit(e):
                self._accounting.stats.admission_refused += 1
            elif self._try_place(e, src, dst):
                self._accounting.tier(src.name).evictions[reason] += 1
                self._accounting.tier(dst.name).demotions += 1
                self._emit("demote", e, src=src.name)
                return True
        if keep:
            self._policies[src.name].on_insert(e)
            return False
        self._accounting.tier(src.name).evictions[reason] += 1
        src.delete(e.key)
        self._forget(e)
        return True

    def _try_place(
        self,
        e: Entry,
        src: Tier,
        dst: Tier,
        data: Buffer | None = None,
        *,
        demotion: bool | None = None,
        delete_later: bool = False,
    ) -> bool:
        """Copy ``e`` from ``src`` into ``dst`` (making room there), then delete it from ``src``.
        ``data`` is the chunk's bytes when the caller already read them. On failure nothing has
        moved and the caller decides (drop, keep, or report); a failed demotion (by default:
        any move down) is counted. A put into ``dst`` that raises TierUnavailable takes it
        offline. ``delete_later``: ``src``'s slow clean-up runs in the background (not when its
        freed space must be there at once, as when making room)."""
        down = (
            self._tier_index[dst.name] > self._tier_index[src.name]
            if demotion is None
            else demotion
        )
        if not self._usable(dst):
            if down and dst.name not in self._absent:  # an absent tier is no tier below
                self._demotion_failed(dst, f"it is offline: {self._offline[dst.name][0]}")
            return False
        if not self._may_place(e, dst):
            return False
        if data is None and src.holds_payload:
            buf = bytearray(e.size_bytes)
            try:
                self._read(e, memoryview(buf))
            except CorruptChunk:
                return True  # already forgotten by _read; nothing left to move
            data = buf
        try:
            if not self._make_room(dst, e.size_bytes):
                raise CapacityError(f"no room for {e.size_bytes} bytes in tier {dst.name!r}")
            meta = e.meta()
            try:
                self._write_making_room(dst, meta.size_bytes, lambda: dst.put(meta, data))
            except TierUnavailable as exc:
                self._take_offline(dst, exc)
                raise
        except (CapacityError, DiskFullError, TierUnavailable, InvalidArgument) as exc:
            # InvalidArgument: dst refused the put (it already has the key): nothing moved
            if down:
                self._demotion_failed(dst, exc)
            return False
        self._back_online(dst)
        try:
            if delete_later:
                self._delete_copy(src, e.key)
            else:
                src.delete(e.key)
        except BaseException as exc:
            # src's copy could not be deleted (a rename or unlink failing with EIO or EROFS):
            # take dst's back, so the chunk stays in one tier, src, as the index says
            dst.delete(e.key)
            if not isinstance(exc, TierUnavailable):
                raise
            if down:
                self._demotion_failed(dst, f"its copy in tier {src.name!r} stays: {exc}")
            return False
        e.tier = dst.name
        self._accounting.count_written(dst.name, e.size_bytes)
        if e.pinned:
            self._pinned_bytes[src.name] -= e.size_bytes
            self._pinned_bytes[dst.name] += e.size_bytes
        elif e not in self._reading:  # else its last read's end puts it there (_end_read)
            self._policies[dst.name].on_insert(e)
        return True

    def _may_place(self, e: Entry, dst: Tier) -> bool:
        """Whether ``e`` may go into ``dst``: it fits beside the pinned chunks there, and when
        room must be made for it, ``dst``'s policy admits it."""
        if e.size_bytes > dst.capacity_bytes - self._pinned_bytes[dst.name]:
            return False
        return self._fits_now(dst, e.size_bytes) or self._policies[dst.name].admit(e, self._clock())

    def _promote(self, e: Entry, data: Buffer | None, lease_to: Tier | None = None) -> None:
        """Move a read's chunk to where reads are served from. Without ``lease_to``: up into
        the hit tier (the lease tier, else the top tier) from below it; a chunk at or above it
        stays (a gpu tier above cpu is never promoted into). With ``lease_to`` (a lease): into
        that tier from wherever it is, down from a gpu tier too. Either way it is counted as a
        promotion into the tier it lands in, never as a demotion (no pressure made it move)."""
        if not self.promote_on_hit or e.pinned or e.key not in self._index:
            return
        src = self._tier_of(e)
        if lease_to is not None:
            dst = lease_to
        else:
            dst = self._hit_tier
            if self._tier_index[dst.name] >= self._tier_index[src.name]:
                return
        if src is dst:
            return
        src_policy = self._policies[src.name]
        src_policy.on_remove(e)  # so making room in dst can never pick it while it moves
        if self._try_place(e, src, dst, data, demotion=False, delete_later=True):
            if e.key in self._index:
                self._accounting.count_promotion(dst.name)
                self._emit("promote", e, src=src.name)
        elif e not in self._reading:  # else its last read's end puts it back (_end_read)
            src_policy.on_insert(e)

    def _promote_read(self, e: Entry, data: Buffer) -> list[_Demotion]:
        """Under the lock: ``_promote`` for a chunk just read without the lock from a tier
        below the hit tier, except that where its room there is made by demotions to a tier
        with detached writes (disk), they are only begun: returned, for ``_finish_promotion``
        to write without the lock (a disk write held under it would stall every reader). The
        chunk stays out of its tier's policy meanwhile, so making room below never picks it;
        one a lease batch is bringing up is left to the batch."""
        src, dst = self._tier_of(e), self._hit_tier
        if (
            not self.promote_on_hit
            or e.pinned
            or self._tier_index[dst.name] >= self._tier_index[src.name]
            or self._leases.bringing_up(e.key)
            or not self._usable(dst)
            or not self._may_place(e, dst)
        ):
            return []
        self._begin_read(e)
        try:
            later = self._room_later(dst, e.size_bytes)
        except BaseException:
            self._end_read(e)
            raise
        if not later:  # the room is there ([]), or cannot be made (None)
            self._end_read(e)
            if later is not None:
                self._promote(e, data)
            return []
        self._leases.begin_bringing_up(e.key)
        return later

    def _finish_promotion(
        self, e: Entry, src: str, data: Buffer, later: Sequence[_Demotion]
    ) -> None:
        """Without the lock: write the demotions ``_promote_read`` began, then promote ``e``
        if it is still where it was read and its room is still free (taken meanwhile: it
        stays where it is, and the next read promotes it)."""
        written = False
        try:
            self._finish_demotions(later)
            written = True
        finally:
            with relocked(self._lock):
                self._leases.end_bringing_up(e.key)
                self._end_read(e)
                if (
                    written
                    and self._index.get(e.key) is e
                    and e.tier == src
                    and self._room_victims(self._hit_tier, e.size_bytes) == []
                ):
                    self._promote(e, data)

    def _commit_promotion(self, e: Entry, src: Tier, dst: Tier) -> None:
        """A chunk read from ``src`` outside the lock now has its copy in ``dst`` (and its copy
        in ``src`` is gone): the index, ``dst``'s policy, the counters and listeners learn it."""
        e.tier = dst.name  # before _end_read, which puts it in dst's policy (its last read)
        self._end_read(e)
        self._back_online(dst)
        self._accounting.count_read(src.name, e.size_bytes)
        self._accounting.count_written(dst.name, e.size_bytes)
        self._accounting.count_promotion(dst.name)
        self._emit("promote", e, src=src.name)

    def _move(self, e: Entry, dst: Tier, data: Buffer | None = None) -> None:
        """Under the lock: ``e`` into ``dst`` (``data``: its bytes, read already)."""
        src = self._tier_of(e)
        room = dst.capacity_bytes - self._pinned_bytes[dst.name]
        if e.size_bytes > room:
            raise CapacityError(
                f"chunk of {e.size_bytes} bytes cannot fit tier {dst.name!r} ({room} unpinned)"
            )
        if not self._usable(dst):
            raise TierUnavailable(self._unusable_message(dst))
        # a chunk being read or demoted is out of its policy already, and goes back in when
        # that ends (``_end_read``): putting it back here would leave it there for good
        tracked = not e.pinned and e not in self._reading
        if tracked:
            self._policies[src.name].on_remove(e)
        if not self._try_place(e, src, dst, data):
            if tracked and e.key in self._index:
                self._policies[src.name].on_insert(e)
            raise CapacityError(f"could not move {e.key.hex()} to tier {dst.name!r}")
        if e.key in self._index:
            self._emit("move", e, src=src.name)

    def _pin(self, e: Entry) -> None:
        if e.pinned:
            return
        e.pinned = True
        self._pinned_bytes[e.tier] += e.size_bytes
        self._policies[e.tier].on_remove(e)

    def _forget(self, e: Entry) -> None:
        """Remove ``e`` from the index (its tier copy is already gone)."""
        if self._index.pop(e.key, None) is None:
            return
        self._isolated_owner.pop(e.key, None)
        if e.pinned:
            self._pinned_bytes[e.tier] -= e.size_bytes
        else:
            self._policies[e.tier].on_remove(e)
        self._link_parent(e, -1)
        if e.children:
            self._orphans[e.key] = e.children
        self._accounting.stats.drops += 1
        for adm in self._admission.values():
            adm.on_drop(e)
        self._emit("evict", e)

    def _link_parent(self, e: Entry, delta: int, *, notify: bool = True) -> None:
        if delta > 0:
            e.children = self._orphans.pop(e.key, e.children)
        if e.parent is None:
            return
        p = self._index.get(e.parent)
        if p is None:
            n = self._orphans.get(e.parent, 0) + delta
            if n > 0:
                self._orphans[e.parent] = n
            else:
                self._orphans.pop(e.parent, None)
            return
        p.children += delta
        if notify and not p.pinned and (p.children == 0 or p.children == delta):
            self._policies[p.tier].on_children_changed(p)

    def _emit(self, kind: str, e: Entry, **extra: Any) -> None:
        if not self._listeners:
            return
        event: Event = {
            "type": kind,
            "key": e.key.hex(),
            "tier": e.tier,
            "size_bytes": e.size_bytes,
            "tokens": e.tokens,
            "tenant": e.tenant,
            # what a fleet index needs to keep an isolated tenant's chunk from other tenants
            "isolated": e.isolated,
            **extra,
        }
        for listener in list(self._listeners):
            listener(event)


def _reason(exc: BaseException) -> str:
    """``exc``'s message with its errno's name (its own, or that of the OSError it wraps)."""
    err = exc if isinstance(exc, OSError) and exc.errno else exc.__cause__
    code = errno.errorcode.get(err.errno) if isinstance(err, OSError) and err.errno else None
    return f"{exc} [{code}]" if code else str(exc)


def _as_admission(spec: str | AdmissionPolicy) -> AdmissionPolicy:
    return make_admission_policy(spec) if isinstance(spec, str) else spec


def _own_parent_dropped(key: bytes, parent: bytes | None) -> bytes | None:
    """A chunk named as its own parent is a root: a replay keyed by trace block ids repeats an
    id, where a content hash never would. Kept as its own child, its child count grew by one
    at every eviction and re-put (found by a review's stress run)."""
    return None if parent == key else parent


def _check_key(key: object, what: str = "key") -> None:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InvalidArgument(f"{what} must be {KEY_BYTES} bytes, got {key!r:.60}")


def _payload_size(data: Buffer | None, size_bytes: int | None) -> int:
    if data is None:
        if size_bytes is None:
            raise InvalidArgument("give the payload bytes, or size_bytes for a size-only store")
        size = size_bytes
    else:
        size = memoryview(data).nbytes
        if size_bytes is not None and size_bytes != size:
            raise PayloadSizeError(f"payload is {size} bytes but size_bytes says {size_bytes}")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise PayloadSizeError(f"chunk size must be a positive number of bytes, got {size!r}")
    return size


def _hot(e: Entry, prefix_chunks: int, prefix_tokens: int, prefix_complete: bool) -> HotChunk:
    return HotChunk(
        key=e.key,
        **e.listing(),
        prefix_chunks=prefix_chunks,
        prefix_tokens=prefix_tokens,
        prefix_complete=prefix_complete,
    )


def _found_entry(meta: ChunkMeta, tier: str, tick: int) -> Entry:
    """The index entry of a chunk found in ``tier`` at its open (``meta`` as it was stored):
    last accessed when it was stored, as far as anyone can tell."""
    return Entry(
        key=meta.key,
        tier=tier,
        size_bytes=meta.size_bytes,
        tokens=meta.tokens,
        tenant=meta.tenant,
        parent=meta.parent,
        priority=meta.priority,
        isolated=meta.isolated,
        created_s=meta.created_s,
        last_access_s=meta.created_s,
        last_tick=tick,
    )
