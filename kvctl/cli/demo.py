"""`kvctl demo`: the main job on one machine.

Until the demo fleet exists (agents serving a replayed workload), the demo is the offline
simulator: the shared Mooncake trace when this machine has it, else the built-in workload, at
cache sizes of 1%, 5%, 10% and 25% of the workload's unique blocks.
"""

from __future__ import annotations

import pathlib
from typing import Annotated

import typer

from kvctl.cli.output import console, user_errors

DEMO_FRACTIONS = (0.01, 0.05, 0.10, 0.25)


def demo_command(
    trace: Annotated[
        pathlib.Path | None,
        typer.Option(help="Trace to replay; when the file is absent the built-in workload runs."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Run the demo: replay a workload through every eviction policy at four cache sizes.

    Examples:

      kvctl demo

      kvctl demo --trace ../shared/data/mooncake_synthetic_trace.jsonl
    """
    from kvctl.cli.output import print_json
    from kvctl.cli.simulate import _progress, render_report
    from kvctl.store.policies import EVICTION_POLICIES
    from kvctl.workload.simulate import capacity_from_fraction, simulate
    from kvctl.workload.source import load_workload
    from kvctl.workload.trace import find_default_trace

    with user_errors():
        if trace is not None and not trace.is_file():
            console.print(f"[yellow]{trace} not found; using the built-in workload instead[/]")
            trace = None
        elif trace is None:
            trace = find_default_trace()
        workload = load_workload(trace)
        unique = len({b for r in workload.requests for b in r.block_ids})
        if not json_out:
            console.print(
                f"[bold]kvctl demo[/]: offline replay of [cyan]{workload.name}[/] "
                f"({len(workload.requests):,} requests, {unique:,} unique blocks) through the "
                "store's eviction policies, with LRU and Belady's optimum as references."
            )
        reports = []
        with _progress(disable=json_out) as update:
            for fraction in DEMO_FRACTIONS:
                tiers = {"cpu": capacity_from_fraction(unique, fraction)}
                report = simulate(
                    workload.requests,
                    tiers=tiers,
                    policies=list(EVICTION_POLICIES),
                    trace_name=workload.name,
                    progress=update,
                )
                reports.append(report)
                if not json_out:
                    render_report(report)
    if json_out:
        print_json([r.as_dict() for r in reports])
