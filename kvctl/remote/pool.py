"""The interface every shared pool implements: Redis/Valkey (``redis_pool``) or a pool agent
(``agent_pool``).

A pool is shared by many agents, so it keeps each chunk's metadata (tenant, isolation, parent,
tokens) beside its bytes, and it answers per tenant: a chunk stored by an isolated tenant is never
returned to, nor reported to, another tenant. It enforces its own capacity (and per-tenant
quotas where the backend supports them), because no single agent's index knows what it holds.

Every failure of the backend (server down, timeout, a reply cut short) raises
``TierUnavailable``; a record that fails its checks is a miss (counted in ``corrupt``), never
bytes handed to a caller. Callers degrade both to a miss. Reads (get, probe, usage, ping) are on
a request's path and give up after a short silence (``read_timeout_s``, 0.5 s by default);
writes are behind it and keep a longer deadline (``timeout_s``).

A large read is split into contiguous groups of its keys read in parallel over several
connections (``stream_groups``, run by ``SplitReads``): one connection driven from Python moves
well below what the link and the server can.
"""

from __future__ import annotations

import math
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TypeVar

from kvctl.store.errors import InvalidArgument, TierUnavailable
from kvctl.store.tiers.base import Buffer, ChunkMeta
from kvctl.units import MAX_SIZE_BYTES

T = TypeVar("T")


def visible_to(meta: ChunkMeta, tenant: str, *, tenant_isolated: bool = False) -> bool:
    """An isolated tenant's chunk is seen by that tenant only; any other by everyone, except
    by an isolated tenant (``tenant_isolated``, known where the asking node's settings are),
    which sees only chunks it stored itself: another tenant may have stored under its key."""
    if meta.isolated or tenant_isolated:
        return meta.tenant == tenant
    return True


#: a read from a pool or a peer gives up when the other side sends nothing for this long (connect
#: included): well under a request's budget, far above a healthy answer. It bounds silence, not a
#: transfer: a read that keeps streaming is not cut.
DEFAULT_READ_TIMEOUT_S = 0.5


#: the slowest average rate a pull may move its chunks at: each pull (each stream of a split
#: one) is abandoned once it has taken longer than its read deadline (for the first answer) plus
#: its bytes at this rate (``pull_deadline_s``). Far below any path worth fetching over (one
#: under a few hundred MB/s loses to recomputing at every context length; see the README's
#: fetch or recompute), so it cuts only a source that trickles: every read within the read
#: deadline, which bounds silence and not a transfer, while the whole would hold the request
#: for as long as the source kept trickling.
PULL_FLOOR_BYTES_PER_S = 32 << 20

#: what each record (chunk) of a pull may take besides its bytes, added to its deadline
#: (``pull_deadline_s``). A shared pool is busy with other agents: Redis reads a long pipeline
#: and writes its replies a bounded piece per turn of its event loop, between other clients'
#: work, so each record of a healthy pull can come a few ms late; sized by bytes alone, a pull
#: of hundreds of small records from such a server was cut (measured through a proxy answering
#: each record 2 ms late: 400 records of 4 KiB cut at 0.55 s), and its breaker (one failure
#: opens it) cut the whole pool off. Modest: a 256-token chunk of an 8B model recomputes in
#: ~11 ms on an H100 (32k tokens in 1.4 s), so a source slower per record than this is hardly
#: worth waiting for, and one that sends each record far slower is still cut.
PULL_ALLOWANCE_PER_RECORD_S = 0.005
#: what the link monitor's bandwidth probes get besides a pull's deadline: a probe is off the
#: request path, and on a loaded host a healthy loopback link measured slower than the pull
#: floor (fresh-clone test runs: a link never costed, its probes all cut), so it was never
#: measured; a link that trickles (a 4 MiB probe at 400 KiB/s: 10 s) is still cut
PROBE_SLACK_S = 3.0


#: the rate a write to a pool agent (the write-behind, off the request path) is bounded at: the
#: agent's own floor for a frame (``kvctl.agent.dataplane.MIN_FRAME_BYTES_PER_SECOND``), below
#: which it cuts the sender anyway. At the pull floor a full batch (256 MiB) had 13 s: every
#: batch failed, and the source's breaker (which reads share) opened, on any path under ~160
#: Mbit/s to the pool, a working 100 Mbit/s link or a 1 GbE uplink six nodes write through
WRITE_FLOOR_BYTES_PER_S = 1 << 20


