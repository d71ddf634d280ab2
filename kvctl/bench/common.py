"""What every benchmark shares: timing order, figures from samples, a description of the host."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Callable
from typing import Any

import kvctl


def alternating(repeats: int, reference: Callable[[], None], measured: Callable[[], None]) -> None:
    """Run both halves ``repeats`` times, swapping which goes first each time, so drift and
    whatever the previous step left behind (dirty pages, pending discards) hit both alike."""
    for r in range(repeats):
        first, second = (reference, measured) if r % 2 == 0 else (measured, reference)
        first()
        second()


def figure(samples_seconds: list[float], chunks: int, chunk_bytes: int) -> dict[str, Any]:
    """Bytes per second of moving ``chunks`` x ``chunk_bytes``, median over the samples."""
    nbytes = chunks * chunk_bytes
    # perf_counter can tick 0 for a tiny sample on a coarse clock; keep the rate finite
    rates = [nbytes / max(s, 1e-9) for s in samples_seconds]
    return {
        "bytes_per_second": statistics.median(rates),
        "chunks": chunks,
        "bytes": nbytes,
        "samples_bytes_per_second": rates,
    }


def host_info() -> dict[str, Any]:
    return {
        "kvctl_version": kvctl.__version__,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
