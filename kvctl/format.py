"""Figures for people, as plain strings: the CLI's tables, the live view's cells and the
dashboard's cards all format through here, so one figure reads the same everywhere.

Two forms where they differ on purpose: the long form (``1.50 KiB``, ``12.3 ms``) for tables and
cards, and the compact form (``1.5K``, ``12.3ms``) for the live view's narrow columns. Every
function that takes ``None`` answers ``N/A`` for it, as every one does for NaN or an infinity (a
reading no source should give, but a broken one can: never ``nan J``, nor a crash). Parsing
sizes is ``kvctl.units``' job.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, Final

NA: Final = "N/A"

#: (factor, unit) tables for :func:`format_scaled`, largest first
GPU_TIME_UNITS: Final = ((3600.0, "GPU-h"), (1.0, "GPU-s"))
ENERGY_UNITS: Final = ((3.6e9, "MWh"), (3.6e6, "kWh"), (3.6e3, "Wh"), (1.0, "J"))
MASS_UNITS: Final = ((1e6, "t"), (1e3, "kg"), (1.0, "g"))


def _finite(v: float | None) -> float | None:
    """``v``, or None for NaN and the infinities as for a figure missing (an int is finite,
    however large: ``math.isfinite`` would overflow on one past a float)."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


def significant(v: float, digits: int = 4) -> float:
    """``v`` rounded to ``digits`` significant digits, still a number (tables sort and export
    it): a small figure keeps its size, where rounding to fixed decimals made a DC's 0.00004
    GPU-h saved a 0."""
    if v == 0 or not math.isfinite(v):
        return v
    return round(v, digits - 1 - math.floor(math.log10(abs(v))))


def percent(ratio: float | None, digits: int = 1) -> str:
    """0.1234 -> '12.3%' (``digits=0``: '12%')."""
    ratio = _finite(ratio)
    return NA if ratio is None else f"{ratio * 100:.{digits}f}%"


# --- bytes ------------------------------------------------------------------------------------
def count_of(n: int, noun: str) -> str:
    """``1 node``, ``2 nodes``: ``n`` with ``noun`` (one that takes an s)."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def format_bytes(n: float) -> str:
    """Binary units, three significant figures at most: 1536 -> '1.5 KiB', 1600 -> '1.56 KiB'."""
    if _finite(n) is None:
        return NA
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if unit == "B" and abs(n) < 1024:
            return f"{n:.0f} B"
        # from 999.5 up, three figures would round to "1e+03": the next unit says it
        if unit != "B" and abs(n) < 999.5:
            return f"{n:.3g} {unit}"
        if unit == "TiB":  # the largest unit: whole TiB, grouped, never "3.07e+03"
            return f"{n:,.0f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_rate(bytes_per_second: float) -> str:
    return f"{format_bytes(bytes_per_second)}/s"


def compact_bytes(n: float) -> str:
    """Four characters or so: ``980B``, ``1.2K``, ``34M``, ``5.6G`` (binary units)."""
    if _finite(n) is None:
        return NA
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" or abs(n) >= 10 else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


# --- counts -----------------------------------------------------------------------------------
def format_number(v: float | None, unit: str = "", digits: int = 3) -> str:
    """Thousands separated from 1000 up, else ``digits`` significant figures: '12,345 J'."""
    v = _finite(v)
    if v is None:
        return NA
    if abs(v) >= 1000:
        text = f"{v:,.0f}"
    elif v == 0:
        text = "0"
    else:
        text = f"{v:.{digits}g}"
        if "e" in text:  # below 1e-4: positional, as a card in a family's unit needs
            places = digits - 1 - math.floor(math.log10(abs(v)))
            text = f"{v:.{places}f}"
    return f"{text} {unit}".rstrip()


def common_scale(
    values: Iterable[float | None], units: tuple[tuple[float, str], ...]
) -> tuple[tuple[float, str]]:
    """One of ``units`` for figures shown side by side (a family: energy saved and used), so
    they read in one unit: the one :func:`format_scaled` would pick for the largest of them.
    Pass it as ``units`` to :func:`format_scaled`."""
    largest = max((abs(f) for v in values if (f := _finite(v)) is not None), default=0.0)
    return (next((u for u in units if largest >= u[0]), units[-1]),)


def format_scaled(v: float | None, units: tuple[tuple[float, str], ...]) -> str:
    """``v`` in the largest of ``units`` (factor, name; largest first) it reaches, else the
    smallest: 0.003 GPU-hours reads 12.3 GPU-s."""
    v = _finite(v)
    if v is None:
        return NA
    for factor, name in units:
        if abs(v) >= factor:
            return format_number(v / factor, name)
    factor, name = units[-1]
    return format_number(v / factor, name)


def compact_per_second(per_s: float | None) -> str:
    """Events per second, unit left to the column: '0', '2.5', '1,234'."""
    per_s = _finite(per_s)
    if per_s is None:
        return NA
    if per_s == 0:
        return "0"
    return f"{per_s:.1f}" if per_s < 100 else f"{per_s:,.0f}"


# --- time -------------------------------------------------------------------------------------
def format_seconds(seconds: float | None) -> str:
    """'12 µs', '3.4 ms', '1.25 s'."""
    return _seconds(seconds, " ", 2)


def compact_seconds(seconds: float | None) -> str:
    """'12µs', '3.4ms', '1.2s'."""
    return _seconds(seconds, "", 1)


def _seconds(seconds: float | None, sep: str, digits: int) -> str:
    seconds = _finite(seconds)
    if seconds is None:
        return NA
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}{sep}µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f}{sep}ms"
    return f"{seconds:.{digits}f}{sep}s"


def compact_duration(seconds: float | None) -> str:
    """The largest whole unit: '3d', '5h', '12m', '40s'."""
    seconds = _finite(seconds)
    if seconds is None:
        return NA
    s = int(seconds)
    for unit, width in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= width:
            return f"{s // width}{unit}"
    return f"{s}s"


def format_utc_minute(epoch_ms: int) -> str:
    """'2024-05-01 13:45 UTC'."""
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC")


def describe_policy(status: Mapping[str, Any]) -> str:
    """One tier's eviction policy for people: ``lineage-adaptive following lineage-lru2 (3
    switches)``, or just its name."""
    name = str(status.get("policy", "?"))
    leader = status.get("leader")
    if leader is None:
        return name
    switches = int(status.get("switches", 0))
    return f"{name} following {leader} ({switches} switch{'es' if switches != 1 else ''})"


def finite(value: Any) -> Any:
    """``value`` with every float that is not finite, at any depth (dicts, lists, tuples), as
    None: an unknown figure in JSON for scripts, where Python's json would write bare NaN or
    Infinity, which jq and every non-Python parser refuse."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
