"""`kvctl plan`'s library: the transfer model, fetch-or-recompute, hand-checked plans, the curve."""

from __future__ import annotations

import itertools
import json

import pytest

from kvctl.errors import InvalidArgument
from kvctl.profiles import (
    FIBER_SECONDS_PER_KM,
    GPUProfile,
    ModeledInputs,
    ModelProfile,
    gpu_profile,
    model_profile,
)
from kvctl.workload.builtin import builtin_workload
from kvctl.workload.plan import (
    DEFAULT_TRANSFERS,
    TierCost,
    TransferModel,
    curve_capacities,
    lru_hits_by_capacity,
    plan,
)
from kvctl.workload.simulate import simulate, simulate_policy
from kvctl.workload.trace import TraceRequest

# A toy profile with round numbers: 1 x 1 x 250 x 2 (K, V) x 2 bytes = 1,000 KV bytes per token;
# 2 x 5e8 FLOPs per token on 1 TFLOP/s at MFU 1 = 1,000 prefill tokens/s (1 ms a token), 100 W.
TOY = ModeledInputs(
    ModelProfile("toy", layers=1, kv_heads=1, head_dim=250, params=5e8),
    GPUProfile("toy-gpu", peak_bf16_tflops=1.0, board_power_watts=100.0),
    mfu=1.0,
)
BLOCK = 4  # tokens per block in the hand-built traces: 4,000 bytes, 4 ms to recompute
# cpu: 4 MB/s, no latency -> 1 ms a block; disk: 2 MB/s + 1 ms -> 3 ms; remote: 4 MB/s + 0.5 ms
TOY_TRANSFERS = {
    "cpu": TransferModel("cpu", 4e6, 0.0),
    "disk": TransferModel("disk", 2e6, 1e-3),
    "remote": TransferModel("remote", 4e6, 0.5e-3),
}


def req(*ids: int, tokens: int | None = None, block: int = BLOCK) -> TraceRequest:
    n = tokens if tokens is not None else block * len(ids)
    return TraceRequest(0, n, 1, tuple(ids), block_tokens=block)


# --- the transfer model and fetch-or-recompute --------------------------------------------------


def test_toy_profile_is_what_the_numbers_below_assume() -> None:
    assert TOY.model.kv_bytes_per_token == 1000
    assert TOY.prefill_tokens_per_second == pytest.approx(1000)
    assert TOY.prefill_joules(28) == pytest.approx(2.8)


def test_transfer_model_by_hand() -> None:
    remote = DEFAULT_TRANSFERS["remote"].at_distance(100)
    # 50 us + 2 x 5 us/km x 100 km of fiber, then 64 MiB at 12.5 GB/s
    assert FIBER_SECONDS_PER_KM == 5e-6
    assert remote.fiber_rtt_seconds == pytest.approx(1e-3)
    assert remote.rtt_seconds == pytest.approx(1.05e-3)
    assert remote.fetch_seconds(64 * 2**20) == pytest.approx(1.05e-3 + 67_108_864 / 12.5e9)
    assert DEFAULT_TRANSFERS["cpu"].fetch_seconds(25e9) == pytest.approx(1 + 10e-6)
    assert DEFAULT_TRANSFERS["disk"].fetch_seconds(5e6) == pytest.approx(1e-3 + 100e-6)
    d = remote.as_dict()
    assert d["basis"] == "modeled" and d["bandwidth_bytes_per_second"] == 12.5e9
    assert d["distance_km"] == 100 and d["latency_seconds"] == 50e-6
    with pytest.raises(InvalidArgument, match="distance"):
        TransferModel("remote", 1e9, 0.0, distance_km=-1)
    with pytest.raises(InvalidArgument, match="bandwidth"):
        TransferModel("remote", 0, 0.0)


def test_fetch_or_recompute_by_hand() -> None:
    # 100 tokens: recompute 0.1 s. At 1 MB/s + 10 ms: fetch 0.01 + 0.1 = 0.11 s -> recompute.
    slow = TierCost(TransferModel("x", 1e6, 0.01), TOY)
    assert slow.recompute_seconds(100) == pytest.approx(0.1)
    assert slow.fetch_seconds(100) == pytest.approx(0.11)
    assert not slow.fetches(100)
    assert slow.chunk_seconds(100) == pytest.approx(0.1)
    # At 2 MB/s: 0.01 + 0.05 = 0.06 s -> fetch; 0.04 s to spare = 4,000 km of fiber round trip
    fast = TierCost(TransferModel("x", 2e6, 0.01), TOY)
    assert fast.fetch_seconds(100) == pytest.approx(0.06)
    assert fast.fetches(100) and fast.chunk_seconds(100) == pytest.approx(0.06)
    assert fast.max_distance_km(100) == pytest.approx(4000)
    assert TierCost(fast.transfer.at_distance(3999), TOY).fetches(100)
    assert not TierCost(fast.transfer.at_distance(4001), TOY).fetches(100)
    # a small (partial) chunk is dominated by latency: 1 token = 10.5 ms to fetch, 1 ms to compute
    assert not fast.fetches(1)
    assert slow.max_distance_km(100) == 0.0


