"""``TieredStore.flush``'s order and deadline (the agent's demotion at a clean stop uses them):
hottest first, nothing begun past the deadline; on a disk short of room the stop keeps the
hottest it can fit, across the tiers it demotes and whatever the chunks' sizes."""

from __future__ import annotations

import time
from pathlib import Path

from kvctl.agent.stop_demotion import demote_for_stop
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier

CHUNK = 4096


def _store(tmp_path: Path, disk_chunks: int) -> TieredStore:
    tiers = [CpuTier(32 * CHUNK), DiskTier(tmp_path / "disk", disk_chunks * CHUNK + 4096)]
    return TieredStore(tiers, eviction="lru")


def test_a_deadline_passed_begins_nothing(tmp_path: Path) -> None:
    store = _store(tmp_path, 32)
    keys = [bytes([i]) * 16 for i in range(8)]
    for k in keys:
        store.put(k, bytes(CHUNK))
    r = store.flush("cpu", demote=True, hottest_first=True, deadline_s=time.monotonic())
    assert (r.done, r.unfinished, r.failed) == (0, 8, 0)
    assert store.locate(keys) == ["cpu"] * 8
    store.close()


def test_hottest_first_keeps_the_hottest_when_the_disk_is_short(tmp_path: Path) -> None:
    store = _store(tmp_path, 4)
    keys = [bytes([i]) * 16 for i in range(8)]
    for k in keys:
        store.put(k, bytes(CHUNK))
    for k in keys:  # LRU: keys[-1] read last is the hottest
        store.get(k)
    r = store.flush("cpu", demote=True, hottest_first=True)
    on_disk = [t == "disk" for t in store.locate(keys)]
    assert on_disk == [False] * (8 - r.done) + [True] * r.done
    assert r.done >= 3 and r.failed == 8 - r.done and r.done_bytes == r.done * CHUNK
    store.close()


def _keys(tag: bytes, n: int) -> list[bytes]:
    return [tag * 15 + bytes([i]) for i in range(n)]


def test_a_lower_tiers_chunks_never_evict_the_upper_tiers_from_disk(tmp_path: Path) -> None:
    # a gpu tier stands in as a second arena above cpu (no CUDA here): the stop demotes it first,
    # its chunks being the hottest; the cpu tier's, colder, must not push them off the disk
    tiers = [
        CpuTier(8 * CHUNK, name="gpu"),
        CpuTier(8 * CHUNK),
        DiskTier(tmp_path / "disk", 4 * CHUNK + 4096),
    ]
    store = TieredStore(tiers, eviction="lru")
    hot, cold = _keys(b"g", 4), _keys(b"c", 4)
    for k in cold:
        store.put(k, bytes(CHUNK), tier="cpu")
    for k in hot:
        store.put(k, bytes(CHUNK), tier="gpu")
    r = demote_for_stop(store, 15)
    assert store.locate(hot) == ["disk"] * 4  # before: ['disk', None, None, None]
    assert r.demoted == 5 and r.left == 3  # before: 8 "demoted", 3 of them evicted by the others
    store.close()


def test_one_chunk_too_large_for_the_disk_does_not_stop_the_smaller_ones(tmp_path: Path) -> None:
    store = TieredStore(
        [CpuTier(32 * CHUNK), DiskTier(tmp_path / "disk", 12 * CHUNK)], eviction="lru"
    )
    for k in _keys(b"p", 7):  # pinned on disk: 5 chunks of unpinned room left
        store.put(k, bytes(CHUNK), tier="disk", pinned=True)
    small, big = _keys(b"s", 4), b"B" * 16
    for k in small[1:]:  # coldest first
        store.put(k, bytes(CHUNK))
    store.put(big, bytes(6 * CHUNK))  # larger than the disk's unpinned room: can never go down
    store.put(small[0], bytes(CHUNK))  # the hottest
    r = demote_for_stop(store, 15)
    assert store.locate(small) == ["disk"] * 4  # before: ['disk', 'cpu', 'cpu', 'cpu']
    assert store.locate([big]) == ["cpu"]
    assert (r.demoted, r.left) == (4, 1)
    store.close()
