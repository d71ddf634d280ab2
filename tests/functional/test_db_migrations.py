"""Migrations on a real SQLite and a real PostgreSQL: from empty, from every earlier revision
with data in it, down and up again, and the models agree with what the migrations build."""

from __future__ import annotations

from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import BigInteger, Boolean, Float, Integer, String, Text, inspect, select
from sqlalchemy.engine import Connection, Engine

from kvctl.db import migrate
from kvctl.db.engine import DatabaseError, create_db_engine, resolve_url
from kvctl.db.models import Base


def _engine(url: str) -> Engine:
    return create_db_engine(resolve_url(url))


def _value(col_type: object, i: int) -> object:
    if isinstance(col_type, Boolean):
        return i % 2 == 0
    if isinstance(col_type, Integer | BigInteger):
        return i + 1
    if isinstance(col_type, Float):
        return i + 1.5
    if isinstance(col_type, String | Text):
        return f"v{i}"
    raise AssertionError(f"no test value for {col_type!r}")


def _fill(conn: Connection) -> dict[str, list[dict[str, object]]]:
    """One or two rows in every table the database has now, respecting foreign keys."""
    from sqlalchemy import MetaData

    meta = MetaData()
    meta.reflect(conn)
    written: dict[str, list[dict[str, object]]] = {}
    for table in meta.sorted_tables:
        if table.name == "alembic_version":
            continue
        rows = []
        for i in range(2 if table.name != "link" else 1):
            row = {c.name: _value(c.type, i) for c in table.columns}
            if table.name == "dc":
                row["pue"] = 1.2
            if table.name == "link":
                row.update(dc_a_id=1, dc_b_id=2)
            if table.name == "node":
                row["dc_id"] = 1
            rows.append(row)
        conn.execute(table.insert(), rows)
        written[table.name] = rows
    return written


def test_upgrade_from_empty_builds_what_the_models_describe(empty_db_url: str) -> None:
    engine = _engine(empty_db_url)
    assert migrate.current_revision(engine) is None
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []
        assert set(Base.metadata.tables) <= set(inspect(conn).get_table_names())
    engine.dispose()


@pytest.mark.parametrize("start", migrate.revisions()[:-1])
def test_upgrade_from_each_revision_keeps_its_data(empty_db_url: str, start: str) -> None:
    engine = _engine(empty_db_url)
    migrate.upgrade(engine, start)
    with engine.begin() as conn:
        written = _fill(conn)
    assert written, "the earlier revision has tables to fill"
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    with engine.connect() as conn:
        for name, rows in written.items():
            table = Base.metadata.tables[name]
            got = [dict(r._mapping) for r in conn.execute(select(table))]
            key = sorted(table.primary_key.columns.keys())
            # a column a later revision added reads NULL on the old rows, or '' where it is
            # a NOT NULL series key (0011's plan inputs: not reported)
            want = (
                {c.name: row.get(c.name, None if c.nullable else "") for c in table.c}
                for row in rows
            )
            assert sorted(got, key=lambda r: [r[k] for k in key]) == sorted(
                want, key=lambda r: [r[k] for k in key]
            ), name
    engine.dispose()


def test_downgrade_to_base_and_up_again(empty_db_url: str) -> None:
    engine = _engine(empty_db_url)
    migrate.upgrade(engine)
    migrate.downgrade(engine, "base")
    with engine.connect() as conn:
        assert set(inspect(conn).get_table_names()) <= {"alembic_version"}
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()


def test_sqlite_upgrades_itself_on_first_use(sqlite_url: str) -> None:
    engine = migrate.open_db(sqlite_url)
    assert migrate.current_revision(engine) == migrate.head_revision()
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()


def test_postgresql_behind_schema_asks_for_an_upgrade(pg_url: str) -> None:
    with pytest.raises(DatabaseError, match="kvctl db upgrade"):
        migrate.open_db(pg_url)
    engine = migrate.open_db(pg_url, auto_upgrade=True)
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()
    migrate.open_db(pg_url).dispose()  # current now: no error


