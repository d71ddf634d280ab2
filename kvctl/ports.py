"""Loopback ports chosen before the process that will listen on them starts.

A port the kernel picked for ``bind(("127.0.0.1", 0))`` and then released lies in the ephemeral
range, where the kernel hands it to the next socket bound to port 0 or the next outgoing
connection, so a listener started later can find it taken ("Address already in use"). Ports
chosen below that range are never handed out that way: only a process that names one can take
it.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

# ports under this are left alone: well-known services and common development servers
LOWEST_PORT = 10_000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_LOW = 32_768


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def free_loopback_ports(n: int, *, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports nothing listens on now, below the ephemeral range when it leaves
    room (else ones the kernel picks), held together while chosen."""
    top = ephemeral_low()
    span = range(LOWEST_PORT, top) if top - LOWEST_PORT >= 4 * n else range(0)
    candidates = random.SystemRandom().sample(span, min(len(span), 16 * n + 64))
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in candidates:
            if len(ports) == n:
                break
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind((host, port))
            except OSError:
                continue
            ports.append(port)
        while len(ports) < n:
            sock = stack.enter_context(socket.socket())
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
    return ports


def free_loopback_port(*, host: str = "127.0.0.1") -> int:
    """One port nothing listens on now (see :func:`free_loopback_ports`)."""
    return free_loopback_ports(1, host=host)[0]
