"""A known history for the dashboard tests: three nodes in two DCs, figures worked out by hand
in the tests that use it."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from kvctl.db.analytics.counts import Assumptions
from kvctl.db.ingest import insert_rows
from kvctl.db.inventory import add_dc, add_link, add_node
from kvctl.db.models import raw_table
from kvctl.db.rollup import HOUR_MS, MINUTE_MS
from kvctl.profiles import MODELS

NOW = 1_700_000_000_000 // HOUR_MS * HOUR_MS + 37 * MINUTE_MS
T = NOW - 40 * MINUTE_MS  # inside the 1-hour window
OLD = NOW - 3 * HOUR_MS  # outside it

# prefill rates (tokens/s) of llama-3.1-8b at MFU 0.5, worked out from the profiles' figures
H100_RATE = 989e12 * 0.5 / (2 * 8.03e9)
A100_RATE = 312e12 * 0.5 / (2 * 8.03e9)
L4_RATE = 121e12 * 0.5 / (2 * 8.03e9)
ASSUME = Assumptions(MODELS["llama-3.1-8b"], default_gpu="a100", mfu=0.5)


def _cache(node: int, tier: str, ts: int, **counters: int) -> dict[str, Any]:
    row = {
        "node_id": node,
        "tier": tier,
        "ts_ms": ts,
        "lookups": 0,
        "lookup_tokens": 0,
        "hits": 0,
        "hit_tokens": 0,
        "reuse_hits": 0,
        "sharing_hits": 0,
        "evictions": 0,
        "promotions": 0,
        "demotions": 0,
        "bytes_read": 0,
        "bytes_written": 0,
        "used_bytes": 0,
        "capacity_bytes": 1000,
        "pinned_bytes": 0,
        "items": 0,
    }
    row.update(counters)
    return row


def fill_history(db: Engine) -> dict[str, int]:
    with db.begin() as conn:
        add_dc(conn, "fra", carbon_g_per_kwh=400.0, pue=1.5, location="Frankfurt")
        add_dc(conn, "ams")  # no grid intensity, no PUE
        ids = {
            "fra-a": add_node(
                conn, "fra-a", dc="fra", agent_url="http://127.0.0.1:1", gpu_model="NVIDIA H100"
            ),
            "fra-b": add_node(conn, "fra-b", dc="fra", agent_url="http://127.0.0.1:2"),
            "ams-a": add_node(
                conn, "ams-a", dc="ams", agent_url="http://127.0.0.1:3", gpu_model="L4"
            ),
        }
        add_link(conn, "fra", "ams", distance_km=100.0)
        a, b, c = ids["fra-a"], ids["fra-b"], ids["ams-a"]
        cache = [
            # fra-a: two samples in the window, one before it (must not count)
            _cache(a, "all", OLD, lookups=999, hits=999, hit_tokens=999),
            _cache(a, "all", T, lookups=60, lookup_tokens=15360, hits=40, hit_tokens=10240,
                   reuse_hits=30, sharing_hits=10, evictions=5),
            _cache(a, "all", T + 10 * MINUTE_MS, lookups=40, lookup_tokens=10240, hits=20,
                   hit_tokens=5120, reuse_hits=10, sharing_hits=10, evictions=2),
            _cache(a, "cpu", T, hits=30, hit_tokens=7680, reuse_hits=25, sharing_hits=5,
                   used_bytes=400),
            _cache(a, "cpu", T + 10 * MINUTE_MS, hits=15, hit_tokens=3840, reuse_hits=10,
                   sharing_hits=5, used_bytes=600),
            _cache(a, "disk", T, hits=10, hit_tokens=2560, reuse_hits=5, sharing_hits=5,
                   used_bytes=100, capacity_bytes=4000),
            _cache(a, "disk", T + 10 * MINUTE_MS, hits=5, hit_tokens=1280, used_bytes=300,
                   capacity_bytes=4000),
            _cache(b, "all", T, lookups=50, lookup_tokens=12800, hits=10, hit_tokens=2560,
                   reuse_hits=10),
            _cache(b, "cpu", T, hits=10, hit_tokens=2560, reuse_hits=10, used_bytes=900),
            _cache(c, "all", T + 5 * MINUTE_MS, lookups=40, lookup_tokens=10240, hits=30,
                   hit_tokens=7680, sharing_hits=30, evictions=1),
            _cache(c, "cpu", T + 5 * MINUTE_MS, hits=30, hit_tokens=7680, sharing_hits=30,
                   used_bytes=250),
        ]  # fmt: skip
        insert_rows(conn, raw_table("cache_sample"), cache)
        node = [
            {"node_id": n, "ts_ms": ts, "up": up, "scrape_seconds": 0.01,
             "agent_started_s": started, "nvml_available": False, "error": err}
            for n, ts, up, started, err in (
                (a, T, True, 100.0, None),
                (a, T + 10 * MINUTE_MS, True, 100.0, None),
                (a, T + 20 * MINUTE_MS, False, None, "connection refused"),
                (a, T + 30 * MINUTE_MS, True, 200.0, None),
                (b, T, True, 50.0, None),
                (c, T + 5 * MINUTE_MS, True, 70.0, None),
            )
        ]  # fmt: skip
        insert_rows(conn, raw_table("node_sample"), node)
        power = [
            {"node_id": a, "gpu_index": 0, "ts_ms": T, "power_w": 500.0, "energy_j": 1.8e6},
            {"node_id": a, "gpu_index": 0, "ts_ms": T + 10 * MINUTE_MS, "power_w": 700.0,
             "energy_j": 1.8e6},
            {"node_id": a, "gpu_index": 0, "ts_ms": OLD, "power_w": 1.0, "energy_j": 9e9},
        ]  # fmt: skip
        insert_rows(conn, raw_table("power_sample"), power)
        engine = [
            {"node_id": a, "ts_ms": T, "engine": "vllm", "prompt_tokens": 10_000,
             "cached_prompt_tokens": 4_000, "generation_tokens": 2_000, "requests": 10,
             "ttft_count": 10, "ttft_sum_s": 2.0},
        ]  # fmt: skip
        insert_rows(conn, raw_table("engine_sample"), engine)
        link = [
            {"src_node_id": a, "dst_node_id": c, "ts_ms": T, "rtt_s": 0.002,
             "bandwidth_bytes_per_s": 1e9, "loss_ratio": 0.0, "probe_bytes": 1, "ok": True},
            {"src_node_id": c, "dst_node_id": a, "ts_ms": T + MINUTE_MS, "rtt_s": 0.004,
             "bandwidth_bytes_per_s": 3e9, "loss_ratio": 0.0, "probe_bytes": 1, "ok": True},
            {"src_node_id": a, "dst_node_id": c, "ts_ms": T + 2 * MINUTE_MS, "rtt_s": None,
             "bandwidth_bytes_per_s": None, "loss_ratio": None, "probe_bytes": 0, "ok": False,
             "error": "timed out"},
        ]  # fmt: skip
        insert_rows(conn, raw_table("link_sample"), link)
    return ids
