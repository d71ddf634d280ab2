"""Scraped readings to rows: the mapping of agent counters, and engine restarts."""

from __future__ import annotations

from collectors.engines import parse_engine_metrics
from collectors.rows import cache_rows, engine_row, plan_rows
from kvctl.counters import CounterTracker
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from tests.conftest import chain, put_chain


def test_cache_rows_follow_the_store_counters(ns) -> None:  # type: ignore[no-untyped-def]
    store = TieredStore([CpuTier(1 << 20)])
    keys = chain(ns, 4)
    tracker = CounterTracker()
    stats = {**store.snapshot(), "started_s": 1.0}
    cache_rows(tracker, 7, 0, stats)  # baseline
    put_chain(store, keys, tenant="a")
    store.lookup(keys, tenant="b")
    rows = {
        r["tier"]: r for r in cache_rows(tracker, 7, 10, {**store.snapshot(), "started_s": 1.0})
    }
    assert set(rows) == {"cpu", "all"}
    assert rows["all"]["lookups"] == 4 and rows["all"]["hits"] == 4
    assert rows["all"]["sharing_hits"] == 4 and rows["all"]["reuse_hits"] == 0
    assert rows["cpu"]["hits"] == 4 and rows["cpu"]["lookups"] == 0
    assert rows["all"]["items"] == rows["cpu"]["items"] == 4
    assert rows["all"]["used_bytes"] == 400 and rows["all"]["capacity_bytes"] == 1 << 20


def test_read_counts_go_on_the_nodes_row_and_an_agent_without_them_holds_nothing_back(
    ns,  # type: ignore[no-untyped-def]
) -> None:
    store = TieredStore([CpuTier(1 << 20)])
    keys = chain(ns, 4)
    tracker = CounterTracker()

    def scrape(ts_ms: int, dataplane: dict[str, object] | None) -> dict[str, dict[str, object]]:
        stats = {**store.snapshot(), "started_s": 1.0}
        if dataplane is not None:
            stats["dataplane"] = dataplane
        return {r["tier"]: r for r in cache_rows(tracker, 7, ts_ms, stats)}

    # an agent from before the counts: NULL, and the hits are counted all the same
    scrape(0, None)
    put_chain(store, keys, tenant="a")
    store.lookup(keys, tenant="a")
    rows = scrape(10, None)
    assert rows["all"]["hits"] == 4
    assert rows["all"]["read_chunks"] is None and rows["all"]["read_missing_chunks"] is None
    # the counts appear: the first reading is the series' baseline, then increases; never on
    # a tier's row
    assert scrape(20, {"read_chunks": 10, "read_missing_chunks": 1})["all"]["read_chunks"] == 0
    rows = scrape(30, {"read_chunks": 16, "read_missing_chunks": 3})
    assert (rows["all"]["read_chunks"], rows["all"]["read_missing_chunks"]) == (6, 2)
    assert rows["cpu"]["read_chunks"] is None
    # one unknown (a NaN): both wait, and are counted whole at the next scrape
    rows = scrape(40, {"read_chunks": 20, "read_missing_chunks": float("nan")})
    assert rows["all"]["read_chunks"] is None and rows["all"]["read_missing_chunks"] is None
    rows = scrape(50, {"read_chunks": 21, "read_missing_chunks": 4})
    assert (rows["all"]["read_chunks"], rows["all"]["read_missing_chunks"]) == (5, 1)


TEXT = """# TYPE process_start_time_seconds gauge
process_start_time_seconds {start}
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{model_name="m"}} {prompt}
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{le="0.5",model_name="m"}} {fast}
vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {count}
vllm:time_to_first_token_seconds_count{{model_name="m"}} {count}
vllm:time_to_first_token_seconds_sum{{model_name="m"}} {count}
"""


