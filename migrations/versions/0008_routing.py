"""Routing: what `kvctl router serve` decided, scraped by the collector, and the saved replayed
comparison of routing policies; link probes say what their RTT is.

- ``link_sample`` gains ``rtt_basis`` ("measured" | "emulated"; NULL on rows from before this
  revision: measured) and ``emulated_delay_s`` (the delay the agent adds on that link).
- ``route_sample``: per router and node, the increases of its decision counters since the
  previous scrape; the router's own row (node '') carries every fleet-wide counter.
- ``route_link_sample``: per router and DC link, chunks and bytes the decisions pulled.
- Both roll up at 1 minute, 1 hour and 1 day in the layout of 0003.
- ``route_report``: the latest replayed policy comparison (JSON), saved by the demo.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

RESOLUTIONS = ("1m", "1h", "1d")
DAY_MS = 86_400_000
ROUTE_COUNTERS = (
    "decisions",
    "to_holder",
    "no_node",
    "requested_chunks",
    "indexed_chunks",
    "local_chunks",
    "pulled_chunks",
    "pulled_bytes",
    "tokens",
    "fetched_tokens",
    "recomputed_tokens",
)
LINK_COUNTERS = ("pulled_chunks", "pulled_bytes")

_rollups = importlib.import_module("migrations.versions.0003_rollups")
# table -> (rollup stem, keys with types, integer counters, float counters)
SAMPLES = {
    "route_sample": (
        "route",
        [("router", sa.String(255)), ("node", sa.String(128))],
        ROUTE_COUNTERS,
        ("decision_s",),
    ),
    "route_link_sample": (
        "route_link",
        [("router", sa.String(255)), ("from_dc", sa.String(64)), ("to_dc", sa.String(64))],
        LINK_COUNTERS,
        (),
    ),
}


def _timescale_installed() -> bool:
    """Whether 0002 made the sample tables hypertables (these then become ones too)."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return False
    found = bind.execute(sa.text("SELECT 1 FROM pg_extension WHERE extname = 'timescaledb'"))
    return found.first() is not None


def upgrade() -> None:
    with op.batch_alter_table("link_sample") as batch:
        batch.add_column(sa.Column("rtt_basis", sa.String(16), nullable=True))
        batch.add_column(sa.Column("emulated_delay_s", sa.Float(), nullable=True))
    timescale = _timescale_installed()
    for table, (stem, keys, ints, floats) in SAMPLES.items():
        op.create_table(
            table,
            *(sa.Column(k, t, nullable=False) for k, t in keys),
            sa.Column("ts_ms", sa.BigInteger(), nullable=False),
            *(sa.Column(c, sa.BigInteger(), nullable=True) for c in ints),
            *(sa.Column(c, sa.Float(), nullable=True) for c in floats),
            sa.PrimaryKeyConstraint(*(k for k, _ in keys), "ts_ms", name=f"pk_{table}"),
        )
        op.create_index(f"ix_{table}_ts_ms", table, ["ts_ms"], postgresql_using="brin")
        if timescale:
            op.execute(
                f"SELECT create_hypertable('{table}', 'ts_ms', chunk_time_interval => {DAY_MS}, "
                "if_not_exists => TRUE, create_default_indexes => FALSE)"
            )
        layout = (
            keys,
            [*((c, sa.BigInteger()) for c in ints), *((c, sa.Float()) for c in floats)],
            [],
        )
        for res in RESOLUTIONS:
            _rollups.create_rollup(stem, res, layout)
    op.create_table(
        "route_report",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("ts_ms", sa.BigInteger(), nullable=False),
        sa.Column("report", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_route_report")),
    )
    op.create_index(op.f("ix_route_report_ts_ms"), "route_report", ["ts_ms"])


def downgrade() -> None:
    op.drop_index(op.f("ix_route_report_ts_ms"), table_name="route_report")
    op.drop_table("route_report")
    for table, (stem, *_layout) in reversed(SAMPLES.items()):
        for res in reversed(RESOLUTIONS):
            _rollups.drop_rollup(stem, res)
        op.drop_index(f"ix_{table}_ts_ms", table_name=table)
        op.drop_table(table)
    # the rollup watermarks of the dropped tables would claim work done on a later upgrade
    names = [f"{table}:{res}" for table in SAMPLES for res in RESOLUTIONS]
    op.execute(
        sa.text("DELETE FROM rollup_state WHERE name IN :names").bindparams(
            sa.bindparam("names", names, expanding=True)
        )
    )
    with op.batch_alter_table("link_sample") as batch:
        batch.drop_column("emulated_delay_s")
        batch.drop_column("rtt_basis")
