"""``TieredStore.flush``'s order and deadline (the agent's demotion at a clean stop uses them):
hottest first, nothing begun past the deadline."""

from __future__ import annotations

import time
from pathlib import Path

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
