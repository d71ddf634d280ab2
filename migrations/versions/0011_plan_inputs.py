"""The prefill inputs of the agents' fetch-or-recompute plans: ``plan_sample.prefill_model``
and ``prefill_gpu`` (the model and GPU profile the agent's prefill rate was for, as its plans
reported them), series keys of the plan rollups beside ``prefill_basis``. GPU time saved is
seconds of that GPU, so its energy takes that GPU's board power rather than the inventory's.
Rows from before this revision hold '' (not reported): they keep their old reading (the node's
inventory GPU).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

TABLE = "plan_sample"
ROLLUPS = ("plan_1m", "plan_1h", "plan_1d")
#: new series keys: (column, type)
KEYS = (("prefill_model", sa.String(64)), ("prefill_gpu", sa.String(32)))
OLD_PK = ("node_id", "prefill_basis", "bucket_ms")
SUMS = ("saved_s", "recompute_s", "fetch_s", "fetch_chunks", "recompute_chunks")
NEW_PK = ("node_id", "prefill_basis", "prefill_model", "prefill_gpu", "bucket_ms")


def _add_keys(batch: object) -> None:
    for name, kind in KEYS:
        # NOT NULL with '' for the rows already there: a rollup key cannot be NULL
        batch.add_column(  # type: ignore[attr-defined]
            sa.Column(name, kind, nullable=False, server_default="")
        )


def upgrade() -> None:
    with op.batch_alter_table(TABLE) as batch:
        _add_keys(batch)
    for table in ROLLUPS:
        # the keys join the primary key, so a bucket holds one row per GPU and model
        with op.batch_alter_table(table, recreate="always") as batch:
            _add_keys(batch)
            batch.drop_constraint(f"pk_{table}", type_="primary")
            batch.create_primary_key(f"pk_{table}", list(NEW_PK))


def downgrade() -> None:
    for table in reversed(ROLLUPS):
        # rows of one bucket that only the new keys told apart fold back into one
        keys = ", ".join(OLD_PK)
        sums = ", ".join(f"SUM({c}) AS {c}" for c in ("samples", *SUMS))
        op.execute(
            sa.text(
                f"CREATE TEMPORARY TABLE {table}_fold AS SELECT {keys}, {sums} "
                f"FROM {table} GROUP BY {keys}"
            )
        )
        op.execute(sa.text(f"DELETE FROM {table}"))
        with op.batch_alter_table(table, recreate="always") as batch:
            batch.drop_constraint(f"pk_{table}", type_="primary")
            for name, _ in reversed(KEYS):
                batch.drop_column(name)
            batch.create_primary_key(f"pk_{table}", list(OLD_PK))
        columns = ", ".join((*OLD_PK, "samples", *SUMS))
        op.execute(sa.text(f"INSERT INTO {table} ({columns}) SELECT {columns} FROM {table}_fold"))
        op.execute(sa.text(f"DROP TABLE {table}_fold"))
    with op.batch_alter_table(TABLE) as batch:
        for name, _ in reversed(KEYS):
            batch.drop_column(name)
