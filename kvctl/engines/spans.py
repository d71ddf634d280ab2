"""Runs of adjacent chunk positions: the write-behind packs each run in one call, a fetch copies
each run of leased chunks in one copy. Pure Python (the write-behind does not import torch)."""

from __future__ import annotations

from collections.abc import Iterable


def spans(positions: Iterable[int]) -> list[tuple[int, int]]:
    """Ascending positions as runs of adjacent ones, ``[lo, hi)`` each, in order."""
    out: list[tuple[int, int]] = []
    for i in positions:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
