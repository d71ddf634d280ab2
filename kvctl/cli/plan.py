"""`kvctl plan`: what-if planning of tier sizes and a remote pool's distance, offline."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from kvctl.cli.options import (
    MFU_DEFAULT,
    DbOpt,
    JsonOpt,
    LimitOpt,
    MfuOpt,
    SeedOpt,
    TraceOpt,
    WorkloadOpt,
    db_errors,
    load_workload_said,
    open_engine,
)
from kvctl.cli.output import TaskProgress, console, fail, print_json, user_errors
from kvctl.format import percent

#: the most capacities the miss-ratio curve is drawn at: more than any chart shows
MAX_CURVE_POINTS = 1000

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from kvctl.workload.plan import PlanReport

EXAMPLES = """
Examples:

  kvctl plan --trace ../shared/data/mooncake_synthetic_trace.jsonl

  kvctl plan --trace trace.jsonl --cpu 256GiB --disk 4TiB --remote 20TiB --distance-km 500

  kvctl plan --workload rag --model llama-3.1-70b --gpu a100 --mfu 0.4 --json

  kvctl plan --workload chat --policy lru --curve-points 12 --no-policy-curve

  kvctl plan --trace trace.jsonl --cpu 512GiB --save --dc fra-1   # for the dashboard
"""


def plan_command(
    trace: TraceOpt = None,
    workload: WorkloadOpt = "builtin",
    seed: SeedOpt = 0,
    limit: LimitOpt = None,
    cpu: Annotated[
        str, typer.Option("--cpu", help="Host-memory tier size (e.g. 64GiB).")
    ] = "64GiB",
    disk: Annotated[str, typer.Option("--disk", help="Local SSD tier size.")] = "1TiB",
    remote: Annotated[str, typer.Option("--remote", help="Shared remote pool size.")] = "10TiB",
    distance_km: Annotated[
        list[float] | None,
        typer.Option(
            "--distance-km",
            help="Distance of the remote pool to compare, besides the same DC (repeatable; "
            "default 10, 50 and 100).",
            show_default=False,
        ),
    ] = None,
    model: Annotated[str, typer.Option("--model", help="Model profile.")] = "llama-3.1-8b",
    gpu: Annotated[str, typer.Option("--gpu", help="GPU profile.")] = "h100",
    mfu: MfuOpt = MFU_DEFAULT,
    policy: Annotated[
        str, typer.Option("--policy", help="Eviction policy of every tier.")
    ] = "lineage-lru",
    curve_points: Annotated[
        int,
        typer.Option(
            "--curve-points",
            help="Capacities on the miss-ratio curve (0: no curve).",
            min=0,
            # more than a chart shows: 10**8 spent a minute spacing them for 50 requests
            max=MAX_CURVE_POINTS,
        ),
    ] = 10,
    policy_curve: Annotated[
        bool,
        typer.Option(
            "--policy-curve/--no-policy-curve",
            help="Add --policy to the curve (one replay per point) besides LRU (one pass).",
        ),
    ] = True,
    save: Annotated[
        bool,
        typer.Option(
            "--save", help="Store the report in the database for the dashboard's capacity page."
        ),
    ] = False,
    dc: Annotated[
        str | None,
        typer.Option("--dc", help="With --save: the DC the plan is for (default: the fleet)."),
    ] = None,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """What if the KV cache had these tiers, or the remote pool were that far away?

    For cpu, cpu+disk, cpu+disk+remote (the pool in the same DC) and the pool at each
    --distance-km: the hit ratio of every tier, simulated by replaying the workload through the
    store's own eviction policy, and the TTFT (mean, p50, p99) and prefill energy it would take,
    modeled, next to no cache. A chunk is fetched only when that beats recomputing it (rtt +
    bytes / bandwidth < tokens / prefill rate); a tier that loses is reported as not worth
    fetching from. Modeled figures are labelled so and printed with their inputs: model, GPU,
    MFU, each tier's bandwidth and latency. Below them, the miss-ratio curve: the hit ratio of a
    single tier from 1% to 100% of the workload's unique blocks.
    """
    from kvctl.errors import InvalidArgument
    from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
    from kvctl.units import parse_size
    from kvctl.workload.plan import DEFAULT_DISTANCES_KM, plan

    if dc is not None and not save:
        fail("--dc names the DC a saved plan is for: add --save")
    saving: Engine | None = None
    with user_errors(hint="see `kvctl plan --help`"):
        inputs = ModeledInputs(model_profile(model), gpu_profile(gpu), mfu)
        tiers_bytes: dict[str, int] = {}
        for name, text in (("cpu", cpu), ("disk", disk), ("remote", remote)):
            try:
                tiers_bytes[name] = parse_size(text)
            except InvalidArgument as exc:
                raise InvalidArgument(f"--{name}: {exc}") from None
        workload_data = load_workload_said(
            trace, seed=seed, limit=limit, workload=workload, quiet=json_out
        )
        if not workload_data.requests:
            fail(f"{workload_data.name} holds no requests")
        # where it is saved is checked before planning: a plan of a big trace takes minutes,
        # and was thrown away when the database or --dc was found wrong after it; and after
        # the input is read: a bad --cpu or --trace made no database at --db (one is created)
        saving = saving_to(dc=dc, db=db) if save else None
        with TaskProgress(disable=json_out) as update:
            report = plan(
                workload_data.requests,
                tiers_bytes=tiers_bytes,
                inputs=inputs,
                distances_km=DEFAULT_DISTANCES_KM if distance_km is None else distance_km,
                policy=policy,
                curve_points=curve_points,
                policy_curve=policy_curve,
                workload_name=workload_data.name,
                progress=update,
            )
    out = report.as_dict()
    saved = save_report(out, dc=dc, engine=saving) if saving is not None else None
    if saved is not None:
        out["saved"] = saved
    if json_out:
        print_json(out)
        return
    render_plan(report)
    if saved is not None:
        where = f"DC {dc}" if dc else "the fleet"
        console.print(f"saved as plan {saved['id']} for {where}", soft_wrap=True)


def saving_to(*, dc: str | None, db: str | None) -> Engine:
    """The database a plan will be saved in, checked: it answers, and a --dc is in its
    inventory (refused on one line, exit 2)."""
    from sqlalchemy import select

    from kvctl.db.models import DataCenter

    engine = open_engine(db, create=True)  # a plan is saved for the dashboard, fleet or not
    try:
        with db_errors(), engine.connect() as conn:
            if (
                dc is not None
                and conn.execute(select(DataCenter.id).where(DataCenter.name == dc)).first() is None
            ):
                fail(f"no DC named {dc!r} in the inventory", hint="`kvctl fleet ls` lists them")
    except BaseException:
        engine.dispose()
        raise
    return engine


def save_report(report: dict[str, object], *, dc: str | None, engine: Engine) -> dict[str, object]:
    """Store ``report`` for the dashboard in ``engine``'s database (``saving_to``)."""
    import time

    from kvctl.db.plans import save_plan

    try:
        with db_errors(), engine.begin() as conn:
            plan_id = save_plan(conn, report, dc=dc, now_ms=int(time.time() * 1000))
    finally:
        engine.dispose()
    return {"id": plan_id, "dc": dc}


