"""The agent's data plane server: the binary protocol over TCP and a Unix socket, plus the
shared-memory path (arena mapping, read leases, staged puts) on the Unix socket.

One thread per connection: a request holds the store's lock only while it touches the index;
a new chunk is copied into the arena (from the socket's buffer, or the staging segment) without
it, into space reserved for it (``AgentRuntime.put``), and sending a chunk to a socket happens
outside the lock too, from the arena itself, under a lease that keeps the bytes in place. See
``kvctl.wire.protocol`` for the wire format.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import functools
import hmac
import json
import logging
import math
import mmap
import os
import select
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kvctl import __version__
from kvctl.agent.runtime import AgentRuntime
from kvctl.connection_sources import source_key
from kvctl.errors import InvalidArgument, KvctlError
from kvctl.remote.fetchplan import PrefillSample
from kvctl.store.errors import (
    CapacityError,
    KeyNotFound,
    PayloadSizeError,
    TierUnavailable,
)
from kvctl.store.index import Entry, LookupResult
from kvctl.store.keys import most_tokens
from kvctl.store.tiers import hugepages
from kvctl.store.tiers.cpu import CpuTier, Lease
from kvctl.wire.protocol import (
    DATA_PLANE_FEATURES,
    FETCH_CHECKSUM,
    FETCH_ITEM,
    FLAG_HAS_PARENT,
    FLAG_ISOLATED,
    FLAG_PINNED,
    GET_ITEM,
    HEADER_BYTES,
    ITEM,
    LEASE_ITEM,
    MAX_BATCH,
    MAX_FDS_PER_FRAME,
    MAX_HELLO_META_BYTES,
    MAX_LOOKUP_MANY_KEYS,
    MAX_META_BYTES,
    NO_TIER,
    PROBE_PIECE_BYTES,
    REPLY_BIT,
    SEGMENT_NO_DESCRIPTORS_TEXT,
    SEGMENT_UNMAPPED_TEXT,
    STAGED_ITEM,
    ErrorCode,
    FrameError,
    MetaReader,
    MetaWriter,
    Op,
    PeerClosed,
    Status,
    check_header,
    chunk_checksum,
    error_meta,
    pack_header,
    parse_fetch_flags,
    parse_get_flags,
    parse_probe,
    parse_put_checksums,
    parse_rates,
    rates_reply,
    recv_some_passing,
    send_all,
    zero_pieces,
)

log = logging.getLogger("kvctl.agent.dataplane")

#: a frame is cut off (an error frame, then the connection closes) once it has run the
#: settings' ``data_frame_timeout_seconds`` plus 1 s per this many bytes it has moved: a sender
#: that stops, or trickles a byte every few seconds, is cut off, while a large transfer at a
#: steady rate never is
MIN_FRAME_BYTES_PER_SECOND = 1 << 20
#: a staged put checks that its client is still there (``Connection._check_client_there``)
#: each time it has copied this many more bytes
STAGED_CHECK_BYTES = 64 << 20
#: the receive buffer a connection keeps between frames: chunks and metadata up to this size
#: reuse it (outside the budget); larger ones get a buffer of their own, anonymous memory whose
#: pages exist only once bytes arrive, unmapped as soon as the chunk is stored
KEPT_BUFFER_BYTES = 1 << 20
#: the share of the put budget (``data_put_budget_bytes``) that one TCP source (an IPv4
#: address, an IPv6 /64) may hold at once, raised to one largest chunk: a client that declares
#: large chunks and sends them slowly (or not at all, for a frame timeout) keeps the rest for
#: everyone else
BUDGET_SHARE_PER_SOURCE = 0.5
#: receives are counted (for the stall deadline) in slices of this size
RECV_SLICE_BYTES = 1 << 20
#: replies are sent, and counted toward the stall deadline as they go out, in slices of this
#: size: a reply earns time only by the bytes its reader has taken, not by its length
SEND_SLICE_BYTES = 1 << 20
#: when the agent ends a connection the client may still be sending: closing with its bytes
#: unread makes the kernel reset the connection and drop the replies not yet delivered (the
#: error frame saying why among them), so the agent first reads and drops what still comes,
#: for this long and this many bytes at most
LINGER_SECONDS = 1.0
LINGER_BYTES = 16 << 20
#: a connection must have sent its first frame (its HELLO, where a token is set) this long
#: after it was accepted, or it is closed: connections that never speak hold no thread for long
HELLO_TIMEOUT_SECONDS = 5.0
#: leases one connection may hold at once (a LEASE that would pass it is refused): each is a
#: record the store scans to expire leases, so one client must not create them without end
MAX_LEASES_PER_CONNECTION = MAX_BATCH
#: events a hostile client can cause at will (connections refused over the cap, cut off before
#: HELLO, failed accepts) are logged once per this interval, with their count, not one by one
LOG_EVERY_SECONDS = 60.0
_OP_NAMES = {op.value: op.name.lower() for op in Op}
#: PROBE replies are views of this one immutable buffer, shared by every connection
_PROBE_ZEROS = bytes(PROBE_PIECE_BYTES)
#: ops whose requests carry a payload; any other op with one is a broken frame
_PAYLOAD_OPS = frozenset({Op.PUT, Op.PROBE})
#: a matched chunk on another node, not pulled (LOOKUP_LEASE_LOCAL)
_REMOTE_ITEM = LEASE_ITEM.pack(Status.REMOTE, 0, 0, 0, 0, 0.0)
#: what a handler answers: the reply's parts (its metadata first, then payload pieces) and the
#: payload's length in bytes
Reply = tuple[list[bytes | bytearray | memoryview], int]


class ByteBudget:
    """Bytes that frames may hold while they arrive, shared by every connection: a frame takes
    its share before it receives, and gives it back when its bytes are stored or dropped. A
    frame taking bytes for a ``holder`` (a TCP source) waits too while that holder's bytes
    would pass ``holder_bytes``: one client cannot hold all of them."""

    def __init__(self, total_bytes: int, holder_bytes: int | None = None) -> None:
        self.total_bytes = total_bytes
        self.free_bytes = total_bytes
        self.holder_bytes = total_bytes if holder_bytes is None else min(holder_bytes, total_bytes)
        self._held: collections.Counter[str] = collections.Counter()
        self._cond = threading.Condition()

    def held(self, holder: str) -> int:
        """Bytes ``holder`` holds now."""
        with self._cond:
            return self._held[holder]

    def acquire(
        self,
        n_bytes: int,
        deadline_s: float,
        cancelled: Callable[[], bool],
        holder: str | None = None,
    ) -> bool:
        """Take ``n_bytes`` (for ``holder``), waiting until ``deadline_s`` (monotonic) at most;
        False when the wait ran out or ``cancelled()`` turned true."""
        cap = self.total_bytes if holder is None else self.holder_bytes
        if n_bytes > cap:
            return False
        with self._cond:
            while self.free_bytes < n_bytes or (
                holder is not None and self._held[holder] + n_bytes > cap
            ):
                left_s = deadline_s - time.monotonic()
                if left_s <= 0 or cancelled():
                    return False
                self._cond.wait(min(left_s, 0.25))  # wakes to notice a closing connection
            self.free_bytes -= n_bytes
            if holder is not None:
                self._held[holder] += n_bytes
            return True

    def try_acquire(self, n_bytes: int) -> bool:
        """Take ``n_bytes`` if they are free now; never waits."""
        with self._cond:
            if self.free_bytes < n_bytes:
                return False
            self.free_bytes -= n_bytes
            return True

    def release(self, n_bytes: int, holder: str | None = None) -> None:
        with self._cond:
            self.free_bytes += n_bytes
            if holder is not None:
                self._held[holder] -= n_bytes
                if self._held[holder] <= 0:
                    del self._held[holder]
            self._cond.notify_all()


class EveryInterval:
    """Counts events and says when to log them: the first at once, then at most once per
    ``interval_s``, with how many came since the last line."""

    def __init__(self, interval_s: float = LOG_EVERY_SECONDS) -> None:
        self.interval_s = interval_s
        self.total = 0
        self._unlogged = 0
        self._next_log_s = -math.inf
        self._lock = threading.Lock()

    def count(self, now_s: float | None = None) -> int:
        """Count one event; the events to report now (this one included), or 0 when the line
        waits for the interval to end."""
        now = time.monotonic() if now_s is None else now_s
        with self._lock:
            self.total += 1
            self._unlogged += 1
            if now < self._next_log_s:
                return 0
            self._next_log_s = now + self.interval_s
            n, self._unlogged = self._unlogged, 0
            return n


class Refusals:
    """Connections closed at accept, by reason (the setting whose cap they hit): counted per
    reason, each reason logged once an interval apart from the others (``EveryInterval``)."""

    def __init__(self, interval_s: float = LOG_EVERY_SECONDS) -> None:
        self.interval_s = interval_s
        self._reasons: dict[str, EveryInterval] = {}
        self._lock = threading.Lock()

    def count(self, reason: str) -> int:
        """Count one refusal; the refusals of this reason to report now, or 0 (see
        ``EveryInterval.count``)."""
        with self._lock:
            counter = self._reasons.setdefault(reason, EveryInterval(self.interval_s))
        return counter.count()

    @property
    def by_reason(self) -> dict[str, int]:
        with self._lock:
            return {reason: c.total for reason, c in self._reasons.items()}

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())


def _remove_stale_socket(path: Path) -> None:
    """Clear ``path`` for the data plane's Unix socket: a socket a killed agent left is removed;
    one another process still listens on, or anything but a socket (a mistyped --socket naming
    a file), is left as it is and raises OSError: unlinking it would cut off the engines of the
    agent that listens there, or lose the file."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, "it exists and is not a socket (left as it is)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        pass  # nothing listens: a killed agent's
    except OSError as exc:  # a full backlog (EAGAIN, a timeout): someone listens; EACCES...
        raise OSError(
            errno.EADDRINUSE, f"it is a socket that cannot be checked ({exc}): left as it is"
        ) from exc
    else:
        raise OSError(errno.EADDRINUSE, "another process listens on it (another agent?)")
    finally:
        probe.close()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


#: connections the kernel queues for a data plane listener (TCP or Unix) before it accepts them
LISTEN_BACKLOG = 128

#: the over-cap reserve (``DataPlaneServer.over_cap_reserve``) holds this many sources' worth of
#: ``data_max_unauthenticated_per_source``: one address fills half of it at most
OVER_CAP_RESERVE_SOURCES = 2


