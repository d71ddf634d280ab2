"""Moving chunk bytes into a model's KV cache at the speed of the memory or link in between.

A reused prefix of ``n`` chunks becomes one tensor ``[layers, 2, 1, kv_heads, n*T, head_dim]``
on the engine's device: ``kv[l, 0]`` and ``kv[l, 1]`` are layer ``l``'s K and V, each contiguous,
so a cache takes them as they are. Chunks come straight from where they lie:

- from the agent's shared arena under a lease (same host): on the CPU one strided copy per run of
  adjacent chunks, from the arena into the cache; on CUDA the arena mapping is registered with
  the driver once (``cudaHostRegister``) and each run crosses the link as one asynchronous copy
  on a side stream, then is laid out on the device. No host staging copy either way. On the
  CPU the mapping's pages are faulted in from a background thread when it is first seen
  (registering does that on CUDA), so a fetch never pays a first read's page faults.
- from host buffers (chunks read over a socket): the same copies from those buffers.

On the CPU, torch spreads a large copy over its intra-op threads, so a fetch runs near a
multi-threaded memcpy of the same bytes.
"""

from __future__ import annotations

import functools
import logging
import mmap
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvctl.client import CLOSED_MESSAGE, AgentError, ArenaLeases, DataClient, LeasedChunk
from kvctl.engines.deadlines import ANSWER_SECONDS, answer_seconds
from kvctl.engines.kvformat import ChunkFormat
from kvctl.engines.spans import spans

log = logging.getLogger(__name__)

#: at most this many bytes cross the link per copy (bounds the device scratch of a long run)
MAX_RUN_BYTES = 256 << 20
#: a prefix on other nodes is pulled in at most this many slices, each copied to the device
#: while the next is pulled: more slices leave less of the last copy exposed, and each costs a
#: round trip and a pull's set-up
MAX_PULL_SLICES = 8
#: and none smaller than this (a short remote prefix is one pull)
MIN_PULL_SLICE_BYTES = 64 << 20


