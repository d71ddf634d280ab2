"""Batched sample writes: the fast path each backend offers, idempotent on re-delivery.

Samples are keyed by (series keys, ts_ms), so writing the same sample twice (a retried batch)
keeps one row instead of failing the batch. (Two collectors scraping one node by mistake are
kept from counting an increase twice by the counters' compare-and-set save: kvctl.counters.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg.errors import UniqueViolation
from sqlalchemy import Table
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError


def insert_rows(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> int:
    """Write ``rows`` (dicts with the same keys) into ``table``; rows whose primary key already
    exists are skipped. Returns the number of rows given. Runs in the caller's transaction."""
    if not rows:
        return 0
    if conn.dialect.name == "postgresql":
        try:
            with conn.begin_nested():
                _copy(conn, table, rows)
        except (IntegrityError, UniqueViolation):
            # COPY is all-or-nothing: fall back to row-wise conflict handling for this batch
            conn.execute(pg_insert(table).on_conflict_do_nothing(), list(rows))
        except psycopg.Error as exc:
            # raw driver errors from COPY, wrapped like every other statement's (lock timeouts,
            # lost connections), so callers handle one family of exceptions
            raise DBAPIError.instance(f"COPY {table.name}", None, exc, psycopg.Error) from exc
        return len(rows)
    _sqlite_executemany(conn, table, rows)
    return len(rows)


def _columns(table: Table, rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], str]:
    """The batch's column names, checked against ``table`` (an unknown one fails here with its
    name, not deep inside the driver), and their quoted list for raw SQL."""
    columns = list(rows[0])
    unknown = [c for c in columns if c not in table.c]
    if unknown:
        raise ValueError(f"{table.name} has no column {', '.join(unknown)}")
    return columns, ", ".join(f'"{c}"' for c in columns)


def _sqlite_executemany(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """One prepared INSERT OR IGNORE over plain tuples: about twice SQLAlchemy's executemany,
    which builds a parameter dict per row."""
    columns, quoted = _columns(table, rows)
    marks = ", ".join("?" * len(columns))
    sql = f'INSERT OR IGNORE INTO "{table.name}" ({quoted}) VALUES ({marks})'
    conn.exec_driver_sql(sql, [tuple(row[c] for c in columns) for row in rows])


def _copy(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """COPY FROM STDIN through psycopg 3: several times faster than multi-row INSERTs."""
    columns, quoted = _columns(table, rows)
    driver = conn.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cur, cur.copy(f'COPY "{table.name}" ({quoted}) FROM STDIN') as copy:
        for row in rows:
            copy.write_row([row[c] for c in columns])
