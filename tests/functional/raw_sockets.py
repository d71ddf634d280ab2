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
            raise ConnectionError(f"closed after {len(out)} of {n} bytes", bytes(out))
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


def recv_or_eof(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, or what came before the other end closed."""
    try:
        return recv_exactly(sock, n)
    except ConnectionError as exc:  # closed early: what came (a reset: nothing kept)
        came = exc.args[1] if len(exc.args) > 1 else b""
        return came if isinstance(came, bytes) else b""


def hello_answer_op(sock: socket.socket, client_name: str, token: str = "") -> int | None:
    """The op of a data plane's answer to a HELLO from ``client_name``; None where it closed the
    connection first."""
    from kvctl.wire.protocol import HEADER, HEADER_BYTES, MetaWriter, Op, pack_header

    meta = MetaWriter().text(token).text(client_name).build()
    sock.sendall(pack_header(Op.HELLO, 1, len(meta), 0) + meta)
    try:
        head = recv_exactly(sock, HEADER_BYTES)
        _magic, _version, op, _rid, meta_len, _payload_len = HEADER.unpack(head)
        recv_exactly(sock, meta_len)
    except ConnectionError:
        return None
    return int(op)
