"""The metrics database: fleet inventory, audit trail, time-series samples and their rollups.

Conventions that keep queries exact and portable between SQLite and PostgreSQL:
- Times are integer epoch milliseconds (``ts_ms``, ``bucket_ms``), so bucketing is integer
  arithmetic on every backend and BRIN/time indexes stay cheap.
- Counter columns hold the *increase* since the previous sample of the same series, computed
  by the collector with counter resets handled (see ``kvctl.counters``). The sum over any
  window is then the exact count in that window, across agent restarts, and rollups are sums.
- Gauges hold the reading at sample time; rollups keep their sum, max and count of readings.
- A reading that could not be taken is NULL, never a made-up zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Named constraints: alembic's batch mode on SQLite can only alter what has a name.
NAMING_CONVENTION: Final = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


# --- inventory -----------------------------------------------------------------------------
class DataCenter(Base):
    __tablename__ = "dc"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    region: Mapped[str] = mapped_column(String(64), default="")
    location: Mapped[str] = mapped_column(String(128), default="")
    #: grid carbon intensity, gCO2 per kWh; NULL when unknown (carbon figures then show N/A)
    carbon_g_per_kwh: Mapped[float | None] = mapped_column(Float)
    #: power usage effectiveness (facility energy / IT energy), >= 1
    pue: Mapped[float | None] = mapped_column(Float)
    created_ms: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (
        CheckConstraint("pue IS NULL OR pue >= 1", name="pue_at_least_one"),
        CheckConstraint("carbon_g_per_kwh IS NULL OR carbon_g_per_kwh >= 0", name="carbon"),
    )


class Node(Base):
    __tablename__ = "node"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    dc_id: Mapped[int] = mapped_column(ForeignKey("dc.id", ondelete="RESTRICT"), index=True)
    agent_url: Mapped[str] = mapped_column(String(255))
    gpu_model: Mapped[str] = mapped_column(String(64), default="")
    #: Prometheus endpoint of the inference engine on this node (vLLM, SGLang, LMCache)
    engine_url: Mapped[str | None] = mapped_column(String(255))
    created_ms: Mapped[int] = mapped_column(BigInteger)

    # samples outlive a removed node: SQLite must never hand its id to a new one
    __table_args__ = ({"sqlite_autoincrement": True},)


class RemovedNode(Base):
    """A node as it was when removed from the inventory (``kvctl fleet rm``, a DC removed with
    its nodes, ``kvctl fleet import --prune``), written in the removal's transaction. Its
    samples stay keyed by its id (no foreign key, an id never reused), so window totals keep
    counting them under its DC's name; the DC's grid intensity and PUE are kept for the
    modeled savings of its hits in case the DC goes too."""

    __tablename__ = "removed_node"

    #: the node's id while it was in the inventory (what its samples' ``node_id`` hold)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(128))
    #: its DC's name (a name, so it outlives the DC)
    dc: Mapped[str] = mapped_column(String(64))
    gpu_model: Mapped[str] = mapped_column(String(64), default="")
    dc_carbon_g_per_kwh: Mapped[float | None] = mapped_column(Float)
    dc_pue: Mapped[float | None] = mapped_column(Float)
    removed_ms: Mapped[int] = mapped_column(BigInteger, index=True)


class Link(Base):
    """A fiber path between two DCs; stored once per pair with ``dc_a_id < dc_b_id``."""

    __tablename__ = "link"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    dc_a_id: Mapped[int] = mapped_column(ForeignKey("dc.id", ondelete="CASCADE"))
    dc_b_id: Mapped[int] = mapped_column(ForeignKey("dc.id", ondelete="CASCADE"))
    distance_km: Mapped[float] = mapped_column(Float)

    __table_args__ = (
        UniqueConstraint("dc_a_id", "dc_b_id"),
        CheckConstraint("dc_a_id < dc_b_id", name="ordered"),
        CheckConstraint("distance_km >= 0", name="distance"),
    )


class Audit(Base):
    """Every action an operator's CLI took: who, when, what, on which target, and the outcome."""

    __tablename__ = "audit"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(255))
    #: the action's arguments as JSON (never tokens)
    args: Mapped[str] = mapped_column(Text, default="{}")
    ok: Mapped[bool] = mapped_column(Boolean)
    result: Mapped[str] = mapped_column(Text, default="")


class PlanRecord(Base):
    """A saved `kvctl plan` report: the dashboard's capacity page reads the latest per DC."""

    __tablename__ = "plan_report"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    #: the DC the plan was made for (a name, so it outlives an inventory change); NULL: the fleet
    dc: Mapped[str | None] = mapped_column(String(64))
    workload: Mapped[str] = mapped_column(String(255))
    #: the report as `kvctl plan --json` prints it
    report: Mapped[str] = mapped_column(Text)


