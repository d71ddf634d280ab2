"""`kvctl simulate --seeds N`: one generated workload's policies over N seeds, as users run it
(typer's CliRunner): the table of mean ± sd, the --json object, and what --seeds refuses."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from kvctl.cli import output
from kvctl.cli import simulate as simulate_cli
from kvctl.cli.main import app

runner = CliRunner()
#: small: every run here replays in about a second
ARGS = (
    "simulate", "-w", "system-prompt", "--limit", "20", "--seeds", "3",
    "--capacity-fraction", "0.05", "--capacity-fraction", "0.2", "--policy", "lineage-arc",
    "--policy", "lineage-adaptive",
)  # fmt: skip


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def test_json_is_the_documented_object() -> None:
    code, out = run(*ARGS, "--json")
    assert code == 0, out
    data = json.loads(out)
    assert list(data) == [
        "workload", "seeds", "capacity_fractions", "seeds_counted", "best_policy", "summary",
        "runs",
    ]  # fmt: skip
    assert data["workload"] == "system-prompt" and data["seeds"] == [0, 1, 2]
    assert data["capacity_fractions"] == [0.05, 0.2] and data["seeds_counted"] == [3, 3]
    rows = data["summary"]
    assert [r["policy"] for r in rows] == ["lineage-arc", "lineage-adaptive", "lru", "belady"]
    for r in rows:
        assert set(r) == {
            "policy", "of_belady", "of_belady_mean", "of_belady_stdev", "gap_to_best_mean",
            "gap_to_best_stdev", "best", "slowest_decisions_per_second",
        }  # fmt: skip
        for key in ("of_belady_mean", "of_belady_stdev", "gap_to_best_mean", "best"):
            assert len(r[key]) == 2
        assert [len(per_capacity) for per_capacity in r["of_belady"]] == [3, 3]
    for c, best in enumerate(data["best_policy"]):
        assert [r["policy"] for r in rows if r["best"][c]] == [best]
    # runs: per seed, the list of reports `simulate --json` prints, one per capacity
    assert [[x["trace"] for x in per_seed] for per_seed in data["runs"]] == [
        [f"system-prompt:seed={s}"] * 2 for s in (0, 1, 2)
    ]
    for s, per_seed in enumerate(data["runs"]):
        for c, report in enumerate(per_seed):
            results = {x["policy"]: x for x in report["results"]}
            for r in rows:
                assert r["of_belady"][c][s] == results[r["policy"]]["of_belady"]


def test_the_table_shows_mean_and_sd_of_each_policy_and_the_paired_gaps() -> None:
    code, out = run(*ARGS, "--json")
    assert code == 0, out
    data = json.loads(out)
    code, out = run(*ARGS)
    assert code == 0, out
    said = " ".join(out.split())  # titles and captions may wrap
    assert "system-prompt, 3 seeds (0..2): % of Belady" in said
    assert "mean ± sample standard deviation over 3 seeds (0..2)" in said
    assert "gap to the best mean" in said and "paired by seed" in said
    assert "lineage-adaptive" in out and "belady*" in out and "Belady hit ratio" in out
    for r in data["summary"]:
        for m, sd in zip(r["of_belady_mean"], r["of_belady_stdev"], strict=True):
            assert f"{m * 100:.1f} ± {sd * 100:.1f}" in out, r["policy"]


def test_the_best_mean_of_each_column_is_bold(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvctl.workload.seeds import simulate_seeds

    sweep = simulate_seeds(
        "system-prompt", [0, 1, 2], capacity_fractions=[0.05], policies=["lineage-arc"], limit=20
    )
    shown = io.StringIO()
    monkeypatch.setattr(
        simulate_cli, "console", Console(file=shown, force_terminal=True, width=200)
    )
    simulate_cli.render_seeds(sweep)
    best = sweep.policy(sweep.best_policy[0])
    cell = f"{best.of_belady_mean[0] * 100:.1f} ± {best.of_belady_stdev[0] * 100:.1f}"  # type: ignore[operator]
    assert f"\x1b[1m{cell}" in shown.getvalue()
    assert sweep.policy("belady").best == [False]  # never best: its cell is plain
    assert "\x1b[1m100.0" not in shown.getvalue()


def test_seeds_start_at_seed() -> None:
    code, out = run("simulate", "-w", "rag", "--limit", "10", "--seed", "5", "--seeds", "2",
                    "--policy", "lru", "--json")  # fmt: skip
    assert code == 0, out
    data = json.loads(out)
    assert data["seeds"] == [5, 6] and data["capacity_fractions"] == [0.1]  # the plain default
    assert [per_seed[0]["trace"] for per_seed in data["runs"]] == ["rag:seed=5", "rag:seed=6"]


def test_one_seed_is_todays_plain_run() -> None:
    args = ("simulate", "-w", "rag", "--limit", "10", "--seed", "3", "--policy", "lru", "--json")

    def timeless(text: str) -> object:
        data = json.loads(text)
        for r in data["results"]:
            del r["seconds"], r["decisions_per_second"]
        return data

    code, plain = run(*args)
    assert code == 0, plain
    code, one = run(*args, "--seeds", "1")
    assert code == 0, one
    assert timeless(one) == timeless(plain)


def test_progress_shows_without_json_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for json_out in (False, True):
        said = io.StringIO()  # stderr as a terminal, as TaskProgress decides
        monkeypatch.setattr(
            output, "err_console", Console(file=said, force_terminal=True, width=200)
        )
        code, out = run(*ARGS, *(["--json"] if json_out else []))
        assert code == 0, out
        assert ("simulating seed 0" in said.getvalue()) is not json_out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seeds", "0"], "--seeds takes a count of at least 1, got 0"),
        (["--seeds", "-2"], "--seeds takes a count of at least 1, got -2"),
        (["--seeds", "2", "--trace", "TRACE"], "a --trace is one sequence"),
        (["--seeds", "2", "--capacity-blocks", "5"], "do not carry across seeds"),
        (["--seeds", "2", "--tier", "cpu=5"], "do not carry across seeds"),
        (["--seeds", "2", "--tier", "cpu=5", "--json"], "do not carry across seeds"),
        # one cpu tier per run: frequency admission (tiers below the first) never applied
        (["--seeds", "2", "--admission", "frequency"], "--seeds runs one cpu tier"),
    ],
)
def test_what_seeds_cannot_mean_is_refused(tmp_path: Path, args: list[str], message: str) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n')
    args = [str(trace) if a == "TRACE" else a for a in args]
    code, out = run("simulate", "--limit", "5", *args)
    assert code == 2, out
    assert message in " ".join(out.split()) and "Traceback" not in out


def test_help_shows_a_seeds_example() -> None:
    code, out = run("simulate", "--help")
    assert code == 0
    assert "--sweep --seeds 10 --policy lineage-arc" in " ".join(out.split())


def test_progress_keeps_the_running_seed_in_view(monkeypatch: pytest.MonkeyPatch) -> None:
    # a bar per seed, every finished one kept: past the terminal's height, rich cropped the bars
    # to the first seeds and a "..." line, and the seed running was never shown again
    said = io.StringIO()
    monkeypatch.setattr(
        output, "err_console", Console(file=said, force_terminal=True, width=120, height=8)
    )
    code, out = run("simulate", "-w", "rag", "--limit", "5", "--seeds", "30", "--policy", "lru")
    assert code == 0, out
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", said.getvalue())
    assert "simulating seed 29" in shown
    assert "..." not in shown  # rich's line for the bars cropped off


def test_the_gap_caption_counts_the_seeds_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # 3 seeds, the third's Belady hit nothing: the gaps are over 2 seeds, their standard error
    # is sd / sqrt(2) (the caption said "over the 3 seeds" and "± / √3")
    from kvctl.workload.seeds import summarize_seeds
    from kvctl.workload.simulate import simulate
    from kvctl.workload.trace import TraceRequest

    def req(*ids: int) -> TraceRequest:
        return TraceRequest(0, 512 * len(ids), 1, tuple(ids), "")

    replays = [
        [req(1), req(1), req(2)],
        [req(1), req(1), req(1)],
        [req(1), req(2), req(3)],  # nothing used twice: Belady hits nothing
    ]
    reports = [[simulate(r, tiers={"cpu": 1}, policies=["lineage-lru"])] for r in replays]
    sweep = summarize_seeds("x", [0, 1, 2], [0.5], reports)
    assert sweep.seeds_counted == [2]
    shown = io.StringIO()
    monkeypatch.setattr(
        simulate_cli, "console", Console(file=shown, force_terminal=False, width=300)
    )
    simulate_cli.render_seeds(sweep)
    said = " ".join(shown.getvalue().split())
    assert "± / √2" in said and "√3" not in said
    assert "over the 3 seeds of (policy - best)" not in said
