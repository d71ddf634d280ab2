"""Put/get bandwidth of the cpu and disk tiers, each beside a reference measured in the same run.

For every chunk size the benchmark moves ``chunks = max(2, bytes_per_size // chunk_bytes)`` chunks
of random bytes (generated once per size, never timed) and times, with ``time.perf_counter``:

* cpu tier, against memcpy (memoryview slice assignment, a C memcpy, of the same chunks into a
  page-aligned anonymous map at the same offsets the arena would use):

  - ``put``: ``TieredStore([CpuTier(cap)]).put`` into a fresh store over a freshly mapped arena,
    so the timed puts also fault the arena's pages in; reference ``memcpy_first_touch`` copies
    into a freshly mapped buffer and pays the same faults.
  - ``get``: ``store.read_into`` of those chunks into slices of a preallocated, touched buffer;
    reference ``memcpy`` (into a buffer written before timing).
  - ``put_prefaulted``: the chunks evicted, then put again through another fresh store over the
    same, now touched, arena (a cache that has run a while); reference ``memcpy``.
  - ``tier_put`` / ``tier_get``: ``CpuTier.put`` / ``read_into`` without the store on that
    arena, so ``put_prefaulted`` vs ``tier_put`` and ``get`` vs ``tier_get`` show the store's own
    overhead; reference ``memcpy``.

* disk tier, against plain files in the same directory (same filesystem):

  - ``put``: ``TieredStore([DiskTier(dir, cap)]).put`` (checksum, header, temp file, rename) into
    the page cache; reference ``file_write``: open/``os.write``/close of one file per chunk.
  - ``put_fsync``: the same with ``DiskTier(fsync=True)`` (file and directory fsynced per put),
    on fewer chunks (at most 64 chunks or 64 MiB per sample); reference ``file_write_fsync``
    (``os.fsync`` before close), same count.
  - ``get_cold``: ``store.read_into`` after every chunk file was fsynced and dropped from the page
    cache (``posix_fadvise(POSIX_FADV_DONTNEED)``); reference ``file_read_cold``: ``readinto`` of
    the plain files, dropped the same way.
  - ``get_warm``: the same reads again, now from the page cache; reference ``file_read_warm``.
  - ``lease_batch_cold``: ``TieredStore([CpuTier, DiskTier]).lease_many`` of every chunk, on disk
    and dropped from the page cache: the data plane's path for a request's disk chunks (read in
    parallel by the store's read threads, outside its lock, straight into the cpu arena,
    checksummed, committed, the disk files deleted); reference ``pread_parallel_cold``: raw
    ``os.preadv`` of the payloads of the same chunk files by as many threads, no checksum.
  - ``lease_batch_warm``: the same after the chunks were demoted back to disk (so their files are
    in the page cache); reference ``pread_parallel_warm``: the same preads repeated.

  The tier's fan-out subdirectories are created before timing, as in a tier that has run a while.

Every figure is the median of ``repeats`` samples. Each repeat runs the reference half and the tier
half, swapping which goes first from one repeat to the next, so drift (writeback, discards, busy
neighbours) hits both alike. The result (JSON-safe)::

    {"benchmark": "store", "kvctl_version": str, "python": str, "platform": str,
     "cpu_count": int | None, "directory": str (where the temporary directory was made),
     "directory_filesystem": {"type", "mount_point", "device"} | None (from /proc/mounts),
     "page_cache_dropped": bool (False: no posix_fadvise, "cold" reads were warm),
     "bytes_per_size": int, "repeats": int, "elapsed_seconds": float,
     "results": [
       {"chunk_bytes": int, "chunks": int,
        "cpu": {"put" | "put_prefaulted" | "get" | "tier_put" | "tier_get": TIER_FIGURE},
        "disk": {"put" | "put_fsync" | "get_cold" | "get_warm" | "lease_batch_cold"
                 | "lease_batch_warm": TIER_FIGURE},
        "reference": {"memcpy" | "memcpy_first_touch" | "file_write" | "file_write_fsync"
                      | "file_read_cold" | "file_read_warm" | "pread_parallel_cold"
                      | "pread_parallel_warm": FIGURE}}, ...],
     "notes": [str, ...]}

    FIGURE = {"bytes_per_second": float (median), "chunks": int, "bytes": int (per sample),
              "samples_bytes_per_second": [float, ...]}
    TIER_FIGURE = FIGURE + {"reference": str (a key of "reference"),
                            "ratio_to_reference": float (bytes_per_second / the reference's)}

Peak memory is about four times ``bytes_per_size`` (the payload, up to two arenas or copy
targets, one read buffer); the disk files live under a temporary directory that is removed
before returning.
"""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import os
import pathlib
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from kvctl.bench.common import (
    alternating,
    check_sizes,
    drop_file_pages,
    figure,
    host_info,
    release_views,
    spot_check,
    spread,
)
from kvctl.errors import InvalidArgument
from kvctl.format import format_bytes, format_rate
from kvctl.store.store import DEFAULT_READ_THREADS, TieredStore
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.cpu import CpuTier, Lease
from kvctl.store.tiers.disk import DiskTier

