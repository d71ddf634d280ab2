"""Seeded workload generators: determinism, shapes, prefix sharing, tenants and the registry."""

from __future__ import annotations

import collections
import itertools
from typing import Any

import pytest

from kvctl.errors import InvalidArgument
from kvctl.workload.builtin import builtin_workload
from kvctl.workload.generators import (
    DEFAULT_PROMPT_TOKENS,
    GENERATORS,
    MIX_PARTS,
    generate,
    multi_tenant_mix,
    multi_turn_chat,
    rag,
    shared_system_prompt,
)
from kvctl.workload.segments import PrefixIds
from kvctl.workload.source import load_workload
from kvctl.workload.trace import TraceRequest, prefix_hit_blocks

NEW_GENERATORS = ("system-prompt", "chat", "rag")


def _reuse_and_sharing(requests: list[TraceRequest]) -> tuple[int, int]:
    """Prefix-hit blocks served by the same tenant (reuse) and by another tenant (sharing).

    A hit block counts as reuse when this tenant held it before, else as sharing."""
    holders: dict[int, set[str]] = collections.defaultdict(set)
    reuse = sharing = 0
    for request, n_hit in zip(requests, prefix_hit_blocks(requests), strict=True):
        for block_id in request.block_ids[:n_hit]:
            if request.tenant in holders[block_id]:
                reuse += 1
            else:
                sharing += 1
        for block_id in request.block_ids:
            holders[block_id].add(request.tenant)
    return reuse, sharing


@pytest.mark.parametrize("name", NEW_GENERATORS)
def test_same_seed_same_workload_other_seed_differs(name: str) -> None:
    assert generate(name, 3, requests=200) == generate(name, 3, requests=200)
    assert generate(name, 3, requests=200) != generate(name, 4, requests=200)


