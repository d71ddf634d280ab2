"""The demo's printed summary: a ratio with nothing to divide (an empty workload's unlimited
cache) reads N/A, as everywhere else, not 0.0%."""

from __future__ import annotations

from kvctl.cli.demo import _print_sharing
from kvctl.cli.output import console


def _summary(unlimited: float | None) -> str:
    result = {
        "requests": 10,
        "sharing": {
            "with_sharing": {"hit_ratio": 0.5},
            "without_sharing": {"hit_ratio": 0.25},
            "hit_ratio_gain": 0.25,
            "unlimited_cache_hit_ratio": unlimited,
            "block_tokens": 256,
        },
    }
    with console.capture() as cap:
        _print_sharing(result)
    return " ".join(cap.get().split())


def test_unknown_unlimited_cache_hit_ratio_reads_na_not_zero() -> None:
    assert "an unlimited cache: N/A" in _summary(None)
    assert "an unlimited cache: 62.5%" in _summary(0.625)
