"""What-if planning: for candidate tier configurations of one workload, the simulated hit ratio
of each tier, and the **modeled** TTFT and prefill energy next to a no-cache baseline; plus the
single-tier miss-ratio curve over capacity.

Simulated (the real ``TieredStore`` and eviction policies, one chunk per trace block):
- hit ratio per tier of each candidate (``kvctl.workload.simulate.simulate_policy``);
- the miss-ratio curve. LRU's comes from one pass of Mattson's stack algorithm (LRU is a stack
  algorithm: a cache of C blocks holds exactly the C most recently used blocks), which gives the
  very hit ratio ``simulate()`` does at every capacity at once; the chosen policy's curve, when
  asked, replays the store once per capacity.

Modeled (every figure says so and carries these inputs):
- prefill: ``ModeledInputs`` (model FLOPs per token, GPU peak bf16 FLOP/s, MFU, board power);
- moving a chunk into GPU memory (``TransferModel``): the tier's latency (plus fiber for a remote
  pool: 5 us per km each way) + chunk bytes / bandwidth. The constants are below;
- fetch or recompute (design.md section 3), per chunk: fetch when
  ``rtt + chunk_bytes / bandwidth < chunk_tokens / prefill_tokens_per_second``, else recompute
  (and count the chunk as a miss for TTFT and energy). A tier whose full block is cheaper to
  recompute is reported as not worth fetching from;
- a request's TTFT = prefill seconds of the tokens it does not fetch + the fetch seconds of the
  chunks it does, one after another (no overlap of fetches with compute, no queueing, no decode
  step): conservative for an engine that overlaps them;
- energy = prefill compute only (board power x prefill seconds); moving bytes, idle power and
  cooling are left out.

Every chunk is stored, however deep in its request (``bypass_unreachable`` off, as in an agent by
default, unlike ``kvctl simulate``): a plan sizes the tiers of agents whose engines may keep a
prefix of their own, and LRU's one-pass curve stays exact.

The candidates at several distances share one replay: the cache's contents are taken not to
depend on the pool's distance (a chunk recomputed rather than fetched is cached all the same; the
replay promotes it from the pool where a real store would write the recomputed copy anew).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvctl.errors import InvalidArgument
from kvctl.profiles import FIBER_SECONDS_PER_KM, MAX_DISTANCE_KM, ModeledInputs
from kvctl.quantiles import nearest_rank
from kvctl.store.policies import EVICTION_POLICIES
from kvctl.workload.simulate import simulate_policy
from kvctl.workload.trace import TraceRequest

#: label of every modeled figure
MODELED = "modeled"

#: host DRAM -> GPU over PCIe Gen5 x16 (64 GB/s raw): ~25 GB/s effective for copies of scattered
#: pinned KV blocks, ~10 us to set up a copy
CPU_BANDWIDTH_BYTES_PER_SECOND = 25e9
CPU_LATENCY_SECONDS = 10e-6
#: one local NVMe SSD (PCIe Gen4 sequential read), ~100 us per read
DISK_BANDWIDTH_BYTES_PER_SECOND = 5e9
DISK_LATENCY_SECONDS = 100e-6
#: a shared pool over a 100 Gb/s NIC; ~50 us in the same DC (network stack, switches, the pool's
#: own lookup); fiber adds its round trip per km
REMOTE_BANDWIDTH_BYTES_PER_SECOND = 12.5e9
REMOTE_LATENCY_SECONDS = 50e-6

DEFAULT_DISTANCES_KM = (10.0, 50.0, 100.0)
DEFAULT_CURVE_POINTS = 10
#: the curve spans this fraction of the unique blocks up to all of them
CURVE_LOW_FRACTION = 0.01

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class TransferModel:
    """How a tier's chunks reach GPU memory (modeled): latency + fiber round trip + bytes/bw."""

    tier: str
    bandwidth_bytes_per_second: float
    latency_seconds: float
    distance_km: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_second > 0:
            raise InvalidArgument(f"{self.tier}: bandwidth must be positive")
        if self.latency_seconds < 0:
            raise InvalidArgument(f"{self.tier}: latency must not be negative")
        if not (self.distance_km >= 0 and math.isfinite(self.distance_km)):
            raise InvalidArgument(f"{self.tier}: distance must be a finite number of km >= 0")

    @property
    def fiber_rtt_seconds(self) -> float:
        return 2 * FIBER_SECONDS_PER_KM * self.distance_km

    @property
    def rtt_seconds(self) -> float:
        """Everything a fetch pays before its first byte: the tier's latency and the fiber."""
        return self.latency_seconds + self.fiber_rtt_seconds

    def fetch_seconds(self, nbytes: float) -> float:
        return self.rtt_seconds + nbytes / self.bandwidth_bytes_per_second

    def at_distance(self, distance_km: float) -> TransferModel:
        return replace(self, distance_km=distance_km)

    def as_dict(self) -> dict[str, object]:
        return {
            "tier": self.tier,
            "bandwidth_bytes_per_second": self.bandwidth_bytes_per_second,
            "latency_seconds": self.latency_seconds,
            "distance_km": self.distance_km,
            "fiber_seconds_per_km_one_way": FIBER_SECONDS_PER_KM,
            "rtt_seconds": self.rtt_seconds,
            "basis": MODELED,
        }


