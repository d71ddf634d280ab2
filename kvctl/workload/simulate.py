"""Offline simulation: replay a trace through the real store and policies, sizes only.

Each trace block becomes one chunk of size 1 (capacities are in blocks) in ``MeteredTier``s, so
the eviction, demotion, promotion and admission decisions are made by the same ``TieredStore``
code the agent runs. A block is a prefix hit when it and every block before it in the request is
cached at lookup time. LRU and Belady's offline optimum are always computed in the same run as
references. Three partial oracles run when asked for by name (``ORACLE_POLICIES``, see
``kvctl.store.policies.oracles``): the ceilings of policies that know only how often, or only
whether soon, each block is used again, and of ``lineage-learned-arc`` with a perfect model of
its features. That last one, ``oracle-features``, replays twice (``lineage-learned-arc``
recording its labelled samples, then the oracle scored from them) and reports the second pass;
its ``seconds`` and ``decisions_per_second`` cover both passes (its cost as a reference: the
trace's blocks over the two replays' time).

Three hit ratios weigh a hit differently: per block (``hit_ratio``), per token (``token_hit_ratio``,
which is also the byte hit ratio: a chunk's KV bytes are proportional to its tokens), and per
second of prefill saved (``prefill_hit_ratio``): recomputing tokens [a, b) of a request costs
``(b - a) x (1 + (a + b) / (2 x attention_tokens))`` (the weights' per-token matmuls plus attention
over every earlier token, as in ``kvctl.remote.fetchplan.PrefillModel``), so a hit deep in a long
prompt saves more than one at its start. ``attention_tokens`` is the context length at which a
token's attention costs as much as its matmuls: about 30k tokens for Llama-3.1-8B (2 x 8e9 weight
flops against 4 x 32 layers x 4,096 flops per earlier token).

A block deeper in its request than every tier together can hold is not stored
(``bypass_unreachable``, on by default; ``TieredStore``'s setting of that name): under this hit
model it could never be a hit, and storing it would only evict blocks that can. Belady's
optimum already turns such blocks away (its bypass); every other policy gains from it on the
system-prompt generator (its longest prompts outgrow the small caches) and is unchanged where
no request outgrows the cache.
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
from kvctl.store.policies.learned_arc import LineageLearnedARCPolicy
from kvctl.store.policies.oracles import (
    REUSE_HORIZON_FACTOR,
    FeatureOraclePolicy,
    FutureUse,
    PopularityOraclePolicy,
    RecordingReuseModel,
    ReuseOraclePolicy,
)
from kvctl.store.store import TieredStore
from kvctl.store.tiers.metered import MeteredTier
from kvctl.workload.trace import TraceRequest

REFERENCE_POLICIES = ("lru", "belady")
#: see the module docstring
DEFAULT_ATTENTION_TOKENS = 30_000
#: simulation-only references that run when asked for (not part of "all policies")
ORACLE_POLICIES = (PopularityOraclePolicy.name, ReuseOraclePolicy.name, FeatureOraclePolicy.name)
SIMULATION_POLICIES = (*EVICTION_POLICIES, "belady", *ORACLE_POLICIES)

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
    #: share of the trace's prefill cost the hits saved (see the module docstring)
    prefill_hit_ratio: float = 0.0
    #: blocks placed per second of replay: each is one decision of the store and its policies
    #: (a hit refreshed, or a miss stored and whatever that evicts), lookups included
    decisions_per_second: float = 0.0
    #: chunks evicted from any tier to make room (demotions included)
    evictions: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "hit_ratio": self.hit_ratio,
            "token_hit_ratio": self.token_hit_ratio,
            "prefill_hit_ratio": self.prefill_hit_ratio,
            "hits_by_tier": self.hits_by_tier,
            "hit_tokens_by_tier": self.hit_tokens_by_tier,
            "hit_blocks": self.hit_blocks,
            "hit_tokens": self.hit_tokens,
            "seconds": self.seconds,
            "decisions_per_second": self.decisions_per_second,
            "evictions": self.evictions,
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
    #: whether blocks deeper than the tiers can hold were turned away (the module docstring)
    bypass_unreachable: bool = True

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
            "bypass_unreachable": self.bypass_unreachable,
            "results": [self._result_dict(r) for r in self.results],
        }

    def _result_dict(self, r: PolicyResult) -> dict[str, object]:
        """A result with its hit ratio as a share of Belady's and of LRU's in the same replay
        (None when the reference hit nothing)."""
        out = r.as_dict()
        for ref in REFERENCE_POLICIES:
            try:
                base = self.result(ref).hit_ratio
            except KeyError:
                continue
            out[f"of_{ref}"] = r.hit_ratio / base if base else None
        return out


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


def prefill_costs(block_tokens: Sequence[int], attention_tokens: float) -> list[float]:
    """The relative prefill cost of each block of one request: tokens [a, b) cost
    ``(b - a) x (1 + (a + b) / (2 x attention_tokens))`` (see the module docstring)."""
    if not attention_tokens > 0:
        raise InvalidArgument(f"attention_tokens must be positive, got {attention_tokens}")
    out: list[float] = []
    start = 0
    for t in block_tokens:
        out.append(t * (1.0 + (2 * start + t) / (2.0 * attention_tokens)))
        start += t
    return out


class _Chains:
    """The trace flattened once: per-request keys, token counts and prefill costs, and per
    position the next use's position and the uses left after it."""

    def __init__(
        self, requests: Sequence[TraceRequest], attention_tokens: float = DEFAULT_ATTENTION_TOKENS
    ) -> None:
        keys: list[list[bytes]] = []
        tokens: list[tuple[int, ...]] = []
        costs: list[list[float]] = []
        flat: list[bytes] = []
        for r in requests:
            ks = [b.to_bytes(16, "little") for b in r.block_ids]
            keys.append(ks)
            tokens.append(r.block_token_counts)
            costs.append(prefill_costs(r.block_token_counts, attention_tokens))
            flat.extend(ks)
        nxt: list[float] = [math.inf] * len(flat)
        left = [0] * len(flat)
        last: dict[bytes, int] = {}
        seen_after: dict[bytes, int] = {}
        for pos in range(len(flat) - 1, -1, -1):
            k = flat[pos]
            nxt[pos] = last.get(k, math.inf)
            last[k] = pos
            left[pos] = seen_after.get(k, 0)
            seen_after[k] = left[pos] + 1
        self.keys = keys
        self.tokens = tokens
        self.costs = costs
        self.total_cost = sum(sum(c) for c in costs)
        self.next_use = nxt
        self.uses_left = left
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
    attention_tokens: float = DEFAULT_ATTENTION_TOKENS,
    bypass_unreachable: bool = True,
) -> SimulationReport:
    """Replay ``requests`` for each policy (plus LRU and Belady) over tiers of the given
    capacities in blocks, fastest first, e.g. ``{"cpu": 1000}`` or ``{"cpu": 500, "disk": 5000}``.
    ``admission`` gates every tier below the first (``all`` or ``frequency``);
    ``attention_tokens`` sets the prefill cost model and ``bypass_unreachable`` whether blocks
    no lookup could reach are stored (see the module docstring)."""
    if not tiers:
        raise InvalidArgument("give at least one tier capacity")
    for name, cap in tiers.items():
        if cap < 1:
            raise InvalidArgument(f"tier {name!r} needs a capacity of at least one block")
    if admission not in ("all", "frequency"):
        raise InvalidArgument(f"unknown admission {admission!r}; choose all or frequency")
    chains = _Chains(requests, attention_tokens)
    report = SimulationReport(
        trace=trace_name,
        requests=len(requests),
        total_blocks=chains.total_blocks,
        total_tokens=chains.total_tokens,
        unique_blocks=chains.unique_blocks,
        tiers=dict(tiers),
        admission=admission,
        bypass_unreachable=bypass_unreachable,
    )
    for policy in policies_with_references(policies):
        report.results.append(
            _run_one(
                chains,
                requests,
                tiers,
                policy,
                admission,
                progress,
                bypass_unreachable=bypass_unreachable,
            )
        )
    return report


