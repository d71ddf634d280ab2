"""parse_size: exact whole bytes, ASCII digits only, bounded to a signed 64-bit count."""

from __future__ import annotations

import pytest

from kvctl.errors import InvalidArgument
from kvctl.units import MAX_SIZE_BYTES, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("1.5KiB", 1536),
        (" 4 GiB ", 4 << 30),
        ("9007199254740993", 2**53 + 1),  # a float would round it to 2**53
        ("8TiB", 8 << 40),
        (MAX_SIZE_BYTES, MAX_SIZE_BYTES),
    ],
)
def test_sizes_are_exact(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "\uff11\uff12\uff13",  # full-width digits: \d matched them
        "9" * 400 + "TiB",  # overflowed a float (OverflowError, not a clear error)
        "9223372036854775808",
        2**63,
        -1,
        "0.3B",
        "12 parsecs",
    ],
)
def test_bad_sizes_are_clear_errors(text: str | int) -> None:
    with pytest.raises(InvalidArgument):
        parse_size(text)
