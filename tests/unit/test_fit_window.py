"""The dashboard's default window fits the data: the shortest span that holds the latest stretch
of samples, whatever the data's age, never stretched by an earlier run."""

from __future__ import annotations

import pytest

from kvctl.db.analytics.windows import (
    EMPTY_WINDOW,
    FIT_SPANS,
    WINDOWS,
    Window,
    fit_window,
    window_for,
)
from kvctl.db.rollup import DAY_MS, HOUR_MS, MINUTE_MS

NOW = 1_800_000_000_000


def _fit(*ages_ms: int, now_ms: int = NOW) -> Window:
    """The window fitted to samples taken ``ages_ms`` before NOW."""
    times = [NOW - age for age in ages_ms]

    def has_data(start: int, end: int) -> bool:
        return any(start <= t < end for t in times)

    def latest(start: int, end: int) -> int | None:
        return max((t for t in times if start <= t < end), default=None)

    return fit_window(has_data, latest, now_ms)


def _every(step_ms: int, since_ms: int, until_ms: int = 0) -> list[int]:
    """Ages of samples every ``step_ms`` from ``since_ms`` ago to ``until_ms`` ago (the last
    a second earlier when it is now: a sample is always taken before the page asks)."""
    return list(range(max(until_ms, 1_000), since_ms + 1, step_ms))


@pytest.mark.parametrize(
    ("ages", "span"),
    [
        (_every(2_000, 40_000), "2m"),  # a 40 s demo
        (_every(2_000, 150_000), "5m"),  # past two minutes: the next span
        (_every(10_000, 10 * MINUTE_MS), "15m"),
        (_every(MINUTE_MS, 3 * HOUR_MS), "6h"),
        (_every(5 * MINUTE_MS, 20 * DAY_MS), "30d"),
        (_every(5 * MINUTE_MS, 90 * DAY_MS), "30d"),  # longer history: the longest span
    ],
)
def test_the_shortest_span_holding_the_data_is_chosen(ages: list[int], span: str) -> None:
    win = _fit(*ages)
    assert (win.name, win.fitted, win.end_ms) == (span, True, NOW)
    assert win.span_ms == FIT_SPANS[span][0] and win.step_ms == FIT_SPANS[span][1]
    # the data spans at least a tenth of the window: its plots are not squeezed to an edge
    assert max(ages) >= win.span_ms / 10 or win.span_ms == FIT_SPANS["30d"][0]


def test_an_earlier_run_does_not_stretch_the_latest_one() -> None:
    """Yesterday's demo in the same database, and one running now for a minute: the window
    is this minute's, not a day's (the pause between them is past STRETCH_GAP_MS)."""
    yesterday = _every(2_000, DAY_MS + 60_000, DAY_MS)
    win = _fit(*_every(2_000, 60_000), *yesterday)
    assert win.name == "2m"


def test_data_that_stopped_earlier_fits_a_window_ending_at_its_last_sample() -> None:
    """A 40 s demo looked at ten minutes later still fills its window: 2 minutes, ending just
    after its last sample, not a quarter-hour ending now."""
    win = _fit(*_every(2_000, 10 * MINUTE_MS + 40_000, 10 * MINUTE_MS))
    assert (win.name, win.fitted) == ("2m", True)
    assert win.end_ms == NOW - 10 * MINUTE_MS + 1 and win.span_ms == 2 * MINUTE_MS
    # an hour of collection that stopped three hours ago: that hour
    win = _fit(*_every(MINUTE_MS, 4 * HOUR_MS - MINUTE_MS, 3 * HOUR_MS))
    assert (win.name, win.end_ms) == ("1h", NOW - 3 * HOUR_MS + 1)


def test_a_pause_shorter_than_the_stretch_gap_does_not_cut_the_window() -> None:
    """Ten minutes of data, a five-minute collector restart, then a minute: one stretch."""
    win = _fit(*_every(10_000, 60_000), *_every(10_000, 16 * MINUTE_MS, 6 * MINUTE_MS))
    assert win.name == "1h"  # 16 minutes of data: past the quarter-hour span
    assert (
        _fit(*_every(10_000, 60_000), *_every(10_000, 30 * MINUTE_MS, 20 * MINUTE_MS)).name == "2m"
    )


def test_nothing_to_fit_gives_the_named_default_not_a_fitted_one() -> None:
    assert _fit() == window_for(EMPTY_WINDOW, NOW)
    assert not _fit().fitted and EMPTY_WINDOW in WINDOWS


def test_spans_grow_and_their_buckets_give_a_few_dozen_points() -> None:
    spans = list(FIT_SPANS.values())
    assert [s for s, _ in spans] == sorted(s for s, _ in spans)
    for span, step in spans:
        assert 20 <= span // step <= 60
        # a day and more read rollups: whole minutes at least
        assert span < DAY_MS or step % MINUTE_MS == 0
