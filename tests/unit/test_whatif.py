"""What-if planning: the transfer model, fetch-or-recompute, modeled TTFT on hand-built
workloads, and the miss-ratio curve against the simulator."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.store.errors import InvalidArgument
from kvctl.workload.generators import generate
from kvctl.workload.profiles import ModeledInputs, ModelProfile, gpu_profile, model_profile
from kvctl.workload.simulate import simulate
from kvctl.workload.trace import TraceRequest
from kvctl.workload.whatif import (
    TierLink,
    curve_capacities,
    default_candidates,
    miss_ratio_curve,
    plan,
    worth_fetching,
)

# a made-up model for round numbers: 1,000 B of KV per token, 1e9 FLOPs per token
TOY = ModelProfile("toy", layers=1, kv_heads=1, head_dim=250, params=0.5e9)
INPUTS = ModeledInputs(TOY, gpu_profile("h100"), mfu=0.5)  # 494,500 tokens/s


def test_transfer_model_by_hand() -> None:
    link = TierLink(bytes_per_second=1e9, latency_seconds=100e-6, distance_km=100)
    assert link.round_trip_seconds == pytest.approx(100e-6 + 1e-3)
    assert link.fetch_seconds(2e6) == pytest.approx(1.1e-3 + 2e-3)


def test_fetch_or_recompute() -> None:
    tps = INPUTS.prefill_tokens_per_second
    assert tps == pytest.approx(494_500)
    chunk_tokens = 512  # recompute: 1.035 ms
    fast = TierLink(25e9, 10e-6)  # 512 KB in 20 us + 10 us
    far = TierLink(12.5e9, 50e-6, distance_km=200)  # 2 ms of fiber alone
    assert worth_fetching(fast, chunk_tokens * 1000, chunk_tokens, INPUTS)
    assert not worth_fetching(far, chunk_tokens * 1000, chunk_tokens, INPUTS)


def _req(ts: int, ids: tuple[int, ...], tokens: int | None = None) -> TraceRequest:
    return TraceRequest(ts, tokens or 512 * len(ids), 1, ids)


def test_plan_by_hand() -> None:
    requests = [_req(0, (1, 2)), _req(1, (1, 2)), _req(2, (1, 3))]
    block_bytes = 512 * 1000
    report = plan(
        requests,
        tiers_bytes={"cpu": 10 * block_bytes},
        inputs=INPUTS,
        distances_km=(),
        curve_points=2,
    )
    (cpu,) = report.candidates
    assert cpu.candidate.name == "cpu"
    assert cpu.tiers_blocks == {"cpu": 10}
    assert cpu.hit_ratio == pytest.approx(3 / 6)  # 2 blocks, then 1 block of 2
    assert cpu.hits_by_tier == {"cpu": 3}
    prefill_block = 512 / INPUTS.prefill_tokens_per_second
    fetch = TierLink(25e9, 10e-6)
    expected = [
        2 * prefill_block,
        fetch.fetch_seconds(2 * block_bytes),
        prefill_block + fetch.fetch_seconds(block_bytes),
    ]
    assert cpu.mean_ttft_seconds == pytest.approx(sum(expected) / 3)
    assert cpu.p99_ttft_seconds == pytest.approx(max(expected))
    assert cpu.prefill_joules == pytest.approx(3 * prefill_block * 700)
    assert report.baseline.prefill_joules == pytest.approx(6 * prefill_block * 700)
    d = report.as_dict()
    assert d["candidates"][0]["modeled"]["energy_saved_ratio"] == pytest.approx(0.5)
    assert d["inputs"]["model"]["name"] == "toy"
    assert "modeled" in d["basis"]


def test_a_far_pool_is_not_read_and_says_so() -> None:
    requests = generate("system-prompt", 1, requests=60)
    block_bytes = 512 * 1000
    report = plan(
        requests,
        tiers_bytes={"cpu": 2 * block_bytes, "remote": 10_000 * block_bytes},
        inputs=INPUTS,
        distances_km=(10, 400),
        curve_points=3,
    )
    by_name = {c.candidate.name: c for c in report.candidates}
    assert list(by_name) == ["cpu", "cpu+remote", "cpu+remote @10 km", "cpu+remote @400 km"]
    assert by_name["cpu+remote @400 km"].not_worth_fetching == ("remote",)
    assert by_name["cpu+remote @10 km"].not_worth_fetching == ()
    # same hits wherever the pool is; farther never faster
    assert by_name["cpu+remote @400 km"].hit_ratio == by_name["cpu+remote"].hit_ratio
    ttft = [by_name[n].mean_ttft_seconds for n in ("cpu+remote", "cpu+remote @10 km")]
    assert ttft[0] <= ttft[1]
    assert by_name["cpu+remote @400 km"].prefill_joules > by_name["cpu+remote"].prefill_joules


def test_more_tiers_never_lower_the_hit_ratio() -> None:
    requests = generate("rag", 3, requests=300)
    model = model_profile("qwen2.5-7b")
    block_bytes = 512 * model.kv_bytes_per_token
    report = plan(
        requests,
        tiers_bytes={"cpu": 20 * block_bytes, "disk": 200 * block_bytes, "remote": 10**15},
        inputs=ModeledInputs(model, gpu_profile("l4")),
        distances_km=(50,),
        curve_points=4,
    )
    ratios = [c.hit_ratio for c in report.candidates[:3]]
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1]
    assert all(c.mean_ttft_seconds <= report.baseline.mean_ttft_seconds for c in report.candidates)


def test_curve_matches_the_simulator() -> None:
    requests = generate("chat", 2, requests=200)
    unique = len({b for r in requests for b in r.block_ids})
    caps = curve_capacities(unique, 6)
    assert caps[0] == max(1, round(unique * 0.01)) and caps[-1] == unique
    curve = miss_ratio_curve(requests, unique, "lru", 6)
    ratios = [p.hit_ratio for p in curve]
    assert ratios == sorted(ratios)
    for point in curve[::2]:
        ref = simulate(requests, tiers={"cpu": point.capacity_blocks}, policies=["lru"])
        assert point.hit_ratio == ref.result("lru").hit_ratio
        assert point.miss_ratio == pytest.approx(1 - point.hit_ratio)


def test_default_candidates() -> None:
    names = [c.name for c in default_candidates({"cpu": 1, "disk": 0, "remote": 5}, (10, 0))]
    assert names == ["cpu", "cpu+remote", "cpu+remote @10 km"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tiers_bytes": {"cpu": 10}}, "less than one block"),
        ({"tiers_bytes": {"gpu": 10**12}}, "unknown tier"),
        ({"distances_km": (-1,)}, "negative"),
        ({"curve_points": 1}, "at least 2"),
        ({"policy": "fifo"}, "unknown policy"),
    ],
)
def test_bad_plans(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"tiers_bytes": {"cpu": 10**12}, "inputs": INPUTS, **kwargs}
    with pytest.raises(InvalidArgument, match=message):
        plan([_req(0, (1,))], **args)  # type: ignore[arg-type]


# --- the command --------------------------------------------------------------------------
runner = CliRunner()


def test_plan_command_table_and_json() -> None:
    args = ["plan", "--workload", "rag", "--limit", "150", "--cpu", "1GiB", "--disk", "8GiB",
            "--remote", "1TiB", "--model", "qwen2.5-7b", "--curve-points", "4"]  # fmt: skip
    result = runner.invoke(app, args, env={"COLUMNS": "140"})
    assert result.exit_code == 0, result.output
    for text in (
        "no cache",
        "cpu+disk+remote @100 km",
        "miss-ratio curve",
        "modeled",
        "qwen2.5-7b",
    ):
        assert text in result.output
    out = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert [c["name"] for c in out["candidates"]][:3] == ["cpu", "cpu+disk", "cpu+disk+remote"]
    assert out["inputs"]["tier_links"]["remote"]["latency_seconds"] > 0
    assert len(out["miss_ratio_curve"]["lru"]) == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-9"], "unknown model"),
        (["--gpu", "tpu"], "unknown GPU"),
        (["--cpu", "0"], "--cpu"),
        (["--cpu", "1KiB"], "less than one block"),
        (["--disk", "lots"], "not a size"),
        (["--trace", "/nonexistent.jsonl"], "no such"),
    ],
)
def test_plan_command_bad_input(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["plan", "--limit", "20", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_plan_on_the_shared_trace(shared_trace) -> None:  # type: ignore[no-untyped-def]
    result = runner.invoke(
        app, ["plan", "--trace", str(shared_trace), "--limit", "300", "--curve-points", "3",
              "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["requests"] == 300 and out["block_tokens"] == 512
    assert out["candidates"][-1]["hit_ratio"] >= out["candidates"][0]["hit_ratio"]
