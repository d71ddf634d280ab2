"""Chunks packed by the caller into the put itself (``DataClient.put_packed``), against a real
agent: on a same-host shared-memory connection each chunk is written straight into the staging
segment the agent copies from (no buffer of its own between), over TCP into one buffer sent on
the socket; either way the agent holds exactly those bytes. A staging segment's listener
(``on_staging``: how a CUDA engine registers it) hears of each segment before it is unmapped,
so a registration's hold on it never stops the client from closing it."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest

from kvctl.client import DataClient
from kvctl.store.tiers.hostreg import buffer_address
from tests.functional.agents import key, payload, running_agent
from tests.functional.child_report import child_report

SIZE = 64 << 10


def _put(client: DataClient, keys: list[bytes], seen: list[int]) -> None:
    def fill(i: int, out: memoryview) -> None:
        assert out.nbytes == SIZE and not out.readonly
        seen.append(buffer_address(out))
        out[:] = payload(keys[i], SIZE)

    outcomes = client.put_packed(
        keys, [SIZE] * len(keys), fill, tenant="t", parents=[None, *keys[:-1]], tokens=16
    )
    assert [o.status for o in outcomes] == ["stored"] * len(keys)


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_packed_chunks_land_bit_exact(tmp_path: Path, transport: str) -> None:
    keys = [key(i, 7) for i in range(5)]
    with running_agent(tmp_path) as agent, agent.data(transport) as client:
        seen: list[int] = []
        _put(client, keys, seen)
        assert all(bytes(client.get(k, tenant="t")) == payload(k, SIZE) for k in keys)
        assert client.lookup(keys, tenant="t").matched_chunks == 5  # parents chained as given
        if transport == "unix":
            assert client.shm and client._staging is not None
            with memoryview(client._staging) as seg:
                base = buffer_address(seg)
                # each chunk was written in its place in the staging segment itself
                assert seen == [base + i * SIZE for i in range(5)]


def test_a_fill_that_fails_stores_nothing_and_the_client_goes_on(tmp_path: Path) -> None:
    keys = [key(i, 8) for i in range(3)]
    with running_agent(tmp_path) as agent, agent.data("unix") as client:

        def fill(i: int, out: memoryview) -> None:
            if i == 2:
                raise RuntimeError("device error")
            out[:] = payload(keys[i], SIZE)

        with pytest.raises(RuntimeError, match="device error"):
            client.put_packed(keys, [SIZE] * 3, fill, tenant="t")
        assert client.exists(keys, tenant="t") == [None] * 3
        _put(client, keys, [])  # the same connection stores them afterwards


def test_the_staging_listener_hears_of_each_segment_before_it_is_unmapped(tmp_path: Path) -> None:
    heard: list[int] = []
    held: list[memoryview] = []  # what a registration holds: an export of the mapping

    def on_staging(segment: mmap.mmap | None) -> None:
        while held:
            held.pop()  # dropped, not released, as HostRegistration.close does
        if segment is not None:
            held.append(memoryview(segment))
        heard.append(0 if segment is None else len(segment))

    with running_agent(tmp_path) as agent:
        client = agent.data("unix")
        client.on_staging = on_staging
        _put(client, [key(0, 9)], [])
        first = heard[-1]
        assert heard == [first] and first >= SIZE
        # a batch larger than the segment: a new one, the old one let go of before it is closed
        big = first + SIZE

        def zeros(_i: int, out: memoryview) -> None:
            out[:] = bytes(big)

        assert client.put_packed([key(1, 9)], [big], zeros)[0].status == "stored"
        assert bytes(client.get(key(1, 9))) == bytes(big)
        assert heard[1:] == [0, heard[-1]] and heard[-1] >= big
        client.close()  # closing unmaps: the listener hears None first (no BufferError)
        assert heard[-1] == 0 and not held


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_fill_many_writes_every_chunk_back_to_back_in_one_call(
    tmp_path: Path, transport: str
) -> None:
    keys = [key(i, 10) for i in range(4)]
    calls: list[int] = []

    def fill_many(out: memoryview) -> None:
        calls.append(out.nbytes)
        for i, k in enumerate(keys):
            out[i * SIZE : (i + 1) * SIZE] = payload(k, SIZE)

    with running_agent(tmp_path) as agent, agent.data(transport) as client:
        outcomes = client.put_packed(keys, [SIZE] * 4, fill_many=fill_many, tenant="t")
        assert [o.status for o in outcomes] == ["stored"] * 4 and calls == [4 * SIZE]
        assert all(bytes(client.get(k, tenant="t")) == payload(k, SIZE) for k in keys)
        with pytest.raises(ValueError, match="one of fill and fill_many"):
            client.put_packed(keys, [SIZE] * 4, tenant="t")
        with pytest.raises(ValueError, match="one of fill and fill_many"):
            client.put_packed(keys, [SIZE] * 4, lambda i, out: None, fill_many=fill_many)


OUT_OF_MEMORY_CLIENT = r"""
import json, resource, sys
from kvctl.client import AgentError, DataClient
from tests.functional.agents import key, payload

MiB = 1 << 20
c = DataClient.connect(sys.argv[1], use_shm=False)  # over the socket: one buffer for the put
keys = [key(i, 12) for i in range(4)]
data = {k: payload(k, 16 * MiB) for k in keys}  # allocated before the limit

def fill(i, out):
    out[:] = data[keys[i]]

with open("/proc/self/status") as f:
    vm_bytes = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
# room for the put's small allocations, not for a 64 MiB buffer
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + 32 * MiB, resource.RLIM_INFINITY))
report = {}
try:
    c.put_packed(keys, [16 * MiB] * 4, fill, tenant="t")
except BaseException as exc:
    report["raised"] = [isinstance(exc, AgentError), isinstance(exc, MemoryError), str(exc)]
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
report["held"] = c.exists(keys, tenant="t")  # nothing stored, the connection in step
report["after"] = [o.status for o in c.put_packed(keys, [16 * MiB] * 4, fill, tenant="t")]
report["same"] = all(bytes(c.get(k, tenant="t")) == data[k] for k in keys)
print(json.dumps(report))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS on the client is Linux")
def test_a_client_short_of_memory_gets_the_sdks_error_and_the_connection_goes_on(
    tmp_path: Path,
) -> None:
    """Over the socket, ``put_packed`` fills one buffer the size of the put. A client that
    cannot allocate it got a bare MemoryError out of the SDK; now an AgentError (a MemoryError
    too) that says what happened and what to do, before anything is sent: nothing is stored
    and the same connection puts those chunks once memory is back. Memory is made short for
    real: RLIMIT_AS on a child process that is the client."""
    with running_agent(tmp_path, "--cpu", "128MiB") as agent:
        report, _ = child_report(OUT_OF_MEMORY_CLIENT, str(agent.state.data_unix))
    is_agent_error, is_memory_error, message = report["raised"]
    assert is_agent_error and is_memory_error, message
    assert f"could not allocate {64 << 20} bytes" in message and "nothing was sent" in message
    assert report["held"] == [None] * 4
    assert report["after"] == ["stored"] * 4 and report["same"]
