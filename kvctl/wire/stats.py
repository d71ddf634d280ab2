"""What an agent's ``/v1/stats`` reports, in the fleet's one vocabulary.

The agent counts chunk lookups as ``lookup_chunks`` and hits as ``hit_chunks``; everything
downstream (collectors' rows, the read model, the live view) calls them ``lookups`` and
``hits``. This is the only place that translates.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


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
