"""Option values no run can mean, refused with the option named (exit 2) instead of a result
made of them. Found by an adversarial pass over every command's options:

- `kvctl plan --distance-km 1e308` planned a pool at that distance: its fetch column printed a
  300-digit number of ms and its latency "50+inf".
- `kvctl plan --mfu 1e-300` (or `kvctl replay --mfu`) modeled "0 prefill tokens/s"; the
  dashboard already took 0.01 to 1, `kvctl router serve` only at least 0.01 (`--mfu 5` was
  refused late, as the library's "MFU must be in (0, 1]", without the option named). One
  option now, kvctl.cli.options.MfuOpt, for all four.
- `kvctl plan --curve-points 100000000` spent most of a minute spacing capacities for a 50-request
  workload, for a curve that has at most one point per block.
- `kvctl keys --model ""` said "Namespace.model_id must not be empty", the library's name."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app

runner = CliRunner()


def _run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    # typer's error box wraps its line: compare the words
    return result.exit_code, " ".join(result.output.replace("│", " ").split())


@pytest.mark.parametrize("km", ["1e308", "100000", "40076"])
def test_plan_refuses_a_distance_no_fiber_has(km: str) -> None:
    code, out = _run("plan", "--limit", "20", "--distance-km", km)
    assert code == 2, out
    assert "distance" in out and "40,075 km" in out and "Traceback" not in out


def test_plan_still_takes_the_longest_real_distances() -> None:
    code, out = _run("plan", "--limit", "20", "--distance-km", "20000", "--json")
    assert code == 0, out


@pytest.mark.parametrize("command", ["plan", "replay"])
@pytest.mark.parametrize("mfu", ["1e-300", "0.001", "1.5"])
def test_mfu_outside_what_a_gpu_reaches_is_refused_by_name(command: str, mfu: str) -> None:
    code, out = _run(command, "--mfu", mfu, "--limit", "5", "--db", "sqlite:///:memory:")
    assert code == 2, out
    assert "'--mfu'" in out and "Traceback" not in out


MFU_COMMANDS = [("plan",), ("replay",), ("dashboard",), ("router", "serve")]


def test_router_serve_refuses_an_mfu_above_1_by_name() -> None:
    code, out = _run(
        "router", "serve", "--mfu", "1.5", "--agent", "a=http://127.0.0.1:9@fra",
        "--listen", "127.0.0.1:0",
    )  # fmt: skip
    assert code == 2, out
    assert "'--mfu'" in out and "Traceback" not in out


@pytest.mark.parametrize("command", MFU_COMMANDS, ids=" ".join)
def test_every_mfu_is_the_one_option(command: tuple[str, ...]) -> None:
    from kvctl.profiles import DEFAULT_MFU

    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    line = next(x for x in result.output.splitlines() if "--mfu " in x and "│" in x)
    said = " ".join(line.replace("│", " ").split())
    # the same help, bounds and default in each (plan's "[default: 0.5]" was in its help text,
    # where rich took it for markup and showed no default)
    assert said == (
        "--mfu <float range> [0.01<=x<=1.0] Prefill MFU (model FLOPs utilisation) of the "
        f"modeled figures. [default: {DEFAULT_MFU}]"
    ), said


def test_plan_refuses_more_curve_points_than_a_curve_can_show() -> None:
    code, out = _run("plan", "--limit", "20", "--curve-points", "100000000")
    assert code == 2, out
    assert "'--curve-points'" in out and "1000" in out


def test_keys_says_an_empty_model_is_the_option_given() -> None:
    code, out = _run("keys", "--text", "a", "--model", "")
    assert code == 2, out
    assert "--model" in out and "Namespace" not in out
