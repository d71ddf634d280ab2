"""``kvctl.ratios.HitCounts``: the one place where a ratio over an unknown count is unknown,
which `kvctl status`, `kvctl agent status` and `kvctl top` all report through."""

from __future__ import annotations

import itertools

import pytest

from kvctl.ratios import HIT_COUNT_NAMES, RATIO_NAMES, RATIO_OF, HitCounts


def test_every_ratio_says_which_counts_it_divides() -> None:
    assert set(RATIO_OF) == set(RATIO_NAMES)
    assert {name for pair in RATIO_OF.values() for name in pair} == HIT_COUNT_NAMES


def test_known_counts_give_every_ratio() -> None:
    figures = HitCounts(lookups=10, hits=4, reuse_hits=3, sharing_hits=1).hit_figures()
    assert figures["hit_ratio"] == pytest.approx(0.4)
    assert figures["reuse_hit_ratio"] == pytest.approx(0.3)
    assert figures["sharing_hit_ratio"] == pytest.approx(0.1)
    assert figures["reuse_share_of_hits"] == pytest.approx(0.75)
    assert figures["sharing_share_of_hits"] == pytest.approx(0.25)
    assert HitCounts().hit_ratio is None  # no lookups: unknown, not zero


@pytest.mark.parametrize(
    "unknown",
    [frozenset(c) for n in (1, 2) for c in itertools.combinations(sorted(HIT_COUNT_NAMES), n)],
)
def test_a_ratio_over_an_unknown_count_is_unknown_and_the_rest_stand(
    unknown: frozenset[str],
) -> None:
    counts = HitCounts(lookups=10, hits=4, reuse_hits=3, sharing_hits=1, unknown=unknown)
    figures = counts.hit_figures()
    for name in unknown:
        assert figures[name] is None, name
    for name in HIT_COUNT_NAMES - unknown:
        assert figures[name] == getattr(counts, name), name
    for name, (num, den) in RATIO_OF.items():
        if {num, den} & unknown:
            assert figures[name] is None, name
        else:
            assert figures[name] == getattr(counts, num) / getattr(counts, den), name


def test_a_sum_takes_all_four_hit_counts_or_none() -> None:
    total = HitCounts()
    total.add_hits(HitCounts(lookups=10, hits=4, reuse_hits=3, sharing_hits=1))
    # one count unknown: none of its four are added (never hits over another set's lookups)
    total.add_hits(HitCounts(lookups=5, hits=5, reuse_hits=5, unknown=frozenset({"sharing_hits"})))
    assert (total.lookups, total.hits, total.reuse_hits, total.sharing_hits) == (10, 4, 3, 1)
    assert HitCounts(unknown=frozenset({"hits"})).summed_unknown == HIT_COUNT_NAMES
    assert HitCounts(unknown=frozenset({"other"})).summed_unknown == {"other"}


def test_a_hit_moved_between_reuse_and_sharing_is_not_impossible() -> None:
    """An agent moves a hit from reuse to sharing when its copy arrives (up to 30 s after the
    lookup): a span can hold the move (sharing +4) without its hit or lookup. Before, such a
    span read as impossible, and a node's bucket or window was left out of the sums, lookups
    included. More hits than lookups still is."""
    from kvctl.ratios import HitCounts

    assert not HitCounts(0, 0, 0, 4).impossible
    assert not HitCounts(10, 2, 0, 4).impossible
    assert HitCounts(1, 2, 2, 0).impossible
