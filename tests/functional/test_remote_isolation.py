"""Tenant isolation across nodes sharing a real Redis pool, attacked with random tenants,
prefixes and policies: a chunk stored under an isolated tenant never reaches another tenant
through a lookup, a read, or a fill from the pool, even when the attacker knows its keys."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.remote import federation
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.remote.redis_pool import RedisPool
from kvctl.store.errors import KeyNotFound
from kvctl.store.keys import KEY_BYTES
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier

TENANTS = ("acme", "globex", "initech", "umbrella")
CHUNK_BYTES = 512


def _key(prefix: int, i: int) -> bytes:
    # one key space for everyone: the attacker is assumed to know (or guess) every key
    return hashlib.blake2b(f"{prefix}:{i}".encode(), digest_size=KEY_BYTES).digest()


def _payload(key: bytes) -> bytes:
    return (key * (CHUNK_BYTES // len(key) + 1))[:CHUNK_BYTES]


def _node(url: str, prefix: str) -> RemoteTiers:
    store = TieredStore([CpuTier(64 * CHUNK_BYTES)], chunk_tokens=16)
    pool = Source(
        "pool",
        POOL_TIER,
        RedisPool(url, prefix=prefix, capacity_bytes=1 << 24),
        # fetch whatever the pool holds: the test is about who sees what, not about cost
        LinkEstimator("pool", override="fetch"),
    )
    remote = RemoteTiers(store, pool=pool, prefill=PrefillRate(1e4, "configured"))
    remote.start()
    return remote


@pytest.fixture
def nodes(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RemoteTiers]]:
    # who sees what, not how fast: a probe late past the lookup's 0.5 s wait (a loaded
    # fresh-clone run) reads as nothing found, and acme's own lookup then matched 0 of 2
    monkeypatch.setattr(federation, "PROBE_DEADLINE_S", 30.0)
    prefix = f"kvctl-test-iso-{uuid.uuid4().hex[:10]}"
    made = [_node(redis_url, prefix) for _ in range(2)]
    yield made
    made[0].pool.backend.clear()  # type: ignore[union-attr]
    for n in made:
        n.close()


op = st.tuples(
    st.sampled_from(["put", "read"]),
    st.integers(0, 1),  # node
    st.sampled_from(TENANTS),
    st.integers(0, 3),  # prefix
    st.integers(1, 4),  # chain length
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(isolated=st.sets(st.sampled_from(TENANTS)), ops=st.lists(op, min_size=1, max_size=14))
def test_no_tenant_ever_reads_an_isolated_tenants_chunk(
    nodes: list[RemoteTiers],
    isolated: set[str],
    ops: list[tuple[str, int, str, int, int]],
) -> None:
    run = uuid.uuid4().int % 10**9  # a fresh key space per example: the pool is shared
    owner: dict[bytes, tuple[str, bool]] = {}  # key -> (tenant that stored it, isolated)
    for kind, node_i, tenant, prefix, length in ops:
        node = nodes[node_i]
        keys = [_key(run * 10 + prefix, i) for i in range(length)]
        if kind == "put":
            for parent, k in zip([None, *keys], keys, strict=False):
                if k in owner:  # one owner per key: who stored it is then unambiguous
                    continue
                owner[k] = (tenant, tenant in isolated)
                node.store.put(
                    k, _payload(k), tenant=tenant, parent=parent, isolated=tenant in isolated
                )
            assert node.flush_writes()
            continue
        res = node.lookup(keys, tenant=tenant)
        node.fill(keys, tenant=tenant)
        for i, k in enumerate(keys):
            try:
                data = node.store.get(k, tenant=tenant)
            except KeyNotFound:
                data = None
            stored_by, was_isolated = owner.get(k, ("", False))
            forbidden = was_isolated and stored_by != tenant
            if forbidden:
                assert data is None, f"{tenant} read {stored_by}'s isolated chunk"
                assert i >= res.matched_chunks and res.locations[i] is None
            if data is not None:
                assert bytes(data) == _payload(k)
                assert k in owner  # nothing appears that nobody stored
        # a tenant that never stored anything cannot even learn where isolated chunks are
        where = node.locate(keys, tenant="mallory")
        for k, t in zip(keys, where, strict=True):
            if owner.get(k, ("", False))[1]:
                assert t is None


def test_an_isolated_tenant_takes_nothing_from_the_pool_that_another_stored_under_its_key(
    nodes: list[RemoteTiers],
) -> None:
    """globex stores (not isolated) under keys acme's isolated namespace will use; acme's
    lookup on another node must not count them, fill them, or read them."""
    victim, planter = nodes
    victim.store.set_isolated_tenants({"acme"})
    keys = [_key(uuid.uuid4().int % 10**9, i) for i in range(3)]
    for parent, k in zip([None, *keys], keys, strict=False):
        planter.store.put(k, b"\xee" * CHUNK_BYTES, tenant="globex", parent=parent)
    assert planter.flush_writes()
    assert victim.lookup(keys, tenant="acme").matched_chunks == 0
    assert victim.locate(keys, tenant="acme") == [None] * len(keys)
    victim.fill(keys, tenant="acme")
    for k in keys:
        with pytest.raises(KeyNotFound):
            victim.store.get(k, tenant="acme")
    # a tenant that shares still gets them: isolation takes nothing from others
    assert victim.lookup(keys, tenant="initech").matched_chunks == len(keys)


def test_a_chunk_whose_owner_is_isolated_here_is_not_counted_for_another_tenant(
    nodes: list[RemoteTiers],
) -> None:
    """A node whose settings do not isolate acme wrote acme's chunks to the pool, unflagged;
    on a node where acme is isolated, another tenant's lookup must not count them (its store
    would refuse to serve them: a hit promised and never delivered, bytes moved for nothing)."""
    strict, lax = nodes
    strict.store.set_isolated_tenants({"acme"})
    keys = [_key(uuid.uuid4().int % 10**9, i) for i in range(2)]
    for parent, k in zip([None, *keys], keys, strict=False):
        lax.store.put(k, _payload(k), tenant="acme", parent=parent, isolated=False)
    assert lax.flush_writes()
    assert strict.lookup(keys, tenant="initech").matched_chunks == 0
    assert strict.locate(keys, tenant="initech") == [None] * len(keys)
    strict.fill(keys, tenant="initech")
    for k in keys:
        with pytest.raises(KeyNotFound):
            strict.store.get(k, tenant="initech")
    # acme itself, isolated here, still reads what it stored elsewhere
    assert strict.lookup(keys, tenant="acme").matched_chunks == len(keys)
