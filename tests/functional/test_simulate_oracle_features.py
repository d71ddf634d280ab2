"""`kvctl simulate --policy oracle-features` as users run it (typer's CliRunner): the --json
report holds the oracle, the same figures run to run, and the table marks it a partial oracle."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()
#: small: each replay takes a few seconds
ARGS = (
    "simulate", "--workload", "chat", "--limit", "200", "--capacity-fraction", "0.05",
    "--policy", "oracle-features",
)  # fmt: skip


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def _figures(out: str) -> list[dict[str, object]]:
    data = json.loads(out)
    return [
        {k: v for k, v in r.items() if k not in ("seconds", "decisions_per_second")}
        for r in data["results"]
    ]


def test_json_reports_the_oracle_the_same_every_run() -> None:
    code, out = run(*ARGS, "--json")
    assert code == 0, out
    figures = _figures(out)
    assert [r["policy"] for r in figures] == ["oracle-features", "lru", "belady"]
    oracle = figures[0]
    assert 0 < oracle["of_belady"] <= 1  # type: ignore[operator]
    code, again = run(*ARGS, "--json")
    assert code == 0, again
    assert _figures(again) == figures


def test_the_table_marks_it_a_partial_oracle() -> None:
    code, out = run(*ARGS)
    assert code == 0, out
    assert "oracle-features°" in out and "partial oracle" in out
    code, out = run("simulate", "--help")
    assert code == 0, out
    assert "oracle-features" in " ".join(out.split())
