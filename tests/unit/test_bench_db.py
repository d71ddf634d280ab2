"""`kvctl bench db`: result structure, an exact generated history, clean-up of the throwaway
PostgreSQL database, input validation and the CLI. Timings are never asserted."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select, text
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

import kvctl.bench.db as bench_db
from kvctl.bench.db import (
    GENERATED_TABLES,
    HISTORY_END_MS,
    FleetModel,
    _write,
    bench_database_name,
    column_rows,
    generate_rollups,
    generate_samples,
    render_db_bench,
    run_db_bench,
)
from kvctl.cli.main import app
from kvctl.db.engine import DatabaseError
from kvctl.db.models import ROLLUPS, raw_table
from kvctl.db.rollup import DAY_MS, HOUR_MS, rollup_all
from kvctl.errors import InvalidArgument

TINY: dict[str, Any] = {
    "rows": 2000,
    "batch_rows": 500,
    "nodes": 6,
    "dcs": 2,
    "days": 1,
    "repeats": 1,
}
WINDOWS = ("last_1d", "last_1h")  # with days=1 the 24 h window is the 1 d one


@pytest.fixture(scope="module")
def sqlite_run() -> dict[str, Any]:
    # one tiny run shared by the structure tests: the benchmark is the slow part
    return run_db_bench(**TINY, pg=False)


def _positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _model_lookups(nodes: int, start_ms: int, end_ms: int) -> tuple[int, int]:
    """Lookups and hits of tier ``all`` over [start, end), from the model's rollups and,
    separately, from its raw samples: the two must agree, and the summary with them."""
    # a fresh database numbers nodes from 1, in the order the benchmark adds them
    model = FleetModel(tuple(range(1, nodes + 1)))
    rolled = generate_rollups(model, "cache_sample", "1h", start_ms, end_ms)
    mine = rolled["tier"] == "all"
    raw = generate_samples(model, "cache_sample", start_ms, end_ms)
    raw_mine = raw["tier"] == "all"
    lookups = int(rolled["lookups"][mine].sum())
    assert lookups == int(raw["lookups"][raw_mine].sum())
    assert int(rolled["hits"][mine].sum()) == int(raw["hits"][raw_mine].sum())
    return lookups, int(rolled["hits"][mine].sum())


def _check_backend(result: dict[str, Any]) -> None:
    ing = result["ingest"]
    assert ing["rows"] == TINY["rows"] and ing["batch_rows"] == TINY["batch_rows"]
    assert _positive(ing["rows_per_s"]) and _positive(ing["reference"]["rows_per_s"])
    assert len(ing["samples_rows_per_s"]) == TINY["repeats"]
    assert ing["ratio_to_reference"] == pytest.approx(
        ing["rows_per_s"] / ing["reference"]["rows_per_s"]
    )

    hist = result["history"]
    nodes, days = TINY["nodes"], TINY["days"]
    raw_hours = 2
    assert hist["end_ms"] - hist["start_ms"] == days * DAY_MS
    assert hist["raw_samples"]["from_ms"] == hist["end_ms"] - raw_hours * HOUR_MS
    # node_sample has a row per scrape; one per node-hour in 1 h, per node-minute in 1 m
    older_hours = days * 24 - raw_hours
    assert hist["generated_as_rollups"]["1h"]["rows"]["node_1h"] == nodes * older_hours
    minute_hours = hist["raw_samples"]["from_ms"] - hist["generated_as_rollups"]["1m"]["from_ms"]
    assert hist["generated_as_rollups"]["1m"]["rows"]["node_1m"] == nodes * minute_hours // 60_000
    assert hist["raw_samples"]["rows"]["node_sample"] == nodes * raw_hours * 360
    # the real rollup finished what the watermarks left: up to 2 minutes (1 m) and 1 hour
    # (1 h) before the end; the last day is not whole before then
    assert hist["watermarks_ms"]["cache_sample:1m"] == hist["end_ms"] - 120_000
    assert hist["watermarks_ms"]["cache_sample:1h"] == hist["end_ms"] - HOUR_MS
    assert hist["watermarks_ms"]["cache_sample:1d"] == hist["end_ms"] - DAY_MS
    assert hist["generated_as_rollups"]["1d"]["rows"].get("node_1d", 0) == nodes * (days - 1)

    rollup = result["rollup"]
    assert rollup["raw_rows"] == sum(hist["raw_samples"]["rows"].values())
    assert rollup["rows_written"]["node_1h"] == nodes
    assert _positive(rollup["raw_rows_per_s"]) and _positive(rollup["reference"]["raw_rows_per_s"])

    ov = result["dashboard_overview"]  # the dashboard's fleet page, checked the same way
    assert set(ov) == {*WINDOWS, "reference", "check"} and ov["check"]["exact"] is True
    assert ov["check"]["windows"] == result["fleet_summary"]["check"]["windows"]
    fs = result["fleet_summary"]
    assert set(fs) == {*WINDOWS, "reference", "check"}
    for name in WINDOWS:
        assert _positive(fs[name]["median_s"]) and len(fs[name]["samples_s"]) == TINY["repeats"]
    assert fs["reference"]["rows"] == (
        hist["generated_as_rollups"]["1h"]["rows"]["cache_1h"] + rollup["rows_written"]["cache_1h"]
    )
    assert fs["check"]["exact"] is True
    for name, width_ms in (("last_1d", DAY_MS), ("last_1h", HOUR_MS)):
        got = fs["check"]["windows"][name]
        want = _model_lookups(nodes, hist["end_ms"] - width_ms, hist["end_ms"])
        assert (got["lookups"], got["hits"]) == want
        assert got["lookups"] > 0 and got["nodes"] == nodes


def test_sqlite_result_structure_and_exact_history(sqlite_run: dict[str, Any]) -> None:
    result = sqlite_run
    assert result["benchmark"] == "db"
    assert set(result["host"]) >= {"kvctl_version", "python", "platform", "cpu_count"}
    assert result["config"]["nodes"] == TINY["nodes"] and result["config"]["days"] == 1
    assert result["postgresql"] == {"skipped": "--no-pg"}
    assert result["targets"] == {"ingest_rows_per_s": 100_000, "fleet_summary_s": 0.5}
    assert set(result["meets_targets"]["sqlite"]) == {"ingest_rows_per_s", "fleet_summary_s"}
    assert result["meets_targets"]["postgresql"] is None
    assert result["sqlite"]["server_version"]
    _check_backend(result["sqlite"])
    json.dumps(result, allow_nan=False)  # JSON-safe, no NaN/inf


def test_render_has_a_row_per_figure(sqlite_run: dict[str, Any]) -> None:
    table = render_db_bench(sqlite_run)
    # sqlite: ingest, rollup, two windows of each of two queries; postgresql: one "skipped" row
    assert table.row_count == 7


def test_postgresql_run_drops_its_database(pg_admin: Engine) -> None:
    admin_url = pg_admin.url.render_as_string(hide_password=False)
    result = run_db_bench(**TINY, pg_admin_url=admin_url)
    pg = result["postgresql"]
    assert "skipped" not in pg and pg["history"]["vacuum_analyze_s"] is not None
    _check_backend(pg)
    assert set(result["meets_targets"]["postgresql"]) == {"ingest_rows_per_s", "fleet_summary_s"}
    assert not _pg_database_exists(pg_admin, bench_database_name())


def test_postgresql_database_dropped_on_error(
    pg_admin: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    load_history = bench_db._load_history

    def boom(backend: Any, *args: Any) -> Any:
        if backend.name == "sqlite":
            return load_history(backend, *args)
        assert _pg_database_exists(pg_admin, bench_database_name())  # it was there
        raise RuntimeError("boom")

    monkeypatch.setattr(bench_db, "_load_history", boom)
    admin_url = pg_admin.url.render_as_string(hide_password=False)
    with pytest.raises(RuntimeError, match="boom"):
        run_db_bench(**TINY, pg_admin_url=admin_url)
    assert not _pg_database_exists(pg_admin, bench_database_name())


class _SqliteSkipped(Exception):
    pass


def _skip_sqlite(path: Any) -> Any:
    raise _SqliteSkipped


def _pg_database_exists(pg_admin: Engine, name: str) -> bool:
    with pg_admin.connect() as conn:
        found = conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name})
        return found.first() is not None


def test_generated_rollups_equal_the_real_rollup_of_the_samples(
    db: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # many down node-hours, so the paths for missed scrapes (NULL gauges, no rows) are covered
    monkeypatch.setattr(bench_db, "DOWN_PROBABILITY", 0.3)
    model = FleetModel(tuple(range(1, 5)), seed=5)
    end_ms = HISTORY_END_MS
    start_ms = end_ms - DAY_MS  # one UTC day, so the daily rollup is covered too
    with db.begin() as conn:
        for table in GENERATED_TABLES:
            _write(conn, raw_table(table), generate_samples(model, table, start_ms, end_ms))
    rollup_all(db.begin, end_ms + HOUR_MS)  # everything final
    for table in GENERATED_TABLES:
        for res in ("1m", "1h", "1d"):
            target = ROLLUPS[table, res]
            names = [c.name for c in target.c]
            with db.connect() as conn:
                got = sorted(tuple(r) for r in conn.execute(select(*target.c)))
            want = sorted(column_rows(generate_rollups(model, table, res, start_ms, end_ms), names))
            assert got == want, (table, res)
    samples = generate_samples(model, "node_sample", start_ms, end_ms)
    assert not samples["up"].all() and np.isnan(samples["scrape_seconds"]).any()


def test_generator_is_deterministic_and_hour_aligned() -> None:
    model = FleetModel((1, 2, 3), seed=1)
    a = generate_rollups(model, "power_sample", "1h", HISTORY_END_MS - HOUR_MS, HISTORY_END_MS)
    b = generate_rollups(model, "power_sample", "1h", HISTORY_END_MS - HOUR_MS, HISTORY_END_MS)
    assert all(np.array_equal(a[c], b[c], equal_nan=True) for c in a)
    with pytest.raises(InvalidArgument):
        generate_samples(model, "cache_sample", HISTORY_END_MS + 1, HISTORY_END_MS + HOUR_MS)
    with pytest.raises(InvalidArgument):
        generate_rollups(model, "link_sample", "1h", HISTORY_END_MS, HISTORY_END_MS)


@pytest.mark.parametrize(
    "kw",
    [{"rows": 0}, {"repeats": 0}, {"dcs": 7, "nodes": 6}, {"days": 1, "raw_hours": 24}],
)
def test_bad_arguments_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        run_db_bench(**{**TINY, **kw}, pg=False)


def test_explicit_unreachable_pg_url_fails_before_the_sqlite_half(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench_db, "_sqlite_db", _skip_sqlite)
    with pytest.raises(DatabaseError, match="not reachable"):
        run_db_bench(**TINY, pg_admin_url="postgresql://nobody@127.0.0.1:1/postgres")


def test_cli_json() -> None:
    args = ["bench", "db", "--json", "--no-pg", "--rows", "2000", "--batch", "500"]
    args += ["--nodes", "6", "--dcs", "2", "--days", "1", "--repeats", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)  # progress went to stderr
    assert out["benchmark"] == "db" and out["postgresql"] == {"skipped": "--no-pg"}
    assert out["config"]["rows"] == 2000 and out["sqlite"]["fleet_summary"]["check"]["exact"]


def test_cli_help_has_examples() -> None:
    result = CliRunner().invoke(app, ["bench", "db", "--help"])
    assert (
        result.exit_code == 0 and "Examples" in result.output and "kvctl bench db" in result.output
    )
