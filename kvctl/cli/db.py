"""`kvctl db ...`: the metrics database's schema and upkeep."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from kvctl.cli.options import DbOpt, JsonOpt, db_errors, db_server_hint, open_engine
from kvctl.cli.output import console, fail, print_json

#: ``db maintain``'s longest retention (about 27,000 years): any longer is "forever", and its
#: milliseconds stay far inside the database's 64-bit integers
MAX_RETENTION_DAYS = 10_000_000

db_app = typer.Typer(no_args_is_help=True, help="Schema and upkeep of the metrics database.")


@db_app.command("upgrade")
def upgrade_command(
    db: DbOpt = None,
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
    json_out: JsonOpt = False,
) -> None:
    """Migrate the database schema to the latest revision (or to --revision).

    Safe to run again: it does nothing when the schema is current. PostgreSQL databases shared
    by several collectors are only migrated by this command.

    Examples:

      kvctl db upgrade

      KVCTL_DB_URL=postgresql://kvctl@db.internal/kvctl kvctl db upgrade
    """
    from kvctl.db import migrate
    from kvctl.db.engine import SchemaNotKnown, create_db_engine, display_url, resolve_url

    with db_errors():
        url = resolve_url(db)
    from alembic.util import CommandError

    with db_errors(db_server_hint(url), url=url):
        engine = create_db_engine(url)
        try:
            before = migrate.current_revision(engine)
            newer = migrate.unknown_revision(engine, before)
            if newer is not None:  # alembic: "Can't locate revision", of the database's own
                fail(newer, hint=SchemaNotKnown.hint)
            migrate.check_upgrade_target(engine, revision)
            migrate.upgrade(engine, revision)
            after = migrate.current_revision(engine)
        except CommandError as exc:  # a revision alembic does not know, said in its words
            fail(
                f"cannot upgrade to --revision {revision}: {exc}",
                hint=f"the newest revision is {migrate.head_revision()} (also: head)",
            )
        finally:
            engine.dispose()
    out = {"database": display_url(str(engine.url)), "from": before, "to": after}
    if json_out:
        print_json(out)
    elif before == after and not migrate.is_revision(after, revision):
        # alembic's upgrade to an older revision (or base) does nothing: not "already at" it
        console.print(
            f"{out['database']}: at {after or 'empty'}, already past --revision {revision}; "
            "nothing done (upgrade never downgrades)",
            soft_wrap=True,
        )
    elif before == after:
        console.print(f"{out['database']}: already at {after or 'empty'}", soft_wrap=True)
    else:
        console.print(f"{out['database']}: upgraded {before or 'empty'} -> {after}", soft_wrap=True)


@db_app.command("current")
def current_command(db: DbOpt = None, json_out: JsonOpt = False) -> None:
    """Show which database kvctl uses, its schema revision, and whether it is current.

    Exits 1 when the schema is behind (run `kvctl db upgrade`).

    Examples:

      kvctl db current

      kvctl db current --db sqlite:////var/lib/kvctl/metrics.db --json
    """
    from sqlalchemy.engine import make_url

    from kvctl.db import migrate
    from kvctl.db.engine import NoDatabase, create_db_engine, display_url, resolve_url

    missing: str | None = None  # a SQLite file not there: said, not created by looking
    with db_errors():
        url = resolve_url(db)
    # this command is the one DB_HINT points to: its own failure names the URL it tried
    with db_errors(db_server_hint(url), url=url):
        current = None
        try:
            engine = create_db_engine(url, create=False)
        except NoDatabase as exc:
            missing = str(exc)
        else:
            try:
                current = migrate.current_revision(engine)
            finally:
                engine.dispose()
    head = migrate.head_revision()
    newer = None if missing else migrate.unknown_revision(engine, current)
    out = {
        "database": display_url(url),
        "backend": make_url(url).get_backend_name(),
        "exists": missing is None,
        "current": current,
        "head": head,
        "up_to_date": current == head,
    }
    if json_out:
        print_json(out)
    else:
        state = "[green]up to date[/]" if current == head else "[yellow]behind[/]"
        if newer:
            state = "[red]newer than this kvctl[/]"
        console.print(f"database  {out['database']}")
        console.print(f"backend   {out['backend']}")
        console.print(f"revision  {current or 'empty'} (head {head}, {state})")
        if missing:
            console.print(f"[dim]{escape(missing)}[/]", soft_wrap=True)
        elif newer:
            console.print(f"[dim]{escape(newer)}[/]", soft_wrap=True)
        elif current != head and out["backend"] == "sqlite":
            console.print(
                "[dim]SQLite upgrades itself on first use, or run `kvctl db upgrade`[/]",
                soft_wrap=True,
            )
    if current != head:
        raise typer.Exit(1)


@db_app.command("maintain")
def maintain_command(
    db: DbOpt = None,
    raw_days: Annotated[float, typer.Option(help="Keep raw samples this many days.")] = 2,
    minute_days: Annotated[float, typer.Option(help="Keep 1-minute rollups this long.")] = 30,
    hour_days: Annotated[float, typer.Option(help="Keep 1-hour rollups this long.")] = 365,
    day_days: Annotated[float, typer.Option(help="Keep daily rollups this long.")] = 5 * 365,
    json_out: JsonOpt = False,
) -> None:
    """Roll up final buckets (1 minute, 1 hour, 1 UTC day) and delete what is past retention.

    `kvctl collect` does this every minute; run it by hand after a bulk import or to apply a
    new retention. Rows are never deleted before they are rolled up.

    Examples:

      kvctl db maintain

      kvctl db maintain --raw-days 1 --json
    """
    import time

    from kvctl.db.rollup import DAY_MS, Retention, maintain

    periods = (raw_days, minute_days, hour_days, day_days)
    # nan, inf or past the database's 64-bit milliseconds failed in int() or in the driver
    if not all(0 < days <= MAX_RETENTION_DAYS for days in periods):
        fail(f"retention periods must be positive numbers of days, at most {MAX_RETENTION_DAYS:,}")
    retention = Retention(
        raw_ms=int(raw_days * DAY_MS),
        minute_ms=int(minute_days * DAY_MS),
        hour_ms=int(hour_days * DAY_MS),
        day_ms=int(day_days * DAY_MS),
    )
    engine = open_engine(db)
    with db_errors():
        out = maintain(engine, int(time.time() * 1000), retention)
    engine.dispose()
    if json_out:
        print_json(out)
        return
    rolled, deleted = sum(out["rolled_up"].values()), sum(out["deleted"].values())
    console.print(f"rolled up {rolled} rows, deleted {deleted} past retention")
