"""Behaviour of ``lineage-lru2`` (leaf-first LRU-2 with a history of recently seen keys)."""

from __future__ import annotations

from kvctl.store.index import Entry
from kvctl.store.policies import EVICTION_POLICIES, LineageLRU2Policy
from kvctl.workload.builtin import builtin_workload
from kvctl.workload.simulate import capacity_from_fraction, simulate
from tests.unit.policy_ops import access, entry


def _evict(policy: LineageLRU2Policy, entries: dict[str, Entry]) -> str:
    v = policy.victim(0.0)
    assert v is not None
    policy.on_remove(v)
    if v.parent is not None:  # what the store does when a child leaves
        p = entries[v.parent.decode()]
        p.children -= 1
        policy.on_children_changed(p)
    return v.key.decode()


def test_registered() -> None:
    assert EVICTION_POLICIES["lineage-lru2"] is LineageLRU2Policy


def test_victim_order_once_seen_first_then_oldest_previous_access_leaf_first() -> None:
    p = LineageLRU2Policy()
    a = entry("a", 1)
    b = entry("b", 2, parent=a)
    c = entry("c", 3)
    d = entry("d", 4)
    for e in (a, b, c, d):
        p.on_insert(e)
    access(p, a, 5)  # previous access 1
    access(p, b, 6)  # previous access 2
    access(p, d, 7)  # previous access 4
    e = entry("e", 8)
    p.on_insert(e)
    entries = {x.key.decode(): x for x in (a, b, c, d, e)}
    # c and e were seen once: they go first, least recently used first. Then reused leaves by
    # previous access: b (2); a (1) only once its child b is gone (leaf-first); then d (4).
    assert _evict(p, entries) == "c"
    # c comes back: the history remembers its access at tick 3, so it now outranks e (seen once)
    c.last_tick = 9
    p.on_insert(c)
    assert [_evict(p, entries) for _ in range(4)] == ["e", "b", "a", "c"]
    # a move between tiers (same last tick) is not an access: d keeps previous access 4
    p.on_remove(d)
    p.on_insert(d)
    assert p.rank(d) == (4, 7)
    assert _evict(p, entries) == "d"
    assert p.victim(0.0) is None and len(p) == 0


def test_burst_of_new_chunks_goes_before_reused_ones() -> None:
    # Scan resistance: plain LRU would evict the three reused chunks first (oldest last access);
    # LRU-2 evicts the whole burst of one-time chunks before any of them.
    p = LineageLRU2Policy()
    olds = [entry(f"o{i}", i + 1) for i in range(3)]
    for o in olds:
        p.on_insert(o)
    for i, o in enumerate(olds):
        access(p, o, 10 + i)
    burst = [entry(f"n{i}", 20 + i) for i in range(5)]
    for n in burst:
        p.on_insert(n)
    entries = {x.key.decode(): x for x in (*olds, *burst)}
    # every chunk of the burst goes before any reused chunk, though all are more recent
    assert [_evict(p, entries) for _ in range(5)] == [f"n{i}" for i in range(5)]
    assert [_evict(p, entries) for _ in range(3)] == ["o0", "o1", "o2"]


def test_history_is_bounded() -> None:
    p = LineageLRU2Policy(history_factor=2, min_history=4)
    live = [entry(f"k{i}", i + 1) for i in range(3)]
    for e in live:
        p.on_insert(e)
    for i in range(20):  # churn: never more than 3 entries tracked at once
        p.on_remove(live.pop(0))
        live.append(entry(f"x{i}", 10 + i))
        p.on_insert(live[-1])
    assert len(p) == 3
    assert len(p._history) == 6  # 2 x the 3 entries held at most


def test_beats_lru_on_builtin_workload_at_5_percent() -> None:
    reqs = builtin_workload(seed=0, requests=600)
    unique = len({b for r in reqs for b in r.block_ids})
    rep = simulate(reqs, tiers={"cpu": capacity_from_fraction(unique, 0.05)},
                   policies=["lineage-lru2"])  # fmt: skip
    assert rep.result("lineage-lru2").hit_ratio >= rep.result("lru").hit_ratio
