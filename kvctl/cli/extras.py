"""A command whose optional extra is not installed says so in one line and exits 2."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import typer

from kvctl.extras import MissingExtra, extra_of, require


def exit_missing(exc: MissingExtra) -> NoReturn:
    """One line on stderr (never wrapped, so scripts and people see the whole command), exit 2."""
    from rich.markup import escape

    from kvctl.cli.output import err_console

    err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def needs_extra(what: str, extra: str, *, otherwise: str | None = None) -> None:
    """Exit (one line, code 2) before doing anything when ``extra`` is not installed."""
    try:
        require(what, extra, otherwise=otherwise)
    except MissingExtra as exc:
        exit_missing(exc)


@contextmanager
def extra_errors(what: str) -> Iterator[None]:
    """Turn an import of a module some extra provides, failing inside, into the same line."""
    try:
        yield
    except MissingExtra as exc:
        exit_missing(exc)
    except ImportError as exc:
        extra = extra_of(exc)
        if extra is None:
            raise
        exit_missing(MissingExtra(what, extra))
