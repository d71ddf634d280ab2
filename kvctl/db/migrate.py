"""Schema migrations, run in-process with alembic (scripts in the top-level ``migrations``)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import URL, Engine

import migrations


def alembic_config(engine: Engine | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    if engine is not None:
        url = engine.url.render_as_string(hide_password=False)
        # configparser reads % as interpolation, and a URL %-escapes its password's '@', '/'...
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def revisions() -> list[str]:
    """Every revision from the first to the head, in order."""
    script = ScriptDirectory.from_config(alembic_config())
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def current_revision(engine: Engine) -> str | None:
    """The database's schema revision (None: no schema yet). A database at more than one
    revision at once (its alembic_version table holds several rows: branches this kvctl never
    makes) raises ``kvctl.db.engine.SchemaNotKnown`` saying so: alembic's CommandError reached
    every command and the dashboard as a traceback."""
    with engine.connect() as conn:
        heads = MigrationContext.configure(conn).get_current_heads()
    if len(heads) > 1:
        from kvctl.db.engine import SchemaNotKnown

        known = set(revisions())
        unknown = [h for h in heads if h not in known]
        by = "a newer kvctl" if unknown else "hand (alembic stamp) or another tool"
        several = SchemaNotKnown(
            f"the database at {_where(engine)} is at schema revisions {', '.join(heads)} at once, "
            f"which this kvctl never writes (its schema is one line of revisions up to "
            f"{head_revision()}): it was migrated by {by}; "
            + ("upgrade kvctl" if unknown else "check its alembic_version table")
        )
        if not unknown:  # no newer kvctl migrated it: the class's hint would send for one
            several.hint = (
                "leave one row in its alembic_version table, the revision its tables are at "
                "(alembic stamp), then `kvctl db upgrade`"
            )
        raise several
    return heads[0] if heads else None


def unknown_revision(engine: Engine, current: str | None) -> str | None:
    """Where the database is at a revision this kvctl does not know: what is true (a newer
    kvctl migrated it) and what to do; None for a revision it knows, or no schema."""
    if current is None or current in revisions():
        return None
    return (
        f"the database at {_where(engine)} is at schema revision {current}, which this kvctl "
        f"does not know (it knows up to {head_revision()}): it was migrated by a newer kvctl; "
        "upgrade kvctl"
    )


def is_revision(revision: str | None, target: str) -> bool:
    """Whether ``target`` (as ``upgrade`` takes it: a revision or a unique prefix of one,
    head, heads, base) names ``revision`` (None: no schema)."""
    from alembic.util import CommandError

    if target == "base":
        return revision is None
    if "+" in target or "-" in target:  # relative (+1, head-2, -1): from where the database was
        return True
    try:
        found = ScriptDirectory.from_config(alembic_config()).get_revisions(target)
    except CommandError:
        return True  # an upgrade to it failed already; nothing better to say
    return tuple(r.revision for r in found if r is not None) == ((revision,) if revision else ())


def _where(engine: Engine) -> str:
    from kvctl.db.engine import display_url, sqlite_file_path

    return sqlite_file_path(engine) or display_url(engine.url.render_as_string(hide_password=False))


#: what SQLite says of a table or column its schema lacks: a read's "no such table: x" or "no
#: such column: x", an insert's "table x has no column named y" (PostgreSQL raises a
#: ProgrammingError: undefined table or column)
MISSING_IN_SCHEMA: Final = re.compile(r"no such (table|column)|has no column named")


def schema_behind(engine: Engine, exc: BaseException) -> str | None:
    """Where ``exc`` (a failed statement) may be a table or column ``engine``'s schema lacks
    and the database's revision is not this kvctl's: what to run, naming the database and both
    revisions, as ``open_db`` refuses one behind (a backup at an older schema restored under a
    running process). None where the schema is current, the failure is of another kind, or the
    revision cannot be read (the caller says the driver's words). Never upgrades: a process
    that found its database current does not migrate one put there under it; the operator
    runs ``kvctl db upgrade``. Asked only on such failures: a database away is not asked again."""
    from alembic.util import CommandError
    from sqlalchemy.exc import ProgrammingError, SQLAlchemyError

    from kvctl.db.engine import DatabaseError, display_url, sqlite_file_path

    said = str(getattr(exc, "orig", None) or exc)
    if not (isinstance(exc, ProgrammingError) or MISSING_IN_SCHEMA.search(said)):
        return None
    try:
        current = current_revision(engine)
    except DatabaseError as not_ours:  # at several revisions at once
        return str(not_ours)
    except (SQLAlchemyError, CommandError):
        return None
    head = head_revision()
    if current == head:
        return None
    url = display_url(engine.url.render_as_string(hide_password=False))
    where = sqlite_file_path(engine) or url
    newer = unknown_revision(engine, current)
    if newer is not None:
        return newer
    return (
        f"the database at {where} is at schema revision {current or 'empty'}, this kvctl needs "
        f"{head}: run `kvctl db upgrade --db {shlex.quote(url)}`"
    )


def _run(engine: Engine, fn: str, target: str) -> None:
    migrating = _transactional(engine)
    cfg = alembic_config(engine)
    try:
        with migrating.begin() as conn:
            cfg.attributes["connection"] = conn
            getattr(command, fn)(cfg, target)
    finally:
        if migrating is not engine:
            migrating.dispose()


def _transactional(engine: Engine) -> Engine:
    """An engine whose transactions hold schema changes too. pysqlite commits each CREATE,
    ALTER or DROP on its own, so a SQLite migration that failed midway (a full disk, a kill,
    a clash) left its first steps applied under the old revision, and every later upgrade
    failed on them; SQLite rolls DDL back like anything else once the transaction is its own
    (SQLAlchemy's pysqlite recipe: the driver's transactions off, BEGIN emitted on begin).
    PostgreSQL's DDL is transactional already; an in-memory SQLite database is this engine's
    alone, so it stays as it is."""
    if engine.dialect.name != "sqlite" or engine.url.database in (None, "", ":memory:"):
        return engine
    from sqlalchemy import create_engine, event

    from kvctl.db.engine import sqlite_pragmas

    migrating = create_engine(engine.url, connect_args={"isolation_level": None})
    event.listen(migrating, "connect", sqlite_pragmas)
    event.listen(migrating, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    return migrating


def upgrade(engine: Engine, target: str = "head") -> None:
    _run(engine, "upgrade", target)


def check_upgrade_target(engine: Engine, target: str) -> None:
    """Raise alembic's CommandError for a ``target`` it cannot upgrade the database to. Alembic
    says most in its words, but asserts on some ('' or 'head+1' at the head: past the newest),
    a bug's AssertionError to the operator; resolved here, nothing run, and said as the rest."""
    from alembic.util import CommandError

    current = current_revision(engine)
    try:
        ScriptDirectory.from_config(alembic_config())._upgrade_revs(target, current or ())
    except AssertionError:
        raise CommandError(
            f"Can't resolve revision {target!r} from {current or 'an empty database'}"
        ) from None


def downgrade(engine: Engine, target: str) -> None:
    _run(engine, "downgrade", target)


def open_db(
    url: str | URL | None = None, *, auto_upgrade: bool | None = None, create: bool = True
) -> Engine:
    """An engine on a database at the current schema.

    SQLite upgrades itself (it is local and single-owner); PostgreSQL is shared by several
    collectors and the dashboard, so its schema changes only on `kvctl db upgrade` unless
    ``auto_upgrade`` says otherwise. A missing SQLite file is created (0600) only with
    ``create``: a reader pointed at a mistyped path gets :class:`NoDatabase` instead.
    """
    from sqlalchemy.exc import OperationalError, SQLAlchemyError

    from kvctl.db.engine import (
        DatabaseError,
        SchemaNotKnown,
        create_db_engine,
        display_url,
        driver_message,
        resolve_url,
        sqlite_dir_problem,
    )

    engine = create_db_engine(resolve_url(url), create=create)
    try:
        current = current_revision(engine)
    except DatabaseError:
        engine.dispose()
        raise
    except OperationalError as exc:
        engine.dispose()
        raise DatabaseError(
            f"cannot connect to {display_url(str(engine.url))}: {driver_message(exc)}"
            + sqlite_dir_problem(engine.url.database if engine.dialect.name == "sqlite" else None)
        ) from None
    except SQLAlchemyError as exc:  # a SQLite file that is no database: name the file
        engine.dispose()
        raise DatabaseError(
            f"cannot use {display_url(str(engine.url))}: {driver_message(exc)}"
        ) from None
    head = head_revision()
    if current == head:
        return engine
    newer = unknown_revision(engine, current)
    if newer is not None:
        engine.dispose()
        raise SchemaNotKnown(newer)
    if auto_upgrade is None:
        auto_upgrade = engine.dialect.name == "sqlite"
    if not auto_upgrade:
        engine.dispose()
        raise DatabaseError(
            f"the database schema is at {current or 'empty'}, kvctl needs {head}: run "
            "`kvctl db upgrade`"
        )
    try:
        upgrade(engine)
    except SQLAlchemyError as exc:
        engine.dispose()
        raise DatabaseError(
            f"upgrading the schema from {current or 'empty'} to {head} failed and was rolled "
            f"back, the database is as it was: {getattr(exc, 'orig', None) or exc}"
        ) from None
    return engine
