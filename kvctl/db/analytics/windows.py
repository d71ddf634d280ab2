"""Windows of time the read model reports over: the dashboard's named windows, any duration
the CLI is given (``15m``, ``1h``, ``7d``), and the buckets of their time series."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from kvctl.db.rollup import DAY_MS, HOUR_MS, MINUTE_MS
from kvctl.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class Window:
    name: str
    start_ms: int
    end_ms: int
    #: bucket width of the window's time series
    step_ms: int

    @property
    def span_ms(self) -> int:
        return self.end_ms - self.start_ms

    def as_dict(self) -> dict[str, str | int]:
        return {"name": self.name, "start_ms": self.start_ms, "end_ms": self.end_ms}


#: the window picker: name -> (span, time-series bucket); buckets are whole rollup widths so
#: long windows read coarse rollups
WINDOWS: Final = {
    "15m": (15 * MINUTE_MS, MINUTE_MS),
    "1h": (HOUR_MS, MINUTE_MS),
    "24h": (DAY_MS, 15 * MINUTE_MS),
    "7d": (7 * DAY_MS, HOUR_MS),
    "30d": (30 * DAY_MS, 6 * HOUR_MS),
}
DEFAULT_WINDOW: Final = "1h"

_UNIT_MS: Final = {"s": 1000, "m": MINUTE_MS, "h": HOUR_MS, "d": DAY_MS}
_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])")


def window_for(name: str, now_ms: int) -> Window:
    """The window ``name`` (a key of :data:`WINDOWS`) ending at ``now_ms``."""
    try:
        span, step = WINDOWS[name]
    except KeyError:
        raise ValueError(f"unknown window {name!r}; choose from {', '.join(WINDOWS)}") from None
    return Window(name, now_ms - span, now_ms, step)


def duration_ms(text: str) -> int:
    """``15m``, ``1h``, ``90s``, ``1.5d``: a whole number of milliseconds, above zero."""
    m = _DURATION.fullmatch(text.strip().lower())
    span = round(float(m[1]) * _UNIT_MS[m[2]]) if m else 0
    if span <= 0:
        raise InvalidArgument(f"not a duration: {text!r} (e.g. 90s, 15m, 1h, 7d)")
    return span


def window_of(text: str, now_ms: int) -> Window:
    """The last ``text`` (a duration) up to ``now_ms``, bucketed like the shortest named window
    at least as long."""
    span = duration_ms(text)
    step = next((s for w, s in WINDOWS.values() if w >= span), WINDOWS["30d"][1])
    return Window(text.strip(), now_ms - span, now_ms, step)


def bucket_starts(win: Window) -> list[int]:
    """Start of every time-series bucket of the window, the first one holding its start."""
    return list(range(win.start_ms - win.start_ms % win.step_ms, win.end_ms, win.step_ms))
