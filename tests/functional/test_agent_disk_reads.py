"""A real agent serving batches of disk chunks: GET (TCP), LEASE (shared memory) and FETCH each
lease a request's keys in one batch, so its disk chunks are read in parallel outside the store's
lock; a corrupt chunk in the batch is a miss, the rest come back exact, and the disk tier's read
bandwidth is measured and reported in /v1/stats."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .agents import Agent, key, payload, running_agent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the agent's shm path is Linux")

CHUNK = 256 << 10


def _spill(agent: Agent, seed: int, n_disk: int, n_cpu: int) -> tuple[list[bytes], list[bytes]]:
    """Puts ``n_disk + n_cpu`` chunks and moves the first ``n_disk`` to the disk tier."""
    on_disk = [key(i, seed) for i in range(n_disk)]
    in_cpu = [key(i, seed) for i in range(n_disk, n_disk + n_cpu)]
    with agent.data("tcp") as c:
        out = c.put_many([(k, payload(k, CHUNK)) for k in [*on_disk, *in_cpu]])
        assert {o.status for o in out} == {"stored"}
    agent.control().move(on_disk, "disk")
    with agent.data("tcp") as c:
        assert c.exists([*on_disk, *in_cpu]) == ["disk"] * n_disk + ["cpu"] * n_cpu
    return on_disk, in_cpu


def _corrupt(agent: Agent, k: bytes) -> None:
    (path,) = agent.data_dir.rglob(f"{k.hex()}.kv")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # the payload's last byte: only the checksum can tell
    path.write_bytes(raw)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_batch_of_disk_chunks_comes_back_exact_and_a_corrupt_one_is_a_miss(
    tmp_path: Path, transport: str
) -> None:
    with running_agent(tmp_path / "a", "--cpu", "8MiB", "--disk", "64MiB") as agent:
        on_disk, in_cpu = _spill(agent, 1, 8, 4)
        _corrupt(agent, on_disk[3])
        absent = key(999, 1)
        keys = [*on_disk, absent, *in_cpu]
        kind = "tcp" if transport == "tcp" else "unix"
        with agent.data(kind, use_shm=transport == "shm") as c:
            assert c.shm is (transport == "shm")
            got = c.get_many(keys)
            for k, g in zip(keys, got, strict=True):
                if k in (on_disk[3], absent):
                    assert g is None
                else:
                    assert g is not None and bytes(g) == payload(k, CHUNK)
            # one connection serves frames in order: this reply comes after the GET's leases
            # were released (they are, right after its reply is sent)
            assert c.exists(keys) == ["cpu"] * 3 + [None] + ["cpu"] * 4 + [None] + ["cpu"] * 4
        stats = agent.control().stats()
        assert stats["stats"]["corrupt_dropped"] == 1
        assert stats["stats"]["tiers"]["cpu"]["promotions"] == 7
        assert stats["stats"]["tiers"]["disk"]["bytes_read"] == 7 * CHUNK
        assert stats["leases"] == 0  # every lease of the batch was released
        bandwidth = stats["read_bandwidth_bytes_per_second"]
        assert bandwidth["disk"] is not None and bandwidth["disk"] > 0


def test_fetch_serves_disk_chunks_with_their_metadata(tmp_path: Path) -> None:
    with running_agent(tmp_path / "f", "--cpu", "8MiB", "--disk", "64MiB") as agent:
        on_disk, in_cpu = _spill(agent, 2, 6, 2)
        _corrupt(agent, on_disk[0])
        keys = [*on_disk, *in_cpu, key(999, 2)]
        with agent.data("tcp") as c:
            probe = c.fetch(keys, payload=False)  # metadata only: nothing read, nothing moved
            assert [p is None for p in probe] == [False] * 8 + [True]
            assert c.exists(on_disk[1:]) == ["disk"] * 5
            got = c.fetch(keys)
            c.ping()  # served after the FETCH's leases were released
        assert got[0] is None and got[-1] is None
        for k, item in zip(keys[1:-1], got[1:-1], strict=True):
            assert item is not None
            meta, data = item
            assert meta.key == k and meta.size_bytes == CHUNK
            assert data is not None and bytes(data) == payload(k, CHUNK)
        stats = agent.control().stats()
        assert stats["stats"]["tiers"]["cpu"]["promotions"] == 5
        assert stats["leases"] == 0
        assert stats["read_bandwidth_bytes_per_second"]["disk"] is not None
