"""Fetch-or-recompute over a chain: hand-built link figures, overrides, and a brute-force check."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.errors import InvalidArgument
from kvctl.profiles import GPUProfile, ModeledInputs, ModelProfile
from kvctl.remote.fetchplan import Candidate, FetchPlan, PrefillRate, plan_fetch
from kvctl.remote.links import Link

# 1,000 prefill tokens/s: a 100-token chunk takes 0.1 s to recompute
PREFILL = PrefillRate(1000.0, "configured")


def link(name: str, rtt_s: float | None, bandwidth: float | None, **kw: object) -> Link:
    source = "default" if rtt_s is None or bandwidth is None else "configured"
    return Link(name, rtt_s, bandwidth, source, **kw)  # type: ignore[arg-type]


def links_of(*items: Link) -> dict[str, Link]:
    return {item.name: item for item in items}


def chain(
    sources: Sequence[Sequence[str]], *, size_bytes: int = 1000, tokens: int = 100, start: int = 0
) -> list[Candidate]:
    return [
        Candidate(start + i, size_bytes, tokens, tuple(names)) for i, names in enumerate(sources)
    ]


def test_single_chunk_at_the_boundary_of_the_design_rule() -> None:
    # rtt 0.05 s + size / 1 MB/s against 100 tokens / 1,000 tokens/s = 0.1 s
    links = links_of(link("pool", 0.05, 1e6))
    below = plan_fetch(chain([["pool"]], size_bytes=49_999, start=7), links, PREFILL)
    assert below.fetch == ((7, "pool"),) and below.reason == "fetch" and below.recompute == 0
    assert below.fetch_s == pytest.approx(0.099999)
    assert below.recompute_s == pytest.approx(0.1)
    assert below.saved_s == pytest.approx(1e-6)
    above = plan_fetch(chain([["pool"]], size_bytes=50_001), links, PREFILL)
    assert above.fetch == () and above.reason == "slower-than-recompute" and above.recompute == 1
    assert (above.fetch_s, above.recompute_s, above.saved_s) == (0.0, 0.0, 0.0)
    # equal is not faster: the design's inequality is strict
    equal = plan_fetch(chain([["pool"]], size_bytes=50_000), links, PREFILL)
    assert equal.fetch == ()


def test_rtt_is_amortised_over_a_batch() -> None:
    # 0.1 s RTT, fast link; each chunk recomputes in 0.05 s: one is not worth the round trip
    links = links_of(link("peer:dc2/n1", 0.1, 1e9))
    one = plan_fetch(chain([["peer:dc2/n1"]], tokens=50), links, PREFILL)
    assert one.fetch == () and one.reason == "slower-than-recompute"
    eight = plan_fetch(chain([["peer:dc2/n1"]] * 8, tokens=50), links, PREFILL)
    assert eight.fetched_indices == tuple(range(8)) and eight.reason == "fetch"
    assert eight.fetch_s == pytest.approx(0.1 + 8000 / 1e9)
    assert eight.recompute_s == pytest.approx(0.4)
    assert eight.per_link_bytes == {"peer:dc2/n1": 8000}


def test_two_links_run_in_parallel() -> None:
    # each link: 0.1 s + 4 x 0.1 s = 0.5 s; parallel 0.5 s < 0.8 s recompute (a sum, 1.0 s, is not)
    links = links_of(link("pool", 0.1, 1e6), link("peer:dc2/n1", 0.1, 1e6))
    names = [["pool"] if i % 2 == 0 else ["peer:dc2/n1"] for i in range(8)]
    plan = plan_fetch(chain(names, size_bytes=100_000), links, PREFILL)
    assert plan.fetched_indices == tuple(range(8))
    assert plan.fetch_s == pytest.approx(0.5)
    assert plan.saved_s == pytest.approx(0.3)
    assert plan.per_link_bytes == {"pool": 400_000, "peer:dc2/n1": 400_000}
    assert plan.per_link_s == pytest.approx({"pool": 0.5, "peer:dc2/n1": 0.5})


def test_each_chunk_comes_from_its_fastest_source() -> None:
    # transfer time decides, not the RTT: 1 MB at 100 MB/s beats 1 MB at 1 MB/s despite the RTT
    links = links_of(link("slow", 0.001, 1e6), link("fast", 0.05, 1e8))
    plan = plan_fetch(
        chain([["slow", "fast"], ["slow"]], size_bytes=1_000_000, tokens=2000), links, PREFILL
    )
    assert plan.fetch == ((0, "fast"), (1, "slow"))
    assert plan.fetch_s == pytest.approx(max(0.05 + 0.01, 0.001 + 1.0))
    # equal bandwidth: the smaller RTT, then the name
    tie = links_of(link("b", 0.01, 1e8), link("a", 0.01, 1e8), link("c", 0.02, 1e8))
    assert plan_fetch(chain([["c", "b", "a"]]), tie, PREFILL).fetch == ((0, "a"),)
    assert plan_fetch(chain([["c", "b"]]), tie, PREFILL).fetch == ((0, "b"),)


def test_the_chain_breaks_at_a_chunk_with_no_source() -> None:
    links = links_of(link("pool", 0.001, 1e9))
    # chunk 2 is nowhere, chunk 3 is named on a link nobody knows: neither can be used, nor
    # chunk 4 after them (KV is only reusable for an exact prefix)
    candidates = chain([["pool"], ["pool"], [], ["peer:dc9/x"], ["pool"]], start=10)
    plan = plan_fetch(candidates, links, PREFILL)
    assert plan.fetched_indices == (10, 11) and plan.recompute == 3
    assert plan.usable == 2 and plan.stopped_by == "no-source" and plan.reason == "fetch"
    nothing = plan_fetch(chain([[], ["pool"]]), links, PREFILL)
    assert nothing.fetch == () and nothing.reason == "no-source" and nothing.usable == 0
    assert plan_fetch([], links, PREFILL).reason == "no-candidates"


def test_override_recompute_excludes_a_link() -> None:
    links = links_of(link("pool", 0.001, 1e9, override="recompute"), link("peer", 0.002, 1e8))
    # the fastest link is refused: the peer serves the chunk instead
    plan = plan_fetch(chain([["pool", "peer"], ["pool"]]), links, PREFILL)
    assert plan.fetch == ((0, "peer"),) and plan.stopped_by == "override"
    only = plan_fetch(chain([["pool"]]), links, PREFILL)
    assert only.fetch == () and only.reason == "override" and only.recompute == 1


def test_override_fetch_forces_a_slow_link() -> None:
    # 1 s RTT against 0.1 s of recompute a chunk: never worth it, but the operator says fetch
    links = links_of(link("peer", 1.0, 1e6, override="fetch"))
    plan = plan_fetch(chain([["peer"]] * 3), links, PREFILL)
    assert plan.fetched_indices == (0, 1, 2) and plan.reason == "override"
    assert plan.saved_s == pytest.approx(0.3 - (1.0 + 3000 / 1e6))
    assert plan.saved_s < 0


def test_override_fetch_on_leading_chunks_is_a_floor() -> None:
    links = links_of(
        link("forced", 1.0, 1e9, override="fetch"),
        link("slow", 5.0, 1e9),
        link("fast", 0.0, 1e9),
    )
    # the forced chunks are fetched; the slow link's chunk would only lose more time
    floor = plan_fetch(chain([["forced"]] * 2 + [["slow"]]), links, PREFILL)
    assert floor.fetched_indices == (0, 1) and floor.reason == "override" and floor.recompute == 1
    # past the floor, the planner extends where that saves more than stopping there
    extended = plan_fetch(chain([["forced"]] * 2 + [["fast"]] * 3), links, PREFILL)
    assert extended.fetched_indices == (0, 1, 2, 3, 4) and extended.reason == "fetch"


def test_unknown_links_are_not_costed() -> None:
    unknown = link("peer", None, None)
    plan = plan_fetch(chain([["peer"]] * 4), links_of(unknown), PREFILL)
    assert plan.fetch == () and plan.reason == "unknown-link" and plan.usable == 0
    assert plan.links["peer"]["source"] == "default" and plan.links["peer"]["costed"] is False
    # half known is still not costed
    half = link("peer", 0.01, None)
    assert plan_fetch(chain([["peer"]]), links_of(half), PREFILL).reason == "unknown-link"
    # forced, it is used and counts 0 s, flagged
    forced = link("peer", None, None, override="fetch")
    plan = plan_fetch(chain([["peer"]] * 2), links_of(forced), PREFILL)
    assert plan.fetched_indices == (0, 1) and plan.reason == "override"
    assert plan.fetch_s == 0.0 and plan.uncosted_links == ("peer",)
    assert plan.per_link_s == {"peer": 0.0}
    # but a costed source is preferred where one serves the chunk: its cost can be compared
    both = links_of(forced, link("pool", 0.5, 1e9))
    plan = plan_fetch(chain([["peer", "pool"]] * 8), both, PREFILL)
    assert {name for _, name in plan.fetch} == {"pool"} and plan.uncosted_links == ()


def test_k_stops_where_the_saving_peaks() -> None:
    # four chunks on a near link, then two that only a 1 s peer holds
    links = links_of(link("pool", 0.01, 1e9), link("peer:dc3/n2", 1.0, 1e9))
    names = [["pool"]] * 4 + [["peer:dc3/n2"]] * 2
    plan = plan_fetch(chain(names), links, PREFILL)
    assert plan.fetched_indices == (0, 1, 2, 3) and plan.recompute == 2 and plan.usable == 6
    assert plan.saved_s == pytest.approx(0.4 - (0.01 + 4000 / 1e9))
    assert "peer:dc3/n2" not in plan.per_link_bytes and "peer:dc3/n2" in plan.links


def test_ties_prefer_the_longer_prefix() -> None:
    links = links_of(link("pool", 0.01, 1e9))
    # the second chunk costs nothing either way: same saving, take it
    candidates = [Candidate(0, 1000, 100, ("pool",)), Candidate(1, 0, 0, ("pool",))]
    assert plan_fetch(candidates, links, PREFILL).fetched_indices == (0, 1)


def test_as_dict_is_json_ready_and_shows_the_inputs() -> None:
    links = links_of(Link("peer:dc2/n1", 0.02, 1e8, "measured", emulated_delay_s=0.02))
    plan = plan_fetch(chain([["peer:dc2/n1"]] * 3), links, PREFILL)
    shown = json.loads(json.dumps(plan.as_dict()))
    assert shown["fetch"] == [{"index": i, "link": "peer:dc2/n1"} for i in range(3)]
    assert shown["links"]["peer:dc2/n1"]["rtt_basis"] == "emulated"
    prefill = shown["prefill"]
    assert prefill["tokens_per_s"] == 1000.0 and prefill["basis"] == "configured"
    assert prefill["beta_s_per_token2"] == 0.0 and prefill["kind"] == "configured"
    assert shown["reason"] == "fetch" and shown["per_link_bytes"] == {"peer:dc2/n1": 3000}


def test_prefill_rate_from_a_model_and_its_validation() -> None:
    toy = ModeledInputs(
        ModelProfile("toy", layers=1, kv_heads=1, head_dim=250, params=5e8),
        GPUProfile("toy-gpu", peak_bf16_tflops=1.0, board_power_watts=100.0),
        mfu=0.5,
    )
    rate = PrefillRate.modeled(toy)
    assert rate.tokens_per_s == pytest.approx(500.0)
    assert rate.basis == "modeled: toy on toy-gpu at MFU 0.5"
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument):
            PrefillRate(bad, "configured")


def test_input_validation() -> None:
    links = links_of(link("pool", 0.01, 1e9))
    with pytest.raises(InvalidArgument, match="consecutive"):
        plan_fetch([Candidate(0, 1, 1, ("pool",)), Candidate(2, 1, 1, ("pool",))], links, PREFILL)
    with pytest.raises(InvalidArgument, match="filed under"):
        plan_fetch(chain([["pool"]]), {"other": links["pool"]}, PREFILL)
    with pytest.raises(InvalidArgument):
        Candidate(0, -1, 1, ("pool",))
    with pytest.raises(InvalidArgument):
        Candidate(0, 1, 1, "pool")  # type: ignore[arg-type]
    assert Candidate(0, 1, 1, ["pool"]).sources == ("pool",)  # type: ignore[arg-type]


# --- brute force -----------------------------------------------------------------------------


def brute_force(
    candidates: Sequence[Candidate], links: Mapping[str, Link], prefill: PrefillRate
) -> tuple[list[str], list[float]]:
    """Each usable chunk's source (the same rule, written plainly) and saved_s for every k."""
    chosen: list[str] = []
    for c in candidates:
        usable = [links[n] for n in c.sources if n in links]
        if not usable:
            break
        best = min(
            usable, key=lambda lk: (c.size_bytes / lk.bandwidth_bytes_per_s, lk.rtt_s, lk.name)
        )
        chosen.append(best.name)
    saved = [0.0]
    for k in range(1, len(chosen) + 1):
        per_link: dict[str, int] = {}
        for c, name in zip(candidates[:k], chosen[:k], strict=True):
            per_link[name] = per_link.get(name, 0) + c.size_bytes
        fetch_s = max(
            links[n].rtt_s + b / links[n].bandwidth_bytes_per_s for n, b in per_link.items()
        )
        saved.append(sum(c.tokens for c in candidates[:k]) / prefill.tokens_per_s - fetch_s)
    return chosen, saved


