"""Calls given up at a deadline let go of their thread. httpx's timeouts bound each read, not a
whole answer, so a call to a target trickling its answer (a byte at a time, each within the
read timeout) read on for as long as it trickled, holding its thread and its socket after the
caller had stopped waiting. A call run under :func:`running` whose requests go through an
:class:`AbandonableTransport` notes the connections it opens; the waiting side gives it up with
:meth:`Abandonable.abandon`, which shuts them down, so the call's read fails at once and its
thread returns. The collector's scrapes (``collectors.collector.Deadlines``) and the fleet's
fan-outs (``kvctl.fleet.fanout.fan_out``) use it.

A request given up so may still have reached its target: an action (pin, evict) cut off may
act all the same; the callers report it as failed, as they do one their client's timeout cut."""

from __future__ import annotations

import contextlib
import functools
import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpcore
import httpx

from kvctl.errors import KvctlError

#: the call the current thread runs under ``running``, for the transport it goes through
_running = threading.local()


class Abandonable:
    """One call run to a deadline: the connections it opened, each as a duplicate of its
    socket, so the waiting side can shut the connection down when it gives the call up (waking
    a read blocked on it at once) without racing the call's thread, which closes its own
    descriptor; the duplicates are closed when the call ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.abandoned = False

    def opened(self, sock: socket.socket) -> None:
        """In the call's thread: it connected ``sock`` (shut down at once if given up)."""
        dup = sock.dup()
        with self._lock:
            self._socks.append(dup)
            if self.abandoned:
                _shut_down(dup)

    def abandon(self) -> None:
        """The waiting side gave the call up: its connections are shut down, so its thread
        stops reading now rather than when a trickled answer ends (and one it opens later is
        shut down as it opens). Harmless on a call that ended."""
        with self._lock:
            self.abandoned = True
            for sock in self._socks:
                _shut_down(sock)

    def end(self) -> None:
        """In the call's thread, once it returned or raised."""
        with self._lock:
            socks, self._socks = self._socks, []
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def running(call: Abandonable) -> Iterator[None]:
    """In the call's thread, around the call: the requests it makes through an
    ``AbandonableTransport`` are ``call``'s, cut when it is abandoned."""
    previous = getattr(_running, "call", None)
    _running.call = call
    try:
        yield
    finally:
        _running.call = previous
        call.end()


