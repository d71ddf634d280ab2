"""kvctl.workload.seeds: one generated workload's policies over several seeds, with the figures
checked against the per-seed reports they summarise."""

from __future__ import annotations

import statistics

import pytest

from kvctl.errors import InvalidArgument
from kvctl.workload.seeds import SeedSweep, simulate_seeds, summarize_seeds
from kvctl.workload.simulate import capacity_from_fraction, simulate
from kvctl.workload.source import load_workload
from kvctl.workload.trace import TraceRequest

WORKLOAD = "system-prompt"
REQUESTS = 20  # small: each seed replays in well under a second
FRACTIONS = [0.05, 0.2]
POLICIES = ["lineage-arc", "lineage-adaptive"]


@pytest.fixture(scope="module")
def sweep() -> SeedSweep:
    return simulate_seeds(
        WORKLOAD, [0, 1, 2], capacity_fractions=FRACTIONS, policies=POLICIES, limit=REQUESTS
    )


def shares(sweep: SeedSweep, policy: str, c: int) -> list[float]:
    """Each seed's hit ratio as a share of Belady's, read from the reports."""
    out = []
    for per_seed in sweep.reports:
        r = per_seed[c]
        out.append(r.result(policy).hit_ratio / r.result("belady").hit_ratio)
    return out


def test_each_seed_is_its_own_workload_at_fractions_of_its_own_unique_blocks(
    sweep: SeedSweep,
) -> None:
    assert sweep.seeds == [0, 1, 2] and sweep.capacity_fractions == FRACTIONS
    for seed, per_seed in zip(sweep.seeds, sweep.reports, strict=True):
        loaded = load_workload(None, seed=seed, limit=REQUESTS, workload=WORKLOAD)
        unique = len({b for r in loaded.requests for b in r.block_ids})
        for f, report in zip(FRACTIONS, per_seed, strict=True):
            assert report.trace == f"{WORKLOAD}:seed={seed}"
            assert report.unique_blocks == unique
            assert report.tiers == {"cpu": capacity_from_fraction(unique, f)}
            alone = simulate(loaded.requests, tiers=report.tiers, policies=POLICIES)
            assert [r.hit_blocks for r in report.results] == [r.hit_blocks for r in alone.results]
    # the seeds are different samples: else the spread below would say nothing
    assert len({per_seed[0].result("lru").hit_blocks for per_seed in sweep.reports}) > 1


def test_means_and_sample_stdevs_are_those_of_the_per_seed_shares(sweep: SeedSweep) -> None:
    assert [p.policy for p in sweep.summary] == [*POLICIES, "lru", "belady"]
    assert sweep.seeds_counted == [3, 3]
    for p in sweep.summary:
        for c in range(len(FRACTIONS)):
            values = shares(sweep, p.policy, c)
            assert p.of_belady[c] == pytest.approx(values)
            assert p.of_belady_mean[c] == pytest.approx(statistics.fmean(values))
            assert p.of_belady_stdev[c] == pytest.approx(statistics.stdev(values))
    belady = sweep.policy("belady")
    assert belady.of_belady_mean == [1.0, 1.0] and belady.of_belady_stdev == [0.0, 0.0]
    for p in sweep.summary:
        slowest = min(
            r.result(p.policy).decisions_per_second for per_seed in sweep.reports for r in per_seed
        )
        assert p.slowest_decisions_per_second == slowest


def test_gaps_are_paired_by_seed_against_the_best_mean_runnable_policy(sweep: SeedSweep) -> None:
    for c in range(len(FRACTIONS)):
        runnable = [p for p in sweep.summary if p.policy != "belady"]
        top = max(p.of_belady_mean[c] for p in runnable)  # type: ignore[type-var]
        assert sweep.policy(sweep.best_policy[c]).of_belady_mean[c] == top
        best = shares(sweep, sweep.best_policy[c], c)
        for p in sweep.summary:
            diffs = [a - b for a, b in zip(shares(sweep, p.policy, c), best, strict=True)]
            assert p.gap_to_best_mean[c] == pytest.approx(statistics.fmean(diffs))
            assert p.gap_to_best_stdev[c] == pytest.approx(statistics.stdev(diffs))
            assert p.best[c] == (p.policy != "belady" and p.of_belady_mean[c] == top)
        assert sweep.policy(sweep.best_policy[c]).gap_to_best_mean[c] == 0.0
        assert not sweep.policy("belady").best[c]  # the optimum is a reference, never "best"
        assert sweep.policy("belady").gap_to_best_mean[c] >= 0  # type: ignore[operator]


def test_a_sweep_is_deterministic(sweep: SeedSweep) -> None:
    again = simulate_seeds(
        WORKLOAD, [0, 1, 2], capacity_fractions=FRACTIONS, policies=POLICIES, limit=REQUESTS
    )
    assert again.best_policy == sweep.best_policy
    for a, b in zip(again.summary, sweep.summary, strict=True):
        assert (a.of_belady, a.gap_to_best_mean, a.gap_to_best_stdev, a.best) == (
            b.of_belady,
            b.gap_to_best_mean,
            b.gap_to_best_stdev,
            b.best,
        )


