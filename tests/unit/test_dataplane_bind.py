"""The data plane's TCP listener (bound before the agent's tiers open, and kept) takes a port
whose last connection lies in TIME_WAIT, as an agent restarted on its port after closing
connections needs, and leaves no socket open when the port is taken."""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

import pytest

from kvctl.agent.dataplane import bind_tcp

TIME_WAIT = "06"  # /proc/net/tcp's st


def _in_time_wait(port: int) -> bool:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].partition(":")[2], 16) == port and fields[3] == TIME_WAIT:
            return True
    return False


def test_a_port_in_time_wait_is_taken() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()  # the listening side closes first: its end (on `port`) waits
        client.close()
    deadline_s = time.monotonic() + 30.0
    while not _in_time_wait(port):  # FIN and ACKs cross on loopback, not at once
        assert time.monotonic() < deadline_s, "no connection in TIME_WAIT on the port"
        time.sleep(0.01)
    sock = bind_tcp("127.0.0.1", port)
    try:
        assert sock.getsockname()[1] == port
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    finally:
        sock.close()


def test_a_taken_port_leaves_no_socket_open() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError) as exc:
            bind_tcp("127.0.0.1", taken.getsockname()[1])
        assert exc.value.errno == errno.EADDRINUSE
        assert len(os.listdir("/proc/self/fd")) == before
