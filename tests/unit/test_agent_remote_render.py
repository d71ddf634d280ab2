"""`kvctl agent remote`'s table during an outage: the pool's usage, kept from its last read,
says how old it is, and each source shows its late answers and the chunks that failed their
check (a review read a stale "7 MiB of 1 GiB" as current while the pool was down)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvctl.cli.agent import _render_remote


def _source(name: str, tier: str, *, up: bool) -> dict[str, Any]:
    return {
        "name": name, "tier": tier, "address": "127.0.0.1:1", "up": up,
        "last_error": "" if up else "connection refused",
        "breaker": {"state": "closed" if up else "open", "retry_in_s": 1.0},
        "link": {"rtt_s": 0.001, "rtt_basis": "measured", "bandwidth_bytes_per_s": 1e9,
                 "override": ""},
        "chunks_in": 3, "chunks_out": 0, "errors": 0 if up else 2, "late": 5, "overdue": 6,
        "corrupt": 4,
    }  # fmt: skip


def _report(pool_up: bool, read_ago_s: float) -> dict[str, Any]:
    return {
        "configured": True, "role": "node", "pool": _source("pool", "remote", up=pool_up),
        "peers": [], "index": None,
        "pool_usage": {"used_bytes": 7 << 20, "capacity_bytes": 1 << 30, "chunks": 25},
        "pool_usage_read_s": time.time() - read_ago_s,
        "plans": {"lookups": 0, "fetch_chunks": 0, "recompute_chunks": 0, "reasons": {},
                  "saved_s": 0.0},
        "prefill": {"basis": "modeled", "tokens_per_s": 1000.0},
        "write": {"mode": "write-through", "written": 0, "queued": 0, "failed": 0,
                  "dropped": 0, "refused": 2},
    }  # fmt: skip


def test_a_down_pools_usage_says_how_old_it_is(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    _render_remote(_report(pool_up=False, read_ago_s=42))
    out = capsys.readouterr().out
    assert "7 MiB of 1 GiB, 25 chunks (read 42 s ago; the pool is not answering)" in out
    assert "5/6/4" in out  # late/overdue/corrupt
    assert "short of local room" not in out
    assert "refused 2" in out  # writes the pool refused (damaged on the way, or no room)
    _render_remote(_report(pool_up=True, read_ago_s=3))
    assert "read 3 s ago" not in capsys.readouterr().out  # a pool that answers: current


def test_pulls_short_of_room_are_shown(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    _render_remote({**_report(pool_up=True, read_ago_s=1), "pull": {"no_room_chunks": 12}})
    assert "pulls short of local room: 12 chunks not kept" in capsys.readouterr().out


def test_counts_an_older_agent_does_not_keep_show_as_dashes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent of an earlier version reports no ``overdue``: a rolling upgrade's operator must
    not read its 0 as "none cut" (a review saw 0/0/0 for an agent that counts no such thing)."""
    monkeypatch.setenv("COLUMNS", "200")
    report = _report(pool_up=True, read_ago_s=1)
    del report["pool"]["overdue"]
    _render_remote(report)
    assert "5/-/4" in capsys.readouterr().out
