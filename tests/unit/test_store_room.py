"""A put lands in the first tier that can take it, and a put that fails changes nothing.

The cpu tier's arena can be split by leased regions (a reader holds a chunk in place), so
"enough free bytes" is not "room": these tests mix chunk sizes and leases so that the free space
of the arena is fragmented, and check that the store decides where a chunk can go before it
evicts anything (issue 22, item 1).
"""

from __future__ import annotations

import math
import random
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.store.errors import CapacityError
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier, Lease
from kvctl.store.tiers.disk import DiskTier


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def data(i: int, n: int) -> bytes:
    return random.Random(i).randbytes(n)


def snapshot(store: TieredStore) -> tuple[dict[bytes, str], dict[str, dict[str, int]], int]:
    """What a failed put must leave as it was: where every chunk is, each tier's usage, and
    the cpu tier's live leases."""
    home = store.lease_tier
    leases = 0 if home is None else home.lease_count
    return {e.key: e.tier for e in store.entries()}, store.usage(), leases


def test_put_falls_through_to_disk_when_leases_split_the_arena(tmp_path: Path) -> None:
    store = TieredStore([CpuTier(1000), DiskTier(tmp_path / "disk", 10_000)], eviction="lru")
    for i in range(10):  # chunk i at offset 100 * i
        store.put(k(i), data(i, 100))
    leases = {i: store.lease(k(i), math.inf) for i in (2, 5, 8)}
    assert all(isinstance(lease, Lease) for lease in leases.values())
    before = {e.key: e.tier for e in store.entries()}

    # 300 bytes: no run of 300 bytes exists between the leased regions (200, 500 and 800),
    # whatever is evicted, so the cpu tier cannot take it and must not be touched
    assert store.put(k(100), data(100, 300)) == "disk"
    assert store.get(k(100)) == data(100, 300)
    after = {e.key: e.tier for e in store.entries()}
    del after[k(100)]
    assert after == before  # nothing was demoted for a put that could not land in cpu
    assert store.stats.tiers["cpu"].evictions["capacity"] == 0
    for i, lease in leases.items():
        assert bytes(store.leased_view(lease)) == data(i, 100)


def test_put_evicts_next_to_a_hole_to_land_in_cpu_between_leases(tmp_path: Path) -> None:
    store = TieredStore([CpuTier(1000), DiskTier(tmp_path / "disk", 10_000)], eviction="lru")
    sizes = {1: 100, 2: 300, 3: 100, 4: 200, 5: 100, 6: 200}  # offsets 0, 100, 400, 500, 700, 800
    for i, n in sizes.items():
        store.put(k(i), data(i, n))
    lease = store.lease(k(3), math.inf)  # [400, 500) stays put: [0, 400) and [500, 1000) around it
    assert lease is not None and lease.offset == 400
    store.touch(k(2))  # LRU order now 1, 4, 5, 6, 2, 3
    # the 400 bytes fit only in [500, 1000): evicting the policy's first victims (1, 4, 5) frees
    # 400 bytes, but split 100 + 300 on both sides of the lease
    assert store.put(k(100), data(100, 400)) == "cpu"
    tiers = {i: store.entry(k(i)).tier for i in sizes}
    assert tiers == {1: "cpu", 2: "cpu", 3: "cpu", 4: "disk", 5: "disk", 6: "disk"}
    for i, n in sizes.items():
        assert store.get(k(i)) == data(i, n)
    assert store.get(k(100)) == data(100, 400)
    assert bytes(store.leased_view(lease)) == data(3, 100)


