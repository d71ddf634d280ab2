"""Engine block counters: TensorRT-LLM's KV-cache blocks reused and missed, and Dynamo KVBM's
matched tokens and the blocks it moves between tiers, as increases per engine sample and
summed in the engine rollups (1 minute, 1 hour, 1 day). Rows from before this revision, and
engines that do not expose them, hold NULL.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

COUNTERS = (
    "kv_reused_blocks",
    "kv_missed_blocks",
    "kvbm_matched_tokens",
    "kvbm_offload_host_blocks",
    "kvbm_offload_disk_blocks",
    "kvbm_onboard_host_blocks",
    "kvbm_onboard_disk_blocks",
)
TABLES = ("engine_sample", "engine_1m", "engine_1h", "engine_1d")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            for column in COUNTERS:
                batch.add_column(sa.Column(column, sa.BigInteger(), nullable=True))


def downgrade() -> None:
    for table in reversed(TABLES):
        with op.batch_alter_table(table) as batch:
            for column in reversed(COUNTERS):
                batch.drop_column(column)
