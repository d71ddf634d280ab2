"""The pool writer (write-through) copies each batch's chunks into one staging buffer it reuses
while it is busy and unmaps once it idles, instead of a new bytearray per chunk: those left
glibc's arenas holding the batches' high-water (a node agent's RSS grew tens of MiB under
write-through while its live Python memory stayed flat). A real Redis pool, spied on: what the
writer hands it, and what it stores."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence

import pytest

from kvctl.remote import federation
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.keys import KEY_BYTES
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import Buffer, ChunkMeta
from kvctl.store.tiers.cpu import CpuTier

CHUNK_BYTES = 64 << 10
TENANT = "t1"


class SpyPool(RedisPool):
    """A real Redis pool that remembers, per batch written, the object each chunk's bytes
    live in and a copy of the bytes as they were handed over."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.batches: list[list[tuple[object, bytes, bytes]]] = []

    def put_many(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[bool]:
        seen: list[tuple[object, bytes, bytes]] = []
        for meta, data in items:
            with memoryview(data) as view:
                seen.append((view.obj, meta.key, view.tobytes()))
        self.batches.append(seen)
        return super().put_many(items)


def _key(i: int) -> bytes:
    return hashlib.blake2b(f"staging:{i}".encode(), digest_size=KEY_BYTES).digest()


def _payload(i: int, size: int = CHUNK_BYTES) -> bytes:
    return bytes([i % 251]) * size


@pytest.fixture
def node(redis_url: str, redis_prefix: str) -> Iterator[tuple[RemoteTiers, SpyPool]]:
    store = TieredStore([CpuTier(256 * CHUNK_BYTES)], chunk_tokens=16)
    backend = SpyPool(redis_url, prefix=redis_prefix, capacity_bytes=64 << 20)
    pool = Source("pool", POOL_TIER, backend, LinkEstimator("pool", override="fetch"))
    remote = RemoteTiers(store, pool=pool, prefill=PrefillRate(1e4, "configured"))
    try:
        yield remote, backend
    finally:
        remote.close()


def _put(remote: RemoteTiers, n: int, *, size: int = CHUNK_BYTES, first: int = 0) -> None:
    # queued for the writer as they are stored; it starts after, so it finds them all waiting
    for i in range(first, first + n):
        remote.store.put(_key(i), _payload(i, size), tokens=16, tenant=TENANT)


def _written(remote: RemoteTiers, backend: SpyPool, sizes_bytes: Sequence[int]) -> None:
    """Every chunk written, and the pool holds each one's own bytes."""
    n = len(sizes_bytes)
    assert remote.flush_writes(30.0)
    assert remote.write["written"] == n, dict(remote.write)
    got = backend.get_many([_key(i) for i in range(n)], tenant=TENANT)
    assert [None if c is None else c.data.tobytes() for c in got] == [
        _payload(i, size) for i, size in enumerate(sizes_bytes)
    ]


def test_successive_batches_are_copied_into_one_reused_buffer(
    node: tuple[RemoteTiers, SpyPool],
) -> None:
    remote, backend = node
    n = 2 * federation._WRITE_BATCH_CHUNKS + 6  # three batches, written back to back
    _put(remote, n)
    remote.start()
    _written(remote, backend, [CHUNK_BYTES] * n)
    assert [len(b) for b in backend.batches] == [32, 32, 6]
    holders = {id(obj) for batch in backend.batches for obj, _k, _b in batch}
    assert len(holders) == 1, f"{len(holders)} buffers for {n} chunks"
    # each batch handed over each chunk's own bytes, though the buffer was reused
    for batch in backend.batches:
        for _obj, key, data in batch:
            assert data == _payload(next(i for i in range(n) if _key(i) == key))


def test_the_buffer_is_unmapped_once_the_writer_idles(node: tuple[RemoteTiers, SpyPool]) -> None:
    remote, backend = node
    _put(remote, 3)
    remote.start()
    _written(remote, backend, [CHUNK_BYTES] * 3)
    region = backend.batches[0][0][0]
    deadline = time.monotonic() + 10.0
    while not getattr(region, "closed", False) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert getattr(region, "closed", False), (
        f"a {type(region).__name__} kept while the writer idles"
    )


def test_a_chunk_that_does_not_fit_opens_the_next_batch_and_one_larger_than_it_gets_its_own(
    node: tuple[RemoteTiers, SpyPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    remote, backend = node
    monkeypatch.setattr(federation, "_WRITE_BATCH_BYTES", 3 * CHUNK_BYTES)
    sizes = [2, 2, 1, 4, 1]  # in CHUNK_BYTES; the 4 is larger than the whole buffer
    for i, size in enumerate(sizes):
        _put(remote, 1, size=size * CHUNK_BYTES, first=i)
    remote.start()
    _written(remote, backend, [size * CHUNK_BYTES for size in sizes])
    # 2 + 2 does not fit: the second opens the next batch; 2 + 1 fill it; the 4 alone
    assert [len(b) for b in backend.batches] == [1, 2, 1, 1]
    order = [key for batch in backend.batches for _o, key, _d in batch]
    assert order == [_key(i) for i in range(len(sizes))]
    holders = [obj for batch in backend.batches for obj, _k, _d in batch]
    assert isinstance(holders[3], bytearray) and len(holders[3]) == 4 * CHUNK_BYTES
    staged = {id(h) for i, h in enumerate(holders) if i != 3}
    assert len(staged) == 1, f"{len(staged)} buffers for the 4 chunks that fit"
