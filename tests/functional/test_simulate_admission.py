"""`kvctl simulate --admission frequency` on one tier: admission gates only the tiers below the
first, so it changes nothing there; the run goes on (scripts pass it) but says so on stderr, and
not where a second tier makes it count."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()
SMALL = ("simulate", "--workload", "chat", "--limit", "40", "--policy", "lru", "--json")


def test_frequency_admission_on_one_tier_is_warned_of_and_the_report_still_printed() -> None:
    result = runner.invoke(app, [*SMALL, "--capacity-fraction", "0.1", "--admission", "frequency"])
    assert result.exit_code == 0, result.output
    assert "--admission frequency gates only the tiers below the first" in result.stderr
    assert json.loads(result.stdout)["admission"] == "frequency"


def test_no_warning_where_a_second_tier_makes_admission_count() -> None:
    result = runner.invoke(
        app, [*SMALL, "--tier", "cpu=20", "--tier", "disk=200", "--admission", "frequency"]
    )
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr
    assert json.loads(result.stdout)["admission"] == "frequency"


def test_no_warning_with_the_default_admission() -> None:
    result = runner.invoke(app, [*SMALL, "--capacity-fraction", "0.1"])
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr
