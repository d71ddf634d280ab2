"""One exponential backoff, shared by what writes to the fleet index.

A write the index server takes longer to run than its client waits (a whole node's entries
replaced at once) holds the server for its whole length at each try: sent again at every poll
or batch, it would hold it for ever. After such a write failed, the next try waits ``first_s``,
twice as long after each further failure, ``max_s`` at most; one done resets the wait. The
agent followers (``follower``) and the vLLM event feed (``vllm_events``) back off their
replaces with it, each on its own clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from kvctl.errors import InvalidArgument


class Backoff:
    """When the next try of a failing action may be sent (see the module).

    ``failed()`` after a failed try, ``succeeded()`` after one done, ``due()`` before each try.
    ``failed(lengthen=False)`` notes a failure of something other than the action itself (a
    cheap check before it): the current wait, at least ``first_s``, starts again from now
    without growing. Not thread-safe: its owner's lock guards the changes (a status read
    without it may see the failures and the wait of two consecutive moments).
    """

    __slots__ = ("_clock", "failures", "first_s", "max_s", "retry_at_s", "wait_s")

    def __init__(
        self, first_s: float, max_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        for what, value in (("first_s", first_s), ("max_s", max_s)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgument(f"backoff {what} must be a number of seconds, got {value!r}")
        if not (0 < first_s <= max_s and math.isfinite(max_s)):
            raise InvalidArgument(
                f"backoff needs 0 < first_s <= max_s < inf, got {first_s}, {max_s}"
            )
        self.first_s = float(first_s)
        self.max_s = float(max_s)
        self._clock = clock
        #: the wait after the last failure (0: none since the last success)
        self.wait_s = 0.0
        #: when the next try may be sent, on ``clock`` (None: now)
        self.retry_at_s: float | None = None
        #: the action's failed tries since its last success (``failed()`` lengthening the wait)
        self.failures = 0

    def due(self) -> bool:
        """Whether a try may be sent now."""
        return self.retry_at_s is None or self._clock() >= self.retry_at_s

    def failed(self, *, lengthen: bool = True) -> float:
        """Note a failure; returns the wait before the next try, in seconds."""
        if lengthen:
            self.wait_s = min(self.max_s, max(self.first_s, 2 * self.wait_s))
            self.failures += 1
        else:
            self.wait_s = max(self.first_s, self.wait_s)
        self.retry_at_s = self._clock() + self.wait_s
        return self.wait_s

    def succeeded(self) -> None:
        """The action was done: the next failure waits ``first_s`` again."""
        self.wait_s, self.retry_at_s, self.failures = 0.0, None, 0

    def retry_in_s(self) -> float | None:
        """Seconds until the next try may be sent (0: it may now), None when nothing failed."""
        retry_at_s = self.retry_at_s
        if retry_at_s is None:
            return None
        return max(0.0, retry_at_s - self._clock())
