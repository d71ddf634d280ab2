"""`kvctl doctor`: check the database, the agents, NVML, disk space and clocks; print fixes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from kvctl.cli.options import DbOpt, DcOpt, JsonOpt, NodeOpt, TimeoutOpt
from kvctl.cli.output import console, err_console, print_json

if TYPE_CHECKING:
    from kvctl.fleet.doctor import Check

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def doctor_command(
    db: DbOpt = None,
    node: NodeOpt = None,
    dc: DcOpt = None,
    timeout: TimeoutOpt = 3.0,
    json_out: JsonOpt = False,
) -> None:
    """Check the database, each agent, NVML, disk space and clock skew, and print fixes.

    Checks that the database answers and its schema is current; that each
    agent in the inventory (or only --node/--dc) answers, accepts
    KVCTL_TOKEN, runs this kvctl version under its inventory name, keeps its
    clock in step with this machine's, sees its GPUs, has free disk space and
    keeps its shared arena on huge pages; and NVML and the database's disk
    here. Read-only. Exits 1 when a check
    fails; warnings (e.g. no GPU on a laptop) do not. An agent still opening
    its tiers fails as starting (it serves nothing yet): run it again shortly.

    Examples:

      kvctl doctor

      kvctl doctor --dc fra --timeout 10

      kvctl doctor --db postgresql://kvctl@db.internal/kvctl --json
    """
    from kvctl.fleet.doctor import exit_code, run_checks, summarize

    try:
        checks = run_checks(db, nodes=node or (), dcs=dc or (), timeout_s=timeout)
    except KeyboardInterrupt:  # read-only: no agent still asked is waited for
        err_console.print("[yellow]interrupted[/]", highlight=False)
        raise typer.Exit(130) from None
    summary = summarize(checks)
    if json_out:
        print_json({"checks": [c.as_dict() for c in checks], "summary": summary})
    else:
        _render(checks, summary)
    raise typer.Exit(exit_code(checks))


def _render(checks: list[Check], summary: dict[str, int]) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(show_header=True, header_style="bold")
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    for c in checks:
        style = _STYLE.get(c.status, "")
        # escaped: details quote URLs, errors and TOML such as "[agent]", which is not markup
        table.add_row(escape(c.name), f"[{style}]{c.status}[/]", escape(c.detail))
    console.print(table)
    fixes = [c for c in checks if c.fix]
    if fixes:
        console.print("\n[bold]Fixes:[/]")
        for i, c in enumerate(fixes, 1):
            # soft_wrap: a command in a fix must stay copyable, not be broken across lines
            console.print(f"  {i}. {escape(c.name)}: {escape(c.fix or '')}", soft_wrap=True)
    counts = ", ".join(f"{n} {status}" for status, n in summary.items())
    verdict = "[bold red]problems found[/]" if summary["fail"] else "[green]no failures[/]"
    console.print(f"\n{counts}: {verdict}")
