"""`kvctl demo`: the main job on one machine.

Until the demo fleet exists (agents serving a replayed workload), the demo is the offline
simulator: the shared Mooncake trace when this machine has it, else the built-in workload, at
cache sizes of 1%, 5%, 10% and 25% of the workload's unique blocks.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Annotated

import typer

from kvctl.cli.output import console, user_errors

if TYPE_CHECKING:
    from kvctl.workload.simulate import SimulationReport

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
                "store's eviction policies, with LRU and Belady's optimum as references. "
                "Traces carry no retention priorities, so `priority` behaves as LRU here."
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
        return
    console.print(_summary(reports))


def _summary(reports: list[SimulationReport]) -> str:
    """One line per policy: its share of Belady's hit ratio at each cache size."""
    lines = ["[bold]Share of Belady's hit ratio by cache size[/] (1%, 5%, 10%, 25% of unique):"]
    for policy in (r.policy for r in reports[0].results if r.policy != "belady"):
        shares = []
        for report in reports:
            best = report.result("belady").hit_ratio
            shares.append(
                f"{report.result(policy).hit_ratio / best * 100:5.1f}" if best else "  n/a"
            )
        lines.append(f"  {policy:<14} " + "  ".join(shares))
    return "\n".join(lines)
