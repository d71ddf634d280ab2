"""What-if planning: hit ratio per tier, and modeled TTFT and prefill energy, for candidate tier
configurations of one workload, with the miss-ratio curve over capacity.

Hit ratios come from the offline simulator (the real ``TieredStore`` and policies, one chunk per
trace block). Everything in time and energy is **modeled** from these inputs, all reported:

- prefill: ``ModeledInputs`` (model FLOPs per token, GPU peak bf16, MFU, board power);
- moving a tier's chunks into GPU memory (``TierLink``): one round trip per tier a request
  reads from, plus its bytes over the tier's bandwidth. The remote pool adds fiber: 5 us per km
  each way. Defaults: host DRAM over PCIe Gen5 x16 (25 GB/s effective, 10 us), local NVMe
  (5 GB/s, 100 us), a pool over 100 Gb/s (12.5 GB/s, 50 us in the same DC).
- fetch or recompute (design.md): a tier whose chunk takes longer to fetch than to recompute is
  not read from; its hits are recomputed, and the result says so.

A request's modeled TTFT = prefill of the tokens not fetched + the fetches. Energy counts prefill
compute only (board power x prefill time); the energy of moving bytes is left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvctl.store.errors import InvalidArgument
from kvctl.workload.profiles import ModeledInputs
from kvctl.workload.simulate import simulate_policy
from kvctl.workload.trace import TraceRequest

FIBER_SECONDS_PER_KM = 5e-6
TIER_ORDER = ("cpu", "disk", "remote")
DEFAULT_DISTANCES_KM = (10.0, 50.0, 100.0)

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class TierLink:
    """How a tier's chunks reach GPU memory (modeled)."""

    bytes_per_second: float
    latency_seconds: float
    distance_km: float = 0.0

    @property
    def round_trip_seconds(self) -> float:
        return self.latency_seconds + 2 * self.distance_km * FIBER_SECONDS_PER_KM

    def fetch_seconds(self, nbytes: float) -> float:
        return self.round_trip_seconds + nbytes / self.bytes_per_second

    def as_dict(self) -> dict[str, float]:
        return {
            "bytes_per_second": self.bytes_per_second,
            "latency_seconds": self.latency_seconds,
            "distance_km": self.distance_km,
            "round_trip_seconds": self.round_trip_seconds,
        }


DEFAULT_LINKS: dict[str, TierLink] = {
    "cpu": TierLink(25e9, 10e-6),
    "disk": TierLink(5e9, 100e-6),
    "remote": TierLink(12.5e9, 50e-6),
}


def worth_fetching(
    link: TierLink, chunk_bytes: float, chunk_tokens: int, inputs: ModeledInputs
) -> bool:
    """design.md's rule: fetch when ``rtt + bytes / bandwidth < tokens / prefill rate``."""
    return link.fetch_seconds(chunk_bytes) < inputs.prefill_seconds(chunk_tokens)


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    #: tier -> capacity in bytes, fastest first
    tiers_bytes: dict[str, int]
    remote_km: float = 0.0


@dataclass(frozen=True, slots=True)
class CandidateResult:
    candidate: Candidate
    tiers_blocks: dict[str, int]
    hit_ratio: float
    token_hit_ratio: float
    hits_by_tier: dict[str, int]
    #: tiers whose chunks are cheaper to recompute than to fetch (their hits recomputed)
    not_worth_fetching: tuple[str, ...]
    mean_ttft_seconds: float
    p50_ttft_seconds: float
    p99_ttft_seconds: float
    prefill_joules: float

    def as_dict(self, baseline: CandidateResult | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.candidate.name,
            "tiers_bytes": self.candidate.tiers_bytes,
            "tiers_blocks": self.tiers_blocks,
            "remote_km": self.candidate.remote_km,
            "hit_ratio": self.hit_ratio,
            "token_hit_ratio": self.token_hit_ratio,
            "hits_by_tier": self.hits_by_tier,
            "not_worth_fetching": list(self.not_worth_fetching),
            "modeled": {
                "mean_ttft_seconds": self.mean_ttft_seconds,
                "p50_ttft_seconds": self.p50_ttft_seconds,
                "p99_ttft_seconds": self.p99_ttft_seconds,
                "prefill_joules": self.prefill_joules,
            },
        }
        if baseline is not None:
            out["modeled"]["ttft_saved_ratio"] = _saved(
                baseline.mean_ttft_seconds, self.mean_ttft_seconds
            )
            out["modeled"]["energy_saved_ratio"] = _saved(
                baseline.prefill_joules, self.prefill_joules
            )
        return out


def _saved(before: float, after: float) -> float:
    return (before - after) / before if before else 0.0


