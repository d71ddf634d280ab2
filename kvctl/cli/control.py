"""`kvctl pin|unpin|evict|flush|prefetch|move|resize`: act on one node, a DC, or the fleet.

Thin: options become a :class:`kvctl.fleet.actions.ActionRequest`, the library fans it out and
audits it, and this module asks for confirmation, shows progress and renders the outcome."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from kvctl.cli.options import (
    ActionTimeoutOpt,
    ChunkOptions,
    DbOpt,
    JsonOpt,
    Targets,
    TierOpt,
    bundled,
    db_errors,
    open_engine,
)
from kvctl.cli.output import (
    confirm,
    console,
    err_console,
    print_json,
    said_on_interrupt,
    user_errors,
)

if TYPE_CHECKING:
    from kvctl.fleet.actions import ActionReport
    from kvctl.fleet.fanout import NodeResult


# --all and --dc act on nodes no one named, as many as the fleet or a DC holds: asked first
YesOpt = Annotated[
    bool,
    typer.Option(
        "--yes",
        "-y",
        help="Do not ask for confirmation, which --all and --dc ask for (no answer, as from a "
        "closed stdin, is a no).",
    ),
]


@dataclass(frozen=True, slots=True)
class Fanout:
    """How a control command runs on its nodes: asking first or not, each agent's timeout (a
    command's own default: ``Fanout(timeout=30.0)``), the inventory's database, the output."""

    yes: YesOpt = False
    timeout: ActionTimeoutOpt = 10.0
    db: DbOpt = None
    json_out: JsonOpt = False


def _act(
    fanout: Fanout,
    targets: Targets,
    action: str,
    *,
    chunks: ChunkOptions | None = None,
    hint: str | None = None,
    **request: Any,
) -> None:
    """Build the request (a bad value is a usage error with ``hint``), confirm one on --all or
    a whole --dc, run it on the targets with a progress bar, render the report; exit 1 on a
    failure."""
    from kvctl.fleet.actions import ActionRequest, run_action

    with user_errors(hint=hint):
        req = ActionRequest(
            action, chunks=None if chunks is None else chunks.selection(), **request
        )
    engine = open_engine(fanout.db)
    nodes = targets.resolve(engine)
    question = None if fanout.yes else targets.question(req.action, nodes)
    if question is not None and not confirm(question):
        err_console.print("nothing done")
        raise typer.Exit(1)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    answered: list[str] = []
    failed: list[str] = []  # of those answered: an error, a timeout (not acted, or unknown)
    waiting = (
        f"waiting up to {fanout.timeout:g} s for the agents already asked, whose answers are "
        "audited; nodes not yet asked are left alone"
    )
    try:
        with (
            db_errors(),
            said_on_interrupt(waiting),
            Progress(
                TextColumn(f"{req.action}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[last]}"),
                console=err_console,
                transient=True,
            ) as progress,
        ):
            task = progress.add_task(req.action, total=len(nodes), last="")

            def answer(r: NodeResult[dict[str, Any]]) -> None:
                if r.node.name not in answered:  # a Ctrl-C mid-report has it reported again
                    answered.append(r.node.name)
                    if not r.ok:
                        failed.append(r.node.name)
                progress.update(task, advance=1, last=escape(r.node.name))

            report = run_action(engine, nodes, req, timeout_s=fanout.timeout, on_result=answer)
    except KeyboardInterrupt as exc:
        unrecorded: list[str] = getattr(exc, "unrecorded", [])
        done = [name for name in answered if name not in failed]
        ended = "; ".join(
            f"{what} on {escape(', '.join(names))}"
            for what, names in (("done", done), ("[bold red]failed[/]", failed))
            if names
        )
        err_console.print(
            f"[yellow]interrupted:[/] {len(answered)} of {len(nodes)} node(s) ended"
            + (f": {ended}" if ended else "")
            + (
                f"; [bold red]not in the audit trail[/] (its write was stopped, or failed), "
                f"though asked and possibly acted: {escape(', '.join(unrecorded))}"
                if unrecorded
                else f"; `kvctl audit --action {req.action}` shows how each ended"
            ),
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(130) from None
    engine.dispose()
    _render(report, fanout.json_out)
    if not report.ok:
        names = ", ".join(r.node.name for r in report.failed)
        err_console.print(
            f"[bold red]failed on {len(report.failed)} of {len(report.results)} node(s):[/] "
            f"{escape(names)}",
            highlight=False,
        )
        raise typer.Exit(1)


def _render(report: ActionReport, json_out: bool) -> None:
    if json_out:
        print_json(report.as_dict())
        return
    from rich.table import Table

    table = Table(title=f"{report.request.action}", title_justify="left")
    # "done": chunks in the state asked for afterwards (one pinned already counts); "skipped
    # pinned" only where pinned chunks are passed over (evict, flush), not for pin itself
    skips = report.request.action in ("evict", "flush")
    counts = ("done", *(("skipped_pinned",) if skips else ()), "missing", "failed")
    heads = ("done", *(("skipped pinned",) if skips else ()), "missing", "no room")
    for col in ("node", "dc", "result", *heads, "time"):
        table.add_column(col, justify="left" if col in ("node", "dc", "result") else "right")
    for r in report.results:
        v: dict[str, Any] = r.value or {}
        cells = [str(v.get(c, "")) for c in counts]
        status = "[green]ok[/]" if r.ok else "[bold red]failed[/]"
        # escaped: the inventory's names are text, not markup
        name, dc = escape(r.node.name), escape(r.node.dc)
        table.add_row(name, dc, status, *cells, f"{r.elapsed_s * 1000:.0f} ms")
    console.print(table)
    # errors below the table, one line each: inside a cell they wrap into a column of words
    for r in report.failed:
        console.print(
            f"[red]{escape(r.node.name)}:[/] {escape(r.error or '')}",
            highlight=False,
            soft_wrap=True,
        )
    # "ok" with chunks missing did nothing for them: said on stderr (--json has `missing`)
    for note in report.missing_notes():
        err_console.print(f"[yellow]{escape(note)}[/]", highlight=False, soft_wrap=True)


# --- the commands -----------------------------------------------------------------------------
@bundled
def pin_command(
    *, chunks: ChunkOptions, tier: TierOpt = None, targets: Targets, fanout: Fanout = Fanout()
) -> None:
    """Pin chunks so they are never evicted (moved to --tier first when given).

    Examples:

      kvctl pin --node gpu-a1 --text "You are a helpful assistant." --tier cpu

      kvctl pin --dc fra --keys-file system-prompt.keys

      kvctl pin --all --yes --key 3f2a9c0d1e4b5a697887766554433221
    """
    _act(fanout, targets, "pin", chunks=chunks, tier=tier)


@bundled
def unpin_command(*, chunks: ChunkOptions, targets: Targets, fanout: Fanout = Fanout()) -> None:
    """Make pinned chunks evictable again.

    Examples:

      kvctl unpin --node gpu-a1 --text "You are a helpful assistant."

      kvctl unpin --dc fra --keys-file system-prompt.keys --json
    """
    _act(fanout, targets, "unpin", chunks=chunks)


@bundled
def evict_command(*, chunks: ChunkOptions, targets: Targets, fanout: Fanout = Fanout()) -> None:
    """Drop chunks from every tier of the nodes; pinned chunks are skipped and counted.

    Examples:

      kvctl evict --node gpu-a1 --key 3f2a9c0d1e4b5a697887766554433221

      kvctl evict --all --yes --keys-file leaked-prompt.keys
    """
    _act(fanout, targets, "evict", chunks=chunks)


@bundled
def flush_command(
    *,
    tier: Annotated[str, typer.Option("--tier", "-t", help="Tier to empty of unpinned chunks.")],
    demote: Annotated[
        bool,
        typer.Option(
            help="Demote to the next tier down instead of dropping; refused for the bottom "
            "tier (disk, or cpu where disk is off), which is then left as it is."
        ),
    ] = False,
    targets: Targets,
    fanout: Fanout = Fanout(timeout=30.0),
) -> None:
    """Empty a tier of its unpinned chunks (dropped, or demoted with --demote).

    Examples:

      kvctl flush --tier cpu --node gpu-a1 --demote

      kvctl flush --tier disk --dc fra --json

      kvctl flush --tier cpu --all --yes
    """
    _act(fanout, targets, "flush", tier=tier, demote=demote)


@bundled
def prefetch_command(
    *,
    to: Annotated[
        str | None, typer.Option("--to", help="Tier to bring the chunks up to (default: top).")
    ] = None,
    chunks: ChunkOptions,
    targets: Targets,
    fanout: Fanout = Fanout(timeout=30.0),
) -> None:
    """Bring chunks up to a faster tier ahead of the requests that will need them.

    Examples:

      kvctl prefetch --to cpu --node gpu-a1 --text "You are a helpful assistant."

      kvctl prefetch --dc fra --keys-file tomorrow-9am.keys
    """
    _act(fanout, targets, "prefetch", chunks=chunks, tier=to)


@bundled
def move_command(
    *,
    to: Annotated[str, typer.Option("--to", help="Destination tier, up or down.")],
    chunks: ChunkOptions,
    targets: Targets,
    fanout: Fanout = Fanout(timeout=30.0),
) -> None:
    """Move chunks to a tier, up or down, making room there by the eviction policy.

    Examples:

      kvctl move --to disk --node gpu-a1 --keys-file cold.keys

      kvctl move --to cpu --dc fra --text "You are a helpful assistant." --json
    """
    _act(fanout, targets, "move", chunks=chunks, tier=to)


@bundled
def resize_command(
    *,
    tier: Annotated[str, typer.Option("--tier", "-t", help="Tier to resize.")],
    size: Annotated[str, typer.Option("--size", help="New capacity: 4096, 512MiB, 64GiB...")],
    targets: Targets,
    fanout: Fanout = Fanout(timeout=60.0),
) -> None:
    """Change a tier's capacity live; shrinking demotes (or drops) chunks to fit.

    Refused on a node (the others go on) when its pinned chunks exceed the new size.

    Examples:

      kvctl resize --tier cpu --size 64GiB --node gpu-a1

      kvctl resize --tier disk --size 2TiB --dc fra --json
    """
    _act(
        fanout,
        targets,
        "resize",
        hint="sizes look like 4096, 512MiB or 64GiB",
        tier=tier,
        size=size,
    )


COMMANDS = {
    "pin": (pin_command, "Pin chunks so they are never evicted."),
    "unpin": (unpin_command, "Make pinned chunks evictable again."),
    "evict": (evict_command, "Drop chunks (pinned ones are skipped)."),
    "flush": (flush_command, "Empty a tier of unpinned chunks."),
    "prefetch": (prefetch_command, "Bring chunks up to a faster tier."),
    "move": (move_command, "Move chunks to a tier, up or down."),
    "resize": (resize_command, "Change a tier's capacity live."),
}
