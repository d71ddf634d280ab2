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


def test_the_unlimited_cache_is_said_to_bound_the_per_block_figures_only() -> None:
    """Its per-block ceiling stood next to the replay's per-chunk hit ratio, which can pass
    it (a 256-token chunk reuses half a 512-token block): it read as a ceiling below what was
    achieved."""
    said = _summary(0.721)
    assert "a ceiling of these, not of the replay's hit ratio above, counted per chunk" in said


def test_tiers_held_to_the_cap_say_what_that_costs() -> None:
    from kvctl.cli.demo import sizing_text
    from kvctl.fleet.demo import TierSizing

    capped = sizing_text(
        TierSizing(100, 400, 3 << 30, 256 << 20, 1 << 30, 512 << 20, ("pool",)), 1.0
    )
    assert capped.endswith(
        "the pool 512 MiB (pool held to the demo's cap, below the working set: some reuse is "
        "evicted before it comes back)"
    ), capped
    assert sizing_text(TierSizing(1, 1, 1, 1, 1, 1, ()), 1.0).endswith("the pool 1 B")
