"""A store's accounting: hits (reuse or sharing), lookups, per-tier traffic and measured read
bandwidth, read together for metrics and the stats API.

Every method is called under the store's lock (``TieredStore.locked()``); nothing here takes a
lock of its own, so counting costs the lookup hot path no more than the increments themselves.
Tiers the store does not hold (the remote pool, peers) are counted here too, in their own
``TierStats``: ``kvctl.remote`` adds them (``add_external_tier``) and counts their hits and reads
through ``count_tier_hits``, ``count_hits_past_lookup``, ``count_read`` and ``count_promotion``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from operator import attrgetter

from kvctl.store.errors import InvalidArgument
from kvctl.store.index import Entry
from kvctl.store.stats import StoreStats, TierStats

#: reads smaller than this say more about per-call overheads than about a tier's bandwidth
MIN_BANDWIDTH_SAMPLE_BYTES = 256 << 10
#: weight of the newest sample in a tier's read bandwidth (an exponential moving average)
_BANDWIDTH_EWMA_WEIGHT = 0.25
#: distinct tenants remembered per chunk (``Entry.tenants``: how widely it is shared)
_MAX_TENANTS_TRACKED = 8
_TENANT_OF = attrgetter("tenant")


class Accounting:
    """The counters of one store with tiers ``tier_names`` of ``chunk_tokens`` tokens a chunk."""

    def __init__(self, tier_names: Sequence[str], chunk_tokens: int) -> None:
        self._local = frozenset(tier_names)
        self._chunk_tokens = chunk_tokens
        self.stats = StoreStats(tiers={n: TierStats() for n in tier_names})
        #: puts that landed below their tier because it was offline (or failed on that put)
        self.rerouted_puts = 0
        #: puts that landed below their tier because no room could be made there (pinned
        #: chunks, or leased regions splitting the cpu arena's free space)
        self.spilled_puts = 0
        #: measured read bandwidth per tier, bytes/s (an EWMA; None until a large read)
        self._read_bandwidth: dict[str, float | None] = dict.fromkeys(tier_names)
        #: tiers beyond this node (the remote pool, peers): their hits are counted here, their
        #: bytes live elsewhere (so the store's ``usage()``, which nodes and DCs sum, leaves
        #: them out)
        self._external: list[str] = []

    def tier(self, name: str) -> TierStats:
        return self.stats.tiers[name]

    def as_dict(self) -> dict[str, object]:
        return {
            **self.stats.as_dict(),
            "rerouted_puts": self.rerouted_puts,
            "spilled_puts": self.spilled_puts,
        }

    # --- lookups and hits ---------------------------------------------------------------------
    def count_lookup(
        self, n: int, cached: int, cached_tokens: int, hits: int, hit_tokens: int
    ) -> None:
        """One lookup of ``n`` chunks whose cached prefix is ``cached`` chunks of
        ``cached_tokens`` tokens (the rest count chunk_tokens each), ``hits`` of them hits."""
        st = self.stats
        st.lookups += 1
        st.lookup_chunks += n
        st.lookup_tokens += cached_tokens + (n - cached) * self._chunk_tokens
        st.hit_chunks += hits
        st.hit_tokens += hit_tokens

    def count_hits(
        self, prefix: list[Entry], tiers: list[str], tokens: list[int], tenant: str
    ) -> None:
        """Hits on the cached ``prefix`` (in ``tiers``, of ``tokens`` each) asked for by
        ``tenant``: reuse where the chunk is its own, sharing where another tenant's."""
        reuse = list(map(_TENANT_OF, prefix)).count(tenant)
        m = len(prefix)
        if tiers.count(tiers[0]) == m:  # the common case: the whole prefix in one tier
            self.count_tier_hits(tiers[0], m, sum(tokens), reuse)
            return
        self.stats.reuse_hits += reuse
        self.stats.sharing_hits += m - reuse
        for e, tier, tok in zip(prefix, tiers, tokens, strict=True):
            ts = self.stats.tiers[tier]
            ts.hits += 1
            ts.hit_tokens += tok
            if e.tenant == tenant:
                ts.reuse_hits += 1
            else:
                ts.sharing_hits += 1

    def count_tier_hits(self, tier: str, hits: int, hit_tokens: int, reuse_hits: int) -> None:
        """``hits`` chunks of ``hit_tokens`` tokens found in ``tier``, ``reuse_hits`` of them
        the asking tenant's own (the rest are sharing hits)."""
        sharing = hits - reuse_hits
        ts = self.stats.tiers[tier]
        ts.hits += hits
        ts.hit_tokens += hit_tokens
        for st in (self.stats, ts):
            st.reuse_hits += reuse_hits
            st.sharing_hits += sharing

    def count_hits_past_lookup(self, hits: int, hit_tokens: int) -> None:
        """Hits extending the prefix a lookup counted (found beyond this node): the lookup
        counted these chunks as missed, of chunk_tokens tokens each, not knowing them."""
        self.stats.hit_chunks += hits
        self.stats.hit_tokens += hit_tokens
        self.stats.lookup_tokens += hit_tokens - hits * self._chunk_tokens

    @staticmethod
    def served(e: Entry, tenant: str) -> None:
        """A read that served a chunk: the per-chunk hit count and the spread of tenants."""
        e.hit_count += 1
        if len(e.tenants) < _MAX_TENANTS_TRACKED:
            e.tenants.add(tenant)

    # --- traffic ------------------------------------------------------------------------------
    def count_read(self, tier: str, nbytes: int) -> None:
        self.stats.tiers[tier].bytes_read += nbytes

    def count_written(self, tier: str, nbytes: int) -> None:
        self.stats.tiers[tier].bytes_written += nbytes

    def count_promotion(self, tier: str) -> None:
        """A chunk arrived in ``tier`` on a read (its bytes are counted where it was written)."""
        self.stats.tiers[tier].promotions += 1

    def note_bandwidth(self, tier: str, nbytes: int, seconds: float) -> None:
        """One read sample of ``tier``: ``nbytes`` in ``seconds`` (small ones are left out)."""
        if nbytes < MIN_BANDWIDTH_SAMPLE_BYTES or seconds <= 0:
            return
        sample = nbytes / seconds
        old = self._read_bandwidth.get(tier)
        self._read_bandwidth[tier] = (
            sample if old is None else old + _BANDWIDTH_EWMA_WEIGHT * (sample - old)
        )

    def read_bandwidth(self) -> dict[str, float | None]:
        return dict(self._read_bandwidth)

    # --- tiers beyond this node ---------------------------------------------------------------
    @property
    def external_tier_names(self) -> list[str]:
        return list(self._external)

    def add_external_tier(self, name: str) -> TierStats:
        if name in self._local or name in self._external:
            raise InvalidArgument(f"tier {name!r} already exists")
        self._external.append(name)
        return self.stats.tiers.setdefault(name, TierStats())


def busy_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of the ``(start, end)`` intervals: the time at least one ran."""
    total = 0.0
    covered_to = -math.inf
    for start, end in sorted(spans):
        if end > covered_to:
            total += end - max(start, covered_to)
            covered_to = end
    return total
