"""The CLI as users run it: typer's CliRunner for speed, a real subprocess for the entry point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl import __version__
from kvctl.cli.main import app

runner = CliRunner()
COMMANDS = ("demo", "simulate", "keys", "bench")


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def write_trace(path: Path, n: int = 60) -> Path:
    lines = []
    for i in range(n):
        shared = [0, 1, 2] if i % 2 == 0 else [10, 11]
        ids = [*shared, 100 + i]
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


def test_help_lists_every_command_with_a_one_line_help() -> None:
    code, out = run("--help")
    assert code == 0
    for name in COMMANDS:
        line = next(line for line in out.splitlines() if f" {name} " in line)
        assert len(line.split(name, 1)[1].strip()) > 10, line


@pytest.mark.parametrize("args", [["demo"], ["simulate"], ["keys"], ["bench", "store"]])
def test_each_command_help_has_examples(args: list[str]) -> None:
    code, out = run(*args, "--help")
    assert code == 0 and "Examples" in out and "kvctl " in out


def test_version_from_the_installed_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvctl", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"kvctl {__version__}"


def test_simulate_json_schema(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    code, out = run("simulate", "--trace", str(trace), "--capacity-blocks", "4", "--json")
    assert code == 0, out
    data = json.loads(out)
    assert data["trace"] == str(trace)
    assert data["unique_blocks"] == 5 + 60 and data["capacity_blocks"] == 4
    policies = [r["policy"] for r in data["results"]]
    assert {"lru", "lineage-lru", "priority", "lineage-gdsf", "belady"} <= set(policies)
    for r in data["results"]:
        assert 0 <= r["token_hit_ratio"] <= 1 and 0 <= r["hit_ratio"] <= 1


def test_simulate_several_capacities_and_tiers(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl")
    code, out = run(
        "simulate",
        "--trace",
        str(trace),
        "--capacity-fraction",
        "0.05",
        "--capacity-fraction",
        "0.5",
        "--policy",
        "lru",
        "--json",
    )
    assert code == 0, out
    runs = json.loads(out)
    assert [r["capacity_blocks"] for r in runs] == [3, 32]
    code, out = run("simulate", "--trace", str(trace), "--tier", "cpu=2", "--tier", "disk=8")
    assert code == 0, out
    assert "disk=8" in out
    assert "belady*" in out  # whole: a policy's name is never cut, a header may wrap


def test_simulate_sweep_of_a_generated_workload() -> None:
    code, out = run(
        "simulate", "--workload", "chat", "--limit", "60", "--sweep", "--policy", "lineage-arc",
        "--json",
    )  # fmt: skip
    assert code == 0, out
    runs = json.loads(out)
    assert [r["trace"] for r in runs] == ["chat:seed=0"] * 6
    unique = runs[0]["unique_blocks"]
    assert [r["capacity_blocks"] for r in runs] == [
        max(1, round(unique * f)) for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
    ]
    for r in runs:
        rows = {x["policy"]: x for x in r["results"]}
        assert set(rows) == {"lineage-arc", "lru", "belady"}
        assert rows["belady"]["of_belady"] == 1.0
        for x in rows.values():
            assert x["decisions_per_second"] > 0 and 0 <= x["prefill_hit_ratio"] <= 1
    code, out = run("simulate", "--workload", "rag", "--limit", "40", "--sweep", "--policy", "lru")
    assert code == 0, out
    summary = out[out.rindex("rag:seed=0: % of Belady") :]  # the sweep's table, after the six
    assert "50%" in summary and "Belady hit" in summary
    assert "unreachable" not in summary
    code, out = run(
        "simulate", "--workload", "rag", "--limit", "40", "--sweep", "--policy", "lru",
        "--keep-unreachable",
    )  # fmt: skip
    assert code == 0, out
    summary = out[out.rindex("rag:seed=0: % of Belady") :]
    assert "unreachable blocks kept" in " ".join(summary.split())  # the title may wrap


def test_simulate_turns_unreachable_blocks_away_unless_told_to_keep_them() -> None:
    args = ("simulate", "--workload", "system-prompt", "--capacity-blocks", "25", "--policy")
    code, out = run(*args, "lineage-lru", "--json")
    assert code == 0, out
    turned = json.loads(out)
    code, out = run(*args, "lineage-lru", "--keep-unreachable", "--json")
    assert code == 0, out
    kept = json.loads(out)
    assert (turned["bypass_unreachable"], kept["bypass_unreachable"]) == (True, False)
    hits = [{r["policy"]: r["hit_blocks"] for r in d["results"]} for d in (turned, kept)]
    assert hits[0]["lineage-lru"] > hits[1]["lineage-lru"]
    code, out = run(*args, "lru", "--keep-unreachable")
    assert code == 0, out
    assert "unreachable blocks kept" in " ".join(out.split())  # the title may wrap


def test_simulate_marks_the_partial_oracles() -> None:
    code, out = run(
        "simulate", "--workload", "rag", "--limit", "40", "--policy", "oracle-reuse",
        "--policy", "oracle-popularity",
    )  # fmt: skip
    assert code == 0, out
    assert "oracle-reuse°" in out and "oracle-popularity°" in out and "belady*" in out
    assert "partial oracle" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["simulate", "--trace", "missing.jsonl"], "no such file"),
        (["simulate", "--tier", "cpu"], "NAME=BLOCKS"),
        # a name holding markup failed in rich (MarkupError: a bug's line, exit 1)
        (["simulate", "--tier", "a[/]=5", "--limit", "5"], "NAME=BLOCKS"),
        (["simulate", "--tier", " =5", "--limit", "5"], "NAME=BLOCKS"),
        (["simulate", "--policy", "fifo", "--limit", "5"], "unknown policy"),
        (["simulate", "--capacity-fraction", "2", "--limit", "5"], "fraction"),
        (["simulate", "--capacity-blocks", "3", "--tier", "cpu=3"], "only one of"),
        (["simulate", "--sweep", "--capacity-fraction", "0.1", "--limit", "5"], "only one of"),
        (["simulate", "--workload", "nope"], "unknown workload"),
        (["keys"], "exactly one of"),
        (["keys", "--text", "a", "--tokenizer", "bpe"], "unknown tokenizer"),
    ],
)
def test_bad_input_gets_one_clear_error_line(args: list[str], message: str) -> None:
    code, out = run(*args)
    assert code == 2
    assert message in out and "Traceback" not in out


def test_malformed_trace_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n{not json}\n'
    )
    code, out = run("simulate", "--trace", str(bad))
    assert code == 2 and ":2:" in out


def _hostile_trace(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A trace file (or not a file) that once failed with a bug's message, and what the one
    clear line must say instead."""
    good = b'{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
    path = tmp_path / "t.jsonl"
    if kind == "id-past-64-bits":  # past 128 the simulator's int.to_bytes raised OverflowError
        path.write_bytes(good + good.replace(b"[0]", str([2**128]).encode()))
        return path, f"{path}:2: hash_ids must be non-negative integers below 2**64"
    if kind == "not-utf8":  # Python's decode error, naming neither file nor line
        path.write_bytes(good + b'{"tenant": "caf\xe9"}\n')
        return path, f"{path}:2: not UTF-8 text"
    if kind == "content-hashes":  # read, and block 1 of line 2 counted as a prefix hit
        line = b'{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": %b}\n'
        path.write_bytes(line % b"[0, 1]" + line % b"[2, 1]")
        return path, f"{path}:2: hash id 1 at block 2 follows id 2 here, id 0 on line 1"
    return tmp_path, f"{tmp_path} is a directory"  # was "no such file"


