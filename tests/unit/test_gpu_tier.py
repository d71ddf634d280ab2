"""The gpu tier (CUDA memory through torch), its settings and how the agent and the store treat
it. Tests of the tier itself need CUDA and skip without it; the rest run everywhere: why a GPU
is unavailable, settings validation, an agent runtime asked for a gpu tier it cannot have, and
leases of chunks that sit in a tier above the cpu tier."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import math
import os
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvctl.agent.runtime as runtime_module
import kvctl.store.tiers.cpu as cpu_module
from kvctl.agent.config import ConfigError, describe, load_settings
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.store.errors import (
    CapacityError,
    CorruptChunk,
    InvalidArgument,
    KeyNotFound,
    PayloadSizeError,
    TierUnavailable,
)
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.cpu import ArenaAllocator, CpuTier
from kvctl.store.tiers.disk import DiskTier
from kvctl.store.tiers.gpu import GpuTier, gpu_available, host_view, parse_device
from kvctl.store.tiers.hostreg import HostRegistry, buffer_address, register_host
from tests.unit.cuda_marks import CUDA, needs_cuda, needs_torch, torch, without_cuda
from tests.unit.hostreg_fakes import PAGE, FakeRegistrar, mapped, shared_maps

#: small staging slots, so chunks of a few KiB already cross the bus in several pieces
SLOT = 4096


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def expected_reason() -> str:
    """Why this machine has no gpu tier, found out independently of gpu_available."""
    if torch is None:
        return "torch is not installed"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return "is a build without CUDA"
    return "no CUDA device is visible"


# --- everywhere: availability, device names, settings -----------------------------------------


def test_gpu_available_says_why_not_here_or_names_the_device() -> None:
    ok, detail = gpu_available()
    assert ok is CUDA
    if CUDA:
        assert "(cuda:0)" in detail and "GiB" in detail
    else:
        assert expected_reason() in detail


def test_gpu_available_refuses_bad_devices_with_a_reason() -> None:
    ok, detail = gpu_available("gpu0")
    assert not ok and '"cuda:N"' in detail
    ok, detail = gpu_available("cuda:999")
    assert not ok
    assert ("out of range" in detail) if CUDA else (expected_reason() in detail)


@pytest.mark.parametrize(("text", "index"), [("cuda", 0), ("cuda:0", 0), (" cuda:3 ", 3)])
def test_parse_device(text: str, index: int) -> None:
    assert parse_device(text) == index


@pytest.mark.parametrize("text", ["", "gpu", "cuda:", "cuda:-1", "cuda:1:2", "cpu", "cuda:a"])
def test_parse_device_refuses(text: str) -> None:
    with pytest.raises(InvalidArgument, match='"cuda" or "cuda:N"'):
        parse_device(text)


@without_cuda
def test_a_gpu_tier_cannot_be_made_without_cuda() -> None:
    with pytest.raises(TierUnavailable, match=expected_reason()):
        GpuTier(1 << 20)


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("XDG_STATE_HOME", "/tmp/kvctl-test-state")  # short derived socket path
    return {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}


def test_gpu_settings_default_off_and_come_from_file_env_and_flags(
    tmp_path: Path, env: dict[str, str]
) -> None:
    s = load_settings(env=env).settings
    assert (s.gpu_capacity_bytes, s.gpu_device, s.gpu) == (0, "cuda:0", "h100")

    path = tmp_path / "agent.toml"
    path.write_text('[agent]\ngpu_capacity = "8GiB"\ngpu_device = "cuda:1"\ngpu = "a100"\n')
    loaded = load_settings(config_file=path, env=env)
    s = loaded.settings
    assert (s.gpu_capacity_bytes, s.gpu_device, s.gpu) == (8 << 30, "cuda:1", "a100")
    assert loaded.sources["gpu_capacity_bytes"] == f"file:{path}"

    loaded = load_settings(
        config_file=path,
        env={**env, "KVCTL_GPU_CAPACITY": "2GiB", "KVCTL_GPU_DEVICE": "CUDA"},
        flags={"gpu_capacity": "512MiB"},
    )
    s = loaded.settings
    assert (s.gpu_capacity_bytes, s.gpu_device) == (512 << 20, "cuda:0")  # one spelling
    assert loaded.sources["gpu_capacity_bytes"] == "flag:--gpu-capacity"
    assert loaded.sources["gpu_device"] == "env:KVCTL_GPU_DEVICE"
    rows = {r["setting"]: r["value"] for r in describe(loaded)}
    assert rows["gpu_capacity_bytes"] == "512MiB" and rows["gpu_device"] == "cuda:0"
    # the full field name is accepted as well, in files and flags
    flagged = load_settings(env=env, flags={"gpu_capacity_bytes": 4096}).settings
    assert flagged.gpu_capacity_bytes == 4096


@pytest.mark.parametrize(
    ("source", "value", "problem", "example"),
    [
        ("env", "8 gigs", "unknown size unit", "KVCTL_GPU_CAPACITY=8GiB"),
        ("env", "-1GiB", "not a size", "KVCTL_GPU_CAPACITY=8GiB"),
        ("flag", "lots", "not a size", "--gpu-capacity 8GiB"),
        ("file", True, "expected a size", 'gpu_capacity = "8GiB" in [agent]'),
    ],
)
def test_bad_gpu_capacity_is_refused_with_an_example(
    tmp_path: Path, env: dict[str, str], source: str, value: object, problem: str, example: str
) -> None:
    with pytest.raises(ConfigError) as err:
        if source == "env":
            load_settings(env={**env, "KVCTL_GPU_CAPACITY": str(value)})
        elif source == "flag":
            load_settings(env=env, flags={"gpu_capacity": value})
        else:
            path = tmp_path / "agent.toml"
            path.write_text(f"[agent]\ngpu_capacity = {str(value).lower()}\n")
            load_settings(config_file=path, env=env)
    assert err.value.setting == "gpu_capacity_bytes"
    assert problem in str(err.value) and example in str(err.value)


@pytest.mark.parametrize("value", ["gpu0", "cuda:", "cuda:x", "0", "h100"])
def test_bad_gpu_device_is_refused_with_an_example(env: dict[str, str], value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(env=env, flags={"gpu_device": value})
    message = str(err.value)
    assert err.value.setting == "gpu_device" and err.value.source == "flag:--gpu-device"
    assert '"cuda" or "cuda:N"' in message and "--gpu-device cuda:0" in message


# --- everywhere: the agent runtime asked for a gpu tier -----------------------------------------


def test_runtime_without_cuda_runs_on_cpu_and_says_why(tmp_path: Path) -> None:
    if CUDA:
        pytest.skip("this machine has CUDA: the gpu tier is built (see the CUDA tests)")
    settings = AgentSettings(
        name="g1", data_dir=str(tmp_path), cpu_bytes=1 << 20, disk_bytes=4 << 20,
        gpu_capacity_bytes=64 << 20, gpu_device="cuda:0", shm=False,
    )  # fmt: skip
    runtime = AgentRuntime.open(settings)
    try:
        assert runtime.store.tier_names == ["cpu", "disk"]
        info = runtime.info()
        assert [t["name"] for t in info["tiers"]] == ["cpu", "disk"]
        (gone,) = info["unavailable_tiers"]
        assert gone["name"] == "gpu" and gone["capacity_bytes"] == 64 << 20
        assert gone["device"] == "cuda:0" and expected_reason() in gone["reason"]
        # and it serves: a put lands in cpu, and leases work from there
        assert runtime.store.put(k(1), b"x" * 4096) == "cpu"
        lease = runtime.store.lease(k(1), 10.0)
        assert lease is not None and bytes(runtime.store.leased_view(lease)) == b"x" * 4096
        runtime.store.release([lease.lease_id])
    finally:
        runtime.close()


def test_runtime_without_a_gpu_setting_lists_nothing_unavailable(tmp_path: Path) -> None:
    settings = AgentSettings(name="g2", data_dir=str(tmp_path), cpu_bytes=1 << 20, disk_bytes=0)
    runtime = AgentRuntime.open(settings)
    try:
        assert runtime.store.tier_names == ["cpu"]
        assert runtime.info()["unavailable_tiers"] == []
    finally:
        runtime.close()


# --- everywhere: leases of chunks in a tier above the cpu tier ---------------------------------
# Leases hold bytes in place in the first cpu tier, which under a gpu tier is not the top one.
# A disk tier stands in above cpu here (a real tier of another kind, as gpu is); the CUDA tests
# below repeat the main case with a real GpuTier.


def two_kinds(tmp_path: Path, **kw: object) -> TieredStore:
    """[disk named "fast", cpu (300 bytes), disk]: a non-cpu tier above the cpu tier."""
    return TieredStore(
        [
            DiskTier(tmp_path / "upper", 10_000, name="fast"),
            CpuTier(300),
            DiskTier(tmp_path / "lower", 10_000),
        ],
        **kw,  # type: ignore[arg-type]
    )


def test_lease_tier_is_the_first_cpu_tier(tmp_path: Path) -> None:
    store = two_kinds(tmp_path)
    assert store.tier_names == ["fast", "cpu", "disk"]
    assert store.lease_tier is store.tier("cpu")
    first = CpuTier(100, name="cpu0")
    assert TieredStore([first, CpuTier(100)]).lease_tier is first
    assert TieredStore([DiskTier(tmp_path / "only", 1000)]).lease_tier is None


def test_lease_moves_a_chunk_down_from_a_tier_above_cpu(tmp_path: Path) -> None:
    store = two_kinds(tmp_path)
    events: list[dict[str, object]] = []
    store.subscribe(events.append)
    data = rand(100, 1)
    assert store.put(k(1), data) == "fast"  # puts land in the top tier
    lease = store.lease(k(1), 30.0)
    assert lease is not None
    assert store.entry(k(1)).tier == "cpu" and store.locate([k(1)]) == ["cpu"]
    assert bytes(store.leased_view(lease)) == data
    assert store.tier("fast").used_bytes == 0
    cpu = store.stats.tiers["cpu"]
    # moved for a read, not pushed out by pressure: a promotion into cpu, not a demotion
    assert (cpu.demotions, cpu.promotions) == (0, 1)
    assert store.stats.tiers["fast"].evictions.total() == 0
    assert events[-1]["type"] == "promote" and events[-1]["src"] == "fast"
    assert store.snapshot()["leases"] == 1
    assert store.release([lease.lease_id]) == 1 and store.snapshot()["leases"] == 0
    # an ordinary read leaves it in cpu, where reads are served from: no trip back up
    assert store.get(k(1)) == data and store.entry(k(1)).tier == "cpu"
    assert cpu.promotions == 1 and store.stats.tiers["fast"].promotions == 0


def test_lease_from_below_still_promotes_into_cpu_not_the_top(tmp_path: Path) -> None:
    store = two_kinds(tmp_path)
    data = rand(100, 2)
    assert store.put(k(2), data, tier="disk") == "disk"
    lease = store.lease(k(2), 30.0)
    assert lease is not None and store.entry(k(2)).tier == "cpu"
    assert store.stats.tiers["cpu"].promotions == 1
    assert bytes(store.leased_view(lease)) == data


def test_lease_of_a_chunk_pinned_above_cpu_is_none_and_it_stays(tmp_path: Path) -> None:
    store = two_kinds(tmp_path)
    data = rand(100, 3)
    store.put(k(3), data, pinned=True)
    assert store.lease(k(3), 30.0) is None
    assert store.entry(k(3)).tier == "fast" and store.get(k(3)) == data
    plain = two_kinds(tmp_path / "b", promote_on_hit=False)
    plain.put(k(4), data)
    assert plain.lease(k(4), 30.0) is None and plain.entry(k(4)).tier == "fast"


def test_lease_moving_down_makes_room_in_cpu_by_demoting(tmp_path: Path) -> None:
    store = two_kinds(tmp_path)
    for i in range(3):  # cpu (300 bytes) full
        store.put(k(10 + i), rand(100, 10 + i), tier="cpu")
    store.put(k(20), rand(100, 20))
    lease = store.lease(k(20), math.inf)
    assert lease is not None and store.entry(k(20)).tier == "cpu"
    assert [store.entry(k(10 + i)).tier for i in range(3)].count("disk") == 1
    for i in range(3):
        assert store.get(k(10 + i)) == rand(100, 10 + i)
    store.release([lease.lease_id])


def test_reads_never_promote_into_the_tier_above_cpu(tmp_path: Path) -> None:
    store = two_kinds(tmp_path)
    events: list[dict[str, object]] = []
    store.subscribe(events.append)
    top, low = rand(100, 30), rand(100, 31)
    assert store.put(k(30), top) == "fast"
    assert store.put(k(31), low, tier="disk") == "disk"
    for _ in range(3):  # a hit above cpu stays where it is, however often it is read
        assert store.get(k(30)) == top
        out = bytearray(100)
        assert store.read_into(k(30), out) == 100 and bytes(out) == top
        assert store.entry(k(30)).tier == "fast"
    assert store.get(k(31)) == low  # a disk hit goes to cpu, where reads are served from
    assert store.entry(k(31)).tier == "cpu"
    assert store.get(k(31)) == low and store.entry(k(31)).tier == "cpu"  # and no further
    assert [(e["type"], e["src"], e["tier"]) for e in events if e["type"] != "store"] == [
        ("promote", "disk", "cpu")
    ]
    st = store.stats.tiers
    assert (st["fast"].promotions, st["cpu"].promotions, st["cpu"].demotions) == (0, 1, 0)


def test_touch_and_default_prefetch_go_to_cpu_and_an_explicit_one_above(tmp_path: Path) -> None:
    store = two_kinds(tmp_path)
    for i in (40, 41, 42):
        store.put(k(i), rand(100, i), tier="disk")
    assert store.touch(k(40)) == "cpu"
    assert store.prefetch([k(41)]).done == 1 and store.entry(k(41)).tier == "cpu"
    assert store.prefetch([k(40), k(41)]).done == 0  # already where the default goes
    assert store.prefetch([k(42)], "fast").done == 1 and store.entry(k(42)).tier == "fast"
    assert store.get(k(42)) == rand(100, 42) and store.entry(k(42)).tier == "fast"


def test_leases_and_reads_do_not_ping_pong_a_chunk(tmp_path: Path) -> None:
    store = two_kinds(tmp_path)
    data = rand(100, 50)
    store.put(k(50), data)
    moves: list[dict[str, object]] = []
    store.subscribe(lambda e: moves.append(e) if e["type"] != "store" else None)
    for _ in range(5):  # shared-memory reads (leases) and socket reads, alternating
        lease = store.lease(k(50), 30.0)
        assert lease is not None and bytes(store.leased_view(lease)) == data
        store.release([lease.lease_id])
        assert store.get(k(50)) == data
    assert store.entry(k(50)).tier == "cpu"
    assert [(e["type"], e["src"]) for e in moves] == [("promote", "fast")]  # moved once
    st = store.stats.tiers
    assert sum(t.demotions for t in st.values()) == 0
    assert st["cpu"].promotions == 1 and st["cpu"].bytes_written == 100


def test_the_tier_above_cpu_holds_new_chunks_and_overflows_into_cpu(tmp_path: Path) -> None:
    store = TieredStore(
        [DiskTier(tmp_path / "upper", 300, name="fast"), CpuTier(1000)], eviction="lru"
    )
    for i in range(5):
        assert store.put(k(60 + i), rand(100, 60 + i)) == "fast"
    assert [store.entry(k(60 + i)).tier for i in range(5)] == ["cpu"] * 2 + ["fast"] * 3
    assert store.stats.tiers["cpu"].demotions == 2  # pushed out by pressure: demotions
    for i in range(5):  # reads move nothing back up
        assert store.get(k(60 + i)) == rand(100, 60 + i)
    assert [store.entry(k(60 + i)).tier for i in range(5)] == ["cpu"] * 2 + ["fast"] * 3
    assert store.stats.tiers["fast"].promotions == 0


def test_a_store_without_a_cpu_tier_has_no_leases(tmp_path: Path) -> None:
    store = TieredStore([DiskTier(tmp_path / "only", 1000)])
    store.put(k(1), b"z" * 10)
    with pytest.raises(TierUnavailable, match="supports leases"):
        store.lease(k(1), 1.0)
    assert store.release([1]) == 0 and store.expire_leases() == 0
    assert store.snapshot()["leases"] == 0


# --- with torch, CUDA or not: the tier's bookkeeping and copy code over host memory ------------
# The arena and staging slots are host tensors and the stream and events do nothing (host copies
# are synchronous), so put, read, delete and compaction run the tier's own code where there is no
# GPU: above all what a failed compaction leaves behind, which a real device cannot be made to do.


class _Synchronous:
    def synchronize(self) -> None:
        pass

    def record(self, stream: object = None) -> None:
        pass


def host_backed(capacity: int, slot: int = SLOT, registrar: FakeRegistrar | None = None) -> GpuTier:
    """A GpuTier built around host memory instead of through __init__ (which needs CUDA); its
    host regions are registered with ``registrar``, a stand-in for CUDA's books."""
    assert torch is not None
    t = GpuTier.__new__(GpuTier)
    t.name, t.device, t.device_description = "gpu", "cuda:0", "host memory stand-in"
    t._torch = SimpleNamespace(  # type: ignore[assignment]
        cuda=SimpleNamespace(stream=lambda _s: contextlib.nullcontext(), empty_cache=lambda: None)
    )
    t._dev = torch.device("cpu")
    t._capacity_bytes = capacity
    t._stream = _Synchronous()  # type: ignore[assignment]
    t._arena = torch.zeros(capacity, dtype=torch.uint8)
    t._slot_bytes = slot
    t._slots = [torch.zeros(slot, dtype=torch.uint8) for _ in range(2)]
    t._slot_views = [host_view(x) for x in t._slots]
    t._events = [_Synchronous(), _Synchronous()]  # type: ignore[list-item]
    t._alloc = ArenaAllocator(capacity)
    t._chunks, t._lost, t._used_bytes = {}, {}, 0
    t._host = HostRegistry(registrar=registrar or FakeRegistrar())
    t.copied_bytes = {"direct": 0, "staged": 0}
    t.compactions, t._closed = 0, False
    return t