def host_tensor(buffer: Any) -> torch.Tensor:
    """A flat uint8 CPU tensor over ``buffer``'s memory, without copying (read-only buffers too:
    torch warns that it cannot protect them; nothing here writes through it)."""
    array = np.frombuffer(buffer, dtype=np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def runs(offsets: Sequence[int], size_bytes: int, max_run_bytes: int) -> list[tuple[int, int]]:
    """Split chunks ``0..len(offsets)`` into ``(first, count)`` runs whose bytes lie back to back
    (chunk ``i+1`` right after chunk ``i``), each at most ``max_run_bytes`` (and at least one
    chunk), so each run is one copy."""
    out: list[tuple[int, int]] = []
    per_run = max(1, max_run_bytes // max(size_bytes, 1))
    first = 0
    for i in range(1, len(offsets) + 1):
        if i == len(offsets) or offsets[i] != offsets[i - 1] + size_bytes or i - first >= per_run:
            out.append((first, i - first))
            first = i
    return out


class QueuedCopy:
    """A ``KVLoader.load_timed`` copy: done or not yet (CUDA: its end event; CPU: done when
    queued), and the seconds it took once done."""

    def __init__(self, start: Any, end: Any, seconds: float = 0.0) -> None:
        self._start, self._end, self._seconds = start, end, seconds

    def done(self) -> bool:
        return self._end is None or bool(self._end.query())

    def seconds(self) -> float:
        if self._end is None:
            return self._seconds
        return float(self._start.elapsed_time(self._end)) / 1e3


class LayerCopies:
    """A prefix's copies queued layer by layer (``KVLoader.load_layers``), so a forward pass can
    start on the first layers while the later ones are still crossing: ``ready(l)`` before
    layer ``l`` reads its KV, ``done()`` before the source may go. On CUDA the copies run on
    the loader's side stream, an event after each layer, and ``ready`` makes the caller's
    stream wait for it (the host does not block); on the CPU ``ready`` copies the layers up to
    ``l`` then, in order."""

    def __init__(
        self,
        steps: list[Callable[[], None]] | None = None,
        events: list[Any] | None = None,
        stream: Any = None,
        start: Any = None,
    ) -> None:
        self._steps = steps or []
        self._events = events or []
        self._stream = stream
        self._start = start
        self._next = 0  # CPU: the first layer not copied yet
        self._cpu_seconds = 0.0
        #: the leases the copies read under (``queue_leased``): checked once ``done``
        self.leased: Sequence[LeasedChunk] = ()
        #: what took them: a close of its client ends them all (``_still_held``)
        self.leases: ArenaLeases | None = None

    def ready(self, layer: int) -> None:
        if self._events:
            torch.cuda.current_stream(self._stream.device).wait_event(self._events[layer])
            return
        while self._next <= layer and self._next < len(self._steps):
            started_s = time.perf_counter()
            self._steps[self._next]()
            self._cpu_seconds += time.perf_counter() - started_s
            self._next += 1

    def done(self) -> None:
        """Every layer copied (blocks the host until then)."""
        if self._events:
            self._events[-1].synchronize()
        else:
            self.ready(len(self._steps) - 1)

    def abandon(self) -> None:
        """Nothing more is wanted of these copies (the request failed or is over): on the CPU
        the layers not copied yet are dropped; on CUDA the host waits for the queued ones,
        which read the arena and must end before its leases go."""
        if self._events:
            self._events[-1].synchronize()
        else:
            self._next = len(self._steps)

    def seconds(self) -> float:
        """The copies' own time, once ``done``: on CUDA from the first copy's start to the last
        layer's event on the side stream; on the CPU the layers' copies added up."""
        if self._events:
            return float(self._start.elapsed_time(self._events[-1])) / 1e3
        return self._cpu_seconds

    def held(self) -> int:
        """How many leading leased chunks' leases held until the copies were ``done``."""
        return _still_held(self.leased, self.leases)


class KVLoader:
    """Copies chunks into ``[layers, 2, 1, kv_heads, n*T, head_dim]`` tensors on ``device``."""

    def __init__(self, fmt: ChunkFormat, device: torch.device) -> None:
        self.format = fmt
        self.device = device
        self.cuda = device.type == "cuda"
        self._stream: Any = torch.cuda.Stream(device) if self.cuda else None
        #: registered host mappings: id(buffer) -> (buffer, its tensor, unregister callback)
        self._registered: dict[int, tuple[Any, torch.Tensor, Callable[[], None] | None]] = {}
        self._lock = threading.Lock()
        self.register_failures = 0
        #: (bytes, seconds) of the last copy straight from the arena: the host->device rate an
        #: engine reports, with no round trip or disk read in it
        self.last_copy: tuple[int, float] | None = None
        #: the buffer ``alloc(reuse=True)`` hands out views of (CPU only), and those views by
        #: chunk count
        self._slab: torch.Tensor | None = None
        self._views: dict[int, torch.Tensor] = {}
        #: per-layer (keys, values) views of those, by (chunks allocated, chunks used)
        self._layer_views: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        #: a copy's target views in those, by (id of the view, first chunk, chunks): with the
        #: CPU caches cold, as a request finds them, each view made costs tens of microseconds
        self._targets: dict[tuple[int, int, int], torch.Tensor | None] = {}
        #: the mapped arena's tensor and its view as the KV dtype (CPU), made once per mapping
        self._arena_typed: tuple[torch.Tensor, torch.Tensor | None] | None = None
        #: host buffer for chunks read over a socket, kept between requests (page-locked for a
        #: GPU: pinning is slow, and a fresh buffer's first touch would be timed as fetch)
        self._staging: torch.Tensor | None = None

    def staging(self, nbytes: int) -> torch.Tensor:
        host = self._staging
        if host is None or host.numel() < nbytes:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)
            self._staging = host
        return host[:nbytes]

    # --- allocation ----------------------------------------------------------------------------
    def alloc(self, chunks: int, *, reuse: bool = False) -> torch.Tensor:
        """Room for ``chunks`` chunks. ``reuse``: on the CPU, a view of one buffer kept between
        calls, for a caller that is done with the previous one before asking again (fresh host
        memory is faulted in page by page on first touch, which cost more than the copy itself:
        ~16 ms for 64 MiB against ~3 ms, measured on a 2-core VM). A GPU's caching allocator
        already hands memory back without faults."""
        lay = self.format.layout
        tokens = chunks * self.format.chunk_tokens
        shape = (lay.layers, 2, 1, lay.kv_heads, tokens, lay.head_dim)
        if not reuse or self.cuda:
            return torch.empty(shape, dtype=self.format.dtype, device=self.device)
        view = self._views.get(chunks)
        if view is not None:
            return view
        numel = lay.layers * 2 * lay.kv_heads * tokens * lay.head_dim
        if self._slab is None or self._slab.numel() < numel:
            self._slab = torch.empty(numel, dtype=self.format.dtype, device=self.device)
            self._views.clear()
            self._layer_views.clear()
            self._targets.clear()
        # kept per size: making a view costs tens of microseconds once the caches are cold
        view = self._views[chunks] = self._slab[:numel].view(shape)
        return view

    def layer_views(self, kv: torch.Tensor, chunks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's (keys, values) ``[1, kv_heads, tokens, head_dim]`` over the first
        ``chunks`` chunks of ``kv`` (from ``alloc``), without copying; kept for the reused
        buffer's views, which later requests get again."""
        tokens = chunks * self.format.chunk_tokens
        allocated = kv.shape[4] // self.format.chunk_tokens
        reused = self._views.get(allocated) is kv
        views = self._layer_views.get((allocated, chunks)) if reused else None
        if views is None:
            views = [(kv[i, 0, :, :, :tokens], kv[i, 1, :, :, :tokens]) for i in range(kv.shape[0])]
            if reused:
                self._layer_views[(allocated, chunks)] = views
        return views

    def reserve(self, chunks: int) -> None:
        """Size the buffer ``alloc(reuse=True)`` hands out for ``chunks`` chunks and fault its
        pages in now (CPU only), as an engine sizes its KV cache at start: a request that
        reuses a longer prefix than any before it must not pay the page faults of a larger
        buffer (~4x the copy's own time) in its time to first token."""
        if self.cuda or chunks <= 0:
            return
        self.alloc(chunks, reuse=True).view(-1).view(torch.uint8).fill_(0)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in the reused buffer (the caller must copy it to keep it)."""
        slab = self._slab
        if slab is None or tensor.device != slab.device:
            return False
        start = slab.untyped_storage().data_ptr()
        return start <= tensor.data_ptr() < start + slab.untyped_storage().nbytes()

    # --- host memory ---------------------------------------------------------------------------
    def arena_tensor(self, arena: Any) -> torch.Tensor:
        """The whole arena mapping as a uint8 CPU tensor, registered with CUDA for a GPU engine
        (once per mapping: the agent maps a new one when it resizes its arena)."""
        with self._lock:
            known = self._registered.get(id(arena))
            if known is not None and known[0] is arena:
                return known[1]
            for stale in [k for k, (buf, _, _) in self._registered.items() if buf is not arena]:
                self._forget(stale)
            tensor = host_tensor(arena)
            unregister = self._register(tensor) if self.cuda else self._populate(arena)
            self._registered[id(arena)] = (arena, tensor, unregister)
            if not self.cuda:
                self._arena_typed = (tensor, _typed(tensor, self.format.dtype))
            return tensor

    def attach(self, client: DataClient, *, answer_s: float = ANSWER_SECONDS) -> float | None:
        """Map ``client``'s shared arena and register it (CUDA) now, before any request needs
        it: the seconds that took, or None where there is no arena to map (TCP, shm off) or the
        agent would not map it, nor answer within ``answer_s`` (logged; the first lease maps it
        instead)."""
        started_s = time.perf_counter()
        try:
            with client.timeout(answer_s):  # registering, after the call, takes what it takes
                arena = client.shared_arena()
            if arena is None:
                return None
            self.arena_tensor(arena)
        except (AgentError, OSError, ValueError) as exc:  # ValueError: closed or remapped since
            log.warning("could not map the agent's arena at start (first read maps it): %s", exc)
            return None
        return time.perf_counter() - started_s

    def _register(self, tensor: torch.Tensor) -> Callable[[], None] | None:
        """Page-lock the mapping for the driver so copies from it run asynchronously at link
        speed; None (plain pageable copies, slower) when the driver refuses."""
        from kvctl.store.tiers.hostreg import register_host  # CUDA only; imported on first use

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        try:
            reg = register_host(tensor.numpy(), read_only=True, device=f"cuda:{index}")
        except Exception as exc:  # any refusal leaves a working, slower path
            self.register_failures += 1
            log.warning("could not register the agent's arena with CUDA (copies slower): %s", exc)
            return None
        return reg.close

    @staticmethod
    def _populate(arena: Any) -> Callable[[], None] | None:
        """Fault the mapping's pages in from a background thread (page tables only: the agent
        committed the memory), so no fetch pays a first read's page faults; registering it
        with CUDA does that for a GPU engine."""
        from kvctl.store.tiers.prefault import MADV_POPULATE_READ, Prefaulter

        if not isinstance(arena, mmap.mmap) or len(arena) <= 1:
            return None
        prefault = Prefaulter(arena, ahead_bytes=len(arena), advice=MADV_POPULATE_READ)
        prefault.want(0)
        return prefault.close  # (not stop: the client unmapping the arena next must be able to)

    def _forget(self, key: int) -> None:
        _, tensor, unregister = self._registered.pop(key)
        if self._arena_typed is not None and self._arena_typed[0] is tensor:
            self._arena_typed = None
        if unregister is not None:
            if self._stream is not None:
                self._stream.synchronize()
            unregister()

    def close(self) -> None:
        with self._lock:
            for key in list(self._registered):
                self._forget(key)

    # --- copies --------------------------------------------------------------------------------
    def load(
        self,
        src: torch.Tensor,
        offsets: Sequence[int],
        dst: torch.Tensor,
        first_chunk: int = 0,
    ) -> None:
        """Copy chunks lying at ``offsets`` (bytes) in the flat uint8 CPU tensor ``src`` into
        ``dst`` at chunk positions ``first_chunk, first_chunk+1, ...``. On CUDA the copies are
        queued on a side stream: call ``wait()`` before reading ``dst`` or reusing ``src``."""
        if self._stream is not None:
            # dst may reuse memory the caller's stream still reads: copy after that work
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        views, whole = self._split_runs(src, offsets, dst, first_chunk)
        try:
            for source, target in views:
                target.copy_(source)
            for start, at, count in whole:
                self._copy_whole(src, start, dst, at, count)
        except BaseException:
            self.wait()  # what was queued reads src and writes dst: over before either goes
            raise

    def load_timed(
        self,
        src: torch.Tensor,
        offsets: Sequence[int],
        dst: torch.Tensor,
        first_chunk: int = 0,
    ) -> QueuedCopy:
        """``load``, as a copy that says when it is done and, once it is, the seconds it took:
        on CUDA timed by events on the side stream around it, so neither the request's queued
        work nor the time until the next slice is asked for is in it."""
        if self._stream is None:
            started_s = time.perf_counter()
            self.load(src, offsets, dst, first_chunk)
            return QueuedCopy(None, None, time.perf_counter() - started_s)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self._stream)
        self.load(src, offsets, dst, first_chunk)
        end.record(self._stream)
        return QueuedCopy(start, end)

    def load_layers(
        self, src: torch.Tensor, offsets: Sequence[int], dst: torch.Tensor
    ) -> LayerCopies:
        """``load`` of chunks into ``dst`` from chunk 0, layer by layer: the returned copies say
        when each layer is complete (``LayerCopies``). On CUDA every copy is queued now on the
        side stream, layer 0 first: each chunk's part of the layer crosses the link as one
        copy into a device buffer (a chunk holds its layers one after another, so a layer's
        parts are not adjacent in the arena), then the layer is laid out on the device. That is
        layers x chunks launches, all queued before this returns (4,096 at 32k tokens on the
        8B shape): the forward pass is queued after them, and its layers still wait on the
        link only while queueing is quicker than the link. On the CPU nothing is copied until
        ``ready`` asks for a layer."""
        return self.load_layers_many([(src, offsets, dst)])[0]

    def load_layers_many(
        self, loads: Sequence[tuple[torch.Tensor, Sequence[int], torch.Tensor]]
    ) -> list[LayerCopies]:
        """``load_layers`` of several (src, offsets, dst) at once (a step's requests), queued
        layer-major on CUDA: every load's layer ``l`` before any load's layer ``l + 1``, so the
        first layer's attention waits for each request's first layer only, not for the whole
        prefix of the requests queued before it (one side stream runs its copies in order).
        Should queueing fail part way (a scratch buffer the device has no room for), what was
        queued is waited for before the error is raised: it reads the sources and writes the
        targets, which the caller then gives up."""
        if self._stream is None:
            return [LayerCopies(self._cpu_layer_steps(*load)) for load in loads]
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        starts = [torch.cuda.Event(enable_timing=True) for _ in loads]
        events: list[list[Any]] = [[] for _ in loads]
        try:
            with torch.cuda.stream(self._stream):
                for start in starts:
                    start.record(self._stream)
                for layer in range(self.format.layout.layers):
                    for (src, offsets, dst), done in zip(loads, events, strict=True):
                        self._queue_layer(src, offsets, dst, layer)
                        event = torch.cuda.Event(enable_timing=True)
                        event.record(self._stream)
                        done.append(event)
        except BaseException:
            self.wait()
            raise
        return [
            LayerCopies(events=done, stream=self._stream, start=start)
            for start, done in zip(starts, events, strict=True)
        ]

    def _queue_layer(
        self, src: torch.Tensor, offsets: Sequence[int], dst: torch.Tensor, layer: int
    ) -> None:
        """Queue layer ``layer`` of the chunks at ``offsets`` into ``dst`` on the side stream
        (the caller has made it current): each chunk's part through a device scratch buffer
        per group of chunks, then laid out on the device."""
        lay = self.format.layout
        part = self.format.chunk_bytes // lay.layers  # one layer's K and V of one chunk, bytes
        t = self.format.chunk_tokens
        per = max(1, MAX_RUN_BYTES // part)  # chunks per device scratch buffer
        for lo in range(0, len(offsets), per):
            group = offsets[lo : lo + per]
            k = len(group)
            landed = torch.empty(k * part, dtype=torch.uint8, device=self.device)
            for i, offset in enumerate(group):
                at = offset + layer * part
                landed[i * part : (i + 1) * part].copy_(src[at : at + part], non_blocking=True)
            # [k, 2, heads, T, dim] -> [2, heads, k, T, dim]
            shape = (k, 2, lay.kv_heads, t, lay.head_dim)
            target = dst[layer, :, 0, :, lo * t : (lo + k) * t, :].unflatten(2, (k, t))
            target.copy_(landed.view(self.format.dtype).view(shape).permute(1, 2, 0, 3, 4))

    def _cpu_layer_steps(
        self, src: torch.Tensor, offsets: Sequence[int], dst: torch.Tensor
    ) -> list[Callable[[], None]]:
        """Each layer's copies of the chunks at ``offsets``, to run in layer order: one strided
        copy per run of adjacent chunks per layer; a run those views cannot cover is copied
        whole in layer 0's step (the op-by-op copy ``load`` falls back on)."""
        views, whole = self._split_runs(src, offsets, dst, 0)

        def step(layer: int) -> None:
            if layer == 0:
                for start, at, count in whole:
                    self._copy_whole(src, start, dst, at, count)
            for source, target in views:
                target[layer].copy_(source[layer])

        return [functools.partial(step, layer) for layer in range(self.format.layout.layers)]

    def _split_runs(
        self, src: torch.Tensor, offsets: Sequence[int], dst: torch.Tensor, first_chunk: int
    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[int, int, int]]]:
        """The runs of adjacent chunks at ``offsets`` (into ``dst`` from ``first_chunk``): as
        (source, target) strided views where they can be made (CPU: ``_source_view``,
        ``_target_view``), the others as (start byte, chunk position, count) for the op-by-op
        copy (``_copy_whole``)."""
        item = self.format.dtype.itemsize
        typed = None if self.cuda else self._typed_source(src)
        views: list[tuple[torch.Tensor, torch.Tensor]] = []
        whole: list[tuple[int, int, int]] = []
        for first, count in runs(offsets, self.format.chunk_bytes, MAX_RUN_BYTES):
            start, at = offsets[first], first_chunk + first
            source = target = None
            if typed is not None and start % item == 0:
                target = self._target(dst, at, count)
                if target is not None:
                    source = _source_view(typed, start // item, count, self.format)
            if source is None or target is None:
                whole.append((start, at, count))
            else:
                views.append((source, target))
        return views, whole

    def _typed_source(self, src: torch.Tensor) -> torch.Tensor | None:
        """``_typed(src)``, kept for the arena's tensor (the source of nearly every copy)."""
        known = self._arena_typed
        if known is not None and known[0] is src:
            return known[1]
        return _typed(src, self.format.dtype)

    def _target(self, dst: torch.Tensor, at: int, count: int) -> torch.Tensor | None:
        """``_target_view``, kept for the views of the reused buffer (``alloc(reuse=True)``),
        which requests get again."""
        key = (id(dst), at, count)
        if key in self._targets:  # the id is that view's while ``_views`` holds it
            return self._targets[key]
        target = _target_view(dst, at, count, self.format)
        if any(view is dst for view in self._views.values()):
            self._targets[key] = target
        return target

    def _copy_whole(
        self, src: torch.Tensor, start: int, dst: torch.Tensor, at: int, count: int
    ) -> None:
        """``count`` chunks from byte ``start`` of ``src`` into ``dst`` at chunk ``at``, op by op
        (``_copy_run``)."""
        flat = src[start : start + count * self.format.chunk_bytes]
        if not self.cuda and flat.storage_offset() % self.format.dtype.itemsize:
            flat = flat.clone()  # a view as the KV dtype needs aligned bytes (CUDA views its
            # own scratch copy on the device instead)
        self._copy_run(flat, dst, at, count)

    def _copy_run(self, flat: torch.Tensor, dst: torch.Tensor, at: int, count: int) -> None:
        fmt = self.format
        t = fmt.chunk_tokens
        # [count, layers, 2, heads, T, dim] -> [layers, 2, heads, count, T, dim]
        shape = (count, *fmt.chunk_shape)
        target = dst[:, :, 0, :, at * t : (at + count) * t, :].unflatten(3, (count, t))
        if not self.cuda:
            target.copy_(flat.view(fmt.dtype).view(shape).permute(1, 2, 3, 0, 4, 5))
            return
        with torch.cuda.stream(self._stream):
            # one transfer of the run's bytes over the link, then the layout on the device
            landed = torch.empty(flat.numel(), dtype=torch.uint8, device=self.device)
            landed.copy_(flat, non_blocking=True)
            target.copy_(landed.view(fmt.dtype).view(shape).permute(1, 2, 3, 0, 4, 5))

    def wait(self) -> None:
        """Block until queued copies are done (then ``dst`` is complete and the source bytes
        may be released); the caller's stream may use ``dst`` right after."""
        if self._stream is not None:
            self._stream.synchronize()


def _typed(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The flat uint8 ``src`` viewed as ``dtype`` without copying, or None where it is not a
    contiguous uint8 vector whose length and start are whole numbers of elements."""
    item = dtype.itemsize
    if (
        src.dtype != torch.uint8
        or src.dim() != 1
        or src.stride(0) != 1
        or src.numel() % item
        or src.storage_offset() % item
    ):
        return None
    return src.view(dtype)


def _target_view(dst: torch.Tensor, at: int, count: int, fmt: ChunkFormat) -> torch.Tensor | None:
    """The ``[layers, 2, kv_heads, count, T x head_dim]`` view of ``count`` chunks' place in
    ``dst`` from chunk ``at``, matching ``_source_view``'s, so a run is one strided copy (CPU):
    the views made op by op (slice, view, unflatten, permute) made a 4-chunk run's load
    0.08-0.1 ms slower (0.72-0.79 ms against 0.64-0.69, 4 MiB after a cache flush, on a 2-core
    VM). None where ``dst`` is not a KV buffer of this format with room for them whose heads
    keep their tokens and dimensions back to back (the op-by-op copy then raises or copies)."""
    lay = fmt.layout
    t = fmt.chunk_tokens
    s = dst.stride()
    if (
        at < 0
        or dst.dim() != 6
        or tuple(dst.shape[:4]) != (lay.layers, 2, 1, lay.kv_heads)
        or dst.shape[4] < (at + count) * t
        or dst.shape[5] != lay.head_dim
        or s[5] != 1
        or s[4] != lay.head_dim
    ):
        return None
    return dst.as_strided(
        (lay.layers, 2, lay.kv_heads, count, t * lay.head_dim),
        (s[0], s[1], s[3], t * s[4], 1),
        dst.storage_offset() + at * t * s[4],
    )


def _source_view(
    typed: torch.Tensor, start: int, count: int, fmt: ChunkFormat
) -> torch.Tensor | None:
    """The ``[layers, 2, kv_heads, count, T x head_dim]`` view of ``count`` chunks lying back
    to back from element ``start`` of ``typed`` (the arena as the KV dtype); None where they
    run past it (a strided view is not bounded)."""
    lay = fmt.layout
    piece = fmt.chunk_tokens * lay.head_dim  # one head's part of one chunk, in elements
    heads = 2 * lay.kv_heads * piece
    if start < 0 or start + count * lay.layers * heads > typed.numel():
        return None
    return typed.as_strided(
        (lay.layers, 2, lay.kv_heads, count, piece),
        (heads, lay.kv_heads * piece, piece, lay.layers * heads, 1),
        typed.storage_offset() + start,
    )


def read_chunks(
    client: DataClient,
    keys: Sequence[bytes],
    tenant: str,
    loader: KVLoader,
    kv: torch.Tensor,
    *,
    answer_s: float = ANSWER_SECONDS,
) -> tuple[int, str]:
    """Chunks ``keys`` from the agent into ``kv`` (``loader.alloc(len(keys))``): how many
    leading ones arrived whole, and the path ("lease": straight from the shared arena on the
    same host; "socket"). A chunk evicted since the lookup, of the wrong size, or whose lease
    ran out before its copy finished ends the run. Each call to the agent has a deadline
    (``answer_s`` plus its bytes' time: ``deadlines.answer_seconds``). Raises AgentError
    (AgentTimeout, with the connection closed, for a call past its deadline)."""
    if not client.shm:
        return read_socket(client, keys, tenant, loader, kv, 0, answer_s=answer_s), "socket"
    loader.last_copy = None  # this read's copy only
    # in slices, as a pull from other nodes is (a LEASE pulls what is not local): a long read's
    # copies overlap the next slice's lease, disk reads and pulls. The client's pending leases
    # go with these, as its next call would release them anyway
    try:
        n, blocked, counted = pull_leased_counted(
            client, keys, tenant, loader, kv, 0, answer_s=answer_s
        )
    finally:
        with client.timeout(answer_s):
            client.release_pending()
    if blocked:  # what the holds counted is read again uncounted, the rest read (and counted)
        n += read_socket(
            client, keys[n:], tenant, loader, kv, n, counted=counted - n, answer_s=answer_s
        )
    return n, "lease"


def release_pending(client: DataClient | None, *, answer_s: float = ANSWER_SECONDS) -> None:
    """Release the leases a ``release_later`` block or ``hold`` left held, once the caller is
    done with the bytes; a failure is logged, not raised (the agent ends a lost connection's
    leases itself)."""
    if client is None:
        return
    try:
        with client.timeout(answer_s):
            client.release_pending()
    except AgentError as exc:
        log.warning("kvctl lease release failed: %s", exc)


def copy_leased(
    leases: ArenaLeases, count: int, loader: KVLoader, kv: torch.Tensor
) -> tuple[int, bool]:
    """The first ``count`` leased chunks into ``kv``, while the leases are held: how many
    leading ones arrived whole, and whether the next one is cached but could not be read in
    place (pinned in another tier, arena full, lease ran out): read it over the socket, after
    the leases are released (``read_socket``)."""
    size = loader.format.chunk_bytes
    chunks = leases.chunks
    n = leased_whole(chunks[:count], size)
    if n:
        arena = _arena_of(leases, loader)
        started_s = time.perf_counter()
        loader.load(arena, [c.offset for c in chunks[:n]], kv)  # type: ignore[union-attr]
        loader.wait()  # the copies read the arena: done before the leases end
        loader.last_copy = (n * size, time.perf_counter() - started_s)
        n = _still_held(chunks[:n], leases)  # type: ignore[arg-type]
    return n, n < count and n not in leases.missing and n not in leases.remote


def counted_run(leases: ArenaLeases, start: int, count: int) -> int:
    """How many of the leased chunks from ``start`` on (of the first ``count``) the lease
    request counted as served, leased or not (cached here but not leasable): up to the first
    one missing, or on another node and not pulled (``remote``). A re-read of those, from a
    blocked chunk on, must not count them again (``read_socket``'s ``counted``)."""
    return (
        next((i for i in range(start, count) if i in leases.missing or i in leases.remote), count)
        - start
    )


def queue_leased(
    leases: ArenaLeases, count: int, loader: KVLoader, kv: torch.Tensor
) -> LayerCopies | None:
    """The first ``count`` leased chunks' copies into ``kv``, layer by layer
    (``KVLoader.load_layers``), when every one of them is leased whole in the arena; None
    otherwise (``copy_leased`` then). The leases must hold until ``done()``: ``held()`` then
    says how many leading chunks' did (fewer: what was read of the rest may be another
    chunk's bytes)."""
    return queue_leased_many([(leases, count, kv)], loader)[0]


def queue_leased_many(
    loads: Sequence[tuple[ArenaLeases, int, torch.Tensor]], loader: KVLoader
) -> list[LayerCopies | None]:
    """``queue_leased`` of several (leases, count, kv) through one loader, their layers queued
    together (``KVLoader.load_layers_many``): None for each one not leased whole."""
    size = loader.format.chunk_bytes
    whole: list[tuple[int, list[LeasedChunk]]] = []
    for i, (leases, count, _kv) in enumerate(loads):
        chunks = leases.chunks[:count]
        if count and leased_whole(chunks, size) == count:
            whole.append((i, chunks))  # type: ignore[arg-type]
    out: list[LayerCopies | None] = [None] * len(loads)
    if not whole:
        return out
    queued = loader.load_layers_many(
        [
            (_arena_of(loads[i][0], loader), [c.offset for c in chunks], loads[i][2])
            for i, chunks in whole
        ]
    )
    for (i, chunks), copies in zip(whole, queued, strict=True):
        copies.leased, copies.leases = chunks, loads[i][0]
        out[i] = copies
    return out


def copy_past_blocked(
    client: DataClient,
    keys: Sequence[bytes],
    tenant: str,
    loader: KVLoader,
    kv: torch.Tensor,
    at: int,
    leases: ArenaLeases,
    start: int,
    *,
    answer_s: float = ANSWER_SECONDS,
) -> int:
    """The chunks ``leases`` counted from chunk ``start`` on (``counted_run``), where a copy
    from them stopped (``start`` is cached but was not leasable, or its lease ran out), into
    ``kv``: ``keys[i]`` is ``leases.chunks[i]``, for ``kv``'s chunk ``at + i``. Those leased
    whole are copied from the arena while their leases hold; the rest, and any whose lease ran
    out meanwhile, are read over the socket uncounted (``get_into(counted=True)``), so each is
    counted once. That read lets go of the client's pending leases, so it comes after the
    copies; call this before any other call on the client. How many leading chunks from
    ``start`` arrived whole."""
    size = loader.format.chunk_bytes
    end = start + counted_run(leases, start, len(keys))
    chunks = leases.chunks
    now_s = time.monotonic()
    leased: dict[int, LeasedChunk] = {
        i: c
        for i in range(start, end)
        if (c := chunks[i]) is not None and c.size_bytes == size and c.deadline_s > now_s
    }
    arrived: set[int] = set()
    if leased:
        arena = _arena_of(leases, loader)
        started_s = time.perf_counter()
        for lo, hi in spans(leased):
            loader.load(arena, [leased[i].offset for i in range(lo, hi)], kv, at + lo)
        loader.wait()  # the copies read the arena: done before the leases end
        before_bytes, before_s = loader.last_copy or (0, 0.0)
        took_s = time.perf_counter() - started_s
        loader.last_copy = (before_bytes + len(leased) * size, before_s + took_s)
        now_s = time.monotonic()  # a lease that held at the copies' end held throughout
        # none held where the client was closed meanwhile (the agent ended its leases)
        ended = leases.ended()
        arrived = {i for i, c in leased.items() if c.deadline_s > now_s and not ended}
    again = [i for i in range(start, end) if i not in arrived]
    if again:
        host = loader.staging(len(again) * size)
        flat = host.numpy()
        bufs = [flat[j * size : (j + 1) * size] for j in range(len(again))]
        with client.timeout(answer_seconds(len(again) * size, answer_s)):
            got = client.get_into([keys[i] for i in again], bufs, tenant=tenant, counted=True)
        whole = _whole(got, size)
        slot = {i: j for j, i in enumerate(again)}  # chunk -> its place in the staging buffer
        for lo, hi in spans(again[:whole]):
            loader.load(host, [slot[i] * size for i in range(lo, hi)], kv, at + lo)
        loader.wait()  # the staging buffer serves the next read
        arrived.update(again[:whole])
    n = start
    while n < end and n in arrived:
        n += 1
    return n - start


def _whole(got: Sequence[int], size_bytes: int) -> int:
    """How many leading chunks of a ``get_into`` arrived at the chunk size."""
    n = 0
    for got_bytes in got:
        if got_bytes != size_bytes:
            if got_bytes >= 0:
                log.warning(
                    "chunk of %d bytes where %d expected; not reused", got_bytes, size_bytes
                )
            break
        n += 1
    return n


class Pulled(NamedTuple):
    """What ``pull_leased_counted`` read."""

    #: leading chunks that arrived whole
    held: int
    #: the chunks from ``held`` on are for ``read_socket``: a lease ran out during its copy,
    #: or a slice that stopped at a chunk not leasable was read whole (``copy_past_blocked``)
    #: and the later slices were not asked for
    blocked: bool
    #: leading chunks the slices' holds counted as served (``held`` and on, up to the end of the
    #: last slice held or its first missing chunk): ``read_socket`` reads those again with
    #: ``counted``, so each chunk is counted once
    counted: int


def pull_leased(
    client: DataClient,
    keys: Sequence[bytes],
    tenant: str,
    loader: KVLoader,
    kv: torch.Tensor,
    at: int,
    *,
    answer_s: float = ANSWER_SECONDS,
) -> tuple[int, bool]:
    """``pull_leased_counted``'s leading chunks held and whether the next is blocked."""
    held, blocked, _counted = pull_leased_counted(
        client, keys, tenant, loader, kv, at, answer_s=answer_s
    )
    return held, blocked


def pull_leased_counted(
    client: DataClient,
    keys: Sequence[bytes],
    tenant: str,
    loader: KVLoader,
    kv: torch.Tensor,
    at: int,
    *,
    answer_s: float = ANSWER_SECONDS,
) -> Pulled:
    """Chunks ``keys`` into ``kv`` from chunk ``at`` on, in slices (``MAX_PULL_SLICES``): each
    slice is leased with ``client.hold`` (the agent reads it into its arena first where it lies
    on disk or on another node: the pool, a peer), its copy queued, and the next slice asked
    for while that copy runs. On CUDA the copies run on the side stream, so all but the last
    slice's copy hide behind the pulls; on the CPU a copy ends before the next slice is asked
    for. The leases stay held until ``client.release_pending()``. A slice that stops at a
    chunk cached but not leasable here has the rest of it copied from its leases or read
    uncounted (``copy_past_blocked``: its hold counted them), and the read ends there. How many
    leading chunks arrived whole, whether the rest is to be read with ``read_socket``, and how
    many leading chunks the holds counted as served (``Pulled``).
    Each slice's hold has a deadline sized to its bytes (it may read them from disk or pull
    them: ``deadlines.answer_seconds``, from ``answer_s``)."""
    if not keys:
        return Pulled(0, False, 0)
    size = loader.format.chunk_bytes
    slices = min(MAX_PULL_SLICES, max(1, len(keys) * size // MIN_PULL_SLICE_BYTES))
    per = -(-len(keys) // slices)
    copies: list[tuple[list[LeasedChunk], QueuedCopy]] = []
    checked = held = 0  # slices whose leases were checked; leading chunks that held
    counted = 0  # leading chunks the holds counted as served
    stop: tuple[int, Sequence[bytes], ArenaLeases, int] | None = None  # where a slice blocked
    expired = blocked = False

    def check() -> None:
        """Each copy done since the last check, in order, against its leases' deadlines
        (read once it is done: a lease that held then held throughout), so a long pull
        keeps the slices that were copied in time."""
        nonlocal checked, held, expired
        while checked < len(copies) and not expired and copies[checked][1].done():
            chunks = copies[checked][0]
            # every slice's leases are the one client's: a close of it ends them all
            ok = 0 if client.closed else _still_held(chunks, None)
            held += ok
            expired = ok < len(chunks)
            checked += 1

    try:
        for lo in range(0, len(keys), per):
            if copies:
                check()
            part = keys[lo : lo + per]
            with client.timeout(answer_seconds(len(part) * size, answer_s)):
                leases = client.hold(part, tenant=tenant)
            counted = lo + counted_run(leases, 0, len(part))
            n = leased_whole(leases.chunks, size)
            if n:
                arena = _arena_of(leases, loader)
                chunks: list[LeasedChunk] = leases.chunks[:n]  # type: ignore[assignment]
                at_chunk = at + sum(len(c) for c, _ in copies)
                copy = loader.load_timed(arena, [c.offset for c in chunks], kv, at_chunk)
                copies.append((chunks, copy))
            if n < len(leases.chunks):
                blocked = n not in leases.missing
                stop = (lo, part, leases, n)
                break
    finally:
        loader.wait()  # the copies read the arena: done before the leases can end
    check()
    if copies:  # the copies alone, added to the local part's (the rate an engine reports)
        before_bytes, before_s = loader.last_copy or (0, 0.0)
        copied = sum(len(c) for c, _ in copies) * size
        took_s = sum(copy.seconds() for _, copy in copies)
        loader.last_copy = (before_bytes + copied, before_s + took_s)
    if blocked and not expired and stop is not None and held == stop[0] + stop[3]:
        # the blocked slice's leases counted the rest of it: copy from them what they hold,
        # read the others uncounted; a later slice's chunks are the caller's plain read
        lo, part, leases, n = stop
        got = copy_past_blocked(
            client, part, tenant, loader, kv, at + lo, leases, n, answer_s=answer_s
        )
        held += got
        # go on past the slice only where all it counted arrived and it counted all of it
        blocked = lo + n + got == counted == lo + len(part) < len(keys)
    return Pulled(held, blocked or expired, counted)


def leased_whole(chunks: Sequence[LeasedChunk | None], size_bytes: int) -> int:
    """How many leading chunks are leased at the chunk size."""
    return next(
        (i for i, c in enumerate(chunks) if c is None or c.size_bytes != size_bytes), len(chunks)
    )


def _arena_of(leases: ArenaLeases, loader: KVLoader) -> torch.Tensor:
    """The loader's tensor over the arena ``leases`` are in. AgentError('this client is
    closed') where a close of their client (by another thread too) unmapped it before any
    tensor over it kept it mapped: the mapping's ValueError reached the engines, which handle
    an AgentError (prefill in full), as every call on a closed client says."""
    try:
        return loader.arena_tensor(leases.arena)
    except ValueError:  # the mapping closed
        if leases.ended():
            raise AgentError(CLOSED_MESSAGE) from None
        raise


def _still_held(chunks: Sequence[LeasedChunk], leases: ArenaLeases | None) -> int:
    """How many leading chunks' leases still hold now that their copies are done: one clock
    read for all, since a lease that held at the copy's end held throughout. None where the
    client that took them (``leases``) was closed meanwhile, by another thread too (a vLLM
    link's saver that failed): the agent ended them with the connection, while the copies
    read an arena the loader's tensor kept mapped."""
    if leases is not None and leases.ended():
        return 0
    now_s = time.monotonic()
    return next((i for i, c in enumerate(chunks) if c.deadline_s <= now_s), len(chunks))


def read_socket(
    client: DataClient,
    keys: Sequence[bytes],
    tenant: str,
    loader: KVLoader,
    kv: torch.Tensor,
    at: int,
    *,
    counted: int = 0,
    answer_s: float = ANSWER_SECONDS,
) -> int:
    """Chunks ``keys`` read through the socket (or through leases by the client, on the same
    host) into ``kv`` from chunk ``at`` on: how many leading ones arrived whole. ``counted``:
    the first that many were counted as served by this request's own leases already (a lease
    that could not be copied from: ``copy_leased``, ``pull_leased_counted``): they are read
    uncounted (``get_into(counted=True)``), the rest as an ordinary read that counts them,
    so each chunk of the request is counted once. Each read's deadline is sized to its bytes
    (``deadlines.answer_seconds``, from ``answer_s``)."""
    size = loader.format.chunk_bytes
    host = loader.staging(len(keys) * size)
    flat = host.numpy()
    bufs = [flat[i * size : (i + 1) * size] for i in range(len(keys))]
    split = min(max(counted, 0), len(keys))
    usable = 0
    for lo, hi, again in ((0, split, True), (split, len(keys), False)):
        if lo == hi or usable < lo:  # nothing here, or the run ended before it
            continue
        with client.timeout(answer_seconds((hi - lo) * size, answer_s)):
            got = client.get_into(keys[lo:hi], bufs[lo:hi], tenant=tenant, counted=again)
        usable += _whole(got, size)
    if usable:
        loader.load(host, [i * size for i in range(usable)], kv, at)
        loader.wait()  # the staging buffer serves the next request
    return usable
