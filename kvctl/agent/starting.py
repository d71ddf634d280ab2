"""What the control port answers while the agent opens its tiers.

The control API's socket listens from the start (a second agent given the same ports is refused
before its tiers open), but the API itself is served only once the tiers are open: a large disk
tier's scan takes minutes, committing the arena seconds a GiB. A client connecting meanwhile
(``kvctl status``, a collector, Prometheus) used to wait, unanswered, for its own timeout and then
say the agent was not answering. :class:`StartingResponder` answers each such request at once with
``503 Service Unavailable``, ``Retry-After`` and a detail saying the agent is starting, until the
API takes the socket over. It tells nothing else (no name, no settings), so it needs no token.
Prometheus's scrape of ``/metrics`` is the one exception: it gets ``200`` and the gauge
``kvctl_agent_starting 1`` alone, so a start is told from an agent that is down (``up`` stays 1,
and an alert on that gauge says when a start is taking too long).
"""

from __future__ import annotations

import contextlib
import json
import logging
import selectors
import socket
import threading
import time

from kvctl.agent_starting import STARTING_DETAIL

log = logging.getLogger("kvctl.agent")

#: the answer's detail (kvctl.agent_starting: the SDK, collectors and read model know it too)
DETAIL = STARTING_DETAIL
#: seconds a client is told to wait before it asks again
RETRY_AFTER_S = 1
#: seconds one client may hold this responder in all (to send its request head, to close after
#: the answer): the requests are answered one at a time, so a client that trickles its bytes
#: delays the next, and the API's start, this long at most
CLIENT_TIMEOUT_S = 1.0
#: most bytes of a request read (its head: what comes after is not needed to answer it)
MAX_REQUEST_BYTES = 16 << 10
#: seconds between two looks at whether to stop
POLL_S = 0.05


def starting_answer(*, head_only: bool = False) -> bytes:
    """The whole HTTP answer to any request while the agent starts (``head_only``: to a HEAD
    request, its head alone)."""
    body = json.dumps({"detail": DETAIL, "starting": True}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Retry-After: {RETRY_AFTER_S}\r\n"
        "Connection: close\r\n"
        "\r\n"
    )
    return head.encode() + (b"" if head_only else body)


#: the gauge a scrape of /metrics gets while the agent starts; the API serves it as 0
STARTING_GAUGE = "kvctl_agent_starting"
STARTING_GAUGE_HELP = (
    "1 while the agent opens its tiers (it serves nothing else then), 0 once it serves."
)


def metrics_answer(*, head_only: bool = False) -> bytes:
    """The answer to a scrape of /metrics while the agent starts: Prometheus text with
    :data:`STARTING_GAUGE` at 1 and nothing else (``head_only``: to a HEAD request)."""
    body = (
        f"# HELP {STARTING_GAUGE} {STARTING_GAUGE_HELP}\n"
        f"# TYPE {STARTING_GAUGE} gauge\n"
        f"{STARTING_GAUGE} 1.0\n"
    ).encode()
    head = (
        "HTTP/1.1 200 OK\r\n"
        "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        "\r\n"
    )
    return head.encode() + (b"" if head_only else body)


def _answer_for(request: bytes) -> bytes:
    """The answer to ``request`` (its head): a scrape of /metrics gets the starting gauge, any
    other request "starting" (a HEAD either's head alone)."""
    method, _, rest = request.partition(b" ")
    target = rest.split(b" ", 1)[0].split(b"?", 1)[0]
    head_only = method == b"HEAD"
    if method in (b"GET", b"HEAD") and target == b"/metrics":
        return metrics_answer(head_only=head_only)
    return starting_answer(head_only=head_only)


class StartingResponder:
    """Answers every request on the listening socket ``sock`` with :func:`starting_answer` (a
    scrape of /metrics with :func:`metrics_answer`), on a
    thread of its own, from :meth:`start` until :meth:`stop`; then connections wait in the
    socket's backlog again, for the server that takes it over. The socket stays open and
    listening throughout."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: requests answered so far (for tests and the log)
        self.answered = 0

    def __enter__(self) -> StartingResponder:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="kvctl-starting-responder", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop answering (idempotent); returns once no request is being answered."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self.answered:
                log.info(
                    "answered %d request(s) while the tiers opened: 'starting' (503), and "
                    "a /metrics scrape the starting gauge",
                    self.answered,
                )

    def _run(self) -> None:
        try:
            self._answer_all()
        except Exception:  # in the agent's log, not on a detached agent's lost stderr
            log.exception("the responder answering 'starting' failed; clients wait instead")

    def _answer_all(self) -> None:
        # non-blocking while answering: a client gone between select and accept must not hold
        # this thread (and stop()) in accept until the next one comes
        try:
            self._sock.setblocking(False)
        except OSError:  # closed under it: a failed start
            return
        # a selector, not select.select: that refuses descriptors past 1023 (an embedder's)
        try:
            with selectors.DefaultSelector() as selector:
                try:
                    selector.register(self._sock, selectors.EVENT_READ)
                except (OSError, ValueError):  # closed under it
                    return
                while not self._stop.is_set():
                    if not selector.select(POLL_S) or self._stop.is_set():
                        continue
                    self._accept_one()
        finally:
            with contextlib.suppress(OSError):
                self._sock.setblocking(True)  # as it was given, for the server taking it over

    def _accept_one(self) -> None:
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        except OSError:  # out of descriptors (EMFILE): the client waits in the backlog
            self._stop.wait(POLL_S)
            return
        with conn:
            self._answer_one(conn)

    def _answer_one(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + CLIENT_TIMEOUT_S

        def receive() -> bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            conn.settimeout(left)
            return conn.recv(4096)

        conn.setblocking(True)
        with contextlib.suppress(OSError):
            request = b""
            while b"\r\n\r\n" not in request and len(request) < MAX_REQUEST_BYTES:
                chunk = receive()
                if not chunk:
                    break
                request += chunk
            conn.sendall(_answer_for(request))
            self.answered += 1
            # closed gracefully: what the client still sends (a body) is read and dropped,
            # since closing with unread bytes would reset the connection, maybe before the
            # client had read the answer
            conn.shutdown(socket.SHUT_WR)
            while receive():
                pass
