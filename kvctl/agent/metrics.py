"""The agent's Prometheus metrics: store counters and gauges, data plane and HTTP instruments.

Conventions (design.md section 4): every name starts with ``kvctl_``, values are in base units
(bytes, seconds), counters end in ``_total``, and no label carries a key, request or tenant. Hit
ratios are not exported; a dashboard derives them from the hit and lookup counters. DC and host
are target labels added by the scraper, not metric labels.

Each ``AgentMetrics`` owns its registry (never the process-global ``REGISTRY``), so tests and
several agents in one process do not collide.

Store figures are not mirrored into instruments (that would double-book every count and need a
hook in each store path); a custom collector reads one consistent snapshot per scrape instead.
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvctl import __version__
from kvctl.agent.starting import STARTING_GAUGE, STARTING_GAUGE_HELP
from kvctl.store.stats import EVICTION_REASONS

# 10 µs (a shared-memory lease or a small lookup) .. 10 s (a large chunk over a slow link)
LATENCY_BUCKETS = (
    1e-5, 2.5e-5, 5e-5,
    1e-4, 2.5e-4, 5e-4,
    1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

OTHER = "other"

# Label cardinality is bounded for every caller-supplied value. Method is a fixed set. Op,
# transport and route are whatever the data plane / HTTP layer pass in, and their exact spelling
# is theirs to choose, so by default the first N distinct values are kept and later ones become
# "other" (a cap, not a guess at names we do not own). When the callers know their full set they
# pass it (``ops=``, ``transports=``, ``routes=`` or ``allow_routes()``) and anything outside it
# becomes "other" from the first request, so a scanner probing random paths can never crowd real
# routes out of the cap.
MAX_OPS = 32
MAX_TRANSPORTS = 8
MAX_ROUTES = 64
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class _SnapshotSource(Protocol):
    """What the collector needs from the store: one consistent snapshot per scrape."""

    def snapshot(self) -> dict[str, Any]: ...


class BoundedLabel:
    """Maps caller-supplied label values onto a bounded set (see the comment above)."""

    def __init__(self, cap: int, allowed: Iterable[str] | None = None) -> None:
        self.cap = cap
        self._lock = threading.Lock()
        self._allowed: frozenset[str] | None = None
        self._seen: set[str] = set()
        if allowed is not None:
            self.restrict(allowed)

    def restrict(self, allowed: Iterable[str]) -> None:
        """From now on accept only ``allowed`` (values seen before stay exported)."""
        with self._lock:
            self._allowed = frozenset(allowed)

    def __call__(self, value: str) -> str:
        allowed = self._allowed
        if allowed is not None:
            return value if value in allowed else OTHER
        if value in self._seen:
            return value
        if not isinstance(value, str) or not value:
            return OTHER
        with self._lock:
            if value in self._seen:
                return value
            if len(self._seen) < self.cap:
                self._seen.add(value)
                return value
        return OTHER


class StoreCollector(Collector):
    """Exports the store's counters and occupancy from one snapshot per scrape."""

    def __init__(self, store: _SnapshotSource) -> None:
        self._store = store

    def describe(self) -> Iterator[Metric]:
        # names only, so registering checks clashes without touching the store
        yield from self._families({"stats": {"tiers": {}}, "usage": {}, "leases": 0})

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._store.snapshot())

    @staticmethod
    def _families(snap: Mapping[str, Any]) -> Iterator[Metric]:
        stats: Mapping[str, Any] = snap["stats"]
        tiers: Mapping[str, Mapping[str, Any]] = stats["tiers"]
        usage: Mapping[str, Mapping[str, int]] = snap["usage"]

        def store_counter(name: str, doc: str, field: str) -> CounterMetricFamily:
            # CounterMetricFamily names go without "_total": the exposition adds it
            return CounterMetricFamily(name, doc, value=stats.get(field, 0))

        yield store_counter("kvctl_lookups", "Prefix lookups served.", "lookups")
        yield store_counter(
            "kvctl_lookup_chunks", "Chunks asked for by lookups (hits and misses).", "lookup_chunks"
        )
        yield store_counter(
            "kvctl_lookup_tokens", "Tokens covered by the chunks asked for.", "lookup_tokens"
        )

        hits = CounterMetricFamily(
            "kvctl_hits",
            "Chunk hits (in the matched prefix) by tier; kind=reuse: the chunk's own tenant, "
            "kind=sharing: another tenant's chunk.",
            labels=("tier", "kind"),
        )
        per_tier: dict[str, CounterMetricFamily] = {
            "hit_tokens": CounterMetricFamily(
                "kvctl_hit_tokens", "Tokens of the chunk hits, by tier.", labels=("tier",)
            ),
            "puts": CounterMetricFamily(
                "kvctl_puts", "New chunks stored, by tier they landed in.", labels=("tier",)
            ),
            "bytes_written": CounterMetricFamily(
                "kvctl_tier_written_bytes",
                "Bytes written into a tier (puts, promotions and demotions).",
                labels=("tier",),
            ),
            "bytes_read": CounterMetricFamily(
                "kvctl_tier_read_bytes", "Payload bytes read from a tier.", labels=("tier",)
            ),
            "promotions": CounterMetricFamily(
                "kvctl_promotions",
                "Chunks that arrived in this tier from a slower tier.",
                labels=("tier",),
            ),
            "demotions": CounterMetricFamily(
                "kvctl_demotions",
                "Chunks that arrived in this tier from a faster tier.",
                labels=("tier",),
            ),
            "filesystem_full": CounterMetricFamily(
                "kvctl_tier_filesystem_full",
                "Writes into a tier that found its filesystem full below the tier's capacity "
                "(ENOSPC, EDQUOT, EFBIG), whether evicting its own chunks then made room "
                '(kvctl_evictions_total reason="filesystem") or not.',
                labels=("tier",),
            ),
            "unreadable_on_open": CounterMetricFamily(
                "kvctl_tier_unreadable_on_open",
                "Chunk files (or fan-out directories) a tier's scan at start could not read "
                "(an I/O error: a bad sector) and skipped: not served, left in place.",
                labels=("tier",),
            ),
        }
        evictions = CounterMetricFamily(
            "kvctl_evictions",
            "Chunks that left a tier by eviction (demoted or dropped), by reason.",
            labels=("tier", "reason"),
        )
        for tier, ts in tiers.items():
            hits.add_metric((tier, "reuse"), ts.get("reuse_hits", 0))
            hits.add_metric((tier, "sharing"), ts.get("sharing_hits", 0))
            for field, family in per_tier.items():
                family.add_metric((tier,), ts.get(field, 0))
            by_reason: Mapping[str, int] = ts.get("evictions", {})
            # every known reason is always present so rate() works from the first scrape
            for reason in (*EVICTION_REASONS, *(r for r in by_reason if r not in EVICTION_REASONS)):
                evictions.add_metric((tier, reason), by_reason.get(reason, 0))
        yield hits
        yield from per_tier.values()
        yield evictions

        yield store_counter(
            "kvctl_drops", "Chunks that left the store entirely (not demoted).", "drops"
        )
        yield store_counter(
            "kvctl_demotion_failures",
            "Demotions that failed (lower tier full or unavailable) and dropped instead.",
            "demotion_failures",
        )
        yield store_counter(
            "kvctl_admission_refused",
            "Demotions refused by the lower tier's admission policy.",
            "admission_refused",
        )
        yield store_counter(
            "kvctl_bypassed_puts",
            "Puts declined: by the eviction policy's admission check, or (bypass_unreachable) "
            "as deeper in their chain than all the tiers hold.",
            "bypassed_puts",
        )
        yield store_counter(
            "kvctl_unreachable_puts",
            "Of kvctl_bypassed_puts, the puts bypass_unreachable turned away: deeper in their "
            "chain than all the tiers hold, so no lookup from the chain's start could reach them.",
            "unreachable_puts",
        )
        yield store_counter(
            "kvctl_spilled_puts",
            "Puts that landed in a lower tier because no room could be made in a higher one "
            "(e.g. free space split by leased chunks).",
            "spilled_puts",
        )
        yield store_counter(
            "kvctl_rerouted_puts",
            "Puts sent past a tier that was offline (e.g. after a CUDA error).",
            "rerouted_puts",
        )
        yield store_counter(
            "kvctl_corrupt_chunks",
            "Chunks found corrupt on read and dropped.",
            "corrupt_dropped",
        )

        gauges = {
            "capacity_bytes": GaugeMetricFamily(
                "kvctl_tier_capacity_bytes", "Configured tier capacity.", labels=("tier",)
            ),
            "used_bytes": GaugeMetricFamily(
                "kvctl_tier_used_bytes", "Bytes held by a tier.", labels=("tier",)
            ),
            "pinned_bytes": GaugeMetricFamily(
                "kvctl_tier_pinned_bytes", "Bytes of pinned chunks in a tier.", labels=("tier",)
            ),
            "chunks": GaugeMetricFamily(
                "kvctl_tier_items", "Chunks held by a tier.", labels=("tier",)
            ),
        }
        for tier, u in usage.items():
            for field, gauge in gauges.items():
                gauge.add_metric((tier,), u.get(field, 0))
        yield from gauges.values()
        yield GaugeMetricFamily(
            "kvctl_shm_leases",
            "Shared-memory chunk leases held by local readers.",
            value=snap.get("leases", 0),
        )
        switches = CounterMetricFamily(
            "kvctl_policy_switches",
            "Times an adaptive eviction policy handed the lead to another candidate.",
            labels=("tier",),
        )
        for tier, status in (snap.get("policies") or {}).items():
            if "switches" in status:
                switches.add_metric((tier,), status["switches"])
        yield switches
        yield GaugeMetricFamily(
            "kvctl_policy_queued_accesses",
            "Reads whose eviction-policy bookkeeping waits to be replayed after their reply "
            "(staying high: the replay falls behind, and reads replay it themselves).",
            value=snap.get("queued_accesses", 0),
        )