def test_engine_restart_counts_from_zero_even_when_counters_grew_past() -> None:
    tracker = CounterTracker()
    first = parse_engine_metrics(TEXT.format(start=100, prompt=500, fast=0, count=4))
    assert first.process_start_s == 100
    engine_row(tracker, 1, 0, first, None, epoch=first.process_start_s)
    # restarted, and already past the old values: only the start time shows it
    second = parse_engine_metrics(TEXT.format(start=200, prompt=900, fast=6, count=6))
    row = engine_row(tracker, 1, 10, second, first.ttft, epoch=second.process_start_s)
    assert row["prompt_tokens"] == 900 and row["ttft_count"] == 6
    # all 6 requests of the new process were fast: the median is in the first bucket, not
    # skewed by subtracting the old process's 4 slow ones
    assert row["ttft_p50_s"] is not None and row["ttft_p50_s"] <= 0.5


def _plan_stats(
    recompute_s: float,
    fetch_s: float,
    chunks: int,
    *,
    started_s: float = 1.0,
    kind: str = "modeled",
) -> dict[str, object]:
    """``/v1/stats`` as an agent that plans fetch-or-recompute reports it (its documented shape)."""
    return {
        "started_s": started_s,
        "fetch_plans": {
            "prefill": {"basis": f"{kind}: x", "kind": kind},
            "plans": {
                "recompute_s": recompute_s,
                "fetch_s": fetch_s,
                "saved_s": recompute_s - fetch_s,
                "fetch_chunks": chunks,
                "recompute_chunks": 1,
            },
        },
    }


def test_plan_rows_are_increases_even_when_saved_seconds_go_down() -> None:
    tracker = CounterTracker()
    (base,) = plan_rows(tracker, 3, 0, _plan_stats(2.0, 0.5, 10))
    assert base["saved_s"] == 0 and base["fetch_chunks"] == 0 and base["prefill_basis"] == "modeled"
    # a link overridden to "fetch" took chunks slower than recompute: saved_s fell 1.5 -> 1.0,
    # which is not a restart
    (row,) = plan_rows(tracker, 3, 10, _plan_stats(2.5, 1.5, 12, kind="measured"))
    assert row["recompute_s"] == 0.5 and row["fetch_s"] == 1.0 and row["saved_s"] == -0.5
    assert row["fetch_chunks"] == 2 and row["recompute_chunks"] == 0
    assert row["prefill_basis"] == "measured"
    # a restart (new epoch) counts the new process's figures from zero
    (row,) = plan_rows(tracker, 3, 20, _plan_stats(0.25, 0.05, 1, started_s=9.0))
    assert row["saved_s"] == 0.2 and row["fetch_chunks"] == 1


def test_plan_rows_need_fetch_plans_and_never_invent_a_basis() -> None:
    tracker = CounterTracker()
    assert plan_rows(tracker, 3, 0, {"started_s": 1.0}) == []  # an agent that does not plan
    odd = _plan_stats(1.0, 0.0, 1, kind="guessed")
    assert plan_rows(tracker, 3, 0, odd)[0]["prefill_basis"] == "unknown"


def test_plan_rows_record_the_prefill_inputs_the_agent_planned_with() -> None:
    """An agent started without --gpu plans on llama-3.1-8b on h100 whatever GPU its node has:
    the row says so, so its seconds are never priced at another GPU's board power."""
    tracker = CounterTracker()
    stats = _plan_stats(2.0, 0.5, 10)
    stats["fetch_plans"]["prefill"]["inputs"] = {  # type: ignore[index]
        "tokens_per_s": 20_000.0,
        "model": "llama-3.1-8b",
        "gpu": "H100",
    }
    (row,) = plan_rows(tracker, 3, 0, stats)
    assert (row["prefill_model"], row["prefill_gpu"]) == ("llama-3.1-8b", "h100")
    # a measured or configured rate names no GPU (the node's own): '' rather than a guess
    measured = _plan_stats(2.0, 0.5, 10, kind="measured")
    measured["fetch_plans"]["prefill"]["inputs"] = {"model": "Qwen/Qwen2.5-7B"}  # type: ignore[index]
    (row,) = plan_rows(CounterTracker(), 3, 0, measured)
    assert (row["prefill_model"], row["prefill_gpu"]) == ("Qwen/Qwen2.5-7B", "")
    (row,) = plan_rows(CounterTracker(), 3, 0, _plan_stats(1.0, 0.0, 1))  # an older agent
    assert (row["prefill_model"], row["prefill_gpu"]) == ("", "")