@pytest.mark.parametrize("name", NEW_GENERATORS)
@pytest.mark.parametrize("block_tokens", [512, 100])
def test_requests_are_consistent(name: str, block_tokens: int) -> None:
    requests = generate(name, block_tokens=block_tokens)
    assert 0 < len(requests) <= 5_000  # the default sizes stay moderate
    timestamps = [r.timestamp_ms for r in requests]
    assert timestamps[0] >= 0
    assert all(a < b for a, b in itertools.pairwise(timestamps))
    for request in requests:
        assert request.tenant.startswith("tenant-")
        assert request.segments
        assert sum(tokens for _, tokens in request.segments) == request.input_tokens
        assert len(request.block_ids) == -(-request.input_tokens // block_tokens)
        assert request.block_tokens == block_tokens
        assert request.output_tokens > 0
    # The block ids are those of one PrefixIds over the whole workload, in arrival order.
    prefix_ids = PrefixIds()
    for request in requests:
        assert prefix_ids.block_ids(list(request.segments), block_tokens) == request.block_ids


@pytest.mark.parametrize("name", NEW_GENERATORS)
def test_tenants_both_reuse_and_share_prefixes(name: str) -> None:
    requests = generate(name)
    assert len({r.tenant for r in requests}) == 8
    reuse, sharing = _reuse_and_sharing(requests)
    assert reuse > 0 and sharing > 0


@pytest.mark.parametrize("name", [*NEW_GENERATORS, "builtin", "mix"])
@pytest.mark.parametrize("count", [0, 1, 7, 123])
def test_generate_sets_the_request_count(name: str, count: int) -> None:
    requests = generate(name, requests=count, block_tokens=256)
    assert len(requests) == count
    assert all(r.block_tokens == 256 for r in requests)


def test_registry_names() -> None:
    assert set(GENERATORS) == {"system-prompt", "chat", "rag", "builtin", "mix"}
    assert GENERATORS["builtin"] is builtin_workload
    assert generate("builtin", 2, requests=50) == builtin_workload(2, requests=50)


def test_unknown_generator_lists_the_names() -> None:
    with pytest.raises(InvalidArgument, match="unknown workload 'nope'") as excinfo:
        generate("nope")
    for name in GENERATORS:
        assert name in str(excinfo.value)
    with pytest.raises(InvalidArgument, match="requests"):
        generate("rag", requests=-1)


# --- (a) shared system prompt -----------------------------------------------------------------


def test_system_prompt_groups() -> None:
    requests = shared_system_prompt(5)
    assert len(requests) == len(DEFAULT_PROMPT_TOKENS) * 20
    groups: dict[tuple[int, int], list[TraceRequest]] = collections.defaultdict(list)
    for request in requests:
        prompt, user_input = request.segments
        assert user_input[1] == 256
        assert request.input_tokens == prompt[1] + 256
        assert request.output_tokens == 512
        groups[prompt].append(request)
    assert sorted(tokens for _, tokens in groups) == sorted(DEFAULT_PROMPT_TOKENS)
    assert all(len(group) == 20 for group in groups.values())
    # Every user input is its own content.
    assert len({r.segments[1][0] for r in requests}) == len(requests)
    full_blocks_by_group = []
    for (_, prompt_tokens), group in groups.items():
        full = prompt_tokens // 512
        shared = {r.block_ids[:full] for r in group}
        assert len(shared) == 1
        assert len({r.block_ids[full:] for r in group}) == len(group)  # beyond: all unique
        full_blocks_by_group.append(set(next(iter(shared))))
        tenants = collections.Counter(r.tenant for r in group)
        assert len(tenants) == 3  # several tenants share the prompt ...
        assert max(tenants.values()) > 1  # ... and each reuses it
    for a, b in itertools.combinations(full_blocks_by_group, 2):
        assert not a & b


def test_system_prompt_interleaving() -> None:
    interleaved = [r.segments[0] for r in shared_system_prompt(1)]
    assert len({prompt for prompt in interleaved[:20]}) > 1
    sequential = [r.segments[0] for r in shared_system_prompt(1, interleave=False)]
    assert [tokens for _, tokens in dict.fromkeys(sequential)] == list(DEFAULT_PROMPT_TOKENS)
    assert all(len(set(sequential[i : i + 20])) == 1 for i in range(0, 100, 20))


def test_system_prompt_custom_shape() -> None:
    requests = shared_system_prompt(
        prompt_tokens=(600, 1_500), group_size=4, input_tokens=10, output_tokens=3, tenants=1
    )
    assert len(requests) == 8
    assert {r.input_tokens for r in requests} == {610, 1_510}
    assert {r.tenant for r in requests} == {"tenant-0"}
    assert {r.output_tokens for r in requests} == {3}


# --- (b) multi-turn chat ----------------------------------------------------------------------


def test_chat_turns_extend_the_previous_turn() -> None:
    requests = multi_turn_chat(2, conversations=40, turns=(2, 5))
    by_segments = {r.segments: (i, r) for i, r in enumerate(requests)}
    system_prompt = requests[0].segments[0]
    seen_content: set[int] = set()
    first_turns = 0
    turns_of: dict[tuple[int, int], int] = {}  # first user message -> turns
    for i, request in enumerate(requests):
        assert request.segments[0] == system_prompt  # shared by every conversation
        if len(request.segments) == 2:
            first_turns += 1
            turns_of[request.segments[1]] = 1
        else:
            j, previous = by_segments[request.segments[:-2]]
            assert j < i
            assert previous.tenant == request.tenant  # one tenant per conversation
            reply, message = request.segments[-2:]
            assert reply[1] == previous.output_tokens  # the previous reply, as new content
            assert reply[0] not in seen_content and message[0] not in seen_content
            full = previous.input_tokens // 512
            assert request.block_ids[:full] == previous.block_ids[:full]
            turns_of[request.segments[1]] += 1
        seen_content.update(content_id for content_id, _ in request.segments)
    assert first_turns == 40
    assert all(2 <= n <= 5 for n in turns_of.values())
    assert len(requests) == sum(turns_of.values())
    # Conversations interleave: consecutive requests often belong to different conversations.
    starts = [r.segments[1] for r in requests]
    assert sum(a != b for a, b in itertools.pairwise(starts)) > len(requests) // 2


def test_chat_without_system_prompt_and_with_a_request_cap() -> None:
    requests = multi_turn_chat(system_prompt_tokens=0, requests=30)
    assert len(requests) == 30
    first_contents = {r.segments[0] for r in requests}
    # Every conversation starts with its own user message, so only turns share a first segment.
    assert len(first_contents) == sum(len(r.segments) == 1 for r in requests)


# --- (c) RAG ----------------------------------------------------------------------------------


def test_rag_documents_recur_across_tenants_in_varying_order() -> None:
    requests = rag(7, documents=50, requests=400)
    instruction = requests[0].segments[0]
    questions = set()
    tenants_of: dict[int, set[str]] = collections.defaultdict(set)
    uses: collections.Counter[int] = collections.Counter()
    order_pairs: set[tuple[int, int]] = set()
    for request in requests:
        first, *docs, question = request.segments
        assert first == instruction
        assert 2 <= len(docs) <= 4
        assert len(set(docs)) == len(docs)
        assert question[0] not in questions
        questions.add(question[0])
        for content_id, tokens in docs:
            assert 500 <= tokens <= 4_000
            tenants_of[content_id].add(request.tenant)
            uses[content_id] += 1
        order_pairs |= {(a[0], b[0]) for a, b in itertools.combinations(docs, 2)}
    assert len(tenants_of) <= 50
    assert sum(len(t) > 1 for t in tenants_of.values()) > 10
    # Different orders of the same documents occur, and they are different prefixes.
    assert any((b, a) in order_pairs for a, b in order_pairs)
    # Zipf-like popularity: the favourite document is used far more than a typical one.
    counts = sorted(uses.values(), reverse=True)
    assert counts[0] > 3 * counts[len(counts) // 2]


def test_rag_order_changes_block_ids() -> None:
    requests = rag(0, documents=2, docs_per_request=(2, 2), instruction_tokens=0, requests=50)
    orders = {tuple(c for c, _ in r.segments[:2]): r.block_ids[0] for r in requests}
    assert len(orders) == 2  # both orders occur ...
    assert len(set(orders.values())) == 2  # ... and start with different blocks


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("generator", "kwargs", "problem"),
    [
        (shared_system_prompt, {"prompt_tokens": ()}, "prompt_tokens"),
        (shared_system_prompt, {"prompt_tokens": (100, 0)}, "prompt_tokens"),
        (shared_system_prompt, {"group_size": -1}, "group_size"),
        (shared_system_prompt, {"input_tokens": 0}, "input_tokens"),
        (shared_system_prompt, {"tenants": 0}, "tenants"),
        (shared_system_prompt, {"rate_per_second": 0.0}, "rate_per_second"),
        (shared_system_prompt, {"rate_per_second": float("inf")}, "rate_per_second"),
        (shared_system_prompt, {"block_tokens": 0}, "block_tokens"),
        (multi_turn_chat, {"turns": (3, 2)}, "turns"),
        (multi_turn_chat, {"turns": (0, 2)}, "turns"),
        (multi_turn_chat, {"user_tokens": (5,)}, "user_tokens"),
        (multi_turn_chat, {"conversations": -1}, "conversations"),
        (multi_turn_chat, {"active_conversations": 0}, "active_conversations"),
        (multi_turn_chat, {"system_prompt_tokens": -5}, "system_prompt_tokens"),
        (rag, {"documents": 0}, "documents"),
        (rag, {"documents": 3, "docs_per_request": (2, 4)}, "exceeds the 3 documents"),
        (rag, {"document_tokens": (10, 5)}, "document_tokens"),
        (rag, {"requests": -1}, "requests"),
        (rag, {"zipf_exponent": -1.0}, "zipf_exponent"),
    ],
)
def test_invalid_arguments_are_rejected(
    generator: Any, kwargs: dict[str, Any], problem: str
) -> None:
    with pytest.raises(InvalidArgument, match=problem):
        generator(**kwargs)


# --- (d) multi-tenant mix ---------------------------------------------------------------------


def _part(request: TraceRequest) -> str:
    return request.tenant.split("/", 1)[0]


def test_mix_is_deterministic_under_the_seed() -> None:
    assert generate("mix", 5, requests=300) == generate("mix", 5, requests=300)
    assert generate("mix", 5, requests=300) != generate("mix", 6, requests=300)
    assert generate("mix", 5) == multi_tenant_mix(5)


@pytest.mark.parametrize("block_tokens", [512, 100])
def test_mix_keeps_its_parts_apart(block_tokens: int) -> None:
    requests = generate("mix", 1, block_tokens=block_tokens)
    by_part: dict[str, list[TraceRequest]] = collections.defaultdict(list)
    for request in requests:
        by_part[_part(request)].append(request)
    assert set(by_part) == set(MIX_PARTS)
    # Each part is its generator at the same seed, tenants prefixed with the part's name.
    for name, part in by_part.items():
        alone = generate(name, 1, block_tokens=block_tokens)
        assert [(r.input_tokens, r.output_tokens) for r in part] == [
            (r.input_tokens, r.output_tokens) for r in alone
        ]
        assert [r.tenant for r in part] == [f"{name}/{r.tenant}" for r in alone]
    tenants = {name: {r.tenant for r in part} for name, part in by_part.items()}
    blocks = {name: {b for r in part for b in r.block_ids} for name, part in by_part.items()}
    contents = {name: {c for r in part for c, _ in r.segments} for name, part in by_part.items()}
    for a, b in itertools.combinations(MIX_PARTS, 2):
        assert not tenants[a] & tenants[b]
        assert not blocks[a] & blocks[b], (a, b)
        assert not contents[a] & contents[b], (a, b)  # the replay's tokens never collide either
    # Renumbered, a part's block ids still share exactly where its own generator's do.
    for name, part in by_part.items():
        alone = generate(name, 1, block_tokens=block_tokens)
        pairs = {
            (x, y)
            for mixed, own in zip(part, alone, strict=True)
            for x, y in zip(mixed.block_ids, own.block_ids, strict=True)
        }
        assert len({x for x, _ in pairs}) == len({y for _, y in pairs}) == len(pairs)
    timestamps = [r.timestamp_ms for r in requests]
    assert all(a < b for a, b in itertools.pairwise(timestamps))
    # One PrefixIds over the merged stream, as for any generator.
    prefix_ids = PrefixIds()
    for request in requests:
        assert prefix_ids.block_ids(list(request.segments), block_tokens) == request.block_ids


def test_mix_parts_arrive_side_by_side() -> None:
    """Each part gets its share of the arrival rate, so the 100 system-prompt requests spread over
    the whole mix instead of all arriving before the others' first tenth."""
    requests = generate("mix", 0)
    end_ms = requests[-1].timestamp_ms
    for name in MIX_PARTS:
        last_ms = max(r.timestamp_ms for r in requests if _part(r) == name)
        assert last_ms > 0.7 * end_ms, name


def test_mix_splits_the_request_count_by_the_parts_default_sizes() -> None:
    counts = collections.Counter(_part(r) for r in generate("mix", 0, requests=210))
    assert counts == {"system-prompt": 10, "chat": 100, "rag": 100}
    counts = collections.Counter(_part(r) for r in generate("mix", 0, requests=7))
    assert counts == {"system-prompt": 1, "chat": 3, "rag": 3}  # remainders tied: earlier part
    with pytest.raises(InvalidArgument, match="requests"):
        multi_tenant_mix(requests=-1)


def test_simulate_cli_runs_the_mix() -> None:
    import json

    from typer.testing import CliRunner

    from kvctl.cli.main import app

    args = ["simulate", "--workload", "mix", "--capacity-fraction", "0.05", "--policy"]
    result = CliRunner().invoke(app, [*args, "lineage-lru2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["trace"] == "mix:seed=0"
    assert data["unique_blocks"] == len({b for r in generate("mix", 0) for b in r.block_ids})
    rows = {row["policy"]: row for row in data["results"]}
    assert set(rows) == {"lineage-lru2", "lru", "belady"}
    assert 0 < rows["lineage-lru2"]["hit_ratio"] <= rows["belady"]["hit_ratio"]
    help_text = CliRunner().invoke(app, ["simulate", "--help"]).output
    assert "mix" in help_text


# --- load_workload ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*NEW_GENERATORS, "mix"])
def test_load_workload_by_name(name: str) -> None:
    workload = load_workload(None, seed=2, workload=name)
    assert workload.name == f"{name}:seed=2"
    assert workload.requests == generate(name, 2)
    limited = load_workload(None, seed=2, limit=40, workload=name)
    assert len(limited.requests) == 40
    assert limited.name == f"{name}:seed=2"


def test_load_workload_default_is_still_builtin() -> None:
    workload = load_workload(None, seed=1, limit=30)
    assert workload.name == "builtin:seed=1"
    assert workload.requests == builtin_workload(1, requests=30)


def test_load_workload_unknown_name() -> None:
    with pytest.raises(InvalidArgument, match="system-prompt"):
        load_workload(None, workload="nope")


@pytest.mark.parametrize("name", ["builtin", "mix"])
def test_load_workload_negative_limit_is_named_as_such(name: str) -> None:
    # a generated workload said "requests must be an integer >= 0", naming no option the
    # user gave; a trace said "limit must be non-negative"
    with pytest.raises(InvalidArgument, match="limit must be non-negative, got -1"):
        load_workload(None, limit=-1, workload=name)
