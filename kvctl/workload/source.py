"""Pick a workload: a Mooncake trace file, or the seeded built-in mix when there is none."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from kvctl.workload.trace import TraceRequest, read_mooncake_trace


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: list[TraceRequest]


def load_workload(
    trace: str | pathlib.Path | None, *, seed: int = 0, limit: int | None = None
) -> Workload:
    """``trace`` None means the built-in workload (``builtin:seed=N``)."""
    if trace is None:
        from kvctl.workload.builtin import builtin_workload

        requests = (
            builtin_workload(seed) if limit is None else builtin_workload(seed, requests=limit)
        )
        return Workload(f"builtin:seed={seed}", requests)
    path = pathlib.Path(trace)
    if not path.is_file():
        raise FileNotFoundError(2, "no such trace file", str(path))
    return Workload(str(path), read_mooncake_trace(path, limit=limit))
