"""The settings a detaching `kvctl agent start` hands its child in a memory file: read back by
the agent's own loader, as the child reads them, they are the same settings, secrets and odd
characters included; and the memory file is no file in any directory."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvctl.agent.config import load_settings
from kvctl.agent.daemon import (
    START_SECONDS,
    START_SECONDS_PER_GIB,
    settings_memfd,
    settings_toml,
    start_timeout_seconds,
)


def test_settings_round_trip_through_the_memory_file(tmp_path: Path) -> None:
    flags: dict[str, object] = {
        "name": "gpu-07",
        "dc": 'fra "1"\\x',
        "data_dir": str(tmp_path / "d"),
        "listen": "127.0.0.1:0",
        "cpu": "3GiB",
        "disk": 0,
        "token": "s3cret-tok\u00e9n",
        "pool": "redis://:p%40ss@10.0.0.5:6379/0",
        "pool_ttl_seconds": 0.25,
        "peers": ["fra-2=10.1.0.7:7071", "ams=[::1]:7171"],
        "links": ["fra-2:override=fetch,rtt_ms=2.5,bandwidth=10GB,delay_ms=1", "pool:rtt_ms=0.1"],
        "isolated_tenants": "acme,globex",
        "models": [{"id": "m", "layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "float16"}],
        "fsync": True,
        "shm": False,
    }
    original = load_settings(flags=flags, env={}).settings
    fd = settings_memfd(settings_toml(original))
    try:
        assert not os.get_inheritable(fd)  # only a child it is passed to gets it
        assert stat.S_ISREG(os.fstat(fd).st_mode)
        # read as the child reads it, twice: each open starts at the beginning
        for _ in range(2):
            path = Path(f"/proc/self/fd/{fd}")
            assert load_settings(config_file=path, env={}).settings == original
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvctl-agent-settings")
    finally:
        os.close(fd)
    assert not list(tmp_path.rglob("*agent-settings*"))


def test_defaults_round_trip(tmp_path: Path) -> None:
    original = load_settings(flags={"data_dir": str(tmp_path)}, env={}).settings
    path = tmp_path / "agent-settings.toml"
    path.write_text(settings_toml(original))
    assert load_settings(config_file=path, env={}).settings == original


def test_the_wait_for_a_detached_agent_grows_with_the_memory_it_commits(tmp_path: Path) -> None:
    small = load_settings(flags={"data_dir": str(tmp_path), "cpu": "64MiB"}, env={}).settings
    large = load_settings(flags={"data_dir": str(tmp_path), "cpu": "64GiB"}, env={}).settings
    assert start_timeout_seconds(small) == START_SECONDS + START_SECONDS_PER_GIB / 16
    # 64 GiB on huge pages took up to ~140 s to commit where memory had to be compacted
    assert start_timeout_seconds(large) == START_SECONDS + 64 * START_SECONDS_PER_GIB >= 140
