"""The router's fast scoring (kvctl.router.score) against a straightforward reference.

The reference below plans every node the plain way: one ``Candidate`` per chunk, the shared
planner ``plan_fetch`` and a per-chunk walk of its plan (what ``score_nodes`` did before it
planned runs of chunks). On seeded random fleets, holdings, costs, queues and origins the
optimized ``score_nodes`` and ``decide`` must give exactly the same NodeScores (every float
bit for bit) and decisions, pruned and not.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence

from kvctl.index.model import Holding, owner
from kvctl.remote.fetchplan import (
    DEVICE_TIERS,
    AnyLink,
    Candidate,
    FetchPlan,
    LocalLink,
    PrefillModel,
    plan_fetch,
)
from kvctl.remote.links import Link
from kvctl.router.score import (
    DISK_READ_LATENCY_S,
    Costs,
    NodeScore,
    Pull,
    decide,
    decision_for,
    held_prefix,
    held_tokens,
    local_prefix,
    score_nodes,
)
from kvctl.router.topology import DcLink, Node, Topology

TIERS = ("gpu", "cpu", "disk")


# --- the reference: plan_fetch over one Candidate per chunk, for every planned node --------


def reference_scores(
    holdings: Sequence[Sequence[Holding]],
    *,
    tokens: int,
    chunk_tokens: int,
    topology: Topology,
    costs: Costs,
    origin_dc: str | None = None,
    queue_s: Mapping[str, float] | None = None,
    up: frozenset[str] | set[str] | None = None,
    prune: bool = False,
) -> list[NodeScore]:
    queue = queue_s or {}
    chain = list(holdings[: held_prefix(holdings)])
    device = LocalLink("device", 0.0, costs.host_to_device_bytes_per_s, "configured")
    if costs.host_to_device_bytes_per_s is None:
        device = LocalLink("device", 0.0, None, "unreported")
    sizes = [max(h.size_bytes for h in held) for held in chain]
    chunk_tokens_of = [max(held_tokens(h, chunk_tokens) for h in held) or chunk_tokens
                       for held in chain]  # fmt: skip
    floor_prefill_s = costs.prefill.seconds(min(tokens, sum(chunk_tokens_of)), tokens)
    bounded: list[tuple[float, str, Node, float]] = []
    for node in topology.nodes.values():
        if not node.serves or (up is not None and node.name not in up):
            continue
        origin_s = 0.0
        if origin_dc is not None:
            to_node = topology.link(origin_dc, node.dc)
            if to_node is None:
                continue
            origin_s = to_node.rtt_s
        floor_s = origin_s + 0.0 + floor_prefill_s + max(0.0, float(queue.get(node.name, 0.0)))
        carbon_g = _carbon_g(node, floor_prefill_s, costs)
        floor_s += costs.carbon_s_per_g * (carbon_g or 0.0)
        bounded.append((floor_s, node.name, node, origin_s))
    if prune:
        bounded.sort(key=lambda b: (b[0], b[1]))
    out: list[NodeScore] = []
    best_s = math.inf
    for floor_s, _, node, origin_s in bounded:
        if prune and floor_s > best_s:
            break
        plan, names = _reference_plan(chain, sizes, chunk_tokens_of, node, topology, costs, device)
        scored = _reference_score(
            node, plan, names, chain, sizes, chunk_tokens_of, tokens, costs, origin_s, queue
        )
        best_s = min(best_s, scored.score_s)
        out.append(scored)
    out.sort(key=lambda s: (s.score_s, -s.local_chunks, s.queue_s, s.node))
    return out


def _carbon_g(node: Node, prefill_s: float, costs: Costs) -> float | None:
    if node.carbon_g_per_kwh is None:
        return None
    return prefill_s * costs.prefill_watts * node.pue / 3.6e6 * node.carbon_g_per_kwh


def _reference_plan(
    chain: Sequence[Sequence[Holding]],
    sizes: Sequence[int],
    chunk_tokens_of: Sequence[int],
    node: Node,
    topology: Topology,
    costs: Costs,
    device: LocalLink,
) -> tuple[FetchPlan, dict[str, tuple[str, str]]]:
    links: dict[str, AnyLink] = {}
    names: dict[str, tuple[str, str]] = {}
    stages: dict[str, int] = {}
    candidates: list[Candidate] = []
    for i, held in enumerate(chain):
        found = (_reference_link(h, node, topology, costs, links, names, stages) for h in held)
        sources = tuple(name for name in found if name is not None)
        if not sources or sizes[i] <= 0:
            break
        candidates.append(Candidate(i, sizes[i], chunk_tokens_of[i], sources))
    plan = plan_fetch(
        candidates,
        links,
        costs.prefill,
        stages=stages,
        device=device,
        on_device=DEVICE_TIERS,
    )
    return plan, names


def _reference_link(
    h: Holding,
    node: Node,
    topology: Topology,
    costs: Costs,
    links: dict[str, AnyLink],
    names: dict[str, tuple[str, str]],
    stages: dict[str, int],
) -> str | None:
    if owner(h.node) == node.name:
        name = h.tier
        if h.tier in DEVICE_TIERS or h.tier == "cpu":
            kind = "host memory" if h.tier == "cpu" else "device"
            links.setdefault(name, LocalLink(name, 0.0, None, kind))
        else:
            links.setdefault(
                name,
                LocalLink(name, DISK_READ_LATENCY_S, costs.disk_read_bytes_per_s, "configured"),
            )
        names[name] = ("", h.tier)
        stages[name] = 1
        return name
    if h.engine_cache:
        return None
    holder = topology.nodes.get(h.node)
    if holder is None:
        return None
    dc_link = topology.link(node.dc, holder.dc)
    if dc_link is None:
        return None
    bw, rtt_s = dc_link.bandwidth_bytes_per_s, dc_link.rtt_s
    if h.tier not in DEVICE_TIERS and h.tier != "cpu":
        bw = min(bw, costs.disk_read_bytes_per_s)
        rtt_s += DISK_READ_LATENCY_S
    name = f"{h.node}/{h.tier}"
    basis = "measured" if dc_link.basis == "measured" else "configured"
    links[name] = Link(name, rtt_s, bw, basis)
    names[name] = (h.node, h.tier)
    stages[name] = 0
    return name


def _reference_score(
    node: Node,
    plan: FetchPlan,
    names: Mapping[str, tuple[str, str]],
    chain: Sequence[Sequence[Holding]],
    sizes: Sequence[int],
    chunk_tokens_of: Sequence[int],
    tokens: int,
    costs: Costs,
    origin_s: float,
    queue: Mapping[str, float],
) -> NodeScore:
    fetched_tokens = pulled_chunks = pulled_bytes = 0
    pulls: list[Pull] = []
    for index, link in plan.fetch:
        holder, tier = names[link]
        fetched_tokens += chunk_tokens_of[index]
        if holder:
            pulled_chunks += 1
            pulled_bytes += sizes[index]
        last = pulls[-1] if pulls else None
        if last is not None and (last.node, last.tier) == (holder, tier):
            pulls[-1] = Pull(
                last.first, last.chunks + 1, holder, tier, last.size_bytes + sizes[index]
            )
        else:
            pulls.append(Pull(index, 1, holder, tier, sizes[index]))
    fetched_tokens = min(fetched_tokens, tokens)
    prefill_s = costs.prefill.seconds(fetched_tokens, tokens)
    queue_s = max(0.0, float(queue.get(node.name, 0.0)))
    ttft_s = origin_s + plan.fetch_s + prefill_s + queue_s
    carbon_g = _carbon_g(node, prefill_s, costs)
    return NodeScore(
        node=node.name,
        dc=node.dc,
        local_chunks=local_prefix(chain, node.name),
        fetched_chunks=len(plan.fetch),
        fetched_tokens=fetched_tokens,
        pulled_chunks=pulled_chunks,
        pulled_bytes=pulled_bytes,
        origin_s=origin_s,
        fetch_s=plan.fetch_s,
        prefill_s=prefill_s,
        queue_s=queue_s,
        carbon_g=carbon_g,
        ttft_s=ttft_s,
        score_s=ttft_s + (costs.carbon_s_per_g * carbon_g if carbon_g else 0.0),
        pulls=tuple(pulls),
        reason=plan.reason,
        links=plan.links,
    )


# --- random fleets ---------------------------------------------------------------------------


def random_case(rng: random.Random) -> tuple[list[list[Holding]], dict[str, object]]:
    """A fleet, a chain's holdings and the request's figures, drawn from ``rng``: several DCs
    (some pairs unlinked), pool agents, engine caches, holders the topology does not know,
    chunks of odd sizes and tokens (0 included), runs of chunks with the same holders."""
    dcs = [f"dc{i}" for i in range(rng.randint(1, 4))]
    nodes = [
        Node(
            f"n{i}",
            rng.choice(dcs),
            carbon_g_per_kwh=rng.choice([None, 50.0, 400.0]),
            pue=rng.choice([1.0, 1.3]),
            serves=rng.random() > 0.15,
        )
        for i in range(rng.randint(1, 12))
    ]
    links: dict[tuple[str, str], DcLink] = {}
    for a in range(len(dcs)):
        for b in range(a + 1, len(dcs)):
            if rng.random() < 0.85:
                km = rng.choice([10.0, 100.0, 1500.0, 6000.0])
                bw = rng.choice([1.25e9, 12.5e9, 50e9])
                link = (
                    DcLink.fiber(km, bandwidth_bytes_per_s=bw)
                    if rng.random() < 0.7
                    else DcLink(km * 1e-5, bw, "measured")
                )
                links[(dcs[a], dcs[b])] = link
    topology = Topology.build(nodes, links)
    names = [n.name for n in nodes] + ["ghost"]  # a holder the topology does not know
    holder_names = names + [f"{n.name}#vllm" for n in nodes[:3]]
    chunk_tokens = rng.choice([16, 256, 512])
    kv_bytes_per_token = rng.choice([1, 131_072])
    holdings: list[list[Holding]] = []
    current: list[Holding] = []
    for _ in range(rng.randint(0, 120)):
        if not current or rng.random() < 0.15:  # a new run of holders
            picked = sorted(rng.sample(holder_names, rng.randint(0, min(4, len(holder_names)))))
            current = [Holding(n, rng.choice(TIERS), 0, 0) for n in picked]
        tokens_of = chunk_tokens if rng.random() < 0.9 else rng.choice([0, 1, chunk_tokens // 2])
        size = tokens_of * kv_bytes_per_token if rng.random() < 0.97 else 0
        held = [Holding(h.node, h.tier, size, tokens_of) for h in current]
        if held and rng.random() < 0.1:  # holders disagree on the figures: the largest counts
            held[0] = Holding(held[0].node, held[0].tier, size + 7, tokens_of + 1)
        holdings.append(held)
    prefill = PrefillModel(
        rng.choice([2e-5, 1e-4, 1e-3]), rng.choice([0.0, 0.0, 1e-9, 3e-8]), "configured: test"
    )
    costs = Costs(
        prefill,
        host_to_device_bytes_per_s=rng.choice([None, 25e9, 50e9]),
        disk_read_bytes_per_s=rng.choice([1e9, 3e9, 20e9]),
        carbon_s_per_g=rng.choice([0.0, 0.0, 0.5, 20.0]),
    )
    queue = {n.name: rng.choice([0.0, 0.0, 0.001, 0.05, 1.0, -1.0]) for n in nodes}
    up = None if rng.random() < 0.7 else {n.name for n in nodes if rng.random() < 0.8}
    request: dict[str, object] = {
        "tokens": sum(h[0].tokens if h else chunk_tokens for h in holdings)
        + rng.choice([0, 0, 17, -5]),
        "chunk_tokens": chunk_tokens,
        "topology": topology,
        "costs": costs,
        "origin_dc": rng.choice([*dcs, None]),
        "queue_s": queue if rng.random() < 0.8 else None,
        "up": up,
    }
    request["tokens"] = max(0, request["tokens"])  # type: ignore[call-overload]
    return holdings, request


def test_fast_scoring_equals_the_reference_on_random_fleets() -> None:
    rng = random.Random(24)
    planned = pruned_fewer = 0
    seen: Counter[str] = Counter()
    for _ in range(600):
        holdings, request = random_case(rng)
        full = score_nodes(holdings, **request)  # type: ignore[arg-type]
        assert full == reference_scores(holdings, **request)  # type: ignore[arg-type]
        pruned = score_nodes(holdings, prune=True, **request)  # type: ignore[arg-type]
        want = reference_scores(holdings, prune=True, **request)  # type: ignore[arg-type]
        assert pruned == want
        planned += len(full)
        pruned_fewer += len(pruned) < len(full)
        for s in full:
            seen[s.reason] += 1
            seen["pulls from two places"] += len(s.pulls) > 1
            seen["local and pulled"] += len({p.node == "" for p in s.pulls}) == 2
        decided = decide(holdings, **request)  # type: ignore[arg-type]
        if want:
            expected = decision_for(
                want[0], want, holdings, tokens=request["tokens"], costs=request["costs"]
            )  # type: ignore[arg-type]
            assert decided == expected
            assert decided is not None and decided.as_dict(explain=True) == expected.as_dict(
                explain=True
            )
        else:
            assert decided is None
    # the cases exercise what they are meant to: every kind of plan, pruning that skips nodes
    assert planned > 1000 and pruned_fewer > 50
    assert min(seen.values()) > 50 and len(seen) == 5, seen


def test_long_chains_with_few_holder_sets_equal_the_reference() -> None:
    # the bench's shape: hundreds of chunks, two or three holder runs, nine nodes in 3 DCs
    rng = random.Random(5)
    nodes = [Node(f"dc{i % 3}-n{i // 3}", f"dc{i % 3}") for i in range(9)]
    topology = Topology.build(
        nodes,
        {
            ("dc0", "dc1"): DcLink.fiber(100),
            ("dc0", "dc2"): DcLink.fiber(1500),
            ("dc1", "dc2"): DcLink.fiber(1500),
        },
    )
    costs = Costs(PrefillModel(6e-5, 2e-9, "configured: test"), host_to_device_bytes_per_s=50e9)
    for _ in range(30):
        chunks = rng.randint(100, 300)
        holdings: list[list[Holding]] = []
        cut = sorted(rng.sample(range(1, chunks), 2))
        for i in range(chunks):
            run = 0 if i < cut[0] else 1 if i < cut[1] else 2
            held = [
                Holding(n.name, TIERS[(run + j) % 3], 512 * 131_072, 512)
                for j, n in enumerate(nodes)
                if (j + run) % 4 == 0
            ]
            holdings.append(held)
        request: dict[str, object] = {
            "tokens": chunks * 512 - rng.randint(0, 511),
            "chunk_tokens": 512,
            "topology": topology,
            "costs": costs,
            "origin_dc": rng.choice(["dc0", "dc1", "dc2"]),
            "queue_s": {n.name: rng.choice([0.0, 0.01, 0.2]) for n in nodes},
        }
        for prune in (False, True):
            got = score_nodes(holdings, prune=prune, **request)  # type: ignore[arg-type]
            assert got == reference_scores(holdings, prune=prune, **request)  # type: ignore[arg-type]


def test_the_index_answers_from_its_cache_as_it_would_without_it() -> None:
    # EmbeddedIndex keeps each looked-up key's answer until an event changes the key (the
    # event streams of test_fleet_index check every op); a caller changing an answer's list
    # does not change the next answer
    from kvctl.index.events import ChunkEvent
    from kvctl.index.model import EmbeddedIndex

    index = EmbeddedIndex()
    ks = [bytes([i]) * 16 for i in range(3)]
    index.apply("b", [ChunkEvent("stored", k, "cpu", "t", False, 100, 16) for k in ks])
    index.apply("a", [ChunkEvent("stored", ks[0], "disk", "u", True, 100, 16)])
    first = index.holders(ks, tenant="t")
    assert first == [[Holding("b", "cpu", 100, 16)]] * 3
    first[0].clear()
    assert index.holders(ks, tenant="u")[0] == [
        Holding("a", "disk", 100, 16),
        Holding("b", "cpu", 100, 16),
    ]
    assert index.holders(ks, tenant="t") == [[Holding("b", "cpu", 100, 16)]] * 3
    index.apply("b", [ChunkEvent("removed", ks[1], "cpu")])
    index.replace("a", [ChunkEvent("stored", ks[2], "gpu", "t", False, 100, 16)])
    assert index.holders(ks, tenant="t") == [
        [Holding("b", "cpu", 100, 16)],
        [],
        [Holding("a", "gpu", 100, 16), Holding("b", "cpu", 100, 16)],
    ]