@pytest.mark.parametrize("command", [["simulate"], ["plan", "--curve-points", "0"]])
@pytest.mark.parametrize("kind", ["id-past-64-bits", "not-utf8", "directory", "content-hashes"])
def test_a_hostile_trace_is_one_clear_line_naming_it(
    tmp_path: Path, command: list[str], kind: str
) -> None:
    path, said = _hostile_trace(tmp_path, kind)
    code, out = run(*command, "--trace", str(path), "--json")
    assert code == 2, out
    assert said in " ".join(out.split()), out  # rich may wrap a long path
    assert "did not expect" not in out and "Traceback" not in out


def test_keys_json_matches_the_library() -> None:
    from kvctl.agent.settings import DEFAULT_MODELS
    from kvctl.store.keys import Namespace, keys_for
    from kvctl.tokenize import tokenize

    code, out = run("keys", "--text", "a b c d e f g h i", "--chunk-tokens", "4", "--json")
    assert code == 0
    data = json.loads(out)
    # by default, the keys an agent started without a model setting computes
    model = DEFAULT_MODELS[0]
    expected = keys_for(tokenize("a b c d e f g h i"), Namespace(model.id, model.layout), 4)
    assert [c["key"] for c in data["chunks"]] == [k.hex() for k in expected]
    assert data["kv_bytes_per_token"] == 131_072


def test_demo_replays_the_given_trace(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", n=200)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    out = subprocess.run(
        [sys.executable, "-m", "kvctl", "demo", "--trace", str(trace), "--json", "--duration",
         "5", "--speed", "0", "--no-browser", "--workdir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        check=True,
        timeout=180,
        env=env,
    )  # fmt: skip
    report = json.loads(out.stdout)
    assert report["workload"] == str(trace)
    assert report["requests"]["requests"] > 0
    assert report["agents_agree"] is True and report["database"]["agree"] is True
