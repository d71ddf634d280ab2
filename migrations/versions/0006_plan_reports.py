"""Saved capacity plans (`kvctl plan --save`), read by the dashboard's capacity page.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "plan_report",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("dc", sa.String(length=64), nullable=True),
        sa.Column("workload", sa.String(length=255), nullable=False),
        sa.Column("report", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_plan_report")),
    )
    op.create_index(op.f("ix_plan_report_created_ms"), "plan_report", ["created_ms"])


def downgrade() -> None:
    op.drop_index(op.f("ix_plan_report_created_ms"), table_name="plan_report")
    op.drop_table("plan_report")