def write_deadline_s(nbytes: int, timeout_s: float, records: int = 0) -> float:
    """Seconds a write of ``records`` records of ``nbytes`` in all may take at most: its
    timeout plus its bytes at ``WRITE_FLOOR_BYTES_PER_S`` plus the records' allowance; one
    slower trickles (the agent would cut it too)."""
    return timeout_s + nbytes / WRITE_FLOOR_BYTES_PER_S + records * PULL_ALLOWANCE_PER_RECORD_S


def pull_deadline_s(nbytes: int, read_timeout_s: float, records: int = 0) -> float:
    """Seconds a pull of ``records`` records of ``nbytes`` in all may take at most (see
    ``PULL_FLOOR_BYTES_PER_S`` and ``PULL_ALLOWANCE_PER_RECORD_S``)."""
    return read_timeout_s + nbytes / PULL_FLOOR_BYTES_PER_S + records * PULL_ALLOWANCE_PER_RECORD_S


def probe_too_slow(source: str, what: str, took_s: float, deadline_s: float) -> TierUnavailable:
    """The error a bandwidth probe cut at its deadline raises (``pull_deadline_s`` of its
    bytes: a probe is a transfer like a pull, and a link that trickles would hold it, and
    whoever waits on it, for as long as it kept trickling). Not a pull: not counted in
    ``overdue``."""
    return TierUnavailable(
        f"{source}: bandwidth probe ({what}) abandoned after {took_s:.2f} s, past its "
        f"{deadline_s:.2f} s deadline (the read deadline plus its bytes at "
        f"{PULL_FLOOR_BYTES_PER_S >> 20} MiB/s): the link trickles; connection dropped"
    )


class PullTooSlow(TierUnavailable):
    """A pull abandoned at its deadline (``pull_deadline_s``): the source sent its bytes too
    slowly to be worth waiting for. A miss like any failure of the source, counted apart
    (``RemotePool.overdue``)."""


@dataclass(eq=False, slots=True)
class Pull:
    """One stream's deadline (monotonic seconds), how to cut it, and whether ``PullWatch``
    did."""

    cut_fn: Callable[[], None]
    started_s: float
    end_s: float
    cut: bool = False

    def too_slow(self, source: str, what: str, read_timeout_s: float) -> PullTooSlow:
        """The error a pull that was cut raises (every backend words it alike)."""
        took_s = time.monotonic() - self.started_s
        return PullTooSlow(
            f"{source}: pull of {what} abandoned after {took_s:.2f} s, past its deadline (the "
            f"{read_timeout_s:g} s read deadline plus its bytes at "
            f"{PULL_FLOOR_BYTES_PER_S >> 20} MiB/s and "
            f"{PULL_ALLOWANCE_PER_RECORD_S * 1000:g} ms a record); connection dropped"
        )


