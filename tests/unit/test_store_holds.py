"""Chunks a caller holds (``TieredStore.holding``, as a remote pull holds the chain it lands):
making room never evicts them, those cached before and those stored during the hold alike; a
put that finds no room beside them goes to a lower tier or fails as beside pins; they are
evictable again once the hold ends; ``room_bytes`` leaves them out."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.store.errors import CapacityError
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from tests.unit.test_store_put_slots import CHUNK, data_of, key

POLICIES = ["lru", "lineage-lru", "lineage-lru2", "lineage-adaptive"]


def put(store: TieredStore, i: int) -> str | None:
    return store.put(key(i), data_of(key(i)), tenant="t", parent=key(i - 1) if i else None)


@pytest.mark.parametrize("policy", POLICIES)
def test_putting_past_capacity_never_evicts_held_chunks(policy: str) -> None:
    store = TieredStore([CpuTier(4 * CHUNK)], eviction=policy)
    try:
        put(store, 0)  # cached before the hold, one of its keys
        put(store, 100)  # not held: the one room may be made from
        with store.holding([key(i) for i in range(6)]) as hold:
            for i in (1, 2):
                assert put(store, i) == "cpu"
            assert put(store, 3) == "cpu"  # room made by evicting the one chunk not held
            assert key(100) not in store
            with pytest.raises(CapacityError):
                put(store, 4)
            assert all(key(i) in store for i in range(4))
            assert sorted(e.key for e in hold.entries) == [key(i) for i in range(4)]
            assert store.room_bytes() == 0
        assert store.room_bytes() == 4 * CHUNK
        assert put(store, 4) == "cpu"  # the hold is over: they are evictable again
        assert sum(key(i) in store for i in range(5)) == 4
    finally:
        store.close()


def test_a_put_beside_held_chunks_goes_to_the_tier_below(tmp_path: Path) -> None:
    store = TieredStore([CpuTier(2 * CHUNK), DiskTier(tmp_path / "disk", 8 * CHUNK)])
    try:
        with store.holding([key(i) for i in range(4)]):
            assert [put(store, i) for i in range(4)] == ["cpu", "cpu", "disk", "disk"]
            assert store.room_bytes() == 6 * CHUNK
        assert all(key(i) in store for i in range(4))
    finally:
        store.close()


def test_a_held_chunk_pinned_or_evicted_meanwhile_ends_its_hold_cleanly() -> None:
    store = TieredStore([CpuTier(3 * CHUNK)])
    try:
        with store.holding([key(0), key(1)]):
            put(store, 0)
            put(store, 1)
            store.pin([key(0)])
            assert store.evict([key(1)]).done == 1  # an operator's evict still takes it
        assert store.room_bytes() == 2 * CHUNK  # the pin stays out of the room, nothing else
        put(store, 2)
        put(store, 3)
        put(store, 4)  # room made from the unpinned chunks only
        assert key(0) in store
    finally:
        store.close()
