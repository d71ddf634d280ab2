from __future__ import annotations

import pytest

from kvctl.errors import InvalidArgument
from kvctl.workload.builtin import builtin_workload
from kvctl.workload.simulate import (
    capacity_from_fraction,
    policies_with_references,
    prefill_costs,
    simulate,
)
from kvctl.workload.trace import TraceRequest, read_mooncake_trace, trace_summary


def req(*ids: int, tokens: int | None = None, tenant: str = "") -> TraceRequest:
    n = tokens if tokens is not None else 512 * len(ids)
    return TraceRequest(0, n, 1, tuple(ids), tenant)


def test_lru_by_hand_on_a_tiny_trace() -> None:
    trace = [req(1, 2), req(1, 2), req(3), req(1, 2), req(1, 4, tokens=600)]
    report = simulate(trace, tiers={"cpu": 2}, policies=["lru"])
    lru = report.result("lru")
    # r1 miss miss; r2 hit hit; r3 evicts 1 (LRU); r4: 1 misses so 2 is past the prefix;
    # r5: 1 hits (re-stored by r4), 4 misses
    assert lru.hit_blocks == 3
    assert lru.hit_ratio == pytest.approx(3 / 9)
    assert lru.token_hit_ratio == pytest.approx(3 * 512 / (512 * 7 + 600))


def test_unlimited_capacity_equals_the_infinite_cache_prefix_ratio() -> None:
    """Two independent implementations of the prefix-hit definition must agree."""
    trace = builtin_workload(seed=3, requests=400)
    summary = trace_summary(trace)
    report = simulate(trace, tiers={"cpu": int(summary["unique_blocks"])}, policies=["lru"])
    for r in report.results:
        assert r.hit_ratio == pytest.approx(summary["block_hit_ratio"])
        assert r.token_hit_ratio == pytest.approx(summary["token_hit_ratio"])


def test_references_always_run_and_belady_leads_lru() -> None:
    trace = builtin_workload(seed=0, requests=500)
    unique = len({b for r in trace for b in r.block_ids})
    report = simulate(
        trace, tiers={"cpu": capacity_from_fraction(unique, 0.05)}, policies=["lineage-lru"]
    )
    assert [r.policy for r in report.results] == ["lineage-lru", "lru", "belady"]
    assert report.result("belady").hit_ratio > report.result("lru").hit_ratio


def test_multi_tier_reports_hits_per_tier() -> None:
    trace = builtin_workload(seed=1, requests=300)
    report = simulate(
        trace, tiers={"cpu": 100, "disk": 1000}, policies=["lru"], admission="frequency"
    )
    for r in report.results:
        assert sum(r.hits_by_tier.values()) == r.hit_blocks
        assert r.hits_by_tier["disk"] > 0
    assert report.capacity_blocks == 1100
    d = report.as_dict()
    assert {"trace", "unique_blocks", "capacity_blocks", "results"} <= d.keys()


def test_bad_arguments() -> None:
    trace = [req(1)]
    with pytest.raises(InvalidArgument, match="unknown policy"):
        simulate(trace, tiers={"cpu": 1}, policies=["fifo"])
    with pytest.raises(InvalidArgument, match="at least one block"):
        simulate(trace, tiers={"cpu": 0})
    with pytest.raises(InvalidArgument, match="admission"):
        simulate(trace, tiers={"cpu": 1}, admission="sometimes")
    with pytest.raises(InvalidArgument, match="fraction"):
        capacity_from_fraction(100, 1.5)
    assert policies_with_references(["belady", "lru"]) == ["belady", "lru"]


def test_shared_trace_replay(shared_trace) -> None:  # type: ignore[no-untyped-def]
    trace = read_mooncake_trace(shared_trace, limit=800)
    unique = len({b for r in trace for b in r.block_ids})
    report = simulate(
        trace, tiers={"cpu": capacity_from_fraction(unique, 0.1)}, policies=["lineage-lru"]
    )
    belady = report.result("belady").hit_ratio
    assert 0 < report.result("lru").hit_ratio < belady
    assert 0 < report.result("lineage-lru").hit_ratio <= belady


