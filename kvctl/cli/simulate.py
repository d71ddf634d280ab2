"""`kvctl simulate`: replay a trace offline through the store's policies."""

from __future__ import annotations

import inspect
import pathlib
import re
from typing import Annotated, Any

import typer
from rich.markup import escape

from kvctl.cli.options import SeedOpt, WorkloadOpt, load_workload_said
from kvctl.cli.output import TaskProgress, console, err_console, fail, print_json, user_errors
from kvctl.format import percent

EXAMPLES = """
Examples:

  kvctl simulate --trace ../shared/data/mooncake_synthetic_trace.jsonl --capacity-fraction 0.1

  kvctl simulate --trace trace.jsonl --capacity-blocks 5000 --policy lru --policy lineage-gdsf

  kvctl simulate --trace trace.jsonl --tier cpu=2000 --tier disk=20000 --admission frequency

  kvctl simulate --json            # built-in seeded workload when no --trace is given

  kvctl simulate --workload chat --sweep --policy lineage-arc --policy lineage-lru2 --json

  kvctl simulate --trace trace.jsonl --sweep --policy oracle-popularity --policy oracle-reuse

  kvctl simulate -w system-prompt --sweep --seeds 10 --policy lineage-arc --policy lineage-adaptive
"""

#: under every table: what the marks after a policy's name mean
CAPTION = (
    "* reference, measured in the same replay; ° partial oracle (knows part of the future, "
    "simulation only)"
)

#: a ``--tier`` name
_TIER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")

