"""Which database, and how to connect: ``KVCTL_DB_URL`` or a SQLite file in the state dir."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError

from kvctl.paths import default_state_dir


class DatabaseError(Exception):
    """The database cannot be used as asked; the message says what to do."""


def default_db_path() -> Path:
    return default_state_dir() / "metrics.db"


def resolve_url(url: str | None = None) -> str:
    """The database URL: ``url``, else ``KVCTL_DB_URL``, else the default SQLite file.

    ``postgresql://`` URLs use psycopg 3 (the driver installed with kvctl)."""
    text = url or os.environ.get("KVCTL_DB_URL") or f"sqlite:///{default_db_path()}"
    try:
        parsed = make_url(text)
    except ArgumentError:
        raise DatabaseError(
            f"not a database URL: {text!r} (examples: sqlite:////var/lib/kvctl/metrics.db, "
            "postgresql://kvctl@db.example:5432/kvctl)"
        ) from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise DatabaseError(
            f"unsupported database {parsed.get_backend_name()!r}: kvctl supports SQLite and "
            "PostgreSQL"
        )
    return parsed.render_as_string(hide_password=False)


def display_url(url: str) -> str:
    """The URL with its password masked, for logs and `kvctl db current`."""
    return make_url(url).render_as_string(hide_password=True)


def _sqlite_pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    # WAL: readers (dashboard, CLI) never block the collector's writes, and vice versa
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def create_db_engine(url: str) -> Engine:
    parsed: URL = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            path = Path(parsed.database).expanduser()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DatabaseError(f"cannot create {path.parent}: {exc.strerror}") from None
        engine = create_engine(parsed)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(parsed, pool_pre_ping=True, pool_size=5, max_overflow=5)
