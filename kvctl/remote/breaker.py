"""A circuit breaker for one remote source (the pool or a peer): when to leave it alone, and
when to try it again.

- **closed**: every call goes through. ``failures_to_open`` failures in a row open it.
- **open**: no call goes through until its backoff has run out. The first backoff is
  ``first_backoff_s``; each failed probe multiplies it by ``factor``, up to ``max_backoff_s``.
- **half_open** (the backoff ran out): exactly one call is let through, the probe; the others
  are turned away while it is out. Its success closes the breaker (and forgets the backoff);
  its failure opens it again with the grown backoff.

**Late answers.** A call that succeeds past the deadline its caller had (a lookup that went on
without it) is a late answer: the source answers, but too late to be used, while each call holds
a worker and a lookup's wait. ``late_to_open`` of them in a row open a closed breaker as a
failure does, and a half-open probe that answers late is a failed probe. A source that answers a
ping in time but lookups late would be closed by its next ping and opened again by the next
lookups, every first backoff: so a breaker opened for lateness keeps its backoff through the
probe that closes it, and opens for lateness again with that backoff grown, until the source has
answered ``late_to_open`` calls in time in a row.

Calls are counted per *attempt window*: every change of state starts a new window, and a call
reports into the window it was admitted in. So a burst of concurrent calls that all meet the same
outage opens the breaker once, with the first backoff, however many of them fail (the old rule,
one doubling per failure, turned one stall into a 30 s silence); and a slow call admitted before
an outage that answers after the breaker opened changes nothing (only the probe decides).

Thread-safe. The clock is injected, so the whole cycle is testable without sleeping.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvctl.errors import InvalidArgument

BreakerState = Literal["closed", "open", "half_open"]

#: first wait after an outage is seen: short, since most outages are blips and a miss costs a
#: recompute, while a probe of a dead source costs one short read deadline
DEFAULT_FIRST_BACKOFF_S = 0.25
#: the longest wait between probes: a pool that comes back is used again within about this.
#: A probe costs one ping (the link monitor's) or one read that gives up after its short read
#: deadline, so probing a dead pool this often is cheap; waiting longer only delays recovery.
DEFAULT_MAX_BACKOFF_S = 2.0
DEFAULT_FACTOR = 2.0
#: late answers in a row that open a closed breaker: one is a blip (a pause of the reader's own
#: process can make it), a few in a row a source that cannot keep up
DEFAULT_LATE_TO_OPEN = 3


@dataclass(frozen=True, slots=True)
class Ticket:
    """A call's admission: the attempt window it was admitted in, and whether it is the probe."""

    window: int
    probe: bool


