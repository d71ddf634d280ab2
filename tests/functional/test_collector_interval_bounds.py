"""``CollectorConfig`` refuses an interval no collector can wait (InvalidArgument naming it), as
`kvctl collect` does since f94909e: the CLI refused past a day, but the library it wraps took
``interval_s=1e300`` and its first ``collect_once`` failed with "OverflowError: timestamp out of
range for platform time_t" (threading's wait). ``link_interval_s`` inf stays "no link probes"."""

from __future__ import annotations

import math

import pytest

from collectors.collector import MAX_INTERVAL_S, CollectorConfig
from kvctl.cli.collect import MAX_INTERVAL_S as CLI_MAX_INTERVAL_S
from kvctl.errors import InvalidArgument

_BAD = [1e300, MAX_INTERVAL_S * 2, 0.0, -1.0, math.nan]


@pytest.mark.parametrize(
    ("name", "value"),
    [*(("interval_s", v) for v in [*_BAD, math.inf]), *(("link_interval_s", v) for v in _BAD)],
)
def test_an_interval_no_collector_can_wait_is_refused_by_name(name: str, value: float) -> None:
    with pytest.raises(InvalidArgument, match=name):
        CollectorConfig(**{name: value})


def test_the_longest_intervals_and_no_links_are_taken() -> None:
    config = CollectorConfig(interval_s=MAX_INTERVAL_S, link_interval_s=math.inf)
    assert config.interval_s == MAX_INTERVAL_S
    CollectorConfig(link_interval_s=MAX_INTERVAL_S)


def test_the_cli_and_the_library_take_the_same_longest_interval() -> None:
    assert CLI_MAX_INTERVAL_S == MAX_INTERVAL_S
