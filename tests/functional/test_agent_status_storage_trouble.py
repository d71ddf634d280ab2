"""`kvctl agent status` says when storage under a tier went wrong: writes that met the disk
tier's filesystem full, chunk files skipped as unreadable at start, chunks dropped on the way
down a tier. Before, these were only in /v1/stats and /metrics: the table said "disk 45.8%"
over a filesystem that refused every write. An agent from before these counters shows none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.functional.test_agent_status_impossible_values import INFO, _agent_status
from tests.functional.test_collector_impossible_values import StandIn, _stats
from tests.functional.test_top_impossible_values import _strict


@pytest.fixture
def troubled() -> Iterator[StandIn]:
    stand_in = StandIn("n1")
    stats = _stats(10, 5, 1.0)
    stats["stats"]["demotion_failures"] = 3
    for name, tier in stats["stats"]["tiers"].items():
        tier["filesystem_full"] = 4 if name == "disk" else 0
        tier["unreadable_on_open"] = 2 if name == "disk" else 0
    stand_in.answers["/v1/stats"] = stats
    stand_in.answers["/v1/info"] = INFO
    try:
        yield stand_in
    finally:
        stand_in.close()


def test_json_has_the_storage_trouble_counters(troubled: StandIn) -> None:
    run = _agent_status(troubled.url, "--json")
    assert run.returncode == 0, run.stderr
    report = _strict(run.stdout)
    assert report["demotion_failures"] == 3
    assert report["tiers"]["disk"]["filesystem_full"] == 4
    assert report["tiers"]["disk"]["unreadable_on_open"] == 2
    assert report["tiers"]["cpu"]["filesystem_full"] == 0


def test_the_table_says_what_went_wrong_under_which_tier(troubled: StandIn) -> None:
    run = _agent_status(troubled.url)
    assert run.returncode == 0, run.stderr
    said = " ".join(run.stdout.split())
    assert "disk: 4 writes met its filesystem full" in said, said
    assert "2 chunk files unreadable at start, skipped (see the agent log)" in said, said
    assert "dropped 3 chunks on the way down a tier" in said, said
    assert "cpu:" not in said, said  # nothing went wrong there: nothing said


def test_an_agent_from_before_the_counters_shows_none() -> None:
    stand_in = StandIn("n1")
    try:
        stand_in.answers["/v1/stats"] = _stats(10, 5, 1.0)
        stand_in.answers["/v1/info"] = INFO
        report = _strict(_agent_status(stand_in.url, "--json").stdout)
        table = _agent_status(stand_in.url).stdout
    finally:
        stand_in.close()
    assert report["demotion_failures"] is None
    assert report["tiers"]["disk"]["filesystem_full"] is None
    assert "filesystem full" not in table and "on the way down" not in table
