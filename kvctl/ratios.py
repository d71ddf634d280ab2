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


#: each ratio in :data:`RATIO_NAMES` and the two counts it divides (numerator, denominator)
RATIO_OF: Final[dict[str, tuple[str, str]]] = {
    "hit_ratio": ("hits", "lookups"),
    "reuse_hit_ratio": ("reuse_hits", "lookups"),
    "sharing_hit_ratio": ("sharing_hits", "lookups"),
    "reuse_share_of_hits": ("reuse_hits", "hits"),
    "sharing_share_of_hits": ("sharing_hits", "hits"),
}
#: the counts every hit ratio and share is taken over
HIT_COUNT_NAMES: Final = frozenset(("lookups", "hits", "reuse_hits", "sharing_hits"))


def ratio(num: float, den: float) -> float | None:
    """``num / den``; None (unknown, not zero) where the denominator is zero."""
    return num / den if den else None


def fraction(part: float, whole: float) -> float | None:
    """``part / whole`` for a part of a whole (hits of lookups, hit tokens of lookup tokens):
    None (unknown) where the whole is zero, and where the part is larger, which cannot be
    true (a broken or hostile agent's counts, rows recorded before the collector checked
    them): a hit ratio is never shown above 100%, nor clamped to a 100% no one measured."""
    return part / whole if whole and part <= whole else None


@dataclass(slots=True)
class HitCounts:
    """Chunk lookups and hits, the hits split by who stored the chunk: reuse (the tenant that
    asks) or sharing (another tenant). Whole counts, except the live view's increases, which
    are floats. A count named in ``unknown`` (its counter answered impossible, see
    :mod:`kvctl.db.sample_checks`) is held as 0 but reported None, and so is every ratio over
    it: a ratio over an unknown count is unknown, never a number."""

    lookups: float = 0
    hits: float = 0
    reuse_hits: float = 0
    sharing_hits: float = 0
    unknown: frozenset[str] = frozenset()

    def known(self, *counts: str) -> bool:
        """Whether every one of ``counts`` is known."""
        return self.unknown.isdisjoint(counts)

    def _ratio(self, name: str) -> float | None:
        num, den = RATIO_OF[name]
        return fraction(getattr(self, num), getattr(self, den)) if self.known(num, den) else None

    @property
    def impossible(self) -> bool:
        """Whether these counts cannot be true: more hits than lookups. (Not reuse or sharing
        hits against hits: an agent moves a hit between the two when its copy arrives, up to
        30 s after the lookup, so a span can hold a move without its hit.)"""
        return self.hits > self.lookups

    def unknown_hits(self) -> None:
        """Make the four hit counts unknown (0, reported None): a sum over nodes leaves them
        out, as ``add_hits`` does, and no ratio is taken over them."""
        self.lookups = self.hits = self.reuse_hits = self.sharing_hits = 0
        self.unknown = self.unknown | HIT_COUNT_NAMES

    @property
    def hit_ratio(self) -> float | None:
        """Hits per chunk lookup."""
        return self._ratio("hit_ratio")

    @property
    def reuse_hit_ratio(self) -> float | None:
        """Hits on a chunk the same tenant stored, per lookup."""
        return self._ratio("reuse_hit_ratio")

    @property
    def sharing_hit_ratio(self) -> float | None:
        """Hits on a chunk another tenant stored, per lookup (reuse + sharing = hit ratio)."""
        return self._ratio("sharing_hit_ratio")

    @property
    def reuse_share_of_hits(self) -> float | None:
        """The part of the hits that were on a chunk the same tenant stored."""
        return self._ratio("reuse_share_of_hits")

    @property
    def sharing_share_of_hits(self) -> float | None:
        """The part of the hits that were on a chunk another tenant stored."""
        return self._ratio("sharing_share_of_hits")

    @property
    def summed_unknown(self) -> frozenset[str]:
        """What a sum over nodes leaves out of these counts: the unknown ones, and all four hit
        counts where one is (a DC's hit ratio is over the nodes whose ratio is known, never
        hits of one set of nodes over lookups of another)."""
        u = self.unknown
        return u | HIT_COUNT_NAMES if u & HIT_COUNT_NAMES else u

    def add_hits(self, other: HitCounts) -> None:
        """Add ``other``'s four hit counts, or none of them where one is unknown."""
        if not other.known(*HIT_COUNT_NAMES):
            return
        self.lookups += other.lookups
        self.hits += other.hits
        self.reuse_hits += other.reuse_hits
        self.sharing_hits += other.sharing_hits

    def hit_figures(self) -> dict[str, float | None]:
        """The counts and every ratio, under the names all JSON outputs use (None: unknown)."""
        counts: dict[str, float | None] = {
            name: None if name in self.unknown else getattr(self, name)
            for name in ("lookups", "hits", "reuse_hits", "sharing_hits")
        }
        return counts | {name: getattr(self, name) for name in RATIO_NAMES}


def tier_hit_counts(
    whole: HitCounts,
    hits: float,
    reuse_hits: float,
    sharing_hits: float,
    *,
    unknown: frozenset[str] = frozenset(),
) -> HitCounts:
    """The hits one tier served and their reuse/sharing split, over ``whole``'s lookups (a
    node's, a DC's, the fleet's): a lookup asks every tier and a hit is served by one, so each
    tier's ratios are :class:`HitCounts`' own and the tiers' hit (reuse, sharing) ratios add up
    to the whole's. ``unknown``: the tier's counts that are, on top of the whole's."""
    return HitCounts(
        lookups=whole.lookups,
        hits=hits,
        reuse_hits=reuse_hits,
        sharing_hits=sharing_hits,
        unknown=(whole.unknown & HIT_COUNT_NAMES) | unknown,
    )


def tier_figures(tier: HitCounts) -> dict[str, float | None]:
    """A tier's hit counts and every ratio (:meth:`HitCounts.hit_figures`) but the lookups:
    they are the whole's, not the tier's."""
    figures = tier.hit_figures()
    del figures["lookups"]
    return figures


#: the data plane's read figures, by the name every JSON output gives them
READ_NAMES: Final = ("read_chunks", "read_missing_chunks", "read_missing_ratio")


def read_figures(nodes: int, chunks: float, missing_chunks: float) -> dict[str, float | None]:
    """The chunks engines' reads asked for and, of those, the chunks not there (evicted between
    the lookup that counted them as hits and the read, or never looked up), summed over the
    ``nodes`` whose agents reported them. All None where none did (agents older than the
    counts), the ratio None over no reads."""
    if not nodes:
        return dict.fromkeys(READ_NAMES)
    return {
        "read_chunks": chunks,
        "read_missing_chunks": missing_chunks,
        "read_missing_ratio": ratio(missing_chunks, chunks),
    }
