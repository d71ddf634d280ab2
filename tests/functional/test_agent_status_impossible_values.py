"""`kvctl agent status` and an agent answering figures that cannot be true (NaN, Infinity), as
`kvctl status` and `kvctl top` have them: the figure is unknown (None, N/A) and named, the rest
shown. Before, the command failed on the first one with "kvctl failed where it did not expect
to: ValueError: cannot convert float NaN to integer", calling it a bug in kvctl."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from tests.functional.test_collector_impossible_values import StandIn, _stats
from tests.functional.test_status_impossible_values import BAD_READS, READS
from tests.functional.test_top_impossible_values import _strict

#: what `kvctl agent status` renders of /v1/info (a real agent says more)
INFO = {
    "name": "n1",
    "dc": "fra",
    "pid": 4242,
    "version": "0.1.0",
    "started_s": 1.0,
    "dataplane": {"tcp": "127.0.0.1:9", "unix": None, "shm": False},
    "tiers": [
        {"name": t, "capacity_bytes": 1 << 30, "used_bytes": 0, "chunks": 0, "pinned_bytes": 0}
        for t in ("cpu", "disk")
    ],
}
runner = CliRunner()


@pytest.fixture
def agent() -> Iterator[StandIn]:
    stand_in = StandIn("n1")
    stats = _stats(10, 5, 1.0)
    stats["stats"]["lookup_chunks"] = math.nan
    stats["stats"]["tiers"]["cpu"]["hits"] = math.inf
    stand_in.answers["/v1/stats"] = stats
    stand_in.answers["/v1/info"] = INFO
    try:
        yield stand_in
    finally:
        stand_in.close()


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


def _agent_status(url: str, *args: str) -> Run:
    """``kvctl agent status`` in this process (a new process each call took ~1.8 s of the
    file's ~50; test_agent_status_json_in_a_process_of_its_own keeps one real process)."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("KVCTL_")}
    out = runner.invoke(app, ["agent", "status", "--url", url, *args], env=env | {"COLUMNS": "200"})
    if out.exception is not None and not isinstance(out.exception, SystemExit):
        raise out.exception
    return Run(out.exit_code, out.stdout, out.stderr)


def test_agent_status_json_has_impossible_figures_unknown_and_named(agent: StandIn) -> None:
    run = _agent_status(agent.url, "--json")
    assert run.returncode == 0, run.stderr
    report = _strict(run.stdout)
    assert report["up"] is True
    assert report["lookups"] is None and report["hit_ratio"] is None  # over an unknown count
    assert report["hits"] == 5 and report["lookup_requests"] == 10  # the rest stands
    assert report["tiers"]["cpu"]["hits"] is None and report["tiers"]["disk"]["hits"] == 0
    assert set(report["rejected"]) == {"stats.lookup_chunks", "stats.tiers.cpu.hits"}


def test_agent_status_json_in_a_process_of_its_own(agent: StandIn) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    argv = [sys.executable, "-m", "kvctl", "agent", "status", "--url", agent.url, "--json"]
    run = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr
    assert set(_strict(run.stdout)["rejected"]) == {"stats.lookup_chunks", "stats.tiers.cpu.hits"}


def test_agent_status_table_shows_n_a_and_names_the_fields(agent: StandIn) -> None:
    run = _agent_status(agent.url)
    assert run.returncode == 0, run.stderr
    said = " ".join(run.stdout.split())
    assert "lookups N/A in 10 requests" in said and "hit ratio N/A" in said, said
    assert "2 value(s) rejected as impossible, shown N/A" in said, said
    assert "stats.lookup_chunks (not finite)" in said, said


def test_agent_status_rejects_impossible_read_counts(agent: StandIn) -> None:
    """Read counts that cannot be true are unknown and named, as `kvctl status` has them (the
    same checks, test_status_impossible_values.py), not shown as said; sound ones carry the
    share gone under the name `kvctl status --json` gives it."""
    stats = agent.answers["/v1/stats"]
    for dataplane, rejected in BAD_READS:
        agent.answers["/v1/stats"] = {**stats, "dataplane": dataplane}
        run = _agent_status(agent.url, "--json")
        assert run.returncode == 0, (dataplane, run.stderr)
        report = _strict(run.stdout)
        assert [report[k] for k in READS] == [None, None, None], dataplane
        assert set(rejected) <= set(report["rejected"]), (dataplane, report["rejected"])
        table = _agent_status(agent.url)
        assert table.returncode == 0, (dataplane, table.stderr)
        assert "were not here" not in table.stdout, (dataplane, table.stdout)
    sound = {"read_chunks": 8, "read_missing_chunks": 2}
    agent.answers["/v1/stats"] = {**stats, "dataplane": sound}
    report = _strict(_agent_status(agent.url, "--json").stdout)
    assert [report[k] for k in READS] == [8, 2, 0.25]


@pytest.mark.parametrize("bad", ["3", -1, math.nan, True, [1]])
def test_agent_status_rejects_impossible_refused_put_counts(agent: StandIn, bad: object) -> None:
    """The PUT chunks refused (damaged, no room): a count that cannot be true is unknown and
    named, not a crash formatting it nor a figure shown as said."""
    stats = agent.answers["/v1/stats"]
    agent.answers["/v1/stats"] = {**stats, "dataplane": {"corrupt_puts": bad, "no_room_puts": 4}}
    run = _agent_status(agent.url, "--json")
    assert run.returncode == 0, run.stderr
    report = _strict(run.stdout)
    assert (report["corrupt_puts"], report["no_room_puts"]) == (None, 4)
    assert "dataplane.corrupt_puts" in report["rejected"], report["rejected"]
    table = _agent_status(agent.url)
    assert table.returncode == 0, table.stderr
    said = " ".join(table.stdout.split())
    assert "whose bytes did" not in said and "refused 4 PUT chunks for want of room" in said, said
