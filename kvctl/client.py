"""Python SDK for kvctl agents.

``DataClient`` speaks the binary data plane (bulk KV bytes) over TCP or the agent's Unix socket;
on the Unix socket it reads chunks straight from the agent's shared-memory arena under a read
lease, and puts through a staging segment it shares with the agent. ``AgentClient`` speaks the
JSON control API. Both raise the typed errors below, never bare socket or HTTP errors.

    with DataClient.connect("unix:///run/kvctl/agent.sock") as dc:
        dc.put(key, payload, tenant="acme")
        data = dc.get(key, tenant="acme")
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import math
import mmap
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast, overload

from kvctl import __version__, json_text
from kvctl.agent_starting import STARTING_PREFIX, says_starting
from kvctl.bearer import bearer_headers, token_problem
from kvctl.store.index import DEFAULT_PRIORITY, LookupResult
from kvctl.store.keys import KVLayout, Namespace
from kvctl.store.tiers import hugepages
from kvctl.store.tiers.base import ChunkMeta, copy_bytes
from kvctl.wire.address import UnixAddress, parse_address
from kvctl.wire.protocol import (
    CLOSING_ERROR_CODES,
    FETCH_CHECKSUM_NAME,
    FETCH_ITEM,
    FLAG_HAS_PARENT,
    FLAG_ISOLATED,
    GET_ITEM,
    HEADER_BYTES,
    LEASE_ITEM,
    MAX_LOOKUP_MANY_KEYS,
    MAX_PROBE_BYTES,
    PROBE_PIECE_BYTES,
    PUT_CHECKSUM_NAME,
    REPLY_BIT,
    SEGMENT_NO_DESCRIPTORS_TEXT,
    SEGMENT_UNMAPPED_TEXT,
    ErrorCode,
    FrameError,
    MetaReader,
    MetaWriter,
    Op,
    PeerClosed,
    Status,
    check_header,
    chunk_checksum,
    fetch_flags,
    get_meta,
    pack_header,
    parse_error,
    parse_fetch_checksums,
    parse_rates_reply,
    probe_meta,
    put_item,
    put_meta,
    rates_meta,
    recv_exactly,
    recv_some_with_fds,
    recv_with_fds,
    send_all,
    zero_pieces,
)
from kvctl.wire.reports import AgentInfo, AgentStats, LinkProbe

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("kvctl.client")

Payload = bytes | bytearray | memoryview | Any  # anything with the buffer protocol (numpy arrays)
#: replies' payloads are read into buffers the caller sized (or drained), never allocated whole,
#: so only the metadata length needs the protocol's bound
_ANY_PAYLOAD = 1 << 64


#: PROBE filler to send and a scratch buffer to drain replies into, made on the first probe
#: and shared by every connection of the process: each connection made its own, and one kept
#: open (an agent keeps up to 4 per pool or peer for reads) held those 2 MiB from its first
#: probe until it closed, a step in the agent's memory per kept connection. Threads may drain
#: into the scratch at once: what lands there is never read.
_probe_pair: tuple[bytes, memoryview] | None = None
_probe_pair_lock = threading.Lock()


def _probe_buffers() -> tuple[bytes, memoryview]:
    global _probe_pair
    with _probe_pair_lock:
        if _probe_pair is None:
            _probe_pair = (bytes(PROBE_PIECE_BYTES), memoryview(bytearray(PROBE_PIECE_BYTES)))
        return _probe_pair


#: OpenSSL's reasons for a TLS handshake whose peer answered with something else, as an HTTP
#: server's plain answer to a ClientHello reads (3.2 and later say RECORD_LAYER_FAILURE)
_NOT_TLS_REASONS = frozenset({"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST"})


def plain_http_answer(exc: BaseException) -> bool:
    """Whether ``exc`` (an httpx transport error of an https:// request) came of a peer that
    does not speak TLS: an SSLError of those reasons in its chain, not a certificate's."""
    import ssl

    seen: BaseException | None = exc
    for _ in range(8):  # the chain httpx -> httpcore -> ssl is three deep
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError) and not isinstance(seen, ssl.SSLCertVerificationError):
            return getattr(seen, "reason", None) in _NOT_TLS_REASONS
        seen = seen.__cause__ or seen.__context__
    return False


# --- errors -------------------------------------------------------------------------------
class AgentError(Exception):
    """Base of every error the SDK raises."""


class AgentUnreachable(AgentError, ConnectionError):
    """No agent answers at the address (not running, wrong address, or it went away)."""


class AgentTimeout(AgentUnreachable):
    """The agent did not answer in time (a hung agent: stopped, or accepting and never
    answering); the connection is closed, since a late reply would come out of step."""


class AgentNotAnswering(AgentUnreachable):
    """The agent's port took the connection and the answer did not come in time: something
    runs there (hung or overloaded), so "down, start it" would mislead."""


class AuthError(AgentError):
    """The agent refused the token (or needs one and none was given)."""


