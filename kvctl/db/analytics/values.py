"""Reading one rollup or sample row's columns: NULL is zero for counters, and a gauge's mean is
its sum over its readings (none: no mean, not zero)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


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
