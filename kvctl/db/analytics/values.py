"""Reading one rollup or sample row's columns: NULL is zero for counters, and a gauge's mean is
its sum over its readings (none: no mean, not zero)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

#: a count's sum at or past the largest 64-bit integer: no counter reaches it, so rows written
#: by hand or a broken export made it; unknown, not a figure. At the limit, not only past it:
#: SQLite's sum of a window's pieces holds one past it at the limit (``rollup.count_sum``)
COUNT_LIMIT: Final = 2**63 - 1


def as_float(v: Any) -> float:
    return 0.0 if v is None else float(v)


def as_int(v: Any) -> int:
    return 0 if v is None else int(v)


def gauge_mean(m: Mapping[Any, Any], gauge: str) -> float | None:
    n = m[f"{gauge}_n"]
    return float(m[f"{gauge}_sum"]) / float(n) if n else None


def possible_joules(joules: float) -> bool:
    """Whether a node's energy over a window (or a bucket) can be true: no collector records
    one below zero or not finite (NVML's counter only rises; emulated energy is busy time x
    watts), so such a sum comes of rows written by hand or a broken export, and is unknown,
    not a figure."""
    return math.isfinite(joules) and joules >= 0


def beyond_count(v: Any) -> bool:
    """Whether a count's sum (an int, PostgreSQL's numeric, SQLite's float past 64 bits) is at
    or past :data:`COUNT_LIMIT`, either way."""
    return v is not None and abs(v) >= COUNT_LIMIT


def possible_seconds(seconds: float) -> bool:
    """Whether a sum of seconds (TTFT, a plan's prefill and fetch time, emulated busy time) can
    be true: none is recorded below zero or not finite (PostgreSQL's 'NaN' and 'Infinity',
    SQLite's NaN stored as NULL beside its count: ``rollup.PAIRED_SUMS``)."""
    return math.isfinite(seconds) and seconds >= 0
