"""Asking many agents at once without waiting on the slowest one.

Each key (an agent, the router) has at most one call in flight. A poll waits for its calls up to
its own deadline; a key whose call is still running then gets the late answer of its previous
call if one came in since (read at its own time), else "no answer yet". So a hung agent (stopped,
overloaded, trickling its answer byte by byte, which no per-read timeout ends) costs its own row,
never the refresh of the others. The calls run on daemon threads: one stuck in a hung agent never
holds up quitting the view. Threads may share one :class:`Calls` (a node page's workers): a
round started while another waits joins its call in flight, never makes a second one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvctl.daemon_pool import MAX_THREADS_TOTAL, DaemonPool
from kvctl.interrupts import wait_interruptibly

T = TypeVar("T")

#: threads asking at the same time, at most (an agent has one call in flight at a time), in
#: each of a :class:`Calls`' two pools (its keys that answered, those that did not); past it,
#: see ``OVERFLOW_AFTER_S``
MAX_THREADS = 64
#: a call to a key that answered that has waited this long for a thread gets one of its own
#: (up to ``kvctl.daemon_pool.MAX_THREADS_TOTAL``): agents that answered and all hang at once
#: (a DC's link down) held every thread for a request timeout each, and the agents that answer
#: were shown "still asking" behind them. 64 threads asking agents that answer in 10 ms take
#: 3,200 calls in this time: a fleet that answers never gets there
OVERFLOW_AFTER_S = 0.5


@dataclass(frozen=True, slots=True)
class Answer(Generic[T]):
    """One key's outcome at a poll: ``value`` or ``error`` once its call came back (at
    ``at_s``, epoch seconds), else ``waiting_s``: how long the call in flight has run."""

    value: T | None = None
    error: Exception | None = None
    at_s: float | None = None
    elapsed_s: float = 0.0
    waiting_s: float | None = None
    #: the answer of a call an earlier poll made, which came back after that poll's deadline
    late: bool = False

    @property
    def waiting(self) -> bool:
        return self.waiting_s is not None


@dataclass(slots=True)
class _Call(Generic[T]):
    future: Future[Answer[T]]
    asked_s: float  # perf_counter
    #: rounds waiting for it: once back, its answer is theirs to hand over, not a late one
    rounds: int = 1


class Calls(Generic[T]):
    """Calls keyed by what they ask (see the module's docstring). ``clock`` stamps answers.

    A key whose last call failed (a hung agent's, at its timeout) is asked on a pool of its
    own (``max_threads``, no more): a DC's agents that all hang hold those threads, never the
    threads of the agents that answer. Those, on the other pool, get a thread of their own
    past ``max_threads`` once a call has waited ``overflow_after_s`` for one, up to
    ``max_threads_total``: the agents that hang together the first time (they answered before)
    are still on it."""

    def __init__(
        self,
        *,
        max_threads: int = MAX_THREADS,
        overflow_after_s: float | None = OVERFLOW_AFTER_S,
        max_threads_total: int = MAX_THREADS_TOTAL,
        clock: Callable[[], float] = time.time,
        name: str = "kvctl-ask",
    ) -> None:
        self._pool = DaemonPool(
            max_threads, name, overflow_after_s=overflow_after_s, max_threads=max_threads_total
        )
        self._failing_pool = DaemonPool(max_threads, f"{name}-failing")
        # every call in flight stays here while rounds wait for it, so a round started
        # meanwhile (another thread's: two page workers asking one node) joins it, never
        # makes a second call to a hung agent; the lock makes each round's bookkeeping whole
        self._pending: dict[str, _Call[T]] = {}
        #: keys whose last call failed
        self._failing: set[str] = set()
        self._lock = threading.Lock()
        self._clock = clock
        self._closed = False

    def start(self, jobs: Mapping[str, Callable[[], T] | None]) -> Round[T]:
        """Make this poll's calls (none for a key whose previous call still runs, nor for a
        key whose job is None: its call in flight or late answer is still collected); the
        round's :meth:`Round.answers` waits for them. A key left out is forgotten."""
        late: dict[str, Answer[T]] = {}
        calls: dict[str, _Call[T]] = {}
        with self._lock:
            for key in set(self._pending) - set(jobs):  # no longer asked (left the inventory)
                del self._pending[key]
            self._failing &= set(jobs)
            for key, fn in jobs.items():
                prev = self._pending.get(key)
                if prev is not None and not prev.future.done():
                    prev.rounds += 1  # still asking: never a second call to a hung agent
                    calls[key] = prev
                    continue
                if prev is not None:
                    del self._pending[key]
                    if not prev.future.cancelled():
                        answer = _noted(self._failing, key, prev.future.result())
                        if prev.rounds == 0:  # back after every round that waited for it ended
                            late[key] = _late(answer)
                if fn is not None:
                    call = _Call(self._submit(key, self._timed(fn)), time.perf_counter())
                    calls[key] = self._pending[key] = call
        return Round(self._lock, self._pending, calls, late, self._failing)

    def _submit(self, key: str, run: Callable[[], Answer[T]]) -> Future[Answer[T]]:
        if self._closed:  # (a poll finishing as the view quits: no call, no answer)
            fut: Future[Answer[T]] = Future()
            # notified too: concurrent.futures.wait() (a round off the main thread) counts a
            # future done once notified only, and waited for ever on one merely cancelled
            fut.cancel()
            fut.set_running_or_notify_cancel()
            return fut
        pool = self._failing_pool if key in self._failing else self._pool
        return pool.submit(run)

    def _timed(self, fn: Callable[[], T]) -> Callable[[], Answer[T]]:
        def run() -> Answer[T]:
            t0 = time.perf_counter()
            try:
                value = fn()
            except Exception as exc:  # the agent's failure, this key's answer
                return Answer(error=exc, at_s=self._clock(), elapsed_s=time.perf_counter() - t0)
            return Answer(value=value, at_s=self._clock(), elapsed_s=time.perf_counter() - t0)

        return run

    def close(self) -> None:
        """Calls not started are dropped; those under way end on their own (daemon threads,
        never waited for)."""
        with self._lock:
            self._closed = True
            self._pending.clear()
        self._pool.shutdown()
        self._failing_pool.shutdown()


def _noted(failing: set[str], key: str, answer: Answer[T]) -> Answer[T]:
    """``answer``, the key noted as failing where it failed (its next call on the failing
    pool), else as answering."""
    if answer.error is None:
        failing.discard(key)
    else:
        failing.add(key)
    return answer


def _late(a: Answer[T]) -> Answer[T]:
    return Answer(a.value, a.error, a.at_s, a.elapsed_s, None, late=True)


class Round(Generic[T]):
    """One poll's calls, from :meth:`Calls.start`."""

    def __init__(
        self,
        lock: threading.Lock,
        pending: dict[str, _Call[T]],
        calls: dict[str, _Call[T]],
        late: dict[str, Answer[T]],
        failing: set[str],
    ) -> None:
        self._lock, self._pending, self._calls, self._late = lock, pending, calls, late
        self._failing = failing

    def answers(self, deadline_s: float | None) -> dict[str, Answer[T]]:
        """Each key's answer by ``deadline_s`` (a :func:`time.perf_counter` time; None: once
        every call came back); a call still running is kept for the next poll. A key asked no
        new call has an answer only where an earlier one came back late."""
        timeout_s = None if deadline_s is None else max(deadline_s - time.perf_counter(), 0.0)
        # (a Ctrl-C on `kvctl top --json` lands here: seen within a moment, not at the deadline)
        wait_interruptibly([c.future for c in self._calls.values()], timeout_s)
        out: dict[str, Answer[T]] = {}
        with self._lock:
            for key, call in self._calls.items():
                call.rounds -= 1
                if call.future.done() and not call.future.cancelled():
                    out[key] = _noted(self._failing, key, call.future.result())
                    if self._pending.get(key) is call:  # handed over in time: not late
                        del self._pending[key]
                    continue
                # still running (or dropped as the view quit): it stays in flight for the next
                # poll (unless forgotten); how it ends says where the key's next call goes
                waiting: Answer[T] = Answer(waiting_s=time.perf_counter() - call.asked_s)
                out[key] = self._late.get(key, waiting)
        for key, late in self._late.items():
            out.setdefault(key, late)
        return out
