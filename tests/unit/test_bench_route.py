"""`kvctl bench route`: a quick replay of small generated workloads, its JSON and invariants."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.bench.route import (
    RouteBenchConfig,
    build_topology,
    render_route_bench,
    run_route_bench,
    session_ids,
)
from kvctl.cli.main import app
from kvctl.errors import InvalidArgument
from kvctl.router.policies import POLICIES
from kvctl.workload.generators import generate
from kvctl.workload.trace import TraceRequest


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    missing = tmp_path_factory.mktemp("no-trace") / "absent.jsonl"
    config = RouteBenchConfig.quick(
        workloads=("mooncake", "system-prompt", "chat"),
        requests=40,
        trace_path=str(missing),
        redis_url=None,
        latency_requests=30,
        latency_rate_per_s=5000.0,
        index_entries=5_000,
        index_events=5_000,
    )
    return run_route_bench(config)


def _ran(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for w in result["workloads"] if "skipped" not in w]


def test_the_result_is_json_with_every_section(result: dict[str, Any]) -> None:
    again = json.loads(json.dumps(result))
    assert again["benchmark"] == "route"
    for key in ("host", "config", "modeled_inputs", "workloads", "decision_latency",
                "index_updates", "targets", "notes", "elapsed_s"):  # fmt: skip
        assert key in again
    inputs = again["modeled_inputs"]
    assert inputs["profiles"]["model"]["name"] == "llama-3.1-8b"
    assert inputs["basis"].startswith("modeled")
    assert {tuple(link["dcs"]) for link in inputs["topology"]["links"]} == {("dc0", "dc1")}
    assert [w["workload"] for w in _ran(result)] == ["system-prompt", "chat"]
    for w in _ran(result):
        assert list(w["policies"]) == list(POLICIES)  # round-robin, the reference, first


def test_an_absent_trace_is_skipped_with_a_note(result: dict[str, Any]) -> None:
    skipped = result["workloads"][0]
    assert skipped["workload"] == "mooncake"
    assert "not on this machine" in skipped["skipped"]
    assert any("mooncake skipped" in n for n in result["notes"])
    assert result["index_updates"]["redis"] == {"skipped": "no Redis URL given"}


def test_counts_hold_together_for_every_policy(result: dict[str, Any]) -> None:
    for w in _ran(result):
        for name, p in w["policies"].items():
            assert p["requests"] == w["requests"], name  # same requests for every policy
            assert p["lookups"] == w["chunks"]
            assert p["no_node"] == 0
            assert p["hits"] == p["local_hits"] + p["pulled_hits"] <= p["lookups"]
            assert 0 <= p["hit_ratio"] <= 1
            assert sum(p["requests_per_node"].values()) == p["requests"]
            assert p["to_holder_requests"] <= p["indexed_requests"] <= p["requests"]
            assert sum(p["pulled_bytes_by_link"].values()) == p["pulled_bytes"]
            assert sum(p["pulled_chunks_by_link"].values()) == p["pulled_hits"]
            # the index, fed by the stores' events, agreed with every chosen node's store
            assert p["index_mismatches"] == 0
            t = p["ttft_modeled"]
            assert 0 < t["p50_s"] <= t["p99_s"] <= t["max_s"]
        assert w["policies"]["prefix-only"]["pulled_hits"] >= 0


def test_cost_beats_round_robin_on_heavy_prefix_reuse(result: dict[str, Any]) -> None:
    w = next(w for w in _ran(result) if w["workload"] == "system-prompt")
    cost, rr = w["policies"]["cost"], w["policies"]["round-robin"]
    assert cost["ttft_modeled"]["mean_s"] <= rr["ttft_modeled"]["mean_s"]
    assert cost["vs_reference"]["ttft_mean_ratio_to_reference"] <= 1.0
    assert rr["vs_reference"]["ttft_mean_ratio_to_reference"] == 1.0


def test_latency_and_index_figures_sit_beside_their_references(result: dict[str, Any]) -> None:
    lat = result["decision_latency"]
    assert lat["requests"] == 30
    assert lat["index_entries"] >= 5_000
    for key in ("cost", "prefix_only", "reference"):
        assert 0 < lat[key]["p50_s"] <= lat[key]["p99_s"]
        assert lat[key]["what"]
    assert isinstance(lat["meets_target"], bool)
    # Router.route by a router following 50 agents (quick), every one up
    router = lat["router"]
    assert router["followers"] == 50 and router["what"].startswith("Router.route")
    assert 0 < router["p50_s"] <= router["p99_s"]
    assert router["p99_ratio_to_reference"] > 0
    emb = result["index_updates"]["embedded"]
    assert emb["stored_events_per_s"] > 0 and emb["reference"]["stored_events_per_s"] > 0


def test_the_summary_renders(result: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(render_route_bench(result))
    text = console.export_text()
    assert "system-prompt" in text and "decision latency" in text and "mooncake: skipped" in text


def test_sessions_follow_conversations() -> None:
    def req(*blocks: int) -> TraceRequest:
        return TraceRequest(0, 512 * len(blocks), 10, blocks, tenant="t")

    # r1 and r3 are later turns of r0's conversation; r2 only shares its first block
    requests = [req(1, 2), req(1, 2, 3), req(1, 5), req(1, 2, 3, 4)]
    ids = session_ids(requests)
    assert ids[0] == ids[1] == ids[3]
    assert ids[2] != ids[0]
    assert len(set(session_ids(generate("chat", 0, requests=40)))) < 40


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dcs": 5}, "dcs must be 2 to 4"),
        ({"nodes": 1}, "at least one node per DC"),
        ({"distances_km": (1.0, 2.0)}, "one per pair"),
        ({"workloads": ("nope",)}, "unknown workload"),
        ({"policies": ("random",)}, "unknown policy"),
        ({"cpu_bytes": 0}, "cpu_bytes"),
        ({"latency_followers": -1}, "latency_followers"),
    ],
)
def test_bad_settings_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        run_route_bench(RouteBenchConfig.quick(**overrides))


def test_topology_deals_nodes_over_dcs_with_pairwise_distances() -> None:
    topo = build_topology(RouteBenchConfig(nodes=6, dcs=3, distances_km=(10.0, 20.0, 30.0)))
    assert topo.dcs == ["dc0", "dc1", "dc2"]
    assert sorted(n.name for n in topo.nodes.values() if n.dc == "dc1") == ["dc1-n0", "dc1-n1"]
    rtt = {
        pair: topo.link(*pair).rtt_s for pair in (("dc0", "dc1"), ("dc0", "dc2"), ("dc1", "dc2"))
    }  # type: ignore[union-attr]
    assert rtt[("dc0", "dc1")] < rtt[("dc0", "dc2")] < rtt[("dc1", "dc2")]


def test_cli_prints_json_and_refuses_bad_options() -> None:
    args = ["bench", "route", "--quick", "--json", "--workloads", "chat", "--requests", "15",
            "--latency-requests", "10", "--rate", "5000", "--index-events", "2000",
            "--index-entries", "2000", "--no-redis"]  # fmt: skip
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [w["workload"] for w in data["workloads"]] == ["chat"]
    assert data["config"]["requests"] == 15
    bad = CliRunner().invoke(app, ["bench", "route", "--quick", "--dcs", "9"])
    assert bad.exit_code == 2
    assert "dcs must be 2 to 4" in bad.output


def test_cli_latency_followers_sets_or_skips_the_router_figure() -> None:
    args = ["bench", "route", "--quick", "--json", "--workloads", "chat", "--requests", "15",
            "--latency-requests", "10", "--rate", "5000", "--index-events", "2000",
            "--index-entries", "2000", "--no-redis"]  # fmt: skip
    out = CliRunner().invoke(app, [*args, "--latency-followers", "0"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["config"]["latency_followers"] == 0
    assert "router" not in data["decision_latency"]
    out = CliRunner().invoke(app, [*args, "--latency-followers", "3"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["decision_latency"]["router"]["followers"] >= 3
    bad = CliRunner().invoke(app, ["bench", "route", "--quick", "--latency-followers", "-1"])
    assert bad.exit_code == 2
    assert "latency_followers must be an integer >= 0" in bad.output