# --- raw samples ---------------------------------------------------------------------------
class NodeSample(Base):
    """One scrape of one agent: whether it answered, how fast, and its start time."""

    __tablename__ = "node_sample"

    node_id: Mapped[int] = mapped_column(Integer)
    ts_ms: Mapped[int] = mapped_column(BigInteger)
    up: Mapped[bool] = mapped_column(Boolean)
    scrape_seconds: Mapped[float | None] = mapped_column(Float)
    #: the agent's own start time: a change means its counters restarted from zero
    agent_started_s: Mapped[float | None] = mapped_column(Float)
    #: whether the agent could read NVML; NULL when the agent did not say
    nvml_available: Mapped[bool | None] = mapped_column(Boolean)
    error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (PrimaryKeyConstraint("node_id", "ts_ms"),)


class CacheSample(Base):
    """Store counters of one node, per tier; ``tier='all'`` is the node as a whole.

    On the ``all`` row: lookups/hits count chunks looked up and found, evictions count chunks
    that left the store (not demoted). Tier rows have lookups and lookup_tokens 0: a lookup is
    made against the node, a hit is served by one tier.
    """

    __tablename__ = "cache_sample"

    node_id: Mapped[int] = mapped_column(Integer)
    tier: Mapped[str] = mapped_column(String(16))
    ts_ms: Mapped[int] = mapped_column(BigInteger)
    lookups: Mapped[int] = mapped_column(BigInteger, default=0)
    lookup_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    hits: Mapped[int] = mapped_column(BigInteger, default=0)
    hit_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    reuse_hits: Mapped[int] = mapped_column(BigInteger, default=0)
    sharing_hits: Mapped[int] = mapped_column(BigInteger, default=0)
    evictions: Mapped[int] = mapped_column(BigInteger, default=0)
    promotions: Mapped[int] = mapped_column(BigInteger, default=0)
    demotions: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_read: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_written: Mapped[int] = mapped_column(BigInteger, default=0)
    used_bytes: Mapped[int] = mapped_column(BigInteger)
    capacity_bytes: Mapped[int] = mapped_column(BigInteger)
    pinned_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    items: Mapped[int] = mapped_column(BigInteger)
    #: ``all`` row only: chunks the node's data plane reads asked for, and those not there
    #: (evicted since the lookup that counted them as hits, or never looked up); NULL on tier
    #: rows, from agents before the counts and in rows before migration 0013
    read_chunks: Mapped[int | None] = mapped_column(BigInteger)
    read_missing_chunks: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (PrimaryKeyConstraint("node_id", "tier", "ts_ms"),)


class PowerSample(Base):
    """One NVML reading of one GPU. ``energy_j`` is the energy used since the last sample."""

    __tablename__ = "power_sample"

    node_id: Mapped[int] = mapped_column(Integer)
    gpu_index: Mapped[int] = mapped_column(Integer)
    ts_ms: Mapped[int] = mapped_column(BigInteger)
    power_w: Mapped[float | None] = mapped_column(Float)
    energy_j: Mapped[float | None] = mapped_column(Float)
    utilization_ratio: Mapped[float | None] = mapped_column(Float)
    memory_used_bytes: Mapped[int | None] = mapped_column(BigInteger)
    memory_total_bytes: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (PrimaryKeyConstraint("node_id", "gpu_index", "ts_ms"),)


class EmulatedPowerSample(Base):
    """A node's GPU energy *emulated* where NVML gives none (``kvctl collect --emulate-power``):
    the modeled prefill time of the tokens its cache did not serve since the last sample
    (agent counters: lookup_tokens - hit_tokens, at the model and GPU profiles' prefill rate)
    x the GPU profile's published board power. Kept in a table of its own so no query can add
    it to NVML's measured ``power_sample``; ``gpu_profile`` and ``model`` name the inputs."""

    __tablename__ = "emulated_power_sample"

    node_id: Mapped[int] = mapped_column(Integer)
    gpu_profile: Mapped[str] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(String(64))
    ts_ms: Mapped[int] = mapped_column(BigInteger)
    #: prompt tokens looked up since the last sample (agent counter): tokens per joule
    lookup_tokens: Mapped[int | None] = mapped_column(BigInteger)
    #: modeled prefill seconds of the tokens not served from cache since the last sample
    busy_s: Mapped[float | None] = mapped_column(Float)
    energy_j: Mapped[float | None] = mapped_column(Float)
    #: energy_j over the seconds since the node's previous sample
    power_w: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (PrimaryKeyConstraint("node_id", "ts_ms"),)