def bind_tcp(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """The data plane's TCP socket on ``host:port`` (IPv6 where the host has a colon; port 0:
    any free one). SO_REUSEADDR, so a port whose last connections are in TIME_WAIT is taken
    again. ``listen=False``: bound only, until :meth:`DataPlaneServer.serve_tcp` listens. A
    bound port is refused to a listener already there and to a bind without SO_REUSEADDR (one
    with it can still take it), and a connection to it is refused at once: a listening socket
    would take connections that nobody answers until the data plane serves. A failed bind
    closes the socket and raises its OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


class DataPlaneServer:
    def __init__(
        self,
        runtime: AgentRuntime,
        *,
        frame_timeout_s: float | None = None,
        put_budget_bytes: int | None = None,
        copy_budget_bytes: int | None = None,
        max_connections: int | None = None,
        max_unauthenticated_per_source: int | None = None,
        max_connections_per_source: int | None = None,
        hello_timeout_s: float = HELLO_TIMEOUT_SECONDS,
    ) -> None:
        """Limits left as None are the settings' (``data_frame_timeout_seconds``,
        ``data_put_budget_bytes``, ``data_max_connections``,
        ``data_max_unauthenticated_per_source``, ``data_max_connections_per_source``);
        ``copy_budget_bytes`` is ``data_put_budget_bytes`` too."""
        self.runtime = runtime
        settings = runtime.settings
        #: staging segments refused, by cause (``_SegmentRefused.cause``): each cause logged
        #: with what to do, once an interval (any client may send many); their clients put over
        #: the socket meanwhile, which their engines do not say
        self.segments_refused = Refusals()
        #: open connections each transport keeps at most (a flood of TCP connections cannot
        #: lock local engines out of the Unix socket). Past it, on TCP, a new connection is
        #: taken into the over-cap reserve while an idle one could make room for it, and the
        #: idle one is closed (``_close_idle``) only once the new one authenticates
        #: (``make_room``); a new one is refused when none is idle or the reserve is full
        self.max_connections = (
            settings.data_max_connections if max_connections is None else max_connections
        )
        #: TCP connections one source address may hold in all: past it, that source's own
        #: longest idle connection is closed to make room once the new one authenticates (as
        #: above), or (none idle) the new one refused.
        #: One client (a leaking connection pool, or a hostile one) holds this many of the
        #: ``max_connections`` at most, idle or busy
        self.max_connections_per_source = (
            settings.data_max_connections_per_source
            if max_connections_per_source is None
            else max_connections_per_source
        )
        #: TCP connections one source address may hold before they authenticate: whoever
        #: reopens connections that never say HELLO (each cut off after ``hello_timeout_s``)
        #: holds this many of the slots at most, not all of them
        self.max_unauthenticated_per_source = (
            settings.data_max_unauthenticated_per_source
            if max_unauthenticated_per_source is None
            else max_unauthenticated_per_source
        )
        #: TCP connections taken past ``max_connections`` or ``max_connections_per_source``
        #: before they authenticate, all sources together (each source also holds at most
        #: ``max_unauthenticated_per_source`` of them, as of any not yet authenticated): twice
        #: that, so one address cannot fill it. A connection here closes an idle one to make
        #: room only once it authenticates; one that never does is closed at its HELLO deadline
        #: and closes none
        self.over_cap_reserve = OVER_CAP_RESERVE_SOURCES * self.max_unauthenticated_per_source
        self.hello_timeout_s = hello_timeout_s
        #: by the setting whose cap refused them
        self.refused_connections = Refusals()
        #: idle TCP connections closed to make room for new ones, by the cap they were at
        self.idle_closed = Refusals()
        self.hello_timeouts = EveryInterval()
        #: PUT chunks refused because their bytes did not match their sender's checksum
        self.corrupt_puts = EveryInterval()
        #: PUT chunks no tier could take (NO_ROOM): logged with the store's reason
        self.no_room_puts = EveryInterval()
        #: chunks answered missing because the replies' copy budget was full
        self.copies_refused = EveryInterval()
        self._accept_failures = EveryInterval()
        #: requests refused for want of memory to receive a chunk or a request's metadata
        #: (``_receive_region``)
        self.no_receive_memory = EveryInterval()
        #: connections refused for want of a thread to serve them (``_no_thread``)
        self._thread_failures = EveryInterval()
        #: connections closed for any other failure to take them (``_connection_failed``)
        self._take_failures = EveryInterval()
        self.max_chunk_bytes = settings.max_chunk_bytes
        self.max_payload_bytes = MAX_BATCH * self.max_chunk_bytes
        self.frame_timeout_s = (
            settings.data_frame_timeout_seconds if frame_timeout_s is None else frame_timeout_s
        )
        self.min_frame_bytes_per_s = MIN_FRAME_BYTES_PER_SECOND
        budget = settings.data_put_budget_bytes if put_budget_bytes is None else put_budget_bytes
        # a frame waits for its share at most until its stall deadline, then gets BUSY; raised
        # to one largest chunk plus the largest metadata, so any valid frame can fit. One TCP
        # source holds BUDGET_SHARE_PER_SOURCE of it at most (as much, so it can too)
        largest_frame = self.max_chunk_bytes + MAX_META_BYTES
        budget = max(budget, largest_frame)
        self.budget = ByteBudget(budget, max(int(budget * BUDGET_SHARE_PER_SOURCE), largest_frame))
        # copies of chunks a GET or FETCH reply cannot send in place (not leasable in the
        # arena) are held until the reply is sent, maybe to a reader that never reads: all
        # replies share this many bytes of them, past which a chunk is answered missing. Apart
        # from the puts' budget, so stalled readers cannot make puts BUSY
        copies = budget if copy_budget_bytes is None else copy_budget_bytes
        self.copy_budget = ByteBudget(max(copies, self.max_chunk_bytes))
        self.token = settings.token.encode()
        self.tier_names = runtime.served_tier_names
        self.tier_codes: dict[str | None, int] = {name: i for i, name in enumerate(self.tier_names)}
        self.tier_codes[None] = NO_TIER
        #: this node's own tiers (LOOKUP_LEASE_LOCAL leases up to the first chunk outside them)
        self.local_tiers = frozenset(runtime.store.tier_names)
        self.shm_tier = runtime.shm_tier
        #: set by ``stop``; an Event so that the reaper wakes at once instead of at its next tick
        self._stop = threading.Event()
        self._listeners: list[tuple[socket.socket, str]] = []
        self._threads: list[threading.Thread] = []
        self._conns: set[Connection] = set()
        #: open connections by transport (the cap's count)
        self._open: collections.Counter[str] = collections.Counter()
        #: TCP connections not yet authenticated, by source address
        self._unauthenticated: collections.Counter[str] = collections.Counter()
        #: open TCP connections, by source address
        self._by_source: collections.Counter[str] = collections.Counter()
        #: TCP connections in the over-cap reserve (``Connection.over_cap`` set)
        self._over_cap = 0
        self._lock = threading.Lock()
        self.tcp_address: tuple[str, int] | None = None
        self.unix_path: Path | None = None
        self._unix_inode: tuple[int, int] | None = None

    # --- lifecycle --------------------------------------------------------------------------
    def listen_tcp(self, host: str, port: int) -> tuple[str, int]:
        return self.serve_tcp(bind_tcp(host, port))

    def serve_tcp(self, sock: socket.socket) -> tuple[str, int]:
        """Serve TCP on ``sock``, a socket from :func:`bind_tcp` (bound before the tiers
        opened, so a taken port is found before they do), listening from here on if it was
        not (OSError: it cannot, the port taken since); closed by ``stop``."""
        sock.listen(LISTEN_BACKLOG)
        self.tcp_address = sock.getsockname()[:2]
        self._listeners.append((sock, "tcp"))
        return self.tcp_address

    def listen_unix(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # owner-only from the start, not chmod after the fact
        try:
            sock.bind(str(path))
        finally:
            os.umask(old_umask)
        sock.listen(LISTEN_BACKLOG)
        bound = os.stat(path)
        self._unix_inode = (bound.st_dev, bound.st_ino)
        self.unix_path = path
        self._listeners.append((sock, "unix"))
        return path

    def start(self) -> None:
        for sock, transport in self._listeners:
            self._spawn(self._accept_loop, sock, transport, name=f"kvctl-accept-{transport}")
        self._spawn(self._reaper, name="kvctl-lease-reaper")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish, close idle connections."""
        self._stop.set()
        for sock, _ in self._listeners:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept (Linux), close does not
            with contextlib.suppress(OSError):
                sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            c.close_if_idle()
        deadline = time.monotonic() + timeout_s
        for c in conns:
            c.thread.join(max(0.0, deadline - time.monotonic()))
            c.close_if_idle(force=True)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                now = os.stat(self.unix_path)
                # only our own: another agent may have bound that path since (ours removed)
                if (now.st_dev, now.st_ino) == self._unix_inode:
                    self.unix_path.unlink()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _spawn(self, target: Callable[..., None], *args: object, name: str) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _accept_loop(self, sock: socket.socket, transport: str) -> None:
        sock.settimeout(0.25)  # wake up to notice ``stopping``
        while not self.stopping:
            try:
                conn_sock, address = sock.accept()
            except TimeoutError:
                continue
            except (OSError, MemoryError) as exc:
                if self.stopping:
                    return
                # out of descriptors (EMFILE) fails every accept until some close, and memory
                # short (MemoryError making its socket object) may: one line an interval, not
                # a traceback each time, and never the end of the loop
                # memory short, counting or making the line may fail too: raised, it ended
                # the loop
                with contextlib.suppress(Exception):
                    n = self._accept_failures.count()
                    if n:
                        log.error(
                            "data plane accept failed on %s: %s (%d time(s) since the last line)",
                            transport,
                            exc,
                            n,
                        )
                time.sleep(0.1)
                continue
            try:
                self._take(conn_sock, address, transport)
            except Exception as exc:  # one connection's failure, never the loop's
                self._connection_failed(conn_sock, transport, exc)

    def _take(self, conn_sock: socket.socket, address: Any, transport: str) -> None:
        """Serve a connection just accepted, or refuse it. What fails here (MemoryError
        building its Connection, a thread that will not start) costs this connection only
        (``_connection_failed``): raised out of the accept loop, it ended the loop, and every
        connection after sat unanswered in the backlog until the agent restarted."""
        source = source_key(address[0]) if transport == "tcp" else None
        try:
            conn_sock.setblocking(True)  # a stalled client is cut off by the reaper
            if transport == "tcp":
                conn_sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # gone already (reset): nothing to serve
            conn_sock.close()
            return
        # built before a slot is taken: where building fails, there is no slot to give back
        conn = Connection(self, conn_sock, transport, source)
        admitted = False
        try:
            with self._lock:
                refused_by, over_cap = self._admit(transport, source)
                if refused_by is None:
                    conn.over_cap, admitted = over_cap, True
                    self._conns.add(conn)
            if refused_by is not None:
                self._refuse(conn_sock, transport, source, refused_by)
                return
            try:
                conn.thread.start()
            except RuntimeError as exc:
                admitted = False  # _no_thread frees its slot
                self._no_thread(conn, exc)
        except BaseException:
            if admitted:
                with self._lock:
                    self._drop(conn)
            raise

    def _connection_failed(self, conn_sock: socket.socket, transport: str, exc: Exception) -> None:
        """A connection that could not be taken for ``exc`` (``_take``): closed, with BUSY
        where its buffer has room, logged once an interval with a count (a flood of them must
        not flood the log)."""
        # memory short, counting or making the line (its traceback) may fail too: raised out
        # of here, it ended the accept loop and left this connection open
        with contextlib.suppress(Exception):
            n = self._take_failures.count()
            if n:
                log.error(
                    "data plane: could not take a new %s connection (%s: %s): closed %d "
                    "connection(s) this way since the last such line; the agent serves the "
                    "others. Where "
                    "it is MemoryError, free memory or raise the agent's limits (systemd's "
                    "LimitAS=, MemoryMax=); otherwise report this line with its traceback",
                    transport,
                    type(exc).__name__,
                    exc,
                    n,
                    exc_info=exc,
                )
        with contextlib.suppress(Exception):  # short of memory, even the refusal may fail
            meta = error_meta(
                ErrorCode.BUSY, "this agent could not take this connection now; retry later"
            )
            conn_sock.setblocking(False)  # never wait on a client that does not read
            conn_sock.send(pack_header(Op.ERROR, 0, len(meta)) + meta)
        with contextlib.suppress(OSError):
            conn_sock.close()

    def _no_thread(self, conn: Connection, exc: RuntimeError) -> None:
        """``conn`` could not have its thread (out of address space for its stack, a limit on
        threads, memory short): refused BUSY and closed, its slot freed, logged once an
        interval. Raised out of the accept loop, this ended the loop: the agent took no
        connection again, and each one after sat unanswered in the backlog."""
        with self._lock:
            self._drop(conn)
        n = self._thread_failures.count()
        if n:
            log.error(
                "data plane: could not start a thread for a new %s connection (%s): refused "
                "%d connection(s) since the last line. Raise the agent's limits (systemd's "
                "LimitAS=, TasksMax=, MemoryMax=) or lower data_max_connections",
                conn.transport,
                exc,
                n,
            )
        meta = error_meta(
            ErrorCode.BUSY, "this agent cannot take a connection now (no thread); retry later"
        )
        with contextlib.suppress(OSError):
            conn.sock.setblocking(False)  # never wait on a client that does not read
            conn.sock.send(pack_header(Op.ERROR, 0, len(meta)) + meta)
        conn.sock.close()

    def _admit(self, transport: str, source: str | None) -> tuple[str | None, str | None]:
        """Take a slot for a new connection (the caller holds ``_lock``): (None, the cap it is
        over, if any) or (the setting whose cap refuses it, None). ``source``: a TCP client's
        ``source_key`` (None on the Unix socket). A TCP connection over a cap is taken into the
        over-cap reserve where an idle connection could make room for it: that one is closed
        only once the new one authenticates (``make_room``), so connections that never do
        (no token, a wrong one) close none; the caps on those not yet authenticated close none
        either."""
        if source is None:
            if self._open[transport] >= self.max_connections:
                return "data_max_connections", None
            self._open[transport] += 1
            return None, None
        if self._unauthenticated[source] >= self.max_unauthenticated_per_source:
            return "data_max_unauthenticated_per_source", None
        over: str | None = None
        if self._by_source[source] >= self.max_connections_per_source:
            over = "data_max_connections_per_source"
            if self._over_cap >= self.over_cap_reserve or not self._has_idle(source):
                return over, None
        elif self._open[transport] >= self.max_connections:
            over = "data_max_connections"
            if self._over_cap >= self.over_cap_reserve or not self._has_idle():
                return over, None
        if over is not None:
            self._over_cap += 1
        self._open[transport] += 1
        self._unauthenticated[source] += 1
        self._by_source[source] += 1
        return None, over

    def _has_idle(self, source: str | None = None) -> bool:
        """Whether a TCP connection (``source``'s where given) is idle now, with no leases: one
        ``_close_idle`` could close (the caller holds ``_lock``)."""
        return any(
            conn.transport == "tcp"
            and conn.idle_since is not None
            and not conn.holds_leases
            and (source is None or conn.source == source)
            for conn in self._conns
        )

    def make_room(self, conn: Connection) -> bool:
        """``conn`` has authenticated (its HELLO with the token; no token: its first frame):
        if it came over a cap (the over-cap reserve) and the connections are still over it,
        close one idle connection to make room, as ``_close_idle`` chooses (its own source's
        past ``max_connections_per_source``; else the source holding the most's), the longest
        idle first. False when none may be closed: ``conn`` is then refused (BUSY) and closed,
        staying in the reserve until it is gone."""
        with self._lock:
            if conn.over_cap is None or conn not in self._conns:
                return True
            source = conn.source
            assert source is not None  # only TCP connections go over a cap
            if self._by_source[source] > self.max_connections_per_source and not (
                self._close_idle("data_max_connections_per_source", source)
            ):
                return False
            if self._open[conn.transport] > self.max_connections and not self._close_idle(
                "data_max_connections"
            ):
                return False
            conn.over_cap = None
            self._over_cap -= 1
            return True

    def _close_idle(self, cap: str, source: str | None = None) -> bool:
        """Close one idle TCP connection (the caller holds ``_lock``) to make room for a new one
        over ``cap`` that has authenticated (``make_room``), and free its slot at once; False
        when none may be closed. Idle: its first frame served and no request in flight, no
        bytes of the next one waiting unread, no leases held. Among them, one of ``source``'s
        where given, else one of the source holding the most connections (the client filling
        the cap, not the engines and peers elsewhere); then the one idle the longest. Refusing
        the newcomer instead let one client with idle connections (a leaking connection pool,
        or a hostile one) lock every other out."""
        candidates = []
        for conn in self._conns:
            idle_since = conn.idle_since
            if conn.transport != "tcp" or idle_since is None or conn.source is None:
                continue
            if source is not None and conn.source != source:
                continue
            candidates.append((-self._by_source[conn.source], idle_since, conn))
        candidates.sort(key=lambda c: c[:2])  # the biggest source's, then the oldest, first
        for _, _, conn in candidates:
            if conn.close_to_make_room():
                self._drop(conn)
                n = self.idle_closed.count(cap)
                self.runtime.metrics.idle_connection_closed(cap)
                if n:
                    log.warning(
                        "data plane tcp connections at the limit (%s): closed %d idle "
                        "connection(s) to make room for new ones, the last from %s",
                        cap,
                        n,
                        conn.source,
                    )
                return True
        return False

    def authenticated(self, conn: Connection) -> None:
        """``conn`` has had its first frame served (its HELLO with the token): it no longer
        counts against its address's ``max_unauthenticated_per_source``."""
        with self._lock:
            self._forget_unauthenticated(conn)

    def _forget_unauthenticated(self, conn: Connection) -> None:
        source, conn.unauthenticated_source = conn.unauthenticated_source, None
        if source is not None:
            self._unauthenticated[source] -= 1
            if self._unauthenticated[source] <= 0:
                del self._unauthenticated[source]

    def _refuse(
        self, sock: socket.socket, transport: str, source: str | None, setting: str
    ) -> None:
        """Close a connection over a cap at once, saying why where its buffer has room;
        ``setting`` names the cap (and is the refusal's reason in ``refused_connections``)."""
        n = self.refused_connections.count(setting)
        if setting == "data_max_connections":
            if n:
                log.warning(
                    "data plane %s connections at the limit of %d (data_max_connections): "
                    "refused %d connection(s)",
                    transport,
                    self.max_connections,
                    n,
                )
            message = (
                f"this agent serves at most {self.max_connections} {transport} connections; "
                "retry later"
            )
        elif setting == "data_max_connections_per_source":
            cap = self.max_connections_per_source
            if n:
                log.warning(
                    "data plane: refused %d connection(s) from sources (an IPv4 address, an IPv6 "
                    "/64) already holding %d, none of them idle (data_max_connections_per_source)"
                    ", the last from %s",
                    n,
                    cap,
                    source,
                )
            message = (
                f"this agent serves at most {cap} tcp connections from one address (IPv6: one "
                "/64), and none of this address's is idle; retry later"
            )
        else:
            cap = self.max_unauthenticated_per_source
            if n:
                log.warning(
                    "data plane: refused %d connection(s) from sources (an IPv4 address, an IPv6 "
                    "/64) already holding %d not yet authenticated "
                    "(data_max_unauthenticated_per_source), the last from %s",
                    n,
                    cap,
                    source,
                )
            message = (
                f"this agent takes at most {cap} connections that have not authenticated "
                "(sent their HELLO) from one address (IPv6: one /64); retry later"
            )
        meta = error_meta(ErrorCode.BUSY, message)
        with contextlib.suppress(OSError):
            sock.setblocking(False)  # never wait on a client that does not read
            sock.send(pack_header(Op.ERROR, 0, len(meta)) + meta)
        sock.close()

    def _reaper(self) -> None:
        """Ends expired leases, and cuts off clients stalled mid-frame. (A watchdog here rather
        than a socket timeout: toggling timeouts costs syscalls on every request.)"""
        while not self._stop.wait(0.5):
            try:
                n = self.runtime.expire_leases()
            except KvctlError:
                return  # store closed
            if n:
                log.info("expired %d shared-memory leases", n)
            now = time.monotonic()
            with self._lock:
                conns = list(self._conns)
            for c in conns:
                c.cut_if_stalled(now)

    def forget(self, conn: Connection) -> None:
        with self._lock:
            if conn in self._conns:
                self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        """Free ``conn``'s slots (the caller holds ``_lock``)."""
        self._conns.discard(conn)
        if conn.over_cap is not None:
            conn.over_cap = None
            self._over_cap -= 1
        self._open[conn.transport] -= 1
        self._forget_unauthenticated(conn)
        if conn.source is not None:
            self._by_source[conn.source] -= 1
            if self._by_source[conn.source] <= 0:
                del self._by_source[conn.source]

    def hello_info(self) -> dict[str, object]:
        s = self.runtime.settings
        return {
            "agent": s.name,
            "dc": s.dc,
            "role": s.role,
            # kvctl's package version (what pip and importlib.metadata report: pyproject takes
            # it from kvctl.__version__), for people and logs only: capabilities are the flags
            # below, which clients decide by (see kvctl.wire.protocol)
            "version": __version__,
            "tiers": self.tier_names,
            #: what a pool agent's clients report as the pool's size
            "usage": self.runtime.usage(),
            "chunk_tokens": s.chunk_tokens,
            "max_chunk_bytes": self.max_chunk_bytes,
            "lease_seconds": s.lease_seconds,
            "shm": self.shm_tier is not None,
            #: FETCH replies carry this checksum per chunk when asked (FETCH_CHECKSUMS); PUTs
            #: may carry this checksum per chunk (PUT_CHECKSUMS), checked before storing; GETs
            #: may carry GET_COUNTED (a re-read its LEASE counted: served, not counted)
            **DATA_PLANE_FEATURES,
        }