def test_unknown_revision_means_a_newer_kvctl(sqlite_url: str) -> None:
    engine = migrate.open_db(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    engine.dispose()
    with pytest.raises(DatabaseError, match="newer kvctl"):
        migrate.open_db(sqlite_url)


def test_unreachable_postgresql_is_one_clear_error() -> None:
    with pytest.raises(DatabaseError, match="cannot connect to postgresql"):
        migrate.open_db("postgresql://nobody@127.0.0.1:1/none")


@pytest.mark.parametrize(
    ("url", "message"),
    [("mysql://x@h/db", "supports SQLite and PostgreSQL"), ("::nonsense", "not a database URL")],
)
def test_bad_urls_are_refused(url: str, message: str) -> None:
    with pytest.raises(DatabaseError, match=message):
        resolve_url(url)


def test_postgres_urls_use_psycopg_3() -> None:
    assert resolve_url("postgresql://u:p@h:5432/d").startswith("postgresql+psycopg://u:p@h")


def test_node_ids_of_nodes_removed_before_0005_are_not_reused(sqlite_url: str) -> None:
    from sqlalchemy import text

    from kvctl.db.engine import create_db_engine

    engine = create_db_engine(sqlite_url)
    migrate.upgrade(engine, "0004")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO dc (id, name, region, location, created_ms) "
                "VALUES (1, 'fra', '', '', 0)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO node (id, name, dc_id, agent_url, gpu_model, created_ms) "
                "VALUES (1, 'n1', 1, 'http://a:1', '', 0)"
            )
        )
        # node 7 was removed before the upgrade; its samples remain
        conn.execute(text("INSERT INTO node_sample (node_id, ts_ms, up) VALUES (7, 1, 1)"))
    migrate.upgrade(engine, "head")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO node (name, dc_id, agent_url, gpu_model, created_ms) "
                "VALUES ('n2', 1, 'http://b:1', '', 0)"
            )
        )
        new_id = conn.execute(text("SELECT id FROM node WHERE name = 'n2'")).scalar()
    engine.dispose()
    assert new_id == 8


def test_plan_samples_upgrade_roll_up_and_downgrade(empty_db_url: str) -> None:
    """0007 on both backends: plan samples and their rollups come with it, and go with it
    (their rollup watermarks too: a later upgrade must roll them up again), leaving 0006's
    tables and data as they were."""
    from kvctl.db.ingest import insert_rows
    from kvctl.db.models import ROLLUPS, raw_table
    from kvctl.db.rollup import HOUR_MS, rollup_all, watermark

    engine = _engine(empty_db_url)
    migrate.upgrade(engine, "0006")
    t0 = 1_700_000_000_000 // HOUR_MS * HOUR_MS
    with engine.begin() as conn:
        conn.execute(raw_table("node_sample").insert().values(node_id=1, ts_ms=t0, up=True))
    migrate.upgrade(engine, "0007")
    rows = [
        {
            "node_id": 1,
            "ts_ms": t0 + i * 10_000,
            "prefill_basis": "measured" if i % 2 else "modeled",
            "saved_s": 0.25,
            "recompute_s": 0.5,
            "fetch_s": 0.25,
            "fetch_chunks": 2,
            "recompute_chunks": 1,
        }
        for i in range(12)
    ]
    with engine.begin() as conn:
        insert_rows(conn, raw_table("plan_sample"), rows)
    migrate.upgrade(engine)  # this kvctl's rollups cover later revisions' series too
    rollup_all(engine.begin, t0 + 2 * HOUR_MS)
    with engine.connect() as conn:
        hourly = ROLLUPS["plan_sample", "1h"]
        got = {r.prefill_basis: r for r in conn.execute(select(hourly))}
        assert watermark(conn, "plan_sample", "1h") == t0 + HOUR_MS
    assert got["measured"].saved_s == 6 * 0.25 and got["modeled"].fetch_chunks == 12
    migrate.downgrade(engine, "0006")
    with engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())
        assert not tables & {"plan_sample", "plan_1m", "plan_1h", "plan_1d"}
        assert watermark(conn, "plan_sample", "1h") is None
        assert watermark(conn, "node_sample", "1h") is not None
        assert conn.execute(select(raw_table("node_sample").c.ts_ms)).scalars().all() == [t0]
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()


