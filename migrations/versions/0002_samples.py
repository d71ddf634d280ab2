"""Raw time-series samples (node scrapes, cache, power, links, engines) and counter state.

On PostgreSQL the time indexes are BRIN; when the TimescaleDB extension is available the sample
tables become hypertables (integer time in milliseconds, one-day chunks).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

SAMPLES = ("node_sample", "cache_sample", "power_sample", "link_sample", "engine_sample")
DAY_MS = 86_400_000


def _timescale_available() -> bool:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return False
    found = bind.execute(
        sa.text("SELECT 1 FROM pg_available_extensions WHERE name = 'timescaledb'")
    ).first()
    return found is not None


def _big(name: str, nullable: bool = False) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger(), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "node_sample",
        sa.Column("node_id", sa.Integer(), nullable=False),
        _big("ts_ms"),
        sa.Column("up", sa.Boolean(), nullable=False),
        sa.Column("scrape_seconds", sa.Float(), nullable=True),
        sa.Column("agent_started_s", sa.Float(), nullable=True),
        sa.Column("nvml_available", sa.Boolean(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("node_id", "ts_ms", name="pk_node_sample"),
    )
    counters = (
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
    op.create_table(
        "cache_sample",
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        _big("ts_ms"),
        *(_big(c) for c in counters),
        _big("used_bytes"),
        _big("capacity_bytes"),
        _big("pinned_bytes"),
        _big("items"),
        sa.PrimaryKeyConstraint("node_id", "tier", "ts_ms", name="pk_cache_sample"),
    )
    op.create_table(
        "power_sample",
        sa.Column("node_id", sa.Integer(), nullable=False),
        sa.Column("gpu_index", sa.Integer(), nullable=False),
        _big("ts_ms"),
        sa.Column("power_w", sa.Float(), nullable=True),
        sa.Column("energy_j", sa.Float(), nullable=True),
        sa.Column("utilization_ratio", sa.Float(), nullable=True),
        _big("memory_used_bytes", nullable=True),
        _big("memory_total_bytes", nullable=True),
        sa.PrimaryKeyConstraint("node_id", "gpu_index", "ts_ms", name="pk_power_sample"),
    )
    op.create_table(
        "link_sample",
        sa.Column("src_node_id", sa.Integer(), nullable=False),
        sa.Column("dst_node_id", sa.Integer(), nullable=False),
        _big("ts_ms"),
        sa.Column("rtt_s", sa.Float(), nullable=True),
        sa.Column("bandwidth_bytes_per_s", sa.Float(), nullable=True),
        sa.Column("loss_ratio", sa.Float(), nullable=True),
        _big("probe_bytes"),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("src_node_id", "dst_node_id", "ts_ms", name="pk_link_sample"),
    )
    op.create_table(
        "engine_sample",
        sa.Column("node_id", sa.Integer(), nullable=False),
        _big("ts_ms"),
        sa.Column("engine", sa.String(16), nullable=False),
        _big("prompt_tokens", nullable=True),
        _big("cached_prompt_tokens", nullable=True),
        _big("generation_tokens", nullable=True),
        _big("requests", nullable=True),
        _big("ttft_count", nullable=True),
        sa.Column("ttft_sum_s", sa.Float(), nullable=True),
        sa.Column("ttft_p50_s", sa.Float(), nullable=True),
        sa.Column("ttft_p90_s", sa.Float(), nullable=True),
        sa.Column("ttft_p99_s", sa.Float(), nullable=True),
        sa.Column("kv_usage_ratio", sa.Float(), nullable=True),
        _big("lmcache_hit_tokens", nullable=True),
        _big("lmcache_requested_tokens", nullable=True),
        sa.Column("lmcache_local_cache_usage_bytes", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("node_id", "ts_ms", name="pk_engine_sample"),
    )
    op.create_table(
        "counter_state",
        sa.Column("series", sa.String(255), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        _big("ts_ms"),
        sa.PrimaryKeyConstraint("series", name="pk_counter_state"),
    )
    timescale = _timescale_available()
    if timescale:
        op.execute("CREATE EXTENSION IF NOT EXISTS timescaledb")
    for table in SAMPLES:
        op.create_index(f"ix_{table}_ts_ms", table, ["ts_ms"], postgresql_using="brin")
        if timescale:
            op.execute(
                f"SELECT create_hypertable('{table}', 'ts_ms', chunk_time_interval => {DAY_MS}, "
                "if_not_exists => TRUE, create_default_indexes => FALSE)"
            )


def downgrade() -> None:
    for table in SAMPLES:
        op.drop_index(f"ix_{table}_ts_ms", table_name=table)
    op.drop_table("counter_state")
    for table in reversed(SAMPLES):
        op.drop_table(table)
