"""What an agent's ``/v1/stats`` reports, in the fleet's one vocabulary.

The agent counts chunk lookups as ``lookup_chunks`` and hits as ``hit_chunks``; everything
downstream (collectors' rows, the read model, the live view) calls them ``lookups`` and
``hits``. This is the only place that translates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvctl.ratios import HIT_COUNT_NAMES, HitCounts

#: the node counters every tier also has; a tier's ``lookups`` are the node's (a lookup asks
#: every tier), so a tier's report leaves them out
_NODE_ONLY = ("lookups", "lookup_tokens")


def cache_counters(stats: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Raw cumulative counters per tier, and ``all`` for the node, from ``/v1/stats``."""
    counters = stats["stats"]
    tiers: Mapping[str, Mapping[str, Any]] = counters.get("tiers", {})
    out: dict[str, dict[str, float]] = {}
    for name, t in tiers.items():
        out[name] = {
            "lookups": 0,
            "lookup_tokens": 0,
            "hits": t["hits"],
            "hit_tokens": t["hit_tokens"],
            "reuse_hits": t["reuse_hits"],
            "sharing_hits": t["sharing_hits"],
            "evictions": sum(t.get("evictions", {}).values()),
            "promotions": t["promotions"],
            "demotions": t["demotions"],
            "bytes_read": t["bytes_read"],
            "bytes_written": t["bytes_written"],
        }
    out["all"] = {
        "lookups": counters["lookup_chunks"],
        "lookup_tokens": counters["lookup_tokens"],
        "hits": counters["hit_chunks"],
        "hit_tokens": counters["hit_tokens"],
        "reuse_hits": counters["reuse_hits"],
        "sharing_hits": counters["sharing_hits"],
        # chunks that left the node; a demotion moves a chunk within it
        "evictions": counters["drops"],
        "promotions": sum(t["promotions"] for t in tiers.values()),
        "demotions": sum(t["demotions"] for t in tiers.values()),
        "bytes_read": sum(t["bytes_read"] for t in tiers.values()),
        "bytes_written": sum(t["bytes_written"] for t in tiers.values()),
    }
    return out


def hit_counts(stats: Mapping[str, Any]) -> HitCounts:
    """The node's chunk lookups and hits since its agent started, from ``/v1/stats``."""
    whole = cache_counters(stats)["all"]
    return HitCounts(
        int(whole["lookups"]),
        int(whole["hits"]),
        int(whole["reuse_hits"]),
        int(whole["sharing_hits"]),
    )


def agent_figures(stats: Mapping[str, Any]) -> dict[str, Any]:
    """``/v1/stats`` in the fleet's vocabulary, as `kvctl status` reports a node: counts
    (``lookups`` and ``hits`` in chunks), every ratio (None before any lookup), each tier's
    counters, plus ``lookup_requests`` (lookup calls, one per request's prefix) and the
    eviction policies. A count that is not a finite number (what ``kvctl.db.sample_checks``
    leaves of an impossible one) is None, and so is every ratio over it."""
    counters = cache_counters(stats)
    whole = {k: _whole(v) for k, v in counters.pop("all").items()}
    four = {name: whole[name] for name in HIT_COUNT_NAMES}
    figures = HitCounts(
        **{k: v or 0 for k, v in four.items()},
        unknown=frozenset(k for k, v in four.items() if v is None),
    ).hit_figures()
    return {
        **whole,
        **{k: v for k, v in figures.items() if k not in whole},
        "lookup_requests": _whole(stats["stats"]["lookups"]),
        # chunks that should have gone down a tier and were dropped (a full or failing disk)
        "demotion_failures": _whole(stats["stats"].get("demotion_failures")),
        "tiers": {
            name: {k: _whole(v) for k, v in tier.items() if k not in _NODE_ONLY}
            | _storage_trouble(stats["stats"].get("tiers", {}).get(name, {}))
            for name, tier in counters.items()
        },
        "policies": stats.get("policies") or {},
    }


#: a tier's counters of storage going wrong under it (a disk tier's), shown where an agent has
#: them (None from one before them)
STORAGE_TROUBLE = ("filesystem_full", "unreadable_on_open")


def _storage_trouble(tier: Mapping[str, Any]) -> dict[str, int | None]:
    return {name: _whole(tier.get(name)) for name in STORAGE_TROUBLE}


def _whole(value: Any) -> int | None:
    """A count as a whole number; None where it is not a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return int(value)
