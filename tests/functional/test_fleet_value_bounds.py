"""`kvctl fleet add-dc --pue` and `add-link --distance-km` past any real value are bad input (exit
2, the value and the range named), in the library, so a fleet file is refused the same way."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db import inventory as inv
from kvctl.db.fleetfile import validate

runner = CliRunner()


def flat(text: str) -> str:
    return " ".join(text.split())


def fleet(url: str, *args: str, code: int = 0) -> str:
    result = runner.invoke(app, ["fleet", *args, "--db", url])
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return flat(result.output)


@pytest.mark.parametrize("pue", ["1e308", "3.5"])
def test_a_pue_past_any_data_centers_is_refused(db: Engine, pue: str) -> None:
    url = db.url.render_as_string(hide_password=False)
    out = fleet(url, "add-dc", "fra", "--pue", pue, code=2)
    assert "error: PUE must be 1 to 3 (facility energy over IT energy" in out, out
    assert f"got {float(pue):g}" in out, out
    fleet(url, "add-dc", "fra", "--pue", "3")  # the bound itself is taken
    assert '"dcs": []' not in fleet(url, "ls", "--json")


@pytest.mark.parametrize("km", ["1e300", "40076"])
def test_a_link_longer_than_the_earths_circumference_is_refused(db: Engine, km: str) -> None:
    url = db.url.render_as_string(hide_password=False)
    fleet(url, "add-dc", "fra")
    fleet(url, "add-dc", "syd")
    out = fleet(url, "add-link", "fra", "syd", "--distance-km", km, code=2)
    expected = (
        f"error: distance must be 0 to 40,075 km (the Earth's circumference), got {float(km):g} km"
    )
    assert expected in out, out
    fleet(url, "add-link", "fra", "syd", "--distance-km", "40075")


def test_the_library_and_a_fleet_file_share_the_bounds() -> None:
    from kvctl.workload import plan

    assert inv.MAX_DISTANCE_KM is plan.MAX_DISTANCE_KM  # one constant, `kvctl plan`'s
    doc = {
        "dcs": [{"name": "a", "pue": 1e308}, {"name": "b"}],
        "links": [{"a": "a", "b": "b", "distance_km": 1e300}],
    }
    problems = validate(doc)
    assert any(p.startswith("dcs[0].pue: PUE must be 1 to 3") for p in problems), problems
    assert any(
        p.startswith("links[0].distance_km: distance must be 0 to 40,075 km") for p in problems
    ), problems
