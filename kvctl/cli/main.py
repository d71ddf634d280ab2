"""The `kvctl` entry point. Command modules import heavy code inside the command, so `--help`
and `--version` stay fast."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable
from typing import Annotated, Any, NoReturn

import typer

from kvctl import __version__
from kvctl.cli.agent import agent_app
from kvctl.cli.audit import audit_command
from kvctl.cli.bench import bench_app
from kvctl.cli.collect import collect_command
from kvctl.cli.control import COMMANDS as CONTROL_COMMANDS
from kvctl.cli.dashboard import dashboard_command
from kvctl.cli.db import db_app
from kvctl.cli.demo import demo_command
from kvctl.cli.doctor import doctor_command
from kvctl.cli.fleet import fleet_app
from kvctl.cli.keys import keys_command
from kvctl.cli.lookup import lookup_command
from kvctl.cli.plan import plan_command
from kvctl.cli.replay import replay_command
from kvctl.cli.router import route_command, router_app
from kvctl.cli.simulate import simulate_command
from kvctl.cli.status import status_command
from kvctl.cli.top import top_command

app = typer.Typer(
    name="kvctl",
    help="Operate fleets of LLM inference nodes that share tiered KV caches.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def prose_help(doc: str) -> str:
    """A docstring as help text: each prose paragraph on one line, so the terminal wraps it
    instead of the source's line breaks; indented paragraphs (the examples) keep their lines."""
    paragraphs = re.split(r"\n[ \t]*\n", inspect.cleandoc(doc))
    return "\n\n".join(
        p if p[:1].isspace() else " ".join(line.strip() for line in p.splitlines())
        for p in paragraphs
        if p.strip()
    )


def _prose_help_everywhere(typer_app: typer.Typer) -> None:
    """Every command's docstring through :func:`prose_help`, subcommands' too."""
    for info in typer_app.registered_commands:
        doc = info.help or (info.callback.__doc__ if info.callback else None)
        if doc:
            info.help = prose_help(doc)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _prose_help_everywhere(group.typer_instance)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """Operate fleets of LLM inference nodes that share tiered KV caches."""


# `kvctl --help` groups commands by what the operator is doing
FLEET, CONTROL, METRICS, NODE = "Fleet", "Control", "Metrics", "This node"
WORKLOADS, OFFLINE = "Workloads", "Offline"

app.add_typer(
    fleet_app,
    name="fleet",
    help="The fleet inventory: DCs, nodes, links; import and export.",
    rich_help_panel=FLEET,
)
# (name, command, short help, help panel); typed, as the commands' signatures differ
_COMMANDS: list[tuple[str, Callable[..., Any], str, str]] = [
    ("status", status_command, "Every node: up/down, hit ratio, occupancy; totals per DC.", FLEET),
    ("top", top_command, "Live view: sort, filter, drill into a node, act from it.", FLEET),
    ("lookup", lookup_command, "Which chunks of a prompt are cached, where.", FLEET),
    ("doctor", doctor_command, "Check the database, agents, NVML, disks and clocks.", FLEET),
    ("audit", audit_command, "What operators' kvctl did: who, when, what, result.", FLEET),
    ("route", route_command, "Which node should serve a prompt, and why (modeled).", FLEET),
    *((name, fn, short, CONTROL) for name, (fn, short) in CONTROL_COMMANDS.items()),
    ("collect", collect_command, "Record the fleet's metrics in the database.", METRICS),
    (
        "dashboard",
        dashboard_command,
        "Serve the managers' dashboard: efficiency across DCs, links, capacity.",
        METRICS,
    ),
    (
        "demo",
        demo_command,
        "The main job: a fleet of agents in two DCs serving a replayed workload.",
        WORKLOADS,
    ),
    ("replay", replay_command, "Drive the agents with a workload or trace, for real.", WORKLOADS),
    (
        "plan",
        plan_command,
        "What-if: tier sizes and pool distance vs hit ratio and TTFT.",
        WORKLOADS,
    ),
    (
        "simulate",
        simulate_command,
        "Replay a trace offline and compare eviction policies.",
        OFFLINE,
    ),
    ("keys", keys_command, "Show the chunk keys of a token sequence or a text.", OFFLINE),
]
for _name, _fn, _help, _panel in _COMMANDS:
    app.command(_name, short_help=_help, rich_help_panel=_panel)(_fn)
app.add_typer(
    db_app, name="db", help="Schema and upkeep of the metrics database.", rich_help_panel=METRICS
)
app.add_typer(
    agent_app,
    name="agent",
    help="Run and inspect the tiered KV-cache agent on this node.",
    rich_help_panel=NODE,
)
app.add_typer(
    router_app,
    name="router",
    help="The fleet's KV index and cache/link-aware routing: serve it, inspect it.",
    rich_help_panel=FLEET,
)
app.add_typer(bench_app, name="bench", help="Benchmarks that print JSON.", rich_help_panel=OFFLINE)
_prose_help_everywhere(app)


#: set (to anything) to see the traceback of a failure kvctl did not foresee
DEBUG_ENV = "KVCTL_DEBUG"


def main() -> None:
    from kvctl.cli.extras import extra_errors

    # commands check their extra first; this catches an import any of them left unchecked
    try:
        with extra_errors("this kvctl command"):
            app()
    except typer.Exit as exc:  # raised outside click's own handling of it
        raise SystemExit(exc.exit_code) from None
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        _unforeseen(exc)


def _unforeseen(exc: Exception) -> NoReturn:
    """A failure no command turned into its own message (a bug): one line and exit 1, not a
    screenful of traceback in an operator's terminal or a script's log; KVCTL_DEBUG shows it.
    A permission denied is said as such, with the user to run as, not as a bug."""
    from rich.markup import escape

    from kvctl.cli.output import err_console

    if isinstance(exc, PermissionError):
        # not a bug: a file or process of another user (an agent's 0700 data dir, its pid),
        # which a hint to report a bug would send the operator after
        where = f": {exc.filename}" if exc.filename else f" ({exc.strerror or exc})"
        err_console.print(
            f"[bold red]error:[/] permission denied{escape(str(where))}\n"
            "[dim]hint:[/] it belongs to another user: run kvctl as that user, or as root",
            highlight=False,
            soft_wrap=True,
        )
        raise SystemExit(1)
    what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    err_console.print(
        f"[bold red]error:[/] kvctl failed where it did not expect to: {escape(what)}\n"
        f"[dim]hint:[/] a bug in kvctl: `{DEBUG_ENV}=1 kvctl ...` shows the traceback to report",
        highlight=False,
        soft_wrap=True,
    )
    raise SystemExit(1)
