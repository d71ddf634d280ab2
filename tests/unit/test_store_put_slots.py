"""Puts received in place (``TieredStore.reserve_put`` / ``commit_put`` / ``abort_put``): a new
chunk's place reserved in the lease tier's arena, written without the store's lock (as a remote
pull's socket does), then committed or given back. Every path (commit, abort, the key stored
meanwhile, a resize, a close, a spill to another tier, isolation) leaves nothing reserved and
never wrong bytes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvctl.store.errors import InvalidArgument, PayloadSizeError, TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier

CHUNK = 4096


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def data_of(k: bytes, size: int = CHUNK) -> bytes:
    return random.Random(k).randbytes(size)


def read(store: TieredStore, k: bytes, tenant: str = "t") -> bytes:
    out = bytearray(CHUNK)
    n = store.read_into(k, memoryview(out), tenant=tenant)
    return bytes(out[:n])


def events_of(store: TieredStore) -> list[dict[str, object]]:
    seen: list[dict[str, object]] = []
    store.subscribe(seen.append)
    return seen


def test_a_committed_slot_is_the_chunk_in_place_with_its_metadata() -> None:
    cpu = CpuTier(8 * CHUNK)
    store = TieredStore([cpu], chunk_tokens=4)
    seen = events_of(store)
    k = key(1)
    slot = store.reserve_put(k, CHUNK, tokens=3, tenant="t", parent=key(0), priority=70)
    assert slot is not None and slot.view.nbytes == CHUNK and not slot.view.readonly
    # reserved, not yet a chunk: counted as used, invisible to readers, no event
    assert (cpu.reserved_bytes, cpu.used_bytes, len(store)) == (CHUNK, CHUNK, 0)
    assert store.locate([k], tenant="t") == [None] and seen == []
    slot.view[:] = data_of(k)  # the socket writes here, without the store's lock
    assert store.commit_put(slot) == "cpu"
    assert (cpu.reserved_bytes, cpu.used_bytes, len(store)) == (0, CHUNK, 1)
    e = store.entry(k)
    assert (e.tier, e.tokens, e.tenant, e.parent, e.priority) == ("cpu", 3, "t", key(0), 70)
    assert read(store, k) == data_of(k)
    assert [ev["type"] for ev in seen] == ["store"]
    assert store.stats.tiers["cpu"].puts == 1
    with pytest.raises(InvalidArgument):  # one commit or abort per slot
        store.commit_put(slot)
    store.abort_put(slot)  # a no-op once committed
    assert len(store) == 1 and read(store, k) == data_of(k)


def test_an_aborted_slot_gives_its_space_back_and_stores_nothing() -> None:
    cpu = CpuTier(2 * CHUNK)
    store = TieredStore([cpu], chunk_tokens=4)
    slots = [store.reserve_put(key(i), CHUNK, tenant="t") for i in range(2)]
    assert all(s is not None for s in slots) and cpu.free_bytes == 0
    for s in slots:
        assert s is not None
        s.view[:] = b"\xff" * CHUNK  # written in part or whole, then given up on
        store.abort_put(s)
        store.abort_put(s)  # twice is harmless
    assert (cpu.reserved_bytes, cpu.used_bytes, len(store)) == (0, 0, 0)
    assert store.put(key(5), data_of(key(5)), tenant="t") == "cpu"  # the space is usable


def test_room_is_made_as_a_put_makes_it_and_a_reserved_slot_is_never_evicted() -> None:
    cpu = CpuTier(3 * CHUNK)
    store = TieredStore([cpu], chunk_tokens=4)
    for i in range(3):
        store.put(key(i), data_of(key(i)), tenant="t")
    slot = store.reserve_put(key(10), CHUNK, tenant="t")  # evicts the least recent
    assert slot is not None and key(0) not in store
    # more puts while the slot is being written: they evict chunks, never the slot's bytes
    for i in range(20, 26):
        store.put(key(i), data_of(key(i)), tenant="t")
    slot.view[:] = data_of(key(10))
    assert store.commit_put(slot) == "cpu"
    assert read(store, key(10)) == data_of(key(10)) and cpu.reserved_bytes == 0


def test_a_key_stored_meanwhile_keeps_one_copy_and_the_slot_goes_back() -> None:
    cpu = CpuTier(8 * CHUNK)
    store = TieredStore([cpu], chunk_tokens=4)
    k = key(1)
    slot = store.reserve_put(k, CHUNK, tenant="t")
    assert slot is not None
    assert store.reserve_put(k, CHUNK, tenant="t") is not None  # two pulls may race
    store.put(k, data_of(k), tenant="t")  # the other one landed first
    slot.view[:] = data_of(k)
    assert store.commit_put(slot) == "cpu"  # a refresh of the chunk that is there
    assert len(store) == 1 and cpu.used_bytes == CHUNK + CHUNK  # the racing slot, still held
    assert read(store, k) == data_of(k)


def test_a_resize_under_a_slot_lands_its_bytes_by_a_put() -> None:
    cpu = CpuTier(4 * CHUNK)
    store = TieredStore([cpu], chunk_tokens=4)
    store.put(key(0), data_of(key(0)), tenant="t")
    slot = store.reserve_put(key(1), CHUNK, tenant="t")
    assert slot is not None
    store.resize("cpu", 16 * CHUNK)  # a new arena: the slot belongs to the old one
    assert cpu.reserved_bytes == 0
    slot.view[:] = data_of(key(1))  # still mapped: the writer is not cut off
    assert store.commit_put(slot) == "cpu"
    assert read(store, key(1)) == data_of(key(1)) and read(store, key(0)) == data_of(key(0))
    assert (cpu.reserved_bytes, cpu.used_bytes) == (0, 2 * CHUNK)


def test_a_store_closed_under_a_slot_keeps_nothing() -> None:
    cpu = CpuTier(4 * CHUNK)
    store = TieredStore([cpu], chunk_tokens=4)
    slot = store.reserve_put(key(1), CHUNK, tenant="t")
    assert slot is not None
    slot.view[:] = data_of(key(1))
    store.close()
    with pytest.raises(TierUnavailable):
        store.commit_put(slot)
    assert store.reserve_put(key(2), CHUNK, tenant="t") is None


def test_no_slot_where_a_put_would_not_land_in_the_lease_tier(tmp_path: Path) -> None:
    # no cpu tier at all
    disk_only = TieredStore([DiskTier(tmp_path / "d1", 8 * CHUNK)], chunk_tokens=4)
    assert disk_only.reserve_put(key(1), CHUNK, tenant="t") is None
    disk_only.close()
    # the cpu tier is all pinned: a put spills to disk, so no slot
    cpu = CpuTier(2 * CHUNK)
    store = TieredStore([cpu, DiskTier(tmp_path / "d2", 8 * CHUNK)], chunk_tokens=4)
    for i in range(2):
        store.put(key(i), data_of(key(i)), tenant="t", pinned=True)
    assert store.reserve_put(key(5), CHUNK, tenant="t") is None
    assert store.put(key(5), data_of(key(5)), tenant="t") == "disk"
    # cached already: a put only refreshes it
    assert store.reserve_put(key(0), CHUNK, tenant="t") is None
    assert cpu.reserved_bytes == 0
    # bad arguments are refused like put refuses them
    with pytest.raises(InvalidArgument):
        store.reserve_put(b"short", CHUNK, tenant="t")
    with pytest.raises(InvalidArgument):
        store.reserve_put(key(9), CHUNK, tenant="t", priority=1000)
    fixed = TieredStore([CpuTier(4 * CHUNK)], chunk_tokens=4, chunk_bytes=CHUNK)
    with pytest.raises(PayloadSizeError):
        fixed.reserve_put(key(9), CHUNK + 1, tenant="t")
    store.close()
    fixed.close()


def test_isolation_holds_for_chunks_received_in_place() -> None:
    cpu = CpuTier(8 * CHUNK)
    store = TieredStore([cpu], chunk_tokens=4, isolated_tenants=["iso"])
    # an isolated tenant's chunk is isolated and its own, as with put
    slot = store.reserve_put(key(1), CHUNK, tenant="iso")
    assert slot is not None
    slot.view[:] = data_of(key(1))
    store.commit_put(slot)
    assert store.entry(key(1)).isolated
    assert store.locate([key(1)], tenant="other") == [None]
    assert read(store, key(1), tenant="iso") == data_of(key(1))
    # another tenant's chunk under the same key is not reserved over: put replaces it
    assert store.reserve_put(key(1), CHUNK, tenant="other") is None
    # one stored by an isolated tenant meanwhile is replaced by the commit, as a put would
    slot = store.reserve_put(key(2), CHUNK, tenant="other")
    assert slot is not None
    store.put(key(2), b"\x01" * CHUNK, tenant="iso")
    slot.view[:] = data_of(key(2))
    store.commit_put(slot)
    assert read(store, key(2), tenant="other") == data_of(key(2))
    assert store.locate([key(2)], tenant="iso") == [None]
    assert cpu.reserved_bytes == 0
