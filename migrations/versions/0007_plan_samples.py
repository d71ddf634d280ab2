"""Fetch-or-recompute samples per node (the agents' planned lookups: prefill time of the chunks
taken, their fetch time, the difference saved) and their 1-minute, 1-hour and daily rollups, in
the rollup layout of 0003. The prefill basis (measured, configured, modeled) is a series key, so
rollups keep seconds of each basis apart.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

TABLE = "plan_sample"
ROLLUP_STEM = "plan"
RESOLUTIONS = ("1m", "1h", "1d")
FLOAT_SUMS = ("saved_s", "recompute_s", "fetch_s")
INT_SUMS = ("fetch_chunks", "recompute_chunks")
DAY_MS = 86_400_000

# the module name starts with a digit, so no plain import statement can name it
_rollups = importlib.import_module("migrations.versions.0003_rollups")
#: the rollups' layout in 0003's form: keys, sums, no gauges
ROLLUP = (
    [("node_id", sa.Integer()), ("prefill_basis", sa.String(16))],
    [*((c, sa.Float()) for c in FLOAT_SUMS), *((c, sa.BigInteger()) for c in INT_SUMS)],
    [],
)


def _timescale_installed() -> bool:
    """Whether 0002 made the sample tables hypertables (this one then becomes one too)."""
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return False
    found = bind.execute(sa.text("SELECT 1 FROM pg_extension WHERE extname = 'timescaledb'"))
    return found.first() is not None


def upgrade() -> None:
    op.create_table(
        TABLE,
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("ts_ms", sa.BigInteger(), nullable=False),
        sa.Column("prefill_basis", sa.String(16), nullable=False),
        *(sa.Column(c, sa.Float(), nullable=True) for c in FLOAT_SUMS),
        *(sa.Column(c, sa.BigInteger(), nullable=True) for c in INT_SUMS),
        sa.PrimaryKeyConstraint("node_id", "ts_ms", name=f"pk_{TABLE}"),
    )
    op.create_index(f"ix_{TABLE}_ts_ms", TABLE, ["ts_ms"], postgresql_using="brin")
    if _timescale_installed():
        op.execute(
            f"SELECT create_hypertable('{TABLE}', 'ts_ms', chunk_time_interval => {DAY_MS}, "
            "if_not_exists => TRUE, create_default_indexes => FALSE)"
        )
    for res in RESOLUTIONS:
        _rollups.create_rollup(ROLLUP_STEM, res, ROLLUP)


def downgrade() -> None:
    for res in reversed(RESOLUTIONS):
        _rollups.drop_rollup(ROLLUP_STEM, res)
    op.drop_index(f"ix_{TABLE}_ts_ms", table_name=TABLE)
    op.drop_table(TABLE)
    # the rollup watermarks of the dropped tables would claim work done on a later upgrade
    op.execute(sa.text("DELETE FROM rollup_state WHERE name LIKE 'plan_sample:%'"))
