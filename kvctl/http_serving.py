"""How the daemons' HTTP APIs (the agent's control API, the router's) are served by uvicorn,
against clients that hold connections: a cap on connections with a reserve that connections
waiting for a request's head cannot take, a cap on those per source address, a short backlog,
a deadline and a size bound for each request's head, a deadline for its body (whose size
``http_guards.BodyLimit`` bounds), and one log line an interval for failed accepts; and the
listening socket itself (``listen_tcp``).

uvicorn and h11 are imported where used: the module costs nothing to a process that serves no
API.
"""

from __future__ import annotations

import json
import logging
import math
import select
import socket
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from kvctl.connection_sources import source_key

if TYPE_CHECKING:
    import asyncio

    import uvicorn
    from starlette.types import ASGIApp

log = logging.getLogger(__name__)

#: HTTP connections (and requests) an API serves at once: past it uvicorn answers 503
#: (collectors, the CLI and a router's event stream need a handful)
MAX_CONNECTIONS = 256
#: of MAX_CONNECTIONS, those that connections waiting for a request's head (new, or idle between
#: requests) cannot take: past MAX_CONNECTIONS - this, the oldest such connection is closed to
#: make room, so requests (an operator's, authenticated) always find a slot unless requests
#: themselves fill them
RESERVED_FOR_REQUESTS = 32
#: connections waiting for a request's head one source (an IPv4 address, an IPv6 /64) may hold:
#: past it, its oldest is closed, so one client holding silent connections takes 32 slots, not
#: all (the data plane's default data_max_unauthenticated_per_source)
MAX_HEAD_PENDING_PER_SOURCE = 32
#: connections the kernel queues for an API before the daemon accepts them (uvicorn's
#: default, 2048, is also how many failed accepts asyncio logs per retry when out of descriptors)
BACKLOG = 128
#: a request's line and headers must all arrive within this of the connection opening (or of
#: its previous response), or the connection is closed: a slow sender holds nothing for long
HEADER_TIMEOUT_SECONDS = 10.0
#: most bytes of a request's line and headers (a bearer token fits many times over)
MAX_HEADER_BYTES = 16 << 10
#: a request's body must all arrive within this of its headers, or it is answered 408 (the
#: connection closed): the largest body either API takes (4 MiB) needs only 140 KB/s, while a
#: sender trickling a byte every few seconds held its connection, and a slot, for ever
BODY_TIMEOUT_SECONDS = 30.0
#: asyncio's failed accepts, and connections closed to make room, are logged at most once per
#: this interval
ACCEPT_ERROR_LOG_SECONDS = 60.0


class Waiting(Protocol):
    """A connection as ``HeadPending`` sees it."""

    def has_unread_bytes(self) -> bool: ...

    def close_to_make_room(self) -> None: ...


class HeadPending:
    """The connections of one API waiting for a request's head (just opened, or idle after a
    response), oldest first, in all and per source. Past ``per_source`` from one source or
    ``total`` in all, the oldest is closed to make room: refusing the newest instead would
    refuse an operator's connection as readily as a flooder's, and from the flooder's own
    address (a local client and a local operator are both 127.0.0.1) the flooder, reconnecting
    at once, would keep every slot. A connection whose bytes wait unread in its socket is passed
    over: its head is about to be read (a client sends its request as it connects), so a burst
    of new connections accepted before the loop reads any of them cannot close it."""

    def __init__(self, per_source: int, total: int) -> None:
        self.per_source = per_source
        self.total = total
        self._all: dict[Waiting, str] = {}  # insertion order: oldest first
        self._by_source: dict[str, dict[Waiting, None]] = {}
        #: connections closed to make room: in all, and since the last log line
        self.closed = 0
        self._unlogged = 0
        self._next_log_s = -math.inf

    def __len__(self) -> int:
        return len(self._all)

    def count(self, source: str) -> int:
        return len(self._by_source.get(source, ()))

    def add(self, conn: Waiting, source: str, where: str) -> None:
        """``conn`` (from ``source``) waits for a head from now: it is the newest; make room."""
        self.discard(conn)
        self._all[conn] = source
        mine = self._by_source.setdefault(source, {})
        mine[conn] = None
        if len(mine) > self.per_source:
            self._make_room(mine, len(mine) - self.per_source, where)
        if len(self._all) > self.total:
            self._make_room(self._all, len(self._all) - self.total, where)

    def discard(self, conn: Waiting) -> None:
        source = self._all.pop(conn, None)
        if source is None:
            return
        mine = self._by_source[source]
        del mine[conn]
        if not mine:
            del self._by_source[source]

    def _make_room(self, among: Iterable[Waiting], n: int, where: str) -> None:
        victims: list[Waiting] = []
        for conn in among:  # oldest first
            if len(victims) == n:
                break
            if not conn.has_unread_bytes():
                victims.append(conn)
        source = ""
        for conn in victims:
            source = self._all[conn]
            self.discard(conn)
            conn.close_to_make_room()
        self.closed += len(victims)
        self._unlogged += len(victims)
        now = time.monotonic()
        if victims and now >= self._next_log_s:
            log.warning(
                "HTTP API on %s: closed %d connection(s) waiting for a request, to make room "
                "(at most %d such from one address (IPv6: one /64), %d in all); the last from "
                "%s (logged once per %g s)",
                where,
                self._unlogged,
                self.per_source,
                self.total,
                source,
                ACCEPT_ERROR_LOG_SECONDS,
            )
            self._unlogged = 0
            self._next_log_s = now + ACCEPT_ERROR_LOG_SECONDS


