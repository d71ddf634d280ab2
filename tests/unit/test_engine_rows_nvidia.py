"""NVIDIA engines' counters become increases between scrapes, across restarts (a new start time,
or counters that fell), and an idle TensorRT-LLM JSON scrape is unknown, not zero."""

from __future__ import annotations

from collectors.engines import parse_engine_metrics
from collectors.rows import engine_row
from kvctl.counters import CounterTracker
from tests.unit.test_engine_metrics_nvidia import KVBM, KVBM_1, TRTLLM, TRTLLM_1, trtllm_iterations


def test_kvbm_increases_between_scrapes_and_across_a_restart() -> None:
    tracker = CounterTracker()
    scrapes = [
        KVBM_1,
        {"matched": 90112, "d2h": 2304, "h2d_off": 700, "d2d_off": 4, "h2d_on": 1300, "d2d_on": 86},
        # restarted (KVBM exposes no start time): every counter fell; counted from zero
        {"matched": 512, "d2h": 16, "h2d_off": 2, "d2d_off": 0, "h2d_on": 9, "d2d_on": 1},
    ]
    rows = [
        engine_row(tracker, 3, 10_000 * i, parse_engine_metrics(KVBM.format(**s)), None)
        for i, s in enumerate(scrapes)
    ]
    columns = (
        "kvbm_matched_tokens",
        "kvbm_offload_host_blocks",
        "kvbm_offload_disk_blocks",
        "kvbm_onboard_host_blocks",
        "kvbm_onboard_disk_blocks",
    )
    assert [rows[0][c] for c in columns] == [0, 0, 0, 0, 0]  # the baseline
    assert [rows[1][c] for c in columns] == [8192, 256, 64, 100, 6]
    assert [rows[2][c] for c in columns] == [512, 16, 2, 9, 1]
    assert all(r["engine"] == "kvbm" and r["prompt_tokens"] is None for r in rows)


def test_trtllm_increases_across_a_restart_seen_by_its_start_time() -> None:
    tracker = CounterTracker()
    first = parse_engine_metrics(TRTLLM.format(**TRTLLM_1))
    engine_row(tracker, 5, 0, first, None, epoch=first.process_start_s)
    later = {**TRTLLM_1, "stop": 130.0, "prompt": 460800.0, "cached": 420000.0}
    second = parse_engine_metrics(TRTLLM.format(**later).replace("11875.0", "13000.0"))
    row = engine_row(tracker, 5, 10_000, second, first.ttft, epoch=second.process_start_s)
    assert (row["prompt_tokens"], row["cached_prompt_tokens"]) == (51200, 40000)
    assert (row["requests"], row["kv_reused_blocks"], row["kv_missed_blocks"]) == (30, 1125, 0)
    # restarted: a new start time, and the block counters already past their old values
    restarted = {**TRTLLM_1, "start": 1.7948e09, "reused": 20000.0, "missed": 1000.0}
    third = parse_engine_metrics(TRTLLM.format(**restarted))
    row = engine_row(tracker, 5, 20_000, third, second.ttft, epoch=third.process_start_s)
    assert (row["kv_reused_blocks"], row["kv_missed_blocks"]) == (20000, 1000)
    assert row["prompt_tokens"] == 409600


def test_trtllm_iteration_stats_increases_across_idle_scrapes_and_a_restart() -> None:
    tracker = CounterTracker()
    texts = [
        trtllm_iterations((150, 4, 3121, 3)),
        trtllm_iterations((151, 40, 3200, 9), (152, 100, 3300, 12)),
        "[]",  # idle: nothing queued since the last read
        trtllm_iterations((190, 160, 3310, 12)),
        trtllm_iterations((3, 7, 20, 1)),  # restarted: the counters fell
    ]
    rows = [
        engine_row(tracker, 9, 10_000 * i, parse_engine_metrics(t), None)
        for i, t in enumerate(texts)
    ]
    got = [(r["kv_reused_blocks"], r["kv_missed_blocks"]) for r in rows]
    # the idle scrape records nothing, and the next one carries its interval too
    assert got == [(0, 0), (96, 179), (None, None), (60, 10), (7, 20)]
    assert all(r["engine"] == "trtllm" for r in rows)


def test_trtllm_iteration_stats_first_seen_after_idle_scrapes_are_a_baseline() -> None:
    # The collector met the engine idle ("[]": its JSON hides the block counters, which have
    # been counting since it started): the first counters it shows are a baseline, not the
    # blocks of this one interval.
    tracker = CounterTracker()
    texts = [
        "[]",
        "[]",
        trtllm_iterations((150, 4000, 31210, 3)),
        trtllm_iterations((151, 4040, 31290, 9)),
    ]
    rows = [
        engine_row(tracker, 9, 10_000 * i, parse_engine_metrics(t), None)
        for i, t in enumerate(texts)
    ]
    got = [(r["kv_reused_blocks"], r["kv_missed_blocks"]) for r in rows]
    assert got == [(None, None), (None, None), (None, None), (40, 80)]