# dedented apart: EXAMPLES is not indented like the docstring
plan_command.__doc__ = inspect.cleandoc(plan_command.__doc__ or "") + "\n" + EXAMPLES


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"


def _kj(joules: float) -> str:
    return f"{joules / 1e3:,.3g}" if joules < 1e5 else f"{joules / 1e3:,.0f}"


def render_plan(report: PlanReport) -> None:
    from rich.table import Table

    from kvctl.format import format_bytes

    inputs = report.inputs
    tiers = list(report.tiers_bytes)
    hits = Table(
        title=f"{escape(report.workload)}: {report.requests:,} requests, "
        f"{report.unique_blocks:,} unique blocks of {report.block_tokens} tokens "
        f"({format_bytes(report.block_bytes)} of "
        f"{inputs.model.name} KV each); policy {report.policy}\n"
        "hit ratio by tier (simulated: share of all blocks, by the tier that held them)",
        title_justify="left",
        caption="* not worth fetching from: a block is faster to recompute, so the modeled "
        "figures count these hits as misses"
        if any(c.not_worth_fetching for c in report.candidates)
        else None,
        caption_justify="left",
    )
    hits.add_column("configuration", no_wrap=True)
    hits.add_column("hit ratio", justify="right")
    hits.add_column("tokens", justify="right")
    for t in tiers:
        hits.add_column(t, justify="right")
    for c in report.candidates:
        by_tier = []
        for t in tiers:
            if t not in c.hit_ratio_by_tier:
                by_tier.append("")
                continue
            mark = "*" if t in c.not_worth_fetching else ""
            by_tier.append(percent(c.hit_ratio_by_tier[t]) + mark)
        hits.add_row(c.candidate.name, percent(c.hit_ratio), percent(c.token_hit_ratio), *by_tier)
    console.print(hits)

    modeled = Table(
        title="TTFT per request and prefill energy (modeled; inputs below)", title_justify="left"
    )
    modeled.add_column("configuration", no_wrap=True)
    for col in ("TTFT mean ms", "p50 ms", "p99 ms", "TTFT saved", "energy kJ", "energy saved"):
        modeled.add_column(col, justify="right")
    base = report.baseline
    modeled.add_row(
        "no cache",
        _ms(base.mean_ttft_seconds),
        _ms(base.p50_ttft_seconds),
        _ms(base.p99_ttft_seconds),
        "-",
        _kj(base.prefill_joules),
        "-",
    )
    for c in report.candidates:
        modeled.add_row(
            c.candidate.name,
            _ms(c.ttft.mean_ttft_seconds),
            _ms(c.ttft.p50_ttft_seconds),
            _ms(c.ttft.p99_ttft_seconds),
            percent(c.mean_ttft_saved_ratio),
            _kj(c.ttft.prefill_joules),
            percent(c.prefill_joules_saved_ratio),
        )
    console.print(modeled)
    render_tiers(report)
    if report.curve:
        render_curve(report)
    console.print(
        f"[dim]modeled inputs: {inputs.model.name} ({inputs.model.prefill_flops_per_token:.3g} "
        f"prefill FLOPs/token, {inputs.model.kv_bytes_per_token:,} KV bytes/token) on "
        f"{inputs.gpu.name} ({inputs.gpu.peak_bf16_tflops:g} bf16 TFLOP/s, "
        f"{inputs.gpu.board_power_watts:g} W) at MFU {inputs.mfu:g} = "
        f"{inputs.prefill_tokens_per_second:,.0f} prefill tokens/s; tier bandwidths and "
        "latencies above. TTFT = prefill of the tokens not fetched + each fetched chunk's "
        "latency and transfer, one after another (no overlap, queueing or decode). Energy = "
        "prefill compute only (board power x prefill time). "
        f"Planned in {report.seconds:.1f} s.[/]",
        highlight=False,
    )


