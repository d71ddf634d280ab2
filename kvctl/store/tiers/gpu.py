"""Device-memory tier: one preallocated arena in CUDA memory (torch) with its own allocator.

One arena rather than a tensor per chunk, because:

* the tier's GPU memory is reserved once, at start: on a GPU shared with an inference engine the
  agent's footprint is known up front, and a size the device cannot hold is an error at start
  rather than some later put;
* the capacity holds to the byte: PyTorch's caching allocator rounds blocks up and keeps freed
  ones cached, so per-chunk tensors would use more than the tier accounts for;
* the cpu tier's allocator (first fit, coalescing, compaction when fragmented) is reused as is.

Host <-> device copies take one of two paths, on a stream of the tier's own:

* direct: host bytes in a region registered with CUDA (``register_host_region``: the agent
  registers the cpu tier's arena and clients' staging segments) cross the bus as one
  ``cudaMemcpyAsync`` at link speed (see ``kvctl.store.tiers.hostreg``);
* staged: any other buffer (a socket's receive buffer, a bytearray) goes through two reused
  pinned host buffers ("slots") in slot-sized pieces, so while the device copies one piece the
  host fills (or drains) the other. Measured on an H100, 12-14% of a bare pinned copy.

A put returns once its bytes are on the device, so a CUDA error surfaces in the put that hit it;
a read returns once the bytes are in the caller's buffer.

Nothing outside this tier reads its memory in place (there are no leases), so compaction and
resize are free to move chunks. A compaction whose copies fail leaves the chunks it was moving
torn: they are dropped (a read of one reports CorruptChunk, as the tier contract says for a copy
that cannot be trusted) and the allocator is rebuilt from the chunks that stayed in place.

``import torch`` happens only inside functions: importing this module, or ``kvctl.store``, never
loads torch. ``gpu_available`` says why a tier cannot be made here (torch missing, a build
without CUDA, no device, an index out of range).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvctl.format import format_bytes
from kvctl.store.errors import (
    CapacityError,
    CorruptChunk,
    InvalidArgument,
    KeyNotFound,
    TierUnavailable,
)
from kvctl.store.tiers.base import (
    Buffer,
    ChunkMeta,
    Tier,
    check_capacity,
    check_put,
    check_resize,
)
from kvctl.store.tiers.cpu import ArenaAllocator
from kvctl.store.tiers.hostreg import HostRegistrationError, HostRegistry

if TYPE_CHECKING:
    import torch
    from torch import Tensor

log = logging.getLogger("kvctl.store")

#: bytes of one pinned staging slot; a chunk crosses the bus in pieces this size. Two slots let
#: the host copy of one piece overlap the device copy of the other; larger pieces would leave
#: 4 MiB chunks with nothing to overlap, smaller ones pay more per-copy launch overhead
STAGING_SLOT_BYTES = 2 << 20
_SLOTS = 2
_DEVICE = re.compile(r"cuda(?::(\d+))?")


def parse_device(device: object) -> int:
    """The index of a CUDA device spelt ``"cuda"`` (device 0) or ``"cuda:N"``."""
    m = _DEVICE.fullmatch(device.strip()) if isinstance(device, str) else None
    if m is None:
        raise InvalidArgument(f'a gpu device is "cuda" or "cuda:N" (e.g. "cuda:0"), got {device!r}')
    return int(m.group(1) or 0)


def gpu_available(device: str = "cuda:0") -> tuple[bool, str]:
    """(True, a description of the device) when a GpuTier can use ``device`` here, else
    (False, why not). Imports torch (the first call takes a second or two); never raises."""
    try:
        index = parse_device(device)
    except InvalidArgument as exc:
        return False, str(exc)
    try:
        import torch
    except ImportError:
        return (
            False,
            "torch is not installed (pip install 'kvctl[engine]', with a CUDA build of torch)",
        )
    except Exception as exc:  # a broken install (missing CUDA libraries) is a reason, not a crash
        return False, f"torch failed to import: {exc}"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return False, f"torch {torch.__version__} is a build without CUDA"
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # a driver that fails to initialise
        return False, f"CUDA failed to initialise: {exc}"
    if count == 0:
        return (
            False,
            "no CUDA device is visible (no driver or GPU, or CUDA_VISIBLE_DEVICES hides them)",
        )
    if index >= count:
        return (
            False,
            f"cuda:{index} is out of range: {count} CUDA device(s) visible "
            f"(cuda:0..cuda:{count - 1})",
        )
    try:
        props = torch.cuda.get_device_properties(index)
    except Exception as exc:
        return False, f"cuda:{index} cannot be queried: {exc}"
    return True, f"{props.name}, {props.total_memory / (1 << 30):.1f} GiB (cuda:{index})"


class GpuTier(Tier):
    """Chunks in one CUDA-memory arena of ``capacity_bytes`` on ``device``.

    Raises TierUnavailable when CUDA cannot be used here (the reason from ``gpu_available``) and
    CapacityError when the device cannot hold the arena.
    """

    def __init__(
        self,
        capacity_bytes: int,
        device: str = "cuda:0",
        *,
        name: str = "gpu",
        staging_slot_bytes: int = STAGING_SLOT_BYTES,
    ) -> None:
        check_capacity(capacity_bytes, f"{name} capacity")
        index = parse_device(device)
        if isinstance(staging_slot_bytes, bool) or not isinstance(staging_slot_bytes, int):
            raise InvalidArgument(
                f"staging_slot_bytes must be an integer, got {staging_slot_bytes!r}"
            )
        if staging_slot_bytes <= 0:
            raise InvalidArgument(f"staging_slot_bytes must be positive, got {staging_slot_bytes}")
        ok, why = gpu_available(device)
        if not ok:
            raise TierUnavailable(f"tier {name!r} needs CUDA: {why}")
        import torch

        self.name = name
        self.device = f"cuda:{index}"
        self.device_description = why
        self._torch = torch
        self._dev = torch.device("cuda", index)
        self._capacity_bytes = capacity_bytes
        # copies on a stream of our own neither wait for nor hold up work on the default stream
        # (torch leaves Stream's and Event's constructors unannotated)
        self._stream = torch.cuda.Stream(self._dev)  # type: ignore[no-untyped-call]
        self._arena = self._new_arena(capacity_bytes)
        self._slot_bytes = staging_slot_bytes
        self._slots = [
            torch.empty(staging_slot_bytes, dtype=torch.uint8, pin_memory=True)
            for _ in range(_SLOTS)
        ]
        # the host side of a slot as a memoryview: filling it is a plain C memcpy
        self._slot_views = [host_view(t) for t in self._slots]
        # each slot's last device copy: the host waits on it before touching the slot again
        self._events = [torch.cuda.Event() for _ in range(_SLOTS)]  # type: ignore[no-untyped-call]
        #: host regions registered with CUDA: copies from and to them skip the slots
        self._host = HostRegistry(device=self.device)
        #: bytes moved each way: "direct" (registered host memory) or "staged" (through slots)
        self.copied_bytes = {"direct": 0, "staged": 0}
        self._alloc = ArenaAllocator(capacity_bytes)
        self._chunks: dict[bytes, tuple[int, int]] = {}  # key -> (offset, size)
        #: key -> size of chunks a failed compaction tore: still listed (the store indexes them)
        #: until read (CorruptChunk) or deleted, their bytes already free in the allocator
        self._lost: dict[bytes, int] = {}
        self._used_bytes = 0
        self.compactions = 0
        self._closed = False

    # --- Tier interface -------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def __contains__(self, key: object) -> bool:
        return key in self._chunks or key in self._lost

    def __len__(self) -> int:
        return len(self._chunks) + len(self._lost)

    def keys(self) -> Iterator[bytes]:
        return iter([*self._chunks, *self._lost])

    def size_of(self, key: bytes) -> int:
        self._check_open()
        if key in self._lost:
            return self._lost[key]
        return self._slot(key)[1]

    def put(self, meta: ChunkMeta, data: Buffer | None) -> None:
        """As the Tier contract says, with one exception: when the compaction a fragmented
        arena needs fails (TierUnavailable), the chunks it was moving are lost (see
        ``_compact``), though nothing of this put's chunk is stored."""
        self._check_open()
        check_put(self, meta, data)
        assert data is not None  # check_put guarantees it for payload tiers
        n = meta.size_bytes
        off = self._alloc.alloc(n)
        if off is None:  # enough free bytes (check_put), but fragmented
            self._device_call(self._compact)
            off = self._alloc.alloc(n)
            if off is None:  # cannot happen: compaction leaves all free bytes in one hole
                raise CapacityError(f"tier {self.name!r}: no hole of {n} bytes after compaction")
        try:
            self._device_call(self._upload, _byte_view(data)[:n], off)
        except TierUnavailable:
            self._alloc.free(off, n)
            raise
        self._chunks[meta.key] = (off, n)
        self._used_bytes += n

    def read_into(self, key: bytes, out: memoryview) -> int:
        self._check_open()
        if key in self._lost:
            del self._lost[key]
            raise CorruptChunk(
                f"key {key.hex()} in tier {self.name!r} was lost when a compaction failed"
            )
        off, n = self._slot(key)
        if out.nbytes < n:
            raise InvalidArgument(f"buffer of {out.nbytes} bytes is smaller than the chunk ({n})")
        try:
            self._device_call(self._download, off, n, _byte_view(out)[:n])
        except TierUnavailable as exc:
            # the copy cannot be trusted: drop the chunk, and report a miss as the contract says
            self.delete(key)
            raise CorruptChunk(f"key {key.hex()} in tier {self.name!r}: {exc}") from exc
        return n

    def delete(self, key: bytes) -> int:
        self._check_open()
        if key in self._lost:  # its bytes were freed when it was lost
            return self._lost.pop(key)
        off, n = self._slot(key)
        del self._chunks[key]
        self._alloc.free(off, n)
        self._used_bytes -= n
        return n

    def resize(self, capacity_bytes: int) -> None:
        """A new arena of ``capacity_bytes`` with the chunks packed at its start; the old one
        goes back to the driver. Both exist during the copy; CapacityError (nothing changed) when
        the device cannot hold the new one."""
        self._check_open()
        check_resize(self, capacity_bytes)
        if capacity_bytes == self._capacity_bytes:
            return
        arena = self._new_arena(capacity_bytes)
        moved: dict[bytes, tuple[int, int]] = {}

        def copy_all() -> None:
            cursor = 0
            with self._torch.cuda.stream(self._stream):
                for key, (off, n) in sorted(self._chunks.items(), key=lambda kv: kv[1][0]):
                    arena[cursor : cursor + n].copy_(self._arena[off : off + n], non_blocking=True)
                    moved[key] = (cursor, n)
                    cursor += n
            self._stream.synchronize()

        self._device_call(copy_all)
        old, self._arena = self._arena, arena
        self._chunks = moved
        self._capacity_bytes = capacity_bytes
        self._alloc.rebuild(capacity_bytes, [(0, self._used_bytes)] if self._used_bytes else [])
        self.compactions += 1
        del old
        self._return_cached_memory()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):  # a failed device has nothing left to wait for
            self._stream.synchronize()
        self._chunks.clear()
        self._lost.clear()
        self._used_bytes = 0
        self._host.close()
        for view in self._slot_views:
            view.release()
        self._slot_views = []
        self._slots = []
        del self._arena
        self._return_cached_memory()

    # --- host regions ------------------------------------------------------------------------
    def register_host_region(
        self, owner: object, buffer: mmap.mmap | Buffer, *, read_only: bool, generation: int = 0
    ) -> bool:
        """Copy straight from (and, unless ``read_only``, into) ``buffer``'s memory: register it
        with CUDA as ``owner``'s region, replacing that owner's earlier one. An object owner is
        not kept alive: its region goes when it is collected (or ``unregister_host_region``).
        The region stays mapped while registered (closing its mmap raises BufferError).
        False, logged, when CUDA refuses: copies of its bytes are then staged. Thread-safe."""
        try:
            self._host.register(owner, buffer, read_only=read_only, generation=generation)
        except (HostRegistrationError, InvalidArgument) as exc:
            log.warning("tier %r: host region not registered, copies staged: %s", self.name, exc)
            return False
        return True

    def follow_host_region(
        self,
        owner: object,
        source: Callable[[], tuple[mmap.mmap | Buffer, int]],
        *,
        read_only: bool,
    ) -> bool:
        """``register_host_region`` of the (buffer, generation) ``source()`` names, registered
        again whenever the generation changes (checked before every copy): the cpu tier's
        arena, replaced on resize. ``source`` raising (a closed tier) drops the region. The
        replaced buffer stays registered and mapped until then, so whoever replaces it calls
        ``host_registry.refresh()`` right after (the agent does, on a cpu resize)."""
        try:
            self._host.follow(owner, source, read_only=read_only)
        except (HostRegistrationError, InvalidArgument, TierUnavailable) as exc:
            log.warning("tier %r: host region not registered, copies staged: %s", self.name, exc)
            return False
        return True

    def unregister_host_region(self, owner: object) -> bool:
        """Drop ``owner``'s region (False when it had none). Waits for a copy using it."""
        return self._host.unregister(owner)

    @property
    def host_registry(self) -> HostRegistry:
        """The registry behind ``register_host_region``: ``tensor_for`` a registered view."""
        return self._host

    def host_regions(self) -> list[dict[str, Any]]:
        """The registered host regions: owner, size_bytes, read_only, generation, followed."""
        return self._host.regions()

    # --- copies -----------------------------------------------------------------------------
    def _upload(self, src: memoryview, off: int) -> None:
        """Host bytes -> device: one copy from a registered region, else staged."""
        self._host.refresh()
        with self._host.borrow(src) as host:
            if host is not None:
                with self._torch.cuda.stream(self._stream):
                    self._arena[off : off + src.nbytes].copy_(host, non_blocking=True)
                self._stream.synchronize()  # before the region may be unregistered or reused
                self.copied_bytes["direct"] += src.nbytes
                return
        self._upload_staged(src, off)
        self.copied_bytes["staged"] += src.nbytes

    def _download(self, off: int, n: int, out: memoryview) -> None:
        """Device -> host bytes: one copy into a registered (writable) region, else staged."""
        self._host.refresh()
        with self._host.borrow(out, writable=True) as host:
            if host is not None:
                with self._torch.cuda.stream(self._stream):
                    host.copy_(self._arena[off : off + n], non_blocking=True)
                self._stream.synchronize()
                self.copied_bytes["direct"] += n
                return
        self._download_staged(off, n, out)
        self.copied_bytes["staged"] += n

    def _upload_staged(self, src: memoryview, off: int) -> None:
        """Host bytes -> pinned slot -> device, piece by piece, alternating slots."""
        torch, step = self._torch, self._slot_bytes
        with torch.cuda.stream(self._stream):
            for i, start in enumerate(range(0, src.nbytes, step)):
                k = min(step, src.nbytes - start)
                s = i % _SLOTS
                self._events[s].synchronize()  # the device is done reading this slot
                self._slot_views[s][:k] = src[start : start + k]
                dst = self._arena[off + start : off + start + k]
                dst.copy_(self._slots[s][:k], non_blocking=True)
                self._events[s].record(self._stream)
        self._stream.synchronize()

    def _download_staged(self, off: int, n: int, out: memoryview) -> None:
        """Device -> pinned slot -> the caller's buffer; the next pieces are already on their
        way while the host drains a slot."""
        torch, step = self._torch, self._slot_bytes
        pieces = [(start, min(step, n - start)) for start in range(0, n, step)]

        def issue(i: int) -> None:
            start, k = pieces[i]
            s = i % _SLOTS
            src = self._arena[off + start : off + start + k]
            self._slots[s][:k].copy_(src, non_blocking=True)
            self._events[s].record(self._stream)

        with torch.cuda.stream(self._stream):
            for i in range(min(_SLOTS, len(pieces))):
                issue(i)
            for i, (start, k) in enumerate(pieces):
                s = i % _SLOTS
                self._events[s].synchronize()
                out[start : start + k] = self._slot_views[s][:k]
                if i + _SLOTS < len(pieces):
                    issue(i + _SLOTS)

    def _compact(self) -> None:
        """Slide every chunk down to the start of the arena, in offset order. The map and the
        allocator change together, once every copy has finished.

        When a copy fails, which of the queued copies ran is unknown, so every chunk that was
        moving may be torn: its new bytes incomplete, its old ones partly overwritten by its
        own move or a later chunk's. Those are dropped (kept in ``_lost``, so a read reports
        CorruptChunk and the store forgets them) and the allocator is rebuilt from the chunks
        that did not move: all of them lie below the first move's destination, which no copy
        writes. Then the error propagates.
        """
        packed: dict[bytes, tuple[int, int]] = {}
        moves: list[tuple[int, int, int]] = []  # (destination, source, size)
        cursor = 0
        for key, (off, n) in sorted(self._chunks.items(), key=lambda kv: kv[1][0]):
            if off != cursor:
                moves.append((cursor, off, n))
            packed[key] = (cursor, n)
            cursor += n
        try:
            with self._torch.cuda.stream(self._stream):
                for dst, src, n in moves:
                    self._move_down(dst, src, n)
            self._stream.synchronize()
        except BaseException:
            self._drop_moving(packed)
            raise
        self._chunks = packed
        self._alloc.rebuild(self._capacity_bytes, [(0, cursor)] if cursor else [])
        self.compactions += 1

    def _drop_moving(self, packed: dict[bytes, tuple[int, int]]) -> None:
        """After a failed compaction: keep the chunks that stayed in place, lose the rest."""
        # copies queued before the failure may still run; later ones on this stream (uploads
        # into the freed regions) queue behind them, but wait anyway where the device still can
        with contextlib.suppress(RuntimeError):
            self._stream.synchronize()
        kept = {key: slot for key, slot in self._chunks.items() if packed[key] == slot}
        for key, (_off, n) in self._chunks.items():
            if key not in kept:
                self._lost[key] = n
                self._used_bytes -= n
        self._chunks = kept
        self._alloc.rebuild(self._capacity_bytes, sorted(kept.values()))

    def _move_down(self, dst: int, src: int, n: int) -> None:
        arena = self._arena
        if src - dst >= n:
            arena[dst : dst + n].copy_(arena[src : src + n], non_blocking=True)
            return
        # Overlapping (torch refuses such a copy): bounce through a pinned slot, front first.
        # The stream runs each piece's read before its write, and a write ends below the next
        # piece's source, so nothing is overwritten before it is read.
        slot = self._slots[0]
        for start in range(0, n, self._slot_bytes):
            k = min(self._slot_bytes, n - start)
            slot[:k].copy_(arena[src + start : src + start + k], non_blocking=True)
            arena[dst + start : dst + start + k].copy_(slot[:k], non_blocking=True)

    # --- internals --------------------------------------------------------------------------
    def _new_arena(self, capacity_bytes: int) -> torch.Tensor:
        torch = self._torch
        try:
            with torch.cuda.stream(self._stream):  # the block belongs to the stream that uses it
                # self._torch is typed as a bare module (tests put a stand-in there)
                arena: Tensor = torch.empty(capacity_bytes, dtype=torch.uint8, device=self._dev)
                return arena
        except torch.cuda.OutOfMemoryError as exc:
            free_bytes, total_bytes = torch.cuda.mem_get_info(self._dev)
            raise CapacityError(
                f"cannot reserve {format_bytes(capacity_bytes)} of GPU memory on {self.device} "
                f"for tier {self.name!r}: {format_bytes(free_bytes)} of "
                f"{format_bytes(total_bytes)} free; lower its size"
            ) from exc

    def _device_call(self, fn: Callable[..., None], *args: object) -> None:
        """Run a copy; a CUDA failure (torch raises RuntimeError) becomes TierUnavailable."""
        try:
            fn(*args)
        except RuntimeError as exc:
            raise TierUnavailable(f"tier {self.name!r} on {self.device}: {exc}") from exc

    def _return_cached_memory(self) -> None:
        # torch keeps freed blocks cached for reuse by this process; give them back, so memory a
        # resize or close frees is there for the engine sharing the GPU
        with contextlib.suppress(RuntimeError):
            self._torch.cuda.empty_cache()

    def _slot(self, key: bytes) -> tuple[int, int]:
        self._check_open()
        try:
            return self._chunks[key]
        except KeyError:
            raise KeyNotFound(f"key {_hex(key)} is not in tier {self.name!r}") from None

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"tier {self.name!r} is closed")


def host_view(t: torch.Tensor) -> memoryview:
    """A writable byte view of a (pinned) host tensor's memory; the tensor must outlive it."""
    array = (ctypes.c_ubyte * t.numel()).from_address(t.data_ptr())
    return memoryview(array).cast("B")


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _hex(key: object) -> str:
    return key.hex() if isinstance(key, bytes | bytearray) else repr(key)