class RequestError(AgentError):
    """The agent understood the request and refused it; ``code`` says why."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class AgentStarting(RequestError):
    """The agent is up but still opening its tiers (``code`` 503): its API serves once they
    are open, so the call is worth making again shortly."""


class NotAnAgent(RequestError):
    """Something answered at the address, but not as a kvctl agent's control API does: a web
    page, an endpoint it does not have (``code`` 404: a wrong URL, or an agent too old for the
    call), or no HTTP at all (:class:`NoHttpAnswer`)."""


class NoHttpAnswer(NotAnAgent, AgentUnreachable):
    """The address took the connection and closed it without an HTTP answer: another
    protocol's port (an agent's data plane does this), or an agent that went away mid-request.
    Either is possible, so it is both kinds."""


#: what a call on a closed client raises (AgentError), also where ``close`` from another thread
#: ended a call in flight: never a ValueError of a closed mapping or socket
CLOSED_MESSAGE = "this client is closed"


class ClientOutOfMemory(AgentError, MemoryError):
    """This process could not allocate what a call needs (a put's buffer over the socket):
    nothing was sent and the connection stays usable. A MemoryError too, for callers that
    caught the bare one."""


class ChunkNotFound(AgentError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "chunk not found"


class NoRoom(RequestError):
    """The chunk cannot fit (tier full of pinned or leased chunks, larger than a tier, or a
    disk tier's filesystem full)."""


def no_room_message(key: bytes, full_tier: str | None) -> str:
    """What a NO_ROOM for chunk ``key`` tells the operator: the likely causes and where to
    look. ``full_tier``: the tier whose filesystem the agent found full (a PUT item's tier
    code on NO_ROOM; None from an agent that does not say, or where that was not why)."""
    if full_tier is not None:
        return (
            f"no room for chunk {key.hex()}: the agent's {full_tier} tier found its filesystem "
            "full (others' files, or --disk above the free space) and no other tier could take "
            "it; `kvctl agent status` on that node counts it (filesystem full), its log says "
            "how many bytes were free"
        )
    return (
        f"no room for chunk {key.hex()}: no tier of the agent could take it (full of pinned or "
        "leased chunks, a chunk larger than a tier, or a disk tier's filesystem full); "
        "`kvctl agent status` on that node shows pins and full filesystems, its log says why"
    )


@dataclass(frozen=True, slots=True)
class PutOutcome:
    #: "stored" (or already cached), "declined" (a policy bypassed it, or the agent's
    #: bypass_unreachable: deeper in its chain than its tiers hold), "too_large", "no_room",
    #: "bad" (size or key refused), "corrupt" (its bytes arrived damaged: they did not match
    #: the checksum sent with them, so the agent refused them; only puts that carry checksums)
    status: str
    #: where it is stored; for "no_room", the tier whose filesystem was full when that is part
    #: of why (``no_room_message``), else None
    tier: str | None


_STATUS_NAMES = {
    Status.OK: "stored",
    Status.DECLINED: "declined",
    Status.TOO_LARGE: "too_large",
    Status.NO_ROOM: "no_room",
    Status.BAD: "bad",
    Status.MISSING: "missing",
    Status.CORRUPT: "corrupt",
}


@dataclass(frozen=True, slots=True)
class LeasedChunk:
    """Where a leased chunk's bytes lie in the agent's arena, and until when they may be read."""

    offset: int
    size_bytes: int
    #: ``time.monotonic()`` on this host after which the agent may reuse the bytes
    deadline_s: float


@dataclass(frozen=True, slots=True)
class ArenaLeases:
    """Chunks held in place in the agent's shared-memory arena for the length of a
    ``DataClient.leased()`` block: read them straight from ``arena`` (no copy through the socket
    or a staging buffer). ``chunks[i]`` is None where key i is not cached (``missing``), is on
    another node and was not pulled (``remote``: ``lookup_leased(local_only=True)``; lease it to
    pull it) or could not be held in the arena (read it with ``get_into``); ``arena`` is None
    only when no chunk is held and the arena was never mapped."""

    arena: mmap.mmap | None
    generation: int
    chunks: list[LeasedChunk | None]
    missing: frozenset[int]
    remote: frozenset[int] = frozenset()
    #: the client that took the leases (weak: these must not keep it open): once it is closed,
    #: by another thread too, the agent has ended them and its arena is unmapped
    _client: weakref.ref[DataClient] | None = field(default=None, repr=False, compare=False)

    def ended(self) -> bool:
        """Whether the client that took these leases is closed (by another thread too): the
        agent ended them with the connection, whatever their deadlines say, and may reuse the
        bytes. A copy from the arena (an engine's tensor over it keeps it mapped past close)
        that ends with this True cannot be trusted."""
        if self._client is None:
            return False
        client = self._client()
        return client is None or client.closed

    def view(self, i: int) -> memoryview:
        """Chunk i's bytes in the arena; AgentError('this client is closed') once the client
        is (its leases ended, its arena unmapped), as every call on a closed client says."""
        c = self.chunks[i]
        if c is None or self.arena is None:
            raise KeyError(f"chunk {i} is not leased")
        # asked first, not only when the arena is found unmapped: a view of it held elsewhere
        # (an engine's tensor) keeps it mapped past close, over bytes the agent may reuse
        if self.ended():
            raise AgentError(CLOSED_MESSAGE)
        try:
            whole = memoryview(self.arena)
        except ValueError:  # the arena unmapped: by a close since, or a new generation
            if self.ended():
                raise AgentError(CLOSED_MESSAGE) from None
            raise
        return whole[c.offset : c.offset + c.size_bytes]

    def valid(self, i: int) -> bool:
        """Whether chunk i's lease still holds now: a copy that ended after its deadline, or
        after the client was closed (which ends its leases), may hold bytes the agent reused,
        so check this after the copy is complete."""
        c = self.chunks[i]
        return c is not None and time.monotonic() < c.deadline_s and not self.ended()


def _as_bytes_view(data: Payload) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("a payload must be C-contiguous (use numpy.ascontiguousarray)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class DataClient:
    """One connection to an agent's data plane. Thread-safe (requests are serialized); use one
    client per thread for parallelism."""

    def __init__(
        self,
        sock: socket.socket,
        transport: str,
        *,
        token: str = "",
        use_shm: bool = True,
        client_name: str = "kvctl-sdk",
        hello_timeout_s: float | None = None,
    ) -> None:
        """``hello_timeout_s``: how long the HELLO may take in all (None: each wait is bounded
        by the socket's timeout only)."""
        self._sock = sock
        self.transport = transport
        # reentrant: a thread inside a ``leased()`` block may make other calls on its client
        self._lock = threading.RLock()
        #: guards ``closed`` and the swap of the mappings a call makes (staging segment, arena)
        #: against ``close`` from another thread; held only for the swap, never across a wait
        #: on the agent, so a close never waits on a call blocked on a dead agent (``_lock``,
        #: held by that call until its socket times out). ``on_staging`` runs under it and must
        #: not call into the client, ``close`` included (see ``on_staging``).
        self._mappings_lock = threading.RLock()
        self._rid = 0
        #: leases a ``release_later`` block or ``hold`` left held, by the thread that took
        #: them: released before that thread's next call on this client, or by its
        #: ``release_pending``. Engines sharing a client each keep theirs: another engine's
        #: call must not end leases whose bytes a layer-wise copy is still reading.
        self._unreleased: dict[int, list[int]] = {}
        self._fds: list[int] = []
        self._arena: mmap.mmap | None = None
        self._arena_gen = -1
        self._staging: mmap.mmap | None = None
        self._staging_fd = -1
        #: puts go through a staging segment (False where this system cannot seal one, or the
        #: agent maps none: then they go over the socket for the life of the connection)
        self._staged_puts = True
        #: staging segments that could not be made (ENOMEM...) or that the agent refused, in a
        #: row: puts that need a new one go over the socket until ``_staging_retry_at_s``
        #: (monotonic), then one is tried again (``_ensure_staging``)
        self._staging_failures = 0
        self._staging_retry_at_s = -math.inf
        #: the smallest segment the row's last failure refused for want of memory (here or in
        #: the agent): the back-off holds back only that size and larger; None: all sizes
        self._staging_refused_bytes: int | None = None
        #: when the row's last line was logged (monotonic): a row that lasts is logged again
        #: every STAGING_RELOG_SECONDS, not only at its first failure
        self._staging_logged_at_s = -math.inf
        #: the clock the staging back-off runs on (a seam: tests move it by hand)
        self._monotonic_s: Callable[[], float] = time.monotonic
        #: told of each staging segment this client attaches (and None before it unmaps one,
        #: and on close): a CUDA engine registers the segment so device copies into it run at
        #: link speed. It must not raise, and must drop every view of a segment it is told of
        #: when told None. It must not call into this client (``close`` included), nor wait on
        #: a thread that does: it runs under ``_mappings_lock`` (and ``_lock`` when a put
        #: attaches a segment). ``close`` from another thread calls it holding
        #: ``_mappings_lock`` only, so a call from it, which takes ``_lock``, deadlocks against
        #: a put that holds ``_lock`` and waits for ``_mappings_lock``; a ``close`` from it
        #: unmaps the segment the put is swapping in.
        self.on_staging: Callable[[mmap.mmap | None], None] | None = None
        self._reconnect_args: tuple[str | Path, str, float, bool] | None = None
        #: per thread: the ``timeout`` its calls run under (none: the socket's own timeout)
        self._limits = threading.local()
        #: monotonic time the call in progress must be answered by (None: no deadline)
        self._call_end_s: float | None = None
        self.closed = False
        # a bound on the whole HELLO, not only on each wait: an agent (or whatever listens
        # there) that trickles its answer a byte at a time would hold the caller for as long
        # as it kept trickling (a peer's pull, or the link monitor's ping, for good)
        self._limits.seconds = hello_timeout_s
        try:
            self.info: dict[str, Any] = self._hello(token, client_name)
        finally:
            self._limits.seconds = None
        self.tiers: list[str] = list(self.info["tiers"])
        # tier code -> name, indexable by any byte (unused codes and NO_TIER give None)
        self._tier_table: list[str | None] = [*self.tiers, *[None] * (256 - len(self.tiers))]
        self.shm = bool(use_shm and transport == "unix" and self.info.get("shm"))

    @classmethod
    def connect(
        cls,
        address: str | Path,
        *,
        token: str | None = None,
        timeout_s: float = 30.0,
        use_shm: bool = True,
        hello_timeout_s: float | None = None,
    ) -> DataClient:
        """``timeout_s``: how long the socket waits on the agent (each wait; ``timeout`` sets
        a deadline per call instead). ``hello_timeout_s``: how long the connection and its
        HELLO may take (a hung agent costs no more; the HELLO's answer in all, so one that
        trickles costs no more either), ``timeout_s`` applying after."""
        where = parse_address(address)
        target: str | tuple[str, int]
        if isinstance(where, UnixAddress):
            transport, family, target = "unix", socket.AF_UNIX, where.path
        else:
            family = socket.AF_INET6 if ":" in where.host else socket.AF_INET
            transport, target = "tcp", (where.host, where.port)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(timeout_s if hello_timeout_s is None else min(hello_timeout_s, timeout_s))
        try:
            sock.connect(target)
        except OSError as exc:
            sock.close()
            raise AgentUnreachable(
                f"no kvctl agent data plane at {address}: {exc.strerror or exc}; is the agent "
                "running (kvctl agent status)?"
            ) from exc
        if transport == "tcp":
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        token = os.environ.get("KVCTL_TOKEN", "") if token is None else token
        try:
            client = cls(
                sock, transport, token=token, use_shm=use_shm, hello_timeout_s=hello_timeout_s
            )
        except BaseException:
            sock.close()
            raise
        sock.settimeout(timeout_s)
        client._reconnect_args = (address, token, timeout_s, use_shm)
        return client

    def reconnect(self, *, hello_timeout_s: float | None = None) -> DataClient:
        """A new, independent connection to the same agent with the same settings (e.g. for a
        background writer, so its puts never hold up this connection's reads).
        ``hello_timeout_s``: how long the connection and its HELLO may take (a hung agent
        costs no more), the usual timeout applying after."""
        if self._reconnect_args is None:
            raise AgentError("this client was not made by DataClient.connect; connect anew")
        address, token, timeout_s, use_shm = self._reconnect_args
        return DataClient.connect(
            address,
            token=token,
            timeout_s=timeout_s,
            use_shm=use_shm,
            hello_timeout_s=hello_timeout_s,
        )

    @contextlib.contextmanager
    def timeout(self, seconds: float) -> Iterator[None]:
        """Each call this thread makes on this client inside the block must be answered in
        full within ``seconds`` of being sent (instead of the socket's timeout, which bounds
        each wait). A call that is not raises AgentTimeout and closes the connection (its
        reply would come out of step). An engine gives a call that moves no chunk bytes a
        short deadline, and one that moves bytes a deadline sized to them, so a hung agent
        costs a request no more than that. Other threads' calls keep their own."""
        if not seconds > 0:
            raise ValueError(f"a timeout must be a positive number of seconds, got {seconds!r}")
        before = getattr(self._limits, "seconds", None)
        self._limits.seconds = seconds
        try:
            yield
        finally:
            self._limits.seconds = before

    # --- public API -------------------------------------------------------------------------
    def ping(self) -> float:
        """Round-trip time in seconds."""
        t = time.perf_counter()
        self._call(Op.PING, b"")
        return time.perf_counter() - t

    def probe(self, upload_bytes: int = 0, download_bytes: int = 0) -> float:
        """Seconds for one PROBE round trip that uploads ``upload_bytes`` (the agent reads and
        drops them) and downloads ``download_bytes`` zero bytes (read here and dropped). Each
        is at most ``MAX_PROBE_BYTES``; beyond it this raises ValueError and sends nothing."""
        for what, n in (("upload_bytes", upload_bytes), ("download_bytes", download_bytes)):
            if not 0 <= n <= MAX_PROBE_BYTES:
                raise ValueError(f"{what} must be 0..{MAX_PROBE_BYTES}, got {n}")
        meta = probe_meta(download_bytes)
        with self._lock:
            zeros, scratch = _probe_buffers()
            pieces = zero_pieces(zeros, upload_bytes)
            started = time.perf_counter()
            reply, _ = self._call_locked(
                Op.PROBE, meta, pieces, None, sink=scratch, sink_bytes=download_bytes
            )
            elapsed_s = time.perf_counter() - started
        received = MetaReader(reply).u64()
        if received != upload_bytes:
            raise AgentError(f"the agent received {received} of {upload_bytes} probe bytes")
        return elapsed_s

    def put(
        self,
        key: bytes,
        data: Payload,
        *,
        tenant: str = "",
        parent: bytes | None = None,
        tokens: int = 0,
        priority: int = DEFAULT_PRIORITY,
        pinned: bool = False,
        depth: int = 0,
        checksums: bool | None = None,
    ) -> str | None:
        """Store one chunk; returns its tier, or None when the agent declined it (a policy,
        or ``bypass_unreachable``: deeper in its chain than the agent's tiers hold)."""
        out = self.put_many(
            [(key, data)],
            tenant=tenant,
            parents=[parent],
            tokens=tokens,
            priority=priority,
            pinned=pinned,
            depths=[depth],
            checksums=checksums,
        )[0]
        if out.status == "no_room":
            raise NoRoom(no_room_message(key, out.tier), ErrorCode.NO_ROOM)
        if out.status in ("too_large", "bad", "corrupt"):
            raise RequestError(f"agent refused chunk {key.hex()}: {out.status}")
        return out.tier

    def put_many(
        self,
        items: Sequence[tuple[bytes, Payload]],
        *,
        tenant: str = "",
        parents: Sequence[bytes | None] | None = None,
        tokens: int | Sequence[int] = 0,
        priority: int | Sequence[int] = DEFAULT_PRIORITY,
        pinned: bool = False,
        depths: Sequence[int] | None = None,
        isolated: bool = False,
        checksums: bool | None = None,
    ) -> list[PutOutcome]:
        """Store chunks in one request. ``parents[i]`` links chunk i into its prefix chain;
        ``tokens`` and ``priority`` are one value for all or one per chunk (an agent passing
        chunks on keeps each one's own priority). ``isolated`` marks the chunks as the
        tenant's own (agents passing chunks on say so; engines leave it to the agent's
        settings). ``checksums``: see ``put_packed``."""
        views = [_as_bytes_view(d) for _, d in items]

        def copy(i: int, out: memoryview) -> None:
            copy_bytes(out, views[i])

        return self.put_packed(
            [key for key, _ in items],
            [v.nbytes for v in views],
            copy,
            tenant=tenant,
            parents=parents,
            tokens=tokens,
            priority=priority,
            pinned=pinned,
            depths=depths,
            isolated=isolated,
            payload=views,
            checksums=checksums,
        )

    def put_packed(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        fill: Callable[[int, memoryview], None] | None = None,
        *,
        fill_many: Callable[[memoryview], None] | None = None,
        tenant: str = "",
        parents: Sequence[bytes | None] | None = None,
        tokens: int | Sequence[int] = 0,
        priority: int | Sequence[int] = DEFAULT_PRIORITY,
        pinned: bool = False,
        depths: Sequence[int] | None = None,
        isolated: bool = False,
        payload: Sequence[memoryview] | None = None,
        checksums: bool | None = None,
    ) -> list[PutOutcome]:
        """``put_many`` for chunks the caller writes itself: ``fill(i, out)`` writes chunk i's
        ``sizes[i]`` bytes into ``out``; or ``fill_many(out)`` writes every chunk, back to back
        in order, into one buffer of their summed sizes (for a caller that packs many chunks
        in one operation faster than one at a time). On a same-host shared-memory connection
        ``out`` is the chunks' place in the staging segment the agent copies from, so a chunk
        packed there crosses to the agent's arena with no buffer of its own between (``out``
        is only valid during the call). Elsewhere the chunks are filled into one buffer sent
        over the socket (``payload``: the bytes already, for ``put_many``).

        ``checksums``: send each chunk's XXH3-64, computed here from the bytes sent, so the
        agent refuses a chunk damaged on the way (outcome "corrupt") instead of storing it;
        None (default) sends them over TCP, where bytes may cross a NIC, a relay or another
        host, and not over the Unix socket. They are sent only to an agent that takes them
        (``put_checksum`` in its HELLO: one before them would refuse the whole PUT), and never
        through the staging segment (memory to memory, on this host)."""
        if (fill is None) == (fill_many is None):
            raise ValueError("give put_packed one of fill and fill_many")
        total = sum(sizes)

        def fill_region(out: memoryview) -> None:
            if fill_many is not None:
                fill_many(out)
                return
            assert fill is not None
            off = 0
            for i, size in enumerate(sizes):
                with out[off : off + size] as part:
                    fill(i, part)
                off += size

        parents = parents or [None] * len(keys)
        depths = depths or [0] * len(keys)
        counts = list(tokens) if isinstance(tokens, Sequence) else [int(tokens)] * len(keys)
        priorities = (
            list(priority) if isinstance(priority, Sequence) else [int(priority)] * len(keys)
        )

        def meta(offsets: Sequence[int | None], sums: Sequence[int] | None = None) -> bytes:
            items = [
                put_item(key, size, tokens=n, priority=p, pinned=pinned, parent=parent,
                         depth=depth, staging_offset=off, isolated=isolated)
                for key, size, parent, depth, off, n, p in zip(
                    keys, sizes, parents, depths, offsets, counts, priorities, strict=True
                )
            ]  # fmt: skip
            return put_meta(tenant, items, sums)

        if self.shm and self._staged_puts:
            # same host: the bytes go through the staging segment the agent maps, not the socket
            with self._lock:
                segment = self._ensure_staging(total)
                if segment is not None:
                    # a ``close`` from another thread closes the segment unless a view of it
                    # is held: the view is taken under its lock, or the client found closed
                    with self._mappings_lock:
                        if self.closed:
                            raise AgentError(CLOSED_MESSAGE)
                        staging = memoryview(segment)
                    with staging, staging[:total] as out:
                        fill_region(out)
                    offsets = [0, *itertools.accumulate(sizes)][:-1]
                    reply, _ = self._call_locked(Op.PUT_STAGED, meta(offsets), (), None)
                    return self._outcomes(reply)
        if payload is None:
            try:
                buf = memoryview(bytearray(total))
            except MemoryError:
                # before anything is sent: the connection stays in step, nothing is stored
                raise ClientOutOfMemory(
                    f"this process could not allocate {total} bytes to put {len(keys)} "
                    "chunk(s) over the socket (the staging segment was not available or "
                    "this is not a same-host shared-memory connection); nothing was sent. "
                    "Free memory or raise this process's limits (RLIMIT_AS, its cgroup's "
                    "memory.max), or put fewer chunks at a time"
                ) from None
            fill_region(buf)
            payload, off = [], 0
            for size in sizes:
                payload.append(buf[off : off + size])
                off += size
        # of the very bytes that go out, after they were filled
        sums = [chunk_checksum(v) for v in payload] if self._put_checksums(checksums) else None
        reply, _ = self._call(Op.PUT, meta([None] * len(keys), sums), payload)
        return self._outcomes(reply)

    @property
    def takes_put_checksums(self) -> bool:
        """The agent checks chunks' checksums sent with a PUT (``put_checksum`` in its HELLO)."""
        return self.info.get("put_checksum") == PUT_CHECKSUM_NAME

    def _put_checksums(self, wanted: bool | None) -> bool:
        """Whether a PUT over the socket carries checksums (see ``put_packed``)."""
        if wanted is None:
            wanted = self.transport == "tcp"
        return wanted and self.takes_put_checksums

    def get(self, key: bytes, *, tenant: str = "") -> bytearray:
        """A chunk's bytes; raises ChunkNotFound."""
        out = self.get_many([key], tenant=tenant)[0]
        if out is None:
            raise ChunkNotFound(f"chunk {key.hex()} is not cached (for tenant {tenant!r})")
        return out

    def get_many(self, keys: Sequence[bytes], *, tenant: str = "") -> list[bytearray | None]:
        """Chunks' bytes in new buffers (None where not cached)."""
        if self.shm:
            return self._get_leased(keys, tenant)
        return self._get_socket(keys, tenant, None)

    def get_into(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Payload],
        *,
        tenant: str = "",
        counted: bool = False,
    ) -> list[int]:
        """Read chunks into the caller's buffers (e.g. preallocated numpy arrays, or pinned
        host memory). Returns each chunk's size, or -1 where it is not cached.

        ``counted``: a lease of this same read (``hold``, ``lookup_leased``, ``leased``)
        counted these chunks as served already, and could not be copied from (the chunk was
        not leasable, or its lease ran out during the copy): they are read over the socket,
        with no lease, and the agent counts them no second time (GET_COUNTED; an agent before
        it, without ``get_counted`` in its HELLO, does)."""
        outs = [_as_bytes_view(b) for b in buffers]
        if len(outs) != len(keys):
            raise ValueError("give one buffer per key")
        # with caller buffers both paths give each chunk's size or None; an agent that would
        # count a socket re-read again anyway is read in place, as a plain get_into is
        got = (
            self._get_leased(keys, tenant, outs)
            if self.shm and not (counted and self.takes_get_counted)
            else self._get_socket(keys, tenant, outs, counted=counted)
        )
        return [-1 if g is None else g for g in got]

    @contextlib.contextmanager
    def leased(
        self, keys: Sequence[bytes], *, tenant: str = "", ttl_s: float | None = None
    ) -> Iterator[ArenaLeases]:
        """Hold chunks in place in the agent's shared arena while the block runs, so a same-host
        engine copies them straight to where they go (its KV cache, a device) with no copy in
        between; released on exit. Needs the Unix socket with shared memory (``self.shm``).
        The client's other calls wait until the block ends."""
        ttl = self._lease_ttl(ttl_s)
        with self._lock:
            leases, held = self._lease_locked(keys, tenant, ttl)
            try:
                yield self._arena_leases(leases)
            finally:
                self._release_locked(held)

    @contextlib.contextmanager
    def lookup_leased(
        self,
        keys: Sequence[bytes],
        *,
        tenant: str = "",
        ttl_s: float | None = None,
        release_later: bool = False,
        local_only: bool = False,
    ) -> Iterator[tuple[LookupResult, ArenaLeases]]:
        """``lookup`` (counted) whose matched prefix is held in place as by ``leased``, in one
        round trip: what a same-host engine that reads its hits at once asks. The leases cover
        ``keys[:matched_chunks]``; released on exit, or with ``release_later`` before this
        client's next call or at ``release_pending`` (an engine releases after its first
        token, not in its time to it; the leases' ttl bounds how long they stay held if
        neither comes). ``local_only``: nothing is pulled from the pool or peers; from the
        first matched chunk on another node the leases are ``remote``, for ``hold`` to pull
        in slices (an agent that predates it raises RequestError UNSUPPORTED)."""
        ttl = self._lease_ttl(ttl_s)
        op = Op.LOOKUP_LEASE_LOCAL if local_only else Op.LOOKUP_LEASE
        with self._lock:
            meta, _ = self._call_locked(
                op, MetaWriter().text(tenant).f64(ttl).keys(keys).build(), (), None
            )
            r = MetaReader(meta)
            try:
                found = self._lookup_result(r)
            except Exception as exc:  # the leases after it cannot be read, nor released
                self.close()  # which ends them at the agent
                raise AgentError(
                    f"the agent's {op.name} reply is malformed ({exc!r}); connection closed"
                ) from None
            leases, held = self._leases_locked(r)
            try:
                if len(leases) != found.matched_chunks:
                    raise AgentError(
                        f"the agent leased {len(leases)} chunks of a matched prefix of "
                        f"{found.matched_chunks}"
                    )
                yield found, self._arena_leases(leases)
            finally:
                if release_later:
                    self._pend(held)
                else:
                    self._release_locked(held)

    def hold(
        self, keys: Sequence[bytes], *, tenant: str = "", ttl_s: float | None = None
    ) -> ArenaLeases:
        """LEASE ``keys`` (chunks on other nodes are pulled here first) and keep them held
        with the leases a ``release_later`` block or an earlier ``hold`` left, until
        ``release_pending`` or the next call that is not a ``hold``: an engine copies one
        slice of a long prefix while the next is pulled, and releases all after its first
        token."""
        ttl = self._lease_ttl(ttl_s)
        with self._lock:
            leases, held = self._lease_locked(keys, tenant, ttl, keep_pending=True)
            self._pend(held)
            return self._arena_leases(leases)

    def release_pending(self) -> None:
        """Release the leases ``release_later`` blocks left held (one frame, no round trip)."""
        with self._lock:
            self._release_pending_locked()

    def pending_leases(self) -> int:
        """Leases ``release_later`` blocks and ``hold`` left held, of every thread."""
        with self._lock:
            return sum(len(ids) for ids in self._unreleased.values())

    def _pend(self, held: list[int]) -> None:
        self._unreleased.setdefault(threading.get_ident(), []).extend(held)

    def _release_pending_locked(self) -> None:
        """Release this thread's pending leases, and those of threads that have ended."""
        me = threading.get_ident()
        others = [i for i in self._unreleased if i != me]
        alive = {t.ident for t in threading.enumerate()} if others else set()
        held: list[int] = self._unreleased.pop(me, [])
        for ident in others:
            if ident not in alive:
                held += self._unreleased.pop(ident)
        self._release_locked(held)

    def _lease_ttl(self, ttl_s: float | None) -> float:
        """The ttl a lease is asked for (the agent's ``lease_seconds`` by default); raises
        AgentError where leases cannot be had (TCP, or shm off)."""
        if not self.shm:
            raise AgentError("leases need the agent's Unix socket with shared memory (shm on)")
        return float(self.info.get("lease_seconds", 10.0)) if ttl_s is None else ttl_s

    def _arena_leases(self, leases: list[tuple[LeasedChunk | None, str]]) -> ArenaLeases:
        with self._mappings_lock:  # a ``close`` from another thread drops the arena
            if self.closed:  # since the leases were answered: they ended with the connection
                raise AgentError(CLOSED_MESSAGE)
            arena = self._arena
        return ArenaLeases(
            arena=arena,
            generation=self._arena_gen,
            chunks=[c for c, _ in leases],
            missing=frozenset(i for i, (_, st) in enumerate(leases) if st == "missing"),
            remote=frozenset(i for i, (_, st) in enumerate(leases) if st == "remote"),
            _client=weakref.ref(self),
        )

    def is_isolated(self, tenant: str) -> bool:
        """Whether the agent keeps ``tenant``'s chunks to itself (salted keys, never shared)."""
        meta, _ = self._call(Op.TENANT, MetaWriter().text(tenant).build())
        return meta[:1] == b"\x01"

    def namespace(self, model_id: str, layout: KVLayout, tenant: str) -> Namespace:
        """The key namespace the agent uses for ``tenant``'s requests to this model: isolated
        tenants get their own salt, shared ones the common namespace."""
        return Namespace(model_id, layout, tenant if self.is_isolated(tenant) else "")

    def exists(self, keys: Sequence[bytes], *, tenant: str = "") -> list[str | None]:
        """Tier of each key, without counting a lookup."""
        meta, _ = self._call(Op.EXISTS, MetaWriter().text(tenant).keys(keys).build())
        r = MetaReader(meta)
        return list(map(self._tier_table.__getitem__, r.take(r.count())))

    def fetch(
        self,
        keys: Sequence[bytes],
        *,
        tenant: str = "",
        payload: bool = True,
        into: Callable[[int, ChunkMeta], memoryview | None] | None = None,
        arrived: Callable[[int, ChunkMeta, bytearray | memoryview], None] | None = None,
        checksums: list[int | None] | None = None,
        max_chunk_bytes: int | None = None,
        keep: bool = True,
    ) -> list[tuple[ChunkMeta, bytearray | memoryview | None] | None]:
        """Chunks with their metadata (owner tenant, parent, tokens, isolation), for agents
        pulling from a pool agent or a peer; None where missing or not visible to ``tenant``.
        ``payload=False`` asks for the metadata only (moves no bytes, counts nothing).
        ``into(i, meta)``, asked just before chunk ``i``'s bytes are read, gives the writable
        view of exactly ``meta.size_bytes`` they are received into (None: a new bytearray).
        ``arrived(i, meta, data)`` runs as each chunk lands, before the rest have arrived.
        A failing ``into`` or ``arrived`` is raised after the reply is read to its end: a
        chunk whose view was given but which did not arrive was not (wholly) written.
        ``checksums``, given with the payload, asks for each chunk's XXH3-64 as the agent
        computed it from the bytes it sent, and is filled (one per key) before the first chunk
        lands: None for a missing chunk, and for all of them where the agent does not offer
        checksums (no ``fetch_checksum`` in its HELLO: an agent before them). Verifying is the
        caller's, where the bytes landed (``protocol.fetch_checksum``).
        ``max_chunk_bytes``: the most this side takes for one chunk (its own limit, as for a
        PUT): a reply with a larger item is refused, its connection closed, before any chunk
        is read. The agent's HELLO bounds it too, but that is the answering side's word, and
        a hostile or broken peer names none, or any. ``keep=False`` (with ``arrived``): each
        chunk's buffer is let go once ``arrived`` returns (the answer holds no bytes), so a
        reply of many chunks the caller drops is never all held at once."""
        metas: list[ChunkMeta | None] = []
        # asked only of an agent that offers them: one before them would take the flag for
        # "send the payload" and answer without the checksums
        want_checksums = (
            payload
            and checksums is not None
            and self.info.get("fetch_checksum") == FETCH_CHECKSUM_NAME
        )
        bufs: dict[int, bytearray | memoryview] = {}

        def sizes_of(reply: bytes) -> list[tuple[int, int]]:
            r = MetaReader(reply)
            for key in keys[: r.count()]:
                status, size, tokens, priority, flags, parent, created_s = r.structs(FETCH_ITEM, 1)[
                    0
                ]
                owner = r.text()
                metas.append(
                    None
                    if status != Status.OK
                    else ChunkMeta(
                        key=key,
                        size_bytes=size,
                        tokens=tokens,
                        tenant=owner,
                        parent=parent if flags & FLAG_HAS_PARENT else None,
                        priority=priority,
                        isolated=bool(flags & FLAG_ISOLATED),
                        created_s=created_s,
                    )
                )
            if len(metas) != len(keys):
                raise AgentError(f"FETCH reply has {len(metas)} items for {len(keys)} keys")
            if checksums is not None:
                sums = parse_fetch_checksums(r, len(metas)) if want_checksums else []
                checksums[:] = [
                    sums[i] if sums and m is not None else None for i, m in enumerate(metas)
                ]
            if not payload:
                return []
            return [(i, m.size_bytes) for i, m in enumerate(metas) if m is not None]

        def target(i: int, size: int) -> memoryview:
            meta = metas[i]
            view = None if into is None or meta is None else into(i, meta)
            if view is None:
                bufs[i] = bytearray(size)
                return memoryview(bufs[i])
            if view.nbytes != size:
                raise ValueError(f"chunk {i} is {size} bytes; its buffer holds {view.nbytes}")
            bufs[i] = view
            return view

        def landed(i: int) -> None:
            meta = metas[i]  # only chunks with metadata carry bytes
            if arrived is not None and meta is not None:
                try:
                    arrived(i, meta, bufs[i])
                finally:
                    if not keep:
                        del bufs[i]

        flags = fetch_flags(payload=payload, checksums=want_checksums)
        w = MetaWriter().text(tenant).u8(flags).keys(keys)
        self._call(
            Op.FETCH,
            w.build(),
            into=target,
            sizes_of=sizes_of,
            arrived=landed,
            max_chunk_bytes=max_chunk_bytes,
        )
        return [None if m is None else (m, bufs.get(i)) for i, m in enumerate(metas)]

    def lookup(self, keys: Sequence[bytes], *, tenant: str = "") -> LookupResult:
        """Longest cached prefix of a key chain and the tier of each key (counts hits)."""
        meta, _ = self._call(Op.LOOKUP, MetaWriter().text(tenant).keys(keys).build())
        return self._lookup_result(MetaReader(meta))

    def lookup_many(
        self, chains: Sequence[Sequence[bytes]], *, tenant: str = ""
    ) -> list[LookupResult]:
        """``lookup`` of many chains in one round trip (a scheduler placing a batch), of at
        most ``MAX_LOOKUP_MANY_KEYS`` keys in all (ValueError beyond, nothing sent). An empty
        chain is a miss the agent does not count as a lookup."""
        n_keys = sum(map(len, chains))
        if n_keys > MAX_LOOKUP_MANY_KEYS:
            raise ValueError(f"at most {MAX_LOOKUP_MANY_KEYS} keys per lookup_many, got {n_keys}")
        w = MetaWriter().text(tenant).u32(len(chains))
        for keys in chains:
            w.keys(keys)
        meta, _ = self._call(Op.LOOKUP_MANY, w.build())
        r = MetaReader(meta)
        return [self._lookup_result(r) for _ in range(r.count())]

    def report_rates(
        self,
        prefill: Sequence[tuple[int, int, float]] = (),
        *,
        host_to_device_bytes_per_s: float | None = None,
        model: str = "",
    ) -> dict[str, object]:
        """Tell the agent what this engine measured, for its fetch-or-recompute decision:
        ``prefill`` samples ``(computed_tokens, cached_prefix_tokens, seconds)`` and the host ->
        device copy rate (None: not measured, e.g. a CPU engine). Returns the agent's prefill
        figure after the report: ``kept``, ``tokens_per_s``, ``beta_s_per_token2``, ``basis``.
        A bad figure (NaN, negative, absurd) raises RequestError and keeps nothing."""
        meta, _ = self._call(Op.RATES, rates_meta(prefill, host_to_device_bytes_per_s, model))
        return parse_rates_reply(meta)

    def _lookup_result(self, r: MetaReader) -> LookupResult:
        matched, matched_tokens, n = r.u32(), r.u64(), r.count()
        locations = tuple(map(self._tier_table.__getitem__, r.take(n)))
        return LookupResult(n, matched, locations, matched_tokens)

    def close(self) -> None:
        # not under ``_lock``: a call blocked on a dead agent holds it until its socket times
        # out. A call that gets a mapping meanwhile (an ATTACH, a MAP answered) takes
        # ``_mappings_lock`` to keep it, finds the client closed, and unmaps it itself.
        with self._mappings_lock:
            if self.closed:
                return
            self.closed = True
            if self._staging is not None and self.on_staging is not None:
                self.on_staging(None)
            # dropped even where closing fails: a view still held (an engine's tensor over the
            # arena) keeps the mapping until that view goes, and a closed client kept alive (a
            # writer's source connection, a test's local) must not keep it, a whole arena,
            # beyond that
            mappings, self._arena, self._staging = (self._arena, self._staging), None, None
            for m in mappings:
                if m is not None:
                    with contextlib.suppress(BufferError):
                        m.close()
            staging_fd, self._staging_fd = self._staging_fd, -1
            if staging_fd >= 0:
                os.close(staging_fd)
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> DataClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- requests ---------------------------------------------------------------------------
    def _hello(self, token: str, client_name: str) -> dict[str, Any]:
        meta, _ = self._call(Op.HELLO, MetaWriter().text(token).text(client_name).build())
        try:
            info = json_text.loads(meta)
        except ValueError:
            info = None
        tiers = info.get("tiers") if isinstance(info, dict) else None
        if not isinstance(tiers, list) or not all(isinstance(t, str) for t in tiers):
            # whatever listens there answered in frames, but not as an agent does
            raise AgentError(
                "the HELLO reply names no tiers: not a kvctl agent's data plane "
                f"(it began {bytes(meta[:40])!r})"
            )
        return dict(info)

    def _call(
        self,
        op: Op,
        meta: bytes,
        payload: Sequence[memoryview] = (),
        *,
        into: Callable[[int, int], memoryview] | None = None,
        sizes_of: Callable[[bytes], list[tuple[int, int]]] | None = None,
        arrived: Callable[[int], None] | None = None,
        max_chunk_bytes: int | None = None,
    ) -> tuple[bytes, int]:
        """Send a request, read the reply's metadata; with ``into``, also read its payload
        (no item larger than ``max_chunk_bytes``, when given, nor than the agent's)."""
        with self._lock:
            return self._call_locked(
                op,
                meta,
                payload,
                into,
                sizes_of=sizes_of,
                arrived=arrived,
                max_chunk_bytes=max_chunk_bytes,
            )

    def _call_locked(
        self,
        op: Op,
        meta: bytes,
        payload: Sequence[memoryview],
        into: Callable[[int, int], memoryview] | None,
        fd: int = -1,
        *,
        sink: memoryview | None = None,
        sink_bytes: int = 0,
        sizes_of: Callable[[bytes], list[tuple[int, int]]] | None = None,
        arrived: Callable[[int], None] | None = None,
        keep_pending: bool = False,
        max_chunk_bytes: int | None = None,
    ) -> tuple[bytes, int]:
        """``into``: where a GET reply's chunks go. ``sink``: a scratch buffer that a reply's
        payload of exactly ``sink_bytes`` is read into, piece by piece, and dropped (PROBE
        downloads; any other length is refused, so a rogue peer cannot stream without end).
        ``keep_pending``: the leases a ``release_later`` block left stay held (``hold``)."""
        if self.closed:
            raise AgentError(CLOSED_MESSAGE)
        if self._unreleased and op != Op.RELEASE and not keep_pending:
            self._release_pending_locked()  # this thread's (another engine's stay held)
        self._rid = (self._rid + 1) & 0xFFFFFFFF
        total = sum(v.nbytes for v in payload)
        limit_s: float | None = getattr(self._limits, "seconds", None)
        wait_s = self._sock.gettimeout()
        try:
            if limit_s is not None:
                self._call_end_s = time.monotonic() + limit_s
                self._sock.settimeout(limit_s)
            # the request's send is within the call's deadline too: an agent taking a PUT's
            # payload a little at a time held the caller for as long as it kept reading
            send_all(
                self._sock,
                [pack_header(op, self._rid, len(meta), total), meta, *payload],
                fd,
                end_s=self._call_end_s if limit_s is not None else None,
            )
            if op == Op.RELEASE:
                return b"", 0
            head = bytearray(HEADER_BYTES)
            self._recv(memoryview(head))
            # checked before allocating: a peer that is not an agent (a probe can name any
            # address) must not make this side allocate up to 4 GiB of "metadata"
            rop, rid, meta_len, payload_len = check_header(head, max_payload_bytes=_ANY_PAYLOAD)
            reply = bytearray(meta_len)
            self._recv(memoryview(reply))
            if rop == (op | REPLY_BIT) and rid == self._rid:
                if into is not None:
                    self._read_payload(
                        bytes(reply),
                        payload_len,
                        into,
                        sizes_of or _get_sizes,
                        arrived,
                        max_chunk_bytes,
                    )
                    payload_len = 0
                elif sink is not None and payload_len == sink_bytes:
                    self._drain(payload_len, sink)
                    payload_len = 0
        except TimeoutError as exc:
            self.close()
            within_s = limit_s if limit_s is not None else wait_s
            raise AgentTimeout(
                f"the agent did not answer {op.name} within {within_s:.3g} s; connection closed"
            ) from exc
        except (PeerClosed, OSError) as exc:
            if self.closed:  # by ``close`` from another thread: its socket, not the agent's
                raise AgentError(CLOSED_MESSAGE) from exc
            self.close()
            raise AgentUnreachable(f"lost the connection to the agent: {exc}") from exc
        except FrameError as exc:
            self.close()
            raise AgentError(
                f"the peer does not speak the kvctl data plane ({exc.message}); connection closed"
            ) from None
        finally:
            if limit_s is not None:
                self._call_end_s = None
                if not self.closed:
                    self._sock.settimeout(wait_s)
        if rop == Op.ERROR:
            code, message = parse_error(bytes(reply))
            if code in CLOSING_ERROR_CODES:
                self.close()  # the agent closes the connection after these
            if code == ErrorCode.UNAUTHORIZED:
                raise AuthError(f"the agent refused this client: {message}")
            if code == ErrorCode.NO_ROOM:
                raise NoRoom(message, code)
            if code == ErrorCode.NOT_FOUND:
                raise ChunkNotFound(message)
            raise RequestError(message, code)
        if rop != (op | REPLY_BIT) or rid != self._rid:
            self.close()
            raise AgentError(f"reply out of step (op {rop}, request {rid}); connection closed")
        if payload_len:
            self.close()
            raise AgentError("unexpected payload in a reply; connection closed")
        return bytes(reply), payload_len

    def _recv(self, view: memoryview) -> None:
        if self._call_end_s is not None:
            self._recv_by(view, self._call_end_s)
        elif self.transport == "unix":
            if not recv_with_fds(self._sock, view, self._fds):
                raise PeerClosed("the agent closed the connection")
        else:
            recv_exactly(self._sock, view)

    def _recv_by(self, view: memoryview, end_s: float) -> None:
        """``_recv`` that ends by ``end_s`` (monotonic) or raises TimeoutError: each read waits
        only for what is left of the call's deadline, so a reply that trickles is cut off too."""
        got, n = 0, view.nbytes
        while got < n:
            left_s = end_s - time.monotonic()
            if left_s <= 0:
                raise TimeoutError("timed out")
            self._sock.settimeout(left_s)
            if self.transport == "unix":
                k = recv_some_with_fds(self._sock, view[got:], self._fds)
            else:
                k = self._sock.recv_into(view[got:], n - got)
            if k == 0:
                raise PeerClosed(f"the agent closed the connection after {got} of {n} bytes")
            got += k

    def _read_payload(
        self,
        meta: bytes,
        payload_len: int,
        into: Callable[[int, int], memoryview],
        sizes_of: Callable[[bytes], list[tuple[int, int]]],
        arrived: Callable[[int], None] | None,
        max_chunk_bytes: int | None = None,
    ) -> None:
        """Read a reply's chunks straight into the buffers ``into(i, size)`` gives, each asked
        for just before its bytes are read, calling ``arrived(i)`` as each one lands: a puller
        starts on the first chunk before the last arrives (and before buffers for the rest
        exist). A failing ``into`` or callback is reported after the stream is read to its
        end, so the connection stays in step. ``max_chunk_bytes``: the caller's own bound on
        an item (the agent's HELLO is its own word on it)."""
        failure: BaseException | None = None
        items = sizes_of(meta)
        declared = sum(size for _, size in items)
        largest = max((size for _, size in items), default=0)
        theirs = self.info.get("max_chunk_bytes")
        limits = {"this side's": max_chunk_bytes, "the agent's": theirs}
        over = [
            f"{whose} {limit}-byte chunks"
            for whose, limit in limits.items()
            if isinstance(limit, int) and not isinstance(limit, bool) and largest > limit
        ]
        if declared != payload_len or over:
            # a reply whose items and payload disagree (a corrupt size, a rogue peer), or an
            # item larger than either side takes, would have this side allocate what the item
            # claims: closed before any is read
            self.close()
            raise AgentError(
                (
                    f"a reply item of {largest} bytes is larger than {over[0]}"
                    if over
                    else f"reply items declare {declared} bytes but its payload carries "
                    f"{payload_len}"
                )
                + "; connection closed"
            )
        left = payload_len
        for i, size in items:
            try:
                view = into(i, size)
            except BaseException as exc:
                failure = exc
                break
            self._recv(view)
            left -= size
            if arrived is not None:
                try:
                    arrived(i)
                except Exception as exc:
                    failure = exc
                    break
        if failure is not None:
            self._discard(left)
            raise failure
        if left:
            self._discard(left)  # back in step, then refuse a reply that broke its own items
            raise AgentError(f"reply payload has {left} bytes its items do not account for")

    def _discard(self, n: int) -> None:
        self._drain(n, memoryview(bytearray(min(n, 1 << 20) or 1)))

    def _drain(self, n: int, scratch: memoryview) -> None:
        """Read ``n`` bytes of the stream into ``scratch`` (reused) and drop them."""
        while n:
            k = min(n, scratch.nbytes)
            self._recv(scratch[:k])
            n -= k

    def _outcomes(self, meta: bytes) -> list[PutOutcome]:
        r = MetaReader(meta)
        n = r.count()
        raw = r.rest()
        return [
            PutOutcome(
                _STATUS_NAMES.get(Status(raw[2 * i]), "bad"), self._tier_table[raw[2 * i + 1]]
            )
            for i in range(n)
        ]

    # --- socket path --------------------------------------------------------------------------
    @property
    def takes_get_counted(self) -> bool:
        """The agent serves a GET_COUNTED re-read without counting it again (``get_counted``
        in its HELLO)."""
        return self.info.get("get_counted") is True

    @overload
    def _get_socket(
        self, keys: Sequence[bytes], tenant: str, outs: None, *, counted: bool = False
    ) -> list[bytearray | None]: ...
    @overload
    def _get_socket(
        self,
        keys: Sequence[bytes],
        tenant: str,
        outs: Sequence[memoryview],
        *,
        counted: bool = False,
    ) -> list[int | None]: ...
    @overload
    def _get_socket(
        self,
        keys: Sequence[bytes],
        tenant: str,
        outs: Sequence[memoryview] | None,
        *,
        counted: bool = False,
    ) -> list[bytearray | None] | list[int | None]: ...
    def _get_socket(
        self,
        keys: Sequence[bytes],
        tenant: str,
        outs: Sequence[memoryview] | None,
        *,
        counted: bool = False,
    ) -> list[bytearray | None] | list[int | None]:
        """The chunks in new buffers (``outs`` None), else read into ``outs`` (their sizes);
        None where not cached. ``counted``: a LEASE of this read counted them as served
        already, so the GET says so (GET_COUNTED) to an agent that takes it; an agent before
        it gets the plain GET and counts them a second time."""
        results: list[Any] = [None] * len(keys)  # the overloads say which, by ``outs``

        def target(i: int, size: int) -> memoryview:
            if outs is None:
                buf = bytearray(size)
                results[i] = buf
                return memoryview(buf)
            if outs[i].nbytes < size:
                raise ValueError(f"buffer {i} holds {outs[i].nbytes} bytes; the chunk is {size}")
            results[i] = size
            return outs[i][:size]

        meta = get_meta(tenant, keys, counted=counted and self.takes_get_counted)
        self._call(Op.GET, meta, into=target)
        return results

    # --- shared-memory path -------------------------------------------------------------------
    def shared_arena(self) -> mmap.mmap | None:
        """The agent's shared arena, mapped read-only (now, if no lease has mapped it yet); None
        without shared memory (TCP, shm off). An engine asks at start so that preparing the
        mapping (registering it with CUDA pins every page: seconds for a few GiB) is not paid
        by its first request. A later lease maps the arena anew if the agent resized it."""
        if not self.shm:
            return None
        with self._lock:
            if self._arena is None:
                self._map_arena()
            return self._arena

    def _map_arena(self) -> None:
        # inside a lease's reply: the leases pending beside it (``hold``) stay held
        meta, _ = self._call_locked(Op.MAP, b"", (), None, keep_pending=True)
        r = MetaReader(meta)
        generation, size = r.u64(), r.u64()
        if len(self._fds) != 1:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
            raise AgentError("the agent did not pass its arena descriptor")
        fd = self._fds.pop()
        try:
            arena = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        hugepages.advise(arena)  # this mapping too, where the agent's pages are huge
        with self._mappings_lock:
            if self.closed:  # by another thread since the MAP was answered: not kept
                arena.close()
                raise AgentError(CLOSED_MESSAGE)
            if self._arena is not None:
                with contextlib.suppress(BufferError):
                    self._arena.close()
            self._arena, self._arena_gen = arena, generation

    def _lease_locked(
        self, keys: Sequence[bytes], tenant: str, ttl_s: float, *, keep_pending: bool = False
    ) -> tuple[list[tuple[LeasedChunk | None, str]], list[int]]:
        """LEASE the keys (see ``_leases_locked``)."""
        meta, _ = self._call_locked(
            Op.LEASE,
            MetaWriter().text(tenant).f64(ttl_s).keys(keys).build(),
            (),
            None,
            keep_pending=keep_pending,
        )
        return self._leases_locked(MetaReader(meta))

    def _leases_locked(
        self, r: MetaReader
    ) -> tuple[list[tuple[LeasedChunk | None, str]], list[int]]:
        """The leases a reply holds (u32 n, n x LEASE_ITEM): each key's place in the arena (or
        None) with its status ("ok", "missing", "remote": on another node, not pulled,
        "fallback": cached but not leasable here), and the lease ids to release. Maps the
        arena anew when the agent resized it."""
        items = r.structs(LEASE_ITEM, r.count())
        held = [lease_id for status, _, lease_id, *_ in items if status == Status.OK]
        try:
            # one reply can hold leases of two arena generations (the agent resized its arena
            # while it read part of the batch from disk): map the newest, and a lease in any
            # other generation is read over the socket, never at its offset in the new mapping
            newest = max((gen for status, gen, *_ in items if status == Status.OK), default=None)
            if newest is not None and newest != self._arena_gen:
                self._map_arena()
        except BaseException:
            self._release_locked(held)
            raise
        out: list[tuple[LeasedChunk | None, str]] = []
        for status, gen, _lease_id, off, size, deadline in items:
            if status == Status.MISSING:
                out.append((None, "missing"))
            elif status == Status.REMOTE:
                out.append((None, "remote"))
            elif status != Status.OK or gen != self._arena_gen:
                out.append((None, "fallback"))
            else:
                out.append((LeasedChunk(off, size, deadline), "ok"))
        return out, held

    def _release_locked(self, lease_ids: Sequence[int]) -> None:
        if not lease_ids or self.closed:
            return
        w = MetaWriter().u32(len(lease_ids))
        for lease_id in lease_ids:
            w.u64(lease_id)
        self._call_locked(Op.RELEASE, w.build(), (), None)

    @overload
    def _get_leased(
        self, keys: Sequence[bytes], tenant: str, outs: None = None
    ) -> list[bytearray | None]: ...
    @overload
    def _get_leased(
        self, keys: Sequence[bytes], tenant: str, outs: Sequence[memoryview]
    ) -> list[int | None]: ...
    def _get_leased(
        self,
        keys: Sequence[bytes],
        tenant: str,
        outs: Sequence[memoryview] | None = None,
    ) -> list[bytearray | None] | list[int | None]:
        """``_get_socket`` through leases on the shared arena; chunks that cannot be leased,
        or whose lease ran out during the copy, go over the socket (GET_COUNTED: the LEASE
        counted them as served, and the re-read must not count them again)."""
        ttl = self._lease_ttl(None)
        results: list[Any] = [None] * len(keys)
        retry: list[int] = []
        with self._lock:
            leases, held = self._lease_locked(keys, tenant, ttl)
            try:
                # a ``close`` from another thread closes the arena unless a view of it is held:
                # the view is taken under its lock, or the client found closed
                with self._mappings_lock:
                    if self.closed:
                        raise AgentError(CLOSED_MESSAGE)
                    arena = memoryview(self._arena) if held and self._arena is not None else None
                for i, (chunk, status) in enumerate(leases):
                    if chunk is None or arena is None:  # a held chunk means a mapped arena
                        if status == "fallback":
                            retry.append(i)
                        continue
                    src = arena[chunk.offset : chunk.offset + chunk.size_bytes]
                    size = chunk.size_bytes
                    if outs is None:
                        dst = bytearray(size)
                        copy_bytes(memoryview(dst), src)
                        results[i] = dst
                    else:
                        if outs[i].nbytes < size:
                            raise ValueError(
                                f"buffer {i} holds {outs[i].nbytes} bytes; need {size}"
                            )
                        copy_bytes(outs[i][:size], src)
                        results[i] = size
                    src.release()
                    # the agent may reuse the bytes after the deadline: a copy that ended later
                    # cannot be trusted, so it is fetched again
                    if time.monotonic() >= chunk.deadline_s:
                        results[i] = None
                        retry.append(i)
                if arena is not None:
                    arena.release()
                # a ``close`` from another thread during the copies ended the leases with the
                # connection: the agent may have given those bytes to another chunk meanwhile,
                # so nothing copied is kept (``closed`` is set before the socket closes)
                if self.closed:
                    raise AgentError(CLOSED_MESSAGE)
            finally:
                self._release_locked(held)
        if retry:
            again = self._get_socket(
                [keys[i] for i in retry],
                tenant,
                None if outs is None else [outs[i] for i in retry],
                counted=True,
            )
            for i, got in zip(retry, again, strict=True):
                results[i] = got
        return results

    def _ensure_staging(self, size: int) -> mmap.mmap | None:
        """The staging segment, at least ``size`` bytes, attached to the agent; None where the
        put goes over the socket instead: this system cannot seal a segment, or the agent maps
        none (for the life of the connection), or a new segment could not be made (ENOMEM...)
        or the agent refused it (for a while: ``_staging_failed``). A segment that could not be
        replaced by a larger one still serves the puts that fit it. The agent maps only
        segments sealed against shrinking: a file that could shrink under its mapping would
        crash it."""
        with self._mappings_lock:  # ``close`` from another thread closes the segment
            if self.closed:
                raise AgentError(CLOSED_MESSAGE)
            held_bytes = len(self._staging) if self._staging is not None else 0
            if self._staging is not None and held_bytes >= size:
                return self._staging
        # no floor: the segment is written in full before it is attached (``_sealed_segment``),
        # so every byte of it is this client's memory, and takes the time to write, from the
        # first put (a 64 MiB floor made a 4 KiB put cost 64 MiB and some 70 ms). Doubling keeps
        # the segments a client replaces as its puts grow few; where memory is short, the
        # doubled size is refused first and only what this put needs is tried.
        need = -(-max(size, 1) // STAGING_UNIT_BYTES) * STAGING_UNIT_BYTES
        want = max(need, 2 * held_bytes)
        # backing off after a failure: one try per interval, not one per put. A failure for
        # want of memory (here or in the agent) holds back only segments as large as the one
        # that failed: a smaller one may well be had, and is tried at once (until one fails too)
        below_bytes: float = math.inf
        in_back_off = self._monotonic_s() < self._staging_retry_at_s
        if in_back_off:
            if self._staging_refused_bytes is None:
                return None
            below_bytes = self._staging_refused_bytes
        sizes = [n for n in dict.fromkeys((want, need)) if n < below_bytes]
        if not sizes:
            return None
        failure, to_do, refused_bytes = "", "", None
        for attempt_bytes in sizes:
            try:
                fd, staging = _sealed_segment(attempt_bytes)
            except _CannotSeal:
                self._staged_puts = False
                return None
            except OSError as exc:
                failure = f"could not make a staging segment of {attempt_bytes} bytes here: {exc}"
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    # a segment takes descriptors (its memfd, and mmap's dup of it): where this
                    # process is at its open files limit, memory is not what to raise, and a
                    # smaller segment fails the same
                    to_do, refused_bytes = _CLIENT_DESCRIPTORS_TO_DO, None
                    break
                to_do, refused_bytes = _CLIENT_MEMORY_TO_DO, attempt_bytes
                continue
            try:
                self._call_locked(Op.ATTACH, MetaWriter().u64(attempt_bytes).build(), (), None, fd)
            except BaseException as exc:
                staging.close()
                os.close(fd)
                if not isinstance(exc, RequestError) or exc.code not in (
                    ErrorCode.BAD_REQUEST,
                    ErrorCode.UNSUPPORTED,
                ):
                    raise
                if exc.code == ErrorCode.UNSUPPORTED:  # an agent that maps no segment at all
                    self._staged_puts = False
                    return None
                reason = str(exc).strip() or "it gave no reason"
                failure = (
                    f"the agent refused this client's staging segment of {attempt_bytes} bytes "
                    f"({reason})"
                )
                to_do = (
                    f"see the agent's log, which says what to do; this SDK is kvctl {__version__}, "
                    f"the agent kvctl {self.info.get('version', '(unknown)')}"
                )
                if not _refused_for_memory(reason):
                    refused_bytes = None  # any other cause refuses a smaller segment the same
                    break
                refused_bytes = attempt_bytes
                continue
            if refused_bytes is not None:
                # the doubled size failed for want of memory and this one attached: the doubled
                # size is held back all the same, else each later growth would make (fill and
                # send) a doomed doubled segment before asking for what its put needs
                self._held_back_above(refused_bytes, failure, attempt_bytes)
            return self._attached(fd, staging)
        if in_back_off and refused_bytes is not None:
            # tried at once below a size refused in this back-off, and refused too: memory is
            # short beyond the larger size, so no more tries (one per 2 MiB step down) until
            # the back-off runs out
            refused_bytes = None
        self._staging_failed(failure, to_do, refused_bytes)
        return None

    def _back_off(self, refused_bytes: int | None) -> tuple[float, float]:
        """Count one more staging failure in the row and hold back ``refused_bytes`` and larger
        (None: every size) until a delay that doubles with each failure has passed; the time
        now and that delay, both in seconds."""
        now_s = self._monotonic_s()
        self._staging_failures += 1
        self._staging_refused_bytes = refused_bytes
        delay_s = staging_retry_delay_s(self._staging_failures)
        self._staging_retry_at_s = now_s + delay_s
        return now_s, delay_s

    def _held_back_above(self, refused_bytes: int, what: str, attached_bytes: int) -> None:
        """A segment of ``attached_bytes`` is about to attach after a larger one failed for want
        of memory (``what``): sizes from ``refused_bytes`` up wait out a back-off, as where
        none attached, and ``_attached`` ends none for a smaller segment. Said once a row (at
        INFO: no put goes over the socket for it). A row this attach escapes (as ``_attached``
        would have judged it before this back-off) ends first: its 'resumed' line is said, and
        this back-off starts a row of its own."""
        self._end_row_escaped_by(attached_bytes)
        _, delay_s = self._back_off(refused_bytes)
        if self._staging_failures == 1:
            log.info(
                "%s; one of %d bytes, what the put needs, attached instead, and segments of %d "
                "bytes or more are not tried for %g s",
                what,
                attached_bytes,
                refused_bytes,
                delay_s,
            )

    def _end_row_escaped_by(self, attached_bytes: int) -> None:
        """A segment of ``attached_bytes`` attaches: the row of failures ends (back-off and all)
        unless that size is smaller than one the back-off holds back for want of memory (larger
        ones still wait it out, and a failure then counts in the same row). 'Resumed' is said
        only where a WARNING said puts go over the socket (``_staging_failed``): a row of
        doubled sizes held back alone (``_held_back_above``) sent none there."""
        if self._staging_refused_bytes is not None and attached_bytes < self._staging_refused_bytes:
            return
        if self._staging_logged_at_s > -math.inf:
            log.info(
                "staged puts resumed: a staging segment of %d bytes attached after %d failure(s)",
                attached_bytes,
                self._staging_failures,
            )
        self._staging_failures, self._staging_retry_at_s = 0, -math.inf
        self._staging_logged_at_s = -math.inf
        self._staging_refused_bytes = None

    def _attached(self, fd: int, staging: mmap.mmap) -> mmap.mmap:
        """Keep a segment the agent attached in place of the one held (``_ensure_staging``)."""
        with self._mappings_lock:
            if self.closed:  # by another thread since the ATTACH was answered: not kept
                staging.close()
                os.close(fd)
                raise AgentError(CLOSED_MESSAGE)
            self._end_row_escaped_by(len(staging))
            if self._staging is not None:
                if self.on_staging is not None:
                    self.on_staging(None)
                self._staging.close()
                os.close(self._staging_fd)
            self._staging, self._staging_fd = staging, fd
            if self.on_staging is not None:
                self.on_staging(staging)
        return staging

    def _staging_failed(self, what: str, to_do: str, refused_bytes: int | None = None) -> None:
        """A new staging segment could not be had (``what``): puts that do not fit the one held
        (if any) go over the socket, and a new one is tried after a delay that doubles with each
        failure in a row. The first failure of a row is logged (with ``to_do``), then one line
        every STAGING_RELOG_SECONDS while the row lasts, not each: a row resets only when a
        segment attaches, so a shortage hours after the first would otherwise go unsaid.
        ``refused_bytes``: the smallest size refused for want of memory (None: another cause,
        such as descriptors, which a smaller segment does not escape, or a second size refused
        for memory in one back-off); the back-off holds back only sizes from it up
        (``_ensure_staging``)."""
        # the row's first line (a row may have begun with doubled sizes held back, said at INFO
        # only: no put went over the socket until now)
        first_line = self._staging_logged_at_s == -math.inf
        now_s, delay_s = self._back_off(refused_bytes)
        if now_s - self._staging_logged_at_s < STAGING_RELOG_SECONDS:
            return
        self._staging_logged_at_s = now_s
        with self._mappings_lock:  # not a segment ``close`` from another thread closed
            held = f"{len(self._staging)} bytes" if self._staging is not None else "none"
        if first_line:
            log.warning(
                "%s; puts larger than the segment this client holds (%s) go over the Unix socket,"
                " more slowly, and a new one is tried in %g s (then less often while it fails). "
                "If this persists, %s",
                what,
                held,
                delay_s,
                to_do,
            )
        else:
            log.warning(
                "%s (%d failures in a row, none as large attached since the first); puts larger "
                "than the segment this client holds (%s) still go over the Unix socket, more "
                "slowly, and a new one is tried in %g s. %s",
                what,
                self._staging_failures,
                held,
                delay_s,
                to_do[0].upper() + to_do[1:],
            )


#: after a staging segment could not be made or was refused, puts that need a new one go over
#: the socket, and one is tried again this long later; the delay doubles with each failure in a
#: row, up to STAGING_RETRY_MAX_SECONDS (each try costs a segment's allocation, so not each put)
STAGING_RETRY_FIRST_SECONDS = 1.0
STAGING_RETRY_MAX_SECONDS = 120.0
#: while staging segments keep failing, the failures are logged again this often (the first of
#: a row at once), so a shortage that comes back hours later is said again
STAGING_RELOG_SECONDS = 600.0


def staging_retry_delay_s(failures: int) -> float:
    """How long after the ``failures``-th failure in a row to get a staging segment (1 or more)
    puts wait before a new one is tried."""
    doublings = min(max(failures, 1) - 1, 32)  # past the cap long before: no huge powers
    return min(STAGING_RETRY_FIRST_SECONDS * (1 << doublings), STAGING_RETRY_MAX_SECONDS)


class _CannotSeal(OSError):
    """This system cannot make a sealed staging segment at all (not Linux, a kernel before
    memfd or F_SEAL_FUTURE_WRITE): puts go over the socket for the life of the connection."""


#: staging segments are sized in multiples of this (the smallest is one): a huge page, so a
#: segment can be backed by huge pages where the host allows them for shared memory
STAGING_UNIT_BYTES = 2 << 20


def _sealed_segment(size_bytes: int) -> tuple[int, mmap.mmap]:
    """A new staging segment of ``size_bytes``: a memfd written in full, mapped writable here,
    then sealed against shrinking, growing, punching holes and any write access but this
    mapping's (what an agent needs to map it safely: reading a hole through its mapping would
    allocate it there). Its descriptor and this mapping; OSError where the system has no memfd
    or seals (not Linux) or cannot allocate it."""
    import fcntl  # POSIX only; the data plane's shared-memory path is Linux only

    add_seals = getattr(fcntl, "F_ADD_SEALS", None)
    if not hasattr(os, "memfd_create") or add_seals is None:
        raise _CannotSeal("this system cannot seal a memfd")
    try:
        fd = os.memfd_create("kvctl-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        if exc.errno in (errno.ENOSYS, errno.EINVAL):  # a kernel before memfd or its seals
            raise _CannotSeal(f"this system cannot make a sealable memfd: {exc}") from exc
        raise  # out of descriptors (EMFILE, ENFILE) or memory: worth another try later
    staging = None
    try:
        os.ftruncate(fd, size_bytes)
        staging = mmap.mmap(fd, size_bytes)
        hugepages.advise(staging)  # before the pages come, so they may be huge ones
        _populate(staging)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL
        try:
            fcntl.fcntl(fd, add_seals, seals)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # a kernel before F_SEAL_FUTURE_WRITE (5.1)
                raise _CannotSeal(f"this system cannot seal a memfd as needed: {exc}") from exc
            raise
    except BaseException:
        if staging is not None:
            staging.close()
        os.close(fd)
        raise
    return fd, staging


#: what to do where this client could not make a staging segment (``_ensure_staging``)
_CLIENT_DESCRIPTORS_TO_DO = (
    "raise this process's open files limit (ulimit -n, systemd's LimitNOFILE=; ENFILE: the "
    "host's fs.file-max), or find what holds its descriptors"
)
_CLIENT_MEMORY_TO_DO = (
    "free memory on this host, or raise this process's limits (RLIMIT_AS, systemd's LimitAS=, "
    "its cgroup's memory.max)"
)


def _refused_for_memory(reason: str) -> bool:
    """Whether an agent's refusal of a staging segment (its message: the protocol carries no
    cause) says it could not map it for want of memory or address space, which a smaller
    segment may escape; not for want of descriptors, nor a segment it will not take at all."""
    return SEGMENT_UNMAPPED_TEXT in reason and SEGMENT_NO_DESCRIPTORS_TEXT not in reason


#: Linux's F_SEAL_FUTURE_WRITE (Python's fcntl does not name it)
_F_SEAL_FUTURE_WRITE = 0x10
#: Linux's MADV_POPULATE_WRITE (5.14; Python's mmap names it from 3.12 only)
_MADV_POPULATE_WRITE = 23


def _populate(segment: mmap.mmap) -> None:
    """Fault every page of a new, writable shared mapping in (zeroed): written, not merely
    fallocated, since agents count a page allocated but never written as a hole."""
    try:
        segment.madvise(_MADV_POPULATE_WRITE)
        return
    except AttributeError:  # no madvise here: written instead
        pass
    except OSError as exc:
        # only a kernel without it (EINVAL, < 5.14) has it written instead: where it failed
        # for want of memory (ENOMEM) or where a write would fault (EFAULT: SIGBUS), writing
        # the pages would have the process killed; the OSError has its puts go over the socket
        if exc.errno != errno.EINVAL:
            raise
    zeros = bytes(min(len(segment), 1 << 20))
    with memoryview(segment) as view:
        for offset in range(0, len(segment), len(zeros)):
            piece = view[offset : offset + len(zeros)]
            piece[:] = zeros[: piece.nbytes]


# --- control API ------------------------------------------------------------------------------
class AgentClient:
    """The agent's JSON control API (``/v1``). Methods return the decoded JSON."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 5.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        """``transport``: httpx's transport for the requests (the collector's shuts down the
        connection of a request it gave up on); its TLS settings are its own."""
        import httpx  # the data plane SDK does not need it

        from kvctl.deadline_transport import AnswerTooSlow

        self.url = url.rstrip("/")
        token = os.environ.get("KVCTL_TOKEN", "") if token is None else token
        self._token = bool(token)
        #: raised by every request, as AuthError: httpx's own refusal quotes the token
        self._token_problem = token_problem(token, "the agent token (KVCTL_TOKEN)")
        headers = bearer_headers(token)
        # building the default TLS context costs ~20 ms of CPU per client: only https needs it
        # (fan-outs create one client per node; a plain-http agent never negotiates TLS)
        verify = self.url.startswith("https://")
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=timeout_s,
            verify=verify,
            transport=transport,
        )
        self._httpx = httpx
        self._too_slow = AnswerTooSlow

    def _request(self, method: str, path: str, **kw: Any) -> Any:
        if self._token_problem:
            raise AuthError(self._token_problem)
        try:
            resp = self._http.request(method, path, **kw)
        except self._httpx.RemoteProtocolError as exc:
            # it took the connection and spoke no HTTP: an agent's data plane does that
            raise NoHttpAnswer(
                f"{self.url} closed the connection without an HTTP answer: is that an agent's "
                "data-plane port? Its control API is on its --listen port (default 7070)"
            ) from exc
        except (self._httpx.ReadTimeout, self._too_slow) as exc:
            # it took the connection and said nothing, or trickles its answer past a bounded
            # transport's deadline: running, so starting another is wrong
            raise AgentNotAnswering(
                f"the agent at {self.url} took the connection but did not answer in time "
                f"({exc or 'timed out'}): hung or overloaded? Its log (agent.log in its data dir) "
                "says what it is doing"
            ) from exc
        except self._httpx.TransportError as exc:
            if plain_http_answer(exc):  # up, and speaking HTTP: "down, start it" misleads
                plain = "http://" + self.url.removeprefix("https://")
                raise NotAnAgent(
                    f"{self.url} answered in plain HTTP, not TLS: an agent serves its control "
                    f"API over plain HTTP, so give {plain} (https:// only through a TLS proxy "
                    "in front of it)"
                ) from exc
            # what to check depends on where the caller is: each says it (kvctl agent status
            # on this node; kvctl status and doctor of the fleet's)
            raise AgentUnreachable(
                f"cannot reach the agent at {self.url}: {exc}; is it running, and listening there?"
            ) from exc
        if resp.status_code == 401:
            # the agent is up: what to fix is the token, not the agent
            said = "needs a token and none was sent" if not self._token else "refused the token"
            raise AuthError(
                f"the agent at {self.url} is up but {said}: set KVCTL_TOKEN to the agent's token"
            )
        if resp.status_code == 403:
            # the agent answers 401, but an authenticating proxy in front of it may say 403:
            # still up, and what to fix is still the credentials, not the agent
            raise AuthError(
                f"{self.url} is up but answered 403 Forbidden to {path}: the token was refused "
                "there (or a proxy in front of the agent forbids it); set KVCTL_TOKEN to a "
                "token it accepts"
            )
        if resp.status_code >= 400:
            self._raise_for(resp, path)
        if resp.headers.get("content-type", "").startswith("application/json"):
            try:
                return json_text.loads(resp.content)
            except ValueError as exc:  # escaped every caller's AgentError as a traceback
                raise NotAnAgent(
                    f"{self.url}{path} answered JSON that cannot be read ({_json_fault(exc)}): "
                    "is a kvctl agent's control API listening there?"
                ) from None
        return resp.text

    def _raise_for(self, resp: httpx.Response, path: str) -> NoReturn:
        """The typed error of an HTTP error answer, in one line: an agent's own detail, a
        validation error's fields, or what came back instead of an agent's answer."""
        status = resp.status_code
        try:
            body = json_text.loads(resp.content)
        except ValueError:
            body = None
        detail = body.get("detail") if isinstance(body, dict) else None
        if detail is None:  # a page or an empty answer: its first line, never the whole page
            said = f"HTTP {status} from {self.url}{path} ({first_line(resp.text) or 'empty body'})"
            if status >= 500:  # a proxy's or the server's own failure, agent or not
                raise RequestError(said, status)
            raise NotAnAgent(
                f"{said}: not a kvctl agent's control API? Check the URL and port", status
            )
        if status == 404 and detail == "Not Found" and self.url.endswith("/v1"):
            # the API's own prefix, copied with the URL: every call asks /v1/v1/...
            raise NotAnAgent(
                f"HTTP 404 from {self.url}{path}: no such endpoint, as its URL ends in the API's "
                f"own /v1: give the agent's URL without /v1 ({self.url.removesuffix('/v1')})",
                status,
            )
        if status == 404 and detail == "Not Found":  # the framework's: no such endpoint
            raise NotAnAgent(
                f"HTTP 404 from {self.url}{path}: no such endpoint; not a kvctl agent's control "
                "API, or an agent older than this call",
                status,
            )
        text = validation_text(detail) if isinstance(detail, list) else str(detail)
        if status == 503 and isinstance(body, dict) and body.get("starting") is True:
            # known by its flag, but recorded by its words (the collectors' samples keep only
            # the text): a detail worded otherwise (another version's) still begins with them
            said = text if says_starting(text) else f"{STARTING_PREFIX} {text}"
            raise AgentStarting(f"{said} ({self.url})", status)
        if status == 404:
            raise ChunkNotFound(text)
        if status == 409:
            raise NoRoom(text, status)
        raise RequestError(f"{status}: {text}", status)

    def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        """A control-API answer that must be a JSON object; anything else (an HTML page, a
        proxy's text) is not an agent's answer and raises instead of passing as one."""
        answer = self._request(method, path, **kw)
        if not isinstance(answer, dict):
            shown = first_line(answer) if isinstance(answer, str) else type(answer).__name__
            raise NotAnAgent(
                f"{self.url}{path} did not answer with JSON ({shown or 'empty body'}): is a "
                "kvctl agent's control API listening there?"
            )
        return cast(dict[str, Any], answer)

    def health(self) -> dict[str, Any]:
        health: dict[str, Any] = self._not_the_router(self._json("GET", "/v1/health"))
        if "status" not in health and "name" not in health:  # neither of an agent's: not one
            self._having(health, "/v1/health", "status or name")
        return health

    def info(self) -> AgentInfo:
        info = cast(AgentInfo, self._not_the_router(self._json("GET", "/v1/info")))
        return info

    def stats(self) -> AgentStats:
        stats = cast(AgentStats, self._not_the_router(self._json("GET", "/v1/stats")))
        return stats

    def _not_the_router(self, answer: Any) -> Any:
        """``answer``, unless it is the router's (its health and info name its ``instance``,
        its stats its ``decisions``): a node's agent URL given the router's port answered as
        an agent that is up (doctor), or failed as a bug (KeyError in `kvctl agent status`)."""
        if isinstance(answer, dict) and (
            ("instance" in answer and ("followers" in answer or "topology" in answer))
            or ("decisions" in answer and "to_holder" in answer)
        ):
            raise NotAnAgent(
                f"{self.url} is a kvctl router, not an agent: give the agent's control URL (its "
                "--listen, default port 7070); the router's URL is for --router"
            )
        return answer

    def lookup(
        self,
        *,
        tokens: Sequence[int] | None = None,
        keys: Sequence[bytes | str] | None = None,
        tenant: str = "",
        model: str | None = None,
        count: bool = True,
    ) -> dict[str, Any]:
        """Longest cached prefix; ``count=False`` leaves the agent's hit statistics alone."""
        body: dict[str, Any] = {"tenant": tenant, "model": model, "count": count}
        if tokens is not None:
            body["tokens"] = list(tokens)
        if keys is not None:
            body["keys"] = [_hex(k) for k in keys]
        return self._json("POST", "/v1/lookup", json=body)

    def pin(self, keys: Sequence[bytes | str], tier: str | None = None) -> dict[str, Any]:
        return self._json("POST", "/v1/pin", json={"keys": _hexes(keys), "tier": tier})

    def unpin(self, keys: Sequence[bytes | str]) -> dict[str, Any]:
        return self._json("POST", "/v1/unpin", json={"keys": _hexes(keys)})

    def evict(self, keys: Sequence[bytes | str]) -> dict[str, Any]:
        return self._json("POST", "/v1/evict", json={"keys": _hexes(keys)})

    def flush(self, tier: str, *, demote: bool = False) -> dict[str, Any]:
        return self._json("POST", "/v1/flush", json={"tier": tier, "demote": demote})

    def prefetch(self, keys: Sequence[bytes | str], tier: str | None = None) -> dict[str, Any]:
        body = {"keys": _hexes(keys), "tier": tier}
        return self._json("POST", "/v1/prefetch", json=body)

    def move(self, keys: Sequence[bytes | str], tier: str) -> dict[str, Any]:
        return self._json("POST", "/v1/move", json={"keys": _hexes(keys), "tier": tier})

    def resize(self, tier: str, capacity: int | str) -> dict[str, Any]:
        body = {"tier": tier, "capacity": capacity}
        return self._json("POST", "/v1/resize", json=body)

    def retry_tier(self, tier: str, *, timeout_s: float = 300.0) -> dict[str, Any]:
        """Have the agent try ``tier``, one it could not open at start (a disk tier whose
        directory was unusable), once now: the tier's ``state`` after the try ("online",
        "absent" with the ``reason``, or "offline"), whether a try was made (``retried``), the
        tries so far and the agent's own next one. ``timeout_s`` bounds the wait for the
        answer: the try opens and indexes the tier's directory (a large one takes a while)
        and first waits out one under way. Raises RequestError (400) for a tier the agent
        does not have."""
        from urllib.parse import quote

        timeout = self._httpx.Timeout(timeout_s, connect=self._http.timeout.connect)
        path = f"/v1/tiers/{quote(tier, safe='')}/retry"
        return self._having(self._json("POST", path, timeout=timeout), path, "tier", "state")

    def keys(
        self, *, tier: str | None = None, limit: int = 100, after: str | None = None
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if tier:
            params["tier"] = tier
        if after:
            params["after"] = after
        return self._json("GET", "/v1/keys", params=params)

    def top_keys(self, *, limit: int = 20, pinned: bool = False) -> dict[str, Any]:
        """The agent's most-hit chunks (``items``, most first), each with the cached prefix it
        ends; ``pinned`` keeps to pinned chunks. Counts nothing on the agent."""
        params = {"limit": limit, "pinned": "true" if pinned else "false"}
        return self._json("GET", "/v1/keys/top", params=params)

    def events(self, *, after: int = 0, limit: int = 1000) -> dict[str, Any]:
        params = {"after": after, "limit": limit}
        return self._json("GET", "/v1/events/recent", params=params)

    def probe(
        self,
        target: str,
        *,
        token: str | None = None,
        pings: int = 5,
        size_bytes: int = 1 << 20,
        timeout_s: float = 2.0,
        name: str | None = None,
    ) -> LinkProbe:
        """Have this agent probe the link to another agent's data plane (``target``,
        HOST:PORT): ping RTT and loss, then upload and download bandwidth of ``size_bytes``.
        ``token`` is the target's data-plane token; ``name`` the target node's name in the
        fleet, so the agent finds its configured link to it and, when that link has an emulated
        delay, includes it (``rtt_basis`` "emulated", ``emulated_delay_s``). The HTTP timeout
        grows with the probe's worst case, since the agent answers only when the probe is done."""
        body: dict[str, Any] = {
            "target": target,
            "pings": pings,
            "bytes": size_bytes,
            "timeout_s": timeout_s,
        }
        if token is not None:
            body["token"] = token
        if name is not None:
            body["name"] = name
        # a read timeout (the agent says nothing until the probe is done): connect + pings
        # (with reconnects) + two transfers, each bounded by timeout_s, the transfers also by
        # their bytes at 32 MiB/s (4 s at most, MAX_PROBE_BYTES each way), within the 5 s more
        worst_s = timeout_s * (2 * pings + 4) + 5.0
        answer = self._json("POST", "/v1/probe", json=body, timeout=worst_s)
        probe = cast(LinkProbe, self._having(answer, "/v1/probe", "ok"))
        probe.setdefault("target", target)  # what was asked: the agent echoes it
        # an agent from before rtt_basis never added a delay to its probes: measured
        probe.setdefault("rtt_basis", "measured")
        probe.setdefault("emulated_delay_s", None)
        return probe

    def remote(self) -> dict[str, Any]:
        """The pool and peers: reachability, link figures, fetch plans, the pool writer."""
        return self._having(self._json("GET", "/v1/remote"), "/v1/remote", "configured", "role")

    def _having(self, answer: dict[str, Any], path: str, *keys: str) -> dict[str, Any]:
        """``answer``, which names ``keys`` as an agent's does; else NotAnAgent: another JSON
        API's answer failed as "a bug in kvctl" (a KeyError) where it was rendered."""
        missing = [key for key in keys if key not in answer]
        if missing:
            raise NotAnAgent(
                f"{self.url}{path} did not answer as a kvctl agent does (no "
                f"{', '.join(missing)}): is a kvctl agent's control API listening there?"
            )
        return answer

    def gpus(self) -> dict[str, Any]:
        """NVML status and one reading per GPU of the agent's host."""
        return self._json("GET", "/v1/gpus")

    def metrics_text(self) -> str:
        return str(self._request("GET", "/metrics"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: longest line of a foreign answer an error message quotes
_QUOTED_CHARS = 80


def _json_fault(exc: BaseException) -> str:
    """Why an answer's JSON could not be read, in a few words."""
    if isinstance(exc, json_text.NestedTooDeep):
        return "nested too deep"
    return f"invalid: {first_line(str(exc))}"


def first_line(text: str) -> str:
    """The first non-blank line of ``text``, cut to a message's length."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= _QUOTED_CHARS else line[:_QUOTED_CHARS] + "..."


def validation_text(errors: list[Any]) -> str:
    """A 422's error list as one line, "field: message; ...": the field's path without
    "body", pydantic's "Value error, " prefix dropped."""
    parts = []
    for err in errors:
        if not isinstance(err, dict):
            parts.append(str(err))
            continue
        loc = [str(p) for p in err.get("loc") or () if p not in ("body", "query")]
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def _get_sizes(reply: bytes) -> list[tuple[int, int]]:
    """(index, size) of the chunks a GET reply carries, in payload order."""
    r = MetaReader(reply)
    items = r.structs(GET_ITEM, r.count())
    return [(i, size) for i, (st, size) in enumerate(items) if st == Status.OK]


def _hex(k: bytes | str) -> str:
    return k.hex() if isinstance(k, bytes | bytearray) else str(k)


def _hexes(keys: Sequence[bytes | str]) -> list[str]:
    return [_hex(k) for k in keys]
