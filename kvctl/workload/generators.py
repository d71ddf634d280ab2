"""Seeded workload generators, one per prefix-reuse pattern, for simulation and benchmarks.

Every generator returns ``list[TraceRequest]`` in arrival order with:

- ``segments`` set: the input as ``(content_id, tokens)`` runs, equal content ids meaning equal
  tokens (see ``kvctl.workload.segments``); the sum of segment tokens is ``input_tokens``;
- ``block_ids`` from one ``PrefixIds`` per workload at ``block_tokens`` (default 512): equal ids
  exactly when the whole prefix up to and including the block is equal, numbered from 0 in order
  of first appearance, the last block possibly partial;
- ``timestamp_ms`` strictly increasing, from a Poisson process of ``rate_per_second`` arrivals
  (exponential gaps, rounded down to ms and bumped by 1 ms when two arrivals would collide);
- a ``tenant`` (``tenant-0``, ``tenant-1``, ...) on every request, drawn so that prefixes are both
  reused by the same tenant and shared across tenants.

The same ``seed`` and arguments always give the same list; the arrival rate only changes the
timestamps, never the requests. Invalid arguments raise ``InvalidArgument``.

Generators (registered in ``GENERATORS`` under the name in brackets):

``shared_system_prompt`` ("system-prompt")
    One group per size in ``prompt_tokens`` (default 1k, 5k, 10k, 50k and 100k tokens). A group is
    ``group_size`` requests (default 20) that share one system prompt of that size, each followed
    by a unique ``input_tokens`` user input (default 256) and answered with ``output_tokens``
    (default 512): ``len(prompt_tokens) * group_size`` requests (default 100). Each group belongs
    to ``tenants_per_prompt`` tenants (default 3, of ``tenants`` = 8), spread round-robin over its
    requests, so a prompt is shared by several tenants and each of them reuses it. Groups
    interleave in time by default (a random order of all requests, as when several products run
    at once); ``interleave=False`` sends the groups one after another, smallest prompt first.

``multi_turn_chat`` ("chat")
    ``conversations`` chats (default 200) of ``turns`` turns each (uniform in 2..8). Turn 1's
    input is the system prompt (``system_prompt_tokens``, default 1,000, shared by every
    conversation; 0 for none) and a user message of ``user_tokens`` (20..800); every later turn's
    input is the previous turn's input, then the previous reply (that turn's output tokens, new
    content) and a new user message. Replies are ``output_tokens`` (50..800). Each conversation
    has one tenant (round-robin over ``tenants``, shuffled), so a tenant reuses its own history
    and shares the system prompt with the others. Up to ``active_conversations`` (default 8) run
    at once; each arrival advances a random active one, and a finished conversation is replaced
    by the next, so conversations interleave and start staggered. ``requests`` stops early.

``rag`` ("rag")
    ``requests`` requests (default 1,000) over a pool of ``documents`` documents (default 200, each
    ``document_tokens`` = 500..4,000). Each request is a shared retrieval instruction
    (``instruction_tokens``, default 200), then ``docs_per_request`` (2..4) distinct documents
    drawn by Zipf-like popularity (weight ``1 / rank ** zipf_exponent``) in draw order, then a
    unique question of ``question_tokens`` (20..200); replies are ``output_tokens`` (50..500).
    Tenants are drawn uniformly from ``tenants`` (8) per request, so popular documents recur
    across tenants. A different document order is a different prefix: block ids diverge from the
    first block that differs.

``builtin_workload`` ("builtin")
    The mixed workload of ``kvctl.workload.builtin`` (2,000 requests by default).

``multi_tenant_mix`` ("mix")
    The system-prompt, chat and rag generators run side by side, as three products sharing one
    cache: each part is its generator with its defaults and the mix's ``seed`` (so with
    ``requests=None`` the parts hold exactly the requests of ``system-prompt``, ``chat`` and
    ``rag`` at that seed, about 100 + 1,000 + 1,000), merged by arrival time. Each part arrives
    at its share of ``rate_per_second`` (shares by size, see ``MIX_PARTS``), so all three span
    about the same time instead of the 100 system-prompt requests all landing first. A part's
    tenants are prefixed with its name (``chat/tenant-3``), so no tenant spans two parts. Its
    content ids are offset past the previous parts' and the block ids recomputed by one
    ``PrefixIds`` over the merged stream: no block id is shared between parts, equal ids still
    mean equal prefixes, numbered from 0 in order of first appearance like any generator's.
    Timestamps are bumped by 1 ms where two parts' arrivals collide, to stay strictly increasing.
    ``requests`` is split over the parts in proportion to ``MIX_PARTS`` (largest remainder, ties
    to the earlier part), each part sized as ``generate`` sizes it alone.

``generate(name, seed, requests=..., block_tokens=...)`` runs a generator by name with its
defaults; ``requests`` sets how many requests it produces (see ``generate``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvctl.errors import InvalidArgument
from kvctl.workload.builtin import builtin_workload
from kvctl.workload.segments import PrefixIds, Segment
from kvctl.workload.trace import DEFAULT_BLOCK_TOKENS, TraceRequest

DEFAULT_RATE_PER_SECOND = 4.0
DEFAULT_PROMPT_TOKENS = (1_000, 5_000, 10_000, 50_000, 100_000)
DEFAULT_TURNS = (2, 8)

TokenRange = tuple[int, int]
"""(min, max) tokens, both inclusive."""

_Arrival = tuple[str, list[Segment], int]
"""(tenant, input segments, output tokens) of one request, before timestamps and block ids."""


# --- argument checks --------------------------------------------------------------------------


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_range(name: str, value: TokenRange, minimum: int) -> None:
    if (
        not isinstance(value, tuple | list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        or not minimum <= value[0] <= value[1]
    ):
        raise InvalidArgument(
            f"{name} must be a (min, max) pair of integers with {minimum} <= min <= max,"
            f" got {value!r}"
        )


def _check_common(tenants: int, rate_per_second: float, block_tokens: int) -> None:
    _check_at_least("tenants", tenants, 1)
    _check_at_least("block_tokens", block_tokens, 1)
    if not (
        isinstance(rate_per_second, int | float)
        and math.isfinite(rate_per_second)
        and rate_per_second > 0
    ):
        raise InvalidArgument(
            f"rate_per_second must be a positive finite number, got {rate_per_second!r}"
        )


# --- shared machinery -------------------------------------------------------------------------


def _tenant_names(tenants: int) -> list[str]:
    return [f"tenant-{i}" for i in range(tenants)]


def _materialise(
    arrivals: Iterable[_Arrival], rng: random.Random, rate_per_second: float, block_tokens: int
) -> list[TraceRequest]:
    """Stamp arrivals (in order) with Poisson timestamps and prefix-block ids of one workload."""
    prefix_ids = PrefixIds()
    out: list[TraceRequest] = []
    clock_seconds = 0.0
    last_ms = -1
    for tenant, segments, output_tokens in arrivals:
        clock_seconds += rng.expovariate(rate_per_second)
        last_ms = max(int(clock_seconds * 1000), last_ms + 1)  # strictly increasing, in ms
        out.append(
            TraceRequest(
                timestamp_ms=last_ms,
                input_tokens=sum(tokens for _, tokens in segments),
                output_tokens=output_tokens,
                block_ids=prefix_ids.block_ids(segments, block_tokens),
                tenant=tenant,
                block_tokens=block_tokens,
                segments=tuple(segments),
            )
        )
    return out


# --- (a) shared system prompt -----------------------------------------------------------------


def shared_system_prompt(
    seed: int = 0,
    *,
    prompt_tokens: tuple[int, ...] = DEFAULT_PROMPT_TOKENS,
    group_size: int = 20,
    input_tokens: int = 256,
    output_tokens: int = 512,
    tenants: int = 8,
    tenants_per_prompt: int = 3,
    interleave: bool = True,
    rate_per_second: float = DEFAULT_RATE_PER_SECOND,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Groups of requests sharing one system prompt per size in ``prompt_tokens``.

    Request ``input_tokens`` is the prompt size plus ``input_tokens`` (the unique user input).
    ``tenants_per_prompt`` is capped at ``tenants``. See the module docstring.
    """
    if not isinstance(prompt_tokens, tuple | list) or not prompt_tokens:
        raise InvalidArgument(f"prompt_tokens must be a non-empty sequence, got {prompt_tokens!r}")
    for size in prompt_tokens:
        _check_at_least("every prompt_tokens size", size, 1)
    _check_at_least("group_size", group_size, 0)
    _check_at_least("input_tokens", input_tokens, 1)
    _check_at_least("output_tokens", output_tokens, 1)
    _check_at_least("tenants_per_prompt", tenants_per_prompt, 1)
    _check_common(tenants, rate_per_second, block_tokens)
    rng = random.Random(seed)
    content_ids = itertools.count()
    names = _tenant_names(tenants)
    per_prompt = min(tenants_per_prompt, tenants)
    # (system prompt segment, tenant) per request, group by group.
    plan: list[tuple[Segment, str]] = []
    for size in prompt_tokens:
        prompt: Segment = (next(content_ids), size)
        owners = rng.sample(names, per_prompt)
        group_tenants = [owners[i % per_prompt] for i in range(group_size)]
        rng.shuffle(group_tenants)
        plan += [(prompt, tenant) for tenant in group_tenants]
    if interleave:
        rng.shuffle(plan)
    arrivals = (
        (tenant, [prompt, (next(content_ids), input_tokens)], output_tokens)
        for prompt, tenant in plan
    )
    return _materialise(arrivals, rng, rate_per_second, block_tokens)


