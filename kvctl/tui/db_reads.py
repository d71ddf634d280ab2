"""`kvctl top`'s reads of the fleet database, kept from holding up the live view.

A database host that drops off the network holds a new connection for the connect timeout
(``PG_CONNECT_TIMEOUT_SECONDS``) and a query on a kept-open one for as long as TCP retransmits
(minutes), while the agents, which the view asks directly, are all still there. So each read
runs on a thread of its own: a poll waits for it up to :data:`DB_WAIT_S`, then goes on with
what was last read and says why. While a read is still out, or after one failed, a poll does
not wait at all: it starts one read (never a second while one is out) and looks at how that
ended at the next poll, so a database that answers again is waited for again from then on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvctl.daemon_pool import DaemonPool

T = TypeVar("T")

#: how long a poll waits for the fleet database before going on without it: far above a
#: healthy read (milliseconds), far below a dropped host's connect timeout
DB_WAIT_S = 5.0


class DatabaseUnavailable(Exception):
    """The database failed a read (the failure's words), or has not answered one yet."""


class DbReads:
    """Database reads with a bounded wait (see the module). ``read`` returns a read's result,
    or raises :class:`DatabaseUnavailable` where it raised one of ``failures`` (described by
    ``describe``) or did not answer in time; anything else it raised propagates."""

    def __init__(
        self,
        failures: tuple[type[Exception], ...],
        describe: Callable[[Exception], str] = str,
        *,
        wait_s: float = DB_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failures, self.describe = failures, describe
        self.wait_s = wait_s
        self._clock = clock
        self._pool = DaemonPool(1, "top-database")
        self._out: Future[Any] | None = None  # a read not waited for to its end
        self._out_since_s = 0.0
        self._failing: str | None = None  # how the last read ended, where it failed

    def read(self, fn: Callable[[], T]) -> T:
        out = self._out
        if out is not None:
            if not out.done():
                raise DatabaseUnavailable(self._late())
            self._out = None  # how it ended says whether the database answers again
            exc = out.exception()
            if exc is not None and not isinstance(exc, self.failures):
                raise exc
            self._failing = None if exc is None else self.describe(exc)
        fut = self._pool.submit(fn)
        submitted_s = self._clock()
        if self._failing is not None:  # failing: ask again, look at the next poll, wait not
            self._out, self._out_since_s = fut, submitted_s
            raise DatabaseUnavailable(self._failing)
        try:
            return fut.result(timeout=self.wait_s)
        except FutureTimeout:
            self._out, self._out_since_s = fut, submitted_s
            self._failing = self._late()
            raise DatabaseUnavailable(self._failing) from None
        except self.failures as exc:
            self._failing = self.describe(exc)
            raise DatabaseUnavailable(self._failing) from exc

    def _late(self) -> str:
        return f"no answer in {self._clock() - self._out_since_s:.0f} s (still waiting for it)"

    def close(self) -> None:
        self._pool.shutdown()
