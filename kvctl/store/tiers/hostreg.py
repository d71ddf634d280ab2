"""Host memory registered with CUDA, so copies between it and a device run at link speed.

``cudaHostRegister`` page-locks a range of host memory that something else allocated (here: the
agent's cpu-tier arena, a client's staging segment, an engine's mapping of the agent's arena) and
tells the driver about it. A ``cudaMemcpyAsync`` from or to such a range is a DMA at link speed
(measured on an H100 over PCIe: 47-53 GB/s, as fast as torch's own pinned buffers), where a copy
from pageable memory is staged by the driver, or, in the gpu tier, bounced through small pinned
buffers (5-7 GB/s).

What this relies on in torch (``import torch`` happens only inside functions):

* ``torch.cuda.cudart().cudaHostRegister(ptr, size_bytes, flags)`` and
  ``cudaHostUnregister(ptr)``: thin bindings that return a ``cudaError`` enum (0 is success) and
  never raise; the message comes from ``cudaGetErrorString``. A failed call leaves CUDA's
  per-thread "last error" set, which torch's next kernel-launch check would report as its own
  failure; ``_clear_last_error`` drains it.
* ``torch.frombuffer`` (``numpy`` never): a uint8 CPU tensor over the registered bytes, no copy.
  torch does not keep the buffer exported, so a registration keeps a ``memoryview`` of its own:
  while it (or any tensor made from it) lives, the mapping cannot be closed (``mmap.close()``
  raises BufferError) and the registered pages cannot be unmapped under a copy.
* ``dst.copy_(src, non_blocking=True)`` between a contiguous uint8 CPU tensor and a CUDA one is
  one ``cudaMemcpyAsync`` on the current stream. Whether the copy is a direct DMA is the
  driver's business (it knows the range is registered); ``is_pinned()`` is not relied on (recent
  torch answers True for registered memory, through ``cudaPointerGetAttributes``). Callers
  synchronize their stream before they use or release the bytes.

Registration pins whole pages: two registrations that share a page collide
(cudaErrorHostMemoryAlreadyRegistered), so register mappings (page-aligned), not small buffers.
Registering makes the range resident and locked for as long as it stays registered.

``HostRegistry`` is what the gpu tier and an engine use: regions by owner, each re-registered
when its mapping or generation changes (the cpu arena is replaced on resize), and found by
address (``tensor_for``) or by offset (``HostRegistration.tensor_view``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvctl.store.errors import InvalidArgument, StoreError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import mmap

    import torch

    from kvctl.store.tiers.base import Buffer

#: cudaHostRegister flags (cuda_runtime_api.h). Portable: the registration holds for every CUDA
#: context in the process, not only the current device's
HOST_REGISTER_PORTABLE = 0x01
#: the device only reads the range: needed for a read-only (PROT_READ) mapping, which the driver
#: otherwise refuses to pin (it would pin for writing)
HOST_REGISTER_READ_ONLY = 0x08
_SUCCESS = 0
#: cudaErrorNotSupported: what a read-only registration gets on a device without support for it
_NOT_SUPPORTED = 801
_READ_ONLY_HINT = (
    "this device or driver cannot register read-only host memory "
    "(cudaDevAttrHostRegisterReadOnlySupported is 0), so copies from the agent's shared arena "
    "run unpinned and slower; a newer driver may support it"
)


class HostRegistrationError(StoreError):
    """Host memory could not be registered with CUDA: no CUDA here (the reason says why), or the
    driver refused the range (its error says why)."""


class Registrar(Protocol):
    """The two CUDA calls a registration makes; tests stand in for them where there is no GPU."""

    def register(self, address: int, size_bytes: int, flags: int) -> None:
        """Raise HostRegistrationError when the range cannot be registered."""

    def unregister(self, address: int) -> None:
        """Raise HostRegistrationError when the range was not registered."""


class CudaRegistrar:
    """``cudaHostRegister``/``cudaHostUnregister`` through torch's cudart bindings, on
    ``device`` (registrations are portable: the device only picks the context that makes them).
    Raises HostRegistrationError where CUDA is unavailable, with the reason."""

    def __init__(self, device: str = "cuda:0") -> None:
        from kvctl.store.tiers.gpu import gpu_available, parse_device

        index = parse_device(device)
        ok, why = gpu_available(device)
        if not ok:
            raise HostRegistrationError(f"host memory cannot be registered with CUDA: {why}")
        import torch

        self._torch = torch
        self._index = index
        try:
            # torch leaves cudart() unannotated
            self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        except (AssertionError, RuntimeError) as exc:  # a build without the cudart bindings
            raise HostRegistrationError(f"torch exposes no CUDA runtime bindings: {exc}") from exc

    def register(self, address: int, size_bytes: int, flags: int) -> None:
        what = f"cudaHostRegister of {size_bytes} bytes at {address:#x}"
        self._call(what, self._cudart.cudaHostRegister, address, size_bytes, flags)

    def unregister(self, address: int) -> None:
        self._call(f"cudaHostUnregister {address:#x}", self._cudart.cudaHostUnregister, address)

    def _call(self, what: str, fn: Callable[..., Any], *args: int) -> None:
        try:
            with self._torch.cuda.device(self._index):
                err = fn(*args)
        except RuntimeError as exc:  # selecting the device failed: a broken driver or device
            raise HostRegistrationError(f"{what} failed: {exc}") from exc
        self._check(err, what)

    def _check(self, err: Any, what: str) -> None:
        code = int(err)
        if code == _SUCCESS:
            return
        try:
            message = self._cudart.cudaGetErrorString(err)
        except Exception:  # an enum value the bindings do not name
            message = "CUDA error"
        self._clear_last_error()
        raise HostRegistrationError(f"{what} failed: {message} (cudaError {code})")

    def _clear_last_error(self) -> None:
        # The failed call left CUDA's per-thread last error set. torch checks it after every
        # kernel launch and would blame the next kernel (an engine's forward pass) for it. A
        # launch check reads and resets it: launch one tiny kernel and ignore what it reports.
        torch = self._torch
        with contextlib.suppress(RuntimeError):
            torch.empty(1, dtype=torch.uint8, device=torch.device("cuda", self._index)).fill_(0)


def registration_available(device: str = "cuda:0") -> tuple[bool, str]:
    """(True, the device) when host memory can be registered here, else (False, why not)."""
    from kvctl.store.tiers.gpu import gpu_available

    return gpu_available(device)


class HostRegistration:
    """One range of host memory registered with CUDA; ``close`` (or leaving a ``with``)
    unregisters it, once. Holds an export of the buffer, so the mapping stays in place while
    registered; tensors from ``tensor_view`` keep the memory mapped (not registered) after."""

    def __init__(
        self,
        buffer: mmap.mmap | Buffer,
        *,
        read_only: bool,
        registrar: Registrar,
        generation: int = 0,
    ) -> None:
        view = memoryview(buffer)
        try:  # a refused registration must not hold the mapping open (nor must its traceback)
            if not view.contiguous:
                raise InvalidArgument("only contiguous memory can be registered with CUDA")
            if view.format != "B" or view.ndim != 1:
                cast = view.cast("B")
                view.release()
                view = cast
            if view.nbytes == 0:
                raise InvalidArgument("an empty buffer cannot be registered with CUDA")
            if not read_only and view.readonly:
                raise InvalidArgument(
                    "a read-only buffer can be registered only with read_only=True "
                    "(the device may then read it, never write it)"
                )
            self.address = buffer_address(view)
            self.size_bytes = view.nbytes
            self.read_only = read_only
            self.generation = generation
            flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
            try:
                registrar.register(self.address, self.size_bytes, flags)
            except HostRegistrationError as exc:
                if read_only and str(exc).endswith(f"(cudaError {_NOT_SUPPORTED})"):
                    raise HostRegistrationError(f"{exc}: {_READ_ONLY_HINT}") from exc
                raise
        except BaseException:
            view.release()
            raise
        self._registrar: Registrar | None = registrar
        self._view: memoryview | None = view  # the export that keeps the mapping in place
        self._tensor: torch.Tensor | None = None

    @property
    def closed(self) -> bool:
        return self._registrar is None

    def contains(self, address: int, size_bytes: int) -> bool:
        return self.address <= address and address + size_bytes <= self.address + self.size_bytes

    def tensor_view(self, offset: int, size_bytes: int) -> torch.Tensor:
        """A uint8 CPU tensor over ``size_bytes`` registered bytes from ``offset``, no copy.
        Valid as a copy source or target while the registration is open (writing into a
        read-only registration is an error the OS reports as a crash: never do it)."""
        if offset < 0 or size_bytes < 0 or offset + size_bytes > self.size_bytes:
            raise InvalidArgument(
                f"bytes [{offset}, {offset + size_bytes}) are outside the registered "
                f"{self.size_bytes} bytes"
            )
        return self._whole()[offset : offset + size_bytes]

    def close(self) -> None:
        """Unregister (idempotent). A failure to unregister is raised once; the registration
        counts as closed either way (nothing more can be done with it)."""
        registrar, self._registrar = self._registrar, None
        if registrar is None:
            return
        try:
            registrar.unregister(self.address)
        finally:
            # only now drop (never release(): a tensor made from it keeps the memory mapped) the
            # export: it may be the mapping's last reference, and the range must not be unmapped
            # while it is still registered
            self._view = self._tensor = None

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        ro = ", read-only" if self.read_only else ""
        return f"<HostRegistration {self.size_bytes} bytes at {self.address:#x}{ro}, {state}>"

    def _whole(self) -> torch.Tensor:
        if self._view is None:
            raise HostRegistrationError("the host registration is closed")
        if self._tensor is None:
            import torch

            with warnings.catch_warnings():  # "not writable": it is only ever copied from
                warnings.simplefilter("ignore", UserWarning)
                self._tensor = torch.frombuffer(self._view, dtype=torch.uint8)
        return self._tensor


def register_host(
    buffer: mmap.mmap | Buffer,
    *,
    read_only: bool,
    device: str = "cuda:0",
    registrar: Registrar | None = None,
) -> HostRegistration:
    """Register ``buffer``'s memory with CUDA (see the module docstring). Raises
    HostRegistrationError without CUDA or when the driver refuses, InvalidArgument for an empty,
    non-contiguous, or read-only buffer asked to be writable."""
    return HostRegistration(
        buffer, read_only=read_only, registrar=registrar or CudaRegistrar(device)
    )


def _let_go(registration: HostRegistration) -> None:
    """Unregister; a failure to is the driver's to keep (nothing more can be done with it)."""
    with contextlib.suppress(HostRegistrationError):
        registration.close()


