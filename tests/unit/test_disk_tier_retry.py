"""A disk tier whose directory cannot be used at start comes online by itself once the operator
fixes it (no restart): the agent tries it again with backoff, scans it off the store's lock,
and its chunks join the store. Before, it stayed out until the agent was restarted.

The directory is made unusable for real: a regular file where it should be (tests run as root,
so chmod would not bite)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.agent.tier_retry import TierRetry
from kvctl.store.errors import CapacityError, InvalidArgument, TierUnavailable
from kvctl.store.store import TieredStore
from kvctl.store.tiers.absent import AbsentTier
from kvctl.store.tiers.base import ChunkMeta, Tier
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from tests.unit.test_disk_tier import key, payload, put

KIB = 1024
#: how long a test waits for what must happen (never a timing assertion: a hang guard)
HANG_GUARD_S = 60.0


def _settings(tmp_path: Path, cpu_bytes: int = 1 << 20) -> AgentSettings:
    return AgentSettings(
        name="d1", data_dir=str(tmp_path), cpu_bytes=cpu_bytes, disk_bytes=4 << 20, shm=False
    )


def _break(disk: Path) -> Path:
    """Move ``disk`` (with its chunk files) aside and put a regular file in its place."""
    aside = disk.with_name("disk.aside")
    disk.rename(aside)
    disk.write_bytes(b"not a directory")
    return aside


def _fix(disk: Path, aside: Path) -> None:
    disk.unlink()
    aside.rename(disk)


def _wait_for(what: str, done: Callable[[], bool]) -> None:
    end = time.monotonic() + HANG_GUARD_S
    while not done():
        assert time.monotonic() < end, f"still waiting for {what} after {HANG_GUARD_S} s"
        time.sleep(0.01)


def test_a_disk_tier_unusable_at_start_comes_online_once_fixed_without_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "disk"
    with DiskTier(disk, 4 << 20) as tier:
        kept = [put(tier, i, 64 * KIB) for i in range(3)]
    aside = _break(disk)
    caplog.set_level(logging.WARNING, logger="kvctl")
    runtime = AgentRuntime.open(_settings(tmp_path), disk_retry_first_s=0.01, disk_retry_max_s=0.05)
    try:
        store = runtime.store
        # unavailable, tried again, its place kept; cpu serves as before
        assert store.tier_names == ["cpu", "disk"]
        [gone] = runtime.info()["unavailable_tiers"]
        assert gone["name"] == "disk" and "cannot use directory" in gone["reason"]
        assert gone.get("device") == str(disk) and gone.get("capacity_bytes") == 4 << 20
        assert "disk" not in runtime.usage()
        _wait_for(
            "a retry", lambda: runtime.disk_retry is not None and runtime.disk_retry.tries > 0
        )
        assert store.put(key(10), payload(10, 64 * KIB)) == "cpu"

        _fix(disk, aside)
        _wait_for("the disk tier online", lambda: "disk" not in store.absent_tiers)

        assert runtime.info()["unavailable_tiers"] == []
        usage = runtime.usage()["disk"]
        assert usage["chunks"] == 3 and usage["used_bytes"] == 3 * 64 * KIB
        assert runtime.stats()["usage"]["disk"] == usage  # /v1/stats too
        assert store.locate([key(i) for i in range(3)]) == ["disk"] * 3
        assert [bytes(store.get(key(i))) for i in range(3)] == kept
        # it takes chunks: the cpu tier's victims are demoted into it, not dropped
        for i in range(20, 40):
            store.put(key(i), payload(i, 64 * KIB))
        assert store.stats.tiers["disk"].demotions > 0
        assert "disk" in store.locate([key(20)])
        assert store.stats.demotion_failures == 0
    finally:
        runtime.close()
    said = [r.getMessage() for r in caplog.records]
    assert any("disk tier usable again" in m and "3 chunks" in m for m in said), said


def test_each_try_says_why_until_the_directory_is_usable(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.write_bytes(b"not a directory")
    # the thread's first try an hour away: this test makes each try itself
    runtime = AgentRuntime.open(_settings(tmp_path), disk_retry_first_s=3600, disk_retry_max_s=3600)
    try:
        retry = runtime.disk_retry
        assert retry is not None and retry.tries == 0
        [gone] = runtime.info()["unavailable_tiers"]
        assert gone.get("tries") == 0 and gone.get("next_try_s", 0) > time.time() + 3000
        assert retry.try_now() is False and retry.tries == 1
        disk.unlink()
        disk.mkdir()
        (disk / ".lock").mkdir()  # now its lock file cannot be created: another reason
        assert retry.try_now() is False
        [gone] = runtime.info()["unavailable_tiers"]
        assert "cannot create lock file" in gone["reason"] and gone.get("tries") == 2
        (disk / ".lock").rmdir()
        assert retry.try_now() is True
        assert runtime.info()["unavailable_tiers"] == [] and "disk" in runtime.usage()
        assert retry.try_now() is True and retry.tries == 3  # online: nothing more to try
    finally:
        runtime.close()


def test_while_absent_the_disk_tier_is_no_tier_below(tmp_path: Path) -> None:
    """Absent, the disk tier takes nothing and the cpu tier behaves as the bottom one: its
    victims are dropped (not counted as failed demotions), and an operator's move, pin,
    resize or flush --demote into it is refused saying why."""
    (tmp_path / "disk").write_bytes(b"not a directory")
    runtime = AgentRuntime.open(
        _settings(tmp_path, cpu_bytes=256 * KIB), disk_retry_first_s=3600, disk_retry_max_s=3600
    )
    try:
        store = runtime.store
        for i in range(8):
            assert store.put(key(i), payload(i, 64 * KIB)) == "cpu"
        assert store.stats.demotion_failures == 0 and store.stats.tiers["disk"].demotions == 0
        assert store.offline_tiers == {}
        refusals: list[Callable[[], object]] = [
            lambda: store.move([key(7)], "disk"),
            lambda: store.pin([key(7)], tier="disk"),
            lambda: store.resize("disk", 8 << 20),
            lambda: store.flush("cpu", demote=True),
        ]
        for refused in refusals:
            with pytest.raises(TierUnavailable, match=r"'disk' is unavailable: .*cannot use"):
                refused()
        assert store.locate([key(7)]) == ["cpu"]
        with pytest.raises(CapacityError):  # too large for cpu, nowhere else to go
            store.put(key(99), payload(99, 512 * KIB))
    finally:
        runtime.close()


class _GatedOpen:
    """Opens the disk tier, then waits at ``gate`` before handing it over: a scan that takes
    as long as the test wants."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.opened = threading.Event()
        self.gate = threading.Event()

    def __call__(self) -> Tier:
        tier = DiskTier(self.directory, 4 << 20)
        self.opened.set()
        assert self.gate.wait(HANG_GUARD_S)
        return tier