SMALL, BIG = 100, 3 * SLOT + 11  # a big chunk slides down by less than its size: overlapping


def fragmented(t: GpuTier) -> dict[int, bytes]:
    """[k0 small | hole | k2 big | hole | k4 big]: 2 * SMALL free bytes, no hole that large."""
    sizes = [SMALL, SMALL, BIG, SMALL, BIG]
    for i, n in enumerate(sizes):
        t.put(ChunkMeta(k(i), n), rand(n, i))
    t.delete(k(1))
    t.delete(k(3))
    return {i: rand(n, i) for i, n in enumerate(sizes) if i not in (1, 3)}


def fail_on_move(t: GpuTier, monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    """The ``nth`` move of a compaction raises what torch raises for a CUDA error; the moves
    before it complete."""
    real, calls = t._move_down, [0]

    def move(dst: int, src: int, n: int) -> None:
        calls[0] += 1
        if calls[0] == nth:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        real(dst, src, n)

    monkeypatch.setattr(t, "_move_down", move)


@needs_torch
def test_host_backed_compaction_packs_chunks_and_keeps_their_bytes() -> None:
    t = host_backed(3 * SMALL + 2 * BIG)
    chunks = fragmented(t)
    whole = rand(2 * SMALL, 77)
    t.put(ChunkMeta(k(9), 2 * SMALL), whole)  # fits the free bytes, but no single hole
    assert t.compactions == 1 and t.free_bytes == 0 and t._alloc.free_bytes == 0
    assert t.get(k(9)) == whole
    for i, data in chunks.items():
        assert t.get(k(i)) == data
    offsets = sorted(t._chunks.values())
    assert offsets[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(offsets))


@needs_torch
@pytest.mark.parametrize("nth", [1, 2])
def test_a_failed_compaction_loses_only_the_moving_chunks_and_stays_consistent(
    monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    capacity = 3 * SMALL + 2 * BIG
    t = host_backed(capacity)
    chunks = fragmented(t)
    fail_on_move(t, monkeypatch, nth)
    with pytest.raises(TierUnavailable, match="illegal memory access"):
        t.put(ChunkMeta(k(9), 2 * SMALL), rand(2 * SMALL, 9))
    assert t.compactions == 0 and k(9) not in t
    # k0 never moved and is intact; k2 and k4 were moving: still listed, their bytes untrusted
    assert t.get(k(0)) == chunks[0]
    assert t.used_bytes == SMALL and len(t) == 3 and set(t.keys()) == {k(0), k(2), k(4)}
    assert t.size_of(k(2)) == BIG
    with pytest.raises(CorruptChunk, match="compaction failed"):
        t.get(k(2))
    assert k(2) not in t and len(t) == 2
    assert t.delete(k(4)) == BIG and k(4) not in t and len(t) == 1
    # the allocator matches the map: everything but k0 is one hole, handed out without overlap
    assert t._alloc.free_bytes == t.free_bytes == capacity - SMALL and t._alloc.holes == 1
    monkeypatch.undo()
    rest = {i: rand(SMALL, 100 + i) for i in range(10, 10 + (capacity - SMALL) // SMALL)}
    for i, data in rest.items():
        t.put(ChunkMeta(k(i), SMALL), data)
    assert t.get(k(0)) == chunks[0]
    for i, data in rest.items():
        assert t.get(k(i)) == data


@needs_torch
def test_a_store_over_a_failing_gpu_tier_puts_into_cpu_and_forgets_lost_chunks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = host_backed(3 * SMALL + 2 * BIG)
    store = TieredStore([gpu, CpuTier(1 << 20)])
    chunks = {}
    for i, n in enumerate([SMALL, SMALL, BIG, SMALL, BIG]):
        chunks[i] = rand(n, i)
        assert store.put(k(i), chunks[i]) == "gpu"
    store.evict([k(1), k(3)])
    fail_on_move(gpu, monkeypatch, 2)
    assert store.put(k(9), rand(2 * SMALL, 9)) == "cpu"  # the compaction failed: one tier down
    assert "illegal memory access" in store.offline_tiers["gpu"] and store.rerouted_puts == 1
    assert store.put(k(10), rand(SMALL, 10)) == "cpu"
    assert store.get(k(0)) == chunks[0] and store.get(k(9)) == rand(2 * SMALL, 9)
    for i in (2, 4):  # torn by the failed compaction: a miss, and forgotten
        with pytest.raises(CorruptChunk):
            store.get(k(i))
        assert k(i) not in store
    assert store.stats.corrupt_dropped == 2
    assert store.usage()["gpu"] == {
        "capacity_bytes": gpu.capacity_bytes, "used_bytes": SMALL, "pinned_bytes": 0, "chunks": 1
    }  # fmt: skip


# --- with torch, CUDA or not: copies through registered host regions ---------------------------
# The registry's CUDA calls go to a stand-in that keeps CUDA's books; the copies are real (host
# tensors here), so which path a copy takes, and that both paths keep the bytes, is tested here.


class Owner:
    """A connection stand-in: an owner object the registry must not keep alive."""


@needs_torch
@pytest.mark.parametrize("size", [1, SLOT - 1, SLOT + 1, 5 * SLOT + 3])
def test_host_backed_registered_regions_are_copied_directly_and_the_rest_staged(
    size: int,
) -> None:
    fake = FakeRegistrar()
    t = host_backed(1 << 20, registrar=fake)
    data, other = rand(size, size), rand(size, size + 1)
    with shared_maps(16 * SLOT) as (arena, _), shared_maps(16 * SLOT) as (client_rw, staging):
        assert t.register_host_region("arena", arena, read_only=False)
        assert t.register_host_region("staging", staging, read_only=True)
        client_rw[100 : 100 + size] = data  # the client fills its segment; the agent reads it
        t.put(ChunkMeta(k(1), size), memoryview(staging)[100 : 100 + size])
        assert t.copied_bytes == {"direct": size, "staged": 0}
        out = memoryview(arena)[PAGE : PAGE + size + 50]  # larger than the chunk
        assert t.read_into(k(1), out) == size
        assert arena[PAGE : PAGE + size] == data and arena[PAGE + size : PAGE + size + 50] == bytes(
            50
        )
        assert t.copied_bytes == {"direct": 2 * size, "staged": 0}
        # a socket's receive buffer and a fresh bytearray are not registered: staged
        t.put(ChunkMeta(k(2), size), bytearray(other))
        assert t.get(k(2)) == other and t.get(k(1)) == data
        assert t.copied_bytes == {"direct": 2 * size, "staged": 3 * size}
        # a registered region that is only read-only is never a copy target
        before = dict(t.copied_bytes)
        assert t.read_into(k(2), memoryview(arena)[:size]) == size and arena[:size] == other
        assert t.copied_bytes["direct"] == before["direct"] + size
        del out
        t.close()
        assert fake.live == {}  # closing the tier unregistered both


@needs_torch
def test_host_backed_a_refused_registration_is_false_and_copies_are_staged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeRegistrar()
    fake.refuse = "cudaHostRegister failed: operation not supported (cudaError 801)"
    t = host_backed(1 << 20, registrar=fake)
    with shared_maps(4 * SLOT) as (rw, ro):
        assert t.register_host_region("staging", ro, read_only=True) is False
        assert "operation not supported" in caplog.text and t.host_regions() == []
        rw[:SLOT] = rand(SLOT, 7)
        t.put(ChunkMeta(k(1), SLOT), memoryview(ro)[:SLOT])
        assert t.copied_bytes == {"direct": 0, "staged": SLOT}
        assert t.get(k(1)) == rand(SLOT, 7)
        # a read-only buffer is never registered for writing
        assert t.register_host_region("bad", ro, read_only=False) is False
        t.close()


@needs_torch
def test_host_backed_a_collected_owner_takes_its_region_with_it() -> None:
    fake = FakeRegistrar()
    t = host_backed(1 << 20, registrar=fake)
    with shared_maps(4 * SLOT) as (rw, ro):
        conn = Owner()
        assert t.register_host_region(conn, ro, read_only=True)
        rw[:100] = rand(100, 1)
        t.put(ChunkMeta(k(1), 100), memoryview(ro)[:100])
        assert t.copied_bytes["direct"] == 100
        del conn
        gc.collect()
        t.put(ChunkMeta(k(2), 100), memoryview(ro)[:100])
        assert t.copied_bytes == {"direct": 100, "staged": 100} and fake.live == {}
        assert t.unregister_host_region("nobody") is False
        t.close()


@needs_torch
def test_host_backed_the_cpu_arena_is_followed_across_resizes() -> None:
    fake = FakeRegistrar()
    gpu = host_backed(1 << 20, registrar=fake)
    cpu = CpuTier(4 * PAGE, shared=True)
    store = TieredStore([gpu, cpu])
    try:
        assert gpu.follow_host_region("cpu-arena", cpu.arena_mapping, read_only=False)
        data = rand(3 * SLOT, 1)
        assert store.put(k(1), data) == "gpu"  # from a bytes object: staged
        arena, _ = cpu.arena_mapping()
        assert gpu.read_into(k(1), memoryview(arena)[: 3 * SLOT]) == 3 * SLOT  # into the arena
        assert arena[: 3 * SLOT] == data and gpu.copied_bytes["direct"] == 3 * SLOT
        del arena
        store.resize("cpu", 8 * PAGE)  # a new arena (generation 1)
        arena, generation = cpu.arena_mapping()
        assert generation == 1
        assert gpu.read_into(k(1), memoryview(arena)[PAGE : PAGE + 3 * SLOT]) == 3 * SLOT
        assert arena[PAGE : PAGE + 3 * SLOT] == data
        assert gpu.copied_bytes["direct"] == 6 * SLOT  # the new arena was registered first
        (region,) = gpu.host_regions()
        assert (region["owner"], region["generation"], region["size_bytes"]) == (
            "cpu-arena", 1, 8 * PAGE
        )  # fmt: skip
        assert list(fake.live) == [gpu._host.find(arena)[0].address]  # type: ignore[index]
        del arena
    finally:
        store.close()
    assert fake.live == {}


def host_backed_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake: FakeRegistrar, cpu_bytes: int
) -> tuple[AgentRuntime, GpuTier, CpuTier]:
    """An agent runtime whose gpu tier is ``host_backed`` (its registrations go to ``fake``)."""
    gpu = host_backed(1 << 20, registrar=fake)
    monkeypatch.setattr(runtime_module, "_open_gpu_tier", lambda _settings: gpu)
    settings = dataclasses.replace(
        AgentSettings(name="g6", data_dir=str(tmp_path), shm=True),
        cpu_bytes=cpu_bytes,
        disk_bytes=0,
        gpu_capacity_bytes=1 << 20,
    )
    runtime = AgentRuntime.open(settings)
    cpu = runtime.store.lease_tier
    assert runtime.gpu_tier is gpu and isinstance(cpu, CpuTier)
    return runtime, gpu, cpu


@needs_torch
def test_runtime_registers_a_resized_cpu_arena_at_once_and_frees_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An idle gpu tier (no put or get after the resize) must not keep the old arena pinned and
    mapped beside the new one."""
    fake = FakeRegistrar()
    runtime, gpu, cpu = host_backed_runtime(tmp_path, monkeypatch, fake, 4 * PAGE)
    try:
        data = rand(3 * SLOT, 1)
        assert runtime.store.put(k(1), data) == "gpu"
        old, _ = cpu.arena_mapping()
        old_address = buffer_address(old)
        assert list(fake.live) == [old_address]
        runtime.store.resize("cpu", 8 * PAGE)
        new, generation = cpu.arena_mapping()
        assert generation == 1 and list(fake.live) == [buffer_address(new)]
        assert fake.count("register") == 2 and fake.count("unregister") == 1
        assert fake.unmapped_at_unregister == []  # unregistered while still mapped
        assert old.closed  # then unmapped: nothing holds it any more
        (region,) = gpu.host_regions()
        assert (region["owner"], region["generation"], region["size_bytes"]) == (
            "cpu-arena", 1, 8 * PAGE
        )  # fmt: skip
        # the same size again compacts in place: the arena and its registration stay
        runtime.store.resize("cpu", 8 * PAGE)
        assert cpu.arena_mapping()[1] == 1 and fake.count("register") == 2 and not new.closed
        # a sender still holding a slice of the arena: unregistered all the same, and the
        # mapping goes when the slice does
        held = memoryview(new)[:10]
        runtime.store.resize("cpu", 6 * PAGE)
        newer, generation = cpu.arena_mapping()
        assert generation == 2 and list(fake.live) == [buffer_address(newer)]
        assert not new.closed and fake.unmapped_at_unregister == []
        held.release()
        new.close()
        assert runtime.store.get(k(1)) == data
        del old, new, newer
    finally:
        runtime.close()
    assert fake.live == {} and fake.unmapped_at_unregister == []
    assert "resize" not in vars(cpu) and cpu._arena.closed  # the cpu tier could close its arena


@needs_torch
def test_runtime_a_failed_cpu_resize_keeps_the_arena_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeRegistrar()
    runtime, gpu, cpu = host_backed_runtime(tmp_path, monkeypatch, fake, 4 * PAGE)
    try:
        arena, _ = cpu.arena_mapping()

        def no_memory(*_args: object, **_kw: object) -> None:
            raise CapacityError("not enough shared memory for the cpu arena")

        monkeypatch.setattr(cpu_module, "_new_arena", no_memory)
        with pytest.raises(CapacityError, match="shared memory"):
            runtime.store.resize("cpu", 8 * PAGE)
        assert cpu.arena_mapping() == (arena, 0) and not arena.closed
        assert list(fake.live) == [buffer_address(arena)] and fake.count("register") == 1
        assert mapped(buffer_address(arena), 4 * PAGE)
        assert [r["generation"] for r in gpu.host_regions()] == [0]
        del arena
    finally:
        runtime.close()
    assert fake.live == {}


def test_runtime_without_a_gpu_tier_registers_no_host_regions(tmp_path: Path) -> None:
    settings = AgentSettings(name="g4", data_dir=str(tmp_path), cpu_bytes=1 << 20, disk_bytes=0)
    runtime = AgentRuntime.open(settings)
    try:
        assert runtime.gpu_tier is None
        assert runtime.register_host_region(Owner(), bytearray(PAGE), read_only=True) is False
        assert runtime.unregister_host_region("anyone") is False
    finally:
        runtime.close()


# --- CUDA only: the tier ---------------------------------------------------------------------


@pytest.fixture
def gpu() -> Iterator[GpuTier]:
    t = GpuTier(1 << 20, staging_slot_bytes=SLOT)
    yield t
    t.close()


@needs_cuda
@pytest.mark.parametrize(
    "size", [1, 7, SLOT - 1, SLOT, SLOT + 1, 2 * SLOT, 3 * SLOT + 5, 64 * SLOT + 17]
)
def test_round_trip_of_random_payloads(gpu: GpuTier, size: int) -> None:
    data = rand(size, size)
    gpu.put(ChunkMeta(k(1), size), data)
    assert gpu.size_of(k(1)) == size and k(1) in gpu and len(gpu) == 1
    assert gpu.used_bytes == size
    assert gpu.get(k(1)) == data
    out = bytearray(size + 10)
    assert gpu.read_into(k(1), memoryview(out)) == size
    assert bytes(out[:size]) == data and bytes(out[size:]) == bytes(10)


@needs_cuda
def test_many_chunks_and_sources_of_every_buffer_kind(gpu: GpuTier) -> None:
    import numpy as np

    chunks = {i: rand(1000 + 997 * i, i) for i in range(40)}
    for i, data in chunks.items():
        src: object = data if i % 3 == 0 else bytearray(data) if i % 3 == 1 else memoryview(data)
        gpu.put(ChunkMeta(k(i), len(data)), src)  # type: ignore[arg-type]
    arr = np.frombuffer(rand(4096, 99), dtype=np.float32)  # a non-byte format
    gpu.put(ChunkMeta(k(99), 4096), memoryview(arr))
    for i, data in chunks.items():
        assert gpu.get(k(i)) == data
    assert gpu.get(k(99)) == arr.tobytes()
    assert gpu.used_bytes == sum(map(len, chunks.values())) + 4096


@needs_cuda
def test_capacity_to_the_byte_and_refused_puts_change_nothing() -> None:
    t = GpuTier(1000, staging_slot_bytes=SLOT)
    try:
        a, b = rand(600, 1), rand(400, 2)
        t.put(ChunkMeta(k(1), 600), a)
        t.put(ChunkMeta(k(2), 400), b)  # exactly full
        assert t.free_bytes == 0
        with pytest.raises(CapacityError):
            t.put(ChunkMeta(k(3), 1), b"x")
        with pytest.raises(InvalidArgument, match="already"):
            t.put(ChunkMeta(k(1), 600), a)
        t.delete(k(2))
        with pytest.raises(PayloadSizeError):
            t.put(ChunkMeta(k(4), 10), b"x" * 9)
        with pytest.raises(InvalidArgument, match="positive"):
            t.put(ChunkMeta(k(5), 0), b"")
        assert t.used_bytes == 600 and len(t) == 1 and t.get(k(1)) == a
    finally:
        t.close()


@needs_cuda
def test_delete_and_reads_of_missing_keys(gpu: GpuTier) -> None:
    gpu.put(ChunkMeta(k(1), 100), rand(100, 1))
    assert gpu.delete(k(1)) == 100 and gpu.used_bytes == 0 and k(1) not in gpu
    for call in (lambda: gpu.delete(k(1)), lambda: gpu.get(k(1)), lambda: gpu.size_of(k(1))):
        with pytest.raises(KeyNotFound):
            call()
    gpu.put(ChunkMeta(k(2), 100), rand(100, 2))
    with pytest.raises(InvalidArgument, match="smaller"):
        gpu.read_into(k(2), memoryview(bytearray(99)))


@needs_cuda
def test_fragmentation_is_compacted_including_overlapping_moves() -> None:
    # small and big chunks alternate; with the small ones gone, each big one slides down by less
    # than its own size (an overlapping move, made through a staging slot)
    small, big = SLOT // 2 + 3, 3 * SLOT + 11
    t = GpuTier(5 * (small + big), staging_slot_bytes=SLOT)
    try:
        bigs = {}
        for i in range(5):
            t.put(ChunkMeta(k(2 * i), small), rand(small, 2 * i))
            bigs[2 * i + 1] = rand(big, 2 * i + 1)
            t.put(ChunkMeta(k(2 * i + 1), big), bigs[2 * i + 1])
        for i in range(5):
            t.delete(k(2 * i))
        whole = rand(5 * small, 77)
        t.put(ChunkMeta(k(50), 5 * small), whole)  # fits the free bytes, but no single hole
        assert t.compactions == 1 and t.free_bytes == 0
        assert t.get(k(50)) == whole
        for i, data in bigs.items():
            assert t.get(k(i)) == data
    finally:
        t.close()


@needs_cuda
def test_resize_grows_and_shrinks_keeping_bytes(gpu: GpuTier) -> None:
    data = {i: rand(10_000 + i, i) for i in range(5)}
    for i, d in data.items():
        gpu.put(ChunkMeta(k(i), len(d)), d)
    gpu.delete(k(1))
    used = gpu.used_bytes
    gpu.resize(4 << 20)
    assert gpu.capacity_bytes == 4 << 20 and gpu.used_bytes == used
    gpu.resize(used)  # exactly what it holds
    assert gpu.free_bytes == 0
    with pytest.raises(CapacityError):
        gpu.resize(used - 1)
    assert gpu.capacity_bytes == used
    for i in (0, 2, 3, 4):
        assert gpu.get(k(i)) == data[i]
    with pytest.raises(CapacityError):
        gpu.put(ChunkMeta(k(9), 1), b"x")


@needs_cuda
def test_a_capacity_larger_than_the_device_is_a_capacity_error() -> None:
    assert torch is not None
    _free, total = torch.cuda.mem_get_info(0)
    with pytest.raises(CapacityError, match="GPU memory"):
        GpuTier(2 * total)


@needs_cuda
def test_closed_tier_refuses_use() -> None:
    t = GpuTier(4096)
    t.put(ChunkMeta(k(1), 10), b"0123456789")
    t.close()
    t.close()  # twice is fine
    with pytest.raises(TierUnavailable):
        t.get(k(1))
    with pytest.raises(TierUnavailable):
        t.put(ChunkMeta(k(2), 1), b"x")


@needs_cuda
def test_random_operations_match_a_model() -> None:
    rng = random.Random(5)
    t = GpuTier(64 * SLOT, staging_slot_bytes=SLOT)
    model: dict[bytes, bytes] = {}
    try:
        for step in range(400):
            op = rng.random()
            if op < 0.55:
                key, size = k(rng.randrange(60)), rng.randrange(1, 6 * SLOT)
                data = rng.randbytes(size)
                if key in model:
                    with pytest.raises(InvalidArgument):
                        t.put(ChunkMeta(key, size), data)
                elif size > t.free_bytes:
                    with pytest.raises(CapacityError):
                        t.put(ChunkMeta(key, size), data)
                else:
                    t.put(ChunkMeta(key, size), data)
                    model[key] = data
            elif op < 0.85 and model:
                key = rng.choice(list(model))
                assert t.delete(key) == len(model.pop(key))
            elif model:
                key = rng.choice(list(model))
                assert t.get(key) == model[key], step
            assert t.used_bytes == sum(map(len, model.values()))
            assert set(t.keys()) == set(model)
    finally:
        t.close()


# --- CUDA only: a store over [gpu, cpu] ------------------------------------------------------


@needs_cuda
def test_store_over_gpu_and_cpu_demotes_promotes_and_leases(tmp_path: Path) -> None:
    store = TieredStore([GpuTier(300, staging_slot_bytes=SLOT), CpuTier(1000)])
    try:
        assert store.lease_tier is store.tier("cpu")
        data = {i: rand(100, i) for i in range(5)}
        for i in range(3):
            assert store.put(k(i), data[i]) == "gpu"
        store.put(k(3), data[3])  # gpu full: the LRU chunk is demoted to cpu
        assert store.entry(k(0)).tier == "cpu" and store.stats.tiers["cpu"].demotions == 1
        assert store.get(k(0)) == data[0]  # a cpu hit stays in cpu: reads never go up to gpu
        assert store.entry(k(0)).tier == "cpu" and store.stats.tiers["gpu"].promotions == 0
        assert store.get(k(1)) == data[1] and store.entry(k(1)).tier == "gpu"  # a gpu hit stays
        lease = store.lease(k(3), 30.0)  # a gpu chunk is moved into cpu to be leased
        assert lease is not None and store.entry(k(3)).tier == "cpu"
        assert store.stats.tiers["cpu"].promotions == 1  # counted as a promotion into cpu
        assert store.stats.tiers["cpu"].demotions == 1  # still only the one pushed out
        assert bytes(store.leased_view(lease)) == data[3]
        store.release([lease.lease_id])
        for i in range(4):
            assert store.get(k(i)) == data[i]
        usage = store.usage()
        assert usage["gpu"]["used_bytes"] + usage["cpu"]["used_bytes"] == 400
        store.move([k(1)], "cpu")
        assert store.entry(k(1)).tier == "cpu"
        store.resize("gpu", 100)  # the rest is demoted to cpu
        assert store.tier("gpu").capacity_bytes == 100 and store.usage()["gpu"]["chunks"] <= 1
        for i in range(4):
            assert store.get(k(i)) == data[i]
    finally:
        store.close()


@needs_cuda
def test_store_over_gpu_cpu_and_disk_moves_gpu_chunks_to_disk_intact(tmp_path: Path) -> None:
    """A move across two tiers: the gpu chunk is copied to host memory under the store's lock,
    its file written without it (tests/unit/test_store_moves_off_lock.py holds that write)."""
    store = TieredStore(
        [GpuTier(300, staging_slot_bytes=SLOT), CpuTier(1000), DiskTier(tmp_path / "d", 1000)]
    )
    try:
        data = {i: rand(100, i) for i in range(3)}
        for i in range(3):
            assert store.put(k(i), data[i]) == "gpu"
        result = store.move([k(0), k(1)], "disk")
        assert (result.done, result.failed) == (2, 0)
        assert store.locate([k(i) for i in range(3)]) == ["disk", "disk", "gpu"]
        assert store.usage()["gpu"]["used_bytes"] == 100
        for i in range(3):
            assert store.get(k(i)) == data[i]
    finally:
        store.close()


@needs_cuda
def test_runtime_with_cuda_puts_the_gpu_tier_on_top(tmp_path: Path) -> None:
    settings = dataclasses.replace(
        AgentSettings(name="g3", data_dir=str(tmp_path), shm=False),
        cpu_bytes=1 << 20,
        disk_bytes=0,
        gpu_capacity_bytes=1 << 20,
    )
    runtime = AgentRuntime.open(settings)
    try:
        assert runtime.store.tier_names == ["gpu", "cpu"]
        assert runtime.info()["unavailable_tiers"] == []
        payload = os.urandom(4096)
        assert runtime.store.put(k(1), payload) == "gpu"
        assert runtime.store.get(k(1)) == payload
    finally:
        runtime.close()


# --- CUDA only: copies through registered host regions -------------------------------------------


@needs_cuda
@pytest.mark.parametrize("size", [1, SLOT + 1, 64 * SLOT + 17, (3 << 20) + 5])
def test_registered_and_staged_copies_both_round_trip(size: int) -> None:
    t = GpuTier(8 << 20, staging_slot_bytes=SLOT)
    data, other = rand(size, size), rand(size, size + 1)
    try:
        with shared_maps(4 << 20) as (arena, _), shared_maps(4 << 20) as (client, staging):
            assert t.register_host_region("arena", arena, read_only=False)
            assert t.register_host_region("staging", staging, read_only=True)
            client[7 : 7 + size] = data
            t.put(ChunkMeta(k(1), size), memoryview(staging)[7 : 7 + size])  # one copy
            assert t.copied_bytes == {"direct": size, "staged": 0}
            assert t.read_into(k(1), memoryview(arena)[PAGE : PAGE + size]) == size
            assert arena[PAGE : PAGE + size] == data
            assert t.copied_bytes == {"direct": 2 * size, "staged": 0}
            t.put(ChunkMeta(k(2), size), other)  # not registered: through the slots
            assert t.get(k(2)) == other and t.get(k(1)) == data
            assert t.copied_bytes == {"direct": 2 * size, "staged": 3 * size}
            assert t.read_into(k(2), memoryview(arena)[:size]) == size and arena[:size] == other
            t.close()  # unregisters, so the maps can close
    finally:
        t.close()


@needs_cuda
def test_closing_the_tier_unregisters_its_host_regions() -> None:
    t = GpuTier(1 << 20)
    with shared_maps(4 * PAGE) as (rw, _ro):
        assert t.register_host_region("arena", rw, read_only=False)
        with pytest.raises(BufferError):  # registered: the mapping stays in place
            rw.close()
        t.close()
        # CUDA refuses a range registered twice: this works only because close unregistered it
        register_host(rw, read_only=False).close()
        rw.close()  # and nothing holds the mapping any more


@needs_cuda
def test_runtime_with_cuda_registers_the_cpu_arena_and_staging_regions(tmp_path: Path) -> None:
    settings = dataclasses.replace(
        AgentSettings(name="g5", data_dir=str(tmp_path), shm=True),
        cpu_bytes=1 << 20,
        disk_bytes=0,
        gpu_capacity_bytes=1 << 20,
    )
    runtime = AgentRuntime.open(settings)
    try:
        gpu = runtime.gpu_tier
        assert gpu is not None and gpu is runtime.store.tier("gpu")
        (region,) = gpu.host_regions()
        assert region["owner"] == "cpu-arena" and region["size_bytes"] == 1 << 20
        assert region["followed"] and not region["read_only"] and region["generation"] == 0
        with shared_maps(1 << 20) as (client, staging):
            conn = Owner()
            assert runtime.register_host_region(conn, staging, read_only=True)
            payload = rand(64 << 10, 3)
            client[: 64 << 10] = payload
            assert runtime.store.put(k(1), memoryview(staging)[: 64 << 10]) == "gpu"
            assert gpu.copied_bytes["direct"] == 64 << 10
            assert runtime.unregister_host_region(conn) is True
        assert runtime.store.get(k(1)) == payload
        runtime.store.resize("cpu", 2 << 20)  # a new arena: registered again before the next copy
        assert runtime.store.get(k(1)) == payload
        (region,) = gpu.host_regions()
        assert region["generation"] == 1 and region["size_bytes"] == 2 << 20
    finally:
        runtime.close()
