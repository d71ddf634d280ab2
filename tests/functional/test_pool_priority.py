"""A chunk's retention priority travels with it through a pool agent (``--role pool``), as it
does through a Redis pool (its record holds it): the node's write-through PUT carries each
chunk's own priority, so the pool's eviction keeps a high-priority chunk over a low one, and a
node that pulls the chunk back stores it with that priority. Before, the PUT sent the default
(35) for every chunk: a priority-90 chunk and a priority-0 one were equals in the pool."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient
from kvctl.remote.agent_source import AgentSource
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.inprocess_node import InProcessNode

CHUNK_BYTES = 4096
#: each chunk's priority on the node that stored it (0..100; the default is 35)
PRIORITIES = [0, 1, 35, 64, 90, 100]
KEYS = [hashlib.blake2b(f"prio-{p}".encode(), digest_size=16).digest() for p in PRIORITIES]


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[InProcessNode]:
    settings = AgentSettings(name="pool", data_dir=str(tmp_path), cpu_bytes=4 << 20, shm=False)
    node = InProcessNode(tmp_path, settings, [CpuTier(4 << 20, shared=True)])
    yield node
    node.close()


def node_on(pool: InProcessNode) -> RemoteTiers:
    host, port = pool.tcp[:2]
    source = Source(
        "pool", POOL_TIER, AgentSource(f"{host}:{port}"), LinkEstimator("pool", override="fetch")
    )
    store = TieredStore([CpuTier(1 << 20)], chunk_tokens=16)
    return RemoteTiers(store, pool=source, prefill=PrefillRate(1e4, "configured"))


def test_write_through_keeps_each_chunks_priority_in_the_pool_and_back(
    pool: InProcessNode,
) -> None:
    writer = node_on(pool)
    writer.start()
    try:
        for key, priority in zip(KEYS, PRIORITIES, strict=True):
            writer.store.put(key, bytes(CHUNK_BYTES), tenant="t", priority=priority)
        assert writer.flush_writes(30)
        assert writer.write["written"] == len(KEYS)
    finally:
        writer.close()
    assert [pool.store.entry(k).priority for k in KEYS] == PRIORITIES

    reader = node_on(pool)  # another node pulls them: stored with the priority they came with
    try:
        reader.fill(KEYS, tenant="t")
        assert [reader.store.entry(k).priority for k in KEYS] == PRIORITIES
    finally:
        reader.close()


def test_a_put_of_one_priority_for_all_still_gives_each_chunk_that_priority(
    pool: InProcessNode,
) -> None:
    host, port = pool.tcp[:2]
    with DataClient.connect(f"{host}:{port}", use_shm=False) as c:
        outcomes = c.put_many([(k, bytes(CHUNK_BYTES)) for k in KEYS[:2]], tenant="t", priority=77)
        assert [o.status for o in outcomes] == ["stored", "stored"]
        c.put_many([(KEYS[2], bytes(CHUNK_BYTES))], tenant="t")  # none given: the default
    assert [pool.store.entry(k).priority for k in KEYS[:3]] == [77, 77, 35]
