"""The collector loop: scrape every node concurrently, probe links, write, roll up, prune.

One slow or dead node never holds up the others: scrapes run in a thread pool with a deadline
inside the interval, each request to a total deadline of its own (``Deadlines``: a trickled
answer is given up on too), a node that misses either is recorded as down, and a node whose
previous scrape (or request) is still hanging is skipped rather than piled up. Nodes whose
last scrape failed or hung are scraped on threads of their own, and a scrape that waited long
for a thread gets one of its own (bounded), so a DC's nodes all hanging at once do not make
the nodes that answer miss the cycle's deadline. Row building
and counter tracking happen on the loop's thread, so the tracker needs no lock. A batch the
database refuses is kept and retried next cycle (bounded), so a database restart loses no
increases.
"""

from __future__ import annotations

import contextlib
import heapq
import inspect
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

import httpx
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import SQLAlchemyError

from collectors.capped_transport import CappedTransport
from collectors.engines import EngineReading, Histogram, UnknownEngine, parse_engine_metrics
from collectors.metrics import CollectorMetrics
from collectors.router import RouterAnswerError, RouterReading, parse_router_stats, route_rows
from collectors.router import router_key as router_key_of
from collectors.rows import (
    cache_rows,
    emulated_power_rows,
    emulation_for,
    engine_rejected,
    engine_row,
    engine_waits,
    plan_rows,
    power_rows,
)
from kvctl.client import (
    AgentClient,
    AgentError,
    AgentStarting,
    AgentTimeout,
    AuthError,
    NotAnAgent,
    RequestError,
)
from kvctl.counters import CountersMoved, CounterTracker
from kvctl.daemon_pool import MAX_THREADS_TOTAL, DaemonPool
from kvctl.db.engine import (
    FileId,
    NoDatabaseFile,
    StuckWatch,
    connection_file,
    cut_when_stuck,
    driver_message,
    follow_the_path,
    sqlite_file_path,
    write_transaction,
)
from kvctl.db.ingest import insert_rows
from kvctl.db.inventory import NodeInfo, list_nodes
from kvctl.db.models import raw_table
from kvctl.db.rollup import Retention, maintain, reopen
from kvctl.db.sample_checks import (
    MAX_MAGNITUDE,
    Rejections,
    brief,
    checked_gpus,
    checked_probe,
    checked_stats,
    count,
    ratio,
    shown,
)
from kvctl.deadline_transport import Abandonable, AbandonableTransport, running
from kvctl.errors import InvalidArgument
from kvctl.interrupts import interrupts_held
from kvctl.profiles import ModeledInputs
from kvctl.redact import redact_url
from kvctl.remote.pool import pull_deadline_s
from kvctl.router.client import RouterClient, RouterClientError

log = logging.getLogger("kvctl.collect")

T = TypeVar("T")

#: rows kept for retry while the database refuses writes (about a day of a 100-node fleet)
MAX_PENDING_ROWS = 1_000_000
#: the longest interval_s and link_interval_s (`kvctl collect --interval` takes as much): past
#: about 1e10 s a wait overflows the platform's time_t (OverflowError in the first cycle)
MAX_INTERVAL_S = 86_400.0
#: times a batch refused by another collector's save is counted again from its state before
#: it is dropped (a third save in between would take a collector saving every few ms)
MAX_REBASES = 3
#: tables whose rows hold no counters: kept from refused cycles whatever the counters' state
COUNTERLESS_TABLES = frozenset({"node_sample", "link_sample"})
#: scrapes (and link probes) running at once, at most: past ``max_workers``, one that has
#: waited for a thread gets one of its own (``Collector``); past this, it waits for one
MAX_SCRAPE_THREADS = MAX_THREADS_TOTAL
#: what a probe's RTT may be (the agent's ``rtt_basis``); anything else is recorded "unknown"
RTT_BASES = ("measured", "emulated")
#: whether this SDK's probe names its target (the agent then reports the link's emulated delay)
_PROBE_TAKES_NAME = "name" in inspect.signature(AgentClient.probe).parameters
#: what the SDK raises, untyped, for an answer it cannot read: JSON that is not JSON or nested
#: deeper than Python parses, a body its Content-Encoding does not decode
UNREADABLE = (ValueError, RecursionError, httpx.DecodingError)
#: what a link probe's answer may take beyond the probe's own worst case: the HTTP exchange, a
#: wait for one of the agent's workers, an emulated link's delay on each of its round trips
PROBE_SLACK_S = 5.0
#: how far an agent's start time by its health answer (its clock less its uptime) may be from
#: the ``started_s`` its stats said for the two to be one start (the same clock: rounding only)
EPOCH_MATCH_S = 1.0


def probe_deadline_s(pings: int, size_bytes: int, timeout_s: float) -> float:
    """The total deadline of a link probe's answer (``POST /v1/probe``; the agent answers once
    the probe is done): the probe's own worst case (``kvctl.remote.probe.probe_link``: connect
    and each ping, a reconnect each, within ``timeout_s``; each of its two transfers cut at
    ``pull_deadline_s``, ``timeout_s`` plus its bytes at 32 MiB/s) plus ``PROBE_SLACK_S``."""
    steps_s = (2 * pings + 2) * timeout_s
    return steps_s + 2 * pull_deadline_s(size_bytes, timeout_s) + PROBE_SLACK_S


@dataclass(frozen=True, slots=True)
class CollectorConfig:
    interval_s: float = 10.0
    link_interval_s: float = 60.0
    maintenance_interval_s: float = 60.0
    #: each request's whole answer must be in within this (a total deadline, not per read:
    #: an agent trickling its answer is cut off too); default: 80% of the interval, at most 5 s
    timeout_s: float | None = None
    dc: str | None = None
    #: bearer token for the agents (and, in link probes, for the probed agent)
    token: str | None = None
    probe_bytes: int = 1 << 20
    pings: int = 5
    #: a link probe's limit on each step (connect, each ping, each transfer's reads); its
    #: answer's total deadline is ``probe_deadline_s`` of it
    probe_timeout_s: float = 2.0
    retention: Retention = field(default_factory=Retention)
    max_workers: int = 32
    #: `kvctl router serve` URLs scraped each cycle (``/v1/stats``) into route_sample
    routers: tuple[str, ...] = ()
    #: bearer token for the routers
    router_token: str | None = field(default=None, repr=False)
    #: emulate GPU energy on nodes whose agent says NVML is unavailable (never on the others)
    emulate_power: ModeledInputs | None = None
    #: a batch the database refuses is kept for the next cycle (the loop); a single run
    #: (`collect --once`) has none, so it says the batch is not recorded instead
    keep_refused: bool = True
    #: the most rows kept while the database refuses them; past it the oldest cycles' go
    max_pending_rows: int = MAX_PENDING_ROWS
    #: a database call of a cycle (inventory, counters' state, the batch) not answered within
    #: this has its connections cut (PostgreSQL: ``kvctl.db.engine.cut_when_stuck``); the
    #: upkeep's, whose rollups may take long, within ``maintenance_timeout_s``
    db_timeout_s: float = 60.0
    maintenance_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        # inf link_interval_s: no link probes (collect --no-links)
        for name, value, none in (
            ("interval_s", self.interval_s, False),
            ("link_interval_s", self.link_interval_s, True),
        ):
            if not (0 < value <= MAX_INTERVAL_S or (none and value == math.inf)):
                raise InvalidArgument(
                    f"{name} must be above 0 and at most {MAX_INTERVAL_S:,.0f} s (a day)"
                    + (", or inf for none" if none else "")
                    + f", got {value}"
                )

    @property
    def request_timeout_s(self) -> float:
        return self.timeout_s if self.timeout_s is not None else min(5.0, self.interval_s * 0.8)


