"""Shared output helpers: JSON for scripts, rich tables for people, errors with hints."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from kvctl.format import finite

if TYPE_CHECKING:
    from rich.progress import TaskID

T = TypeVar("T")

#: the width of tables written to a pipe or a file, where nobody resizes a window: wide enough
#: that a row stays on one line for grep and awk (rich would wrap it at 80 columns)
PIPED_WIDTH = 240


def _piped_width() -> int | None:
    """PIPED_WIDTH where standard output is not a terminal and COLUMNS does not say otherwise
    (closed, ``>&-``: Python's ``sys.stdout`` is None, and output goes nowhere)."""
    if os.environ.get("COLUMNS") or (sys.stdout is not None and sys.stdout.isatty()):
        return None
    return PIPED_WIDTH


console = Console(width=_piped_width())
err_console = Console(stderr=True)


def json_text(data: Any, *, indent: int | None = 2) -> str:
    """``data`` as indented JSON (``indent=None``: on one line) that any parser reads: a float
    that is not finite (NaN or Infinity from a broken agent, passed on by a command) becomes
    null, where Python's json would write bare NaN, which jq and every non-Python parser
    refuse."""
    try:
        return json.dumps(data, indent=indent, default=str, allow_nan=False) + "\n"
    except ValueError:  # rare: only then walk the data
        return json.dumps(finite(data), indent=indent, default=str, allow_nan=False) + "\n"


def print_json(data: Any, *, line: bool = False) -> None:
    """Plain JSON on stdout (no colour codes, stable key order) so scripts can parse it;
    nowhere where it is closed (``>&-``), as rich's console does with its output. ``line``:
    one line, written out at once (JSON lines from a long-running command: a pipe's buffer
    held a loop's reports until 8 KiB of them had piled up)."""
    if sys.stdout is not None:
        sys.stdout.write(json_text(data, indent=None if line else 2))
        if line:
            sys.stdout.flush()


def fail(message: str, *, hint: str | None = None, code: int = 2) -> NoReturn:
    from rich.markup import escape

    # escaped: messages quote user input and TOML such as "[agent]", which is not markup;
    # soft_wrap: the paths and commands in them are copied, so never broken across lines
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    if hint:
        err_console.print(f"[dim]hint:[/] {escape(hint)}", highlight=False, soft_wrap=True)
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
    from kvctl.errors import KvctlError
    from kvctl.extras import MissingExtra

    try:
        yield
    except MissingExtra as exc:  # the line names what to install; a usage hint would mislead
        from kvctl.cli.extras import exit_missing

        exit_missing(exc)
    except (KvctlError, ValueError) as exc:
        fail(str(exc), hint=hint)
    except FileNotFoundError as exc:
        fail(f"no such file: {exc.filename}", hint=hint)
    except PermissionError as exc:
        fail(f"permission denied: {exc.filename}", hint=hint)


@contextmanager
def said_on_interrupt(message: str) -> Iterator[None]:
    """Ctrl-C in the block prints ``message`` on stderr at once, then interrupts as usual: a
    command that must wait for calls already sent (up to their timeout) says so, instead of
    looking hung."""
    from kvctl.interrupts import on_sigint

    def interrupted(signum: int, frame: object) -> None:
        err_console.print(f"[yellow]interrupted:[/] {message}", highlight=False, soft_wrap=True)
        raise KeyboardInterrupt

    with on_sigint(interrupted):
        yield


@contextmanager
def shown_while(text: str, *, disable: bool = False) -> Iterator[None]:
    """A transient spinner on stderr saying ``text`` while the block runs; silent when not a
    terminal or ``disable``."""
    if disable or not err_console.is_terminal:
        yield
        return
    with err_console.status(f"{text}…"):
        yield


class TaskProgress:
    """A transient progress bar on stderr, one task per run (a policy, a capacity), counting
    requests; silent when not a terminal. Entering gives ``update(name, done, total)``."""

    def __init__(self, *, disable: bool, prefix: str = "") -> None:
        self._prefix = prefix
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed:,}/{task.total:,} requests"),
            TimeElapsedColumn(),
            console=err_console,
            transient=True,
            disable=disable or not err_console.is_terminal,
        )
        self._tasks: dict[str, TaskID] = {}  # by name: the bar of a run not yet finished
        self._finished: list[TaskID] = []  # oldest first

    def __enter__(self):  # type: ignore[no-untyped-def]
        self._bar.__enter__()
        return self.update

    def __exit__(self, *exc: object) -> None:
        self._bar.__exit__(None, None, None)

    def update(self, name: str, done: int, total: int) -> None:
        if name not in self._tasks:  # a new run (a name seen before: that run again)
            # bars past the terminal's height are cropped to a "..." line, the running one
            # with them (a seed of `simulate --seeds 100` seemed stuck): the oldest finished
            # bars make room
            rows = max(1, self._bar.console.size.height - 1)
            while self._finished and len(self._bar.tasks) >= rows:
                self._bar.remove_task(self._finished.pop(0))
            self._tasks[name] = self._bar.add_task(f"{self._prefix}{name}", total=total)
        task = self._tasks[name]
        self._bar.update(task, completed=done)
        if done >= total:
            self._finished.append(self._tasks.pop(name))