def test_a_put_no_tier_can_take_changes_nothing(tmp_path: Path) -> None:
    store = TieredStore([CpuTier(1000), DiskTier(tmp_path / "disk", 250)], eviction="lru")
    for i in range(10):
        store.put(k(i), data(i, 100))
    for i in (2, 5, 8):
        store.lease(k(i), math.inf)
    before = snapshot(store)
    with pytest.raises(CapacityError, match="cannot fit"):
        store.put(k(100), data(100, 300))  # no 300-byte run in cpu; disk holds 250 bytes
    assert k(100) not in store
    assert snapshot(store) == before
    assert store.stats.tiers["cpu"].evictions["capacity"] == 0
    for i in range(10):
        assert store.get(k(i)) == data(i, 100)


def test_cpu_only_store_refuses_without_evicting() -> None:
    store = TieredStore([CpuTier(1000)], eviction="lineage-lru")
    for i in range(10):
        store.put(k(i), data(i, 100))
    for i in (3, 7):
        store.lease(k(i), math.inf)
    before = snapshot(store)
    with pytest.raises(CapacityError):
        store.put(k(100), data(100, 400))  # runs between leases: 300, 300, 200 bytes
    assert snapshot(store) == before
    assert store.put(k(101), data(101, 300)) == "cpu"  # 300 fits in [0, 300) or [400, 700)


# --- property: random mixed-size puts, leases and releases -------------------------------------

_SIZES = st.sampled_from([50, 100, 150, 250, 400, 700])
_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), _SIZES),
        st.tuples(st.just("lease"), st.integers(0, 10_000)),
        st.tuples(st.just("release"), st.integers(0, 10_000)),
    ),
    min_size=1,
    max_size=60,
)


def _largest_run(capacity: int, held: list[tuple[int, int]]) -> int:
    """Longest run of arena bytes that no leased region covers: with every other chunk
    evictable, the largest chunk the cpu tier can take."""
    best, cursor = 0, 0
    for off, n in sorted(held):
        best = max(best, off - cursor)
        cursor = max(cursor, off + n)
    return max(best, capacity - cursor)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    ops=_OPS,
    disk_bytes=st.sampled_from([0, 200, 600, 3000]),
    eviction=st.sampled_from(["lru", "lineage-lru", "lineage-lru2", "lineage-gdsf", "lineage-arc"]),
)
def test_put_raises_only_when_no_tier_can_hold_it_and_then_changes_nothing(
    ops: list[tuple[str, int]], disk_bytes: int, eviction: str
) -> None:
    cpu_bytes = 1000
    with tempfile.TemporaryDirectory() as tmp:
        tiers: list[Any] = [CpuTier(cpu_bytes)]
        if disk_bytes:
            tiers.append(DiskTier(Path(tmp) / "disk", disk_bytes))
        store = TieredStore(tiers, eviction=eviction)
        written: dict[bytes, bytes] = {}
        leases: list[Lease] = []
        next_key = 0
        try:
            for op, arg in ops:
                if op == "put":
                    key = k(next_key)
                    next_key += 1
                    payload = data(next_key, arg)
                    held = [(lease.offset, lease.size_bytes) for lease in leases]
                    cpu_can = _largest_run(cpu_bytes, held) >= arg
                    disk_can = arg <= disk_bytes
                    before = snapshot(store)
                    try:
                        landed = store.put(key, payload)
                    except CapacityError:
                        assert not cpu_can and not disk_can, (arg, held, disk_bytes)
                        assert snapshot(store) == before
                        continue
                    assert cpu_can or disk_can
                    # the first tier that can take it does
                    assert landed == ("cpu" if cpu_can else "disk"), (arg, held)
                    written[key] = payload
                elif op == "lease":
                    cached = sorted(key for key in written if key in store)
                    if not cached:
                        continue
                    lease = store.lease(cached[arg % len(cached)], math.inf)
                    if lease is not None:
                        leases.append(lease)
                elif leases:
                    lease = leases.pop(arg % len(leases))
                    assert store.release([lease.lease_id]) == 1
            # nothing stored was lost or altered; dropped chunks are simply gone
            for key, payload in written.items():
                if key in store:
                    assert bytes(store.get(key)) == payload
        finally:
            store.close()
