"""Shared output helpers: JSON for scripts, rich tables for people, errors with hints."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console

T = TypeVar("T")

console = Console()
err_console = Console(stderr=True)


def print_json(data: Any) -> None:
    """Plain JSON on stdout (no colour codes, stable key order) so scripts can parse it."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def fail(message: str, *, hint: str | None = None, code: int = 2) -> NoReturn:
    from rich.markup import escape

    # escaped: messages quote user input and TOML such as "[agent]", which is not markup
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    if hint:
        err_console.print(f"[dim]hint:[/] {escape(hint)}", highlight=False)
    raise typer.Exit(code)


def confirm(question: str) -> bool:
    """Ask on stderr (so --json output stays parseable); no answer (stdin closed) is a no."""
    try:
        return typer.confirm(question, default=False, err=True)
    except typer.Abort:
        return False


@contextmanager
def user_errors(hint: str | None = None) -> Iterator[None]:
    """Turn the library's errors into one clear line and exit code 2, never a traceback."""
    from kvctl.store.errors import StoreError

    try:
        yield
    except (StoreError, ValueError) as exc:
        fail(str(exc), hint=hint)
    except FileNotFoundError as exc:
        fail(f"no such file: {exc.filename}", hint=hint)
    except PermissionError as exc:
        fail(f"permission denied: {exc.filename}", hint=hint)


def pct(ratio: float) -> str:
    return f"{ratio * 100:.1f}%"