class PlanCollector(Collector):
    """Exports the fetch-or-recompute counters (``FetchPlanner.counters``) per scrape: chunks
    taken by tier, chunks held but recomputed by tier and reason, and the modeled prefill time
    the taken chunks saved (their recompute time minus their fetch time)."""

    def __init__(self, counters: Callable[[], Any]) -> None:
        self._counters = counters

    def describe(self) -> Iterator[Metric]:
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._counters())

    @staticmethod
    def _families(p: Any) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "kvctl_plan_lookups",
            "Lookups planned by fetch or recompute.",
            value=0 if p is None else p.lookups,
        )
        fetched = CounterMetricFamily(
            "kvctl_plan_fetched_chunks",
            "Chunks a lookup's plan took (fetched rather than recomputed), by tier.",
            labels=("tier",),
        )
        recomputed = CounterMetricFamily(
            "kvctl_plan_recomputed_chunks",
            "Chunks a tier held that a lookup's plan left to recompute (fetching them was "
            "slower, overridden or uncosted), by tier and reason.",
            labels=("tier", "reason"),
        )
        if p is not None:
            for tier, n in sorted(p.fetched.items()):
                fetched.add_metric((tier,), n)
            for (tier, reason), n in sorted(p.recomputed.items()):
                recomputed.add_metric((tier, reason), n)
        yield fetched
        yield recomputed
        for name, doc, field in (
            (
                "kvctl_plan_prefill_seconds",
                "Modeled prefill time of the chunks the plans took (what recomputing them costs).",
                "recompute_s",
            ),
            (
                "kvctl_plan_fetch_seconds",
                "Modeled time fetching the chunks the plans took.",
                "fetch_s",
            ),
            (
                "kvctl_plan_saved_seconds",
                "Modeled prefill time saved: the taken chunks' prefill time minus their fetch "
                "time.",
                "saved_s",
            ),
        ):
            yield CounterMetricFamily(name, doc, value=0.0 if p is None else getattr(p, field))
        yield CounterMetricFamily(
            "kvctl_plan_unasked_lookups",
            "Lookups that asked no remote source: nothing of the chain was here and fetching "
            "all of it from the one source would not have beaten recomputing it.",
            value=0 if p is None else p.unasked,
        )


