"""A thread pool whose threads never hold up the process's exit."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


class DaemonPool:
    """Up to ``max_workers`` daemon threads running submitted calls, started as calls come and
    reused while the pool lives.

    Daemon, unlike concurrent.futures' threads, which are joined at interpreter exit: a call
    stuck in a hung agent held a Ctrl-C'd command (`kvctl status`, `kvctl collect --once`) for
    its whole request timeout. So only calls that an exit may drop belong here: ones that ask
    (an agent, a router), their answers used by the caller's thread."""

    def __init__(self, max_workers: int, name: str) -> None:
        self._max_workers, self._name = max_workers, name
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]
        self._jobs = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one per thread waiting for a job
        self._lock = threading.Lock()
        self._threads = 0
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._name} pool is closed")
            self._jobs.put((fut, partial(fn, *args)))
            # a thread waiting takes it; otherwise one more, up to max_workers
            if not self._idle.acquire(timeout=0) and self._threads < self._max_workers:
                self._threads += 1
                name = f"{self._name}-{self._threads}"
                threading.Thread(target=self._work, name=name, daemon=True).start()
        return fut

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fut, call = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(call())
                except BaseException as exc:  # the calls catch a node's failures: a bug
                    fut.set_exception(exc)
            self._idle.release()

    def shutdown(self) -> None:
        """Cancel the calls not started; those under way end on their own (not waited for)."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
            for _ in range(self._threads):
                self._jobs.put(None)  # each thread ends once its call is over
