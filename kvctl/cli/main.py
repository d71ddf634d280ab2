"""The `kvctl` entry point. Command modules import heavy code inside the command, so `--help`
and `--version` stay fast, and `kvctl NAME ...` builds only the command or group NAME
(``build_app``)."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from typing import Annotated, Any, NoReturn

import typer

from kvctl import __version__


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


def _finite_numbers_only(command: Any) -> None:
    """Every option and argument of ``command`` (and of its subcommands) refuses a number that
    is not finite: a float option took inf and nan as any number (``--timeout inf`` waited for
    ever; nan passed every comparison but ``min``), which no option means."""
    import math

    for sub in getattr(command, "commands", {}).values():
        _finite_numbers_only(sub)
    for param in command.params:
        if getattr(param, "_finite_only", False):
            continue
        then = param.callback

        def finite(ctx: Any, param: Any, value: Any, then: Any = then) -> Any:
            for item in value if isinstance(value, list | tuple) else (value,):
                if isinstance(item, float) and not math.isfinite(item):
                    raise typer.BadParameter(f"must be a finite number, got {item}")
            return then(ctx, param, value) if then is not None else value

        param.callback = finite
        param._finite_only = True
        if hasattr(param, "process_value"):
            param.process_value = _finite_before_bounds(param, param.process_value)


def _finite_before_bounds(param: Any, process: Any) -> Any:
    """``process`` (a parameter's coercion, its bounds' check, then its callback), saying a
    number that is not finite as such where the bounds' check refused it first: ``--timeout
    inf`` read 'should be less than or equal to 3600', nan too, as if it were a large number."""
    import math

    def process_value(ctx: Any, value: Any) -> Any:
        try:
            return process(ctx, value)
        except typer.BadParameter:
            for item in value if isinstance(value, list | tuple) else (value,):
                try:
                    number = float(item) if isinstance(item, str) else None
                except ValueError:
                    continue
                if number is not None and not math.isfinite(number):
                    raise typer.BadParameter(
                        f"must be a finite number, got {number}", ctx=ctx, param=param
                    ) from None
            raise

    return process_value


class _Root(typer.core.TyperGroup):
    """The root command: as typer builds it, with :func:`_finite_numbers_only` applied."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _finite_numbers_only(self)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kvctl {__version__}")
        raise typer.Exit()


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

#: every top-level command and group, in `kvctl --help`'s order: (name, "module:attribute",
#: help, panel, is a group). Imported only when used: each kvctl process (every agent, router
#: and collector an operator or a test starts) imports and builds the one it runs, not the other
#: command modules and typer's whole command tree (about 0.3-0.5 s of CPU a process on a 2-core
#: VM). ``CONTROL`` stands for kvctl.cli.control's commands, in its order.
_ENTRIES: list[tuple[str, str, str, str, bool]] = [
    ("fleet", "fleet:fleet_app", "The fleet inventory: DCs, nodes, links; import and export.",
     FLEET, True),
    ("status", "status:status_command",
     "Every node: up/down, hit ratio, occupancy; totals per DC.", FLEET, False),
    ("top", "top:top_command", "Live view: sort, filter, drill into a node, act from it.", FLEET,
     False),
    ("lookup", "lookup:lookup_command", "Which chunks of a prompt are cached, where.", FLEET,
     False),
    ("doctor", "doctor:doctor_command", "Check the database, agents, NVML, disks and clocks.",
     FLEET, False),
    ("audit", "audit:audit_command", "What operators' kvctl did: who, when, what, result.", FLEET,
     False),
    ("route", "router:route_command", "Which node should serve a prompt, and why (modeled).",
     FLEET, False),
    (CONTROL, "", "", CONTROL, False),
    ("collect", "collect:collect_command", "Record the fleet's metrics in the database.",
     METRICS, False),
    ("dashboard", "dashboard:dashboard_command",
     "Serve the managers' dashboard: efficiency across DCs, links, capacity.", METRICS, False),
    ("demo", "demo:demo_command",
     "The main job: a fleet of agents in two DCs serving a replayed workload.", WORKLOADS, False),
    ("replay", "replay:replay_command", "Drive the agents with a workload or trace, for real.",
     WORKLOADS, False),
    ("plan", "plan:plan_command", "What-if: tier sizes and pool distance vs hit ratio and TTFT.",
     WORKLOADS, False),
    ("simulate", "simulate:simulate_command",
     "Replay a trace offline and compare eviction policies.", OFFLINE, False),
    ("keys", "keys:keys_command", "Show the chunk keys of a token sequence or a text.", OFFLINE,
     False),
    ("db", "db:db_app", "Schema and upkeep of the metrics database.", METRICS, True),
    ("agent", "agent:agent_app", "Run and inspect the tiered KV-cache agent on this node.", NODE,
     True),
    ("router", "router:router_app",
     "The fleet's KV index and cache/link-aware routing: serve it, inspect it.", FLEET, True),
    ("bench", "bench:bench_app", "Benchmarks that print JSON.", OFFLINE, True),
]  # fmt: skip


