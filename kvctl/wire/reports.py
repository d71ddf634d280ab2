"""The shape of what an agent reports on its control API: ``/v1/info``, ``/v1/stats`` and
``/v1/probe``. The agent builds these and the SDK returns them; both are typed by these
definitions, so a field is added, renamed or removed here and nowhere else.

Counters are cumulative since the agent started (``started_s``); ratios are derived.
"""

# no ``from __future__ import annotations``: TypedDict reads NotRequired from evaluated
# annotations only, and tests check reports against __required_keys__
from typing import Any, Literal, NotRequired, TypedDict


class TierUsage(TypedDict):
    """One tier's occupancy."""

    capacity_bytes: int
    used_bytes: int
    pinned_bytes: int
    chunks: int


class TierEntry(TierUsage):
    """A tier as ``/v1/info`` lists it (fastest first)."""

    name: str


class UnavailableTier(TypedDict):
    """A tier the settings ask for that the agent does not serve: never opened (no CUDA:
    ``capacity_bytes`` and ``device`` say what was asked for), not opened yet (a disk tier
    whose directory cannot be used: tried again, ``tries`` so far, the next at ``next_try_s``;
    ``reason`` is the last try's error) or failed in service (``offline``)."""

    name: str
    reason: str
    capacity_bytes: NotRequired[int]
    device: NotRequired[str]
    offline: NotRequired[bool]
    tries: NotRequired[int]
    next_try_s: NotRequired[float]


class ModelEntry(TypedDict):
    id: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    bytes_per_token: int
    chunk_bytes: int


class DataPlaneAddresses(TypedDict):
    #: "HOST:PORT" the TCP listener bound, None when off
    tcp: str | None
    #: the Unix socket's path, None when off
    unix: str | None
    #: whether local clients may read chunks from the shared-memory arena
    shm: bool
    #: bytes of that arena on huge pages in the agent's mapping (None without shm, or where
    #: unreadable): engines copy out of 4 KiB pages measurably slower
    shm_huge_page_bytes: int | None
    #: the kernel's huge-page mode for shared memory (shmem_enabled; None where unreadable)
    shmem_huge_pages: str | None
    #: the data plane's capabilities, as its HELLO names them (``protocol.DATA_PLANE_FEATURES``)
    features: dict[str, object]


class DataDir(TypedDict):
    """The state directory: its filesystem's free and total bytes and its permission bits (None
    where unreadable)."""

    path: str
    free_bytes: int | None
    total_bytes: int | None
    mode: int | None


class AgentInfo(TypedDict):
    """``/v1/info``."""

    name: str
    dc: str
    version: str
    pid: int
    started_s: float
    chunk_tokens: int
    max_chunk_bytes: int
    eviction: str
    tiers: list[TierEntry]
    unavailable_tiers: list[UnavailableTier]
    models: list[ModelEntry]
    isolated_tenants: list[str]
    #: "node" or "pool"
    role: str
    #: the pool and peers (``kvctl.remote``'s description), None without them
    remote: dict[str, Any] | None
    dataplane: DataPlaneAddresses
    auth: bool
    data_dir: DataDir


class TierCounters(TypedDict):
    """One tier's counters in ``/v1/stats``."""

    hits: int
    hit_tokens: int
    #: hits on a chunk the same tenant stored
    reuse_hits: int
    #: hits on a chunk another tenant stored
    sharing_hits: int
    puts: int
    bytes_written: int
    bytes_read: int
    #: chunks that arrived here on a read (from a slower tier, or into the lease tier)
    promotions: int
    #: chunks that arrived here from a faster tier
    demotions: int
    #: chunks that left this tier, by reason
    evictions: dict[str, int]
    #: writes that found the tier's filesystem full below its capacity (a disk tier's)
    filesystem_full: int
    #: chunk files the tier's scan at start could not read (I/O errors: a bad sector) and
    #: skipped, left in place (a disk tier's)
    unreadable_on_open: int


