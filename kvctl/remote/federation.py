"""One node's cache beyond itself: the local store, the shared pool and peer agents, joined.

- ``lookup``: fetch or recompute over the whole chain (``FetchPlanner``): the local prefix is
  peeked (counting nothing), the pool and the peers are asked which of the next chunks they hold
  (metadata only, in parallel), and the planner picks the prefix worth fetching, from where:
  local disk chunks are weighed like remote ones. Hits are counted for the chunks it takes only
  (``remote`` or ``peer`` tier past the local prefix); the plan and its inputs are published as a
  ``fetch_plan`` event and summed in ``status()``.
- ``fill``: chunks a reader asks for that are not local are pulled (pool first, then peers,
  each chunk put into the local store as it lands) and then served like local ones; only the
  prefix the local tiers can hold, never evicting the request's own chunks to land more.
- write-through: every chunk stored here is copied to the pool by a background writer, so other
  nodes can hit it; a slow or dead pool delays nothing and loses nothing local.

Every remote failure is a miss and a counted error, never a failed request. Each source has a
circuit breaker (``kvctl.remote.breaker``): a failure opens it, and the source is left alone for
a backoff (0.25 s, doubling per failed probe, at most 2 s); then one probe call is let through
(a read, a write, or the link monitor's ping, whichever comes first), whose success closes it.
A burst of concurrent calls failing together counts as one failure. Reads of a source give up
after its short read deadline (the backends' ``read_timeout_s``, 0.5 s by default), so a stalled
pool costs a request a fraction of a second once, then nothing until a probe finds it back.
A pull from the pool or a peer also has a deadline sized from its bytes and its records (``pool.
PULL_FLOOR_BYTES_PER_S``, ``pool.PULL_ALLOWANCE_PER_RECORD_S``): one that trickles is a failure
of its source (``PullTooSlow``).

A source that answers, but slowly, is kept from costing the others: each source's lookup probes
run in its own lane of workers (a slow one fills its own lane only; a lookup that stops waiting
cancels its probe still queued there), and an answer that takes longer than the lookup's wait
(``PROBE_DEADLINE_S``) from its call's start, or a ping slower than that, is late for its
breaker: a few in a row open it as a failure does (``Breaker.late``). Time queued in the lane is
not the source's: a burst of lookups does not open a healthy source.

With a fleet index (``index``: a router's ``IndexClient``, or any ``FleetIndex``), a lookup
does not probe every peer: it asks the index once which nodes hold the chunks past its local
prefix, and probes only the peers it names (by name: a peer's configured name must be the name
that node has in the fleet, its agent's ``name``), and the pool (always: it is one source).
Their answers are the truth: a named chunk a peer no longer holds is a stale entry, counted and
never served. An index that fails, or is backing off after a failure (its own breaker: the link
monitor probes it, so a lookup never waits on a dead router more than once), or gives an answer
of the wrong shape, leaves the lookup to probe every peer as without one (counted).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import mmap
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from kvctl.index.model import Holding
from kvctl.redact import redact_url
from kvctl.remote.agent_source import AgentSource
from kvctl.remote.breaker import Breaker, Ticket
from kvctl.remote.counting import RemoteTierCounts
from kvctl.remote.fetchplan import (
    DEVICE_TIERS,
    AnyLink,
    Candidate,
    EngineRates,
    FetchPlan,
    LocalLink,
    PrefillModel,
    PrefillRate,
    as_prefill_model,
    plan_fetch,
)
from kvctl.remote.links import EmulatedDelay, LinkEstimator
from kvctl.remote.measure_schedule import MeasureSchedule
from kvctl.remote.pool import BadUsageReport, PoolChunk, PoolUsage, RemotePool, visible_to
from kvctl.store.errors import CapacityError, InvalidArgument, StoreError, TierUnavailable
from kvctl.store.index import Entry, LookupResult
from kvctl.store.keys import MIN_KV_BYTES_PER_TOKEN, most_tokens
from kvctl.store.store import PutSlot, TieredStore
from kvctl.store.tiers import hugepages
from kvctl.store.tiers.base import ChunkMeta

log = logging.getLogger("kvctl.remote")

T = TypeVar("T")
POOL_TIER = "remote"
PEER_TIER = "peer"
#: where the last lookups found chunks, so a fill asks the right source first
_HINTS_MAX = 65536
#: a pull moves a hit counted by a lookup this recent at most (the lookup it follows), never
#: one left by a lookup no pull followed
_HINT_RECOUNT_S = 30.0
_WRITE_QUEUE_MAX = 4096
_WRITE_BATCH_CHUNKS = 32
_WRITE_BATCH_BYTES = 256 << 20
#: probe workers of each source's own lane: a slow source's probes queue behind its own only,
#: never ahead of another source's (a lookup cancels its probes still queued when it stops
#: waiting, so a lane's queue holds no more than the lookups waiting on it)
_PROBE_WORKERS_PER_SOURCE = 4
#: how often the link monitor looks for work (a source due for its probe, a measurement)
_MONITOR_TICK_S = 0.25
#: a lookup waits this long for a source's answer, then goes on without it (the backends' read
#: deadline is the same by default: a late probe is about to fail anyway). An answer that takes
#: longer from its call's start is late for its source's breaker (``Breaker.late``), and so is a
#: ping slower than this
PROBE_DEADLINE_S = 0.5
#: the key the link monitor asks a failed index's holders of, to tell whether lookups may
#: use it again (a key of zeros: no chunk's, so the answer is short)
_INDEX_PROBE_KEY = bytes(16)
#: bytes a link's bandwidth is sampled with, when no real transfer has measured it yet
PROBE_TRANSFER_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class _Hint:
    """A remote hit a tenant's lookup counted: the source it chose, whether it counted as reuse
    (the copy found was the tenant's own), and when (monotonic seconds)."""

    source: str
    reuse: bool
    at_s: float
    #: the chunk's size as the source described it: a pull is sized by it before it starts
    size_bytes: int = 0


@dataclass
class SourceCounters:
    calls: int = 0
    errors: int = 0
    #: calls not made because the source was in backoff after an error
    skipped: int = 0
    #: probes a lookup stopped waiting for (past PROBE_DEADLINE_S); the answers that came
    #: past it anyway are the breaker's ``late_answers``
    late: int = 0
    chunks_in: int = 0
    bytes_in: int = 0
    chunks_out: int = 0
    bytes_out: int = 0
    #: chunks the source described (a probe's answer) or sent (a pull) with more tokens than a
    #: chunk holds (``RemoteTiers._token_bound``): a hostile or broken source's claim, which
    #: would inflate the hit and saved-token counts; each a miss, counted in ``corrupt``
    bad_tokens: int = 0


@dataclass
class Source:
    """The pool or one peer, with its link figures, emulated delay and circuit breaker."""

    name: str
    tier: str
    backend: RemotePool
    link: LinkEstimator
    delay: EmulatedDelay = field(default_factory=lambda: EmulatedDelay(0.0))
    clock: Callable[[], float] = time.monotonic
    counters: SourceCounters = field(default_factory=SourceCounters)
    last_error: str = ""
    #: made on the source's clock when not given
    breaker: Breaker = None  # type: ignore[assignment]
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.breaker is None:
            self.breaker = Breaker(clock=self.clock)

    @property
    def up(self) -> bool:
        """In use: its breaker is closed (not backing off, nor waiting on a probe)."""
        return self.breaker.state == "closed"

    def call(
        self,
        what: str,
        fn: Callable[[], T],
        *,
        moved_bytes: Callable[[T], int],
        observe: bool = True,
        answer_within_s: float | None = None,
        said: Callable[[str], None] | None = None,
    ) -> T | None:
        """``fn()`` over the link, timed into the link's figures (unless ``observe`` is False:
        a warm-up); None (and a counted error) when the source fails, or (a counted skip) when
        its breaker turns the call away. ``answer_within_s``: how long the source may take from
        the call's start (its caller's wait); an answer that takes longer is still returned,
        but tells the breaker it came late (``Breaker.late``). Timed from the start, not from
        when the caller began waiting: time queued behind this source's other calls is its
        caller's load, not the source's slowness. ``said``: told why when None is returned
        (``last_error`` is the source's: the next failed call of anyone replaces it)."""
        ticket = self.breaker.admit()
        if ticket is None:
            with self._lock:
                self.counters.skipped += 1
            if said is not None:  # last_error: maybe an old one, the breaker opened since late
                why = "answering too late" if self.breaker.opened_late else None
                said(
                    f"not sent: {self.name} is left alone after "
                    f"{why or f'an error ({self.last_error})'}"
                )
            return None
        t0 = time.perf_counter()
        try:
            self.delay.wait()  # emulated distance: one round trip's worth, inside the timing
            out = fn()
        except Exception as exc:  # any failure of a remote call is a miss, never a failed request
            with self._lock:
                self.counters.calls += 1
                self.counters.errors += 1
                self.last_error = f"{what}: {exc}"
            if said is not None:
                said(f"{what}: {exc}")
            if self.breaker.failed(ticket):
                log.warning(
                    "%s %s failed (%s); leaving it alone for %.2f s",
                    self.name,
                    what,
                    exc,
                    self.breaker.backoff_s,
                )
            else:  # one of a burst already counted: the log says it once
                log.debug("%s %s failed too (%s)", self.name, what, exc)
            return None
        except BaseException:  # interrupted: says nothing about the source
            self.breaker.abandoned(ticket)
            raise
        elapsed_s = time.perf_counter() - t0
        if answer_within_s is not None and elapsed_s > answer_within_s:
            self._answered_late(ticket, what, elapsed_s)
        else:
            self.breaker.succeeded(ticket)
            if ticket.probe:
                log.info("%s answered its probe (%s): using it again", self.name, what)
        nbytes = moved_bytes(out)
        with self._lock:
            self.counters.calls += 1
        if not observe:
            return out
        if nbytes:
            self.link.observe_transfer(nbytes, elapsed_s)
        else:
            self.link.observe_rtt(elapsed_s)
        return out

    def _answered_late(self, ticket: Ticket, what: str, elapsed_s: float) -> None:
        if self.breaker.late(ticket):
            log.warning(
                "%s %s answered too late to be used (%.3f s); leaving it alone for %.2f s",
                self.name,
                what,
                elapsed_s,
                self.breaker.backoff_s,
            )
        else:
            log.debug("%s %s answered late (%.3f s)", self.name, what, elapsed_s)

    def status(self) -> dict[str, Any]:
        c = self.counters
        return {
            "name": self.name,
            "tier": self.tier,
            "address": self.backend.address,
            "up": self.up,
            # closed / open / half_open, the backoff and when the next probe may go
            "breaker": self.breaker.as_dict(),
            "last_error": self.last_error,
            "calls": c.calls,
            "errors": c.errors,
            "skipped": c.skipped,
            "late": c.late,
            # the backend's dropped chunks (key, size, tenant, checksum) and the answers
            # claiming more tokens than a chunk holds
            "corrupt": self.backend.corrupt + c.bad_tokens,
            # pulls abandoned at their deadline: the source trickled (``PullTooSlow``)
            "overdue": self.backend.overdue,
            "chunks_in": c.chunks_in,
            "bytes_in": c.bytes_in,
            "chunks_out": c.chunks_out,
            "bytes_out": c.bytes_out,
            "link": self.link.link().as_dict(),
        }


class HolderIndex(Protocol):
    """What a lookup needs of a fleet index (``kvctl.index.model.FleetIndex``'s read side):
    ``IndexClient`` at a router, or an ``EmbeddedIndex`` in tests."""

    def holders(self, keys: Sequence[bytes], *, tenant: str) -> list[list[Holding]]: ...

    def nodes(self) -> dict[str, int]: ...


@dataclass
class IndexCounters:
    #: lookups the index answered (its answer chose the peers to probe)
    queries: int = 0
    #: index calls that failed (unreachable, an error answer, or an answer of the wrong shape)
    errors: int = 0
    #: lookups that probed every peer because the index failed or was backing off
    fallbacks: int = 0
    #: index calls not made because its breaker was open (each also a fallback)
    skipped: int = 0
    #: chunks the index said a peer holds that the peer, asked, did not have (each probe that
    #: finds one counts it: a lookup, then a locate, may meet the same entry again)
    stale_chunks: int = 0
    #: peers not probed because the index named no chunk of the lookup on them
    peer_probes_saved: int = 0
    #: holdings naming a node that is not a configured peer (nor this node): a peer's
    #: configured name differs from the fleet's name for it, or the node is not a peer
    unknown_nodes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "queries": self.queries,
            "errors": self.errors,
            "fallbacks": self.fallbacks,
            "skipped": self.skipped,
            "stale_chunks": self.stale_chunks,
            "peer_probes_saved": self.peer_probes_saved,
            "unknown_nodes": self.unknown_nodes,
        }