def test_real_profiles_llama_8b_on_h100() -> None:
    inputs = ModeledInputs(model_profile("llama-3.1-8b"), gpu_profile("h100"), 0.5)
    remote = TierCost(DEFAULT_TRANSFERS["remote"], inputs)
    block_bytes = 512 * 131_072
    rate = 989e12 * 0.5 / (2 * 8.03e9)
    assert remote.recompute_seconds(512) == pytest.approx(512 / rate)
    assert remote.fetch_seconds(512) == pytest.approx(50e-6 + block_bytes / 12.5e9)
    assert remote.fetches(512)
    # the pool stays worth it until the fiber eats the ~11 ms to spare: ~1,100 km
    spare = 512 / rate - 50e-6 - block_bytes / 12.5e9
    assert remote.max_distance_km(512) == pytest.approx(spare / 1e-5)
    assert 1000 < remote.max_distance_km(512) < 1200


# --- plan on hand-built traces ------------------------------------------------------------------

# r0 misses 1, 2; r1 hits both in cpu; r2's block 3 evicts 1 (LRU); r3 looks up 1, 2.
HAND = [req(1, 2), req(1, 2), req(3), req(1, 2)]


def _plan(trace, transfers=TOY_TRANSFERS, **kw):  # type: ignore[no-untyped-def]
    args = {
        "tiers_bytes": {"cpu": 2 * BLOCK * 1000, "disk": 2 * BLOCK * 1000},
        "inputs": TOY,
        "distances_km": (),
        "policy": "lru",
        "curve_points": 0,
        "transfers": transfers,
    }
    return plan(trace, **{**args, **kw})


def test_plan_by_hand() -> None:
    report = _plan(HAND)
    assert report.tiers_blocks == {"cpu": 2, "disk": 2}
    assert report.block_bytes == 4000
    # no cache: 8, 8, 4 and 8 tokens at 1 ms each
    base = report.baseline
    assert base.mean_ttft_seconds == pytest.approx(7e-3)
    assert base.p50_ttft_seconds == pytest.approx(8e-3)  # nearest rank of [4, 8, 8, 8]
    assert base.p99_ttft_seconds == pytest.approx(8e-3)
    assert base.prefill_tokens == 28 and base.prefill_joules == pytest.approx(2.8)

    cpu = report.candidate("cpu")
    # cpu alone: r1 hits 2 blocks; r3 misses block 1 (evicted), so block 2 is past the prefix
    assert cpu.hit_ratio == pytest.approx(2 / 7)
    assert cpu.token_hit_ratio == pytest.approx(8 / 28)
    assert cpu.hits_by_tier == {"cpu": 2}
    # TTFT: 8 ms; 2 x 1 ms cpu fetches; 4 ms; 8 ms -> mean 5.5 ms, p50 4 ms, p99 8 ms
    assert cpu.ttft.mean_ttft_seconds == pytest.approx(5.5e-3)
    assert cpu.ttft.p50_ttft_seconds == pytest.approx(4e-3)
    assert cpu.ttft.p99_ttft_seconds == pytest.approx(8e-3)
    assert cpu.ttft.prefill_tokens == 20
    assert cpu.ttft.prefill_joules == pytest.approx(2.0)
    assert cpu.mean_ttft_saved_ratio == pytest.approx(1.5 / 7)
    assert cpu.prefill_joules_saved == pytest.approx(0.8)

    both = report.candidate("cpu+disk")
    # block 1 is demoted to disk instead of dropped, so r3 hits 1 (disk) and 2 (cpu)
    assert both.hit_ratio == pytest.approx(4 / 7)
    assert both.hits_by_tier == {"cpu": 3, "disk": 1}
    assert both.hit_tokens_by_tier == {"cpu": 12, "disk": 4}
    assert both.hit_ratio_by_tier == {"cpu": pytest.approx(3 / 7), "disk": pytest.approx(1 / 7)}
    # r3: 3 ms from disk + 1 ms from cpu -> TTFTs 8, 2, 4, 4 ms
    assert both.ttft.mean_ttft_seconds == pytest.approx(4.5e-3)
    assert both.fetched_tokens_by_tier == {"cpu": 12, "disk": 4}
    assert both.recomputed_hit_tokens_by_tier == {"cpu": 0, "disk": 0}
    assert both.not_worth_fetching == ()
    assert both.ttft.prefill_joules == pytest.approx(1.2)


