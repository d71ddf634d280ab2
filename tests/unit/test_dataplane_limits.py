"""The data plane's limits as plain parts: the in-flight byte budget and the staging-segment
check (the agent-level behaviour is in tests/functional/test_dataplane_hostile.py)."""

from __future__ import annotations

import fcntl
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from kvctl.agent.dataplane import ByteBudget, EveryInterval, _check_segment
from kvctl.wire.protocol import ErrorCode, FrameError

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="memfd seals are Linux")


def test_the_budget_grants_what_is_free_and_takes_it_back() -> None:
    budget = ByteBudget(100)
    never = time.monotonic() + 60
    assert budget.acquire(60, never, lambda: False)
    assert budget.acquire(40, never, lambda: False)
    assert budget.free_bytes == 0
    budget.release(60)
    assert budget.free_bytes == 60


def test_a_wait_for_budget_ends_at_its_deadline_with_nothing_taken() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(100, time.monotonic() + 60, lambda: False)
    assert not budget.acquire(1, time.monotonic() + 0.05, lambda: False)
    assert budget.free_bytes == 0  # a failed wait takes nothing


def test_a_wait_for_budget_ends_when_cancelled_and_never_for_more_than_all() -> None:
    budget = ByteBudget(100)
    assert not budget.acquire(101, time.monotonic() + 60, lambda: False)  # can never fit
    assert budget.acquire(100, time.monotonic() + 60, lambda: False)
    assert not budget.acquire(1, time.monotonic() + 60, lambda: True)


def test_a_release_wakes_a_waiter() -> None:
    budget = ByteBudget(100)
    assert budget.acquire(100, time.monotonic() + 60, lambda: False)
    got: list[bool] = []
    t = threading.Thread(
        target=lambda: got.append(budget.acquire(70, time.monotonic() + 60, lambda: False))
    )
    t.start()
    budget.release(100)
    t.join(30)
    assert got == [True] and budget.free_bytes == 30


#: Linux's F_SEAL_FUTURE_WRITE (Python's fcntl does not name it): no hole can be punched
F_SEAL_FUTURE_WRITE = 0x10
#: what an agent asks of a staging segment: it can neither shrink nor get a hole
SEGMENT_SEALS = fcntl.F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE if sys.platform == "linux" else 0


def _memfd(size: int, seals: int | None, *, allocated: bool = True) -> int:
    fd = os.memfd_create("t", os.MFD_CLOEXEC | (0 if seals is None else os.MFD_ALLOW_SEALING))
    os.ftruncate(fd, size)
    if allocated:  # written: a page allocated but never written counts as a hole
        os.pwrite(fd, bytes(size), 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@linux_only
def test_a_memfd_allocated_and_sealed_against_shrinking_and_holes_is_accepted() -> None:
    for seals in (
        SEGMENT_SEALS,
        SEGMENT_SEALS | fcntl.F_SEAL_GROW,
        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE,
    ):
        fd = _memfd(1 << 16, seals)
        try:
            _check_segment(fd, 1 << 16)
            _check_segment(fd, 100)  # mapping less than the file holds is fine
        finally:
            os.close(fd)


@linux_only
@pytest.mark.parametrize(
    ("make", "declared", "why"),
    [
        (lambda tmp: _memfd(1 << 16, None), 1 << 16, "not sealed"),
        (lambda tmp: _memfd(1 << 16, fcntl.F_SEAL_GROW), 1 << 16, "not sealed"),
        (lambda tmp: _memfd(1 << 16, SEGMENT_SEALS), 1 << 17, "holds 65536 bytes"),
        (lambda tmp: _memfd(1 << 16, SEGMENT_SEALS), 0, "needs a size"),
        # a hole could be punched in it once mapped: reading it there would allocate it
        (lambda tmp: _memfd(1 << 16, fcntl.F_SEAL_SHRINK), 1 << 16, "holes can be punched"),
        # a hole already: never written, or written in part
        (
            lambda tmp: _memfd(1 << 16, SEGMENT_SEALS, allocated=False),
            1 << 16,
            "has a hole at byte 0",
        ),
        (lambda tmp: os.open(tmp, os.O_RDWR | os.O_CREAT), 1, "takes no seals"),
    ],
)
def test_an_unsafe_segment_is_refused(tmp_path: Path, make, declared: int, why: str) -> None:  # type: ignore[no-untyped-def]
    fd = make(tmp_path / "file")
    try:
        with pytest.raises(FrameError) as err:
            _check_segment(fd, declared)
    finally:
        os.close(fd)
    assert err.value.code == ErrorCode.BAD_REQUEST and not err.value.fatal
    assert why in err.value.message


@linux_only
def test_a_hugetlbfs_segment_is_refused() -> None:
    """A hole punched in a hugetlbfs file faults with SIGBUS once no huge page is free: never
    mapped. (A tmpfs file on transparent huge pages reports a 2 MiB st_blksize too, where the
    kernel gives them to shared memory: that one is accepted, statfs telling the two apart.)"""
    try:
        # creating it takes no huge page: they come at the first fault
        fd = os.memfd_create("t", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
    except OSError as exc:
        pytest.skip(f"no hugetlbfs memfd here: {exc}")
    try:
        os.ftruncate(fd, 4 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
        with pytest.raises(FrameError) as err:
            _check_segment(fd, 4 << 20)
    finally:
        os.close(fd)
    assert err.value.code == ErrorCode.BAD_REQUEST and "hugetlbfs" in err.value.message


def test_events_are_reported_at_once_then_once_an_interval_with_their_count() -> None:
    every = EveryInterval(interval_s=10.0)
    assert every.count(now_s=100.0) == 1  # the first at once
    assert [every.count(now_s=100.0 + i) for i in range(1, 6)] == [0] * 5
    assert every.count(now_s=110.5) == 6  # the five held back and this one
    assert every.count(now_s=111.0) == 0
    assert every.total == 8


class _Segment(bytearray):
    """A stand-in for the SDK's new mapping whose MADV_POPULATE_WRITE fails with ``err``."""

    def __init__(self, size: int, err: int) -> None:
        super().__init__(b"\xff" * size)
        self.err = err

    def madvise(self, _option: int) -> None:
        raise OSError(self.err, os.strerror(self.err))


@pytest.mark.parametrize("err", ["ENOMEM", "EFAULT"])
def test_a_segment_the_kernel_could_not_populate_is_not_written_instead(err: str) -> None:
    # the SDK writes a segment's pages itself only where the kernel lacks MADV_POPULATE_WRITE
    # (EINVAL): where it failed for want of memory, or because a write would fault (SIGBUS),
    # writing them would have the engine killed; the error has its puts go over the socket
    # (second review of 71334fe)
    import errno

    from kvctl.client import _populate

    segment = _Segment(3 << 20, getattr(errno, err))
    with pytest.raises(OSError):
        _populate(segment)  # type: ignore[arg-type]
    assert segment == b"\xff" * (3 << 20)  # nothing written
    older_kernel = _Segment(3 << 20, errno.EINVAL)
    _populate(older_kernel)  # type: ignore[arg-type]
    assert older_kernel == bytes(3 << 20)  # written in full instead
