"""A tenant name over MAX_TENANT_BYTES is refused over the data plane, and nothing of it is
kept. Before, a client sending one-byte chunks each under its own 60 KB tenant name grew the
agent by ~60 KiB of memory per byte of tier capacity (reviewer's exp4b_big_tenants.py: RSS
+971 MiB for 16,000 bytes of used capacity)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient, RequestError
from kvctl.store.index import MAX_TENANT_BYTES
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.wire.protocol import ErrorCode
from tests.functional.agents import key

LONG = "T" * 60_000


class Node:
    def __init__(self, tmp_path: Path) -> None:
        settings = AgentSettings(name="tn", data_dir=str(tmp_path), cpu_bytes=1 << 20)
        self.store = TieredStore([CpuTier(1 << 20)])
        self.runtime = AgentRuntime(settings, self.store)
        self.server = DataPlaneServer(self.runtime)
        host, port = self.server.listen_tcp("127.0.0.1", 0)[:2]
        self.tcp = f"{host}:{port}"
        self.server.start()

    def close(self) -> None:
        self.server.stop()
        self.runtime.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.close()


def test_a_put_under_a_tenant_name_over_the_cap_stores_nothing(node: Node) -> None:
    keys = [key(i, 41) for i in range(3)]
    with DataClient.connect(node.tcp, use_shm=False) as client:
        # refused whole, as the frame is read (MetaReader.tenant), not chunk by chunk
        with pytest.raises(RequestError, match="tenant name is 60000 bytes") as err:
            client.put_many([(k, b"x") for k in keys], tenant=LONG)
        assert err.value.code == ErrorCode.BAD_REQUEST
        assert len(node.store) == 0
        # the connection is still in step: a name at the cap is taken
        at_cap = "t" * MAX_TENANT_BYTES
        assert [o.status for o in client.put_many([(keys[0], b"x")], tenant=at_cap)] == ["stored"]
    assert node.store.entry(keys[0]).tenant == at_cap


def test_a_lookup_under_a_tenant_name_over_the_cap_is_a_bad_request(node: Node) -> None:
    k = key(0, 42)
    node.store.put(k, b"x", tenant="a")
    with DataClient.connect(node.tcp, use_shm=False) as client:
        with pytest.raises(RequestError, match="tenant name is 60000 bytes") as err:
            client.lookup([k], tenant=LONG)
        assert err.value.code == ErrorCode.BAD_REQUEST
        assert client.lookup([k], tenant="a").matched_chunks == 1
    assert node.store.stats.lookups == 1


@pytest.mark.parametrize("op", ["exists", "is_isolated", "fetch"])
def test_every_op_naming_a_tenant_refuses_one_over_the_cap(node: Node, op: str) -> None:
    """Each data-plane op that names a tenant reads it with MetaReader.tenant: one over the
    cap is a BAD_REQUEST saying so, and the connection stays in step."""
    k = key(0, 43)
    node.store.put(k, b"x", tenant="a")
    calls = {
        "exists": lambda c, t: c.exists([k], tenant=t),
        "is_isolated": lambda c, t: c.is_isolated(t),
        "fetch": lambda c, t: c.fetch([k], tenant=t),
    }
    with DataClient.connect(node.tcp, use_shm=False) as client:
        with pytest.raises(RequestError, match="tenant name is 60000 bytes") as err:
            calls[op](client, LONG)
        assert err.value.code == ErrorCode.BAD_REQUEST
        calls[op](client, "a")  # in step: the next request is answered