def test_a_tier_slower_than_recompute_is_not_fetched_from() -> None:
    # disk at 2 MB/s + 3 ms: 5 ms a block > 4 ms to recompute it
    transfers = {**TOY_TRANSFERS, "disk": TransferModel("disk", 2e6, 3e-3)}
    both = _plan(HAND, transfers).candidate("cpu+disk")
    assert both.hit_ratio == pytest.approx(4 / 7)  # the cache holds it all the same
    assert both.not_worth_fetching == ("disk",)
    assert both.recomputed_hit_tokens_by_tier == {"cpu": 0, "disk": 4}
    assert both.fetched_tokens_by_tier == {"cpu": 12, "disk": 0}
    # r3: block 1 recomputed (4 ms) + block 2 from cpu (1 ms) -> TTFTs 8, 2, 4, 5 ms
    assert both.ttft.mean_ttft_seconds == pytest.approx(4.75e-3)
    assert both.ttft.prefill_tokens == 16


def test_partial_chunks_apply_the_rule_per_chunk() -> None:
    # the last block holds 1 token: from disk that is 1 ms + 0.5 ms > 1 ms to recompute
    trace = [req(1, 2, tokens=5), req(3), req(4), req(1, 2, tokens=5)]
    transfers = {**TOY_TRANSFERS, "cpu": TransferModel("cpu", 4e6, 0.0)}
    report = _plan(trace, transfers, tiers_bytes={"cpu": 8000, "disk": 8000})
    both = report.candidate("cpu+disk")
    # r1 (3) and r2 (4) push 1 and 2 down to disk; r3 hits both there
    assert both.hits_by_tier == {"cpu": 0, "disk": 2}
    assert both.fetched_tokens_by_tier["disk"] == 4
    assert both.recomputed_hit_tokens_by_tier["disk"] == 1
    assert both.not_worth_fetching == ()  # a full block is still worth fetching
    # r3: 3 ms (block 1 from disk) + 1 ms (recompute the 1-token block)
    ttfts = [5e-3, 4e-3, 4e-3, 4e-3]
    assert both.ttft.mean_ttft_seconds == pytest.approx(sum(ttfts) / 4)


def test_remote_distance_candidates_share_one_replay() -> None:
    report = plan(
        builtin_workload(seed=2, requests=300),
        tiers_bytes={"cpu": 40 * 4000 * 128, "disk": 200 * 4000 * 128, "remote": 10**12},
        inputs=TOY,
        distances_km=(0, 100, 10, 100),  # 0 is the same-DC candidate; repeats are dropped
        policy="lru",
        curve_points=0,
    )
    names = [c.candidate.name for c in report.candidates]
    assert names == [
        "cpu", "cpu+disk", "cpu+disk+remote", "cpu+disk+remote@100km", "cpu+disk+remote@10km",
    ]  # fmt: skip
    same = report.candidate("cpu+disk+remote")
    far = report.candidate("cpu+disk+remote@100km")
    assert far.hits_by_tier == same.hits_by_tier and far.candidate.distance_km == 100
    assert far.tier_costs["remote"].transfer.distance_km == 100
    assert far.tier_costs["disk"].transfer.distance_km == 0


# --- properties on generated workloads ----------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lineage-lru"])
@pytest.mark.parametrize("seed", [0, 1])
def test_more_tiers_never_lower_the_hit_ratio(policy: str, seed: int) -> None:
    trace = builtin_workload(seed=seed, requests=400)
    unique = len({b for r in trace for b in r.block_ids})
    block_bytes = 512 * 1000
    for cpu_share, disk_share in ((0.02, 0.1), (0.05, 0.3), (0.1, 2.0)):
        report = plan(
            trace,
            tiers_bytes={
                "cpu": max(1, int(unique * cpu_share)) * block_bytes,
                "disk": max(1, int(unique * disk_share)) * block_bytes,
                "remote": unique * block_bytes,
            },
            inputs=TOY,
            distances_km=(),
            policy=policy,
            curve_points=0,
        )
        ratios = [c.hit_ratio for c in report.candidates]
        assert ratios == sorted(ratios), (cpu_share, disk_share, ratios)


