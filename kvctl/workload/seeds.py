"""Multi-seed sweeps: one generated workload's policies compared over several seeds.

One seed of a generated workload is one small sample: on the 100-request system-prompt workload
each policy's share of Belady's hit ratio moves by several points from seed to seed, and which
policy leads at a capacity flips with the seed. ``simulate_seeds`` replays the workload of each
seed at each capacity (a fraction of *that seed's* unique blocks: block counts do not carry
across seeds of different sizes) and ``summarize_seeds`` says, per policy and capacity, the mean
and sample standard deviation of its share of Belady over the seeds, and the *paired* gap to the
policy of best mean: the same seed is the same workload, so the spread of the per-seed difference
tells a real gap from noise where the spreads of the two means, taken apart, cannot.

Shares are of Belady's block hit ratio in the same replay (``hit_ratio / belady.hit_ratio``, as
``of_belady`` in ``SimulationReport.as_dict``: 1.0 is Belady). A seed whose Belady hit nothing at
a capacity has no share there and is left out of that capacity's figures, for every policy alike
(``seeds_counted`` says how many were counted).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvctl.errors import InvalidArgument
from kvctl.workload.simulate import (
    DEFAULT_ATTENTION_TOKENS,
    ORACLE_POLICIES,
    Progress,
    SimulationReport,
    capacity_from_fraction,
    policies_with_references,
    replays_of,
    simulate,
)
from kvctl.workload.source import load_workload

#: never "the best policy": Belady's optimum and the partial oracles know the future
NOT_RUNNABLE = ("belady", *ORACLE_POLICIES)


@dataclass(frozen=True, slots=True)
class PolicySeeds:
    """One policy's figures, each list indexed like ``SeedSweep.capacity_fractions``; shares of
    Belady's block hit ratio (1.0 is Belady), None where no seed (for the standard deviations:
    fewer than two) counted."""

    policy: str
    #: per capacity, per seed (``SeedSweep.seeds``): the share, None where Belady hit nothing
    of_belady: list[list[float | None]]
    of_belady_mean: list[float | None]
    #: sample standard deviation over the seeds
    of_belady_stdev: list[float | None]
    #: per seed, this policy's share minus the best mean policy's: mean and sample standard
    #: deviation (0 and 0 for the best itself; negative behind it)
    gap_to_best_mean: list[float | None]
    gap_to_best_stdev: list[float | None]
    #: whether this policy has the best mean at the capacity (ties all marked)
    best: list[bool]
    #: the slowest run's blocks placed per second of replay, over every seed and capacity
    slowest_decisions_per_second: float

    def as_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "of_belady": self.of_belady,
            "of_belady_mean": self.of_belady_mean,
            "of_belady_stdev": self.of_belady_stdev,
            "gap_to_best_mean": self.gap_to_best_mean,
            "gap_to_best_stdev": self.gap_to_best_stdev,
            "best": self.best,
            "slowest_decisions_per_second": self.slowest_decisions_per_second,
        }


@dataclass(frozen=True, slots=True)
class SeedSweep:
    workload: str
    seeds: list[int]
    capacity_fractions: list[float]
    #: per seed, per capacity: the replay's report
    reports: list[list[SimulationReport]]
    #: per capacity: the seeds whose Belady hit something there (the figures' sample size)
    seeds_counted: list[int] = field(default_factory=list)
    #: per capacity: the first policy of best mean among those an agent can run (not Belady's
    #: optimum nor a partial oracle; LRU always ran), None where no seed counted (no figures)
    best_policy: list[str | None] = field(default_factory=list)
    #: one per policy, in the reports' order (the asked ones, then LRU and Belady)
    summary: list[PolicySeeds] = field(default_factory=list)

    def policy(self, name: str) -> PolicySeeds:
        for p in self.summary:
            if p.policy == name:
                return p
        raise KeyError(name)

    def as_dict(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "seeds": self.seeds,
            "capacity_fractions": self.capacity_fractions,
            "seeds_counted": self.seeds_counted,
            "best_policy": self.best_policy,
            "summary": [p.as_dict() for p in self.summary],
            "runs": [[r.as_dict() for r in per_seed] for per_seed in self.reports],
        }


def simulate_seeds(
    workload: str,
    seeds: Sequence[int],
    *,
    capacity_fractions: Sequence[float],
    policies: Sequence[str],
    limit: int | None = None,
    admission: str = "all",
    attention_tokens: float = DEFAULT_ATTENTION_TOKENS,
    bypass_unreachable: bool = True,
    progress: Progress | None = None,
) -> SeedSweep:
    """Generate ``workload`` (a ``kvctl.workload.generators.GENERATORS`` name, ``limit``
    requests as in ``load_workload``) for each seed and ``simulate`` it, one cpu tier per
    capacity fraction of that seed's unique blocks; then ``summarize_seeds``.

    ``progress(name, done, total)`` counts, per seed (``name``: "seed N"), the requests replayed
    over every capacity and policy of that seed."""
    if not seeds:
        raise InvalidArgument("give at least one seed")
    # (a range holds each seed once: no set of a billion seeds built to check it)
    if not isinstance(seeds, range) and len(set(seeds)) != len(seeds):
        # one workload counted twice would shrink the spread
        raise InvalidArgument("each seed once: a seed given twice is the same workload twice")
    if not capacity_fractions:
        raise InvalidArgument("give at least one capacity fraction")
    for f in capacity_fractions:
        capacity_from_fraction(1, f)  # refuse a bad fraction before generating anything
    # requests replayed per capacity: oracle-features replays twice
    runs_per_capacity = sum(replays_of(p) for p in policies_with_references(policies))
    reports: list[list[SimulationReport]] = []
    for seed in seeds:
        loaded = load_workload(None, seed=seed, limit=limit, workload=workload)
        if not loaded.requests:
            raise InvalidArgument(f"{loaded.name} holds no requests")
        unique = len({b for r in loaded.requests for b in r.block_ids})
        total = len(loaded.requests) * len(capacity_fractions) * runs_per_capacity
        step = None if progress is None else _seed_progress(progress, f"seed {seed}", total)
        per_seed: list[SimulationReport] = []
        for f in capacity_fractions:
            per_seed.append(
                simulate(
                    loaded.requests,
                    tiers={"cpu": capacity_from_fraction(unique, f)},
                    policies=policies,
                    admission=admission,
                    trace_name=loaded.name,
                    progress=step,
                    attention_tokens=attention_tokens,
                    bypass_unreachable=bypass_unreachable,
                )
            )
        reports.append(per_seed)
    return summarize_seeds(workload, list(seeds), list(capacity_fractions), reports)


def summarize_seeds(
    workload: str,
    seeds: list[int],
    capacity_fractions: list[float],
    reports: list[list[SimulationReport]],
) -> SeedSweep:
    """The figures of ``SeedSweep`` from its reports (per seed, per capacity, every report
    holding the same policies in the same order)."""
    if (
        not seeds
        or not capacity_fractions
        or len(reports) != len(seeds)
        or any(len(r) != len(capacity_fractions) for r in reports)
    ):
        raise InvalidArgument("one report per seed and capacity fraction")
    policies = [r.policy for r in reports[0][0].results]
    # shares[policy][capacity][seed]
    shares: dict[str, list[list[float | None]]] = {p: [] for p in policies}
    counted: list[int] = []
    best_policy: list[str | None] = []
    for c in range(len(capacity_fractions)):
        at = [per_seed[c] for per_seed in reports]
        for p in policies:
            shares[p].append([_share(r, p) for r in at])
        counted.append(sum(r.result("belady").hit_ratio > 0 for r in at))
        runnable = [p for p in policies if p not in NOT_RUNNABLE]
        means = {p: m for p in runnable if (m := _mean(shares[p][c])) is not None}
        # the first of the best (max keeps the first); none where no seed counted: every mean
        # is None there alike, and naming one would call a policy best on no figures
        best_policy.append(max(means, key=means.__getitem__) if means else None)
    best_means = [None if b is None else _mean(shares[b][c]) for c, b in enumerate(best_policy)]
    summary: list[PolicySeeds] = []
    for p in policies:
        gaps = [
            [
                None if a is None or b is None else a - b
                for a, b in zip(
                    shares[p][c],
                    [None] * len(seeds) if best is None else shares[best][c],
                    strict=True,
                )
            ]
            for c, best in enumerate(best_policy)
        ]
        mean = [_mean(s) for s in shares[p]]
        summary.append(
            PolicySeeds(
                policy=p,
                of_belady=shares[p],
                of_belady_mean=mean,
                of_belady_stdev=[_stdev(s) for s in shares[p]],
                gap_to_best_mean=[_mean(g) for g in gaps],
                gap_to_best_stdev=[_stdev(g) for g in gaps],
                best=[
                    p not in NOT_RUNNABLE and m is not None and m == best_means[c]
                    for c, m in enumerate(mean)
                ],
                slowest_decisions_per_second=min(
                    r.result(p).decisions_per_second for per_seed in reports for r in per_seed
                ),
            )
        )
    return SeedSweep(
        workload=workload,
        seeds=seeds,
        capacity_fractions=capacity_fractions,
        reports=reports,
        seeds_counted=counted,
        best_policy=best_policy,
        summary=summary,
    )


def _seed_progress(progress: Progress, name: str, total: int) -> Progress:
    """``simulate``'s progress (one policy's requests) as one seed's: requests replayed over all
    its runs, so a seed is one bar, not one per policy and capacity."""
    finished = 0  # requests of this seed's runs already done

    def step(_policy: str, done: int, of: int) -> None:
        nonlocal finished
        progress(name, finished + done, total)
        if done == of:
            finished += of

    return step


def _share(report: SimulationReport, policy: str) -> float | None:
    belady = report.result("belady").hit_ratio
    return report.result(policy).hit_ratio / belady if belady else None


def _mean(values: Sequence[float | None]) -> float | None:
    counted = [v for v in values if v is not None]
    return statistics.fmean(counted) if counted else None


def _stdev(values: Sequence[float | None]) -> float | None:
    counted = [v for v in values if v is not None]
    return statistics.stdev(counted) if len(counted) > 1 else None