def test_one_seed_is_the_plain_run_with_no_spread() -> None:
    one = simulate_seeds(
        "rag", [4], capacity_fractions=[0.1], policies=["lineage-lru"], limit=REQUESTS
    )
    loaded = load_workload(None, seed=4, limit=REQUESTS, workload="rag")
    unique = len({b for r in loaded.requests for b in r.block_ids})
    plain = simulate(
        loaded.requests,
        tiers={"cpu": capacity_from_fraction(unique, 0.1)},
        policies=["lineage-lru"],
        trace_name=loaded.name,
    )

    def timeless(d: dict[str, object]) -> dict[str, object]:
        rows = [
            {k: v for k, v in r.items() if k not in ("seconds", "decisions_per_second")}
            for r in d["results"]  # type: ignore[attr-defined]
        ]
        return {**d, "results": rows}

    assert timeless(one.reports[0][0].as_dict()) == timeless(plain.as_dict())
    for p in one.summary:
        assert p.of_belady_stdev == [None] and p.gap_to_best_stdev == [None]
        assert p.of_belady_mean == p.of_belady[0]


def test_progress_counts_each_seeds_requests_over_its_runs() -> None:
    seen: list[tuple[str, int, int]] = []
    simulate_seeds(
        "chat",
        [7, 8],
        capacity_fractions=[0.1, 0.5],
        policies=["lru"],
        limit=10,
        progress=lambda name, done, total: seen.append((name, done, total)),
    )
    for name in ("seed 7", "seed 8"):
        mine = [(done, total) for n, done, total in seen if n == name]
        assert {total for _, total in mine} == {10 * 2 * 2}  # requests x capacities x (lru, belady)
        assert [done for done, _ in mine] == sorted(done for done, _ in mine)
        assert mine[-1][0] == mine[-1][1]


def test_progress_counts_both_replays_of_oracle_features() -> None:
    """oracle-features replays each seed twice: its seed's bar must end at its total, not
    overshoot it and start again."""
    seen: list[tuple[str, int, int]] = []
    simulate_seeds(
        "chat",
        [3],
        capacity_fractions=[0.2],
        policies=["oracle-features"],
        limit=10,
        progress=lambda name, done, total: seen.append((name, done, total)),
    )
    assert {total for _, _, total in seen} == {10 * (2 + 1 + 1)}  # (2 passes, lru, belady)
    done = [d for _, d, _ in seen]
    assert done == sorted(done) and done[-1] == 40


def req(*ids: int) -> TraceRequest:
    return TraceRequest(0, 512 * len(ids), 1, tuple(ids), "")


def test_a_seed_whose_belady_hit_nothing_is_left_out_of_that_capacity() -> None:
    reused = simulate([req(1), req(1), req(2)], tiers={"cpu": 1}, policies=["lineage-lru"])
    fresh = simulate([req(1), req(2), req(3)], tiers={"cpu": 1}, policies=["lineage-lru"])
    assert fresh.result("belady").hit_ratio == 0
    s = summarize_seeds("x", [0, 1], [0.5], [[reused], [fresh]])
    assert s.seeds_counted == [1]
    lineage = s.policy("lineage-lru")
    assert lineage.of_belady == [[1.0, None]]
    assert lineage.of_belady_mean == [1.0] and lineage.of_belady_stdev == [None]
    assert s.as_dict()["seeds_counted"] == [1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seeds": []}, "at least one seed"),
        ({"seeds": [1, 1]}, "each seed once"),
        ({"capacity_fractions": []}, "at least one capacity fraction"),
        ({"capacity_fractions": [0.1, 1.5]}, "fraction"),
        ({"policies": ["fifo"]}, "unknown policy"),
        ({"workload": "nope"}, "unknown workload"),
        ({"limit": 0}, "holds no requests"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "workload": "rag",
        "seeds": [0, 1],
        "capacity_fractions": [0.1],
        "policies": ["lru"],
        "limit": 5,
    }
    args.update(kwargs)
    with pytest.raises(InvalidArgument, match=message):
        simulate_seeds(**args)  # type: ignore[arg-type]


def test_no_policy_is_best_where_no_seed_counted() -> None:
    # every seed's Belady hit nothing: no figures, so no best (best_policy named the first
    # runnable policy, though no policy's `best` said so and its gaps were all None)
    fresh = simulate([req(1), req(2), req(3)], tiers={"cpu": 1}, policies=["lineage-lru"])
    other = simulate([req(4), req(5), req(6)], tiers={"cpu": 1}, policies=["lineage-lru"])
    s = summarize_seeds("x", [0, 1], [0.5], [[fresh], [other]])
    assert s.seeds_counted == [0]
    assert s.best_policy == [None] and s.as_dict()["best_policy"] == [None]
    for p in s.summary:
        assert p.best == [False] and p.of_belady_mean == [None]
        assert p.gap_to_best_mean == [None] and p.gap_to_best_stdev == [None]


def test_a_range_of_seeds_is_not_built_into_a_set_to_check_it() -> None:
    """--seeds N passes range(seed, seed + N): each seed once by construction, so a huge N is
    refused or run seed by seed, never first made into a set of N seeds (memory)."""
    with pytest.raises(InvalidArgument, match="capacity fraction"):
        simulate_seeds("chat", range(10**15), capacity_fractions=[], policies=["lru"])
