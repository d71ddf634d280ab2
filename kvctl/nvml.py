"""GPU power, energy, utilisation and memory read over NVML, in the spirit of nvitop.

A reading NVML cannot give is ``None`` (shown as N/A): never a crash and never an invented
number. A failure to initialise NVML is not an exception either but an :class:`NvmlStatus`
carrying NVML's own error text and a hint for the operator, because CPU-only nodes and nodes
with a broken driver are normal members of a fleet.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import pynvml

__all__ = ["GpuReading", "NvmlReader", "NvmlStatus", "nvml_hint"]

# NVML fills a counter it cannot read with all ones (NVML_VALUE_NOT_AVAILABLE_*); passing that
# through would report a 4.3 MW GPU, so it becomes None instead.
_NOT_AVAILABLE = frozenset({2**32 - 1, 2**64 - 1})


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU at one instant; every field but ``index`` is None when NVML could not read it."""

    index: int
    uuid: str | None
    name: str | None
    power_w: float | None  # nvmlDeviceGetPowerUsage (mW) / 1000
    energy_j: float | None  # mJ since the driver loaded / 1000: a counter, diff it for energy
    utilization_ratio: float | None  # nvmlDeviceGetUtilizationRates().gpu / 100
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    power_limit_w: float | None  # nvmlDeviceGetEnforcedPowerLimit (mW) / 1000


@dataclass(frozen=True, slots=True)
class NvmlStatus:
    """Whether NVML works on this host and, when it does not, why and what to do about it."""

    available: bool
    driver_version: str | None
    nvml_version: str | None
    device_count: int
    error: str | None  # NVML's own error text, e.g. "NVML Shared Library Not Found"
    hint: str | None  # what the operator should do


# Not opened yet, or closed: nothing failed, so there is neither error nor hint.
_CLOSED = NvmlStatus(False, None, None, 0, None, None)


_GENERIC_NVML_HINT = (
    "NVML failed unexpectedly: run `nvidia-smi` to see whether the driver works and check "
    "`dmesg | grep -i -e nvidia -e xid` for driver errors."
)
_LIBRARY_NOT_FOUND_HINT = (
    "No NVIDIA driver found (libnvidia-ml.so.1 is missing): expected on CPU-only hosts; "
    "if this node has a GPU, install the NVIDIA driver and check that `nvidia-smi` works."
)
_VERSION_MISMATCH_HINT = (
    "Driver/library version mismatch: the NVIDIA driver was upgraded without a reboot. "
    "Reboot the node, or drain it and reload the nvidia kernel modules "
    "(`rmmod nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia`)."
)

# Keyed by the NVML_ERROR_* code, which pynvml stores as `.value` on every NVMLError subclass.
_HINTS: dict[int, str] = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: _LIBRARY_NOT_FOUND_HINT,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (
        "The NVIDIA kernel module is not loaded: run `nvidia-smi`, check `lsmod | grep nvidia` "
        "and `dmesg | grep -i nvidia`, then `modprobe nvidia` or reinstall the driver."
    ),
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: _VERSION_MISMATCH_HINT,
    pynvml.NVML_ERROR_NO_PERMISSION: (
        "Permission denied on the GPU: give this user read/write access to /dev/nvidia* "
        "(e.g. the video group), or expose the devices to the container (--gpus)."
    ),
    pynvml.NVML_ERROR_INSUFFICIENT_POWER: (
        "A GPU reports insufficient external power: check its PCIe auxiliary power cables "
        "and the power supply."
    ),
    pynvml.NVML_ERROR_GPU_IS_LOST: (
        "A GPU fell off the bus: check `dmesg` for NVIDIA Xid errors (79 = fallen off the bus), "
        "drain the node, then reset the GPU (`nvidia-smi -r`) or reboot."
    ),
    pynvml.NVML_ERROR_UNINITIALIZED: (
        "NVML was called before nvmlInit or after nvmlShutdown: a kvctl bug; reopen the reader "
        "and report it."
    ),
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: (
        "The installed NVIDIA driver is too old for this NVML call: upgrade the driver; the "
        "reading stays N/A until then."
    ),
    pynvml.NVML_ERROR_UNKNOWN: _GENERIC_NVML_HINT,
}


def _error_text(error: BaseException) -> str:
    # NVMLError.__str__ may call into NVML for codes it does not know; never let that escape.
    try:
        text = str(error)
    except Exception:
        text = ""
    if isinstance(error, pynvml.NVMLError):
        return text or f"NVML error code {getattr(error, 'value', '?')}"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def nvml_hint(error: BaseException) -> str:
    """Advice for the operator on an NVML failure, matched by NVML error code, then by text."""
    if isinstance(error, pynvml.NVMLError):
        code = getattr(error, "value", None)
        hint = _HINTS.get(code) if isinstance(code, int) else None
        if hint is not None and hint is not _GENERIC_NVML_HINT:
            return hint
    # The real libnvidia-ml says "Driver/library version mismatch"; some paths surface it only
    # as text (NVML_ERROR_UNKNOWN on old drivers, or a wrapped RuntimeError).
    text = _error_text(error).lower()
    if "version mismatch" in text:
        return _VERSION_MISMATCH_HINT
    if isinstance(error, pynvml.NVMLError):
        return _GENERIC_NVML_HINT
    if "libnvidia-ml" in text:  # an OSError from loading the shared library ourselves
        return _LIBRARY_NOT_FOUND_HINT
    return (
        f"Could not use NVML ({type(error).__name__}): check that the NVIDIA driver is installed "
        "and that `nvidia-smi` works on this node."
    )


