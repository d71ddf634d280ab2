"""The replay's view of the agents' own pulls: /v1/remote readings before and after a run,
grouped by the DC link they crossed; and which locations a node holds itself."""

from __future__ import annotations

from typing import Any

import pytest

from kvctl.workload.routed import (
    PullTally,
    RouterChooser,
    RoutingTally,
    held_locally,
    pulls_between,
)

NODE_DC = {"fra-a": "fra", "fra-b": "fra", "ams-a": "ams"}


def test_pulls_are_the_increases_grouped_by_link() -> None:
    before = {
        "fra-a": {"pool": (10, 1000), "fra-b": (0, 0), "ams-a": (5, 500)},
        "ams-a": {"pool": (0, 0), "fra-a": (0, 0)},
    }
    after = {
        "fra-a": {"pool": (10, 1000), "fra-b": (3, 300), "ams-a": (7, 700)},
        "ams-a": {"pool": (4, 400), "fra-a": (1, 100)},
        # a node first read after the run: everything it took in counts
        "fra-b": {"pool": (2, 200)},
    }
    pulls = pulls_between(before, after, NODE_DC, {"pool": "fra"})
    assert {k: (v.chunks, v.bytes, v.cross_dc) for k, v in pulls.by_link.items()} == {
        "fra": (3 + 2, 300 + 200, False),
        "ams<->fra": (2 + 4 + 1, 200 + 400 + 100, True),
    }
    assert pulls.cross_dc_bytes == 700 and pulls.within_dc_bytes == 500
    # nothing moved from fra-a's pool: no row for it
    assert pulls.by_node["fra-a"] == {
        "fra-b": {"chunks": 3, "bytes": 300, "dc": "fra"},
        "ams-a": {"chunks": 2, "bytes": 200, "dc": "ams"},
    }
    out = pulls.as_dict()
    assert out["basis"].startswith("measured")
    assert out["by_link"]["ams<->fra"] == {"cross_dc": True, "chunks": 7, "bytes": 700}
    assert out["unknown_dc_sources"] == []


def test_a_source_of_unknown_dc_is_named_so() -> None:
    pulls = pulls_between({}, {"ams-a": {"pool": (1, 64)}}, NODE_DC, {})
    assert set(pulls.by_link) == {"?pool<->ams"}
    assert pulls.as_dict()["unknown_dc_sources"] == ["pool"]
    assert PullTally().as_dict()["by_link"] == {}


def test_held_locally() -> None:
    assert held_locally("cpu") and held_locally("disk") and held_locally("gpu")
    assert not held_locally("peer") and not held_locally("remote") and not held_locally(None)


def test_routing_tally_ratio_is_unknown_without_decisions() -> None:
    assert RoutingTally().as_dict()["to_holder_ratio"] is None
    tally = RoutingTally(decisions=4, to_holder=3, fallbacks=1)
    out = tally.as_dict()
    assert out["to_holder_ratio"] == 0.75 and out["fallbacks"] == 1
    assert out["planned_basis"].startswith("modeled")


class _Answering:
    """A router (``RouteAsker``) that answers every route with ``answer``."""

    def __init__(self, answer: dict[str, Any]) -> None:
        self.answer = answer

    def route(self, **_: Any) -> dict[str, Any]:
        return self.answer


def _choose(answer: dict[str, Any], chunks: int = 4) -> tuple[str | None, RoutingTally]:
    chooser = RouterChooser(_Answering(answer))
    keys = [bytes([i]) * 16 for i in range(chunks)]
    node = chooser.choose(keys, tenant="t", home_dc="fra", prompt_tokens=512 * chunks,
                          nodes=NODE_DC)  # fmt: skip
    return node, chooser.tally


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("local_chunks", "many"),  # int(): ValueError, the replay stopped at this request
        ("local_chunks", float("inf")),  # JSON 1e400: int() raised OverflowError (a bug's line)
        ("pulled_chunks", [1]),  # int(): TypeError (a bug's line)
        ("pulled_chunks", -2),  # counted into planned_pulled_chunks as it came
        ("local_chunks", True),
    ],
)
def test_a_router_answer_whose_counts_are_no_counts_is_a_fallback(field: str, value: Any) -> None:
    node, tally = _choose({"node": "ams-a", "local_chunks": 1, "pulled_chunks": 0, field: value})
    assert node is None
    assert (tally.fallbacks, tally.decisions, tally.planned_pulled_chunks) == (1, 0, 0)
    assert f"{field} {value!r}, not a count of chunks" in tally.last_error


def test_a_router_answer_is_counted() -> None:
    node, tally = _choose({"node": "ams-a", "local_chunks": 2, "pulled_chunks": 3})
    assert node == "ams-a"
    assert (tally.decisions, tally.to_holder, tally.other_dc) == (1, 1, 1)
    assert tally.planned_pulled_chunks == 3 and tally.by_node == {"ams-a": 1}
    node, tally = _choose({"node": "fra-b", "local_chunks": None})  # counts left out: none
    assert node == "fra-b" and (tally.to_holder, tally.other_dc) == (0, 0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("pulled_chunks", 10**400),  # summed into planned_pulled_chunks as it came
        ("pulled_chunks", 5),  # one past the 4 chunks asked about
        ("local_chunks", 2**63),
    ],
    ids=["pulled-10**400", "pulled-one-past", "local-2**63"],
)
def test_a_router_answer_counting_more_chunks_than_asked_about_is_a_fallback(
    field: str, value: int
) -> None:
    """A router's plan holds or pulls at most the chunks of the chain it was asked about: a
    count past them is no router's answer (found by a review: 10**400 pulled chunks were
    counted into the replay's planned pulls)."""
    node, tally = _choose({"node": "ams-a", "local_chunks": 1, "pulled_chunks": 0, field: value})
    assert node is None
    assert (tally.fallbacks, tally.decisions, tally.planned_pulled_chunks) == (1, 0, 0)
    assert f"{field} {value!r:.40}" in tally.last_error
    assert "more than the 4 chunks asked about" in tally.last_error
    node, tally = _choose({"node": "ams-a", "local_chunks": 4, "pulled_chunks": 4})  # all of it
    assert node == "ams-a" and tally.planned_pulled_chunks == 4
