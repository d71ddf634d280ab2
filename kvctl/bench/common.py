"""What every benchmark shares: timing order, figures from samples, a description of the host."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvctl
from kvctl.errors import InvalidArgument

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor

    from kvctl.agent.daemon import AgentState
    from kvctl.remote.agent_source import AgentSource

#: how long a bench agent gets to stop on SIGTERM before it is killed
AGENT_STOP_GRACE_S = 30.0


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


def parallel_probe_seconds(
    source: AgentSource, each_bytes: int, streams: int, workers: ThreadPoolExecutor
) -> float:
    """Wall seconds for ``streams`` PROBE downloads at once, one per connection, ``each_bytes``
    each (in pieces of at most the protocol's maximum): the socket's bound for a pull split over
    as many streams, with no chunk, index or arena in it. ``workers`` runs at least ``streams``."""
    from kvctl.wire.protocol import MAX_PROBE_BYTES

    def one(_: int) -> None:
        left = each_bytes
        while left > 0:
            n = min(left, MAX_PROBE_BYTES)
            source.probe_transfer(n)
            left -= n

    started = time.perf_counter()
    list(workers.map(one, range(streams)))
    return max(time.perf_counter() - started, 1e-9)


def drop_file_pages(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Write each file back, then evict its pages from the page cache (fadvise drops clean
    pages only), so the next read of it comes from the device. Where there is no
    posix_fadvise the files are written back only."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(root: str | os.PathLike[str]) -> list[str]:
    """Every regular file under ``root``, at any depth."""
    return [os.path.join(d, f) for d, _dirs, names in os.walk(root) for f in names]


def host_info() -> dict[str, Any]:
    return {
        "kvctl_version": kvctl.__version__,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


@contextlib.contextmanager
def spawned_agent(data_dir: Path, *argv: str) -> Iterator[AgentState]:
    """An agent on loopback (ephemeral ports, no user config file, no KVCTL_* settings from the
    environment), stopped on the way out whatever happened: SIGTERM, then SIGKILL after a grace
    period."""
    with spawned_agent_process(data_dir, *argv) as (_proc, state):
        yield state


@contextlib.contextmanager
def spawned_agent_process(
    data_dir: Path, *argv: str, env: Mapping[str, str] | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], AgentState]]:
    """``spawned_agent`` with its process (to kill it) and ``env``: KVCTL_* settings for it."""
    from kvctl.agent.daemon import spawn_agent

    child_env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    child_env["XDG_CONFIG_HOME"] = str(data_dir / "xdg")  # no user config file leaks in
    child_env.update(env or {})
    loopback = ["--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0"]
    proc, state = spawn_agent([*loopback, *argv], data_dir, env=child_env, detach=False)
    try:
        yield proc, state
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(AGENT_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def release_views(views: list[memoryview]) -> None:
    for view in views:
        view.release()


def spot_check(outs: list[memoryview], chunks: list[memoryview]) -> None:
    """First and last chunk read back must be the bytes written (cheap; not a full compare)."""
    for i in (0, len(chunks) - 1):
        if outs[i].tobytes() != chunks[i].tobytes():
            raise RuntimeError(f"benchmark chunk {i} read back different bytes")


def spread(fig: dict[str, Any]) -> float:
    """(max - min) / median of a figure's samples: 0 for a single sample."""
    samples = fig["samples_bytes_per_second"]
    return (max(samples) - min(samples)) / statistics.median(samples)


def check_sizes(sizes_bytes: Sequence[int], bytes_per_size: int, repeats: int) -> list[int]:
    """The chunk sizes, bytes per size and repeats every size-sweeping benchmark takes, checked
    before anything is allocated (bools are not counts)."""
    sizes = list(sizes_bytes)
    if not sizes:
        raise InvalidArgument("give at least one chunk size")
    for size in sizes:
        if not _is_int(size) or size <= 0:
            raise InvalidArgument(f"chunk sizes must be positive numbers of bytes, got {size!r}")
    if not _is_int(bytes_per_size) or bytes_per_size <= 0:
        raise InvalidArgument(f"bytes_per_size must be a positive integer, got {bytes_per_size!r}")
    if not _is_int(repeats) or repeats < 1:
        raise InvalidArgument(f"repeats must be an integer of at least 1, got {repeats!r}")
    return sizes


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
