"""The `kvctl` entry point. Command modules import heavy code inside the command, so `--help`
and `--version` stay fast."""

from __future__ import annotations

from typing import Annotated

import typer

from kvctl import __version__
from kvctl.cli.agent import agent_app
from kvctl.cli.bench import bench_app
from kvctl.cli.collect import collect_command
from kvctl.cli.db import db_app
from kvctl.cli.demo import demo_command
from kvctl.cli.keys import keys_command
from kvctl.cli.simulate import simulate_command

app = typer.Typer(
    name="kvctl",
    help="Operate fleets of LLM inference nodes that share tiered KV caches.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


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


app.command("demo", short_help="Run the demo: replay a workload through every policy (main job).")(
    demo_command
)
app.command("simulate", short_help="Replay a trace offline and compare eviction policies.")(
    simulate_command
)
app.command("keys", short_help="Show the chunk keys of a token sequence or a text.")(keys_command)
app.add_typer(bench_app, name="bench", help="Benchmarks that print JSON.")
app.add_typer(
    agent_app, name="agent", help="Run and inspect the tiered KV-cache agent on this node."
)
app.command("collect", short_help="Record the fleet's metrics in the database.")(collect_command)
app.add_typer(db_app, name="db", help="Schema and upkeep of the metrics database.")


def main() -> None:
    app()
