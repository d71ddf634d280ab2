"""What guards the daemons' HTTP APIs (the agent's and the router's): the bearer token, or
without one the Host a request names (``BearerAuth``), the body one request may send
(``BodyLimit``) and what a validation error echoes back (``clip_echo``).

Pure ASGI and standard library only, so the limits hold whatever FastAPI/Starlette version or
server (uvicorn, the test client) runs the app.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The largest valid control request is a bulk call with MAX_KEYS_PER_REQUEST (100,000) keys:
#: 100,000 x 36 bytes (32 hex characters, quotes, comma, space) = 3.6 MB. 4 MiB admits it and
#: bounds what parsing one body can cost (the JSON of 4 MiB parses to a few tens of MiB).
DEFAULT_MAX_BODY_BYTES = 4 << 20

#: what a validation error echoes of the input: items per list/object, characters per string,
#: nesting depth. Inputs are echoed so the caller sees what was wrong, not to return the body.
ECHO_ITEMS = 10
ECHO_CHARS = 200
ECHO_DEPTH = 4


def _json_error(status: int, detail: str, *, close: bool = False) -> tuple[Message, Message]:
    body = json.dumps({"detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if close:  # the rest of the body is never read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    return (
        {"type": "http.response.start", "status": status, "headers": headers},
        {"type": "http.response.body", "body": body},
    )


class _BodyTooLarge(Exception):
    """Raised from ``receive`` into the app once a streamed body passes the cap."""


class BodyLimit:
    """Answers 413 to an HTTP request whose body is over ``max_body_bytes``.

    A Content-Length over the cap is refused before the app runs, reading nothing. A body
    without one (chunked) is counted as the app reads it: the read that passes the cap raises
    into the app instead of returning, nothing more is read, and whatever the app answers to
    that is replaced by the 413. Either way the connection is closed after the answer.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, *, server: str = "agent") -> None:
        if isinstance(max_body_bytes, bool) or not isinstance(max_body_bytes, int):
            raise TypeError(f"max_body_bytes must be an int, got {max_body_bytes!r}")
        if max_body_bytes < 0:
            raise ValueError(f"max_body_bytes must not be negative, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        #: named in the refusal ("the agent's limit")
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name.lower() != b"content-length":
                continue
            # ASCII digits only: int() would take " 5", "+5", "1_0" and non-ASCII digits
            if not value.isdigit() or not value.isascii():
                await self._answer(send, 400, "Content-Length must be a byte count")
                return
            # 20 digits and more are over any cap (and int() refuses over 4,300 digits)
            declared = int(value) if len(value) < 20 else 10**19
            if declared > self.max_body_bytes:
                shown = value[:20].decode() + ("..." if len(value) > 20 else "")
                await self._answer(send, 413, self._too_large(f"{shown} bytes declared"))
                return

        seen_bytes = 0
        over = False
        started = False

        async def limited_receive() -> Message:
            nonlocal seen_bytes, over
            if over:  # the app asked again after the refusal: it gets no more of the body
                raise _BodyTooLarge
            message = await receive()
            if message["type"] == "http.request":
                seen_bytes += len(message.get("body", b""))
                if seen_bytes > self.max_body_bytes:
                    over = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over:  # the app's answer to the refusal (a 400 or a 500) is replaced by the 413
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:  # _BodyTooLarge, or what the app made of it: answered below
            if not over:
                raise
        if over and not started:
            await self._answer(send, 413, self._too_large("more than that sent"))

    def _too_large(self, seen: str) -> str:
        return (
            f"request body over the {self.server}'s limit of {self.max_body_bytes} bytes ({seen}); "
            "split the request"
        )

    @staticmethod
    async def _answer(send: Send, status: int, detail: str) -> None:
        start, body = _json_error(status, detail, close=True)
        await send(start)
        await send(body)


_AUTH_DETAIL = b'{"detail":"missing or wrong bearer token"}'

#: most characters of a refused Host shown back in the refusal
_HOST_SHOWN_CHARS = 100


def host_name(value: str) -> str:
    """The host of a Host header's value, lower case, without its port, brackets or a trailing
    dot: ``"[::1]:7070"`` -> ``"::1"``, ``"LocalHost.:80"`` -> ``"localhost"``."""
    value = value.strip()
    if value.startswith("["):
        value = value[1:].partition("]")[0]
    elif value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".").lower()


