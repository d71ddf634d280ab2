"""A plain GET (TCP, or the Unix socket without shared memory) and a FETCH lease their chunks in
the cpu arena, then take a view of each lease to send. A live ``resize cpu`` between the two
replaces the arena: a lease of the old one no longer holds its chunk. Such a chunk is read again
where it is now (or is a miss if it went meanwhile), never an error for the whole batch. Found in
review: readers racing a resize got 'lease N no longer holds its chunk' for their batch. Here the
resize is made at that exact point (after the batch's leases, before its views), so the test
fails every time without the fix."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient
from kvctl.store.errors import KeyNotFound
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier, Lease
from tests.functional.agents import key, payload

CHUNK = 64 << 10


class ResizingRuntime(AgentRuntime):
    """A runtime whose next lease batch is followed at once by a live resize of its cpu tier
    (and, with ``evict_after``, the eviction of one of the batch's chunks)."""

    resize_to = 0
    evict_after: bytes | None = None
    resized = 0

    def lease_many(
        self, keys: Sequence[bytes], ttl_s: float, *, tenant: str, served: bool = True
    ) -> list[Lease | KeyNotFound | None]:
        leases = super().lease_many(keys, ttl_s, tenant=tenant, served=served)
        if self.resize_to:
            self.store.resize("cpu", self.resize_to)
            self.resize_to = 0
            self.resized += 1
            if self.evict_after is not None:
                self.store.evict([self.evict_after])
        return leases


class ResizingNode:
    """An agent's runtime (with the resize hook) and data plane, served in the test's process."""

    def __init__(self, tmp_path: Path) -> None:
        settings = AgentSettings(name="rz", data_dir=str(tmp_path), cpu_bytes=1 << 20, shm=True)
        self.store = TieredStore([CpuTier(1 << 20, shared=True)])
        self.runtime = ResizingRuntime(settings, self.store)
        self.server = DataPlaneServer(self.runtime)
        self.unix = str(self.server.listen_unix(tmp_path / "data.sock"))
        host, port = self.server.listen_tcp("127.0.0.1", 0)[:2]
        self.tcp = f"{host}:{port}"
        self.server.start()

    def client(self, transport: str) -> DataClient:
        address = self.unix if transport == "unix" else self.tcp
        return DataClient.connect(address, use_shm=False)

    def leases(self) -> int:
        return int(self.store.snapshot()["leases"])

    def close(self) -> None:
        self.server.stop()
        self.runtime.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[ResizingNode]:
    n = ResizingNode(tmp_path)
    yield n
    n.close()


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_get_racing_a_resize_serves_its_chunks(node: ResizingNode, transport: str) -> None:
    keys = [key(i, 7) for i in range(4)]
    for k in keys:
        node.store.put(k, payload(k, CHUNK))
    with node.client(transport) as client:
        node.runtime.resize_to = 2 << 20
        got = client.get_many(keys)
        assert node.runtime.resized == 1  # the resize did fall between the leases and the views
        assert [bytes(g) if g is not None else None for g in got] == [
            payload(k, CHUNK) for k in keys
        ]
        client.exists(keys)  # a round trip: the connection released the GET's leases before it
        assert node.leases() == 0  # the old generation's leases were let go too


def test_a_chunk_gone_during_the_resize_is_a_miss(node: ResizingNode) -> None:
    keys = [key(i, 8) for i in range(3)]
    for k in keys:
        node.store.put(k, payload(k, CHUNK))
    with node.client("tcp") as client:
        node.runtime.resize_to, node.runtime.evict_after = 2 << 20, keys[1]
        got = client.get_many(keys)
        assert node.runtime.resized == 1
        assert got[1] is None
        # as GET answers any miss: per chunk, the others served
        assert [bytes(got[0] or b""), bytes(got[2] or b"")] == [
            payload(keys[0], CHUNK),
            payload(keys[2], CHUNK),
        ]


def test_a_fetch_racing_a_resize_serves_its_chunks(node: ResizingNode) -> None:
    keys = [key(i, 9) for i in range(3)]
    for k in keys:
        node.store.put(k, payload(k, CHUNK))
    with node.client("tcp") as client:
        node.runtime.resize_to = 2 << 20
        sums: list[int | None] = []
        got = client.fetch(keys, checksums=sums)
        assert node.runtime.resized == 1
        for k, item in zip(keys, got, strict=True):
            assert item is not None and item[1] is not None
            assert bytes(item[1]) == payload(k, CHUNK)
