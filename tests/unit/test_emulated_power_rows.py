"""Emulated GPU energy where NVML gives none: the modeled prefill time of the tokens the cache
did not serve x the GPU profile's board power, per scrape, from the agent's own counters; and
the collector emulates only nodes whose agent says NVML is unavailable."""

from __future__ import annotations

from typing import Any

import pytest

from collectors.collector import Collector, CollectorConfig, Scrape
from collectors.rows import emulated_power_rows, emulation_for
from kvctl.counters import CounterTracker
from kvctl.db.inventory import NodeInfo
from kvctl.db.migrate import open_db
from kvctl.profiles import BOARD_POWER_SOURCES, GPUS, ModeledInputs, gpu_profile, model_profile
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier

L4 = ModeledInputs(model_profile("qwen2.5-0.5b"), gpu_profile("l4"))


def _stats(lookup_tokens: int, hit_tokens: int, started_s: float = 1.0) -> dict[str, Any]:
    """An agent's ``/v1/stats`` (a real store's snapshot) with these token counters."""
    snap = TieredStore([CpuTier(1 << 20)]).snapshot()
    snap["stats"] |= {"lookup_tokens": lookup_tokens, "hit_tokens": hit_tokens}
    return {**snap, "started_s": started_s}


def test_energy_is_the_missed_tokens_prefill_time_at_board_power() -> None:
    tracker = CounterTracker()
    assert emulated_power_rows(tracker, 3, 1_000, _stats(0, 0), L4) == []  # a baseline
    (row,) = emulated_power_rows(tracker, 3, 11_000, _stats(100_000, 40_000), L4)
    busy_s = L4.prefill_seconds(60_000)
    assert row["busy_s"] == pytest.approx(busy_s)
    assert row["energy_j"] == pytest.approx(busy_s * 72.0)  # the L4's published 72 W
    assert row["power_w"] == pytest.approx(busy_s * 72.0 / 10)  # over the 10 s interval
    assert (row["gpu_profile"], row["model"], row["lookup_tokens"]) == (
        "l4",
        "qwen2.5-0.5b",
        100_000,
    )
    # the next scrape counts only what happened since
    (row,) = emulated_power_rows(tracker, 3, 21_000, _stats(100_000, 40_000), L4)
    assert row["energy_j"] == 0 and row["lookup_tokens"] == 0


def test_power_and_energy_are_capped_together_at_the_board_power() -> None:
    """More work than the GPU could do in the interval: the board at full power for the whole
    interval, and the energy of the same sample is that, not more (before, the power was
    capped and the energy was not: 72 W beside 10x the joules 72 W can make in 1 s)."""
    tracker = CounterTracker()
    emulated_power_rows(tracker, 1, 0, _stats(0, 0), L4)
    (row,) = emulated_power_rows(tracker, 1, 1_000, _stats(10_000_000, 0), L4)
    assert row["power_w"] == 72.0 and row["busy_s"] == 1.0
    assert row["energy_j"] == pytest.approx(row["power_w"] * 1.0)  # power x interval


def test_an_agent_restart_counts_from_zero() -> None:
    tracker = CounterTracker()
    emulated_power_rows(tracker, 1, 0, _stats(50_000, 0, started_s=1.0), L4)
    (row,) = emulated_power_rows(tracker, 1, 5_000, _stats(2_000, 1_000, started_s=9.0), L4)
    assert row["lookup_tokens"] == 2_000
    assert row["busy_s"] == pytest.approx(L4.prefill_seconds(1_000))


def test_every_gpu_profile_cites_its_board_power() -> None:
    assert set(BOARD_POWER_SOURCES) == set(GPUS)
    for name, gpu in GPUS.items():
        assert f"{gpu.board_power_watts:g} W" in BOARD_POWER_SOURCES[name]


def _collector(tmp_path: Any, emulate: ModeledInputs | None) -> Collector:
    engine = open_db(f"sqlite:///{tmp_path / 'kvctl.db'}")
    return Collector(engine, CollectorConfig(emulate_power=emulate))


NODE = NodeInfo(1, "n1", "dc", "http://127.0.0.1:1", "", None)


def _scrapes(nvml: bool | None, lookup_tokens: int) -> list[Scrape]:
    gpus = None if nvml is None else {"nvml": {"available": nvml}, "gpus": []}
    return [Scrape(NODE, True, 0.01, stats=_stats(lookup_tokens, 0), gpus=gpus)]


@pytest.mark.parametrize(
    ("nvml", "emulate", "expected"),
    [
        (False, L4, 1),  # no NVML, asked to emulate: emulated
        (True, L4, 0),  # NVML answers: its readings stand alone, nothing emulated
        (None, L4, 0),  # the agent did not say: nothing made up
        (False, None, 0),  # not asked to
    ],
)
def test_the_collector_emulates_only_nodes_without_nvml(
    tmp_path: Any, nvml: bool | None, emulate: ModeledInputs | None, expected: int
) -> None:
    from collectors.collector import CycleReport

    collector = _collector(tmp_path, emulate)
    try:
        collector._rows(_scrapes(nvml, 0), 1_000, CycleReport(1_000))
        rows = collector._rows(_scrapes(nvml, 4_096), 3_000, CycleReport(3_000))
    finally:
        collector.close()
        collector.engine.dispose()
    assert len(rows.get("emulated_power_sample", [])) == expected


def test_each_node_is_emulated_on_its_inventory_gpu() -> None:
    """--emulate-power l4 is the default for nodes whose inventory names no GPU profile; a node
    listed as H100 is emulated at the H100's rate and 700 W, never the L4's 72 W."""
    h100 = emulation_for(L4, "NVIDIA H100 80GB HBM3")
    assert (h100.gpu.name, h100.model.name, h100.mfu) == ("h100", "qwen2.5-0.5b", L4.mfu)
    assert emulation_for(L4, "") is L4 and emulation_for(L4, "some new GPU") is L4


def test_the_collector_emulates_an_h100_node_as_an_h100(tmp_path: Any) -> None:
    from collectors.collector import CycleReport

    node = NodeInfo(1, "n1", "dc", "http://127.0.0.1:1", "H100", None)
    gpus = {"nvml": {"available": False}, "gpus": []}
    collector = _collector(tmp_path, L4)
    try:
        for ts_ms, tokens in ((1_000, 0), (3_000, 4_096)):
            scrape = Scrape(node, True, 0.01, stats=_stats(tokens, 0), gpus=gpus)
            rows = collector._rows([scrape], ts_ms, CycleReport(ts_ms))
    finally:
        collector.close()
        collector.engine.dispose()
    (row,) = rows["emulated_power_sample"]
    assert row["gpu_profile"] == "h100"
    assert row["energy_j"] == pytest.approx(row["busy_s"] * 700.0)
