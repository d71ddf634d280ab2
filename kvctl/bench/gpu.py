"""Put/get bandwidth of the gpu tier beside bare host <-> device copies from the same run.

Runs only where CUDA is available (torch built with CUDA, a visible device); elsewhere
``run_gpu_bench`` measures nothing and returns the reason under "skipped".

For every chunk size the benchmark moves ``chunks = max(2, bytes_per_size // chunk_bytes)``
chunks of random bytes (generated once per size, never timed) and times, with
``time.perf_counter``:

* ``gpu.put``: ``GpuTier.put`` of each chunk from ordinary (pageable) host memory: a memcpy into
  a pinned staging slot and a copy to the device, piece by piece over two slots, returning once
  the chunk is on the device. Reference ``h2d_pinned``: a bare torch
  ``device[off:off+n].copy_(pinned[off:off+n], non_blocking=True)`` and a stream synchronize per
  chunk, from pinned host memory that already holds the bytes (the bus alone).
* ``gpu.get``: ``GpuTier.read_into`` of each chunk into a pageable host buffer. Reference
  ``d2h_pinned``: the bare copy the other way, device to pinned host memory, synchronized per
  chunk.
* ``gpu.put_registered`` / ``gpu.get_registered``: the same, from and into a shared host
  mapping (a memfd, as the agent's cpu arena and clients' staging segments are) registered with
  the tier (``GpuTier.register_host_region``): one copy per chunk, no staging. References
  ``h2d_registered`` / ``d2h_registered``: the bare ``copy_`` from and to that registered
  mapping; each figure also has ``ratio_to_pinned`` (to the bare pinned copy). Left out, with a
  note, when CUDA refuses to register the mapping.
* reference ``memcpy``: the same chunks copied between two pageable host buffers (memoryview
  slice assignment): the host half of the staged path's work, which the bare copies do not do.

Every figure is the median of ``repeats`` samples; each repeat runs the references and the tier,
swapping which goes first. One untimed round of each warms the CUDA context and the copies up.
The result (JSON-safe)::

    {"benchmark": "gpu", "kvctl_version": str, "python": str, "platform": str,
     "cpu_count": int | None, "device": str,
     # where CUDA is unavailable, only this besides the above:
     "skipped": str,
     # otherwise:
     "device_name": str, "torch": str, "cuda": str | None, "staging_slot_bytes": int,
     "bytes_per_size": int, "repeats": int, "elapsed_seconds": float,
     "results": [{"chunk_bytes": int, "chunks": int,
                  "registered": bool, "registered_is_pinned": bool | None,
                  "gpu": {"put" | "get" | "put_registered" | "get_registered": TIER_FIGURE},
                  "reference": {"h2d_pinned" | "d2h_pinned" | "h2d_registered"
                                | "d2h_registered" | "memcpy": FIGURE}}, ...],
     "notes": [str, ...]}

FIGURE and TIER_FIGURE are as in ``kvctl.bench.store``; a registered TIER_FIGURE also has
``ratio_to_pinned``. ``registered_is_pinned`` is what torch's ``is_pinned()`` says of registered
memory (nothing relies on it). Peak memory: five times ``bytes_per_size`` of host memory
(payload, read buffer, memcpy target, two registered mappings), two times pinned, and two times
on the device (the tier's arena and the reference buffer).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvctl.bench.common import (
    alternating,
    check_sizes,
    figure,
    host_info,
    release_views,
    spot_check,
    spread,
)
from kvctl.format import format_bytes, format_rate
from kvctl.store.tiers.base import ChunkMeta
from kvctl.store.tiers.gpu import (
    STAGING_SLOT_BYTES,
    GpuTier,
    gpu_available,
    host_view,
    parse_device,
)

if TYPE_CHECKING:
    from rich.table import Table

DEFAULT_SIZES_BYTES: tuple[int, ...] = (4 << 20, 32 << 20)
DEFAULT_BYTES_PER_SIZE = 256 << 20
DEFAULT_REPEATS = 3
DEFAULT_DEVICE = "cuda:0"
#: figure name -> the reference it is divided by
GPU_FIGURES: dict[str, str] = {
    "put": "h2d_pinned",
    "get": "d2h_pinned",
    "put_registered": "h2d_registered",
    "get_registered": "d2h_registered",
}
#: registered figure -> the bare pinned copy it is also compared with
PINNED_OF: dict[str, str] = {"put_registered": "h2d_pinned", "get_registered": "d2h_pinned"}
REFERENCES = ("h2d_pinned", "d2h_pinned", "h2d_registered", "d2h_registered", "memcpy")
_REGISTERED_REFERENCES = ("h2d_registered", "d2h_registered")
#: above this (max - min) / median, a figure is called out in the notes as noisy
NOISY_SPREAD = 0.25
_KEY_BYTES = 16
_LABELS = {
    "gpu.put": "gpu put (tier, pageable source)",
    "gpu.get": "gpu get (tier, pageable target)",
    "gpu.put_registered": "gpu put (tier, registered source)",
    "gpu.get_registered": "gpu get (tier, registered target)",
    "h2d_pinned": "copy_ pinned -> device",
    "d2h_pinned": "copy_ device -> pinned",
    "h2d_registered": "copy_ registered -> device",
    "d2h_registered": "copy_ device -> registered",
    "memcpy": "host memcpy",
}
_Record = Callable[[str, float], None]


def run_gpu_bench(
    sizes_bytes: Sequence[int],
    *,
    bytes_per_size: int = DEFAULT_BYTES_PER_SIZE,
    repeats: int = DEFAULT_REPEATS,
    device: str = DEFAULT_DEVICE,
) -> dict[str, Any]:
    """Measure the gpu tier at each chunk size (see the module docstring for the result), or
    return {"skipped": why, ...} where CUDA is unavailable. InvalidArgument for bad arguments."""
    sizes = check_sizes(sizes_bytes, bytes_per_size, repeats)
    device = f"cuda:{parse_device(device)}"
    base = {"benchmark": "gpu", **host_info(), "device": device}
    ok, detail = gpu_available(device)
    if not ok:
        return {**base, "skipped": detail}
    import torch

    started_s = time.perf_counter()
    results = [
        _bench_size(torch, device, size, max(2, bytes_per_size // size), repeats) for size in sizes
    ]
    return {
        **base,
        "device_name": detail,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "staging_slot_bytes": STAGING_SLOT_BYTES,
        "bytes_per_size": bytes_per_size,
        "repeats": repeats,
        "elapsed_seconds": time.perf_counter() - started_s,
        "results": results,
        "notes": _notes(repeats) + _registration_notes(results) + _noise_notes(results),
    }


def render_gpu_bench(result: dict[str, Any]) -> Table:
    """A table for people: one row per figure, beside its reference and the ratio."""
    from rich.table import Table

    table = Table(
        title=f"kvctl gpu tier bandwidth on {result['device_name']} "
        f"(median of {result['repeats']} repeats)",
        caption="ratio = figure / reference (and / the bare pinned copy for registered "
        "memory); spread = (max - min) / median of the samples",
    )
    for name, justify in (
        ("chunk", "right"),
        ("figure", "left"),
        ("bandwidth", "right"),
        ("spread", "right"),
        ("reference", "left"),
        ("ref. bandwidth", "right"),
        ("ratio", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for row in result["results"]:
        for name, fig in row["gpu"].items():
            ref = row["reference"][fig["reference"]]
            table.add_row(
                f"{format_bytes(row['chunk_bytes'])} x {fig['chunks']}",
                _LABELS[f"gpu.{name}"],
                format_rate(fig["bytes_per_second"]),
                f"{spread(fig):.0%}",
                _LABELS[fig["reference"]],
                format_rate(ref["bytes_per_second"]),
                _ratio(fig),
            )
        memcpy = row["reference"]["memcpy"]
        table.add_row(
            "", _LABELS["memcpy"], format_rate(memcpy["bytes_per_second"]), "", "", "", ""
        )
        table.add_section()
    return table


def _ratio(fig: dict[str, Any]) -> str:
    text = f"{fig['ratio_to_reference']:.2f}"
    if "ratio_to_pinned" in fig:
        text += f" ({fig['ratio_to_pinned']:.2f} of pinned)"
    return text


# --- one chunk size ---------------------------------------------------------------------------
def _bench_size(torch: Any, device: str, size: int, n: int, repeats: int) -> dict[str, Any]:
    total = size * n
    payload = os.urandom(total)
    keys = [os.urandom(_KEY_BYTES) for _ in range(n)]
    metas = [ChunkMeta(key=key, size_bytes=size) for key in keys]
    offsets = [i * size for i in range(n)]
    seconds: dict[str, list[float]] = {}

    def add(name: str, elapsed_seconds: float) -> None:
        seconds.setdefault(name, []).append(elapsed_seconds)

    registered_is_pinned: bool | None = None
    with contextlib.ExitStack() as stack:
        # the registered mappings close last, after the tier (which unregisters them) is closed
        src_map, dst_map = _shared_map(total), _shared_map(total)
        stack.callback(_close_map, dst_map)
        stack.callback(_close_map, src_map)
        src_map[:] = payload
        dst_map[:] = payload  # pages in before timing
        src = stack.enter_context(memoryview(payload))
        chunks = [src[off : off + size] for off in offsets]
        stack.callback(release_views, chunks)
        out = bytearray(total)  # written before timing: its pages are in
        out_view = stack.enter_context(memoryview(out))
        out_view[:] = src
        outs = [out_view[off : off + size] for off in offsets]
        stack.callback(release_views, outs)
        sink = bytearray(total)
        sink_view = stack.enter_context(memoryview(sink))
        sink_view[:] = src

        pinned_src = torch.frombuffer(bytearray(payload), dtype=torch.uint8).pin_memory()
        pinned_dst = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(total, dtype=torch.uint8, device=device)
        stream = torch.cuda.Stream(device)
        tier = GpuTier(total, device)
        stack.callback(tier.close)
        registered = tier.register_host_region(
            "bench-source", src_map, read_only=False
        ) and tier.register_host_region("bench-target", dst_map, read_only=False)
        reg_src = reg_dst = None
        if registered:
            reg_src = tier.host_registry.tensor_for(src_map)
            reg_dst = tier.host_registry.tensor_for(dst_map, writable=True)
            registered_is_pinned = bool(reg_src is not None and reg_src.is_pinned())
        src_whole, dst_whole = memoryview(src_map), memoryview(dst_map)
        reg_chunks = [src_whole[off : off + size] for off in offsets]
        reg_outs = [dst_whole[off : off + size] for off in offsets]
        stack.callback(release_views, [*reg_chunks, *reg_outs, src_whole, dst_whole])

        def copies(dst: Any, src_t: Any) -> float:
            with torch.cuda.stream(stream):
                t0 = time.perf_counter()
                for off in offsets:
                    dst[off : off + size].copy_(src_t[off : off + size], non_blocking=True)
                    stream.synchronize()  # per chunk, as a tier put or get returns per chunk
                return time.perf_counter() - t0

        def references(record: _Record) -> None:
            record("reference.h2d_pinned", copies(on_device, pinned_src))
            record("reference.d2h_pinned", copies(pinned_dst, on_device))
            if reg_src is not None and reg_dst is not None:
                record("reference.h2d_registered", copies(on_device, reg_src))
                record("reference.d2h_registered", copies(reg_dst, on_device))
            t0 = time.perf_counter()
            for off, chunk in zip(offsets, chunks, strict=True):
                sink_view[off : off + size] = chunk
            record("reference.memcpy", time.perf_counter() - t0)

        def round_trip(record: _Record, suffix: str, sources: list[Any], sinks: list[Any]) -> None:
            """Every chunk put from ``sources`` and read back into ``sinks``, each way timed."""
            t0 = time.perf_counter()
            for meta, chunk in zip(metas, sources, strict=True):
                tier.put(meta, chunk)
            record(f"gpu.put{suffix}", time.perf_counter() - t0)
            t0 = time.perf_counter()
            for key, o in zip(keys, sinks, strict=True):
                tier.read_into(key, o)
            record(f"gpu.get{suffix}", time.perf_counter() - t0)
            spot_check(sinks, chunks)
            for key in keys:
                tier.delete(key)

        def measured(record: _Record) -> None:
            round_trip(record, "", chunks, outs)
            if not registered:
                return
            direct_bytes = tier.copied_bytes["direct"]
            round_trip(record, "_registered", reg_chunks, reg_outs)
            if tier.copied_bytes["direct"] - direct_bytes != 2 * total:
                raise RuntimeError("copies from registered memory took the staged path")

        def ignore(_name: str, _elapsed_seconds: float) -> None:
            pass

        references(ignore)  # warm-up: CUDA context, copy kernels, pinned pages
        measured(ignore)
        if host_view(pinned_dst)[:size] != chunks[0]:
            raise RuntimeError("the reference copy read back different bytes")
        alternating(repeats, lambda: references(add), lambda: measured(add))
        reg_src = reg_dst = None  # the tensors hold the mappings open

    reference = {
        name: figure(seconds[f"reference.{name}"], n, size)
        for name in REFERENCES
        if f"reference.{name}" in seconds
    }
    result: dict[str, Any] = {
        "chunk_bytes": size,
        "chunks": n,
        "registered": registered,
        "registered_is_pinned": registered_is_pinned,
        "gpu": {},
    }
    for name, ref_name in GPU_FIGURES.items():
        if f"gpu.{name}" not in seconds:
            continue
        fig = figure(seconds[f"gpu.{name}"], n, size)
        fig["reference"] = ref_name
        fig["ratio_to_reference"] = (
            fig["bytes_per_second"] / reference[ref_name]["bytes_per_second"]
        )
        if name in PINNED_OF:
            pinned = reference[PINNED_OF[name]]["bytes_per_second"]
            fig["ratio_to_pinned"] = fig["bytes_per_second"] / pinned
        result["gpu"][name] = fig
    result["reference"] = reference
    return result


def _shared_map(size_bytes: int) -> mmap.mmap:
    """A shared mapping of a memfd, as the agent's cpu arena and staging segments are."""
    if not hasattr(os, "memfd_create"):
        return mmap.mmap(-1, size_bytes)
    fd = os.memfd_create("kvctl-bench-gpu", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size_bytes)
        return mmap.mmap(fd, size_bytes)
    finally:
        os.close(fd)


