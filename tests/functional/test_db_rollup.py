"""Rollups and retention on a real SQLite and PostgreSQL: rollup sums equal raw sums, repeated
and incremental runs agree, stitched windows are exact, and retention never loses history."""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy import Integer, cast, func, select
from sqlalchemy.engine import Engine

from kvctl.db.ingest import insert_rows
from kvctl.db.models import ROLLUPS, raw_table
from kvctl.db.rollup import (
    DAY_MS,
    HOUR_MS,
    MINUTE_MS,
    Retention,
    prune,
    rollup,
    rollup_all,
    series,
    set_watermark,
    watermark,
)

T0 = 1_700_000_000_000 // HOUR_MS * HOUR_MS  # an hour boundary
SPAN_MS = 3 * HOUR_MS + 17 * MINUTE_MS


def _cache_rows(
    seed: int = 7, start_ms: int = T0, span_ms: int = SPAN_MS, step_ms: int = 10_000
) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    rows = []
    for node in (1, 2, 3):
        for tier in ("all", "cpu"):
            ts = start_ms + rnd.randrange(step_ms)
            while ts < start_ms + span_ms:
                rows.append(
                    {
                        "node_id": node,
                        "tier": tier,
                        "ts_ms": ts,
                        **{c: rnd.randrange(1000) for c in series("cache_sample").sums},
                        "used_bytes": rnd.randrange(10**9),
                        "capacity_bytes": 10**9,
                        "pinned_bytes": 0,
                        "items": rnd.randrange(500),
                    }
                )
                ts += rnd.randrange(step_ms // 2, step_ms * 3 // 2)
    return rows


def _node_rows(seed: int = 3) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    return [
        {
            "node_id": n,
            "ts_ms": T0 + i * 10_000,
            "up": rnd.random() < 0.8,
            "scrape_seconds": None if rnd.random() < 0.2 else rnd.random(),
            "agent_started_s": 1.0,
            "nvml_available": False,
            "error": None,
        }
        for n in (1, 2)
        for i in range(SPAN_MS // 10_000)
    ]


@pytest.fixture
def filled(db: Engine) -> Engine:
    with db.begin() as conn:
        insert_rows(conn, raw_table("cache_sample"), _cache_rows())
        insert_rows(conn, raw_table("node_sample"), _node_rows())
    return db


def _raw_totals(conn: Any, name: str, start: int, end: int) -> dict[tuple[Any, ...], list[Any]]:
    s = series(name)
    t = raw_table(name)
    cols = [func.count()]
    for c in s.sums:
        cols.append(func.sum(cast(t.c[c], Integer)))
    for g in s.gauges:
        cols += [func.sum(t.c[g]), func.max(t.c[g]), func.count(t.c[g])]
    q = (
        select(*[t.c[k] for k in s.keys], *cols)
        .where(t.c.ts_ms >= start, t.c.ts_ms < end)
        .group_by(*[t.c[k] for k in s.keys])
    )
    return {tuple(r[: len(s.keys)]): _norm(r[len(s.keys) :]) for r in conn.execute(q)}


def _norm(values: Any) -> list[Any]:
    return [None if v is None else round(float(v), 6) for v in values]


def _window_totals(conn: Any, name: str, start: int, end: int) -> dict[tuple[Any, ...], list[Any]]:
    from kvctl.db.rollup import window

    s = series(name)
    q = window(conn, s, start, end)
    out = {}
    for r in conn.execute(q):
        m = r._mapping
        vals = [m["samples"], *(m[c] for c in s.sums)]
        for g in s.gauges:
            vals += [m[f"{g}_sum"], m[f"{g}_max"], m[f"{g}_n"]]
        out[tuple(m[k] for k in s.keys)] = _norm(vals)
    return out


def test_rollup_sums_equal_raw_sums(filled: Engine) -> None:
    now = T0 + SPAN_MS + 10 * MINUTE_MS
    total = rollup_all(filled.begin, now)
    assert total["cache_1m"] > 0 and total["cache_1h"] > 0
    with filled.connect() as conn:
        for name in ("cache_sample", "node_sample"):
            s = series(name)
            for res, width in (("1m", MINUTE_MS), ("1h", HOUR_MS)):
                table = ROLLUPS[name, res]
                done = watermark(conn, name, res)
                assert done is not None and done % width == 0
                t = raw_table(name)
                for c in s.sums:
                    rolled = conn.execute(select(func.sum(table.c[c]))).scalar()
                    raw = conn.execute(
                        select(func.sum(cast(t.c[c], Integer))).where(t.c.ts_ms < done)
                    ).scalar()
                    assert int(rolled) == int(raw), (name, res, c)
                rolled_n = conn.execute(select(func.sum(table.c.samples))).scalar()
                raw_n = conn.execute(select(func.count()).where(t.c.ts_ms < done)).scalar()
                assert rolled_n == raw_n, (name, res)
    # the last full hour ends before now - grace; the partial hour stays raw/minutes
    assert done == (now - 2 * MINUTE_MS) // HOUR_MS * HOUR_MS


def test_rerun_and_incremental_rollups_agree(filled: Engine) -> None:
    def snapshot() -> list[Any]:
        with filled.connect() as conn:
            return [
                sorted(tuple(r) for r in conn.execute(select(ROLLUPS["cache_sample", res])))
                for res in ("1m", "1h")
            ]

    for step in range(T0, T0 + SPAN_MS + 10 * MINUTE_MS, 7 * MINUTE_MS + 13_000):
        rollup_all(filled.begin, step)
    incremental = snapshot()
    with filled.begin() as conn:
        for res in ("1m", "1h"):
            conn.execute(ROLLUPS["cache_sample", res].delete())
        conn.exec_driver_sql("DELETE FROM rollup_state")
    rollup_all(filled.begin, T0 + SPAN_MS + 10 * MINUTE_MS)
    once = snapshot()
    assert incremental == once
    rollup_all(filled.begin, T0 + SPAN_MS + 10 * MINUTE_MS)  # nothing new: unchanged
    assert snapshot() == once


def test_stitched_windows_are_exact(filled: Engine) -> None:
    rollup_all(filled.begin, T0 + 2 * HOUR_MS + 30 * MINUTE_MS)
    rnd = random.Random(11)
    windows = [(T0, T0 + SPAN_MS), (T0 + 1, T0 + SPAN_MS - 1)]
    windows += [
        tuple(sorted((T0 + rnd.randrange(SPAN_MS), T0 + rnd.randrange(SPAN_MS)))) for _ in range(12)
    ]
    with filled.connect() as conn:
        for start, end in windows:
            for name in ("cache_sample", "node_sample"):
                assert _window_totals(conn, name, start, end) == _raw_totals(
                    conn, name, start, end
                ), (name, start - T0, end - T0)


def test_a_windows_sql_is_the_same_whatever_its_start(filled: Engine) -> None:
    """A soak review ran kvctl top (--interval 1) for 7 minutes: its RSS grew 127 -> 208 MB,
    one new statement in the engine's compiled cache per poll (~200 KB each), because each
    window's start was written into its SQL (bucket_ms). Two windows of the same layout
    (stitched from raw and rolled-up rows, a second apart) compile to the same SQL now, and
    still sum exactly; a window of one piece still says its start in bucket_ms."""
    from kvctl.db.rollup import window

    rollup_all(filled.begin, T0 + 2 * HOUR_MS + 30 * MINUTE_MS)
    s = series("cache_sample")
    with filled.connect() as conn:
        starts = [T0 + 7_000, T0 + 8_000]
        queries = [window(conn, s, start, start + 2 * HOUR_MS) for start in starts]
        sql = [str(q.compile(dialect=conn.dialect)) for q in queries]
        assert "UNION ALL" in sql[0]  # stitched: every piece carries the start
        assert sql[0] == sql[1]
        # a window of raw rows alone is one piece, whose rows say its start
        raw_start = T0 + 2 * HOUR_MS + 40 * MINUTE_MS + 7_000
        q = window(conn, s, raw_start, raw_start + 5 * MINUTE_MS)
        assert {r._mapping["bucket_ms"] for r in conn.execute(q)} == {raw_start}
        assert _window_totals(conn, "cache_sample", starts[1], starts[1] + 2 * HOUR_MS) == (
            _raw_totals(conn, "cache_sample", starts[1], starts[1] + 2 * HOUR_MS)
        )


def test_retention_deletes_only_what_is_rolled_up(filled: Engine) -> None:
    with filled.connect() as conn:
        before = _raw_totals(conn, "cache_sample", T0, T0 + SPAN_MS)
    short = Retention(raw_ms=HOUR_MS, minute_ms=2 * HOUR_MS, hour_ms=DAY_MS)
    now = T0 + SPAN_MS + 5 * MINUTE_MS
    with filled.begin() as conn:
        # nothing rolled up yet: nothing may go
        assert sum(prune(conn, now, short).values()) == 0
    rollup_all(filled.begin, now)
    with filled.begin() as conn:
        deleted = prune(conn, now, short)
    assert deleted["cache_sample"] > 0
    with filled.connect() as conn:
        oldest = conn.execute(select(func.min(raw_table("cache_sample").c.ts_ms))).scalar()
        assert oldest >= now - HOUR_MS
        # the whole span is still exact, now read from rollups where raw rows are gone
        assert _window_totals(conn, "cache_sample", T0, T0 + SPAN_MS) == before


def test_rollup_processes_bounded_spans(filled: Engine) -> None:
    with filled.begin() as conn:
        written = rollup(conn, T0 + SPAN_MS + HOUR_MS, max_span_ms=HOUR_MS)
        assert watermark(conn, "cache_sample", "1m") == T0 + HOUR_MS
    assert written["cache_1m"] > 0


# --- daily rollups: a sparse history across two UTC day boundaries ---------------------------
D0 = T0 // DAY_MS * DAY_MS + DAY_MS  # a UTC midnight
DAYS_START_MS = D0 - 5 * HOUR_MS
DAYS_SPAN_MS = 2 * DAY_MS + 8 * HOUR_MS + 7 * MINUTE_MS


@pytest.fixture
def filled_days(db: Engine) -> Engine:
    rows = _cache_rows(5, DAYS_START_MS, DAYS_SPAN_MS, step_ms=10 * MINUTE_MS)
    with db.begin() as conn:
        insert_rows(conn, raw_table("cache_sample"), rows)
    return db


def test_daily_rollups_equal_raw_sums_and_stitch_exactly(filled_days: Engine) -> None:
    now = DAYS_START_MS + DAYS_SPAN_MS + 5 * MINUTE_MS
    total = rollup_all(filled_days.begin, now)
    # the day before D0 (its last 5 hours hold samples) and two whole days, x 3 nodes x 2 tiers
    assert total["cache_1d"] == 3 * 3 * 2
    t = raw_table("cache_sample")
    daily = ROLLUPS["cache_sample", "1d"]
    with filled_days.connect() as conn:
        assert watermark(conn, "cache_sample", "1d") == D0 + 2 * DAY_MS
        for c in series("cache_sample").sums:
            rolled = conn.execute(select(func.sum(daily.c[c]))).scalar()
            raw = conn.execute(select(func.sum(t.c[c])).where(t.c.ts_ms < D0 + 2 * DAY_MS)).scalar()
            assert int(rolled) == int(raw), c
        rnd = random.Random(3)
        windows = [(DAYS_START_MS, DAYS_START_MS + DAYS_SPAN_MS), (D0, D0 + 2 * DAY_MS)]
        windows += [
            tuple(sorted(DAYS_START_MS + rnd.randrange(DAYS_SPAN_MS) for _ in range(2)))
            for _ in range(10)
        ]
        for start, end in windows:
            assert _window_totals(conn, "cache_sample", start, end) == _raw_totals(
                conn, "cache_sample", start, end
            ), (start - D0, end - D0)


def test_hourly_rows_outlive_retention_until_rolled_into_days(filled_days: Engine) -> None:
    with filled_days.connect() as conn:
        full_days = _raw_totals(conn, "cache_sample", D0, D0 + 2 * DAY_MS)
    now = DAYS_START_MS + DAYS_SPAN_MS + 5 * MINUTE_MS
    short = Retention(raw_ms=HOUR_MS, minute_ms=HOUR_MS, hour_ms=HOUR_MS, day_ms=30 * DAY_MS)
    hourly = ROLLUPS["cache_sample", "1h"]
    rollup_all(filled_days.begin, now)
    with filled_days.begin() as conn:
        # pretend the last day has not been rolled up: its hours must stay
        conn.execute(
            ROLLUPS["cache_sample", "1d"]
            .delete()
            .where(ROLLUPS["cache_sample", "1d"].c.bucket_ms >= D0 + DAY_MS)
        )
        set_watermark(conn, "cache_sample", "1d", D0 + DAY_MS)
        prune(conn, now, short)
        oldest_hour = conn.execute(select(func.min(hourly.c.bucket_ms))).scalar()
        assert oldest_hour == D0 + DAY_MS
    rollup_all(filled_days.begin, now)
    with filled_days.begin() as conn:
        prune(conn, now, short)
        assert conn.execute(select(func.min(hourly.c.bucket_ms))).scalar() == D0 + 2 * DAY_MS
    with filled_days.connect() as conn:
        # the raw rows are mostly gone; whole days are still exact, read from daily rollups
        assert _raw_totals(conn, "cache_sample", D0, D0 + 2 * DAY_MS) != full_days
        assert _window_totals(conn, "cache_sample", D0, D0 + 2 * DAY_MS) == full_days


def _raw_buckets(conn: Any, start: int, end: int, width: int, nodes: list[int]) -> dict[Any, Any]:
    t = raw_table("cache_sample")
    out: dict[Any, Any] = {}
    q = select(t.c.ts_ms, t.c.node_id, t.c.tier, t.c.hits, t.c.used_bytes).where(
        t.c.ts_ms >= start, t.c.ts_ms < end, t.c.node_id.in_(nodes)
    )
    for ts, node, tier, hits, used in conn.execute(q):
        row = out.setdefault((ts - ts % width, node, tier), [0, 0, 0.0, 0])
        row[0] += 1
        row[1] += hits
        row[2] += used
        row[3] = max(row[3], used)
    return {k: [v[0], v[1], round(v[2], 3), float(v[3])] for k, v in out.items()}


@pytest.mark.parametrize("width", [MINUTE_MS, 15 * MINUTE_MS, HOUR_MS, DAY_MS])
def test_buckets_equal_raw_buckets_across_levels(filled_days: Engine, width: int) -> None:
    from kvctl.db.rollup import buckets

    now = DAYS_START_MS + DAYS_SPAN_MS + 5 * MINUTE_MS
    rollup_all(filled_days.begin, now - 3 * HOUR_MS)  # the last hours stay raw
    rnd = random.Random(width)
    windows = [(DAYS_START_MS, now), (D0 - 7 * MINUTE_MS - 3, D0 + DAY_MS + 31 * MINUTE_MS)]
    windows += [
        tuple(sorted(DAYS_START_MS + rnd.randrange(DAYS_SPAN_MS) for _ in range(2)))
        for _ in range(4)
    ]
    with filled_days.connect() as conn:
        for start, end in windows:
            q = buckets(
                conn,
                series("cache_sample"),
                start,
                end,
                width,
                where={"node_id": [1, 3]},
                columns=["hits", "used_bytes"],
            )
            got = {
                (m["bucket_ms"], m["node_id"], m["tier"]): [
                    int(m["samples"]),
                    int(m["hits"]),
                    round(float(m["used_bytes_sum"]), 3),
                    float(m["used_bytes_max"]),
                ]
                for m in (r._mapping for r in conn.execute(q))
            }
            assert got == _raw_buckets(conn, start, end, width, [1, 3]), (start, end)


def test_gauges_whose_sum_passes_bigint_roll_up_and_so_does_every_other_series(
    db: Engine,
) -> None:
    """A tier's gauge near 2**63 (each reading fits the raw BIGINT column; the agent's API
    allows up to 2**63 - 1, and a broken or hostile agent can say so) twice in a minute: the
    minute's sum passes BIGINT. SQLite's sum() of integers raised "integer overflow", failing
    the rollup's one transaction, so no series rolled up again (the dashboard's longer windows
    went stale for the whole fleet). Gauge sums are summed as floats: the mean is what they
    are for."""
    big = 2**62 + 2**61
    rows = [
        {
            "node_id": 1,
            "tier": "pool",
            "ts_ms": T0 + i * 10_000,
            **dict.fromkeys(series("cache_sample").sums, 0),
            "used_bytes": big,
            "capacity_bytes": big,
            "pinned_bytes": 0,
            "items": 0,
        }
        for i in range(6)
    ]
    with db.begin() as conn:
        insert_rows(conn, raw_table("cache_sample"), rows)
        insert_rows(conn, raw_table("node_sample"), _node_rows())
    rollup_all(db.begin, T0 + DAY_MS)
    minute = ROLLUPS["cache_sample", "1m"]
    with db.connect() as conn:
        got = conn.execute(
            select(minute.c.capacity_bytes_sum, minute.c.capacity_bytes_n).where(
                minute.c.bucket_ms == T0
            )
        ).one()
        nodes = conn.execute(
            select(func.count()).select_from(ROLLUPS["node_sample", "1h"])
        ).scalar_one()
    assert got.capacity_bytes_n == 6
    assert got.capacity_bytes_sum / got.capacity_bytes_n == pytest.approx(big, rel=1e-12)
    assert nodes > 0  # the other series rolled up too
