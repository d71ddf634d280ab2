"""A second agent told to listen (--listen, --data-listen) on a TCP port another process
listens on: refused before it opens its tiers, naming the agent there (or saying another
process does), and the first keeps serving. Before, the data plane's port was found taken only
once the cpu arena was committed and the disk tier scanned (minutes for a large one), and
neither port's error said who held it."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from tests.functional.agents import Agent, running_agent, start_in_foreground

#: the option under test, and what the error calls what it was for
PORTS = {
    "--data-listen": "the data plane (data_listen)",
    "--listen": "the control API",
}


def _start_second(tmp_path: Path, option: str, address: str) -> tuple[int, str]:
    """`kvctl agent start` of a second agent (with a disk tier: its directory appears once
    its tiers open) told to listen on ``address`` with ``option``, its other port free."""
    other = "--listen" if option == "--data-listen" else "--data-listen"
    argv = ["--data-dir", str(tmp_path / "second"), option, address, other, "127.0.0.1:0"]
    argv += ["--socket", "off", "--cpu", "8MiB", "--disk", "64MiB"]
    return start_in_foreground(tmp_path / "xdg", *argv)


def _address(agent: Agent, option: str) -> str:
    if option == "--data-listen":
        assert agent.state.data_tcp is not None
        return agent.state.data_tcp
    return agent.state.control_url.removeprefix("http://")


@pytest.mark.parametrize("option", list(PORTS))
def test_a_port_another_agent_listens_on_is_refused_before_the_tiers_open(
    tmp_path: Path, option: str
) -> None:
    first_dir = tmp_path / "first"
    with running_agent(first_dir, "--cpu", "8MiB", "--disk", "0", "--socket", "off") as first:
        address = _address(first, option)
        code, said = _start_second(tmp_path, option, address)
        assert code == 1, said
        assert f"cannot listen on {address} for {PORTS[option]}" in said, said
        assert (
            f"another agent, {first.state.name} (pid {first.proc.pid}, data dir {first_dir}, "
            f"control {first.state.control_url}) listens there" in said
        ), said
        assert f"kvctl agent stop --data-dir {first_dir}" in said, said
        assert f"give this agent another {option}" in said, said
        assert "Traceback" not in said
        # refused before its tiers opened: the disk tier's directory was never made
        assert not (tmp_path / "second" / "disk").exists()
        assert first.control().health()  # the first agent still answers, on both ports
        with first.data("tcp") as client:
            assert client.ping() >= 0


@pytest.mark.parametrize("option", list(PORTS))
def test_a_port_another_process_listens_on_is_refused_before_the_tiers_open(
    tmp_path: Path, option: str
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        code, said = _start_second(tmp_path, option, address)
    assert code == 1, said
    assert (
        f"cannot listen on {address} for {PORTS[option]}: another process (pid {os.getpid()}) "
        f"listens there; give this agent another {option}" in said
    ), said
    assert "kvctl agent stop" not in said and "Traceback" not in said
    assert not (tmp_path / "second" / "disk").exists()
