"""`kvctl bench top`'s pieces that need no agent: the spread of samples, and bad input refused
before anything starts."""

from __future__ import annotations

import statistics

import pytest
from typer.testing import CliRunner

from kvctl.bench.top import run_top_bench, spread
from kvctl.cli.main import app
from kvctl.errors import InvalidArgument


def test_spread_is_min_median_nearest_rank_p95_max_and_keeps_the_samples() -> None:
    samples = [float(x) for x in range(20, 0, -1)]  # 20..1, unsorted on purpose
    s = spread(samples)
    assert s["samples"] == samples
    assert (s["min"], s["max"]) == (1.0, 20.0)
    assert s["median"] == statistics.median(samples) == 10.5
    assert s["p95"] == 19.0  # the 19th of 20: nearest rank
    one = spread([0.25])
    assert one["min"] == one["median"] == one["p95"] == one["max"] == 0.25


@pytest.fixture
def no_agents(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("bad input must be refused before any agent starts")

    monkeypatch.setattr("kvctl.agent.daemon.spawn_agent", refuse)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"agents": 0}, "--agents must be at least 1"),
        ({"agents": -3}, "--agents must be at least 1"),
        ({"interval_s": 0.0}, "--interval must be a positive"),
        ({"interval_s": -1.0}, "--interval must be a positive"),
        ({"interval_s": float("nan")}, "--interval must be a positive"),
        ({"seconds": 0.0}, "--seconds must be a positive"),
        ({"cycles": 0}, "cycles must be at least 1"),
    ],
)
def test_bad_input_is_refused_before_anything_starts(
    no_agents: None, kwargs: dict[str, float], words: str
) -> None:
    with pytest.raises(InvalidArgument, match=words):
        run_top_bench(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--agents", "0"], "--agents must be at least 1, got 0"),
        (["--interval", "0"], "--interval must be a positive number of seconds, got 0.0"),
        (["--interval", "-2", "--json"], "--interval must be a positive number of seconds"),
        (["--seconds", "-1"], "--seconds must be a positive number of seconds, got -1.0"),
    ],
)
def test_cli_bad_input_is_one_clear_line_and_exit_code_2(
    no_agents: None, args: list[str], words: str
) -> None:
    result = CliRunner().invoke(app, ["bench", "top", *args])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and words in result.output
    assert "Traceback" not in result.output


def test_cli_help_has_examples() -> None:
    result = CliRunner().invoke(app, ["bench", "top", "--help"])
    assert result.exit_code == 0
    for option in ("--agents", "--interval", "--seconds", "--json"):
        assert option in result.output
    assert "kvctl bench top --json" in result.output