def _shut_down(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # the connection may be gone already
        sock.shutdown(socket.SHUT_RDWR)


def _trace(
    call: Abandonable, inner: Callable[[str, Any], None] | None, name: str, info: Any
) -> None:
    """httpcore's trace hook on a request of a call run under ``running``: notes each
    connection it opens."""
    if name in ("connection.connect_tcp.complete", "connection.connect_unix_socket.complete"):
        sock = info["return_value"].get_extra_info("socket")
        if isinstance(sock, socket.socket):
            call.opened(sock)
    if inner is not None:
        inner(name, info)


class AbandonableTransport(httpx.BaseTransport):
    """An HTTP transport whose requests made under ``running`` are cut when their call is
    abandoned (any other request goes as through httpx's own). ``verify``: False for plain
    http spares building a TLS context.

    Each request opens a connection of its own, a TCP handshake a request: a connection kept
    alive and handed on is not seen being opened, so a call reusing one another call opened
    could not be cut. ``keep_alive`` keeps them all the same, for a transport whose requests
    are all one call's (a client made for the call and closed with it). A proxy the
    environment names (HTTP_PROXY and the rest) is used as by a client of httpx's own."""

    def __init__(self, *, verify: bool = True, keep_alive: bool = False) -> None:
        self._verify = verify
        self._limits = httpx.Limits() if keep_alive else httpx.Limits(max_keepalive_connections=0)
        self._inner = httpx.HTTPTransport(verify=verify, limits=self._limits)
        # httpx takes no proxy from the environment for a client given a transport: this one
        # does, as a client of httpx's own would (one inner transport per proxy, made on use)
        self._env_proxies = urllib.request.getproxies_environment()
        self._via: dict[str, httpx.HTTPTransport] = {}
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        call: Abandonable | None = getattr(_running, "call", None)
        if call is not None:
            inner = request.extensions.get("trace")
            request.extensions["trace"] = functools.partial(_trace, call, inner)
        return self._transport_for(request.url).handle_request(request)

    def _transport_for(self, url: httpx.URL) -> httpx.HTTPTransport:
        """The proxy's transport where the environment names one for ``url`` (HTTP_PROXY,
        HTTPS_PROXY, ALL_PROXY; not for a host NO_PROXY names), else the direct one. Its
        connection to the proxy is the one a call is seen opening, and cut."""
        proxies = self._env_proxies
        proxy = proxies.get(url.scheme) or proxies.get("all")
        if not proxy:
            return self._inner
        host = url.host if url.port is None else f"{url.host}:{url.port}"
        if urllib.request.proxy_bypass(host):  # NO_PROXY (where the environment names a proxy)
            return self._inner
        with self._lock:
            via = self._via.get(proxy)
            if via is None:
                via = httpx.HTTPTransport(verify=self._verify, limits=self._limits, proxy=proxy)
                self._via[proxy] = via
            return via

    def close(self) -> None:
        self._inner.close()
        with self._lock:
            via, self._via = list(self._via.values()), {}
        for t in via:
            t.close()


def answer_framing(response: httpx.Response) -> tuple[str | None, int | None]:
    """What an answer's headers say of its body before a byte of it is read: its encoding
    where it is not plain (None: plain; a body asked for unencoded but encoded all the same is
    not to be read, its size once decoded is not the size read), and the length it declares
    (None: none, as a chunked answer)."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    declared = response.headers.get("content-length", "").strip()
    return (
        None if encoding in ("", "identity") else encoding,
        int(declared) if declared.isdigit() else None,
    )


class AnswerTooLarge(KvctlError):
    """An answer longer than its transport's ``max_answer_bytes`` (read no further), or one
    compressed though asked not to be. Not an ``httpx.HTTPError``: the server answered, so a
    client's "cannot reach" would mislead; its message names the path asked."""


class AnswerTooSlow(httpx.TimeoutException):
    """An answer not whole by its transport's ``deadline_s`` from the request's start."""


#: when the request the current thread makes through a ``BoundedTransport`` must be done
_bounded = threading.local()


def _remaining_s(timeout: float | None, make: type[Exception]) -> float | None:
    """``timeout`` (httpcore's, for one socket operation) cut to what is left of the current
    request's deadline; ``make`` raised when nothing is left."""
    deadline: _Deadline | None = getattr(_bounded, "deadline", None)
    if deadline is None:
        return timeout
    left: float = deadline.at_s - time.monotonic()
    if left <= 0:
        raise make(f"no whole answer within {deadline.seconds:g} s")
    return left if timeout is None else min(timeout, left)


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at_s = time.monotonic() + seconds


class _BoundedStream(httpcore.NetworkStream):
    """A connection whose every read and write waits no longer than its request has left."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            return self._inner.read(max_bytes, _remaining_s(timeout, httpcore.ReadTimeout))
        except httpcore.ReadTimeout:
            _remaining_s(None, httpcore.ReadTimeout)  # says so when it was the deadline
            raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        try:
            self._inner.write(buffer, _remaining_s(timeout, httpcore.WriteTimeout))
        except httpcore.WriteTimeout:
            _remaining_s(None, httpcore.WriteTimeout)
            raise

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        left = _remaining_s(timeout, httpcore.ConnectTimeout)
        return _BoundedStream(self._inner.start_tls(ssl_context, server_hostname, left))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _BoundedBackend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = _remaining_s(timeout, httpcore.ConnectTimeout)
        return _BoundedStream(
            self._inner.connect_tcp(host, port, left, local_address, socket_options)
        )

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        left = _remaining_s(timeout, httpcore.ConnectTimeout)
        return _BoundedStream(self._inner.connect_unix_socket(path, left, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """In the caller's thread: every request it makes through a ``BoundedTransport`` meanwhile
    is done ``seconds`` from now at the latest (each within its own ``deadline_s`` too), so a
    call of several requests is bounded as a whole."""
    previous = getattr(_bounded, "deadline", None)
    own = _Deadline(seconds)
    _bounded.deadline = own if previous is None or own.at_s < previous.at_s else previous
    try:
        yield
    finally:
        _bounded.deadline = previous


@contextlib.contextmanager
def at_most(max_answer_bytes: int) -> Iterator[None]:
    """In the caller's thread: every answer it reads through a ``BoundedTransport`` meanwhile
    is at most ``max_answer_bytes`` long (and at most its transport's ``max_answer_bytes``)."""
    previous: int | None = getattr(_bounded, "cap", None)
    _bounded.cap = max_answer_bytes if previous is None else min(previous, max_answer_bytes)
    try:
        yield
    finally:
        _bounded.cap = previous


class BoundedTransport(httpx.HTTPTransport):
    """httpx's transport with two bounds on each request, for a caller that must not be held
    by the server it asks: the whole answer, headers and body, within ``deadline_s`` of the
    request's start (``AnswerTooSlow``, a ``httpx.TimeoutException``; httpx's own timeouts
    bound each read, so an answer trickled a byte at a time read on for as long as it
    trickled), and at most ``max_answer_bytes`` of body (``AnswerTooLarge``; read whole here,
    so the caller never holds more). Connections are kept alive as httpx's are: the bound is
    on each socket operation of the request, in the caller's own thread, so no thread is
    started and none is held past the deadline (by more than the socket's own timeout).

    The answer is asked for unencoded (``Accept-Encoding: identity``) and one compressed all
    the same is refused: its size, once decoded, is not the size read."""

    def __init__(
        self,
        *,
        deadline_s: float,
        max_answer_bytes: int,
        verify: bool = True,
        limits: httpx.Limits | None = None,
    ) -> None:
        super().__init__(verify=verify, limits=limits or httpx.Limits())
        pool = self._pool
        backend = getattr(pool, "_network_backend", None)
        if not isinstance(backend, httpcore.NetworkBackend):  # an httpcore this was not made for
            raise TypeError("httpcore's connection pool has no network backend to bound")
        pool._network_backend = _BoundedBackend(backend)
        self.deadline_s = float(deadline_s)
        self.max_answer_bytes = int(max_answer_bytes)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        request.headers["Accept-Encoding"] = "identity"
        previous = getattr(_bounded, "deadline", None)
        own = _Deadline(self.deadline_s)
        _bounded.deadline = own if previous is None or own.at_s < previous.at_s else previous
        try:
            try:
                response = super().handle_request(request)
            except httpx.TimeoutException as exc:
                if "no whole answer within" in str(exc):
                    raise AnswerTooSlow(str(exc), request=request) from exc
                raise
            try:
                body = self._read(response, request)
            finally:
                response.close()
        finally:
            _bounded.deadline = previous
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=httpx.ByteStream(body),
            extensions=response.extensions,
            request=request,
        )

    def _read(self, response: httpx.Response, request: httpx.Request) -> bytes:
        cap = self.max_answer_bytes
        asked: int | None = getattr(_bounded, "cap", None)
        if asked is not None:
            cap = min(cap, asked)
        encoding, declared = answer_framing(response)
        if encoding is not None:
            raise AnswerTooLarge(
                f"{request.url.path}: answer encoded {encoding!r} though asked unencoded: not read"
            )
        if declared is not None and declared > cap:
            raise AnswerTooLarge(
                f"{request.url.path}: answer of {declared:,} bytes, over the {cap:,} taken"
            )
        parts: list[bytes] = []
        size = 0
        try:
            assert isinstance(response.stream, httpx.SyncByteStream)
            for part in response.stream:
                size += len(part)
                if size > cap:
                    raise AnswerTooLarge(
                        f"{request.url.path}: answer longer than the {cap:,} bytes taken"
                    )
                parts.append(part)
        except httpx.TimeoutException as exc:
            if "no whole answer within" in str(exc):
                raise AnswerTooSlow(str(exc), request=request) from exc
            raise
        return b"".join(parts)
