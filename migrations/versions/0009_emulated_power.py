"""Emulated GPU energy, kept apart from NVML's measured readings: ``emulated_power_sample`` per
node (``kvctl collect --emulate-power`` on nodes without NVML: the modeled prefill seconds of
the tokens the cache did not serve x the GPU profile's board power), keyed by the GPU and model
profiles it assumed, and its 1-minute, 1-hour and daily rollups in the layout of 0003. A table
of its own, so no query can sum it with ``power_sample``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

TABLE = "emulated_power_sample"
ROLLUP_STEM = "emulated_power"
RESOLUTIONS = ("1m", "1h", "1d")
DAY_MS = 86_400_000

# the module name starts with a digit, so no plain import statement can name it
_rollups = importlib.import_module("migrations.versions.0003_rollups")
#: the rollups' layout in 0003's form: keys, sums, gauges
ROLLUP = (
    [("node_id", sa.Integer()), ("gpu_profile", sa.String(32)), ("model", sa.String(64))],
    [("lookup_tokens", sa.BigInteger()), ("busy_s", sa.Float()), ("energy_j", sa.Float())],
    ["power_w"],
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
        sa.Column("gpu_profile", sa.String(32), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("ts_ms", sa.BigInteger(), nullable=False),
        sa.Column("lookup_tokens", sa.BigInteger(), nullable=True),
        sa.Column("busy_s", sa.Float(), nullable=True),
        sa.Column("energy_j", sa.Float(), nullable=True),
        sa.Column("power_w", sa.Float(), nullable=True),
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
    op.execute(sa.text(f"DELETE FROM rollup_state WHERE name LIKE '{TABLE}:%'"))
