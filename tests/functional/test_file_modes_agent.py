"""A real agent in a data directory others can list, started under umask 0: its log, state file
and chunk files are still 0600, and its log warns about the directory."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.functional.agents import key, payload, running_agent


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_data_dir(tmp_path: Path) -> Iterator[Path]:
    """A 0755 data directory, and umask 0 for the agent to inherit: nothing may rely on either."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    os.chmod(data_dir, 0o755)
    config = data_dir / "xdg" / "kvctl" / "agent.toml"  # start_agent's XDG_CONFIG_HOME
    config.parent.mkdir(parents=True)
    config.write_text('[agent]\ndisk_admission = "all"\n')  # every demotion reaches the disk
    old_umask = os.umask(0)
    try:
        yield data_dir
    finally:
        os.umask(old_umask)


def test_agent_log_is_0600_and_warns_about_a_readable_data_dir(open_data_dir: Path) -> None:
    with running_agent(open_data_dir, "--cpu", "1MiB", "--disk", "0") as agent:
        assert oct(_mode(open_data_dir / "agent.log")) == oct(0o600)
        assert oct(_mode(open_data_dir / "agent.json")) == oct(0o600)
    log = agent.log()
    assert "group/others can read it" in log and f"chmod 700 {open_data_dir}" in log


def test_chunk_files_of_a_real_agent_are_0600(open_data_dir: Path) -> None:
    with running_agent(open_data_dir, "--cpu", "1MiB", "--disk", "64MiB") as agent:
        with agent.data() as client:
            # 1 MiB of cpu tier: the later puts demote the earlier ones to disk
            for i in range(8):
                client.put(key(i, 7), payload(key(i, 7), 256 << 10))
        chunks = list((open_data_dir / "disk").glob("??/*.kv"))
        assert chunks, "no chunk reached the disk tier"
        modes = {str(p.relative_to(open_data_dir)): oct(_mode(p)) for p in chunks}
        assert set(modes.values()) == {oct(0o600)}, modes
        assert {oct(_mode(p.parent)) for p in chunks} == {oct(0o700)}
        assert oct(_mode(open_data_dir / "disk")) == oct(0o700)
