"""`kvctl agent ...` on a host whose agent runs under a --name of its own, a hung agent, and an
agent that cannot listen where it is told: the hints name the data dir to use (never "start
one" about a host whose agent runs, nor a bare `kvctl agent stop` that would stop another), a
hung agent is not called down, and a data plane that cannot bind says which address."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.agents import Agent, closed_port, running_agent
from tests.functional.hung import stopped

runner = CliRunner()


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Agent]]:
    """A state dir (XDG_STATE_HOME) where one agent runs, started with --name other."""
    state = tmp_path_factory.mktemp("state")
    with running_agent(state / "kvctl" / "other", "--name", "other", "--cpu", "8MiB") as agent:
        yield state, agent


def _run(state: Path, *args: str) -> tuple[int, str]:
    """``kvctl ARGS`` on that host, whose default agent (the host name's) would listen on a
    port nothing listens on (another test's agent on 7070 must not answer for it)."""
    config = state / "default.toml"
    config.write_text(f'[agent]\nlisten = "127.0.0.1:{closed_port()}"\n')
    clean: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    env = clean | {"XDG_STATE_HOME": str(state), "COLUMNS": "1000"}
    result = runner.invoke(app, ["agent", *args, "--config", str(config)], env=env)
    assert "Traceback" not in result.output, result.output
    return result.exit_code, " ".join(result.output.split())


@pytest.mark.parametrize("command", ["status", "remote"])
def test_a_host_whose_agent_has_a_name_of_its_own_is_not_told_to_start_one(
    host: tuple[Path, Agent], command: str
) -> None:
    state, agent = host
    code, out = _run(state, command)
    assert code == 1 and out.startswith(("down:", "error: down:")), out
    assert f"kvctl agent {command} --data-dir {agent.data_dir}" in out
    assert "other from" in out and "kvctl agent start" not in out


def test_stopping_the_default_agent_names_the_one_that_runs(host: tuple[Path, Agent]) -> None:
    state, agent = host
    code, out = _run(state, "stop")
    assert code == 0, out  # nothing ran from the default data dir: nothing to stop there
    assert "no agent is running for" in out
    assert f"kvctl agent stop --data-dir {agent.data_dir}" in out
    assert agent.proc.poll() is None


def test_starting_a_named_agent_twice_says_how_to_stop_that_one(host: tuple[Path, Agent]) -> None:
    state, agent = host
    code, out = _run(state, "start", "--name", "other", "--detach")
    assert code == 1, out
    assert f"`kvctl agent stop --data-dir {agent.data_dir}` first" in out


def test_a_data_plane_that_cannot_bind_says_where(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = runner.invoke(
            app,
            ["agent", "start", "--data-dir", str(tmp_path / "a"), "--cpu", "8MiB",
             "--listen", f"127.0.0.1:{closed_port()}", "--data-listen", address],
            env={"XDG_CONFIG_HOME": str(tmp_path / "xdg"), "COLUMNS": "1000"},
        )  # fmt: skip
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert f"cannot listen on {address} for the data plane (data_listen)" in said, said


def test_a_hung_agent_is_not_answering_rather_than_down(host: tuple[Path, Agent]) -> None:
    state, agent = host
    with stopped(agent):  # alive, its port accepting, answering nothing
        code, out = _run(state, "status", "--url", agent.state.control_url)
    assert code == 1, out
    assert out.startswith("not answering:") and "hung or overloaded agent" in out, out
    assert "kvctl agent start" not in out
