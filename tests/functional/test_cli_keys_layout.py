"""`kvctl keys` refuses a KV layout no model has, naming the option and the range it takes.

It took any int: --layers 99999999999999999999 printed keys under a title of 8e23 KV bytes a
chunk, and --layers 0 said "KVLayout.layers must be positive", a library's name for it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()


def _keys(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["keys", "--text", "a b c d", "--chunk-tokens", "2", *args])
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("option", "value", "most"),
    [
        ("--layers", "0", "1,024"),
        ("--layers", "-1", "1,024"),
        ("--layers", "99999999999999999999", "1,024"),
        ("--kv-heads", "0", "1,024"),
        ("--kv-heads", "100000", "1,024"),
        ("--head-dim", "0", "4,096"),
        ("--head-dim", "1000000", "4,096"),
        ("--chunk-tokens", "0", "65,536"),
        ("--chunk-tokens", "10000000", "65,536"),
    ],
)
def test_a_dimension_no_model_has_is_refused_with_its_range(
    option: str, value: str, most: str
) -> None:
    code, out = _keys(option, value)
    flat = " ".join(out.replace("│", " ").split())  # typer's error box wraps its line
    assert code == 2, out
    assert f"'{option}'" in flat and f"{value} is outside 1 to {most}" in flat, out
    assert "Traceback" not in out


def test_dimensions_each_in_range_whose_product_no_model_has_are_refused() -> None:
    code, out = _keys("--layers", "1024", "--kv-heads", "1024", "--head-dim", "4096")
    flat = " ".join(out.split())
    assert code == 2, out
    assert "--layers 1024 x --kv-heads 1024 x --head-dim 4096" in flat
    assert "KV bytes per token" in flat and "64 MiB" in flat


def test_the_largest_real_layouts_still_give_keys() -> None:
    # Llama-3.1-405B (126 layers, 8 KV heads); GPT-3 175B's full multi-head attention in
    # float32 (96 layers, 96 heads of 128); DeepSeek-V3's MLA (61 layers, 1 latent "head" of 576)
    for layers, heads, dim, dtype in (
        (126, 8, 128, "bfloat16"),
        (96, 96, 128, "float32"),
        (61, 1, 576, "bfloat16"),
    ):
        code, out = _keys(
            "--layers", str(layers), "--kv-heads", str(heads), "--head-dim", str(dim),
            "--dtype", dtype, "--json",
        )  # fmt: skip
        assert code == 0, out