if TYPE_CHECKING:
    from rich.table import Table

DEFAULT_SIZES_BYTES: tuple[int, ...] = (256 << 10, 4 << 20, 32 << 20)
DEFAULT_BYTES_PER_SIZE = 256 << 20
DEFAULT_REPEATS = 3
# One fsync costs milliseconds on an SSD and more on a virtual disk: bound the durable-write
# samples so the default run stays around a minute, while still spanning many fsyncs.
FSYNC_MAX_CHUNKS = 64
FSYNC_MAX_BYTES = 64 << 20

# Above this (max - min) / median, a figure is called out in the notes as noisy.
NOISY_SPREAD = 0.25
_KEY_BYTES = 16
# Figure name -> the reference it is divided by.
CPU_FIGURES: dict[str, str] = {
    "put": "memcpy_first_touch",
    "put_prefaulted": "memcpy",
    "get": "memcpy",
    "tier_put": "memcpy",
    "tier_get": "memcpy",
}
DISK_FIGURES: dict[str, str] = {
    "put": "file_write",
    "put_fsync": "file_write_fsync",
    "get_cold": "file_read_cold",
    "get_warm": "file_read_warm",
    "lease_batch_cold": "pread_parallel_cold",
    "lease_batch_warm": "pread_parallel_warm",
}
REFERENCES = (
    "memcpy",
    "memcpy_first_touch",
    "file_write",
    "file_write_fsync",
    "file_read_cold",
    "file_read_warm",
    "pread_parallel_cold",
    "pread_parallel_warm",
)
# Records one sample: (figure name such as "cpu.put", elapsed seconds).
_Record = Callable[[str, float], None]
_CAN_DROP_CACHE = hasattr(os, "posix_fadvise")
# Linux moves at most this many bytes per read/write call; larger requests come back short.
_MAX_IO_BYTES = 0x7FFFF000