class Breaker:
    def __init__(
        self,
        *,
        first_backoff_s: float = DEFAULT_FIRST_BACKOFF_S,
        max_backoff_s: float = DEFAULT_MAX_BACKOFF_S,
        factor: float = DEFAULT_FACTOR,
        failures_to_open: int = 1,
        late_to_open: int = DEFAULT_LATE_TO_OPEN,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        first_backoff_s = _positive_seconds(first_backoff_s, "first_backoff_s")
        max_backoff_s = _positive_seconds(max_backoff_s, "max_backoff_s")
        if max_backoff_s < first_backoff_s:
            raise InvalidArgument(
                f"max_backoff_s ({max_backoff_s}) must be at least first_backoff_s "
                f"({first_backoff_s})"
            )
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise InvalidArgument(f"backoff factor must be a number, got {factor!r}")
        if not (math.isfinite(factor) and factor >= 1):
            raise InvalidArgument(f"backoff factor must be finite and >= 1, got {factor!r}")
        if isinstance(failures_to_open, bool) or not isinstance(failures_to_open, int):
            raise InvalidArgument(f"failures_to_open must be an int, got {failures_to_open!r}")
        if failures_to_open < 1:
            raise InvalidArgument(f"failures_to_open must be >= 1, got {failures_to_open}")
        if isinstance(late_to_open, bool) or not isinstance(late_to_open, int) or late_to_open < 1:
            raise InvalidArgument(f"late_to_open must be an int >= 1, got {late_to_open!r}")
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.factor = float(factor)
        self.failures_to_open = failures_to_open
        self.late_to_open = late_to_open
        self.clock = clock
        self._lock = threading.Lock()
        self._open = False
        self._window = 0
        self._backoff_s = 0.0
        self._retry_at_s = 0.0
        self._probing = False
        #: failures in a row while closed (in the current window)
        self._failures = 0
        #: late answers in a row while closed (in the current window), answers in time in a row
        self._late = 0
        self._in_time = 0
        #: it is open because of late answers (not failures)
        self._opened_late = False
        #: the backoff of the last opening for lateness, kept until ``late_to_open`` answers in
        #: time in a row (0: none)
        self._late_backoff_s = 0.0
        #: times it went from closed to open, probes let through, probes that failed; openings
        #: for late answers (among ``opens``) and late answers in all
        self.opens = 0
        self.probes = 0
        self.probe_failures = 0
        self.late_opens = 0
        self.late_answers = 0

    # --- the state ----------------------------------------------------------------------------
    def _state_locked(self, now_s: float) -> BreakerState:
        if not self._open:
            return "closed"
        return "open" if now_s < self._retry_at_s else "half_open"

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state_locked(self.clock())

    @property
    def opened_late(self) -> bool:
        """Whether it is open because of late answers (not failures)."""
        with self._lock:
            return self._open and self._opened_late

    def may_call(self) -> bool:
        """Whether a call made now would be let through (no state changes: a hint only)."""
        with self._lock:
            state = self._state_locked(self.clock())
            return state == "closed" or (state == "half_open" and not self._probing)

    # --- a call's life ------------------------------------------------------------------------
    def admit(self) -> Ticket | None:
        """A ticket for a call to make now, or None: the source is to be left alone."""
        with self._lock:
            state = self._state_locked(self.clock())
            if state == "closed":
                return Ticket(self._window, probe=False)
            if state == "open" or self._probing:
                return None
            self._probing = True
            self.probes += 1
            return Ticket(self._window, probe=True)

    def succeeded(self, ticket: Ticket) -> None:
        with self._lock:
            if ticket.window != self._window:
                return  # admitted before the last change of state: says nothing about now
            if ticket.probe:
                # a source opened for lateness may answer a ping in time and lookups late
                # again: its backoff is remembered until it has answered in time a while
                if self._opened_late:
                    self._late_backoff_s = self._backoff_s
                self._open = self._probing = self._opened_late = False
                self._backoff_s = self._retry_at_s = 0.0
                self._window += 1
                self._in_time = 0
            else:
                self._in_time += 1
                if self._in_time >= self.late_to_open:
                    self._late_backoff_s = 0.0
            self._failures = self._late = 0

    def failed(self, ticket: Ticket) -> bool:
        """Records a failure; True when it opened (or reopened) the breaker, False when it was
        one of a burst already counted, or not yet enough to open."""
        with self._lock:
            if ticket.window != self._window:
                return False
            if ticket.probe:
                self._probe_failed_locked(late=False)
                return True
            self._failures += 1
            if self._failures < self.failures_to_open:
                return False
            self._open_locked(self.first_backoff_s, late=False)
            return True

    def late(self, ticket: Ticket) -> bool:
        """Records an answer that came past its caller's deadline (see the module); True when
        it opened (or reopened) the breaker."""
        with self._lock:
            self.late_answers += 1
            if ticket.window != self._window:
                return False
            self._in_time = 0
            if ticket.probe:
                self._probe_failed_locked(late=True)
                return True
            self._late += 1
            if self._late < self.late_to_open:
                return False
            grown = min(self.max_backoff_s, self._late_backoff_s * self.factor)
            self.late_opens += 1
            self._open_locked(grown or self.first_backoff_s, late=True)
            return True

    def _probe_failed_locked(self, *, late: bool) -> None:
        self._probing = False
        self.probe_failures += 1
        self._opened_late = late
        self._backoff_s = min(self.max_backoff_s, self._backoff_s * self.factor)
        self._next_window_locked()

    def _open_locked(self, backoff_s: float, *, late: bool) -> None:
        self._open = True
        self._opened_late = late
        self.opens += 1
        self._backoff_s = backoff_s
        self._next_window_locked()

    def _next_window_locked(self) -> None:
        self._failures = self._late = 0
        self._retry_at_s = self.clock() + self._backoff_s
        self._window += 1

    def abandoned(self, ticket: Ticket) -> None:
        """A call that ended with neither outcome (interrupted): frees the probe slot."""
        with self._lock:
            if ticket.probe and ticket.window == self._window:
                self._probing = False

    # --- reporting ----------------------------------------------------------------------------
    @property
    def backoff_s(self) -> float:
        with self._lock:
            return self._backoff_s

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            now_s = self.clock()
            return {
                "state": self._state_locked(now_s),
                "backoff_s": self._backoff_s,
                "retry_in_s": max(0.0, self._retry_at_s - now_s) if self._open else 0.0,
                "probing": self._probing,
                "opens": self.opens,
                "probes": self.probes,
                "probe_failures": self.probe_failures,
                # openings for answers past their deadline (among ``opens``), and such answers
                "late_opens": self.late_opens,
                "late_answers": self.late_answers,
                "first_backoff_s": self.first_backoff_s,
                "max_backoff_s": self.max_backoff_s,
            }


def _positive_seconds(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{what} must be finite and > 0, got {value!r}")
    return float(value)
