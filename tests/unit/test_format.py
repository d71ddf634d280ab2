"""kvctl.format: one formatter per figure, long and compact forms, N/A for what is unknown."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from kvctl.format import (
    ENERGY_UNITS,
    GPU_TIME_UNITS,
    NA,
    common_scale,
    compact_bytes,
    compact_duration,
    compact_per_second,
    compact_seconds,
    describe_policy,
    format_bytes,
    format_number,
    format_rate,
    format_scaled,
    format_seconds,
    format_utc_minute,
    percent,
    significant,
)


def test_percent_long_and_compact() -> None:
    assert percent(0.1234) == "12.3%"
    assert percent(0.1234, digits=0) == "12%"
    assert percent(None) == "N/A"


@pytest.mark.parametrize(
    ("n", "long", "compact"),
    [
        (980, "980 B", "980B"),
        (1536, "1.5 KiB", "1.5K"),
        (34 << 20, "34 MiB", "34M"),
        (1020 << 20, "0.996 GiB", "1.0G"),
        (5.6 * (1 << 30), "5.6 GiB", "5.6G"),
        (3 << 50, "3,072 TiB", "3072T"),
        (1000 << 40, "1,000 TiB", "1000T"),
    ],
)
def test_bytes(n: float, long: str, compact: str) -> None:
    assert format_bytes(n) == long
    assert compact_bytes(n) == compact


def test_rates() -> None:
    assert format_rate(1536) == "1.5 KiB/s"
    assert compact_per_second(None) == "N/A"
    assert compact_per_second(0) == "0"
    assert compact_per_second(2.54) == "2.5"
    assert compact_per_second(1234.4) == "1,234"


@pytest.mark.parametrize(
    ("seconds", "long", "compact"),
    [(12e-6, "12 µs", "12µs"), (3.4e-3, "3.4 ms", "3.4ms"), (1.25, "1.25 s", "1.2s")],
)
def test_seconds(seconds: float, long: str, compact: str) -> None:
    assert format_seconds(seconds) == long
    assert compact_seconds(seconds) == compact
    assert format_seconds(None) == compact_seconds(None) == "N/A"


def test_duration_takes_the_largest_whole_unit() -> None:
    assert [compact_duration(s) for s in (40, 720, 5 * 3600, 3 * 86400 + 5)] == [
        "40s",
        "12m",
        "5h",
        "3d",
    ]
    assert compact_duration(None) == "N/A"


def test_numbers_and_scaled_units() -> None:
    assert format_number(12_345.6, "J") == "12,346 J"
    assert format_number(0) == "0"
    assert format_number(0.012345, digits=2) == "0.012"
    assert format_number(None) == "N/A"
    assert format_scaled(0.5, GPU_TIME_UNITS) == "0.5 GPU-s"
    assert format_scaled(7200, GPU_TIME_UNITS) == "2 GPU-h"
    assert format_scaled(7.2e6, ENERGY_UNITS) == "2 kWh"
    assert format_scaled(None, ENERGY_UNITS) == "N/A"
    assert format_number(1.1666e-5, "kWh") == "0.0000117 kWh"  # never 1.17e-05


def test_a_family_of_figures_reads_in_one_unit() -> None:
    """The demo's 13.2 kJ saved beside 42 J used read 3.67 Wh and 0.0117 Wh, not kJ and J."""
    unit = common_scale([13_200.0, 42.0, None], ENERGY_UNITS)
    assert (format_scaled(13_200.0, unit), format_scaled(42.0, unit)) == ("3.67 Wh", "0.0117 Wh")
    assert common_scale([None], ENERGY_UNITS) == ((1.0, "J"),)


def test_utc_minute() -> None:
    assert format_utc_minute(1_714_571_100_000) == "2024-05-01 13:45 UTC"


def test_describe_policy() -> None:
    assert describe_policy({"policy": "lineage-lru2"}) == "lineage-lru2"
    follows = {"policy": "lineage-adaptive", "leader": "lineage-arc", "switches": 1}
    assert describe_policy(follows) == "lineage-adaptive following lineage-arc (1 switch)"
    assert describe_policy({**follows, "switches": 3}).endswith("(3 switches)")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(
    "shown",
    [
        percent,
        format_bytes,
        compact_bytes,
        format_number,
        lambda v: format_scaled(v, ENERGY_UNITS),
        compact_per_second,
        format_seconds,
        compact_seconds,
        compact_duration,
    ],
)
def test_nan_and_infinities_read_as_missing(shown: Callable[[float], str], value: float) -> None:
    """A broken source's NaN or infinity (a hand-edited database, an agent's bad JSON) showed
    as 'nan J', 'inf s' or '-inf%', and compact_duration raised (int of an infinity)."""
    assert shown(value) == NA


def test_a_huge_int_is_still_a_figure_and_an_infinity_sets_no_scale() -> None:
    assert format_bytes(2**80).endswith(" TiB")
    # the finite figures' unit, not MWh for the infinity beside them
    assert common_scale([float("inf"), 2.0e3], ENERGY_UNITS) == ((1.0, "J"),)


def test_significant_keeps_small_figures_and_stays_a_number() -> None:
    assert significant(0.000012345) == 1.234e-05  # 4 decimals made it 0.0
    assert significant(123456.7) == 123500.0
    assert significant(-0.5) == -0.5
    assert significant(0.0) == 0.0
    assert math.isnan(significant(float("nan")))
