"""`kvctl replay`: drive real agents with a workload or trace through the data plane."""

from __future__ import annotations

import pathlib
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from kvctl.cli.options import (
    MFU_DEFAULT,
    AllOpt,
    DbOpt,
    DcOpt,
    JsonOpt,
    LimitOpt,
    MfuOpt,
    NodeOpt,
    SeedOpt,
    TenantsOpt,
    TraceOpt,
    WorkloadOpt,
    db_errors,
    load_workload_said,
    open_engine,
)
from kvctl.cli.output import console, err_console, fail, print_json, user_errors
from kvctl.format import ENERGY_UNITS, format_scaled, percent
from kvctl.interrupts import on_sigint

if TYPE_CHECKING:
    from types import FrameType

    from kvctl.router.client import RouterClient
    from kvctl.workload.replay import ReplayReport
    from kvctl.workload.source import Workload

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model", help="Model profile (default: the agents' model when known, else llama-3.1-8b)."
    ),
]
GpuOpt = Annotated[str, typer.Option("--gpu", help="GPU profile for modeled figures.")]


def parse_fraction(text: str) -> float:
    """``0.25`` or ``1/4``."""
    from kvctl.errors import InvalidArgument

    num, sep, den = text.partition("/")
    try:
        value = float(num) / float(den) if sep else float(num)
    except (ValueError, ZeroDivisionError):
        raise InvalidArgument(f"not a fraction: {text!r} (examples: 0.25, 1/64)") from None
    return value


def load_for_replay(
    trace: pathlib.Path | None,
    workload: str,
    seed: int,
    limit: int | None,
    tenants: int,
    *,
    quiet: bool,
) -> Workload:
    """The workload to replay, every request with a tenant (see ``assign_tenants``). ``quiet``
    (--json): no spinner on stderr while it loads, as simulate and plan do."""
    import dataclasses

    from kvctl.workload.trace import assign_tenants

    loaded = load_workload_said(trace, seed=seed, limit=limit, workload=workload, quiet=quiet)
    if not loaded.requests:
        fail(f"{loaded.name} holds no requests")
    return dataclasses.replace(loaded, requests=assign_tenants(loaded.requests, tenants, seed=seed))


