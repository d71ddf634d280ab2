"""Rollups, retention, and exact window sums that stitch raw samples and rollups together.

Raw samples roll up into 1-minute buckets, those into 1-hour buckets, and those into UTC days
(so a week's window reads about a hundred rows per series, not thousands). A bucket is final once
``now - grace`` has passed its end; ``rollup_state`` keeps the watermark per rollup, and retention
never deletes rows that have not been rolled up yet, so history is never silently lost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    Integer,
    Select,
    Table,
    and_,
    case,
    cast,
    delete,
    false,
    func,
    literal,
    select,
    union_all,
)
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

from kvctl.db.models import (
    RESOLUTIONS,
    ROLLUPS,
    SERIES,
    SERIES_BY_TABLE,
    RollupState,
    Series,
    raw_table,
)

MINUTE_MS: Final = RESOLUTIONS["1m"]
HOUR_MS: Final = RESOLUTIONS["1h"]
DAY_MS: Final = RESOLUTIONS["1d"]
#: each rollup level and the level it is built from, finest first
LEVELS: Final = (("1m", "raw"), ("1h", "1m"), ("1d", "1h"))
#: samples may arrive this late (scrape interval plus slow nodes) and still be rolled up
DEFAULT_GRACE_MS: Final = 2 * MINUTE_MS
# any constant: serialises rollup runs of several collectors on one PostgreSQL
_PG_LOCK_ID: Final = 0x6B76_6374


@dataclass(frozen=True, slots=True)
class Retention:
    raw_ms: int = 2 * DAY_MS
    minute_ms: int = 30 * DAY_MS
    hour_ms: int = 365 * DAY_MS
    day_ms: int = 5 * 365 * DAY_MS

    def of(self, res: str) -> int:
        """How long rows of ``res`` ("raw" or a rollup) are kept."""
        return {"raw": self.raw_ms, "1m": self.minute_ms, "1h": self.hour_ms, "1d": self.day_ms}[
            res
        ]


def series(name: str) -> Series:
    return SERIES_BY_TABLE[name]


def _watermark_name(table: str, res: str) -> str:
    return f"{table}:{res}"


def watermark(conn: Connection, table: str, res: str) -> int | None:
    return conn.execute(
        select(RollupState.done_until_ms).where(RollupState.name == _watermark_name(table, res))
    ).scalar_one_or_none()


def set_watermark(conn: Connection, table: str, res: str, until_ms: int) -> None:
    name = _watermark_name(table, res)
    updated = conn.execute(
        RollupState.__table__.update()
        .where(RollupState.name == name)
        .values(done_until_ms=until_ms)
    ).rowcount
    if not updated:
        conn.execute(RollupState.__table__.insert().values(name=name, done_until_ms=until_ms))


def reopen(conn: Connection, table: str, since_ms: int, now_ms: int) -> None:
    """Raw samples of ``table`` from ``since_ms`` were just written, in ``conn``'s
    transaction, at ``now_ms``: every rollup of ``table`` whose watermark is past them is
    redone from the bucket holding ``since_ms`` (a rollup deletes its buckets before
    rebuilding them, so nothing counts twice). Windows read rollups below the watermark, so
    samples written there (a batch kept through an outage while another process rolled up; a
    clock stepped back) were counted in no window. Call it only for samples within raw
    retention: the rebuilt buckets are read from every raw row they cover."""
    if since_ms < now_ms - DEFAULT_GRACE_MS // 2:
        # old enough for a rollup running now to pass them unseen: look once it is done
        _lock(conn)
    done = watermark(conn, table, LEVELS[0][0])
    if done is None or since_ms >= done:
        return
    _lock(conn)  # no rollup is halfway through these buckets while they are reopened
    state = RollupState.__table__
    for res, _source in LEVELS:
        start = since_ms // RESOLUTIONS[res] * RESOLUTIONS[res]
        conn.execute(
            state.update()
            .where(state.c.name == _watermark_name(table, res), state.c.done_until_ms > start)
            .values(done_until_ms=start)
        )


_INT64_MAX: Final = 2**63 - 1


class count_sum(FunctionElement[int]):
    """SUM of integer counts that never fails: SQLite's SUM raises "integer overflow" once a
    sum passes 2**63 (two rows written by hand near it failed every page and command reading
    the window), where PostgreSQL's is an exact numeric. On SQLite it sums the high and low 32
    bits apart (neither sum can overflow) and joins them: exact where the sum fits 64 bits,
    else a float (SQLite's arithmetic overflows into one), which the read model takes for
    unknown (``kvctl.db.analytics.values.beyond_count``), as it does PostgreSQL's, held to the
    limit."""

    inherit_cache = True
    name = "count_sum"
    type = BigInteger()


@compiles(count_sum)
def _count_sum(element: count_sum, compiler: Any, **kw: Any) -> str:
    return f"sum({compiler.process(element.clauses, **kw)})"


@compiles(count_sum, "postgresql")
def _count_sum_postgresql(element: count_sum, compiler: Any, **kw: Any) -> str:
    # an exact numeric, held to a bigint's range (a rollup's column): at the limit is unknown
    # to the read model either way, and the rollup no longer fails "bigint out of range"
    # (a CASE: GREATEST and LEAST pass over a NULL, the sum of no reading)
    x = compiler.process(element.clauses, **kw)
    total = f"sum({x})"
    return (
        f"CASE WHEN {total} > {_INT64_MAX} THEN {_INT64_MAX} "
        f"WHEN {total} < -{_INT64_MAX} THEN -{_INT64_MAX} ELSE {total} END"
    )


@compiles(count_sum, "sqlite")
def _count_sum_sqlite(element: count_sum, compiler: Any, **kw: Any) -> str:
    x = compiler.process(element.clauses, **kw)
    return f"(sum(({x}) >> 32) * 4294967296 + sum(({x}) & 4294967295))"


def sum_of(col: ColumnElement[Any]) -> ColumnElement[Any]:
    """SUM of ``col``: :class:`count_sum` for integer counts (booleans as 0/1: PostgreSQL has
    no SUM(boolean)), SQL's own for floats."""
    if isinstance(col.type, Boolean):
        return count_sum(cast(col, Integer))
    if isinstance(col.type, Integer):
        return count_sum(col)
    return func.sum(col)


#: a float sum and a count written with it (a mean's numerator and denominator): every
#: collector writes both or neither, so a row with the count and no sum held a NaN, which SQLite
#: stores as NULL; summed as infinite, the read model's mark of a sum that cannot be true, as
#: PostgreSQL's NaN is, rather than as none (a TTFT mean of the other rows' seconds over every
#: row's count). Not a plan's seconds and chunks: collectors of 2026-11-24..29 wrote a rejected
#: reading's seconds NULL beside its chunks, a sound row that must not make a node's plans
#: unknown (on SQLite a NaN written by hand reads as such a row: seconds not known)
PAIRED_SUMS: Final = {"ttft_sum_s": "ttft_count"}


def _raw_sum(t: Table, name: str) -> ColumnElement[Any]:
    col = t.c[name]
    if (count := PAIRED_SUMS.get(name)) is not None:
        lost = and_(t.c[count].is_not(None), col.is_(None))
        return func.sum(case((lost, literal(math.inf, Float)), else_=col))
    return sum_of(col)


def _reaggregate(s: Series, c: Any) -> list[ColumnElement[Any]]:
    """Aggregates of already aggregated rows (a rollup table, or pieces of a window)."""
    cols: list[ColumnElement[Any]] = [sum_of(c.samples).label("samples")]
    cols += [sum_of(c[name]).label(name) for name in s.sums]
    for g in s.gauges:
        cols += [
            func.sum(c[f"{g}_sum"]).label(f"{g}_sum"),
            func.max(c[f"{g}_max"]).label(f"{g}_max"),
            sum_of(c[f"{g}_n"]).label(f"{g}_n"),
        ]
    return cols


def _matches(col: ColumnElement[Any], value: Any) -> ColumnElement[bool]:
    """``where`` values: one value, or a list/tuple/set of values (an IN filter)."""
    if isinstance(value, list | tuple | set | frozenset):
        return col.in_(list(value))
    return col == value


def piece(
    s: Series,
    source: str,
    start_ms: int,
    end_ms: int,
    width_ms: int | None,
    where: Mapping[str, Any] | None = None,
) -> Select[Any]:
    """Aggregates of ``s`` over [start, end) read from ``source`` ("raw" or a rollup),
    grouped by the series keys and, when ``width_ms`` is given, by bucket of that width.

    Every piece has the same columns (bucket_ms, keys, samples, sums, gauge sum/max/n), so
    pieces from different resolutions can be combined with UNION ALL and summed again."""
    if source == "raw":
        t = raw_table(s.table)
        time = t.c.ts_ms
        cols: list[ColumnElement[Any]] = [func.count().label("samples")]
        cols += [_raw_sum(t, c).label(c) for c in s.sums]
        for g in s.gauges:
            cols += [
                # as floats (what the rollup column holds; a mean is what it is for): two
                # readings near 2**63 overflow SQLite's integer sum(), which failed the whole
                # rollup, every series with it
                func.sum(cast(t.c[g], Float)).label(f"{g}_sum"),
                func.max(t.c[g]).label(f"{g}_max"),
                func.count(t.c[g]).label(f"{g}_n"),
            ]
    else:
        t = ROLLUPS[s.table, source]
        time = t.c.bucket_ms
        cols = _reaggregate(s, t.c)
    keys = [t.c[k] for k in s.keys]
    filters = [_matches(t.c[k], v) for k, v in (where or {}).items()]
    if width_ms is not None:
        bucket = (time - time % width_ms).label("bucket_ms")
        group: list[ColumnElement[Any]] = [bucket, *keys]
    else:
        # a parameter, not the number in the SQL: a window's text must not change with its
        # start, or every poll of a live view (kvctl top, the dashboard) compiles and caches
        # a statement of its own (~200 KB each, up to the engine's 500-750 cached)
        bucket = cast(literal(start_ms, BigInteger), BigInteger).label("bucket_ms")
        group = list(keys)
    return (
        select(bucket, *keys, *cols)
        .where(time >= start_ms, time < end_ms, *filters)
        .group_by(*group)
    )


def _lock(conn: Connection) -> None:
    """Serialise rollups, prunes and ``reopen`` until ``conn``'s transaction ends."""
    if conn.dialect.name == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(_PG_LOCK_ID)))
    else:
        # SQLite's write lock, taken now: pysqlite begins a transaction at the first write,
        # so a rollup read its watermark outside it, and a collector's late rows and the
        # watermark they lowered could go in between, to be overwritten unread
        state = RollupState.__table__
        conn.execute(state.update().where(false()).values(done_until_ms=0))