def _index_address(index: object) -> str:
    url = getattr(index, "url", None)
    return redact_url(str(url)) if url else str(getattr(index, "kind", type(index).__name__))


def _no_bytes(_: object) -> int:
    return 0


def _chunk_bytes(chunks: Sequence[PoolChunk | None] | None) -> int:
    return sum(c.data.nbytes for c in chunks or () if c is not None)


@dataclass
class PlanCounters:
    #: lookups planned
    lookups: int = 0
    #: chunks the plans took (fetched from a tier below the engine), by tier
    fetch_chunks: int = 0
    fetched: Counter[str] = field(default_factory=Counter)
    #: chunks some tier held that the plans left to recompute, by (tier, reason)
    recompute_chunks: int = 0
    recomputed: Counter[tuple[str, str]] = field(default_factory=Counter)
    #: modeled prefill time of the chunks taken, their fetch time, and the difference
    recompute_s: float = 0.0
    fetch_s: float = 0.0
    saved_s: float = 0.0
    reasons: Counter[str] = field(default_factory=Counter)
    #: lookups that asked no remote source: nothing of the chain was here, and fetching all of
    #: it from the one source would not have beaten recomputing it (``_not_worth_asking``)
    unasked: int = 0

    def as_dict(self) -> dict[str, Any]:
        recomputed: dict[str, dict[str, int]] = {}
        for (tier, reason), n in sorted(self.recomputed.items()):
            recomputed.setdefault(tier, {})[reason] = n
        return {
            "lookups": self.lookups,
            "fetch_chunks": self.fetch_chunks,
            "fetched_by_tier": dict(sorted(self.fetched.items())),
            "recompute_chunks": self.recompute_chunks,
            "recomputed_by_tier": recomputed,
            "recompute_s": self.recompute_s,
            "fetch_s": self.fetch_s,
            "saved_s": self.saved_s,
            "reasons": dict(self.reasons),
            "unasked_lookups": self.unasked,
        }


#: a disk read's latency before its first byte (NVMe order); paid once per lookup's batch, on
#: top of a configured read rate only (a measured rate already includes it)
DISK_READ_LATENCY_S = 1e-4
#: stage order of a lookup's fetch: fills from the pool and peers, then local reads
_REMOTE_STAGE = 0
#: of the lookups not worth asking the remote source about (``_not_worth_asking``), every
#: this-many-th asks anyway: its answer corrects the chunk bounds if a smaller model's came
ASK_ANYWAY_AFTER = 32


