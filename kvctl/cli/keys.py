"""`kvctl keys`: chunk keys of a token sequence, as an engine or agent would compute them."""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from typing import Annotated

import typer

from kvctl.agent.settings import DEFAULT_MODELS
from kvctl.cli.options import MAX_CHUNK_TOKENS, prompt_tokens
from kvctl.cli.output import console, fail, print_json, user_errors
from kvctl.store.keys import DEFAULT_CHUNK_TOKENS

# an agent started without [[agent.models]] computes its keys for this model: the defaults here
# match it, so `kvctl keys` and `kvctl lookup` agree on such a node
_AGENT_MODEL = DEFAULT_MODELS[0]

# the bounds of a real model's KV layout, generous: the largest models have ~130 layers, 128 KV
# heads and head dimensions up to 576 (MLA); a value past them is a typo, not a model, and its
# table claimed absurd KV sizes (e.g. 10**20 layers: 8e23 bytes a chunk) without a word
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
#: K and V of one token over all layers; GPT-3-size models with full multi-head attention
#: keep ~4.5 MiB (bfloat16), so 64 MiB is no model's
MAX_KV_BYTES_PER_TOKEN = 64 * 2**20


def _within(most: int, what: str = "no model's KV layout") -> Callable[[int], int]:
    """An option's check: 1 to ``most``, else a usage error (exit 2) naming the option and
    the range (typer's own min/max name only the bound that was crossed)."""

    def check(value: int) -> int:
        if not 1 <= value <= most:
            raise typer.BadParameter(f"{value} is outside 1 to {most:,}: {what}")
        return value

    return check


def keys_command(
    text: Annotated[str | None, typer.Option(help="Text to tokenize with --tokenizer.")] = None,
    tokens: Annotated[
        pathlib.Path | None, typer.Option(help="File of token ids (whitespace or commas).")
    ] = None,
    tokenizer: Annotated[str, typer.Option(help="simple (words) or bytes (UTF-8).")] = "simple",
    model: Annotated[
        str, typer.Option(help="Model id folded into the key root (an agent's default model).")
    ] = _AGENT_MODEL.id,
    layers: Annotated[
        int,
        typer.Option(
            help=f"KV layout: layers (1 to {MAX_LAYERS:,}).", callback=_within(MAX_LAYERS)
        ),
    ] = _AGENT_MODEL.layers,
    kv_heads: Annotated[
        int,
        typer.Option(
            help=f"KV layout: KV heads (1 to {MAX_KV_HEADS:,}).", callback=_within(MAX_KV_HEADS)
        ),
    ] = _AGENT_MODEL.kv_heads,
    head_dim: Annotated[
        int,
        typer.Option(
            help=f"KV layout: head dimension (1 to {MAX_HEAD_DIM:,}).",
            callback=_within(MAX_HEAD_DIM),
        ),
    ] = _AGENT_MODEL.head_dim,
    dtype: Annotated[str, typer.Option(help="KV layout: dtype.")] = _AGENT_MODEL.dtype,
    salt: Annotated[
        str, typer.Option(help="Tenant cache salt: the tenant, for an agent's isolated tenants.")
    ] = "",
    chunk_tokens: Annotated[
        int,
        typer.Option(
            help=f"Tokens per chunk (1 to {MAX_CHUNK_TOKENS:,}).",
            callback=_within(MAX_CHUNK_TOKENS, "no engine's KV block size"),
        ),
    ] = DEFAULT_CHUNK_TOKENS,
    partial: Annotated[bool, typer.Option(help="Also key a partial last chunk.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Show the prefix-chained chunk keys of a token sequence, computed here (no agent asked).

    Each key is a 128-bit digest of its parent key and its chunk's tokens; the root folds in the
    model id, the KV layout and the tenant salt, so keys only match for the same whole prefix.

    The defaults are an agent's own defaults (its default model, layout and chunk size), so
    the keys equal those `kvctl lookup --node NODE` shows for a node that keeps them. For a
    node configured with another model, give its --model, layout and --chunk-tokens, or ask
    the node itself: `kvctl lookup --node NODE --text ...` lists the keys it computes.

    Examples:

      kvctl keys --text "You are a helpful assistant." --chunk-tokens 4

      kvctl keys --tokens prompt.txt --model meta-llama/Llama-3.1-8B --json
    """
    from kvctl.store.keys import KVLayout, Namespace, keys_for

    with user_errors(hint="see `kvctl keys --help`"):
        if (text is None) == (tokens is None):
            fail("give exactly one of --text and --tokens")
        if not model.strip():
            fail("--model must not be empty: the model id its keys are computed for")
        ids = prompt_tokens(text, tokens, tokenizer) or []
        layout = KVLayout(layers, kv_heads, head_dim, dtype)
        if layout.bytes_per_token > MAX_KV_BYTES_PER_TOKEN:
            fail(
                f"--layers {layers} x --kv-heads {kv_heads} x --head-dim {head_dim} x 2 (K and V)"
                f" x {layout.dtype_bytes} bytes ({dtype}) = {layout.bytes_per_token:,} KV bytes"
                f" per token: past {MAX_KV_BYTES_PER_TOKEN:,} (64 MiB), more than any model"
                " keeps; check the layout options against the model's config"
            )
        ns = Namespace(model, layout, salt)
        keys = keys_for(ids, ns, chunk_tokens, include_partial=partial)
        bytes_per_chunk = ns.layout.bytes_per_token * chunk_tokens
    rows = [
        {
            "index": i,
            "key": k.hex(),
            "first_token": i * chunk_tokens,
            "tokens": min(chunk_tokens, len(ids) - i * chunk_tokens),
        }
        for i, k in enumerate(keys)
    ]
    if json_out:
        print_json(
            {
                "tokens": len(ids),
                "chunk_tokens": chunk_tokens,
                "kv_bytes_per_token": ns.layout.bytes_per_token,
                "namespace_root": ns.root.hex(),
                "chunks": rows,
            }
        )
        return
    from rich.table import Table

    table = Table(
        title=f"{len(ids):,} tokens -> {len(keys)} chunk(s) of {chunk_tokens} tokens "
        f"({bytes_per_chunk:,} KV bytes per full chunk)",
        title_justify="left",
    )
    for col in ("#", "key", "first token", "tokens"):
        table.add_column(col, justify="right" if col != "key" else "left")
    for r in rows:
        table.add_row(str(r["index"]), str(r["key"]), str(r["first_token"]), str(r["tokens"]))
    console.print(table)
    if not keys:
        console.print(f"[yellow]fewer than {chunk_tokens} tokens: no full chunk to key[/]")