def test_a_farther_remote_pool_never_lowers_ttft() -> None:
    # qwen2.5-0.5b recomputes a block in ~1 ms, so the pool stops paying between 10 and 100 km
    inputs = ModeledInputs(model_profile("qwen2.5-0.5b"), gpu_profile("h100"), 0.5)
    block_bytes = 512 * inputs.model.kv_bytes_per_token
    report = plan(
        builtin_workload(seed=4, requests=400),
        tiers_bytes={"cpu": 20 * block_bytes, "disk": 60 * block_bytes, "remote": 1 << 40},
        inputs=inputs,
        distances_km=(1, 10, 30, 60, 100, 1000),
        policy="lineage-lru",
        curve_points=0,
    )
    pool = [c for c in report.candidates if "remote" in c.candidate.tiers_bytes]
    assert [c.candidate.distance_km for c in pool] == [0, 1, 10, 30, 60, 100, 1000]
    assert pool[0].hits_by_tier["remote"] > 0
    for attr in ("mean_ttft_seconds", "p50_ttft_seconds", "p99_ttft_seconds", "prefill_joules"):
        values = [getattr(c.ttft, attr) for c in pool]
        assert values == sorted(values), (attr, values)
    assert "remote" not in pool[0].not_worth_fetching
    assert "remote" in pool[-1].not_worth_fetching
    # not worth fetching: its hits are recomputed, no worse than no remote tier at all
    assert pool[-1].fetched_tokens_by_tier["remote"] == 0
    assert pool[-1].ttft.mean_ttft_seconds <= report.baseline.mean_ttft_seconds


# --- the miss-ratio curve -----------------------------------------------------------------------


def test_curve_capacities() -> None:
    assert curve_capacities(3, 10) == [1, 2, 3]
    caps = curve_capacities(44_000, 10)
    assert caps[0] == 440 and caps[-1] == 44_000 and len(caps) == 10
    ratios = [b / a for a, b in itertools.pairwise(caps)]
    assert max(ratios) / min(ratios) < 1.01  # evenly spaced in log
    assert curve_capacities(0, 10) == []
    with pytest.raises(InvalidArgument, match="2 points"):
        curve_capacities(100, 1)


def _tricky_trace() -> list[TraceRequest]:
    # partial blocks, repeated prefixes, a block repeated inside a request, different lengths
    return [
        req(1, 2, 3, tokens=10),
        req(1, 2, 4),
        req(5, 5, 6),
        req(1, 2, 3, tokens=9),
        req(7),
        req(1, 2, 4, 8, tokens=13),
        req(5, 5, 6),
        req(1, 9, tokens=5),
        req(1, 2, 3),
    ]


@pytest.mark.parametrize("source", ["tricky", "builtin", "chat"])
def test_lru_curve_equals_simulate_at_every_capacity(source: str) -> None:
    from kvctl.workload.generators import generate

    trace = {
        "tricky": _tricky_trace,
        "builtin": lambda: builtin_workload(seed=5, requests=300),
        "chat": lambda: generate("chat", 1, requests=300),
    }[source]()
    unique = len({b for r in trace for b in r.block_ids})
    caps = sorted({*curve_capacities(unique, 8), 1, 2, 3, unique + 5})
    fast = lru_hits_by_capacity(trace, caps)
    for cap, (hit_blocks, hit_tokens) in zip(caps, fast, strict=True):
        # the one-pass curve is of a store that keeps every block (as a plan's replay does)
        ref = simulate(
            trace, tiers={"cpu": cap}, policies=["lru"], bypass_unreachable=False
        ).result("lru")
        assert (hit_blocks, hit_tokens) == (ref.hit_blocks, ref.hit_tokens), cap
    assert fast == sorted(fast)  # non-decreasing in capacity


