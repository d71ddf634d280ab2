"""The agent's settings: one typed record, filled by ``kvctl.agent.config`` from defaults, a TOML
file, ``KVCTL_*`` environment variables and command-line flags (later sources win)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from kvctl.paths import default_state_dir
from kvctl.store.keys import DEFAULT_CHUNK_TOKENS, KVLayout
from kvctl.wire.address import connect_host, split_host_port, url_host

DEFAULT_CONTROL_PORT = 7070
DEFAULT_DATA_PORT = 7071
#: the smallest size of each tier, at start (--cpu, --disk, --gpu-capacity) and on a live
#: resize alike: every agent serves reads from its cpu tier, so it cannot be 0; a gpu or disk
#: tier of 0 is off
MIN_TIER_BYTES = {"gpu": 0, "cpu": 1, "disk": 0}


def tier_size_problem(tier: str, size_bytes: int) -> str | None:
    """Why ``tier`` cannot be sized ``size_bytes``; None when it can."""
    least = MIN_TIER_BYTES.get(tier, 0)
    if size_bytes >= least:
        return None
    return (
        f"the {tier} tier cannot be {size_bytes} bytes: every agent has one, of at least "
        f"{least} byte(s); to empty it, `kvctl flush --tier {tier}` (--demote keeps its chunks)"
    )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model namespace the agent computes keys for (lookup by tokens)."""

    id: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.layers, self.kv_heads, self.head_dim, self.dtype)


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """An operator's override for one remote link: figures to use instead of measured ones, a
    forced decision, and an emulated delay (tests and demos without real distance)."""

    name: str
    override: str = "auto"
    rtt_seconds: float | None = None
    bandwidth_bytes_per_second: float | None = None
    delay_seconds: float = 0.0


