"""How long a disk tier takes to open: after a clean close (its index read, ``disk_index``) beside
after a crash (every chunk file's header read: the scan), on the same directory in the same run.

The agent serves nothing until its tiers are open, so this is the cache's downtime on each
restart of a node with a large disk tier. ``chunks`` chunk files of ``chunk_bytes`` are written
once (not timed) through a real ``DiskTier``; then each repeat opens the directory both ways,
swapping which goes first, each from the same cache state:

- ``warm``: the files' pages and inodes in memory (a restart right after a stop);
- ``cold``: each chunk file's pages dropped first (fsync + ``posix_fadvise(DONTNEED)``): their
  data is read from the device again, their inodes and directory entries stay cached;
- ``cold_all`` (``drop_all_caches``, root only): the kernel's page, inode and dentry caches all
  dropped (``/proc/sys/vm/drop_caches``) before each open: a reboot's cold start. It drops
  every process's caches on the machine, so it is asked for, never the default.

Each figure is the median open, beside the scan of the same directory (the reference) and the
ratio; ``close_seconds`` is what the clean close spent writing the index. The result::

    {"benchmark": "reopen", ...host, "directory", "chunks", "chunk_bytes", "repeats",
     "index_bytes", "close_seconds": float (median),
     "figures": {"warm" | "cold" | "cold_all": {"index_open_seconds": float,
                 "scan_open_seconds": float, "scan_over_index_ratio": float,
                 "samples_index_seconds": [...], "samples_scan_seconds": [...]}},
     "elapsed_seconds": float, "notes": [str]}
"""

from __future__ import annotations

import os
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvctl.bench.common import alternating, drop_file_pages, files_under, host_info
from kvctl.errors import InvalidArgument
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.disk import DiskTier
from kvctl.store.tiers.disk_index import INDEX_NAME

DEFAULT_CHUNKS = 20_000
DEFAULT_CHUNK_BYTES = 4 << 10
DEFAULT_REPEATS = 3
_DROP_CACHES = "/proc/sys/vm/drop_caches"


def run_reopen_bench(
    *,
    chunks: int = DEFAULT_CHUNKS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    repeats: int = DEFAULT_REPEATS,
    directory: pathlib.Path | None = None,
    drop_all_caches: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fill a disk tier in a temporary directory under ``directory`` (default: the system temp
    dir; removed at the end), then time its opens; see the module docstring."""
    if chunks < 1 or chunk_bytes < 1 or repeats < 1:
        raise InvalidArgument(
            f"chunks, chunk size and repeats must be at least 1, got {chunks}, {chunk_bytes}, "
            f"{repeats}"
        )
    if drop_all_caches and not os.access(_DROP_CACHES, os.W_OK):
        raise InvalidArgument(
            f"--drop-all-caches writes {_DROP_CACHES}, which this user cannot (root only)"
        )
    say = progress or (lambda _msg: None)
    parent = str(directory) if directory is not None else tempfile.gettempdir()
    started_s = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-reopen-", dir=parent) as workdir:
        tier_dir = pathlib.Path(workdir) / "disk"
        say(f"writing {chunks:,} chunk files of {chunk_bytes:,} bytes (not timed)")
        _fill(tier_dir, chunks, chunk_bytes)
        index_bytes = (tier_dir / INDEX_NAME).stat().st_size
        closes: list[float] = []
        modes = ["warm", "cold", *(["cold_all"] if drop_all_caches else [])]
        figures: dict[str, Any] = {}
        for mode in modes:
            say(f"opening it {repeats} times each way, {mode}")
            index_s: list[float] = []
            scan_s: list[float] = []

            def by_index(mode: str = mode, out: list[float] = index_s) -> None:
                out.append(_timed_open(tier_dir, mode, closes))

            def by_scan(mode: str = mode, out: list[float] = scan_s) -> None:
                (tier_dir / INDEX_NAME).unlink()  # as a crash leaves it
                out.append(_timed_open(tier_dir, mode, None))

            alternating(repeats, by_scan, by_index)
            index_med, scan_med = statistics.median(index_s), statistics.median(scan_s)
            figures[mode] = {
                "index_open_seconds": index_med,
                "scan_open_seconds": scan_med,
                "scan_over_index_ratio": scan_med / max(index_med, 1e-9),
                "samples_index_seconds": index_s,
                "samples_scan_seconds": scan_s,
            }
    return {
        "benchmark": "reopen",
        **host_info(),
        "directory": os.path.abspath(parent),
        "chunks": chunks,
        "chunk_bytes": chunk_bytes,
        "repeats": repeats,
        "index_bytes": index_bytes,
        "close_seconds": statistics.median(closes),
        "figures": figures,
        "elapsed_seconds": time.perf_counter() - started_s,
        "notes": [
            "index_open: the open after a clean close (its index read, each listed file "
            "trusted); scan_open (the reference): after a crash (every chunk file's header read)",
            "cold: each chunk file's pages dropped (fadvise DONTNEED), its inode still cached; "
            "cold_all (--drop-all-caches): every cache of the machine dropped",
            "close_seconds: the clean close, which writes the index",
        ],
    }


def render_reopen_bench(result: dict[str, Any]) -> Any:
    """A table for people: per cache state, the open through the index beside the scan."""
    from rich.table import Table

    table = Table(
        title=(
            f"disk tier open: {result['chunks']:,} chunks of {result['chunk_bytes']:,} bytes "
            f"(median of {result['repeats']})"
        ),
        caption=(
            f"index {result['index_bytes']:,} bytes, written by the clean close in "
            f"{result['close_seconds']:.2f} s; scan = every chunk file's header read, as "
            "after a crash"
        ),
    )
    for col in ("cache", "after a clean close", "after a crash (scan)", "scan / clean"):
        table.add_column(col, justify="left" if col == "cache" else "right")
    for mode, fig in result["figures"].items():
        table.add_row(
            mode,
            f"{fig['index_open_seconds']:.2f} s",
            f"{fig['scan_open_seconds']:.2f} s",
            f"{fig['scan_over_index_ratio']:.1f}x",
        )
    return table


def _fill(tier_dir: pathlib.Path, chunks: int, chunk_bytes: int) -> None:
    payload = os.urandom(chunk_bytes)
    with DiskTier(tier_dir, chunks * chunk_bytes) as tier:
        for _ in range(chunks):  # random keys: spread over the fan-out dirs, as real ones are
            tier.put(ChunkMeta(key=os.urandom(16), size_bytes=chunk_bytes, tokens=16), payload)


def _timed_open(tier_dir: pathlib.Path, mode: str, closes: list[float] | None) -> float:
    """Seconds to open the tier at ``tier_dir`` from cache state ``mode``; the close after it
    (which writes the index) timed into ``closes`` where given."""
    if mode == "cold":
        drop_file_pages(files_under(tier_dir))
    elif mode == "cold_all":
        os.sync()
        with open(_DROP_CACHES, "w") as f:
            f.write("3\n")
    t0 = time.perf_counter()
    tier = DiskTier(tier_dir, 1 << 60)
    opened_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    tier.close()
    if closes is not None:
        closes.append(time.perf_counter() - t1)
    return opened_s
