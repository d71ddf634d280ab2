"""Daily (UTC) rollups of every sample table, in the layout of 0003's rollups.

A week's window then reads about seven rows per series from these instead of 168 hourly ones.
The daily rollups fill from the existing 1-hour rollups on the next maintenance run.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-21
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# the module name starts with a digit, so no plain import statement can name it
_rollups = importlib.import_module("migrations.versions.0003_rollups")


def upgrade() -> None:
    for stem in _rollups.ROLLUPS:
        _rollups.create_rollup(stem, "1d")


def downgrade() -> None:
    for stem in _rollups.ROLLUPS:
        _rollups.drop_rollup(stem, "1d")
    state = sa.table("rollup_state", sa.column("name", sa.String))
    op.execute(state.delete().where(state.c.name.like("%:1d")))