def local_host(value: str, server_host: str | None) -> bool:
    """Whether a request naming ``value`` as its Host is addressed to this host: ``localhost``,
    a loopback address (127.x, ::1, an IPv4-mapped 127.x), or the address the connection came
    in on (``server_host``: scope["server"], the listening address)."""
    name = host_name(value)
    if name == "localhost" or (server_host is not None and name == server_host.lower()):
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


class BearerAuth:
    """Refuses every request (any path, docs and unknown paths included) without the token.

    Pure ASGI and outside routing, so nothing is reachable unauthenticated. ``token`` is read
    per request, so a server whose settings are replaced picks up the new one.

    Without a token (an agent serves without one on loopback only), a request is refused (403)
    unless its Host names this host: ``localhost``, a loopback address or the address it
    listens on. Before, any Host was served: a page in a browser on the same host whose domain
    was pointed at 127.0.0.1 (DNS rebinding) could flush the store; the browser sends that
    domain as the Host, while every local client (kvctl's, curl, a tunnel to localhost) sends
    the address or name it connected to. With a token the Host is not checked: such a page
    cannot send the token, and an agent reached by a name of its own (off loopback) needs it."""

    def __init__(self, app: ASGIApp, token: Callable[[], str | None]) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        token = self.token()
        refused_host = self._refused_host(scope) if not token else None
        if refused_host is None and (not token or self._ok(scope, token)):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        if refused_host is not None:
            shown = refused_host[:_HOST_SHOWN_CHARS] + (
                "..." if len(refused_host) > _HOST_SHOWN_CHARS else ""
            )
            start, body = _json_error(
                403,
                safe_text(
                    f"Host {shown!r} does not name this server: with no token set it answers "
                    "only requests addressed to localhost, a loopback address (127.0.0.1, "
                    "[::1]) or the address it listens on, so that a web page whose domain "
                    "points here (DNS rebinding) cannot use it; connect to one of those, or "
                    "set a token"
                ),
            )
            await send(start)
            await send(body)
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_AUTH_DETAIL)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _AUTH_DETAIL})

    @staticmethod
    def _refused_host(scope: Scope) -> str | None:
        """The request's first Host that does not name this host, or None (a request without
        one, HTTP/1.0, is not a browser's)."""
        server = scope.get("server")
        server_host = str(server[0]) if server else None
        for name, value in scope.get("headers", ()):
            if name == b"host":
                text: str = bytes(value).decode("latin-1")
                if not local_host(text, server_host):
                    return text
        return None

    @staticmethod
    def _ok(scope: Scope, token: str) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, given = value.partition(b" ")
                # compare bytes: compare_digest refuses non-ASCII str
                return scheme.lower() == b"bearer" and hmac.compare_digest(
                    given.strip(), token.encode()
                )
        return False


def safe_text(text: str) -> str:
    """``text`` with lone surrogates (JSON's "\\ud800" decodes to one) written as escapes:
    UTF-8 cannot encode them, so a response echoing one would fail as it is sent."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def clip_echo(value: Any, depth: int = 0) -> Any:
    """``value`` made safe to echo in a JSON error: long lists, objects and strings clipped,
    deep nesting cut, and NaN/infinity given as text (strict JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str):
        if len(value) > ECHO_CHARS:
            value = f"{value[:ECHO_CHARS]}... ({len(value):,} characters)"
        return safe_text(value)
    if isinstance(value, (bytes, bytearray)):
        return clip_echo(bytes(value[: ECHO_CHARS + 1]).decode("utf-8", "replace"), depth)
    if isinstance(value, dict):
        if depth >= ECHO_DEPTH:
            return f"{{... {len(value):,} fields}}"
        out = {
            safe_text(str(k)[:ECHO_CHARS]): clip_echo(v, depth + 1)
            for k, v in list(value.items())[:ECHO_ITEMS]
        }
        if len(value) > ECHO_ITEMS:
            out["..."] = f"{len(value) - ECHO_ITEMS:,} more fields"
        return out
    if isinstance(value, (list, tuple)):
        if depth >= ECHO_DEPTH:
            return f"[... {len(value):,} items]"
        items = [clip_echo(v, depth + 1) for v in value[:ECHO_ITEMS]]
        if len(value) > ECHO_ITEMS:
            items.append(f"... {len(value) - ECHO_ITEMS:,} more items")
        return items
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return clip_echo(str(value), depth)  # exceptions in ctx, decimals, anything else: as text