def replay_command(
    trace: TraceOpt = None,
    workload: WorkloadOpt = "builtin",
    seed: SeedOpt = 0,
    limit: LimitOpt = None,
    tenants: TenantsOpt = 8,
    node: NodeOpt = None,
    dc: DcOpt = None,
    all_nodes: AllOpt = False,
    model: ModelOpt = None,
    kv_scale: Annotated[
        str,
        typer.Option(
            "--kv-scale",
            help="Shrink KV bytes per token by this fraction on small machines (e.g. 1/64).",
        ),
    ] = "1",
    route: Annotated[
        str,
        typer.Option(
            "--route",
            help="prefix (node of the home DC holding the longest prefix) or round-robin; "
            "--router sets 'router'.",
        ),
    ] = "prefix",
    router: Annotated[
        str | None,
        typer.Option(
            "--router",
            help="Ask this kvctl router (http://HOST:9480) which node serves each request, any "
            "DC; the agents then pull from their own peers and pool (no --peer-fetch). Its "
            "token, if any: $KVCTL_ROUTER_TOKEN.",
            show_default=False,
        ),
    ] = None,
    router_policy: Annotated[
        str,
        typer.Option(
            "--router-policy",
            help="With --router: the router's policy, cost (its own) or a baseline to compare "
            "with on the same trace: round-robin, session-affinity, prefix-only.",
        ),
    ] = "cost",
    speed: Annotated[
        float | None,
        typer.Option(
            "--speed",
            help="Honour the timestamps, this many times faster (default: as fast as possible).",
            min=0.001,
        ),
    ] = None,
    peer_fetch: Annotated[
        bool,
        typer.Option(
            "--peer-fetch/--no-peer-fetch",
            help="Fetch what the home node lacks from other nodes (cross-DC over emulated links).",
        ),
    ] = True,
    gpu: GpuOpt = "h100",
    mfu: MfuOpt = MFU_DEFAULT,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Replay a workload or trace against the fleet's agents through the real data plane.

    Each request goes to a node of its tenant's home DC (the node with the longest cached
    prefix, or round-robin); hits are fetched and checked byte for byte, misses are stored with
    payloads of the model's KV size (times --kv-scale). Afterwards every agent's counters are
    compared with what the replay expects; exit 1 when one differs or cannot be read (the
    summary is printed all the same). Prefill time and energy saved are modeled from the
    model and GPU profiles, and say so.

    With --router, a router that does not answer or refuses the token fails the command before
    the first request (exit 1). Ctrl-C stops after the request in flight and prints the summary
    of what ran (exit 130); a second Ctrl-C stops at once.

    Examples:

      kvctl replay --workload system-prompt --kv-scale 1/64

      kvctl replay --trace ../shared/data/mooncake_synthetic_trace.jsonl --limit 500 --speed 10

      kvctl replay --dc fra --route round-robin --no-peer-fetch --json

      kvctl replay --workload chat --kv-scale 1/16 --router http://127.0.0.1:9480

      kvctl replay --workload chat --router http://127.0.0.1:9480 --router-policy round-robin
    """
    from contextlib import ExitStack

    from kvctl.client import AgentClient, AgentError
    from kvctl.fleet.targets import replay_targets
    from kvctl.profiles import MODELS, ModeledInputs, gpu_profile, model_profile
    from kvctl.workload.replay import ReplayError, replay

    engine = open_engine(db)
    with (
        db_errors(),
        user_errors(hint="`kvctl fleet ls` lists DCs and nodes"),
        engine.connect() as conn,
    ):
        nodes, links = replay_targets(conn, nodes=node or [], dcs=dc or [], all_nodes=all_nodes)
    engine.dispose()
    with user_errors(hint="see `kvctl replay --help`"):
        if router is not None:
            from kvctl.router.policies import POLICIES

            if route not in ("prefix", "router"):
                fail(f"--route {route} and --router exclude each other: the router routes")
            if router_policy not in POLICIES:
                fail(
                    f"unknown --router-policy {router_policy!r}; choose from {', '.join(POLICIES)}"
                )
            route = "router"
        elif router_policy != "cost":
            fail("--router-policy goes with --router")
        scale = parse_fraction(kv_scale)
        loaded = load_for_replay(trace, workload, seed, limit, tenants, quiet=json_out)
        requests = loaded.requests
        if model is None:
            try:
                with AgentClient(nodes[0].control_url, timeout_s=5.0) as first:
                    served = [m["id"] for m in first.info().get("models", [])]
            except AgentError:
                served = []
            model = next((m for m in served if m in MODELS), "llama-3.1-8b")
        inputs = ModeledInputs(model_profile(model), gpu_profile(gpu), mfu)
        stop = threading.Event()
        with ExitStack() as stack:
            asker = _router_client(router) if router is not None else None
            if asker is not None:
                stack.enter_context(asker)
            stack.enter_context(_stop_on_interrupt(stop))
            if not json_out:
                console.print(
                    f"[bold]replay[/] {escape(loaded.name)}: {len(requests):,} requests on "
                    f"{len(nodes)} node(s), model {inputs.model.name}"
                    + (f", KV bytes scaled by {scale:g}" if scale != 1 else "")
                    + f", routing {route}"
                    + (f", {speed:g}x the trace's pace" if speed else ", as fast as possible"),
                    highlight=False,
                )
            try:
                with _Bar(len(requests), disable=json_out) as bar:
                    report = replay(
                        requests,
                        nodes,
                        inputs,
                        workload_name=loaded.name,
                        kv_scale=scale,
                        routing=route,
                        speed=speed,
                        peer_fetch=peer_fetch,
                        links_km=links,
                        progress=bar.update,
                        stop=stop,
                        salt=loaded.salt,
                        router=asker,
                        router_policy=router_policy,
                    )
            except (AgentError, ReplayError) as exc:
                hint = exc.hint if isinstance(exc, ReplayError) else None
                hint = hint or "`kvctl status` shows which agents answer"
                fail(str(exc), hint=hint, code=1)
    if json_out:
        print_json(report.as_dict())
    else:
        render_replay(report)
    if stop.is_set():  # the summary of what ran, but not what was asked for: 128 + SIGINT
        raise typer.Exit(130)
    if report.agents_agree is False or report.agents_unread:  # not checked is not agreed
        raise typer.Exit(1)


def _router_client(url: str) -> RouterClient:
    """A client of the router at ``url`` (token: $KVCTL_ROUTER_TOKEN) that has answered once:
    one that is away, hangs or refuses the token fails the command here (exit 1) instead of
    each request falling back to round-robin after the client's timeout."""
    import os

    from kvctl.cli.router import ROUTER_TOKEN_ENV, router_failed, router_url
    from kvctl.router.client import RouterClient, RouterClientError

    client = RouterClient(router_url(url), token=os.environ.get(ROUTER_TOKEN_ENV) or None)
    try:
        client.info()
    except RouterClientError as exc:
        client.close()
        # replay has no --token-file and reads no $KVCTL_ROUTER_URL (its --router is given):
        # the shared hints sent the operator to an option it lacks and a variable it ignores
        router_failed(
            exc,
            token_hint=f"set ${ROUTER_TOKEN_ENV} to the router's token (the first line of the "
            "file its `kvctl router serve --token-file` reads)",
            away_hint="start it with `kvctl router serve`, or give --router the address it prints",
        )
    return client


