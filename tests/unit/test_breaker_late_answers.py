"""A source whose answers come past its caller's deadline (``Source.call(answer_within_s=)``) is
treated as failing by its breaker: a run of late answers opens it, a late half-open probe is a
failed probe, and a source that answers its probes in time but its lookups late is not closed and
reopened every first backoff. The breaker's clock is injected; lateness is judged on the call's
real duration, so an allowance of 0 s (or a minute) makes an answer late (or in time)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvctl.errors import InvalidArgument
from kvctl.remote.breaker import DEFAULT_LATE_TO_OPEN, Breaker
from kvctl.remote.federation import POOL_TIER, RemoteTiers, Source
from kvctl.remote.fetchplan import PrefillRate
from kvctl.remote.links import LinkEstimator
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.unit.test_source_breaker import FakeClock, NoBackend, fail, make_source, no_bytes, ok


def answer(src: Source, *, late: bool, what: str = "probe") -> str | None:
    # any answer takes longer than 0 s; none of these takes a minute
    return src.call(what, ok, moved_bytes=no_bytes, answer_within_s=0.0 if late else 60.0)


def open_for_lateness(src: Source) -> None:
    for _ in range(DEFAULT_LATE_TO_OPEN):
        assert answer(src, late=True) == "answer"  # a late answer is still an answer


def test_a_run_of_late_answers_opens_the_breaker_and_one_in_time_resets_the_run() -> None:
    clock = FakeClock()
    src = make_source(clock)
    for _ in range(DEFAULT_LATE_TO_OPEN - 1):
        answer(src, late=True)
    answer(src, late=False)  # the run is broken: the source can keep up after all
    for _ in range(DEFAULT_LATE_TO_OPEN - 1):
        answer(src, late=True)
    assert src.breaker.state == "closed"
    answer(src, late=True)
    b = src.status()["breaker"]
    assert b["state"] == "open" and src.up is False
    assert b["opens"] == b["late_opens"] == 1
    assert b["late_answers"] == 2 * DEFAULT_LATE_TO_OPEN - 1
    assert b["backoff_s"] == src.breaker.first_backoff_s
    assert src.call("probe", ok, moved_bytes=no_bytes) is None  # left alone meanwhile
    assert src.status()["skipped"] == 1 and src.status()["errors"] == 0


def test_a_late_probe_fails_it_and_a_probe_in_time_closes_the_breaker() -> None:
    clock = FakeClock()
    src = make_source(clock)
    open_for_lateness(src)
    clock.advance(src.breaker.backoff_s)
    assert src.breaker.state == "half_open"
    answer(src, late=True, what="probe ping")  # the monitor's ping, too slow
    b = src.status()["breaker"]
    assert b["state"] == "open" and b["probe_failures"] == 1
    assert b["backoff_s"] == 2 * src.breaker.first_backoff_s
    clock.advance(src.breaker.backoff_s)
    answer(src, late=False, what="probe ping")
    assert src.status()["breaker"]["state"] == "closed" and src.up is True


def test_a_source_late_again_after_its_probe_closed_it_backs_off_longer_each_time() -> None:
    """Its pings answer in time, its lookups' probes late: each reopening for lateness waits
    longer, up to the cap, where a first-backoff reopening would cost a run of late lookups
    every quarter second; answers in time for a while make it forget."""
    clock = FakeClock()
    src = make_source(clock)
    breaker = src.breaker
    waits: list[float] = []
    for _ in range(5):
        open_for_lateness(src)
        waits.append(breaker.backoff_s)
        clock.advance(breaker.backoff_s)
        answer(src, late=False, what="probe ping")
        assert breaker.state == "closed"
    first = breaker.first_backoff_s
    assert waits == [first, 2 * first, 4 * first, breaker.max_backoff_s, breaker.max_backoff_s]
    for _ in range(DEFAULT_LATE_TO_OPEN):
        answer(src, late=False)
    open_for_lateness(src)
    assert breaker.backoff_s == first


def test_a_late_answer_of_a_call_admitted_before_the_breaker_opened_changes_nothing() -> None:
    clock = FakeClock()
    src = make_source(clock)
    ticket = src.breaker.admit()
    assert ticket is not None
    open_for_lateness(src)
    clock.advance(src.breaker.backoff_s)
    assert src.breaker.late(ticket) is False  # its window is gone: only the probe decides
    assert src.breaker.state == "half_open"


@pytest.mark.parametrize("late_to_open", [0, -1, True, 1.5, "3"])
def test_bad_late_to_open_is_refused(late_to_open: object) -> None:
    with pytest.raises(InvalidArgument, match="late_to_open"):
        Breaker(late_to_open=late_to_open)  # type: ignore[arg-type]


def test_time_queued_behind_the_sources_own_probes_is_not_lateness() -> None:
    """A burst of lookups queues probes in the source's lane (4 workers): each probe answers in
    80 ms, but the last ones start long after their lookup began. Those the lookups stopped
    waiting for are counted as ``late`` (the lookups went on without them); the breaker, which
    judges the source, sees only 80 ms answers and stays closed (a review's burst of 32
    lookups opened a healthy pool for lateness)."""

    class Steady(NoBackend):
        def probe_many(self, keys: Sequence[bytes], *, tenant: str) -> list[None]:
            time.sleep(0.08)
            return [None for _ in keys]

    pool = Source("pool", POOL_TIER, Steady(), LinkEstimator("pool", override="fetch"))
    store = TieredStore([CpuTier(8 << 20)], chunk_tokens=256)
    remote = RemoteTiers(
        store, pool=pool, peers=[], write_through=False, prefill=PrefillRate(1e4, "configured")
    )
    keys = [bytes([i]) * 16 for i in range(4)]
    try:
        with ThreadPoolExecutor(32) as burst:
            list(burst.map(lambda _: remote._probe(keys, "t"), range(32)))
        for lane in remote._lanes.values():
            lane.shutdown(wait=True)  # every probe queued answers, the last ones long after
        status = pool.status()
        assert status["late"] > 0  # the burst did outlast some lookups' wait
        assert status["breaker"]["late_answers"] == 0
        assert status["breaker"]["state"] == "closed"
    finally:
        remote.close()
        store.close()


def test_a_write_turned_away_for_late_answers_is_told_so_not_an_old_error() -> None:
    """``said`` (the pool writer's write.last_error, shown by kvctl agent remote) of a call
    turned away said 'left alone after an error (<last_error>)' whatever opened the breaker:
    opened by late lookups, it showed an empty or an old, long since mended error."""
    clock = FakeClock()
    src = make_source(clock)
    told: list[str] = []
    assert src.call("write", fail, moved_bytes=no_bytes, said=told.append) is None
    clock.advance(src.breaker.backoff_s)
    assert answer(src, late=False) == "answer"  # the probe closes it: the error is over
    open_for_lateness(src)
    assert src.call("write", ok, moved_bytes=no_bytes, said=told.append) is None
    assert told[-1] == "not sent: pool is left alone after answering too late"
    clock.advance(src.breaker.backoff_s)
    assert src.call("write", fail, moved_bytes=no_bytes, said=told.append) is None  # a probe
    assert src.call("write", ok, moved_bytes=no_bytes, said=told.append) is None
    assert told[-1].startswith("not sent: pool is left alone after an error (write: pool")
