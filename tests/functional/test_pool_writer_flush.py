"""RemoteTiers.flush_writes waits for the batch the pool writer is writing, not only for its
queue to empty: it said every chunk was written while the writer's batch was still on its way to
the pool (on a loaded machine a full CI run saw written == 0 after it returned True). A real
Redis pool whose writes wait on a gate the test opens."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import pytest

from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import Buffer, ChunkMeta
from kvctl.store.tiers.cpu import CpuTier
from tests.functional.test_pool_writer_staging import CHUNK_BYTES, TENANT, _key, _payload


class GatedPool(RedisPool):
    """A real Redis pool whose puts start only once ``gate`` is open."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put_many(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[bool]:
        self.entered.set()
        self.gate.wait(30.0)
        return super().put_many(items)


@pytest.fixture
def node(redis_url: str, redis_prefix: str) -> Iterator[tuple[RemoteTiers, GatedPool]]:
    store = TieredStore([CpuTier(256 * CHUNK_BYTES)], chunk_tokens=16)
    backend = GatedPool(redis_url, prefix=redis_prefix, capacity_bytes=64 << 20)
    pool = Source("pool", POOL_TIER, backend, LinkEstimator("pool", override="fetch"))
    remote = RemoteTiers(store, pool=pool, prefill=PrefillRate(1e4, "configured"))
    try:
        yield remote, backend
    finally:
        backend.gate.set()
        remote.close()


def test_flush_waits_for_the_batch_being_written(node: tuple[RemoteTiers, GatedPool]) -> None:
    remote, backend = node
    for i in range(3):
        remote.store.put(_key(i), _payload(i), tokens=16, tenant=TENANT)
    remote.start()
    assert backend.entered.wait(30.0), "the writer never reached the pool"
    # the queue is empty now: every key is in the batch held at the gate
    assert not remote.flush_writes(0.3), "flushed while the batch was not yet written"
    assert remote.write.get("written", 0) == 0
    backend.gate.set()
    assert remote.flush_writes(30.0)
    assert remote.write["written"] == 3, dict(remote.write)