def simulate_policy(
    requests: Sequence[TraceRequest],
    *,
    tiers: Mapping[str, int],
    policy: str,
    admission: str = "all",
    on_request: RequestHook | None = None,
    progress: Progress | None = None,
    attention_tokens: float = DEFAULT_ATTENTION_TOKENS,
    bypass_unreachable: bool = True,
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
    chains = _Chains(requests, attention_tokens)
    return _run_one(
        chains, requests, tiers, policy, admission, progress, on_request,
        bypass_unreachable=bypass_unreachable,
    )  # fmt: skip


def replays_of(policy: str) -> int:
    """How many replays of the sequence running ``policy`` takes (``oracle-features`` records a
    first pass): what its progress counts, in units of the sequence's requests."""
    return 2 if policy == FeatureOraclePolicy.name else 1


def _run_one(
    chains: _Chains,
    requests: Sequence[TraceRequest],
    tiers: Mapping[str, int],
    policy: str,
    admission: str,
    progress: Progress | None,
    on_request: RequestHook | None = None,
    *,
    bypass_unreachable: bool = True,
) -> PolicyResult:
    started = time.perf_counter()
    next_use: dict[bytes, float] = {}
    future: dict[bytes, FutureUse] = {}
    recorded: dict[str, RecordingReuseModel] | None = None
    passes = 1
    if policy == FeatureOraclePolicy.name:
        # the recording pass: lineage-learned-arc's decisions, keeping its labelled samples
        recorded = {n: RecordingReuseModel() for n in tiers}
        rec = recorded
        _replay(
            chains,
            requests,
            tiers,
            lambda n: LineageLearnedARCPolicy(reuse_model=rec[n]),
            admission=admission,
            policy=policy,
            progress=progress,
            bypass_unreachable=bypass_unreachable,
            pass_index=0,
            passes=replays_of(policy),
        )
        passes = replays_of(policy)

    def make(name: str) -> EvictionPolicy:
        if policy == "belady":
            return BeladyPolicy(next_use)
        if policy == PopularityOraclePolicy.name:
            return PopularityOraclePolicy(future)
        if policy == ReuseOraclePolicy.name:
            return ReuseOraclePolicy(future, REUSE_HORIZON_FACTOR * tiers[name])
        if recorded is not None:
            return FeatureOraclePolicy(recorded[name].samples)
        return make_eviction_policy(policy)

    store, hit_blocks, hit_tokens, hit_cost, hits_by_tier, hit_tokens_by_tier = _replay(
        chains,
        requests,
        tiers,
        make,
        admission=admission,
        policy=policy,
        progress=progress,
        on_request=on_request,
        next_use=next_use,
        future=future if policy in (PopularityOraclePolicy.name, ReuseOraclePolicy.name) else None,
        bypass_unreachable=bypass_unreachable,
        pass_index=passes - 1,
        passes=passes,
    )
    seconds = time.perf_counter() - started
    return PolicyResult(
        policy=policy,
        hit_ratio=hit_blocks / chains.total_blocks if chains.total_blocks else 0.0,
        token_hit_ratio=hit_tokens / chains.total_tokens if chains.total_tokens else 0.0,
        hits_by_tier=hits_by_tier,
        hit_blocks=hit_blocks,
        hit_tokens=hit_tokens,
        seconds=seconds,
        hit_tokens_by_tier=hit_tokens_by_tier,
        prefill_hit_ratio=hit_cost / chains.total_cost if chains.total_cost else 0.0,
        decisions_per_second=chains.total_blocks / seconds if seconds > 0 else 0.0,
        evictions=sum(store.stats.tiers[n].evictions["capacity"] for n in tiers),
    )


def _replay(
    chains: _Chains,
    requests: Sequence[TraceRequest],
    tiers: Mapping[str, int],
    make: Callable[[str], EvictionPolicy],
    *,
    admission: str,
    policy: str,
    progress: Progress | None,
    on_request: RequestHook | None = None,
    next_use: dict[bytes, float] | None = None,
    future: dict[bytes, FutureUse] | None = None,
    bypass_unreachable: bool,
    pass_index: int = 0,
    passes: int = 1,
) -> tuple[TieredStore, int, int, float, dict[str, int], dict[str, int]]:
    """One replay of ``requests`` through tiers whose policies ``make`` builds: the store, hit
    blocks, hit tokens, hit prefill cost, and hit blocks and tokens per tier. ``next_use`` and
    ``future`` (None: not kept; Belady and the first two oracles read them) are updated just
    before each access; progress counts this pass as pass ``pass_index`` of ``passes`` of
    ``policy``'s run."""
    names = list(tiers)
    store = TieredStore(
        [MeteredTier(n, tiers[n]) for n in names],
        eviction={n: make(n) for n in names},
        admission={n: FrequencyAdmission() for n in names[1:]} if admission == "frequency" else {},
        clock=lambda: 0.0,  # a trace replay has no wall time; order comes from the tick
        bypass_unreachable=bypass_unreachable,
    )
    hit_blocks = hit_tokens = 0
    hit_cost = 0.0
    hits_by_tier = dict.fromkeys(names, 0)
    hit_tokens_by_tier = dict.fromkeys(names, 0)
    nxt = chains.next_use
    left = chains.uses_left
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
        hit_cost += sum(chains.costs[i][:m])
        for loc, t in zip(res.locations[:m], toks, strict=False):
            hits_by_tier[loc] += 1  # type: ignore[index]
            hit_tokens_by_tier[loc] += t  # type: ignore[index]
        if on_request is not None:
            on_request(i, res.locations[:m])  # type: ignore[arg-type]
        parent = None
        for depth, (k, t) in enumerate(zip(keys, toks, strict=True)):
            if next_use is not None:
                next_use[k] = nxt[pos]
            if future is not None:
                future[k] = FutureUse(nxt[pos] - pos, left[pos])
            pos += 1
            if k in store:
                store.touch(k, tenant=r.tenant)
            else:
                store.put(
                    k, None, size_bytes=1, tokens=t, tenant=r.tenant, parent=parent, depth=depth
                )
            parent = k
        if progress is not None and (i % step == 0 or i == total - 1):
            progress(policy, pass_index * total + i + 1, passes * total)
    return store, hit_blocks, hit_tokens, hit_cost, hits_by_tier, hit_tokens_by_tier