def run_store_bench(
    sizes_bytes: list[int],
    *,
    bytes_per_size: int,
    directory: pathlib.Path | None,
    repeats: int = DEFAULT_REPEATS,
) -> dict[str, Any]:
    """Measure the cpu and disk tiers at each chunk size; see the module docstring for the
    result's layout. ``directory`` (default: the system temp dir) holds the disk tier's files,
    inside a temporary directory removed before returning."""
    sizes = _check_args(sizes_bytes, bytes_per_size, directory, repeats)
    parent = str(directory) if directory is not None else tempfile.gettempdir()
    filesystem = _filesystem_of(parent)
    started_s = time.perf_counter()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-", dir=parent) as workdir:
        for size in sizes:
            chunks = max(2, bytes_per_size // size)
            results.append(_bench_size(size, chunks, repeats, pathlib.Path(workdir)))
    return {
        "benchmark": "store",
        **host_info(),
        "directory": os.path.abspath(parent),
        "directory_filesystem": filesystem,
        "page_cache_dropped": _CAN_DROP_CACHE,
        "bytes_per_size": bytes_per_size,
        "repeats": repeats,
        "elapsed_seconds": time.perf_counter() - started_s,
        "results": results,
        "notes": _notes(repeats, filesystem) + _noise_notes(results),
    }


def render_store_bench(result: dict[str, Any]) -> Table:
    """A table for people: one row per figure, beside its reference and the ratio."""
    from rich.table import Table

    fs = result.get("directory_filesystem") or {}
    cold = "page cache dropped" if result.get("page_cache_dropped") else "page cache NOT dropped"
    table = Table(
        title=f"kvctl store bandwidth (median of {result['repeats']} repeats)",
        caption=(
            f"disk files in {result['directory']} ({fs.get('type', 'unknown filesystem')}); "
            f"cold reads: {cold} (fsync + fadvise DONTNEED); spread = (max - min) / median of the "
            "samples; ratio = figure / reference"
        ),
    )
    table.add_column("chunk", justify="right")
    table.add_column("figure")
    table.add_column("bandwidth", justify="right")
    table.add_column("spread", justify="right")
    table.add_column("reference")
    table.add_column("ref. bandwidth", justify="right")
    table.add_column("ratio", justify="right")
    for row in result["results"]:
        chunk = format_bytes(row["chunk_bytes"])
        for section in ("cpu", "disk"):
            for name, fig in row[section].items():
                ref = row["reference"][fig["reference"]]
                table.add_row(
                    f"{chunk} x {fig['chunks']}",
                    _LABELS.get(f"{section}.{name}", f"{section} {name}"),
                    format_rate(fig["bytes_per_second"]),
                    f"{spread(fig):.0%}" if len(fig["samples_bytes_per_second"]) > 1 else "-",
                    _LABELS.get(fig["reference"], fig["reference"]),
                    format_rate(ref["bytes_per_second"]),
                    f"{fig['ratio_to_reference']:.2f}",
                )
        table.add_section()
    return table


_LABELS = {
    "cpu.put": "cpu put (store, fresh arena)",
    "cpu.put_prefaulted": "cpu put (store)",
    "cpu.get": "cpu get (store)",
    "cpu.tier_put": "cpu put (tier only)",
    "cpu.tier_get": "cpu get (tier only)",
    "disk.put": "disk put (page cache)",
    "disk.put_fsync": "disk put (fsync)",
    "disk.get_cold": "disk get (cold)",
    "disk.get_warm": "disk get (warm)",
    "disk.lease_batch_cold": "disk->cpu lease batch (cold)",
    "disk.lease_batch_warm": "disk->cpu lease batch (warm)",
    "memcpy": "memcpy",
    "memcpy_first_touch": "memcpy (fresh buffer)",
    "file_write": "file write",
    "file_write_fsync": "file write + fsync",
    "file_read_cold": "file read (cold)",
    "file_read_warm": "file read (warm)",
    "pread_parallel_cold": f"parallel pread x{DEFAULT_READ_THREADS} (cold)",
    "pread_parallel_warm": f"parallel pread x{DEFAULT_READ_THREADS} (warm)",
}


# --- one chunk size ---------------------------------------------------------------------------
def _bench_size(size: int, n: int, repeats: int, workdir: pathlib.Path) -> dict[str, Any]:
    total = size * n
    fsync_n = min(n, max(2, min(FSYNC_MAX_CHUNKS, FSYNC_MAX_BYTES // size)))
    # One block of payload for all chunks: memory stays at bytes_per_size however small they are.
    payload = os.urandom(total)
    keys = [os.urandom(_KEY_BYTES) for _ in range(n)]
    offsets = [i * size for i in range(n)]
    seconds: dict[str, list[float]] = {}

    def add(name: str, elapsed_seconds: float) -> None:
        seconds.setdefault(name, []).append(elapsed_seconds)

    with contextlib.ExitStack() as stack:
        src = stack.enter_context(memoryview(payload))
        chunks = [src[off : off + size] for off in offsets]
        stack.callback(release_views, chunks)
        sink = stack.enter_context(_mapped(total))
        sink_view = stack.enter_context(memoryview(sink))
        sink_view[:] = src  # fault the read buffer in before anything is timed
        outs = [sink_view[off : off + size] for off in offsets]
        stack.callback(release_views, outs)

        _bench_cpu(add, keys, chunks, outs, sink, offsets, repeats)
        _bench_disk(add, keys, chunks, outs, fsync_n, repeats, workdir)
        _bench_lease_batch(add, keys, chunks, repeats, workdir)

    figure_chunks = {"put_fsync": fsync_n, "file_write_fsync": fsync_n}
    reference = {
        name: figure(seconds[f"reference.{name}"], figure_chunks.get(name, n), size)
        for name in REFERENCES
    }
    result: dict[str, Any] = {"chunk_bytes": size, "chunks": n}
    for section, figures in (("cpu", CPU_FIGURES), ("disk", DISK_FIGURES)):
        result[section] = {}
        for name, ref_name in figures.items():
            fig = figure(seconds[f"{section}.{name}"], figure_chunks.get(name, n), size)
            fig["reference"] = ref_name
            fig["ratio_to_reference"] = (
                fig["bytes_per_second"] / reference[ref_name]["bytes_per_second"]
            )
            result[section][name] = fig
    result["reference"] = reference
    return result


def _bench_cpu(
    add: _Record,
    keys: list[bytes],
    chunks: list[memoryview],
    outs: list[memoryview],
    sink: mmap.mmap,
    offsets: list[int],
    repeats: int,
) -> None:
    size = chunks[0].nbytes
    total = size * len(chunks)
    metas = [ChunkMeta(key=key, size_bytes=size) for key in keys]

    def reference() -> None:
        with _mapped(total) as fresh:
            add("reference.memcpy_first_touch", _copy_into(fresh, offsets, chunks))
        add("reference.memcpy", _copy_into(sink, offsets, chunks))

    def tier() -> None:
        # A freshly mapped arena: the first puts fault its pages in, later ones find them.
        cpu_tier = CpuTier(total)
        try:
            store = TieredStore([cpu_tier])
            add("cpu.put", _store_puts(store, keys, chunks))
            add("cpu.get", _store_gets(store, keys, outs, chunks))
            store.evict(keys)
            # A fresh store (not closed: that would close the tier) over the now touched arena.
            store = TieredStore([cpu_tier])
            add("cpu.put_prefaulted", _store_puts(store, keys, chunks))
            store.evict(keys)

            t0 = time.perf_counter()
            for meta, chunk in zip(metas, chunks, strict=True):
                cpu_tier.put(meta, chunk)
            add("cpu.tier_put", time.perf_counter() - t0)
            t0 = time.perf_counter()
            for key, out in zip(keys, outs, strict=True):
                cpu_tier.read_into(key, out)
            add("cpu.tier_get", time.perf_counter() - t0)
            spot_check(outs, chunks)
        finally:
            cpu_tier.close()

    alternating(repeats, reference, tier)


def _bench_disk(
    add: _Record,
    keys: list[bytes],
    chunks: list[memoryview],
    outs: list[memoryview],
    fsync_n: int,
    repeats: int,
    workdir: pathlib.Path,
) -> None:
    total = chunks[0].nbytes * len(chunks)
    tier_dir = workdir / "tier"
    files_dir = workdir / "files"
    paths = [str(files_dir / f"{i:08d}.bin") for i in range(len(chunks))]

    def reference() -> None:  # plain files: no checksum, no header, no rename
        add("reference.file_write", _write_files(paths, chunks, fsync=False))
        drop_file_pages(paths)
        add("reference.file_read_cold", _read_files(paths, outs))
        add("reference.file_read_warm", _read_files(paths, outs))
        spot_check(outs, chunks)
        _remove_files(paths, files_dir)
        add(
            "reference.file_write_fsync",
            _write_files(paths[:fsync_n], chunks[:fsync_n], fsync=True),
        )
        _remove_files(paths[:fsync_n], files_dir)

    def tier() -> None:
        store = TieredStore([DiskTier(tier_dir, total)])
        try:
            add("disk.put", _store_puts(store, keys, chunks))
            drop_file_pages(_files_under(tier_dir))
            add("disk.get_cold", _store_gets(store, keys, outs, chunks))
            add("disk.get_warm", _store_gets(store, keys, outs, chunks))
            store.evict(keys)
        finally:
            store.close()
        _fsync_dirs(tier_dir)  # commit the deletes so the fsync samples do not pay for them

        store = TieredStore([DiskTier(tier_dir, total, fsync=True)])
        try:
            add("disk.put_fsync", _store_puts(store, keys[:fsync_n], chunks[:fsync_n]))
            store.evict(keys[:fsync_n])
        finally:
            store.close()
        _fsync_dirs(tier_dir)

    try:
        _make_fanout(tier_dir, keys)
        files_dir.mkdir()
        alternating(repeats, reference, tier)
    finally:
        shutil.rmtree(tier_dir, ignore_errors=True)
        shutil.rmtree(files_dir, ignore_errors=True)


def _bench_lease_batch(
    add: _Record,
    keys: list[bytes],
    chunks: list[memoryview],
    repeats: int,
    workdir: pathlib.Path,
) -> None:
    """Disk -> cpu through ``lease_many`` against raw parallel preads of the same chunk files.
    Between halves the chunks are back on disk (demoted), so each half finds the same state."""
    size = chunks[0].nbytes
    total = size * len(chunks)
    tier_dir = workdir / "lease"
    _make_fanout(tier_dir, keys)
    store = TieredStore([CpuTier(total), DiskTier(tier_dir, total)])
    pool = ThreadPoolExecutor(DEFAULT_READ_THREADS, thread_name_prefix="kvctl-bench-pread")
    try:
        # into the cpu tier first, then demoted: the arena's pages are faulted in before timing
        _store_puts(store, keys, chunks)
        store.flush("cpu", demote=True)

        def reference() -> None:
            paths = _files_under(tier_dir)
            drop_file_pages(paths)
            add("reference.pread_parallel_cold", _pread_parallel(pool, paths, size))
            add("reference.pread_parallel_warm", _pread_parallel(pool, paths, size))

        def tier() -> None:
            drop_file_pages(_files_under(tier_dir))
            add("disk.lease_batch_cold", _lease_batch(store, keys, chunks))
            store.flush("cpu", demote=True)  # back to disk: new files, in the page cache
            add("disk.lease_batch_warm", _lease_batch(store, keys, chunks))
            store.flush("cpu", demote=True)
            if store.locate(keys) != ["disk"] * len(keys):
                raise RuntimeError("the benchmark chunks did not all go back to disk")

        alternating(repeats, reference, tier)
    finally:
        pool.shutdown()
        store.close()
        shutil.rmtree(tier_dir, ignore_errors=True)


# --- timed loops ------------------------------------------------------------------------------
def _lease_batch(store: TieredStore, keys: list[bytes], chunks: list[memoryview]) -> float:
    t0 = time.perf_counter()
    leases = store.lease_many(keys, math.inf)
    elapsed_seconds = time.perf_counter() - t0
    held = [lease for lease in leases if isinstance(lease, Lease)]
    try:
        if len(held) != len(keys):
            raise RuntimeError(f"the store leased {len(held)} of {len(keys)} benchmark chunks")
        views = [store.leased_view(lease) for lease in held]
        try:
            spot_check(views, chunks)
        finally:
            release_views(views)
    finally:
        store.release(lease.lease_id for lease in held)
    return elapsed_seconds


def _pread_parallel(pool: ThreadPoolExecutor, paths: list[str], size: int) -> float:
    """Each file's last ``size`` bytes (a chunk file's payload) read by the pool's threads into
    buffers of their own, like a store read into its arena; no checksum."""
    bufs = [bytearray(size) for _ in paths]  # allocated and touched before timing

    def read(i: int) -> None:
        fd = os.open(paths[i], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            offset = os.fstat(fd).st_size - size
            view = memoryview(bufs[i])
            got = 0
            while got < size:
                step = os.preadv(fd, [view[got : got + _MAX_IO_BYTES]], offset + got)
                if step <= 0:
                    raise RuntimeError(f"{paths[i]} is shorter than a chunk")
                got += step
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    for _ in pool.map(read, range(len(paths))):
        pass
    return time.perf_counter() - t0


def _copy_into(dest: mmap.mmap, offsets: list[int], chunks: list[memoryview]) -> float:
    with memoryview(dest) as view:
        t0 = time.perf_counter()
        for off, chunk in zip(offsets, chunks, strict=True):
            view[off : off + chunk.nbytes] = chunk
        return time.perf_counter() - t0


def _store_puts(store: TieredStore, keys: list[bytes], chunks: list[memoryview]) -> float:
    t0 = time.perf_counter()
    for key, chunk in zip(keys, chunks, strict=True):
        store.put(key, chunk)
    elapsed_seconds = time.perf_counter() - t0
    if len(store) != len(keys):  # a policy declining a put would make the figure meaningless
        raise RuntimeError(f"the store kept {len(store)} of {len(keys)} benchmark chunks")
    return elapsed_seconds


def _store_gets(
    store: TieredStore, keys: list[bytes], outs: list[memoryview], chunks: list[memoryview]
) -> float:
    t0 = time.perf_counter()
    for key, out in zip(keys, outs, strict=True):
        store.read_into(key, out)
    elapsed_seconds = time.perf_counter() - t0
    spot_check(outs, chunks)
    return elapsed_seconds


def _write_files(paths: list[str], chunks: list[memoryview], *, fsync: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    t0 = time.perf_counter()
    for path, chunk in zip(paths, chunks, strict=True):
        fd = os.open(path, flags, 0o644)
        try:
            written = os.write(fd, chunk)
            while written < chunk.nbytes:  # only chunks over ~2 GiB come back short
                written += os.write(fd, chunk[written : written + _MAX_IO_BYTES])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _read_files(paths: list[str], outs: list[memoryview]) -> float:
    t0 = time.perf_counter()
    for path, out in zip(paths, outs, strict=True):
        with io.FileIO(path, "r") as f:
            got = f.readinto(out)
            while got < out.nbytes:
                step = f.readinto(out[got:])
                if not step:
                    raise RuntimeError(f"{path} is shorter than the {out.nbytes} bytes written")
                got += step
    return time.perf_counter() - t0


# --- file system helpers (untimed) ------------------------------------------------------------
def _make_fanout(tier_dir: pathlib.Path, keys: list[bytes]) -> None:
    """Let a DiskTier create the subdirectories these keys fan out to, then persist them, so
    timed puts do not pay for mkdir (and, with fsync=True, for fsyncing the parent)."""
    tier = DiskTier(tier_dir, len(keys))
    try:
        for key in keys:
            tier.put(ChunkMeta(key=key, size_bytes=1), b"\0")
        for key in keys:
            tier.delete(key)
    finally:
        tier.close()
    _fsync_dirs(tier_dir)


def _files_under(root: pathlib.Path) -> list[str]:
    """Chunk files of a tier directory (skipping the lock file and anything hidden)."""
    found: list[str] = []
    for dirpath, _dirnames, filenames in os.walk(root):
        found.extend(os.path.join(dirpath, f) for f in filenames if not f.startswith("."))
    return found


def _fsync_dirs(root: pathlib.Path) -> None:
    for dirpath, _dirnames, _filenames in os.walk(root):
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_files(paths: list[str], parent: pathlib.Path) -> None:
    for path in paths:
        os.unlink(path)
    _fsync_dirs(parent)


@contextlib.contextmanager
def _mapped(size_bytes: int) -> Iterator[mmap.mmap]:
    """A page-aligned anonymous map, like the CpuTier arena, unmapped on exit."""
    m = mmap.mmap(-1, size_bytes)
    try:
        yield m
    finally:
        with contextlib.suppress(BufferError):  # a view still alive: unmapped when collected
            m.close()


# --- results ----------------------------------------------------------------------------------


def _noise_notes(results: list[dict[str, Any]]) -> list[str]:
    noisy = [
        f"{format_bytes(row['chunk_bytes'])} {section}.{name}"
        for row in results
        for section in ("cpu", "disk", "reference")
        for name, fig in row[section].items()
        if spread(fig) > NOISY_SPREAD
    ]
    if not noisy:
        return []
    return [
        f"samples of {len(noisy)} figures spread by more than {NOISY_SPREAD:.0%} of their median "
        f"({', '.join(noisy)}): the machine was busy or its storage is erratic; read those "
        "ratios with care, or rerun with more repeats"
    ]


def _notes(repeats: int, filesystem: dict[str, str] | None) -> list[str]:
    notes = [
        f"each figure is the median of {repeats} samples; ratio_to_reference = figure / reference",
        "cpu.put runs a fresh store over a freshly mapped arena, so it includes first-touch page "
        "faults, as does its reference memcpy_first_touch; put_prefaulted, get and tier_* use an "
        "arena written before timing and are compared with memcpy into a touched buffer",
        "disk tier figures include an xxh3-64 checksum of the payload (put and get), a header "
        "and, for puts, a temp file plus rename; the plain-file references have none of these",
        "disk.put and file_write go to the page cache; writing it back to the device is not timed",
        f"put_fsync / file_write_fsync use at most {FSYNC_MAX_CHUNKS} chunks or "
        f"{FSYNC_MAX_BYTES >> 20} MiB per sample (see their 'chunks'); the tier also fsyncs the "
        "chunk's directory after the rename",
        "cold reads: every file was fsynced and dropped with posix_fadvise(DONTNEED) before the "
        "timed reads; inodes and directories stay cached, and a virtual disk may still be "
        "cached by its host; warm reads are the same reads repeated, from the page cache",
    ]
    if not _CAN_DROP_CACHE:
        notes.append("posix_fadvise is unavailable here: the 'cold' reads were served warm")
    fs_type = (filesystem or {}).get("type")
    if fs_type in ("tmpfs", "ramfs"):
        notes.append(
            f"the directory is on {fs_type}: 'disk' figures measure memory, fsync is a no-op and "
            "cold reads cannot be cold; pass --dir on a real disk"
        )
    elif fs_type is None:
        notes.append("the directory's filesystem could not be identified from /proc/mounts")
    return notes


# --- arguments and environment ----------------------------------------------------------------
def _check_args(
    sizes_bytes: Sequence[int], bytes_per_size: int, directory: pathlib.Path | None, repeats: int
) -> list[int]:
    sizes = check_sizes(sizes_bytes, bytes_per_size, repeats)
    if directory is not None:
        path = pathlib.Path(directory)
        if not path.is_dir():
            raise InvalidArgument(f"benchmark directory {path} is missing or not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise InvalidArgument(f"benchmark directory {path} is not writable")
    return sizes


def _filesystem_of(path: str) -> dict[str, str] | None:
    """The /proc/mounts entry whose mount point holds ``path`` (the last of equals wins, as a
    later mount hides an earlier one), or None where there is no /proc/mounts."""
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best: dict[str, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        device, mount_point, fs_type = (_unescape_mount(x) for x in fields[:3])
        inside = real == mount_point or real.startswith(mount_point.rstrip("/") + "/")
        if inside and (best is None or len(mount_point) >= len(best["mount_point"])):
            best = {"type": fs_type, "mount_point": mount_point, "device": device}
    return best


def _unescape_mount(field: str) -> str:
    # /proc/mounts writes space, tab, newline and backslash as octal escapes (\040 ...)
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
