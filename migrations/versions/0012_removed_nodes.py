"""Removed nodes as they were (``removed_node``): a node's samples outlive it, and window totals
count them under its DC's name instead of dropping them with the inventory row. Nodes removed
before this revision have no record: their samples stay out of the totals, as before.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "removed_node",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("dc", sa.String(length=64), nullable=False),
        sa.Column("gpu_model", sa.String(length=64), nullable=False),
        sa.Column("dc_carbon_g_per_kwh", sa.Float(), nullable=True),
        sa.Column("dc_pue", sa.Float(), nullable=True),
        sa.Column("removed_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_removed_node")),
    )
    op.create_index(op.f("ix_removed_node_removed_ms"), "removed_node", ["removed_ms"])


def downgrade() -> None:
    op.drop_index(op.f("ix_removed_node_removed_ms"), table_name="removed_node")
    op.drop_table("removed_node")