DEFAULT_TRANSFERS: dict[str, TransferModel] = {
    "cpu": TransferModel("cpu", CPU_BANDWIDTH_BYTES_PER_SECOND, CPU_LATENCY_SECONDS),
    "disk": TransferModel("disk", DISK_BANDWIDTH_BYTES_PER_SECOND, DISK_LATENCY_SECONDS),
    "remote": TransferModel("remote", REMOTE_BANDWIDTH_BYTES_PER_SECOND, REMOTE_LATENCY_SECONDS),
}


@dataclass(frozen=True, slots=True)
class TierCost:
    """design.md's fetch-or-recompute rule for one tier, one model and one GPU (modeled)."""

    transfer: TransferModel
    inputs: ModeledInputs

    def fetch_seconds(self, tokens: int) -> float:
        return self.transfer.fetch_seconds(tokens * self.inputs.model.kv_bytes_per_token)

    def recompute_seconds(self, tokens: int) -> float:
        return self.inputs.prefill_seconds(tokens)

    def fetches(self, tokens: int) -> bool:
        """Fetch when ``rtt + bytes / bandwidth < tokens / prefill rate`` (strictly)."""
        return self.fetch_seconds(tokens) < self.recompute_seconds(tokens)

    def chunk_seconds(self, tokens: int) -> float:
        """What a cached chunk of ``tokens`` costs the request: the cheaper of the two."""
        return min(self.fetch_seconds(tokens), self.recompute_seconds(tokens))

    def max_distance_km(self, tokens: int) -> float:
        """Farthest distance at which fetching a chunk of ``tokens`` still beats recomputing it
        (0 when it does not even at 0 km)."""
        spare = self.recompute_seconds(tokens) - self.transfer.at_distance(0).fetch_seconds(
            tokens * self.inputs.model.kv_bytes_per_token
        )
        return max(0.0, spare / (2 * FIBER_SECONDS_PER_KM))

    def as_dict(self, block_tokens: int) -> dict[str, object]:
        out = {
            **self.transfer.as_dict(),
            "block_tokens": block_tokens,
            "fetch_seconds_per_block": self.fetch_seconds(block_tokens),
            "recompute_seconds_per_block": self.recompute_seconds(block_tokens),
            "worth_fetching": self.fetches(block_tokens),
        }
        if self.transfer.tier == "remote":  # the one tier whose distance is a choice
            out["max_distance_km_worth_fetching"] = self.max_distance_km(block_tokens)
        return out


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration: tiers fastest first with their sizes, and the remote pool's distance."""

    name: str
    tiers_bytes: dict[str, int]
    tiers_blocks: dict[str, int]
    transfers: dict[str, TransferModel]
    distance_km: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "tiers_bytes": self.tiers_bytes,
            "tiers_blocks": self.tiers_blocks,
            "distance_km": self.distance_km,
        }


@dataclass(frozen=True, slots=True)
class TTFTStats:
    """Modeled TTFT over the requests and prefill energy of one configuration (or none)."""

    mean_ttft_seconds: float
    p50_ttft_seconds: float
    p99_ttft_seconds: float
    prefill_tokens: int
    prefill_joules: float

    def as_dict(self) -> dict[str, object]:
        return {
            "basis": MODELED,
            "mean_ttft_seconds": self.mean_ttft_seconds,
            "p50_ttft_seconds": self.p50_ttft_seconds,
            "p99_ttft_seconds": self.p99_ttft_seconds,
            "prefill_tokens": self.prefill_tokens,
            "prefill_joules": self.prefill_joules,
        }


