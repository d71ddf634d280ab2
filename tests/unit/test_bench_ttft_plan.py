"""`kvctl bench ttft`'s brief of the agent's last fetch-or-recompute plan: a plan that asked no
source (the best link could not beat the prefill) says how many chunks it recomputed so, or a
loaded machine's sample reads as a plan of no chunks at all (the fresh-clone CI's 0 + 0 of 8)."""

from __future__ import annotations

from typing import Any

from kvctl.bench.ttft import _last_plan

UNASKED = {
    "type": "fetch_plan",
    "reason": "unasked",
    "chunks": 8,
    "fetch": 0,
    "recompute": 0,
    "unasked": 8,
    "missed": 0,
    "links": {"pool": {"rtt_s": 0.002, "bandwidth_bytes_per_s": 1e8, "source": "measured"}},
    "prefill": {"tokens_per_s": 5e4, "basis": "measured"},
}


class _Control:
    """The agent's /v1/remote answer, as the bench reads it."""

    def __init__(self, lookups: int, last: dict[str, Any]) -> None:
        self.answer = {"plans": {"lookups": lookups}, "last_plan": last}

    def remote(self) -> dict[str, Any]:
        return self.answer


def test_a_plan_that_asked_no_source_counts_its_chunks() -> None:
    plan = _last_plan(_Control(3, UNASKED), (2, None))
    assert plan is not None
    counts = ("fetch_chunks", "recompute_chunks", "unasked_chunks", "missed_chunks")
    assert [plan[k] for k in counts] == [0, 0, 8, 0]


def test_no_new_plan_is_none() -> None:
    assert _last_plan(_Control(2, UNASKED), (2, UNASKED)) is None
