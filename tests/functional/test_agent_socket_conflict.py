"""A second agent told to serve its data plane on a Unix socket another live agent serves
(--socket, another data dir): refused before it opens its tiers, naming the agent there.
Before, the conflict was found only when the data plane bound, once the cpu arena was
committed and the disk tier scanned (minutes for a large one), and said "another process"."""

from __future__ import annotations

from pathlib import Path

from tests.functional.agents import EPHEMERAL, running_agent, start_in_foreground


def test_a_socket_another_agent_serves_is_refused_before_the_tiers_open(tmp_path: Path) -> None:
    sock = tmp_path / "engines.sock"
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    with running_agent(first_dir, "--cpu", "8MiB", "--disk", "0", "--socket", str(sock)) as first:
        argv = ["--data-dir", str(second_dir), *EPHEMERAL, "--socket", str(sock)]
        argv += ["--cpu", "8MiB", "--disk", "64MiB"]  # a disk tier: its directory, once open
        code, said = start_in_foreground(tmp_path / "xdg", *argv)
        assert code == 1, said
        assert f"cannot serve the data plane's Unix socket (socket) on {sock}" in said
        name = first.state.name
        assert (
            f"another agent, {name} (pid {first.proc.pid}, data dir {first_dir}, control "
            f"{first.state.control_url}) listens on it" in said
        ), said
        assert f"kvctl agent stop --data-dir {first_dir}" in said and "--socket off" in said
        assert "Traceback" not in said
        # refused before its tiers opened: the disk tier's directory was never made
        assert not (second_dir / "disk").exists()
        with first.data("unix") as client:  # the first agent's engines still reach it
            assert client.ping() >= 0