def _close_map(m: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a tensor of a failed run still holds it
        m.close()


# --- results ----------------------------------------------------------------------------------


def _noise_notes(results: list[dict[str, Any]]) -> list[str]:
    noisy = [
        f"{format_bytes(row['chunk_bytes'])} {section}.{name}"
        for row in results
        for section in ("gpu", "reference")
        for name, fig in row[section].items()
        if spread(fig) > NOISY_SPREAD
    ]
    if not noisy:
        return []
    return [
        f"samples of {len(noisy)} figures spread by more than {NOISY_SPREAD:.0%} of their median "
        f"({', '.join(noisy)}): the machine or its bus was busy; rerun with more repeats"
    ]


def _registration_notes(results: list[dict[str, Any]]) -> list[str]:
    if all(row["registered"] for row in results):
        return [
            "gpu.put_registered and gpu.get_registered copy each chunk in one cudaMemcpyAsync "
            "from or to a shared mapping registered with CUDA (cudaHostRegister), as the agent "
            "registers its cpu arena and clients' staging segments; ratio_to_pinned compares "
            "them with the bare copy_ from torch's own pinned memory"
        ]
    return [
        "CUDA refused to register the benchmark's host mappings (see the log): the registered "
        "figures are left out, and the agent's copies of such memory would be staged too"
    ]


def _notes(repeats: int) -> list[str]:
    return [
        f"each figure is the median of {repeats} samples; ratio_to_reference = figure / reference",
        "gpu.put and gpu.get also copy every byte on the host (pageable memory <-> a pinned "
        f"staging slot of {STAGING_SLOT_BYTES >> 20} MiB, two slots so the host copy of one "
        "piece overlaps the device copy of the other); the bare copy_ references start from "
        "memory that is already pinned, so a ratio below 1 is the price of staging, and "
        "reference memcpy shows what the host half alone costs",
        "tier and references synchronize after every chunk, as a put or get returns only when "
        "its bytes have arrived",
    ]


# --- arguments --------------------------------------------------------------------------------