def test_plan_curve_is_monotonic_and_matches_simulate() -> None:
    trace = builtin_workload(seed=6, requests=300)
    report = plan(
        trace,
        tiers_bytes={"cpu": 512 * 1000 * 50},
        inputs=TOY,
        distances_km=(),
        policy="lineage-lru",
        curve_points=9,
    )
    curve = report.curve
    assert report.policy_curve and 6 <= len(curve) <= 9
    assert curve[-1].capacity_blocks == report.unique_blocks
    assert curve[0].unique_fraction == pytest.approx(0.01, rel=0.3)
    lru = [p.lru_hit_ratio for p in curve]
    assert lru == sorted(lru)
    for p in (curve[0], curve[len(curve) // 2], curve[-1]):
        ref = simulate(
            trace,
            tiers={"cpu": p.capacity_blocks},
            policies=["lineage-lru"],
            bypass_unreachable=False,
        )
        assert p.lru_hit_ratio == ref.result("lru").hit_ratio  # exactly
        assert p.policy_hit_ratio == ref.result("lineage-lru").hit_ratio
        assert p.capacity_bytes == p.capacity_blocks * 512 * 1000
    no_policy = plan(
        trace, tiers_bytes={"cpu": 512 * 1000 * 50}, inputs=TOY, distances_km=(),
        policy="lineage-lru", curve_points=9, policy_curve=False,
    )  # fmt: skip
    assert not no_policy.policy_curve
    assert [p.lru_hit_ratio for p in no_policy.curve] == lru
    assert all(p.policy_hit_ratio is None for p in no_policy.curve)


def test_simulate_reports_hit_tokens_by_tier() -> None:
    trace = builtin_workload(seed=1, requests=200)
    for r in simulate(trace, tiers={"cpu": 50, "disk": 400}, policies=["lru"]).results:
        assert sum(r.hit_tokens_by_tier.values()) == r.hit_tokens
        assert r.as_dict()["hit_tokens_by_tier"] == r.hit_tokens_by_tier
    single = simulate_policy(trace, tiers={"cpu": 50}, policy="lru")
    assert single.hit_tokens_by_tier == {"cpu": single.hit_tokens}


# --- the report and errors ----------------------------------------------------------------------


def test_as_dict_labels_every_modeled_figure_with_its_inputs() -> None:
    report = plan(
        builtin_workload(seed=0, requests=150),
        tiers_bytes={"cpu": 512 * 1000 * 20, "disk": 512 * 1000 * 200, "remote": 10**12},
        inputs=TOY,
        distances_km=(50,),
        policy="lineage-lru",
        curve_points=4,
    )
    d = json.loads(json.dumps(report.as_dict()))
    inputs = d["modeled_inputs"]
    assert inputs["basis"] == "modeled"
    assert inputs["model"]["name"] == "toy" and inputs["gpu"]["name"] == "toy-gpu"
    assert inputs["mfu"] == 1.0 and inputs["prefill_tokens_per_second"] == pytest.approx(1000)
    for tier in ("cpu", "disk", "remote"):
        t = inputs["transfers"][tier]
        assert t["bandwidth_bytes_per_second"] > 0 and "latency_seconds" in t
        assert "worth_fetching" in t and "fetch_seconds_per_block" in t
    assert "compute only" in inputs["energy"]
    assert d["baseline"]["basis"] == "modeled"
    assert [c["name"] for c in d["candidates"]] == [
        "cpu", "cpu+disk", "cpu+disk+remote", "cpu+disk+remote@50km",
    ]  # fmt: skip
    for c in d["candidates"]:
        assert c["simulated"]["basis"] == "simulated"
        m = c["modeled"]
        assert m["basis"] == "modeled"
        assert {"mean_ttft_seconds", "p50_ttft_seconds", "p99_ttft_seconds", "prefill_joules",
                "mean_ttft_saved_ratio", "prefill_joules_saved"} <= m.keys()  # fmt: skip
        assert set(m["transfers"]) == set(c["tiers_bytes"])
    assert d["candidates"][-1]["modeled"]["transfers"]["remote"]["distance_km"] == 50
    assert d["miss_ratio_curve"]["policies"] == ["lru", "lineage-lru"]
    assert len(d["miss_ratio_curve"]["points"]) == 4


def test_bad_arguments() -> None:
    trace = [req(1, 2)]
    with pytest.raises(InvalidArgument, match="unknown policy"):
        _plan(trace, policy="fifo")
    with pytest.raises(InvalidArgument, match="unknown policy"):
        _plan(trace, policy="belady")  # an oracle, not something a fleet can run
    with pytest.raises(InvalidArgument, match="less than one block"):
        _plan(trace, tiers_bytes={"cpu": 3999})
    with pytest.raises(InvalidArgument, match="less than one block"):
        _plan(trace, tiers_bytes={"cpu": 0})
    with pytest.raises(InvalidArgument, match="no requests"):
        _plan([])
    with pytest.raises(InvalidArgument, match="distance"):
        _plan(trace, distances_km=(-5,))
    with pytest.raises(InvalidArgument, match="2 points"):
        _plan(trace, curve_points=1)
    with pytest.raises(InvalidArgument, match="transfer model"):
        _plan(trace, tiers_bytes={"gpu": 10**9})
    with pytest.raises(InvalidArgument, match="block sizes"):
        _plan([req(1), req(2, block=8)])
    with pytest.raises(InvalidArgument, match="MFU"):
        ModeledInputs(TOY.model, TOY.gpu, 0.0)
