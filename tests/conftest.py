"""Shared fixtures. Unit tests: tests/unit; functional (CLI, subprocess): tests/functional."""

from __future__ import annotations

import pytest

from kvctl.store.keys import KVLayout, Namespace, keys_for, parents_of
from kvctl.workload.trace import find_default_trace

TINY_LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=4, dtype="float16")


@pytest.fixture
def ns() -> Namespace:
    return Namespace("test-model", TINY_LAYOUT)


def chain(ns: Namespace, n_chunks: int, *, seed: int = 0, chunk_tokens: int = 4) -> list[bytes]:
    """Keys of a request of ``n_chunks`` full chunks whose tokens depend on ``seed``."""
    tokens = [seed * 1_000_003 + i for i in range(n_chunks * chunk_tokens)]
    return keys_for(tokens, ns, chunk_tokens)


def put_chain(store, keys: list[bytes], size: int = 100, tenant: str = "a", **kw) -> None:  # type: ignore[no-untyped-def]
    for k, p in zip(keys, parents_of(keys), strict=True):
        store.put(k, bytes([k[0]]) * size, parent=p, tenant=tenant, **kw)


@pytest.fixture
def shared_trace():  # type: ignore[no-untyped-def]
    path = find_default_trace()
    if path is None:
        pytest.skip("shared Mooncake trace not found at ../shared/data (a fresh machine has none)")
    return path
