"""Operators' token files: what they may hold is what an agent takes."""

from __future__ import annotations

import pytest

from kvctl.errors import InvalidArgument
from kvctl.tokenize import MAX_TOKEN_ID, read_token_file


def test_token_files_take_whitespace_commas_and_json_lists() -> None:
    assert read_token_file("1 2,3\n[4, 5]") == [1, 2, 3, 4, 5]
    assert read_token_file(f"0 {MAX_TOKEN_ID}") == [0, MAX_TOKEN_ID]


@pytest.mark.parametrize(("text", "bad"), [("7 -5", "#2 is -5"), (f"{MAX_TOKEN_ID + 1}", "#1")])
def test_an_id_out_of_range_is_refused_before_any_agent_sees_it(text: str, bad: str) -> None:
    # an agent answers such an id with a 422 (and the action was audited as a node failure)
    with pytest.raises(InvalidArgument, match=f"token {bad}") as info:
        read_token_file(text)
    assert f"0..{MAX_TOKEN_ID}" in str(info.value)


def test_words_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="must hold integers"):
        read_token_file("1 two 3")
