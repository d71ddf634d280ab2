"""A node's counts since its agent started, from its checked ``/v1/stats``: what live `kvctl
status`, `kvctl top`'s node page and `kvctl agent status` show. Apart from kvctl.fleet.status so
the views' models import no HTTP client (httpx brings click and rich with it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvctl.db.sample_checks import READ_COUNTERS, UNREADABLE_TIER, known
from kvctl.ratios import HIT_COUNT_NAMES, HitCounts, read_figures, tier_hit_counts
from kvctl.wire.stats import cache_counters

#: the counts of a tier's hits (its lookups are the node's)
TIER_HIT_NAMES = ("hits", "reuse_hits", "sharing_hits")
#: why a count is impossible: more than the node's lookups (chunks), or its lookup tokens
BEYOND_LOOKUPS = "more than stats.lookup_chunks"
BEYOND_LOOKUP_TOKENS = "more than stats.lookup_tokens"


@dataclass(slots=True)
class TierHits:
    """The hits one tier served since its agent started, split into reuse and sharing; a count
    its agent answered impossible is in ``unknown`` (held as 0), and so is ``hit_tokens`` where
    the tier's hit tokens were more than the node's lookup tokens (shown by `kvctl agent
    status` alone: no count here holds them)."""

    hits: int = 0
    reuse_hits: int = 0
    sharing_hits: int = 0
    unknown: frozenset[str] = frozenset()

    def add(self, other: TierHits) -> None:
        self.hits += other.hits
        self.reuse_hits += other.reuse_hits
        self.sharing_hits += other.sharing_hits
        self.unknown |= other.unknown

    def over(self, whole: HitCounts) -> HitCounts:
        """These hits over ``whole``'s lookups (``kvctl.ratios.tier_hit_counts``)."""
        return tier_hit_counts(
            whole,
            self.hits,
            self.reuse_hits,
            self.sharing_hits,
            unknown=self.unknown & frozenset(TIER_HIT_NAMES),
        )


@dataclass(frozen=True, slots=True)
class SinceStart:
    """A node's counts since its agent started, as `kvctl status` and `kvctl top`'s node page
    show them: its hits, those each tier served, and its engines' reads."""

    counts: HitCounts
    tier_hits: dict[str, TierHits]
    #: None where not reported (an agent older than the counts) or rejected as impossible
    read_chunks: int | None
    read_missing_chunks: int | None
    #: a tier could not be read (``UNREADABLE_TIER``): its hits are in none of ``tier_hits``
    tiers_unreadable: bool = False
    #: counts that cannot be true together (more hits than lookups, more hit tokens than
    #: lookup tokens), by field, with why: unknown here, for the views to name beside
    #: ``checked_stats``'s rejections
    impossible: dict[str, str] = field(default_factory=dict)
    #: the node's prompt tokens looked up and found: None where rejected, or where its hit
    #: counts are unknown as impossible (its chunks' or its tokens')
    lookup_tokens: int | None = None
    hit_tokens: int | None = None

    def token_figures(self) -> dict[str, int | None]:
        """The node's lookup and hit tokens, under `kvctl agent status --json`'s names."""
        return {"lookup_tokens": self.lookup_tokens, "hit_tokens": self.hit_tokens}

    def read_figures(self) -> dict[str, float | None]:
        """The read counts and the share gone (``kvctl.ratios.read_figures``)."""
        if self.read_chunks is None or self.read_missing_chunks is None:
            return read_figures(0, 0, 0)
        return read_figures(1, self.read_chunks, self.read_missing_chunks)

    def tier_hit_counts(self, tier: str) -> HitCounts:
        """The hits ``tier`` served, over the node's lookups."""
        return self.tier_hits.get(tier, TierHits()).over(self.counts)


def since_start(checked: Mapping[str, Any]) -> SinceStart:
    """The counts of an agent's ``/v1/stats`` as :func:`checked_stats` left them: a count it
    rejected (UNKNOWN, or None for the reads) is unknown, never 0 and never summed."""
    counters = cache_counters(checked)
    whole = counters.pop("all")
    hits = {k: known(whole[k]) for k in HIT_COUNT_NAMES}
    tier_hits: dict[str, TierHits] = {}
    for name, t in counters.items():
        if name == UNREADABLE_TIER:
            continue
        counted = {k: known(t[k]) for k in TIER_HIT_NAMES}
        tier_hits[name] = TierHits(
            *(0 if v is None else int(v) for v in counted.values()),
            unknown=frozenset(k for k, v in counted.items() if v is None),
        )
    # counts since an agent's start never have more hits than lookups (it counts a lookup
    # before its hits, remote ones included): a node's or a tier's that do are unknown, and
    # the node left out of a DC's sums (``HitCounts.add_hits``), as the database's window
    # has it (``kvctl.db.analytics.counts``); the collector reads intervals instead
    lookups = hits["lookups"]
    impossible: dict[str, str] = {}
    node_impossible = False  # the node's own counts (not only a tier's)
    if lookups is not None:
        for name, where in (("hits", "hit_chunks"), ("reuse_hits", "reuse_hits"),
                            ("sharing_hits", "sharing_hits")):  # fmt: skip
            value = hits[name]
            if value is not None and value > lookups:
                impossible[f"stats.{where}"] = BEYOND_LOOKUPS
                node_impossible = True
        for name, t in tier_hits.items():
            for part in TIER_HIT_NAMES:
                if part not in t.unknown and getattr(t, part) > lookups:
                    impossible[f"stats.tiers.{name}.{part}"] = BEYOND_LOOKUPS
                    t.unknown |= {part}
    # likewise tokens: a sound agent counts a lookup's tokens before its hits' (and a hit past
    # the looked-up prefix adds its tokens to both), as the database's window checks them
    lookup_tokens, hit_tokens = known(whole["lookup_tokens"]), known(whole["hit_tokens"])
    if lookup_tokens is not None:
        if hit_tokens is not None and hit_tokens > lookup_tokens:
            impossible["stats.hit_tokens"] = BEYOND_LOOKUP_TOKENS
            node_impossible = True
        for name, t in tier_hits.items():
            tier_tokens = known(counters[name]["hit_tokens"])
            if tier_tokens is not None and tier_tokens > lookup_tokens:
                impossible[f"stats.tiers.{name}.hit_tokens"] = BEYOND_LOOKUP_TOKENS
                t.unknown |= {"hit_tokens"}
    # a read count rejected (not a number, negative, more missing than read) is None
    dataplane = checked.get("dataplane") or {}
    reads = [dataplane.get(c) for c in READ_COUNTERS]
    counts = HitCounts(
        **{k: 0 if v is None else int(v) for k, v in hits.items()},
        unknown=frozenset(k for k, v in hits.items() if v is None),
    )
    if node_impossible:
        counts.unknown_hits()  # its tokens too, as the database's window has them
        lookup_tokens = hit_tokens = None
    return SinceStart(
        counts,
        tier_hits,
        None if None in reads else int(reads[0]),
        None if None in reads else int(reads[1]),
        UNREADABLE_TIER in counters,
        impossible,
        None if lookup_tokens is None else int(lookup_tokens),
        None if hit_tokens is None else int(hit_tokens),
    )
