"""Options and database access shared by command modules, so each flag reads the same everywhere."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from kvctl.cli.output import fail

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
YesOpt = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]
DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        help="Database URL (default: $KVCTL_DB_URL, else a SQLite file in ~/.local/state/kvctl).",
        show_default=False,
    ),
]
DB_HINT = "set KVCTL_DB_URL or --db; `kvctl db current` shows which database is used"


@contextmanager
def db_errors() -> Iterator[None]:
    """The database's failures as one line with a hint, never a traceback."""
    from sqlalchemy.exc import SQLAlchemyError

    from kvctl.db.engine import DatabaseError

    try:
        yield
    except DatabaseError as exc:
        fail(str(exc), hint=DB_HINT)
    except SQLAlchemyError as exc:
        fail(f"database error: {getattr(exc, 'orig', None) or exc}", hint=DB_HINT)


def open_engine(db: str | None) -> Any:
    """The CLI's way into the database: SQLite upgrades itself, PostgreSQL must be current."""
    from kvctl.db.migrate import open_db

    with db_errors():
        return open_db(db)


# --- targets: which nodes a fleet command acts on ---------------------------------------------
NodeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--node",
        "-n",
        help="A node by name (repeat for several).",
        metavar="NODE",
        show_default=False,
    ),
]
DcOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--dc", help="Every node of a DC (repeat for several).", metavar="DC", show_default=False
    ),
]
AllOpt = Annotated[bool, typer.Option("--all", help="Every node of the fleet.")]
TimeoutOpt = Annotated[
    float, typer.Option("--timeout", help="Seconds to wait for each agent.", min=0.1)
]

# --- a prompt given as text or token ids -------------------------------------------------------
TextOpt = Annotated[
    str | None, typer.Option("--text", help="Prompt text, tokenized with --tokenizer.")
]
TokensOpt = Annotated[
    Path | None,
    typer.Option("--tokens", help="File of token ids (whitespace or commas; - for stdin)."),
]
TokenizerOpt = Annotated[
    str, typer.Option("--tokenizer", help="simple (whitespace words) or bytes (UTF-8).")
]


def prompt_tokens(text: str | None, tokens: Path | None, tokenizer: str) -> list[int] | None:
    """Token ids from --text or --tokens; None when neither is given, an error when both are."""
    from kvctl.tokenize import read_token_file, tokenize

    if text is not None and tokens is not None:
        fail("give one of --text and --tokens, not both")
    if text is not None:
        return tokenize(text, tokenizer)
    if tokens is not None:
        raw = sys.stdin.read() if str(tokens) == "-" else tokens.read_text(encoding="utf-8")
        return read_token_file(raw)
    return None
