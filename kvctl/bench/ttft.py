"""`kvctl bench ttft`: time to first token of a real (random-weight) Llama, full prefill vs the
prefix's KV read from a kvctl agent's cpu tier, its disk tier, and the shared pool.

Four agents on loopback: ``node`` (cpu + disk tiers, writes through to the pool), ``pool`` (an
embedded pool agent), ``reader`` (another node with the same pool and nothing local, so its
lookups go to the pool and its plan decides whether pulling beats recomputing) and ``puller``
(the same, its link to the pool forced to fetch, so the pull is measured whatever the plan would
decide). The engine talks to the nodes over their Unix
sockets with shared memory, as an engine on the same host would.

Per context length: a prompt of ``context`` tokens plus ``suffix`` new ones; the full prefill is
the reference; each source's TTFT is lookup + fetch + prefill of the tokens not reused. Every
cache-assisted answer is checked against the full prefill (next token equal, logits within the
stated tolerance) and every reuse against the tier it must come from. The agents may decide to
recompute rather than fetch (fetch-or-recompute): the sample then reuses fewer chunks, and the
row says so. Each source's fetch rate stands next to the bound for its path measured in the
same run: the cpu tier next to a host->device copy from page-locked memory on CUDA (a
multi-threaded memcpy on a CPU), the disk tier next to a raw parallel read of the same chunk
files from the device, the pool next to a raw read of the same bytes from another process's
arena over loopback TCP, on as many connections as the pull's streams.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvctl.bench.common import drop_file_pages, files_under, host_info, spawned_agent
from kvctl.errors import InvalidArgument
from kvctl.extras import MissingExtra, extra_of
from kvctl.remote.pool import DEFAULT_MIN_STREAM_BYTES, DEFAULT_STREAMS, stream_groups
from kvctl.store.tiers import hugepages

if TYPE_CHECKING:
    from rich.console import Group

    from kvctl.agent.daemon import AgentState
    from kvctl.bench.agent import RawStreams
    from kvctl.client import AgentClient, DataClient
    from kvctl.engines.hf import CachedLM, Prefill

T = TypeVar("T")

SOURCES = ("cpu", "disk", "pool")
#: where each source's chunks must be found by the lookup
_TIER_OF = {"cpu": "cpu", "disk": "disk", "pool": "remote"}
CPU_CONTEXTS = "1k,4k,16k"
GPU_CONTEXTS = "1k,4k,16k,32k,64k,100k"
#: logits of a cache-assisted one-pass prefill vs a full one (see kvctl.engines.hf.CachedLM):
#: the larger of an absolute bound and a share of the largest |logit|. One-pass KV differs from a
#: longer prefill's in the last bits, which a low-precision dtype carries into the logits in
#: proportion to their size (bf16 on the Llama-3.1-8B shape: ~0.23 with |logits| up to ~12,
#: next token equal)
ATOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
RTOL = {"float32": 1e-5, "bfloat16": 4e-2, "float16": 1e-2}
POOL_WAIT_S = 120.0
#: tries of a forced pull before the bench gives up on it: a pull measures only once every chunk
#: came, and on a loaded host the pool's answer to a lookup can miss its deadline
#: (``PROBE_DEADLINE_S``), so that lookup recomputes; the short tries are reported
FORCED_PULL_TRIES = 3
#: control calls that move a whole context (GiB) between tiers take more than a health check
CONTROL_TIMEOUT_S = 600.0
#: threads reading chunk files in the raw disk bound (as the store's own reader)
RAW_READ_THREADS = 8


def parse_contexts(text: str) -> list[int]:
    """``"1k,4k,16k"`` -> token counts (k = 1024)."""
    out: list[int] = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        try:
            n = int(float(p[:-1]) * 1024) if p.endswith("k") else int(p)
        except ValueError:
            raise InvalidArgument(f"bad context length {part!r}; e.g. 1k,4k,16k or 2048") from None
        if n <= 0:
            raise InvalidArgument(f"context lengths must be positive, got {part!r}")
        out.append(n)
    if not out:
        raise InvalidArgument("give at least one context length, e.g. --contexts 1k,4k")
    return out


def run_ttft_bench(
    *,
    contexts: list[int] | None = None,
    shape: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    suffix_tokens: int = 64,
    chunk_tokens: int = 256,
    repeats: int = 3,
    sources: tuple[str, ...] = SOURCES,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
    layerwise: bool = False,
) -> dict[str, Any]:
    """``layerwise``: the engines copy a prefix leased whole from the arena layer by layer
    under the forward pass (``CachedLM(layerwise=True)``)."""
    # what needs no torch is checked before importing it: a typo costs no seconds of imports
    bad = [s for s in sources if s not in SOURCES]
    if bad or not sources:
        raise InvalidArgument(f"unknown source {bad}; choose from {', '.join(SOURCES)}")
    if repeats < 1 or suffix_tokens < 1 or chunk_tokens < 1:
        raise InvalidArgument("repeats, suffix tokens and chunk tokens must be positive")
    if dtype is not None and dtype not in ATOL:
        raise InvalidArgument(f"unknown dtype {dtype!r}; choose from {', '.join(ATOL)}")
    from kvctl.engines.shapes import SHAPES

    if shape is not None and shape not in SHAPES:
        raise InvalidArgument(f"unknown model {shape!r}; choose from {', '.join(SHAPES)}")
    try:
        import torch

        from kvctl.engines.hf import CachedLM
        from kvctl.engines.models import build_model
    except ImportError as exc:
        if extra_of(exc) is None:
            raise
        raise MissingExtra("the ttft bench", "engine") from None

    cuda = torch.cuda.is_available()
    device = device or ("cuda" if cuda else "cpu")
    if device.startswith("cuda") and not cuda:
        raise InvalidArgument("--device cuda asked for, but torch sees no CUDA device")
    shape = shape or ("llama-3.1-8b" if device.startswith("cuda") else "tiny-llama")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    contexts = contexts or parse_contexts(
        GPU_CONTEXTS if device.startswith("cuda") else CPU_CONTEXTS
    )
    say = progress or (lambda _msg: None)

    say(f"building {shape} ({dtype}) on {device}")
    model = build_model(shape, seed=seed, dtype=getattr(torch, dtype), device=device)
    full = CachedLM(model, None, chunk_tokens=chunk_tokens)
    chunk_bytes = full.format.chunk_bytes
    kv_bytes = max(contexts) // chunk_tokens * chunk_bytes
    cap = kv_bytes + kv_bytes // 4 + 4 * chunk_bytes

    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvctl-bench-ttft-") as tmp,
        _fleet(Path(tmp), cap, chunk_tokens, chunk_bytes, sources) as fleet,
    ):
        engines = {
            # the landing buffer sized for the longest context at start, as an engine sizes
            # its KV cache: no sample pays its page faults
            name: CachedLM(
                model,
                client,
                tenant="bench",
                store=name == "node",
                reserve_tokens=max(contexts),
                layerwise=layerwise,
            )
            for name, client in fleet.data.items()
        }
        # each engine maps (on CUDA: registers, pinning every page) its agent's arena when it
        # starts, as a serving engine would: a one-off cost, reported apart from every sample
        attach_s = {name: engine.arena_attach_seconds for name, engine in engines.items()}

        def cold(engine: CachedLM) -> CachedLM:
            """``engine``, the CPU caches flushed first on a CPU (every timed sample starts
            cold, as the memcpy bound's copies do)."""
            if device == "cpu":
                flush_cpu_caches(torch)
            return engine

        # warm-up: one-off kernel and allocator set-up of both paths, kept out of every figure
        warm = _tokens(2 * chunk_tokens + suffix_tokens, seed - 1, model.config.vocab_size)
        for _ in range(2):
            full.prefill(warm)
            engines["node"].prefill(warm)
        fleet.forget(engines["node"].chunk_keys(warm))
        for n, context in enumerate(contexts):
            prompt = _tokens(context + suffix_tokens, seed + n, model.config.vocab_size)
            say(f"{context} tokens: full prefill")
            base = [_light(cold(full).prefill(prompt)) for _ in range(repeats - 1)]
            last = cold(full).prefill(prompt)
            split = _split_reference(full, last, prompt, chunk_tokens)
            base.append(_light(last))
            reference = base[-1]
            full_s = statistics.median(p.ttft_seconds for p in base)
            # the first request through the node stores the prompt's chunks (a miss: nothing
            # is cached yet); its TTFT is the cost of asking the agent for nothing
            miss = _light(cold(engines["node"]).prefill(prompt))
            stored = engines["node"].chunk_keys(prompt)
            keys = stored[: (len(prompt) - 1) // chunk_tokens]  # the reusable ones
            engines["node"].flush()  # stored behind the request: wait before sampling
            if "pool" in sources:
                _wait_for_pool(fleet.data["pool"], keys)
            nbytes = len(keys) * chunk_bytes
            memcpy = _memcpy_seconds(torch, nbytes, repeats, cold=device == "cpu")
            row: dict[str, Any] = {
                "context_tokens": context,
                "prompt_tokens": len(prompt),
                "full_prefill": {
                    "ttft_seconds": full_s,
                    "samples_seconds": [p.ttft_seconds for p in base],
                },
                "miss": _summary([miss], full_s),
                "split_reference": split.as_dict(),
                "memcpy_seconds": memcpy,
                "memcpy_threads": torch.get_num_threads(),
                "sources": {},
            }
            for source in sources:
                say(f"{context} tokens: prefix from {source}")
                runs = []
                bounds: list[tuple[str, float]] = []
                forced: list[Prefill] = []
                forced_bounds: list[tuple[str, float]] = []
                short: list[dict[str, Any]] = []  # forced pulls that did not move every chunk
                reads: list[tuple[int, float]] = []  # (bytes, seconds) of forced disk reads
                plans: list[dict[str, Any] | None] = []
                try:
                    for _ in range(repeats):
                        fleet.prepare(source, keys)
                        bounds.append(_bound(torch, fleet, source, device, nbytes, memcpy))
                        if source == "disk":
                            # the bound read them: from the device again
                            drop_file_pages(files_under(fleet.disk))
                        agent = "reader" if source == "pool" else "node"
                        planned = _plans_made(fleet.control[agent])
                        got = _light(cold(engines[agent]).prefill(prompt))
                        runs.append(_check(got, reference, split, source, len(keys), dtype))
                        plans.append(_last_plan(fleet.control[agent], planned))
                        if source == "pool":  # the pull itself, whatever the plan decided
                            fleet.prepare(source, keys)
                            forced_bounds.append(
                                _bound(torch, fleet, source, device, nbytes, memcpy)
                            )
                            got = _forced_pull(fleet, cold, engines["puller"], prompt, keys, short)
                            forced.append(_check(got, reference, split, source, len(keys), dtype))
                        elif source == "disk":  # the disk read itself, whatever the plan decided
                            fleet.prepare(source, keys)
                            forced_bounds.append(
                                _bound(torch, fleet, source, device, nbytes, memcpy)
                            )
                            drop_file_pages(files_under(fleet.disk))
                            reads.append(_read_only(torch, engines["node"], keys))
                except Exception as exc:  # one source failing must not lose the others' figures
                    failure = f"{context} tokens, {source}: {type(exc).__name__}: {exc}"
                    say(failure)
                    failures.append(failure)
                    row["sources"][source] = {"error": f"{type(exc).__name__}: {exc}"}
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
                    continue
                # the copy out of the arena is held against the bound of the cpu tier's path
                # only: a disk read's or a pull's bound is another path's
                summary = _bounded(_summary(runs, full_s), runs, bounds, copy=source == "cpu")
                summary["plan"] = plans[-1] if plans else None
                if forced:
                    summary["forced_fetch"] = _bounded(
                        _summary(forced, full_s), forced, forced_bounds, copy=False
                    )
                    summary["forced_fetch"]["short_tries"] = short
                if reads:
                    summary["forced_fetch"] = _read_summary(reads, forced_bounds, len(keys))
                row["sources"][source] = summary
                say(_one_line(source, summary))
                if "forced_fetch" in summary:
                    say(_one_line(f"{source} (forced fetch)", summary["forced_fetch"]))
            rows.append(row)
            fleet.forget(stored)
            del base, miss, runs
            if device.startswith("cuda"):
                torch.cuda.empty_cache()  # the next context's caches need the room
        redos = {name: engine.layerwise_redos for name, engine in engines.items()}
        arena_pages = {
            "shmem_huge_pages": hugepages.shmem_mode(),
            "engine_huge_page_bytes": {
                name: _mapped_huge_bytes(engine) for name, engine in engines.items()
            },
        }

    return {
        "bench": "ttft",
        "model": {
            "shape": shape,
            "dtype": dtype,
            "device": device,
            "device_name": torch.cuda.get_device_name(device)
            if device.startswith("cuda")
            else None,
            "parameters": sum(p.numel() for p in model.parameters()),
            "weights": f"random, seed {seed} (nothing downloaded)",
            "kv_bytes_per_token": full.layout.bytes_per_token,
            "chunk_tokens": chunk_tokens,
            "chunk_bytes": chunk_bytes,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
        "suffix_tokens": suffix_tokens,
        "repeats": repeats,
        "layerwise": layerwise,
        "logits_atol": ATOL[dtype],
        "logits_rtol": RTOL[dtype],
        "rows": rows,
        "arena_attach_seconds": attach_s,
        "shared_arena_pages": arena_pages,
        # requests an engine prefilled again: a lease ran out under its layer-wise copies
        "layerwise_redos": redos,
        "failures": failures,
        "host": host_info(),
        "notes": [
            "ttft = lookup + fetch + prefill of the tokens not reused, up to the next token's "
            "logits; storing new chunks comes after and is reported as store_seconds",
            "every cache-assisted answer was checked against two references: the full "
            "prefill, and the split reference (the full prefill's own KV cropped to the reused "
            "chunks, then the new tokens prefilled on it: what a reuse of exactly those bytes "
            "must answer). Same next token as the split reference (as the full prefill where "
            "the planner reused fewer chunks); max |logit diff| to the split reference within "
            "logits_atol; to the full prefill within max(logits_atol, logits_rtol x max "
            "|logit|, the split reference's own diff + logits_atol), since one-pass and "
            "two-pass prefills round differently in low precision",
            "a source that failed has an error instead of figures, and is listed in failures",
            "engine <-> agent over a Unix socket with shared memory (same host): reused chunks "
            "are copied from the agent's arena under a lease straight into the KV cache; the "
            "lookup leases what it matched on its node in the same round trip "
            "(LOOKUP_LEASE_LOCAL), so that lease is in lookup_seconds and fetch_seconds is the "
            "copy (compare lookup + fetch across builds older than it); matched chunks on "
            "other nodes (pool) are pulled in slices within fetch_seconds, each slice's copy "
            "overlapping the next slice's pull on CUDA (before 2026-11-28 the whole pull was "
            "in lookup_seconds); the leases are released after the first token, so the "
            "release is in no figure here",
            "arena_attach_seconds: the time each engine took, when it connected, to map its "
            "agent's shared arena (and on CUDA register it: pinning the whole capacity), paid "
            "once per engine process and so in no sample (None: no shared arena)",
            "shared_arena_pages: the kernel's huge-page mode for shared memory "
            "(transparent_hugepage/shmem_enabled) and the bytes of each engine's mapping of its "
            "agent's arena on huge pages (None: not mapped, or unreadable); an arena on 4 KiB "
            "pages is copied out of measurably slower (see kvctl doctor)",
            "new chunks are stored behind the request (write-behind): store_seconds is from "
            "hand-over to the agent's acknowledgement, off the request path",
            "bound: the cpu tier's is a copy of the same bytes from page-locked host memory to "
            "the device (CUDA) or a multi-threaded memcpy (CPU: from memory on huge pages "
            "where the kernel allows them, into a tensor like the engine's; each of its copies, "
            "and every sample on a CPU, full prefills included, starts with the CPU caches "
            "flushed, so copies read from DRAM as chunks stored earlier are); the disk tier's a "
            "raw parallel read of the chunk files after dropping the page cache; the pool's a raw "
            "socket read of the same bytes from a second process's arena over loopback TCP "
            "into a buffer of their size (caches flushed first on a CPU), on as many "
            "connections at once as the pull splits over (its streams), no protocol; each is "
            "measured right before its sample, and fetch_share_of_bound is the median over the "
            "samples of fetch rate / that bound",
            "copy_seconds: of fetch_seconds, the copy out of the shared arena alone (leased "
            "chunks; on CUDA up to the copies' end); copy_share_of_bound (cpu tier only: the "
            "other sources' bounds are another path's) is its rate / the bound. "
            "The rest of the fetch (the landing buffer's views, the model's cache object) is "
            "the same per request whatever its size",
            "reused_chunks below the context's chunks means the agent's plan chose to recompute "
            "(see planner_recomputed_chunks); plan: the last sample's fetch-or-recompute "
            "decision as the agent recorded it (reason; chunks fetched, recomputed, recomputed "
            "with no source asked (unasked_chunks: the best link could not beat the prefill) "
            "and found on no source (missed_chunks); estimated fetch_s and recompute_s; the "
            "link, device and prefill figures it used), None where the lookup needed no plan",
            "disk: files fsynced and dropped from the page cache (posix_fadvise DONTNEED) "
            "before each sample, so reads come from the device",
            "disk: forced_fetch is the engine's read of every chunk from the disk tier with no "
            "lookup, plan or prefill (the plan may recompute instead), against the same raw bound",
            "pool: an embedded pool agent on loopback, read by a node with nothing local whose "
            "plan decides whether pulling beats recomputing (the row), and by another whose "
            "link to the pool is forced to fetch (forced_fetch: the pull measured whatever the "
            "plan would decide)",
            "layerwise (when true): a prefix leased whole from the arena is copied layer by "
            "layer under the forward pass, so fetch_seconds is only the time to queue its "
            "copies and compute_seconds holds the rest of them; copy_seconds is their own time, "
            "and fetch_bytes_per_second and the shares of the bound use it instead of the fetch",
            "pool: a forced pull counts once it moved every chunk, tried up to "
            f"{FORCED_PULL_TRIES} times; forced_fetch.short_tries lists the tries that did not "
            "(late_probes: pool answers the lookup stopped waiting for)",
        ],
    }


# --- the agents -------------------------------------------------------------------------------
class _Fleet:
    def __init__(
        self,
        data: dict[str, DataClient],
        control: dict[str, AgentClient],
        disk: Path,
        chunk_bytes: int,
        stack: contextlib.ExitStack,
    ):
        self.data = data
        self.control = control
        self.disk = disk
        self.chunk_bytes = chunk_bytes
        self._stack = stack
        self._raw: tuple[RawStreams, memoryview, int] | None = None
        self._raw_stack: contextlib.ExitStack | None = None

    def raw_socket(self, nbytes: int) -> tuple[RawStreams, memoryview]:
        """A raw-socket peer process whose arena holds at least ``nbytes`` (started again,
        larger, when it does not), connections to it for every stream a pull may use, and a
        written buffer of at least ``nbytes`` to read into: the pool bound's set-up, once per
        size so no sample pays for it."""
        import numpy as np

        from kvctl.bench.agent import RawStreams, raw_reference

        if self._raw is None or self._raw[2] < nbytes:
            if self._raw_stack is not None:
                self._raw_stack.close()
            self._raw = None  # the old sink goes before the new one is made
            stack = self._raw_stack = self._stack.enter_context(contextlib.ExitStack())
            first = stack.enter_context(raw_reference(nbytes))
            streams = RawStreams(first, DEFAULT_STREAMS)
            stack.callback(streams.close)
            sink = memoryview(np.ones(nbytes, dtype=np.uint8))  # written: real pages
            n = len(streams.clients)  # untimed: every connection carries data once
            streams.get_seconds([(nbytes * i // n, nbytes * (i + 1) // n) for i in range(n)], sink)
            self._raw = streams, sink, nbytes
        return self._raw[0], self._raw[1]

    def prepare(self, source: str, keys: list[bytes]) -> None:
        """Put the chunks where ``source`` says before a sample."""
        node = self.control["node"]
        if source == "cpu":
            node.move([k.hex() for k in keys], "cpu")
        elif source == "disk":
            node.move([k.hex() for k in keys], "disk")
            drop_file_pages(files_under(self.disk))
        else:  # the readers pulled them last time: forget them locally, the pool keeps its copy
            for name in ("reader", "puller"):
                self.control[name].evict([k.hex() for k in keys])

    def forget(self, keys: list[bytes]) -> None:
        """Room for the next context: every agent drops this prompt's chunks."""
        hexes = [k.hex() for k in keys]
        for client in self.control.values():
            client.evict(hexes)


@contextlib.contextmanager
def _fleet(
    tmp: Path, cap: int, chunk_tokens: int, chunk_bytes: int, sources: tuple[str, ...]
) -> Iterator[_Fleet]:
    from kvctl.client import AgentClient, DataClient

    config = tmp / "agent.toml"
    config.write_text(f"[agent]\nchunk_tokens = {chunk_tokens}\n")
    with contextlib.ExitStack() as stack:

        def start(name: str, *argv: str) -> AgentState:
            settings = ["--config", str(config), "--log-level", "warning", "--name", name]
            return stack.enter_context(spawned_agent(tmp / name, *settings, *argv))

        agents: dict[str, AgentState] = {}
        pool_args: list[str] = []
        if "pool" in sources:
            agents["pool"] = start("pool", "--role", "pool", "--cpu", str(cap), "--disk", "0")
            pool_args = ["--pool", f"kvctl://{agents['pool'].data_tcp}"]
        agents["node"] = start("node", "--cpu", str(cap), "--disk", str(cap), *pool_args)
        if "pool" in sources:
            # nothing local: their lookups go to the pool; the reader's plan decides whether to
            # pull, the puller's link is forced to fetch (the pull measured whatever it decides)
            alone = ("--cpu", str(cap), "--disk", "0", *pool_args)
            agents["reader"] = start("reader", *alone)
            agents["puller"] = start("puller", *alone, "--link", "pool:override=fetch")
        data: dict[str, DataClient] = {}
        control: dict[str, AgentClient] = {}
        for name, state in agents.items():
            address = state.data_unix if name != "pool" else state.data_tcp
            data[name] = stack.enter_context(DataClient.connect(address))  # type: ignore[arg-type]
            control[name] = AgentClient(state.control_url, timeout_s=CONTROL_TIMEOUT_S)
            stack.callback(control[name].close)
        yield _Fleet(data, control, tmp / "node" / "disk", chunk_bytes, stack)


def _forced_pull(
    fleet: _Fleet,
    cold: Callable[[CachedLM], CachedLM],
    engine: CachedLM,
    prompt: Any,
    keys: list[bytes],
    short: list[dict[str, Any]],
) -> Prefill:
    """The puller's prefill of ``prompt`` once it pulled every chunk (its link is forced to
    fetch), in up to ``FORCED_PULL_TRIES``; each short try is appended to ``short`` with the
    pool probes its lookup gave up on, and what it wrote behind is forgotten before the next."""
    for _ in range(FORCED_PULL_TRIES):
        late = _late_probes(fleet.control["puller"])
        got = _light(cold(engine).prefill(prompt))
        if got.reused_chunks == len(keys):
            return got
        now = _late_probes(fleet.control["puller"])
        short.append(
            {
                "reused_chunks": got.reused_chunks,
                "late_probes": None if late is None or now is None else now - late,
            }
        )
        engine.flush()  # its recomputed chunks are stored behind the request: then forgotten
        fleet.prepare("pool", keys)
    raise RuntimeError(
        f"the forced pull moved fewer than {len(keys)} chunks in {FORCED_PULL_TRIES} tries: "
        f"{short[-FORCED_PULL_TRIES:]}"
    )


def _late_probes(control: Any) -> int | None:
    """The pool probes the agent's lookups stopped waiting for (None: it would not say)."""
    return _from_remote(control, lambda remote: int(remote["pool"]["late"]))


def _wait_for_pool(pool: DataClient, keys: list[bytes]) -> None:
    """The node writes through to the pool in the background; wait until every chunk is there."""
    deadline = time.monotonic() + POOL_WAIT_S
    while time.monotonic() < deadline:
        if all(t is not None for t in pool.exists(keys, tenant="bench")):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the pool did not receive the prompt's chunks within {POOL_WAIT_S:.0f} s")


# --- bounds -----------------------------------------------------------------------------------
def _bound(
    torch: Any, fleet: _Fleet, source: str, device: str, nbytes: int, memcpy_s: float | None
) -> tuple[str, float]:
    """(what, bytes/s) of the path ``source``'s bytes take, with nothing of kvctl in it."""
    if source == "cpu":
        if device.startswith("cuda"):
            return "page-locked host -> device copy", nbytes / _h2d_seconds(torch, device, nbytes)
        # measured again for each sample (the row's figure is one moment of a shared machine)
        sample_s = _memcpy_seconds(torch, nbytes, 1, cold=True) or memcpy_s
        return "multi-threaded memcpy", nbytes / sample_s if sample_s else 0.0
    if source == "disk":
        read_bytes, seconds = _raw_read(fleet.disk)
        return f"raw parallel read ({RAW_READ_THREADS} threads)", read_bytes / seconds
    return _pool_bound(torch, fleet, device, nbytes)


def _bounded(
    summary: dict[str, Any],
    runs: list[Prefill],
    bounds: list[tuple[str, float]],
    *,
    copy: bool,
) -> dict[str, Any]:
    """``summary`` with its bound: each sample against the bound measured just before it, so a
    machine whose speed drifts (other work on it) compares like with like. ``copy``: also the
    copy out of the arena alone against it (where the bound is that copy's path's)."""
    pairs = [
        (p, b)
        for p, (_, b) in zip(runs, bounds, strict=True)
        if p.fetched_bytes and _moving_seconds(p) > 0 and b > 0
    ]
    shares = [p.fetched_bytes / _moving_seconds(p) / b for p, b in pairs]
    # the lookup's round trip counted too: on a same-host engine the lookup also leases what
    # it matched (LOOKUP_LEASE), so that work is in the lookup, not the fetch
    with_lookup = [p.fetched_bytes / (p.lookup_seconds + _moving_seconds(p)) / b for p, b in pairs]
    # the copy alone: what the fetch spends beyond it is per request, whatever the size
    copy_shares = [  # of the bytes copied out of the arena (not those read over the socket)
        p.timings["copy_bytes"] / p.timings["copy_seconds"] / b
        for p, b in pairs
        if copy and p.timings.get("copy_seconds", 0) > 0
    ]
    summary["bound"] = {
        "what": bounds[0][0],
        "bytes_per_second": statistics.median(b for _, b in bounds),
        "fetch_share_of_bound": statistics.median(shares) if shares else None,
        "samples_fetch_share": shares,
        "lookup_and_fetch_share_of_bound": statistics.median(with_lookup) if pairs else None,
        "copy_share_of_bound": statistics.median(copy_shares) if copy_shares else None,
    }
    return summary


def _moving_seconds(p: Prefill) -> float:
    """The seconds a sample's bytes took to arrive: its fetch, or where its copies ran layer
    by layer under the forward pass (its fetch then only queued them), the copies' own time."""
    return p.timings["copy_seconds"] if p.timings.get("layerwise") else p.fetch_seconds


def _read_only(torch: Any, lm: Any, keys: list[bytes]) -> tuple[int, float]:
    """The engine's read of ``keys`` into its KV buffer (``read_chunks``: the agent reads its
    disk into the arena, the engine copies from there), with no lookup, plan or prefill:
    (bytes that arrived whole, seconds)."""
    from kvctl.engines.kvload import read_chunks

    with torch.inference_mode():  # the engine's reused buffer is an inference tensor
        kv = lm.loader.alloc(len(keys), reuse=True)
        t0 = time.perf_counter()
        got, _ = read_chunks(lm.client, keys, lm.tenant, lm.loader, kv)
        if lm.device.type == "cuda":
            torch.cuda.synchronize(lm.device)
        seconds = time.perf_counter() - t0
    if got != len(keys):
        raise RuntimeError(f"a forced read got {got} of {len(keys)} chunks")
    return got * lm.format.chunk_bytes, seconds


def _read_summary(
    reads: list[tuple[int, float]], bounds: list[tuple[str, float]], chunks: int
) -> dict[str, Any]:
    seconds = statistics.median(s for _, s in reads)
    shares = [n / s / b for (n, s), (_, b) in zip(reads, bounds, strict=True) if s > 0 and b > 0]
    return {
        "what": "the engine's read of every chunk (read_chunks), no lookup, plan or prefill",
        "chunks": chunks,
        "bytes_moved": reads[-1][0],
        "fetch_seconds": seconds,
        "fetch_bytes_per_second": reads[-1][0] / seconds if seconds > 0 else None,
        "samples_seconds": [s for _, s in reads],
        "bound": {
            "what": bounds[0][0],
            "bytes_per_second": statistics.median(b for _, b in bounds),
            "fetch_share_of_bound": statistics.median(shares) if shares else None,
            "samples_fetch_share": shares,
        },
    }


def _h2d_seconds(torch: Any, device: str, nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)  # first touch of both, out of the timing
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _raw_read(directory: Path) -> tuple[int, float]:
    """Every file under ``directory`` read whole by a pool of threads (O_DIRECT where the file
    system takes it), as bytes and seconds."""
    files = [p for p in directory.rglob("*") if p.is_file()]
    sizes = [p.stat().st_size for p in files]
    page = mmap.PAGESIZE

    # one page-aligned, touched buffer per file, made before the clock starts (as the store's
    # arena is): the figure is the read alone
    bufs = [_aligned(size + page, page) for size in sizes]
    for buf in bufs:
        buf.write(bytes(len(buf)))

    def read(i: int) -> int:
        size, view = sizes[i], memoryview(bufs[i])
        fd = _open_direct(files[i])
        try:
            got = 0
            while got < size:
                want = (size - got + page - 1) // page * page  # O_DIRECT reads whole pages
                n = os.preadv(fd, [view[got : got + want]], got)
                if n <= 0:
                    break
                got += n
            return got
        finally:
            view.release()
            os.close(fd)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(RAW_READ_THREADS) as pool:
        total = sum(pool.map(read, range(len(files))))
    seconds = time.perf_counter() - t0
    for buf in bufs:
        buf.close()
    return total, max(seconds, 1e-9)


def _aligned(size: int, align: int) -> Any:
    """A page-aligned writable buffer (an anonymous mapping), as O_DIRECT wants."""
    return mmap.mmap(-1, (size + align - 1) // align * align)


def _open_direct(path: Path) -> int:
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        return os.open(path, flags)
    except OSError:  # tmpfs and some others refuse O_DIRECT: the page cache was dropped anyway
        return os.open(path, os.O_RDONLY)


def _pool_bound(torch: Any, fleet: _Fleet, device: str, nbytes: int) -> tuple[str, float]:
    """The same bytes read over TCP loopback from a second process's arena into a buffer of
    their size, split into the pull's streams (``stream_groups``, the reader's defaults), with
    no protocol, store or lock: a pull moves that many bytes out of one arena and into another,
    so its bound must too (PROBE downloads send one small buffer into another, both in the
    CPU's cache, and ran 1.6-2x as fast as this on a 2-core VM)."""
    chunk_bytes = fleet.chunk_bytes
    groups = stream_groups(
        max(1, nbytes // chunk_bytes),
        streams=DEFAULT_STREAMS,
        chunk_bytes_seen=chunk_bytes,
        min_stream_bytes=DEFAULT_MIN_STREAM_BYTES,
    )
    raw, sink = fleet.raw_socket(nbytes)
    spans = [(lo * chunk_bytes, min(hi * chunk_bytes, nbytes)) for lo, hi in groups]
    if device == "cpu":  # the pull's bytes come from DRAM: so do these
        flush_cpu_caches(torch)
    seconds = raw.get_seconds(spans, sink)
    what = (
        f"raw socket: the same bytes from a peer process's arena over TCP loopback, "
        f"{len(spans)} connections at once (the pull's streams), no protocol"
    )
    return what, nbytes / seconds


# --- figures ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Split:
    """The full prefill's own KV cropped to ``reused_tokens``, then the rest prefilled on it."""

    reused_tokens: int
    logits: Any
    next_token: int
    #: max |logit diff| to the one-pass full prefill: rounding alone, no transport in it
    diff_to_full: float
    next_token_equal: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "reused_tokens": self.reused_tokens,
            "max_logit_diff_to_full": self.diff_to_full,
            "next_token_equal_to_full": self.next_token_equal,
        }


def _split_reference(lm: Any, full: Prefill, prompt: list[int], chunk_tokens: int) -> _Split:
    """What a reuse of every reusable chunk must answer."""
    start = (len(prompt) - 1) // chunk_tokens * chunk_tokens
    assert full.cache is not None
    logits = lm.continue_prefill(full.cache, prompt, start)
    token = int(logits.argmax())
    return _Split(
        start,
        logits,
        token,
        float((logits - full.logits).abs().max()),
        token == full.next_token,
    )


def _check(
    got: Prefill, reference: Prefill, split: _Split, source: str, chunks: int, dtype: str
) -> Prefill:
    """A sample counts only if what it reused came from the right tier (all of it, unless the
    agents chose to recompute some) and it answered as the same KV bytes must: as the split
    reference bit for bit up to ``ATOL``, and as the full prefill up to rounding."""
    import torch

    tier = _TIER_OF[source]
    if got.reused_chunks > chunks or any(t != tier for t in got.reused_tiers):
        raise RuntimeError(
            f"{source}: expected up to {chunks} chunks from the {tier} tier, reused "
            f"{got.reused_chunks} from {sorted(set(got.reused_tiers))}"
        )
    diff = float((got.logits - reference.logits).abs().max())
    scale = float(reference.logits.abs().max())
    tolerance = max(ATOL[dtype], RTOL[dtype] * scale, split.diff_to_full + ATOL[dtype])
    same_bytes = got.reused_tokens == split.reused_tokens
    expected = split.next_token if same_bytes else reference.next_token
    split_diff = float((got.logits - split.logits).abs().max()) if same_bytes else None
    if (
        got.next_token != expected
        or not torch.isfinite(got.logits).all()
        or diff > tolerance
        or (split_diff is not None and split_diff > ATOL[dtype])
    ):
        raise RuntimeError(
            f"{source}: the cache-assisted answer differs (max |logit diff| {diff:.3g} to the "
            f"full prefill, allowed {tolerance:.3g}; "
            + (
                f"{split_diff:.3g} to the split reference, allowed {ATOL[dtype]:.3g}; "
                if split_diff is not None
                else ""
            )
            + f"next token {got.next_token}, expected {expected})"
        )
    got.timings["max_logit_diff"] = diff
    if split_diff is not None:
        got.timings["max_logit_diff_to_split"] = split_diff
    got.timings["planned_recompute_chunks"] = chunks - got.reused_chunks
    return got


def _light(p: Prefill) -> Prefill:
    """Keep a sample's figures, not its KV cache (12.5 GiB at 100k tokens on Llama-3.1-8B)."""
    p.cache = None
    return p


def _summary(runs: list[Prefill], full_s: float) -> dict[str, Any]:
    ttft = statistics.median(p.ttft_seconds for p in runs)
    last = runs[-1]
    fetch = statistics.median(p.fetch_seconds for p in runs)
    moving = statistics.median(_moving_seconds(p) for p in runs)
    copies = [p.timings["copy_seconds"] for p in runs if "copy_seconds" in p.timings]
    return {
        "ttft_seconds": ttft,
        "speedup": full_s / ttft if ttft > 0 else None,
        "lookup_seconds": statistics.median(p.lookup_seconds for p in runs),
        "fetch_seconds": fetch,
        "compute_seconds": statistics.median(p.compute_seconds for p in runs),
        "store_seconds": statistics.median(p.store_seconds for p in runs),
        "reused_tokens": last.reused_tokens,
        "computed_tokens": last.computed_tokens,
        "reused_chunks": last.reused_chunks,
        "planner_recomputed_chunks": int(last.timings.get("planned_recompute_chunks", 0)),
        "fetch_path": last.fetch_path,
        "max_logit_diff": max(p.timings.get("max_logit_diff", 0.0) for p in runs),
        "max_logit_diff_to_split": max(
            (
                p.timings["max_logit_diff_to_split"]
                for p in runs
                if "max_logit_diff_to_split" in p.timings
            ),
            default=None,
        ),
        # the copy out of the shared arena alone, where chunks were leased (None otherwise)
        "copy_seconds": statistics.median(copies) if copies else None,
        "bytes_moved": last.fetched_bytes,
        "fetch_bytes_per_second": last.fetched_bytes / moving
        if last.fetched_bytes and moving
        else None,
        "samples_seconds": [p.ttft_seconds for p in runs],
    }


def _plans_made(control: Any) -> tuple[int, dict[str, Any] | None] | None:
    """How many fetch-or-recompute plans the agent has made, and its last one (None: it would
    not say)."""
    return _from_remote(
        control, lambda remote: (int(remote["plans"]["lookups"]), remote.get("last_plan"))
    )


def _from_remote(control: Any, read: Callable[[dict[str, Any]], T]) -> T | None:
    """``read`` of the agent's ``/v1/remote`` (None where the agent would not answer, or its
    answer lacks what ``read`` looks for)."""
    from kvctl.client import AgentError

    try:
        return read(control.remote())
    except (AgentError, KeyError, TypeError, ValueError):
        return None


def _last_plan(control: Any, before: tuple[int, Any] | None) -> dict[str, Any] | None:
    """The plan the agent made for the sample's lookup (made since ``before``, what
    ``_plans_made`` said then), in brief: what it chose, why, and the figures it chose from.
    None where the lookup needed no plan (every chunk local and free but for the copy to the
    device, which always beats recomputing) or the agent would not say: a diagnosis, never a
    reason to fail a sample."""
    after = _plans_made(control)
    if after is None or before is None or after[0] == before[0] or not after[1]:
        return None
    plan = after[1]
    links = plan.get("links") or {}
    return {
        "reason": plan.get("reason"),
        "fetch_chunks": plan.get("fetch"),
        "recompute_chunks": plan.get("recompute"),
        # recomputed with no source asked (the best link could not beat the prefill), and
        # with sources asked that had none of them (or did not answer in time)
        "unasked_chunks": plan.get("unasked"),
        "missed_chunks": plan.get("missed"),
        "fetch_s": plan.get("fetch_s"),
        "recompute_s": plan.get("recompute_s"),
        "links": {
            name: {k: link.get(k) for k in ("rtt_s", "bandwidth_bytes_per_s", "source", "override")}
            for name, link in links.items()
        },
        "device": plan.get("device"),
        "prefill": {k: (plan.get("prefill") or {}).get(k) for k in ("tokens_per_s", "basis")},
    }


def _plan_words(plan: dict[str, Any] | None) -> str:
    """Why the last sample's plan recomputed, and from which figures, for the progress line."""
    if plan is None:
        return ""
    links = [
        f"{name} {_rate(link['bandwidth_bytes_per_s'])}"
        + (f" rtt {link['rtt_s'] * 1e3:.2f} ms" if link["rtt_s"] is not None else "")
        + f" ({link['source']})"
        for name, link in plan["links"].items()
    ]
    tokens_per_s = plan["prefill"]["tokens_per_s"]
    prefill = (
        f"prefill {tokens_per_s:,.0f} tokens/s ({plan['prefill']['basis']})" if tokens_per_s else ""
    )
    return f" (plan: {plan['reason']}; " + ", ".join([*links, prefill]).strip(", ") + ")"


def _one_line(source: str, s: dict[str, Any]) -> str:
    """A source's figures as a progress line (what a cut-short run still leaves behind)."""
    head = (
        f"  {source}: ttft {s['ttft_seconds'] * 1e3:,.1f} ms ({s['speedup']:.2f}x)"
        if "ttft_seconds" in s
        else f"  {source}: read only (no lookup or prefill), {s['fetch_seconds'] * 1e3:,.1f} ms"
    )
    bound, share = s["bound"], s["bound"]["fetch_share_of_bound"]
    if share is None:
        return f"{head}, nothing fetched" + _plan_words(s.get("plan"))
    return (
        f"{head}, {s.get('reused_chunks', s.get('chunks'))} chunks, fetch "
        f"{_rate(s['fetch_bytes_per_second'])}"
        f" = {share:.2f} of {_rate(bound['bytes_per_second'])} ({bound['what']})"
        + (
            f"; with the lookup {both:.2f}"
            if (both := bound.get("lookup_and_fetch_share_of_bound")) is not None
            else ""
        )
        + (
            f"; the copy alone {copy:.2f}"
            if (copy := bound.get("copy_share_of_bound")) is not None
            else ""
        )
    )


def _memcpy_seconds(torch: Any, nbytes: int, repeats: int, *, cold: bool) -> float | None:
    """One host copy of the same bytes on all of torch's threads (the intra-op pool splits a
    large copy; numpy copies on as many Python threads as a cross-check, the faster counts):
    the floor under any fetch from this host. ``cold`` (a CPU engine): each copy starts with the
    CPU caches flushed, as each sample does: a source just written sits in a large last-level
    cache (300 MiB on the 2-core VM this was tuned on) and is copied at up to twice DRAM's rate,
    which a fetch of chunks stored earlier never sees."""
    if nbytes == 0:
        return None
    src = _huge_page_tensor(torch, nbytes)
    src.fill_(1)
    dst = torch.zeros_like(src)  # touched: page faults are not a copy's cost
    threads = max(1, torch.get_num_threads())
    parts = [(i * nbytes // threads, (i + 1) * nbytes // threads) for i in range(threads)]
    a, b = src.numpy(), dst.numpy()
    samples = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            if cold:
                flush_cpu_caches(torch)
            t0 = time.perf_counter()
            dst.copy_(src)
            torch_s = time.perf_counter() - t0
            if cold:
                flush_cpu_caches(torch)
            t1 = time.perf_counter()
            list(pool.map(lambda p: b.__setitem__(slice(*p), a[slice(*p)]), parts))
            samples.append(min(torch_s, time.perf_counter() - t1))
    return statistics.median(samples)


def _mapped_huge_bytes(engine: Any) -> int | None:
    """Bytes of ``engine``'s mapping of its agent's arena on huge pages (None: none mapped, or
    the agent could not be asked: the run's figures are kept either way)."""
    try:
        arena = engine.client.shared_arena() if engine.client is not None else None
    except Exception:  # AgentError, OSError: a footnote, not worth the run
        return None
    return None if arena is None else hugepages.huge_bytes(arena)


def _huge_page_tensor(torch: Any, nbytes: int) -> Any:
    """A uint8 CPU tensor on huge pages where the kernel gives them to process memory that asks
    (transparent_hugepage/enabled: madvise or always): the memcpy's source, so that the bound
    is this host's best copy, not one slowed by 4 KiB pages that an arena on huge pages is not."""
    region = hugepages.anonymous_region(nbytes)
    with warnings.catch_warnings():  # frombuffer keeps ``region`` alive with the tensor
        warnings.simplefilter("ignore")
        return torch.frombuffer(region, dtype=torch.uint8)


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu")) -> int:
    """Bytes of the last-level caches as Linux reports them: each distinct cache of the highest
    level once (one per socket or core complex), 64 MiB where none can be read."""
    found: dict[tuple[int, str], int] = {}  # (level, the CPUs sharing it) -> bytes
    for cache in root.glob("cpu[0-9]*/cache/index[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            text = (cache / "size").read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            level = int((cache / "level").read_text())
            shared = (cache / "shared_cpu_list").read_text().strip()
            found[(level, shared)] = int(text.rstrip("KMG")) * scale
    if not found:
        return 64 << 20
    top = max(level for level, _ in found)
    return sum(size for (level, _), size in found.items() if level == top)


_flush_buffer: list[Any] = []


def flush_cpu_caches(torch: Any) -> None:
    """Write twice the last-level cache's bytes (one buffer kept between calls), so what a copy
    reads next comes from DRAM, as chunks stored earlier do."""
    if not _flush_buffer:
        _flush_buffer.append(
            torch.zeros(min(2 * last_level_cache_bytes(), 1 << 30), dtype=torch.uint8)
        )
    buf = _flush_buffer[0]
    buf.fill_(int(buf[0]) ^ 1)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=g)]


def render_ttft_bench(result: dict[str, Any]) -> Group:
    from rich.console import Group
    from rich.table import Table

    from kvctl.format import format_bytes

    m = result["model"]
    title = (
        f"TTFT, {m['shape']} ({m['dtype']}, random weights) on {m['device_name'] or m['device']}, "
        f"{result['suffix_tokens']} new tokens after the context"
    )
    if result.get("layerwise"):  # older JSON has no such key
        title += "; layer-wise copies (fetch: queueing them; rates: the copies' own time)"
    table = Table(title=title)
    for col in (
        "context",
        "full prefill",
        "source",
        "ttft",
        "speedup",
        "reused",
        "moved",
        "fetch",
        "fetch rate",
        "bound",
        "memcpy",
    ):
        table.add_column(col, justify="left" if col == "source" else "right")
    for row in result["rows"]:
        first = True
        entries = [("miss", row["miss"])]
        for name, s in row["sources"].items():
            entries.append((name, s))
            if "forced_fetch" in s:
                entries.append((f"{name} (forced fetch)", s["forced_fetch"]))
        for source, s in entries:
            if "error" in s:
                table.add_row(f"{row['context_tokens']:,}" if first else "", "", source, "failed")
                first = False
                continue
            table.add_row(
                f"{row['context_tokens']:,}" if first else "",
                f"{row['full_prefill']['ttft_seconds'] * 1e3:,.1f} ms" if first else "",
                source,
                f"{s['ttft_seconds'] * 1e3:,.1f} ms" if "ttft_seconds" in s else "read only",
                f"{s['speedup']:.1f}x" if s.get("speedup") else "n/a",
                f"{s['reused_tokens']:,}" if "reused_tokens" in s else f"{s['chunks']} chunks",
                format_bytes(s["bytes_moved"]) if s["bytes_moved"] else "-",
                f"{s['fetch_seconds'] * 1e3:,.1f} ms",
                _rate(s["fetch_bytes_per_second"]),
                _rate(s["bound"]["bytes_per_second"]) if "bound" in s else "",
                f"{row['memcpy_seconds'] * 1e3:,.2f} ms" if first and row["memcpy_seconds"] else "",
            )
            first = False
    failed = [f"[red]failed: {f}[/]" for f in result.get("failures", [])]
    attached = ", ".join(
        f"{name} {'n/a' if s is None else f'{s * 1e3:,.1f} ms'}"
        for name, s in result.get("arena_attach_seconds", {}).items()
    )
    attach = [f"arena mapped at engine start: {attached}"] if attached else []
    return Group(table, *attach, *failed, *[f"- {n}" for n in result["notes"]])


def _rate(bytes_per_second: float | None) -> str:
    return f"{bytes_per_second / 1e9:,.2f} GB/s" if bytes_per_second else "-"