def _first_time(conn: Connection, s: Series, source: str) -> int | None:
    if source == "raw":
        t = raw_table(s.table)
        return conn.execute(select(func.min(t.c.ts_ms))).scalar()
    t = ROLLUPS[s.table, source]
    return conn.execute(select(func.min(t.c.bucket_ms))).scalar()


def rollup(
    conn: Connection, now_ms: int, *, grace_ms: int = DEFAULT_GRACE_MS, max_span_ms: int = DAY_MS
) -> dict[str, int]:
    """Roll up every series whose buckets are final by ``now_ms``; returns rows written per
    rollup table. At most ``max_span_ms`` of history is processed per table and call, so a first
    run over a long history is split into bounded transactions by the caller's loop."""
    _lock(conn)
    written: dict[str, int] = {}
    for s in SERIES:
        for res, source in LEVELS:
            width = RESOLUTIONS[res]
            target: Table = ROLLUPS[s.table, res]
            end = (now_ms - grace_ms) // width * width
            if source != "raw":
                # an hour is final only when all of its minutes are, a day when all its hours are
                done_source = watermark(conn, s.table, source)
                if done_source is None:
                    continue
                end = min(end, done_source // width * width)
            start = watermark(conn, s.table, res)
            if start is None:
                first = _first_time(conn, s, source)
                if first is None:
                    continue
                start = first // width * width
            end = min(end, start + max(max_span_ms // width, 1) * width)
            if end <= start:
                continue
            conn.execute(
                delete(target).where(target.c.bucket_ms >= start, target.c.bucket_ms < end)
            )
            sel = piece(s, source, start, end, width)
            conn.execute(target.insert().from_select([c.name for c in sel.selected_columns], sel))
            # counted, not rowcount: psycopg reports -1 for INSERT ... SELECT
            written[target.name] = conn.execute(
                select(func.count()).where(target.c.bucket_ms >= start, target.c.bucket_ms < end)
            ).scalar_one()
            set_watermark(conn, s.table, res, end)
    return written


def rollup_all(conn_factory: Any, now_ms: int, **kw: Any) -> dict[str, int]:
    """Run :func:`rollup` in transactions of bounded span until everything final is done."""
    total: dict[str, int] = {}
    while True:
        with conn_factory() as conn:
            written = rollup(conn, now_ms, **kw)
        if not written:
            return total
        for k, v in written.items():
            total[k] = total.get(k, 0) + v


#: every level, finest first, and the level each one rolls up into (the coarsest: none)
_PRUNED: Final = (*(source for _res, source in LEVELS), LEVELS[-1][0])
_ROLLED_INTO: Final = {source: res for res, source in LEVELS}


def prune(conn: Connection, now_ms: int, retention: Retention = Retention()) -> dict[str, int]:
    """Delete what is past its retention, but never rows not yet rolled up to the next level."""
    _lock(conn)
    deleted: dict[str, int] = {}
    for s in SERIES:
        for source in _PRUNED:
            before = now_ms - retention.of(source)
            if source in _ROLLED_INTO:
                before = min(before, watermark(conn, s.table, _ROLLED_INTO[source]) or 0)
            if source == "raw":
                table, time = raw_table(s.table), raw_table(s.table).c.ts_ms
            else:
                table = ROLLUPS[s.table, source]
                time = table.c.bucket_ms
            n = conn.execute(delete(table).where(time < before)).rowcount
            deleted[table.name] = max(n or 0, 0)
    return deleted


def maintain(engine: Engine, now_ms: int, retention: Retention = Retention()) -> dict[str, Any]:
    """Roll up everything final, then prune what is past retention: the upkeep the collector
    runs every minute and `kvctl db maintain` runs on demand."""
    written = rollup_all(engine.begin, now_ms)
    with engine.begin() as conn:
        deleted = prune(conn, now_ms, retention)
    return {"rolled_up": written, "deleted": {k: v for k, v in deleted.items() if v}}


def _only(s: Series, columns: Sequence[str] | None) -> Series:
    if columns is None:
        return s
    wanted = set(columns)
    return replace(
        s,
        sums=tuple(c for c in s.sums if c in wanted),
        gauges=tuple(g for g in s.gauges if g in wanted),
    )


def _pieces(
    conn: Connection,
    s: Series,
    start_ms: int,
    end_ms: int,
    width_ms: int | None,
    where: Mapping[str, Any] | None,
) -> list[Select[Any]]:
    """Pieces covering [start, end): the coarsest final rollup rows that fit (only levels whose
    width divides ``width_ms`` when bucketing), finer levels at the edges, raw samples last."""
    levels = [
        (res, RESOLUTIONS[res], watermark(conn, s.table, res) or 0)
        for res, _ in reversed(LEVELS)
        if width_ms is None or width_ms % RESOLUTIONS[res] == 0
    ]
    parts: list[Select[Any]] = []

    def cover(lo: int, hi: int, level: int) -> None:
        if lo >= hi:
            return
        for i in range(level, len(levels)):
            source, width, done = levels[i]
            a = -(-lo // width) * width  # first whole bucket at or after lo
            b = min(hi, done) // width * width
            if a < b:
                cover(lo, a, i + 1)
                parts.append(piece(s, source, a, b, width_ms, where))
                cover(b, hi, i + 1)
                return
        parts.append(piece(s, "raw", lo, hi, width_ms, where))

    cover(start_ms, end_ms, 0)
    return parts


def window(
    conn: Connection,
    s: Series,
    start_ms: int,
    end_ms: int,
    *,
    where: Mapping[str, Any] | None = None,
    columns: Sequence[str] | None = None,
) -> Select[Any]:
    """A select of exact aggregates over [start, end) per series key, stitched from daily
    rollups where whole final days fit, then 1-hour, then 1-minute rollups likewise, and raw
    samples for the rest. Columns as in :func:`piece`.

    ``where`` keeps only rows whose keys have the given values (a collection: any of them);
    ``columns`` limits the counters and gauges aggregated to those named (a dashboard query
    needs a few, and on SQLite each aggregated column costs about as much as reading the rows).

    Exact within the retention of the finest level: where a window's edge falls in a period
    whose finer rows are past retention (a window starting mid-hour two months ago, with
    1-minute rows kept 30 days), that partial bucket has nothing left to read and counts as
    empty."""
    s = _only(s, columns)
    return _combine(s, _pieces(conn, s, start_ms, end_ms, None, where), by_bucket=False)


def buckets(
    conn: Connection,
    s: Series,
    start_ms: int,
    end_ms: int,
    width_ms: int,
    *,
    where: Mapping[str, Any] | None = None,
    columns: Sequence[str] | None = None,
) -> Select[Any]:
    """A time series: exact aggregates per ``width_ms`` bucket (aligned to the epoch) and
    series key over [start, end); each row's ``bucket_ms`` is its bucket's start. A week in
    hourly buckets reads hourly rollups, not samples. Edge buckets hold only their part inside
    the window. Arguments as in :func:`window`."""
    if width_ms <= 0:
        raise ValueError("bucket width must be positive")
    s = _only(s, columns)
    return _combine(s, _pieces(conn, s, start_ms, end_ms, width_ms, where), by_bucket=True)


def _combine(s: Series, parts: list[Select[Any]], *, by_bucket: bool) -> Select[Any]:
    """One select of the pieces' aggregates per series key (and bucket)."""
    if len(parts) == 1:
        return parts[0]
    u = union_all(*parts).subquery()
    group = [u.c[k] for k in s.keys]
    if by_bucket:
        group.insert(0, u.c.bucket_ms)
    return select(*group, *_reaggregate(s, u.c)).group_by(*group)
