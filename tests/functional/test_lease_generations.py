"""A LEASE reply can hold leases of two arena generations: the agent grants the chunks already
in its cpu tier, then reads the rest from disk without its lock, and an operator may resize the
cpu tier meanwhile (a new arena). A client must never read an old-generation chunk at its offset
in the new mapping: it reads it over the socket instead. Found in review: before the fix the
first chunk came back with another chunk's bytes and nothing noticed."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from tests.functional.agents import key, payload, running_agent

CHUNK = 64 << 10


class ResizingDisk(DiskTier):
    """A disk tier during whose reads an operator resizes the cpu tier (once)."""

    store: TieredStore | None = None
    resize_to: int = 0

    def read_planned(self, plan, out):  # type: ignore[no-untyped-def]
        got = super().read_planned(plan, out)
        store, self.store = self.store, None
        if store is not None:
            store.resize("cpu", self.resize_to)
        return got


@pytest.mark.parametrize("read", ["get_many", "leased"])
def test_a_reply_across_an_arena_resize_serves_the_right_bytes(tmp_path: Path, read: str) -> None:
    settings = AgentSettings(name="gen", data_dir=str(tmp_path), cpu_bytes=1 << 20, shm=True)
    disk = ResizingDisk(tmp_path / "disk", 8 << 20)
    store = TieredStore([CpuTier(1 << 20, shared=True), disk])
    runtime = AgentRuntime(settings, store)
    server = DataPlaneServer(runtime)
    sock = server.listen_unix(tmp_path / "data.sock")
    server.start()
    try:
        # fillers first, so the chunk that stays in cpu sits at a high offset, then drop them
        fillers = [key(100 + i) for i in range(6)]
        for k in fillers:
            store.put(k, payload(k, CHUNK))
        a, b = key(1), key(2)
        store.put(a, payload(a, CHUNK))
        store.put(b, payload(b, CHUNK))
        store.move([b], "disk")
        store.evict(fillers)
        with DataClient.connect(sock) as client:
            assert client.shm
            assert bytes(client.get_many([a])[0]) == payload(a, CHUNK)  # arena mapped (gen 0)
            disk.store, disk.resize_to = store, 2 << 20
            if read == "get_many":
                got = client.get_many([a, b])
                assert bytes(got[0]) == payload(a, CHUNK)
                assert bytes(got[1]) == payload(b, CHUNK)
            else:
                with client.leased([a, b]) as leases:
                    # a lease of the old arena is not offered in place (read it over the socket)
                    for i, want in enumerate((a, b)):
                        if leases.chunks[i] is not None:
                            assert bytes(leases.view(i)) == payload(want, CHUNK)
                    assert leases.chunks[0] is None  # granted in the arena that was replaced
            assert disk.store is None  # the resize did happen mid-batch
    finally:
        server.stop()
        runtime.close()


def test_calls_inside_a_leased_block_do_not_deadlock(tmp_path: Path) -> None:
    """The client's lock is held across a ``leased()`` block; the same thread may still use the
    client inside it (a plain lock hung here for ever, found in review)."""
    with running_agent(tmp_path) as agent, agent.data("unix") as client:
        a = key(1)
        client.put(a, payload(a, CHUNK), tenant="t")
        done = threading.Event()

        def inside() -> None:
            with client.leased([a], tenant="t") as leases:
                assert client.exists([a], tenant="t") == ["cpu"]
                assert bytes(leases.view(0)) == payload(a, CHUNK)
            done.set()

        worker = threading.Thread(target=inside, daemon=True)
        worker.start()
        assert done.wait(30), "a call inside leased() blocked on the client's own lock"
