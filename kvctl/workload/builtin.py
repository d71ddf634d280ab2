"""A seeded, Mooncake-shaped workload for machines without the shared trace.

Requests arrive as a Poisson process (about 4 per second) from tenants ``tenant-0``..``tenant-7``
and mix three patterns that make prefix caching pay off:

- shared system prompt (40%): one of a few 1k-10k-token system prompts, shared by all tenants,
  followed by a unique user input;
- multi-turn chat (35%): each turn's input is the previous turn's input plus the model's reply and
  a new user message, so it extends the previous turn's prefix;
- RAG (25%): a retrieval system prompt, then 2-4 documents drawn (popular ones more often) from a
  reused pool in varying order, then a unique question. A different order is a different prefix,
  so block ids diverge from the first block that differs.

Block ids are prefix hashes, as in Mooncake: equal ids exactly when the whole prefix up to and
including the block is equal. Block ids are numbered from 0 in order of first appearance.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from kvctl.errors import InvalidArgument
from kvctl.workload.segments import PrefixIds, Segment
from kvctl.workload.trace import DEFAULT_BLOCK_TOKENS, TraceRequest

TENANTS = tuple(f"tenant-{i}" for i in range(8))
ARRIVALS_PER_SECOND = 4.0
SYSTEM_PROMPTS = 6
SYSTEM_PROMPT_TOKENS = (1_000, 10_000)
RAG_PROMPTS = 2
RAG_DOCUMENTS = 40
DOCUMENT_TOKENS = (500, 4_000)
PATTERN_WEIGHTS = {"system": 0.40, "chat": 0.35, "rag": 0.25}


@dataclass(eq=False)
class _Chat:
    tenant: str
    history: list[Segment]
    turns_left: int
    last_output_tokens: int = 0
    slot: int = 0  # where it is in the open chats (``_OpenChats``)


class _OpenChats:
    """The open chats in the order they started, as a sequence for ``random.choice``: indexing
    and removal cost O(log n) (a Fenwick tree counts the chats still open), where a list's
    ``remove`` cost O(n) and made a long workload quadratic. ``rng.choice`` draws exactly as
    from a list of the same chats in the same order, so a seed's workload is unchanged."""

    def __init__(self) -> None:
        self._chats: list[_Chat | None] = []
        self._open: list[int] = [0]  # Fenwick tree over slots, 1-based: open chats per range
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, chat: _Chat) -> None:
        chat.slot = len(self._chats)
        self._chats.append(chat)
        i = chat.slot + 1
        # A new node covers (i - lowbit(i), i]: itself plus the nodes that tile the rest.
        count, j, start = 1, i - 1, i - (i & -i)
        while j > start:
            count += self._open[j]
            j -= j & -j
        self._open.append(count)
        self._len += 1

    def remove(self, chat: _Chat) -> None:
        self._chats[chat.slot] = None
        i = chat.slot + 1
        while i < len(self._open):
            self._open[i] -= 1
            i += i & -i
        self._len -= 1

    def __getitem__(self, index: int) -> _Chat:
        if not 0 <= index < self._len:
            raise IndexError(index)
        # Descend to the slot with ``index`` open chats before it.
        position, step = 0, 1 << (len(self._open) - 1).bit_length()
        while step:
            nxt = position + step
            if nxt < len(self._open) and self._open[nxt] <= index:
                position = nxt
                index -= self._open[nxt]
            step >>= 1
        chat = self._chats[position]
        assert chat is not None
        return chat


def builtin_workload(
    seed: int = 0, *, requests: int = 2000, block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> list[TraceRequest]:
    """``requests`` deterministic requests for ``seed``; see the module docstring for the mix."""
    if requests < 0:
        raise InvalidArgument(f"requests must be non-negative, got {requests}")
    if block_tokens <= 0:
        raise InvalidArgument(f"block_tokens must be positive, got {block_tokens}")
    rng = random.Random(seed)
    content_ids = itertools.count()
    system_prompts = [
        (next(content_ids), rng.randint(*SYSTEM_PROMPT_TOKENS)) for _ in range(SYSTEM_PROMPTS)
    ]
    rag_prompts = [(next(content_ids), rng.randint(300, 1_500)) for _ in range(RAG_PROMPTS)]
    documents = [(next(content_ids), rng.randint(*DOCUMENT_TOKENS)) for _ in range(RAG_DOCUMENTS)]
    document_weights = [1.0 / (rank + 1) for rank in range(RAG_DOCUMENTS)]  # Zipf-like reuse
    prefix_ids = PrefixIds()
    chats = _OpenChats()
    out: list[TraceRequest] = []
    clock_s = 0.0
    last_ms = -1
    for _ in range(requests):
        clock_s += rng.expovariate(ARRIVALS_PER_SECOND)
        last_ms = max(int(clock_s * 1000), last_ms + 1)  # strictly increasing, in ms
        output_tokens = rng.randint(20, 400)
        user_input: Segment = (next(content_ids), rng.randint(50, 2_000))
        pattern = rng.choices(list(PATTERN_WEIGHTS), weights=list(PATTERN_WEIGHTS.values()))[0]
        if pattern == "system":
            tenant = rng.choice(TENANTS)
            segments = [rng.choice(system_prompts), user_input]
        elif pattern == "chat":
            if chats and rng.random() < 0.7:
                chat = rng.choice(chats)
                # The previous reply becomes context before the new user message.
                chat.history += [(next(content_ids), chat.last_output_tokens), user_input]
            else:
                history = [rng.choice(system_prompts), user_input]
                chat = _Chat(rng.choice(TENANTS), history, turns_left=rng.randint(2, 8))
                chats.append(chat)
            chat.turns_left -= 1
            chat.last_output_tokens = output_tokens
            if chat.turns_left == 0:
                chats.remove(chat)
            tenant, segments = chat.tenant, list(chat.history)
        else:
            tenant = rng.choice(TENANTS)
            n_documents = rng.randint(2, 4)
            picked: list[Segment] = []
            while len(picked) < n_documents:
                doc = rng.choices(documents, weights=document_weights)[0]
                if doc not in picked:
                    picked.append(doc)  # pick order is the order in the prompt
            segments = [rng.choice(rag_prompts), *picked, user_input]
        input_tokens = sum(tokens for _, tokens in segments)
        out.append(
            TraceRequest(
                timestamp_ms=last_ms,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                block_ids=prefix_ids.block_ids(segments, block_tokens),
                tenant=tenant,
                block_tokens=block_tokens,
                segments=tuple(segments),
            )
        )
    return out