class Connection:
    """One client connection, served by its own thread until either side closes it."""

    def __init__(
        self,
        server: DataPlaneServer,
        sock: socket.socket,
        transport: str,
        source: str | None = None,
    ) -> None:
        self.server = server
        self.runtime = server.runtime
        self.sock = sock
        self.transport = transport
        #: the TCP client's ``source_key`` (None on the Unix socket)
        self.source = source
        #: the cap a TCP connection was taken past, into the server's over-cap reserve, until
        #: it authenticates and an idle connection is closed for it (``DataPlaneServer.make_room``;
        #: set and cleared under the server's ``_lock``)
        self.over_cap: str | None = None
        self.authed = not server.token
        #: the TCP client's address while its first frame is not yet served (it holds one of
        #: that address's ``max_unauthenticated_per_source`` slots); None after, and on Unix
        self.unauthenticated_source = source
        #: when the connection is closed unless its first frame (its HELLO, where a token is
        #: set) has been served (monotonic; None once it has)
        self._hello_deadline_s: float | None = time.monotonic() + server.hello_timeout_s
        #: the reaper closed the connection for want of that first frame
        self._hello_late = False
        #: descriptors the frame being read may pass (one, until its header says it is not an
        #: ATTACH): any past it are closed as they arrive, and counted here to refuse the frame
        self._max_fds = MAX_FDS_PER_FRAME
        self._fds_refused = 0
        #: when the frame being served started (None: idle between frames)
        self.busy_since: float | None = None
        #: since when the connection has waited for its next frame, its first one served
        #: (monotonic; None while a frame is served or before the first)
        self.idle_since: float | None = None
        #: bytes the frame has moved so far (in and out): each buys time before a stall cut-off
        self._moved_bytes = 0
        #: bytes of the frame received so far (its header's included): what the metrics count
        #: in, never the lengths its header declares (a frame refused unread, or cut short,
        #: would count bytes that never came: a terabyte for one 20-byte header)
        self._received_bytes = 0
        #: the frame's request id once its header is read (for the error a cut-off sends)
        self._frame_rid: int | None = None
        #: waiting for budget: the frame keeps its own deadline, the reaper leaves it alone
        self._waiting_budget = False
        #: the reaper found the frame stalled and shut the connection's reading side
        self._stalled = False
        self._state_lock = threading.Lock()
        self._closed = False
        #: leases this connection holds: id -> deadline (monotonic)
        self._leases: dict[int, float] = {}
        self._fds: list[int] = []
        self._staging: mmap.mmap | None = None
        self._buf = bytearray()
        self._release_after_send: list[int] = []
        #: bytes of ``server.copy_budget`` the reply being built or sent holds
        self._copy_bytes_held = 0
        self._send_fd = -1
        self.thread = threading.Thread(target=self._run, name="kvctl-conn", daemon=True)
        self._handlers: dict[int, Callable[[MetaReader, int], Reply]] = {
            Op.HELLO: self._hello,
            Op.PING: lambda meta, _n: ([b""], 0),
            Op.PUT: self._put,
            Op.PUT_STAGED: self._put_staged,
            Op.GET: self._get,
            Op.EXISTS: self._exists,
            Op.LOOKUP: self._lookup,
            Op.LOOKUP_MANY: self._lookup_many,
            Op.LEASE: self._lease,
            Op.LOOKUP_LEASE: self._lookup_lease,
            Op.LOOKUP_LEASE_LOCAL: functools.partial(self._lookup_lease, local_only=True),
            Op.RELEASE: self._release,
            Op.MAP: self._map,
            Op.ATTACH: self._attach,
            Op.PROBE: self._probe,
            Op.FETCH: self._fetch,
            Op.TENANT: self._tenant,
            Op.RATES: self._rates,
        }

    # --- connection loop --------------------------------------------------------------------
    def _run(self) -> None:
        metrics = self.runtime.metrics
        metrics.connection_opened(self.transport)
        header = bytearray(HEADER_BYTES)
        try:
            while not self.server.stopping:
                if not self._read_header(memoryview(header)):
                    break
                if not self.server.token:
                    # no token: its first frame has come, so it is not a silent connection;
                    # serving that frame, however long, is the frame deadline's to bound
                    self._hello_deadline_s = None
                if not self._serve_one(header):
                    break
                if self.authed and (
                    self._hello_deadline_s is not None or self.unauthenticated_source is not None
                ):
                    # its first frame served: it may idle from now on, and leaves its
                    # address's share of the slots for connections not yet authenticated
                    self._hello_deadline_s = None
                    self.server.authenticated(self)
        except (PeerClosed, ConnectionError, TimeoutError):
            # the client went away or stalled mid-frame; nothing half-done was stored
            if self._stalled and self._frame_rid is not None:
                self._send_error(self._frame_rid, self._stall_error())
        except OSError as exc:
            if not self._closed:
                log.warning("data plane connection error: %s", exc)
        finally:
            if self._hello_late:
                self._send_error(self._frame_rid or 0, self._hello_error())
            self._cleanup()
            metrics.connection_closed(self.transport)

    def _deadline_s(self) -> float:
        """When the frame in flight is cut off unless it moves more bytes (monotonic)."""
        started = self.busy_since
        if started is None:
            return math.inf
        credit_s = self._moved_bytes / self.server.min_frame_bytes_per_s
        return started + self.server.frame_timeout_s + credit_s

    def _stall_error(self) -> FrameError:
        return FrameError(
            ErrorCode.TIMEOUT,
            f"request stalled: it moved {self._moved_bytes} bytes, less than "
            f"{self.server.min_frame_bytes_per_s:.0f} bytes/s after a "
            f"{self.server.frame_timeout_s:g} s grace; connection closed",
            fatal=True,
        )

    def _hello_error(self) -> FrameError:
        first = "HELLO with the token" if self.server.token else "first frame"
        return FrameError(
            ErrorCode.TIMEOUT,
            f"no {first} within {self.server.hello_timeout_s:g} s of connecting; connection closed",
            fatal=True,
        )

    def cut_if_stalled(self, now_s: float) -> None:
        """The reaper's check: shut the reading side of a connection whose frame is past its
        deadline, or that has not sent its first frame in time (its thread then answers with
        an error frame and closes); one still busy a tick later (blocked sending to a reader
        that stopped reading) is shut down entirely."""
        hello_due = self._hello_deadline_s
        if hello_due is not None and now_s > hello_due:
            self._cut_before_hello()
            return
        if self._waiting_budget or now_s <= self._deadline_s():
            return
        with self._state_lock:
            if self._closed or self.busy_since is None:
                return
            again = self._stalled
            self._stalled = True
        if not again:
            log.warning(
                "cutting off a %s connection stalled mid-frame (%d bytes moved)",
                self.transport,
                self._moved_bytes,
            )
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR if again else socket.SHUT_RD)

    def _cut_before_hello(self) -> None:
        """Close a connection whose first frame did not come in time; logged once an interval
        (whoever opens connections and stays silent must not fill the log)."""
        with self._state_lock:
            if self._closed:
                return
            again = self._hello_late
            self._hello_late = True
        if not again:
            n = self.server.hello_timeouts.count()
            if n:
                log.warning(
                    "closed %d data plane connection(s) that sent no first frame (HELLO) "
                    "within %g s",
                    n,
                    self.server.hello_timeout_s,
                )
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR if again else socket.SHUT_RD)

    def _read_header(self, view: memoryview) -> bool:
        """Wait for the next frame: without a timeout once the connection's first frame is
        served (idle connections are fine), until its HELLO deadline before that. An idle TCP
        connection (one ``close_to_make_room`` may close) waits for its next request's bytes
        without taking any of them, and marks itself busy before it reads them: one closed to
        make room never has its request read and left unanswered (``close_to_make_room`` sees
        the bytes waiting and leaves it open)."""
        with self._state_lock:
            self.busy_since = None
            if self._closed or self.server.stopping:
                return False
            idle = self._hello_deadline_s is None
            if idle:
                self.idle_since = time.monotonic()
        self._max_fds = MAX_FDS_PER_FRAME
        self._fds_refused = 0
        if idle and self.transport == "tcp":
            if self.sock.recv_into(view, 1, socket.MSG_PEEK) == 0:
                return False  # closed by its client, or shut by the agent
            self._moved_bytes = 0
            self._frame_rid = None
            with self._state_lock:
                self.idle_since = None
                if self._closed:  # closed to make room before its request came: not read
                    return False
                self.busy_since = time.monotonic()
            first = self.sock.recv_into(view, HEADER_BYTES)
            if first == 0:
                return False
            self._moved_bytes = self._received_bytes = first
        else:
            first = (
                self.sock.recv_into(view, HEADER_BYTES)
                if self.transport == "tcp"
                else self._recv_some_unix(view)
            )
            if first == 0:
                return False
            self._moved_bytes = self._received_bytes = first
            self._frame_rid = None
            with self._state_lock:
                self.idle_since = None
                if self._closed:  # closed as its request came (the agent stopping): not served
                    return False
                self.busy_since = time.monotonic()
        if first < HEADER_BYTES:
            self._recv(view[first:])
        return True

    def _recv(self, view: memoryview) -> None:
        """Fill ``view`` from the socket, counting what arrives in ``_received_bytes`` (also
        when the client stops short: the bytes it sent were received)."""
        got = 0
        tcp = self.transport == "tcp"
        try:
            while got < view.nbytes:
                k = self.sock.recv_into(view[got:]) if tcp else self._recv_some_unix(view[got:])
                if k == 0:
                    raise PeerClosed(f"connection closed mid-frame, after {got} of {view.nbytes}")
                got += k
        finally:
            self._received_bytes += got

    def _recv_some_unix(self, view: memoryview) -> int:
        """One receive on the Unix socket, keeping the descriptors the frame may pass and
        closing any others as they arrive: a client passing thousands in one slow frame once
        held them all open in the agent until the frame ended, and ran it out of descriptors."""
        k, passed, truncated = recv_some_passing(self.sock, view)
        for fd in passed:
            if len(self._fds) < self._max_fds:
                self._fds.append(fd)
            else:
                os.close(fd)
                self._fds_refused += 1
        self._fds_refused += truncated
        return k

    def _recv_counted(self, view: memoryview) -> None:
        """Fill ``view`` slice by slice, counting each slice toward the stall deadline."""
        n = view.nbytes
        done = 0
        while done < n:
            k = min(n - done, RECV_SLICE_BYTES)
            self._recv(view[done : done + k])
            done += k
            self._moved_bytes += k

    def _take_budget(self, n_bytes: int) -> None:
        """Reserve ``n_bytes`` of the server's budget before receiving them (a TCP client's
        within its source's share); waits at most until this frame's stall deadline, then BUSY
        (fatal: the bytes are never read)."""
        budget = self.server.budget
        self._waiting_budget = True
        try:
            ok = budget.acquire(
                n_bytes,
                self._deadline_s(),
                lambda: self._closed or self.server.stopping,
                self.source,
            )
        finally:
            self._waiting_budget = False
        if ok:
            return
        if self.source is not None and budget.held(self.source) + n_bytes > budget.holder_bytes:
            stayed_full = (
                f"this address's share ({budget.holder_bytes} bytes; IPv6: one /64's) of the "
                f"agent's budget of {budget.total_bytes} bytes for requests in flight stayed "
                "full with its other requests"
            )
        else:
            stayed_full = (
                f"the agent's budget of {budget.total_bytes} bytes for requests in flight "
                "stayed full"
            )
        raise FrameError(
            ErrorCode.BUSY,
            f"no room to receive {n_bytes} more bytes: {stayed_full}; retry later",
            fatal=True,
        )

    @contextlib.contextmanager
    def _received(self, n_bytes: int, what: str = "a chunk") -> Iterator[memoryview]:
        """The next ``n_bytes`` of the stream, valid inside the block. Up to KEPT_BUFFER_BYTES
        land in the connection's reused buffer; more take their share of the budget and land in
        anonymous memory of their own (pages exist only as bytes arrive), unmapped on exit."""
        if n_bytes <= KEPT_BUFFER_BYTES:
            view = memoryview(self._buffer(n_bytes))[:n_bytes]
            try:
                self._recv_counted(view)
                yield view
            finally:
                view.release()
            return
        self._take_budget(n_bytes)
        try:
            region = self._receive_region(n_bytes, what)
            view = memoryview(region)
            try:
                self._recv_counted(view)
                yield view
            finally:
                with contextlib.suppress(BufferError):  # a view still held elsewhere: GC frees it
                    view.release()
                    region.close()
        finally:
            self.server.budget.release(n_bytes, self.source)

    def _receive_region(self, n_bytes: int, what: str) -> mmap.mmap:
        """Memory of its own for ``what`` (a chunk, or a request's metadata) of ``n_bytes``
        about to arrive; where none can be had (ENOMEM: memory or address space short,
        RLIMIT_AS) BUSY, fatal as its bytes are never read, and a line once an interval: it
        was an INTERNAL error with a traceback logged for each such request, which any client
        could repeat while the agent was short."""
        try:
            return hugepages.anonymous_region(n_bytes)
        except OSError as exc:
            n = self.server.no_receive_memory.count()
            if n:
                log.warning(
                    "data plane: no memory to receive %s of %d bytes (%s): refused %d "
                    "request(s) BUSY since the last line. Free memory, or raise the agent's "
                    "limits (systemd's LimitAS=, MemoryMax=), or lower data_put_budget_bytes",
                    what,
                    n_bytes,
                    exc,
                    n,
                )
            raise FrameError(
                ErrorCode.BUSY,
                f"this agent could not allocate {n_bytes} bytes to receive {what} ({exc}); "
                "retry later",
                fatal=True,
            ) from None

    def _serve_one(self, header: bytearray) -> bool:
        """Serve one frame; False when the connection must close."""
        started = time.perf_counter()
        op = header[3]
        sent = 0
        ok = False
        rid = 0
        try:
            op, rid, meta_len, payload_len = check_header(
                header, max_payload_bytes=self.server.max_payload_bytes
            )
            self._frame_rid = rid
            self._check_frame_shape(op, meta_len, payload_len)
            with self._received(meta_len, "a request's metadata") as view:
                meta = MetaReader(view)  # a copy: the buffer is free for the payload
        except FrameError as exc:  # all fatal: the frame's body is never read
            self._send_error(rid, exc)
            return False
        try:
            if self.over_cap is not None and self.authed:  # no token: its first frame
                self._take_room()
            self._check_fds_passed(op, payload_len)
            handler = self._handlers.get(op)
            if handler is None:
                self._discard(payload_len)
                raise FrameError(ErrorCode.UNSUPPORTED, f"unknown op {op}")
            if payload_len and op not in _PAYLOAD_OPS:
                raise FrameError(
                    ErrorCode.BAD_FRAME, f"{Op(op).name} carries no payload", fatal=True
                )
            parts, bytes_out = handler(meta, payload_len)
            if op != Op.RELEASE:  # releases are one-way so a reader never waits on them
                head = pack_header(op | REPLY_BIT, rid, len(parts[0]), bytes_out)
                fd, self._send_fd = self._send_fd, -1
                try:
                    sent = self._send_counted([head, *parts], fd)
                finally:
                    if fd >= 0:
                        os.close(fd)
                    parts.clear()  # the copies among them go before their budget does
            ok = True
            return True
        except FrameError as exc:
            self._send_error(rid, exc)
            return not exc.fatal
        except (PeerClosed, ConnectionError, TimeoutError):
            raise
        except KvctlError as exc:
            self._send_error(rid, _store_error(exc))
            return True
        except Exception as exc:  # a bug: report it, and close since the stream may be off
            if self._stalled and isinstance(exc, OSError):  # the reaper shut the socket
                raise PeerClosed("cut off mid-frame") from None
            log.exception("data plane request failed")
            self._send_error(
                rid, FrameError(ErrorCode.INTERNAL, f"internal error: {exc}", fatal=True)
            )
            return False
        finally:
            self.runtime.metrics.observe_dataplane(
                _OP_NAMES.get(op, "other"),
                self.transport,
                time.perf_counter() - started,
                ok=ok,
                bytes_in=self._received_bytes,
                bytes_out=sent,
            )
            if self._release_after_send:
                self.runtime.release(self._release_after_send)
                self._release_after_send = []
            if self._copy_bytes_held:
                self.server.copy_budget.release(self._copy_bytes_held)
                self._copy_bytes_held = 0
            for fd in self._fds:  # descriptors only count with the frame that expects them
                os.close(fd)
            self._fds.clear()

    def _check_frame_shape(self, op: int, meta_len: int, payload_len: int) -> None:
        """Refuse (fatal, before reading any of its body) a frame this connection may not send:
        before the token, anything but a HELLO; a HELLO larger than a token and a name. Sets
        the descriptors the frame may pass, closing any its header brought that it may not."""
        if not self.authed and op != Op.HELLO:
            raise FrameError(
                ErrorCode.UNAUTHORIZED, "this agent needs a token: send HELLO first", fatal=True
            )
        if op == Op.HELLO and meta_len > MAX_HELLO_META_BYTES:
            raise FrameError(
                ErrorCode.TOO_LARGE,
                f"HELLO metadata of {meta_len} bytes > {MAX_HELLO_META_BYTES}",
                fatal=True,
            )
        if op == Op.HELLO and payload_len:
            raise FrameError(ErrorCode.BAD_FRAME, "HELLO carries no payload", fatal=True)
        self._max_fds = MAX_FDS_PER_FRAME if op == Op.ATTACH else 0
        while len(self._fds) > self._max_fds:  # came with the header, before its op was known
            os.close(self._fds.pop())
            self._fds_refused += 1

    def _check_fds_passed(self, op: int, payload_len: int) -> None:
        """Refuse (BAD_REQUEST, the connection stays usable) a frame that passed descriptors
        it may not; they are closed already. Its payload is dropped to stay in step."""
        if not self._fds_refused:
            return
        self._discard(payload_len)
        n = len(self._fds) + self._fds_refused
        may = "one" if self._max_fds else "none"
        name = _OP_NAMES.get(op, f"op {op}").upper()
        if op == Op.ATTACH:
            # the kernel drops what the agent cannot take (MSG_CTRUNC) alike whether the client
            # passed too many or the agent is out of descriptors (EMFILE), a transient state
            # the client retries after: the refusal says both, and is logged as a segment's
            self._segment_refused(
                _SegmentRefused(
                    "descriptors",
                    f"ATTACH passed {n} file descriptor(s) or more, or this agent could not "
                    "take the one passed (out of descriptors); it may pass one",
                )
            )
        raise FrameError(
            ErrorCode.BAD_REQUEST,
            f"{name} passed {n} file descriptor(s) or more; it may pass {may}",
        )

    def _send_counted(self, parts: list[bytes | bytearray | memoryview], fd: int) -> int:
        """``send_all``, a slice at a time, each slice counted toward the stall deadline once
        the kernel took it: a reply buys time as its reader takes it, so one never read is cut
        off like a stalled request (its leases and copies freed), however large. Returns bytes
        sent."""
        return send_all(self.sock, parts, fd, slice_bytes=SEND_SLICE_BYTES, on_sent=self._sent)

    def _sent(self, nbytes: int) -> None:
        self._moved_bytes += nbytes

    def _send_error(self, rid: int, exc: FrameError) -> None:
        meta = error_meta(exc.code, exc.message)
        with contextlib.suppress(OSError):
            send_all(self.sock, [pack_header(Op.ERROR, rid, len(meta)), meta])

    def _discard(self, n: int) -> None:
        chunk = memoryview(self._buffer(min(n, KEPT_BUFFER_BYTES)))
        while n:
            k = min(n, chunk.nbytes)
            self._recv(chunk[:k])
            self._moved_bytes += k
            n -= k

    def _buffer(self, n: int) -> bytearray:
        """The connection's reused receive buffer, at least ``n`` (<= KEPT_BUFFER_BYTES) long."""
        if len(self._buf) < n:
            self._buf = bytearray(n)
        return self._buf

    # --- handlers: each returns (reply parts: meta first, payload bytes) ---------------------
    def _hello(self, meta: MetaReader, _payload: int) -> Reply:
        token = meta.text().encode()
        meta.text()  # client name, for logs
        if self.server.token and not hmac.compare_digest(token, self.server.token):
            raise FrameError(ErrorCode.UNAUTHORIZED, "wrong or missing token", fatal=True)
        self.authed = True
        if self.over_cap is not None:
            self._take_room()
        # its address's slot among those not yet authenticated is freed before the reply goes:
        # a client that opens its next connection once this one's HELLO is answered must find
        # it free (freed after the reply, a burst of one engine's connections was refused
        # under load: 'at most 2 connections that have not authenticated from one address')
        self._hello_deadline_s = None
        self.server.authenticated(self)
        return [json.dumps(self.server.hello_info()).encode()], 0

    def _take_room(self) -> None:
        """This connection, taken past a cap, has authenticated: an idle one is closed for it
        (``DataPlaneServer.make_room``), or (none idle any more) it is refused, BUSY (fatal)."""
        cap = self.over_cap
        if self.server.make_room(self):
            return
        n = self.server.refused_connections.count(cap or "data_max_connections")
        if n:
            log.warning(
                "data plane tcp connections at the limit (%s): refused %d connection(s) that "
                "authenticated when none was idle to make room for them, the last from %s",
                cap,
                n,
                self.source,
            )
        raise FrameError(
            ErrorCode.BUSY,
            f"this agent's tcp connections are at their limit ({cap}) and none is idle to "
            "make room; retry later",
            fatal=True,
        )

    def _put(self, meta: MetaReader, payload_len: int) -> Reply:
        """Chunks received from the socket and stored one by one. A PUT that carries checksums
        (PUT_CHECKSUMS: agents writing through to a pool agent, clients over TCP) has each
        chunk's bytes checked where they landed, before they are stored: a chunk damaged on the
        way (a flipped bit past TCP's weak checksum) is refused alone (CORRUPT), counted and
        logged; the rest of the batch is stored as usual."""
        try:
            tenant = meta.tenant()
            items = meta.structs(ITEM, meta.count())
            checksums = parse_put_checksums(meta, len(items))
            sizes = [it[1] for it in items]
            if sum(sizes) != payload_len:
                raise FrameError(
                    ErrorCode.BAD_REQUEST,
                    f"items declare {sum(sizes)} bytes but the payload is {payload_len}",
                )
        except FrameError:
            self._discard(payload_len)
            raise
        out = bytearray()
        for i, item in enumerate(items):
            size = item[1]
            if size > self.server.max_chunk_bytes:
                self._discard(size)
                out += bytes((Status.TOO_LARGE, NO_TIER))
                continue
            # straight from the socket into the buffer (a failed receive closes the connection)
            with self._received(size) as buf:
                try:
                    if checksums is None or self._intact(item[0], buf, checksums[i]):
                        out += self._store_item(tenant, item, buf)
                    else:
                        out += bytes((Status.CORRUPT, NO_TIER))
                except BaseException:
                    self._discard(sum(sizes[i + 1 :]))  # in step with the stream for the error
                    raise
        return [MetaWriter().u32(len(items)).raw(bytes(out)).build()], 0

    def _intact(self, key: bytes, data: memoryview, checksum: int) -> bool:
        """Whether ``data`` is what its sender checksummed; a chunk that is not is counted
        (``kvctl_dataplane_corrupt_puts_total``) and logged once a minute at most."""
        got = chunk_checksum(data)
        if got == checksum:
            return True
        self.runtime.metrics.corrupt_put()
        n = self.server.corrupt_puts.count()
        if n:
            log.warning(
                "refused %d PUT chunk(s) whose bytes did not match their sender's checksum "
                "(damaged on the way; the last: %s from %s, XXH3-64 %016x, the sender's "
                "%016x): not stored",
                n,
                key.hex(),
                self._peer_name(),
                got,
                checksum,
            )
        return False

    def _peer_name(self) -> str:
        """The other end, for logs: its address over TCP, "unix" on the Unix socket."""
        if self.transport != "tcp":
            return self.transport
        try:
            host, port, *_ = self.sock.getpeername()
        except OSError:
            return "a closed connection"
        return f"{host}:{port}"

    def _probe(self, meta: MetaReader, payload_len: int) -> Reply:
        try:
            want_bytes = parse_probe(meta, payload_len)
        except FrameError as exc:
            if not exc.fatal:  # stay in step with the stream (a fatal one closes it anyway)
                self._discard(payload_len)
            raise
        self._discard(payload_len)  # the upload half of the measurement: read, then dropped
        reply = MetaWriter().u64(payload_len).build()
        return [reply, *zero_pieces(_PROBE_ZEROS, want_bytes)], want_bytes

    def _put_staged(self, meta: MetaReader, _payload: int) -> Reply:
        if self._staging is None:
            raise FrameError(ErrorCode.BAD_REQUEST, "PUT_STAGED before ATTACH")
        tenant = meta.tenant()
        items = meta.structs(STAGED_ITEM, meta.count())
        meta.done()
        out = bytearray()
        unchecked_bytes = 0
        with memoryview(self._staging) as staging:
            for item in items:
                size, offset = item[1], item[7]
                if offset + size > staging.nbytes:
                    out += bytes((Status.BAD, NO_TIER))
                elif size > self.server.max_chunk_bytes:
                    out += bytes((Status.TOO_LARGE, NO_TIER))
                else:
                    out += self._store_item(tenant, item[:7], staging[offset : offset + size])
                    # copied bytes earn time as received ones do (a large batch is not cut
                    # off as stalled), and whether the client is still there is checked
                    # between chunks: copies into the arena move nothing on the socket, and
                    # a batch from a client gone (closed, or cut off) went on copying up to
                    # its 65,536 chunks of up to max_chunk_bytes each, evicting as it went
                    self._moved_bytes += size
                    unchecked_bytes += size
                if unchecked_bytes >= STAGED_CHECK_BYTES:
                    unchecked_bytes = 0
                    self._check_client_there()
        return [MetaWriter().u32(len(items)).raw(bytes(out)).build()], 0

    def _check_client_there(self) -> None:
        """PeerClosed where the client closed its connection (its replies can go nowhere) or
        the reaper cut it off; a client that only shut its writing side still gets them."""
        if self._stalled or self._closed:
            raise PeerClosed("cut off mid-frame")
        poller = select.poll()
        poller.register(self.sock, select.POLLHUP | select.POLLERR)
        if any(ev & (select.POLLHUP | select.POLLERR) for _fd, ev in poller.poll(0)):
            raise PeerClosed("the client closed its connection mid-frame")

    def _store_item(self, tenant: str, item: tuple[Any, ...], data: memoryview) -> bytes:
        key, _size, tokens, priority, flags, parent, depth = item
        if tokens > self._token_bound(data.nbytes):
            # every hit would count the claim as prefill saved (4,294,967,295 tokens for a
            # 1 KiB chunk): refused, as a pool's or a peer's chunk claiming so many is
            return bytes((Status.BAD, NO_TIER))
        try:
            tier = self.runtime.put(
                key,
                data,
                tokens=tokens or None,
                tenant=tenant,
                parent=parent if flags & FLAG_HAS_PARENT else None,
                depth=depth,
                priority=priority,
                pinned=bool(flags & FLAG_PINNED),
                isolated=bool(flags & FLAG_ISOLATED),
            )
        except CapacityError as exc:
            return self._no_room(key, exc)
        except (InvalidArgument, PayloadSizeError):
            return bytes((Status.BAD, NO_TIER))
        if tier is None:
            return bytes((Status.DECLINED, NO_TIER))
        return bytes((Status.OK, self.server.tier_codes[tier]))

    def _token_bound(self, size_bytes: int) -> int:
        """The most tokens a chunk of ``size_bytes`` can hold (``most_tokens``), the bound
        remote chunks are held to (``RemoteTiers._token_bound``)."""
        return most_tokens(self.runtime.store.chunk_tokens, size_bytes)

    def _no_room(self, key: bytes, exc: CapacityError) -> bytes:
        """A PUT chunk no tier could take: its NO_ROOM item, whose tier code names a tier
        whose filesystem was full where that is part of why (the one reason a client can do
        nothing about but tell the operator; older clients ignore it). The store's reason
        (pins, a full filesystem with its free bytes, ...) goes to the log, once a minute at
        most: the item has no room for text. Counted (``kvctl_dataplane_no_room_puts_total``)."""
        self.runtime.metrics.no_room_put()
        n = self.server.no_room_puts.count()
        if n:
            log.warning(
                "refused %d PUT chunk(s) for want of room (NO_ROOM; the last: %s from %s): %s",
                n,
                key.hex(),
                self._peer_name(),
                exc,
            )
        full = exc.filesystem_full_tiers
        return bytes(
            (Status.NO_ROOM, self.server.tier_codes.get(full[0], NO_TIER) if full else NO_TIER)
        )

    def _get(self, meta: MetaReader, _payload: int) -> Reply:
        """Chunks' bytes, in place under leases where they can be (``_send_views``), else as
        copies. With GET_COUNTED (a client's re-read of chunks its LEASE counted as served: the
        lease ran out during its copy, or the chunk was not leasable) the same, without
        counting the access again, so each read counts a chunk once."""
        tenant = meta.tenant()
        keys = meta.keys()
        counted = parse_get_flags(meta)
        items = bytearray()
        payload: list[memoryview | bytearray] = []
        total = 0
        self.runtime.fill(keys, tenant=tenant)  # what is not here, from the pool/peers
        views = self._send_views(keys, tenant, served=not counted)
        for data in views:
            if data is None:
                items += GET_ITEM.pack(Status.MISSING, 0)
                continue
            n = memoryview(data).nbytes
            items += GET_ITEM.pack(Status.OK, n)
            payload.append(data)
            total += n
        if not counted:  # a re-read of chunks a LEASE counted: counted there
            self._count_reads("get", keys, views)
        return [MetaWriter().u32(len(keys)).raw(bytes(items)).build(), *payload], total

    def _send_views(
        self, keys: list[bytes], tenant: str, *, served: bool = True
    ) -> list[memoryview | bytearray | None]:
        """The chunks' bytes to send (None: missing): in place under endless leases (this
        thread releases them after the send, whatever happens), or a copy where one cannot be
        leased. One batch lease, so the disk chunks among them are read in parallel. A key
        named twice is leased (or copied) once and sent twice. Copies are held until the reply
        is sent: they take ``server.copy_budget`` (freed after the send), and a chunk past it
        is answered missing, as one evicted meanwhile would be, so a reply costs the agent a
        bounded amount of memory however many chunks it names and however slowly it is read."""
        unique = list(dict.fromkeys(keys))
        leases = self.runtime.lease_many(unique, math.inf, tenant=tenant, served=served)
        # every lease is released after the send, even when making a view below fails
        self._release_after_send += [r.lease_id for r in leases if isinstance(r, Lease)]
        views: dict[bytes, memoryview | bytearray | None] = {}
        to_copy: list[bytes] = []
        for key, lease in zip(unique, leases, strict=True):
            views[key] = None
            if isinstance(lease, KeyNotFound):
                continue
            if lease is not None:
                try:
                    views[key] = self.runtime.leased_view(lease)
                    continue
                except TierUnavailable:
                    # a live resize replaced the arena between the lease and its view (views
                    # taken before it stay valid: the old mapping lives while they do): the
                    # chunk is read again where it is now, or is a miss if it went meanwhile.
                    # A closed tier fails that read too, and that error is the batch's.
                    pass
            to_copy.append(key)
        views.update(self._copies(to_copy, tenant))
        return [views[k] for k in keys]

    def _copies(self, keys: list[bytes], tenant: str) -> dict[bytes, bytearray | None]:
        """A copy of each of ``keys`` (distinct) read without counting the access (None: not
        cached, or past the copy budget), for chunks whose read was counted already: by this
        request's batch lease, or by the client's LEASE before a GET_COUNTED."""
        copies: dict[bytes, bytearray | None] = dict.fromkeys(keys)
        if keys:
            entries = self.runtime.cached_entries(keys, tenant=tenant)
            for key, entry in zip(keys, entries, strict=True):
                if entry is not None:
                    copies[key] = self._copy_within_budget(key, entry.size_bytes, tenant)
        return copies

    def _copy_within_budget(self, key: bytes, size_bytes: int, tenant: str) -> bytearray | None:
        """A copy of a chunk the reply cannot send in place, its bytes taken from the copy
        budget (without waiting: a reply holding some must not wait on others that do); None
        (a miss) when the budget has no room for it or the chunk went meanwhile."""
        budget = self.server.copy_budget
        if not budget.try_acquire(size_bytes):
            n = self.server.copies_refused.count()
            if n:
                log.warning(
                    "answered %d chunk(s) missing: they could not be sent in place and the "
                    "replies' copies in flight held their budget of %d bytes "
                    "(data_put_budget_bytes; readers slow to take their replies hold it)",
                    n,
                    budget.total_bytes,
                )
            return None
        try:
            # counted as served already (by lease_many, or the client's LEASE): once a read
            data = self.runtime.get_uncounted(key, tenant=tenant)
        except KeyNotFound:
            budget.release(size_bytes)
            return None
        except BaseException:
            budget.release(size_bytes)
            raise
        extra = len(data) - size_bytes  # put again, with another size, since it was looked up
        if extra > 0 and not budget.try_acquire(extra):
            budget.release(size_bytes)
            return None
        if extra < 0:
            budget.release(-extra)
        self._copy_bytes_held += len(data)
        return data

    def _fetch(self, meta: MetaReader, _payload: int) -> Reply:
        """Chunks and their metadata for another agent; without FETCH_PAYLOAD only the metadata
        (a probe: counts nothing, moves no bytes). With FETCH_CHECKSUMS the reply ends with
        each chunk's XXH3-64, so the puller can tell bytes damaged on the way (a flipped bit
        past TCP's weak checksum, a faulty NIC or relay) from the chunk: it is asked for by
        other agents only, so an engine's local reads never pay for it."""
        tenant = meta.tenant()
        want_payload, want_checksums = parse_fetch_flags(meta.u8())
        keys = meta.keys()
        meta.done()
        w = MetaWriter().u32(len(keys))
        payload: list[memoryview | bytearray] = []
        checksums: list[int] = []
        checksum_of: dict[int, int] = {}  # by id of the view: a key named twice is hashed once
        total = 0
        # the bytes (without the store's lock: disk reads run in parallel) between two reads
        # of each entry's metadata: a chunk evicted, or replaced (another tenant's put over a
        # key it may not see replaces the chunk), in between is reported missing. Read after
        # the bytes alone, a replacement sent one chunk's bytes under another's owner and
        # flags (an isolated tenant's chunk as the putter's shared one), or under another
        # size, which broke the reply
        before = (
            [_chunk_id(e) for e in self.runtime.cached_entries(keys, tenant=tenant)]
            if want_payload
            else None
        )
        views = self._send_views(keys, tenant) if want_payload else [None] * len(keys)
        after = self.runtime.cached_entries(keys, tenant=tenant)
        entries = (
            [_sent_chunk(b, e, data) for b, e, data in zip(before, after, views, strict=True)]
            if before is not None
            else after
        )
        for e, data in zip(entries, views, strict=True):
            if e is None:
                w.raw(FETCH_ITEM.pack(Status.MISSING, 0, 0, 0, 0, bytes(16), 0.0)).text("")
                checksums.append(0)
                continue
            flags = (FLAG_HAS_PARENT if e.parent is not None else 0) | (
                FLAG_ISOLATED if e.isolated else 0
            )
            w.raw(
                FETCH_ITEM.pack(
                    Status.OK,
                    e.size_bytes,
                    e.tokens,
                    e.priority,
                    flags,
                    e.parent or bytes(16),
                    e.created_s,
                )
            ).text(e.tenant)
            if data is not None:
                payload.append(data)
                total += memoryview(data).nbytes
            # of the very view sent: it is leased (released only after the send) or a copy, so
            # these are the bytes that go out
            if want_checksums and data is not None:
                if id(data) not in checksum_of:
                    checksum_of[id(data)] = chunk_checksum(data)
                checksums.append(checksum_of[id(data)])
            else:
                checksums.append(0)
        if want_checksums:
            w.raw(b"".join(map(FETCH_CHECKSUM.pack, checksums)))
        if want_payload:  # without it, a probe: it reads nothing
            self._count_reads("fetch", keys, entries)
        return [w.build(), *payload], total

    def _count_reads(self, op: str, keys: list[bytes], got: Sequence[object | None]) -> None:
        """Count a read's chunks, found or missing (None in ``got``, one per key): a key named
        twice once, as its lease and its served count are (and as a LEASE counts it)."""
        found = dict(zip(keys, (g is not None for g in got), strict=True))
        n_found = sum(found.values())
        self.runtime.metrics.chunks_read(op, n_found, len(found) - n_found)

    def _exists(self, meta: MetaReader, _payload: int) -> Reply:
        tenant = meta.tenant()
        keys = meta.keys()
        meta.done()
        codes = self.server.tier_codes
        tiers = self.runtime.locate(keys, tenant=tenant)
        return [MetaWriter().u32(len(keys)).raw(bytes(map(codes.__getitem__, tiers))).build()], 0

    def _tenant(self, meta: MetaReader, _payload: int) -> Reply:
        tenant = meta.tenant()
        meta.done()
        return [bytes((int(self.runtime.is_isolated(tenant)),))], 0

    def _rates(self, meta: MetaReader, _payload: int) -> Reply:
        """An engine's measured prefill samples and host -> device bandwidth: all of the frame
        is checked before any of it is kept, and a bad figure names itself (BAD_REQUEST)."""
        raw, bandwidth, model = parse_rates(meta)
        try:
            samples = [PrefillSample(n, a, t) for n, a, t in raw]
            kept = self.runtime.report_rates(
                samples, host_to_device_bytes_per_s=bandwidth, model=model
            )
        except InvalidArgument as exc:
            raise FrameError(ErrorCode.BAD_REQUEST, f"RATES refused: {exc}") from None
        prefill = self.runtime.planner.prefill(model or None)
        reply = rates_reply(kept, prefill.tokens_per_s, prefill.beta_s_per_token2, prefill.basis)
        return [reply], 0

    def _lookup(self, meta: MetaReader, _payload: int) -> Reply:
        tenant = meta.tenant()
        keys = meta.keys()
        meta.done()
        w = MetaWriter()
        self._lookup_reply(w, keys, tenant)
        return [w.build()], 0

    def _lookup_many(self, meta: MetaReader, _payload: int) -> Reply:
        """Each chain's lookup; an empty chain (a prompt shorter than a chunk) is answered as
        a miss without counting a lookup, so it cannot dilute the hit ratios."""
        tenant = meta.tenant()
        chains: list[list[bytes]] = []
        n_keys = 0
        for i in range(meta.count()):
            # refused as soon as the chains pass the cap, before their keys are read: read
            # whole first, a frame of 8 MiB of keys held about 29 MiB of key objects to be refused
            n_keys += meta.next_count()
            if n_keys > MAX_LOOKUP_MANY_KEYS:
                raise FrameError(
                    ErrorCode.BAD_REQUEST,
                    f"LOOKUP_MANY of more than {MAX_LOOKUP_MANY_KEYS} keys in all (the limit; "
                    f"{n_keys} by its chain {i + 1}); split the batch",
                )
            chains.append(meta.keys())
        meta.done()
        w = MetaWriter().u32(len(chains))
        empty = MetaWriter().u32(0).u64(0).u32(0).build()  # nothing matched of no keys
        for keys in chains:
            if keys:
                self._lookup_reply(w, keys, tenant)
            else:
                w.raw(empty)
        return [w.build()], 0

    def _lookup_reply(self, w: MetaWriter, keys: list[bytes], tenant: str) -> LookupResult:
        """Writes the lookup's answer; returns it."""
        res = self.runtime.lookup(keys, tenant=tenant)
        codes = self.server.tier_codes
        w.u32(res.matched_chunks).u64(res.matched_tokens).u32(len(keys))
        w.raw(bytes(map(codes.__getitem__, res.locations)))
        return res

    def _require_shm(self) -> CpuTier:
        if self.transport != "unix":
            raise FrameError(ErrorCode.UNSUPPORTED, "shared memory is served on the Unix socket")
        if self.server.shm_tier is None:
            raise FrameError(ErrorCode.UNSUPPORTED, "this agent's cpu tier is not shared (shm off)")
        return self.server.shm_tier

    def _map(self, meta: MetaReader, _payload: int) -> Reply:
        meta.done()
        tier = self._require_shm()
        fd, generation, size = self.runtime.map_shm_arena(tier)
        self._send_fd = fd
        return [MetaWriter().u64(generation).u64(size).build()], 0

    def _lease(self, meta: MetaReader, _payload: int) -> Reply:
        self._require_shm()
        tenant = meta.tenant()
        ttl = self._lease_ttl(meta.f64())
        keys = meta.keys()
        meta.done()
        w = MetaWriter().u32(len(keys))
        return [w.raw(self._lease_items(keys, ttl, tenant)).build()], 0

    def _lookup_lease(self, meta: MetaReader, _payload: int, *, local_only: bool = False) -> Reply:
        """A lookup whose matched prefix is leased at once: the engine that asks is about to
        read it, and saves the LEASE round trip. ``local_only`` (LOOKUP_LEASE_LOCAL): leased up
        to its first chunk on another node, and that one and the rest are REMOTE, not pulled,
        so the engine can LEASE them in slices and copy each while the next one is pulled."""
        self._require_shm()
        tenant = meta.tenant()
        ttl = self._lease_ttl(meta.f64())
        keys = meta.keys()
        meta.done()
        w = MetaWriter()
        res = self._lookup_reply(w, keys, tenant)
        m = here = res.matched_chunks
        if local_only:
            local = self.server.local_tiers
            here = next((i for i, t in enumerate(res.locations[:m]) if t not in local), m)
        items = self._lease_items(keys[:here], ttl, tenant, pull=not local_only)
        w.u32(m).raw(items + _REMOTE_ITEM * (m - here))
        return [w.build()], 0

    def _lease_ttl(self, ttl: float) -> float:
        if math.isnan(ttl):  # passes any clamp, and no expiry would ever end such a lease
            raise FrameError(ErrorCode.BAD_REQUEST, "a lease's ttl must be a number, got NaN")
        return min(max(ttl, 0.001), self.runtime.settings.lease_seconds)

    def _lease_items(
        self, keys: list[bytes], ttl: float, tenant: str, *, pull: bool = True
    ) -> bytes:
        """A LEASE_ITEM per key: held in the arena, cached elsewhere (fallback) or missing.
        ``pull``: chunks on other nodes are brought here first. A key named twice is leased
        once, and its item (the same lease) repeated: a client releasing both releases it."""
        if not keys:
            return b""
        unique = list(dict.fromkeys(keys))
        self._check_lease_room(len(unique))
        if pull:
            self.runtime.fill(unique, tenant=tenant)  # same-host readers get remote chunks too
        items: dict[bytes, bytes] = {}
        missing = 0
        # one batch, so the disk chunks among them are read in parallel
        for key, lease in zip(
            unique, self.runtime.lease_many(unique, ttl, tenant=tenant), strict=True
        ):
            if isinstance(lease, KeyNotFound):
                items[key] = LEASE_ITEM.pack(Status.MISSING, 0, 0, 0, 0, 0.0)
                missing += 1
                continue
            if lease is None:
                # cached here, not leasable (pinned on disk, no room in the arena): counted
                # read here, where lease_many counted it served, as the client's re-read of it
                # is a GET_COUNTED that counts nothing
                items[key] = LEASE_ITEM.pack(Status.FALLBACK, 0, 0, 0, 0, 0.0)
                continue
            self._leases[lease.lease_id] = lease.deadline_s
            items[key] = LEASE_ITEM.pack(
                Status.OK,
                lease.generation,
                lease.lease_id,
                lease.offset,
                lease.size_bytes,
                lease.deadline_s,
            )
        self.runtime.metrics.chunks_read("lease", len(unique) - missing, missing)
        return b"".join(map(items.__getitem__, keys))

    def _check_lease_room(self, n_new: int) -> None:
        """Refuse (BAD_REQUEST) leases that would take this connection past its limit; leases
        that expired (the store ended them) stop counting here too."""
        if len(self._leases) + n_new <= MAX_LEASES_PER_CONNECTION:
            return
        now_s = time.monotonic()
        self._leases = {i: due for i, due in self._leases.items() if due > now_s}
        held = len(self._leases)
        if held + n_new > MAX_LEASES_PER_CONNECTION:
            raise FrameError(
                ErrorCode.BAD_REQUEST,
                f"this connection holds {held} leases; {n_new} more would pass its limit of "
                f"{MAX_LEASES_PER_CONNECTION}: release some first",
            )

    def _release(self, meta: MetaReader, _payload: int) -> Reply:
        n = meta.count()
        ids = [meta.u64() for _ in range(n)]
        meta.done()
        # never another client's leases; a lease named twice (a key leased twice) ends once
        mine = [i for i in dict.fromkeys(ids) if self._leases.pop(i, None) is not None]
        self.runtime.release(mine)
        return [b""], 0

    def _attach(self, meta: MetaReader, _payload: int) -> Reply:
        if self.transport != "unix":
            raise FrameError(ErrorCode.UNSUPPORTED, "staging segments attach on the Unix socket")
        size = meta.u64()
        meta.done()
        try:
            if len(self._fds) != 1:
                raise _SegmentRefused("descriptors", "ATTACH needs exactly one file descriptor")
            fd = self._fds[0]
            _check_segment(fd, size)
            try:
                staging = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            except (OSError, OverflowError) as exc:
                # out of address space (RLIMIT_AS), memory or descriptors: the client's puts
                # go over the socket and it tries again later; an INTERNAL error closed its
                # connection
                raise _mapping_refused(size, exc) from None
        except _SegmentRefused as exc:
            self._segment_refused(exc)
        hugepages.advise(staging)
        # a gpu tier copies puts from the segment in one transfer once it is registered; this
        # replaces the connection's old registration first, so the old mapping can close
        self.runtime.register_host_region(self, staging, read_only=True)
        if self._staging is not None:
            self._staging.close()
        self._staging = staging
        return [b""], 0

    def _segment_refused(self, exc: _SegmentRefused) -> NoReturn:
        """Log a refused staging segment with what to do (each cause once an interval, with
        a count: any client may send many), and raise the refusal."""
        n = self.server.segments_refused.count(exc.cause)
        if n:
            log.warning(
                "refused a client's staging segment: %s. Its puts go over the socket, more "
                "slowly, until it attaches one this agent takes. To fix: %s (%d refusal(s) "
                "of this kind since the last such line)",
                exc.message,
                _SEGMENT_TO_DO[exc.cause],
                n,
            )
        raise exc

    # --- teardown ---------------------------------------------------------------------------
    @property
    def holds_leases(self) -> bool:
        return bool(self._leases)

    def close_to_make_room(self) -> bool:
        """Close this connection if it is idle (``DataPlaneServer._close_idle``): waiting for
        its next frame with none of its bytes unread, and holding no leases (their chunks would
        go from under its reader); whether it did. Its client sees the connection closed
        (``DataClient``: AgentUnreachable on its next call) and connects again."""
        with self._state_lock:
            if self._closed or self.idle_since is None or self._leases:
                return False
            poller = select.poll()  # not select(): descriptors past 1024 are common here
            poller.register(self.sock, select.POLLIN)
            if poller.poll(0):
                # its next request (or its close) is here: its reader, waiting on it without
                # reading (``_read_header``), serves it
                return False
            self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        return True

    def close_if_idle(self, *, force: bool = False) -> None:
        with self._state_lock:
            if self._closed or (self.busy_since is not None and not force):
                return
            self._closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _cleanup(self) -> None:
        with self._state_lock:
            self._closed = True
        # a crashed or departed client's leases end with its connection, not at their deadline
        with contextlib.suppress(KvctlError):
            self.runtime.release(list(self._leases))
        self._leases.clear()
        self.runtime.unregister_host_region(self)
        if self._staging is not None:
            with contextlib.suppress(BufferError):
                self._staging.close()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self._linger()
        with contextlib.suppress(OSError):
            self.sock.close()
        self.server.forget(self)

    def _linger(self) -> None:
        """Send FIN after the replies, then drop what the client still sends until it closes
        (see LINGER_SECONDS). A client that closed first costs two syscalls."""
        deadline = time.monotonic() + LINGER_SECONDS
        left = LINGER_BYTES
        scratch = memoryview(self._buffer(64 << 10))
        try:
            self.sock.shutdown(socket.SHUT_WR)
            while left > 0:
                self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
                k = self.sock.recv_into(scratch, min(left, scratch.nbytes))
                if k == 0:
                    return
                left -= k
        except OSError:  # a timeout, a reset, a socket already shut: nothing more to save
            return
        finally:
            scratch.release()