def render_tiers(report: PlanReport) -> None:
    from rich.table import Table

    from kvctl.format import format_bytes

    sizes = ", ".join(f"{t} {format_bytes(n)}" for t, n in report.tiers_bytes.items())
    table = Table(
        title=f"tiers ({sizes}): moving one block to GPU memory, or recomputing it (modeled; "
        "latency = the tier's + the fiber's round trip)",
        title_justify="left",
    )
    table.add_column("tier", no_wrap=True)
    for col in ("blocks", "GB/s", "latency us", "fetch ms", "prefill ms"):
        table.add_column(col, justify="right")
    table.add_column("per block")
    seen: set[tuple[str, float]] = set()
    for c in report.candidates:
        for t, cost in c.tier_costs.items():
            tm = cost.transfer
            if (t, tm.distance_km) in seen:
                continue
            seen.add((t, tm.distance_km))
            name = t if t != "remote" else f"remote@{tm.distance_km:g}km"
            latency = f"{tm.latency_seconds * 1e6:g}"
            if tm.distance_km:
                latency += f"+{tm.fiber_rtt_seconds * 1e6:,.0f}"
            fetches = cost.fetches(report.block_tokens)
            verdict = "fetch" if fetches else "recompute"
            if t == "remote" and fetches:
                verdict += f" (to {cost.max_distance_km(report.block_tokens):,.0f} km)"
            table.add_row(
                name,
                f"{report.tiers_blocks[t]:,}",
                f"{tm.bandwidth_bytes_per_second / 1e9:g}",
                latency,
                _ms(cost.fetch_seconds(report.block_tokens)),
                _ms(cost.recompute_seconds(report.block_tokens)),
                verdict,
            )
    console.print(table)


def render_curve(report: PlanReport) -> None:
    from rich.table import Table

    from kvctl.format import format_bytes

    table = Table(
        title="miss-ratio curve: hit ratio of one tier by capacity (simulated)",
        title_justify="left",
    )
    table.add_column("capacity (blocks)", justify="right")
    table.add_column("size", justify="right")
    table.add_column("% of unique", justify="right")
    table.add_column("LRU", justify="right")
    if report.policy_curve:
        table.add_column(report.policy, justify="right")
    table.add_column("LRU hit ratio")
    width = 20
    for p in report.curve:
        row = [
            f"{p.capacity_blocks:,}",
            format_bytes(p.capacity_bytes),
            percent(p.unique_fraction),
            percent(p.lru_hit_ratio),
        ]
        if report.policy_curve:
            row.append(percent(p.policy_hit_ratio or 0.0))
        row.append("█" * round(p.lru_hit_ratio * width) or "▏")
        table.add_row(*row)
    console.print(table)
