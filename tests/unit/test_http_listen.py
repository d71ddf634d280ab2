"""Both daemons' API listeners come from ``http_serving.listen_tcp``: TCP sockets (so asyncio
sets TCP_NODELAY on what they accept), and a taken address is said by each daemon in its own
words, with the socket it opened closed."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Iterator

import pytest

from kvctl.agent.daemon import _bind_tcp
from kvctl.router.app import RouterError, _bind


@pytest.fixture
def taken_port() -> Iterator[int]:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        yield holder.getsockname()[1]
    finally:
        holder.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    "listen", [lambda: _bind_tcp("127.0.0.1", 0), lambda: _bind("127.0.0.1:0")]
)
def test_a_daemon_listener_is_tcp(listen: Callable[[], socket.socket]) -> None:
    sock = listen()
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    finally:
        sock.close()


def test_the_agent_says_its_control_address_is_taken(taken_port: int) -> None:
    before = _open_fds()
    with pytest.raises(OSError) as exc:
        _bind_tcp("127.0.0.1", taken_port)
    assert exc.value.errno == errno.EADDRINUSE
    assert str(exc.value) == (
        f"[Errno {errno.EADDRINUSE}] cannot listen on 127.0.0.1:{taken_port} for the control "
        f"API: {os.strerror(errno.EADDRINUSE)}"
    )
    assert _open_fds() == before  # the socket it opened is closed


def test_the_router_says_its_address_is_taken(taken_port: int) -> None:
    before = _open_fds()
    with pytest.raises(RouterError) as exc:
        _bind(f"127.0.0.1:{taken_port}")
    assert str(exc.value) == (
        f"cannot listen on 127.0.0.1:{taken_port} for the router: {os.strerror(errno.EADDRINUSE)}"
    )
    assert isinstance(exc.value.__cause__, OSError)
    assert _open_fds() == before