class LinkSample(Base):
    """A probe from one agent's node to another's through the data plane."""

    __tablename__ = "link_sample"

    src_node_id: Mapped[int] = mapped_column(Integer)
    dst_node_id: Mapped[int] = mapped_column(Integer)
    ts_ms: Mapped[int] = mapped_column(BigInteger)
    rtt_s: Mapped[float | None] = mapped_column(Float)
    bandwidth_bytes_per_s: Mapped[float | None] = mapped_column(Float)
    loss_ratio: Mapped[float | None] = mapped_column(Float)
    probe_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    ok: Mapped[bool] = mapped_column(Boolean)
    error: Mapped[str | None] = mapped_column(Text)
    #: what ``rtt_s`` is: "measured", or "emulated" when the agent adds a configured delay on
    #: the link it probed (included in ``rtt_s``); NULL on rows older than the field: measured
    rtt_basis: Mapped[str | None] = mapped_column(String(16))
    #: the delay the agent emulates on that link, seconds; NULL: none reported
    emulated_delay_s: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (PrimaryKeyConstraint("src_node_id", "dst_node_id", "ts_ms"),)


class EngineSample(Base):
    """Inference-engine metrics of one node (vLLM, SGLang, TensorRT-LLM, LMCache or Dynamo's
    KVBM). Counters are increases since the last sample; TTFT quantiles are over the requests
    of that interval."""

    __tablename__ = "engine_sample"

    node_id: Mapped[int] = mapped_column(Integer)
    ts_ms: Mapped[int] = mapped_column(BigInteger)
    engine: Mapped[str] = mapped_column(String(16))
    prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    cached_prompt_tokens: Mapped[int | None] = mapped_column(BigInteger)
    generation_tokens: Mapped[int | None] = mapped_column(BigInteger)
    requests: Mapped[int | None] = mapped_column(BigInteger)
    ttft_count: Mapped[int | None] = mapped_column(BigInteger)
    ttft_sum_s: Mapped[float | None] = mapped_column(Float)
    ttft_p50_s: Mapped[float | None] = mapped_column(Float)
    ttft_p90_s: Mapped[float | None] = mapped_column(Float)
    ttft_p99_s: Mapped[float | None] = mapped_column(Float)
    kv_usage_ratio: Mapped[float | None] = mapped_column(Float)
    lmcache_hit_tokens: Mapped[int | None] = mapped_column(BigInteger)
    lmcache_requested_tokens: Mapped[int | None] = mapped_column(BigInteger)
    lmcache_local_cache_usage_bytes: Mapped[float | None] = mapped_column(Float)
    #: the engine's own KV-cache blocks reused / not found at allocation (TensorRT-LLM)
    kv_reused_blocks: Mapped[int | None] = mapped_column(BigInteger)
    kv_missed_blocks: Mapped[int | None] = mapped_column(BigInteger)
    #: Dynamo KVBM: prompt tokens matched in its host/disk tiers; blocks offloaded device ->
    #: host and to disk, onboarded host -> device and disk -> device
    kvbm_matched_tokens: Mapped[int | None] = mapped_column(BigInteger)
    kvbm_offload_host_blocks: Mapped[int | None] = mapped_column(BigInteger)
    kvbm_offload_disk_blocks: Mapped[int | None] = mapped_column(BigInteger)
    kvbm_onboard_host_blocks: Mapped[int | None] = mapped_column(BigInteger)
    kvbm_onboard_disk_blocks: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (PrimaryKeyConstraint("node_id", "ts_ms"),)


class PlanSample(Base):
    """Fetch-or-recompute figures of one node's planned lookups (``/v1/stats``
    ``fetch_plans.plans``), as increases since the last sample. ``saved_s`` is ``recompute_s -
    fetch_s`` of the chunks the plans took: the GPU time the cache saved net of fetching."""

    __tablename__ = "plan_sample"

    node_id: Mapped[int] = mapped_column(Integer)
    ts_ms: Mapped[int] = mapped_column(BigInteger)
    #: where the agent's prefill rate came from: measured | configured | modeled (a series key,
    #: so rollups keep seconds of each basis apart and a saving is never called measured
    #: because part of it was)
    prefill_basis: Mapped[str] = mapped_column(String(16))
    #: the model and GPU profile the agent's prefill rate was for, as its plans reported them
    #: (``fetch_plans.prefill.inputs``): the seconds saved are seconds *of that GPU*, so their
    #: energy is that GPU's board power, not the inventory's. '' where the plans named none (a
    #: measured or configured rate: the node's own GPU; rows from before 0011). Series keys, so
    #: rollups never add seconds of different GPUs together.
    prefill_model: Mapped[str] = mapped_column(String(64), server_default="")
    prefill_gpu: Mapped[str] = mapped_column(String(32), server_default="")
    saved_s: Mapped[float | None] = mapped_column(Float)
    recompute_s: Mapped[float | None] = mapped_column(Float)
    fetch_s: Mapped[float | None] = mapped_column(Float)
    fetch_chunks: Mapped[int | None] = mapped_column(BigInteger)
    recompute_chunks: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (PrimaryKeyConstraint("node_id", "ts_ms"),)


