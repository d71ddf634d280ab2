"""Parsing byte sizes ("64GiB", "512MiB", "4096"); ``kvctl.format`` writes them for people."""

from __future__ import annotations

import re
from fractions import Fraction

from kvctl.errors import InvalidArgument

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)


#: the largest size anything here takes: a signed 64-bit byte count
MAX_SIZE_BYTES = 2**63 - 1


def parse_size(text: str | int) -> int:
    """Bytes in ``text``: a plain integer or a number with a unit (KiB/MiB/GiB/TiB, KB/MB/GB/TB;
    K/M/G/T are binary). Fractions are allowed when they give whole bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if not 0 <= text <= MAX_SIZE_BYTES:
            raise InvalidArgument(f"a size must be in 0..2**63 - 1, got {text}")
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise InvalidArgument(f"not a size: {text!r} (examples: 4096, 256KiB, 64GiB)")
    number, unit = m.groups()
    try:
        factor = _UNITS[unit.lower()]
    except KeyError:
        raise InvalidArgument(
            f"unknown size unit {unit!r} in {text!r}; use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB"
        ) from None
    # exact: a float would round sizes past 2**53 and overflow on long digit strings
    value = Fraction(number) * factor
    if value.denominator != 1:
        raise InvalidArgument(f"{text!r} is not a whole number of bytes")
    if value > MAX_SIZE_BYTES:
        raise InvalidArgument(f"a size must be at most 2**63 - 1 bytes, got {str(text)[:40]!r}...")
    return int(value)