def test_puts_and_reads_go_on_while_the_retry_opens_the_tier(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with DiskTier(disk, 4 << 20) as tier:
        put(tier, 0, 4 * KIB)
        put(tier, 1, 4 * KIB)
    store = TieredStore(
        [CpuTier(1 << 20), AbsentTier("disk", 4 << 20, "not mounted")], defer_accesses=True
    )
    opener = _GatedOpen(disk)
    retry = TierRetry(store, "disk", opener, first_s=3600, max_s=3600)
    trying = threading.Thread(target=retry.try_now)
    try:
        trying.start()
        assert opener.opened.wait(HANG_GUARD_S)
        # the tier is open and being handed over: the store serves meanwhile (in a thread of
        # its own, so a store waiting on the retry fails the test instead of hanging it). Key
        # 1 is put again here: the cpu copy, the newer, is the one kept
        served: list[object] = []

        def serve() -> None:
            served.append(store.put(key(1), b"new" * 100))
            served.append(store.put(key(5), b"x" * 300))
            served.append(bytes(store.get(key(5))))

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        server.join(HANG_GUARD_S)
        assert served == ["cpu", "cpu", b"x" * 300], "the store waited on the retry's open"
        assert store.absent_tiers == {"disk": "not mounted"}
        opener.gate.set()
        trying.join(HANG_GUARD_S)
        assert not trying.is_alive()
        assert store.absent_tiers == {}
        assert store.locate([key(0), key(1), key(5)]) == ["disk", "cpu", "cpu"]
        assert bytes(store.get(key(1))) == b"new" * 100
        assert (
            len(store.tier("disk")) == 1
            and not (disk / key(1).hex()[:2] / f"{key(1).hex()}.kv").exists()
        )
    finally:
        opener.gate.set()
        retry.close()
        store.close()


def test_adoption_in_batches_brings_every_chunk(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with DiskTier(disk, 4 << 20) as tier:
        for i in range(7):
            put(tier, i, 4 * KIB)
    store = TieredStore([CpuTier(1 << 20), AbsentTier("disk", 4 << 20, "not mounted")])
    try:
        assert store.adopt_tier(DiskTier(disk, 4 << 20), batch=2) == 7
        assert store.usage()["disk"]["chunks"] == 7
        assert store.locate([key(i) for i in range(7)]) == ["disk"] * 7
        other = DiskTier(tmp_path / "other", 1 << 20)
        with pytest.raises(InvalidArgument, match="no absent tier"):
            store.adopt_tier(other)
        other.close()
    finally:
        store.close()


def test_a_store_closed_before_the_handover_leaves_the_opened_tier_closed(tmp_path: Path) -> None:
    store = TieredStore([CpuTier(1 << 20), AbsentTier("disk", 4 << 20, "not mounted")])
    opener = _GatedOpen(tmp_path / "disk")
    opener.gate.set()
    store.close()
    retry = TierRetry(store, "disk", opener, first_s=3600, max_s=3600)
    with pytest.raises(TierUnavailable, match="closed"):
        retry.try_now()
    # the directory's lock was let go: another tier can open it
    DiskTier(tmp_path / "disk", 1 << 20).close()


def _disk_of(tmp_path: Path, chunks: int) -> Path:
    """A disk tier's directory holding ``chunks`` chunks of tenant "a" (keys 0, 1, ...)."""
    disk = tmp_path / "disk"
    with DiskTier(disk, 4 << 20) as tier:
        for i in range(chunks):
            put(tier, i, 4 * KIB, tenant="a")
    return disk


def test_adopted_chunks_are_published_for_a_fleet_index_not_the_pool(tmp_path: Path) -> None:
    """Each chunk brought in is an ``adopt`` event, which a fleet index takes as stored (before,
    none was published: routers following the agent never learned the disk's chunks until
    something made them resync); the pool's write-through takes ``store`` events only, so a
    directory coming online is not written out to the pool."""
    from kvctl.index.events import from_agent_event

    disk = _disk_of(tmp_path, 5)
    store = TieredStore([CpuTier(1 << 20), AbsentTier("disk", 4 << 20, "not mounted")])
    events: list[dict[str, object]] = []
    store.subscribe(events.append)
    try:
        assert store.adopt_tier(DiskTier(disk, 4 << 20), batch=2) == 5
        assert [e["type"] for e in events] == ["adopt"] * 5
        assert sorted(e["key"] for e in events) == sorted(key(i).hex() for i in range(5))
        seen = [from_agent_event(e) for e in events]
        assert all(c is not None and c.kind == "stored" and c.tier == "disk" for c in seen)
        assert all(c is not None and c.tenant == "a" for c in seen)
    finally:
        store.close()


class _FailingDuplicateDelete(DiskTier):
    """A disk tier whose unlink of a chunk cached meanwhile elsewhere fails: ``error`` raised."""

    error: BaseException = TierUnavailable("disk tier 'disk' cannot delete: Permission denied")

    def delete(self, key: bytes) -> int:
        raise self.error


def test_a_duplicate_whose_file_cannot_go_does_not_stop_the_adoption(tmp_path: Path) -> None:
    """A chunk put again while the tier was absent keeps that copy; when its file here cannot
    be removed, the file stays (unindexed) and the rest comes online (before, the adoption
    stopped part way with a closed tier installed, some chunks indexed and the retry dead)."""
    disk = _disk_of(tmp_path, 6)
    store = TieredStore([CpuTier(1 << 20), AbsentTier("disk", 4 << 20, "not mounted")])
    try:
        store.put(key(3), payload(3, 4 * KIB), tenant="a")
        assert store.adopt_tier(_FailingDuplicateDelete(disk, 4 << 20), batch=2) == 5
        assert store.absent_tiers == {}
        assert store.locate([key(i) for i in range(6)], tenant="a") == [
            "disk", "disk", "disk", "cpu", "disk", "disk"
        ]  # fmt: skip
        assert bytes(store.get(key(0), tenant="a")) == payload(0, 4 * KIB)
    finally:
        store.close()


def test_an_adoption_that_fails_part_way_is_taken_back_and_tried_again(tmp_path: Path) -> None:
    """Anything else raised part way takes back what was brought in (each an ``evict`` event),
    puts the absent tier back with the error as its reason and lets the caller close the tier:
    the next try opens it afresh and brings every chunk (before: the closed tier stayed in
    place, 'absent', its first chunks indexed and unreadable, and the retry thread stopped)."""
    disk = _disk_of(tmp_path, 6)
    store = TieredStore([CpuTier(1 << 20), AbsentTier("disk", 4 << 20, "not mounted")])
    events: list[dict[str, object]] = []
    store.subscribe(events.append)
    try:
        store.put(key(5), payload(5, 4 * KIB), tenant="a")
        broken = _FailingDuplicateDelete(disk, 4 << 20)
        broken.error = RuntimeError("a surprise")
        retry = TierRetry(store, "disk", lambda: broken, first_s=3600, max_s=3600)
        with pytest.raises(RuntimeError, match="a surprise"):
            retry.try_now()  # at key 5's duplicate, after those scanned before it
        assert store.absent_tiers == {"disk": "bringing it online failed: a surprise"}
        assert isinstance(store.tier("disk"), AbsentTier)
        assert store.locate([key(i) for i in range(6)], tenant="a") == [None] * 5 + ["cpu"]
        kinds = [e["type"] for e in events[1:]]  # after the put's "store"
        brought = kinds.count("adopt")
        assert kinds == ["adopt"] * brought + ["evict"] * brought, kinds
        with pytest.raises(TierUnavailable):  # the caller closed the tier it opened
            broken.put(meta_of(9), memoryview(payload(9, 4 * KIB)))
        retry._open = lambda: DiskTier(disk, 4 << 20)  # fixed: the next try opens it afresh
        assert retry.try_now()
        assert store.absent_tiers == {}
        assert store.locate([key(i) for i in range(6)], tenant="a") == ["disk"] * 5 + ["cpu"]
        assert bytes(store.get(key(2), tenant="a")) == payload(2, 4 * KIB)
    finally:
        store.close()


def meta_of(i: int) -> ChunkMeta:
    return ChunkMeta(key=key(i), size_bytes=4 * KIB, tenant="a")