#: the states a remote source's circuit breaker can be in (kvctl/remote/breaker.py)
BREAKER_STATES = ("closed", "open", "half_open")


class SourceCollector:
    """The pool's and each peer's circuit breaker and call counters, read per scrape. Sources
    are named in the agent's settings, so the ``source`` label is bounded by configuration."""

    def __init__(self, statuses: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        self._statuses = statuses

    def describe(self) -> Iterator[Metric]:
        yield from self._families(())

    def collect(self) -> Iterator[Metric]:
        yield from self._families(list(self._statuses()))

    @staticmethod
    def _families(statuses: Iterable[Mapping[str, Any]]) -> Iterator[Metric]:
        labels = ("source", "tier")
        state = GaugeMetricFamily(
            "kvctl_remote_source_breaker_state",
            "1 for the state a source's circuit breaker is in (closed, open, half_open), else 0.",
            labels=(*labels, "state"),
        )
        counters = {
            field: CounterMetricFamily(f"kvctl_remote_source_{name}", doc, labels=labels)
            for field, name, doc in (
                ("calls", "calls", "Calls made to a remote source."),
                ("errors", "errors", "Calls to a remote source that failed."),
                ("skipped", "skipped", "Calls not made because the source's breaker was open."),
                (
                    "late",
                    "late",
                    "Lookup probes a lookup stopped waiting for (past its deadline): it went on "
                    "without the source's answer.",
                ),
                (
                    "overdue",
                    "overdue",
                    "Pulls cut at their deadline (the source sent too slowly): the chunk in "
                    "flight and any not yet sent are misses.",
                ),
                (
                    "corrupt",
                    "corrupt",
                    "Chunks from a remote source that failed their checks (checksum, size, key, "
                    "tenant, more tokens than a chunk holds) and were dropped: misses, never "
                    "stored.",
                ),
                ("opens", "breaker_opens", "Times a source's circuit breaker opened."),
                ("probes", "breaker_probes", "Half-open probes let through to a source."),
                ("probe_failures", "breaker_probe_failures", "Half-open probes that failed."),
                (
                    "late_opens",
                    "breaker_late_opens",
                    "Times a source's breaker opened because its answers kept coming too late "
                    "(also counted in breaker_opens).",
                ),
            )
        }
        for src in statuses:
            key = (str(src["name"]), str(src["tier"]))
            breaker = src.get("breaker") or {}
            current = breaker.get("state", "closed" if src.get("up") else "open")
            for name in BREAKER_STATES:
                state.add_metric((*key, name), 1.0 if name == current else 0.0)
            for field, family in counters.items():
                value = src.get(field, breaker.get(field))
                if value is not None:
                    family.add_metric(key, value)
        yield state
        yield from counters.values()


#: the fleet index's counters (``RemoteTiers.index_status``): field, metric name, help
INDEX_COUNTERS = (
    ("queries", "kvctl_index_queries", "Lookups whose peer probes the fleet index chose."),
    ("errors", "kvctl_index_errors", "Fleet index calls that failed."),
    (
        "fallbacks",
        "kvctl_index_fallbacks",
        "Lookups that probed every peer because the fleet index failed or was backing off.",
    ),
    (
        "skipped",
        "kvctl_index_skipped",
        "Fleet index calls not made because its circuit breaker was open.",
    ),
    (
        "stale_chunks",
        "kvctl_index_stale_chunks",
        "Chunks the fleet index placed on a peer that the peer no longer held.",
    ),
    (
        "peer_probes_saved",
        "kvctl_index_peer_probes_saved",
        "Peer probes not made because the fleet index named no chunk of the lookup there.",
    ),
    (
        "unknown_nodes",
        "kvctl_index_unknown_nodes",
        "Holdings the fleet index named on a node that is not a configured peer (a peer "
        "configured under another name than its own is never probed by the index's answer).",
    ),
)


class IndexCollector(Collector):
    """The fleet index's counters and breaker state, read per scrape (``status()`` returns
    ``RemoteTiers.index_status()``: None without an index, which exports zeros)."""

    def __init__(self, status: Callable[[], Mapping[str, Any] | None]) -> None:
        self._status = status

    def describe(self) -> Iterator[Metric]:
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._status())

    @staticmethod
    def _families(status: Mapping[str, Any] | None) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvctl_index_configured",
            "1 when lookups ask a fleet index which peers to probe, else 0.",
            value=0.0 if status is None else 1.0,
        )
        state = GaugeMetricFamily(
            "kvctl_index_breaker_state",
            "1 for the state the fleet index's circuit breaker is in, else 0.",
            labels=("state",),
        )
        if status is not None:
            current = (status.get("breaker") or {}).get("state", "closed")
            for name in BREAKER_STATES:
                state.add_metric((name,), 1.0 if name == current else 0.0)
        yield state
        for field, name, doc in INDEX_COUNTERS:
            value = 0 if status is None else status.get(field, 0)
            yield CounterMetricFamily(name, doc, value=value)


