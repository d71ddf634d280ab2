"""`kvctl fleet ...`: the fleet inventory (DCs, nodes, links) kept in the metrics database.

Thin: the library (``kvctl.db.inventory``, ``kvctl.db.fleetfile``) checks and makes the
changes; this module turns options into calls, writes each change's audit row in the same
transaction, asks before removing nodes in bulk, and renders the outcome."""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from kvctl.cli.options import DbOpt, JsonOpt, YesOpt, db_errors, open_engine, read_option_file
from kvctl.cli.output import confirm, console, err_console, fail, print_json

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from kvctl.db.fleetfile import ImportPlan

fleet_app = typer.Typer(
    no_args_is_help=True, help="The fleet inventory: DCs, nodes, links; import and export."
)

LS_HINT = "`kvctl fleet ls` lists the DCs, nodes and links"
#: a name taken: how to change what it names (a node's agent URL after a restart on another port)
CHANGE_HINT = (
    f"{LS_HINT}; to change one, edit it in a fleet file: `kvctl fleet export -o fleet.toml`, "
    "then `kvctl fleet import fleet.toml`"
)
EMPTY_HINT = (
    "add a DC with `kvctl fleet add-dc NAME`, or load a whole fleet with `kvctl fleet import FILE`"
)


class Kind(StrEnum):
    node = "node"
    dc = "dc"
    link = "link"


class ExportFormat(StrEnum):
    toml = "toml"
    yaml = "yaml"


def _change(
    db: str | None,
    *,
    action: str,
    target: str,
    args: dict[str, Any],
    change: Callable[[Connection], Any],
    create: bool = False,
) -> Any:
    """Make one inventory change and write its audit row in one transaction. A change the
    inventory refuses rolls back, is audited as failed (who tried what matters too) and exits 2
    with the reason. Only an addition ``create``s a missing database (a removal from one that
    is not there is a mistyped --db)."""
    from kvctl.db.inventory import InventoryError
    from kvctl.fleet.audit import record

    engine = open_engine(db, create=create)
    try:
        with db_errors():
            try:
                with engine.begin() as conn:
                    result = change(conn)
                    record(conn, action=action, target=target, args=args, ok=True, result=result)
            except InventoryError as exc:
                with engine.begin() as conn:
                    record(conn, action=action, target=target, args=args, ok=False, result=str(exc))
                # unknown names and bad values say what to do already; a duplicate does not
                fail(str(exc), hint=CHANGE_HINT if "already exists" in str(exc) else None)
    finally:
        engine.dispose()
    return result


def _add(
    db: str | None,
    json_out: bool,
    kind: str,
    *,
    target: str,
    args: dict[str, Any],
    change: Callable[[Connection], Any],
    said: str,
    shown: dict[str, Any] | None = None,
) -> None:
    """Add a DC, node or link (audited as fleet.add-KIND) and say so: ``said`` for people,
    for scripts its id and ``shown`` (default: its name and ``args``)."""
    key = _change(
        db, action=f"fleet.add-{kind}", target=target, args=args, change=change, create=True
    )
    if json_out:
        print_json({"added": kind, "id": key, **(shown or {"name": target, **args})})
    else:
        console.print(f"added {said}", highlight=False)


def _cell(value: Any, unit: str = "") -> str:
    """A table cell: markup escaped (names are user text), unknown as a dim dash."""
    from rich.markup import escape

    if value is None or value == "":
        return "[dim]-[/]"
    if isinstance(value, float):
        return f"{value:g}{unit}"
    return escape(str(value))


