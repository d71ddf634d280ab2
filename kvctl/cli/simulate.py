"""`kvctl simulate`: replay a trace offline through the store's policies."""

from __future__ import annotations

import inspect
import pathlib
from typing import Annotated

import typer

from kvctl.cli.output import TaskProgress, console, fail, print_json, user_errors
from kvctl.format import percent

EXAMPLES = """
Examples:

  kvctl simulate --trace ../shared/data/mooncake_synthetic_trace.jsonl --capacity-fraction 0.1

  kvctl simulate --trace trace.jsonl --capacity-blocks 5000 --policy lru --policy lineage-gdsf

  kvctl simulate --trace trace.jsonl --tier cpu=2000 --tier disk=20000 --admission frequency

  kvctl simulate --json            # built-in seeded workload when no --trace is given
"""


def simulate_command(
    trace: Annotated[
        pathlib.Path | None,
        typer.Option(help="Mooncake-format JSONL trace. Without it, the built-in workload."),
    ] = None,
    capacity_fraction: Annotated[
        list[float] | None,
        typer.Option(help="Cache size as a fraction of the trace's unique blocks (repeatable)."),
    ] = None,
    capacity_blocks: Annotated[
        list[int] | None, typer.Option(help="Cache size in blocks (repeatable).")
    ] = None,
    tier: Annotated[
        list[str] | None,
        typer.Option(help="Multi-tier mode: NAME=BLOCKS, fastest first (e.g. cpu=2000)."),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(help="Eviction policy (repeatable). Default: all. LRU and Belady always run."),
    ] = None,
    admission: Annotated[
        str, typer.Option(help="Admission to tiers below the first: all or frequency.")
    ] = "all",
    limit: Annotated[int | None, typer.Option(help="Replay only the first N requests.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the built-in workload.")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Replay a trace offline through the store's eviction policies and compare hit ratios.

    Every block of the trace is one chunk; a block is a prefix hit when it and all blocks before
    it in the request are cached. LRU and Belady's offline optimum always run in the same
    replay as references, and each policy is shown as a percentage of Belady.
    """
    from kvctl.store.policies import EVICTION_POLICIES
    from kvctl.workload.simulate import capacity_from_fraction, simulate
    from kvctl.workload.source import load_workload

    with user_errors(hint="see `kvctl simulate --help`"):
        if sum(bool(x) for x in (capacity_fraction, capacity_blocks, tier)) > 1:
            fail("give only one of --capacity-fraction, --capacity-blocks and --tier")
        workload = load_workload(trace, seed=seed, limit=limit)
        if not workload.requests:
            fail(f"{workload.name} holds no requests")
        unique = len({b for r in workload.requests for b in r.block_ids})
        runs: list[dict[str, int]]
        if tier:
            runs = [_parse_tiers(tier)]
        elif capacity_blocks:
            runs = [{"cpu": n} for n in capacity_blocks]
        else:
            fractions = capacity_fraction or [0.1]
            runs = [{"cpu": capacity_from_fraction(unique, f)} for f in fractions]
        policies = policy or list(EVICTION_POLICIES)
        reports = []
        with TaskProgress(disable=json_out, prefix="simulating ") as update:
            for tiers in runs:
                reports.append(
                    simulate(
                        workload.requests,
                        tiers=tiers,
                        policies=policies,
                        admission=admission,
                        trace_name=workload.name,
                        progress=update,
                    )
                )
    if json_out:
        payload = [r.as_dict() for r in reports]
        print_json(payload[0] if len(payload) == 1 else payload)
        return
    for report in reports:
        render_report(report)


# dedented apart: EXAMPLES is not indented like the docstring
simulate_command.__doc__ = inspect.cleandoc(simulate_command.__doc__ or "") + "\n" + EXAMPLES


def render_report(report: object) -> None:
    from rich.table import Table

    from kvctl.workload.simulate import REFERENCE_POLICIES, SimulationReport

    assert isinstance(report, SimulationReport)
    belady = report.result("belady").hit_ratio
    tiers = ", ".join(f"{n}={c:,}" for n, c in report.tiers.items())
    share = report.capacity_blocks / report.unique_blocks if report.unique_blocks else 0.0
    table = Table(
        title=f"{report.trace}: {report.requests:,} requests, {report.unique_blocks:,} unique "
        f"blocks, capacity {tiers} blocks ({percent(share)} of unique)"
        + (f", admission {report.admission}" if len(report.tiers) > 1 else ""),
        title_justify="left",
        caption="* reference, measured in the same replay",
        caption_justify="left",
    )
    table.add_column("policy")
    table.add_column("block hit ratio", justify="right")
    table.add_column("token hit ratio", justify="right")
    table.add_column("% of Belady", justify="right")
    multi = len(report.tiers) > 1
    if multi:
        for name in report.tiers:
            table.add_column(f"hits in {name}", justify="right")
    table.add_column("seconds", justify="right")
    for r in report.results:
        row = [
            r.policy + ("*" if r.policy in REFERENCE_POLICIES else ""),
            percent(r.hit_ratio),
            percent(r.token_hit_ratio),
            f"{r.hit_ratio / belady * 100:.1f}" if belady else "n/a",
        ]
        if multi:
            row += [f"{r.hits_by_tier[n]:,}" for n in report.tiers]
        row.append(f"{r.seconds:.1f}")
        table.add_row(*row)
    console.print(table)


def _parse_tiers(specs: list[str]) -> dict[str, int]:
    from kvctl.errors import InvalidArgument

    tiers: dict[str, int] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name or not value.strip().isdigit():
            raise InvalidArgument(f"--tier takes NAME=BLOCKS, e.g. cpu=2000; got {spec!r}")
        if name in tiers:
            raise InvalidArgument(f"tier {name!r} given twice")
        tiers[name] = int(value)
    return tiers
