"""The work the router has sent each node and that is not done yet, as modeled seconds.

The router does not see a node's engine queue. It keeps, per node, the seconds of work it routed
there (each decision's modeled prefill and fetch time) and drains that backlog at wall-clock
rate: one second of work is done per second. The figure is *modeled* (the decision's own
estimate of the work, not a measured queue), and it only counts this router's requests, so it
is a tie-breaker between nodes that cost alike, not a measurement of load.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from kvctl.errors import InvalidArgument

#: what the figure is, for whoever shows it
BASIS = "modeled: seconds of prefill and fetch routed to the node, drained at wall-clock rate"


class LoadTally:
    """Per-node backlog seconds: ``add`` when a request is routed, drained as time passes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        #: node -> (backlog seconds at ``at_s``, ``at_s``)
        self._backlog: dict[str, tuple[float, float]] = {}

    def add(self, node: str, seconds: float) -> None:
        """Queue ``seconds`` of modeled work on ``node``."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise InvalidArgument(f"queued seconds must be finite and >= 0, got {seconds!r}")
        with self._lock:
            now_s = self._clock()
            self._backlog[node] = (self._left_locked(node, now_s) + seconds, now_s)

    def _left_locked(self, node: str, now_s: float) -> float:
        backlog_s, at_s = self._backlog.get(node, (0.0, now_s))
        return max(0.0, backlog_s - max(0.0, now_s - at_s))

    def queue_s(self) -> dict[str, float]:
        """Each node with work left, and its seconds; drained nodes are forgotten."""
        with self._lock:
            now_s = self._clock()
            out: dict[str, float] = {}
            for node in list(self._backlog):
                left_s = self._left_locked(node, now_s)
                if left_s > 0:
                    out[node] = left_s
                else:
                    del self._backlog[node]
            return out

    def clear(self, node: str | None = None) -> None:
        """Forget ``node``'s backlog (every node's when None)."""
        with self._lock:
            if node is None:
                self._backlog.clear()
            else:
                self._backlog.pop(node, None)
