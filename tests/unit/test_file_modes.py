"""Files the agent writes are the owner's alone (0600, directories 0700), whatever the mode of
the directory they land in and whatever the umask: KV chunks and logs hold prompts."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.daemon import AgentState
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.disk import DiskTier
from tests.unit.test_disk_tier import as_after_a_crash


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """umask 0: anything created without an explicit tight mode comes out world-readable."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _key(i: int) -> bytes:
    return hashlib.blake2b(f"mode-{i}".encode(), digest_size=16).digest()


def _put(tier: DiskTier, i: int, size_bytes: int = 4096) -> Path:
    k = _key(i)
    tier.put(ChunkMeta(key=k, size_bytes=size_bytes), memoryview(bytes([i % 256]) * size_bytes))
    return Path(tier.directory) / k.hex()[:2] / f"{k.hex()}.kv"


def test_chunk_files_are_0600_in_a_0755_directory_under_umask_0(
    tmp_path: Path, open_umask: None
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)  # an operator-made directory that others may list
    with DiskTier(data / "disk", 1 << 20) as tier:
        chunk = _put(tier, 1)
        assert oct(_mode(chunk)) == oct(0o600)
        assert oct(_mode(chunk.parent)) == oct(0o700)  # the fan-out directory
        assert oct(_mode(data / "disk")) == oct(0o700)  # the tier's own directory
        assert oct(_mode(data / "disk" / ".lock")) == oct(0o600)


def test_chunk_files_of_an_older_build_are_made_0600_at_open(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "disk", 1 << 20) as tier:
        chunk = _put(tier, 2)
    as_after_a_crash(tmp_path / "disk")  # an older build left no clean-close index either
    os.chmod(chunk, 0o644)  # as builds before 0600 wrote them
    os.chmod(chunk.parent, 0o755)
    with DiskTier(tmp_path / "disk", 1 << 20) as tier:
        assert _key(2) in tier
        assert oct(_mode(chunk)) == oct(0o600)
        assert oct(_mode(chunk.parent)) == oct(0o700)


def test_state_file_is_0600_under_umask_0(tmp_path: Path, open_umask: None) -> None:
    state = AgentState(
        pid=os.getpid(),
        name="n",
        dc="d",
        control_url="http://127.0.0.1:1",
        data_tcp=None,
        data_unix=None,
        started_s=0.0,
        version="x",
    )
    state.write(tmp_path)
    assert oct(_mode(tmp_path / "agent.json")) == oct(0o600)
    assert AgentState.read(tmp_path) == state


def test_tightening_at_open_keeps_the_owners_bits(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "disk", 1 << 20) as tier:
        chunk = _put(tier, 3)
    as_after_a_crash(tmp_path / "disk")  # the scan, which looks at each file, tightens it
    os.chmod(chunk, 0o444)  # an operator's read-only chunk stays read-only, and private
    with DiskTier(tmp_path / "disk", 1 << 20) as tier:
        assert _key(3) in tier
        assert oct(_mode(chunk)) == oct(0o400)
