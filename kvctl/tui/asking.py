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

import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvctl.interrupts import wait_interruptibly

T = TypeVar("T")

#: threads asking at the same time, at most (an agent has one call in flight at a time)
MAX_THREADS = 64


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


class _Workers(Generic[T]):
    """A pool of daemon threads (concurrent.futures' are joined at exit: a call stuck in a hung
    agent would keep the process from ending)."""

    def __init__(self, max_threads: int, name: str) -> None:
        self._max, self._name = max_threads, name
        self._jobs: queue.SimpleQueue[tuple[Future[Answer[T]], Callable[[], Answer[T]]] | None]
        self._jobs = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads = 0

    def submit(self, fn: Callable[[], Answer[T]]) -> Future[Answer[T]]:
        fut: Future[Answer[T]] = Future()
        self._jobs.put((fut, fn))
        if self._idle.acquire(blocking=False):  # a thread waiting for work takes it
            return fut
        with self._lock:
            if self._threads < self._max:
                self._threads += 1
                threading.Thread(
                    target=self._work, name=f"{self._name}-{self._threads}", daemon=True
                ).start()
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn = job
            if fut.set_running_or_notify_cancel():
                fut.set_result(fn())  # fn never raises: its failure is in the Answer
            self._idle.release()

    def close(self) -> None:
        """Let every thread end once its call is over; waits for none."""
        with self._lock:
            for _ in range(self._threads):
                self._jobs.put(None)
            self._threads = self._max  # no new thread after closing


class Calls(Generic[T]):
    """Calls keyed by what they ask (see the module's docstring). ``clock`` stamps answers."""

    def __init__(
        self,
        *,
        max_threads: int = MAX_THREADS,
        clock: Callable[[], float] = time.time,
        name: str = "kvctl-ask",
    ) -> None:
        self._workers: _Workers[T] = _Workers(max_threads, name)
        # every call in flight stays here while rounds wait for it, so a round started
        # meanwhile (another thread's: two page workers asking one node) joins it, never
        # makes a second call to a hung agent; the lock makes each round's bookkeeping whole
        self._pending: dict[str, _Call[T]] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def start(self, jobs: Mapping[str, Callable[[], T] | None]) -> Round[T]:
        """Make this poll's calls (none for a key whose previous call still runs, nor for a
        key whose job is None: its call in flight or late answer is still collected); the
        round's :meth:`Round.answers` waits for them. A key left out is forgotten."""
        late: dict[str, Answer[T]] = {}
        calls: dict[str, _Call[T]] = {}
        with self._lock:
            for key in set(self._pending) - set(jobs):  # no longer asked (left the inventory)
                del self._pending[key]
            for key, fn in jobs.items():
                prev = self._pending.get(key)
                if prev is not None and not prev.future.done():
                    prev.rounds += 1  # still asking: never a second call to a hung agent
                    calls[key] = prev
                    continue
                if prev is not None:
                    del self._pending[key]
                    if prev.rounds == 0:  # back after every round that waited for it ended
                        late[key] = _late(prev.future.result())
                if fn is not None:
                    call = _Call(self._workers.submit(self._timed(fn)), time.perf_counter())
                    calls[key] = self._pending[key] = call
        return Round(self._lock, self._pending, calls, late)

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
        with self._lock:
            self._pending.clear()
        self._workers.close()


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
    ) -> None:
        self._lock, self._pending, self._calls, self._late = lock, pending, calls, late

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
                if call.future.done():
                    out[key] = call.future.result()
                    if self._pending.get(key) is call:  # handed over in time: not late
                        del self._pending[key]
                    continue
                # still running: it stays in flight for the next poll (unless forgotten)
                waiting: Answer[T] = Answer(waiting_s=time.perf_counter() - call.asked_s)
                out[key] = self._late.get(key, waiting)
        for key, late in self._late.items():
            out.setdefault(key, late)
        return out
