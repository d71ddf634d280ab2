"""`kvctl bench ...`: reproducible benchmarks that print JSON, each figure beside a reference
measured in the same run."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from kvctl.cli.extras import needs_extra
from kvctl.cli.options import JsonOpt, bundled, db_errors
from kvctl.cli.output import console, err_console, fail, print_json, user_errors

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print JSON.")

Result = dict[str, Any]

SizesOpt = Annotated[str, typer.Option(help="Chunk sizes, comma separated.")]
BytesPerSampleOpt = Annotated[
    str, typer.Option(help="Bytes moved per sample (per size, per figure).")
]
SamplesOpt = Annotated[int, typer.Option(help="Samples per figure; the median is reported.")]


@dataclass(frozen=True, slots=True)
class Sweep:
    """The chunk sizes a bandwidth benchmark measures and the bytes it moves at each."""

    sizes: SizesOpt = "4MiB,32MiB"
    bytes_per_size: BytesPerSampleOpt = "256MiB"

    def sizes_bytes(self) -> list[int]:
        from kvctl.units import parse_size

        return [parse_size(s) for s in self.sizes.split(",") if s.strip()]

    def moved_bytes(self) -> int:
        from kvctl.units import parse_size

        return parse_size(self.bytes_per_size)


@dataclass(frozen=True, slots=True)
class _TierSweep(Sweep):
    """bench store's wording and sizes: it measures each tier, from small chunks up."""

    sizes: SizesOpt = "256KiB,4MiB,32MiB"
    bytes_per_size: Annotated[
        str, typer.Option(help="Bytes moved per measurement (per size, per tier).")
    ] = "256MiB"


@dataclass(frozen=True, slots=True)
class _PoolSweep(Sweep):
    """bench remote's wording: its sizes are the pool tier's (the peer pull has its own)."""

    sizes: Annotated[str, typer.Option(help="Pool chunk sizes, comma separated.")] = "4MiB,32MiB"
    bytes_per_size: Annotated[
        str, typer.Option(help="Bytes moved per pool sample (per size, per figure).")
    ] = "256MiB"


def _run(
    command: str, measure: Callable[[], Result], render: Callable[[Result], Any], json_out: bool
) -> Result:
    """Measure (a bad option value or the library's refusal is one line pointing at the
    command's help, exit 2), then print the result: JSON for scripts, else its table."""
    with user_errors(hint=_help_hint(command)):
        result = measure()
    if json_out:
        print_json(result)
    else:
        console.print(render(result))
    return result


def _help_hint(command: str) -> str:
    return f"see `kvctl bench {command} --help`"


def _progress(msg: str) -> None:
    """Progress lines on stderr, so stdout stays the result alone."""
    err_console.print(msg, style="dim", markup=False)


@bench_app.command(
    "store", short_help="Put/get bandwidth of the cpu and disk tiers vs memcpy/file."
)
@bundled
def bench_store_command(
    sweep: _TierSweep,
    directory: Annotated[
        pathlib.Path | None,
        typer.Option("--dir", help="Where the disk tier writes (default: a temporary directory)."),
    ] = None,
    repeats: Annotated[int, typer.Option(help="Repeats per figure; the median is reported.")] = 3,
    json_out: JsonOpt = False,
) -> None:
    """Measure put/get bytes per second of the cpu and disk tiers at several chunk sizes, next
    to memcpy and raw file write/read bandwidth measured in the same run.

    Examples:

      kvctl bench store --json

      kvctl bench store --sizes 4MiB --bytes-per-size 1GiB --dir /mnt/nvme/kvctl-bench
    """
    from kvctl.bench.store import render_store_bench, run_store_bench

    def measure() -> Result:
        return run_store_bench(
            sweep.sizes_bytes(),
            bytes_per_size=sweep.moved_bytes(),
            directory=directory,
            repeats=repeats,
        )

    _run("store", measure, render_store_bench, json_out)


@bench_app.command("agent", short_help="Data plane of a real agent: shm/TCP vs memcpy/raw socket.")
@bundled
def bench_agent_command(
    sweep: Sweep,
    repeats: SamplesOpt = 3,
    lookup_seconds: Annotated[
        float, typer.Option(help="Seconds spent timing lookups.", min=0.01)
    ] = 2.0,
    json_out: JsonOpt = False,
) -> None:
    """Start an agent, drive it from this process through the SDK, and measure shared-memory
    and TCP get/put bandwidth next to memcpy and a raw loopback socket measured in the same
    run, and lookups of a 512-chunk chain per second.

    Examples:

      kvctl bench agent --json > agent.json

      kvctl bench agent --sizes 32MiB --bytes-per-size 1GiB --repeats 5
    """
    from kvctl.bench.agent import render_agent_bench, run_agent_bench

    def measure() -> Result:
        return run_agent_bench(
            sweep.sizes_bytes(),
            bytes_per_size=sweep.moved_bytes(),
            repeats=repeats,
            lookup_seconds=lookup_seconds,
            progress=None if json_out else lambda msg: console.print(f"[dim]{msg}[/]"),
        )

    _run("agent", measure, render_agent_bench, json_out)


@bench_app.command(
    "db", short_help="Sample ingest rows/s and fleet-summary time, SQLite and PostgreSQL."
)
def bench_db_command(
    rows: Annotated[int, typer.Option(help="Cache samples written per ingest sample.")] = 500_000,
    batch: Annotated[int, typer.Option(help="Rows per batch (one transaction each).")] = 10_000,
    nodes: Annotated[int, typer.Option(help="Nodes in the generated history.")] = 1000,
    dcs: Annotated[int, typer.Option(help="DCs the nodes are spread over.")] = 8,
    days: Annotated[int, typer.Option(help="Days of history at 10 s resolution.")] = 7,
    repeats: SamplesOpt = 3,
    pg_url: Annotated[
        str | None,
        typer.Option(
            help="PostgreSQL URL allowed to create databases (default: KVCTL_TEST_PG_URL, else "
            "postgres on 127.0.0.1:5432); given, an unreachable server is an error."
        ),
    ] = None,
    no_pg: Annotated[bool, typer.Option("--no-pg", help="SQLite only.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Measure batched sample ingest (rows per second) into SQLite and PostgreSQL next to the
    driver's plain bulk path, and the dashboard's fleet summary over a generated history of
    NODES x DAYS at 10 s next to a full scan, all in the same run. PostgreSQL runs in a
    throwaway database, dropped at the end; it is skipped when no server is reachable.
    Progress goes to stderr.

    Examples:

      kvctl bench db --json > db.json

      kvctl bench db --no-pg --nodes 200 --days 2

      kvctl bench db --pg-url postgresql://postgres@db.example:5432/postgres --repeats 5
    """
    from kvctl.bench.db import render_db_bench, run_db_bench

    def measure() -> Result:
        with db_errors(hint=_help_hint("db")):
            return run_db_bench(
                rows=rows,
                batch_rows=batch,
                nodes=nodes,
                dcs=dcs,
                days=days,
                repeats=repeats,
                pg=not no_pg,
                pg_admin_url=pg_url,
                progress=_progress,
            )

    _run("db", measure, render_db_bench, json_out)


@bench_app.command(
    "top", short_help="Does `kvctl top` keep up on N real agents? Poll vs bare fan-out."
)
def bench_top_command(
    agents: Annotated[int, typer.Option(help="Real agent processes to start on loopback.")] = 50,
    interval: Annotated[
        float, typer.Option("--interval", help="The view's refresh interval, seconds.")
    ] = 1.0,
    seconds: Annotated[
        float, typer.Option("--seconds", help="How long the view runs headless, seconds.")
    ] = 20.0,
    json_out: JsonOpt = False,
) -> None:
    """Start AGENTS real agents on loopback (a 16 MiB cpu tier each, over up to 4 DCs) in a
    throwaway inventory, keep some traffic on them, and measure whether the live view keeps up
    with its refresh interval: one poll's work (every agent's stats and the sampler) next to a
    bare health fan-out to the same agents, alternating in the same run; then the real view run
    headless for SECONDS: refreshes applied and late ticks next to the ticks expected, nodes up,
    and the UI thread's cost of drawing one refresh. Every agent is stopped at the end. Each
    agent takes ~80 MB of memory. Progress goes to stderr.

    Examples:

      kvctl bench top --json > top.json

      kvctl bench top --agents 200 --interval 2 --seconds 30
    """
    needs_extra("kvctl bench top", "tui")
    from kvctl.bench.top import render_top_bench, run_top_bench

    def measure() -> Result:
        return run_top_bench(
            agents=agents, interval_s=interval, seconds=seconds, progress=_progress
        )

    _run("top", measure, render_top_bench, json_out)


@bench_app.command(
    "remote", short_help="Pool tier on Redis vs a plain pipeline; a peer pull vs its lower bound."
)
@bundled
def bench_remote_command(
    sweep: _PoolSweep,
    repeats: SamplesOpt = 3,
    batch: Annotated[
        int, typer.Option(help="Chunks per put_many/get_many call and per reference pipeline.")
    ] = 8,
    redis_url: Annotated[
        str, typer.Option(help="The Redis (or Valkey) server the pool tier is measured on.")
    ] = "redis://127.0.0.1:6379/0",
    prefix: Annotated[
        str | None,
        typer.Option(
            help="Key prefix of the run (default: kvctl-bench-<pid>-<random>); every key under "
            "it is deleted at the end."
        ),
    ] = None,
    pull_chunks: Annotated[
        int, typer.Option(help="Chunks stored in the peer and pulled in one request.")
    ] = 64,
    pull_chunk_size: Annotated[str, typer.Option(help="Size of each pulled chunk.")] = "4MiB",
    rtts_ms: Annotated[
        str,
        typer.Option(help="Emulated RTTs of the peer pull, milliseconds, comma separated."),
    ] = "0,1,5",
    json_out: JsonOpt = False,
) -> None:
    """Measure the remote tiers, each figure next to a reference from the same run: put/get
    bytes per second of the pool tier (RedisPool: records with header and checksum, the
    accounting script) next to a plain redis-py pipeline of SET/GET on the same server, every
    byte read back checked; then start one peer agent on loopback, store PULL_CHUNKS chained
    chunks in it and pull them all in one request at each emulated RTT (an in-process wait per
    request, as an agent applies a configured link delay): time to first chunk and to last byte
    next to the lower bound ping RTT + emulated RTT + bytes / the PROBE bandwidth. Every Redis
    key of the run is deleted and the agent stopped at the end, also on errors and Ctrl-C.
    Progress goes to stderr.

    Examples:

      kvctl bench remote --json > remote.json

      kvctl bench remote --redis-url redis://:secret@cache.example:6379/0 --sizes 32MiB

      kvctl bench remote --pull-chunks 256 --pull-chunk-size 2MiB --rtts-ms 0,2,10,50
    """
    from kvctl.bench.remote import parse_rtts_ms, render_remote_bench, run_remote_bench
    from kvctl.units import parse_size

    def measure() -> Result:
        return run_remote_bench(
            sweep.sizes_bytes(),
            bytes_per_size=sweep.moved_bytes(),
            repeats=repeats,
            batch_chunks=batch,
            redis_url=redis_url,
            prefix=prefix,
            pull_chunks=pull_chunks,
            pull_chunk_bytes=parse_size(pull_chunk_size),
            rtts_s=parse_rtts_ms(rtts_ms),
            progress=_progress,
        )

    _run("remote", measure, render_remote_bench, json_out)


@bench_app.command(
    "gpu", short_help="Put/get of the gpu tier vs bare pinned-host<->device copy_ (CUDA only)."
)
@bundled
def bench_gpu_command(
    sweep: Sweep,
    repeats: SamplesOpt = 3,
    device: Annotated[str, typer.Option(help="CUDA device: cuda or cuda:N.")] = "cuda:0",
    json_out: JsonOpt = False,
) -> None:
    """Measure put/get bytes per second of the gpu tier (a CUDA-memory arena, copies staged
    through pinned host memory) at each chunk size, next to a bare torch copy_ between pinned
    host memory and the device and a host memcpy, all measured in the same run. Needs torch
    built with CUDA and a visible GPU: without them it measures nothing and exits 2 (with
    --json, after printing {"skipped": reason}).

    Examples:

      kvctl bench gpu --json > gpu.json

      kvctl bench gpu --sizes 4MiB,32MiB,128MiB --bytes-per-size 1GiB --device cuda:1
    """
    needs_extra("kvctl bench gpu", "engine")
    from kvctl.bench.gpu import render_gpu_bench, run_gpu_bench

    def measure() -> Result:
        result = run_gpu_bench(
            sweep.sizes_bytes(), bytes_per_size=sweep.moved_bytes(), repeats=repeats, device=device
        )
        if "skipped" in result:  # nothing measured: exit 2, scripts still get the reason
            if json_out:
                print_json(result)
            fail(
                f"gpu benchmark skipped: {result['skipped']}",
                hint="it needs torch built with CUDA and a visible GPU (`nvidia-smi` lists them)",
            )
        return result

    _run("gpu", measure, render_gpu_bench, json_out)


@bench_app.command(
    "ttft", short_help="Time to first token: full prefill vs the prefix from cpu, disk, pool."
)
def bench_ttft_command(
    contexts: Annotated[
        str | None,
        typer.Option(
            help="Context lengths in tokens, comma separated (k = 1024). Default: 1k,4k,16k on "
            "a CPU; 1k,4k,16k,32k,64k,100k with CUDA."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="Model shape (random weights): tiny-llama or llama-3.1-8b. Default: tiny-llama "
            "on a CPU, llama-3.1-8b with CUDA."
        ),
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="torch device (cpu, cuda, cuda:N). Default: cuda if any.")
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(help="float32, bfloat16 or float16. Default: float32 on a CPU, else bf16."),
    ] = None,
    suffix: Annotated[int, typer.Option(help="New tokens after the cached context.")] = 64,
    chunk_tokens: Annotated[int, typer.Option(help="Tokens per KV chunk.")] = 256,
    sources: Annotated[
        str, typer.Option(help="Where the prefix comes from, comma separated.")
    ] = "cpu,disk,pool",
    repeats: SamplesOpt = 3,
    seed: Annotated[int, typer.Option(help="Seed of the weights and prompts.")] = 0,
    layerwise: Annotated[
        bool,
        typer.Option(
            help="Copy a prefix leased from the shared arena layer by layer under the forward "
            "pass (on a GPU the later layers cross the link while the first ones compute)."
        ),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Time to first token of a Llama-architecture model with seeded random weights (real
    shapes, nothing downloaded): a full prefill of CONTEXT + SUFFIX tokens next to the same
    request with the context's KV read from a kvctl agent's cpu tier, its disk tier (page
    cache dropped before each sample) and a shared pool (an embedded pool agent, pulled by
    another node). Three agents are started on loopback and stopped at the end. Each
    cache-assisted answer is checked against the full prefill (same next token, logits within
    a stated tolerance). Needs torch and transformers (`pip install 'kvctl[engine]'`).
    Progress goes to stderr.

    Examples:

      kvctl bench ttft --json > ttft-cpu.json

      kvctl bench ttft --contexts 1k,4k --sources cpu,pool --repeats 5

      kvctl bench ttft --device cuda --model llama-3.1-8b --contexts 1k,16k,100k --json

      kvctl bench ttft --device cuda --contexts 32k --sources cpu --layerwise --json
    """
    needs_extra("kvctl bench ttft", "engine")
    from kvctl.bench.ttft import parse_contexts, render_ttft_bench, run_ttft_bench

    def measure() -> Result:
        return run_ttft_bench(
            contexts=parse_contexts(contexts) if contexts else None,
            shape=model,
            device=device,
            dtype=dtype,
            suffix_tokens=suffix,
            chunk_tokens=chunk_tokens,
            repeats=repeats,
            sources=tuple(s.strip() for s in sources.split(",") if s.strip()),
            seed=seed,
            progress=_progress,
            layerwise=layerwise,
        )

    result = _run("ttft", measure, render_ttft_bench, json_out)
    if result["failures"]:  # the figures are out; a wrong or failed sample still fails the run
        raise typer.Exit(1)


@bench_app.command(
    "route", short_help="Routing policies on the same requests (modeled TTFT); decision latency."
)
def bench_route_command(
    workloads: Annotated[
        str | None,
        typer.Option(
            help="Workloads, comma separated: mooncake (the shared trace, skipped when absent) "
            "and generated ones (system-prompt, chat, rag, builtin). "
            "Default: mooncake,system-prompt,chat,rag."
        ),
    ] = None,
    policies: Annotated[
        str | None,
        typer.Option(
            help="Policies, comma separated (round-robin, session-affinity, prefix-only, cost); "
            "round-robin, the reference, always runs. Default: all."
        ),
    ] = None,
    nodes: Annotated[
        int | None, typer.Option(help="Serving nodes, dealt over the DCs. [9]")
    ] = None,
    dcs: Annotated[int | None, typer.Option(help="DCs, 2 to 4. [3]")] = None,
    distances_km: Annotated[
        str | None,
        typer.Option(
            help="km between DCs: one value for every pair, or one per pair in the order "
            "0-1,0-2,..,1-2,.. [100,1500,1500]"
        ),
    ] = None,
    link_gbps: Annotated[
        float | None, typer.Option(help="Bandwidth of each inter-DC link, Gb/s. [100]")
    ] = None,
    cpu: Annotated[str | None, typer.Option(help="Each node's cpu tier. [64GiB]")] = None,
    disk: Annotated[str | None, typer.Option(help="Each node's disk tier. [256GiB]")] = None,
    requests: Annotated[
        int | None,
        typer.Option(help="Requests per workload (default: the whole trace, generators' size)."),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of workloads and tenants. [0]")] = None,
    model: Annotated[str | None, typer.Option(help="Model profile. [llama-3.1-8b]")] = None,
    gpu: Annotated[str | None, typer.Option(help="GPU profile. [h100]")] = None,
    latency_requests: Annotated[
        int | None, typer.Option(help="Decisions timed for the latency figures. [2000]")
    ] = None,
    rate: Annotated[
        float | None, typer.Option(help="Paced decisions per second when timing. [1000]")
    ] = None,
    index_entries: Annotated[
        int | None, typer.Option(help="Index size the decisions are timed at. [500000]")
    ] = None,
    index_events: Annotated[
        int | None, typer.Option(help="Events applied when timing index updates. [200000]")
    ] = None,
    latency_followers: Annotated[
        int | None,
        typer.Option(
            help="Agents the router figure's router follows (each a stand-in answering its "
            "poll; setting 1,000 up takes 15-25 s on 2 cores); 0 skips that figure. [1000]"
        ),
    ] = None,
    redis_url: Annotated[
        str | None,
        typer.Option(help="Redis for the RedisIndex figure. [redis://127.0.0.1:6379/0]"),
    ] = None,
    no_redis: Annotated[bool, typer.Option("--no-redis", help="Skip the Redis figure.")] = False,
    quick: Annotated[
        bool, typer.Option("--quick", help="A size that finishes in seconds (smoke runs).")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Compare routing policies on the same requests, in one process with no agents: each
    node runs the real store over size-only tiers, its events feed one fleet index, each
    request comes from its tenant's home DC; the chosen node executes the cost model's fetch
    plan for itself (local tiers, pulls over DC links, recompute), so policies differ only in
    the node they pick. Per policy: hit ratio (local / pulled), requests sent to a node holding
    part of the prefix, bytes pulled per DC link, and modeled TTFT (mean, p50, p99), next to
    round-robin in the same run. Then the decision latency (index answer + decide, p50/p99 at
    a paced rate, next to prefix-only and a plain dict lookup of the same keys) and the index's
    update rate (EmbeddedIndex, and RedisIndex when Redis answers, next to plain dict inserts
    and raw Redis pipelines). Bracketed values are the defaults; --quick starts from a small
    size instead (options given still apply). Progress goes to stderr.

    Examples:

      kvctl bench route --json > route.json

      kvctl bench route --quick

      kvctl bench route --workloads mooncake --dcs 4 --nodes 16 --distances-km 2000

      kvctl bench route --latency-followers 0     # no router figure, no 1,000-agent set-up
    """
    from kvctl.bench.route import (
        RouteBenchConfig,
        parse_distances,
        parse_names,
        render_route_bench,
        run_route_bench,
    )
    from kvctl.units import parse_size

    def measure() -> Result:
        given: dict[str, Any] = {
            "workloads": parse_names(workloads) if workloads is not None else None,
            "policies": parse_names(policies) if policies is not None else None,
            "nodes": nodes,
            "dcs": dcs,
            "distances_km": parse_distances(distances_km) if distances_km is not None else None,
            "link_bytes_per_s": link_gbps * 1e9 / 8 if link_gbps is not None else None,
            "cpu_bytes": parse_size(cpu) if cpu is not None else None,
            "disk_bytes": parse_size(disk) if disk is not None else None,
            "requests": requests,
            "seed": seed,
            "model": model,
            "gpu": gpu,
            "latency_requests": latency_requests,
            "latency_rate_per_s": rate,
            "index_entries": index_entries,
            "index_events": index_events,
            "latency_followers": latency_followers,
            "redis_url": redis_url,
        }
        overrides = {k: v for k, v in given.items() if v is not None}
        if no_redis:
            overrides["redis_url"] = None
        config = RouteBenchConfig.quick(**overrides) if quick else RouteBenchConfig(**overrides)
        return run_route_bench(config, progress=_progress)

    _run("route", measure, render_route_bench, json_out)


@bench_app.command(
    "reopen", short_help="Disk tier open after a clean close (its index) vs after a crash (scan)."
)
def bench_reopen_command(
    chunks: Annotated[int, typer.Option(help="Chunk files in the disk tier.")] = 20_000,
    chunk_size: Annotated[str, typer.Option(help="Size of each chunk.")] = "4KiB",
    repeats: Annotated[int, typer.Option(help="Opens each way per cache state.")] = 3,
    directory: Annotated[
        pathlib.Path | None,
        typer.Option("--dir", help="Where the tier is written (default: a temporary directory)."),
    ] = None,
    drop_all_caches: Annotated[
        bool,
        typer.Option(
            "--drop-all-caches",
            help="Also time opens after dropping every kernel cache of the machine "
            "(/proc/sys/vm/drop_caches: root only, and it slows every other process a while).",
        ),
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """How long a disk tier takes to open, which is how long a restarted agent serves nothing:
    after a clean close (its index is read and each chunk file still listed is trusted) beside
    after a crash (every chunk file's header is read), on the same directory in the same run,
    with its files' pages in memory (warm) and dropped (cold). The chunk size barely matters:
    a chunk costs its file, not its bytes. Progress goes to stderr.

    Examples:

      kvctl bench reopen --json > reopen.json

      kvctl bench reopen --chunks 100000 --dir /mnt/nvme/kvctl-bench --drop-all-caches
    """
    from kvctl.bench.reopen import render_reopen_bench, run_reopen_bench
    from kvctl.units import parse_size

    def measure() -> Result:
        return run_reopen_bench(
            chunks=chunks,
            chunk_bytes=parse_size(chunk_size),
            repeats=repeats,
            directory=directory,
            drop_all_caches=drop_all_caches,
            progress=_progress,
        )

    _run("reopen", measure, render_reopen_bench, json_out)


@bench_app.command(
    "crash", short_help="kill -9 an agent under write load: what the disk tier kept, restart time."
)
def bench_crash_command(
    trials: Annotated[int, typer.Option(help="kill -9 trials, each on a fresh data dir.")] = 20,
    writers: Annotated[int, typer.Option(help="Client threads putting chunks.")] = 2,
    chunk_size: Annotated[str, typer.Option(help="Size of each chunk put.")] = "256KiB",
    cpu: Annotated[
        str, typer.Option(help="The agent's cpu tier: small, so puts demote to disk.")
    ] = "8MiB",
    disk: Annotated[
        str, typer.Option(help="The agent's disk tier: large enough that nothing is evicted.")
    ] = "4GiB",
    kill_after: Annotated[
        str,
        typer.Option(help="FIRST,LAST: the kill comes at a random second in this window."),
    ] = "0.2,1.5",
    fsync: Annotated[
        bool, typer.Option("--fsync/--no-fsync", help="The agent's fsync setting.")
    ] = True,
    seed: Annotated[int, typer.Option(help="Seed of the kill instants.")] = 0,
    directory: Annotated[
        pathlib.Path | None,
        typer.Option("--dir", help="Where the trial data dirs go (default: a temporary one)."),
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Crash consistency of the disk tier: per trial, start an agent (small cpu tier over a
    disk tier, every demotion admitted), put chunks from WRITERS client threads while
    following the agent's demotions, kill -9 it at a random instant, audit the directory it
    left (whole chunk files, temp files, damaged files), restart it on the same directory and
    read back every chunk sent, comparing every byte. Reports corrupt reads and acknowledged
    chunks known on disk that were lost (both must be 0), chunks only in the cpu tier that were
    lost (expected: DRAM), torn/partial files dropped at the restart, and the restart time next
    to a fresh start. Exits 1 when a must-be-zero figure is not. A kill -9 is not a power loss:
    the page cache survives it. Progress goes to stderr.

    Examples:

      kvctl bench crash --json > crash.json

      kvctl bench crash --trials 100 --writers 4 --chunk-size 1MiB --dir /mnt/nvme/kvctl-bench

      kvctl bench crash --trials 5 --no-fsync --kill-after 0.05,0.5
    """
    from kvctl.bench.crash import render_crash_bench, run_crash_bench
    from kvctl.units import parse_size

    def measure() -> Result:
        window = _seconds_pair(kill_after, "--kill-after")
        with _TrialProgress() as progress, _agent_errors():
            return run_crash_bench(
                trials=trials,
                writers=writers,
                chunk_bytes=parse_size(chunk_size),
                cpu_bytes=parse_size(cpu),
                disk_bytes=parse_size(disk),
                kill_after_s=window,
                fsync=fsync,
                seed=seed,
                directory=directory,
                progress=progress,
            )

    if not _run("crash", measure, render_crash_bench, json_out)["ok"]:
        fail("a figure that must be 0 is not (see corrupt_reads, acked_disk_lost, "
             "disk_files_not_served)", code=1)  # fmt: skip


@contextlib.contextmanager
def _agent_errors() -> Iterator[None]:
    """An agent that would not start (its log's end is in the message): one error, exit 1."""
    try:
        yield
    except RuntimeError as exc:
        fail(str(exc), hint="the agent's log is quoted above; fix what it says and rerun", code=1)


def _seconds_pair(text: str, option: str) -> tuple[float, float]:
    parts = [p.strip() for p in text.split(",")]
    try:
        first, last = (float(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"{option} takes two seconds, FIRST,LAST (e.g. 0.2,1.5): {text!r}"
        ) from None
    return first, last


class _TrialProgress:
    """A transient bar of trials done on stderr; silent when stderr is not a terminal."""

    def __enter__(self):  # type: ignore[no-untyped-def]
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._bar = Progress(
            "kill -9 trials",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err_console,
            transient=True,
            disable=not err_console.is_terminal,
        )
        self._bar.__enter__()
        self._task = self._bar.add_task("trials", total=None)
        return self.update

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(None, None, None)

    def update(self, done: int, total: int) -> None:
        self._bar.update(self._task, completed=done, total=total)
