"""Rollups of every sample table at 1 minute and 1 hour, and the rollup watermark.

Each rollup keeps the bucket, the series keys, the number of samples, the sum of each counter,
and for each gauge its sum, max and count of readings, so coarser rollups are exact sums of
finer ones. The layout is frozen here; ``kvctl.db.models`` must keep matching it.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

Int, B, F, S = sa.Integer, sa.BigInteger, sa.Float, sa.String
#: (keys with types, sums with types, gauges)
Layout = tuple[list[tuple[str, object]], list[tuple[str, object]], list[str]]
# stem: layout
ROLLUPS: dict[str, Layout] = {
    "node": ([("node_id", Int())], [("up", B())], ["scrape_seconds"]),
    "cache": (
        [("node_id", Int()), ("tier", S(16))],
        [
            (c, B())
            for c in (
                "lookups",
                "lookup_tokens",
                "hits",
                "hit_tokens",
                "reuse_hits",
                "sharing_hits",
                "evictions",
                "promotions",
                "demotions",
                "bytes_read",
                "bytes_written",
            )
        ],
        ["used_bytes", "capacity_bytes", "pinned_bytes", "items"],
    ),
    "power": (
        [("node_id", Int()), ("gpu_index", Int())],
        [("energy_j", F())],
        ["power_w", "utilization_ratio", "memory_used_bytes"],
    ),
    "link": (
        [("src_node_id", Int()), ("dst_node_id", Int())],
        [("ok", B())],
        ["rtt_s", "bandwidth_bytes_per_s", "loss_ratio"],
    ),
    "engine": (
        [("node_id", Int()), ("engine", S(16))],
        [
            ("prompt_tokens", B()),
            ("cached_prompt_tokens", B()),
            ("generation_tokens", B()),
            ("requests", B()),
            ("ttft_count", B()),
            ("ttft_sum_s", F()),
            ("lmcache_hit_tokens", B()),
            ("lmcache_requested_tokens", B()),
        ],
        ["ttft_p99_s", "kv_usage_ratio", "lmcache_local_cache_usage_bytes"],
    ),
}
RESOLUTIONS = ("1m", "1h")


def create_rollup(stem: str, res: str, layout: Layout | None = None) -> None:
    """Create rollup table ``{stem}_{res}`` in this revision's layout (0004 reuses it), of
    ``layout`` where given (a later revision's series), else of :data:`ROLLUPS`' ``stem``."""
    keys, sums, gauges = ROLLUPS[stem] if layout is None else layout
    name = f"{stem}_{res}"
    cols: list[sa.Column[object]] = [sa.Column("bucket_ms", B(), nullable=False)]
    cols += [sa.Column(k, t, nullable=False) for k, t in keys]  # type: ignore[arg-type]
    cols.append(sa.Column("samples", Int(), nullable=False))
    cols += [sa.Column(s, t, nullable=True) for s, t in sums]  # type: ignore[arg-type]
    for g in gauges:
        cols += [
            sa.Column(f"{g}_sum", F(), nullable=True),
            sa.Column(f"{g}_max", F(), nullable=True),
            sa.Column(f"{g}_n", Int(), nullable=False),
        ]
    op.create_table(
        name,
        *cols,
        sa.PrimaryKeyConstraint(*(k for k, _ in keys), "bucket_ms", name=f"pk_{name}"),
    )
    op.create_index(f"ix_{name}_bucket_ms", name, ["bucket_ms"], postgresql_using="brin")


def drop_rollup(stem: str, res: str) -> None:
    op.drop_index(f"ix_{stem}_{res}_bucket_ms", table_name=f"{stem}_{res}")
    op.drop_table(f"{stem}_{res}")


def upgrade() -> None:
    for stem in ROLLUPS:
        for res in RESOLUTIONS:
            create_rollup(stem, res)
    op.create_table(
        "rollup_state",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("done_until_ms", B(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_rollup_state"),
    )


def downgrade() -> None:
    op.drop_table("rollup_state")
    for stem in ROLLUPS:
        for res in RESOLUTIONS:
            drop_rollup(stem, res)
