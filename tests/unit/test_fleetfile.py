"""The fleet file without a database: formats, dump/load, and validate()'s problem messages."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvctl.db.fleetfile import FleetFileError, dump, format_for, load, validate

GOOD: dict[str, Any] = {
    "dcs": [
        {"name": "fra", "region": "eu-central", "carbon_g_per_kwh": 350.0, "pue": 1.2},
        {"name": "ams", "location": "Amsterdam"},
    ],
    "nodes": [
        {"name": "n1", "dc": "fra", "agent_url": "http://10.0.0.1:7070", "gpu_model": "H100"},
        {
            "name": "n2",
            "dc": "ams",
            "agent_url": "https://node2.example",
            "engine_url": "http://10.0.0.2:8000/metrics",
        },
    ],
    "links": [{"a": "ams", "b": "fra", "distance_km": 360.0}],
}


def _with(**changes: Any) -> dict[str, Any]:
    """GOOD with ``section=[...]`` replaced, or ``nodes__0={...}`` merged into one entry."""
    doc = copy.deepcopy(GOOD)
    for key, value in changes.items():
        section, _, index = key.partition("__")
        if index:
            doc[section][int(index)].update(value)
        else:
            doc[section] = value
    return doc


@pytest.mark.parametrize(
    ("path", "fmt"),
    [("fleet.toml", "toml"), ("a/b/fleet.yaml", "yaml"), ("x.yml", "yaml"), ("F.TOML", "toml")],
)
def test_format_for(path: str, fmt: str) -> None:
    assert format_for(path) == fmt


def test_format_for_unknown_suffix() -> None:
    with pytest.raises(FleetFileError, match=r"'fleet\.json'.*use \.toml, \.yaml or \.yml"):
        format_for("fleet.json")
    with pytest.raises(FleetFileError):
        format_for("fleet")


@pytest.mark.parametrize("fmt", ["toml", "yaml"])
def test_dump_load_round_trip(fmt: str) -> None:
    text = dump(GOOD, fmt)
    assert load(text, fmt) == GOOD
    assert dump(load(text, fmt), fmt) == text
    empty = {"dcs": [], "nodes": [], "links": []}
    assert load(dump(empty, fmt), fmt) == empty


def test_toml_omits_none_and_uses_tables() -> None:
    doc = {"dcs": [{"name": "fra", "pue": None, "region": ""}], "nodes": [], "links": []}
    text = dump(doc, "toml")
    assert "pue" not in text and "region" not in text
    assert "[[dcs]]" in text
    assert load(text, "toml") == {"dcs": [{"name": "fra"}], "nodes": [], "links": []}
    assert "null" not in dump(doc, "yaml")


def test_dump_rejects_unknown_format() -> None:
    with pytest.raises(FleetFileError, match="toml or yaml"):
        dump(GOOD, "json")


def test_syntax_errors_say_where() -> None:
    with pytest.raises(FleetFileError, match=r"not valid TOML: .*line 2"):
        load('[[dcs]]\nname = "fra\n', "toml")
    with pytest.raises(FleetFileError, match=r"not valid YAML at line \d+, column \d+"):
        load("dcs:\n  - name: fra\n bad: [", "yaml")


def test_empty_yaml_is_an_empty_fleet() -> None:
    assert load("", "yaml") == {}
    assert validate(load("", "yaml")) == []


def test_a_good_document_has_no_problems() -> None:
    assert validate(GOOD) == []
    assert validate({}) == []  # every section is optional
    # ints where floats are stored are fine: `pue = 2` is what people write
    assert validate(_with(dcs__0={"pue": 2, "carbon_g_per_kwh": 0})) == []


def test_unknown_dc_has_its_location() -> None:
    doc = _with(nodes__1={"dc": "x"}, links=[{"a": "fra", "b": "y", "distance_km": 1}])
    assert validate(doc) == [
        "nodes[1].dc: unknown DC 'x' (not in the file's dcs)",
        "links[0].b: unknown DC 'y' (not in the file's dcs)",
    ]
    # DCs already in the database may be referred to when the import keeps them
    assert validate(doc, known_dcs={"x", "y"}) == []


def test_shape_problems() -> None:
    assert validate([1, 2]) == [
        "the fleet file must be a table with dcs, nodes and links, got a list"
    ]
    assert validate({"dcs": {"name": "fra"}, "hosts": []}) == [
        "hosts: unknown key (expected: dcs, nodes, links)",
        "dcs: expected a list of tables, got a table",
    ]
    assert validate({"dcs": ["fra"]}) == ["dcs[0]: expected a table, got text"]


def test_missing_wrong_types_and_unknown_keys() -> None:
    doc = _with(
        dcs=[
            {"region": "eu"},
            {"name": 5, "pue": "high", "carbon_g_per_kwh": True},
            {"name": "fra", "colour": "blue"},
        ],
        nodes=[{"name": "n1", "dc": "fra"}],
        links=[],
    )
    assert validate(doc) == [
        "dcs[0].name: missing (required)",
        "dcs[1].name: a DC name must be text, got int",
        "dcs[1].carbon_g_per_kwh: carbon intensity must be a number, got bool",
        "dcs[1].pue: PUE must be a number, got str",
        "dcs[2].colour: unknown key (expected: name, region, location, carbon_g_per_kwh, pue)",
        "nodes[0].agent_url: missing (required)",
    ]


def test_values_out_of_range() -> None:
    doc = _with(
        dcs__0={"pue": 0.9, "carbon_g_per_kwh": -1},
        nodes__0={"agent_url": "10.0.0.1:7070"},
        nodes__1={"engine_url": "http://h:99999/metrics", "name": " n2"},
        links=[{"a": "ams", "b": "fra", "distance_km": float("nan")}],
    )
    problems = validate(doc)
    assert problems == [
        "dcs[0].carbon_g_per_kwh: carbon intensity must not be negative, got -1",
        "dcs[0].pue: PUE must be at least 1, got 0.9",
        "nodes[0].agent_url: agent URL must be http:// or https:// with a host "
        "(e.g. http://10.0.0.7:7070), got '10.0.0.1:7070'",
        "nodes[1].name: a node name must not have leading/trailing spaces or control characters",
        "nodes[1].engine_url: engine URL has a bad port (e.g. http://10.0.0.7:8000/metrics), "
        "got 'http://h:99999/metrics'",
        "links[0].distance_km: distance must be a finite number, got nan",
    ]


def test_text_fields_with_control_characters_are_problems() -> None:
    """An escape sequence in a location or a GPU model was stored and then played by every
    terminal `kvctl fleet ls` printed it to (before: no problem found)."""
    doc = _with(
        dcs__0={"location": "\x1b[31mRED\x1b[0m", "region": "eu\ncentral"},
        nodes__0={"gpu_model": "H100\r"},
    )
    assert validate(doc) == [
        "dcs[0].region: region must not hold control characters, got 'eu\\ncentral'",
        "dcs[0].location: location must not hold control characters, got '\\x1b[31mRED\\x1b[0m'",
        "nodes[0].gpu_model: GPU model must not hold control characters, got 'H100\\r'",
    ]
    assert validate(_with(dcs__0={"location": "Zürich, Frankfurt am Main"})) == []


def test_duplicates_and_self_links() -> None:
    doc = _with(
        dcs=[*GOOD["dcs"], {"name": "fra"}],
        nodes=[*GOOD["nodes"], {"name": "n1", "dc": "ams", "agent_url": "http://a:1"}],
        links=[
            *GOOD["links"],
            {"a": "fra", "b": "ams", "distance_km": 1},
            {"a": "fra", "b": "fra", "distance_km": 0},
        ],
    )
    assert validate(doc) == [
        "dcs[2].name: duplicate DC 'fra' (also dcs[0])",
        "nodes[2].name: duplicate node 'n1' (also nodes[0])",
        "links[1]: duplicate link 'fra'-'ams' (also links[0])",
        "links[2]: a link joins two different DCs, got 'fra' twice",
    ]


def test_yaml_surprises_are_caught() -> None:
    # YAML reads `no` as false and `1.10` as a number: names must be quoted, and are checked
    doc = load("dcs:\n  - name: no\n  - name: 1.10\n", "yaml")
    assert validate(doc) == [
        "dcs[0].name: a DC name must be text, got bool",
        "dcs[1].name: a DC name must be text, got float",
    ]


def test_every_problem_is_listed_at_once() -> None:
    doc = {
        "dcs": [{"name": "fra", "pue": 0}],
        "nodes": [{"name": "n1", "dc": "x", "agent_url": "ftp://h"}, {"dc": "fra"}],
        "links": [{"a": "fra"}],
    }
    problems = validate(doc)
    # a bad agent URL does not hide the same entry's unknown DC
    assert "nodes[0].dc: unknown DC 'x' (not in the file's dcs)" in problems
    assert len(problems) == 7, problems
    error = FleetFileError(problems)
    assert error.problems == problems and str(error).startswith("7 problems in the fleet file")


def test_urls_with_credentials_are_refused() -> None:
    from kvctl.db.inventory import url_problem

    problem = url_problem("http://ops:hunter2@10.0.0.7:7070")
    assert problem is not None and "password" in problem and "hunter2" not in problem
    assert url_problem("http://10.0.0.7:7070") is None


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("toml", "a = " + "[" * 5000 + "]" * 5000),
        ("yaml", "[" * 5000 + "]" * 5000),
        ("yaml", "a: " + "{x: " * 3000 + "1" + "}" * 3000),
    ],
    ids=["toml-arrays", "yaml-lists", "yaml-maps"],
)
def test_a_fleet_file_nested_thousands_deep_is_not_valid_not_a_bug(fmt: str, text: str) -> None:
    """tomllib's and PyYAML's parsers raise RecursionError (no TOMLDecodeError or YAMLError)
    on a document nested thousands deep: `kvctl fleet import` (and every --fleet) said
    'kvctl failed where it did not expect to: RecursionError' (as 9ed94ae found of JSON)."""
    with pytest.raises(FleetFileError, match=f"not valid {fmt.upper()}: nested too deep"):
        load(text, fmt)