NAMES = ("pool", "peer:dc2/n1", "peer:dc3/n7")


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Candidate], dict[str, Link], PrefillRate]:
    links = {
        name: Link(
            name,
            draw(st.floats(0.0, 0.5)),
            draw(st.floats(1e5, 1e10)),
            "measured",
        )
        for name in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    }
    n = draw(st.integers(0, 12))
    start = draw(st.integers(0, 100))
    candidates = [
        Candidate(
            start + i,
            draw(st.integers(0, 4_000_000)),
            draw(st.integers(0, 4096)),
            tuple(draw(st.lists(st.sampled_from(NAMES), max_size=3, unique=True))),
        )
        for i in range(n)
    ]
    prefill = PrefillRate(draw(st.floats(100.0, 1e5)), "configured")
    return candidates, links, prefill


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_the_plan_saves_at_least_as_much_as_any_other_prefix(
    scenario: tuple[list[Candidate], dict[str, Link], PrefillRate],
) -> None:
    candidates, links, prefill = scenario
    plan: FetchPlan = plan_fetch(candidates, links, prefill)
    chosen, saved = brute_force(candidates, links, prefill)
    k = len(plan.fetch)
    # always a prefix of the candidates, each chunk from the chosen source
    assert plan.fetch == tuple(
        (c.index, n) for c, n in zip(candidates[:k], chosen[:k], strict=True)
    )
    assert plan.recompute == len(candidates) - k and plan.usable == len(chosen)
    tolerance = 1e-9 * (1 + max(abs(s) for s in saved))
    assert plan.saved_s == pytest.approx(saved[k], abs=tolerance)
    assert all(plan.saved_s >= other - tolerance for other in saved)
    assert k == 0 or plan.saved_s > 0
    if k == 1:  # one chunk: the design's inequality
        lk, c = links[plan.fetch[0][1]], candidates[0]
        assert (
            lk.rtt_s + c.size_bytes / lk.bandwidth_bytes_per_s
            < c.tokens / prefill.tokens_per_s + tolerance
        )
