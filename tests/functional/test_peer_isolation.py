"""Tenant isolation across agents joined by a pool agent (``kvctl://``) and a peer, attacked with
random tenants, prefixes and isolation flags (as ``test_remote_isolation`` does over a Redis
pool): a chunk stored under an isolated tenant never reaches another tenant through an agent's
lookup or read, whether it comes from the node itself, the pool agent (written there by the
other node's write-through) or the peer (its FETCH), and an isolated tenant never reads a chunk
another tenant stored under its key. Three agents run in this process, each a real runtime and
data plane on loopback: ``pool``; ``a``, writing through to the pool; ``b``, writing through to
the pool and pulling from ``a`` as a peer; their settings isolate different tenants, the pool
agent's none (isolation reaches it in each PUT's flag). Reads and puts go through each agent's
data plane (LOOKUP then GET), the pool agent's too (what the write-through left there), so the
agents' handlers and their remote pulls are what is tried."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings, LinkSpec
from kvctl.client import DataClient
from kvctl.remote import federation
from kvctl.store.keys import KEY_BYTES

TENANTS = ("acme", "globex", "initech", "umbrella")
#: isolated by each agent's settings (their settings differ, as in a rolling change of them);
#: any tenant by a put's flag too, per example
ISOLATED_BY_SETTINGS = {
    "pool": frozenset[str](),
    "a": frozenset({"acme"}),
    "b": frozenset({"acme", "globex"}),
}
CHUNK_BYTES = 512


def _key(prefix: int, i: int) -> bytes:
    # one key space for everyone: the attacker is assumed to know (or guess) every key
    return hashlib.blake2b(f"{prefix}:{i}".encode(), digest_size=KEY_BYTES).digest()


def _payload(key: bytes, owner: str) -> bytes:
    """Bytes that say whose chunk they are: a read of another owner's copy shows."""
    block = hashlib.blake2b(key + owner.encode(), digest_size=64).digest()
    return (block * (CHUNK_BYTES // 64 + 1))[:CHUNK_BYTES]


@dataclass
class Node:
    name: str
    runtime: AgentRuntime
    server: DataPlaneServer
    tcp: str

    def client(self) -> DataClient:
        return DataClient.connect(self.tcp, use_shm=False)

    def flush(self) -> None:
        remote = self.runtime.remote
        assert remote is None or remote.flush_writes()

    def close(self) -> None:
        self.server.stop()
        self.runtime.close()


def _node(tmp_path: Path, name: str, **kw: object) -> Node:
    config = AgentSettings(
        name=name,
        data_dir=str(tmp_path / name),
        cpu_bytes=16 << 20,
        disk_bytes=0,
        shm=False,
        isolated_tenants=tuple(sorted(ISOLATED_BY_SETTINGS[name])),
        **kw,  # type: ignore[arg-type]
    )
    runtime = AgentRuntime.open(config)
    server = DataPlaneServer(runtime)
    host, port = server.listen_tcp("127.0.0.1", 0)[:2]
    server.start()
    if runtime.remote is not None:
        runtime.remote.start()
    return Node(name, runtime, server, f"{host}:{port}")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Node]]:
    # who sees what, not how fast: a probe late past the lookup's 0.5 s wait on a loaded
    # machine reads as nothing found
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(federation, "PROBE_DEADLINE_S", 30.0)
        tmp_path = tmp_path_factory.mktemp("peer-iso")
        made: dict[str, Node] = {}
        try:
            made["pool"] = pool = _node(tmp_path, "pool")
            fetch = (LinkSpec("pool", override="fetch"), LinkSpec("a", override="fetch"))
            made["a"] = a = _node(tmp_path, "a", pool=f"kvctl://{pool.tcp}", links=fetch)
            made["b"] = _node(
                tmp_path, "b", pool=f"kvctl://{pool.tcp}", peers=(("a", a.tcp),), links=fetch
            )
            yield made
        finally:
            for n in reversed(made.values()):
                n.close()


