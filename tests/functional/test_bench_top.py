"""`kvctl bench top` for real on a tiny fleet: the JSON's shape and its internal consistency, and
every agent gone afterwards (also when the run is interrupted). No assertion on speed."""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

import pytest

from kvctl.agent.daemon import pid_alive
from kvctl.bench import top as bench_top
from kvctl.bench.top import SEED_CHUNKS, SHOW_VIEW_REPEATS, render_top_bench, run_top_bench

AGENTS, INTERVAL_S, SECONDS, CYCLES = 3, 0.5, 2.0, 4


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    said: list[str] = []
    out = run_top_bench(AGENTS, INTERVAL_S, SECONDS, cycles=CYCLES, progress=said.append)
    out["_progress"] = said
    return out


def _check_spread(s: dict[str, Any], n: int) -> None:
    assert len(s["samples"]) == n and all(x >= 0 for x in s["samples"])
    assert s["min"] == min(s["samples"]) and s["max"] == max(s["samples"])
    assert s["median"] == statistics.median(s["samples"])
    assert s["min"] <= s["median"] <= s["p95"] <= s["max"]


def test_shape_and_figures_beside_their_references(result: dict[str, Any]) -> None:
    r = result
    assert r["benchmark"] == "top"
    for key in ("kvctl_version", "python", "platform", "cpu_count"):
        assert r[key]
    assert (r["agents"], r["dcs"], r["cycles"]) == (AGENTS, AGENTS, CYCLES)
    assert (r["interval_seconds"], r["app_seconds"]) == (INTERVAL_S, SECONDS)
    assert r["elapsed_seconds"] > r["agent_start_seconds"] > 0
    assert r["agent_rss_bytes_median"] > 0
    for name in ("poll_seconds", "health_fanout_seconds", "health_kept_clients_seconds"):
        _check_spread(r[name], CYCLES)
    poll, health = r["poll_seconds"], r["health_fanout_seconds"]
    kept = r["health_kept_clients_seconds"]
    assert math.isclose(r["poll_vs_health_ratio"], poll["median"] / health["median"])
    assert math.isclose(r["poll_vs_interval_ratio"], poll["p95"] / INTERVAL_S)
    assert math.isclose(r["health_fanout_vs_kept_clients_ratio"], health["median"] / kept["median"])
    assert r["agent_client_setup_seconds_median"] > 0
    # every poll and every fan-out reached every agent: a fast poll of down nodes means nothing
    assert r["poll_nodes_up_min"] == r["health_nodes_ok_min"] == AGENTS
    assert r["health_kept_clients_ok_min"] == AGENTS
    assert r["notes"] and all(isinstance(n, str) for n in r["notes"])
    json.dumps({k: v for k, v in r.items() if k != "_progress"}, allow_nan=False)


def test_the_headless_view_refreshed_and_saw_every_agent_up(result: dict[str, Any]) -> None:
    app = result["app"]
    assert app["window_seconds"] >= SECONDS
    assert app["ticks_expected"] == SECONDS / INTERVAL_S
    assert app["refreshes"] >= 1
    assert math.isclose(app["refreshes_vs_expected_ratio"], app["refreshes"] / 4)
    # each tick either started a poll (applied, or running at the end) or was late; the timer
    # fires at most once per interval, plus the tick at start
    started = app["refreshes"] + app["late_ticks"] + int(app["poll_in_flight_at_end"])
    assert started <= app["ticks_expected"] + 2
    assert app["poll_error"] is None
    assert app["rows"] == app["up"] == AGENTS and app["all_up"] is True
    assert app["screen"] == "FleetScreen"
    assert app["last_view_poll_seconds"] > 0
    _check_spread(app["show_view_ms"], SHOW_VIEW_REPEATS)
    assert math.isclose(
        app["show_view_vs_interval_ratio"], app["show_view_ms"]["median"] / 1000 / INTERVAL_S
    )
    lag = app["loop_lag_seconds"]
    assert lag["count"] >= 1 and 0 <= lag["min"] <= lag["median"] <= lag["p95"] <= lag["max"]


def test_traffic_moved_without_errors(result: dict[str, Any]) -> None:
    t = result["traffic"]
    assert t["errors"] == 0 and t["last_error"] is None
    assert t["seed_puts"] == AGENTS * SEED_CHUNKS and t["seed_lookups"] > 0
    assert t["background_ops"] >= 1
    assert t["background_lookups"] == 2 * t["background_ops"]
    assert t["background_puts"] >= 1


def test_every_agent_is_gone_afterwards(result: dict[str, Any]) -> None:
    pids = result["agent_pids"]
    assert len(set(pids)) == AGENTS
    assert not [p for p in pids if pid_alive(p)]


def test_progress_and_the_table_for_people(result: dict[str, Any]) -> None:
    said = result["_progress"]
    assert said[0].startswith(f"starting {AGENTS} agents") and said[-1].startswith("stopping")
    from rich.console import Console

    console = Console(width=160, record=True)
    console.print(render_top_bench(result))
    text = console.export_text()
    for words in ("health fan-out", "refresh interval", "ticks expected", "show_view"):
        assert words in text


def test_an_interrupted_run_stops_every_agent(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real_inventory = bench_top._inventory

    def interrupted(path: Any, agents: list[Any], dcs: int) -> Any:
        seen.extend(a.proc.pid for a in agents)
        assert all(pid_alive(p) for p in seen)
        real_inventory(path, agents, dcs).dispose()
        raise KeyboardInterrupt  # Ctrl-C with the fleet up

    monkeypatch.setattr(bench_top, "_inventory", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_top_bench(2, INTERVAL_S, SECONDS, cycles=1)
    assert len(seen) == 2
    assert not [p for p in seen if pid_alive(p)]


def test_a_failed_start_stops_the_agents_that_did_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvctl.agent import daemon

    started: list[int] = []
    real_spawn = daemon.spawn_agent

    def spawn(argv: list[str], data_dir: Any, **kw: Any) -> Any:
        if "top-1" in argv:
            raise RuntimeError("the agent did not start (a test's refusal)")
        proc, state = real_spawn(argv, data_dir, **kw)
        started.append(proc.pid)
        return proc, state

    monkeypatch.setattr(daemon, "spawn_agent", spawn)
    with pytest.raises(RuntimeError, match="1 of 3 agents did not start"):
        run_top_bench(3, INTERVAL_S, SECONDS, cycles=1)
    assert len(started) == 2
    assert not [p for p in started if pid_alive(p)]
