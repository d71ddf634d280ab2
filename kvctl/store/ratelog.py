"""Log lines that may repeat many times a second (a failing disk fails every write) without
flooding the log: the first of each kind at once, then at most one per interval, saying how
many more there were since the last line."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

#: at most one line per kind this often, after the first
DEFAULT_INTERVAL_S = 60.0


class RateLimitedLog:
    """``say(kind, level, msg, *args)``: logs the first event of ``kind`` at once; later ones
    are counted and logged at most once per ``interval_s`` with that count. Thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        #: kind -> (when it was last logged, events since then not logged)
        self._kinds: dict[str, tuple[float, int]] = {}

    def say(self, kind: str, level: int, msg: str, *args: object) -> bool:
        """Log (or count) one event; True when it was logged."""
        now = self._clock()
        with self._lock:
            last = self._kinds.get(kind)
            if last is not None and now - last[0] < self._interval_s:
                self._kinds[kind] = (last[0], last[1] + 1)
                return False
            unsaid = 0 if last is None else last[1]
            self._kinds[kind] = (now, 0)
        if unsaid:
            msg += " (and %d more like it in the last %.0f s, not logged)"
            args = (*args, unsaid, now - last[0]) if last is not None else args
        self._log.log(level, msg, *args)
        return True

    def forget(self, kind: str) -> None:
        """The next event of ``kind`` is logged at once (the condition ended and was said)."""
        with self._lock:
            self._kinds.pop(kind, None)
