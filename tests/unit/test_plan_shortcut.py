"""A lookup whose whole local prefix sits in free tiers (cpu, gpu) and whose only cost is the
copy to the device takes all of it without running the plan when every chunk's copy is quicker
than recomputing the cheapest chunk (the prefill model's per-token cost only grows with depth).
The shortcut must answer and count exactly what the plan would; where its condition fails the
plan runs as before."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from kvctl.remote.federation import FetchPlanner
from kvctl.remote.fetchplan import PrefillRate, PrefillSample
from kvctl.store.index import LookupResult
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier

TOKENS = 256


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def planner(
    tmp_path: Path, sizes: list[int], *, disk_at: int | None = None, disk_bytes_per_s: float = 0
) -> FetchPlanner:
    store = TieredStore([CpuTier(64 << 20), DiskTier(tmp_path / "disk", 64 << 20)])
    for i, size in enumerate(sizes):
        store.put(key(i), bytes(size), tokens=TOKENS, parent=key(i - 1) if i else None)
    if disk_at is not None:
        store.move([key(disk_at)], "disk")
    p = FetchPlanner(
        store, prefill=PrefillRate(1e4, "configured"), disk_read_bytes_per_s=disk_bytes_per_s
    )
    # an attention term, so recomputing deep chunks costs more than shallow ones
    p.rates.report([PrefillSample(TOKENS, 0, 0.01), PrefillSample(TOKENS, 8 * TOKENS, 0.03)])
    return p


def planned(p: FetchPlanner, monkeypatch: pytest.MonkeyPatch, keys: list[bytes]) -> LookupResult:
    with monkeypatch.context() as m:
        m.setattr(FetchPlanner, "_dominant_fetch_s", staticmethod(lambda *_a: None))
        return p.lookup(keys)


def counted(p: FetchPlanner) -> tuple[int, float, float, float]:
    c = p.counters()
    return c.fetch_chunks, c.recompute_s, c.fetch_s, c.saved_s


@pytest.mark.parametrize("seed", range(6))
def test_the_shortcut_answers_and_counts_what_the_plan_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    rng = random.Random(seed)
    sizes = [rng.choice([64 << 10, 256 << 10, 1 << 20]) for _ in range(rng.randint(1, 12))]
    keys = [key(i) for i in range(len(sizes) + 2)]  # two past what is cached
    # a chunk on a disk no read has measured yet costs nothing either (as the plan says)
    disk_at = rng.choice([None, rng.randrange(len(sizes))])
    fast = planner(tmp_path / "a", sizes, disk_at=disk_at)
    slow = planner(tmp_path / "b", sizes, disk_at=disk_at)
    for p in (fast, slow):
        # quick enough that every chunk is worth copying
        p.rates.report([], host_to_device_bytes_per_s=1e12)
    got = fast.lookup(keys)
    want = planned(slow, monkeypatch, keys)
    assert got == want and got.matched_chunks == len(sizes)
    assert fast.last_plan is None and slow.last_plan is not None  # planned only the second
    for a, b in zip(counted(fast), counted(slow), strict=True):
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def test_a_copy_slower_than_recomputing_a_chunk_is_planned(tmp_path: Path) -> None:
    p = planner(tmp_path, [1 << 20] * 4)
    p.rates.report([], host_to_device_bytes_per_s=1e6)  # 1 s a chunk against 10 ms of prefill
    res = p.lookup([key(i) for i in range(4)])
    assert res.matched_chunks == 0 and p.last_plan is not None
    assert p.counters().recompute_chunks == 4


def test_a_chunk_on_a_costed_disk_is_planned(tmp_path: Path) -> None:
    p = planner(tmp_path, [1 << 20] * 4, disk_at=2, disk_bytes_per_s=1e9)
    p.rates.report([], host_to_device_bytes_per_s=1e12)
    p.lookup([key(i) for i in range(4)])
    assert p.last_plan is not None  # the disk's read is costed by the plan
