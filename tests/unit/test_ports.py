"""Ports chosen ahead of a listener: free, distinct, and outside the kernel's ephemeral range."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest

from kvctl import ports
from kvctl.ports import LOWEST_PORT, ephemeral_low, free_loopback_port, free_loopback_ports
from tests.functional import agents


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    chosen = free_loopback_ports(8)
    assert len(set(chosen)) == 8
    assert all(LOWEST_PORT <= p < ephemeral_low() for p in chosen)
    for port in chosen:  # each can be listened on now
        with socket.create_server(("127.0.0.1", port)):
            pass


def test_a_port_taken_is_never_chosen(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # an ephemeral range that leaves room for exactly the candidates probed, one of them busy
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "LOWEST_PORT", taken)
        bounds = tmp_path / "range"
        bounds.write_text(f"{taken + 100}\t60999\n")
        monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", bounds)
        chosen = free_loopback_ports(20)
    assert taken not in chosen and len(set(chosen)) == 20
    assert all(taken < p < taken + 100 for p in chosen)


def test_no_room_below_the_range_falls_back_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bounds = tmp_path / "range"
    bounds.write_text(f"{LOWEST_PORT + 1} 60999\n")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", bounds)
    assert ephemeral_low() == LOWEST_PORT + 1
    port = free_loopback_port()
    assert port > LOWEST_PORT + 1
    with socket.create_server(("127.0.0.1", port)):
        pass


def test_an_unreadable_range_means_linux_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", tmp_path / "missing")
    assert ephemeral_low() == 32_768


def test_the_tests_closed_ports_never_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    # tests give each node of an inventory its own closed_port(), and two nodes on one agent
    # URL are refused: a draw that repeats a port (four random ones did about once in 3,800
    # fills: a test_tier_reuse_sharing.py failure) is drawn again
    first = agents.closed_port()
    draws = itertools.chain([first, first], itertools.count(first + 1))
    monkeypatch.setattr(agents, "free_loopback_port", lambda: next(draws))
    assert agents.closed_port() > first
