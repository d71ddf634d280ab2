"""Segments: a request's input as runs of content, and the prefix-block ids they imply.

A segment ``(content_id, tokens)`` is a run of ``tokens`` tokens of one piece of content (a
system prompt, a document, a user message, a trace block). Equal content ids mean equal tokens,
so two inputs share a prefix exactly as far as their segments agree. Segments are what the replay
expands into real token ids (``kvctl.workload.tokens``); block ids are what the offline simulator
counts.
"""

from __future__ import annotations

from collections.abc import Iterable

Segment = tuple[int, int]
"""(content id, tokens): a run of tokens; equal content ids mean equal tokens."""

Piece = tuple[int, int, int]
"""(content id, start, end): the tokens ``start..end`` of one content inside a block."""


class PrefixIds:
    """Assign block ids so that equal prefixes share ids and different prefixes never do.

    Ids count from 0 in order of first appearance, like the renumbered ids of a Mooncake trace.
    One instance must serve a whole workload: ids are only comparable within it.
    """

    def __init__(self) -> None:
        # (parent block id, block content) -> id; the parent chains in the whole prefix.
        self._ids: dict[tuple[int, tuple[Piece, ...]], int] = {}

    def block_ids(self, segments: list[Segment], block_tokens: int) -> tuple[int, ...]:
        full, tail = split_pieces(segments, block_tokens)
        ids: list[int] = []
        parent = -1
        for pieces in full:
            parent = self._id(parent, pieces)
            ids.append(parent)
        if tail:  # partial last block: its own content key, so a longer prefix gets a new id
            ids.append(self._id(parent, tail))
        return tuple(ids)

    def _id(self, parent: int, pieces: tuple[Piece, ...]) -> int:
        return self._ids.setdefault((parent, pieces), len(self._ids))


def split_pieces(
    segments: Iterable[Segment], size: int
) -> tuple[list[tuple[Piece, ...]], tuple[Piece, ...]]:
    """Cut the concatenated segments into blocks of ``size`` tokens: the content pieces of each
    full block, and of the partial tail (empty when the tokens divide evenly)."""
    blocks: list[tuple[Piece, ...]] = []
    pieces: list[Piece] = []
    filled = 0
    for content_id, tokens in segments:
        start = 0
        while start < tokens:
            take = min(tokens - start, size - filled)
            pieces.append((content_id, start, start + take))
            start += take
            filled += take
            if filled == size:
                blocks.append(tuple(pieces))
                pieces, filled = [], 0
    return blocks, tuple(pieces)