def _unread_bytes(transport: asyncio.BaseTransport) -> bool:
    """Whether the socket under ``transport`` has bytes (or its end) waiting to be read."""
    sock = transport.get_extra_info("socket")
    fd = sock.fileno() if sock is not None else -1
    if fd < 0:
        return False
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def listen_tcp(
    host: str, port: int, *, cannot_bind: Callable[[OSError], Exception]
) -> socket.socket:
    """A daemon API's listening TCP socket on ``host:port`` (IPv6 where the host has a colon),
    ``BACKLOG`` deep. A failed bind closes the socket and raises ``cannot_bind(its error)``,
    so each daemon says which address and what for."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named explicitly: accepted sockets inherit it, and asyncio turns on TCP_NODELAY only
    # for IPPROTO_TCP; with Nagle left on, each keep-alive request past the first waited ~40 ms
    # on the client's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise cannot_bind(exc) from exc
    sock.listen(BACKLOG)
    return sock


def serving_config(
    app: ASGIApp,
    log_level: str,
    *,
    header_timeout_s: float = HEADER_TIMEOUT_SECONDS,
    body_timeout_s: float | None = None,
    graceful_shutdown_s: int = 10,
) -> uvicorn.Config:
    """uvicorn's settings for a daemon's API (the agent's control API, the router's), with its
    limits against clients that hold connections: a cap on connections (of which those waiting
    for a request's head take at most all but RESERVED_FOR_REQUESTS, and
    MAX_HEAD_PENDING_PER_SOURCE from one source), a short backlog, a deadline for each
    request's headers and a bound on their size, a deadline for its body (None:
    ``BODY_TIMEOUT_SECONDS``)."""
    import uvicorn

    if body_timeout_s is None:
        body_timeout_s = BODY_TIMEOUT_SECONDS

    return uvicorn.Config(
        app,
        log_level=log_level,
        log_config=None,  # keep the process's logging set-up (kvctl's format, one stream)
        access_log=False,
        lifespan="off",
        # no WebSocket endpoints: an upgrade request is answered as plain HTTP, and the
        # websockets/wsproto modules are not loaded at each daemon's start
        ws="none",
        timeout_graceful_shutdown=graceful_shutdown_s,
        http=deadline_protocol(header_timeout_s, body_timeout_s),
        limit_concurrency=MAX_CONNECTIONS,
        backlog=BACKLOG,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )


def deadline_protocol(header_timeout_s: float, body_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request line and headers have not
    all arrived ``header_timeout_s`` after it opened or after its previous response, and
    answering 408 (then closing) to a request whose body has not all arrived
    ``body_timeout_s`` after its headers. uvicorn times out only a kept-alive connection that
    sends nothing: one that trickled a header byte every few seconds was held for ever, and a
    few hundred of them took every descriptor; so was one that trickled its body, also to an
    endpoint that had answered already (a 401 for a missing token).

    Connections waiting for a request's head (``HeadPending``) are capped per source and in
    all, below MAX_CONNECTIONS (uvicorn's ``limit_concurrency``, which counts every open
    connection): before, one local client without the token holding 300 silent connections
    (reopened as the deadline closed them) had every request answered 503, the operator's
    too. One closed to make room leaves uvicorn's count at once, not at its close's callback."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    waiting = HeadPending(MAX_HEAD_PENDING_PER_SOURCE, MAX_CONNECTIONS - RESERVED_FOR_REQUESTS)

    too_slow = json.dumps(
        {
            "detail": f"request body not all received within {body_timeout_s:g} s of its "
            "headers; send it at once (connection closed)"
        }
    ).encode()

    class DeadlineH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _body_timer: asyncio.TimerHandle | None = None
        _source = ""
        _where = "?"

        #: the API's connections waiting for a head (tests read it)
        head_pending = waiting

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._source = source_key(self.client[0]) if self.client else ""
            if self.server:
                self._where = f"{self.server[0]}:{self.server[1]}"
            self._arm_header_deadline()
            self._wait_for_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_deadline()
            self._wait_for_head()

        def handle_events(self) -> None:
            super().handle_events()
            self._watch_body()
            if self._serving() or self.transport.get_protocol() is not self:  # (an upgrade)
                waiting.discard(self)

        def connection_lost(self, exc: Exception | None) -> None:
            waiting.discard(self)
            for timer in (self._header_timer, self._body_timer):
                if timer is not None:
                    timer.cancel()
            self._header_timer = self._body_timer = None
            super().connection_lost(exc)

        def _serving(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _wait_for_head(self) -> None:
            """Count this connection among those waiting for a head, unless a request (one
            pipelined after the last) is being served or the connection is closing."""
            if not self._serving() and not self.transport.is_closing():
                waiting.add(self, self._source, self._where)

        def has_unread_bytes(self) -> bool:
            return _unread_bytes(self.transport)

        def close_to_make_room(self) -> None:
            # out of uvicorn's count now, not once the close's callback runs: a request read in
            # the same pass of the loop is not answered 503 for slots already given back
            self.connections.discard(self)
            self.transport.close()

        def _arm_header_deadline(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_deadline)

        def _header_deadline(self) -> None:
            self._header_timer = None
            # a request whose headers came (its body arriving, its answer running) is not this
            # deadline's to end: only one still waiting for its whole head
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def _watch_body(self) -> None:
            """Arm the body deadline once a request's headers are in and its body is due;
            disarm it once the body is whole (or the connection failed)."""
            receiving = self.conn.their_state is h11.SEND_BODY
            if receiving and self._body_timer is None:
                self._body_timer = self.loop.call_later(body_timeout_s, self._body_deadline)
            elif not receiving and self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_deadline(self) -> None:
            self._body_timer = None
            if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                # the app waits on the rest of the body: it is told the client left (its
                # answer, if any, goes nowhere) and the client gets the 408 instead
                cycle.disconnected = True
                cycle.message_event.set()
                self._send_408()
            # an answer already under way (or sent, the body unread) is cut off with the body
            self.transport.close()

        def _send_408(self) -> None:
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(too_slow)).encode()),
                (b"connection", b"close"),
            ]
            try:
                for event in (
                    h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                    h11.Data(data=too_slow),
                    h11.EndOfMessage(),
                ):
                    self.transport.write(self.conn.send(event) or b"")
            except h11.LocalProtocolError:  # h11 cannot answer in its state: the close will do
                pass

    return DeadlineH11


class AcceptErrorThrottle(logging.Filter):
    """On the ``asyncio`` logger: one line an interval for failed accepts. Out of descriptors
    (EMFILE), CPython's event loop logs a traceback for each failed accept, as many as the
    backlog every second: about 19,000 lines in seconds, filling the data directory the log is
    in. The line let through says what happened and how many were left out."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(
        self, interval_s: float = ACCEPT_ERROR_LOG_SECONDS, what: str = "control API"
    ) -> None:
        super().__init__()
        self.what = what
        self.interval_s = interval_s
        self._next_s = -math.inf
        self._left_out = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.MESSAGE):
            return True
        now = time.monotonic()
        if now < self._next_s:
            self._left_out += 1
            return False
        exc = record.exc_info[1] if record.exc_info else None
        since = f"; {self._left_out} more since the last line" if self._left_out else ""
        record.msg = "%s: accept failed (%s): new connections wait%s (logged once per %g s)"
        record.args = (self.what, exc, since, self.interval_s)
        record.exc_info = None
        record.exc_text = None
        self._left_out = 0
        self._next_s = now + self.interval_s
        return True


def throttle_accept_errors(
    interval_s: float = ACCEPT_ERROR_LOG_SECONDS, what: str = "control API"
) -> None:
    """Put an ``AcceptErrorThrottle`` on the ``asyncio`` logger (once per process); ``what``
    names the API in its lines."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, AcceptErrorThrottle) for f in logger.filters):
        logger.addFilter(AcceptErrorThrottle(interval_s, what))
