"""`kvctl lookup`: which chunks of a prompt (or a chain of keys) are cached, in which tier, on
which node."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from kvctl.cli.options import (
    DbOpt,
    JsonOpt,
    KeyOpt,
    KeysFileOpt,
    Targets,
    TextOpt,
    TimeoutOpt,
    TokenizerOpt,
    TokensOpt,
    bundled,
    open_engine,
    prompt_or_keys,
)
from kvctl.cli.output import console, err_console, print_json


@bundled
def lookup_command(
    *,
    key: KeyOpt = None,
    keys_file: KeysFileOpt = None,
    text: TextOpt = None,
    tokens: TokensOpt = None,
    tokenizer: TokenizerOpt = "simple",
    model: Annotated[
        str | None, typer.Option("--model", help="Model id (default: each agent's first model).")
    ] = None,
    tenant: Annotated[str, typer.Option("--tenant", help="Tenant asking.")] = "",
    targets: Targets,
    timeout: TimeoutOpt = 5.0,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show which chunks of a prompt (or a chain of keys) hit, in which tier, on which node.

    Each agent computes the prompt's chunk keys for its model; only full chunks are keyed.
    With --key/--keys-file the keys are asked as given, in order (a prefix chain: the hit is
    the longest cached prefix). Read-only: the agents' hit statistics do not count these
    lookups.

    Examples:

      kvctl lookup --node gpu-a1 --text "You are a helpful assistant. Answer briefly."

      kvctl lookup --dc fra --tokens prompt.txt --tenant acme

      kvctl lookup --all --tokens - --json < prompt-ids.txt

      kvctl lookup --dc fra --key 3f2a9c0d1e4b5a697887766554433221
    """
    from kvctl.fleet.lookup import lookup_prompt

    keys, ids = prompt_or_keys(key, keys_file, text, tokens, tokenizer)
    engine = open_engine(db)
    nodes = targets.resolve(engine)
    engine.dispose()
    try:
        found = lookup_prompt(
            nodes, ids, keys=keys or None, model=model, tenant=tenant, timeout_s=timeout
        )
    except KeyboardInterrupt:  # read-only: no agent still asked is waited for
        err_console.print("[yellow]interrupted[/]", highlight=False)
        raise typer.Exit(130) from None
    asked = {"tokens": len(ids)} if ids is not None else {"keys": len(keys)}
    if json_out:
        print_json({**asked, "nodes": [f.as_dict() for f in found]})
    else:
        from rich.table import Table

        title = f"{len(ids):,} tokens" if ids is not None else f"{len(keys):,} keys"
        summary = Table(title=title, title_justify="left")
        for col in ("node", "dc", "prefix hit", "tokens", "cached anywhere", "error"):
            summary.add_column(col, justify="right" if col in ("tokens",) else "left")
        for f in found:
            # escaped: names and errors are the inventory's and the agents' text, not markup
            summary.add_row(
                escape(f.node),
                escape(f.dc),
                f"{f.matched_chunks}/{f.total_chunks}" if f.ok else "N/A",
                f"{f.matched_tokens:,}" if f.ok else "N/A",
                str(f.cached_chunks) if f.ok else "N/A",
                f"[red]{escape(f.error)}[/]" if f.error else "",
            )
        console.print(summary)
        answered = [f for f in found if f.ok]
        longest = max((f.total_chunks for f in answered), default=0)
        if longest:
            chunks = Table(title="tier of each chunk ('-': not cached)", title_justify="left")
            chunks.add_column("#", justify="right")
            chunks.add_column("key (first node)")
            for f in answered:
                chunks.add_column(escape(f.node))
            first = answered[0]
            for i in range(longest):
                chunk_key = first.chunks[i][0] if i < len(first.chunks) else ""
                cells = [f.chunks[i][1] or "-" if i < len(f.chunks) else "" for f in answered]
                chunks.add_row(str(i), chunk_key, *cells)
            console.print(chunks)
        elif answered:
            console.print("[yellow]the prompt has no full chunk: nothing to look up[/]")
    down = [f.node for f in found if not f.ok]
    if down:
        err_console.print(
            # "failed", not "no answer": a node that refused the token answered (the error says)
            f"[red]failed on {len(down)} of {len(found)} node(s):[/] {escape(', '.join(down))}",
            highlight=False,
        )
        raise typer.Exit(1)