@dataclass(frozen=True, slots=True)
class CandidateResult:
    candidate: Candidate
    #: simulated
    hit_ratio: float
    token_hit_ratio: float
    hits_by_tier: dict[str, int]
    hit_tokens_by_tier: dict[str, int]
    hit_ratio_by_tier: dict[str, float]
    #: modeled: hit tokens each tier serves, and hit tokens recomputed because fetching them
    #: was slower (fetch-or-recompute)
    fetched_tokens_by_tier: dict[str, int]
    recomputed_hit_tokens_by_tier: dict[str, int]
    #: modeled: tiers whose full block is cheaper to recompute than to fetch
    not_worth_fetching: tuple[str, ...]
    ttft: TTFTStats
    baseline: TTFTStats
    #: modeled: the fetch-or-recompute inputs of each tier (with this candidate's distance)
    tier_costs: dict[str, TierCost]
    block_tokens: int
    simulate_seconds: float = 0.0

    @property
    def mean_ttft_saved_seconds(self) -> float:
        return self.baseline.mean_ttft_seconds - self.ttft.mean_ttft_seconds

    @property
    def mean_ttft_saved_ratio(self) -> float:
        return _saved_ratio(self.baseline.mean_ttft_seconds, self.ttft.mean_ttft_seconds)

    @property
    def prefill_joules_saved(self) -> float:
        return self.baseline.prefill_joules - self.ttft.prefill_joules

    @property
    def prefill_joules_saved_ratio(self) -> float:
        return _saved_ratio(self.baseline.prefill_joules, self.ttft.prefill_joules)

    def as_dict(self) -> dict[str, object]:
        return {
            **self.candidate.as_dict(),
            "simulated": {
                "basis": "simulated",
                "hit_ratio": self.hit_ratio,
                "token_hit_ratio": self.token_hit_ratio,
                "hit_ratio_by_tier": self.hit_ratio_by_tier,
                "hits_by_tier": self.hits_by_tier,
                "hit_tokens_by_tier": self.hit_tokens_by_tier,
                "seconds": self.simulate_seconds,
            },
            "modeled": {
                **self.ttft.as_dict(),
                "fetched_tokens_by_tier": self.fetched_tokens_by_tier,
                "recomputed_hit_tokens_by_tier": self.recomputed_hit_tokens_by_tier,
                "not_worth_fetching": list(self.not_worth_fetching),
                "mean_ttft_saved_seconds": self.mean_ttft_saved_seconds,
                "mean_ttft_saved_ratio": self.mean_ttft_saved_ratio,
                "prefill_tokens_saved": self.baseline.prefill_tokens - self.ttft.prefill_tokens,
                "prefill_joules_saved": self.prefill_joules_saved,
                "prefill_joules_saved_ratio": self.prefill_joules_saved_ratio,
                "transfers": {t: c.as_dict(self.block_tokens) for t, c in self.tier_costs.items()},
            },
        }


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """Simulated hit ratios of one single-tier cache size."""

    capacity_blocks: int
    capacity_bytes: int
    unique_fraction: float
    lru_hit_ratio: float
    lru_token_hit_ratio: float
    policy_hit_ratio: float | None = None
    policy_token_hit_ratio: float | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "capacity_blocks": self.capacity_blocks,
            "capacity_bytes": self.capacity_bytes,
            "unique_fraction": self.unique_fraction,
            "lru_hit_ratio": self.lru_hit_ratio,
            "lru_token_hit_ratio": self.lru_token_hit_ratio,
            "policy_hit_ratio": self.policy_hit_ratio,
            "policy_token_hit_ratio": self.policy_token_hit_ratio,
        }


