"""`kvctl bench ...`: reproducible benchmarks that print JSON, each figure beside a reference
measured in the same run."""

from __future__ import annotations

import pathlib
from typing import Annotated

import typer

from kvctl.cli.output import console, print_json, user_errors

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print JSON.")

DEFAULT_SIZES = "256KiB,4MiB,32MiB"


@bench_app.command(
    "store", short_help="Put/get bandwidth of the cpu and disk tiers vs memcpy/file."
)
def bench_store_command(
    sizes: Annotated[str, typer.Option(help="Chunk sizes, comma separated.")] = DEFAULT_SIZES,
    bytes_per_size: Annotated[
        str, typer.Option(help="Bytes moved per measurement (per size, per tier).")
    ] = "256MiB",
    directory: Annotated[
        pathlib.Path | None,
        typer.Option("--dir", help="Where the disk tier writes (default: a temporary directory)."),
    ] = None,
    repeats: Annotated[int, typer.Option(help="Repeats per figure; the median is reported.")] = 3,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Measure put/get bytes per second of the cpu and disk tiers at several chunk sizes, next
    to memcpy and raw file write/read bandwidth measured in the same run.

    Examples:

      kvctl bench store --json

      kvctl bench store --sizes 4MiB --bytes-per-size 1GiB --dir /mnt/nvme/kvctl-bench
    """
    from kvctl.bench.store import run_store_bench
    from kvctl.units import parse_size

    with user_errors(hint="see `kvctl bench store --help`"):
        size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
        result = run_store_bench(
            size_list,
            bytes_per_size=parse_size(bytes_per_size),
            directory=directory,
            repeats=repeats,
        )
    if json_out:
        print_json(result)
        return
    from kvctl.bench.store import render_store_bench

    console.print(render_store_bench(result))


@bench_app.command("agent", short_help="Data plane of a real agent: shm/TCP vs memcpy/raw socket.")
def bench_agent_command(
    sizes: Annotated[str, typer.Option(help="Chunk sizes, comma separated.")] = "4MiB,32MiB",
    bytes_per_size: Annotated[
        str, typer.Option(help="Bytes moved per sample (per size, per figure).")
    ] = "256MiB",
    repeats: Annotated[int, typer.Option(help="Samples per figure; the median is reported.")] = 3,
    lookup_seconds: Annotated[float, typer.Option(help="Seconds spent timing lookups.")] = 2.0,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Start an agent, drive it from this process through the SDK, and measure shared-memory
    and TCP get/put bandwidth next to memcpy and a raw loopback socket measured in the same
    run, and lookups of a 512-chunk chain per second.

    Examples:

      kvctl bench agent --json > bench/results/agent.json

      kvctl bench agent --sizes 32MiB --bytes-per-size 1GiB --repeats 5
    """
    from kvctl.bench.agent import run_agent_bench
    from kvctl.units import parse_size

    with user_errors(hint="see `kvctl bench agent --help`"):
        size_list = [parse_size(s) for s in sizes.split(",") if s.strip()]
        result = run_agent_bench(
            size_list,
            bytes_per_size=parse_size(bytes_per_size),
            repeats=repeats,
            lookup_seconds=lookup_seconds,
            progress=None if json_out else lambda msg: console.print(f"[dim]{msg}[/]"),
        )
    if json_out:
        print_json(result)
        return
    from kvctl.bench.agent import render_agent_bench

    console.print(render_agent_bench(result))
