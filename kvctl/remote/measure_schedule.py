"""When the link monitor measures each source's link next.

A costed link is measured every ``measure_every_s``. An uncosted one cannot be priced, so no
fetch uses it (its first measurement failed: a loaded peer slow to answer at start): it is
measured again as soon as its source answers calls, after ``first_retry_s``, doubled after each
measurement that leaves it uncosted, up to ``measure_every_s`` (a pool refusing the probe's
upload is not sent 4 MiB every second)."""

from __future__ import annotations

from collections.abc import Iterable

#: the first wait after a measurement that left a link uncosted
FIRST_RETRY_S = 1.0


class MeasureSchedule:
    """Per source name: when it is due (monotonic seconds) and its next uncosted wait."""

    def __init__(
        self, names: Iterable[str], measure_every_s: float, first_retry_s: float = FIRST_RETRY_S
    ) -> None:
        self.measure_every_s = measure_every_s
        self._first_retry_s = first_retry_s
        self._due_s = dict.fromkeys(names, 0.0)
        self._retry_s = dict.fromkeys(self._due_s, first_retry_s)

    def due(self, name: str, now_s: float) -> bool:
        return now_s >= self._due_s[name]

    def measured(self, name: str, now_s: float, *, costed: bool) -> float:
        """Record a measurement made at ``now_s``; the seconds until the next one."""
        wait_s = self.measure_every_s
        if costed:
            self._retry_s[name] = self._first_retry_s
        else:
            wait_s = min(self._retry_s[name], wait_s)
            self._retry_s[name] = wait_s * 2
        self._due_s[name] = now_s + wait_s
        return wait_s