#: the examples each group's --help ends with (its commands' own --help give more); typer
#: joins an epilog's lines, so each is a paragraph of its own
_GROUP_EXAMPLES: dict[str, tuple[str, ...]] = {
    "": ("kvctl demo", "kvctl doctor", "kvctl status --dc fra"),
    "fleet": (
        "kvctl fleet ls",
        "kvctl fleet import fleet.toml",
        "kvctl fleet export -o fleet.toml",
    ),
    "agent": ("kvctl agent start --detach", "kvctl agent status", "kvctl agent logs --follow"),
    "router": ("kvctl router serve", "kvctl router status --json"),
    "db": ("kvctl db current", "kvctl db upgrade"),
    "bench": ("kvctl bench store --json", "kvctl bench agent"),
}


def _examples(group: str) -> str:
    return "\n\n".join(("Examples:", *_GROUP_EXAMPLES[group]))


def _load(target: str) -> Any:
    module, attribute = target.split(":")
    return getattr(importlib.import_module(f"kvctl.cli.{module}"), attribute)


def build_app(only: str | None = None) -> typer.Typer:
    """The `kvctl` command: every command, or only the one named ``only`` (a top-level command
    or group; None or an unknown name: all), which answers exactly as in the whole CLI."""
    control: dict[str, tuple[Any, str]] = {}  # imported only when one of them may be built
    if only not in {entry[0] for entry in _ENTRIES if entry[0] != CONTROL}:
        from kvctl.cli.control import COMMANDS as control

        if only not in control:
            only = None
    root = typer.Typer(
        name="kvctl",
        help="Operate fleets of LLM inference nodes that share tiered KV caches.",
        epilog=_examples(""),
        no_args_is_help=True,
        cls=_Root,
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    root.callback()(_root)
    for name, target, short, panel, group in _ENTRIES:
        if name == CONTROL:
            for cname, (fn, cshort) in control.items():
                if only in (None, cname):
                    root.command(cname, short_help=cshort, rich_help_panel=CONTROL)(fn)
        elif only in (None, name):
            if group:
                root.add_typer(
                    _load(target),
                    name=name,
                    help=short,
                    epilog=_examples(name),
                    rich_help_panel=panel,
                )
            else:
                root.command(name, short_help=short, rich_help_panel=panel)(_load(target))
    _prose_help_everywhere(root)
    return root


_whole: typer.Typer | None = None


def __getattr__(name: str) -> Any:
    """``app``: the whole CLI (as tests and ``typer.testing.CliRunner`` use it), built once."""
    global _whole
    if name == "app":
        if _whole is None:
            _whole = build_app()
        return _whole
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: set (to anything) to see the traceback of a failure kvctl did not foresee
DEBUG_ENV = "KVCTL_DEBUG"


def main() -> None:
    from kvctl.cli.extras import extra_errors

    # commands check their extra first; this catches an import any of them left unchecked
    try:
        with extra_errors("this kvctl command"):
            # the whole CLI once something has used (and may have extended) ``app``
            cli = _whole or build_app(sys.argv[1] if len(sys.argv) > 1 else None)
            cli()
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