# --- add ----------------------------------------------------------------------------------------
@fleet_app.command("add-dc")
def add_dc_command(
    name: Annotated[str, typer.Argument(help="DC name, unique in the fleet.", show_default=False)],
    region: Annotated[str, typer.Option(help="Region (free text, e.g. eu-central).")] = "",
    location: Annotated[str, typer.Option(help="Location (free text, e.g. Frankfurt).")] = "",
    carbon: Annotated[
        float | None,
        typer.Option("--carbon", metavar="G_PER_KWH", help="Grid carbon intensity, gCO2 per kWh."),
    ] = None,
    pue: Annotated[
        float | None, typer.Option(help="Power usage effectiveness (facility / IT energy), 1 to 3.")
    ] = None,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Add a data center to the inventory.

    Carbon intensity and PUE feed the energy and carbon figures; leave them out when unknown
    (those figures then show N/A rather than a guess).

    Examples:

      kvctl fleet add-dc fra-1 --region eu-central --location Frankfurt

      kvctl fleet add-dc ams-1 --region eu-west --carbon 328 --pue 1.2
    """
    from kvctl.db.inventory import add_dc

    fields: dict[str, Any] = {
        "region": region,
        "location": location,
        "carbon_g_per_kwh": carbon,
        "pue": pue,
    }
    _add(
        db,
        json_out,
        "dc",
        target=name,
        args=fields,
        change=lambda conn: add_dc(conn, name, **fields),
        said=f"DC {_cell(name)}",
    )


@fleet_app.command("add-node")
def add_node_command(
    name: Annotated[
        str, typer.Argument(help="Node name, unique in the fleet.", show_default=False)
    ],
    dc: Annotated[str, typer.Option("--dc", help="The DC the node is in.", show_default=False)],
    agent_url: Annotated[
        str,
        typer.Option(
            "--agent-url",
            help="URL of the node's kvctl agent, e.g. http://10.0.0.7:7070.",
            show_default=False,
        ),
    ],
    gpu_model: Annotated[str, typer.Option(help="GPU model (free text, e.g. H100).")] = "",
    engine_url: Annotated[
        str | None,
        typer.Option(
            help="Metrics endpoint of the node's inference engine: vLLM, SGLang, TensorRT-LLM "
            "(/prometheus/metrics, or its JSON iteration stats at /metrics), LMCache or Dynamo "
            "KVBM (its own port, default 6880)."
        ),
    ] = None,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Add a node (one kvctl agent) to a DC of the inventory.

    Examples:

      kvctl fleet add-node gpu-01 --dc fra-1 --agent-url http://10.0.0.7:7070 --gpu-model H100

      kvctl fleet add-node gpu-02 --dc fra-1 --agent-url http://10.0.0.8:7070 --engine-url http://10.0.0.8:8000/metrics
    """
    from kvctl.db.inventory import add_node

    fields: dict[str, Any] = {
        "dc": dc,
        "agent_url": agent_url,
        "gpu_model": gpu_model,
        "engine_url": engine_url,
    }
    _add(
        db,
        json_out,
        "node",
        target=name,
        args=fields,
        change=lambda conn: add_node(conn, name, **fields),
        said=f"node {_cell(name)} in DC {_cell(dc)}",
    )


@fleet_app.command("add-link")
def add_link_command(
    dc_a: Annotated[str, typer.Argument(metavar="DC_A", help="One DC.", show_default=False)],
    dc_b: Annotated[str, typer.Argument(metavar="DC_B", help="The other DC.", show_default=False)],
    distance_km: Annotated[
        float,
        typer.Option(
            "--distance-km", metavar="KM", help="Fiber distance in km.", show_default=False
        ),
    ],
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Add the link (fiber path) between two DCs; one link per pair, either way round.

    Examples:

      kvctl fleet add-link fra-1 ams-1 --distance-km 360
    """
    from kvctl.db.inventory import add_link

    a, b = sorted((dc_a, dc_b))
    _add(
        db,
        json_out,
        "link",
        target=f"{a},{b}",
        args={"a": dc_a, "b": dc_b, "distance_km": distance_km},
        change=lambda conn: add_link(conn, dc_a, dc_b, distance_km=distance_km),
        said=f"link {_cell(a)} <-> {_cell(b)} ({distance_km:g} km)",
        shown={"a": a, "b": b, "distance_km": distance_km},
    )


# --- ls -----------------------------------------------------------------------------------------
@fleet_app.command("ls")
def ls_command(
    dc: Annotated[
        str | None, typer.Option("--dc", help="Only this DC, its nodes and its links.")
    ] = None,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List the fleet: DCs (with their node counts), nodes, and links between DCs.

    Examples:

      kvctl fleet ls

      kvctl fleet ls --dc fra-1

      kvctl fleet ls --json
    """
    from kvctl.db.inventory import InventoryError, list_dcs, list_links, list_nodes

    engine = open_engine(db)
    try:
        with db_errors(), engine.connect() as conn:
            try:
                nodes = list_nodes(conn, dc=dc)
            except InventoryError as exc:
                fail(str(exc), hint=LS_HINT)
            dcs = [d for d in list_dcs(conn) if dc is None or d.name == dc]
            links = [x for x in list_links(conn) if dc is None or dc in (x.a, x.b)]
    finally:
        engine.dispose()
    if json_out:
        print_json(
            {
                "dcs": [d.as_dict() for d in dcs],
                "nodes": [n.as_dict() for n in nodes],
                "links": [x.as_dict() for x in links],
            }
        )
        return
    if not dcs:
        console.print("the fleet inventory is empty")
        err_console.print(f"[dim]hint:[/] {EMPTY_HINT}", highlight=False, soft_wrap=True)
        return
    from rich.table import Table

    table = Table(title="DCs", title_justify="left")
    for col in ("name", "region", "location", "gCO2/kWh", "PUE", "nodes"):
        table.add_column(col, justify="right" if col in ("gCO2/kWh", "PUE", "nodes") else "left")
    for d in dcs:
        table.add_row(
            _cell(d.name),
            _cell(d.region),
            _cell(d.location),
            _cell(d.carbon_g_per_kwh),
            _cell(d.pue),
            str(d.nodes),
        )
    console.print(table)
    if nodes:
        table = Table(title="nodes", title_justify="left")
        table.add_column("name")
        table.add_column("dc")
        table.add_column("agent URL", overflow="fold")
        table.add_column("GPU")
        table.add_column("engine URL", overflow="fold")
        for n in nodes:
            cells = (n.name, n.dc, n.agent_url, n.gpu_model, n.engine_url)
            table.add_row(*map(_cell, cells))
        console.print(table)
    else:
        console.print(
            "no nodes yet (`kvctl fleet add-node NAME --dc DC --agent-url URL`)", soft_wrap=True
        )
    if links:
        table = Table(title="links", title_justify="left")
        table.add_column("dc a")
        table.add_column("dc b")
        table.add_column("distance", justify="right")
        for x in links:
            table.add_row(_cell(x.a), _cell(x.b), _cell(x.distance_km, " km"))
        console.print(table)


# --- rm -----------------------------------------------------------------------------------------
@fleet_app.command("rm")
def rm_command(
    kind: Annotated[Kind, typer.Argument(help="What to remove.", show_default=False)],
    names: Annotated[
        list[str],
        typer.Argument(
            metavar="NAME...", help="The node or DC name; a link's two DCs.", show_default=False
        ),
    ],
    with_nodes: Annotated[
        bool, typer.Option("--with-nodes", help="Remove a DC's nodes with it (asks first).")
    ] = False,
    yes: YesOpt = False,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Remove a node, a DC (and its links), or the link between two DCs.

    A DC that still has nodes is kept unless --with-nodes, which asks before removing them
    (--yes does not ask). Recorded samples stay in the database as history: a removed node's
    samples still count in the totals of the windows that hold them (the dashboard, `kvctl
    status --window`), listed as removed; live views show only the inventory's nodes.

    Examples:

      kvctl fleet rm node gpu-01

      kvctl fleet rm dc fra-1 --with-nodes --yes

      kvctl fleet rm link fra-1 ams-1
    """
    from kvctl.db import inventory as inv

    want = 2 if kind is Kind.link else 1
    if len(names) != want:
        usage = "DC_A DC_B" if kind is Kind.link else "NAME"
        fail(
            f"`kvctl fleet rm {kind.value}` takes {usage}, got {len(names)} name(s)",
            hint="e.g. `kvctl fleet rm node gpu-01`, `kvctl fleet rm link fra-1 ams-1`",
        )
    if with_nodes and kind is not Kind.dc:
        fail("--with-nodes only applies to `kvctl fleet rm dc`")
    args: dict[str, Any] = {"kind": kind.value}
    if kind is Kind.dc:
        args["with_nodes"] = with_nodes
        if with_nodes and not yes:
            _confirm_dc_removal(db, names[0])

    def change(conn: Connection) -> dict[str, Any]:
        if kind is Kind.node:
            return inv.remove_node(conn, names[0]).as_dict()
        if kind is Kind.link:
            return inv.remove_link(conn, names[0], names[1]).as_dict()
        return inv.remove_dc(conn, names[0], with_nodes=with_nodes).as_dict()

    target = ",".join(sorted(names))
    removed = _change(db, action="fleet.rm", target=target, args=args, change=change)
    if json_out:
        print_json({"removed": kind.value, **removed})
        return
    if kind is Kind.dc:
        extra = [f"{len(removed['nodes'])} node(s)"] if removed["nodes"] else []
        extra += [f"{len(removed['links'])} link(s)"] if removed["links"] else []
        tail = f" with {' and '.join(extra)}" if extra else ""
        console.print(f"removed DC {_cell(names[0])}{tail}", highlight=False)
    elif kind is Kind.link:
        console.print(f"removed link {_cell(removed['a'])} <-> {_cell(removed['b'])}")
    else:
        console.print(f"removed node {_cell(names[0])}", highlight=False)


def _confirm_dc_removal(db: str | None, name: str) -> None:
    """Ask before removing a DC's nodes; a no exits 1 with nothing changed. An unknown DC is
    not asked about: the removal itself then fails with the known names."""
    from kvctl.db.inventory import InventoryError, list_nodes

    engine = open_engine(db)
    try:
        with db_errors(), engine.connect() as conn:
            try:
                nodes = [n.name for n in list_nodes(conn, dc=name)]
            except InventoryError:
                return
    finally:
        engine.dispose()
    if not nodes:
        return
    shown = ", ".join(nodes[:10]) + (f" and {len(nodes) - 10} more" if len(nodes) > 10 else "")
    if not confirm(f"Remove DC {name!r} and its {len(nodes)} node(s): {shown}?"):
        err_console.print("nothing removed")
        raise typer.Exit(1)


# --- import / export ----------------------------------------------------------------------------
@fleet_app.command("import")
def import_command(
    file: Annotated[
        Path, typer.Argument(help="Fleet file, .toml or .yaml/.yml.", show_default=False)
    ],
    prune: Annotated[
        bool,
        typer.Option("--prune", help="Also remove DCs, nodes and links the file does not name."),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would change; change nothing.")
    ] = False,
    yes: YesOpt = False,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Make the inventory match a fleet file (TOML or YAML, as `kvctl fleet export` writes).

    New DCs, nodes and links are added and changed ones updated; with --prune, what the file
    does not name is removed (asks first, unless --yes). The whole file is checked before
    anything is written: every problem is listed with its place in the file, and the import
    is all or nothing. Importing the same file again changes nothing.

    Examples:

      kvctl fleet import fleet.toml --dry-run

      kvctl fleet import fleet.yaml

      kvctl fleet import fleet.toml --prune --yes --json
    """
    from kvctl.db import fleetfile as ff
    from kvctl.db.inventory import InventoryError
    from kvctl.fleet.audit import record

    text = read_option_file(file)
    try:
        doc = ff.load(text, ff.format_for(file))
    except ff.FleetFileError as exc:
        fail(f"{file}: {exc}", hint="`kvctl fleet export` writes a file of the expected shape")

    def problems(exc: ff.FleetFileError) -> NoReturn:
        for problem in exc.problems:
            err_console.print(f"  {problem}", highlight=False, markup=False)
        fail(
            f"{file}: {len(exc.problems)} problem(s); nothing was imported",
            hint="`kvctl fleet export` writes a file of the expected shape",
        )

    engine = _dry_run_engine(db) if dry_run else open_engine(db, create=True)
    args = {"file": str(file), "prune": prune}
    try:
        with db_errors():
            with engine.connect() as conn:  # only reads: the plan, for showing and asking
                try:
                    plan = ff.import_fleet(conn, doc, prune=prune, dry_run=True)
                except ff.FleetFileError as exc:
                    problems(exc)
            if dry_run or not plan.changes:
                _show_plan(file, plan, json_out)
                return
            if plan.removals and not yes:
                if not json_out:
                    _show_plan(file, plan, json_out=False, note="")
                counts = plan.counts()
                what = ", ".join(f"{n['remove']} {k}(s)" for k, n in counts.items() if n["remove"])
                if not confirm(f"Remove {what} that {file.name} does not name?"):
                    err_console.print("nothing imported")
                    raise typer.Exit(1)
            try:
                # planned again inside the writing transaction: what is applied is what is
                # there now, even if someone changed the inventory while we asked
                with engine.begin() as conn:
                    if plan.removals and not yes:
                        # remove only what the operator was shown and agreed to
                        now = ff.import_fleet(conn, doc, prune=prune, dry_run=True)
                        if _removal_set(now) != _removal_set(plan):
                            raise InventoryError(
                                "the inventory changed while you were asked (other removals "
                                "now); run the import again to see the new plan"
                            )
                    plan = ff.import_fleet(conn, doc, prune=prune)
                    record(
                        conn,
                        action="fleet.import",
                        target=file.name,
                        args=args,
                        ok=True,
                        result=plan.counts(),
                    )
            except InventoryError as exc:
                with engine.begin() as conn:
                    record(
                        conn,
                        action="fleet.import",
                        target=file.name,
                        args=args,
                        ok=False,
                        result=str(exc),
                    )
                if isinstance(exc, ff.FleetFileError):
                    problems(exc)
                fail(f"{file}: {exc}; nothing was imported", hint=LS_HINT)
    finally:
        engine.dispose()
    _show_plan(file, plan, json_out, shown=bool(plan.removals and not yes))


def _dry_run_engine(db: str | None) -> Any:
    """The inventory a dry run compares the file with. A dry run changes nothing, so a missing
    SQLite file is not created (a mistyped --db would have left one behind): the file is
    planned against an empty inventory, said on stderr."""
    from sqlalchemy.engine import make_url

    from kvctl.db.engine import NoDatabase, resolve_url
    from kvctl.db.migrate import open_db

    with db_errors():
        try:
            return open_db(db, create=False)
        except NoDatabase:
            err_console.print(
                f"no fleet database at {make_url(resolve_url(db)).database} yet: planned against "
                "an empty inventory (the import without --dry-run creates it)",
                highlight=False,
                markup=False,
            )
            return open_db("sqlite://")


def _removal_set(plan: ImportPlan) -> set[tuple[str, str]]:
    return {(c.kind, c.name) for c in plan.removals}


def _show_plan(
    file: Path,
    plan: ImportPlan,
    json_out: bool,
    shown: bool = False,
    note: str = "dry run: nothing written",
) -> None:
    """The plan as a table and a summary line (``shown``: the table was printed already)."""
    if json_out:
        print_json({"file": str(file), **plan.as_dict()})
        return
    if not plan.changes:
        console.print(f"{_cell(str(file))}: the inventory already matches; nothing to change")
        return
    if not shown:
        from rich.markup import escape
        from rich.table import Table

        marks = {
            "add": "[green]+ add[/]",
            "update": "[yellow]~ update[/]",
            "remove": "[red]- remove[/]",
        }
        table = Table("", "kind", "name", "details", title=f"{file.name}", title_justify="left")
        for c in plan.changes:
            if c.action == "update":
                parts = [f"{k}: {old!r} -> {new!r}" for k, (old, new) in c.fields.items()]
            else:
                parts = [f"{k}={v!r}" for k, v in c.fields.items() if v not in ("", None)]
            detail = ", ".join(parts)
            table.add_row(marks[c.action], c.kind, escape(c.name), escape(detail))
        console.print(table)
    t = plan.totals()
    if plan.applied:
        summary = f"imported {file.name}: {t['add']} added, {t['update']} updated"
        summary += f", {t['remove']} removed"
        console.print(_cell(summary), highlight=False)
        return
    summary = f"{t['add']} to add, {t['update']} to update, {t['remove']} to remove"
    if not plan.prune:
        summary += " (without --prune nothing is removed)"
    console.print(f"{_cell(summary)}{f' [dim]({note})[/]' if note else ''}", highlight=False)


@fleet_app.command("export")
def export_command(
    fmt: Annotated[
        ExportFormat | None,
        typer.Option(
            "--format", "-f", help="toml or yaml (default: from --output's suffix, else toml)."
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("--output", "-o", help="Write to this file (default: stdout)."),
    ] = None,
    db: DbOpt = None,
) -> None:
    """Write the inventory as a fleet file that `kvctl fleet import` reads back.

    Examples:

      kvctl fleet export > fleet.toml

      kvctl fleet export --format yaml

      kvctl fleet export -o fleet.yaml
    """
    from kvctl.db import fleetfile as ff

    # said first, naming the option: a directory was "cannot tell the format of 'adir'" or "is
    # a directory writing adir" (with --format), and -o '' (read as '.') the same of '.'
    if output is not None and output.is_dir():
        fail(f"--output {output} is a directory: give the file to write, e.g. -o fleet.toml")
    if fmt is not None:
        chosen: str = fmt.value
    elif output is not None:
        try:
            chosen = ff.format_for(output)
        except ff.FleetFileError as exc:
            fail(str(exc), hint="or name the format with --format toml|yaml")
    else:
        chosen = "toml"
    engine = open_engine(db)
    try:
        with db_errors(), engine.connect() as conn:
            doc = ff.export_fleet(conn)
    finally:
        engine.dispose()
    text = ff.dump(doc, chosen)
    if output is None:
        sys.stdout.write(text)  # not rich: the document must come out byte for byte
        return
    from kvctl.paths import WriteFailed, write_output

    try:
        write_output(output, text)
    except WriteFailed as exc:  # names the file and says why
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write {output}: {exc.strerror}")
    counts = ", ".join(f"{len(doc[k])} {k}" for k in ("dcs", "nodes", "links"))
    err_console.print(f"wrote {counts} to {output}", highlight=False, markup=False)
