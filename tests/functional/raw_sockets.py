"""Reading a daemon's replies off a raw socket, for tests that speak the wire by hand (hostile
clients, relays that damage frames): whole byte counts, and whether the other end closed."""

from __future__ import annotations

import socket


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes; ConnectionError where the other end closes first."""
    out = bytearray()
    while len(out) < n:
        got = sock.recv(min(n - len(out), 1 << 20))
        if not got:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += got
    return bytes(out)


def closed_within(sock: socket.socket, seconds: float | None = None) -> bool:
    """The other end closed (EOF, or a reset) within ``seconds`` (None: the socket's own
    timeout); what it sent before is read and dropped."""
    if seconds is not None:
        sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionError:
        return True
    return True