class RouteSample(Base):
    """One scrape of one router (``/v1/stats``), as increases since the previous scrape. The
    row with ``node = ''`` is the router as a whole and carries every counter; a node's row
    carries only its ``decisions`` and ``to_holder`` (its other counters are NULL), so fleet
    figures read the router's row and per-node figures the others, never both summed."""

    __tablename__ = "route_sample"

    #: the router's URL, credentials redacted
    router: Mapped[str] = mapped_column(String(255))
    #: the chosen node; '' for the router as a whole
    node: Mapped[str] = mapped_column(String(128))
    ts_ms: Mapped[int] = mapped_column(BigInteger)
    decisions: Mapped[int | None] = mapped_column(BigInteger)
    #: decisions sent to a node already holding part of the prompt's prefix
    to_holder: Mapped[int | None] = mapped_column(BigInteger)
    #: requests no node could serve (router row only)
    no_node: Mapped[int | None] = mapped_column(BigInteger)
    #: chunks of the routed prompts, those the index placed somewhere, those read on the chosen
    #: node itself, and those it pulls from other nodes (with their bytes)
    requested_chunks: Mapped[int | None] = mapped_column(BigInteger)
    indexed_chunks: Mapped[int | None] = mapped_column(BigInteger)
    local_chunks: Mapped[int | None] = mapped_column(BigInteger)
    pulled_chunks: Mapped[int | None] = mapped_column(BigInteger)
    pulled_bytes: Mapped[int | None] = mapped_column(BigInteger)
    #: prompt tokens routed, those the plans fetch instead of prefilling, those recomputed
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    fetched_tokens: Mapped[int | None] = mapped_column(BigInteger)
    recomputed_tokens: Mapped[int | None] = mapped_column(BigInteger)
    #: seconds the router spent deciding (measured in the router: index lookup + scoring)
    decision_s: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (PrimaryKeyConstraint("router", "node", "ts_ms"),)


class RouteLinkSample(Base):
    """Chunks and bytes a router's decisions pulled from a holder in ``from_dc`` to the chosen
    node in ``to_dc`` (the same DC included), as increases since the previous scrape."""

    __tablename__ = "route_link_sample"

    router: Mapped[str] = mapped_column(String(255))
    from_dc: Mapped[str] = mapped_column(String(64))
    to_dc: Mapped[str] = mapped_column(String(64))
    ts_ms: Mapped[int] = mapped_column(BigInteger)
    pulled_chunks: Mapped[int | None] = mapped_column(BigInteger)
    pulled_bytes: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (PrimaryKeyConstraint("router", "from_dc", "to_dc", "ts_ms"),)


class RouteReport(Base):
    """A saved replayed comparison of routing policies (`kvctl bench route`'s result, saved by
    the demo); the dashboard's routing page shows the latest."""

    __tablename__ = "route_report"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts_ms: Mapped[int] = mapped_column(BigInteger, index=True)
    #: the report as JSON
    report: Mapped[str] = mapped_column(Text)


class CounterState(Base):
    """The last raw counter values of each series, so a restarted collector (or a second one
    taking over a DC) computes the next increase exactly instead of losing an interval."""

    __tablename__ = "counter_state"

    series: Mapped[str] = mapped_column(String(255), primary_key=True)
    #: JSON: {"epoch": agent start time or null, "values": {counter: raw value}}
    state: Mapped[str] = mapped_column(Text)
    ts_ms: Mapped[int] = mapped_column(BigInteger)


class RollupState(Base):
    """How far each rollup has been computed: buckets before ``done_until_ms`` are final."""

    __tablename__ = "rollup_state"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    done_until_ms: Mapped[int] = mapped_column(BigInteger)


# --- rollups -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Series:
    """How a raw sample table rolls up: keys to group by, counters to sum, gauges to summarise."""

    table: str
    keys: tuple[str, ...]
    sums: tuple[str, ...]
    gauges: tuple[str, ...]


