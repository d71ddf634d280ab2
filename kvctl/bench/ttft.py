"""`kvctl bench ttft`: time to first token of a real (random-weight) Llama, full prefill vs the
prefix's KV read from a kvctl agent's cpu tier, its disk tier, and the shared pool.

Three agents on loopback: ``node`` (cpu + disk tiers, writes through to the pool), ``pool`` (an
embedded pool agent) and ``reader`` (another node with the same pool and nothing local, so its
lookups and reads go to the pool). The engine talks to ``node`` and ``reader`` over their Unix
sockets with shared memory, as an engine on the same host would.

Per context length: a prompt of ``context`` tokens plus ``suffix`` new ones; the full prefill is
the reference; each source's TTFT is lookup + fetch + prefill of the tokens not reused. Every
cache-assisted answer is checked against the full prefill (next token equal, logits within the
stated tolerance) and every reuse against the tier it must come from. Bytes moved are next to a
host memcpy of the same bytes measured in the same run.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvctl.bench.common import host_info, spawned_agent
from kvctl.store.errors import InvalidArgument

if TYPE_CHECKING:
    from rich.console import Group

    from kvctl.agent.daemon import AgentState
    from kvctl.client import AgentClient, DataClient
    from kvctl.engines.hf import Prefill

SOURCES = ("cpu", "disk", "pool")
#: where each source's chunks must be found by the lookup
_TIER_OF = {"cpu": "cpu", "disk": "disk", "pool": "remote"}
CPU_CONTEXTS = "1k,4k,16k"
GPU_CONTEXTS = "1k,4k,16k,32k,64k,100k"
#: logits of a cache-assisted one-pass prefill vs a full one (see kvctl.engines.hf.CachedLM)
ATOL = {"float32": 1e-4, "bfloat16": 5e-2, "float16": 1e-2}
POOL_WAIT_S = 120.0


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
) -> dict[str, Any]:
    try:
        import torch

        from kvctl.engines.hf import CachedLM
        from kvctl.engines.models import SHAPES, build_model
    except ImportError as exc:
        raise InvalidArgument(
            f"the ttft bench needs torch and transformers ({exc}); pip install 'kvctl[engine]'"
        ) from None

    cuda = torch.cuda.is_available()
    device = device or ("cuda" if cuda else "cpu")
    if device.startswith("cuda") and not cuda:
        raise InvalidArgument("--device cuda asked for, but torch sees no CUDA device")
    shape = shape or ("llama-3.1-8b" if device.startswith("cuda") else "tiny-llama")
    if shape not in SHAPES:
        raise InvalidArgument(f"unknown model {shape!r}; choose from {', '.join(SHAPES)}")
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if dtype not in ATOL:
        raise InvalidArgument(f"unknown dtype {dtype!r}; choose from {', '.join(ATOL)}")
    contexts = contexts or parse_contexts(
        GPU_CONTEXTS if device.startswith("cuda") else CPU_CONTEXTS
    )
    bad = [s for s in sources if s not in SOURCES]
    if bad or not sources:
        raise InvalidArgument(f"unknown source {bad}; choose from {', '.join(SOURCES)}")
    if repeats < 1 or suffix_tokens < 1 or chunk_tokens < 1:
        raise InvalidArgument("repeats, suffix tokens and chunk tokens must be positive")
    say = progress or (lambda _msg: None)

    say(f"building {shape} ({dtype}) on {device}")
    model = build_model(shape, seed=seed, dtype=getattr(torch, dtype), device=device)
    full = CachedLM(model, None, chunk_tokens=chunk_tokens)
    chunk_bytes = full.format.chunk_bytes
    kv_bytes = max(contexts) // chunk_tokens * chunk_bytes
    cap = kv_bytes + kv_bytes // 4 + 4 * chunk_bytes

    rows: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvctl-bench-ttft-") as tmp,
        _fleet(Path(tmp), cap, chunk_tokens, sources) as fleet,
    ):
        engines = {
            name: CachedLM(model, client, tenant="bench", store=name == "node")
            for name, client in fleet.data.items()
        }
        # warm-up: one-off kernel and allocator set-up of both paths, kept out of every figure
        warm = _tokens(2 * chunk_tokens + suffix_tokens, seed - 1, model.config.vocab_size)
        for _ in range(2):
            full.prefill(warm)
            engines["node"].prefill(warm)
        fleet.forget(engines["node"].chunk_keys(warm))
        for n, context in enumerate(contexts):
            prompt = _tokens(context + suffix_tokens, seed + n, model.config.vocab_size)
            say(f"{context} tokens: full prefill")
            base = [_light(full.prefill(prompt)) for _ in range(repeats)]
            reference = base[-1]
            full_s = statistics.median(p.ttft_seconds for p in base)
            # the first request through the node stores the prompt's chunks (a miss: nothing
            # is cached yet); its TTFT is the cost of asking the agent for nothing
            miss = _light(engines["node"].prefill(prompt))
            stored = engines["node"].chunk_keys(prompt)
            keys = stored[: (len(prompt) - 1) // chunk_tokens]  # the reusable ones
            if "pool" in sources:
                _wait_for_pool(fleet.data["pool"], keys)
            memcpy = _memcpy_seconds(torch, len(keys) * chunk_bytes, repeats)
            row: dict[str, Any] = {
                "context_tokens": context,
                "prompt_tokens": len(prompt),
                "full_prefill": {
                    "ttft_seconds": full_s,
                    "samples_seconds": [p.ttft_seconds for p in base],
                },
                "miss": _summary([miss], full_s),
                "memcpy_seconds": memcpy,
                "sources": {},
            }
            for source in sources:
                say(f"{context} tokens: prefix from {source}")
                runs = []
                for _ in range(repeats):
                    fleet.prepare(source, keys)
                    got = _light(engines["reader" if source == "pool" else "node"].prefill(prompt))
                    _check(got, reference, source, len(keys), dtype)
                    runs.append(got)
                row["sources"][source] = _summary(runs, full_s)
            rows.append(row)
            fleet.forget(stored)
            del base, miss, runs
            if device.startswith("cuda"):
                torch.cuda.empty_cache()  # the next context's caches need the room

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
        "logits_atol": ATOL[dtype],
        "rows": rows,
        "host": host_info(),
        "notes": [
            "ttft = lookup + fetch + prefill of the tokens not reused, up to the next token's "
            "logits; storing new chunks comes after and is reported as store_seconds",
            "every cache-assisted answer was checked: same next token as the full prefill, "
            "logits within logits_atol",
            "engine <-> agent over a Unix socket with shared memory (same host)",
            "disk: files fsynced and dropped from the page cache (posix_fadvise DONTNEED) "
            "before each sample, so reads come from the device",
            "pool: an embedded pool agent on loopback; the reader node has nothing local and "
            "its link to the pool is forced to fetch (override=fetch), so the pull is measured "
            "whatever the link plan would decide",
        ],
    }


# --- the agents -------------------------------------------------------------------------------
class _Fleet:
    def __init__(self, data: dict[str, DataClient], control: dict[str, AgentClient], disk: Path):
        self.data = data
        self.control = control
        self.disk = disk

    def prepare(self, source: str, keys: list[bytes]) -> None:
        """Put the chunks where ``source`` says before a sample."""
        node = self.control["node"]
        if source == "cpu":
            node.move([k.hex() for k in keys], "cpu")
        elif source == "disk":
            node.move([k.hex() for k in keys], "disk")
            _drop_page_cache(self.disk)
        else:  # the reader pulled them last time: forget them locally, the pool keeps its copy
            self.control["reader"].evict([k.hex() for k in keys])

    def forget(self, keys: list[bytes]) -> None:
        """Room for the next context: every agent drops this prompt's chunks."""
        hexes = [k.hex() for k in keys]
        for client in self.control.values():
            client.evict(hexes)


