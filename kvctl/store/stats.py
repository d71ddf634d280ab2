"""Store counters. Everything is a monotonic count; ratios are derived when read, never stored."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvctl.ratios import ratio

#: "replaced": an isolated tenant's put took its key back from a chunk another tenant stored;
#: "filesystem": a disk tier's filesystem was full below the tier's capacity (others' files,
#: or a capacity larger than the free space), so the tier made room there by its policy
EVICTION_REASONS = (
    "capacity",
    "resize",
    "flush",
    "explicit",
    "corrupt",
    "replaced",
    "filesystem",
)


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    hit_tokens: int = 0
    reuse_hits: int = 0
    sharing_hits: int = 0
    puts: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    #: chunks that arrived in this tier on a read: up from a slower tier, or into the lease
    #: (cpu) tier from a gpu tier above it
    promotions: int = 0
    #: chunks that arrived in this tier from an upper (faster) tier
    demotions: int = 0
    #: chunks that left this tier by eviction, by reason (a demoted chunk counts here too)
    evictions: Counter[str] = field(default_factory=Counter)
    #: writes into this tier that found its filesystem full (ENOSPC, EDQUOT, EFBIG), whether
    #: evicting its own chunks then made room (evictions["filesystem"]) or not
    filesystem_full: int = 0
    #: chunk files (or fan-out directories) the tier's scan at open could not read (an I/O
    #: error) and skipped: not served, left in place (``DiskTier.unreadable_on_open``)
    unreadable_on_open: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "hits": self.hits,
            "hit_tokens": self.hit_tokens,
            "reuse_hits": self.reuse_hits,
            "sharing_hits": self.sharing_hits,
            "puts": self.puts,
            "bytes_written": self.bytes_written,
            "bytes_read": self.bytes_read,
            "promotions": self.promotions,
            "demotions": self.demotions,
            "evictions": {r: self.evictions.get(r, 0) for r in EVICTION_REASONS},
            "filesystem_full": self.filesystem_full,
            "unreadable_on_open": self.unreadable_on_open,
        }


@dataclass(slots=True)
class StoreStats:
    #: lookup calls (one per request prefix lookup)
    lookups: int = 0
    lookup_chunks: int = 0
    lookup_tokens: int = 0
    hit_chunks: int = 0
    hit_tokens: int = 0
    reuse_hits: int = 0
    sharing_hits: int = 0
    #: chunks that left the store entirely (not demoted)
    drops: int = 0
    demotion_failures: int = 0
    admission_refused: int = 0
    #: puts not stored: declined by a policy's admission check, or turned away as unreachable
    bypassed_puts: int = 0
    #: of those, the ones ``bypass_unreachable`` turned away (deeper in their chain than all
    #: the tiers hold), so an operator can tell the rule from a policy's declines
    unreachable_puts: int = 0
    corrupt_dropped: int = 0
    tiers: dict[str, TierStats] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "lookups": self.lookups,
            "lookup_chunks": self.lookup_chunks,
            "lookup_tokens": self.lookup_tokens,
            "hit_chunks": self.hit_chunks,
            "hit_tokens": self.hit_tokens,
            "reuse_hits": self.reuse_hits,
            "sharing_hits": self.sharing_hits,
            "hit_ratio": ratio(self.hit_chunks, self.lookup_chunks),
            "drops": self.drops,
            "demotion_failures": self.demotion_failures,
            "admission_refused": self.admission_refused,
            "bypassed_puts": self.bypassed_puts,
            "unreachable_puts": self.unreachable_puts,
            "corrupt_dropped": self.corrupt_dropped,
            "tiers": {name: t.as_dict() for name, t in self.tiers.items()},
        }
