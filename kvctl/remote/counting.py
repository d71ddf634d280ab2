"""Counting the tiers beyond this node (the remote pool, peers) in the local store's counters, so
the agent's stats show one hit ratio over every tier a lookup reached.

The store holds none of these tiers' bytes; it only counts them, through its ``accounting``
(each remote tier added with ``TieredStore.add_external_tier``). Everything here runs under the
store's lock, like the store's own counting.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvctl.store.store import TieredStore


class RemoteTierCounts:
    """Hits and reads of the tiers ``tiers`` (names no local tier has) counted in ``store``."""

    def __init__(self, store: TieredStore, tiers: Iterable[str]) -> None:
        self._store = store
        for name in tiers:
            store.add_external_tier(name)

    def count_hits(
        self, tier: str, owners: Sequence[str], tokens: Sequence[int], *, tenant: str
    ) -> None:
        """Chunks a lookup found in ``tier`` past the local prefix the store's lookup counted
        (chunk ``i`` stored by ``owners[i]``, of ``tokens[i]`` tokens): counted like local hits,
        as reuse when the owner is the asking tenant."""
        hits = len(owners)
        hit_tokens = sum(tokens)
        with self._store.locked():
            accounting = self._store.accounting
            accounting.count_tier_hits(tier, hits, hit_tokens, list(owners).count(tenant))
            accounting.count_hits_past_lookup(hits, hit_tokens)

    def recount_owner(self, tier: str, *, reuse: bool) -> None:
        """One hit counted in ``tier`` as sharing (``reuse``: True) or reuse (False) moved to
        the other side: the copy that arrived was the other owner's."""
        step = 1 if reuse else -1
        with self._store.locked():
            stats = self._store.accounting.stats
            for st in (stats, stats.tiers[tier]):
                st.reuse_hits += step
                st.sharing_hits -= step

    def count_read(self, tier: str, nbytes: int, *, landed: str | None) -> None:
        """A chunk of ``nbytes`` read from ``tier`` and kept here, in local tier ``landed``
        (None: not kept): a promotion there, its bytes already counted by the store's put."""
        with self._store.locked():
            accounting = self._store.accounting
            accounting.count_read(tier, nbytes)
            if landed is not None and landed in self._store.tier_names:
                accounting.count_promotion(landed)
