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


@dataclass
class _Chat:
    tenant: str
    history: list[Segment]
    turns_left: int
    last_output_tokens: int = 0


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
    chats: list[_Chat] = []
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