def test_prefill_weighted_ratio_counts_deep_blocks_more() -> None:
    # attention_tokens = 512: tokens [a, b) cost (b - a) x (1 + (a + b) / 1024), so the first
    # block of a request costs 512 x 1.5 = 768 and the second 512 x 2.5 = 1280
    assert prefill_costs([512, 512], 512) == [768.0, 1280.0]
    trace = [req(1, 2), req(1, 3)]
    report = simulate(trace, tiers={"cpu": 2}, policies=["lru"], attention_tokens=512)
    lru = report.result("lru")
    assert lru.hit_blocks == 1  # the second request's first block
    assert lru.hit_ratio == pytest.approx(1 / 4)
    assert lru.token_hit_ratio == pytest.approx(1 / 4)
    assert lru.prefill_hit_ratio == pytest.approx(768 / (2 * (768 + 1280)))
    with pytest.raises(InvalidArgument, match="attention_tokens"):
        prefill_costs([512], 0)


def test_results_carry_shares_of_the_references_speed_and_evictions() -> None:
    trace = builtin_workload(seed=2, requests=200)
    unique = len({b for r in trace for b in r.block_ids})
    small = simulate(trace, tiers={"cpu": capacity_from_fraction(unique, 0.05)},
                     policies=["lineage-arc"]).as_dict()  # fmt: skip
    rows = {r["policy"]: r for r in small["results"]}  # type: ignore[attr-defined]
    assert rows["belady"]["of_belady"] == 1.0 and rows["lru"]["of_lru"] == 1.0
    arc = rows["lineage-arc"]
    assert arc["of_belady"] == pytest.approx(arc["hit_ratio"] / rows["belady"]["hit_ratio"])
    assert arc["of_lru"] == pytest.approx(arc["hit_ratio"] / rows["lru"]["hit_ratio"])
    for r in rows.values():
        assert r["decisions_per_second"] > 0 and r["evictions"] > 0
        assert 0 < r["prefill_hit_ratio"] <= 1
    whole = simulate(trace, tiers={"cpu": unique}, policies=["lineage-arc"])
    assert all(r.evictions == 0 for r in whole.results)


def test_the_popularity_oracle_keeps_the_block_with_more_uses_left() -> None:
    # A B C A B A, room for 2: at C, A has 2 uses left and B 1, so B goes (LRU would drop A);
    # then A hits twice, and B (back at r5) displaces C, which has none left
    trace = [req(1), req(2), req(3), req(1), req(2), req(1)]
    report = simulate(trace, tiers={"cpu": 2}, policies=["oracle-popularity"])
    assert [r.policy for r in report.results] == ["oracle-popularity", "lru", "belady"]
    assert report.result("oracle-popularity").hit_blocks == 2
    assert report.result("lru").hit_blocks == 1  # only the last A


def test_the_reuse_oracle_drops_what_is_not_used_within_its_horizon_first() -> None:
    # room for 2, so a horizon of 8 block accesses: at C, B's next use is 10 accesses away and
    # A's 3, so B goes first although A is older; A then hits, and B comes back as a miss
    fillers = [req(i) for i in range(10, 17)]
    trace = [req(1), req(2), req(3), req(1), *fillers, req(2)]
    report = simulate(trace, tiers={"cpu": 2}, policies=["oracle-reuse"])
    assert report.result("oracle-reuse").hit_blocks == 1
    assert report.result("lru").hit_blocks == 0  # LRU drops A at C


def test_oracles_run_only_when_named() -> None:
    from kvctl.store.policies import EVICTION_POLICIES
    from kvctl.workload.simulate import ORACLE_POLICIES, SIMULATION_POLICIES

    assert set(ORACLE_POLICIES) <= set(SIMULATION_POLICIES)
    assert not set(ORACLE_POLICIES) & set(EVICTION_POLICIES)  # never an agent's policy
    assert policies_with_references(["oracle-reuse"]) == ["oracle-reuse", "lru", "belady"]


def test_partial_oracles_on_the_shared_trace(shared_trace) -> None:  # type: ignore[no-untyped-def]
    """On the Mooncake trace, knowing how often a block is used again is worth less than
    knowing whether it is used again soon, and both less than knowing when (Belady). (Not a
    law: on the first 1,500 requests alone the popularity oracle trails LRU, as blocks that
    are popular later sit in the cache until then.) Deterministic."""
    trace = read_mooncake_trace(shared_trace)
    unique = len({b for r in trace for b in r.block_ids})
    report = simulate(
        trace,
        tiers={"cpu": capacity_from_fraction(unique, 0.05)},
        policies=["oracle-popularity", "oracle-reuse"],
    )
    ratio = {r.policy: r.hit_ratio for r in report.results}
    assert ratio["lru"] < ratio["oracle-popularity"] < ratio["oracle-reuse"] < ratio["belady"]
