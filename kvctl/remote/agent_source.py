"""Another agent as a source of chunks, over its data plane: a pool agent (``--role pool``,
the embedded alternative to Redis) or a peer in another node or DC.

The FETCH op brings each chunk with its metadata (owner tenant, isolation, parent, tokens), so
a chunk pulled from elsewhere keeps its owner here: isolation holds and hits still count as reuse
or sharing correctly. Connections are kept open (a few, for concurrent requests) and a broken
one is dropped; every failure surfaces as ``TierUnavailable``.

A large pull is split into contiguous groups of its keys, one FETCH per group, each on its own
connection, in parallel (up to ``streams``; one stream per ``min_stream_bytes`` of the pull,
sized by the chunks this source served or described last): one Python connection tops out well
below what the host's loopback or NIC moves, since each side copies through one thread. Each
chunk is handed to ``arrived`` as it lands, in order within its stream; streams interleave, so
callbacks come from several threads at once. ``get_many`` returns only after every stream has
ended (no callback runs after it), and raises ``TierUnavailable`` if any stream failed, after
the chunks that landed on the others were handed over. With ``into``, the caller names where
each chunk's bytes are received (its own reserved memory: the agent's arena), so they are read
from the socket straight there, with no buffer of their own and no copy after.

Each chunk is checked where it landed before it is handed over: its key, size and tenant, and
its XXH3-64 against the one the sender computed from the bytes it sent (agents that offer it).
A chunk that fails is a miss counted in ``corrupt``, never stored: its reserved view goes back
through ``unused``. The other way, each chunk written (``put_many``) carries its XXH3-64 to an
agent that takes them, which checks the bytes it received before storing them and refuses a
chunk damaged on the way (a failed write here, logged), so no pool serves such a chunk to the
fleet.

Each stream has a deadline as well as the read deadline (which bounds silence, not a transfer): the
read deadline plus ``PULL_ALLOWANCE_PER_RECORD_S`` per chunk and its bytes at
``PULL_FLOOR_BYTES_PER_S``, grown as each chunk's size is read from the reply. A stream past it is
cut (``PullWatch`` shuts its socket down): it raises ``PullTooSlow``, counted in ``overdue``; the
chunks it landed whole before stay handed over, the one it was receiving goes back through
``unused``, and the connection is dropped.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from itertools import groupby

from kvctl.client import AgentError, DataClient, PutOutcome
from kvctl.remote.pool import (
    DEFAULT_MIN_STREAM_BYTES,
    DEFAULT_STREAMS,
    PROBE_SLACK_S,
    PULL_FLOOR_BYTES_PER_S,
    BadUsageReport,
    PoolChunk,
    PoolUsage,
    Pull,
    PullWatch,
    RemotePool,
    SplitReads,
    SplitStreams,
    check_deadlines,
    probe_too_slow,
    pull_deadline_s,
    usage_count,
    visible_to,
    write_deadline_s,
)
from kvctl.store.errors import InvalidArgument, TierUnavailable
from kvctl.store.tiers.base import Buffer, ChunkMeta
from kvctl.units import MAX_SIZE_BYTES
from kvctl.wire.protocol import FETCH_CHECKSUM_NAME, fetch_checksum

log = logging.getLogger("kvctl.remote.agent_source")

#: connections kept open per source and kind (reads, writes; at least ``streams``); more
#: concurrent requests than this open short-lived ones
_KEEP_CONNECTIONS = 4

Arrived = Callable[[int, PoolChunk], None]
#: ``into(i, meta)``: the writable view of ``meta.size_bytes`` chunk ``i`` is received into, or
#: None (a buffer of the source's own)
Into = Callable[[int, ChunkMeta], memoryview | None]


def cut_client(client: DataClient) -> None:
    """Shut ``client``'s socket down from another thread, so a read blocked on it returns at
    once (the SDK has no public way to end a call in flight from another thread)."""
    with contextlib.suppress(OSError):
        client._sock.shutdown(socket.SHUT_RDWR)


#: what a pool agent's HELLO reports of each tier (``PoolUsage``'s counts)
USAGE_FIELDS = ("capacity_bytes", "used_bytes", "chunks")


class AgentSource(SplitStreams, RemotePool):
    """``streams``: connections one pull may be split over (1: one FETCH per pull);
    ``min_stream_bytes``: the least a stream should carry for the split to pay.
    ``read_timeout_s`` (default ``min(DEFAULT_READ_TIMEOUT_S, timeout_s)``) bounds the reads
    (fetch, probe, usage, ping) and ``timeout_s`` the writes (put), each on its own kept
    connections: a write is behind the request that made it and may wait longer.
    ``max_chunk_bytes``: the most this node takes for one chunk (its agent's
    ``max_chunk_bytes``): a reply with a larger item is a failed read, refused before any of
    it is read, and a probe's larger chunk is not offered. The source's HELLO names its own
    limit, but that is its word: a hostile or broken peer names none, or any, and each chunk
    it claims would be allocated here (a pull of a few keys claiming 512 MiB each made the
    puller allocate 512 MiB and wait out a deadline its claimed bytes stretched)."""

    def __init__(
        self,
        address: str,
        *,
        token: str = "",
        timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        streams: int = DEFAULT_STREAMS,
        min_stream_bytes: int = DEFAULT_MIN_STREAM_BYTES,
        max_chunk_bytes: int | None = None,
    ) -> None:
        read_timeout_s = check_deadlines("source", timeout_s, read_timeout_s)
        if max_chunk_bytes is not None and max_chunk_bytes < 1:
            raise InvalidArgument(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
        self.max_chunk_bytes = max_chunk_bytes
        if streams < 1:
            raise InvalidArgument(f"streams must be at least 1, got {streams}")
        if min_stream_bytes < 1:
            raise InvalidArgument(f"min_stream_bytes must be positive, got {min_stream_bytes}")
        self.address = f"kvctl://{address.removeprefix('kvctl://').rstrip('/')}"
        self._target = self.address.removeprefix("kvctl://")
        self._token = token
        self._timeout_s = timeout_s
        self.read_timeout_s = read_timeout_s
        self._keep = max(_KEEP_CONNECTIONS, streams)
        #: kept connections by ``write``: their socket timeouts differ
        self._idle: dict[bool, list[DataClient]] = {True: [], False: []}
        self._lock = threading.Lock()
        self._closed = False
        #: sized by the chunks this source served or described last; workers enough for a few
        #: pulls at once
        self._split = SplitReads(
            f"source {self.address}",
            streams=streams,
            min_stream_bytes=min_stream_bytes,
            workers=2 * self._keep,
            thread_name="kvctl-pull",
        )
        self.corrupt = 0
        self.overdue = 0
        self._watch = PullWatch(self.address)
        #: a source without checksums on its reads, or on writes to it, was logged (once each)
        self._unchecked_noted = False
        self._unverified_writes_noted = False

    @contextmanager
    def _client(self, *, write: bool = False) -> Iterator[DataClient]:
        """A kept (or new) connection with the write or the read deadline."""
        with self._lock:
            if self._closed:
                raise TierUnavailable(f"source {self.address} is closed")
            idle = self._idle[write]
            client = idle.pop() if idle else None
        try:
            if client is None:
                client = self._connect(self._timeout_s if write else self.read_timeout_s)
            yield client
        except (AgentError, OSError) as exc:
            if client is not None:
                client.close()
            raise TierUnavailable(f"{self.address}: {exc}") from exc
        else:
            with self._lock:
                idle = self._idle[write]
                if not (self._closed or client.closed) and len(idle) < self._keep:
                    idle.append(client)
                    return
            client.close()

    def _connect(self, timeout_s: float) -> DataClient:
        # no shared memory: the peer is another host as far as this code knows. The HELLO is
        # bounded in all (not only each wait): a source that trickles it held a pull (its
        # connection is made before the pull's deadline is watched) as long as it trickled
        return DataClient.connect(
            self._target,
            token=self._token,
            timeout_s=timeout_s,
            use_shm=False,
            hello_timeout_s=timeout_s,
        )

    def ping(self) -> float:
        with self._client() as c, c.timeout(self.read_timeout_s):
            # bounded in all: a source that trickles its answer held the link monitor (which
            # probes every source, and the fleet index, in turn) for as long as it trickled
            return c.ping()

    def probe_transfer(self, nbytes: int) -> float:
        """Seconds to download ``nbytes`` of filler from the agent (a bandwidth sample), cut
        at a pull's deadline for as many bytes (``pull_deadline_s``): the read deadline bounds
        silence only, and a link that trickles held the link monitor for as long as it did."""
        deadline_s = pull_deadline_s(nbytes, self.read_timeout_s) + PROBE_SLACK_S
        probe: Pull | None = None
        try:
            with self._client() as c:
                with self._watch.watching(functools.partial(cut_client, c), deadline_s) as probe:
                    elapsed_s = c.probe(download_bytes=nbytes)
                if probe.cut:  # done just as it was cut: not kept for reuse
                    c.close()
                return elapsed_s
        except TierUnavailable as exc:
            if probe is None or not probe.cut:
                raise
            took_s = time.monotonic() - probe.started_s
            raise probe_too_slow(
                self.address, f"download of {nbytes} bytes", took_s, deadline_s
            ) from exc

    def put_many(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[bool]:
        out: list[bool] = []
        # one request per (tenant, isolation): both travel per request
        for (tenant, isolated), group in groupby(
            items, key=lambda it: (it[0].tenant, it[0].isolated)
        ):
            batch = list(group)
            nbytes = sum(m.size_bytes for m, _ in batch)
            # the whole request bounded: a pool that trickles its answer held the node's one
            # pool writer (every later chunk dropped, nothing failed) for good; at the write
            # floor, not a pull's (a slow but working link is not a trickle)
            deadline_s = write_deadline_s(nbytes, self._timeout_s, len(batch))
            with self._client(write=True) as c, c.timeout(deadline_s):
                self._note_unverified_writes(c)
                outcomes = c.put_many(
                    [(m.key, data) for m, data in batch],
                    tenant=tenant,
                    parents=[m.parent for m, _ in batch],
                    tokens=[m.tokens for m, _ in batch],
                    # each chunk's own, as a Redis pool's record keeps it: a high-priority
                    # chunk keeps its standing in the pool and in a node that pulls it back
                    # (a pin is the node's own, not passed on: no node pins the shared pool)
                    priority=[m.priority for m, _ in batch],
                    isolated=isolated,
                    checksums=True,  # whatever the transport: the pool serves them to the fleet
                )
                if len(outcomes) != len(batch):
                    raise AgentError(f"PUT reply has {len(outcomes)} items for {len(batch)}")
            self._note_damaged(batch, outcomes)
            out += [o.status == "stored" for o in outcomes]
        return out

    def _note_damaged(
        self, batch: Sequence[tuple[ChunkMeta, Buffer]], outcomes: Sequence[PutOutcome]
    ) -> None:
        """Logs the chunks the agent refused as damaged on the way (failed writes all the
        same, counted by the writer as any refusal)."""
        damaged = [
            m.key.hex() for (m, _), o in zip(batch, outcomes, strict=True) if o.status == "corrupt"
        ]
        if damaged:
            log.warning(
                "%s refused %d chunk(s) written to it, damaged on the way (their bytes did not "
                "match their checksums): %s",
                self.address,
                len(damaged),
                ", ".join(damaged[:4]) + (", ..." if len(damaged) > 4 else ""),
            )

    def _note_unverified_writes(self, client: DataClient) -> None:
        """Logs once per source that the chunks written to it go without checksums (an agent
        before them would refuse the PUT): it stores them unverified, as it did before."""
        if self._unverified_writes_noted or client.takes_put_checksums:
            return
        self._unverified_writes_noted = True
        log.warning(
            "%s (kvctl %s) takes no chunk checksums on writes: chunks written to it are stored "
            "unverified",
            self.address,
            client.info.get("version", "?"),
        )

    def get_many(
        self,
        keys: Sequence[bytes],
        *,
        tenant: str,
        arrived: Arrived | None = None,
        into: Into | None = None,
        unused: Callable[[int], None] | None = None,
        streams: int | None = None,
        keep: bool = True,
    ) -> list[PoolChunk | None]:
        """``into``: where each chunk is received (see the module), asked only for a chunk
        that is the key asked for and visible to ``tenant``; the chunk handed to ``arrived``
        (and returned) then holds that view. ``unused(i)``: the view ``into`` gave for chunk
        ``i`` holds no chunk (its stream failed before the chunk was whole, or it failed its
        checks); called on that stream's thread once nothing more is written into the view,
        so the caller may give its memory back then. ``streams``: split over at most this many
        (1: the chunks land in order; None: the source's ``streams``). ``keep=False`` (with
        ``arrived``): no chunk is held past its ``arrived`` (the answer is all None), so the
        chunks a caller drops (a buffer of the source's own each) are never all held at
        once."""
        keys = list(keys)
        if not keys:
            return []
        out: list[PoolChunk | None] = [None] * len(keys)
        sizes: list[int] = []
        # every stream is waited for; the first failure is raised after the others handed over
        self._split.run(
            self._split.groups(len(keys), streams=streams),
            lambda lo, hi: self._pull(
                keys, lo, hi, tenant, out, arrived, into, unused, sizes, keep or arrived is None
            ),
        )
        self._split.saw(sizes)
        return out

    def _pull(
        self,
        keys: list[bytes],
        lo: int,
        hi: int,
        tenant: str,
        out: list[PoolChunk | None],
        arrived: Arrived | None,
        into: Into | None,
        unused: Callable[[int], None] | None,
        sizes: list[int],
        keep: bool = True,
    ) -> None:
        """One stream: FETCH keys[lo:hi] on one connection, each chunk received where
        ``into`` says (if it is what was asked for), checked and handed over as it lands;
        the views ``into`` gave that hold no chunk go to ``unused`` when the stream ends."""
        given: set[int] = set()  # chunks received into a view of ``into``, not landed yet
        # each chunk's XXH3-64 as the sender computed it, filled before the first one lands
        checksums: list[int | None] = []
        pull: Pull | None = None

        def target(i: int, meta: ChunkMeta) -> memoryview | None:
            assert pull is not None
            # asked just before the chunk's bytes are read: its time at the floor rate is added
            self._watch.extend(pull, meta.size_bytes / PULL_FLOOR_BYTES_PER_S)
            if into is None or meta.key != keys[lo + i] or not visible_to(meta, tenant):
                return None  # a buffer of its own, dropped (and counted) when it lands
            view = into(lo + i, meta)
            if view is not None:
                given.add(i)
            return view

        def landed(i: int, meta: ChunkMeta, data: bytearray | memoryview) -> None:
            chunk = self._checked(keys[lo + i], meta, data, tenant, checksums[i])
            if chunk is None:
                return  # (still in ``given`` if it was: unused below)
            given.discard(i)
            sizes.append(meta.size_bytes)
            if keep:
                out[lo + i] = chunk
            if arrived is not None:
                arrived(lo + i, chunk)

        try:
            with self._client() as c:
                allowance_s = pull_deadline_s(0, self.read_timeout_s, hi - lo)  # bytes: target
                with self._watch.watching(functools.partial(cut_client, c), allowance_s) as pull:
                    self._note_unchecked(c)
                    c.fetch(
                        keys[lo:hi],
                        tenant=tenant,
                        into=target,
                        arrived=landed,
                        checksums=checksums,
                        max_chunk_bytes=self.max_chunk_bytes,
                        keep=False,  # each landed chunk is ``out``'s (when kept), not the client's
                    )
                # read once the watch let go of it (a cut is final then): a pull done just as
                # it was cut has its connection cut all the same, so it is not kept for reuse
                if pull.cut:
                    c.close()
        except TierUnavailable as exc:
            if pull is None or not pull.cut:
                raise
            with self._lock:
                self.overdue += 1
            raise pull.too_slow(self.address, f"{hi - lo} chunks", self.read_timeout_s) from exc
        finally:
            # this stream reads no more: what it was given and did not land is free again
            if unused is not None:
                for i in sorted(given):
                    unused(lo + i)

    def _note_unchecked(self, client: DataClient) -> None:
        """Logs once per source that its chunks arrive without checksums (an agent before
        them): they are taken unverified, as they were before."""
        if self._unchecked_noted or client.info.get("fetch_checksum") == FETCH_CHECKSUM_NAME:
            return
        self._unchecked_noted = True
        log.warning(
            "%s (kvctl %s) sends no chunk checksums: its chunks are taken unverified",
            self.address,
            client.info.get("version", "?"),
        )

    def _checked(
        self,
        key: bytes,
        meta: ChunkMeta,
        data: bytearray | memoryview,
        tenant: str,
        checksum: int | None = None,
    ) -> PoolChunk | None:
        """The chunk, or None (a counted miss) when it is not what was asked for: another key,
        a length that is not its declared size, another tenant's isolated chunk, or bytes that
        are not those the sender checksummed (``checksum``: its XXH3-64; None: not sent)."""
        view = memoryview(data)
        why = ""
        if meta.key != key:
            why = f"holds key {meta.key.hex()}"
        elif view.nbytes != meta.size_bytes:
            why = f"is {view.nbytes} bytes, declared {meta.size_bytes}"
        elif not visible_to(meta, tenant):
            why = f"is isolated to another tenant than {tenant!r}"
        elif checksum is not None and (got := fetch_checksum(view)) != checksum:
            why = f"fails its checksum (XXH3-64 {got:016x}, the sender's {checksum:016x})"
        if not why:
            return PoolChunk(meta, view)
        with self._lock:
            self.corrupt += 1
        log.warning("%s: dropping chunk %s: it %s", self.address, key.hex(), why)
        return None

    def probe_many(self, keys: Sequence[bytes], *, tenant: str) -> list[ChunkMeta | None]:
        with self._client() as c, c.timeout(pull_deadline_s(0, self.read_timeout_s, len(keys))):
            got = c.fetch(keys, tenant=tenant, payload=False)
        limit = self.max_chunk_bytes
        # a chunk larger than this node takes would be refused by the pull: not offered
        metas = [
            None if g is None or (limit is not None and g[0].size_bytes > limit) else g[0]
            for g in got
        ]
        # a lookup probes before the fill: the pull that follows is sized by it
        self._split.saw([m.size_bytes for m in metas if m is not None])
        return metas

    def delete_many(self, keys: Sequence[bytes]) -> int:
        raise TierUnavailable(f"{self.address}: evict through its control API (kvctl evict)")

    def usage(self) -> PoolUsage:
        # a new connection: its HELLO carries the agent's usage now, a kept one's is stale
        try:
            with self._connect(self.read_timeout_s) as c:
                tiers = c.info.get("usage", {})
        except (AgentError, OSError) as exc:
            raise TierUnavailable(f"{self.address}: {exc}") from exc
        totals = dict.fromkeys(USAGE_FIELDS, 0)
        # another host's word: a count that is not a whole number in 0..2**63 - 1 (a hostile
        # or broken agent) is refused whole, never summed into the pool usage the node reports
        # (one past a float's range failed `kvctl agent remote` formatting it)
        for name, tier in tiers.items() if isinstance(tiers, dict) else [("", tiers)]:
            for field in USAGE_FIELDS:
                totals[field] += usage_count(
                    tier.get(field) if isinstance(tier, dict) else None,
                    f"{self.address}: its HELLO's usage of tier {str(name)[:40]!r} has {field}",
                )
        for field, total in totals.items():
            if total > MAX_SIZE_BYTES:
                raise BadUsageReport(
                    f"{self.address}: its HELLO's usage sums to {field} {str(total)[:40]}, "
                    "past 2**63 - 1"
                )
        return PoolUsage(totals["capacity_bytes"], totals["used_bytes"], totals["chunks"])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {True: [], False: []}
        for kept in idle.values():
            for c in kept:
                c.close()
        self._split.close()
        self._watch.close()