@dataclass(frozen=True, slots=True)
class CurvePoint:
    capacity_blocks: int
    capacity_ratio: float
    hit_ratio: float

    @property
    def miss_ratio(self) -> float:
        return 1.0 - self.hit_ratio


@dataclass
class PlanReport:
    workload: str
    requests: int
    unique_blocks: int
    block_tokens: int
    block_bytes: int
    policy: str
    inputs: ModeledInputs
    links: dict[str, TierLink]
    baseline: CandidateResult
    candidates: list[CandidateResult] = field(default_factory=list)
    #: single-tier miss-ratio curve per policy (LRU always, and ``policy``)
    curves: dict[str, list[CurvePoint]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "requests": self.requests,
            "unique_blocks": self.unique_blocks,
            "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes,
            "policy": self.policy,
            "basis": "hit ratios simulated; TTFT and energy modeled",
            "inputs": {
                **self.inputs.as_dict(),
                "tier_links": {k: v.as_dict() for k, v in self.links.items()},
                "fiber_seconds_per_km": FIBER_SECONDS_PER_KM,
                "energy": "prefill compute only: board power x prefill seconds",
            },
            "baseline": self.baseline.as_dict(),
            "candidates": [c.as_dict(self.baseline) for c in self.candidates],
            "miss_ratio_curve": {
                policy: [
                    {
                        "capacity_blocks": p.capacity_blocks,
                        "capacity_ratio": p.capacity_ratio,
                        "hit_ratio": p.hit_ratio,
                        "miss_ratio": p.miss_ratio,
                    }
                    for p in points
                ]
                for policy, points in self.curves.items()
            },
        }


def default_candidates(
    tiers_bytes: Mapping[str, int], distances_km: Sequence[float] = DEFAULT_DISTANCES_KM
) -> list[Candidate]:
    """cpu; cpu+disk; cpu+disk+remote in the same DC; and the remote pool at each distance
    (tiers absent from ``tiers_bytes`` are left out)."""
    order = [t for t in TIER_ORDER if tiers_bytes.get(t)]
    out: list[Candidate] = []
    for n in range(1, len(order) + 1):
        chosen = order[:n]
        sizes = {t: int(tiers_bytes[t]) for t in chosen}
        out.append(Candidate("+".join(chosen), sizes))
        if chosen[-1] == "remote":
            out += [
                Candidate(f"{'+'.join(chosen)} @{km:g} km", sizes, km)
                for km in distances_km
                if km > 0
            ]
    return out


