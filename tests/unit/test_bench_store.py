"""`kvctl bench store`: result structure, input validation and clean-up (no timing assertions)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from kvctl.bench.store import (
    CPU_FIGURES,
    DISK_FIGURES,
    REFERENCES,
    render_store_bench,
    run_store_bench,
)
from kvctl.errors import InvalidArgument

CHUNK_BYTES = 64 * 1024
BYTES_PER_SIZE = 1 << 20


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], pathlib.Path]:
    # One small run shared by the structure tests: the benchmark is the slow part.
    directory = tmp_path_factory.mktemp("bench")
    result = run_store_bench(
        [CHUNK_BYTES], bytes_per_size=BYTES_PER_SIZE, directory=directory, repeats=1
    )
    return result, directory


def _bandwidth_ok(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_top_level_fields(bench_run: tuple[dict[str, Any], pathlib.Path]) -> None:
    result, directory = bench_run
    assert result["benchmark"] == "store"
    assert result["bytes_per_size"] == BYTES_PER_SIZE
    assert result["repeats"] == 1
    assert result["directory"] == str(directory)
    for key in ("kvctl_version", "python", "platform"):
        assert isinstance(result[key], str) and result[key]
    assert result["directory_filesystem"] is None or set(result["directory_filesystem"]) == {
        "type",
        "mount_point",
        "device",
    }
    assert result["notes"] and all(isinstance(n, str) for n in result["notes"])
    json.dumps(result, allow_nan=False)  # JSON-safe, no NaN/inf


def test_every_figure_is_a_positive_bandwidth_with_a_consistent_ratio(
    bench_run: tuple[dict[str, Any], pathlib.Path],
) -> None:
    result, _ = bench_run
    (row,) = result["results"]
    assert row["chunk_bytes"] == CHUNK_BYTES
    assert row["chunks"] == BYTES_PER_SIZE // CHUNK_BYTES
    assert set(row["reference"]) == set(REFERENCES)
    for fig in row["reference"].values():
        assert _bandwidth_ok(fig["bytes_per_second"])
        assert len(fig["samples_bytes_per_second"]) == 1
        assert fig["bytes"] == fig["chunks"] * CHUNK_BYTES
    for section, figures in (("cpu", CPU_FIGURES), ("disk", DISK_FIGURES)):
        assert set(row[section]) == set(figures)
        for name, fig in row[section].items():
            assert _bandwidth_ok(fig["bytes_per_second"]), f"{section}.{name}"
            assert fig["reference"] == figures[name]
            ref = row["reference"][fig["reference"]]
            assert fig["chunks"] == ref["chunks"]
            assert fig["ratio_to_reference"] == pytest.approx(
                fig["bytes_per_second"] / ref["bytes_per_second"]
            )
    assert 2 <= row["disk"]["put_fsync"]["chunks"] <= row["chunks"]


def test_leaves_no_files_behind(bench_run: tuple[dict[str, Any], pathlib.Path]) -> None:
    _, directory = bench_run
    assert list(directory.iterdir()) == []


def test_render_returns_a_table(bench_run: tuple[dict[str, Any], pathlib.Path]) -> None:
    from rich.table import Table

    table = render_store_bench(bench_run[0])
    assert isinstance(table, Table)
    assert table.row_count == len(CPU_FIGURES) + len(DISK_FIGURES)


def test_module_does_not_import_rich() -> None:
    code = (
        "import sys, kvctl.bench.store\n"
        "sys.exit(any(m == 'rich' or m.startswith('rich.') for m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize(
    ("sizes", "kwargs", "message"),
    [
        ([], {}, "at least one chunk size"),
        ([0], {}, "positive"),
        ([4096, -1], {}, "positive"),
        ([True], {}, "positive"),
        ([4096], {"bytes_per_size": 0}, "bytes_per_size"),
        ([4096], {"repeats": 0}, "repeats"),
    ],
)
def test_invalid_arguments(
    tmp_path: pathlib.Path, sizes: list[int], kwargs: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {"bytes_per_size": 1 << 16, "directory": tmp_path, "repeats": 1}
    with pytest.raises(InvalidArgument, match=message):
        run_store_bench(sizes, **{**args, **kwargs})
    assert list(tmp_path.iterdir()) == []


def test_directory_must_exist_and_be_a_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidArgument, match="not a directory"):
        run_store_bench([4096], bytes_per_size=1 << 16, directory=tmp_path / "missing")
    a_file = tmp_path / "file"
    a_file.write_bytes(b"x")
    with pytest.raises(InvalidArgument, match="not a directory"):
        run_store_bench([4096], bytes_per_size=1 << 16, directory=a_file)


def test_directory_must_be_writable(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # chmod cannot stop root (tests may run as root): answer the access check as for a user
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)
    with pytest.raises(InvalidArgument, match="not writable"):
        run_store_bench([4096], bytes_per_size=1 << 16, directory=tmp_path)
