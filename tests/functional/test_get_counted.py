"""A same-host read (``DataClient.get_many`` / ``get_into`` with shared memory) LEASEs its
chunks, which counts each as served, and reads again over the socket (GET) those it could not
copy in place: cached but not leasable (pinned on disk), or whose lease ran out during the copy.
That GET counted them as served a second time: a chunk pinned on disk showed hit_count 2
(/v1/keys, hot keys) after one read, and its eviction policy saw two accesses (found by
experiment: [1, 2] for a cpu chunk and a disk-pinned one). The agent's hit counters on
/v1/stats (hit_chunks, reuse/sharing, per tier) are counted at lookup and never moved.

Now the re-read carries GET_COUNTED, and the agent serves it without counting the access again;
to an agent whose HELLO does not offer ``get_counted`` (one before it, which refuses any byte
past a GET's keys) the client sends the plain GET, and such an agent counts the re-read twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.client import AgentClient, DataClient, RequestError
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from kvctl.wire.protocol import ErrorCode, MetaWriter, Op
from tests.functional.agents import key, payload, running_agent

CHUNK_BYTES = 64 << 10


def _hit_counts(control: AgentClient, keys: list[bytes]) -> list[int]:
    by_key = {i["key"]: i["hit_count"] for i in control.keys(limit=1000)["items"]}
    return [by_key[k.hex()] for k in keys]


def _hit_counters(control: AgentClient) -> dict[str, Any]:
    """The /v1/stats hit counters: whole-store and per tier."""
    s = control.stats()["stats"]
    return {
        "store": (s["lookups"], s["hit_chunks"], s["reuse_hits"], s["sharing_hits"]),
        "tiers": {
            t: (v["hits"], v["reuse_hits"], v["sharing_hits"]) for t, v in s["tiers"].items()
        },
    }


@pytest.mark.parametrize("read", ["get_many", "get_into"])
def test_a_leased_read_counts_a_chunk_it_reads_again_over_the_socket_once(
    tmp_path: Path, read: str
) -> None:
    with running_agent(tmp_path / "a", "--cpu", "8MiB", "--disk", "64MiB") as agent:
        keys = [key(i, 91) for i in range(3)]
        want = [payload(k, CHUNK_BYTES) for k in keys]
        control = agent.control()
        with agent.data("unix") as client:
            assert client.shm and client.takes_get_counted
            client.put_many(list(zip(keys, want, strict=True)))
            assert control.pin([keys[2]], tier="disk")["done"] == 1  # not leasable there
            assert client.lookup(keys).locations == ("cpu", "cpu", "disk")
            before = _hit_counters(control)
            if read == "get_many":
                got = [None if g is None else bytes(g) for g in client.get_many(keys)]
            else:
                bufs = [np.zeros(CHUNK_BYTES, dtype=np.uint8) for _ in keys]
                assert client.get_into(keys, bufs) == [CHUNK_BYTES] * 3
                got = [b.tobytes() for b in bufs]
            assert got == want
            # one read of each chunk (the disk one leased as "fallback", then read by GET)
            assert _hit_counts(control, keys) == [1, 1, 1]
            # the agent's hit counters are the lookup's: the read moves none of them
            assert _hit_counters(control) == before
            # and a second read counts each once more
            client.get_many(keys)
            assert _hit_counts(control, keys) == [2, 2, 2]


class _AgentBeforeGetCounted(DataPlaneServer):
    """A real data plane whose HELLO, like an agent's before GET_COUNTED, does not offer it."""

    def hello_info(self) -> dict[str, object]:
        info = super().hello_info()
        del info["get_counted"]
        return info


def test_to_an_agent_without_get_counted_the_reread_is_a_plain_get(tmp_path: Path) -> None:
    """It is served (an agent before the flag would refuse it as BAD_REQUEST), and counted a
    second time: the documented price of an older agent."""
    settings = AgentSettings(name="old", data_dir=str(tmp_path), cpu_bytes=1 << 20, shm=True)
    store = TieredStore([CpuTier(1 << 20, shared=True), DiskTier(tmp_path / "d", 8 << 20)])
    runtime = AgentRuntime(settings, store)
    server = _AgentBeforeGetCounted(runtime)
    unix = str(server.listen_unix(tmp_path / "data.sock"))
    server.start()
    try:
        keys = [key(i, 92) for i in range(2)]
        for k in keys:
            store.put(k, payload(k, CHUNK_BYTES))
        store.pin(keys[1:], tier="disk")
        with DataClient.connect(unix) as client:
            assert client.shm and not client.takes_get_counted
            got = client.get_many(keys)
        assert [None if g is None else bytes(g) for g in got] == [
            payload(k, CHUNK_BYTES) for k in keys
        ]
        assert {e.key: e.hit_count for e in store.entries()}[keys[1]] == 2
    finally:
        server.stop()
        runtime.close()


