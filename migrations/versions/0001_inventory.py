"""Fleet inventory (DCs, nodes, links) and the audit trail.

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dc",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("region", sa.String(64), nullable=False),
        sa.Column("location", sa.String(128), nullable=False),
        sa.Column("carbon_g_per_kwh", sa.Float(), nullable=True),
        sa.Column("pue", sa.Float(), nullable=True),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_dc"),
        sa.UniqueConstraint("name", name="uq_dc_name"),
        sa.CheckConstraint("pue IS NULL OR pue >= 1", name="ck_dc_pue_at_least_one"),
        sa.CheckConstraint(
            "carbon_g_per_kwh IS NULL OR carbon_g_per_kwh >= 0", name="ck_dc_carbon"
        ),
    )
    op.create_table(
        "node",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("dc_id", sa.Integer(), nullable=False),
        sa.Column("agent_url", sa.String(255), nullable=False),
        sa.Column("gpu_model", sa.String(64), nullable=False),
        sa.Column("engine_url", sa.String(255), nullable=True),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_node"),
        sa.UniqueConstraint("name", name="uq_node_name"),
        sa.ForeignKeyConstraint(["dc_id"], ["dc.id"], name="fk_node_dc_id_dc", ondelete="RESTRICT"),
    )
    op.create_index("ix_node_dc_id", "node", ["dc_id"])
    op.create_table(
        "link",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("dc_a_id", sa.Integer(), nullable=False),
        sa.Column("dc_b_id", sa.Integer(), nullable=False),
        sa.Column("distance_km", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_link"),
        sa.UniqueConstraint("dc_a_id", "dc_b_id", name="uq_link_dc_a_id_dc_b_id"),
        sa.CheckConstraint("dc_a_id < dc_b_id", name="ck_link_ordered"),
        sa.CheckConstraint("distance_km >= 0", name="ck_link_distance"),
        sa.ForeignKeyConstraint(
            ["dc_a_id"], ["dc.id"], name="fk_link_dc_a_id_dc", ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["dc_b_id"], ["dc.id"], name="fk_link_dc_b_id_dc", ondelete="CASCADE"
        ),
    )
    op.create_table(
        "audit",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("ts_ms", sa.BigInteger(), nullable=False),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("action", sa.String(64), nullable=False),
        sa.Column("target", sa.String(255), nullable=False),
        sa.Column("args", sa.Text(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("result", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_audit"),
    )
    op.create_index("ix_audit_ts_ms", "audit", ["ts_ms"])


def downgrade() -> None:
    op.drop_index("ix_audit_ts_ms", table_name="audit")
    op.drop_table("audit")
    op.drop_table("link")
    op.drop_index("ix_node_dc_id", table_name="node")
    op.drop_table("node")
    op.drop_table("dc")
