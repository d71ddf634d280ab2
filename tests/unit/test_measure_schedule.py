"""The link monitor's schedule: a costed link every measure_every_s; an uncosted one (its
measurement failed) again after 1 s, doubled each time it stays uncosted, up to
measure_every_s, and back to every measure_every_s once costed."""

from __future__ import annotations

from kvctl.remote.measure_schedule import MeasureSchedule


def test_an_uncosted_link_is_retried_sooner_and_less_often_each_time() -> None:
    s = MeasureSchedule(["pool", "pB"], measure_every_s=30.0)
    assert s.due("pool", 0.0) and s.due("pB", 0.0)  # both at the start
    waits = [s.measured("pool", t, costed=False) for t in (0.0, 1.0, 3.0, 7.0, 15.0, 31.0)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert not s.due("pool", 60.9) and s.due("pool", 61.0)
    assert s.measured("pool", 61.0, costed=True) == 30.0
    assert s.measured("pool", 91.0, costed=False) == 1.0  # the doubling starts over
    assert s.due("pB", 0.0)  # each source on its own schedule


def test_a_short_measure_interval_bounds_the_retry_too() -> None:
    s = MeasureSchedule(["pool"], measure_every_s=0.5)
    assert s.measured("pool", 0.0, costed=False) == 0.5