def _chunk_id(entry: Entry | None) -> tuple[str, bool, int, float] | None:
    """What tells one put of a chunk from another: a chunk is put once, and a new put of its
    key (a replacement, or a put after an eviction) is a new entry with its own ``created_s``,
    while moving between tiers keeps it."""
    if entry is None:
        return None
    return (entry.tenant, entry.isolated, entry.size_bytes, entry.created_s)


def _sent_chunk(
    before: tuple[str, bool, int, float] | None,
    after: Entry | None,
    data: memoryview | bytearray | None,
) -> Entry | None:
    """The entry a FETCH reply names for ``data`` (the bytes read between the two reads of
    the chunk's entry: ``before``, its ``_chunk_id``, and ``after``), or None (reported
    missing) unless both are the same put of the chunk and ``data`` is its size."""
    if before is None or after is None or data is None or before != _chunk_id(after):
        return None
    return after if memoryview(data).nbytes == after.size_bytes else None


#: Linux's F_SEAL_FUTURE_WRITE (Python's fcntl does not name it): no new write access to the
#: file, hole punching included, while mappings made before stay writable
F_SEAL_FUTURE_WRITE = 0x10


class _SegmentRefused(FrameError):
    """A staging segment this agent will not map (BAD_REQUEST: the connection stays usable, its
    puts go over the socket). ``cause`` keys what the log says to do (``_SEGMENT_TO_DO``)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(ErrorCode.BAD_REQUEST, message)
        self.cause = cause


#: what an operator does about each cause of a refused staging segment
_SEGMENT_TO_DO = {
    "format": (
        "kvctl's SDK makes its segments as needed (a memfd written in full, sealed); this one "
        "came from an older SDK or from code of the client's own: upgrade the client's kvctl "
        f"to this agent's ({__version__})"
    ),
    "size": (
        "the client declared more bytes than its segment holds (kvctl's SDK declares the size "
        "it made): a bug in the client, to report to whoever wrote it"
    ),
    "hugetlbfs": "the client must make its segment with memfd_create, not on hugetlbfs",
    "descriptors": (
        "the client must pass its segment's descriptor with ATTACH (one, no more); where it "
        "does, this agent may be out of descriptors: raise its open files limit "
        "(LimitNOFILE=, ulimit -n)"
    ),
    "memory": (
        "free memory on this host, or raise this agent's limits (systemd's LimitAS= or "
        "MemoryMax=, ulimit -v); kvctl's SDK tries again later by itself"
    ),
    "open files": (
        "raise this agent's open files limit (systemd's LimitNOFILE=, ulimit -n; where the "
        "host's table is full, ENFILE, its fs.file-max); kvctl's SDK tries again later by itself"
    ),
}


def _mapping_refused(size: int, exc: OSError | OverflowError) -> _SegmentRefused:
    """The refusal of a segment that passed its checks but could not be mapped: mapping takes
    a descriptor of its own (mmap dups the one passed), so an agent at its open files limit
    fails here (EMFILE, ENFILE), where the remedy is that limit, not memory."""
    # the SDK reads these words to tell the causes apart (``SEGMENT_UNMAPPED_TEXT``)
    message = f"this agent {SEGMENT_UNMAPPED_TEXT} of {size} bytes: {exc}"
    if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE):
        return _SegmentRefused("open files", f"{message} ({SEGMENT_NO_DESCRIPTORS_TEXT})")
    return _SegmentRefused("memory", message)


def _check_segment(fd: int, size: int) -> None:
    """Refuse (``_SegmentRefused``) a staging segment the agent cannot map safely. The client keeps
    write access to it: were it able to shrink the file, the agent's reads through the mapping
    past the new end would raise SIGBUS and kill the agent. So only a memfd sealed against
    shrinking (F_SEAL_SHRINK) that already holds ``size`` bytes is mapped, and not on hugetlbfs,
    where a hole punched in the file faults with SIGBUS once no huge page is free.

    Nor may a read through the mapping allocate: a hole read through a shared mapping is
    allocated by that read, in the agent (its memory, its cgroup's), so a sparse segment (or one
    punched out once attached) made the agent allocate as much as the client declared, the
    client holding none (2 GiB for a 2 GiB segment). So the segment must also be sealed against
    punching holes (F_SEAL_FUTURE_WRITE, or F_SEAL_WRITE) and hold no hole in its first ``size``
    bytes, which it then keeps: every page written (the kernel's SEEK_HOLE counts a page
    fallocated but never written as a hole, and so does this check)."""
    if size <= 0:
        raise _SegmentRefused("size", f"a staging segment needs a size, got {size}")
    need = (
        "a staging segment must be a memfd written in full and sealed against shrinking and "
        "holes (F_SEAL_SHRINK, F_SEAL_FUTURE_WRITE)"
    )
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except (OSError, AttributeError):  # not a memfd (a plain file, a pipe), or not Linux
        raise _SegmentRefused("format", f"{need}; this one takes no seals") from None
    if not seals & fcntl.F_SEAL_SHRINK:
        raise _SegmentRefused("format", f"{need}; this one is not sealed") from None
    st = os.fstat(fd)
    if st.st_size < size:
        raise _SegmentRefused("size", f"staging segment holds {st.st_size} bytes, not {size}")
    # hugetlbfs answers statfs with its page size; tmpfs with the base page size even where its
    # files take transparent huge pages (then their st_blksize is 2 MiB: not a refusal, or no
    # segment would be mapped on a host with shmem_enabled = always)
    if os.fstatvfs(fd).f_bsize > mmap.PAGESIZE:
        raise _SegmentRefused("hugetlbfs", "hugetlbfs staging segments are not accepted")
    if not seals & (F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_WRITE):
        raise _SegmentRefused("format", f"{need}; holes can be punched in this one")
    try:
        hole = os.lseek(fd, 0, os.SEEK_HOLE)  # st_size where there is none
    except OSError as exc:
        raise _SegmentRefused("format", f"{need}; its holes cannot be found") from exc
    if hole < size:
        raise _SegmentRefused("format", f"{need}; this one has a hole at byte {hole}")


def _store_error(exc: KvctlError) -> FrameError:
    if isinstance(exc, KeyNotFound):
        return FrameError(ErrorCode.NOT_FOUND, str(exc))
    if isinstance(exc, CapacityError):
        return FrameError(ErrorCode.NO_ROOM, str(exc))
    if isinstance(exc, TierUnavailable):
        return FrameError(ErrorCode.UNAVAILABLE, str(exc))
    return FrameError(ErrorCode.BAD_REQUEST, str(exc))
