"""The data plane's TCP socket (bound before the agent's tiers open, and kept) takes a port
whose last connection lies in TIME_WAIT, as an agent restarted on its port after closing
connections needs, and leaves no socket open when the port is taken. It listens only once the
data plane serves: until then a connection is refused, not left unanswered."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvctl.agent.daemon import (
    SocketInUse,
    _bind_ports,
    _listen_data_tcp,
    _listening_inodes,
    _tcp_listener_pid,
)
from kvctl.agent.dataplane import bind_tcp
from kvctl.agent.settings import AgentSettings

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


def _settings() -> AgentSettings:
    return AgentSettings(listen="127.0.0.1:0", data_listen="127.0.0.1:0", socket="off")


def test_the_data_port_refuses_connections_until_the_data_plane_serves_it() -> None:
    """Held from before the tiers open (minutes for a large disk tier) but not listening: an
    engine or peer that connects meanwhile is refused at once, as by a stopped agent, instead
    of connected to a socket nothing answers until its own timeout (30 s by default)."""
    control, data = _bind_ports(_settings())
    assert data is not None
    try:
        port = data.getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=30.0).close()
        # still held: a bind without SO_REUSEADDR (most programs') is refused
        with socket.socket() as other, pytest.raises(OSError) as exc:
            other.bind(("127.0.0.1", port))
        assert exc.value.errno == errno.EADDRINUSE
        _listen_data_tcp(data)
        with socket.create_connection(("127.0.0.1", port), timeout=30.0):
            pass  # connected: queued for the data plane, which serves from here on
    finally:
        control.close()
        data.close()


def test_a_data_port_taken_while_the_tiers_open_is_named_when_served() -> None:
    """Bound only, the port can still be taken by a program binding with SO_REUSEADDR while
    the tiers open: the agent then says who took it, as it does for one taken before."""
    control, data = _bind_ports(_settings())
    assert data is not None
    port = data.getsockname()[1]
    taker = subprocess.Popen(
        [sys.executable, "-c", _LISTEN_WITH_REUSEADDR, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert taker.stdout is not None and taker.stdout.readline() == "listening\n"
        with pytest.raises(SocketInUse) as exc:
            _listen_data_tcp(data)
        said = str(exc.value)
        assert f"cannot listen on 127.0.0.1:{port} for the data plane (data_listen)" in said
        assert f"another process (pid {taker.pid}) listens there" in said
    finally:
        control.close()
        data.close()
        taker.kill()
        taker.communicate()


_LISTEN_WITH_REUSEADDR = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize(
    ("setting", "what"),
    [("data_listen", "the data plane (data_listen)"), ("listen", "the control API")],
)
def test_a_taken_ipv6_port_is_said_with_its_address_in_brackets(setting: str, what: str) -> None:
    """'::1:7071' reads as the address ::1:7071 with no port (or port 1); '[::1]:7071' is how
    the setting itself is written."""
    try:
        taken = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with taken:
        port = taken.getsockname()[1]
        ports = {"listen": "127.0.0.1:0", "data_listen": "127.0.0.1:0", setting: f"[::1]:{port}"}
        with pytest.raises(SocketInUse) as exc:
            _bind_ports(AgentSettings(socket="off", **ports))
    assert f"cannot listen on [::1]:{port} for {what}: this process" in str(exc.value)


def test_an_ipv4_wildcard_listener_is_not_taken_for_the_holder_of_an_ipv6_address() -> None:
    """0.0.0.0:P and [::1]:P do not conflict (IPv4's wildcard covers no IPv6 address): when
    [::1]:P is found taken, only the listener on [::1]:P can be the one in the way. Taking
    both, the agent on 0.0.0.0:P was named first and its stop suggested."""
    try:
        v6 = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with v6, socket.socket() as v4:
        port = v6.getsockname()[1]
        v4.bind(("0.0.0.0", port))
        v4.listen()
        found = _listening_inodes("::1", port)
        assert found == {f"socket:[{os.fstat(v6.fileno()).st_ino}]"}
        # and the other way round: [::1]:P is no conflict of 127.0.0.1:P's either
        assert _listening_inodes("127.0.0.1", port) == {f"socket:[{os.fstat(v4.fileno()).st_ino}]"}
        assert len(_listening_inodes("::", port)) == 2  # IPv6's wildcard takes IPv4 too


def test_the_search_for_a_ports_holder_is_bounded() -> None:
    """The /proc search reads every process's descriptors: with its budget spent it gives up
    (the error says "another process") instead of holding a failed start on a busy host."""
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        assert _tcp_listener_pid("127.0.0.1", port) == os.getpid()
        assert _tcp_listener_pid("127.0.0.1", port, budget_s=0.0) is None