#: ``--sweep``: the capacities the policies are compared at, as fractions of the unique blocks
SWEEP_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def simulate_command(
    trace: Annotated[
        pathlib.Path | None,
        typer.Option(help="Mooncake-format JSONL trace. Without it, the generated --workload."),
    ] = None,
    workload: WorkloadOpt = "builtin",
    capacity_fraction: Annotated[
        list[float] | None,
        typer.Option(
            help="Cache size as a fraction of the trace's unique blocks (repeatable). "
            "Without any capacity option: 0.1."
        ),
    ] = None,
    capacity_blocks: Annotated[
        list[int] | None, typer.Option(help="Cache size in blocks (repeatable).")
    ] = None,
    sweep: Annotated[
        bool,
        typer.Option(
            "--sweep",
            help="Capacities 1, 2, 5, 10, 20 and 50% of the unique blocks, with a summary.",
        ),
    ] = False,
    tier: Annotated[
        list[str] | None,
        typer.Option(help="Multi-tier mode: NAME=BLOCKS, fastest first (e.g. cpu=2000)."),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            help="Eviction policy (repeatable). Default: all. LRU and Belady always run. "
            "oracle-popularity (knows each block's uses left), oracle-reuse (knows whether "
            "it is used again within 4x the capacity) and oracle-features (lineage-learned-arc "
            "scoring by each feature row's reuse rate on this replay, in a second pass) run "
            "only when named: the ceilings of frequency-based and reuse-predicting policies, "
            "and of lineage-learned-arc's features."
        ),
    ] = None,
    admission: Annotated[
        str, typer.Option(help="Admission to tiers below the first: all or frequency.")
    ] = "all",
    limit: Annotated[int | None, typer.Option(help="Replay only the first N requests.")] = None,
    seed: SeedOpt = 0,
    seeds: Annotated[
        int,
        typer.Option(
            "--seeds",
            help="Replay N seeds of the generated --workload (--seed to --seed+N-1) and show "
            "each policy's mean ± sample standard deviation over them: one seed is one small "
            "sample. Capacities by --capacity-fraction or --sweep (fractions of each seed's own "
            "unique blocks). 1: one plain run.",
            show_default=False,
        ),
    ] = 1,
    attention_tokens: Annotated[
        float,
        typer.Option(
            help="Prefill cost model: context length at which a token's attention costs as "
            "much as its matmuls (Llama-3.1-8B: about 30k).",
        ),
    ] = 30_000.0,
    bypass_unreachable: Annotated[
        bool,
        typer.Option(
            "--bypass-unreachable/--keep-unreachable",
            help="Turn away a block deeper in its request than the tiers together hold: it "
            "could never be a prefix hit, and storing it evicts blocks that can (the agent's "
            "bypass_unreachable). --keep-unreachable stores it, as a store behind an engine "
            "with a prefix cache of its own must.",
        ),
    ] = True,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Replay a trace offline through the store's eviction policies and compare hit ratios.

    Every block of the trace is one chunk; a block is a prefix hit when it and all blocks before
    it in the request are cached. LRU and Belady's offline optimum always run in the same
    replay as references, and each policy is shown as a percentage of Belady. Hit ratios per
    block, per token (= per byte of KV) and per second of prefill saved (a deep block costs more
    to recompute: attention reads every token before it); decisions/s is blocks placed per
    second of replay.
    """
    from kvctl.store.policies import EVICTION_POLICIES
    from kvctl.workload.simulate import capacity_from_fraction, simulate

    with user_errors(hint="see `kvctl simulate --help`"):
        if sum(bool(x) for x in (capacity_fraction, capacity_blocks, tier, sweep)) > 1:
            fail("give only one of --capacity-fraction, --capacity-blocks, --tier and --sweep")
        _check_seeds(
            seeds, trace=trace, capacity_blocks=capacity_blocks, tier=tier, admission=admission
        )
        fractions = list(SWEEP_FRACTIONS) if sweep else capacity_fraction or [0.1]
        if seeds > 1:
            from kvctl.workload.seeds import simulate_seeds

            with TaskProgress(disable=json_out, prefix="simulating ") as update:
                swept = simulate_seeds(
                    workload,
                    range(seed, seed + seeds),
                    capacity_fractions=fractions,
                    policies=policy or list(EVICTION_POLICIES),
                    limit=limit,
                    admission=admission,
                    attention_tokens=attention_tokens,
                    bypass_unreachable=bypass_unreachable,
                    progress=update,
                )
            if json_out:
                print_json(swept.as_dict())
            else:
                render_seeds(swept)
            return
        loaded = load_workload_said(
            trace, seed=seed, limit=limit, workload=workload, quiet=json_out
        )
        if not loaded.requests:
            fail(f"{loaded.name} holds no requests")
        unique = len({b for r in loaded.requests for b in r.block_ids})
        runs: list[dict[str, int]]
        if tier:
            runs = [_parse_tiers(tier)]
        elif capacity_blocks:
            runs = [{"cpu": n} for n in capacity_blocks]
        else:
            runs = [{"cpu": capacity_from_fraction(unique, f)} for f in fractions]
        policies = policy or list(EVICTION_POLICIES)
        if admission != "all" and all(len(t) == 1 for t in runs):
            # kept for scripts that pass it, but said: the report records it as if it applied
            err_console.print(
                f"[yellow]warning:[/] --admission {escape(admission)} gates only the tiers "
                "below the first, and this run has one: it changes nothing (give --tier "
                "NAME=BLOCKS twice)",
                highlight=False,
                soft_wrap=True,
            )
        reports = []
        with TaskProgress(disable=json_out, prefix="simulating ") as update:
            for tiers in runs:
                reports.append(
                    simulate(
                        loaded.requests,
                        tiers=tiers,
                        policies=policies,
                        admission=admission,
                        trace_name=loaded.name,
                        progress=update,
                        attention_tokens=attention_tokens,
                        bypass_unreachable=bypass_unreachable,
                    )
                )
    if json_out:
        payload = [r.as_dict() for r in reports]
        print_json(payload[0] if len(payload) == 1 else payload)
        return
    for report in reports:
        render_report(report)
    if len(reports) > 1:
        render_sweep(reports)


# dedented apart: EXAMPLES is not indented like the docstring
simulate_command.__doc__ = inspect.cleandoc(simulate_command.__doc__ or "") + "\n" + EXAMPLES


def _check_seeds(
    seeds: int,
    *,
    trace: pathlib.Path | None,
    capacity_blocks: list[int] | None,
    tier: list[str] | None,
    admission: str,
) -> None:
    """Refuse what --seeds cannot mean (with 1, the default, it is one plain run: nothing to
    refuse)."""
    if seeds < 1:
        fail(f"--seeds takes a count of at least 1, got {seeds}")
    if seeds == 1:
        return
    if trace is not None:
        fail("--seeds replays seeds of a generated --workload; a --trace is one sequence")
    if capacity_blocks or tier:
        fail(
            "--seeds takes capacities as fractions (--capacity-fraction or --sweep): block "
            "counts (--capacity-blocks, --tier) do not carry across seeds of different sizes"
        )
    if admission == "frequency":  # accepted, it was in each run's "admission" and did nothing
        fail(
            "--seeds runs one cpu tier, and --admission gates only the tiers below the first: "
            "--admission frequency would change nothing"
        )


def render_seeds(sweep: object) -> None:
    """One row per policy, one column per capacity: mean ± sample standard deviation over the
    seeds of its % of Belady, the best mean of each column bold; then the paired gaps to it."""
    from rich.table import Table

    from kvctl.workload.seeds import SeedSweep

    assert isinstance(sweep, SeedSweep)
    first = sweep.reports[0][0]
    n = len(sweep.seeds)
    seeds = f"{n} seeds ({sweep.seeds[0]}..{sweep.seeds[-1]})"
    kept = "" if first.bypass_unreachable else ", unreachable blocks kept"
    short = [c for c in sweep.seeds_counted if c < n]
    left_out = (
        f"; a seed whose Belady hit nothing at a capacity is left out there (as few as "
        f"{min(short)} counted)"
        if short
        else ""
    )
    # the fraction as given (0.5% stays 0.5%): each seed's capacity in blocks differs anyway
    headers = [f"{f * 100:g}%" for f in sweep.capacity_fractions]
    table = Table(
        title=f"{escape(sweep.workload)}, {seeds}: % of Belady's block hit ratio by capacity "
        f"(% of each seed's unique blocks){kept}",
        title_justify="left",
        caption=f"mean ± sample standard deviation over {seeds} of each seed's % of Belady in "
        f"the same replay; bold: the best mean of a column{left_out}; decisions/s: the "
        f"slowest run's\n{CAPTION}",
        caption_justify="left",
    )
    _policy_column(table, [p.policy for p in sweep.summary])
    for h in headers:
        table.add_column(h, justify="right")
    table.add_column("decisions/s", justify="right")
    for p in sweep.summary:
        cells = [
            _mean_sd(m, sd, bold=b)
            for m, sd, b in zip(p.of_belady_mean, p.of_belady_stdev, p.best, strict=True)
        ]
        table.add_row(_label(p.policy), *cells, f"{p.slowest_decisions_per_second:,.0f}")
    belady = [
        [per_seed[c].result("belady").hit_ratio for per_seed in sweep.reports]
        for c in range(len(headers))
    ]
    table.add_row("Belady hit ratio, %", *[_mean_sd(*_spread(b), bold=False) for b in belady], "")
    console.print(table)
    # the gaps' sample: the seeds counted (a seed left out at a capacity is in no gap there)
    counts = set(sweep.seeds_counted)
    if counts == {n}:
        over, root = f"the {n} seeds", str(n)
    elif len(counts) == 1:
        over, root = f"the {min(counts)} seeds counted", str(min(counts))
    else:
        over, root = "a column's seeds counted", "(seeds counted)"
    gaps = Table(
        title=f"{escape(sweep.workload)}, {seeds}: gap to the best mean (points of % of Belady, "
        "paired by seed)",
        title_justify="left",
        caption=f"mean ± sample standard deviation over {over} of (policy - best) on the same "
        f"seed; the mean gap's own standard error is ± / √{root}",
        caption_justify="left",
    )
    _policy_column(gaps, [p.policy for p in sweep.summary])
    for h in headers:
        gaps.add_column(h, justify="right")
    for p in sweep.summary:
        cells = [
            "best" if b else _mean_sd(m, sd, bold=False, signed=True)
            for m, sd, b in zip(p.gap_to_best_mean, p.gap_to_best_stdev, p.best, strict=True)
        ]
        gaps.add_row(_label(p.policy), *cells)
    console.print(gaps)


def _spread(values: list[float]) -> tuple[float | None, float | None]:
    import statistics

    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def _mean_sd(
    mean: float | None,
    sd: float | None,
    *,
    bold: bool,
    signed: bool = False,
) -> str:
    """A share's mean and standard deviation in percent (points), ``48.3 ± 7.3``; ``n/a`` where
    no seed counted."""
    if mean is None:
        return "n/a"
    text = f"{mean * 100:{'+' if signed else ''}.1f}"
    if sd is not None:
        text += f" ± {sd * 100:.1f}"
    return f"[bold]{text}[/]" if bold else text


def render_report(report: object) -> None:
    from rich.table import Table

    from kvctl.workload.simulate import SimulationReport

    assert isinstance(report, SimulationReport)
    belady = report.result("belady").hit_ratio
    tiers = ", ".join(f"{n}={c:,}" for n, c in report.tiers.items())
    share = report.capacity_blocks / report.unique_blocks if report.unique_blocks else 0.0
    table = Table(
        title=f"{escape(report.trace)}: {report.requests:,} requests, "
        f"{report.unique_blocks:,} unique blocks, capacity {tiers} blocks "
        f"({percent(share)} of unique)"
        + (f", admission {report.admission}" if len(report.tiers) > 1 else "")
        + ("" if report.bypass_unreachable else ", unreachable blocks kept"),
        title_justify="left",
        caption=CAPTION,
        caption_justify="left",
    )
    _policy_column(table, [r.policy for r in report.results])
    table.add_column("block hit ratio", justify="right")
    table.add_column("token (byte) hit ratio", justify="right")
    table.add_column("prefill-weighted hit ratio", justify="right")
    table.add_column("% of Belady", justify="right")
    multi = len(report.tiers) > 1
    if multi:
        for name in report.tiers:
            table.add_column(f"hits in {name}", justify="right")
    table.add_column("decisions/s", justify="right")
    for r in report.results:
        row = [
            _label(r.policy),
            percent(r.hit_ratio),
            percent(r.token_hit_ratio),
            percent(r.prefill_hit_ratio),
            f"{r.hit_ratio / belady * 100:.1f}" if belady else "n/a",
        ]
        if multi:
            row += [f"{r.hits_by_tier[n]:,}" for n in report.tiers]
        row.append(f"{r.decisions_per_second:,.0f}")
        table.add_row(*row)
    console.print(table)


def render_sweep(reports: list[object]) -> None:
    """One row per policy, one column per capacity: its hit ratio as a % of Belady's in the
    same replay, then the slowest run's decisions/s."""
    from rich.table import Table

    from kvctl.workload.simulate import SimulationReport

    runs = [r for r in reports if isinstance(r, SimulationReport)]
    table = Table(
        title=f"{escape(runs[0].trace)}: % of Belady's block hit ratio by capacity "
        "(% of unique blocks)"
        # the table is what gets quoted: it says so when its figures are of the other mode
        + ("" if runs[0].bypass_unreachable else ", unreachable blocks kept"),
        title_justify="left",
        caption=CAPTION,
        caption_justify="left",
    )
    _policy_column(table, [r.policy for r in runs[0].results])
    for r in runs:
        share = r.capacity_blocks / r.unique_blocks if r.unique_blocks else 0.0
        table.add_column(percent(share, 0), justify="right")
    table.add_column("decisions/s", justify="right")
    for result in runs[0].results:
        name = result.policy
        row = [_label(name)]
        for r in runs:
            belady = r.result("belady").hit_ratio
            row.append(f"{r.result(name).hit_ratio / belady * 100:.1f}" if belady else "n/a")
        row.append(f"{min(r.result(name).decisions_per_second for r in runs):,.0f}")
        table.add_row(*row)
    table.add_row("Belady hit ratio", *[percent(r.result("belady").hit_ratio) for r in runs], "")
    console.print(table)