@dataclass(slots=True)
class Scrape:
    """What one node answered (raw), before rows are built on the loop's thread."""

    node: NodeInfo
    up: bool
    seconds: float
    error: str | None = None
    stats: dict[str, Any] | None = None
    gpus: dict[str, Any] | None = None
    engine: EngineReading | None = None
    #: what could not be read although the node answered (its GPUs, its engine)
    warnings: list[str] = field(default_factory=list)
    #: figures of its answers that cannot be true, stored as unknown (kvctl.db.sample_checks)
    rejected: Rejections = field(default_factory=Rejections)
    #: it answered, refusing the token: up (as `kvctl status` says), its figures unread
    auth_refused: bool = False
    #: it answered "starting" (its tiers still opening): up, its figures unread until it serves
    starting: bool = False
    #: the agent's start time (``started_s``, its clock) was checked against this collector's
    #: (``Collector._uptime``): whether it started after the collector did, and how long ago
    epoch_checked: bool = False
    started_after_s: float | None = None
    #: figures found impossible once counted (an interval's hits past its lookups,
    #: ``collectors.rows.hits_beyond_lookups``): each build of the cycle's rows finds them anew
    counted: Rejections = field(default_factory=Rejections)

    @property
    def answered(self) -> bool:
        """Whether the node answered: read, refusing the token, or starting (all up)."""
        return self.up or self.auth_refused or self.starting


@dataclass(slots=True)
class CycleReport:
    ts_ms: int
    seconds: float = 0.0
    up: list[str] = field(default_factory=list)
    down: dict[str, str] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    written: bool = True
    #: routers scraped (their redacted URLs), and why the others could not be
    routers_up: list[str] = field(default_factory=list)
    routers_down: dict[str, str] = field(default_factory=dict)
    #: per node (or link): the fields of its answers rejected as impossible (not finite,
    #: negative, a ratio outside [0, 1], beyond BIGINT, missing), and why; stored as unknown
    rejected: dict[str, dict[str, str]] = field(default_factory=dict)
    #: nodes that answered but refused the token (up, unread), and what they said
    token_refused: dict[str, str] = field(default_factory=dict)
    #: nodes that answered "starting" (up, their tiers still opening, unread), and what they
    #: said (its text begins with kvctl.agent_starting.STARTING_PREFIX)
    starting: dict[str, str] = field(default_factory=dict)
    #: link rounds: DC pairs not probed (a DC whose nodes answered but none can be read:
    #: refusing the token or starting), and why; no sample is recorded for them
    skipped: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ts_ms": self.ts_ms,
            "seconds": round(self.seconds, 4),
            "up": self.up,
            "down": self.down,
            "token_refused": self.token_refused,
            "starting": self.starting,
            "routers": {"up": self.routers_up, "down": self.routers_down},
            "skipped": self.skipped,
            "rows": self.rows,
            "warnings": self.warnings,
            "written": self.written,
            "rejected": {
                node: {"count": len(fields), "fields": fields}
                for node, fields in self.rejected.items()
            },
        }

    def reject(self, node: str, rejected: Rejections) -> None:
        """Note ``rejected`` of ``node``'s answers: in ``rejected`` and as a warning."""
        if not rejected:
            return
        self.rejected.setdefault(node, {}).update(rejected.fields)
        self.warnings.append(
            f"{node}: {len(rejected)} value(s) rejected as impossible, stored as unknown: "
            f"{rejected.summary()}"
        )


@dataclass(slots=True)
class RouterScrape:
    """What one router answered, checked, before rows are built on the loop's thread."""

    router: str
    seconds: float
    reading: RouterReading | None = None
    error: str | None = None


class NotAnswering(AgentTimeout):
    """A scrape's request got no full answer within its total deadline: the agent (router,
    engine) took the connection and answers too slowly or not at all (hung, overloaded, or
    trickling its answer within each read's timeout)."""