# Llama-3.1-8B's KV layout: 131,072 bytes per token, 32 MiB per 256-token chunk
DEFAULT_MODELS = (ModelSpec("llama-3.1-8b", 32, 8, 128, "bfloat16"),)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    name: str = field(default_factory=socket.gethostname)
    dc: str = "local"
    #: control API (HTTP/JSON)
    listen: str = f"127.0.0.1:{DEFAULT_CONTROL_PORT}"
    #: binary data plane over TCP; "off" disables it
    data_listen: str = f"127.0.0.1:{DEFAULT_DATA_PORT}"
    #: binary data plane over a Unix socket; "" means ``<data_dir>/agent.sock``, "off" disables
    socket: str = ""
    #: "" means ``<state dir>/<name>``
    data_dir: str = ""
    cpu_bytes: int = 1 << 30
    #: 0 disables the disk tier
    disk_bytes: int = 8 << 30
    #: CUDA memory for the gpu tier (above cpu); 0 disables it, and where CUDA is unavailable
    #: the agent runs without it and says why
    gpu_capacity_bytes: int = 0
    #: the CUDA device the gpu tier lives on: "cuda" or "cuda:N"
    gpu_device: str = "cuda:0"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    #: largest chunk a client may send; bigger frames are refused before they are read
    max_chunk_bytes: int = 256 << 20
    #: largest control-API request body; a bigger one is a 413 before it is read (the default
    #: fits the largest valid request, 100,000 keys)
    max_body_bytes: int = 4 << 20
    #: a data-plane frame still unfinished after this (plus 1 s per MiB it moved) is cut off
    #: with a TIMEOUT error frame: stalled or trickling senders hold nothing for long
    data_frame_timeout_seconds: float = 30.0
    #: bytes of large puts (over 1 MiB) all connections may hold in flight at once; a put that
    #: cannot get its share within the frame timeout gets BUSY. Replies get a budget of the same
    #: size, apart, for the copies of chunks they cannot send in place (past it: MISSING)
    data_put_budget_bytes: int = 1 << 30
    #: data-plane connections each transport (TCP, the Unix socket) keeps open at most; one past
    #: it is closed at once (each connection is a thread; engines open a few each)
    data_max_connections: int = 1024
    #: TCP data-plane connections one source may hold before they authenticate (their HELLO
    #: served): one past it is closed at once, so one address that keeps reopening silent
    #: connections cannot fill ``data_max_connections``; authenticated connections and the Unix
    #: socket do not count. A source is an IPv4 address (IPv4-mapped IPv6 ones as IPv4), an
    #: IPv6 address's /64 (one host may use any address of its /64), a link-local address
    #: (``kvctl.connection_sources.source_key``)
    data_max_unauthenticated_per_source: int = 32
    #: TCP data-plane connections one source (as above) may hold in all, authenticated or
    #: not: past it, its own longest idle connection is closed to make room (none idle: the new
    #: one is refused), so one client cannot hold the whole of ``data_max_connections``. It
    #: must cover what one host opens: every engine and agent on a host shares its address
    data_max_connections_per_source: int = 256
    eviction: str = "lineage-adaptive"
    disk_admission: str = "all"
    #: fsync each disk chunk before it counts as stored (power-loss safety; crash safety holds
    #: without it because chunks are written to a temp file and renamed)
    fsync: bool = False
    #: don't store a chunk deeper in its chain than all the tiers together hold (no lookup
    #: from the chain's first chunk could reach it; storing it evicts chunks one could): only
    #: where engines look prefixes up from their first chunk (kvctl's own engine, replay), not
    #: behind one that keeps a prefix of its own (vLLM's prefix cache); refused with a pool or
    #: peers, whose chunks a lookup here may take before one held here (``TieredStore``'s
    #: ``bypass_unreachable``)
    bypass_unreachable: bool = False
    #: bearer token for the control API and the data plane; required off loopback
    token: str = ""
    #: serve the cpu tier from a shared-memory segment that local clients read directly
    shm: bool = True
    #: how long a shared-memory read lease holds a chunk in place
    lease_seconds: float = 10.0
    #: tenants whose chunks are salted into their own namespace (never shared)
    isolated_tenants: tuple[str, ...] = ()
    models: tuple[ModelSpec, ...] = DEFAULT_MODELS
    log_level: str = "info"
    #: at a clean stop (SIGTERM, `kvctl agent stop`), once the data plane drained (10 s at
    #: most), the gpu and cpu tiers' unpinned chunks are demoted to the disk tier, hottest
    #: first, for at most this long (0: off), so a restart keeps the hot set (pinned chunks
    #: stay, and are lost). 15 s keeps the drain plus this under `kvctl agent stop`'s --timeout
    #: (30 s) and the systemd unit's and the DaemonSet's 45 s; a stopper that kills sooner cuts
    #: the demotion short: the next start scans the disk tier as after a crash, and finds
    #: whole chunks only
    stop_demote_seconds: float = 15.0
    #: a detached agent's log (``<data_dir>/agent.log``) rolls over to ``agent.log.1`` once it
    #: passes this size; 0: never (a log a terminal or journald takes is never rolled over)
    log_max_bytes: int = 64 << 20
    #: rolled-over logs kept, ``agent.log.1`` (the newest) to ``agent.log.N``; older ones are
    #: deleted
    log_backups: int = 3
    #: "node" serves engines; "pool" serves other agents as their shared remote tier
    role: str = "node"
    #: the shared remote tier: "" (none), redis://, rediss://, valkey://, redis+cluster:// or
    #: kvctl://HOST:PORT (a pool agent's data plane)
    pool: str = ""
    #: key prefix in a Redis pool: agents that share it share chunks
    pool_prefix: str = "kvctl"
    #: the pool's byte capacity; 0 keeps what the pool already has (it is shared)
    pool_capacity_bytes: int = 0
    #: each tenant's share of a Redis pool; 0 means no quota
    pool_tenant_quota_bytes: int = 0
    #: records expire after this long in a Redis pool; 0 means never
    pool_ttl_seconds: float = 0.0
    #: "through": every chunk stored here is copied to the pool in the background, so other
    #: nodes can hit it; "off": the pool is only read
    pool_write: str = "through"
    #: agents in other nodes or DCs to pull chunks from: (name, "HOST:PORT" of their data plane)
    peers: tuple[tuple[str, str], ...] = ()
    #: per-link operator overrides, by link name ("pool" or a peer's name)
    links: tuple[LinkSpec, ...] = ()
    #: prefill speed the fetch-or-recompute decision compares fetches with; 0 means modeled
    #: from the model's profile on ``gpu`` at the default MFU
    prefill_tokens_per_second: float = 0.0
    #: read bandwidth of the disk tier the fetch-or-recompute decision uses (bytes/s); 0 means
    #: measured by the store's reads (until the first read, disk hits are taken so it measures)
    disk_read_bytes_per_second: float = 0.0
    #: GPU profile (a name, not a device) prefill is modeled on; the gpu tier is gpu_capacity_bytes
    gpu: str = "h100"
    #: token this agent presents to pool agents and peers ("" means its own token)
    remote_token: str = ""
    #: the fleet index at a router (http://HOST:PORT): a lookup asks it which nodes hold the
    #: chunks past the local prefix and probes only those peers (and the pool), instead of every
    #: peer; "" probes every peer. The index names nodes by their agents' ``name``, so each
    #: peer must be configured under its agent's name for the index's answer to reach it
    index_url: str = ""
    #: token presented to the router ("" means ``remote_token``, else this agent's own token)
    index_token: str = ""
    #: a lookup waits this long for the index, then probes every peer (and backs off from it)
    index_timeout_seconds: float = 0.25

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir) if self.data_dir else default_state_dir() / self.name

    @property
    def socket_path(self) -> Path | None:
        if self.socket == "off":
            return None
        return Path(self.socket) if self.socket else self.data_path / "agent.sock"

    @property
    def control_host_port(self) -> tuple[str, int]:
        return split_host_port(self.listen, DEFAULT_CONTROL_PORT)

    @property
    def data_host_port(self) -> tuple[str, int] | None:
        if self.data_listen == "off":
            return None
        return split_host_port(self.data_listen, DEFAULT_DATA_PORT)

    @property
    def control_url(self) -> str:
        host, port = self.control_host_port
        return f"http://{url_host(connect_host(host))}:{port}"