def _policy_column(table: Any, policies: list[str]) -> None:
    """The policy column, as wide as its longest name: a cut name cannot be told apart
    (``oracle-po…``); the figures' headers wrap instead."""
    width = max(len(_label(p)) for p in policies)
    table.add_column("policy", no_wrap=True, min_width=width)


def _label(policy: str) -> str:
    """A policy's name, marked when it is a reference or a partial oracle (``CAPTION``)."""
    from kvctl.workload.simulate import ORACLE_POLICIES, REFERENCE_POLICIES

    if policy in REFERENCE_POLICIES:
        return policy + "*"
    return policy + ("°" if policy in ORACLE_POLICIES else "")


def _parse_tiers(specs: list[str]) -> dict[str, int]:
    from kvctl.errors import InvalidArgument

    tiers: dict[str, int] = {}
    for spec in specs:
        name, sep, value = spec.partition("=")
        # a plain name: it titles the table and a column, where '[' would be rich markup
        if not sep or not _TIER_NAME.fullmatch(name) or not value.strip().isdecimal():
            raise InvalidArgument(
                f"--tier takes NAME=BLOCKS (NAME: letters, digits, '-', '_'), e.g. cpu=2000;"
                f" got {spec!r}"
            )
        if name in tiers:
            raise InvalidArgument(f"tier {name!r} given twice")
        tiers[name] = int(value)
    return tiers
