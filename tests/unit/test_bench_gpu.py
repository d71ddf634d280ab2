"""`kvctl bench gpu`: measures only where CUDA is available; elsewhere it says why, exits 2, and
--json gives {"skipped": reason}."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvctl.bench.gpu import render_gpu_bench, run_gpu_bench
from kvctl.cli.main import app
from kvctl.errors import InvalidArgument
from kvctl.store.tiers.gpu import gpu_available

GPU_OK, GPU_DETAIL = gpu_available()
needs_cuda = pytest.mark.skipif(not GPU_OK, reason=f"needs CUDA: {GPU_DETAIL}")
without_cuda = pytest.mark.skipif(GPU_OK, reason="checks behaviour on a machine without CUDA")


@without_cuda
def test_without_cuda_the_result_is_skipped_with_the_reason() -> None:
    result = run_gpu_bench([4 << 20], bytes_per_size=8 << 20, repeats=1)
    assert result["benchmark"] == "gpu" and result["device"] == "cuda:0"
    assert result["skipped"] == GPU_DETAIL
    assert "results" not in result


@without_cuda
def test_cli_json_without_cuda_prints_the_skip_and_exits_2() -> None:
    result = CliRunner().invoke(app, ["bench", "gpu", "--json"])
    assert result.exit_code == 2, result.output
    out = json.loads(result.stdout)
    assert out["skipped"] == GPU_DETAIL and out["benchmark"] == "gpu"
    assert "gpu benchmark skipped" in result.stderr and GPU_DETAIL in result.stderr


@without_cuda
def test_cli_without_cuda_is_one_clear_error() -> None:
    result = CliRunner().invoke(app, ["bench", "gpu"])
    assert result.exit_code == 2
    assert result.stdout == "" and "error: gpu benchmark skipped" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--sizes", "0"], "chunk sizes must be positive"),
        (["--sizes", "4 parsecs"], "unknown size unit"),
        (["--bytes-per-size", "0"], "bytes_per_size must be a positive integer"),
        (["--repeats", "0"], "repeats must be an integer of at least 1"),
        (["--device", "gpu0", "--json"], '"cuda" or "cuda:N"'),
    ],
)
def test_cli_bad_input_is_one_clear_line_and_exit_code_2(args: list[str], words: str) -> None:
    result = CliRunner().invoke(app, ["bench", "gpu", *args])
    assert result.exit_code == 2, result.output
    assert "error:" in result.stderr and words in result.stderr
    assert result.stdout == ""  # checked before anything is measured or skipped


def test_bad_arguments_raise_before_looking_for_a_gpu() -> None:
    with pytest.raises(InvalidArgument, match="at least one chunk size"):
        run_gpu_bench([])


def test_cli_help_has_examples() -> None:
    result = CliRunner().invoke(app, ["bench", "gpu", "--help"])
    assert result.exit_code == 0
    for option in ("--sizes", "--bytes-per-size", "--repeats", "--device", "--json"):
        assert option in result.output
    assert "kvctl bench gpu --json" in result.output


@needs_cuda
def test_a_small_run_measures_every_figure_beside_its_reference() -> None:
    result = run_gpu_bench([64 << 10, 3 << 20], bytes_per_size=8 << 20, repeats=2)
    assert "skipped" not in result and result["device_name"] == GPU_DETAIL
    assert [r["chunk_bytes"] for r in result["results"]] == [64 << 10, 3 << 20]
    for row in result["results"]:
        assert row["chunks"] == max(2, (8 << 20) // row["chunk_bytes"])
        assert row["registered"] is True  # the shared mappings registered with CUDA
        assert isinstance(row["registered_is_pinned"], bool)
        assert set(row["reference"]) == {
            "h2d_pinned", "d2h_pinned", "h2d_registered", "d2h_registered", "memcpy"
        }  # fmt: skip
        for name, ref in (
            ("put", "h2d_pinned"),
            ("get", "d2h_pinned"),
            ("put_registered", "h2d_registered"),
            ("get_registered", "d2h_registered"),
        ):
            fig = row["gpu"][name]
            assert fig["reference"] == ref and len(fig["samples_bytes_per_second"]) == 2
            assert fig["bytes_per_second"] > 0
            expected = fig["bytes_per_second"] / row["reference"][ref]["bytes_per_second"]
            assert fig["ratio_to_reference"] == pytest.approx(expected)
        pinned = row["reference"]["h2d_pinned"]["bytes_per_second"]
        put = row["gpu"]["put_registered"]
        assert put["ratio_to_pinned"] == pytest.approx(put["bytes_per_second"] / pinned)
        assert "ratio_to_pinned" not in row["gpu"]["put"]
    json.dumps(result)  # JSON-safe
    assert render_gpu_bench(result).row_count == 2 * 5  # four tier figures and memcpy, per size


@needs_cuda
def test_cli_json_with_cuda() -> None:
    args = ["bench", "gpu", "--json", "--sizes", "1MiB", "--bytes-per-size", "4MiB"]
    result = CliRunner().invoke(app, [*args, "--repeats", "1"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["results"][0]["gpu"]["put"]["chunks"] == 4