op = st.tuples(
    st.sampled_from(["put", "read"]),
    st.sampled_from(["a", "b", "pool"]),  # the pool agent too: what the write-through left there
    st.sampled_from(TENANTS),
    st.integers(0, 3),  # prefix
    st.integers(1, 4),  # chain length
)


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(flagged=st.sets(st.sampled_from(TENANTS)), ops=st.lists(op, min_size=1, max_size=12))
def test_no_tenant_reads_an_isolated_tenants_chunk_through_the_pool_agent_or_a_peer(
    nodes: dict[str, Node],
    flagged: set[str],
    ops: list[tuple[str, str, str, int, int]],
) -> None:
    run = uuid.uuid4().int % 10**9  # a fresh key space per example: the agents are shared
    owner: dict[bytes, tuple[str, bool]] = {}  # key -> (tenant that stored it, isolated)
    for kind, node_name, tenant, prefix, length in ops:
        node = nodes[node_name]
        keys = [_key(run * 10 + prefix, i) for i in range(length)]
        with node.client() as c:
            if kind == "put":
                isolated = tenant in flagged or tenant in ISOLATED_BY_SETTINGS[node_name]
                for parent, k in zip([None, *keys], keys, strict=False):
                    if k in owner:  # one owner per key: who stored it is then unambiguous
                        continue
                    owner[k] = (tenant, isolated)
                    c.put_many(
                        [(k, _payload(k, tenant))],
                        tenant=tenant,
                        parents=[parent],
                        isolated=isolated,
                    )
                node.flush()
                continue
            res = c.lookup(keys, tenant=tenant)
            got = c.get_many(keys, tenant=tenant)
            where = c.exists(keys, tenant="mallory")
        for i, (k, data) in enumerate(zip(keys, got, strict=True)):
            stored_by, was_isolated = owner.get(k, ("", False))
            # an isolated tenant sees only its own chunks; a chunk stored isolated is its
            # owner's alone; so is one whose owner this node isolates, whatever flag the node
            # that stored it gave it
            here = ISOLATED_BY_SETTINGS[node_name]
            forbidden = (
                bool(stored_by)
                and stored_by != tenant
                and (was_isolated or tenant in here or stored_by in here)
            )
            if forbidden:
                assert data is None, f"{tenant} read {stored_by}'s chunk on {node_name}"
                assert i >= res.matched_chunks and res.locations[i] is None, (
                    f"{tenant}'s lookup on {node_name} counted {stored_by}'s chunk"
                )
            if data is not None:
                assert k in owner  # nothing appears that nobody stored
                assert bytes(data) == _payload(k, stored_by)
            # a tenant that never stored anything cannot learn where isolated chunks are
            if was_isolated:
                assert where[i] is None, f"mallory located {stored_by}'s isolated chunk"


def test_the_paths_tried_above_do_serve_what_may_be_served(nodes: dict[str, Node]) -> None:
    """Not vacuous: a shared chunk stored on ``a`` reaches another tenant on ``b`` (through the
    pool agent or the peer), and an isolated tenant's own chunk reaches it there too."""
    run = uuid.uuid4().int % 10**9
    shared = [_key(run * 10, i) for i in range(3)]
    own = [_key(run * 10 + 1, i) for i in range(3)]
    with nodes["a"].client() as c:
        for keys, tenant, isolated in ((shared, "initech", False), (own, "acme", True)):
            for parent, k in zip([None, *keys], keys, strict=False):
                c.put_many(
                    [(k, _payload(k, tenant))], tenant=tenant, parents=[parent], isolated=isolated
                )
    nodes["a"].flush()
    with nodes["b"].client() as c:
        for keys, tenant, owner in ((shared, "umbrella", "initech"), (own, "acme", "acme")):
            res = c.lookup(keys, tenant=tenant)
            assert res.matched_chunks == len(keys)
            assert set(res.locations) <= {"remote", "peer"}
            got = c.get_many(keys, tenant=tenant)
            assert [bytes(g) for g in got if g is not None] == [_payload(k, owner) for k in keys]
        # and acme's chunks, now held on b too, are still no one else's
        assert c.get_many(own, tenant="globex") == [None] * len(own)
        assert c.lookup(own, tenant="initech").matched_chunks == 0
