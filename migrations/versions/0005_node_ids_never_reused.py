"""Node ids are never reused on SQLite: samples and counter baselines are keyed by node id and
outlive a removed node, so a node added later must not inherit them. PostgreSQL sequences never
reuse ids; SQLite does so without AUTOINCREMENT.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-21
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def _recreate(autoincrement: bool) -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    with op.batch_alter_table(
        "node", recreate="always", table_kwargs={"sqlite_autoincrement": autoincrement}
    ):
        pass


def upgrade() -> None:
    _recreate(True)


def downgrade() -> None:
    _recreate(False)
