"""JSON from outside kvctl fails only as ValueError (kvctl.json_text), and callers that read a
file of the wrong shape say so instead of a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvctl import json_text
from kvctl.fleet.demo import STATE_FILE, clean_leftovers

DEEP = "[" * 100_000 + "]" * 100_000


def test_loads_reads_json() -> None:
    assert json_text.loads('{"a": [1, 2]}') == {"a": [1, 2]}
    assert json_text.loads(b'{"a": 1}') == {"a": 1}


@pytest.mark.parametrize(
    "text", [DEEP, DEEP.encode(), '{"a": ' * 50_000], ids=["deep", "deep-bytes", "deep-cut"]
)
def test_nested_too_deep_is_a_value_error_that_says_so(text: str | bytes) -> None:
    with pytest.raises(ValueError) as caught:
        json_text.loads(text)
    # a truncated deep object is invalid before it is too deep: either fault, never a traceback
    assert isinstance(caught.value, json_text.NestedTooDeep | json.JSONDecodeError)
    if text is DEEP:
        assert isinstance(caught.value, json_text.NestedTooDeep)
        assert str(caught.value) == "nested too deep to read"


@pytest.mark.parametrize("text", ["", "{", b"\xff\xfe\xfa", "nope"])
def test_invalid_json_is_a_value_error(text: str | bytes) -> None:
    with pytest.raises(ValueError) as caught:
        json_text.loads(text)
    assert not isinstance(caught.value, json_text.NestedTooDeep)


@pytest.mark.parametrize(
    "state",
    [DEEP, "[1, 2]", '"text"', '{"processes": 7}', '{"processes": [1, "x", null]}'],
    ids=["deep", "list", "string", "processes-number", "processes-not-objects"],
)
def test_demo_cleanup_reads_a_state_file_of_any_shape(tmp_path: Path, state: str) -> None:
    (tmp_path / STATE_FILE).write_text(state, encoding="utf-8")
    assert clean_leftovers(tmp_path) == []  # nothing named to stop, and no traceback