def test_routing_upgrade_roll_up_and_downgrade(empty_db_url: str) -> None:
    """0008 on both backends: an old link probe reads as measured (NULL basis); route samples
    roll up; downgrading drops them, their watermarks and the new link columns, and keeps the
    probes."""
    from kvctl.db.ingest import insert_rows
    from kvctl.db.models import ROLLUPS, raw_table
    from kvctl.db.rollup import HOUR_MS, rollup_all, watermark

    engine = _engine(empty_db_url)
    migrate.upgrade(engine, "0007")
    t0 = 1_700_000_000_000 // HOUR_MS * HOUR_MS
    probe = {"src_node_id": 1, "dst_node_id": 2, "ts_ms": t0, "rtt_s": 0.001, "ok": True}
    with engine.begin() as conn:
        conn.execute(sa_table(conn, "link_sample").insert().values(**probe, probe_bytes=1))
    migrate.upgrade(engine, "0008")
    links = raw_table("link_sample")
    with engine.connect() as conn:
        old = conn.execute(select(links.c.rtt_basis, links.c.emulated_delay_s)).one()
    assert tuple(old) == (None, None)
    routes = [
        {"router": "http://r:9480", "node": node, "ts_ms": t0 + i * 10_000, "decisions": 2,
         "to_holder": 1, **({"tokens": 512, "decision_s": 0.001} if not node else {})}
        for i in range(6)
        for node in ("", "a1")
    ]  # fmt: skip
    for row in routes:
        row.setdefault("tokens", None)
        row.setdefault("decision_s", None)
    with engine.begin() as conn:
        insert_rows(conn, raw_table("route_sample"), routes)
        insert_rows(
            conn,
            raw_table("route_link_sample"),
            [
                {
                    "router": "http://r:9480",
                    "from_dc": "ams",
                    "to_dc": "fra",
                    "ts_ms": t0,
                    "pulled_chunks": 3,
                    "pulled_bytes": 3 << 20,
                }
            ],
        )
    migrate.upgrade(engine)  # this kvctl's rollups cover later revisions' series too
    rollup_all(engine.begin, t0 + 2 * HOUR_MS)
    with engine.connect() as conn:
        hourly = {r.node: r for r in conn.execute(select(ROLLUPS["route_sample", "1h"]))}
        (pulls,) = conn.execute(select(ROLLUPS["route_link_sample", "1h"])).all()
    assert hourly[""].decisions == 12 and hourly[""].tokens == 3072
    assert hourly["a1"].to_holder == 6 and hourly["a1"].tokens is None
    assert pulls.pulled_bytes == 3 << 20
    migrate.downgrade(engine, "0007")
    with engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())
        assert not tables & {"route_sample", "route_link_sample", "route_report", "route_1h"}
        assert watermark(conn, "route_sample", "1h") is None
        columns = {c["name"] for c in inspect(conn).get_columns("link_sample")}
        assert not columns & {"rtt_basis", "emulated_delay_s"}
        assert conn.execute(sa_table(conn, "link_sample").select()).one().rtt_s == 0.001
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()


def test_emulated_power_upgrade_roll_up_and_downgrade(empty_db_url: str) -> None:
    """0009 on both backends: emulated power samples roll up apart from NVML's measured ones
    (their own tables, keyed by the profiles assumed), and go with a downgrade, watermarks
    too, leaving the measured power samples as they were."""
    from kvctl.db.ingest import insert_rows
    from kvctl.db.models import ROLLUPS, raw_table
    from kvctl.db.rollup import HOUR_MS, rollup_all, watermark

    engine = _engine(empty_db_url)
    migrate.upgrade(engine, "0008")
    t0 = 1_700_000_000_000 // HOUR_MS * HOUR_MS
    measured = {"node_id": 1, "gpu_index": 0, "ts_ms": t0, "power_w": 300.0, "energy_j": 50.0}
    with engine.begin() as conn:
        conn.execute(raw_table("power_sample").insert().values(**measured))
    migrate.upgrade(engine, "0009")
    emulated = [
        {"node_id": 2, "gpu_profile": "l4", "model": "qwen2.5-0.5b", "ts_ms": t0 + i * 10_000,
         "lookup_tokens": 4096, "busy_s": 0.5, "energy_j": 36.0, "power_w": 3.6}
        for i in range(6)
    ]  # fmt: skip
    with engine.begin() as conn:
        insert_rows(conn, raw_table("emulated_power_sample"), emulated)
    rollup_all(engine.begin, t0 + 2 * HOUR_MS)
    with engine.connect() as conn:
        (hour,) = conn.execute(select(ROLLUPS["emulated_power_sample", "1h"])).all()
        (nvml,) = conn.execute(select(ROLLUPS["power_sample", "1h"])).all()
    assert (hour.node_id, hour.gpu_profile, hour.model) == (2, "l4", "qwen2.5-0.5b")
    assert hour.energy_j == 6 * 36.0 and hour.busy_s == 3.0 and hour.power_w_n == 6
    assert nvml.energy_j == 50.0  # the measured rollup holds the measured sample only
    migrate.downgrade(engine, "0008")
    with engine.connect() as conn:
        tables = set(inspect(conn).get_table_names())
        assert not tables & {"emulated_power_sample", "emulated_power_1h"}
        assert watermark(conn, "emulated_power_sample", "1h") is None
        assert conn.execute(select(raw_table("power_sample").c.energy_j)).scalar() == 50.0
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()