class PullWatch:
    """Cuts the connection of a pull that runs past its deadline: one thread per source,
    started on first need, asleep until the earliest deadline. Cutting (``cut_fn``: shutting
    the pull's socket down) wakes the pulling thread's blocked read at once: its call fails,
    and the connection is dropped as any broken one is. Used by every backend that pulls
    chunks (an agent's FETCH streams, a Redis pool's GET pipelines)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._pulls: set[Pull] = set()
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextmanager
    def watching(self, cut_fn: Callable[[], None], allowance_s: float) -> Iterator[Pull]:
        """The call inside the block is cut (``cut_fn()``, from the watch's thread)
        ``allowance_s`` from now (plus what ``extend`` adds); after the block, ``cut`` says
        whether it was."""
        now_s = time.monotonic()
        pull = Pull(cut_fn, now_s, now_s + allowance_s)
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="kvctl-pull-deadline", daemon=True
                )
                self._thread.start()
            self._pulls.add(pull)
            self._cond.notify()
        try:
            yield pull
        finally:
            with self._cond:
                self._pulls.discard(pull)

    def extend(self, pull: Pull, seconds: float) -> None:
        with self._cond:  # a later deadline: the watcher need not wake for it
            pull.end_s += seconds

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                now_s = time.monotonic()
                for pull in [p for p in self._pulls if p.end_s <= now_s]:
                    self._pulls.discard(pull)
                    pull.cut = True
                    pull.cut_fn()
                nearest_s = min((p.end_s for p in self._pulls), default=None)
                self._cond.wait(None if nearest_s is None else nearest_s - now_s)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


def check_deadlines(what: str, timeout_s: float, read_timeout_s: float | None) -> float:
    """A backend's request and read deadlines checked (each finite and positive); returns the
    read deadline, ``min(DEFAULT_READ_TIMEOUT_S, timeout_s)`` when none is given."""
    if not _finite_positive(timeout_s):
        raise InvalidArgument(f"{what} timeout_s must be positive, got {timeout_s!r}")
    if read_timeout_s is None:
        return min(DEFAULT_READ_TIMEOUT_S, timeout_s)
    if not _finite_positive(read_timeout_s):
        raise InvalidArgument(f"{what} read_timeout_s must be positive, got {read_timeout_s!r}")
    return read_timeout_s


def _finite_positive(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


#: connections one read is split over at most
DEFAULT_STREAMS = 4
#: bytes each extra stream should carry at least: below it a second connection and thread cost
#: more than they gain (at a few GB/s, 8 MiB is a few ms against ~0.1 ms of hand-off)
DEFAULT_MIN_STREAM_BYTES = 8 << 20
#: with no chunk size seen yet, a read is split only so far that each stream gets this many
MIN_STREAM_CHUNKS = 2


def stream_groups(
    n_keys: int, *, streams: int, chunk_bytes_seen: int, min_stream_bytes: int
) -> list[tuple[int, int]]:
    """Contiguous ``[lo, hi)`` groups of a read of ``n_keys`` keys, one per stream, their sizes
    within one of each other: up to ``streams`` of them, one per ``min_stream_bytes`` of the
    read as sized by ``chunk_bytes_seen`` (the mean chunk size seen last; 0 when none was, then
    one per ``MIN_STREAM_CHUNKS`` keys). Small reads stay one group."""
    if n_keys <= 0:
        return []
    k = min(streams, n_keys)
    if k > 1:
        worth = (
            n_keys * chunk_bytes_seen // min_stream_bytes
            if chunk_bytes_seen > 0
            else n_keys // MIN_STREAM_CHUNKS
        )
        k = max(1, min(k, worth))
    return [(n_keys * g // k, n_keys * (g + 1) // k) for g in range(k)]


class SplitStreams:
    """What a backend that splits its reads (``self._split``) tells about it: how many streams
    at most, and the bytes each extra stream should carry."""

    _split: SplitReads

    @property
    def streams(self) -> int:
        return self._split.streams

    @property
    def min_stream_bytes(self) -> int:
        return self._split.min_stream_bytes

    @property
    def chunk_bytes_seen(self) -> int:
        """The mean size of the chunks the backend served or described last (0: none yet)."""
        return self._split.chunk_bytes_seen


class SplitReads:
    """A backend's split reads: the groups of each read (``stream_groups``, sized by the chunks
    the backend saw last: ``saw``), and where they run (``run``): the first on the caller's
    thread, the others on worker threads made on first need, until ``close``."""

    def __init__(
        self, name: str, *, streams: int, min_stream_bytes: int, workers: int, thread_name: str
    ) -> None:
        self.name = name
        self.streams = streams
        self.min_stream_bytes = min_stream_bytes
        #: mean size of the chunks seen last (0: none yet)
        self.chunk_bytes_seen = 0
        self._max_workers = workers
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._workers: ThreadPoolExecutor | None = None
        self._closed = False

    def groups(self, n_keys: int, *, streams: int | None = None) -> list[tuple[int, int]]:
        """``streams``: at most this many (None: the backend's ``streams``)."""
        return stream_groups(
            n_keys,
            streams=self.streams if streams is None else min(streams, self.streams),
            chunk_bytes_seen=self.chunk_bytes_seen,
            min_stream_bytes=self.min_stream_bytes,
        )

    def saw(self, sizes: Sequence[int]) -> None:
        """The sizes of the chunks a read brought or a probe described (none: nothing learnt)."""
        if sizes:
            self.chunk_bytes_seen = sum(sizes) // len(sizes)

    def run(self, bounds: Sequence[tuple[int, int]], read: Callable[[int, int], T]) -> list[T]:
        """``read(lo, hi)`` of each group, their results in order. Returns only after every
        group has ended, and raises the first failure in group order if any failed."""
        if len(bounds) == 1:
            return [read(*bounds[0])]
        workers = self._executor()
        futures = [workers.submit(read, lo, hi) for lo, hi in bounds[1:]]
        try:
            first = read(*bounds[0])
        finally:
            wait_all(futures)
        return [first, *(f.result() for f in futures)]

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise TierUnavailable(f"{self.name}: closed")
            if self._workers is None:
                # enough for a few reads at once; more queue behind them (still correct)
                self._workers = ThreadPoolExecutor(
                    max_workers=self._max_workers, thread_name_prefix=self._thread_name
                )
            return self._workers

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.shutdown(wait=False)


@dataclass(frozen=True, slots=True)
class PoolChunk:
    """A chunk read from a pool: its metadata and its verified bytes."""

    meta: ChunkMeta
    data: memoryview


class BadUsageReport(TierUnavailable):
    """A pool's usage report holding counts that are not counts (a broken or hostile pool
    agent's HELLO, or Redis keys another host wrote). The pool answered: its link and data path
    are not at fault, so this is no failed call of the source (no breaker opens); the figure is
    not shown."""


#: a count as Redis keeps one (HINCRBY's decimal text); 19 digits: past 2**63 - 1 already
_COUNT_TEXT = re.compile(rb"[0-9]{1,19}")


def usage_count(value: object, what: str) -> int:
    """``value``, a count of a pool's usage report (another host's word), checked: a whole
    number in 0..2**63 - 1, as an int (not a bool) or as the ASCII decimal digits Redis keeps it
    in. Anything else (negative, fractional, past an int64, not a number) is BadUsageReport
    "``what`` <value, cut at 40 characters>, not a count in 0..2**63 - 1": shown, such a count
    made a node's pool usage negative, or failed ``kvctl agent remote`` formatting it."""
    count = value if type(value) is int else None
    if isinstance(value, bytes) and _COUNT_TEXT.fullmatch(value):
        count = int(value)
    if count is None or not 0 <= count <= MAX_SIZE_BYTES:
        raise BadUsageReport(f"{what} {_shown(value)[:40]!r}, not a count in 0..2**63 - 1")
    return count


def _shown(value: object) -> str:
    if isinstance(value, bytes):
        return value[:40].decode("utf-8", "replace")
    try:
        return str(value)
    except ValueError:  # an int past str()'s digit limit
        return f"a number of {value.bit_length() if isinstance(value, int) else '?'} bits"


@dataclass(slots=True)
class PoolUsage:
    capacity_bytes: int
    used_bytes: int
    chunks: int
    #: bytes per tenant, where the backend accounts them
    tenant_bytes: dict[str, int] = field(default_factory=dict)
    #: per-tenant quota in bytes (0: none), where the backend enforces them
    tenant_quota_bytes: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class RemotePool(ABC):
    """A shared chunk pool. Thread-safe: the agent calls it from many connections at once."""

    #: where it is, for status and logs, never with a password in it
    address: str
    #: records that failed their checks on read since the pool was opened
    corrupt: int = 0
    #: pulls abandoned at their deadline (``PullTooSlow``), where the backend enforces one
    overdue: int = 0

    @abstractmethod
    def put_many(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[bool]:
        """Store chunks; per item True when stored or already present, False when refused
        (over the pool's capacity with nothing evictable, over the tenant's quota, too large).
        Raises TierUnavailable when the backend cannot be reached."""

    @abstractmethod
    def get_many(self, keys: Sequence[bytes], *, tenant: str) -> list[PoolChunk | None]:
        """Chunks in the order asked; None for missing, not visible to ``tenant``, or corrupt."""

    @abstractmethod
    def probe_many(self, keys: Sequence[bytes], *, tenant: str) -> list[ChunkMeta | None]:
        """Metadata of the chunks the pool holds and ``tenant`` may see (no payload moved)."""

    @abstractmethod
    def delete_many(self, keys: Sequence[bytes]) -> int:
        """Remove chunks; returns how many were there."""

    @abstractmethod
    def usage(self) -> PoolUsage: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
