"""`kvctl plan` as users run it, through typer's CliRunner on an app holding just the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvctl.cli.plan import plan_command

app = typer.Typer()
app.command("plan")(plan_command)


@app.command("noop")
def _noop() -> None:
    """A second command, so `plan` stays a subcommand as in kvctl."""


runner = CliRunner()
# llama-3.1-8b: a 512-token block is 64 MiB of KV; these sizes hold 8, 48 and 4,096 blocks
SMALL = ["--cpu", "512MiB", "--disk", "3GiB", "--remote", "256GiB"]


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["plan", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output


def write_trace(path: Path, n: int = 80) -> Path:
    lines = []
    for i in range(n):
        shared = [0, 1, 2, 3] if i % 2 == 0 else [10, 11, 12]
        # prefix hashes: an id names its whole prefix, so the 7 recurring blocks after each
        # shared prefix have ids of their own (the same ids after both read as content hashes)
        ids = [*shared, 1000 * shared[0] + 100 + i % 7, 200 + i]
        lines.append(
            json.dumps(
                {
                    "timestamp": i * 10,
                    "input_length": 512 * len(ids) - 100,
                    "output_length": 5,
                    "hash_ids": ids,
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def test_help_has_examples() -> None:
    code, out = run("--help")
    assert code == 0
    assert "Examples:" in out and "kvctl plan --trace" in out
    for option in ("--cpu", "--disk", "--remote", "--distance-km", "--model", "--gpu", "--mfu",
                   "--policy", "--curve-points", "--workload", "--json"):  # fmt: skip
        assert option in out
    assert plan_command.__doc__ and "Examples:" in plan_command.__doc__


def test_table_on_a_generated_workload() -> None:
    code, out = run("--workload", "chat", "--limit", "150", *SMALL, "--curve-points", "6")
    assert code == 0, out
    assert "chat:seed=0: 150 requests" in out
    for name in ("no cache", "cpu+disk+remote@10km", "cpu+disk+remote@50km",
                 "cpu+disk+remote@100km"):  # fmt: skip
        assert name in out
    assert "hit ratio by tier (simulated" in out
    assert "TTFT per request and prefill energy (modeled" in out
    assert "moving one block to GPU memory" in out and "fetch (to 1,121 km)" in out
    assert "miss-ratio curve" in out and "lineage-lru" in out and "█" in out
    # the inputs of the modeled figures
    assert "llama-3.1-8b" in out and "h100" in out and "MFU 0.5" in out
    assert "12.5" in out and "50+1,000" in out  # the pool's GB/s; latency + fiber at 100 km
    assert "prefill compute only" in out


def test_json_from_a_trace(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    code, out = run(
        "--trace", str(trace), *SMALL, "--json", "--distance-km", "25", "--policy", "lru",
        "--model", "qwen2.5-7b", "--gpu", "a100", "--mfu", "0.4",
    )  # fmt: skip
    assert code == 0, out
    d = json.loads(out)
    assert d["workload"] == str(trace) and d["requests"] == 80
    assert d["policy"] == "lru" and d["block_tokens"] == 512
    assert d["block_bytes"] == 512 * 57_344  # qwen2.5-7b KV bytes per token
    assert d["tiers_blocks"] == {"cpu": 18, "disk": 109, "remote": 9362}
    m = d["modeled_inputs"]
    assert m["basis"] == "modeled" and m["mfu"] == 0.4
    assert m["model"]["name"] == "qwen2.5-7b" and m["gpu"]["name"] == "a100"
    assert m["transfers"]["remote"]["bandwidth_bytes_per_second"] == 12.5e9
    names = [c["name"] for c in d["candidates"]]
    assert names == ["cpu", "cpu+disk", "cpu+disk+remote", "cpu+disk+remote@25km"]
    for c in d["candidates"]:
        assert c["modeled"]["basis"] == "modeled"
        assert 0 < c["simulated"]["hit_ratio"] <= 1
        assert c["modeled"]["mean_ttft_seconds"] <= d["baseline"]["mean_ttft_seconds"]
    ratios = [c["simulated"]["hit_ratio"] for c in d["candidates"]]
    assert ratios == sorted(ratios)
    curve = d["miss_ratio_curve"]
    assert curve["policies"] == ["lru"]  # the chosen policy is LRU: one curve
    lru = [p["lru_hit_ratio"] for p in curve["points"]]
    assert len(lru) >= 5 and lru == sorted(lru)
    assert curve["points"][-1]["capacity_blocks"] == d["unique_blocks"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["--policy", "fifo"], "unknown policy 'fifo'"),
        (["--cpu", "12XB"], "--cpu: unknown size unit"),
        (["--disk", "lots"], "--disk: not a size"),
        (["--cpu", "1MiB"], "holds less than one block"),
        (["--mfu", "1.5"], "'--mfu'"),
        (["--distance-km", "-3"], "distance"),
        (["--trace", "/nonexistent/trace.jsonl"], "no such file"),
        (["--workload", "nope"], "nope"),
        (["--curve-points", "1"], "2 points"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(args: list[str], message: str) -> None:
    code, out = run("--limit", "20", *args)
    assert code == 2, out
    assert message in out
    assert "Traceback" not in out


def test_shared_trace(shared_trace: Path) -> None:
    from kvctl.workload.trace import read_mooncake_trace, trace_summary

    code, out = run("--trace", str(shared_trace), "--limit", "300", "--json", "--curve-points", "8")
    assert code == 0, out
    d = json.loads(out)
    assert d["requests"] == 300
    summary = trace_summary(read_mooncake_trace(shared_trace, limit=300))
    assert d["unique_blocks"] == summary["unique_blocks"]
    # at 100% of the unique blocks nothing is evicted: the infinite-cache prefix hit ratio
    last = d["miss_ratio_curve"]["points"][-1]
    assert last["lru_hit_ratio"] == pytest.approx(summary["block_hit_ratio"])
    assert last["policy_hit_ratio"] == pytest.approx(summary["block_hit_ratio"])
    full = d["candidates"][2]
    assert full["name"] == "cpu+disk+remote"
    assert 0 < full["simulated"]["hit_ratio"] <= summary["block_hit_ratio"] + 1e-12
    saved = full["modeled"]["prefill_joules_saved_ratio"]
    assert 0 < saved <= 1
    means = [c["modeled"]["mean_ttft_seconds"] for c in d["candidates"][2:]]
    assert means == sorted(means)  # the pool farther away never helps


@pytest.mark.parametrize(
    "bad",
    [["--trace", "no-such-trace.jsonl"], ["--workload", "chat", "--cpu", "12XB"]],
)
def test_save_with_bad_input_makes_no_database(bad: list[str], tmp_path: Path) -> None:
    """--save opened (and made) the SQLite database before the input was read: a typo in
    --cpu or --trace left a new, empty fleet database at --db though nothing was planned."""
    path = tmp_path / "plans.db"
    code, out = run(*bad, "--save", "--db", f"sqlite:///{path}")
    assert code == 2 and "error: " in out, out
    assert not path.exists(), out


@pytest.mark.parametrize("where", ["unknown-dc", "database-down"])
def test_save_checks_where_it_saves_before_planning(
    where: str, db: object, empty_db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan of the shared trace takes a minute or more; --save with a --dc not in the
    inventory, or a database that does not answer, was found only after it, and the plan was
    thrown away. Both are now said before planning. (``db``: ``empty_db_url`` migrated.)"""
    import kvctl.workload.plan as planning

    planned: list[object] = []
    real_plan = planning.plan
    monkeypatch.setattr(planning, "plan", lambda *a, **k: planned.append(1) or real_plan(*a, **k))
    if where == "unknown-dc":
        args = ["--dc", "nowhere", "--db", empty_db_url]
        said = "no DC named 'nowhere' in the inventory"
    else:
        args = ["--db", "postgresql://kvctl@127.0.0.1:1/kvctl"]
        said = "cannot connect to postgresql+psycopg://kvctl@127.0.0.1:1/kvctl"
    code, out = run("--workload", "chat", "--limit", "40", *SMALL, "--save", *args)
    assert code == 2, out
    assert said in " ".join(out.split()) and planned == [], out
    # where it can be saved, it is planned and saved
    code, out = run("--workload", "chat", "--limit", "40", *SMALL, "--save", "--db", empty_db_url)
    assert code == 0 and planned == [1] and "saved as plan" in out, out
