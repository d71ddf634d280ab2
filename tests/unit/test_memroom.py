"""The memory room a cpu tier checks before it commits an arena: a size the host or its cgroup
cannot hold is refused with CapacityError (409 on resize), never committed into an
out-of-memory kill."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.store.errors import CapacityError
from kvctl.store.tiers import memroom
from kvctl.store.tiers.cpu import CpuTier

MiB = 1 << 20
GiB = 1 << 30


def meminfo(tmp_path: Path, available: int, total: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(
        f"MemTotal:       {total // 1024} kB\nMemFree:        1 kB\n"
        f"MemAvailable:   {available // 1024} kB\n"
    )
    return path


def test_the_host_room_is_memavailable_less_a_reserve(tmp_path: Path) -> None:
    room = memroom.room(meminfo(tmp_path, 10 * GiB, 64 * GiB), tmp_path / "no-cgroups")
    assert room == memroom.Room(9 * GiB, "MemAvailable")  # the reserve's cap: 1 GiB
    small = memroom.room(meminfo(tmp_path, 512 * MiB, 1 * GiB), tmp_path / "no-cgroups")
    assert small is not None and small.bytes == 512 * MiB - 64 * MiB  # 1/16 of a small host


def test_nothing_readable_refuses_nothing(tmp_path: Path) -> None:
    assert memroom.room(tmp_path / "missing", tmp_path / "no-cgroups") is None
    (tmp_path / "garbled").write_text("MemTotal: lots\n")
    assert memroom.room(tmp_path / "garbled", tmp_path / "no-cgroups") is None


def _group(base: Path, path: str, files: dict[str, str]) -> None:
    group = base.joinpath(*[p for p in path.split("/") if p])
    group.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (group / name).write_text(text)


def test_a_cgroup_v2_limit_on_a_parent_is_the_tighter_room(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _group(root, "/pod/agent", {"memory.max": "max\n", "memory.current": "100\n"})
    _group(root, "/pod", {"memory.max": f"{4 * GiB}\n", "memory.current": f"{1 * GiB}\n"})
    own = tmp_path / "self-cgroup"
    own.write_text("0::/pod/agent\n")
    assert memroom._cgroup_limits(root, own) == [(4 * GiB, 1 * GiB, "/pod")]


def test_a_cgroup_v1_memory_limit_counts_and_its_unlimited_does_not(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    unlimited = str(9223372036854771712)
    _group(root / "memory", "/a/b", {"memory.limit_in_bytes": f"{2 * GiB}",
                                     "memory.usage_in_bytes": f"{GiB}"})  # fmt: skip
    _group(root / "memory", "/a", {"memory.limit_in_bytes": unlimited,
                                   "memory.usage_in_bytes": "0"})  # fmt: skip
    own = tmp_path / "self-cgroup"
    own.write_text("5:cpu,cpuacct:/a/b\n4:memory:/a/b\n0::/\n")  # a hybrid host
    assert memroom._cgroup_limits(root, own) == [(2 * GiB, GiB, "/a/b")]


@pytest.mark.parametrize("shared", [True, False])
def test_a_tier_past_the_room_is_refused_and_a_resize_keeps_its_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    tier = CpuTier(1 * MiB, shared=shared)
    try:
        # 100 MiB free of 1 GiB: 64 MiB of it is the reserve, 36 MiB may be committed
        monkeypatch.setattr(memroom, "MEMINFO", meminfo(tmp_path, 100 * MiB, 1 * GiB))
        monkeypatch.setattr(memroom, "CGROUP_ROOT", tmp_path / "no-cgroups")
        with pytest.raises(CapacityError, match=r"36 MiB can be committed \(MemAvailable"):
            tier.resize(64 * MiB)
        assert tier.capacity_bytes == 1 * MiB
        tier.resize(8 * MiB)  # within the room
        assert tier.capacity_bytes == 8 * MiB
        with pytest.raises(CapacityError, match="lower its size or free memory"):
            CpuTier(64 * MiB, shared=shared)
    finally:
        tier.close()