def plan(
    requests: Sequence[TraceRequest],
    *,
    tiers_bytes: Mapping[str, int],
    inputs: ModeledInputs,
    distances_km: Sequence[float] = DEFAULT_DISTANCES_KM,
    policy: str = "lineage-lru",
    curve_points: int = 10,
    links: Mapping[str, TierLink] | None = None,
    workload_name: str = "",
    progress: Progress | None = None,
) -> PlanReport:
    if not requests:
        raise InvalidArgument("the workload holds no requests")
    unknown = [t for t in tiers_bytes if t not in TIER_ORDER]
    if unknown:
        raise InvalidArgument(f"unknown tier {unknown[0]!r}; plan models {', '.join(TIER_ORDER)}")
    if any(km < 0 for km in distances_km):
        raise InvalidArgument("distances must not be negative")
    if curve_points < 2:
        raise InvalidArgument(f"the curve needs at least 2 points, got {curve_points}")
    block_tokens = requests[0].block_tokens
    block_bytes = block_tokens * inputs.model.kv_bytes_per_token
    tiers_blocks = {t: int(b) // block_bytes for t, b in tiers_bytes.items() if b}
    small = [t for t, n in tiers_blocks.items() if n < 1]
    if small:
        raise InvalidArgument(
            f"tier {small[0]} holds less than one block ({block_bytes:,} bytes for "
            f"{block_tokens} tokens of {inputs.model.name})"
        )
    links = dict(links or DEFAULT_LINKS)
    unique = len({b for r in requests for b in r.block_ids})
    baseline = _result(
        Candidate("no cache", {}), {}, requests, [()] * len(requests), inputs, links, block_bytes
    )
    report = PlanReport(
        workload_name, len(requests), unique, block_tokens, block_bytes, policy, inputs,
        links, baseline,
    )  # fmt: skip
    simulated: dict[tuple[tuple[str, int], ...], list[tuple[str, ...]]] = {}
    for cand in default_candidates(tiers_bytes, distances_km):
        blocks = {t: tiers_blocks[t] for t in cand.tiers_bytes}
        key = tuple(blocks.items())
        if key not in simulated:
            simulated[key] = _simulate(requests, blocks, policy, progress, cand.name)
        report.candidates.append(
            _result(cand, blocks, requests, simulated[key], inputs, links, block_bytes)
        )
    for name in dict.fromkeys(("lru", policy)):
        report.curves[name] = miss_ratio_curve(
            requests, unique, name, curve_points, progress=progress
        )
    return report


def _simulate(
    requests: Sequence[TraceRequest],
    blocks: dict[str, int],
    policy: str,
    progress: Progress | None,
    label: str,
) -> list[tuple[str, ...]]:
    per_request: list[tuple[str, ...]] = [()] * len(requests)

    def record(i: int, tiers: Sequence[str]) -> None:
        per_request[i] = tuple(tiers)

    def step(_: str, done: int, total: int) -> None:
        if progress is not None:
            progress(label, done, total)

    simulate_policy(requests, tiers=blocks, policy=policy, on_request=record, progress=step)
    return per_request


def _result(
    cand: Candidate,
    blocks: dict[str, int],
    requests: Sequence[TraceRequest],
    hit_tiers: Sequence[tuple[str, ...]],
    inputs: ModeledInputs,
    links: Mapping[str, TierLink],
    block_bytes: int,
) -> CandidateResult:
    """Model each request's TTFT from the tier of each of its hit blocks."""
    tier_links = {
        t: replace(links[t], distance_km=cand.remote_km) if t == "remote" else links[t]
        for t in blocks
    }
    block_tokens = requests[0].block_tokens
    skip = tuple(
        t for t, link in tier_links.items()
        if not worth_fetching(link, block_bytes, block_tokens, inputs)
    )  # fmt: skip
    ttfts: list[float] = []
    prefill_total = 0.0
    hit_blocks = hit_tokens = total_blocks = total_tokens = 0
    hits_by_tier = dict.fromkeys(blocks, 0)
    for r, tiers in zip(requests, hit_tiers, strict=True):
        counts = r.block_token_counts
        total_blocks += len(counts)
        total_tokens += r.input_tokens
        fetched_tokens = 0
        per_tier: dict[str, int] = {}
        for tier, tokens in zip(tiers, counts, strict=False):
            hits_by_tier[tier] += 1
            hit_blocks += 1
            hit_tokens += tokens
            if tier not in skip:
                per_tier[tier] = per_tier.get(tier, 0) + tokens
                fetched_tokens += tokens
        fetch = sum(
            tier_links[t].fetch_seconds(tok * inputs.model.kv_bytes_per_token)
            for t, tok in per_tier.items()
        )
        prefill = inputs.prefill_seconds(r.input_tokens - fetched_tokens)
        prefill_total += prefill
        ttfts.append(prefill + fetch)
    ttfts.sort()
    return CandidateResult(
        candidate=cand,
        tiers_blocks=blocks,
        hit_ratio=hit_blocks / total_blocks if total_blocks else 0.0,
        token_hit_ratio=hit_tokens / total_tokens if total_tokens else 0.0,
        hits_by_tier=hits_by_tier,
        not_worth_fetching=skip,
        mean_ttft_seconds=sum(ttfts) / len(ttfts),
        p50_ttft_seconds=_quantile(ttfts, 0.5),
        p99_ttft_seconds=_quantile(ttfts, 0.99),
        prefill_joules=prefill_total * inputs.gpu.board_power_watts,
    )


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of sorted values."""
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def curve_capacities(unique_blocks: int, points: int) -> list[int]:
    """``points`` capacities spaced evenly in log from 1% of the unique blocks to all of them
    (fewer when the workload is too small to tell them apart)."""
    low = max(1, round(unique_blocks * 0.01))
    if unique_blocks <= low:
        return [max(1, unique_blocks)]
    ratio = unique_blocks / low
    caps = [round(low * ratio ** (i / (points - 1))) for i in range(points)]
    return sorted(set(caps))


def miss_ratio_curve(
    requests: Sequence[TraceRequest],
    unique_blocks: int,
    policy: str,
    points: int,
    *,
    progress: Progress | None = None,
) -> list[CurvePoint]:
    """Hit ratio of a single tier of each capacity in ``curve_capacities``."""
    out = []
    for cap in curve_capacities(unique_blocks, points):

        def step(_: str, done: int, total: int, cap: int = cap) -> None:
            if progress is not None:
                progress(f"curve {policy} @{cap:,} blocks", done, total)

        result = simulate_policy(requests, tiers={"cpu": cap}, policy=policy, progress=step)
        out.append(CurvePoint(cap, cap / unique_blocks, result.hit_ratio))
    return out
