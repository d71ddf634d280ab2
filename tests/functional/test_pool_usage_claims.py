"""A pool agent's usage as its HELLO reports it is another host's word: a node summed whatever
counts it held (negative ones showed the pool's usage below zero in the node's stats; a string
raised TypeError out of the link monitor's usage read). Counts that are not whole numbers >= 0
are refused whole (TierUnavailable naming the tier and the field); sound ones are summed."""

from __future__ import annotations

from typing import Any

import pytest

from kvctl.remote.agent_source import AgentSource
from kvctl.remote.pool import TierUnavailable
from tests.functional.hung import answering_hello_only


def _hello(**cpu: Any) -> dict[str, Any]:
    sound = {"capacity_bytes": 4096, "used_bytes": 1024, "chunks": 1}
    return {
        "tiers": ["cpu", "disk"],
        "usage": {"cpu": {**sound, **cpu}, "disk": {**sound, "used_bytes": 2048, "chunks": 2}},
    }


def test_sound_counts_are_summed_over_the_tiers() -> None:
    with answering_hello_only(hello=_hello()) as address:
        usage = AgentSource(address, timeout_s=2).usage()
    assert (usage.capacity_bytes, usage.used_bytes, usage.chunks) == (8192, 3072, 3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("used_bytes", -4096),
        ("chunks", -1),
        ("capacity_bytes", "4096"),
        ("used_bytes", 1.5),
        ("used_bytes", True),
        ("chunks", None),
        # past an int64 (what every count in kvctl is bounded by): 10**400 passed and made
        # `kvctl agent remote` fail on the node (OverflowError formatting the pool's bytes)
        pytest.param("used_bytes", 10**400, id="used_bytes-10**400"),
        pytest.param("capacity_bytes", 2**63, id="capacity_bytes-2**63"),
    ],
)
def test_a_count_that_is_not_one_is_refused_whole(field: str, value: Any) -> None:
    with (
        answering_hello_only(hello=_hello(**{field: value})) as address,
        pytest.raises(TierUnavailable, match=f"tier 'cpu' has {field} "),
    ):
        AgentSource(address, timeout_s=2).usage()


@pytest.mark.parametrize("usage", [[1, 2], {"cpu": 7}, "full"])
def test_a_usage_that_is_not_tiers_of_counts_is_refused(usage: Any) -> None:
    with (
        answering_hello_only(hello={"tiers": ["cpu"], "usage": usage}) as address,
        pytest.raises(TierUnavailable, match="not a count"),
    ):
        AgentSource(address, timeout_s=2).usage()


def test_tiers_whose_sum_is_past_an_int64_are_refused() -> None:
    """Each count fits, their sum does not: refused, as one count past it is."""
    half = {"capacity_bytes": 2**62, "used_bytes": 2**62, "chunks": 1}
    hello = {"tiers": ["cpu", "disk"], "usage": {"cpu": half, "disk": half}}
    with (
        answering_hello_only(hello=hello) as address,
        pytest.raises(TierUnavailable, match="past 2\\*\\*63 - 1"),
    ):
        AgentSource(address, timeout_s=2).usage()
