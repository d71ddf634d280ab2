"""Agent addresses: the one parser of what settings, the SDK, engines and the control API take.

Two kinds of text are read here. A bind address (``listen``, ``data_listen``, a peer's or a
``kvctl://`` pool's data plane) is ``host:port``, ``[v6]:port``, ``host`` or ``:port``, with a
default port. A data-plane address a client connects to is a Unix socket (``unix:///path``,
``unix:path``, or a path starting with ``/`` or ``.``) or TCP (``[tcp://]host:port``, the
port required).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
_DEFAULT_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class UnixAddress:
    path: str


@dataclass(frozen=True, slots=True)
class TcpAddress:
    host: str
    port: int


DataAddress = UnixAddress | TcpAddress


def split_host_port(text: str, default_port: int) -> tuple[str, int]:
    """``"host:port"``, ``"[::1]:port"``, ``"host"`` or ``":port"`` -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not port_text:
        return host or _DEFAULT_HOST, default_port
    return host or _DEFAULT_HOST, _port(port_text, text)


def parse_address(address: str | os.PathLike[str]) -> DataAddress:
    """A data-plane address: ``unix:///p``, ``unix:p``, a path, or ``[tcp://]host:port``."""
    text = str(address)
    if text.startswith("unix://"):
        return UnixAddress(text.removeprefix("unix://"))
    if text.startswith("unix:"):
        return UnixAddress(text.removeprefix("unix:"))
    if text.startswith("/") or text.startswith("."):
        return UnixAddress(text)
    text = text.removeprefix("tcp://")
    # the last colon: an unbracketed IPv6 host ("::1:7071") keeps its own colons
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError(f"not a data plane address: {address!r} (use HOST:PORT or a socket path)")
    return TcpAddress(host.strip("[]") or _DEFAULT_HOST, _port(port_text, text))


def tcp_target_problem(text: str) -> str | None:
    """Why ``text`` is not a data-plane TCP address another agent can be probed at
    (``HOST:PORT``, port 1..65535), or None when it is one."""
    try:
        where = parse_address(text)
    except ValueError:
        where = None
    if not isinstance(where, TcpAddress) or where.port == 0:
        return f"target must be a data-plane TCP address HOST:PORT, got {text[:80]!r}"
    return None


def _port(port_text: str, text: str) -> int:
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"bad port in {text!r}: expected HOST:PORT with PORT in 0..65535")
    return int(port_text)


def is_loopback(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 or ::1 in any spelling; a name like ``127.example.com`` is not."""
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]")).is_loopback
    except ValueError:
        return False


def connect_host(host: str) -> str:
    """Where a local client connects for a bind address (a wildcard bind is reached on loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": _DEFAULT_HOST}.get(host, host)


def url_host(host: str) -> str:
    """``host`` as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def plain_ip(text: str) -> IPAddress:
    """``text`` as an IP address, an IPv4-mapped IPv6 one as the IPv4 one (ValueError: not
    an address)."""
    ip = ipaddress.ip_address(text)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def listeners_overlap(a: IPAddress, b: IPAddress) -> bool:
    """Whether listeners on ``a`` and ``b`` (one port) conflict: the same address, or either
    one a wildcard covering the other. IPv4's covers only IPv4 addresses; IPv6's all, as a
    dual-stack socket (the default) does."""
    if a == b:
        return True
    if any(ip.version == 6 and ip.is_unspecified for ip in (a, b)):
        return True
    return a.version == b.version == 4 and (a.is_unspecified or b.is_unspecified)


def bind_ip(host: str) -> IPAddress | None:
    """The address a bind to ``host`` takes, as the daemons bind (IPv6 where the host has a
    colon, else IPv4; a name: its first address in that family, ``localhost``: 127.0.0.1);
    None where a name does not resolve (the bind will say)."""
    try:
        return plain_ip(host)
    except ValueError:
        pass
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, None, family, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    # (an IPv6 answer may carry a scope: "fe80::1%eth0")
    return plain_ip(str(infos[0][4][0]).partition("%")[0]) if infos else None
