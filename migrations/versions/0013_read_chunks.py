"""Chunks a node's data plane reads asked for, and those not there (``/v1/stats``
``dataplane.read_chunks`` and ``read_missing_chunks``), as increases on each scrape's ``all``
row of ``cache_sample`` and summed in its rollups (1 minute, 1 hour, 1 day). A lookup counts
its hits when it answers; these say how many of the chunks engines then read were gone. Tier
rows, rows from before this revision and agents without the counts hold NULL.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

COUNTERS = ("read_chunks", "read_missing_chunks")
TABLES = ("cache_sample", "cache_1m", "cache_1h", "cache_1d")


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