@contextlib.contextmanager
def _fleet(tmp: Path, cap: int, chunk_tokens: int, sources: tuple[str, ...]) -> Iterator[_Fleet]:
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
            # nothing local: its lookups and reads go to the pool, whatever the link plan says
            link = ["--link", "pool:override=fetch"]
            agents["reader"] = start("reader", "--cpu", str(cap), "--disk", "0", *pool_args, *link)
        data: dict[str, DataClient] = {}
        control: dict[str, AgentClient] = {}
        for name, state in agents.items():
            address = state.data_unix if name != "pool" else state.data_tcp
            data[name] = stack.enter_context(DataClient.connect(address))  # type: ignore[arg-type]
            control[name] = AgentClient(state.control_url)
            stack.callback(control[name].close)
        yield _Fleet(data, control, tmp / "node" / "disk")


def _wait_for_pool(pool: DataClient, keys: list[bytes]) -> None:
    """The node writes through to the pool in the background; wait until every chunk is there."""
    deadline = time.monotonic() + POOL_WAIT_S
    while time.monotonic() < deadline:
        if all(t is not None for t in pool.exists(keys, tenant="bench")):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the pool did not receive the prompt's chunks within {POOL_WAIT_S:.0f} s")


def _drop_page_cache(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# --- figures ----------------------------------------------------------------------------------
def _check(got: Prefill, reference: Prefill, source: str, chunks: int, dtype: str) -> None:
    """A sample counts only if it reused what it should and answered as the full prefill."""
    import torch

    tier = _TIER_OF[source]
    if got.reused_chunks != chunks or any(t != tier for t in got.reused_tiers):
        raise RuntimeError(
            f"{source}: expected {chunks} chunks from the {tier} tier, reused "
            f"{got.reused_chunks} from {sorted(set(got.reused_tiers))}"
        )
    diff = float((got.logits - reference.logits).abs().max())
    if (
        got.next_token != reference.next_token
        or not torch.isfinite(got.logits).all()
        or diff > ATOL[dtype]
    ):
        raise RuntimeError(
            f"{source}: the cache-assisted answer differs from the full prefill (max |logit "
            f"diff| {diff:.3g}, next token {got.next_token} vs {reference.next_token})"
        )


def _light(p: Prefill) -> Prefill:
    """Keep a sample's figures, not its KV cache (12.5 GiB at 100k tokens on Llama-3.1-8B)."""
    p.cache = None
    return p


def _summary(runs: list[Prefill], full_s: float) -> dict[str, Any]:
    ttft = statistics.median(p.ttft_seconds for p in runs)
    last = runs[-1]
    fetch = statistics.median(p.fetch_seconds for p in runs)
    return {
        "ttft_seconds": ttft,
        "speedup": full_s / ttft if ttft > 0 else None,
        "lookup_seconds": statistics.median(p.lookup_seconds for p in runs),
        "fetch_seconds": fetch,
        "compute_seconds": statistics.median(p.compute_seconds for p in runs),
        "store_seconds": statistics.median(p.store_seconds for p in runs),
        "reused_tokens": last.reused_tokens,
        "computed_tokens": last.computed_tokens,
        "bytes_moved": last.fetched_bytes,
        "fetch_bytes_per_second": last.fetched_bytes / fetch
        if last.fetched_bytes and fetch
        else None,
        "samples_seconds": [p.ttft_seconds for p in runs],
    }


def _memcpy_seconds(torch: Any, nbytes: int, repeats: int) -> float | None:
    """One host copy of the same bytes: the floor under any fetch from this host."""
    if nbytes == 0:
        return None
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)  # touched: page faults are not a copy's cost
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=g)]