class StoreCounters(TypedDict):
    """The node's counters in ``/v1/stats``: chunk lookups and hits, and what left the node."""

    #: lookup calls (one per request's prefix)
    lookups: int
    lookup_chunks: int
    lookup_tokens: int
    hit_chunks: int
    hit_tokens: int
    reuse_hits: int
    sharing_hits: int
    #: hit_chunks / lookup_chunks (None before any lookup: unknown, not 0)
    hit_ratio: float | None
    #: chunks that left the node (a demotion keeps a chunk on it)
    drops: int
    demotion_failures: int
    admission_refused: int
    #: puts not stored: a policy declined them, or they were unreachable (below)
    bypassed_puts: int
    #: of ``bypassed_puts``, those turned away as deeper in their chain than all the tiers
    #: hold (the ``bypass_unreachable`` setting)
    unreachable_puts: int
    corrupt_dropped: int
    rerouted_puts: int
    spilled_puts: int
    tiers: dict[str, TierCounters]


class DataplaneCounters(TypedDict):
    """``/v1/stats``' data plane counters, since the agent started."""

    #: PUT chunks refused because their bytes did not match their sender's XXH3-64 (damaged on
    #: the way): ``kvctl_dataplane_corrupt_puts_total``
    corrupt_puts: int
    #: PUT chunks no tier could take (NO_ROOM): ``kvctl_dataplane_no_room_puts_total``
    no_room_puts: int
    #: chunks an engine's reads asked for (GET, LEASE, LOOKUP_LEASE; a LEASE's fallback items
    #: there, as its GET_COUNTED re-read counts nothing; not a peer's FETCH, whose read that
    #: peer counts): ``kvctl_dataplane_read_chunks_total`` of ops get and lease
    read_chunks: int
    #: of those, chunks not here: evicted since the lookup that counted them as hits (lookups
    #: count hits when they answer), or never looked up
    read_missing_chunks: int


class AgentStats(TypedDict):
    """``/v1/stats``."""

    stats: StoreCounters
    usage: dict[str, TierUsage]
    #: live shared-memory read leases
    leases: int
    #: measured read bandwidth per tier, None until measured
    read_bandwidth_bytes_per_second: dict[str, float | None]
    #: stats.hit_ratio, repeated at the top
    hit_ratio: float | None
    #: counters restart at zero with the agent: a collector spots a restart by this changing
    started_s: float
    #: fetch-or-recompute decisions and the rates behind them (``kvctl.remote``'s status)
    fetch_plans: dict[str, Any]
    #: each tier's eviction policy: {"policy": name, ...}; lineage-adaptive adds the candidate
    #: it follows now ("leader"), how often the lead changed ("switches") and its "candidates"
    policies: NotRequired[dict[str, dict[str, Any]]]
    #: data plane counters (an agent before them sends none)
    dataplane: NotRequired[DataplaneCounters]
    #: the pool and peers (``kvctl.remote``'s status), only when configured
    remote: NotRequired[dict[str, Any]]


class LinkProbe(TypedDict):
    """``/v1/probe``: one agent's measurement of the link to another agent's data plane."""

    target: str
    #: the target answered and every step completed; ``error`` says why not
    ok: bool
    rtt_s: float | None
    rtt_min_s: float | None
    #: lost pings / pings
    loss_ratio: float
    upload_bytes_per_s: float | None
    download_bytes_per_s: float | None
    #: the lower of upload and download
    bandwidth_bytes_per_s: float | None
    probe_bytes: int
    error: str | None
    #: "emulated": every ping and transfer included ``emulated_delay_s``, the in-process wait
    #: this agent's own fetches over the same configured link see (``--link NAME:delay_ms=N``);
    #: "measured": the network alone
    rtt_basis: Literal["measured", "emulated"]
    #: that wait, one per round trip; None when measured
    emulated_delay_s: float | None
