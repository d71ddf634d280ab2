"""Storing new chunks behind the request: an engine hands them over and answers at once.

A miss computes KV the agent does not hold; sending it used to sit between one request and the
next. ``WriteBehind`` takes a job (which chunks, and how to pack each to host bytes), answers a
``Future`` at once, and a background thread on its own connection to the agent asks which
chunks are still missing, packs them in batches and puts them: on a same-host agent each run of
consecutive chunks is packed in one operation straight into the staging segment the agent
copies from (``StoreJob.pack_into``), so a chunk is copied once on its way to the agent and once
into the arena. A full queue drops the new job (counted) rather than make the engine wait or
hold unbounded KV. Nothing here is torch-specific: the job's ``pack`` / ``pack_into`` does the
device work on this thread. Each call to the agent has a deadline (``kvctl.engines.deadlines``;
a put's sized to its bytes), so a hung agent costs a job about a second, not the connection's
socket timeout per call, and the queue behind it keeps moving (to drops, counted).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kvctl.client import AgentError, ClientOutOfMemory, DataClient
from kvctl.engines.deadlines import ANSWER_SECONDS, answer_seconds
from kvctl.engines.spans import spans
from kvctl.store.tiers.base import copy_bytes

log = logging.getLogger(__name__)

#: bytes packed per put request: large enough to amortize a round trip, small enough that a
#: batch's host copy stays modest
BATCH_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class Stored:
    """What one job stored: chunks and bytes, and seconds from hand-over to the last put."""

    chunks: int
    bytes: int
    seconds: float
    #: why nothing was stored, if so ("queue full", the agent's error, ...)
    skipped: str = ""


@dataclass(slots=True)
class StoreJob:
    tenant: str
    keys: Sequence[bytes]
    #: indices into ``keys`` of the chunks to store unless the agent holds them already
    indices: Sequence[int]
    parents: Sequence[bytes | None]
    chunk_tokens: int
    chunk_bytes: int
    #: chunk index -> its bytes on the host (anything with the buffer protocol)
    pack: Callable[[int], Any]
    #: ``(first, count, out)``: writes chunks ``first .. first+count-1``, back to back, into
    #: ``out`` (``count x chunk_bytes``; on a same-host agent: the staging segment it copies
    #: from), so no host buffer of their own comes between; used instead of ``pack`` when set
    pack_into: Callable[[int, int, memoryview], None] | None = None
    #: runs on the writer thread before the first pack (e.g. wait for the device's work)
    prepare: Callable[[], None] | None = None
    #: runs on the writer thread after the last put, whatever happened (release device memory)
    finish: Callable[[], None] | None = None
    #: sends what the engine measured, on the writer's connection before the job's puts
    report: Callable[[DataClient], None] | None = None
    queued_s: float = field(default_factory=time.perf_counter)
    future: Future[Stored] = field(default_factory=Future)


def _filler(job: StoreJob, batch: Sequence[int]) -> Callable[[memoryview], None]:
    """``put_packed``'s ``fill_many`` for one batch: its chunks back to back into ``out``, each
    run of consecutive indices packed there in one call (``pack_into``), or each chunk packed,
    then copied."""
    size = job.chunk_bytes

    def fill(out: memoryview) -> None:
        at = 0
        for first, end in spans(batch):
            count = end - first
            region = out[at * size : (at + count) * size]
            if job.pack_into is not None:
                job.pack_into(first, count, region)
            else:
                for n in range(count):
                    data = memoryview(job.pack(first + n))
                    if data.nbytes != size:
                        raise ValueError(
                            f"chunk {first + n} packed to {data.nbytes} bytes, not {size}"
                        )
                    copy_bytes(region[n * size : (n + 1) * size], data)
            at += count

    return fill


#: at exit, how long the writers may take together to write what was handed to them
EXIT_WAIT_SECONDS = 10.0
#: writers whose thread runs: closed at exit (their daemon threads would otherwise be stopped
#: mid-job, losing what was queued, and a thread stopped inside torch aborts the process)
_LIVE: weakref.WeakSet[WriteBehind] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    deadline_s = time.monotonic() + EXIT_WAIT_SECONDS
    for writer in list(_LIVE):
        writer.close(timeout_s=_left(deadline_s) or 0.0)


def _left(deadline_s: float | None) -> float | None:
    """Seconds to ``deadline_s`` (monotonic; None: no deadline), never below 0."""
    return None if deadline_s is None else max(0.0, deadline_s - time.monotonic())


class WriteBehind:
    """One writer thread and connection per engine; jobs are written in the order given."""

    def __init__(
        self,
        client: DataClient,
        *,
        max_pending_jobs: int = 4,
        on_staging: Callable[[mmap.mmap | None], None] | None = None,
    ) -> None:
        self._source = client
        #: set as ``DataClient.on_staging`` on each connection the writer makes
        self._on_staging = on_staging
        self._client: DataClient | None = None
        self._jobs: queue.Queue[StoreJob | None] = queue.Queue(maxsize=max_pending_jobs)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: one close at a time: a second (the exit's, while a dropped engine's finalizer closes
        #: in the background) waits for the first instead of closing the connection under a job
        self._closing = threading.Lock()
        #: a close is stopping the thread: new jobs are refused until it has ended
        self._stopping = False
        #: the thread's stop (None) is queued: a later close must not queue another
        self._stop_sent = False
        self.dropped_jobs = 0
        self.failed_jobs = 0

    def submit(self, job: StoreJob) -> Future[Stored]:
        """Queue ``job``; its future resolves when it is written (or skipped, never raises)."""
        with self._lock:  # checked and queued at once: a close cannot slip its stop before it
            if not self._start_locked():
                skipped = "write-behind closing"
            else:
                try:
                    self._jobs.put_nowait(job)
                    return job.future
                except queue.Full:
                    self.dropped_jobs += 1
                    skipped = "write-behind queue full"
        self._skip(job, skipped)
        return job.future

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every job queued so far is written; False on timeout. The timeout holds
        from the start: a full queue behind a hung agent waits no longer than it."""
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        marker = StoreJob("", (), (), (), 0, 0, pack=lambda i: b"")
        with self._lock:
            if not self._start_locked():  # closing: what was queued is the close's to wait for
                return False
        try:
            # (a close's stop may come first now: the close then resolves the marker)
            self._jobs.put(marker, timeout=_left(deadline_s))  # flushing is waiting
            marker.future.result(timeout=_left(deadline_s))
        except (TimeoutError, queue.Full):
            return False
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what was queued (within ``timeout_s``), stop the thread, close the connection.
        A thread still writing at the timeout keeps its connection and runs on; a later close
        waits for it again. Closes at once wait for each other, within their own timeouts."""
        deadline_s = time.monotonic() + timeout_s
        if not self._closing.acquire(timeout=timeout_s):
            log.warning("another close of the write-behind did not end in %.0f s", timeout_s)
            return
        try:
            with self._lock:
                thread = self._thread
                self._stopping = thread is not None
            if thread is not None:
                if not self._stop_sent:
                    with contextlib.suppress(queue.Full):  # told now, or by a later close
                        self._jobs.put(None, timeout=_left(deadline_s))
                        self._stop_sent = True
                thread.join(_left(deadline_s))
                if thread.is_alive():
                    # still writing: closing its connection now would unmap (and, on CUDA,
                    # unregister) the staging segment under its copy; it closes with the process
                    log.warning(
                        "the write-behind thread did not finish in %.0f s; left running", timeout_s
                    )
                    return
                with self._lock:  # ended: a later submit starts a new one
                    self._thread = None
                    self._stopping = self._stop_sent = False
                    left = self._drain_locked()
                for job in left:  # a flush's marker that came after the stop
                    self._skip(job, "write-behind closing")
            if self._client is not None:
                self._client.close()
                self._client = None
        finally:
            self._closing.release()

    # --- the writer thread -------------------------------------------------------------------
    def _start_locked(self) -> bool:
        """Under ``_lock``: start the thread if none runs; False while a close is stopping it.
        A thread that ended since a close gave up waiting for it is replaced (the close had
        left it its connection): the writer takes jobs again."""
        thread = self._thread
        if self._stopping:
            if thread is not None and thread.is_alive():
                return False
            self._thread = thread = None
            self._stopping = self._stop_sent = False
        if thread is None:
            self._thread = threading.Thread(
                target=self._run, name="kvctl-write-behind", daemon=True
            )
            self._thread.start()
            _LIVE.add(self)
        return True

    def _drain_locked(self) -> list[StoreJob]:
        """Under ``_lock``: the jobs left in the queue (the thread has ended)."""
        left: list[StoreJob] = []
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return left
            if job is not None:
                left.append(job)

    @classmethod
    def _skip(cls, job: StoreJob, why: str) -> None:
        cls._done(job, Stored(0, 0, 0.0, skipped=why))
        if job.finish is not None:
            job.finish()

    def close_in_background(self) -> None:
        """``close`` from a thread of its own, for a finalizer: its owner was collected without
        closing it, and waiting here for the jobs queued would block whatever thread collected
        it."""
        threading.Thread(target=self.close, name="kvctl-write-behind-close", daemon=True).start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._done(job, self._write(job))
            except Exception as exc:  # never lose the thread: the next job may succeed
                self.failed_jobs += 1
                log.warning("kvctl store failed; the next request will prefill again: %s", exc)
                self._done(job, Stored(0, 0, time.perf_counter() - job.queued_s, skipped=str(exc)))
            finally:
                if job.finish is not None:
                    job.finish()
                # not held while waiting for the next: a job's packers hold the request's whole
                # KV cache and their engine (and so its mapping of the agent's arena)
                job = None

    def _connection(self) -> DataClient:
        if self._client is None or self._client.closed:
            self._client = self._source.reconnect(hello_timeout_s=ANSWER_SECONDS)
            self._client.on_staging = self._on_staging
        return self._client

    def _write(self, job: StoreJob) -> Stored:
        if job.report is not None:
            try:
                client = self._connection()
                with client.timeout(ANSWER_SECONDS):
                    job.report(client)
            except AgentError as exc:  # a report is advice: its loss costs nothing stored
                self._drop_connection()
                log.debug("could not report engine rates: %s", exc)
        if not job.indices:
            return Stored(0, 0, time.perf_counter() - job.queued_s)
        try:
            client = self._connection()
            with client.timeout(ANSWER_SECONDS):
                held = client.exists([job.keys[i] for i in job.indices], tenant=job.tenant)
        except AgentError as exc:
            self._drop_connection()
            raise exc
        todo = [i for i, h in zip(job.indices, held, strict=True) if h is None]
        if job.prepare is not None:
            job.prepare()
        stored = 0
        per_batch = max(1, BATCH_BYTES // max(job.chunk_bytes, 1))
        for at in range(0, len(todo), per_batch):
            batch = todo[at : at + per_batch]
            try:
                # the put's deadline holds the send and the agent's answer, not the packing
                with client.timeout(answer_seconds(len(batch) * job.chunk_bytes)):
                    outcomes = client.put_packed(
                        [job.keys[i] for i in batch],
                        [job.chunk_bytes] * len(batch),
                        fill_many=_filler(job, batch),
                        tenant=job.tenant,
                        parents=[job.parents[i] for i in batch],
                        tokens=job.chunk_tokens,
                        depths=batch,
                    )
            except ClientOutOfMemory:
                # this process's memory, before anything was sent: the connection is in step
                # and keeps its staging back-off; a new one would map the arena and try a
                # segment again, on a process already short of memory
                raise
            except AgentError:
                self._drop_connection()
                raise
            stored += sum(o.status == "stored" for o in outcomes)
        return Stored(stored, stored * job.chunk_bytes, time.perf_counter() - job.queued_s)

    def _drop_connection(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    @staticmethod
    def _done(job: StoreJob, result: Stored) -> None:
        if not job.future.done():
            job.future.set_result(result)