def render_ttft_bench(result: dict[str, Any]) -> Group:
    from rich.console import Group
    from rich.table import Table

    from kvctl.units import format_bytes

    m = result["model"]
    title = (
        f"TTFT, {m['shape']} ({m['dtype']}, random weights) on {m['device_name'] or m['device']}, "
        f"{result['suffix_tokens']} new tokens after the context"
    )
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
        "memcpy",
    ):
        table.add_column(col, justify="left" if col == "source" else "right")
    for row in result["rows"]:
        first = True
        for source, s in [("miss", row["miss"]), *row["sources"].items()]:
            table.add_row(
                f"{row['context_tokens']:,}" if first else "",
                f"{row['full_prefill']['ttft_seconds'] * 1e3:,.1f} ms" if first else "",
                source,
                f"{s['ttft_seconds'] * 1e3:,.1f} ms",
                f"{s['speedup']:.1f}x" if s["speedup"] else "n/a",
                f"{s['reused_tokens']:,}",
                format_bytes(s["bytes_moved"]) if s["bytes_moved"] else "-",
                f"{s['fetch_seconds'] * 1e3:,.1f} ms",
                f"{row['memcpy_seconds'] * 1e3:,.2f} ms" if first and row["memcpy_seconds"] else "",
            )
            first = False
    return Group(table, *[f"- {n}" for n in result["notes"]])
