"""A sound agent's intervals are never called impossible (collectors.rows.hits_beyond_lookups):
its remote hits are counted just after their lookup, and a hit moves from reuse to sharing
when its copy arrives, so one interval can hold hits whose lookups were in the one before;
its counts since its start never hold more hits than lookups. An inflating agent's are."""

from __future__ import annotations

from typing import Any

from collectors.rows import cache_rows
from kvctl.counters import CounterTracker
from kvctl.db.sample_checks import Rejections
from kvctl.store.accounting import Accounting

USAGE = {"cpu": {"used_bytes": 0, "capacity_bytes": 1 << 30, "pinned_bytes": 0, "chunks": 0}}


class _Agent:
    def __init__(self) -> None:
        self.acc = Accounting(["cpu"], chunk_tokens=256)
        self.acc.add_external_tier("remote")
        self.tracker = CounterTracker()

    def scrape(self, ts_ms: int) -> tuple[dict[str, Any], dict[str, str]]:
        rejected = Rejections()
        stats = {"stats": self.acc.as_dict(), "usage": USAGE, "started_s": 1000.0}
        rows = cache_rows(self.tracker, 1, ts_ms, stats, rejected)
        (node,) = [r for r in rows if r["tier"] == "all"]
        return node, dict(rejected.fields)

    def moved_to_sharing(self, n: int) -> None:
        """``RemoteTierCounts.recount_owner``: the copies that arrived were another tenant's."""
        for _ in range(n):
            for st in (self.acc.stats, self.acc.stats.tiers["remote"]):
                st.reuse_hits -= 1
                st.sharing_hits += 1


def test_a_recount_after_the_scrape_is_not_an_impossible_interval() -> None:
    """Before: the interval holding the 4 recounts (sharing +4, no lookup) was rejected, its
    hits and lookups not counted, and the healthy node named in the report."""
    agent = _Agent()
    agent.scrape(0)
    agent.acc.count_lookup(8, 0, 0, 0, 0)  # 8 chunks asked, none here
    agent.acc.count_tier_hits("remote", 4, 1024, 4)  # 4 in the pool, said to be its own
    agent.acc.count_hits_past_lookup(4, 1024)
    node, rejected = agent.scrape(15_000)
    assert rejected == {} and (node["lookups"], node["hits"], node["reuse_hits"]) == (8, 4, 4)
    agent.moved_to_sharing(4)
    node, rejected = agent.scrape(30_000)
    assert rejected == {}
    assert (node["lookups"], node["hits"], node["sharing_hits"]) == (0, 0, 4)


def test_remote_hits_counted_after_the_scrape_are_not_an_impossible_interval() -> None:
    """The lookup counted in one interval, its remote hits (counted just after it, not in the
    same step) in the next, which has no lookup of its own."""
    agent = _Agent()
    agent.scrape(0)
    agent.acc.count_lookup(8, 0, 0, 0, 0)
    node, rejected = agent.scrape(15_000)  # between the two counts
    assert rejected == {} and (node["lookups"], node["hits"]) == (8, 0)
    agent.acc.count_tier_hits("remote", 4, 1024, 4)
    agent.acc.count_hits_past_lookup(4, 1024)
    node, rejected = agent.scrape(30_000)
    assert rejected == {} and (node["lookups"], node["hits"], node["hit_tokens"]) == (0, 4, 1024)


def test_hits_past_the_agents_own_lookups_are_still_impossible() -> None:
    agent = _Agent()
    agent.scrape(0)
    agent.acc.count_lookup(1, 0, 0, 0, 0)
    agent.acc.stats.hit_chunks += 10**9  # what an inflating agent says
    node, rejected = agent.scrape(15_000)
    assert "stats.hit_chunks" in rejected and node["hits"] == 0
