"""`kvctl plan`: what-if planning of tier sizes and a remote pool's distance."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from kvctl.cli.options import JsonOpt
from kvctl.cli.output import console, print_json, user_errors
from kvctl.cli.replay import GpuOpt, LimitOpt, MfuOpt, SeedOpt, TraceOpt, WorkloadOpt

if TYPE_CHECKING:
    from kvctl.workload.whatif import PlanReport


def plan_command(
    trace: TraceOpt = None,
    workload: WorkloadOpt = "builtin",
    seed: SeedOpt = 0,
    limit: LimitOpt = None,
    cpu: Annotated[str, typer.Option("--cpu", help="Host-memory tier size.")] = "64GiB",
    disk: Annotated[str, typer.Option("--disk", help="Local SSD tier size; 0 for none.")] = "1TiB",
    remote: Annotated[
        str, typer.Option("--remote", help="Shared remote pool size; 0 for none.")
    ] = "10TiB",
    distance_km: Annotated[
        list[float] | None,
        typer.Option("--distance-km", help="Remote pool distances to compare (repeatable).", min=0),
    ] = None,
    model: Annotated[str, typer.Option("--model", help="Model profile.")] = "llama-3.1-8b",
    gpu: GpuOpt = "h100",
    mfu: MfuOpt = 0.5,
    policy: Annotated[str, typer.Option("--policy", help="Eviction policy.")] = "lineage-lru",
    curve_points: Annotated[
        int, typer.Option("--curve-points", help="Capacities on the miss-ratio curve.", min=2)
    ] = 10,
    json_out: JsonOpt = False,
) -> None:
    """What if the cache were this big, or the pool that far? Hit ratio per tier, modeled TTFT
    and prefill energy for cpu, cpu+disk, cpu+disk+remote and the remote pool at each distance,
    next to no cache; and the miss-ratio curve over capacity.

    Hit ratios are simulated with the store's own policies; TTFT and energy are modeled from the
    model and GPU profiles and the tier bandwidths and latencies printed with them.

    Examples:

      kvctl plan

      kvctl plan --trace ../shared/data/mooncake_synthetic_trace.jsonl --cpu 256GiB --disk 4TiB

      kvctl plan --workload rag --model llama-3.1-70b --gpu a100 --distance-km 200 --json
    """
    from kvctl.cli.simulate import _progress
    from kvctl.units import parse_size
    from kvctl.workload.profiles import ModeledInputs, gpu_profile, model_profile
    from kvctl.workload.source import load_workload
    from kvctl.workload.whatif import DEFAULT_DISTANCES_KM, plan

    with user_errors(hint="see `kvctl plan --help`"):
        inputs = ModeledInputs(model_profile(model), gpu_profile(gpu), mfu)
        tiers = {"cpu": parse_size(cpu), "disk": parse_size(disk), "remote": parse_size(remote)}
        if not tiers["cpu"]:
            raise ValueError("--cpu must be more than 0: every configuration starts with it")
        loaded = load_workload(trace, seed=seed, limit=limit, workload=workload)
        with _progress(disable=json_out) as update:
            report = plan(
                loaded.requests,
                tiers_bytes=tiers,
                inputs=inputs,
                distances_km=distance_km or DEFAULT_DISTANCES_KM,
                policy=policy,
                curve_points=curve_points,
                workload_name=loaded.name,
                progress=update,
            )
    if json_out:
        print_json(report.as_dict())
        return
    render_plan(report)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def render_plan(report: PlanReport) -> None:
    from rich.table import Table

    from kvctl.cli.output import pct
    from kvctl.units import format_bytes, format_rate

    table = Table(
        title=f"{report.workload}: {report.requests:,} requests, {report.unique_blocks:,} unique "
        f"blocks of {report.block_tokens} tokens ({format_bytes(report.block_bytes)} of KV each)"
        f", policy {report.policy}",
        title_justify="left",
        caption="TTFT and energy are modeled (inputs below); hit ratios simulated. "
        "* a tier slower to fetch than to recompute: its hits are recomputed",
        caption_justify="left",
    )
    for col in ("configuration", "hit ratio", "hits cpu/disk/remote", "mean TTFT", "p99 TTFT",
                "TTFT saved", "energy saved"):  # fmt: skip
        table.add_column(col, justify="left" if col == "configuration" else "right")
    base = report.baseline
    table.add_row("no cache", "0.0%", "-", _ms(base.mean_ttft_seconds),
                  _ms(base.p99_ttft_seconds), "-", "-")  # fmt: skip
    for c in report.candidates:
        hits = "/".join(
            f"{c.hits_by_tier.get(t, 0):,}" + ("*" if t in c.not_worth_fetching else "")
            if t in c.hits_by_tier else "-"
            for t in ("cpu", "disk", "remote")
        )  # fmt: skip
        d = c.as_dict(base)["modeled"]
        table.add_row(
            c.candidate.name,
            pct(c.hit_ratio),
            hits,
            _ms(c.mean_ttft_seconds),
            _ms(c.p99_ttft_seconds),
            pct(d["ttft_saved_ratio"]),
            pct(d["energy_saved_ratio"]),
        )
    console.print(table)
    inputs = report.inputs
    links = ", ".join(
        f"{t} {format_rate(link.bytes_per_second)} + {link.latency_seconds * 1e6:g} us"
        for t, link in report.links.items()
    )
    console.print(
        f"[dim]modeled: {inputs.model.name} ({inputs.model.prefill_flops_per_token:.3g} "
        f"FLOPs/token) on {inputs.gpu.name} ({inputs.gpu.peak_bf16_tflops:g} TFLOP/s, "
        f"{inputs.gpu.board_power_watts:g} W) at MFU {inputs.mfu:g} = "
        f"{inputs.prefill_tokens_per_second:,.0f} prefill tokens/s; tiers to GPU: {links}; "
        "fiber 5 us/km each way; energy = prefill compute only[/]",
        highlight=False,
    )
    curve = Table(title="miss-ratio curve (one tier)", title_justify="left")
    curve.add_column("capacity (blocks)", justify="right")
    curve.add_column("% of unique", justify="right")
    for policy in report.curves:
        curve.add_column(f"{policy} hit ratio", justify="right")
    curve.add_column("")
    first = next(iter(report.curves.values()))
    for i, point in enumerate(first):
        ratios = [points[i].hit_ratio for points in report.curves.values()]
        bar = "█" * round(ratios[-1] * 30)
        curve.add_row(
            f"{point.capacity_blocks:,}",
            pct(point.capacity_ratio),
            *(pct(r) for r in ratios),
            bar,
        )
    console.print(curve)
