"""A thread pool whose threads never hold up the process's exit."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")

#: threads of a pool given ``overflow_after_s``, at most, by default
MAX_THREADS_TOTAL = 256
#: a thread past a pool's ``max_workers`` ends once idle this long
IDLE_THREAD_S = 10.0

_Job = tuple[Future[Any], Callable[[], Any], float]


class DaemonPool:
    """Up to ``max_workers`` daemon threads running submitted calls in the order submitted,
    started as calls come and reused while the pool lives.

    Daemon, unlike concurrent.futures' threads, which are joined at interpreter exit: a call
    stuck in a hung agent held a Ctrl-C'd command (`kvctl status`, `kvctl collect --once`) for
    its whole request timeout. So only calls that an exit may drop belong here: ones that ask
    (an agent, a router), their answers used by the caller's thread.

    With ``overflow_after_s``, a call that has waited that long for a thread gets one of its
    own, up to ``max_threads`` threads in all (and a call that finds one of those idle takes
    it); a thread past ``max_workers`` ends once idle for ``idle_s``. Without it, agents that
    all hang at once (a DC's link down) held every thread for a request timeout each, and the
    calls to the agents that answer, queued behind theirs, started only once those timed out:
    too late for the cycle or the refresh that waited for them. While calls wait for a thread,
    one more thread (``NAME-overflow``) waits for the first of them to be due; it ends once
    none waits."""

    def __init__(
        self,
        max_workers: int,
        name: str,
        *,
        overflow_after_s: float | None = None,
        max_threads: int = MAX_THREADS_TOTAL,
        idle_s: float = IDLE_THREAD_S,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        self._max_workers, self._name = max_workers, name
        self._overflow_after_s = overflow_after_s
        self._max_threads = (
            max(max_workers, max_threads) if overflow_after_s is not None else max_workers
        )
        self._idle_s = idle_s
        self._lock = threading.Lock()
        #: idle threads wait on this one, the overflow watcher on the other (same lock): a
        #: notify meant for a thread never wakes the watcher instead
        self._work_cond = threading.Condition(self._lock)
        self._watch_cond = threading.Condition(self._lock)
        #: calls not started yet: (future, call, when submitted)
        self._queue: deque[_Job] = deque()
        #: calls given to idle threads, each taken by the first to wake
        self._handed: deque[_Job] = deque()
        self._threads = 0  # alive, the watcher aside
        self._idle = 0  # threads waiting for a call (none handed to them)
        self._running = 0  # calls started (running, or handed to a thread)
        self._made = 0
        self._watching = False
        self._closed = False

    @property
    def threads(self) -> int:
        """Threads alive (running a call or idle), the overflow watcher aside."""
        with self._lock:
            return self._threads

    @property
    def queued(self) -> int:
        """Calls waiting for a thread."""
        with self._lock:
            return len(self._queue)

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._name} pool is closed")
            self._queue.append((fut, partial(fn, *args), time.monotonic()))
            try:
                self._dispatch_locked()
            except RuntimeError:  # no thread at all to be had: no thread would ever take it
                self._queue.remove(next(j for j in self._queue if j[0] is fut))
                raise
        return fut

    def _dispatch_locked(self) -> float | None:
        """Start the calls that may start: on an idle thread, on a new one up to
        ``max_workers``, or on one of its own once due. Seconds until the next queued call is
        due a thread of its own (None: none will be, unless a thread comes free). Raises
        RuntimeError only where no thread could be started and none is alive."""
        if self._closed:
            return None
        now = time.monotonic()
        after_s = self._overflow_after_s
        while self._queue and self._running < self._max_threads:
            due = after_s is not None and now - self._queue[0][2] >= after_s
            if self._running >= self._max_workers and not due and not self._idle:
                break
            job = self._queue.popleft()
            self._running += 1
            if self._idle:
                self._idle -= 1
                self._handed.append(job)
                self._work_cond.notify()
                continue
            self._made += 1
            thread = threading.Thread(
                target=self._work, args=(job,), name=f"{self._name}-{self._made}", daemon=True
            )
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: the call waits for one that ends
                self._running -= 1
                self._queue.appendleft(job)
                if self._threads == 0:
                    raise
                return None
            except BaseException:  # (a Ctrl-C within start: counted as started, as it was)
                self._threads += 1
                raise
            self._threads += 1
        if not self._queue:
            if self._watching:
                self._watch_cond.notify()  # none waits: the watcher ends
            return None
        if after_s is None or self._running >= self._max_threads:
            return None
        if not self._watching:
            watcher = threading.Thread(
                target=self._watch, name=f"{self._name}-overflow", daemon=True
            )
            try:
                watcher.start()
            except RuntimeError:  # none to be had now: a thread that ends tries again
                return None
            self._watching = True
        return max(0.0, self._queue[0][2] + after_s - now)

    def _watch(self) -> None:
        """Give each queued call its own thread once due, while calls wait."""
        with self._lock:
            try:
                while not self._closed:
                    due_in_s = self._dispatch_locked()
                    if due_in_s is None:
                        break
                    self._watch_cond.wait(due_in_s)
            finally:
                self._watching = False

    def _work(self, job: _Job | None) -> None:
        while job is not None:
            fut, call, _ = job
            job = None
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(call())
                except BaseException as exc:  # the calls catch a node's failures: a bug
                    fut.set_exception(exc)
            del fut, call  # (a call's arguments are not kept while idle)
            with self._lock:
                self._running -= 1
                job = self._next_locked()

    def _next_locked(self) -> _Job | None:
        """This thread's next call, once one is handed to it; None: it ends (the pool closed,
        or idle for ``idle_s`` with more threads than ``max_workers``)."""
        self._idle += 1
        self._dispatch_locked()  # a call waiting for this thread's place (never raises: alive)
        while not self._handed:
            if self._closed:
                break
            extra = self._threads > self._max_workers
            woken = self._work_cond.wait(self._idle_s if extra else None)
            if not woken and not self._handed and self._threads > self._max_workers:
                break
        else:
            return self._handed.popleft()  # (the dispatch that handed it took the idle count)
        self._idle -= 1
        self._threads -= 1
        return None

    def shutdown(self) -> None:
        """Cancel the calls not started; those under way end on their own (not waited for).
        The futures are cancelled once the pool's lock is let go: a future runs its done
        callbacks as it is cancelled, and one that called the pool (a submit, ``queued``)
        waited for ever for the lock held around it."""
        with self._lock:
            self._closed = True
            queued = [fut for fut, _, _ in self._queue]
            handed = [fut for fut, _, _ in self._handed]
            self._queue.clear()
            self._work_cond.notify_all()  # idle threads end; the others once their call is over
            self._watch_cond.notify_all()
        for fut in queued:  # out of the queue: no thread takes them now
            # notified too, as an executor's are: concurrent.futures.wait() counts a future
            # done once notified only, and waited for ever on one merely cancelled
            if fut.cancel():
                fut.set_running_or_notify_cancel()
        for fut in handed:
            # the thread it was handed to notifies it (twice would raise); one that started it
            # first runs it, as a call under way
            fut.cancel()