@dataclass
class _Region:
    registration: HostRegistration
    label: str
    #: where a followed region comes from: (buffer, generation), re-read on ``refresh``
    source: Callable[[], tuple[mmap.mmap | Buffer, int]] | None = None
    owner_ref: weakref.ref[Any] | None = None


class HostRegistry:
    """Registered host regions by owner, found by address. Thread-safe.

    An owner is any hashable key or an object: an object that supports weak references is not
    kept alive, and its region is dropped once it is garbage collected. Registering again for
    the same owner replaces its region (when the buffer or generation changed). ``follow``
    registers a region that moves (the cpu arena: a new mapping on resize) and ``refresh``
    re-reads where it is now. Copies through ``borrow`` hold the registry's lock, so no region
    is unregistered under a copy.

    CUDA is asked for nothing until the first registration; without CUDA that raises
    HostRegistrationError with the reason.
    """

    def __init__(self, *, device: str = "cuda:0", registrar: Registrar | None = None) -> None:
        self.device = device
        self._registrar = registrar
        self._lock = threading.RLock()
        self._regions: dict[object, _Region] = {}
        #: followed regions' next buffers, registered before they replace the current ones
        #: (``prepare``): key -> registration
        self._prepared: dict[object, HostRegistration] = {}
        self._dead: list[object] = []  # keys of collected owners: dropped at the next call
        self._closed = False

    # --- registering -----------------------------------------------------------------------
    def register(
        self, owner: object, buffer: mmap.mmap | Buffer, *, read_only: bool, generation: int = 0
    ) -> HostRegistration:
        """``owner``'s region: ``buffer``, registered (kept as it is when the same bytes and
        generation are registered already). Its earlier region is unregistered first, so a
        failure (raised) leaves the owner without one."""
        key, ref = self._key(owner)
        with self._lock:
            self._reap()
            self._check_open()
            old = self._regions.get(key)
            if old is not None and self._same(old.registration, buffer, read_only, generation):
                return old.registration
            self._drop(key)
            registration = HostRegistration(
                buffer, read_only=read_only, registrar=self._get_registrar(), generation=generation
            )
            self._regions[key] = _Region(registration, _label(owner), owner_ref=ref)
            return registration

    def follow(
        self,
        owner: object,
        source: Callable[[], tuple[mmap.mmap | Buffer, int]],
        *,
        read_only: bool,
    ) -> HostRegistration:
        """Register the region ``source()`` names as (buffer, generation) now, and again on
        each ``refresh`` that finds another generation. ``source`` raising drops the region.
        Until that ``refresh`` the replaced buffer stays registered, pinned and mapped (its
        owner cannot close it): whoever replaces it should ``refresh`` right after."""
        buffer, generation = source()
        registration = self.register(owner, buffer, read_only=read_only, generation=generation)
        key, _ = self._key(owner)
        with self._lock:
            self._regions[key].source = source
        return registration

    def prepare(self, owner: object, buffer: mmap.mmap | Buffer, generation: int) -> bool:
        """Register the buffer a followed region will move to at ``generation`` now, ahead of
        the move: the next ``refresh`` that finds it there takes this registration instead of
        pinning the buffer then (the cpu arena's resize: pinned while its chunks are copied,
        not under the store's lock). False where ``owner`` follows nothing or it is refused
        (``refresh`` registers it then). Its owner must ``discard`` it before unmapping a
        buffer that never took the region's place."""
        key, _ = self._key(owner, make_ref=False)
        with self._lock:
            region = self._regions.get(key)
            if self._closed or region is None or region.source is None:
                return False
            read_only = region.registration.read_only
            registrar = self._get_registrar()
        made: HostRegistration | None
        try:  # pinning takes time: not under the registry's lock, which copies hold
            made = HostRegistration(
                buffer, read_only=read_only, registrar=registrar, generation=generation
            )
        except (HostRegistrationError, InvalidArgument) as exc:
            log.warning("could not register the next host region ahead of time: %s", exc)
            return False
        with self._lock:
            stale = self._prepared.pop(key, None)
            if self._closed or key not in self._regions:
                stale, made = made, None
            else:
                self._prepared[key] = made
        if stale is not None:
            _let_go(stale)
        return made is not None

    def discard(self, owner: object, buffer: mmap.mmap | Buffer, generation: int) -> None:
        """Drop what ``prepare`` registered of ``buffer`` for ``generation`` (the move did not
        happen); another buffer prepared since for the same generation stays."""
        key, _ = self._key(owner, make_ref=False)
        with self._lock:
            made = self._prepared.get(key)
            if made is None or not self._same(made, buffer, made.read_only, generation):
                return
            del self._prepared[key]
        _let_go(made)

    def refresh(self) -> None:
        """Re-register followed regions whose generation changed; drop those whose source is
        gone (raised). A region that can no longer be registered is dropped, not raised: its
        copies take the slow path."""
        with self._lock:
            self._reap()
            for key, region in list(self._regions.items()):
                if region.source is None:
                    continue
                try:
                    buffer, generation = region.source()
                except Exception:
                    self._drop(key)
                    continue
                if generation == region.registration.generation:
                    continue
                read_only = region.registration.read_only
                made = self._prepared.pop(key, None)  # before _drop, which would close it
                self._drop(key)
                if made is not None and not self._same(made, buffer, read_only, generation):
                    _let_go(made)
                    made = None
                with contextlib.suppress(HostRegistrationError, InvalidArgument):
                    new = made or HostRegistration(
                        buffer,
                        read_only=read_only,
                        registrar=self._get_registrar(),
                        generation=generation,
                    )
                    self._regions[key] = _Region(new, region.label, region.source, region.owner_ref)

    def unregister(self, owner: object) -> bool:
        """Drop ``owner``'s region; False when it had none."""
        key, _ = self._key(owner, make_ref=False)
        with self._lock:
            self._reap()
            return self._drop(key)

    def close(self) -> None:
        """Unregister every region (idempotent); the registry refuses new ones after."""
        with self._lock:
            self._closed = True
            for key in list(self._regions):
                self._drop(key)
            self._dead.clear()

    # --- finding ---------------------------------------------------------------------------
    def find(self, view: Buffer, *, writable: bool = False) -> tuple[HostRegistration, int] | None:
        """The registration holding all of ``view``'s bytes and their offset in it, or None
        (not registered, or only read-only when ``writable``)."""
        with memoryview(view) as mv:
            if not mv.contiguous or mv.nbytes == 0:
                return None
            address, n = buffer_address(mv), mv.nbytes
        with self._lock:
            self._reap()
            for region in self._regions.values():
                reg = region.registration
                if reg.contains(address, n) and not (writable and reg.read_only):
                    return reg, address - reg.address
        return None

    def tensor_for(self, view: Buffer, *, writable: bool = False) -> torch.Tensor | None:
        """A uint8 CPU tensor over exactly ``view``'s bytes when they are registered (see
        ``find``), else None. Hold ``borrow`` instead when another thread may unregister."""
        with self._lock:  # so the region found cannot be closed before its view is made
            found = self.find(view, writable=writable)
            if found is None:
                return None
            with memoryview(view) as mv:
                return found[0].tensor_view(found[1], mv.nbytes)

    @contextlib.contextmanager
    def borrow(self, view: Buffer, *, writable: bool = False) -> Iterator[torch.Tensor | None]:
        """``tensor_for`` with the registry locked until the block ends: for a copy that must
        finish (synchronize inside the block) before its region may be unregistered."""
        with self._lock:
            yield self.tensor_for(view, writable=writable)

    def regions(self) -> list[dict[str, Any]]:
        """What is registered, for status: one dict per region."""
        with self._lock:
            self._reap()
            return [
                {
                    "owner": r.label,
                    "size_bytes": r.registration.size_bytes,
                    "read_only": r.registration.read_only,
                    "generation": r.registration.generation,
                    "followed": r.source is not None,
                }
                for r in self._regions.values()
            ]

    def __len__(self) -> int:
        with self._lock:
            self._reap()
            return len(self._regions)

    # --- internals --------------------------------------------------------------------------
    def _key(
        self, owner: object, *, make_ref: bool = True
    ) -> tuple[object, weakref.ref[Any] | None]:
        if isinstance(owner, str | bytes | int | tuple | frozenset) or owner is None:
            return ("key", owner), None
        try:
            weakref.ref(owner)
        except TypeError:  # no weak references: the key itself (kept alive until unregistered)
            return ("key", owner), None
        key = ("obj", id(owner))
        if not make_ref:
            return key, None
        dead = self._dead  # the callback only queues the key: it may run inside any allocation
        return key, weakref.ref(owner, lambda _r: dead.append(key))

    def _reap(self) -> None:
        while self._dead:
            key = self._dead.pop()
            region = self._regions.get(key)
            if region is not None and region.owner_ref is not None and region.owner_ref() is None:
                self._drop(key)

    def _drop(self, key: object) -> bool:
        made = self._prepared.pop(key, None)
        if made is not None:
            _let_go(made)
        region = self._regions.pop(key, None)
        if region is None:
            return False
        # a region whose unregistering fails is gone for us either way; the driver keeps it
        _let_go(region.registration)
        return True

    def _same(
        self, reg: HostRegistration, buffer: mmap.mmap | Buffer, read_only: bool, gen: int
    ) -> bool:
        mv = memoryview(buffer)
        try:
            return (
                not reg.closed
                and reg.read_only == read_only
                and reg.generation == gen
                and reg.size_bytes == mv.nbytes
                and reg.address == buffer_address(mv)
            )
        finally:
            mv.release()

    def _get_registrar(self) -> Registrar:
        if self._registrar is None:
            self._registrar = CudaRegistrar(self.device)
        return self._registrar

    def _check_open(self) -> None:
        if self._closed:
            raise HostRegistrationError("the host registry is closed")


# --- addresses --------------------------------------------------------------------------------
class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer (stable since 3.3; part of the limited API since 3.11)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None
_PYBUF_SIMPLE = 0


def buffer_address(buffer: Buffer) -> int:
    """The address of the first byte of a contiguous buffer (read-only ones too: ctypes'
    ``from_buffer`` refuses those). The buffer must stay alive while the address is used."""
    pb = _PyBuffer()
    _get_buffer(buffer, ctypes.byref(pb), _PYBUF_SIMPLE)  # raises BufferError when it cannot
    try:
        return pb.buf or 0
    finally:
        _release_buffer(ctypes.byref(pb))


def _label(owner: object) -> str:
    if isinstance(owner, str):
        return owner
    return f"{type(owner).__name__}@{id(owner):#x}"
