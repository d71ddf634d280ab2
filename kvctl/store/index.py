"""The store's index: one entry per cached chunk, and the result of a prefix lookup."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvctl.store.errors import InvalidArgument
from kvctl.store.tiers.base import ChunkMeta

DEFAULT_PRIORITY = 35  # TensorRT-LLM's default retention priority
MAX_PRIORITY = 100
#: longest tenant name (UTF-8 bytes) the store takes. A name is kept in every chunk's entry
#: (``tenant``, ``tenants``), in its events and in its disk file's header, so without a cap a
#: client naming a 64 KiB tenant per chunk made each chunk cost the agent ~60 KiB of memory
#: whatever its size. The router takes tenants of up to 256 characters too.
MAX_TENANT_BYTES = 256


def check_tenant(tenant: str) -> None:
    """Raise InvalidArgument for a tenant name longer than ``MAX_TENANT_BYTES`` in UTF-8."""
    # UTF-8 takes at most 4 bytes a character: only a longer name needs encoding (hot path)
    if len(tenant) > MAX_TENANT_BYTES // 4:
        n = len(tenant.encode("utf-8", "surrogatepass"))
        if n > MAX_TENANT_BYTES:
            raise InvalidArgument(
                f"tenant name is {n} bytes in UTF-8; at most {MAX_TENANT_BYTES} are allowed"
            )


@dataclass(slots=True, eq=False)
class Entry:
    """Everything the store knows about one cached chunk. Lives in exactly one tier."""

    key: bytes
    tier: str
    size_bytes: int
    tokens: int
    tenant: str
    parent: bytes | None
    priority: int = DEFAULT_PRIORITY
    isolated: bool = False
    pinned: bool = False
    created_s: float = 0.0
    last_access_s: float = 0.0
    #: logical clock of the last access: orders accesses exactly, unlike wall time
    last_tick: int = 0
    #: reads that served this chunk (get, lease, touch); lookups are counted per tier instead
    hit_count: int = 0
    access_count: int = 1
    #: cached children (chunks whose parent is this key), anywhere in the store
    children: int = 0
    #: priority falls back to DEFAULT_PRIORITY after this time (None: keeps it)
    retention_until_s: float | None = None
    #: depth in its prefix chain (0 = first chunk); known when the caller passes it
    depth: int = 0
    #: distinct tenants that hit this chunk, capped; a spread signal for policies
    tenants: set[str] = field(default_factory=set)

    def effective_priority(self, now_s: float) -> int:
        if self.retention_until_s is not None and now_s >= self.retention_until_s:
            return DEFAULT_PRIORITY
        return self.priority

    def meta(self) -> ChunkMeta:
        """What a tier stores with the chunk's bytes."""
        return ChunkMeta(
            key=self.key,
            size_bytes=self.size_bytes,
            tokens=self.tokens,
            tenant=self.tenant,
            parent=self.parent,
            priority=self.priority,
            isolated=self.isolated,
            created_s=self.created_s,
        )

    def listing(self) -> dict[str, Any]:
        """What an operator's listing shows of a chunk (the key left to the caller's format)."""
        return {
            "tier": self.tier,
            "size_bytes": self.size_bytes,
            "tokens": self.tokens,
            "tenant": self.tenant,
            "pinned": self.pinned,
            "priority": self.priority,
            "hit_count": self.hit_count,
            "last_access_s": self.last_access_s,
            "isolated": self.isolated,
        }

    def as_dict(self) -> dict[str, object]:
        return {
            "key": self.key.hex(),
            "tier": self.tier,
            "size_bytes": self.size_bytes,
            "tokens": self.tokens,
            "tenant": self.tenant,
            "parent": self.parent.hex() if self.parent else None,
            "priority": self.priority,
            "retention_until_s": self.retention_until_s,
            "isolated": self.isolated,
            "pinned": self.pinned,
            "created_s": self.created_s,
            "last_access_s": self.last_access_s,
            "hit_count": self.hit_count,
            "children": self.children,
        }


@dataclass(frozen=True, slots=True)
class HotChunk:
    """One of a store's most-hit chunks, with what is known of the prefix it ends: a snapshot
    for operators, detached from the live Entry so it can leave the store's lock."""

    key: bytes
    tier: str
    size_bytes: int
    tokens: int
    tenant: str
    pinned: bool
    priority: int
    hit_count: int
    last_access_s: float
    isolated: bool
    #: cached chunks in the prefix chain ending here, this one included
    prefix_chunks: int
    #: tokens of those chunks
    prefix_tokens: int
    #: the chain reaches a first chunk (parent None); False when an ancestor is not cached
    #: (or the walk stopped early), so the prefix is only partly known
    prefix_complete: bool

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "key": self.key.hex()}


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Outcome of a longest-prefix lookup over a request's key chain."""

    total_chunks: int
    #: leading chunks that hit (usable as a prefix)
    matched_chunks: int
    #: tier of each key in the chain, None where it is not cached (also past the prefix)
    locations: tuple[str | None, ...]
    matched_tokens: int = 0

    @property
    def hit_ratio(self) -> float:
        return self.matched_chunks / self.total_chunks if self.total_chunks else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "total_chunks": self.total_chunks,
            "matched_chunks": self.matched_chunks,
            "matched_tokens": self.matched_tokens,
            "locations": list(self.locations),
        }
