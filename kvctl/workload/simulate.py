"""Offline simulation: replay a trace through the real store and policies, sizes only.

Each trace block becomes one chunk of size 1 (capacities are in blocks) in ``MeteredTier``s, so
the eviction, demotion, promotion and admission decisions are made by the same ``TieredStore``
code the agent runs. A block is a prefix hit when it and every block before it in the request is
cached at lookup time. LRU and Belady's offline optimum are always computed in the same run as
references.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvctl.errors import InvalidArgument
from kvctl.store.policies import (
    EVICTION_POLICIES,
    BeladyPolicy,
    EvictionPolicy,
    FrequencyAdmission,
    make_eviction_policy,
)
from kvctl.store.store import TieredStore
from kvctl.store.tiers.metered import MeteredTier
from kvctl.workload.trace import TraceRequest

REFERENCE_POLICIES = ("lru", "belady")
SIMULATION_POLICIES = (*EVICTION_POLICIES, "belady")

Progress = Callable[[str, int, int], None]
RequestHook = Callable[[int, Sequence[str]], None]


@dataclass(frozen=True, slots=True)
class PolicyResult:
    policy: str
    hit_ratio: float
    token_hit_ratio: float
    hits_by_tier: dict[str, int]
    hit_blocks: int
    hit_tokens: int
    seconds: float
    #: prefix-hit tokens served by each tier (``hits_by_tier`` counts blocks)
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "hit_ratio": self.hit_ratio,
            "token_hit_ratio": self.token_hit_ratio,
            "hits_by_tier": self.hits_by_tier,
            "hit_tokens_by_tier": self.hit_tokens_by_tier,
            "hit_blocks": self.hit_blocks,
            "hit_tokens": self.hit_tokens,
            "seconds": self.seconds,
        }


@dataclass(frozen=True, slots=True)
class SimulationReport:
    trace: str
    requests: int
    total_blocks: int
    total_tokens: int
    unique_blocks: int
    tiers: dict[str, int]
    admission: str
    results: list[PolicyResult] = field(default_factory=list)

    @property
    def capacity_blocks(self) -> int:
        return sum(self.tiers.values())

    def result(self, policy: str) -> PolicyResult:
        for r in self.results:
            if r.policy == policy:
                return r
        raise KeyError(policy)

    def as_dict(self) -> dict[str, object]:
        return {
            "trace": self.trace,
            "requests": self.requests,
            "total_blocks": self.total_blocks,
            "unique_blocks": self.unique_blocks,
            "capacity_blocks": self.capacity_blocks,
            "tiers": self.tiers,
            "admission": self.admission,
            "results": [r.as_dict() for r in self.results],
        }


def capacity_from_fraction(unique_blocks: int, fraction: float) -> int:
    if not 0 < fraction <= 1:
        raise InvalidArgument(f"capacity fraction must be in (0, 1], got {fraction}")
    return max(1, round(unique_blocks * fraction))


def policies_with_references(policies: Sequence[str]) -> list[str]:
    """The asked policies plus LRU and Belady, each once, in a stable order."""
    unknown = [p for p in policies if p not in SIMULATION_POLICIES]
    if unknown:
        raise InvalidArgument(
            f"unknown policy {unknown[0]!r}; choose from {', '.join(SIMULATION_POLICIES)}"
        )
    out = list(dict.fromkeys(policies))
    out += [p for p in REFERENCE_POLICIES if p not in out]
    return out


class _Chains:
    """The trace flattened once: per-request keys and token counts, and next-use positions."""

    def __init__(self, requests: Sequence[TraceRequest]) -> None:
        keys: list[list[bytes]] = []
        tokens: list[tuple[int, ...]] = []
        flat: list[bytes] = []
        for r in requests:
            ks = [b.to_bytes(16, "little") for b in r.block_ids]
            keys.append(ks)
            tokens.append(r.block_token_counts)
            flat.extend(ks)
        nxt: list[float] = [math.inf] * len(flat)
        last: dict[bytes, int] = {}
        for pos in range(len(flat) - 1, -1, -1):
            k = flat[pos]
            nxt[pos] = last.get(k, math.inf)
            last[k] = pos
        self.keys = keys
        self.tokens = tokens
        self.next_use = nxt
        self.unique_blocks = len(last)
        self.total_blocks = len(flat)
        self.total_tokens = sum(sum(t) for t in tokens)


def simulate(
    requests: Sequence[TraceRequest],
    *,
    tiers: Mapping[str, int],
    policies: Sequence[str] = ("lineage-lru",),
    admission: str = "all",
    trace_name: str = "",
    progress: Progress | None = None,
) -> SimulationReport:
    """Replay ``requests`` for each policy (plus LRU and Belady) over tiers of the given
    capacities in blocks, fastest first, e.g. ``{"cpu": 1000}`` or ``{"cpu": 500, "disk": 5000}``.
    ``admission`` gates every tier below the first (``all`` or ``frequency``)."""
    if not tiers:
        raise InvalidArgument("give at least one tier capacity")
    for name, cap in tiers.items():
        if cap < 1:
            raise InvalidArgument(f"tier {name!r} needs a capacity of at least one block")
    if admission not in ("all", "frequency"):
        raise InvalidArgument(f"unknown admission {admission!r}; choose all or frequency")
    chains = _Chains(requests)
    report = SimulationReport(
        trace=trace_name,
        requests=len(requests),
        total_blocks=chains.total_blocks,
        total_tokens=chains.total_tokens,
        unique_blocks=chains.unique_blocks,
        tiers=dict(tiers),
        admission=admission,
    )
    for policy in policies_with_references(policies):
        report.results.append(_run_one(chains, requests, tiers, policy, admission, progress))
    return report


def simulate_policy(
    requests: Sequence[TraceRequest],
    *,
    tiers: Mapping[str, int],
    policy: str,
    admission: str = "all",
    on_request: RequestHook | None = None,
    progress: Progress | None = None,
) -> PolicyResult:
    """One policy's replay (no LRU/Belady references): for callers that need each request's
    outcome (``on_request(index, tier of each hit block)``) or many capacities quickly."""
    if policy not in SIMULATION_POLICIES:
        raise InvalidArgument(
            f"unknown policy {policy!r}; choose from {', '.join(SIMULATION_POLICIES)}"
        )
    for name, cap in tiers.items():
        if cap < 1:
            raise InvalidArgument(f"tier {name!r} needs a capacity of at least one block")
    return _run_one(_Chains(requests), requests, tiers, policy, admission, progress, on_request)


def _run_one(
    chains: _Chains,
    requests: Sequence[TraceRequest],
    tiers: Mapping[str, int],
    policy: str,
    admission: str,
    progress: Progress | None,
    on_request: RequestHook | None = None,
) -> PolicyResult:
    started = time.perf_counter()
    next_use: dict[bytes, float] = {}
    names = list(tiers)

    def make(_: str) -> EvictionPolicy:
        return BeladyPolicy(next_use) if policy == "belady" else make_eviction_policy(policy)

    store = TieredStore(
        [MeteredTier(n, tiers[n]) for n in names],
        eviction={n: make(n) for n in names},
        admission={n: FrequencyAdmission() for n in names[1:]} if admission == "frequency" else {},
        clock=lambda: 0.0,  # a trace replay has no wall time; order comes from the tick
    )
    hit_blocks = hit_tokens = 0
    hits_by_tier = dict.fromkeys(names, 0)
    hit_tokens_by_tier = dict.fromkeys(names, 0)
    nxt = chains.next_use
    pos = 0
    total = len(requests)
    step = max(1, total // 100)
    for i, r in enumerate(requests):
        keys = chains.keys[i]
        toks = chains.tokens[i]
        res = store.lookup(keys, tenant=r.tenant)
        m = res.matched_chunks
        hit_blocks += m
        hit_tokens += sum(toks[:m])
        for loc, t in zip(res.locations[:m], toks, strict=False):
            hits_by_tier[loc] += 1  # type: ignore[index]
            hit_tokens_by_tier[loc] += t  # type: ignore[index]
        if on_request is not None:
            on_request(i, res.locations[:m])  # type: ignore[arg-type]
        parent = None
        for depth, (k, t) in enumerate(zip(keys, toks, strict=True)):
            next_use[k] = nxt[pos]
            pos += 1
            if k in store:
                store.touch(k, tenant=r.tenant)
            else:
                store.put(
                    k, None, size_bytes=1, tokens=t, tenant=r.tenant, parent=parent, depth=depth
                )
            parent = k
        if progress is not None and (i % step == 0 or i == total - 1):
            progress(policy, i + 1, total)
    return PolicyResult(
        policy=policy,
        hit_ratio=hit_blocks / chains.total_blocks if chains.total_blocks else 0.0,
        token_hit_ratio=hit_tokens / chains.total_tokens if chains.total_tokens else 0.0,
        hits_by_tier=hits_by_tier,
        hit_blocks=hit_blocks,
        hit_tokens=hit_tokens,
        seconds=time.perf_counter() - started,
        hit_tokens_by_tier=hit_tokens_by_tier,
    )
