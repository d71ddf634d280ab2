"""The metrics database: batched sample ingest and the dashboard's fleet summary, on SQLite and
PostgreSQL, each figure beside a reference measured in the same run on the same backend.

For each backend (SQLite in a temporary directory always; PostgreSQL in a throwaway database
``kvctl_bench_<pid>``, dropped at the end also on errors, when a server is reachable):

* ``ingest``: ``rows`` ``cache_sample`` rows written in batches of ``batch`` rows, one transaction
  per batch, through :func:`kvctl.db.ingest.insert_rows` (what the collector does). Reference:
  the driver's plain fastest path for the same rows into a scratch table with the same columns and
  no primary key or index (SQLite: ``executemany`` of tuples on a raw ``sqlite3`` connection with
  WAL and ``synchronous=NORMAL``; PostgreSQL: psycopg ``COPY`` into a plain, logged table). Both
  start from an empty table in every sample, and alternate which goes first.
* ``history``: ``nodes`` nodes in ``dcs`` DCs over ``days`` days at 10 s resolution, for the
  cache (tiers ``all`` and ``cpu``), node and power (one GPU per node) series. Writing that raw
  (60 million samples per series for 1,000 nodes and 7 days) would take longer than the figure it
  serves, so the older history is written as the rollup rows that rolling up the model's 10 s
  samples gives, exactly (:func:`generate_rollups`; the unit tests check it against the real
  rollup): daily rows over the whole UTC days before the raw tail, 1-hour rows over the whole
  span before the raw tail, 1-minute rows over the last
  ``minute_hours`` before it, and the ``rollup_state`` watermarks set to where they end. The last
  ``raw_hours`` are written as real 10 s samples (:func:`generate_samples`) and rolled up by the
  real :func:`kvctl.db.rollup.rollup_all`, timed (``rollup``; reference: a full scan,
  ``count(*), sum(ts_ms)``, of the same raw tables right after).
* ``fleet_summary`` and ``dashboard_overview`` (the dashboard's fleet page:
  :func:`kvctl.db.analytics.overview.overview`, per-node counts, modeled savings and links),
  each timed like this: :func:`kvctl.db.analytics.summary.fleet_summary` over the last
  ``days``, 24 hours and 1 hour up to the end of the history, on one open connection, warmed
  by one untimed run.
  Reference: ``SELECT count(*), sum(lookups) FROM cache_1h``, a full scan of the largest table
  the summary reads (the sum makes it read the rows: SQLite counts from the smaller time index).
  With the collector's 2-minute grace, a window reads daily rollups up to the last UTC midnight
  before the last hour, 1-hour rollups up to an hour before the end, 1-minute rollups up to 2
  minutes before it and raw samples after. The summary's lookup and hit totals are compared
  with the model's (``check``): a wrong history would show there.

Every figure is the median of ``repeats`` samples (rollup: one run, it cannot be repeated). The
result (JSON-safe)::

    {"benchmark": "db", "host": {...}, "config": {...}, "elapsed_s": float,
     "sqlite" | "postgresql": {"database": str, "server_version": str,
         "ingest": {"rows", "batch_rows", "rows_per_s", "samples_rows_per_s",
                    "reference": {"what", "rows_per_s", "samples_rows_per_s"},
                    "ratio_to_reference"},
         "history": {"nodes", "dcs", "days", "start_ms", "end_ms", "generated_as_rollups",
                     "raw_samples", "watermarks_ms", "generation_s", "vacuum_analyze_s"},
         "rollup": {"raw_rows", "rows_written", "elapsed_s", "raw_rows_per_s",
                    "reference": {"what", "elapsed_s", "raw_rows_per_s"}, "ratio_to_reference"},
         "fleet_summary": {"last_<days>d" | "last_24h" | "last_1h":
                               {"window_ms", "median_s", "samples_s", "ratio_to_reference"},
                           "reference": {"what", "rows", "median_s", "samples_s"},
                           "check": {...}},
         "dashboard_overview": {the same keys as fleet_summary}}
         | {"skipped": str},
     "targets": {"ingest_rows_per_s": 100000, "fleet_summary_s": 0.5},
     "meets_targets": {"sqlite": {"ingest_rows_per_s": bool, "fleet_summary_s": bool},
                       "postgresql": {...} | None},
     "notes": [str, ...]}
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from kvctl.bench.common import alternating, host_info
from kvctl.db.models import ROLLUPS, raw_table
from kvctl.db.rollup import DAY_MS, DEFAULT_GRACE_MS, HOUR_MS, MINUTE_MS, series
from kvctl.errors import InvalidArgument

if TYPE_CHECKING:
    from rich.table import Table
    from sqlalchemy import Table as SqlTable
    from sqlalchemy.engine import Connection, Engine

DEFAULT_ROWS: Final = 500_000
DEFAULT_BATCH_ROWS: Final = 10_000
DEFAULT_NODES: Final = 1000
DEFAULT_DCS: Final = 8
DEFAULT_DAYS: Final = 7
DEFAULT_REPEATS: Final = 3
DEFAULT_RAW_HOURS: Final = 2
DEFAULT_MINUTE_HOURS: Final = 6
DEFAULT_PG_ADMIN_URL: Final = "postgresql://postgres@127.0.0.1:5432/postgres"
TARGETS: Final = {"ingest_rows_per_s": 100_000, "fleet_summary_s": 0.5}

#: the history ends here: a fixed clock, so two runs generate the same rows
HISTORY_END_MS: Final = 1_767_225_600_000  # 2026-01-01T00:00Z, an hour boundary
SAMPLE_INTERVAL_MS: Final = 10_000
SAMPLES_PER_HOUR: Final = HOUR_MS // SAMPLE_INTERVAL_MS
SAMPLES_PER_MINUTE: Final = MINUTE_MS // SAMPLE_INTERVAL_MS
#: the series the history fills (link and engine samples stay empty)
GENERATED_TABLES: Final = ("cache_sample", "node_sample", "power_sample")
TIERS: Final = ("all", "cpu")
CHUNK_TOKENS: Final = 256
CHUNK_BYTES: Final = 1 << 20
CAPACITY_BYTES: Final = 64 << 30
GPU_MEMORY_BYTES: Final = 80 << 30
#: share of node-hours in which the node misses some scrapes (no cache/power rows then)
DOWN_PROBABILITY: Final = 0.005
# Coprime with 360: sample k of an hour sits at offset (7k + shift) % 360, a permutation, so
# every sample's value is affine in its offset and every bucket's aggregate is exact.
_OFFSET_STRIDE: Final = 7
_TABLE_CODES: Final = {"cache_sample": 1, "node_sample": 2, "power_sample": 3}
_SCRATCH_TABLE: Final = "kvctl_bench_ref"

Progress = Callable[[str], None]


# --- the fleet model ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FleetModel:
    """A seeded model of a fleet's 10 s samples. Node ``i`` (the i-th of ``node_ids``) scrapes at
    ``hour + 10 s * k + jitter_i`` for k in 0..359; within an hour every column of a series is
    ``(base + step * offset_k) * scale`` with per node-hour ``base``, ``step >= 0`` drawn from
    the seed, and ``offset_k`` a per node-hour permutation of 0..359. A node is down for the
    samples whose offset is below its ``down`` count (usually 0): ``up`` is false, scrape
    time NULL, and no cache or power row is written. Every value is an integer or a dyadic
    fraction, so sums are exact in floating point on both backends."""

    node_ids: tuple[int, ...]
    seed: int = 0
    jitter_ms: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng([self.seed, 0])
        object.__setattr__(
            self, "jitter_ms", rng.integers(0, SAMPLE_INTERVAL_MS, len(self.node_ids))
        )


@dataclass(frozen=True, slots=True)
class _Part:
    """One series key per node within an hour: key columns and per-column (base, step)."""

    keys: dict[str, Any]
    affine: dict[str, tuple[np.ndarray, np.ndarray]]
    #: columns stored as floats: value = (base + step * offset) * scale
    scale: dict[str, float]


def _hour_state(model: FleetModel, hour: int) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (360, nodes) of each sample and whether the node was up for it."""
    n = len(model.node_ids)
    rng = np.random.default_rng([model.seed, 0, hour])
    shift = rng.integers(0, SAMPLES_PER_HOUR, n)
    down = np.where(rng.random(n) < DOWN_PROBABILITY, rng.integers(1, SAMPLES_PER_HOUR + 1, n), 0)
    k = np.arange(SAMPLES_PER_HOUR)
    offsets = (_OFFSET_STRIDE * k[:, None] + shift[None, :]) % SAMPLES_PER_HOUR
    return offsets, offsets >= down[None, :]