def test_a_reread_is_served_in_place_not_under_the_copy_budget(tmp_path: Path) -> None:
    """A GET_COUNTED re-read is sent as a plain GET is, in place under the agent's own leases,
    and only chunks that cannot be leased take the replies' copy budget. Before, it was always
    copies, so past the budget (1 GiB by default, shared by every connection) chunks came
    back missing: a lease that ran out under load cost the reuse of the rest (4 of 8 here)."""
    settings = AgentSettings(
        name="b",
        data_dir=str(tmp_path),
        cpu_bytes=4 << 20,
        shm=True,
        max_chunk_bytes=2 * CHUNK_BYTES,  # the copy budget is at least one chunk this large
    )
    store = TieredStore([CpuTier(4 << 20, shared=True)])
    runtime = AgentRuntime(settings, store)
    server = DataPlaneServer(runtime, put_budget_bytes=1 << 20, copy_budget_bytes=4 * CHUNK_BYTES)
    unix = str(server.listen_unix(tmp_path / "data.sock"))
    server.start()
    try:
        keys = [key(i, 94) for i in range(8)]
        for k in keys:
            store.put(k, payload(k, CHUNK_BYTES))
        with DataClient.connect(unix) as client:
            assert client.takes_get_counted
            got = client._get_socket(keys, "", None, counted=True)
        assert [None if g is None else bytes(g) for g in got] == [
            payload(k, CHUNK_BYTES) for k in keys
        ]
        assert [e.hit_count for e in store.entries()] == [0] * 8  # counted by no one here
    finally:
        server.stop()
        runtime.close()


def test_a_get_with_flags_the_agent_does_not_know_is_refused_and_the_connection_stays(
    tmp_path: Path,
) -> None:
    """What an agent before GET_COUNTED answers any byte past a GET's keys (BAD_REQUEST, the
    connection usable), and what this agent answers a flag it does not know."""
    with running_agent(tmp_path / "a", "--cpu", "4MiB", "--disk", "0") as agent:
        k = key(0, 93)
        with agent.data("tcp") as client:
            client.put(k, payload(k, CHUNK_BYTES))
            with pytest.raises(RequestError) as refused:
                client._call(Op.GET, MetaWriter().text("").keys([k]).u8(2).build())
            assert refused.value.code == ErrorCode.BAD_REQUEST
            assert "unknown GET flags" in str(refused.value)
            assert client.get(k) == payload(k, CHUNK_BYTES)  # still in step
            # GET_COUNTED (sent over TCP here, with no lease before it) serves the chunk and
            # counts nothing
            assert client.takes_get_counted
            (again,) = client._get_socket([k], "", None, counted=True)
            assert again == payload(k, CHUNK_BYTES)
        items = {i["key"]: i["hit_count"] for i in agent.control().keys()["items"]}
        assert items[k.hex()] == 1  # the plain GET's read only


def test_an_engine_reads_over_the_socket_what_its_lease_could_not_hold_counting_it_once(
    tmp_path: Path,
) -> None:
    """An engine's read (``hold`` or ``lookup_leased``) leases its chunks, which counts them;
    one it could not copy from its lease (not leasable here, or its lease ran out) it reads
    over the socket with ``get_into(counted=True)``: no second LEASE, and GET_COUNTED. A plain
    ``get_into`` there LEASEs it again and counts it a second time."""
    with running_agent(tmp_path / "a", "--cpu", "8MiB", "--disk", "64MiB") as agent:
        keys = [key(i, 94) for i in range(3)]
        want = [payload(k, CHUNK_BYTES) for k in keys]
        control = agent.control()
        buf = np.zeros(CHUNK_BYTES, dtype=np.uint8)
        with agent.data("unix") as client:
            client.put_many(list(zip(keys, want, strict=True)))
            assert control.pin([keys[1]], tier="disk")["done"] == 1  # not leasable there
            leases = client.hold(keys)
            assert leases.chunks[1] is None and 1 not in leases.missing  # cached, not leased
            assert client.get_into([keys[1]], [buf], counted=True) == [CHUNK_BYTES]
            assert buf.tobytes() == want[1]
            assert _hit_counts(control, keys) == [1, 1, 1]
            # the same read without ``counted``: its own LEASE counts the chunk again
            client.hold([keys[1]])
            assert client.get_into([keys[1]], [buf]) == [CHUNK_BYTES]
            assert _hit_counts(control, keys) == [1, 3, 1]
            client.release_pending()