class Deadlines:
    """Requests run to a total deadline each. httpx's timeouts are per read, so an answer
    trickled a byte at a time held a scrape (and the cycle waiting for it) for as long as it
    trickled; here each request runs on a daemon thread of its own and the scrape waits for it
    until its deadline, then says the target is not answering. A request through an
    ``AbandonableTransport`` (``kvctl.deadline_transport``) given up at its deadline has its
    connection shut down, so its thread ends then too, and the next cycle asks afresh; any
    other ends with its request, and while it runs the same request (``key``) is not sent
    again (one thread per silent target, never one more each cycle)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._running: dict[tuple[object, ...], tuple[Future[Any], float]] = {}
        self._lock = threading.Lock()

    def call(
        self,
        key: tuple[object, ...],
        what: str,
        request: Callable[[], T],
        *,
        timeout_s: float | None = None,
    ) -> T:
        """``request()``'s answer, in within ``timeout_s`` (default: this one's); else
        ``NotAnswering`` naming ``what`` (a request, said to an operator)."""
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        fut: Future[T] = Future()
        with self._lock:
            in_flight = self._running.get(key)
            if in_flight is not None and not in_flight[0].done():
                waited_s = time.monotonic() - in_flight[1]
                raise NotAnswering(
                    f"not answering: {what} asked {waited_s:.0f} s ago is still unanswered"
                )
            self._running[key] = (fut, time.monotonic())

        this = Abandonable()

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            with running(this):
                try:
                    fut.set_result(request())
                except BaseException as exc:  # raised by result() in the scrape's thread
                    fut.set_exception(exc)

        threading.Thread(target=run, daemon=True, name="kvctl-request").start()
        try:
            return fut.result(timeout=limit_s)
        except FutureTimeout:
            this.abandon()
            raise NotAnswering(
                f"not answering: no full answer to {what} within {limit_s:g} s"
            ) from None
        finally:
            # an ended request is forgotten: kept, each held its answer, a removed node's
            # (and each probed pair's) for as long as the loop ran
            if fut.done():
                with self._lock:
                    if self._running.get(key, (None,))[0] is fut:
                        del self._running[key]


class Collector:
    def __init__(
        self,
        engine: Engine,
        config: CollectorConfig | None = None,
        *,
        metrics: CollectorMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.engine = engine
        # a SQLite file moved away or replaced while the loop runs: its rows kept until a file
        # is there again, never written into the one moved nor into a new empty one
        follow_the_path(engine, "the collector")
        self.config = config or CollectorConfig()
        self.metrics = metrics or CollectorMetrics()
        self._clock = clock
        self._tracker = CounterTracker()
        self._tracker_loaded = False
        #: the SQLite file whose saved state the tracker holds (None: PostgreSQL, or not read)
        self._tracker_file: FileId | None = None
        self._ttft_prev: dict[int, Histogram] = {}
        self._clients: dict[int, AgentClient] = {}
        #: clients replaced (a node's URL changed) or of removed nodes, each with the scrape
        #: that may still use it: closed once that scrape ends
        self._retired: list[tuple[AgentClient, Future[Scrape] | None]] = []
        # a scrape that has waited for a thread past a third of the cycle's deadline (or a
        # request timeout, when shorter) gets one of its own, up to MAX_SCRAPE_THREADS: nodes
        # that answered and all hang at once (a DC's link down) held every thread for a
        # request timeout each, and the nodes behind them in the queue were recorded down
        # ("no answer in 9.0s") every cycle while it lasted. A healthy fleet's scrapes never
        # wait that long (32 threads, 50 ms a node: 1,900 nodes in 3 s)
        self._pool = DaemonPool(
            self.config.max_workers,
            "kvctl-scrape",
            overflow_after_s=min(self.config.request_timeout_s, self._deadline_s / 3),
            max_threads=MAX_SCRAPE_THREADS,
        )
        #: the scrapes of the nodes in ``_failing``: a DC's hung nodes hold these threads
        #: (``max_workers``, no more) from their second cycle on, never the others'
        self._failing_pool = DaemonPool(self.config.max_workers, "kvctl-scrape-failing")
        #: nodes whose last scrape failed (one past a cycle's deadline counts when it ends:
        #: a hung node's at its request timeout; one that only waited for a thread, no fault
        #: of its node's, most often answers then)
        self._failing: set[int] = set()
        self._in_flight: dict[int, Future[Scrape]] = {}
        self._pending: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._warned_nodes: set[int] = set()
        #: per node (and link), the fields last logged as rejected: logged again on a change
        self._rejected_logged: dict[str, frozenset[str]] = {}
        #: the inventory as last read: scraped on while the database cannot be read
        self._known_nodes: list[NodeInfo] = []
        self._link_round = 0
        #: per node, what its last scrape found: "up" (read), "unread" (it answered, refusing
        #: the token or starting) or "down"; link probes pick their endpoints by it
        self._last_scrape: dict[int, str] = {}
        #: when this collector started (monotonic), and per node the agent start time
        #: (``started_s``) checked against it: an agent started since counts from zero
        self._started_mono = time.monotonic()
        self._epoch_checked: dict[int, float] = {}
        #: per node, the start time its last read scrape said, and whether it was new then
        self._last_epoch: dict[int, tuple[float, bool]] = {}
        self._http = httpx.Client(
            timeout=self.config.request_timeout_s,
            transport=CappedTransport(AbandonableTransport()),
        )
        self._deadlines = Deadlines(self.config.request_timeout_s)
        # routers by their redacted URL (the ``router`` column; never logged with credentials)
        self._routers = {router_key_of(redact_url(u)): u for u in self.config.routers}
        self._router_clients: dict[str, RouterClient] = {}
        self._router_in_flight: dict[str, Future[RouterScrape]] = {}
        self._router_errors: dict[str, str] = {}
        #: rows written in all, every cycle: what a run cut by Ctrl-C has recorded
        self.rows_written = 0
        #: when (the cycle's ts_ms) the database first failed a cycle, until it takes a batch
        self._db_down_since_ms: int | None = None
        #: rows kept through the current outage dropped past ``max_pending_rows``
        self._dropped_rows = 0

    @property
    def _deadline_s(self) -> float:
        """How long a cycle waits for its scrapes: a node not answered by then is down."""
        return self.config.interval_s * 0.9

    # --- inventory ---------------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        with self.engine.connect() as conn:
            return list_nodes(conn, dc=self.config.dc)

    def _inventory(self, report: CycleReport) -> list[NodeInfo]:
        """The inventory's nodes; while the database cannot be read, the nodes last read: the
        loop scrapes on and keeps its rows for the database's return."""
        with self._stuck() as watch:
            try:
                self._known_nodes = self.nodes()
            except SQLAlchemyError as exc:
                self._db_failed(
                    report,
                    "database unavailable: cannot read the inventory, scraping the nodes last read",
                    exc,
                    watch,
                )
        return self._known_nodes

    def _stuck(
        self, timeout_s: float | None = None
    ) -> contextlib.AbstractContextManager[StuckWatch]:
        """The database's calls in the block cut after ``timeout_s`` (``db_timeout_s``)."""
        return cut_when_stuck(self.engine, timeout_s or self.config.db_timeout_s)

    def _db_failed(
        self,
        report: CycleReport,
        what: str,
        exc: SQLAlchemyError,
        watch: StuckWatch | None = None,
    ) -> None:
        """A cycle the database failed: counted and in the report's warnings (the loop's line
        each cycle), logged once an outage (``_db_back`` says when it ends): a loop at
        --interval 1 logged each failure, the driver's text over three lines, twice a second
        for as long as the database was away."""
        self.metrics.db_errors.inc()
        report.written = False
        said = f"{what}: {self._cause(exc, watch, self.config.db_timeout_s)}"
        report.warnings.append(said)
        if not self.config.keep_refused:
            log.debug("%s", said)  # a single run: its caller shows the report's warnings
        elif self._db_down_since_ms is None:
            self._db_down_since_ms = report.ts_ms
            log.error("%s; the loop goes on, and says so once the database is back", said)
        else:
            log.debug("%s", said)

    def _cause(self, exc: SQLAlchemyError, watch: StuckWatch | None, timeout_s: float) -> str:
        """Why a database call failed, on one line (``_cause``); a table or column the schema
        lacks said as its revision behind this kvctl's, with what to run: a backup at an older
        schema restored under the loop (its file written from the next cycle) failed every
        write with SQLite's 'no such column', the rows kept, the operator left to guess. The
        loop never upgrades a database put there under it."""
        from kvctl.db.migrate import schema_behind

        if watch is None or not watch.fired:
            behind = schema_behind(self.engine, exc)
            if behind is not None:
                return behind
        return _cause(exc, watch, timeout_s)

    def _db_back(self, report: CycleReport, rows: int) -> None:
        """The database took a batch: where it had failed, say it is back, and what landed."""
        if self._db_down_since_ms is None:
            return
        away_s = max(0, report.ts_ms - self._db_down_since_ms) / 1000
        self._db_down_since_ms = None
        lost = ""
        if self._dropped_rows:
            lost = f"; {self._dropped_rows} rows of its oldest cycles were dropped, lost"
            self._dropped_rows = 0
        log.warning(
            "database back after %.0f s: %d rows written, those kept included%s",
            away_s,
            rows,
            lost,
        )

    def _node_clients(self, nodes: list[NodeInfo]) -> dict[int, AgentClient]:
        """On the loop's thread, once the inventory is read: each node's client, made anew for
        a node whose agent URL changed; the replaced ones and those of nodes gone from the
        inventory are closed once no scrape of theirs runs (they were kept open, and removed
        nodes' kept, for as long as the loop ran). Never made on the scrapes' threads: two
        probes from one node made two clients, one left unclosed."""
        current = {n.id: n for n in nodes}
        for node_id, client in list(self._clients.items()):
            node = current.get(node_id)
            if node is None or client.url != node.agent_url.rstrip("/"):
                del self._clients[node_id]
                self._retired.append((client, self._in_flight.get(node_id)))
        self._retired = [(c, f) for c, f in self._retired if not _closed_when_done(c, f)]
        kept = (self._last_scrape, self._epoch_checked, self._last_epoch, self._ttft_prev)
        kept += (self._failing,)
        for node_id in set().union(*kept, self._in_flight, self._warned_nodes) - set(current):
            self._forget(node_id)
        for node in nodes:
            if node.id not in self._clients:
                self._clients[node.id] = AgentClient(
                    node.agent_url,
                    token=self.config.token,
                    timeout_s=self.config.request_timeout_s,
                    transport=CappedTransport(
                        AbandonableTransport(verify=node.agent_url.startswith("https://"))
                    ),
                )
        return {n.id: self._clients[n.id] for n in nodes}

    def _forget(self, node_id: int) -> None:
        """What this collector kept of a node gone from the inventory (ids are never reused);
        a scrape of it still running keeps its own future until it ends."""
        self._last_scrape.pop(node_id, None)
        self._failing.discard(node_id)
        self._epoch_checked.pop(node_id, None)
        self._last_epoch.pop(node_id, None)
        self._ttft_prev.pop(node_id, None)
        self._warned_nodes.discard(node_id)
        hanging = self._in_flight.get(node_id)
        if hanging is None or hanging.done():
            self._in_flight.pop(node_id, None)

    def _note_lane(self, node_id: int, scrape: Scrape) -> Scrape:
        """Where the node's next scrape runs: on the failing pool once a scrape of it failed,
        until one finds it answering."""
        if scrape.answered:
            self._failing.discard(node_id)
        else:
            self._failing.add(node_id)
        return scrape

    def _ask(
        self,
        key: tuple[object, ...],
        what: str,
        request: Callable[[], T],
        *,
        timeout_s: float | None = None,
    ) -> T:
        """An agent's answer to ``request`` within its deadline (``Deadlines.call``). One the
        SDK cannot read raises NotAnAgent, as an answer that is not an agent's: the SDK lets
        some out untyped, and they ended the cycle, every node's samples with it."""
        try:
            return self._deadlines.call(key, what, request, timeout_s=timeout_s)
        except UNREADABLE as exc:
            raise NotAnAgent(f"unreadable answer to {what}: {exc}") from exc

    # --- one cycle ---------------------------------------------------------------------------
    def _scrape(self, node: NodeInfo, client: AgentClient) -> Scrape:
        t0 = time.perf_counter()
        try:
            stats = self._ask((node.id, "stats"), "GET /v1/stats", client.stats)
        except AuthError as exc:  # it answered: up, but its figures are not ours to read
            self.metrics.errors.labels("agent").inc()
            seconds = time.perf_counter() - t0
            return Scrape(node, False, seconds, error=str(exc), auth_refused=True)
        except AgentStarting as exc:  # it answered: up, its tiers opening, nothing to read yet
            self.metrics.errors.labels("agent").inc()
            seconds = time.perf_counter() - t0
            return Scrape(node, False, seconds, error=str(exc), starting=True)
        except AgentError as exc:
            self.metrics.errors.labels("agent").inc()
            return Scrape(node, False, time.perf_counter() - t0, error=str(exc))
        seconds = time.perf_counter() - t0
        self.metrics.scrape_seconds.labels("agent").observe(seconds)
        # checked here, once: rows, counters and reports see only figures that can be true
        checked, rejected = checked_stats(stats)
        out = Scrape(node, True, seconds, stats=checked, rejected=rejected)
        epoch = checked.get("started_s")
        if epoch is not None and self._epoch_checked.get(node.id) != epoch:
            out.epoch_checked = True
            out.started_after_s = self._uptime(node, client, epoch)
        try:
            gpus = self._ask((node.id, "gpus"), "GET /v1/gpus", client.gpus)
            out.gpus, rejected_gpus = checked_gpus(gpus)
            rejected.fields.update(rejected_gpus.fields)
        except RequestError as exc:
            if exc.code != 404:  # an agent older than /v1/gpus: no power readings
                out.warnings.append(f"gpus: {exc}")
        except AgentError as exc:
            self.metrics.errors.labels("gpus").inc()
            out.warnings.append(f"gpus: {exc}")
        if node.engine_url:
            out.engine, problem = self._scrape_engine(node)
            if problem:
                out.warnings.append(problem)
            if out.engine is not None:
                out.engine = checked_engine(out.engine, rejected)
        return out

    def _uptime(self, node: NodeInfo, client: AgentClient, epoch: float) -> float | None:
        """How long the agent that started at ``epoch`` has run, where it started after this
        collector did; else None (it started before, or it cannot be told). Durations only:
        the agent's uptime by its own clock (``/v1/health``) against this collector's by its
        own, so no skew between the hosts' clocks enters; its start time by that answer
        (its clock minus its uptime) must be ``epoch`` (its clock too), else it restarted
        between the two requests and its uptime is another epoch's."""
        asked_s = time.monotonic() - self._started_mono
        try:
            health = self._ask((node.id, "health"), "GET /v1/health", client.health)
        except AgentError:
            return None  # its first values set the baseline, as ever
        uptime, now = health.get("uptime_seconds"), health.get("time_s")
        if not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            for v in (uptime, now)
        ):
            return None
        assert isinstance(uptime, int | float) and isinstance(now, int | float)
        if abs(now - uptime - epoch) > EPOCH_MATCH_S or not 0 <= uptime < asked_s:
            return None
        return float(uptime)

    def _scrape_engine(self, node: NodeInfo) -> tuple[EngineReading | None, str | None]:
        assert node.engine_url
        t0 = time.perf_counter()
        url = node.engine_url
        try:
            resp = self._deadlines.call(
                (node.id, "engine"), "the engine's metrics", self._engine_get(url)
            )
            resp.raise_for_status()
            reading = parse_engine_metrics(resp.text)
        except UnknownEngine:
            self.metrics.errors.labels("engine").inc()
            return None, (
                f"no vLLM, SGLang, TensorRT-LLM, LMCache or KVBM metrics at {node.engine_url}: "
                "skipped"
            )
        except (httpx.HTTPError, ValueError, NotAnswering) as exc:
            self.metrics.errors.labels("engine").inc()
            return None, f"engine at {node.engine_url}: {exc}"
        self.metrics.scrape_seconds.labels("engine").observe(time.perf_counter() - t0)
        return reading, None

    def _engine_get(self, url: str) -> Callable[[], httpx.Response]:
        return lambda: self._http.get(url)

    def _scrape_router(self, router: str) -> RouterScrape:
        t0 = time.perf_counter()
        client = self._router_clients.get(router)
        if client is None:
            url = self._routers[router]
            client = self._router_clients[router] = RouterClient(
                url,
                token=self.config.router_token,
                timeout_s=self.config.request_timeout_s,
                # a request given up at its deadline is cut, as an agent's is
                transport=CappedTransport(AbandonableTransport(verify=url.startswith("https://"))),
            )
        try:
            # its start time first: a restart between the two calls then shows as counters
            # going down, never as a lost interval
            info = self._deadlines.call((router, "info"), "GET /v1/info", client.info)
            stats = self._deadlines.call((router, "stats"), "GET /v1/stats", client.stats)
            reading = parse_router_stats(stats, info)
        except (RouterClientError, RouterAnswerError, NotAnswering) as exc:
            self.metrics.errors.labels("router").inc()
            # the client's messages carry the URL as given: say it redacted
            text = str(exc).replace(self._routers[router].rstrip("/"), router)
            return RouterScrape(router, time.perf_counter() - t0, error=text)
        seconds = time.perf_counter() - t0
        self.metrics.scrape_seconds.labels("router").observe(seconds)
        return RouterScrape(router, seconds, reading=reading)

    def _submit_routers(self) -> tuple[dict[str, Future[RouterScrape]], list[RouterScrape]]:
        futures: dict[str, Future[RouterScrape]] = {}
        skipped: list[RouterScrape] = []
        for router in self._routers:
            hanging = self._router_in_flight.get(router)
            if hanging is not None and not hanging.done():
                skipped.append(RouterScrape(router, 0.0, error="previous scrape still running"))
                continue
            futures[router] = self._router_in_flight[router] = self._pool.submit(
                self._scrape_router, router
            )
        return futures, skipped

    def _router_results(
        self, futures: dict[str, Future[RouterScrape]], deadline_s: float
    ) -> list[RouterScrape]:
        out = []
        for router, fut in futures.items():
            if fut.done():
                out.append(fut.result())
                del self._router_in_flight[router]
            else:
                self.metrics.errors.labels("router").inc()
                out.append(RouterScrape(router, deadline_s, error=f"no answer in {deadline_s}s"))
        return out

    def collect_once(self) -> CycleReport:
        """Scrape every node once and write the samples; never raises for a node's failure."""
        t0 = time.perf_counter()
        ts_ms = int(self._clock() * 1000)
        report = CycleReport(ts_ms)
        nodes = self._inventory(report)
        clients = self._node_clients(nodes)
        try:
            with self._stuck() as watch:
                self._load_tracker()
        except SQLAlchemyError as exc:
            # increases are counted from the counters' last saved state: nothing is lost by
            # waiting for it, where guessing it would count a restart's counters twice
            self._db_failed(
                report,
                "database unavailable: cannot read the counters' last state, cycle skipped",
                exc,
                watch,
            )
            report.seconds = time.perf_counter() - t0
            return report
        deadline_s = self._deadline_s
        futures: dict[int, Future[Scrape]] = {}
        scrapes: list[Scrape] = []
        router_futures, router_scrapes = self._submit_routers()
        for node in nodes:
            hanging = self._in_flight.get(node.id)
            if hanging is not None and not hanging.done():
                scrapes.append(Scrape(node, False, 0.0, error="previous scrape still running"))
                continue
            if hanging is not None and not hanging.cancelled() and hanging.exception() is None:
                self._note_lane(node.id, hanging.result())  # a late scrape: how it ended
            lane = self._failing_pool if node.id in self._failing else self._pool
            futures[node.id] = self._in_flight[node.id] = lane.submit(
                self._scrape, node, clients[node.id]
            )
        pending: list[Future[Any]] = [*futures.values(), *router_futures.values()]
        wait(pending, timeout=deadline_s)
        router_scrapes += self._router_results(router_futures, deadline_s)
        by_id = {n.id: n for n in nodes}
        for node_id, fut in futures.items():
            if fut.done():
                scrapes.append(self._note_lane(node_id, fut.result()))
                del self._in_flight[node_id]
            else:
                self.metrics.errors.labels("agent").inc()
                scrapes.append(
                    Scrape(by_id[node_id], False, deadline_s, error=f"no answer in {deadline_s}s")
                )
        ttft_before = dict(self._ttft_prev)
        self._note_restarts(scrapes)

        def build(into: CycleReport) -> dict[str, list[dict[str, Any]]]:
            rows = self._rows(scrapes, ts_ms, into)
            self._router_rows(router_scrapes, ts_ms, into, rows)
            return rows

        def rebuild() -> dict[str, list[dict[str, Any]]]:
            # the same scrapes counted again from the tracker as rebased; the report already
            # says what they were, so a scratch one takes it again
            self._ttft_prev = dict(ttft_before)
            return build(CycleReport(ts_ms))

        self._write(build(report), report, rebuild=rebuild)
        # after the write: a cycle not written says why first (the loop's line shows the first
        # warning), then what was rejected
        for s in scrapes:
            if s.up and s.stats is not None:
                rejected = Rejections({**s.rejected.fields, **s.counted.fields})
                self._rejected(report, s.node.name, "agent", rejected)
        report.seconds = time.perf_counter() - t0
        self.metrics.cycle_seconds.observe(report.seconds)
        self.metrics.nodes.labels("up").set(len(report.up))
        self.metrics.nodes.labels("down").set(len(report.down))
        self.metrics.nodes.labels("token_refused").set(len(report.token_refused))
        self.metrics.nodes.labels("starting").set(len(report.starting))
        return report

    def _rows(
        self, scrapes: list[Scrape], ts_ms: int, report: CycleReport
    ) -> dict[str, list[dict[str, Any]]]:
        self._load_tracker()
        rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for s in scrapes:
            node = s.node
            read = s.up and s.stats is not None
            error = None if s.error is None else brief(s.error)
            self._last_scrape[node.id] = "up" if read else "unread" if s.answered else "down"
            nvml = None if s.gpus is None else bool(s.gpus.get("nvml", {}).get("available"))
            rows["node_sample"].append(
                {
                    "node_id": node.id,
                    "ts_ms": ts_ms,
                    # a node refusing the token or starting answered: up, as `kvctl status`
                    # shows it (its error says which: kvctl.agent_starting.says_starting)
                    "up": s.answered,
                    "scrape_seconds": s.seconds if s.answered else None,
                    "agent_started_s": None if s.stats is None else s.stats.get("started_s"),
                    "nvml_available": nvml,
                    "error": error,
                }
            )
            if s.auth_refused:  # no figures to record: none are made up
                report.token_refused[node.name] = error or "token refused"
                continue
            if s.starting:  # nor while its tiers open: none until it serves its API
                report.starting[node.name] = error or "starting"
                continue
            if not s.up or s.stats is None:
                report.down[node.name] = error or "down"
                continue
            report.up.append(node.name)
            self._watch_epoch(s, ts_ms)
            s.counted = Rejections()
            rows["cache_sample"] += cache_rows(self._tracker, node.id, ts_ms, s.stats, s.counted)
            rows["plan_sample"] += plan_rows(self._tracker, node.id, ts_ms, s.stats)
            if s.gpus is not None:
                rows["power_sample"] += power_rows(self._tracker, node.id, ts_ms, s.gpus)
            if nvml is False and self.config.emulate_power is not None:
                # the node's own inventory GPU where it names a profile; the option's else
                inputs = emulation_for(self.config.emulate_power, node.gpu_model)
                rows["emulated_power_sample"] += emulated_power_rows(
                    self._tracker, node.id, ts_ms, s.stats, inputs
                )
            if s.engine is not None:
                prev = self._ttft_prev.get(node.id)
                rejected = engine_rejected(s.rejected)
                rows["engine_sample"].append(
                    engine_row(
                        self._tracker,
                        node.id,
                        ts_ms,
                        s.engine,
                        prev,
                        epoch=s.engine.process_start_s,
                        rejected=rejected,
                    )
                )
                # a waiting row leaves the histogram's baseline too: the quantiles of the row
                # that catches up cover its counts' span
                if s.engine.ttft is not None and not engine_waits(rejected):
                    self._ttft_prev[node.id] = s.engine.ttft
            for warning in map(brief, s.warnings):
                report.warnings.append(f"{node.name}: {warning}")
                if node.id not in self._warned_nodes:
                    self._warned_nodes.add(node.id)
                    log.warning("%s: %s", node.name, warning)
        return rows

    def _note_restarts(self, scrapes: list[Scrape]) -> None:
        """Once a cycle, before its rows are built: a node whose agent says it started anew
        at this scrape and had at its previous one too is restarting at every scrape. Its
        restart is not counted (``CounterTracker.restart_not_counted``: its counters' values
        are the new baseline) and ``started_s`` is named as rejected.

        Why: a restart's counters are counted from zero, whole, and the only bound on them
        was ``MAX_INCREASE_PER_S`` over the interval (2**40 a second, far beyond any node, so
        that no real burst is dropped): an agent saying a new ``started_s`` at every scrape had
        its whole counters (1e12 tokens) counted again each time. A bound on a restart's
        counts by the agent's uptime would take the agent's word for its uptime too. One
        restart is counted as ever (the first of a loop as well: it is told from a real one by
        the next); a second at the very next scrape is counted only from the scrape after,
        so a real agent restarted twice within one interval loses that interval's counts
        (seconds of work), and says why."""
        for s in scrapes:
            if not s.up or s.stats is None:
                continue
            epoch = s.stats.get("started_s")
            if epoch is None:  # unread this once: not a new start
                continue
            last = self._last_epoch.get(s.node.id)
            new = last is not None and last[0] != epoch
            if new and last is not None and last[1]:
                s.rejected.add(
                    "started_s",
                    "a new start time again, as at the previous scrape: its restart not counted",
                )
                self._tracker.restart_not_counted(float(epoch))
            self._last_epoch[s.node.id] = (epoch, new)

    def _watch_epoch(self, s: Scrape, ts_ms: int) -> None:
        """Note a node's agent start time checked at this scrape: one started after this
        collector counted everything while it was watched, in no earlier sample, so its series'
        first samples count from zero (``CounterTracker.started_while_watched``); one started
        before keeps the baseline rule (its earlier counts are no interval's)."""
        epoch = None if s.stats is None else s.stats.get("started_s")
        if not s.epoch_checked or epoch is None:
            return
        self._epoch_checked[s.node.id] = epoch
        if s.started_after_s is not None:
            start_ms = ts_ms - round(s.started_after_s * 1000)
            self._tracker.started_while_watched(epoch, start_ms)

    def _rejected(self, report: CycleReport, name: str, kind: str, rejected: Rejections) -> None:
        """Rejected figures of one node's (or link's) answers: counted, in the report, and
        logged by field (never by value) when they are not those logged last time."""
        self.metrics.rejected.labels(kind).inc(len(rejected))
        report.reject(name, rejected)
        fields = frozenset(rejected.fields)
        if self._rejected_logged.get(name, frozenset()) == fields:
            return
        self._rejected_logged[name] = fields
        if fields:
            log.warning(
                "%s: %d value(s) rejected as impossible, stored as unknown: %s",
                name,
                len(rejected),
                rejected.summary(),
            )
        else:
            log.info("%s: no value rejected any more", name)

    def _router_rows(
        self,
        scrapes: list[RouterScrape],
        ts_ms: int,
        report: CycleReport,
        rows: dict[str, list[dict[str, Any]]],
    ) -> None:
        self._load_tracker()
        for s in scrapes:
            if s.reading is None:
                error = brief(s.error or "no answer")
                report.routers_down[s.router] = error
                if self._router_errors.get(s.router) != error:
                    log.warning("router %s: %s", s.router, error)
                self._router_errors[s.router] = error
                continue
            if self._router_errors.pop(s.router, None) is not None:
                log.info("router %s answers again", s.router)
            report.routers_up.append(s.router)
            routes, links = route_rows(self._tracker, s.router, ts_ms, s.reading)
            rows["route_sample"] += routes
            rows["route_link_sample"] += links

    def _load_tracker(self) -> None:
        if self._tracker_loaded:
            return
        with self.engine.connect() as conn:
            self._tracker.load(conn, ())
            self._tracker_file = connection_file(conn)
        self._tracker_loaded = True

    def _write(
        self,
        rows: dict[str, list[dict[str, Any]]],
        report: CycleReport,
        *,
        rebuild: Callable[[], dict[str, list[dict[str, Any]]]] | None = None,
    ) -> None:
        """Write this cycle's ``rows`` with any kept from cycles the database refused.
        ``rebuild`` counts the cycle's rows again from the tracker (after ``_rebase``, or
        ``_reread``); a batch without it (link samples) has no counters to count again."""
        batch = _shown(rows)
        # held: a Ctrl-C lands before the batch or once it is in and counted, never inside its
        # commit (where the batch is in or not, unsaid, and SQLite's write lock may stay held)
        with interrupts_held():
            for tries in range(MAX_REBASES + 1):
                try:
                    self._write_pending(report, batch, rebuild)
                    return
                except CountersMoved as exc:
                    if tries == MAX_REBASES or not self._rebase(exc, report):
                        self._counted_elsewhere(exc, report, batch)
                        return
                if rebuild is not None:
                    batch = _shown(rebuild())

    def _write_pending(
        self,
        report: CycleReport,
        batch: dict[str, list[dict[str, Any]]],
        rebuild: Callable[[], dict[str, list[dict[str, Any]]]] | None = None,
    ) -> None:
        """Write ``batch`` and the rows kept; a refusal keeps them all for the next cycle (but
        ``CountersMoved``, raised: the caller counts the batch again, or drops it). Into a
        SQLite file other than the one whose state the tracker holds, counted again from its
        own state first (``_reread``, then ``rebuild``)."""
        tables = self._with_kept(batch)
        watch = StuckWatch()
        try:
            with self._stuck() as watch, write_transaction(self.engine) as conn:
                if connection_file(conn) != self._tracker_file:
                    # read under the write lock: no other writer saves in between
                    self._reread(conn, report)
                    if rebuild is not None:
                        batch = _shown(rebuild())
                    tables = self._with_kept(batch)
                self._tracker.save(conn)  # first: it refuses a batch counted from stale state
                # rows past raw retention are pruned at the next upkeep: reopen no rollup
                keep_from_ms = report.ts_ms - self.config.retention.raw_ms
                for table, rows in tables.items():
                    insert_rows(conn, raw_table(table), rows)
                    # rows stamped below a rollup's watermark (kept through an outage, a
                    # clock stepped back) count in no window unless that rollup is redone
                    since_ms = min(
                        (r["ts_ms"] for r in rows if r["ts_ms"] >= keep_from_ms), default=None
                    )
                    if since_ms is not None:
                        reopen(conn, table, since_ms, report.ts_ms)
        except CountersMoved:
            raise
        except SQLAlchemyError as exc:
            if not self.config.keep_refused:
                # the counters' state was not saved either: the next run counts these
                # increases from the state saved last, so only this scrape's readings go
                what = (
                    f"database refused the batch: its {sum(len(b) for b in tables.values())} "
                    "rows are not recorded (no counted increase is lost: the next run counts "
                    "it from the state saved last)"
                )
                self._db_failed(report, what, exc, watch)
                return
            for table, rows in batch.items():
                self._pending[table] += rows
            dropped = self._trim_pending()
            what = f"database refused the batch, keeping {self._count()} rows for retry"
            if isinstance(getattr(exc, "orig", None), NoDatabaseFile):
                what = (
                    f"keeping {self._count()} rows for retry until a database is there again "
                    "(none is created)"
                )
            self._db_failed(report, what, exc, watch)
            if dropped:
                self._said_dropped(report, dropped)
            return
        for table, rows in tables.items():
            report.rows[table] = len(rows)
            self.metrics.rows.labels(table).inc(len(rows))
            self.rows_written += len(rows)
        self._pending.clear()
        self._db_back(report, sum(report.rows.values()))

    def _with_kept(self, batch: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
        """``batch`` with the rows kept from refused cycles, theirs first."""
        names = dict.fromkeys([*self._pending, *batch])
        return {t: [*self._pending.get(t, ()), *batch.get(t, ())] for t in names}

    def _rebase(self, exc: CountersMoved, report: CycleReport) -> bool:
        """Another collector saved counters this one was about to (a `collect --once` beside
        the loop, or two loops on the same nodes): read the saved state again, so the cycle's
        increases are counted from it and written, each once. Rows kept from cycles the
        database refused that hold counters go (their increases are counted again, from the
        saved state, in this cycle's rows); their node and link samples are kept. False where
        the state cannot be read (the caller then drops the batch)."""
        watch = StuckWatch()
        try:
            with self._stuck() as watch, self.engine.connect() as conn:
                self._tracker.rebase(conn, exc.series)
                self._tracker_file = connection_file(conn)
        except SQLAlchemyError as exc_db:
            # the driver's words on one line, as the loop's other database failures: its
            # SQLAlchemy text ran over several lines (a link, the statement where one ran)
            log.error(
                "cannot read the counters' saved state again: %s",
                self._cause(exc_db, watch, self.config.db_timeout_s),
            )
            return False
        self._tracker_loaded = True
        kept = self._drop_kept_counts()
        if exc.all_gone:  # no other collector: the database lost the state this one saved
            report.warnings.append(
                f"the counters' saved state is gone from the database ({len(exc.series)} "
                f"series, e.g. {exc.series[0]}; was it emptied or made anew?): this cycle "
                f"counts from what is there now{kept}"
            )
            log.warning(
                "the counters' saved state of %d series is gone from the database (e.g. %s; "
                "was it emptied or made anew under this collector?): this cycle counts from "
                "what is there now%s",
                len(exc.series),
                exc.series[0],
                kept,
            )
            return True
        report.warnings.append(
            f"another collector saved {len(exc.series)} counter series this one counts (e.g. "
            f"{exc.series[0]}): this cycle's increases are counted from its state{kept}"
        )
        log.warning(
            "another collector saved %d counter series this one counts (e.g. %s): this "
            "cycle's increases are counted from its state%s; a `collect --once` beside the "
            "loop does this, two loops on the same nodes do it every cycle (one per DC: --dc)",
            len(exc.series),
            exc.series[0],
            kept,
        )
        return True

    def _drop_kept_counts(self) -> str:
        """The rows kept from refused cycles that hold counters dropped, the tracker's state
        having been read anew: their increases are counted again from it in the next rows.
        Their node and link samples are kept. What to add to the warning that says so."""
        dropped = 0
        for table in list(self._pending):
            if table not in COUNTERLESS_TABLES:
                dropped += len(self._pending.pop(table))
        return (
            f"; {dropped} rows kept from refused cycles dropped, counted again" if dropped else ""
        )

    def _reread(self, conn: Connection, report: CycleReport) -> None:
        """The SQLite file at the path is not the one whose counters' state the tracker holds
        (a backup restored over it, a file made anew): its saved state is read on ``conn``, in
        the write's transaction, for the batch to be counted again from it. The rows kept from
        refused cycles that hold counters go (``_drop_kept_counts``): their increases are
        counted again from that state. Written from its own state the file holds each
        increase once, whatever another file at the path held; the compare-and-set alone
        would not tell: a backup taken just before the tracker's last save holds the stamp
        it takes for that save rolled back, and the interval between went into no row."""
        known = self._tracker_file is not None  # else first read (a link round before a scrape)
        self._tracker_loaded = False  # read again next cycle if this fails midway
        self._tracker.rebase(conn, ())
        self._tracker_file = connection_file(conn)
        self._tracker_loaded = True
        if not known:
            return
        kept = self._drop_kept_counts()
        said = (
            f"the database file at {sqlite_file_path(self.engine)} was replaced (a backup "
            f"restored, a file made anew?): counting from the counters' state saved in it{kept}"
        )
        report.warnings.append(said)
        log.warning("%s", said)

    def _counted_elsewhere(
        self, exc: CountersMoved, report: CycleReport, batch: dict[str, list[dict[str, Any]]]
    ) -> None:
        """The batch could not be counted again from the other collector's state (it kept
        saving, or the state could not be read): it goes, and the state is read again at the
        next cycle, so each increase is counted once, from whichever saved last."""
        self.metrics.db_errors.inc()
        report.written = False
        report.warnings.append(
            f"another collector scrapes these nodes ({exc}): this batch is dropped and its "
            "increases are counted from the newer state; run one collector per DC (--dc)"
        )
        log.warning(
            "another collector saved %d counter series this one also counts (e.g. %s): "
            "batch of %d rows dropped; run one collector per DC (--dc)",
            len(exc.series),
            exc.series[0],
            self._count() + sum(len(b) for b in batch.values()),
        )
        self._pending.clear()
        self._tracker.forget()
        self._tracker_loaded = False

    def _count(self) -> int:
        return sum(len(b) for b in self._pending.values())

    @property
    def pending_rows(self) -> int:
        """Rows kept from cycles the database refused, not written yet."""
        return self._count()

    def _trim_pending(self) -> int:
        """The rows kept past ``max_pending_rows`` dropped, the oldest cycles' first and each
        cycle's whole (all its tables' rows together: before, the first table's went first,
        every node sample of the outage before any cache row), and how many."""
        over = self._count() - self.config.max_pending_rows
        if over <= 0:
            return 0
        stamps = (r["ts_ms"] for rows in self._pending.values() for r in rows)
        cut_ms = heapq.nsmallest(over, stamps)[-1]  # rows stamped at or before it go
        dropped = 0
        for table, rows in self._pending.items():
            kept = [r for r in rows if r["ts_ms"] > cut_ms]
            dropped += len(rows) - len(kept)
            self._pending[table] = kept
        return dropped

    def _said_dropped(self, report: CycleReport, dropped: int) -> None:
        """Rows kept through an outage dropped past the cap: said in the cycle's warnings,
        logged once an outage (the rows went silently), and again when the database is back."""
        self._dropped_rows += dropped
        said = (
            f"{dropped} rows of the oldest cycles kept for retry dropped: more than "
            f"{self.config.max_pending_rows:,} kept while the database refuses them; their "
            "samples and increases are lost"
        )
        report.warnings.append(said)
        if self._dropped_rows == dropped:
            log.error("%s (said once; the next cycles drop their oldest too)", said)

    # --- links -------------------------------------------------------------------------------
    def probe_links_once(self) -> CycleReport:
        """Probe one node pair per ordered pair of DCs, each DC's node rotating each round
        among those whose last scrape was read (``_link_endpoint``): a dead or unreadable node
        next to a live one is no link failure. A DC none of whose nodes answered is probed
        through one of them, recorded failed (the link cannot carry anything to it); a DC whose
        nodes answered but none can be read (refusing the token, starting) is not probed and
        no sample is recorded (``CycleReport.skipped`` says why)."""
        t0 = time.perf_counter()
        report = CycleReport(int(self._clock() * 1000))
        by_dc: dict[str, list[NodeInfo]] = defaultdict(list)
        nodes = self._inventory(report)
        clients = self._node_clients(nodes)
        for node in nodes:
            by_dc[node.dc].append(node)
        ends = {dc: self._link_endpoint(dc, nodes) for dc, nodes in by_dc.items()}
        pairs: list[tuple[NodeInfo, NodeInfo]] = []
        for a, src in ends.items():
            for b, dst in ends.items():
                if a == b:
                    continue
                if isinstance(src, NodeInfo) and isinstance(dst, NodeInfo):
                    pairs.append((src, dst))
                else:
                    report.skipped[f"{a}->{b}"] = src if isinstance(src, str) else str(dst)
        self._link_round += 1
        # each target's data-plane address, asked once per round however many DCs probe it
        dsts = {dst.id: dst for _src, dst in pairs}
        lookups = {i: self._pool.submit(self._data_address, n, clients[i]) for i, n in dsts.items()}
        wait(lookups.values())
        targets = {i: f.result() for i, f in lookups.items()}
        futures = [
            self._pool.submit(self._probe, src, clients[src.id], dst, targets[dst.id], report.ts_ms)
            for src, dst in pairs
        ]
        wait(futures)
        probed = [f.result() for f in futures]
        rows = [row for row, _rejected in probed]
        for (row, _rejected), (src, dst) in zip(probed, pairs, strict=True):
            name = f"{src.name}->{dst.name}"
            if row["ok"]:
                report.up.append(name)
            else:
                report.down[name] = row["error"] or "failed"
        self._write({"link_sample": rows}, report)
        for (_row, rejected), (src, dst) in zip(probed, pairs, strict=True):
            self._rejected(report, f"{src.name}->{dst.name}", "link", rejected)
        report.seconds = time.perf_counter() - t0
        return report

    def _link_endpoint(self, dc: str, nodes: list[NodeInfo]) -> NodeInfo | str:
        """The node that probes (and is probed) for ``dc`` this round, or why there is none.
        Rotating among the nodes whose last scrape was read (or that were not scraped yet);
        where none was, among the nodes that did not answer, if none answered (the DC cannot be
        reached: the probe is recorded failed); else none (its nodes answered, refusing the
        token or starting: the link itself is not known to fail, so nothing is recorded)."""
        last = self._last_scrape
        ready = [n for n in nodes if last.get(n.id, "up") == "up"]
        if not ready and all(last.get(n.id) == "down" for n in nodes):
            ready = nodes
        if ready:
            return ready[self._link_round % len(ready)]
        return f"no node of DC {dc} can be read (refusing the token or starting): not probed"

    def _data_address(self, node: NodeInfo, client: AgentClient) -> str | AgentError:
        """The node's data-plane TCP address, or why it cannot be probed."""
        try:
            info = self._ask((node.id, "info"), "GET /v1/info", client.info)
            dataplane = info.get("dataplane")
        except AgentError as exc:
            return exc
        # an answer of another shape is no address (it raised in the probe round, ending it)
        address = dataplane.get("tcp") if isinstance(dataplane, Mapping) else None
        if not isinstance(address, str) or not address:
            return AgentError(f"{node.name} has no TCP data plane to probe")
        return address

    def _probe(
        self,
        src: NodeInfo,
        client: AgentClient,
        dst: NodeInfo,
        target: str | AgentError,
        ts_ms: int,
    ) -> tuple[dict[str, Any], Rejections]:
        """The link_sample row of one probe, and the figures of its answer rejected."""
        rejected = Rejections()
        row: dict[str, Any] = {
            "src_node_id": src.id,
            "dst_node_id": dst.id,
            "ts_ms": ts_ms,
            "rtt_s": None,
            "bandwidth_bytes_per_s": None,
            "loss_ratio": None,
            "probe_bytes": self.config.probe_bytes,
            "ok": False,
            "error": None,
            "rtt_basis": None,
            "emulated_delay_s": None,
        }
        t0 = time.perf_counter()
        try:
            if isinstance(target, AgentError):
                raise target
            # naming the target lets the agent report the delay it emulates on that link
            named: dict[str, Any] = {"name": dst.name} if _PROBE_TAKES_NAME else {}
            config = self.config
            # a total deadline: httpx's timeout is per read, and an agent trickling its answer
            # held the link round (and the loop, or collect --once) for as long as it trickled
            result: Mapping[str, Any] = self._ask(
                (src.id, dst.id, "probe"),
                "POST /v1/probe",
                lambda: client.probe(
                    target,
                    token=config.token,
                    pings=config.pings,
                    size_bytes=config.probe_bytes,
                    timeout_s=config.probe_timeout_s,
                    **named,
                ),
                timeout_s=probe_deadline_s(
                    config.pings, config.probe_bytes, config.probe_timeout_s
                ),
            )
        except AgentError as exc:
            self.metrics.errors.labels("link").inc()
            row["error"] = brief(str(exc))
            return row, rejected
        self.metrics.scrape_seconds.labels("link").observe(time.perf_counter() - t0)
        row.update(
            **checked_probe(result, rejected),
            ok=bool(result.get("ok")),
            **rtt_basis_of(result),
        )
        if not row["ok"]:
            self.metrics.errors.labels("link").inc()
        return row, rejected

    # --- maintenance -------------------------------------------------------------------------
    def maintain(self) -> dict[str, Any]:
        """Roll up what is final and prune what is past retention."""
        with self._stuck(self.config.maintenance_timeout_s):
            return maintain(self.engine, int(self._clock() * 1000), self.config.retention)

    def _upkeep(self) -> dict[str, Any]:
        """``maintain``'s report for the loop; a failure's as ``{"error": ...}``, logged unless
        the outage is said already. One given up on is said so: the driver's text of its cut
        connection ('server closed the connection unexpectedly', or 'connection timeout
        expired' once the pool reconnects) sent operators to a server that never went away."""
        watch = StuckWatch()
        try:
            with self._stuck(self.config.maintenance_timeout_s) as watch:
                return maintain(self.engine, int(self._clock() * 1000), self.config.retention)
        except SQLAlchemyError as exc:
            error = self._cause(exc, watch, self.config.maintenance_timeout_s)
            if self._db_down_since_ms is None:  # else the outage is said already
                log.error("rollup/retention failed, will retry: %s", error)
            return {"error": error}

    # --- loop --------------------------------------------------------------------------------
    def run(
        self,
        stop: threading.Event,
        *,
        on_cycle: Callable[[str, CycleReport | dict[str, Any]], None] | None = None,
    ) -> None:
        """Collect every interval until ``stop`` is set; links and maintenance on their own
        schedules. Database and node failures are reported, never end the loop."""
        next_links = next_maint = time.monotonic()
        if not math.isfinite(self.config.link_interval_s):
            next_links = math.inf  # links off (`collect --no-links`): not even a first probe
        while not stop.is_set():
            started = time.monotonic()
            report = self.collect_once()
            if on_cycle:
                on_cycle("scrape", report)
            if started >= next_links:
                next_links = started + self.config.link_interval_s
                links = self.probe_links_once()
                if on_cycle:
                    on_cycle("links", links)
            if started >= next_maint:
                next_maint = started + self.config.maintenance_interval_s
                maint = self._upkeep()
                if on_cycle:
                    on_cycle("maintenance", maint)
            stop.wait(max(0.0, started + self.config.interval_s - time.monotonic()))

    def close(self) -> None:
        self._pool.shutdown()
        self._failing_pool.shutdown()
        for c in [*self._clients.values(), *(c for c, _scrape in self._retired)]:
            c.close()
        for r in self._router_clients.values():
            r.close()
        self._http.close()


def _cause(exc: SQLAlchemyError, watch: StuckWatch | None, timeout_s: float) -> str:
    """Why a database call failed, on one line: where ``cut_when_stuck`` cut its connections,
    that (the driver would say the server hung up, or a reconnect timed out: it did not)."""
    if watch is not None and watch.fired:
        return f"no answer within {timeout_s:g} s, its connections cut"
    return driver_message(exc)


def _closed_when_done(client: AgentClient, scrape: Future[Scrape] | None) -> bool:
    """``client`` closed if no scrape of it runs (True), else left for a later look."""
    if scrape is not None and not scrape.done():
        return False
    client.close()
    return True


def _shown(rows: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """``rows`` with their text as the database can keep it: text answered by agents and
    routers (errors, names) with a NUL made PostgreSQL refuse the whole batch, at every retry."""
    for batch in rows.values():
        for row in batch:
            for column, value in row.items():
                if isinstance(value, str):
                    row[column] = shown(value)
    return rows


def rtt_basis_of(probe: Mapping[str, Any]) -> dict[str, Any]:
    """A probe answer's ``rtt_basis`` and ``emulated_delay_s`` columns. An agent older than
    those fields measured its RTT and emulated nothing; a basis this collector does not know is
    recorded "unknown", never passed off as measured."""
    basis = probe.get("rtt_basis", "measured")
    delay = probe.get("emulated_delay_s")
    delay_s: float | None = None
    # compared before converting: an int past float's range raised OverflowError in isfinite
    if (
        isinstance(delay, int | float)
        and not isinstance(delay, bool)
        and 0 <= delay <= MAX_MAGNITUDE
    ):
        delay_s = float(delay)
    return {"rtt_basis": basis if basis in RTT_BASES else "unknown", "emulated_delay_s": delay_s}


#: an engine reading's counters and byte gauges: every figure but its ratio and its TTFT
#: histogram (checked on their own), so a counter added to EngineReading is checked too
_ENGINE_COUNTS = tuple(
    f.name
    for f in fields(EngineReading)
    if f.name not in ("engine", "kv_usage_ratio", "ttft", "missing_means_unread", "ttft_not_finite")
)


def checked_engine(reading: EngineReading, rejected: Rejections) -> EngineReading:
    """``reading`` with figures that cannot be true (a counter that is not finite or is
    negative, a usage ratio outside [0, 1], a TTFT histogram not finite or counting below zero)
    unknown, noted in ``rejected``: a counter or the histogram rejected makes the engine row's
    counters wait (``collectors.rows.engine_waits``)."""
    fixed: dict[str, Any] = {
        c: count(getattr(reading, c), f"engine.{c}", rejected) for c in _ENGINE_COUNTS
    }
    fixed["kv_usage_ratio"] = ratio(reading.kv_usage_ratio, "engine.kv_usage_ratio", rejected)
    if reading.ttft_not_finite:  # no Histogram holds it: the parser says only that it was
        rejected.add("engine.ttft", "not finite")
    ttft = reading.ttft
    if ttft is not None and (
        count(ttft.count, "engine.ttft.count", rejected) is None
        or count(ttft.sum, "engine.ttft.sum", rejected) is None
    ):
        fixed["ttft"] = None
    return replace(reading, **fixed)