@contextmanager
def _stop_on_interrupt(stop: threading.Event) -> Iterator[None]:
    """The first Ctrl-C (SIGINT) sets ``stop``: the replay ends after the request in flight,
    and the summary says what ran (a long replay's figures are not lost); a second one
    interrupts at once."""

    def first(signum: int, frame: FrameType | None) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        err_console.print(
            "stopping after the request in flight (Ctrl-C again: at once, no summary)",
            highlight=False,
        )

    with on_sigint(first):
        yield


class _Bar:
    """Progress on stderr with the running request count; silent when not a terminal."""

    def __init__(self, total: int, *, disable: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._bar = Progress(
            "replaying",
            BarColumn(),
            MofNCompleteColumn(),
            "requests",
            TimeElapsedColumn(),
            console=err_console,
            transient=True,
            disable=disable or not err_console.is_terminal,
        )
        self._task = self._bar.add_task("replay", total=total)

    def __enter__(self) -> _Bar:
        self._bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(None, None, None)

    def update(self, done: int, total: int) -> None:
        self._bar.update(self._task, completed=done, total=total)


#: how the summary names the agents' tiers beyond the node
_TIER_LABELS = {"remote": "pool", "peer": "peers"}


def _routing_line(report: ReplayReport) -> str:
    r = report.router
    assert r is not None
    to_holder = percent(r.to_holder / r.decisions) if r.decisions else "N/A"
    line = (
        f"{r.decisions:,} router decisions, {to_holder} to a node holding the prefix, "
        f"{r.other_dc:,} outside the tenant's home DC, "
        f"{r.fallbacks:,} fallbacks to round-robin"
        + (f", {r.no_chunks:,} shorter than a chunk (not routed)" if r.no_chunks else "")
    )
    if r.fallbacks and r.last_error:
        from rich.markup import escape

        line += f" [dim](last: {escape(r.last_error)})[/]"
    return line


def render_replay(report: ReplayReport) -> None:
    from rich.table import Table

    from kvctl.format import format_bytes

    rq = report.requests
    d = rq.as_dict()
    head = Table.grid(padding=(0, 2))
    head.add_column(style="dim")
    head.add_column()
    done = f"{rq.requests:,}" + (
        f" of {report.requests_total:,} (stopped early)" if report.stopped_early else ""
    )
    head.add_row("requests", done)
    head.add_row(
        "chunks",
        f"{rq.chunks:,} of {report.chunk_tokens} tokens, {format_bytes(report.chunk_bytes)} each"
        + (f" (KV bytes x {report.kv_scale:g})" if report.kv_scale != 1 else ""),
    )
    head.add_row(
        "hit ratio",
        f"{percent(d['hit_ratio'])} of chunks, {percent(d['token_hit_ratio'])} of tokens",
    )
    by_tier = (
        ", ".join(f"{_TIER_LABELS.get(t, t)} {n:,}" for t, n in d["hits_by_tier"].items() if n)
        or "none"
    )
    head.add_row("hits by tier", by_tier)
    if report.router is not None:
        head.add_row("routing", _routing_line(report))
    hits = rq.reuse_hits + rq.sharing_hits
    if hits:
        head.add_row(
            "reuse / sharing",
            f"{percent(rq.reuse_hits / hits)} / {percent(rq.sharing_hits / hits)} of hits",
        )
    moved = sum(t.bytes_fetched for t in report.nodes.values())
    stored = sum(t.bytes_stored for t in report.nodes.values())
    head.add_row("bytes moved", f"{format_bytes(moved)} fetched, {format_bytes(stored)} stored")
    for link, nbytes in rq.bytes_by_link.items():
        emu = report.links[link]
        head.add_row(
            f"link {link}",
            f"{format_bytes(nbytes)} over {emu.distance_km:g} km "
            f"(emulated RTT {emu.rtt_seconds * 1e3:.2f} ms)",
        )
    if rq.emulated_delay_seconds:
        head.add_row("emulated link delay", f"{rq.emulated_delay_seconds:.3f} s in total")
    pulls = report.pulls
    for link, p in sorted(
        (pulls.by_link if pulls else {}).items(), key=lambda x: not x[1].cross_dc
    ):
        head.add_row(
            f"pulled {'across' if p.cross_dc else 'within'} {link}",
            f"{format_bytes(p.bytes)} ({p.chunks:,} chunks) [dim]measured by the agents[/]",
        )
    lag = f", at most {report.max_lag_seconds:.2f} s behind the trace" if report.speed else ""
    head.add_row("wall time", f"{report.wall_seconds:.1f} s{lag}")
    console.print(head)

    from rich import box

    nodes = Table(
        title="per node: the replay's counts; ✓ = the agent's counters say the same",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    nodes.add_column("node (dc)", no_wrap=True)
    # "requests": the node's lookup calls (the agent's `lookups` counter); everywhere else a
    # lookups column counts chunks, which "chunks" here does
    for col in ("requests", "chunks", "hit ratio", "reuse", "fetched", "stored"):
        nodes.add_column(col, justify="right", no_wrap=True)
    nodes.add_column("agent", min_width=5)
    checks = report.agent_counters or {}
    for name, t in report.nodes.items():
        fields = checks.get(name, {})
        wrong = [f for f, (a, b) in fields.items() if a != b]
        verdict = "N/A" if not fields else ("✓" if not wrong else "✗ " + ", ".join(wrong))
        hits = t.reuse_hits + t.sharing_hits
        nodes.add_row(
            escape(f"{name} ({report.node_dc[name]})"),  # the inventory's text, not markup
            f"{t.lookups:,}",
            f"{t.lookup_chunks:,}",
            percent(t.hit_chunks / t.lookup_chunks) if t.lookup_chunks else "N/A",
            percent(t.reuse_hits / hits) if hits else "N/A",
            format_bytes(t.bytes_fetched),
            format_bytes(t.bytes_stored),
            verdict,
        )
    console.print(nodes)
    m = report.modeled()
    inputs = report.inputs
    console.print(
        f"[bold]modeled[/] prefill saved: {m['prefill_seconds_saved']:.1f} GPU-s of "
        f"{m['prefill_seconds_without_cache']:.1f} ({percent(m['saved_ratio'])}), "
        f"{format_scaled(m['prefill_joules_saved'], ENERGY_UNITS)} (IT: GPU board power)\n"
        f"[dim]modeled from {inputs.model.name} ({inputs.model.prefill_flops_per_token:.3g} "
        f"FLOPs/token) on {inputs.gpu.name} ({inputs.gpu.peak_bf16_tflops:g} TFLOP/s bf16, "
        f"{inputs.gpu.board_power_watts:g} W) at MFU {inputs.mfu:g}; not measured[/]",
        highlight=False,
    )
    unchecked = [n for n, known in report.owners_known.items() if not known]
    if unchecked:
        console.print(
            f"[dim]reuse/sharing split not checked on {', '.join(unchecked)}: the owner of a "
            "chunk cached there before the replay, or of a pulled copy that never arrived, "
            "is not known[/]",
            highlight=False,
        )
    if report.agents_agree is False:
        err_console.print(
            "[yellow]warning:[/] the agents counted something else than the replay expected "
            "(another client using them at the same time?); see --json agent_counters"
        )
    for name, why in report.agents_unread.items():
        err_console.print(
            f"[yellow]warning:[/] {escape(name)}'s counters could not be read after the run "
            f"({escape(why)}): its figures above are the replay's own, not checked against "
            "the agent's, and what it pulled is left out",
            highlight=False,
            soft_wrap=True,
        )
