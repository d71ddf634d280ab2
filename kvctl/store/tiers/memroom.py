"""How much memory a shared arena may still commit on this host.

A memfd's pages are not refused with ENOMEM when RAM runs out: committing them
(``posix_fallocate`` or ``MADV_POPULATE_WRITE``) runs until the kernel's out-of-memory killer
picks a process, most likely the agent holding them. So a cpu tier asks before it commits:
the host's ``MemAvailable`` and, inside a memory cgroup (v2 or v1) with a limit, that limit less
what the group uses, each less a reserve for everything else the node runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

#: the most memory left for the rest of the node (engines, page cache, the agent itself)
RESERVE_CAP_BYTES = 1 << 30
#: the reserve's share of the memory a limit allows, where that is smaller than the cap
RESERVE_SHARE = 1 / 16

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True, slots=True)
class Room:
    """The memory an arena may commit now: ``bytes`` after the reserve, and where that
    figure comes from (for the error that refuses a larger one)."""

    bytes: int
    source: str


def reserve_bytes(total_bytes: int) -> int:
    """What is kept back from a pool of ``total_bytes``: 1/16 of it, at most 1 GiB."""
    return min(RESERVE_CAP_BYTES, int(total_bytes * RESERVE_SHARE))


def room(meminfo: Path | None = None, cgroup_root: Path | None = None) -> Room | None:
    """The tightest of the host's room and that of this process's cgroup and each group above
    it with a limit; None where none can be read (not Linux): nothing is refused then."""
    found: list[Room] = []
    host = _meminfo(meminfo or MEMINFO)
    if host is not None:
        available, total = host
        found.append(Room(available - reserve_bytes(total), "MemAvailable"))
    for limit, current, where in _cgroup_limits(cgroup_root or CGROUP_ROOT):
        found.append(Room(limit - current - reserve_bytes(limit), f"cgroup {where} memory.max"))
    return min(found, key=lambda r: r.bytes) if found else None


def _meminfo(path: Path) -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes."""
    fields: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemAvailable", "MemTotal"):
            with contextlib.suppress(ValueError, IndexError):
                fields[name] = int(rest.split()[0]) * 1024  # meminfo's "kB" are KiB
    if "MemAvailable" not in fields or "MemTotal" not in fields:
        return None
    return fields["MemAvailable"], fields["MemTotal"]


#: cgroup v1 writes "no limit" as a number near 2**63
_V1_UNLIMITED = 1 << 62


def _cgroup_limits(root: Path, self_cgroup: Path | None = None) -> list[tuple[int, int, str]]:
    """(limit, usage, the group's path) of this process's memory cgroup and each group above
    it that has a limit (a container's limit is often on a parent): cgroup v2's memory.max,
    else v1's memory.limit_in_bytes."""
    try:
        lines = (self_cgroup or SELF_CGROUP).read_text().splitlines()
    except OSError:
        return []
    groups = dict(ln.split(":", 2)[1:] for ln in lines if ln.count(":") >= 2)
    v1 = next((path for names, path in groups.items() if "memory" in names.split(",")), None)
    if v1 is not None:  # a hybrid host keeps memory on v1 even where it lists a v2 group
        return _limits(root / "memory", v1, "memory.limit_in_bytes", "memory.usage_in_bytes")
    if "" in groups:  # v2: "0::/path"
        return _limits(root, groups[""], "memory.max", "memory.current")
    return []


def _limits(base: Path, path: str, limit_file: str, usage_file: str) -> list[tuple[int, int, str]]:
    found = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        group = base.joinpath(*parts[:depth])
        try:
            limit_text = (group / limit_file).read_text().strip()
            usage = int((group / usage_file).read_text())
            if limit_text != "max" and int(limit_text) < _V1_UNLIMITED:
                found.append((int(limit_text), usage, "/" + "/".join(parts[:depth])))
        except (OSError, ValueError):  # a group this namespace does not show, or no limit file
            continue
    return found
