"""`kvctl audit`: what operators' kvctl did, newest first."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape

from kvctl.cli.options import DbOpt, JsonOpt, db_errors, open_engine
from kvctl.cli.output import console, print_json, user_errors


def audit_command(
    # max: SQL's LIMIT is a 64-bit integer (a bigger one failed in the driver)
    limit: Annotated[int, typer.Option("--limit", help="Rows to show.", min=1, max=2**63 - 1)] = 50,
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

    from kvctl.fleet.audit import check_action, recent

    engine = open_engine(db)
    with db_errors(), engine.connect() as conn:
        if action is not None:
            with user_errors(hint="see `kvctl audit --help`"):
                check_action(conn, action)
        rows = recent(conn, limit=limit, action=action, target=target, ok=False if failed else None)
    engine.dispose()
    if json_out:
        print_json([r.as_dict() for r in rows])
        return
    from rich.table import Table

    table = Table(title="audit trail, newest first", title_justify="left")
    cells = [
        [
            dt.datetime.fromtimestamp(r.ts_ms / 1000, dt.UTC).strftime("%m-%d %H:%M:%S"),
            r.actor,
            r.action,
            r.target,
            "yes" if r.ok else "no",
            _pairs(r.args),
            _brief(r.result),
        ]
        for r in rows
    ]
    # one line per row: the facts whole, args and result cut to what width is left (ellipsis;
    # the full text is in --json)
    used = 1  # the table's left border; each column adds its padding and right border
    for i, col in enumerate(("when (UTC)", "actor", "action", "target", "ok")):
        width = max([len(col), *(len(c[i]) for c in cells)])
        table.add_column(col, no_wrap=True, width=width)
        used += width + 3
    # rich would squeeze every column to fit: args and result share exactly what is left
    left = max(console.width - used - 6, 10)
    args_width = min(max([4, *(len(c[5]) for c in cells)]), left * 2 // 5)
    table.add_column("args", no_wrap=True, overflow="ellipsis", width=args_width)
    table.add_column("result", no_wrap=True, overflow="ellipsis", width=left - args_width)
    for c in cells:
        # escaped: actors, targets, args and agents' answers are recorded text, not markup
        c = [escape(text) for text in c]
        c[4] = "[green]yes[/]" if c[4] == "yes" else "[red]no[/]"
        table.add_row(*c)
    console.print(table)
    if not rows:
        # with a filter, an empty table is no sign of an empty trail: say what matched nothing
        shown = [
            f"{flag} {value}"
            for flag, value in (("--action", action), ("--target", target))
            if value is not None
        ]
        if failed:
            shown.append("--failed")
        said = f"nothing recorded matches {' '.join(shown)}" if shown else "nothing recorded yet"
        console.print(f"[dim]{escape(said)}[/]")


def _pairs(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


def _brief(result: str) -> str:
    """A JSON result as k=v pairs (``done=2 missing=0``); text as it is."""
    import json

    from kvctl import json_text

    try:
        value = json_text.loads(result)
    except ValueError:
        return result
    if isinstance(value, dict):
        return _pairs({k: v for k, v in value.items() if not isinstance(v, (dict, list))}) or (
            json.dumps(value, separators=(",", ":"))
        )
    return result
