"""Hits and reads of the tiers beyond a node, counted in its store's counters."""

from __future__ import annotations

import pytest

from kvctl.remote.counting import RemoteTierCounts
from kvctl.store.errors import InvalidArgument
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier

CHUNK_TOKENS = 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def make_store() -> TieredStore:
    return TieredStore([CpuTier(1 << 20)], chunk_tokens=CHUNK_TOKENS)


def test_remote_tiers_are_counted_not_held() -> None:
    store = make_store()
    RemoteTierCounts(store, ["remote", "peer"])
    assert store.external_tier_names == ["remote", "peer"]
    assert store.tier_names == ["cpu"] and set(store.usage()) == {"cpu"}
    assert set(store.snapshot()["stats"]["tiers"]) == {"cpu", "remote", "peer"}
    with pytest.raises(InvalidArgument):
        RemoteTierCounts(store, ["cpu"])


def test_hits_past_the_local_prefix_count_like_local_ones() -> None:
    store = make_store()
    counts = RemoteTierCounts(store, ["remote"])
    store.put(key(0), b"x" * 64, tenant="a", tokens=10)
    chain = [key(0), key(1), key(2), key(3)]
    res = store.lookup(chain, tenant="a")  # key(0) hits locally; the rest are missing here
    assert res.matched_chunks == 1
    counts.count_hits("remote", ["a", "b"], [7, 9], tenant="a")  # key(1), key(2) in the pool
    st = store.stats
    assert (st.hit_chunks, st.hit_tokens) == (3, 10 + 7 + 9)
    # the lookup counted the missing chunks as CHUNK_TOKENS each; two of them are now known
    assert st.lookup_tokens == 10 + 7 + 9 + CHUNK_TOKENS
    assert (st.reuse_hits, st.sharing_hits) == (2, 1)
    remote = st.tiers["remote"]
    assert (remote.hits, remote.hit_tokens) == (2, 16)
    assert (remote.reuse_hits, remote.sharing_hits) == (1, 1)


def test_a_read_kept_here_is_a_promotion_into_the_tier_it_landed_in() -> None:
    store = make_store()
    counts = RemoteTierCounts(store, ["peer"])
    counts.count_read("peer", 64, landed="cpu")
    counts.count_read("peer", 32, landed=None)
    assert store.stats.tiers["peer"].bytes_read == 96
    assert store.stats.tiers["cpu"].promotions == 1