#: the data plane ops whose chunks ``AgentMetrics.chunks_read`` counts
READ_OPS = ("get", "lease", "fetch")
#: of those, an engine's reads (on /v1/stats too): a FETCH is a peer's pull, made for a read
#: that the peer's own GET or LEASE counts (and a lookup there counted its hits), so counted
#: here too it made the fleet's sums count one read twice, a chunk gone from the pool as two
ENGINE_READ_OPS = ("get", "lease")


class AgentMetrics:
    """All metrics of one agent, on a registry of its own; ``clock`` gives ``kvctl_time_seconds``
    at each scrape."""

    def __init__(
        self,
        store: _SnapshotSource,
        *,
        ops: Iterable[str] | None = None,
        transports: Iterable[str] | None = None,
        routes: Iterable[str] | None = None,
        started_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry = CollectorRegistry()
        self.store_collector = StoreCollector(store)
        self.registry.register(self.store_collector)
        r = self.registry

        self._op = BoundedLabel(MAX_OPS, ops)
        self._transport = BoundedLabel(MAX_TRANSPORTS, transports)
        self._route = BoundedLabel(MAX_ROUTES, routes)

        build = Gauge(
            "kvctl_build_info",
            "Build of this agent; the value is always 1.",
            ("version", "python"),
            registry=r,
        )
        build.labels(__version__, platform.python_version()).set(1)
        # 1 only on the scrapes its starting responder answers (kvctl.agent.starting): serving
        Gauge(STARTING_GAUGE, STARTING_GAUGE_HELP, registry=r).set(0)
        start = Gauge(
            "kvctl_start_time_seconds", "Agent start time, Unix epoch seconds.", registry=r
        )
        start.set(time.time() if started_s is None else started_s)
        # read at each scrape: Prometheus compares it with the scrape's own timestamp, which
        # measures this node's clock skew (what kvctl doctor checks from one machine)
        Gauge(
            "kvctl_time_seconds",
            "The agent's clock when scraped, Unix epoch seconds.",
            registry=r,
        ).set_function(clock)

        # Counter names go without "_total": prometheus_client appends it
        self._dp_requests = Counter(
            "kvctl_dataplane_requests",
            "Data plane requests by op, transport and outcome.",
            ("op", "transport", "outcome"),
            registry=r,
        )
        self._dp_bytes = Counter(
            "kvctl_dataplane_bytes",
            "Data plane payload bytes by transport; in = received by the agent.",
            ("transport", "direction"),
            registry=r,
        )
        self._dp_duration = Histogram(
            "kvctl_dataplane_request_duration_seconds",
            "Data plane request service time.",
            ("op", "transport"),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._dp_connections = Gauge(
            "kvctl_dataplane_connections",
            "Open data plane connections.",
            ("transport",),
            registry=r,
        )
        #: plain counts below, the same as the Counters', for ``/v1/stats`` (a Counter's value
        #: is not public API)
        self._counts_lock = threading.Lock()
        self.corrupt_puts = 0
        self._corrupt_puts = Counter(
            "kvctl_dataplane_corrupt_puts",
            "PUT chunks whose bytes did not match the checksum their sender computed (damaged "
            "on the way): refused, not stored.",
            registry=r,
        )
        self.no_room_puts = 0
        self._no_room_puts = Counter(
            "kvctl_dataplane_no_room_puts",
            "PUT chunks no tier could take (NO_ROOM: pinned or leased chunks, a chunk larger "
            "than a tier, a disk tier's filesystem full): refused, not stored.",
            registry=r,
        )
        #: chunks an engine's reads asked for (GET, LEASE and LOOKUP_LEASE: ``ENGINE_READ_OPS``),
        #: by whether they were here: a lookup counts its hits when it answers, so a chunk it
        #: found and that was evicted before the read shows here as missing (or a read of a
        #: chunk never looked up). Peers' FETCHes are on the Counter only
        self.read_chunks = 0
        self.read_missing_chunks = 0
        self._read_chunks = Counter(
            "kvctl_dataplane_read_chunks",
            "Chunks data plane reads (GET, LEASE, LOOKUP_LEASE, FETCH with bytes) asked for, "
            "by op and whether they were here (found | missing: evicted since the lookup that "
            "counted them as hits, or never looked up).",
            ("op", "outcome"),
            registry=r,
        )
        self._read_children = {
            (op, outcome): self._read_chunks.labels(op, outcome)
            for op in READ_OPS
            for outcome in ("found", "missing")
        }
        self._idle_closed = Counter(
            "kvctl_dataplane_idle_connections_closed",
            "Idle TCP data plane connections closed to make room for new ones, by the cap "
            "they were at (data_max_connections, data_max_connections_per_source).",
            ("cap",),
            registry=r,
        )
        self._http_requests = Counter(
            "kvctl_http_requests",
            "Control API requests by method, route template and status.",
            ("method", "route", "status"),
            registry=r,
        )
        self._http_duration = Histogram(
            "kvctl_http_request_duration_seconds",
            "Control API request duration.",
            ("method", "route"),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        # Label children resolved once per distinct (raw) label tuple: the hot path is then one
        # dict lookup plus the increments. Only tuples that normalise to themselves are cached,
        # so the caches are as bounded as the labels.
        self._dp_children: dict[tuple[str, str, bool], tuple[Any, Any, Any, Any]] = {}
        self._conn_children: dict[str, Any] = {}
        self._http_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def add_plan_source(self, counters: Callable[[], Any]) -> None:
        """Export the fetch-or-recompute counters that ``counters()`` returns per scrape."""
        self.registry.register(PlanCollector(counters))

    def add_remote_sources(self, statuses: Callable[[], Iterable[Mapping[str, Any]]]) -> None:
        """Export the remote sources' breakers and counters (``statuses()`` per scrape)."""
        self.registry.register(SourceCollector(statuses))

    def add_index(self, status: Callable[[], Mapping[str, Any] | None]) -> None:
        """Export the fleet index's counters and breaker (``status()`` per scrape)."""
        self.registry.register(IndexCollector(status))

    # --- label bounds ------------------------------------------------------------------------
    def allow_routes(self, routes: Iterable[str]) -> None:
        """Accept only these route templates from now on (e.g. the app's route paths)."""
        self._route.restrict(routes)
        self._http_children.clear()  # cached children may hold routes no longer allowed

    # --- data plane --------------------------------------------------------------------------
    def observe_dataplane(
        self,
        op: str,
        transport: str,
        seconds: float,
        *,
        ok: bool,
        bytes_in: int = 0,
        bytes_out: int = 0,
    ) -> None:
        """Count one finished data plane request (called per request: keep it cheap)."""
        key = (op, transport, ok)
        children = self._dp_children.get(key)
        if children is None:
            children = self._dataplane_children(op, transport, bool(ok))
        requests, duration, b_in, b_out = children
        requests.inc()
        duration.observe(seconds if seconds > 0 else 0.0)
        # a negative count is a caller bug; never let metrics fail the request it describes
        if bytes_in > 0:
            b_in.inc(bytes_in)
        if bytes_out > 0:
            b_out.inc(bytes_out)

    def _dataplane_children(self, op: str, transport: str, ok: bool) -> tuple[Any, Any, Any, Any]:
        nop, ntr = self._op(op), self._transport(transport)
        children = (
            self._dp_requests.labels(nop, ntr, "ok" if ok else "error"),
            self._dp_duration.labels(nop, ntr),
            self._dp_bytes.labels(ntr, "in"),
            self._dp_bytes.labels(ntr, "out"),
        )
        if (nop, ntr) == (op, transport):
            self._dp_children[(op, transport, ok)] = children
        return children

    def corrupt_put(self) -> None:
        """Count one PUT chunk refused for failing its sender's checksum."""
        with self._counts_lock:
            self.corrupt_puts += 1
        self._corrupt_puts.inc()

    def no_room_put(self) -> None:
        """Count one PUT chunk refused because no tier could take it."""
        with self._counts_lock:
            self.no_room_puts += 1
        self._no_room_puts.inc()

    def chunks_read(self, op: str, found: int, missing: int) -> None:
        """Count one read request's chunks (``op``: one of ``READ_OPS``; an engine's, in
        ``ENGINE_READ_OPS``, on ``read_counts`` too)."""
        if op in ENGINE_READ_OPS:
            with self._counts_lock:
                self.read_chunks += found + missing
                self.read_missing_chunks += missing
        if found:
            self._read_children[(op, "found")].inc(found)
        if missing:
            self._read_children[(op, "missing")].inc(missing)

    def read_counts(self) -> tuple[int, int]:
        """(read_chunks, read_missing_chunks), read together: apart, a read counted between
        the two could show more missing chunks than reads since the last scrape."""
        with self._counts_lock:
            return self.read_chunks, self.read_missing_chunks

    def idle_connection_closed(self, cap: str) -> None:
        """Count one idle data plane connection closed to make room (``cap``: the setting)."""
        self._idle_closed.labels(cap).inc()

    def connection_opened(self, transport: str) -> None:
        self._connections(transport).inc()

    def connection_closed(self, transport: str) -> None:
        self._connections(transport).dec()

    def _connections(self, transport: str) -> Any:
        child = self._conn_children.get(transport)
        if child is None:
            ntr = self._transport(transport)
            child = self._dp_connections.labels(ntr)
            if ntr == transport:
                self._conn_children[transport] = child
        return child

    # --- control API -------------------------------------------------------------------------
    def observe_http(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one control API request; ``route`` is the route template, not the raw path."""
        key = (method, route, status)
        children = self._http_children.get(key)
        if children is None:
            children = self._http_children_for(method, route, status)
        count, duration = children
        count.inc()
        duration.observe(seconds if seconds > 0 else 0.0)

    def _http_children_for(self, method: str, route: str, status: int) -> tuple[Any, Any]:
        m = method.upper() if isinstance(method, str) else ""
        nmethod = m if m in HTTP_METHODS else OTHER
        nroute = self._route(route)
        nstatus = str(status) if isinstance(status, int) and 100 <= status <= 599 else OTHER
        children = (
            self._http_requests.labels(nmethod, nroute, nstatus),
            self._http_duration.labels(nmethod, nroute),
        )
        if nmethod != OTHER and nroute == route and nstatus != OTHER:
            self._http_children[(method, route, status)] = children
        return children

    # --- exposition --------------------------------------------------------------------------
    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition body and its content type: Prometheus text 0.0.4 by default, or what
        an ``Accept`` header asks for (OpenMetrics) when given."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.registry), content_type
