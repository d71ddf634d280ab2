"""Reading one rollup or sample row's columns: NULL is zero for counters, and a gauge's mean is
its sum over its readings (none: no mean, not zero)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def as_float(v: Any) -> float:
    return 0.0 if v is None else float(v)


def as_int(v: Any) -> int:
    return 0 if v is None else int(v)


def gauge_mean(m: Mapping[Any, Any], gauge: str) -> float | None:
    n = m[f"{gauge}_n"]
    return float(m[f"{gauge}_sum"]) / float(n) if n else None