def _parts(model: FleetModel, table: str, hour: int) -> list[_Part]:
    n = len(model.node_ids)
    rng = np.random.default_rng([model.seed, _TABLE_CODES[table], hour])
    zero = np.zeros(n, dtype=np.int64)
    # a daily cycle, each node with its own phase, so hours differ as in a real fleet
    phase = 2 * np.pi * np.arange(n) / max(n, 1)
    day_frac = (hour % 24) / 24
    level = rng.uniform(0.5, 1.5, n) * (1 + 0.5 * np.sin(2 * np.pi * day_frac + phase))

    def ints(x: Any) -> np.ndarray:
        return np.floor(np.asarray(x, dtype=np.float64)).astype(np.int64)

    if table == "node_sample":
        base = rng.integers(10, 100, n)  # scrape time in 1/1024 s
        return [
            _Part(
                {}, {"scrape_seconds": (base, rng.integers(0, 2, n))}, {"scrape_seconds": 1 / 1024}
            )
        ]
    if table == "power_sample":
        power = ints(16 * (150 + 300 * level / 2))  # watts in 1/16 W
        power_step = rng.integers(0, 3, n)
        util = ints(1024 * np.clip(level / 2, 0, 0.6))  # in 1/1024
        util_step = rng.integers(0, (1024 - util) // (SAMPLES_PER_HOUR - 1) + 1)
        mem = ints(GPU_MEMORY_BYTES * rng.uniform(0.3, 0.9, n))
        mem_step = rng.integers(0, 1 << 20, n)
        return [
            _Part(
                {"gpu_index": 0},
                {
                    # energy over the 10 s since the last sample: power * 10 s
                    "energy_j": (power, power_step),
                    "power_w": (power, power_step),
                    "utilization_ratio": (util, util_step),
                    "memory_used_bytes": (mem, mem_step),
                },
                {"energy_j": 10 / 16, "power_w": 1 / 16, "utilization_ratio": 1 / 1024},
            )
        ]
    lookups = ints(600 * level)
    lookups_step = rng.integers(0, 4, n)
    hit_ratio = rng.uniform(0.2, 0.9, n)
    hits, hits_step = ints(lookups * hit_ratio), ints(lookups_step * hit_ratio)
    share = rng.uniform(0.0, 0.5, n)
    sharing, sharing_step = ints(hits * share), ints(hits_step * share)
    used = ints(CAPACITY_BYTES * rng.uniform(0.5, 0.9, n))
    used_step = ints((CAPACITY_BYTES - used) / (SAMPLES_PER_HOUR - 1) * rng.random(n))
    all_tier = {
        "lookups": (lookups, lookups_step),
        "lookup_tokens": (lookups * CHUNK_TOKENS, lookups_step * CHUNK_TOKENS),
        "hits": (hits, hits_step),
        "hit_tokens": (hits * CHUNK_TOKENS, hits_step * CHUNK_TOKENS),
        "reuse_hits": (hits - sharing, hits_step - sharing_step),
        "sharing_hits": (sharing, sharing_step),
        "evictions": (rng.integers(0, 20, n), rng.integers(0, 2, n)),
        "promotions": (rng.integers(0, 10, n), zero),
        "demotions": (rng.integers(0, 10, n), zero),
        "bytes_read": (hits * CHUNK_BYTES, hits_step * CHUNK_BYTES),
        "bytes_written": ((lookups - hits) * CHUNK_BYTES, (lookups_step - hits_step) * CHUNK_BYTES),
        "used_bytes": (used, used_step),
        "capacity_bytes": (np.full(n, CAPACITY_BYTES, dtype=np.int64), zero),
        "pinned_bytes": (rng.integers(0, 1 << 30, n), zero),
        "items": (used // CHUNK_BYTES, used_step // CHUNK_BYTES),
        # the node's reads: its hits, a few of them gone since their lookup
        "read_chunks": (hits, hits_step),
        "read_missing_chunks": (hits // 20, zero),
    }
    # the cpu tier serves a share of the hits and holds half of the bytes; lookups are made
    # against the node, so a tier row counts none
    cpu_share = rng.uniform(0.5, 1.0, n)
    cpu_tier = {c: (ints(b * cpu_share), ints(s * cpu_share)) for c, (b, s) in all_tier.items()}
    cpu_tier["lookups"] = cpu_tier["lookup_tokens"] = (zero, zero)
    # read counts are the node's only: the collector leaves a tier's NULL, the model 0 (the
    # same sums; integer columns stay integers)
    cpu_tier["read_chunks"] = cpu_tier["read_missing_chunks"] = (zero, zero)
    for gauge in ("used_bytes", "capacity_bytes", "pinned_bytes", "items"):
        base, step = all_tier[gauge]
        cpu_tier[gauge] = (base // 2, step // 2)
    return [_Part({"tier": "all"}, all_tier, {}), _Part({"tier": "cpu"}, cpu_tier, {})]


def _check_span(start_ms: int, end_ms: int) -> range:
    if start_ms % HOUR_MS or end_ms % HOUR_MS or end_ms < start_ms:
        raise InvalidArgument("the model's spans start and end on hour boundaries")
    return range(start_ms // HOUR_MS, end_ms // HOUR_MS)


def _check_table(table: str) -> None:
    if table not in GENERATED_TABLES:
        raise InvalidArgument(f"the model generates {', '.join(GENERATED_TABLES)}, not {table}")


def generate_samples(
    model: FleetModel, table: str, start_ms: int, end_ms: int
) -> dict[str, np.ndarray]:
    """The model's raw 10 s samples of ``table`` in [start, end) (hour boundaries), as columns
    (NaN where the value is NULL), in time order, node by node, tier by tier."""
    _check_table(table)
    ids = np.asarray(model.node_ids, dtype=np.int64)
    pieces: list[dict[str, np.ndarray]] = []
    for hour in _check_span(start_ms, end_ms):
        offsets, up = _hour_state(model, hour)
        k = np.arange(SAMPLES_PER_HOUR)[:, None]
        ts = hour * HOUR_MS + k * SAMPLE_INTERVAL_MS + model.jitter_ms[None, :]
        parts = _parts(model, table, hour)
        shape = (*offsets.shape, len(parts))  # (sample, node, part)
        # a down node answers nothing: only node_sample records the failed scrape
        keep = np.broadcast_to(up[..., None], shape) if table != "node_sample" else None
        cols: dict[str, np.ndarray] = {
            "node_id": np.broadcast_to(ids[None, :, None], shape),
            "ts_ms": np.broadcast_to(ts[..., None], shape),
        }
        for key in parts[0].keys:
            cols[key] = np.broadcast_to(np.array([p.keys[key] for p in parts]), shape)
        for col in parts[0].affine:
            values = np.stack(
                [p.affine[col][0] + p.affine[col][1] * offsets for p in parts], axis=-1
            )
            scale = parts[0].scale.get(col)
            cols[col] = values * scale if scale is not None else values
        if table == "node_sample":
            cols["scrape_seconds"] = np.where(up[..., None], cols["scrape_seconds"], np.nan)
            cols["up"] = up[..., None]
            cols["agent_started_s"] = np.full(shape, (HISTORY_END_MS - 30 * DAY_MS) / 1000)
            cols["nvml_available"] = np.ones(shape, dtype=bool)
            cols["error"] = np.where(up[..., None], None, "timed out").astype(object)
        elif table == "power_sample":
            cols["memory_total_bytes"] = np.full(shape, GPU_MEMORY_BYTES, dtype=np.int64)
        pieces.append(
            {
                c: (v[keep] if keep is not None else np.broadcast_to(v, shape).ravel())
                for c, v in cols.items()
            }
        )
    return _concat(pieces)


def generate_rollups(
    model: FleetModel, table: str, res: str, start_ms: int, end_ms: int
) -> dict[str, np.ndarray]:
    """The rows of rollup ``res`` ("1m", "1h" or "1d") of ``table`` for [start, end) (hour
    boundaries; day boundaries for "1d"): exactly what :func:`kvctl.db.rollup.rollup` writes
    from :func:`generate_samples`' samples, computed from the model without making them."""
    _check_table(table)
    if res not in ("1m", "1h", "1d"):
        raise InvalidArgument(f"no rollup {res!r}: 1m, 1h or 1d")
    if res == "1d":
        if start_ms % DAY_MS or end_ms % DAY_MS:
            raise InvalidArgument("daily rollups start and end on UTC day boundaries")
        return _daily(table, generate_rollups(model, table, "1h", start_ms, end_ms))
    width = SAMPLES_PER_MINUTE if res == "1m" else SAMPLES_PER_HOUR
    buckets = SAMPLES_PER_HOUR // width
    ids = np.asarray(model.node_ids, dtype=np.int64)
    n = len(ids)
    pieces: list[dict[str, np.ndarray]] = []
    sums = set(series(table).sums)
    for hour in _check_span(start_ms, end_ms):
        offsets, up = _hour_state(model, hour)
        o = offsets.reshape(buckets, width, n)
        v = up.reshape(buckets, width, n)
        count = v.sum(axis=1)  # (bucket, node): samples the node answered
        offset_sum = np.where(v, o, 0).sum(axis=1)
        offset_max = np.where(v, o, -1).max(axis=1)
        bucket_ms = hour * HOUR_MS + np.arange(buckets) * width * SAMPLE_INTERVAL_MS
        for part in _parts(model, table, hour):
            cols: dict[str, np.ndarray] = {
                "bucket_ms": np.broadcast_to(bucket_ms[:, None], count.shape),
                "node_id": np.broadcast_to(ids[None, :], count.shape),
            }
            for key, value in part.keys.items():
                cols[key] = np.full(count.shape, value)
            if table == "node_sample":
                cols["samples"] = np.full(count.shape, width)
                cols["up"] = count
            else:
                cols["samples"] = count
            for col, (base, step) in part.affine.items():
                total = count * base + offset_sum * step
                scale = part.scale.get(col)
                if col in sums:  # a counter: its sum
                    cols[col] = total * scale if scale is not None else total
                    continue
                top = base + offset_max * step
                none = count == 0  # no reading: SQL's SUM and MAX are NULL, COUNT 0
                cols[f"{col}_sum"] = np.where(none, np.nan, total * (scale or 1.0))
                cols[f"{col}_max"] = np.where(none, np.nan, top * (scale or 1.0))
                cols[f"{col}_n"] = count
            # a bucket with no sample has no row; node_sample rows exist for every scrape
            keep = np.ones(count.shape, dtype=bool) if table == "node_sample" else count > 0
            pieces.append({c: np.broadcast_to(a, count.shape)[keep] for c, a in cols.items()})
    return _concat(pieces)


def _daily(table: str, hourly: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hourly rollup rows summed into UTC days per series key, as SQL's SUM/MAX would (NULLs
    skipped; NULL where a day has no reading)."""
    if not hourly:
        return {}
    s = series(table)
    day = hourly["bucket_ms"] // DAY_MS * DAY_MS
    code = np.zeros(len(day), dtype=np.int64)
    for col in (day, *(hourly[k] for k in s.keys)):
        values, inverse = np.unique(col, return_inverse=True)
        code = code * len(values) + inverse
    _, first, group = np.unique(code, return_index=True, return_inverse=True)
    groups = len(first)
    out: dict[str, np.ndarray] = {"bucket_ms": day[first]}
    out.update({k: hourly[k][first] for k in s.keys})
    for col, arr in hourly.items():
        if col in out:
            continue
        if col.endswith("_max"):
            acc = np.full(groups, -np.inf)
            np.fmax.at(acc, group, arr)
            out[col] = np.where(np.isneginf(acc), np.nan, acc)
        elif arr.dtype.kind == "f":
            acc = np.zeros(groups)
            seen = np.zeros(groups, dtype=bool)
            np.add.at(acc, group, np.nan_to_num(arr))
            np.logical_or.at(seen, group, ~np.isnan(arr))
            out[col] = np.where(seen, acc, np.nan)
        else:
            acc_int = np.zeros(groups, dtype=np.int64)
            np.add.at(acc_int, group, arr)
            out[col] = acc_int
    return out


def _concat(pieces: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    if not pieces:
        return {}
    return {c: np.concatenate([p[c] for p in pieces]) for c in pieces[0]}


def column_rows(
    cols: Mapping[str, np.ndarray], names: Sequence[str] | None = None
) -> list[tuple[Any, ...]]:
    """Columns as row tuples of Python values, NaN as None (SQL NULL)."""
    names = list(cols) if names is None else list(names)
    lists: list[list[Any]] = []
    for name in names:
        arr = cols[name]
        values = arr.tolist()
        if arr.dtype.kind == "f" and np.isnan(arr).any():
            values = [None if x != x else x for x in values]  # x != x: NaN
        lists.append(values)
    return list(zip(*lists, strict=True))


def _write(conn: Connection, table: SqlTable, cols: Mapping[str, np.ndarray]) -> int:
    """Bulk write for generating the history (not timed): COPY / executemany of tuples."""
    if not cols or not len(next(iter(cols.values()))):
        return 0
    names = [table.c[c].name for c in cols]
    rows = column_rows(cols, names)
    quoted = ", ".join(f'"{c}"' for c in names)
    if conn.dialect.name == "postgresql":
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.cursor() as cur, cur.copy(f'COPY "{table.name}" ({quoted}) FROM STDIN') as cp:
            for row in rows:
                cp.write_row(row)
    else:
        marks = ", ".join("?" * len(names))
        conn.exec_driver_sql(f'INSERT INTO "{table.name}" ({quoted}) VALUES ({marks})', rows)
    return len(rows)


# --- the benchmark --------------------------------------------------------------------------
def run_db_bench(
    *,
    rows: int = DEFAULT_ROWS,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    nodes: int = DEFAULT_NODES,
    dcs: int = DEFAULT_DCS,
    days: int = DEFAULT_DAYS,
    repeats: int = DEFAULT_REPEATS,
    raw_hours: int = DEFAULT_RAW_HOURS,
    minute_hours: int = DEFAULT_MINUTE_HOURS,
    pg: bool = True,
    pg_admin_url: str | None = None,
    seed: int = 0,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the benchmark on SQLite and, when reachable, PostgreSQL; see the module docstring
    for the result's layout. ``pg_admin_url`` (default ``KVCTL_TEST_PG_URL``, else a local
    server as ``postgres``) must be allowed to create databases; given explicitly, an
    unreachable server is an error rather than a skip."""
    if min(rows, batch_rows, nodes, dcs, days, repeats, raw_hours) < 1:
        raise InvalidArgument("rows, batch, nodes, dcs, days, repeats and raw hours must be >= 1")
    if dcs > nodes:
        raise InvalidArgument(f"{dcs} DCs need at least as many nodes, got {nodes}")
    if raw_hours >= days * 24:
        raise InvalidArgument(f"{raw_hours} raw hours leave no older history in {days} days")
    from kvctl.db.engine import display_url, resolve_url

    minute_hours = min(max(minute_hours, raw_hours), days * 24)
    say = progress or (lambda _msg: None)
    started_s = time.perf_counter()
    config: dict[str, Any] = {
        "rows": rows,
        "batch_rows": batch_rows,
        "nodes": nodes,
        "dcs": dcs,
        "days": days,
        "repeats": repeats,
        "raw_hours": raw_hours,
        "minute_hours": minute_hours,
        "sample_interval_ms": SAMPLE_INTERVAL_MS,
        "seed": seed,
        "pg_admin_url": None,
    }
    args = (rows, batch_rows, nodes, dcs, days, repeats, raw_hours, minute_hours, seed, say)
    # before the long SQLite half: an explicit URL that does not answer fails fast
    admin_url = pg_admin_url or os.environ.get("KVCTL_TEST_PG_URL") or DEFAULT_PG_ADMIN_URL
    skip = "--no-pg" if not pg else _pg_unreachable(admin_url, explicit=pg_admin_url is not None)
    if pg:
        config["pg_admin_url"] = display_url(resolve_url(admin_url))
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-db-") as tmp:
        say("sqlite: temporary database file")
        sqlite_result = _bench_backend(_sqlite_db(Path(tmp) / "metrics.db"), *args)
    if skip is not None:
        say(f"postgresql: skipped ({skip})")
        postgresql: dict[str, Any] = {"skipped": skip}
    else:
        postgresql = _bench_backend(_pg_db(admin_url, say), *args)
    return {
        "benchmark": "db",
        "host": host_info(),
        "config": config,
        "elapsed_s": time.perf_counter() - started_s,
        "sqlite": sqlite_result,
        "postgresql": postgresql,
        "targets": dict(TARGETS),
        "meets_targets": {
            "sqlite": _meets(sqlite_result),
            "postgresql": None if "skipped" in postgresql else _meets(postgresql),
        },
        "notes": _notes(config),
    }


def _meets(backend: dict[str, Any]) -> dict[str, bool]:
    slowest_s = max(
        fig["median_s"]
        for query in SUMMARY_QUERIES
        for name, fig in backend[query].items()
        if name.startswith("last_")
    )
    return {
        "ingest_rows_per_s": backend["ingest"]["rows_per_s"] >= TARGETS["ingest_rows_per_s"],
        "fleet_summary_s": slowest_s < TARGETS["fleet_summary_s"],
    }


def _notes(config: dict[str, Any]) -> list[str]:
    return [
        f"every figure but rollup is the median of {config['repeats']} samples; a figure and "
        "its reference alternate, so drift hits both alike",
        "ingest: each sample writes the same rows into an emptied table; rows are dicts built "
        "before timing (insert_rows' input), the reference's tuples likewise",
        f"history: {config['nodes']} nodes x {config['days']} days at 10 s. Older than the last "
        f"{config['raw_hours']} h it is written as generated rollup rows (1 h over the whole "
        f"span, 1 m over the last {config['minute_hours']} h before the raw tail), equal to what "
        "rolling up the model's 10 s samples gives; the raw tail is real 10 s samples rolled up "
        "by rollup_all. Production keeps raw samples 2 days and 1-minute rollups 30 days, so "
        "its raw and 1-minute tables are larger than here; the summary reads them only for the "
        "last hour of a window, through the time index",
        "fleet summary: timed on one open connection after one untimed run (warm caches), "
        "now = the end of the history; the collector's 2-minute grace leaves the last 2 "
        "minutes raw and the last hour in 1-minute rollups",
        "PostgreSQL: VACUUM ANALYZE after loading, as autovacuum would have done on a server "
        "that has been running; SQLite: no ANALYZE, as kvctl never runs one",
        "ratio_to_reference: rows per second over the reference's (ingest, rollup); seconds "
        "over the reference's (fleet summary: how many full scans of cache_1h it costs)",
    ]


class _RefWriter:
    """The driver's plain path into a scratch table: ``reset`` empties it, ``write`` writes."""

    def reset(self) -> None:
        raise NotImplementedError

    def write(self, batches: Sequence[Sequence[tuple[Any, ...]]]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _SqliteRef(_RefWriter):
    def __init__(self, path: Path, names: Sequence[str]) -> None:
        self.conn = sqlite3.connect(path)
        # the pragmas kvctl's engine sets (see kvctl.db.engine)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA busy_timeout=10000")
        with self.conn:
            self.conn.execute(f"DROP TABLE IF EXISTS {_SCRATCH_TABLE}")
            # same columns and affinities, no primary key, no index
            self.conn.execute(
                f"CREATE TABLE {_SCRATCH_TABLE} AS SELECT * FROM cache_sample WHERE 0"
            )
        quoted = ", ".join(f'"{c}"' for c in names)
        marks = ", ".join("?" * len(names))
        self.sql = f"INSERT INTO {_SCRATCH_TABLE} ({quoted}) VALUES ({marks})"

    def reset(self) -> None:
        with self.conn:
            self.conn.execute(f"DELETE FROM {_SCRATCH_TABLE}")

    def write(self, batches: Sequence[Sequence[tuple[Any, ...]]]) -> None:
        for batch in batches:
            with self.conn:  # one transaction per batch, as the measured path
                self.conn.executemany(self.sql, batch)

    def close(self) -> None:
        with self.conn:
            self.conn.execute(f"DROP TABLE IF EXISTS {_SCRATCH_TABLE}")
        self.conn.close()


class _PgRef(_RefWriter):
    def __init__(self, url: str, names: Sequence[str]) -> None:
        import psycopg
        from sqlalchemy.engine import make_url

        conninfo = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.conn.execute(f"DROP TABLE IF EXISTS {_SCRATCH_TABLE}")
        # a plain (logged) table like cache_sample: same columns, no primary key, no index
        self.conn.execute(f"CREATE TABLE {_SCRATCH_TABLE} (LIKE cache_sample)")
        quoted = ", ".join(f'"{c}"' for c in names)
        self.sql = f"COPY {_SCRATCH_TABLE} ({quoted}) FROM STDIN"

    def reset(self) -> None:
        self.conn.execute(f"TRUNCATE {_SCRATCH_TABLE}")

    def write(self, batches: Sequence[Sequence[tuple[Any, ...]]]) -> None:
        for batch in batches:
            with self.conn.transaction(), self.conn.cursor() as cur, cur.copy(self.sql) as cp:
                for row in batch:
                    cp.write_row(row)

    def close(self) -> None:
        self.conn.execute(f"DROP TABLE IF EXISTS {_SCRATCH_TABLE}")
        self.conn.close()


@dataclass(frozen=True, slots=True)
class _Backend:
    name: str
    database: str
    url: str
    engine: Engine
    server_version: str
    reference: Callable[[Sequence[str]], _RefWriter]
    reference_what: str


@contextlib.contextmanager
def _sqlite_db(path: Path) -> Iterator[_Backend]:
    from kvctl.db.migrate import open_db

    url = f"sqlite:///{path}"
    engine = open_db(url, auto_upgrade=True)
    try:
        yield _Backend(
            "sqlite",
            "a temporary file (WAL, synchronous=NORMAL, as kvctl opens it)",
            url,
            engine,
            sqlite3.sqlite_version,
            lambda names: _SqliteRef(path, names),
            "sqlite3 executemany of tuples, one transaction per batch, into a table of the same "
            "columns without primary key or index (WAL, synchronous=NORMAL)",
        )
    finally:
        engine.dispose()


def _pg_unreachable(admin_url: str, *, explicit: bool) -> str | None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import SQLAlchemyError

    from kvctl.db.engine import DatabaseError, display_url, resolve_url

    url = resolve_url(admin_url)
    if not url.startswith("postgresql"):
        raise InvalidArgument(f"not a PostgreSQL URL: {display_url(url)}")
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except SQLAlchemyError as exc:
        reason = f"PostgreSQL not reachable at {display_url(url)}: {getattr(exc, 'orig', exc)}"
        if explicit:
            raise DatabaseError(reason) from None
        return reason.strip()
    finally:
        engine.dispose()
    return None


@contextlib.contextmanager
def _pg_db(admin_url: str, say: Progress) -> Iterator[_Backend]:
    """A throwaway database on the server, dropped WITH (FORCE) on the way out, errors too."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from kvctl.db.engine import resolve_url
    from kvctl.db.migrate import open_db

    name = bench_database_name()
    admin = create_engine(resolve_url(admin_url), isolation_level="AUTOCOMMIT")
    url = make_url(admin.url).set(database=name).render_as_string(hide_password=False)
    engine: Engine | None = None
    try:
        with admin.connect() as conn:
            # only a dead process with our pid can have left it behind
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        say(f"postgresql: throwaway database {name}")
        try:
            engine = open_db(url, auto_upgrade=True)
            with engine.connect() as conn:
                version = str(conn.execute(text("SHOW server_version")).scalar_one())
            yield _Backend(
                "postgresql",
                f"throwaway database {name}, dropped at the end",
                url,
                engine,
                version,
                lambda names: _PgRef(url, names),
                "psycopg COPY of tuples, one transaction per batch, into a plain (logged) table "
                "of the same columns without primary key or index",
            )
        finally:
            if engine is not None:
                engine.dispose()
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


def bench_database_name() -> str:
    """The throwaway PostgreSQL database of this process's runs."""
    return f"kvctl_bench_{os.getpid()}"


def _bench_backend(
    db: contextlib.AbstractContextManager[_Backend],
    rows: int,
    batch_rows: int,
    nodes: int,
    dcs: int,
    days: int,
    repeats: int,
    raw_hours: int,
    minute_hours: int,
    seed: int,
    say: Progress,
) -> dict[str, Any]:
    with db as backend:
        out: dict[str, Any] = {
            "database": backend.database,
            "server_version": backend.server_version,
        }
        out["ingest"] = _bench_ingest(backend, rows, batch_rows, nodes, repeats, seed, say)
        history, rollup, expected = _load_history(
            backend, nodes, dcs, days, raw_hours, minute_hours, seed, say
        )
        out["history"] = history
        out["rollup"] = rollup
        for query in SUMMARY_QUERIES:
            out[query] = _bench_summary(backend, days, repeats, expected, say, query)
        return out


# --- ingest ---------------------------------------------------------------------------------
def _ingest_rows(rows: int, nodes: int, seed: int) -> tuple[list[str], list[tuple[Any, ...]]]:
    """``rows`` cache samples of the model, in the order a collector writes them."""
    model = FleetModel(tuple(range(1, nodes + 1)), seed=seed + 1)
    start_ms = HISTORY_END_MS
    pieces: list[dict[str, np.ndarray]] = []
    have = 0
    while have < rows:
        piece = generate_samples(model, "cache_sample", start_ms, start_ms + HOUR_MS)
        pieces.append(piece)
        have += len(piece["ts_ms"])
        start_ms += HOUR_MS
    cols = {c: a[:rows] for c, a in _concat(pieces).items()}
    return list(cols), column_rows(cols)


def _bench_ingest(
    backend: _Backend,
    rows: int,
    batch_rows: int,
    nodes: int,
    repeats: int,
    seed: int,
    say: Progress,
) -> dict[str, Any]:
    from sqlalchemy import text

    from kvctl.db.ingest import insert_rows

    say(f"{backend.name}: ingest {rows:,} rows in batches of {batch_rows:,}, {repeats} repeats")
    names, tuples = _ingest_rows(rows, nodes, seed)
    dicts = [dict(zip(names, t, strict=True)) for t in tuples]
    tuple_batches = [tuples[i : i + batch_rows] for i in range(0, rows, batch_rows)]
    dict_batches = [dicts[i : i + batch_rows] for i in range(0, rows, batch_rows)]
    table = raw_table("cache_sample")
    empty = "DELETE FROM cache_sample" if backend.name == "sqlite" else "TRUNCATE cache_sample"
    measured_s: list[float] = []
    reference_s: list[float] = []
    ref = backend.reference(names)
    try:

        def reference() -> None:
            ref.reset()
            t0 = time.perf_counter()
            ref.write(tuple_batches)
            reference_s.append(time.perf_counter() - t0)

        def measured() -> None:
            with backend.engine.begin() as conn:
                conn.execute(text(empty))
            t0 = time.perf_counter()
            for batch in dict_batches:
                with backend.engine.begin() as conn:
                    insert_rows(conn, table, batch)
            measured_s.append(time.perf_counter() - t0)

        alternating(repeats, reference, measured)
    finally:
        ref.close()
    with backend.engine.begin() as conn:
        stored = conn.execute(text("SELECT count(*) FROM cache_sample")).scalar_one()
        conn.execute(text(empty))  # the history starts from empty tables
    if stored != rows:
        raise RuntimeError(f"{backend.name}: wrote {rows} rows, found {stored}")
    rates = [rows / max(s, 1e-9) for s in measured_s]
    ref_rates = [rows / max(s, 1e-9) for s in reference_s]
    rate = statistics.median(rates)
    ref_rate = statistics.median(ref_rates)
    return {
        "table": "cache_sample",
        "rows": rows,
        "batch_rows": batch_rows,
        "what": "kvctl.db.ingest.insert_rows of dicts, one transaction per batch (engine.begin)",
        "rows_per_s": rate,
        "samples_rows_per_s": rates,
        "reference": {
            "what": backend.reference_what,
            "rows_per_s": ref_rate,
            "samples_rows_per_s": ref_rates,
        },
        "ratio_to_reference": rate / ref_rate,
    }


# --- history --------------------------------------------------------------------------------
@dataclass(slots=True)
class _Expected:
    """Lookups and hits of tier ``all`` per hour of the history, from the model."""

    start_ms: int
    lookups: np.ndarray
    hits: np.ndarray

    def add(self, cols: Mapping[str, np.ndarray]) -> None:
        if not cols:
            return
        mine = cols["tier"] == "all"
        hour = (cols["bucket_ms"][mine] - self.start_ms) // HOUR_MS
        np.add.at(self.lookups, hour, cols["lookups"][mine])
        np.add.at(self.hits, hour, cols["hits"][mine])

    def window(self, start_ms: int, end_ms: int) -> tuple[int, int]:
        a, b = (start_ms - self.start_ms) // HOUR_MS, (end_ms - self.start_ms) // HOUR_MS
        return int(self.lookups[a:b].sum()), int(self.hits[a:b].sum())


def _add_inventory(engine: Engine, nodes: int, dcs: int) -> tuple[int, ...]:
    from kvctl.db.inventory import add_dc, add_node

    ids: list[int] = []
    with engine.begin() as conn:
        for d in range(dcs):
            add_dc(conn, f"dc-{d:02d}", region=f"region-{d % 3}", carbon_g_per_kwh=300.0, pue=1.3)
        for i in range(nodes):
            dc = i * dcs // nodes  # contiguous blocks, as evenly as the counts allow
            ids.append(
                add_node(
                    conn,
                    f"node-{i:05d}",
                    dc=f"dc-{dc:02d}",
                    agent_url=f"http://10.{dc}.{i // 256}.{i % 256}:8470",
                    gpu_model="H100",
                    check_agent=False,  # unique by construction; the check reads every node
                )
            )
    return tuple(ids)


def _load_history(
    backend: _Backend,
    nodes: int,
    dcs: int,
    days: int,
    raw_hours: int,
    minute_hours: int,
    seed: int,
    say: Progress,
) -> tuple[dict[str, Any], dict[str, Any], _Expected]:
    from sqlalchemy import text

    from kvctl.db.rollup import rollup_all, set_watermark, watermark

    engine = backend.engine
    end_ms = HISTORY_END_MS
    start_ms = end_ms - days * DAY_MS
    raw_start_ms = end_ms - raw_hours * HOUR_MS
    minute_start_ms = end_ms - minute_hours * HOUR_MS
    t0 = time.perf_counter()
    model = FleetModel(_add_inventory(engine, nodes, dcs), seed=seed)
    expected = _Expected(start_ms, np.zeros(days * 24, np.int64), np.zeros(days * 24, np.int64))
    # days are rolled up once all their hours are: the last whole day before the raw samples
    day_end_ms = raw_start_ms // DAY_MS * DAY_MS
    written: dict[str, dict[str, int]] = {"1d": {}, "1h": {}, "1m": {}, "raw": {}}
    say(
        f"{backend.name}: history of {nodes:,} nodes x {days} days: daily and 1-hour rollups, "
        f"1-minute rollups of the last {minute_hours} h, raw samples of the last {raw_hours} h"
    )

    def write(res: str, table: str, cols: dict[str, np.ndarray]) -> None:
        target = ROLLUPS[table, res]
        with engine.begin() as conn:
            n = _write(conn, target, cols)
        written[res][target.name] = written[res].get(target.name, 0) + n

    for table in GENERATED_TABLES:
        for res, lo in (("1h", start_ms), ("1m", minute_start_ms)):
            step_ms = DAY_MS if res == "1h" else HOUR_MS  # bounded memory per transaction
            for a in range(lo, raw_start_ms, step_ms):
                cols = generate_rollups(model, table, res, a, min(a + step_ms, raw_start_ms))
                if table == "cache_sample" and res == "1h":
                    expected.add(cols)
                write(res, table, cols)
                if res == "1h" and a + DAY_MS <= day_end_ms:
                    write("1d", table, _daily(table, cols))
        with engine.begin() as conn:
            # what rollup_all would have recorded after rolling those up
            for res in ("1m", "1h"):
                set_watermark(conn, table, res, raw_start_ms)
            set_watermark(conn, table, "1d", day_end_ms)
        for a in range(raw_start_ms, end_ms, HOUR_MS):
            with engine.begin() as conn:
                n = _write(conn, raw_table(table), generate_samples(model, table, a, a + HOUR_MS))
            written["raw"][table] = written["raw"].get(table, 0) + n
        say(f"{backend.name}: {table} written ({time.perf_counter() - t0:.0f} s so far)")
    expected.add(generate_rollups(model, "cache_sample", "1h", raw_start_ms, end_ms))
    generation_s = time.perf_counter() - t0

    say(f"{backend.name}: rollup_all over {sum(written['raw'].values()):,} raw samples")
    t0 = time.perf_counter()
    rolled = rollup_all(engine.begin, end_ms)
    rollup_s = time.perf_counter() - t0
    with engine.connect() as conn:
        marks = {
            f"{t}:{r}": watermark(conn, t, r) for t in GENERATED_TABLES for r in ("1m", "1h", "1d")
        }
        # reference: a full scan of the raw tables the rollup read, right after it; sum(ts_ms),
        # not count(*), which SQLite answers from b-tree pages without reading the rows
        t0 = time.perf_counter()
        scanned = 0
        for t in GENERATED_TABLES:
            count, _ = conn.execute(text(f"SELECT count(*), sum(ts_ms) FROM {t}")).one()
            scanned += count
        scan_s = time.perf_counter() - t0
    raw_rows = sum(written["raw"].values())
    if scanned != raw_rows:
        raise RuntimeError(f"{backend.name}: wrote {raw_rows} raw samples, found {scanned}")

    vacuum_s: float | None = None
    if backend.name == "postgresql":
        say("postgresql: VACUUM ANALYZE")
        t0 = time.perf_counter()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE"))
        vacuum_s = time.perf_counter() - t0
    history = {
        "nodes": nodes,
        "dcs": dcs,
        "days": days,
        "start_ms": start_ms,
        "end_ms": end_ms,
        "series": {
            "cache_sample": f"tiers {', '.join(TIERS)}",
            "node_sample": "one scrape per node",
            "power_sample": "one GPU per node",
        },
        "generated_as_rollups": {
            "1d": {"from_ms": start_ms, "to_ms": day_end_ms, "rows": written["1d"]},
            "1h": {"from_ms": start_ms, "to_ms": raw_start_ms, "rows": written["1h"]},
            "1m": {"from_ms": minute_start_ms, "to_ms": raw_start_ms, "rows": written["1m"]},
        },
        "raw_samples": {"from_ms": raw_start_ms, "to_ms": end_ms, "rows": written["raw"]},
        "watermarks_ms": marks,
        "generation_s": generation_s,
        "vacuum_analyze_s": vacuum_s,
    }
    rate = raw_rows / max(rollup_s, 1e-9)
    scan_rate = raw_rows / max(scan_s, 1e-9)
    rollup = {
        "what": f"kvctl.db.rollup.rollup_all(now = end, grace {DEFAULT_GRACE_MS // 1000} s)",
        "raw_rows": raw_rows,
        "rows_written": rolled,
        "elapsed_s": rollup_s,
        "raw_rows_per_s": rate,
        "reference": {
            "what": "SELECT count(*), sum(ts_ms) of each raw table, right after the rollup",
            "elapsed_s": scan_s,
            "raw_rows_per_s": scan_rate,
        },
        "ratio_to_reference": rate / scan_rate,
    }
    return history, rollup, expected


# --- fleet summary --------------------------------------------------------------------------
def _fleet_summary_total(conn: Any, start_ms: int, end_ms: int) -> Any:
    from kvctl.db.analytics.summary import fleet_summary

    return fleet_summary(conn, start_ms, end_ms).total


def _dashboard_overview_total(conn: Any, start_ms: int, end_ms: int) -> Any:
    from kvctl.db.analytics.counts import Assumptions
    from kvctl.db.analytics.overview import overview
    from kvctl.db.analytics.windows import Window
    from kvctl.profiles import DEFAULT_GPU, DEFAULT_MFU, DEFAULT_MODEL, MODELS

    assume = Assumptions(MODELS[DEFAULT_MODEL], DEFAULT_GPU, DEFAULT_MFU)
    return overview(conn, Window("bench", start_ms, end_ms, HOUR_MS), assume).fleet


#: the queries timed over the history: each returns totals with ``lookups`` and ``hits``
SUMMARY_QUERIES: Final = {
    "fleet_summary": _fleet_summary_total,
    "dashboard_overview": _dashboard_overview_total,
}


def _bench_summary(
    backend: _Backend,
    days: int,
    repeats: int,
    expected: _Expected,
    say: Progress,
    query: str = "fleet_summary",
) -> dict[str, Any]:
    from sqlalchemy import text

    run_query = SUMMARY_QUERIES[query]
    end_ms = HISTORY_END_MS
    windows = {f"last_{days}d": days * DAY_MS, "last_24h": DAY_MS, "last_1h": HOUR_MS}
    if days == 1:
        del windows["last_24h"]  # the same window twice
    say(f"{backend.name}: {query} over {', '.join(windows)}, {repeats} repeats")
    samples: dict[str, list[float]] = {name: [] for name in windows}
    ref_s: list[float] = []
    # sum(lookups) makes SQLite read the table; count(*) alone walks the bucket_ms index
    scan = "SELECT count(*), sum(lookups) FROM cache_1h"
    check: dict[str, Any] = {}
    with backend.engine.connect() as conn:
        ref_rows = conn.execute(text(scan)).one()[0]  # warms the reference too
        for name, width_ms in windows.items():
            total = run_query(conn, end_ms - width_ms, end_ms)
            want_lookups, want_hits = expected.window(end_ms - width_ms, end_ms)
            check[name] = {
                "lookups": total.lookups,
                "expected_lookups": want_lookups,
                "hits": total.hits,
                "expected_hits": want_hits,
                "nodes": total.nodes,
            }

        def reference() -> None:
            t0 = time.perf_counter()
            conn.execute(text(scan)).one()
            ref_s.append(time.perf_counter() - t0)

        def measured() -> None:
            for name, width_ms in windows.items():
                t0 = time.perf_counter()
                run_query(conn, end_ms - width_ms, end_ms)
                samples[name].append(time.perf_counter() - t0)

        alternating(repeats, reference, measured)
    ref_median_s = statistics.median(ref_s)
    out: dict[str, Any] = {
        name: {
            "window_ms": windows[name],
            "median_s": statistics.median(s),
            "samples_s": s,
            "ratio_to_reference": statistics.median(s) / max(ref_median_s, 1e-9),
        }
        for name, s in samples.items()
    }
    out["reference"] = {
        "what": scan,
        "rows": ref_rows,
        "median_s": ref_median_s,
        "samples_s": ref_s,
    }
    exact = all(
        c["lookups"] == c["expected_lookups"] and c["hits"] == c["expected_hits"]
        for c in check.values()
    )
    out["check"] = {"exact": exact, "windows": check}
    if not exact:
        raise RuntimeError(f"{backend.name}: {query} disagrees with the model: {check}")
    return out


# --- output ---------------------------------------------------------------------------------
def render_db_bench(result: dict[str, Any]) -> Table:
    """A table for people: each figure beside its reference, the ratio and the target."""
    from rich.table import Table

    table = Table(
        title=f"kvctl metrics database (median of {result['config']['repeats']} repeats)",
        caption=(
            f"history: {result['config']['nodes']:,} nodes x {result['config']['days']} days at "
            f"10 s, older than {result['config']['raw_hours']} h generated as rollups; ingest "
            f"target >= {TARGETS['ingest_rows_per_s']:,} rows/s, fleet summary < "
            f"{TARGETS['fleet_summary_s'] * 1000:.0f} ms"
        ),
    )
    for col in ("backend", "figure", "value", "reference", "ref. value", "ratio", "target"):
        table.add_column(
            col, justify="right" if col in ("value", "ref. value", "ratio") else "left"
        )
    for name in ("sqlite", "postgresql"):
        b = result[name]
        if "skipped" in b:
            table.add_row(name, "skipped", "", b["skipped"], "", "", "")
            table.add_section()
            continue
        met = result["meets_targets"][name]
        ing = b["ingest"]
        table.add_row(
            name,
            f"ingest, batches of {ing['batch_rows']:,}",
            f"{ing['rows_per_s']:,.0f} rows/s",
            "driver, no PK (" + ("executemany" if name == "sqlite" else "COPY") + ")",
            f"{ing['reference']['rows_per_s']:,.0f} rows/s",
            f"{ing['ratio_to_reference']:.2f}",
            "met" if met["ingest_rows_per_s"] else "MISSED",
        )
        ru = b["rollup"]
        table.add_row(
            name,
            f"rollup_all ({ru['raw_rows']:,} raw rows)",
            f"{ru['raw_rows_per_s']:,.0f} rows/s",
            "full scan of raw tables",
            f"{ru['reference']['raw_rows_per_s']:,.0f} rows/s",
            f"{ru['ratio_to_reference']:.2f}",
            "",
        )
        for query in SUMMARY_QUERIES:
            _summary_rows(table, name, query, b[query])
        table.add_section()
    return table


def _summary_rows(table: Table, name: str, query: str, fs: dict[str, Any]) -> None:
    ref = fs["reference"]
    for window, fig in fs.items():
        if not window.startswith("last_"):
            continue
        table.add_row(
            name,
            f"{query.replace('_', ' ')}, {window.replace('_', ' ')}",
            f"{fig['median_s'] * 1000:,.1f} ms",
            f"scan of cache_1h ({ref['rows']:,} rows)",
            f"{ref['median_s'] * 1000:,.1f} ms",
            f"{fig['ratio_to_reference']:.2f}",
            "met" if fig["median_s"] < TARGETS["fleet_summary_s"] else "MISSED",
        )
