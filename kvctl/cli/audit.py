"""`kvctl audit`: what operators' kvctl did, newest first."""

from __future__ import annotations

from typing import Annotated

import typer

from kvctl.cli.options import DbOpt, JsonOpt, db_errors, open_engine
from kvctl.cli.output import console, print_json


def audit_command(
    limit: Annotated[int, typer.Option("--limit", help="Rows to show.", min=1)] = 50,
    action: Annotated[
        str | None,
        typer.Option("--action", help="Only this action (pin, resize...); 'fleet.' for a prefix."),
    ] = None,
    target: Annotated[
        str | None, typer.Option("--target", help="Only this target (a node name...).")
    ] = None,
    failed: Annotated[bool, typer.Option("--failed", help="Only actions that failed.")] = False,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show the audit trail: who did what, when, on which target, and how it ended.

    Every control action (pin, unpin, evict, flush, prefetch, move, resize) writes one row per
    node, and every inventory change (`kvctl fleet ...`) one row. Tokens are never recorded.

    Examples:

      kvctl audit

      kvctl audit --action resize --failed

      kvctl audit --action fleet. --limit 200 --json
    """
    import datetime as dt

    from kvctl.fleet.audit import recent

    engine = open_engine(db)
    with db_errors(), engine.connect() as conn:
        # --failed filters after the query: ask for more so --limit still fills
        rows = recent(conn, limit=limit * 20 if failed else limit, action=action, target=target)
    engine.dispose()
    if failed:
        rows = [r for r in rows if not r.ok][:limit]
    if json_out:
        print_json([r.as_dict() for r in rows])
        return
    from rich.table import Table

    table = Table(title="audit trail, newest first", title_justify="left")
    for col in ("when (UTC)", "actor", "action", "target", "ok", "args", "result"):
        table.add_column(col, overflow="fold")
    for r in rows:
        when = dt.datetime.fromtimestamp(r.ts_ms / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        args = " ".join(f"{k}={v}" for k, v in r.args.items())
        ok = "[green]yes[/]" if r.ok else "[red]no[/]"
        table.add_row(when, r.actor, r.action, r.target, ok, args, r.result[:120])
    console.print(table)
    if not rows:
        console.print("[dim]nothing recorded yet[/]")
