"""A remote source's circuit breaker (``Source.call``), driven by an injected clock: a burst of
concurrent failures backs off one step, the wait is capped well under 30 s, half-open admits one
probe, a probe's outcome closes or reopens, and the state is shown in ``Source.status``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvctl.errors import InvalidArgument
from kvctl.remote.federation import POOL_TIER, Source
from kvctl.remote.links import LinkEstimator
from kvctl.remote.pool import PoolChunk, PoolUsage, RemotePool
from kvctl.store.errors import TierUnavailable
from kvctl.store.tiers.base import Buffer, ChunkMeta

#: the old code's first backoff step: every test below waits at least this long for a retry,
#: so a test that fails on the old code fails for the defect, not for a smaller first step
OLD_FIRST_STEP_S = 0.5


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


class NoBackend(RemotePool):
    """A backend for status only: the calls under test are the functions given to ``call``."""

    address = "fake://pool"

    def put_many(self, items: Sequence[tuple[ChunkMeta, Buffer]]) -> list[bool]:
        raise TierUnavailable("not used")

    def get_many(self, keys: Sequence[bytes], *, tenant: str) -> list[PoolChunk | None]:
        raise TierUnavailable("not used")

    def probe_many(self, keys: Sequence[bytes], *, tenant: str) -> list[ChunkMeta | None]:
        raise TierUnavailable("not used")

    def delete_many(self, keys: Sequence[bytes]) -> int:
        raise TierUnavailable("not used")

    def usage(self) -> PoolUsage:
        raise TierUnavailable("not used")


def make_source(clock: FakeClock) -> Source:
    return Source("pool", POOL_TIER, NoBackend(), LinkEstimator("pool"), clock=clock)


def no_bytes(_: object) -> int:
    return 0


def fail() -> str:
    raise TierUnavailable("pool 127.0.0.1:1: Timeout reading from socket")


def ok() -> str:
    return "answer"


def call(src: Source, fn: Callable[[], str]) -> str | None:
    return src.call("probe", fn, moved_bytes=no_bytes)


def fail_together(src: Source, n: int) -> None:
    """``n`` calls admitted at once (all inside the backend before any fails), all failing: one
    burst, as concurrent lookups meet a stalled pool."""
    inside = threading.Barrier(n, timeout=10)

    def stalled() -> str:
        inside.wait()  # every call is in flight before the first one fails
        return fail()

    with ThreadPoolExecutor(n) as workers:
        results = list(workers.map(lambda _: call(src, stalled), range(n)))
    assert results == [None] * n


def test_a_burst_of_concurrent_failures_backs_off_one_step_not_one_per_failure() -> None:
    clock = FakeClock()
    src = make_source(clock)
    fail_together(src, 8)
    assert src.counters.errors == 8  # every failure is counted ...
    clock.advance(OLD_FIRST_STEP_S)
    # ... but the burst is one attempt: the source is tried again after the first step
    assert call(src, ok) == "answer", "a burst of 8 failures backed off 8 steps"
    breaker = src.status()["breaker"]
    assert breaker["state"] == "closed" and breaker["opens"] == 1


def test_the_first_step_of_a_burst_is_the_configured_first_backoff() -> None:
    clock = FakeClock()
    src = make_source(clock)
    fail_together(src, 5)
    first = src.breaker.first_backoff_s
    shown = src.status()["breaker"]
    assert shown["state"] == "open" and shown["backoff_s"] == first
    assert shown["retry_in_s"] == pytest.approx(first)
    assert src.up is False
    clock.advance(first / 2)
    assert call(src, ok) is None and src.counters.skipped == 1  # still backing off
    clock.advance(first / 2)
    assert src.status()["breaker"]["state"] == "half_open" and src.breaker.may_call()
    assert src.up is False  # not in use until its probe answers


def test_the_wait_between_retries_is_capped_well_under_30_s() -> None:
    clock = FakeClock()
    src = make_source(clock)
    cap = 5.0
    for _ in range(12):  # a long outage: each retry fails
        assert call(src, fail) is None
        clock.advance(cap)  # the longest wait the breaker may impose
    assert src.counters.errors == 12 and src.counters.skipped == 0, (
        f"a retry was skipped after waiting {cap} s: the backoff grew past it"
    )
    assert src.status()["breaker"]["backoff_s"] <= cap
    assert call(src, ok) == "answer"


def test_half_open_admits_exactly_one_probe_at_a_time() -> None:
    clock = FakeClock()
    src = make_source(clock)
    assert call(src, fail) is None  # opens
    clock.advance(OLD_FIRST_STEP_S)  # past the backoff: half-open
    probing, release = threading.Event(), threading.Event()

    def slow_probe() -> str:
        probing.set()
        assert release.wait(10)
        return "probe answer"

    reached = 0

    def counted() -> str:
        nonlocal reached
        reached += 1
        return "answer"

    with ThreadPoolExecutor(1) as worker:
        probe = worker.submit(call, src, slow_probe)
        assert probing.wait(10)
        # while the probe is out, every other caller is turned away without touching the pool
        others = [call(src, counted) for _ in range(5)]
        assert reached == 0, f"{reached} calls reached a half-open source beside its probe"
        assert others == [None] * 5 and src.counters.skipped == 5
        assert src.status()["breaker"]["state"] == "half_open"
        release.set()
        assert probe.result(timeout=10) == "probe answer"
    # the probe succeeded: closed, everyone goes through again
    assert src.status()["breaker"]["state"] == "closed"
    assert [call(src, counted) for _ in range(3)] == ["answer"] * 3 and reached == 3


def test_a_failed_probe_reopens_with_a_grown_backoff_then_a_good_one_recovers() -> None:
    clock = FakeClock()
    src = make_source(clock)
    b = src.breaker
    assert call(src, fail) is None
    first = src.status()["breaker"]["backoff_s"]
    clock.advance(first)
    assert call(src, fail) is None  # the probe fails: open again, for longer
    grown = src.status()["breaker"]
    assert grown["state"] == "open" and grown["backoff_s"] == pytest.approx(first * b.factor)
    clock.advance(first)
    assert call(src, ok) is None  # the first step is not enough any more
    clock.advance(first * b.factor - first)
    assert call(src, ok) == "answer"  # the probe succeeds: closed, backoff forgotten
    closed = src.status()["breaker"]
    assert closed["state"] == "closed" and closed["backoff_s"] == 0.0
    assert closed["probes"] == 2 and closed["opens"] == 1
    # a new outage starts again from the first step
    assert call(src, fail) is None
    assert src.status()["breaker"]["backoff_s"] == first


def test_a_late_success_of_a_call_made_before_the_outage_does_not_close_the_breaker() -> None:
    clock = FakeClock()
    src = make_source(clock)
    started, release = threading.Event(), threading.Event()

    def slow_ok() -> str:  # admitted while closed, answers after the breaker opened
        started.set()
        assert release.wait(10)
        return "late answer"

    with ThreadPoolExecutor(1) as worker:
        late = worker.submit(call, src, slow_ok)
        assert started.wait(10)
        assert call(src, fail) is None  # opens
        release.set()
        assert late.result(timeout=10) == "late answer"  # the caller still gets its answer
    assert src.status()["breaker"]["state"] == "open"  # only a probe closes it


def test_a_probe_that_ends_without_an_outcome_frees_the_probe_slot() -> None:
    clock = FakeClock()
    src = make_source(clock)
    assert call(src, fail) is None
    clock.advance(OLD_FIRST_STEP_S)

    def interrupted() -> str:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        call(src, interrupted)
    assert call(src, ok) == "answer"  # the next caller is the probe


def test_failures_to_open_counts_a_run_of_failures() -> None:
    from kvctl.remote.breaker import Breaker

    clock = FakeClock()
    src = Source(
        "pool", POOL_TIER, NoBackend(), LinkEstimator("pool"), clock=clock,
        breaker=Breaker(failures_to_open=3, clock=clock),
    )  # fmt: skip
    assert call(src, fail) is None and call(src, fail) is None
    assert call(src, ok) == "answer"  # a success ends the run
    assert call(src, fail) is None and call(src, fail) is None
    assert src.status()["breaker"]["state"] == "closed"
    assert call(src, fail) is None
    assert src.status()["breaker"]["state"] == "open"


def test_status_names_the_state_and_the_last_error() -> None:
    clock = FakeClock()
    src = make_source(clock)
    shown = src.status()
    assert shown["up"] is True and shown["breaker"]["state"] == "closed"
    call(src, fail)
    shown = src.status()
    assert shown["up"] is False and shown["breaker"]["state"] == "open"
    assert shown["last_error"].startswith("probe: pool 127.0.0.1:1: Timeout")
    assert shown["breaker"]["retry_in_s"] > 0


def test_a_caller_is_told_why_its_own_call_returned_none() -> None:
    """``said``: the caller's own failure, or its call turned away, whatever later calls of
    others leave in ``last_error`` (the pool writer shows its own)."""
    clock = FakeClock()
    src = make_source(clock)
    told: list[str] = []
    assert src.call("write", fail, moved_bytes=no_bytes, said=told.append) is None
    assert told == ["write: pool 127.0.0.1:1: Timeout reading from socket"]
    assert src.call("write", ok, moved_bytes=no_bytes, said=told.append) is None  # left alone
    assert told[1].startswith("not sent: pool is left alone after an error (write: pool")
    assert src.call("write", ok, moved_bytes=no_bytes, said=told.append) is None
    clock.advance(OLD_FIRST_STEP_S)
    assert src.call("write", ok, moved_bytes=no_bytes, said=told.append) == "answer"
    assert len(told) == 3  # an answer tells nothing


@pytest.mark.parametrize(
    "kw",
    [
        {"first_backoff_s": 0.0},
        {"first_backoff_s": float("nan")},
        {"first_backoff_s": 2.0, "max_backoff_s": 1.0},
        {"max_backoff_s": float("inf")},
        {"factor": 0.5},
        {"failures_to_open": 0},
        {"failures_to_open": True},
    ],
)
def test_bad_breaker_settings_are_refused(kw: dict[str, float]) -> None:
    from kvctl.remote.breaker import Breaker

    with pytest.raises(InvalidArgument):
        Breaker(**kw)  # type: ignore[arg-type]
