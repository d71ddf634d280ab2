"""The fleet's hit ratios: one definition each, named for what it divides.

The dashboard, `kvctl status`, `kvctl top` and the benches all read their hit ratio and its
reuse/sharing split from :class:`HitCounts`, whether the counts come from the metrics database
or from live agents, so the same words mean the same number everywhere. Pure Python: the live
views import it without the database.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: every ratio :meth:`HitCounts.hit_figures` reports, by the name it has in every JSON output
RATIO_NAMES: Final = (
    "hit_ratio",
    "reuse_hit_ratio",
    "sharing_hit_ratio",
    "reuse_share_of_hits",
    "sharing_share_of_hits",
)


def ratio(num: float, den: float) -> float | None:
    """``num / den``; None (unknown, not zero) where the denominator is zero."""
    return num / den if den else None


@dataclass(slots=True)
class HitCounts:
    """Chunk lookups and hits, the hits split by who stored the chunk: reuse (the tenant that
    asks) or sharing (another tenant). Whole counts, except the live view's increases, which
    are floats."""

    lookups: float = 0
    hits: float = 0
    reuse_hits: float = 0
    sharing_hits: float = 0

    @property
    def hit_ratio(self) -> float | None:
        """Hits per chunk lookup."""
        return ratio(self.hits, self.lookups)

    @property
    def reuse_hit_ratio(self) -> float | None:
        """Hits on a chunk the same tenant stored, per lookup."""
        return ratio(self.reuse_hits, self.lookups)

    @property
    def sharing_hit_ratio(self) -> float | None:
        """Hits on a chunk another tenant stored, per lookup (reuse + sharing = hit ratio)."""
        return ratio(self.sharing_hits, self.lookups)

    @property
    def reuse_share_of_hits(self) -> float | None:
        """The part of the hits that were on a chunk the same tenant stored."""
        return ratio(self.reuse_hits, self.hits)

    @property
    def sharing_share_of_hits(self) -> float | None:
        """The part of the hits that were on a chunk another tenant stored."""
        return ratio(self.sharing_hits, self.hits)

    def add_hits(self, other: HitCounts) -> None:
        self.lookups += other.lookups
        self.hits += other.hits
        self.reuse_hits += other.reuse_hits
        self.sharing_hits += other.sharing_hits

    def hit_figures(self) -> dict[str, float | None]:
        """The counts and every ratio, under the names all JSON outputs use."""
        counts: dict[str, float | None] = {
            "lookups": self.lookups,
            "hits": self.hits,
            "reuse_hits": self.reuse_hits,
            "sharing_hits": self.sharing_hits,
        }
        return counts | {name: getattr(self, name) for name in RATIO_NAMES}