# --- (b) multi-turn chat ----------------------------------------------------------------------


@dataclass
class _Conversation:
    tenant: str
    turns_left: int
    history: list[Segment]
    last_output_tokens: int = 0


def multi_turn_chat(
    seed: int = 0,
    *,
    conversations: int = 200,
    turns: TokenRange = DEFAULT_TURNS,
    user_tokens: TokenRange = (20, 800),
    output_tokens: TokenRange = (50, 800),
    system_prompt_tokens: int = 1_000,
    tenants: int = 8,
    active_conversations: int = 8,
    requests: int | None = None,
    rate_per_second: float = DEFAULT_RATE_PER_SECOND,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Interleaved multi-turn conversations; each turn extends the previous turn's input.

    ``turns`` is the (min, max) number of turns per conversation; ``requests`` (None: no limit)
    stops after that many requests. See the module docstring.
    """
    _check_at_least("conversations", conversations, 0)
    _check_range("turns", turns, 1)
    _check_range("user_tokens", user_tokens, 1)
    _check_range("output_tokens", output_tokens, 1)
    _check_at_least("system_prompt_tokens", system_prompt_tokens, 0)
    _check_at_least("active_conversations", active_conversations, 1)
    if requests is not None:
        _check_at_least("requests", requests, 0)
    _check_common(tenants, rate_per_second, block_tokens)
    rng = random.Random(seed)
    content_ids = itertools.count()
    system_prompt: list[Segment] = (
        [(next(content_ids), system_prompt_tokens)] if system_prompt_tokens else []
    )
    names = _tenant_names(tenants)
    owners = [names[i % tenants] for i in range(conversations)]
    rng.shuffle(owners)

    def arrivals() -> Iterator[_Arrival]:
        started = 0
        active: list[_Conversation] = []
        emitted = 0
        while requests is None or emitted < requests:
            while len(active) < active_conversations and started < conversations:
                active.append(_Conversation(owners[started], rng.randint(*turns), []))
                started += 1
            if not active:
                return
            chat = rng.choice(active)
            user_message: Segment = (next(content_ids), rng.randint(*user_tokens))
            if chat.history:
                # The previous reply becomes context before the new user message.
                chat.history += [(next(content_ids), chat.last_output_tokens), user_message]
            else:
                chat.history = [*system_prompt, user_message]
            chat.last_output_tokens = rng.randint(*output_tokens)
            chat.turns_left -= 1
            if chat.turns_left == 0:
                active.remove(chat)
            emitted += 1
            yield chat.tenant, list(chat.history), chat.last_output_tokens

    return _materialise(arrivals(), rng, rate_per_second, block_tokens)


# --- (c) retrieval-augmented generation -------------------------------------------------------


def rag(
    seed: int = 0,
    *,
    documents: int = 200,
    document_tokens: TokenRange = (500, 4_000),
    docs_per_request: TokenRange = (2, 4),
    tenants: int = 8,
    requests: int = 1_000,
    instruction_tokens: int = 200,
    question_tokens: TokenRange = (20, 200),
    output_tokens: TokenRange = (50, 500),
    zipf_exponent: float = 1.0,
    rate_per_second: float = DEFAULT_RATE_PER_SECOND,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Instruction, then popular documents from a shared pool in varying order, then a question.

    ``docs_per_request`` is the (min, max) number of distinct documents per request; its max must
    not exceed ``documents``. See the module docstring.
    """
    _check_at_least("documents", documents, 1)
    _check_range("document_tokens", document_tokens, 1)
    _check_range("docs_per_request", docs_per_request, 1)
    if docs_per_request[1] > documents:
        raise InvalidArgument(
            f"docs_per_request max {docs_per_request[1]} exceeds the {documents} documents"
        )
    _check_at_least("requests", requests, 0)
    _check_at_least("instruction_tokens", instruction_tokens, 0)
    _check_range("question_tokens", question_tokens, 1)
    _check_range("output_tokens", output_tokens, 1)
    if not (isinstance(zipf_exponent, int | float) and 0 <= zipf_exponent < math.inf):
        raise InvalidArgument(
            f"zipf_exponent must be a non-negative finite number, got {zipf_exponent!r}"
        )
    _check_common(tenants, rate_per_second, block_tokens)
    rng = random.Random(seed)
    content_ids = itertools.count()
    instruction: list[Segment] = (
        [(next(content_ids), instruction_tokens)] if instruction_tokens else []
    )
    pool = [(next(content_ids), rng.randint(*document_tokens)) for _ in range(documents)]
    cum_weights = list(
        itertools.accumulate(1.0 / (rank + 1) ** zipf_exponent for rank in range(documents))
    )
    names = _tenant_names(tenants)

    def arrivals() -> Iterator[_Arrival]:
        for _ in range(requests):
            wanted = rng.randint(*docs_per_request)
            picked: list[Segment] = []
            while len(picked) < wanted:
                doc = rng.choices(pool, cum_weights=cum_weights)[0]
                if doc not in picked:
                    picked.append(doc)  # draw order is the order in the prompt
            question: Segment = (next(content_ids), rng.randint(*question_tokens))
            segments = [*instruction, *picked, question]
            yield rng.choice(names), segments, rng.randint(*output_tokens)

    return _materialise(arrivals(), rng, rate_per_second, block_tokens)


# --- (d) multi-tenant mix ---------------------------------------------------------------------

MIX_PARTS: dict[str, int] = {
    "system-prompt": len(DEFAULT_PROMPT_TOKENS) * 20,  # groups of 20
    "chat": 200 * sum(DEFAULT_TURNS) // 2,  # 200 conversations, 5 turns on average
    "rag": 1_000,
}
"""The mix's parts and their default sizes in requests: the weights of the request split and of
the arrival rate."""


def _split(requests: int, weights: dict[str, int]) -> dict[str, int]:
    """``requests`` in proportion to ``weights``: floors, then the largest remainders (ties to
    the earlier name) get one more, so the parts add up to ``requests`` exactly."""
    total = sum(weights.values())
    counts = {name: requests * weight // total for name, weight in weights.items()}
    by_remainder = sorted(weights, key=lambda name: -(requests * weights[name] % total))
    for name in by_remainder[: requests - sum(counts.values())]:
        counts[name] += 1
    return counts


def multi_tenant_mix(
    seed: int = 0,
    *,
    requests: int | None = None,
    rate_per_second: float = DEFAULT_RATE_PER_SECOND,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """The system-prompt, chat and rag generators merged by arrival time, tenants and block ids
    kept apart per part; ``requests`` (None: each part's default size) split by ``MIX_PARTS``.
    See the module docstring."""
    if requests is not None:
        _check_at_least("requests", requests, 0)
    _check_common(1, rate_per_second, block_tokens)
    sizes = MIX_PARTS if requests is None else _split(requests, MIX_PARTS)
    total = sum(sizes.values())
    # (timestamp, part, index in part, request) so the merge is a deterministic total order
    arrivals: list[tuple[int, int, int, TraceRequest]] = []
    content_offset = 0
    for part, (name, size) in enumerate(sizes.items()):
        if size == 0:
            continue
        rate = rate_per_second * size / total  # each part spans about the same time
        got = _sized(
            name,
            seed,
            None if requests is None else size,
            block_tokens=block_tokens,
            rate_per_second=rate,
        )
        last_content = content_offset - 1
        for index, request in enumerate(got):
            segments = tuple((content_offset + c, tokens) for c, tokens in request.segments)
            last_content = max(last_content, *(c for c, _ in segments))
            renamed = dataclasses.replace(
                request, tenant=f"{name}/{request.tenant}", segments=segments
            )
            arrivals.append((request.timestamp_ms, part, index, renamed))
        content_offset = last_content + 1
    arrivals.sort(key=lambda arrival: arrival[:3])
    prefix_ids = PrefixIds()
    out: list[TraceRequest] = []
    last_ms = -1
    for timestamp_ms, _, _, request in arrivals:
        last_ms = max(timestamp_ms, last_ms + 1)
        out.append(
            dataclasses.replace(
                request,
                timestamp_ms=last_ms,
                block_ids=prefix_ids.block_ids(list(request.segments), block_tokens),
            )
        )
    return out


# --- registry ---------------------------------------------------------------------------------

GENERATORS: dict[str, Callable[..., list[TraceRequest]]] = {
    "system-prompt": shared_system_prompt,
    "chat": multi_turn_chat,
    "rag": rag,
    "builtin": builtin_workload,
    "mix": multi_tenant_mix,
}
"""Workload generators by name; each takes ``seed`` first, then keyword-only options."""


def generate(
    name: str,
    seed: int = 0,
    *,
    requests: int | None = None,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Run the generator ``name`` with its defaults; ``requests`` (None: default size) sets the
    number of requests produced, scaling the generator's natural size:

    - "system-prompt": ``group_size = ceil(requests / number of prompt sizes)``, then the first
      ``requests`` arrivals (when it does not divide, the few dropped arrivals leave some groups
      a request or so short);
    - "chat": enough conversations (``ceil(requests / min turns)``), stopped after ``requests``;
    - "rag" and "builtin": ``requests`` requests, the first ones of the same stream as any larger
      count for the same seed;
    - "mix": ``requests`` split over its parts in proportion to ``MIX_PARTS`` (100 : 1,000 :
      1,000), each part sized as above.
    """
    if name not in GENERATORS:
        raise InvalidArgument(
            f"unknown workload {name!r}; choose one of: {', '.join(sorted(GENERATORS))}"
        )
    if requests is not None:
        _check_at_least("requests", requests, 0)
    return _sized(name, seed, requests, block_tokens=block_tokens)


def _sized(
    name: str, seed: int, requests: int | None, *, block_tokens: int, **options: Any
) -> list[TraceRequest]:
    """``generate``'s sizing, passing ``options`` (e.g. ``rate_per_second``) to the generator."""
    if requests is None:
        return GENERATORS[name](seed, block_tokens=block_tokens, **options)
    if name == "system-prompt":
        group_size = max(1, -(-requests // len(DEFAULT_PROMPT_TOKENS)))
        return shared_system_prompt(
            seed, group_size=group_size, block_tokens=block_tokens, **options
        )[:requests]
    if name == "chat":
        conversations = -(-requests // DEFAULT_TURNS[0])
        return multi_turn_chat(
            seed,
            conversations=conversations,
            requests=requests,
            block_tokens=block_tokens,
            **options,
        )
    return GENERATORS[name](seed, requests=requests, block_tokens=block_tokens, **options)
