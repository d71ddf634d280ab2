"""The tiered store: lookup, movement between tiers, pins, resize, bad input, recovery."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.store.errors import (
    CapacityError,
    InvalidArgument,
    KeyNotFound,
    PayloadSizeError,
    TierUnavailable,
)
from kvctl.store.keys import Namespace
from kvctl.store.policies import FrequencyAdmission
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import Buffer, ChunkMeta, Tier, check_put, check_resize
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from tests.conftest import chain, put_chain
from tests.unit.test_disk_tier import as_after_a_crash


def two_tier(tmp_path: Path, cpu: int = 300, disk: int = 1000, **kw) -> TieredStore:  # type: ignore[no-untyped-def]
    return TieredStore([CpuTier(cpu), DiskTier(tmp_path / "disk", disk)], **kw)


def payload(key: bytes, size: int = 100) -> bytes:
    return bytes([key[0]]) * size


# --- lookup -------------------------------------------------------------------------------------


def test_lookup_reports_longest_prefix_and_tier_of_each_chunk(ns: Namespace) -> None:
    store = TieredStore([CpuTier(10_000)])
    keys = chain(ns, 5)
    put_chain(store, keys[:3])
    store.put(keys[4], payload(keys[4]), parent=keys[3])  # cached, but past a missing chunk
    res = store.lookup(keys, tenant="a")
    assert res.matched_chunks == 3
    assert res.locations == ("cpu", "cpu", "cpu", None, "cpu")
    assert store.stats.hit_chunks == 3 and store.stats.lookup_chunks == 5


def test_peek_answers_like_lookup_and_counts_nothing(ns: Namespace) -> None:
    store = TieredStore([CpuTier(10_000)])
    keys = chain(ns, 5)
    put_chain(store, keys[:3], tenant="a", tokens=4)
    store.put(keys[4], payload(keys[4]), parent=keys[3], tenant="a", tokens=4)
    cached = [k for k in keys if k != keys[3]]
    touched = [store.entry(k).last_access_s for k in cached]
    before = store.stats.as_dict()
    peeked = store.peek(keys, tenant="a")
    assert store.stats.as_dict() == before
    assert [store.entry(k).last_access_s for k in cached] == touched
    assert peeked == store.lookup(keys, tenant="a")
    assert peeked.matched_tokens == 12 and store.stats.hit_chunks == 3


def test_hits_split_into_reuse_and_sharing(ns: Namespace) -> None:
    store = TieredStore([CpuTier(10_000)])
    keys = chain(ns, 2)
    put_chain(store, keys, tenant="a")
    store.lookup(keys, tenant="a")
    store.lookup(keys, tenant="b")
    store.lookup(keys[:1], tenant="b")
    s = store.stats
    assert (s.reuse_hits, s.sharing_hits) == (2, 3)
    assert (s.tiers["cpu"].reuse_hits, s.tiers["cpu"].sharing_hits) == (2, 3)
    # a chunk's own hit count counts reads that served it, not lookups
    assert store.entry(keys[0]).hit_count == 0
    store.get(keys[0], tenant="b")
    assert store.entry(keys[0]).hit_count == 1
    assert store.entry(keys[0]).tenants == {"a", "b"}


def test_lookup_counts_hits_per_tier_when_the_prefix_spans_tiers(
    ns: Namespace, tmp_path: Path
) -> None:
    store = TieredStore([CpuTier(3 * 100), DiskTier(tmp_path, 10_000)], chunk_tokens=256)
    keys = chain(ns, 5)
    put_chain(store, keys, tenant="a", size=100)
    res = store.lookup(keys, tenant="b")
    assert res.matched_chunks == 5
    per_tier = {name: t.hits for name, t in store.stats.tiers.items()}
    assert per_tier == {"cpu": res.locations.count("cpu"), "disk": res.locations.count("disk")}
    assert per_tier["disk"] >= 1 and per_tier["cpu"] >= 1
    assert store.stats.tiers["disk"].sharing_hits == per_tier["disk"]


def test_isolated_chunks_are_invisible_to_other_tenants(ns: Namespace) -> None:
    store = TieredStore([CpuTier(10_000)])
    keys = chain(ns, 2)
    put_chain(store, keys, tenant="a", isolated=True)
    assert store.lookup(keys, tenant="b").matched_chunks == 0
    with pytest.raises(KeyNotFound):
        store.get(keys[0], tenant="b")
    # answers like a new chunk's put (never "declined", which would say the key exists) and
    # stores nothing: the owner still reads its own bytes
    assert store.put(keys[0], payload(keys[0]), tenant="b") == "cpu"
    assert store.get(keys[0], tenant="a") == payload(keys[0])
    assert store.lookup(keys, tenant="a").matched_chunks == 2


# --- movement between tiers -------------------------------------------------------------------


def test_cpu_eviction_demotes_to_disk_and_disk_hit_promotes(tmp_path: Path, ns: Namespace) -> None:
    store = two_tier(tmp_path, eviction="lru")
    keys = chain(ns, 4)
    put_chain(store, keys)  # cpu holds 3 chunks of 100 bytes; the oldest goes to disk
    assert store.entry(keys[0]).tier == "disk"
    assert [store.entry(k).tier for k in keys[1:]] == ["cpu"] * 3
    assert store.stats.tiers["disk"].demotions == 1
    assert store.stats.tiers["cpu"].evictions["capacity"] == 1
    data = store.get(keys[0])
    assert data == payload(keys[0])
    assert store.entry(keys[0]).tier == "cpu"  # promoted...
    assert store.stats.tiers["cpu"].promotions == 1
    assert store.entry(keys[1]).tier == "disk"  # ...which demoted the LRU chunk
    assert store.tier("cpu").used_bytes == 300 and store.tier("disk").used_bytes == 100


def test_frequency_admission_keeps_one_hit_chunks_off_disk(tmp_path: Path, ns: Namespace) -> None:
    gate = FrequencyAdmission(min_accesses=2)
    store = two_tier(tmp_path, eviction="lru", admission={"disk": gate})
    hot, cold = chain(ns, 1, seed=1)[0], chain(ns, 1, seed=2)[0]
    store.put(hot, payload(hot))
    store.get(hot)  # second access
    store.put(cold, payload(cold))
    for i in range(3, 6):  # push both out of cpu
        k = chain(ns, 1, seed=i)[0]
        store.put(k, payload(k))
    assert store.entry(hot).tier == "disk"
    assert cold not in store
    assert gate.refused >= 1 and store.stats.admission_refused >= 1
    # a dropped chunk that returns is remembered: its second life counts as a second access
    store.put(cold, payload(cold))
    for i in range(6, 9):
        k = chain(ns, 1, seed=i)[0]
        store.put(k, payload(k))
    assert store.entry(cold).tier == "disk"


def test_move_prefetch_flush(tmp_path: Path, ns: Namespace) -> None:
    store = two_tier(tmp_path)
    keys = chain(ns, 3)
    put_chain(store, keys)
    assert store.move(keys[:2], "disk").done == 2
    assert [store.entry(k).tier for k in keys] == ["disk", "disk", "cpu"]
    r = store.prefetch([*keys, b"\0" * 16], "cpu")
    assert (r.done, r.missing) == (2, 1)
    assert store.get(keys[1]) == payload(keys[1])
    store.pin([keys[0]])
    r = store.flush("cpu")
    assert (r.done, r.skipped_pinned) == (2, 1)
    assert list(store.entries("cpu")) == [store.entry(keys[0])]
    assert store.stats.tiers["cpu"].evictions["flush"] == 2


def test_flush_with_demote_keeps_chunks_on_disk(tmp_path: Path, ns: Namespace) -> None:
    store = two_tier(tmp_path)
    keys = chain(ns, 2)
    put_chain(store, keys)
    store.flush("cpu", demote=True)
    assert [store.entry(k).tier for k in keys] == ["disk", "disk"]


@pytest.mark.parametrize("why", ["no room", "refused", "offline"])
def test_flush_with_demote_keeps_what_the_tier_below_cannot_take(
    tmp_path: Path, ns: Namespace, why: str
) -> None:
    """demote promises "instead of dropping": a chunk the tier below has no room for, refuses
    (admission) or cannot be written to (offline) stays where it is, counted failed."""
    gate = FrequencyAdmission(min_accesses=5)
    store = two_tier(
        tmp_path,
        disk=50 if why == "no room" else 1000,  # smaller than a chunk
        admission={"disk": gate} if why == "refused" else None,
    )
    keys = chain(ns, 2)
    put_chain(store, keys)
    if why == "offline":  # the disk's next use fails as a device that went away
        store._take_offline(store.tier("disk"), TierUnavailable("gone (test)"))
    r = store.flush("cpu", demote=True)
    assert (r.done, r.failed) == (0, 2)
    assert [store.entry(k).tier for k in keys] == ["cpu", "cpu"]
    assert store.get(keys[1]) == payload(keys[1])
    assert store.stats.tiers["cpu"].evictions["flush"] == 0
    # back in their policy: pressure still evicts them as before
    assert store.flush("cpu").done == 2 and not any(k in store for k in keys)


@pytest.mark.parametrize("disk", [True, False])
def test_flush_with_demote_of_the_bottom_tier_is_refused_and_drops_nothing(
    tmp_path: Path, ns: Namespace, disk: bool
) -> None:
    # demote promises "instead of dropping": from the bottom tier there is nowhere to go
    store = two_tier(tmp_path) if disk else TieredStore([CpuTier(10_000)])
    bottom = "disk" if disk else "cpu"
    keys = chain(ns, 2)
    put_chain(store, keys)
    if disk:
        store.move(keys, "disk")
    with pytest.raises(InvalidArgument, match=f"cannot demote the {bottom} tier's chunks"):
        store.flush(bottom, demote=True)
    assert [store.entry(k).tier for k in keys] == [bottom, bottom]
    assert store.stats.tiers[bottom].evictions["flush"] == 0


# --- pins and resize --------------------------------------------------------------------------


def test_pinned_chunks_survive_pressure_and_explicit_evict(ns: Namespace) -> None:
    store = TieredStore([CpuTier(300)], eviction="lru")
    keys = chain(ns, 8)
    store.put(keys[0], payload(keys[0]), pinned=True)
    put_chain(store, keys[1:])
    assert keys[0] in store and store.entry(keys[0]).pinned
    r = store.evict([keys[0]])
    assert (r.done, r.skipped_pinned) == (0, 1)
    store.unpin([keys[0]])
    assert store.evict([keys[0]]).done == 1


def test_pin_that_cannot_fit_fails_and_pins_nothing(tmp_path: Path, ns: Namespace) -> None:
    store = two_tier(tmp_path, cpu=200, disk=1000)
    keys = chain(ns, 3)
    put_chain(store, keys, tier="disk")
    with pytest.raises(CapacityError, match="pinning 300 more bytes"):
        store.pin(keys, tier="cpu")
    assert not any(store.entry(k).pinned for k in keys)
    assert all(store.entry(k).tier == "disk" for k in keys)
    assert store.pin(keys[:2], tier="cpu").done == 2
    assert all(store.entry(k).tier == "cpu" for k in keys[:2])
    # the cpu tier is now all pinned: a new chunk cannot go there
    new = chain(ns, 1, seed=5)[0]
    with pytest.raises(CapacityError, match="pinned"):
        store.put(new, payload(new), tier="cpu", pinned=True)
    assert new not in store


def test_put_into_a_fully_pinned_tier_is_refused_without_change(ns: Namespace) -> None:
    store = TieredStore([CpuTier(200)])
    keys = chain(ns, 3)
    for k in keys[:2]:
        store.put(k, payload(k), pinned=True)
    before = store.usage()
    with pytest.raises(CapacityError):
        store.put(keys[2], payload(keys[2]))
    assert store.usage() == before and keys[2] not in store


def test_resize_evicts_down_live_and_respects_pins(tmp_path: Path, ns: Namespace) -> None:
    store = two_tier(tmp_path, cpu=500, disk=1000, eviction="lru")
    keys = chain(ns, 5)
    put_chain(store, keys)
    store.pin([keys[4]])
    r = store.resize("cpu", 200)
    assert r.done == 3
    assert store.tier("cpu").capacity_bytes == 200
    assert [store.entry(k).tier for k in keys] == ["disk", "disk", "disk", "cpu", "cpu"]
    assert store.stats.tiers["cpu"].evictions["resize"] == 3
    with pytest.raises(CapacityError, match="pinned"):
        store.resize("cpu", 50)
    assert store.tier("cpu").capacity_bytes == 200
    store.resize("cpu", 1000)
    for k in keys[:3]:
        assert store.get(k) == payload(k)  # promoted back, bytes intact


# --- bad input ----------------------------------------------------------------------------------


def test_bad_input_is_refused_with_clear_errors_and_no_change(ns: Namespace) -> None:
    store = TieredStore([CpuTier(1000)], chunk_bytes=100)
    k = chain(ns, 1)[0]
    store.put(k, payload(k))
    before = (store.usage(), len(store))
    with pytest.raises(PayloadSizeError, match="holds 100"):
        store.put(chain(ns, 1, seed=9)[0], b"x" * 99)
    with pytest.raises(InvalidArgument, match="16 bytes"):
        store.put(b"short", b"x" * 100)
    with pytest.raises(InvalidArgument, match="priority"):
        store.put(chain(ns, 1, seed=8)[0], b"x" * 100, priority=101)
    with pytest.raises(InvalidArgument, match="retention"):
        store.put(chain(ns, 1, seed=8)[0], b"x" * 100, retention_seconds=-1)
    with pytest.raises(InvalidArgument, match="smaller than one chunk"):
        store.resize("cpu", 99)
    with pytest.raises(InvalidArgument, match="negative"):
        store.resize("cpu", -5)
    with pytest.raises(InvalidArgument, match="unknown tier"):
        store.resize("gpu", 1000)
    with pytest.raises(KeyNotFound):
        store.get(chain(ns, 1, seed=7)[0])
    with pytest.raises(KeyNotFound):
        store.entry(b"\1" * 16)
    assert (store.usage(), len(store)) == before
    assert store.get(k) == payload(k)


def test_capacity_smaller_than_one_chunk_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="smaller than one chunk"):
        TieredStore([CpuTier(99)], chunk_bytes=100)


def test_chunk_larger_than_tier_is_refused(ns: Namespace) -> None:
    store = TieredStore([CpuTier(50)])
    k = chain(ns, 1)[0]
    with pytest.raises(CapacityError, match="cannot fit"):
        store.put(k, b"x" * 51)
    assert len(store) == 0


def test_refreshing_a_key_with_other_bytes_count_is_refused(ns: Namespace) -> None:
    store = TieredStore([CpuTier(1000)])
    k = chain(ns, 1)[0]
    store.put(k, b"x" * 100)
    with pytest.raises(PayloadSizeError, match="cached with 100"):
        store.put(k, b"x" * 101)
    assert store.put(k, b"y" * 100) == "cpu"  # same size: a refresh, bytes unchanged
    assert store.get(k) == b"x" * 100


# --- durability -------------------------------------------------------------------------------


def test_restart_rebuilds_index_and_drops_a_planted_torn_chunk(
    tmp_path: Path, ns: Namespace
) -> None:
    store = two_tier(tmp_path, cpu=1000, disk=10_000)
    keys = chain(ns, 6)
    put_chain(store, keys, tier="disk", tenant="t1")
    store.close()
    as_after_a_crash(tmp_path / "disk")  # torn files come of crashes: the open scans them
    files = sorted((tmp_path / "disk").rglob("*.kv"))
    assert len(files) == 6
    torn = next(f for f in files if f.name.startswith(keys[5].hex()))
    with open(torn, "r+b") as f:
        f.truncate(os.path.getsize(torn) - 10)
    reopened = two_tier(tmp_path, cpu=1000, disk=10_000)
    assert keys[5] not in reopened
    assert reopened.lookup(keys, tenant="t1").matched_chunks == 5
    for k in keys[:5]:
        e = reopened.entry(k)
        assert (e.tier, e.tenant, e.size_bytes) == ("disk", "t1", 100)
        assert reopened.get(k, tenant="t1") == payload(k)
    assert reopened.entry(keys[0]).children == 1  # lineage rebuilt from parent links
    assert reopened.entry(keys[4]).children == 0  # its child was the torn one


def test_restart_with_smaller_disk_evicts_down(tmp_path: Path, ns: Namespace) -> None:
    store = two_tier(tmp_path, disk=1000)
    put_chain(store, chain(ns, 8), tier="disk")
    store.close()
    reopened = two_tier(tmp_path, disk=500)
    assert reopened.tier("disk").used_bytes <= 500 and len(reopened) == 5


def test_disk_full_while_demoting_degrades_to_a_counted_drop(tmp_path: Path) -> None:
    """A real EFBIG (file size limit) while demoting: the victim is dropped and counted, nothing
    else is lost, and the store keeps working."""
    script = textwrap.dedent(
        f"""
        import json, resource, signal
        from kvctl.store.store import TieredStore
        from kvctl.store.tiers.cpu import CpuTier
        from kvctl.store.tiers.disk import DiskTier
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        store = TieredStore([CpuTier(2 << 20), DiskTier({str(tmp_path / "d")!r}, 64 << 20)],
                            eviction="lru")
        resource.setrlimit(resource.RLIMIT_FSIZE, (512 << 10, 512 << 10))
        keys = [bytes([i]) * 16 for i in range(1, 6)]
        for k in keys:
            store.put(k, bytes([k[0]]) * (1 << 20))
        ok = all(store.get(k) == bytes([k[0]]) * (1 << 20) for k in keys if k in store)
        print(json.dumps({{"cached": sum(k in store for k in keys), "ok": ok,
                          "failures": store.stats.demotion_failures,
                          "drops": store.stats.drops,
                          "disk_used": store.tier("disk").used_bytes}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    result = json.loads(out.stdout)
    assert result == {"cached": 2, "ok": True, "failures": 3, "drops": 3, "disk_used": 0}
    assert not list((tmp_path / "d").rglob("*.tmp*"))


# --- a tier that fails (a device gone bad) ---------------------------------------------------


class FailingTier(Tier):
    """An in-memory tier whose puts raise TierUnavailable while ``failure`` is set, as a gpu
    tier's do after a CUDA error; reads of what it already holds keep working."""

    def __init__(self, capacity_bytes: int, name: str = "dev") -> None:
        self.name = name
        self._capacity = capacity_bytes
        self._data: dict[bytes, bytes] = {}
        self.failure: str | None = None
        self.put_calls = 0

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return sum(map(len, self._data.values()))

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> Iterator[bytes]:
        return iter(list(self._data))

    def size_of(self, key: bytes) -> int:
        return len(self._lookup(key))

    def put(self, meta: ChunkMeta, data: Buffer | None) -> None:
        self.put_calls += 1
        check_put(self, meta, data)
        if self.failure is not None:
            raise TierUnavailable(f"tier {self.name!r}: {self.failure}")
        assert data is not None
        self._data[meta.key] = bytes(data)

    def read_into(self, key: bytes, out: memoryview) -> int:
        data = self._lookup(key)
        out[: len(data)] = data
        return len(data)

    def delete(self, key: bytes) -> int:
        return len(self._data.pop(self._known(key)))

    def resize(self, capacity_bytes: int) -> None:
        check_resize(self, capacity_bytes)
        self._capacity = capacity_bytes

    def _known(self, key: bytes) -> bytes:
        if key not in self._data:
            raise KeyNotFound(f"{key.hex()} is not in {self.name!r}")
        return key

    def _lookup(self, key: bytes) -> bytes:
        return self._data[self._known(key)]


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def data_of(i: int, size: int = 100) -> bytes:
    return bytes([i % 251]) * size


def over_failing(tmp_path: Path, dev: int = 300, **kw) -> tuple[TieredStore, FailingTier]:  # type: ignore[no-untyped-def]
    """[FailingTier "dev" (3 chunks), cpu (5 chunks), disk]: dev stands where a gpu tier does."""
    top = FailingTier(dev)
    tiers = [top, CpuTier(500), DiskTier(tmp_path / "disk", 10_000)]
    return TieredStore(tiers, eviction="lru", **kw), top


def test_a_tier_whose_put_fails_goes_offline_and_puts_land_below(tmp_path: Path) -> None:
    store, dev = over_failing(tmp_path)
    assert store.offline_tiers == {}
    assert store.put(key(1), data_of(1)) == "dev"
    assert store.put(key(2), data_of(2), tier="disk") == "disk"
    dev.failure = "CUDA error: an illegal memory access was encountered"
    assert store.put(key(3), data_of(3)) == "cpu"  # the failed put lands in the next tier down
    assert store.offline_tiers == {"dev": f"tier 'dev': {dev.failure}"}
    assert store.rerouted_puts == 1 and dev.put_calls == 2
    for i in range(4, 8):  # while offline, dev is not tried at all
        assert store.put(key(i), data_of(i)) == "cpu"
    assert store.put(key(8), data_of(8), tier="dev") == "cpu"  # asked for by name too
    assert dev.put_calls == 2 and store.rerouted_puts == 6
    # cpu (5 chunks) overflowed into disk by the usual demotions; nothing was lost
    assert store.stats.tiers["disk"].demotions == 1 and store.stats.drops == 0
    assert store.stats.tiers["cpu"].puts == 6 and store.stats.tiers["dev"].puts == 1
    for i in range(1, 9):
        assert store.get(key(i)) == data_of(i)
    assert store.entry(key(1)).tier == "dev"  # read where it is: dev only refuses new chunks
    assert len(store) == 8 and store.usage()["dev"]["chunks"] == 1


def test_an_offline_tier_is_not_emptied_to_make_room(tmp_path: Path) -> None:
    store, dev = over_failing(tmp_path)
    for i in range(3):
        assert store.put(key(i), data_of(i)) == "dev"  # dev is full
    dev.failure = "device lost"
    # the failing put made room first (one chunk demoted to cpu, kept), then failed
    assert store.put(key(3), data_of(3)) == "cpu"
    assert len(dev) == 2 and store.stats.tiers["cpu"].demotions == 1
    for i in range(4, 9):  # offline: checked before any eviction, so dev keeps the rest
        store.put(key(i), data_of(i))
    assert len(dev) == 2 and store.stats.tiers["dev"].evictions["capacity"] == 1
    assert store.stats.drops == 0
    for i in range(9):
        assert store.get(key(i)) == data_of(i)


def test_an_offline_tier_is_tried_again_after_the_retry_interval(tmp_path: Path) -> None:
    now = [1000.0]
    store, dev = over_failing(tmp_path, offline_retry_s=30.0, clock=lambda: now[0])
    dev.failure = "transient"
    assert store.put(key(1), data_of(1)) == "cpu" and "dev" in store.offline_tiers
    now[0] += 29.0
    assert store.put(key(2), data_of(2)) == "cpu" and dev.put_calls == 1
    now[0] += 1.0  # due: the next put tries dev again; it fails again, so another 30 s
    assert store.put(key(3), data_of(3)) == "cpu" and dev.put_calls == 2
    assert store.put(key(4), data_of(4)) == "cpu" and dev.put_calls == 2
    dev.failure = None
    now[0] += 30.0
    assert store.put(key(5), data_of(5)) == "dev"  # it recovered: back online
    assert store.offline_tiers == {} and store.put(key(6), data_of(6)) == "dev"
    assert store.rerouted_puts == 4
    for i in range(1, 7):
        assert store.get(key(i)) == data_of(i)


def test_retry_offline_makes_a_tier_with_no_write_test_due_at_once(tmp_path: Path) -> None:
    """``retry_offline`` (an operator's retry-tier): a tier that knows no test cheaper than a
    put is left for the next put, which tries it now instead of after the retry delay."""
    now = [1000.0]
    store, dev = over_failing(tmp_path, offline_retry_s=30.0, clock=lambda: now[0])
    assert store.retry_offline("dev") is None  # online: nothing to try
    dev.failure = "transient"
    assert store.put(key(1), data_of(1)) == "cpu" and dev.put_calls == 1
    dev.failure = None
    assert store.retry_offline("dev") == "tier 'dev': transient"  # still listed: no test
    assert store.put(key(2), data_of(2)) == "dev"  # tried at once, 0 s after the failure
    assert store.offline_tiers == {} and dev.put_calls == 2


def test_retry_offline_writes_to_an_offline_disk_tier(tmp_path: Path) -> None:
    """A disk tier taken offline by a failed put is written to at once (a page, fsynced,
    removed): back online when that works, still offline with the new reason when not."""
    disk = DiskTier(tmp_path / "disk", 100_000, fsync=False)
    store = TieredStore([CpuTier(300), disk], eviction="lru", offline_retry_s=3600.0)
    aside = tmp_path / "aside"
    (tmp_path / "disk").rename(aside)
    (tmp_path / "disk").write_bytes(b"not a directory")
    with pytest.raises(CapacityError):  # too large for cpu; the disk's write fails
        store.put(key(1), data_of(1, 500))
    assert "disk" in store.offline_tiers
    why = store.retry_offline("disk")
    assert why is not None and "cannot write in" in why and "Not a directory" in why
    assert store.offline_tiers["disk"] == why
    (tmp_path / "disk").unlink()
    aside.rename(tmp_path / "disk")
    assert store.retry_offline("disk") is None and store.offline_tiers == {}
    assert store.put(key(2), data_of(2, 500)) == "disk"  # the retry delay was an hour
    assert sorted(p.name for p in (tmp_path / "disk").iterdir() if p.is_file()) == [".lock"]


def test_moves_into_an_offline_tier_are_refused_and_demotions_into_one_drop(
    tmp_path: Path,
) -> None:
    store, dev = over_failing(tmp_path)
    dev.failure = "gone"
    assert store.put(key(1), data_of(1)) == "cpu"
    assert store.move([key(1)], "dev").failed == 1 and store.entry(key(1)).tier == "cpu"
    with pytest.raises(TierUnavailable, match="offline: tier 'dev': gone"):
        store.pin([key(1)], tier="dev")
    assert not store.entry(key(1)).pinned and dev.put_calls == 1
    assert store.prefetch([key(1)], "dev").failed == 1
    # an offline tier below: demotions into it fail (counted) and the victims are dropped
    low = FailingTier(1000, name="low")
    store2 = TieredStore([CpuTier(200), low], eviction="lru")
    low.failure = "gone"
    for i in range(4):
        assert store2.put(key(i), data_of(i)) == "cpu"
    assert store2.offline_tiers == {"low": "tier 'low': gone"}
    assert low.put_calls == 1  # the first demotion tried it; the next one did not
    assert store2.stats.demotion_failures == 2 and store2.stats.drops == 2
    assert [key(i) in store2 for i in range(4)] == [False, False, True, True]


def test_a_store_whose_only_tier_is_offline_refuses_puts_and_still_reads(tmp_path: Path) -> None:
    only = FailingTier(1000)
    store = TieredStore([only])
    store.put(key(1), data_of(1))
    only.failure = "device lost"
    with pytest.raises(TierUnavailable, match=r"all are offline \(dev: tier 'dev': device lost\)"):
        store.put(key(2), data_of(2))
    with pytest.raises(TierUnavailable):
        store.put(key(3), data_of(3))
    assert only.put_calls == 2 and len(store) == 1 and store.get(key(1)) == data_of(1)
    assert key(2) not in store and store.stats.tiers["dev"].puts == 1


def test_offline_retry_must_not_be_negative() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(InvalidArgument, match="offline_retry_s"):
            TieredStore([CpuTier(100)], offline_retry_s=bad)


# --- events -------------------------------------------------------------------------------------


def test_events_describe_stores_demotions_promotions_and_evictions(
    tmp_path: Path, ns: Namespace
) -> None:
    store = two_tier(tmp_path, cpu=100, eviction="lru")
    events: list[dict[str, object]] = []
    unsubscribe = store.subscribe(events.append)
    a, b = chain(ns, 1, seed=1)[0], chain(ns, 1, seed=2)[0]
    store.put(a, payload(a))
    store.put(b, payload(b))
    store.get(a)
    store.evict([b])
    unsubscribe()
    store.put(chain(ns, 1, seed=3)[0], payload(a))
    kinds = [(e["type"], e["key"]) for e in events]
    assert kinds == [
        ("store", a.hex()),
        ("demote", a.hex()),
        ("store", b.hex()),
        ("demote", b.hex()),
        ("promote", a.hex()),
        ("evict", b.hex()),
    ]


# --- hottest ------------------------------------------------------------------------------------


def test_hottest_orders_by_hits_then_recency_and_counts_nothing(ns: Namespace) -> None:
    store = TieredStore([CpuTier(10_000)])
    a, b, c, d = (chain(ns, 1, seed=i)[0] for i in range(4))
    for k in (a, b, c, d):
        store.put(k, payload(k))
    for k in (a, a, a, b, c):  # b and c tie on one hit; c was read last
        store.touch(k)
    before = store.stats.as_dict()
    touched = [store.entry(k).last_access_s for k in (a, b, c, d)]
    hot = store.hottest(10)
    assert [h.key for h in hot] == [a, c, b, d]
    assert [h.hit_count for h in hot] == [3, 1, 1, 0]
    assert [h.key for h in store.hottest(2)] == [a, c]
    assert store.hottest(0) == []
    assert store.stats.as_dict() == before
    assert [store.entry(k).last_access_s for k in (a, b, c, d)] == touched
    store.touch(b)  # now b leads c
    assert [h.key for h in store.hottest(3)] == [a, b, c]


def test_hottest_pinned_only(ns: Namespace) -> None:
    store = TieredStore([CpuTier(10_000)])
    a, b, c = (chain(ns, 1, seed=i)[0] for i in range(3))
    for k in (a, b, c):
        store.put(k, payload(k))
    store.touch(a)
    store.touch(b)
    store.pin([b, c])
    hot = store.hottest(10, pinned_only=True)
    assert [(h.key, h.pinned) for h in hot] == [(b, True), (c, True)]
    assert [h.key for h in store.hottest(1, pinned_only=True)] == [b]
    store.unpin([b, c])
    assert store.hottest(10, pinned_only=True) == []


def test_hottest_reports_the_cached_prefix_of_each_chunk(ns: Namespace) -> None:
    store = TieredStore([CpuTier(10_000)])
    root, mid, leaf = chain(ns, 3)
    store.put(root, payload(root), tokens=4, tenant="a")
    store.put(mid, payload(mid), tokens=5, tenant="a", parent=root)
    store.put(leaf, payload(leaf), tokens=6, tenant="a", parent=mid, priority=70)
    branch = chain(ns, 1, seed=9)[0]  # a second child of mid: the shared prefix walks once
    store.put(branch, payload(branch), tokens=7, parent=mid)
    for k in (leaf, leaf, leaf, branch, branch, mid):
        store.touch(k)
    hot = {h.key: h for h in store.hottest(10)}
    prefixes = {k: (h.prefix_chunks, h.prefix_tokens, h.prefix_complete) for k, h in hot.items()}
    assert prefixes == {
        leaf: (3, 15, True),
        branch: (3, 16, True),
        mid: (2, 9, True),
        root: (1, 4, True),
    }
    h = hot[leaf]
    assert (h.tier, h.size_bytes, h.tokens, h.tenant, h.priority, h.hit_count) == (
        "cpu",
        100,
        6,
        "a",
        70,
        3,
    )
    assert (h.pinned, h.isolated, h.last_access_s) == (
        False,
        False,
        store.entry(leaf).last_access_s,
    )
    assert h.as_dict()["key"] == leaf.hex()

    store.evict([root])  # the prefix is now only partly known
    hot = {h.key: h for h in store.hottest(10)}
    assert (hot[leaf].prefix_chunks, hot[leaf].prefix_tokens, hot[leaf].prefix_complete) == (
        2,
        11,
        False,
    )
    assert (hot[mid].prefix_chunks, hot[mid].prefix_complete) == (1, False)


def test_hottest_on_an_empty_store_and_bad_limit() -> None:
    store = TieredStore([CpuTier(10_000)])
    assert store.hottest(10) == []
    assert store.hottest(10, pinned_only=True) == []
    for bad in (-1, 1.5, True):
        with pytest.raises(InvalidArgument, match="limit"):
            store.hottest(bad)  # type: ignore[arg-type]


def test_hottest_prefix_walk_survives_cycles_and_stops_at_its_bound(
    ns: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = TieredStore([CpuTier(10_000)])
    a, b = (chain(ns, 1, seed=i)[0] for i in range(2))
    store.put(a, payload(a), tokens=4, parent=b)  # hand-made parents: a -> b -> a
    store.put(b, payload(b), tokens=4, parent=a)
    hot = {h.key: h for h in store.hottest(5)}  # returns at all: no endless walk
    assert set(hot) == {a, b}
    assert not any(h.prefix_complete for h in hot.values())
    # each chunk counted once at most: a cycle's answer is a partial prefix, never a loop's sum
    assert all(1 <= h.prefix_chunks <= 2 for h in (hot[a], hot[b]))

    monkeypatch.setattr("kvctl.store.store._MAX_PREFIX_WALK", 2)
    deep = TieredStore([CpuTier(10_000)])
    keys = chain(ns, 3, seed=5)
    put_chain(deep, keys, tokens=4)
    deep.touch(keys[2])
    top = deep.hottest(1)[0]
    assert (top.key, top.prefix_chunks, top.prefix_tokens, top.prefix_complete) == (
        keys[2],
        2,
        8,
        False,
    )


def test_a_chunk_named_as_its_own_parent_is_a_root(ns: Namespace) -> None:
    """A replay keyed by trace block ids can repeat an id; kept as its own child, its child
    count grew by one at every eviction and re-put (found in review)."""
    store = TieredStore([CpuTier(1000)], chunk_bytes=100)
    own = chain(ns, 1, seed=6)[0]
    for _ in range(3):
        assert store.put(own, payload(own), parent=own) == "cpu"
        e = store.entry(own)
        assert e.parent is None and e.children == 0
        store.evict([own])
    slot = store.reserve_put(own, 100, parent=own)  # the in-place put, too
    assert slot is not None
    slot.view[:] = payload(own)
    assert store.commit_put(slot) == "cpu"
    assert store.entry(own).parent is None and store.get(own) == payload(own)
