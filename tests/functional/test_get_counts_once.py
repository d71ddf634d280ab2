"""A GET (TCP, or the Unix socket without shared memory) leases its chunks in one batch, which
counts each as served; a chunk it cannot lease (pinned on disk, or its lease lost to a live
resize) is read as a copy instead. That copy counted the chunk as served a second time: its
hit_count (/v1/keys, hot keys) said 2 for one GET and its eviction policy saw two accesses
(found by experiment: two chunks pinned on disk, hit_count [1, 1, 2, 2] after one GET of four).
Now each chunk of a request counts once, as the lookup before it counts each hit once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from tests.functional.agents import key, payload
from tests.functional.test_get_across_resize import ResizingNode

CHUNK = 64 << 10


class DiskNode:
    """A runtime with a cpu and a disk tier, and its data plane, served in the test's process."""

    def __init__(self, tmp_path: Path) -> None:
        settings = AgentSettings(name="gc", data_dir=str(tmp_path), cpu_bytes=1 << 20, shm=True)
        self.store = TieredStore([CpuTier(1 << 20, shared=True), DiskTier(tmp_path / "d", 8 << 20)])
        self.runtime = AgentRuntime(settings, self.store)
        self.server = DataPlaneServer(self.runtime)
        self.unix = str(self.server.listen_unix(tmp_path / "data.sock"))
        host, port = self.server.listen_tcp("127.0.0.1", 0)[:2]
        self.tcp = f"{host}:{port}"
        self.server.start()

    def client(self, transport: str) -> DataClient:
        return DataClient.connect(self.unix if transport == "unix" else self.tcp, use_shm=False)

    def close(self) -> None:
        self.server.stop()
        self.runtime.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[DiskNode]:
    n = DiskNode(tmp_path)
    yield n
    n.close()


def hit_counts(store: TieredStore, keys: list[bytes]) -> list[int]:
    by_key = {e.key: e.hit_count for e in store.entries()}
    return [by_key[k] for k in keys]


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_get_counts_each_chunk_once_where_some_cannot_be_leased(
    node: DiskNode, transport: str
) -> None:
    keys = [key(i, 31) for i in range(4)]
    for k in keys:
        node.store.put(k, payload(k, CHUNK))
    assert node.store.pin(keys[2:], tier="disk").done == 2  # pinned there: not leasable
    assert node.store.locate(keys) == ["cpu", "cpu", "disk", "disk"]
    disk_read_before = node.store.snapshot()["stats"]["tiers"]["disk"]["bytes_read"]
    with node.client(transport) as client:
        assert client.lookup(keys).matched_chunks == 4
        got = client.get_many(keys)
    assert [bytes(g) if g is not None else None for g in got] == [payload(k, CHUNK) for k in keys]
    assert hit_counts(node.store, keys) == [1, 1, 1, 1]
    stats = node.store.snapshot()["stats"]
    assert (stats["lookups"], stats["lookup_chunks"], stats["hit_chunks"]) == (1, 4, 4)
    assert stats["tiers"]["cpu"]["hits"] == 2 and stats["tiers"]["disk"]["hits"] == 2
    # the disk chunks' bytes were read, once each
    assert stats["tiers"]["disk"]["bytes_read"] - disk_read_before == 2 * CHUNK


def test_a_fetch_counts_each_chunk_once_where_some_cannot_be_leased(node: DiskNode) -> None:
    keys = [key(i, 32) for i in range(3)]
    for k in keys:
        node.store.put(k, payload(k, CHUNK))
    node.store.pin(keys[:1], tier="disk")
    with node.client("tcp") as client:
        got = client.fetch(keys)
    assert all(item is not None and item[1] is not None for item in got)
    assert hit_counts(node.store, keys) == [1, 1, 1]


def test_a_get_racing_a_resize_counts_each_chunk_once(tmp_path: Path) -> None:
    rz = ResizingNode(tmp_path)
    try:
        keys = [key(i, 33) for i in range(3)]
        for k in keys:
            rz.store.put(k, payload(k, CHUNK))
        with rz.client("tcp") as client:
            rz.runtime.resize_to = 2 << 20
            got = client.get_many(keys)
        assert rz.runtime.resized == 1  # the re-read after the resize did happen
        assert [bytes(g) if g is not None else None for g in got] == [
            payload(k, CHUNK) for k in keys
        ]
        assert hit_counts(rz.store, keys) == [1, 1, 1]
    finally:
        rz.close()