class FetchPlanner:
    """Fetch or recompute for every lookup of this node, over the whole matched chain.

    Sources: the gpu tier (already in device memory: free), the cpu tier (its cost is the host
    -> device copy: bytes / the engine-reported bandwidth, free when none was reported), the
    disk tier (``DISK_READ_LATENCY_S`` + bytes / the configured read bandwidth, else bytes / the
    store's measured one, whose wall-time samples include the latency, else free, latency
    included, until the first reads measure it) plus the device copy, and the pool
    and peers (their link figures) plus the device copy. The prefill model is the engines'
    measured one, else the configured or modeled ``fallback`` (``EngineRates``).

    The answer's matched prefix is the plan's, so an engine that follows the lookup recomputes
    the rest; hits are counted for the chunks taken only (``TieredStore.count_lookup``). Where
    the plan's answer is known without running it (nothing costs anything, or only the device
    copy does and every chunk's copy beats recomputing the cheapest one) the whole local prefix
    is taken and counted with the same figures, with no ``fetch_plan`` event."""

    def __init__(
        self,
        store: TieredStore,
        *,
        prefill: PrefillRate | PrefillModel,
        rates: EngineRates | None = None,
        disk_read_bytes_per_s: float | None = None,
        emit: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.store = store
        self.fallback = as_prefill_model(prefill)
        self.rates = rates or EngineRates()
        self.disk_read_bytes_per_s = disk_read_bytes_per_s or None
        self._emit = emit
        self._lock = threading.Lock()
        self.plans = PlanCounters()
        self.last_plan: dict[str, Any] | None = None
        self._tiers = tuple(store.tier_names)
        #: each tier's chunks' sources in a candidate, and its stage (after the remote fills)
        self._sources = {t: (t,) for t in self._tiers}
        self._stages = {t: 1 + i for i, t in enumerate(self._tiers)}
        read_bandwidth = getattr(store, "read_bandwidth", None)  # added with disk I/O work
        #: the store's measured read rates, when a disk link is costed by them
        self._measured = read_bandwidth if self.disk_read_bytes_per_s is None else None
        # the links as last built, with the figures they were built from: a lookup rebuilds
        # them only when a figure changed (a store read measured a tier, an engine reported)
        self._local: tuple[tuple[float | None, ...], dict[str, LocalLink], frozenset[str]] | None
        self._local = None
        self._device: LocalLink | None = None
        self._futile_lookups = 0

    # --- inputs -------------------------------------------------------------------------------
    def prefill(self, model: str | None = None) -> PrefillModel:
        """``model``'s measured prefill, else (None) the one lookups use (``EngineRates``)."""
        return self.rates.prefill(self.fallback, model=model)

    def device_link(self) -> LocalLink:
        bw = self.rates.host_to_device_bytes_per_s
        link = self._device
        if link is None or link.bandwidth_bytes_per_s != bw:
            source = "engine" if bw is not None else "unreported"
            link = self._device = LocalLink("device", 0.0, bw, source)
        return link

    def local_links(self) -> dict[str, LocalLink]:
        """Each local tier as a source (see the class)."""
        return dict(self._local_links()[0])

    def _local_links(self) -> tuple[dict[str, LocalLink], frozenset[str]]:
        """The local links (shared: not to be changed) and the tiers among them that are free."""
        measured: dict[str, float | None] = self._measured() if self._measured else {}
        figures = tuple(measured.get(t) for t in self._tiers)
        cached = self._local
        if cached is not None and cached[0] == figures:
            return cached[1], cached[2]
        links: dict[str, LocalLink] = {}
        for tier, figure in zip(self._tiers, figures, strict=True):
            if tier in DEVICE_TIERS:
                links[tier] = LocalLink(tier, 0.0, None, "device memory")
            elif tier == "cpu":  # read in place (shared memory): the device copy is its cost
                links[tier] = LocalLink(tier, 0.0, None, "host memory")
            elif self.disk_read_bytes_per_s is not None:
                links[tier] = LocalLink(
                    tier, DISK_READ_LATENCY_S, self.disk_read_bytes_per_s, "configured"
                )
            elif figure:
                # bytes over the wall time of real read batches: their latency is in the figure
                links[tier] = LocalLink(tier, 0.0, figure, "measured")
            else:
                # free, latency included, until a read measures it: never refused for want of a
                # figure (or it never would be), and the same as the all-free fast path
                links[tier] = LocalLink(tier, 0.0, None, "unmeasured")
        free = frozenset(t for t, link in links.items() if link.bandwidth_bytes_per_s is None)
        self._local = (figures, links, free)
        return links, free

    # --- the lookup ---------------------------------------------------------------------------
    def lookup(
        self, keys: Sequence[bytes], *, tenant: str = "", remote: RemoteTiers | None = None
    ) -> LookupResult:
        """The longest prefix worth fetching (see the class); counts its hits and the plan."""
        store, n = self.store, len(keys)
        local, free_tiers = self._local_links()
        device = self.device_link()
        prefill = self.prefill()
        probing = remote is not None and bool(remote.sources)
        if (
            not probing
            and device.bandwidth_bytes_per_s is None
            and free_tiers.issuperset(self._tiers)
        ):
            # nothing anywhere costs anything (the common case): a plain lookup, one pass
            res = store.lookup(keys, tenant=tenant)
            self._count_free(res, prefill)
            return res
        with store.locked():  # one consistent view of the local prefix
            seen = store.peek(keys, tenant=tenant)
            m = seen.matched_chunks
            tiers = seen.locations[:m]
            free = device.bandwidth_bytes_per_s is None and free_tiers.issuperset(tiers)
            entries = [] if free and not probing else list(map(store.entry, keys[:m]))
            # held here past a chunk that is not (a gap): taken from here, never from a source
            # (the pull skips what is local, so its bytes and owner are this copy's)
            past = (
                {i: store.entry(keys[i]) for i in range(m + 1, n) if seen.locations[i] is not None}
                if probing
                else {}
            )
        if free and (not probing or m == n):
            # nothing local costs anything: the whole local prefix, no event (the common case)
            res = store.count_lookup(keys, limit=m, tenant=tenant)
            self._count_free(res, prefill)
            return res
        if not probing or m == n:
            crossing_s = self._dominant_fetch_s(entries, local, free_tiers, device, prefill)
            if crossing_s is not None:
                # every chunk is cheaper to copy to the device than the cheapest one is to
                # recompute: the plan would take all of them, so it is not run (no event)
                res = store.count_lookup(keys, limit=m, tenant=tenant)
                self._count_free(res, prefill, fetch_s=crossing_s)
                return res
        found: list[list[tuple[str, ChunkMeta]]] = []
        if remote is not None and probing and m < n:
            unasked = None if m or past else self._not_worth_asking(remote, n, device, prefill)
            if unasked is not None:
                res = store.count_lookup(keys, limit=0, tenant=tenant)
                remote._hint(tenant, keys, {})  # as a probed lookup that took nothing does
                self._record(unasked, [], res, tenant, chunks=n, local=0, unasked=True)
                return res
            found = remote._probe(keys[m:], tenant)
        sources = self._sources
        candidates = [
            Candidate.trusted(i, e.size_bytes, e.tokens, sources[e.tier])
            for i, e in enumerate(entries)
        ]
        links: dict[str, AnyLink] = dict(local)
        stages = dict(self._stages)
        if remote is not None and found:
            for s in remote.sources:
                links[s.name] = s.link.link()
                stages[s.name] = _REMOTE_STAGE
            for j, options in enumerate(found):
                e = past.get(m + j)
                if e is not None:
                    candidates.append(
                        Candidate.trusted(m + j, e.size_bytes, e.tokens, sources[e.tier])
                    )
                    continue
                if not options:
                    break
                meta = options[0][1]
                candidates.append(
                    Candidate(
                        index=m + j,
                        size_bytes=meta.size_bytes,
                        tokens=meta.tokens or store.chunk_tokens,
                        sources=tuple(name for name, _ in options),
                    )
                )
        plan = plan_fetch(
            candidates, links, prefill, stages=stages, device=device, on_device=DEVICE_TIERS
        )
        k = len(plan.fetch)
        res = store.count_lookup(keys, limit=min(k, m), tenant=tenant)
        if remote is not None and found:
            # past the local prefix only when all of it was taken and is still there
            extend = k > m and res.matched_chunks == m
            res = remote._take(keys, found, res, plan if extend else None, tenant, past)
        self._record(plan, candidates, res, tenant, chunks=n, local=m)
        return res

    def _not_worth_asking(
        self, remote: RemoteTiers, chunks: int, device: LocalLink, prefill: PrefillModel
    ) -> FetchPlan | None:
        """With nothing of a chain of ``chunks`` here and one remote source, the plan made as if
        that source held all of it, each chunk as small and as many tokens long as the smallest
        and the longest it has answered with, over its link with no round trip at all, when that
        plan fetches nothing: its real chunks cost no less to fetch and no more to recompute, so
        asking could not change the answer (the probe's round trip is most of a short prompt's
        lookup). None: ask. The round trip is left out because probes measure it: a figure
        inflated by a slow spell must not stop the probes that would bring it back down (the
        bandwidth is measured by pulls and the link monitor, which asking does not change).

        One candidate of the whole chain decides for every prefix of it: recomputing j chunks
        is convex in j and free at none, fetching them is j times a rate (plus the device's
        round trip), so if any prefix saves time the whole chain does. The bounds hold for the
        chunks seen so far only, so every ``ASK_ANYWAY_AFTER``-th such lookup asks; a source
        whose breaker is not closed, or whose link is not yet costed, is asked as before."""
        bounds = remote.chunk_bounds
        if len(remote.sources) != 1 or bounds is None:
            return None
        (source,) = remote.sources
        link = source.link.link()
        if not link.costed or source.breaker.state != "closed":
            return None
        size_bytes, tokens = bounds
        plan = plan_fetch(
            [Candidate.trusted(0, chunks * size_bytes, chunks * tokens, (source.name,))],
            {source.name: dataclasses.replace(link, rtt_s=0.0, emulated_delay_s=0.0)},
            prefill,
            stages={source.name: _REMOTE_STAGE},
            device=device,
            on_device=DEVICE_TIERS,
        )
        if plan.fetch:
            return None
        with self._lock:
            self._futile_lookups = (self._futile_lookups + 1) % ASK_ANYWAY_AFTER
            if not self._futile_lookups:
                return None
        # what the event says: no candidate was known, the links and prefill it was weighed on
        return dataclasses.replace(
            plan, reason="unasked", recompute=0, usable=0, usable_sources=(), stopped_by=None
        )

    @staticmethod
    def _dominant_fetch_s(
        entries: Sequence[Entry],
        local: Mapping[str, LocalLink],
        free_tiers: frozenset[str],
        device: LocalLink,
        prefill: PrefillModel,
    ) -> float | None:
        """The device copy's seconds of the local prefix ``entries`` when taking all of it is
        the plan without planning: every tier is free but for the copy to the device (no
        latency), and the largest chunk's copy is quicker than recomputing the smallest at the
        start of a context, the cheapest place to recompute (the prefill model's per-token cost
        only grows with depth), so every chunk saves time and the plan takes them all. None
        otherwise (plan it)."""
        bw = device.bandwidth_bytes_per_s
        if not entries or bw is None or device.rtt_s:
            return None
        tiers = {e.tier for e in entries}
        if not tiers <= free_tiers or any(local[t].rtt_s for t in tiers):
            return None
        crossing = [e.size_bytes for e in entries if e.tier not in DEVICE_TIERS]
        if max(crossing, default=0) / bw >= prefill.seconds(0, min(e.tokens for e in entries)):
            return None
        return sum(crossing) / bw

    def _count_free(
        self, res: LookupResult, prefill: PrefillModel, *, fetch_s: float = 0.0
    ) -> None:
        """A lookup that took its whole local prefix without a plan, its fetch ``fetch_s``."""
        m = res.matched_chunks
        recompute_s = prefill.seconds(0, res.matched_tokens) if m else 0.0
        with self._lock:
            p = self.plans
            p.lookups += 1
            p.reasons["fetch" if m else "no-candidates"] += 1
            if m:
                p.fetch_chunks += m
                p.fetched.update(t for t in res.locations[:m] if t is not None)
                p.recompute_s += recompute_s
                p.fetch_s += fetch_s
                p.saved_s += recompute_s - fetch_s

    def _record(
        self,
        plan: FetchPlan,
        candidates: Sequence[Candidate],
        res: LookupResult,
        tenant: str,
        *,
        chunks: int,
        local: int,
        unasked: bool = False,
    ) -> None:
        """Count ``plan`` and emit its event. ``unasked``: the plan of ``_not_worth_asking``
        (no source was asked, so none of the chain's chunks is known to be anywhere)."""
        k = res.matched_chunks  # the plan's, unless the store changed under it
        taken = [res.locations[i] or "" for i in range(k)]
        recomputed: Counter[tuple[str, str]] = Counter()
        for i in range(k, len(candidates)):
            c = candidates[i]
            if i < plan.usable:
                why = "override" if plan.reason == "override" else "slower-than-recompute"
                source = plan.usable_sources[i]
            else:
                why = plan.stopped_by or "no-source"
                source = c.sources[0] if c.sources else ""
            recomputed[(self._tier_of(source, res.locations[c.index]), why)] += 1
        # the plan's figures hold for the chunks it took; a store that changed under it is rare
        scale = 1.0 if k == len(plan.fetch) else 0.0
        with self._lock:
            p = self.plans
            p.lookups += 1
            p.fetch_chunks += k
            p.fetched.update(taken)
            p.recompute_chunks += sum(recomputed.values())
            p.recomputed.update(recomputed)
            p.recompute_s += plan.recompute_s * scale
            p.fetch_s += plan.fetch_s * scale
            p.saved_s += plan.saved_s * scale
            p.reasons[plan.reason] += 1
            p.unasked += unasked
        event = {
            "type": "fetch_plan",
            "tenant": tenant,
            **{key: v for key, v in plan.as_dict(chunks=False).items() if key != "fetch"},
            "chunks": chunks,
            # chunks taken: from the local tiers, and from the pool or peers past them
            "fetch": k,
            "local": min(k, local),
            "remote": max(0, k - local),
            # chunks some tier held that are recomputed, and chunks no tier held
            "recompute": len(candidates) - k,
            "missed": 0 if unasked else chunks - len(candidates),
            # the remote sources were not asked: nothing here, and no fetch could pay
            "unasked": chunks if unasked else 0,
            "held_local": local,
            "recomputed_by_tier": {f"{t}/{r}": v for (t, r), v in sorted(recomputed.items())},
        }
        self.last_plan = event
        if self._emit is not None:
            self._emit(event)

    def _tier_of(self, source: str, location: str | None) -> str:
        if source in self._sources:
            return source
        return location or source or "none"

    def status(self) -> dict[str, Any]:
        with self._lock:
            plans = self.plans.as_dict()
        return {
            "prefill": self.prefill().as_dict(),
            "device": self.device_link().as_dict(),
            "local_links": {name: link.as_dict() for name, link in self.local_links().items()},
            "engine_rates": self.rates.as_dict(),
            "plans": plans,
            "last_plan": self.last_plan,
        }

    def counters(self) -> PlanCounters:
        """A copy of the counters (for metrics)."""
        with self._lock:
            p = self.plans
            return PlanCounters(
                p.lookups,
                p.fetch_chunks,
                Counter(p.fetched),
                p.recompute_chunks,
                Counter(p.recomputed),
                p.recompute_s,
                p.fetch_s,
                p.saved_s,
                Counter(p.reasons),
                p.unasked,
            )


class _PullRoom:
    """Where a fill ran out of local room: the position (in its keys) of the first chunk that
    found none; no chunk from there on is kept, since a chain's chunks past a gap are of no use
    to a lookup. Counts what it cost (``no_room_chunks``). Thread-safe: a split pull's streams
    land chunks at once."""

    def __init__(self, order: Mapping[bytes, int], *, not_asked: int) -> None:
        self._order = order
        self._lock = threading.Lock()
        self._cut: int | None = None
        self.no_room_chunks = not_asked

    def beyond(self, key: bytes) -> bool:
        with self._lock:
            return self._cut is not None and self._order[key] >= self._cut

    def ran_out(self, key: bytes) -> None:
        """``key``'s chunk found no room."""
        with self._lock:
            at = self._order[key]
            self._cut = at if self._cut is None else min(self._cut, at)
            self.no_room_chunks += 1

    def dropped(self) -> None:
        """A chunk landed past the cut, not kept."""
        with self._lock:
            self.no_room_chunks += 1


class _StagingFull(Exception):
    """The pool writer's batch has no room left for the next chunk."""


class _WriteStaging:
    """The pool writer's export buffer: a batch's chunks are copied into it back to back, the
    same memory batch after batch while the writer is busy, unmapped once it idles. A new
    bytearray per chunk left the batches' high-water in glibc's arenas (its mmap threshold
    rises past 1 MiB after the first such free): a node's RSS grew tens of MiB under
    write-through while its live Python memory stayed flat."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.region: mmap.mmap | None = None
        self._used_bytes = 0
        self._views: list[memoryview] = []
        #: the mapping was refused: chunks get buffers of their own until the writer idles
        self._unmappable = False
        self._refusal_logged = False

    def take(self, n_bytes: int) -> memoryview | None:
        """The next ``n_bytes`` of the buffer; None for a chunk larger than all of it, or
        when the buffer cannot be mapped (it gets a buffer of its own). Raises _StagingFull
        when the batch left no room for it."""
        if n_bytes > self.capacity_bytes or self._unmappable:
            return None
        if self._used_bytes + n_bytes > self.capacity_bytes:
            raise _StagingFull
        if self.region is None:
            # pages exist only as chunks are copied in; huge ones make that as fast as reuse
            try:
                self.region = hugepages.anonymous_region(self.capacity_bytes)
            except OSError as exc:
                # the whole mapping counts where a chunk's bytes alone did (RLIMIT_AS, strict
                # overcommit): refused, it would fail every batch, so chunks go as before
                self._unmappable = True
                if not self._refusal_logged:
                    self._refusal_logged = True
                    log.warning(
                        "pool writer: no staging buffer of %d bytes (%s): each chunk is "
                        "copied into a buffer of its own",
                        self.capacity_bytes,
                        exc,
                    )
                return None
        with memoryview(self.region) as whole:
            view = whole[self._used_bytes : self._used_bytes + n_bytes]
        self._views.append(view)
        self._used_bytes += n_bytes
        return view

    def reuse(self) -> None:
        """After its batch was written (the pool's put returns once the bytes are sent): free
        for the next."""
        for view in self._views:
            with contextlib.suppress(BufferError):  # still exported elsewhere: GC frees it
                view.release()
        self._views.clear()
        self._used_bytes = 0

    def close(self) -> None:
        self.reuse()
        self._unmappable = False  # tried again when the writer is next busy
        if self.region is not None:
            with contextlib.suppress(BufferError):
                self.region.close()
            self.region = None


class RemoteTiers:
    def __init__(
        self,
        store: TieredStore,
        *,
        pool: Source | None,
        peers: Sequence[Source] = (),
        prefill: PrefillRate | PrefillModel,
        planner: FetchPlanner | None = None,
        write_through: bool = True,
        emit: Callable[[dict[str, Any]], None] | None = None,
        usage_every_s: float = 5.0,
        measure_every_s: float = 30.0,
        index: HolderIndex | None = None,
        node_name: str = "",
        index_breaker: Breaker | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.peers = list(peers)
        self.sources = [s for s in (pool, *self.peers) if s is not None]
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"remote source names must be unique, got {names}")
        self._by_name = {s.name: s for s in self.sources}
        #: which nodes hold what (see the module); None: every lookup probes every peer
        self.index = index
        #: this node's name in the fleet: the index names it too, and it is not a peer
        self.node_name = node_name
        self.index_breaker = index_breaker or Breaker()
        self.index_counters = IndexCounters()
        self.index_last_error = ""
        self._peer_names = frozenset(s.name for s in self.peers)
        self._monitoring = False
        #: the node's planner; the agent hands its own (``AgentRuntime``) so local and remote
        #: lookups share one set of rates and counters
        self.planner = planner or FetchPlanner(store, prefill=prefill, emit=emit)
        self.write_through = write_through and pool is not None
        self._emit = emit
        self._usage_every_s = usage_every_s
        self._measure_every_s = measure_every_s
        self._pool_usage: PoolUsage | None = None
        #: when ``_pool_usage`` was read (epoch seconds): it is kept through an outage
        self._pool_usage_read_s: float | None = None
        #: the last usage report refused (counts that are not counts), said once until fixed
        self._pool_usage_refused: str | None = None
        #: per (tenant, key) a lookup took from a source: that source, and how the lookup
        #: counted the hit (consumed by the tenant's pull that follows it)
        self._hints: OrderedDict[tuple[str, bytes], _Hint] = OrderedDict()
        self._lock = threading.Lock()
        #: the least bytes and the most tokens of any chunk a probe was answered with: what a
        #: lookup may assume of the chunks it would be answered with (``_not_worth_asking``)
        self.chunk_bounds: tuple[int, int] | None = None
        self._local = threading.local()
        self._queue: queue.Queue[bytes] = queue.Queue(_WRITE_QUEUE_MAX)
        #: a key taken from the queue that did not fit in the writer's batch: the next one's
        self._carried: bytes | None = None
        self.write = Counter[str]()
        self.write_last_error = ""
        #: pulls' chunks not kept for want of local room (``fill``)
        self.pulls = Counter[str]()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        #: each source's probe lane (its workers are started on first need)
        self._lanes = {
            s.name: ThreadPoolExecutor(
                max_workers=_PROBE_WORKERS_PER_SOURCE, thread_name_prefix=f"kvctl-probe-{s.name}"
            )
            for s in self.sources
        }
        counted = {POOL_TIER: pool is not None, PEER_TIER: bool(self.peers)}
        self._counts = RemoteTierCounts(store, [tier for tier, used in counted.items() if used])
        self._unsubscribe = store.subscribe(self._on_event) if self.write_through else None

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Background work: the pool writer, and link measurement and pool usage refresh."""
        if self.write_through:
            self._spawn(self._writer, "kvctl-pool-writer")
        if self.sources:
            self._monitoring = True  # it probes a failed index, so lookups need not
            self._spawn(self._monitor, "kvctl-link-monitor")

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        for t in self._threads:
            t.join(timeout=5)
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)
        for s in self.sources:
            s.backend.close()
        close_index = getattr(self.index, "close", None)
        if close_index is not None:
            close_index()

    # --- lookups ------------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], *, tenant: str = "") -> LookupResult:
        """Fetch or recompute over the local tiers, the pool and the peers (``FetchPlanner``)."""
        return self.planner.lookup(keys, tenant=tenant, remote=self)

    def _take(
        self,
        keys: Sequence[bytes],
        found: list[list[tuple[str, ChunkMeta]]],
        res: LookupResult,
        plan: FetchPlan | None,
        tenant: str,
        held: Mapping[int, Entry] | None = None,
    ) -> LookupResult:
        """``res`` (the local prefix, counted) extended by the plan's chunks past it, counted as
        ``remote`` or ``peer`` hits, or as hits in a local tier for those ``held`` here past a
        gap; every found chunk's location is shown either way."""
        m = len(keys) - len(found)
        fetched = {} if plan is None else {i: n for i, n in plan.fetch if i >= m}
        by_tier: dict[str, tuple[list[str], list[int]]] = {}
        locations = list(res.locations)
        matched_tokens = res.matched_tokens
        hints: dict[bytes, _Hint] = {}
        now_s = time.monotonic()
        for j, options in enumerate(found):
            i = m + j
            e = None if held is None else held.get(i)
            if e is not None:
                if i in fetched:
                    owners, tokens = by_tier.setdefault(e.tier, ([], []))
                    owners.append(e.tenant)
                    tokens.append(e.tokens)
                    matched_tokens += e.tokens
                continue
            if not options:
                continue
            src_name = fetched.get(i) or options[0][0]
            src = self._by_name[src_name]
            locations[i] = src.tier
            if i in fetched:
                meta = dict(options)[src_name]
                owners, tokens = by_tier.setdefault(src.tier, ([], []))
                owners.append(meta.tenant)
                tokens.append(meta.tokens)
                matched_tokens += meta.tokens
                hints[keys[i]] = _Hint(src_name, meta.tenant == tenant, now_s, meta.size_bytes)
        self._hint(tenant, keys, hints)
        for tier, (owners, tokens) in by_tier.items():
            self._counts.count_hits(tier, owners, tokens, tenant=tenant)
        matched = res.matched_chunks + len(fetched)
        return LookupResult(len(keys), matched, tuple(locations), matched_tokens)

    def locate(self, keys: Sequence[bytes], *, tenant: str = "") -> list[str | None]:
        """Best location of each key: a local tier, else ``remote`` or ``peer`` (counts
        nothing)."""
        where = self.store.locate(keys, tenant=tenant)
        missing = [i for i, t in enumerate(where) if t is None]
        if missing and self.sources:
            found = self._probe([keys[i] for i in missing], tenant)
            for i, options in zip(missing, found, strict=True):
                if options:
                    where[i] = self._by_name[options[0][0]].tier
        return where

    def _probe(self, keys: Sequence[bytes], tenant: str) -> list[list[tuple[str, ChunkMeta]]]:
        """Per key, the sources holding it with their metadata, cheapest link first: the pool
        and every peer, or, with an index that answers, the pool and the peers it names. Each
        source's answer is waited for ``PROBE_DEADLINE_S`` from its probe's start at most."""
        # the pool's probe goes first: it runs while the index is asked
        first = [self.pool] if self.pool is not None else []
        futures = self._submit_probes(first, keys, tenant)
        named = self._indexed(keys, tenant) if self.peers else None
        if named is None:
            asked = list(self.peers)
        else:
            asked = [s for s in self.peers if s.name in named]
            with self._lock:
                self.index_counters.peer_probes_saved += len(self.peers) - len(asked)
        futures += self._submit_probes(asked, keys, tenant)
        found: list[list[tuple[str, ChunkMeta]]] = [[] for _ in keys]
        stale = 0
        for s, fut, answer_by_s in futures:
            if fut is None:
                continue
            try:
                metas = fut.result(timeout=max(0.0, answer_by_s - time.monotonic()))
            except FutureTimeout:
                # the lookup goes on without this source's answer; a probe still queued in its
                # lane is not made at all (one running tells the breaker it came late)
                fut.cancel()
                with s._lock:
                    s.counters.late += 1
                continue
            if metas is None:
                continue
            overlong: list[ChunkMeta] = []
            for j, meta in enumerate(metas):
                held = meta is not None and meta.key == keys[j]
                if named is not None and not held and j in named.get(s.name, ()):
                    stale += 1  # the index's entry outlived the chunk: not asked for again
                # the source checked visibility; a size it disagrees on is not trusted either
                if held and meta is not None and self._visible(meta, tenant):
                    if self._overlong(meta):
                        overlong.append(meta)  # a miss: its hit would count tokens it lacks
                    else:
                        found[j].append((s.name, meta))
            if overlong:
                self._count_overlong(s, overlong, "its lookup answer")
        if stale:
            with self._lock:
                self.index_counters.stale_chunks += stale
        self._bound_chunks([meta for options in found for _, meta in options])
        for options in found:
            options.sort(key=lambda o: self._cost_key(o[0]))
        return found

    def _token_bound(self, meta: ChunkMeta) -> int:
        """The most tokens ``meta``'s chunk can hold (``most_tokens``): a node asking before
        its own engines stored any chunk larger than its ``chunk_tokens`` is no exception."""
        return most_tokens(self.store.chunk_tokens, meta.size_bytes)

    def _overlong(self, meta: ChunkMeta) -> bool:
        """Whether ``meta`` claims more tokens than its chunk can hold (``_token_bound``)."""
        return meta.tokens > self._token_bound(meta)

    def _count_overlong(self, s: Source, bad: Sequence[ChunkMeta], what: str) -> None:
        """``bad`` (chunks ``s`` claimed too long in ``what``) counted in ``s``'s ``corrupt``
        and said in one line."""
        with s._lock:
            s.counters.bad_tokens += len(bad)
        worst = max(bad, key=lambda m: m.tokens)
        log.warning(
            "%s: dropping %d chunk(s) in %s claiming more tokens than a chunk holds: %s "
            "claims %d, at most %d (the larger of chunk_tokens and its %d bytes / %d); not "
            "counted as hits, not stored",
            s.name,
            len(bad),
            what,
            worst.key.hex(),
            worst.tokens,
            self._token_bound(worst),
            worst.size_bytes,
            MIN_KV_BYTES_PER_TOKEN,
        )

    def _bound_chunks(self, metas: Sequence[ChunkMeta]) -> None:
        if not metas:
            return
        least = min(m.size_bytes for m in metas)
        most = max(m.tokens or self.store.chunk_tokens for m in metas)
        with self._lock:
            if self.chunk_bounds is not None:
                least = min(least, self.chunk_bounds[0])
                most = max(most, self.chunk_bounds[1])
            self.chunk_bounds = (least, most)

    def _submit_probes(
        self, sources: Sequence[Source], keys: Sequence[bytes], tenant: str
    ) -> list[tuple[Source, Future[list[ChunkMeta | None] | None] | None, float]]:
        """Each source's probe started in its own lane, with when its answer is due; None for
        a source whose breaker turns calls away (counted as skipped)."""
        out: list[tuple[Source, Future[list[ChunkMeta | None] | None] | None, float]] = []
        for s in sources:
            answer_by_s = time.monotonic() + PROBE_DEADLINE_S
            if not s.breaker.may_call():
                with s._lock:
                    s.counters.skipped += 1
                out.append((s, None, answer_by_s))
                continue
            fut = self._lanes[s.name].submit(
                s.call,
                "probe",
                lambda s=s: s.backend.probe_many(keys, tenant=tenant),
                moved_bytes=_no_bytes,
                answer_within_s=PROBE_DEADLINE_S,
            )
            out.append((s, fut, answer_by_s))
        return out

    def _indexed(self, keys: Sequence[bytes], tenant: str) -> dict[str, set[int]] | None:
        """The peers the index says hold some of ``keys``, each with the positions it holds;
        None when there is no index or it cannot answer now (every peer is then probed)."""
        index = self.index
        if index is None:
            return None
        breaker = self.index_breaker
        # a lookup never makes the half-open probe while the link monitor runs: it does
        ticket = breaker.admit() if not self._monitoring or breaker.state == "closed" else None
        if ticket is None:
            with self._lock:
                self.index_counters.skipped += 1
                self.index_counters.fallbacks += 1
            return None

        def holders() -> list[list[Holding]]:
            rows = index.holders(keys, tenant=tenant)
            if len(rows) != len(keys):
                raise ValueError(f"the index answered {len(rows)} rows for {len(keys)} keys")
            return rows

        rows = self._call_index(ticket, "holders", holders)
        if rows is None:  # any failure of the index leaves the lookup to probe all
            with self._lock:
                self.index_counters.fallbacks += 1
            return None
        named: dict[str, set[int]] = {}
        unknown = 0
        for j, row in enumerate(rows):
            for h in row:
                if h.node in self._peer_names:
                    named.setdefault(h.node, set()).add(j)
                elif h.node != self.node_name:
                    unknown += 1
        with self._lock:
            self.index_counters.queries += 1
            self.index_counters.unknown_nodes += unknown
        return named

    def _call_index(self, ticket: Ticket, what: str, fn: Callable[[], T]) -> T | None:
        """``fn()`` (a call of the index) under its breaker; None (and a counted error) when it
        fails."""
        try:
            out = fn()
        except Exception as exc:
            self._index_failed(ticket, f"{what}: {exc}")
            return None
        except BaseException:  # interrupted: says nothing about the index
            self.index_breaker.abandoned(ticket)
            raise
        self.index_breaker.succeeded(ticket)
        return out

    def _index_failed(self, ticket: Ticket, error: str) -> None:
        with self._lock:
            self.index_counters.errors += 1
            self.index_last_error = error
        if self.index_breaker.failed(ticket):
            log.warning(
                "fleet index %s failed (%s); probing every peer for %.2f s",
                _index_address(self.index),
                error,
                self.index_breaker.backoff_s,
            )

    def probe_index(self) -> bool | None:
        """The link monitor's probe of an index whose backoff ran out: True when it answered,
        False when it failed, None when no probe was due. The probe is the call lookups make
        (``holders``, of one key no chunk has), so an index that answers other calls but not
        that one (a router trickling its holder answers) stays out."""
        index = self.index
        if index is None or self.index_breaker.state != "half_open":
            return None
        ticket = self.index_breaker.admit()
        if ticket is None:
            return None

        def probe() -> list[list[Holding]]:
            rows = index.holders([_INDEX_PROBE_KEY], tenant="")
            if len(rows) != 1:
                raise ValueError(f"the index answered {len(rows)} rows for 1 key")
            return rows

        if self._call_index(ticket, "probe", probe) is None:
            return False  # still down: the breaker backs off further
        log.info("fleet index %s answered its probe: using it again", _index_address(index))
        return True

    def index_status(self) -> dict[str, Any] | None:
        """The index's address, breaker and counters (None without one)."""
        if self.index is None:
            return None
        with self._lock:
            counters = self.index_counters.as_dict()
            last_error = self.index_last_error
        return {
            "address": _index_address(self.index),
            "up": self.index_breaker.state == "closed",
            "breaker": self.index_breaker.as_dict(),
            "last_error": last_error,
            **counters,
        }

    def _cost_key(self, name: str) -> tuple[float, float]:
        link = self._by_name[name].link.link()
        bw = link.bandwidth_bytes_per_s or 0.0
        return (1.0 / bw if bw else float("inf"), link.rtt_s or float("inf"))

    def _hint(self, tenant: str, keys: Sequence[bytes], hints: Mapping[bytes, _Hint]) -> None:
        """A lookup's hints (``hints``: its remote hits); any older hint of ``tenant`` for
        the rest of ``keys`` goes, so no pull moves a hit this lookup counted here."""
        with self._lock:
            table = self._hints
            for key in keys:
                hint = hints.get(key)
                if hint is None:
                    table.pop((tenant, key), None)
                    continue
                table[tenant, key] = hint
                table.move_to_end((tenant, key))
            while len(table) > _HINTS_MAX:
                table.popitem(last=False)

    # --- reads --------------------------------------------------------------------------------
    def fill(self, keys: Sequence[bytes], *, tenant: str = "") -> int:
        """Pull the keys that are not local from the pool and peers into the local store, in
        order; returns how many arrived. Failures leave the rest missing (a miss).

        A pull takes the prefix of what is missing that the local tiers can hold: while it
        runs, ``keys``' chunks here and those it lands are held (``TieredStore.holding``), so
        landing one never evicts another (a chain's head evicted for its tail is of no use),
        and it asks only for as many as ``TieredStore.room_bytes`` has room for, by the sizes
        the lookup before it saw. A chunk that finds no room all the same is not kept, nor any
        past it (counted in ``no_room_chunks``)."""
        where = self.store.locate(keys, tenant=tenant)
        missing = [k for k, t in zip(keys, where, strict=True) if t is None]
        hints: dict[bytes, _Hint | None] = {}
        if self._hints:  # the tenant's hints for these keys are used up by this read
            with self._lock:
                hints = {k: self._hints.pop((tenant, k), None) for k in keys}
        if not missing or not self.sources:
            return 0
        with self.store.holding(keys):
            return self._pull(keys, missing, hints, tenant)

    def _pull(
        self,
        keys: Sequence[bytes],
        missing: list[bytes],
        hints: Mapping[bytes, _Hint | None],
        tenant: str,
    ) -> int:
        """``fill``'s pulls of ``missing`` (in ``keys``' order), ``keys`` held."""
        asked, sized = self._within_room(missing, hints)
        room = _PullRoom({k: i for i, k in enumerate(keys)}, not_asked=len(missing) - len(asked))
        missing = asked
        hinted = {k: None if (h := hints.get(k)) is None else h.source for k in missing}
        arrived = 0
        # the sources a lookup chose for some of the keys first (the pool first among them),
        # then the pool, then the others; a key hinted to a source is asked of no other until
        # that one was tried: with many peers, a pull must not go round all of them
        chosen = {h for h in hinted.values() if h is not None}
        order = sorted(self.sources, key=lambda s: (s.name not in chosen, s is not self.pool))
        tried: set[str | None] = {None}
        try:
            for src in order:
                if not missing:
                    break
                ask = [k for k in missing if hinted[k] in tried or hinted[k] == src.name]
                tried.add(src.name)
                if not ask:
                    continue
                # filled as chunks are stored, kept when the call then fails: a split pull whose
                # other stream failed has stored these, so they count and are asked of no one else
                landed: list[PoolChunk | None] = [None] * len(ask)
                try:
                    src.call(
                        "fetch",
                        functools.partial(
                            self._get, src, ask, tenant, landed, room, ordered=not sized
                        ),
                        moved_bytes=_chunk_bytes,
                    )
                finally:
                    self._recount_owners(landed, hints, tenant)
                done = {c.meta.key for c in landed if c is not None}
                arrived += len(done)
                # what no room was left for is asked of no other source
                missing = [k for k in missing if k not in done and not room.beyond(k)]
        finally:
            if room.no_room_chunks:
                with self._lock:
                    self.pulls["no_room_chunks"] += room.no_room_chunks
        return arrived

    def _within_room(
        self, missing: list[bytes], hints: Mapping[bytes, _Hint | None]
    ) -> tuple[list[bytes], bool]:
        """The prefix of ``missing`` the local tiers have room for (``TieredStore.room_bytes``,
        its chunks held), by the sizes the lookup before saw (the largest of them, else the
        sources' last chunks, for keys it did not see); and whether it was sized at all (not:
        nothing is known of the sizes, so all of it is asked, pulled in order)."""
        sizes = [0 if (h := hints.get(k)) is None else h.size_bytes for k in missing]
        guess = max(sizes, default=0) or max(
            (getattr(s.backend, "chunk_bytes_seen", 0) for s in self.sources), default=0
        )
        if guess <= 0:
            return missing, False
        room_bytes = self.store.room_bytes()
        take = 0
        for size in sizes:
            room_bytes -= size or guess
            if room_bytes < 0:
                break
            take += 1
        return missing[:take], True

    def _recount_owners(
        self, landed: Sequence[PoolChunk | None], hints: Mapping[bytes, _Hint | None], tenant: str
    ) -> None:
        """A lookup counted each remote hit as reuse or sharing by the owner of the copy it
        found; the copy that arrived can be another's (the chosen source lost it and another
        served it, or the pool's copy was replaced meanwhile). The hit then counts by the copy
        served, so the split says whose bytes the tenant got. Its tier stays the one the lookup
        counted; a hit the lookup counted here (a local tier) is not moved, even when its copy
        left before the read and a pull brought another."""
        oldest_s = time.monotonic() - _HINT_RECOUNT_S
        for chunk in landed:
            hint = None if chunk is None else hints.get(chunk.meta.key)
            if chunk is None or hint is None or hint.at_s < oldest_s:
                continue
            served_reuse = chunk.meta.tenant == tenant
            if served_reuse != hint.reuse:
                self._counts.recount_owner(self._by_name[hint.source].tier, reuse=served_reuse)

    def _get(
        self,
        src: Source,
        keys: Sequence[bytes],
        tenant: str,
        landed: list[PoolChunk | None],
        room: _PullRoom,
        *,
        ordered: bool = False,
    ) -> list[PoolChunk | None]:
        """Fetch from one source, putting each chunk in the store as it lands (a stream from a
        peer: the first chunks are usable before the last arrive) and into ``landed`` (at its
        index in ``keys``), which holds what was stored even when the pull then raises. The
        backend returns only after its last callback (``AgentSource.get_many``), so ``landed``
        is complete when this returns or raises. ``room``: where the fill ran out of local
        room (no chunk past it is kept); ``ordered``: in one stream, so chunks land in order
        (a pull not sized to the room: the first that finds none ends what is kept)."""

        # chunks received straight into the lease tier's arena: reserved as the stream reaches
        # each one (outside the store's lock), committed as it lands, given back (``unused``)
        # by the stream that held one it could not land (cut mid-chunk, or a chunk dropped),
        # once that stream writes no more
        slots: dict[int, PutSlot] = {}
        isolated = tenant in self.store.isolated_tenants

        def into(i: int, meta: ChunkMeta) -> memoryview | None:
            if (
                meta.key != keys[i]
                or not visible_to(meta, tenant, tenant_isolated=isolated)
                or self._overlong(meta)
            ):
                return None  # dropped when it lands (``_admit``)
            if room.beyond(keys[i]):
                return None  # dropped when it lands
            try:
                slot = self.store.reserve_put(meta.key, meta.size_bytes, **_as_stored(meta))
            except StoreError:  # put will refuse it too, and say why
                return None
            if slot is None:
                return None
            slots[i] = slot
            return slot.view

        def unused(i: int) -> None:
            slot = slots.pop(i, None)
            if slot is not None:
                self.store.abort_put(slot)

        def arrived(i: int, chunk: PoolChunk) -> None:
            slot = slots.pop(i, None)
            if room.beyond(keys[i]):  # past where the room ran out: of no use to a lookup
                room.dropped()
                if slot is not None:
                    self.store.abort_put(slot)
                return
            kept = self._admit(src, keys[i], chunk, tenant, slot)
            if kept == "kept":
                landed[i] = chunk
            elif kept == "no_room":
                room.ran_out(keys[i])

        backend = src.backend
        if isinstance(backend, AgentSource):  # streams: each chunk is kept as it lands
            backend.get_many(
                keys,
                tenant=tenant,
                arrived=arrived,
                into=into,
                unused=unused,
                streams=1 if ordered else None,
                keep=False,  # ``landed`` holds what was kept; a dropped chunk is let go at once
            )
        else:
            for i, chunk in enumerate(backend.get_many(keys, tenant=tenant)):
                if chunk is not None:
                    arrived(i, chunk)
        return landed

    def _visible(self, meta: ChunkMeta, tenant: str) -> bool:
        """Whether ``tenant`` may have a chunk a pool or peer holds, by this node's settings too:
        a chunk whose owner is isolated here is that owner's alone, whatever flag the node that
        stored it gave it (its settings may differ), as this node's store will enforce: a probe
        that counted it would promise a hit the read then refuses."""
        isolated = self.store.isolated_tenants
        either = tenant in isolated or meta.tenant in isolated
        return visible_to(meta, tenant, tenant_isolated=either)

    def _admit(
        self, src: Source, key: bytes, chunk: PoolChunk, tenant: str, slot: PutSlot | None = None
    ) -> Literal["kept", "refused", "no_room"]:
        """Keep a chunk that arrived: commit ``slot`` (the arena space its bytes were received
        into), else put its bytes. Otherwise (nothing kept, ``slot`` given back) "refused" when
        it is not what was asked, or the store would not take it, and "no_room" when no tier
        could make room for it (beside the chunks held)."""
        meta = chunk.meta
        if (
            meta.key != key
            or not self._visible(meta, tenant)
            or chunk.data.nbytes != meta.size_bytes
        ):
            if slot is not None:
                self.store.abort_put(slot)
            return "refused"  # the source broke its contract: never store what was not asked for
        if self._overlong(meta):  # stored, its hits would count tokens it does not hold
            if slot is not None:
                self.store.abort_put(slot)
            self._count_overlong(src, [meta], "a pull")
            return "refused"
        self._local.filling = True  # not an echo for the pool writer
        try:
            if slot is not None:
                tier = self.store.commit_put(slot)
            else:
                tier = self.store.put(key, chunk.data, **_as_stored(meta))
        except StoreError as exc:
            log.debug("could not keep %s from %s: %s", key.hex(), src.name, exc)
            return "no_room" if isinstance(exc, CapacityError) else "refused"
        finally:
            self._local.filling = False
        self._counts.count_read(src.tier, chunk.data.nbytes, landed=tier)
        with src._lock:
            src.counters.chunks_in += 1
            src.counters.bytes_in += chunk.data.nbytes
        return "kept"

    # --- write-through ------------------------------------------------------------------------
    def _on_event(self, event: dict[str, Any]) -> None:
        # called under the store's lock: only enqueue
        if event["type"] != "store" or getattr(self._local, "filling", False):
            return
        try:
            self._queue.put_nowait(bytes.fromhex(event["key"]))
        except queue.Full:
            self.write["dropped"] += 1

    def _write_failed(self, why: str) -> None:
        self.write_last_error = why

    def _writer(self) -> None:
        staging = _WriteStaging(_WRITE_BATCH_BYTES)
        try:
            while not self._stop.is_set():
                first, self._carried = self._carried, None
                if first is None:
                    try:
                        first = self._queue.get(timeout=0.2)
                    except queue.Empty:
                        staging.close()  # idle: its memory goes back to the system
                        continue
                try:
                    self._write_batch(first, staging)
                except Exception:  # the writer must outlive any one bad chunk or store error
                    log.exception("pool writer: a batch failed")
                    self.write["failed"] += 1
                    self.write_last_error = "a batch failed here (the agent's log says why)"
                finally:
                    staging.reuse()
        finally:
            staging.close()

    def _write_batch(self, first: bytes, staging: _WriteStaging) -> None:
        # each key taken from the queue is done once its batch is (``flush_writes``), whatever
        # became of it; a carried one is done with the next batch
        taken = [0]
        try:
            self._write_keys(first, staging, taken)
        finally:
            for _ in range(taken[0]):
                self._queue.task_done()

    def _write_keys(self, first: bytes, staging: _WriteStaging, taken: list[int]) -> None:
        """Write one batch from ``first`` on, counting in ``taken[0]`` the queued keys it took
        care of (so far, should it raise)."""
        assert self.pool is not None
        pool = self.pool
        batch: list[tuple[ChunkMeta, bytearray | memoryview]] = []
        size = 0
        key: bytes | None = first
        while key is not None:
            taken[0] += 1
            try:
                got = self.store.export(key, into=staging.take)
            except _StagingFull:
                taken[0] -= 1
                self._carried = key  # the next batch's first
                break
            if got is None:
                self.write["gone"] += 1  # evicted before its turn
            else:
                batch.append(got)
                size += got[0].size_bytes
            if len(batch) >= _WRITE_BATCH_CHUNKS or size >= _WRITE_BATCH_BYTES:
                break
            try:
                key = self._queue.get_nowait()
            except queue.Empty:
                key = None
        if not batch:
            return
        stored = pool.call(
            "write",
            functools.partial(pool.backend.put_many, batch),
            moved_bytes=_no_bytes,
            said=self._write_failed,
        )
        if stored is None:
            self.write["failed"] += len(batch)
            return
        for (meta, _), ok in zip(batch, stored, strict=True):
            if ok:
                self.write["written"] += 1
                with pool._lock:
                    pool.counters.chunks_out += 1
                    pool.counters.bytes_out += meta.size_bytes
            else:
                self.write["refused"] += 1

    def flush_writes(self, timeout_s: float = 10.0) -> bool:
        """Wait until the writer has written (or given up on) every queued chunk: False if
        ``timeout_s`` passed first. A queue seen empty is not enough: the batch the writer took
        from it may still be on its way (on a loaded machine, for longer than any pause)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    # --- links and usage ----------------------------------------------------------------------
    def _monitor(self) -> None:
        next_usage = 0.0
        schedule = MeasureSchedule(self._by_name, self._measure_every_s)
        while not self._stop.is_set():
            # a source whose backoff ran out is probed now (one ping), not when the next read
            # happens by: a node with no traffic to it still finds it back within the backoff
            for s in self.sources:
                ping = getattr(s.backend, "ping", None)
                if ping is not None and s.breaker.state == "half_open" and s.breaker.may_call():
                    s.call(
                        "probe ping", ping, moved_bytes=_no_bytes, answer_within_s=PROBE_DEADLINE_S
                    )
            self.probe_index()
            now = time.monotonic()
            for s in self.sources:
                # an uncosted link waits for its breaker to let calls through (see
                # MeasureSchedule): measured then, not measure_every_s later
                if schedule.due(s.name, now) and (s.link.link().costed or s.breaker.may_call()):
                    self.measure(s)
                    schedule.measured(s.name, now, costed=s.link.link().costed)
            if now >= next_usage and self.pool is not None:
                self._read_pool_usage(self.pool)
                next_usage = now + self._usage_every_s
            self._stop.wait(_MONITOR_TICK_S)

    def _read_pool_usage(self, pool: Source) -> None:
        """The pool's usage, kept for ``describe``. A report whose counts are not counts is
        not shown and said once (until a sound one comes), but is no failure of the pool: it
        answered, and its breaker (one failure opens it) would stop every read and write of
        this node to it at each read, over a figure."""

        def read() -> PoolUsage | BadUsageReport:
            try:
                return pool.backend.usage()
            except BadUsageReport as exc:
                return exc

        usage = pool.call("usage", read, moved_bytes=_no_bytes)
        if isinstance(usage, BadUsageReport):
            if str(usage) != self._pool_usage_refused:
                log.warning("%s: its usage is not shown: %s", pool.name, usage)
            self._pool_usage_refused = str(usage)
            self._pool_usage = None
        elif usage is not None:
            self._pool_usage, self._pool_usage_read_s = usage, time.time()
            self._pool_usage_refused = None

    def measure(self, src: Source) -> None:
        """One RTT sample (a ping) and one bandwidth sample (a download of filler). A link
        measured for the first time gets one of each first that is not recorded: the first
        ping opens the connection inside its timing, and the first download ran at half the
        speed of the next ones (4 MiB from a pool agent on loopback: 1.6-1.9 ms, then 0.8-1.2),
        and one such sample would price the link for the next ``measure_every_s``, long enough
        for a plan to recompute what it should fetch, learning nothing meanwhile."""
        taken = src.link.samples  # pings record no bandwidth, so one read serves both checks
        ping = getattr(src.backend, "ping", None)
        if ping is not None:
            if taken["rtt"] == 0:
                src.call("ping (warm-up)", ping, moved_bytes=_no_bytes, observe=False)
            # a source that cannot answer a ping within a lookup's wait cannot answer its probe
            src.call("ping", ping, moved_bytes=_no_bytes, answer_within_s=PROBE_DEADLINE_S)
        sample = getattr(src.backend, "probe_transfer", None)
        prepare = getattr(src.backend, "prepare_probe", None)
        if prepare is not None and src.breaker.may_call():
            try:  # outside the timed call: an upload is not the download being measured
                prepare(PROBE_TRANSFER_BYTES)
            except TierUnavailable:
                return
        if sample is not None and src.breaker.may_call():
            if taken["bandwidth"] == 0:
                src.call(
                    "bandwidth probe (warm-up)",
                    lambda: sample(PROBE_TRANSFER_BYTES),
                    moved_bytes=_no_bytes,
                    observe=False,
                )
            src.call(
                "bandwidth probe",
                lambda: sample(PROBE_TRANSFER_BYTES),
                moved_bytes=lambda _: PROBE_TRANSFER_BYTES,
            )

    def describe(self) -> dict[str, Any]:
        """Where this node reaches, for ``/v1/info`` (no round trip)."""
        return {
            "pool": None if self.pool is None else self.pool.backend.address,
            "peers": [{"name": s.name, "address": s.backend.address} for s in self.peers],
            "write": "through" if self.write_through else "off",
            "index": None if self.index is None else _index_address(self.index),
        }

    def status(self) -> dict[str, Any]:
        return {
            "pool": None if self.pool is None else self.pool.status(),
            "pool_usage": None if self._pool_usage is None else self._pool_usage.as_dict(),
            "pool_usage_read_s": self._pool_usage_read_s,
            "peers": [s.status() for s in self.peers],
            # which peers the lookups probed: the fleet index's breaker and counters, or None
            "index": self.index_status(),
            # prefill, device, local_links, engine_rates, plans, last_plan
            **self.planner.status(),
            # chunks pulls could not keep for want of local room: not asked (the room was sized
            # before the pull), found no room, or landed past one that found none
            "pull": {"no_room_chunks": self.pulls.get("no_room_chunks", 0)},
            "write": {
                "mode": "through" if self.write_through else "off",
                "queued": self._queue.qsize(),
                **{
                    k: self.write.get(k, 0)
                    for k in ("written", "refused", "failed", "dropped", "gone")
                },
                # why the last failed batch failed: the pool's own last_error is replaced by
                # the next failed call of anyone (the link monitor's probes, lookups)
                "last_error": self.write_last_error,
            },
        }


def _as_stored(meta: ChunkMeta) -> dict[str, Any]:
    """A pulled chunk's metadata as the store keeps it: its owner, lineage, priority and
    isolation, as ``put`` and ``reserve_put`` take them."""
    return {
        "tokens": meta.tokens or None,
        "tenant": meta.tenant,
        "parent": meta.parent,
        "priority": meta.priority,
        "isolated": meta.isolated,
    }