SERIES: Final = (
    Series("node_sample", ("node_id",), ("up",), ("scrape_seconds",)),
    Series(
        "cache_sample",
        ("node_id", "tier"),
        (
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
            "read_chunks",
            "read_missing_chunks",
        ),
        ("used_bytes", "capacity_bytes", "pinned_bytes", "items"),
    ),
    Series(
        "power_sample",
        ("node_id", "gpu_index"),
        ("energy_j",),
        ("power_w", "utilization_ratio", "memory_used_bytes"),
    ),
    Series(
        "emulated_power_sample",
        ("node_id", "gpu_profile", "model"),
        ("lookup_tokens", "busy_s", "energy_j"),
        ("power_w",),
    ),
    Series(
        "link_sample",
        ("src_node_id", "dst_node_id"),
        ("ok",),
        ("rtt_s", "bandwidth_bytes_per_s", "loss_ratio"),
    ),
    Series(
        "engine_sample",
        ("node_id", "engine"),
        (
            "prompt_tokens",
            "cached_prompt_tokens",
            "generation_tokens",
            "requests",
            "ttft_count",
            "ttft_sum_s",
            "lmcache_hit_tokens",
            "lmcache_requested_tokens",
            "kv_reused_blocks",
            "kv_missed_blocks",
            "kvbm_matched_tokens",
            "kvbm_offload_host_blocks",
            "kvbm_offload_disk_blocks",
            "kvbm_onboard_host_blocks",
            "kvbm_onboard_disk_blocks",
        ),
        ("ttft_p99_s", "kv_usage_ratio", "lmcache_local_cache_usage_bytes"),
    ),
    Series(
        "plan_sample",
        ("node_id", "prefill_basis", "prefill_model", "prefill_gpu"),
        ("saved_s", "recompute_s", "fetch_s", "fetch_chunks", "recompute_chunks"),
        (),
    ),
    Series(
        "route_sample",
        ("router", "node"),
        (
            "decisions",
            "to_holder",
            "no_node",
            "requested_chunks",
            "indexed_chunks",
            "local_chunks",
            "pulled_chunks",
            "pulled_bytes",
            "tokens",
            "fetched_tokens",
            "recomputed_tokens",
            "decision_s",
        ),
        (),
    ),
    Series(
        "route_link_sample", ("router", "from_dc", "to_dc"), ("pulled_chunks", "pulled_bytes"), ()
    ),
)

SERIES_BY_TABLE: Final = {s.table: s for s in SERIES}

#: rollup resolutions, finest first: name suffix -> bucket width in milliseconds (days are UTC)
RESOLUTIONS: Final = {"1m": 60_000, "1h": 3_600_000, "1d": 86_400_000}


def rollup_columns(series: Series, raw: Table) -> list[Column[object]]:
    """Columns of a rollup table: bucket, keys, sample count, sums, and per gauge sum/max/n."""
    cols: list[Column[object]] = [Column("bucket_ms", BigInteger, nullable=False)]
    for k in series.keys:
        cols.append(Column(k, raw.c[k].type, nullable=False))
    cols.append(Column("samples", Integer, nullable=False))
    for s in series.sums:
        is_float = isinstance(raw.c[s].type, Float)
        cols.append(Column(s, Float if is_float else BigInteger))
    for g in series.gauges:
        cols += [
            Column(f"{g}_sum", Float),
            Column(f"{g}_max", Float),
            Column(f"{g}_n", Integer, nullable=False),
        ]
    return cols


def _define_rollups() -> dict[tuple[str, str], Table]:
    tables: dict[tuple[str, str], Table] = {}
    for series in SERIES:
        raw = Base.metadata.tables[series.table]
        stem = series.table.removesuffix("_sample")
        for res in RESOLUTIONS:
            name = f"{stem}_{res}"
            tables[series.table, res] = Table(
                name,
                Base.metadata,
                *rollup_columns(series, raw),
                PrimaryKeyConstraint(*series.keys, "bucket_ms"),
            )
    return tables


#: (raw table name, resolution) -> rollup table
ROLLUPS: Final = _define_rollups()

# Time indexes for retention deletes and fleet-wide windows. On PostgreSQL they are BRIN:
# samples arrive in time order, and BRIN is orders of magnitude smaller than a B-tree there.
for _series in SERIES:
    _raw = Base.metadata.tables[_series.table]
    Index(f"ix_{_series.table}_ts_ms", _raw.c.ts_ms, postgresql_using="brin")
    for _res in RESOLUTIONS:
        _t = ROLLUPS[_series.table, _res]
        Index(f"ix_{_t.name}_bucket_ms", _t.c.bucket_ms, postgresql_using="brin")


def raw_table(name: str) -> Table:
    return Base.metadata.tables[name]
