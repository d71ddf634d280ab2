"""NVML power reader: the real no-driver path on this host, and a stand-in for GPUs it lacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from kvctl.nvml import GpuReading, NvmlReader, NvmlStatus, nvml_hint

ROOT = Path(__file__).parents[2]


# -- the real pynvml on whatever host runs the tests ----------------------------------------


def test_real_nvml_without_driver_is_a_status_not_a_crash() -> None:
    reader = NvmlReader()
    status = reader.open()
    try:
        if status.available:
            # A GPU host: the same test checks that what NVML reports is physically sane.
            readings = reader.read()
            assert status.device_count == len(readings) >= 1
            assert status.error is None and status.driver_version
            assert [r.index for r in readings] == list(range(len(readings)))
            for r in readings:
                assert r.power_w is None or 0 <= r.power_w < 5000
                assert r.utilization_ratio is None or 0 <= r.utilization_ratio <= 1
                if r.memory_used_bytes is not None and r.memory_total_bytes is not None:
                    assert 0 <= r.memory_used_bytes <= r.memory_total_bytes
                assert r.energy_j is None or r.energy_j >= 0
        else:
            assert status == reader.status()
            assert status.device_count == 0 and status.driver_version is None
            assert status.error == "NVML Shared Library Not Found"
            assert status.hint is not None and "driver" in status.hint.lower()
            assert "CPU-only" in status.hint
            assert reader.read() == []
    finally:
        reader.close()
    reader.close()  # idempotent: a second close neither raises nor calls NVML again
    assert reader.status() == NvmlStatus(False, None, None, 0, None, None)
    assert reader.read() == []


def test_real_nvml_context_manager_never_raises() -> None:
    with NvmlReader() as reader:
        status = reader.status()
        assert len(reader.read()) == status.device_count
        assert status.available or (status.hint and status.error)
    assert reader.status().available is False


def test_collectors_nvml_imports_no_ui_library() -> None:
    code = "import sys, kvctl.nvml; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    roots = {m.split(".")[0] for m in out.stdout.split()}
    assert "pynvml" in roots
    assert not roots & {"rich", "typer", "textual", "dash", "plotly", "click"}


# -- a stand-in for the GPUs this machine lacks ---------------------------------------------


class StandInNvml:
    """Stands in for pynvml on GPU hardware this machine does not have.

    Each GPU is a dict from an NVML function name to the value it returns, or to an exception it
    raises. The exceptions are the real pynvml.NVMLError classes, so the reader's error matching
    is exercised for real; only the hardware behind them is pretend.
    """

    def __init__(
        self,
        gpus: list[dict[str, Any]],
        *,
        init_error: BaseException | None = None,
        count_error: BaseException | None = None,
        driver: str | bytes = "550.54.15",
        nvml_version: str | bytes = "12.550.54.15",
    ) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.count_error = count_error
        self.driver = driver
        self.nvml_version = nvml_version
        self.init_calls = 0
        self.shutdown_calls = 0

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        if self.count_error is not None:
            raise self.count_error
        return len(self.gpus)

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return self.driver

    def nvmlSystemGetNVMLVersion(self) -> str | bytes:
        return self.nvml_version

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return self._answer(index, "nvmlDeviceGetHandleByIndex", default=index)

    def nvmlDeviceGetUUID(self, handle: int) -> Any:
        return self._answer(handle, "nvmlDeviceGetUUID")

    def nvmlDeviceGetName(self, handle: int) -> Any:
        return self._answer(handle, "nvmlDeviceGetName")

    def nvmlDeviceGetPowerUsage(self, handle: int) -> Any:
        return self._answer(handle, "nvmlDeviceGetPowerUsage")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> Any:
        return self._answer(handle, "nvmlDeviceGetTotalEnergyConsumption")

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return self._answer(handle, "nvmlDeviceGetUtilizationRates")

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return self._answer(handle, "nvmlDeviceGetMemoryInfo")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> Any:
        return self._answer(handle, "nvmlDeviceGetEnforcedPowerLimit")

    def _answer(self, handle: int, function: str, default: Any = None) -> Any:
        value = self.gpus[handle].get(function, default)
        if isinstance(value, BaseException):
            raise value
        return value


def h100(uuid: str = "GPU-aaaa", **overrides: Any) -> dict[str, Any]:
    gpu: dict[str, Any] = {
        "nvmlDeviceGetUUID": uuid,
        "nvmlDeviceGetName": "NVIDIA H100 80GB HBM3",
        "nvmlDeviceGetPowerUsage": 312_456,  # mW
        "nvmlDeviceGetTotalEnergyConsumption": 9_876_543_210,  # mJ
        "nvmlDeviceGetUtilizationRates": SimpleNamespace(gpu=87, memory=40),
        "nvmlDeviceGetMemoryInfo": SimpleNamespace(
            total=85_520_809_984, used=60_000_000_000, free=25_520_809_984
        ),
        "nvmlDeviceGetEnforcedPowerLimit": 700_000,  # mW
    }
    gpu.update(overrides)
    return gpu


def not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def gpu_lost() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)


ALL_NONE = dict.fromkeys(
    (
        "uuid",
        "name",
        "power_w",
        "energy_j",
        "utilization_ratio",
        "memory_used_bytes",
        "memory_total_bytes",
        "power_limit_w",
    )
)


def test_two_gpus_with_unit_conversions() -> None:
    nvml = StandInNvml([h100("GPU-aaaa"), h100("GPU-bbbb", nvmlDeviceGetPowerUsage=75_000)])
    with NvmlReader(nvml) as reader:
        status = reader.status()
        assert status == NvmlStatus(True, "550.54.15", "12.550.54.15", 2, None, None)
        first, second = reader.read()
    assert first == GpuReading(
        index=0,
        uuid="GPU-aaaa",
        name="NVIDIA H100 80GB HBM3",
        power_w=312.456,
        energy_j=9_876_543.21,
        utilization_ratio=0.87,
        memory_used_bytes=60_000_000_000,
        memory_total_bytes=85_520_809_984,
        power_limit_w=700.0,
    )
    assert (second.index, second.uuid, second.power_w) == (1, "GPU-bbbb", 75.0)
    assert nvml.init_calls == 1 and nvml.shutdown_calls == 1


def test_not_supported_field_is_none_for_that_field_only() -> None:
    nvml = StandInNvml([h100(nvmlDeviceGetTotalEnergyConsumption=not_supported()), h100()])
    with NvmlReader(nvml) as reader:
        first, second = reader.read()
    assert first.energy_j is None
    assert first.power_w == 312.456 and first.power_limit_w == 700.0 and first.name is not None
    assert second.energy_j == 9_876_543.21


def test_any_nvml_error_on_memory_leaves_both_memory_fields_none() -> None:
    no_permission = pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
    with NvmlReader(StandInNvml([h100(nvmlDeviceGetMemoryInfo=no_permission)])) as reader:
        (reading,) = reader.read()
    assert reading.memory_used_bytes is None and reading.memory_total_bytes is None
    assert reading.utilization_ratio == 0.87


def test_lost_gpu_reads_all_none_and_spares_the_others() -> None:
    # Lost after uuid/name were read: those earlier answers must not survive either.
    nvml = StandInNvml([h100("GPU-aaaa"), h100("GPU-bbbb", nvmlDeviceGetPowerUsage=gpu_lost())])
    with NvmlReader(nvml) as reader:
        first, second = reader.read()
    assert first.uuid == "GPU-aaaa" and first.power_w == 312.456
    assert second == GpuReading(index=1, **ALL_NONE)


def test_gpu_lost_before_open_gets_no_handle_and_reads_all_none() -> None:
    nvml = StandInNvml([h100(nvmlDeviceGetHandleByIndex=gpu_lost()), h100("GPU-bbbb")])
    with NvmlReader(nvml) as reader:
        assert reader.status().device_count == 2
        first, second = reader.read()
    assert first == GpuReading(index=0, **ALL_NONE)
    assert second.uuid == "GPU-bbbb"


def test_old_pynvml_bytes_are_decoded() -> None:
    gpu = h100(nvmlDeviceGetUUID=b"GPU-cccc", nvmlDeviceGetName=b"Tesla V100-SXM2-32GB")
    with NvmlReader(StandInNvml([gpu], driver=b"470.82.01", nvml_version=b"11.470")) as reader:
        status = reader.status()
        (reading,) = reader.read()
    assert (status.driver_version, status.nvml_version) == ("470.82.01", "11.470")
    assert (reading.uuid, reading.name) == ("GPU-cccc", "Tesla V100-SXM2-32GB")


def test_not_available_sentinel_is_none_not_four_megawatts() -> None:
    gpu = h100(nvmlDeviceGetPowerUsage=2**32 - 1, nvmlDeviceGetTotalEnergyConsumption=2**64 - 1)
    with NvmlReader(StandInNvml([gpu])) as reader:
        (reading,) = reader.read()
    assert reading.power_w is None and reading.energy_j is None
    assert reading.power_limit_w == 700.0


def test_binding_missing_from_an_old_pynvml_is_none() -> None:
    nvml = StandInNvml([h100()])
    old = SimpleNamespace(
        **{
            name: getattr(nvml, name)
            for name in dir(StandInNvml)
            if name.startswith("nvml") and name != "nvmlDeviceGetTotalEnergyConsumption"
        }
    )
    with NvmlReader(old) as reader:
        (reading,) = reader.read()
    assert reading.energy_j is None and reading.power_w == 312.456


def test_init_failure_becomes_status_with_hint() -> None:
    nvml = StandInNvml([h100()], init_error=pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    reader = NvmlReader(nvml)
    status = reader.open()
    assert status.available is False and status.error == "Driver Not Loaded"
    assert status.hint is not None and "lsmod | grep nvidia" in status.hint
    assert reader.read() == []
    reader.close()
    assert nvml.shutdown_calls == 0  # never initialised, so never shut down


def test_non_nvml_init_failure_is_a_status_too() -> None:
    oserror = OSError("libnvidia-ml.so.1: cannot open shared object file")
    status = NvmlReader(StandInNvml([], init_error=oserror)).open()
    assert status.available is False
    assert status.error is not None and status.error.startswith("OSError: libnvidia-ml.so.1")
    assert status.hint is not None and "install the NVIDIA driver" in status.hint


def test_count_failure_after_init_releases_nvml() -> None:
    nvml = StandInNvml([h100()], count_error=pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN))
    reader = NvmlReader(nvml)
    status = reader.open()
    assert status.available is False and status.error == "Unknown Error"
    assert nvml.shutdown_calls == 1 and reader.read() == []
    reader.close()
    assert nvml.shutdown_calls == 1


def test_failed_open_can_be_retried_once_the_driver_loads() -> None:
    nvml = StandInNvml([h100()], init_error=pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    reader = NvmlReader(nvml)
    assert reader.open().available is False
    nvml.init_error = None
    assert reader.open().available is True
    assert len(reader.read()) == 1
    reader.close()


def test_open_is_cached_and_close_is_idempotent() -> None:
    nvml = StandInNvml([h100()])
    reader = NvmlReader(nvml)
    assert reader.status() == NvmlStatus(False, None, None, 0, None, None)
    assert reader.open() is reader.open()
    assert nvml.init_calls == 1
    reader.close()
    reader.close()
    assert nvml.shutdown_calls == 1
    assert reader.read() == [] and reader.status().available is False


# -- hints, from the real pynvml error classes ---------------------------------------------


@pytest.mark.parametrize(
    ("code", "class_name", "fragment"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "NVMLError_LibraryNotFound", "install the NVIDIA"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "NVMLError_DriverNotLoaded", "lsmod | grep nvidia"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "NVMLError_LibRmVersionMismatch", "reboot"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "NVMLError_NoPermission", "/dev/nvidia*"),
        (pynvml.NVML_ERROR_INSUFFICIENT_POWER, "NVMLError_InsufficientPower", "power cables"),
        (pynvml.NVML_ERROR_GPU_IS_LOST, "NVMLError_GpuIsLost", "Xid"),
        (pynvml.NVML_ERROR_UNINITIALIZED, "NVMLError_Uninitialized", "nvmlInit"),
        (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, "NVMLError_FunctionNotFound", "too old"),
        (pynvml.NVML_ERROR_UNKNOWN, "NVMLError_Unknown", "nvidia-smi"),
    ],
)
def test_hint_for_each_nvml_error(code: int, class_name: str, fragment: str) -> None:
    error = pynvml.NVMLError(code)
    assert type(error) is getattr(pynvml, class_name)  # pynvml builds the per-code subclass
    assert fragment in nvml_hint(error)


def test_hints_are_distinct_per_error() -> None:
    codes = (
        pynvml.NVML_ERROR_LIBRARY_NOT_FOUND,
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_INSUFFICIENT_POWER,
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_UNINITIALIZED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_UNKNOWN,
    )
    assert len({nvml_hint(pynvml.NVMLError(c)) for c in codes}) == len(codes)


def test_version_mismatch_is_recognised_by_text() -> None:
    # The real driver's wording, seen through an error class that carries no matching code.
    hint = nvml_hint(RuntimeError("Failed to initialize NVML: Driver/library version mismatch"))
    assert "upgraded without a reboot" in hint


def test_unlisted_nvml_error_gets_the_generic_nvml_hint() -> None:
    hint = nvml_hint(pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT))
    assert hint == nvml_hint(pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN))
    assert "nvidia-smi" in hint


def test_non_nvml_error_gets_a_generic_hint_naming_it() -> None:
    hint = nvml_hint(PermissionError("denied"))
    assert "PermissionError" in hint and "nvidia-smi" in hint