@dataclass
class PlanReport:
    workload: str
    requests: int
    total_blocks: int
    total_tokens: int
    unique_blocks: int
    block_tokens: int
    block_bytes: int
    policy: str
    inputs: ModeledInputs
    transfers: dict[str, TransferModel]
    tiers_bytes: dict[str, int]
    tiers_blocks: dict[str, int]
    baseline: TTFTStats
    candidates: list[CandidateResult] = field(default_factory=list)
    curve: list[CurvePoint] = field(default_factory=list)
    #: whether ``curve`` carries the chosen policy's hit ratios too (LRU's always)
    policy_curve: bool = False
    seconds: float = 0.0

    def candidate(self, name: str) -> CandidateResult:
        for c in self.candidates:
            if c.candidate.name == name:
                return c
        raise KeyError(name)

    def tier_costs(self) -> dict[str, TierCost]:
        return {t: TierCost(tm, self.inputs) for t, tm in self.transfers.items()}

    def as_dict(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "requests": self.requests,
            "total_blocks": self.total_blocks,
            "total_tokens": self.total_tokens,
            "unique_blocks": self.unique_blocks,
            "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes,
            "policy": self.policy,
            "tiers_bytes": self.tiers_bytes,
            "tiers_blocks": self.tiers_blocks,
            "basis": "hit ratios simulated (the store's own policies); TTFT and energy modeled",
            "modeled_inputs": modeled_inputs(self.inputs, self.transfers, self.block_tokens),
            "baseline": {"name": "no cache", **self.baseline.as_dict()},
            "candidates": [c.as_dict() for c in self.candidates],
            "miss_ratio_curve": {
                "basis": "simulated, one tier",
                "policies": ["lru", self.policy] if self.policy_curve else ["lru"],
                "points": [p.as_dict() for p in self.curve],
            },
            "seconds": self.seconds,
        }


def modeled_inputs(
    inputs: ModeledInputs, transfers: Mapping[str, TransferModel], block_tokens: int
) -> dict[str, Any]:
    """Everything the modeled figures depend on, to print next to them."""
    prefill = inputs.as_dict()
    prefill["prefill_model"] = prefill.pop("basis", "")
    return {
        "basis": MODELED,
        **prefill,
        "transfers": {t: TierCost(tm, inputs).as_dict(block_tokens) for t, tm in transfers.items()},
        "fetch_or_recompute": "per chunk: fetch when rtt + chunk_bytes / bandwidth < "
        "chunk_tokens / prefill_tokens_per_second, else recompute (counted as a miss)",
        "ttft": "prefill seconds of the tokens not fetched + fetch seconds of each fetched "
        "chunk, one after another (no overlap, no queueing, no decode step)",
        "energy": "prefill compute only: board power x prefill seconds (moving bytes, idle "
        "power and cooling are left out)",
    }


def _saved_ratio(before: float, after: float) -> float:
    return (before - after) / before if before else 0.0


# --- the miss-ratio curve ---------------------------------------------------------------------


def curve_capacities(unique_blocks: int, points: int) -> list[int]:
    """``points`` capacities spaced evenly in log from 1% of the unique blocks to all of them
    (fewer when a small workload cannot tell them apart)."""
    if points < 2:
        raise InvalidArgument(f"the curve needs at least 2 points, got {points}")
    if unique_blocks < 1:
        return []
    low = max(1, round(unique_blocks * CURVE_LOW_FRACTION))
    if low >= unique_blocks:
        return [unique_blocks]
    ratio = unique_blocks / low
    caps = {round(low * ratio ** (i / (points - 1))) for i in range(points)}
    caps.add(unique_blocks)
    return sorted(caps)


