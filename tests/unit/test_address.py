"""The one address parser: bind addresses (settings) and data-plane addresses (SDK, engines,
the control API's probe target)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.wire.address import (
    TcpAddress,
    UnixAddress,
    connect_host,
    is_loopback,
    parse_address,
    split_host_port,
    tcp_target_problem,
    url_host,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:7071", ("10.0.0.1", 7071)),
        ("  host:80 ", ("host", 80)),
        ("[::1]:9000", ("::1", 9000)),
        ("[::1]", ("::1", 7071)),
        ("::1", ("::1", 7071)),
        ("host", ("host", 7071)),
        (":8080", ("127.0.0.1", 8080)),
        ("", ("127.0.0.1", 7071)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
    ],
)
def test_split_host_port_takes_every_bind_form(text: str, expected: tuple[str, int]) -> None:
    assert split_host_port(text, 7071) == expected


@pytest.mark.parametrize("text", ["host:http", "host:65536", "[::1]:x", "host:-1"])
def test_split_host_port_names_a_bad_port(text: str) -> None:
    with pytest.raises(ValueError, match=r"bad port in .*PORT in 0\.\.65535"):
        split_host_port(text, 7071)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("unix:///run/kvctl/agent.sock", UnixAddress("/run/kvctl/agent.sock")),
        ("unix:agent.sock", UnixAddress("agent.sock")),
        ("/tmp/a.sock", UnixAddress("/tmp/a.sock")),
        ("./a.sock", UnixAddress("./a.sock")),
        (Path("/tmp/a.sock"), UnixAddress("/tmp/a.sock")),
        ("tcp://10.0.0.1:7071", TcpAddress("10.0.0.1", 7071)),
        ("host:7071", TcpAddress("host", 7071)),
        ("[::1]:7071", TcpAddress("::1", 7071)),
        ("::1:7071", TcpAddress("::1", 7071)),
        (":7071", TcpAddress("127.0.0.1", 7071)),
    ],
)
def test_parse_address_takes_unix_and_tcp_forms(address: str | Path, expected: object) -> None:
    assert parse_address(address) == expected


@pytest.mark.parametrize("address", ["host", "host:", "host:port", "tcp://host"])
def test_parse_address_needs_a_port_or_a_path(address: str) -> None:
    with pytest.raises(ValueError, match="not a data plane address"):
        parse_address(address)


def test_parse_address_refuses_a_port_out_of_range() -> None:
    with pytest.raises(ValueError, match="bad port"):
        parse_address("host:70000")


def test_loopback_and_connect_hosts() -> None:
    assert is_loopback("127.0.0.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1")
    # any spelling of a loopback address counts; a host name that only starts like one does not
    assert is_loopback("0:0:0:0:0:0:0:1") and is_loopback("[::1]")
    assert not is_loopback("127.example.com") and not is_loopback("")
    assert connect_host("0.0.0.0") == "127.0.0.1" and connect_host("::") == "::1"
    assert connect_host("") == "127.0.0.1" and connect_host("10.0.0.1") == "10.0.0.1"
    assert url_host("::1") == "[::1]" and url_host("host") == "host"


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("10.1.0.7:7071", True),
        ("[::1]:7071", True),
        ("tcp://h:1", True),
        ("notanaddress", False),
        ("h:0", False),
        ("/run/kvctl/agent.sock", False),  # a probe crosses the network: TCP only
    ],
)
def test_probe_targets_are_tcp_host_port(text: str, ok: bool) -> None:
    # one rule for the CLI (exit 2 before asking) and the control API (its 422)
    problem = tcp_target_problem(text)
    assert (problem is None) == ok
    if not ok:
        assert problem == f"target must be a data-plane TCP address HOST:PORT, got {text!r}"