def sa_table(conn: Connection, name: str) -> Any:
    """``name`` as the database has it now (an older revision's columns)."""
    from sqlalchemy import MetaData, Table

    return Table(name, MetaData(), autoload_with=conn)


def test_plan_inputs_upgrade_keep_gpus_apart_and_downgrade(empty_db_url: str) -> None:
    """0011 on both backends: plan rows and rollups from before it read '' (inputs not
    reported); after it, seconds of different GPUs roll up apart (their energy takes each
    GPU's board power); a downgrade folds them back into one row per bucket, sums kept."""
    from kvctl.db.ingest import insert_rows
    from kvctl.db.models import ROLLUPS, raw_table
    from kvctl.db.rollup import HOUR_MS, rollup_all

    engine = _engine(empty_db_url)
    migrate.upgrade(engine, "0010")
    t0 = 1_700_000_000_000 // HOUR_MS * HOUR_MS
    old = {
        "node_id": 1,
        "ts_ms": t0,
        "prefill_basis": "modeled",
        "saved_s": 1.0,
        "recompute_s": 1.5,
        "fetch_s": 0.5,
        "fetch_chunks": 1,
        "recompute_chunks": 0,
    }
    with engine.begin() as conn:
        conn.execute(sa_table(conn, "plan_sample").insert().values(**old))
    migrate.upgrade(engine, "0011")
    rows = [
        {**old, "ts_ms": t0 + HOUR_MS + i * 10_000, "prefill_model": "llama-3.1-8b",
         "prefill_gpu": "h100" if i % 2 else "l4"}
        for i in range(4)
    ]  # fmt: skip
    with engine.begin() as conn:
        insert_rows(conn, raw_table("plan_sample"), rows)
    rollup_all(engine.begin, t0 + 3 * HOUR_MS)
    with engine.connect() as conn:
        got = {
            (r.bucket_ms, r.prefill_model, r.prefill_gpu): r.saved_s
            for r in conn.execute(select(ROLLUPS["plan_sample", "1h"]))
        }
    assert got == {
        (t0, "", ""): 1.0,
        (t0 + HOUR_MS, "llama-3.1-8b", "h100"): 2.0,
        (t0 + HOUR_MS, "llama-3.1-8b", "l4"): 2.0,
    }
    migrate.downgrade(engine, "0010")
    with engine.connect() as conn:
        hourly = sa_table(conn, "plan_1h")
        assert "prefill_gpu" not in hourly.c
        folded = {r.bucket_ms: r.saved_s for r in conn.execute(select(hourly))}
    assert folded == {t0: 1.0, t0 + HOUR_MS: 4.0}
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == migrate.head_revision()
    engine.dispose()


def test_a_sqlite_migration_that_fails_midway_is_rolled_back_whole(sqlite_url: str) -> None:
    """0010 adds columns to four tables; the third already has one (as after an earlier run
    that died there). The failure must leave the first two tables as they were, at 0009, so
    that once the clash is gone the upgrade runs; before, the first two kept their columns
    and every later upgrade failed on them."""
    import sqlite3

    from kvctl.db.engine import DatabaseError, create_db_engine
    from kvctl.db.migrate import current_revision, open_db, upgrade

    engine = create_db_engine(sqlite_url)
    upgrade(engine, "0009")
    engine.dispose()
    path = sqlite_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as raw:
        raw.execute("ALTER TABLE engine_1h ADD COLUMN kv_reused_blocks BIGINT")

    def columns(table: str) -> set[str]:
        with sqlite3.connect(path) as raw:
            return {row[1] for row in raw.execute(f"PRAGMA table_info({table})")}

    with pytest.raises(DatabaseError, match=r"from 0009 to \S+ failed and was rolled back"):
        open_db(sqlite_url)
    assert "kv_reused_blocks" not in columns("engine_sample")
    assert "kv_reused_blocks" not in columns("engine_1m")
    engine = create_db_engine(sqlite_url)
    assert current_revision(engine) == "0009"
    engine.dispose()
    with sqlite3.connect(path) as raw:
        raw.execute("ALTER TABLE engine_1h DROP COLUMN kv_reused_blocks")
    open_db(sqlite_url).dispose()  # the clash gone, the upgrade runs to the head
    assert {"kv_reused_blocks", "kvbm_matched_tokens"} <= columns("engine_sample")