def _decode(value: Any) -> str:
    # Older pynvml releases return bytes for names, UUIDs and versions.
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _counter(value: Any) -> int | None:
    raw = int(value)
    return None if raw in _NOT_AVAILABLE or raw < 0 else raw


def _milli(value: Any) -> float | None:
    raw = _counter(value)
    return None if raw is None else raw / 1000


class _GpuLost(Exception):
    """Raised internally to abandon one GPU's reading as soon as NVML reports it lost."""


class NvmlReader:
    """Opens NVML once, caches device handles and reads every GPU on demand.

    ``nvml`` defaults to the real pynvml module; any object with the same functions will do
    (the unit tests stand one in for the GPUs their machine lacks). Calls are serialised by a
    lock so that ``close()`` cannot shut NVML down under a concurrent ``read()``.
    """

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml: Any = pynvml if nvml is None else nvml
        self._lock = threading.Lock()
        self._opened = False
        self._handles: list[Any | None] = []
        self._status = _CLOSED

    def open(self) -> NvmlStatus:
        """Initialise NVML; never raises. A failed open may be retried (e.g. after modprobe)."""
        with self._lock:
            if self._opened:
                return self._status
            try:
                self._nvml.nvmlInit()
            except Exception as exc:  # not just NVMLError: a broken install raises OSError etc.
                self._status = self._failed(exc)
                return self._status
            try:
                count = int(self._nvml.nvmlDeviceGetCount())
                handles = [self._handle(i) for i in range(count)]
                status = NvmlStatus(
                    available=True,
                    driver_version=self._optional_text("nvmlSystemGetDriverVersion"),
                    nvml_version=self._optional_text("nvmlSystemGetNVMLVersion"),
                    device_count=count,
                    error=None,
                    hint=None,
                )
            except Exception as exc:
                # Initialised but could not enumerate: release NVML so a later open() retries.
                self._shutdown()
                self._status = self._failed(exc)
                return self._status
            self._opened, self._handles, self._status = True, handles, status
            return self._status

    def status(self) -> NvmlStatus:
        """The outcome of the last open(); unavailable with no error before open or after close."""
        return self._status

    def read(self) -> list[GpuReading]:
        """One reading per GPU ([] when NVML is unavailable); unreadable fields are None."""
        with self._lock:
            if not self._opened:
                return []
            return [self._read_one(i, h) for i, h in enumerate(self._handles)]

    def close(self) -> None:
        """Shut NVML down if this reader opened it; safe to call any number of times."""
        with self._lock:
            if self._opened:
                self._shutdown()
            self._opened = False
            self._handles = []
            self._status = _CLOSED

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    @staticmethod
    def _failed(exc: BaseException) -> NvmlStatus:
        return NvmlStatus(False, None, None, 0, _error_text(exc), nvml_hint(exc))

    def _shutdown(self) -> None:
        # Nothing useful to do if NVML cannot even shut down; close() must not raise.
        with contextlib.suppress(Exception):
            self._nvml.nvmlShutdown()

    def _handle(self, index: int) -> Any | None:
        # One lost or forbidden GPU must not hide the others: its readings are simply all None.
        try:
            return self._nvml.nvmlDeviceGetHandleByIndex(index)
        except pynvml.NVMLError:
            return None

    def _optional_text(self, function: str) -> str | None:
        fn = getattr(self._nvml, function, None)
        if fn is None:
            return None
        try:
            return _decode(fn())
        except pynvml.NVMLError:
            return None

    def _query(self, function: str, handle: Any) -> Any | None:
        """One NVML call for one field: None when unsupported, _GpuLost when the GPU is gone."""
        fn: Callable[[Any], Any] | None = getattr(self._nvml, function, None)
        if fn is None:  # an older pynvml without this binding
            return None
        try:
            return fn(handle)
        except pynvml.NVMLError_GpuIsLost as exc:
            raise _GpuLost from exc
        except pynvml.NVMLError:
            return None

    def _read_one(self, index: int, handle: Any | None) -> GpuReading:
        lost = GpuReading(index, None, None, None, None, None, None, None, None)
        if handle is None:
            return lost
        try:
            uuid = self._query("nvmlDeviceGetUUID", handle)
            name = self._query("nvmlDeviceGetName", handle)
            power = self._query("nvmlDeviceGetPowerUsage", handle)
            energy = self._query("nvmlDeviceGetTotalEnergyConsumption", handle)
            util = self._query("nvmlDeviceGetUtilizationRates", handle)
            memory = self._query("nvmlDeviceGetMemoryInfo", handle)
            limit = self._query("nvmlDeviceGetEnforcedPowerLimit", handle)
        except _GpuLost:
            # Fields read before NVML noticed the loss are stale; report none of them.
            return lost
        util_pct = None if util is None else _counter(util.gpu)
        return GpuReading(
            index=index,
            uuid=None if uuid is None else _decode(uuid),
            name=None if name is None else _decode(name),
            power_w=None if power is None else _milli(power),
            energy_j=None if energy is None else _milli(energy),
            utilization_ratio=None if util_pct is None else util_pct / 100,
            memory_used_bytes=None if memory is None else _counter(memory.used),
            memory_total_bytes=None if memory is None else _counter(memory.total),
            power_limit_w=None if limit is None else _milli(limit),
        )