def lru_hits_by_capacity(
    requests: Sequence[TraceRequest],
    capacities: Sequence[int],
    *,
    progress: Progress | None = None,
) -> list[tuple[int, int]]:
    """``(hit blocks, hit tokens)`` of a single LRU tier of each capacity (in blocks), all in one
    pass: the same figures ``simulate(..., policies=["lru"])`` gives for its ``lru`` result.

    A block's stack position at lookup time is 1 + the number of distinct blocks used since its
    last use (Mattson et al., 1970), found with a Fenwick tree over access positions that marks
    each block's latest access. An LRU cache of C blocks holds it iff its position <= C, and a
    prefix hit needs every block before it held too: the running maximum of the positions.
    Lookups see the state before the request's own accesses, as ``TieredStore.lookup`` does.
    """
    total = sum(len(r.block_ids) for r in requests)
    tree = [0] * (total + 1)
    last: dict[int, int] = {}
    never = total + 1  # a position no capacity reaches: a miss at every size
    live = 0  # distinct blocks seen so far (= markers in the tree)
    pos = 0
    positions: list[int] = []  # per block: running max of stack positions in its request
    tokens: list[int] = []
    n_requests = len(requests)
    step = max(1, n_requests // 100)
    for i, r in enumerate(requests):
        running = 0
        for b in r.block_ids:
            if running < never:
                q = last.get(b)
                if q is None:
                    running = never
                else:
                    # markers at positions <= q (1-based index q + 1)
                    s = 0
                    j = q + 1
                    while j:
                        s += tree[j]
                        j &= j - 1
                    depth = live - s + 1
                    if depth > running:
                        running = depth
            positions.append(running)
        tokens.extend(r.block_token_counts)
        for b in r.block_ids:
            q = last.get(b)
            if q is None:
                live += 1
            else:
                j = q + 1
                while j <= total:
                    tree[j] -= 1
                    j += j & -j
            j = pos + 1
            while j <= total:
                tree[j] += 1
                j += j & -j
            last[b] = pos
            pos += 1
        if progress is not None and (i % step == 0 or i == n_requests - 1):
            progress("LRU curve (one pass)", i + 1, n_requests)
    order = sorted(range(len(positions)), key=positions.__getitem__)
    sorted_positions = [positions[k] for k in order]
    cum_tokens = [0]
    for k in order:
        cum_tokens.append(cum_tokens[-1] + tokens[k])
    out = []
    for cap in capacities:
        n = bisect.bisect_right(sorted_positions, cap)
        out.append((n, cum_tokens[n]))
    return out


# --- planning ---------------------------------------------------------------------------------


def block_tokens_of(requests: Sequence[TraceRequest]) -> int:
    sizes = {r.block_tokens for r in requests}
    if len(sizes) != 1:
        raise InvalidArgument(f"the workload mixes block sizes {sorted(sizes)}; plan needs one")
    return sizes.pop()


def tier_blocks(
    tiers_bytes: Mapping[str, int], block_bytes: int, *, model: str = "", block_tokens: int = 0
) -> dict[str, int]:
    """Each tier's capacity in whole blocks; a tier that holds less than one is an error."""
    out = {}
    for tier, nbytes in tiers_bytes.items():
        if nbytes < 0:
            raise InvalidArgument(f"tier {tier!r}: a size must not be negative, got {nbytes}")
        blocks = nbytes // block_bytes
        if blocks < 1:
            of = f" ({block_tokens} tokens of {model} KV)" if model else ""
            raise InvalidArgument(
                f"tier {tier!r} of {nbytes:,} bytes holds less than one block: a block is "
                f"{block_bytes:,} bytes{of}"
            )
        out[tier] = blocks
    return out


def candidates_for(
    tiers_bytes: Mapping[str, int],
    tiers_blocks: Mapping[str, int],
    transfers: Mapping[str, TransferModel],
    distances_km: Sequence[float],
) -> list[Candidate]:
    """The tiers cumulatively, fastest first (``cpu``, ``cpu+disk``, ``cpu+disk+remote`` with the
    pool in the same DC), then the one with the remote pool at each distance."""
    names = list(tiers_bytes)
    out: list[Candidate] = []
    for n in range(1, len(names) + 1):
        chosen = names[:n]
        name = "+".join(chosen)
        sizes = {t: int(tiers_bytes[t]) for t in chosen}
        blocks = {t: tiers_blocks[t] for t in chosen}
        tm = {t: transfers[t] for t in chosen}
        out.append(Candidate(name, sizes, blocks, tm))
        if chosen[-1] == "remote":
            for km in distances_km:
                at = {t: m.at_distance(km) if t == "remote" else m for t, m in tm.items()}
                out.append(Candidate(f"{name}@{km:g}km", sizes, blocks, at, km))
    return out


def _distances(distances_km: Sequence[float]) -> list[float]:
    out: list[float] = []
    for km in distances_km:
        km = float(km)
        if not (0 <= km <= MAX_DISTANCE_KM):  # NaN too
            raise InvalidArgument(
                f"a distance must be 0 to {MAX_DISTANCE_KM:,.0f} km (the Earth's "
                f"circumference), got {km:g}"
            )
        if km > 0 and km not in out:  # 0 km is the same-DC candidate, always there
            out.append(km)
    return out


def model_ttft(
    requests: Sequence[TraceRequest],
    hit_tiers: Sequence[Sequence[str]],
    costs: Mapping[str, TierCost],
    inputs: ModeledInputs,
) -> tuple[TTFTStats, dict[str, int], dict[str, int]]:
    """Each request's modeled TTFT from the tier of each of its prefix-hit blocks (applying
    fetch-or-recompute per chunk); returns the stats, fetched tokens and recomputed hit tokens
    by tier."""
    fetched = dict.fromkeys(costs, 0)
    recomputed = dict.fromkeys(costs, 0)
    memo: dict[tuple[str, int], tuple[float, bool]] = {}
    ttfts: list[float] = []
    prefill_tokens = 0
    for r, tiers in zip(requests, hit_tiers, strict=True):
        counts = r.block_token_counts
        fetch_seconds = 0.0
        computed = r.input_tokens
        for tier, tok in zip(tiers, counts, strict=False):
            known = memo.get((tier, tok))
            if known is None:
                c = costs[tier]
                known = memo[(tier, tok)] = (c.fetch_seconds(tok), c.fetches(tok))
            seconds, fetch = known
            if fetch:
                fetch_seconds += seconds
                computed -= tok
                fetched[tier] += tok
            else:
                recomputed[tier] += tok
        prefill_tokens += computed
        ttfts.append(inputs.prefill_seconds(computed) + fetch_seconds)
    ttfts.sort()
    stats = TTFTStats(
        mean_ttft_seconds=sum(ttfts) / len(ttfts) if ttfts else 0.0,
        p50_ttft_seconds=nearest_rank(ttfts, 0.50) or 0.0,
        p99_ttft_seconds=nearest_rank(ttfts, 0.99) or 0.0,
        prefill_tokens=prefill_tokens,
        prefill_joules=inputs.prefill_joules(prefill_tokens),
    )
    return stats, fetched, recomputed


def plan(
    requests: Sequence[TraceRequest],
    *,
    tiers_bytes: Mapping[str, int],
    inputs: ModeledInputs,
    distances_km: Sequence[float] = DEFAULT_DISTANCES_KM,
    policy: str = "lineage-lru",
    curve_points: int = DEFAULT_CURVE_POINTS,
    progress: Progress | None = None,
    policy_curve: bool = True,
    transfers: Mapping[str, TransferModel] | None = None,
    workload_name: str = "",
) -> PlanReport:
    """Plan the tiers in ``tiers_bytes`` (name -> bytes, fastest first, e.g. ``{"cpu": 64 << 30,
    "disk": 1 << 40, "remote": 10 << 40}``) for ``requests``; see the module docstring.

    ``curve_points`` 0 skips the miss-ratio curve; ``policy_curve`` adds ``policy``'s hit ratio
    to it (one replay per point: the slow part on a big trace). ``progress(stage, done, total)``
    is called as replays advance.
    """
    started = time.perf_counter()
    if not requests:
        raise InvalidArgument("the workload holds no requests")
    if policy not in EVICTION_POLICIES:
        raise InvalidArgument(
            f"unknown policy {policy!r}; choose from {', '.join(EVICTION_POLICIES)}"
        )
    if not tiers_bytes:
        raise InvalidArgument("give at least one tier size")
    transfers = dict(DEFAULT_TRANSFERS if transfers is None else transfers)
    unknown = [t for t in tiers_bytes if t not in transfers]
    if unknown:
        raise InvalidArgument(
            f"no transfer model for tier {unknown[0]!r}; known: {', '.join(transfers)}"
        )
    if curve_points and curve_points < 2:
        raise InvalidArgument(
            f"the curve needs at least 2 points (or 0 for none), got {curve_points}"
        )
    distances = _distances(distances_km)
    block_tokens = block_tokens_of(requests)
    block_bytes = block_tokens * inputs.model.kv_bytes_per_token
    blocks = tier_blocks(
        tiers_bytes, block_bytes, model=inputs.model.name, block_tokens=block_tokens
    )
    transfers = {t: transfers[t] for t in tiers_bytes}

    total_blocks = sum(len(r.block_ids) for r in requests)
    total_tokens = sum(r.input_tokens for r in requests)
    unique = len({b for r in requests for b in r.block_ids})
    baseline, _, _ = model_ttft(requests, [()] * len(requests), {}, inputs)
    report = PlanReport(
        workload=workload_name,
        requests=len(requests),
        total_blocks=total_blocks,
        total_tokens=total_tokens,
        unique_blocks=unique,
        block_tokens=block_tokens,
        block_bytes=block_bytes,
        policy=policy,
        inputs=inputs,
        transfers=transfers,
        tiers_bytes=dict(tiers_bytes),
        tiers_blocks=blocks,
        baseline=baseline,
    )

    replays: dict[tuple[str, ...], tuple[list[tuple[str, ...]], Any]] = {}
    for cand in candidates_for(tiers_bytes, blocks, transfers, distances):
        key = tuple(cand.tiers_blocks)
        if key not in replays:
            replays[key] = _replay(requests, cand, policy, progress)
        hit_tiers, result = replays[key]
        costs = {t: TierCost(tm, inputs) for t, tm in cand.transfers.items()}
        stats, fetched, recomputed = model_ttft(requests, hit_tiers, costs, inputs)
        report.candidates.append(
            CandidateResult(
                candidate=cand,
                hit_ratio=result.hit_ratio,
                token_hit_ratio=result.token_hit_ratio,
                hits_by_tier=dict(result.hits_by_tier),
                hit_tokens_by_tier=dict(result.hit_tokens_by_tier),
                hit_ratio_by_tier={
                    t: n / total_blocks if total_blocks else 0.0
                    for t, n in result.hits_by_tier.items()
                },
                fetched_tokens_by_tier=fetched,
                recomputed_hit_tokens_by_tier=recomputed,
                not_worth_fetching=tuple(
                    t for t, c in costs.items() if not c.fetches(block_tokens)
                ),
                ttft=stats,
                baseline=baseline,
                tier_costs=costs,
                block_tokens=block_tokens,
                simulate_seconds=result.seconds,
            )
        )

    if curve_points:
        report.curve = miss_ratio_curve(
            requests,
            curve_capacities(unique, curve_points),
            block_bytes=block_bytes,
            unique_blocks=unique,
            policy=policy if policy_curve and policy != "lru" else None,
            progress=progress,
        )
        report.policy_curve = policy_curve and policy != "lru"
    report.seconds = time.perf_counter() - started
    return report


def _replay(
    requests: Sequence[TraceRequest], cand: Candidate, policy: str, progress: Progress | None
) -> tuple[list[tuple[str, ...]], Any]:
    hit_tiers: list[tuple[str, ...]] = [()] * len(requests)

    def record(i: int, tiers: Sequence[str]) -> None:
        hit_tiers[i] = tuple(tiers)

    label = f"replay {cand.name} ({policy})"

    def step(_: str, done: int, total: int) -> None:
        if progress is not None:
            progress(label, done, total)

    result = simulate_policy(
        requests,
        tiers=cand.tiers_blocks,
        policy=policy,
        on_request=record,
        progress=step,
        bypass_unreachable=False,  # as an agent by default (see the module docstring)
    )
    return hit_tiers, result


def miss_ratio_curve(
    requests: Sequence[TraceRequest],
    capacities: Sequence[int],
    *,
    block_bytes: int,
    unique_blocks: int,
    policy: str | None = None,
    progress: Progress | None = None,
) -> list[CurvePoint]:
    """Single-tier hit ratios at each capacity: LRU's from one stack-distance pass, and
    ``policy``'s (when given) from one replay per capacity below ``unique_blocks`` (at or above
    it nothing is evicted, and every policy hits what LRU does)."""
    total_blocks = sum(len(r.block_ids) for r in requests)
    total_tokens = sum(r.input_tokens for r in requests)
    lru = lru_hits_by_capacity(requests, capacities, progress=progress)
    out = []
    for cap, (hit_blocks, hit_tokens) in zip(capacities, lru, strict=True):
        point = CurvePoint(
            capacity_blocks=cap,
            capacity_bytes=cap * block_bytes,
            unique_fraction=cap / unique_blocks if unique_blocks else 0.0,
            lru_hit_ratio=hit_blocks / total_blocks if total_blocks else 0.0,
            lru_token_hit_ratio=hit_tokens / total_tokens if total_tokens else 0.0,
        )
        if policy is not None and cap >= unique_blocks:
            # nothing is ever evicted, so every policy hits exactly what LRU does
            point = replace(
                point,
                policy_hit_ratio=point.lru_hit_ratio,
                policy_token_hit_ratio=point.lru_token_hit_ratio,
            )
        elif policy is not None:
            label = f"curve {policy} @ {cap:,} blocks"

            def step(_: str, done: int, total: int, label: str = label) -> None:
                if progress is not None:
                    progress(label, done, total)

            r = simulate_policy(
                requests,
                tiers={"cpu": cap},
                policy=policy,
                progress=step,
                bypass_unreachable=False,
            )
            point = replace(
                point, policy_hit_ratio=r.hit_ratio, policy_token_hit_ratio=r.token_hit_ratio
            )
        out.append(point)
    return out
