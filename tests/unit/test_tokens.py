"""Requests to token ids and chunk keys: the replay's keys are the keys an engine computes."""

from __future__ import annotations

import numpy as np
import pytest

from kvctl.errors import InvalidArgument
from kvctl.store.keys import KVLayout, Namespace, keys_for
from kvctl.workload.generators import generate
from kvctl.workload.tokens import KeyChainer, content_tokens, request_tokens
from kvctl.workload.trace import TraceRequest, assign_tenants

NS = Namespace("m", KVLayout(2, 2, 8))


def _chainer(chunk_tokens: int, isolated: frozenset[str] = frozenset()) -> KeyChainer:
    return KeyChainer(
        lambda t: Namespace("m", KVLayout(2, 2, 8), t if t in isolated else ""), chunk_tokens
    )


def test_content_tokens_are_stable_slices() -> None:
    whole = content_tokens(7, 0, 1000)
    assert whole.dtype == np.uint32
    assert int(whole.max()) < 32_000
    assert np.array_equal(content_tokens(7, 300, 700), whole[300:700])
    assert not np.array_equal(content_tokens(8, 0, 1000), whole)
    assert len(set(whole.tolist())) > 900  # scattered, not a short cycle


@pytest.mark.parametrize("bad", [(-1, 0, 1), (2**64, 0, 1), (1, 5, 4), (1, -1, 3)])
def test_content_tokens_refuse_bad_ranges(bad: tuple[int, int, int]) -> None:
    with pytest.raises(InvalidArgument):
        content_tokens(*bad)


@pytest.mark.parametrize("workload", ["builtin", "system-prompt", "chat", "rag"])
@pytest.mark.parametrize("chunk_tokens", [100, 256, 512])
def test_keys_equal_keys_for_of_the_expanded_tokens(workload: str, chunk_tokens: int) -> None:
    chainer = _chainer(chunk_tokens)
    for request in generate(workload, 3, requests=25):
        expected = keys_for(request_tokens(request).tolist(), NS, chunk_tokens)
        assert chainer.keys(request) == expected


def test_memo_hashes_each_distinct_chunk_once() -> None:
    requests = generate("system-prompt", 0, requests=40)
    chainer = _chainer(256)
    total = sum(len(chainer.keys(r)) for r in requests)
    distinct = {k for r in requests for k in chainer.keys(r)}
    assert chainer.hashed == len(distinct) < total


@pytest.mark.parametrize("chunk_tokens", [64, 256, 512, 700])
def test_equal_trace_ids_give_equal_chunks_at_any_chunk_size(chunk_tokens: int) -> None:
    # two requests agree on their first two 512-token blocks, then differ
    a = TraceRequest(0, 2048, 1, (1, 2, 3, 4))
    b = TraceRequest(1, 2048, 1, (1, 2, 9, 10))
    ka, kb = _chainer(chunk_tokens).keys(a), _chainer(chunk_tokens).keys(b)
    shared = 1024 // chunk_tokens  # chunks that end inside the common 1,024 tokens
    assert ka[:shared] == kb[:shared]
    assert ka[shared:] != kb[shared:] and ka[shared] != kb[shared]


def test_partial_tail_is_not_a_key() -> None:
    assert len(_chainer(256).keys(TraceRequest(0, 1000, 1, (1, 2)))) == 3


def test_isolated_tenants_never_share_keys() -> None:
    chainer = _chainer(256, frozenset({"secret"}))
    base = TraceRequest(0, 1024, 1, (1, 2))
    shared = [chainer.keys(TraceRequest(0, 1024, 1, (1, 2), tenant=t)) for t in ("a", "b")]
    secret = chainer.keys(TraceRequest(0, 1024, 1, (1, 2), tenant="secret"))
    assert shared[0] == shared[1] == _chainer(256).keys(base)
    assert not set(secret) & set(shared[0])


def test_assign_tenants_keeps_conversations_together() -> None:
    requests = [
        TraceRequest(0, 1024, 1, (1, 2)),
        TraceRequest(1, 1536, 1, (5, 6, 7)),
        TraceRequest(2, 2048, 1, (1, 2, 3, 4)),  # continues request 0
        TraceRequest(3, 2600, 1, (1, 2, 3, 4, 8, 11)),  # continues request 2
        TraceRequest(4, 512, 1, (5,), tenant="given"),
    ]
    out = assign_tenants(requests, 50, seed=1)
    assert out[0].tenant == out[2].tenant == out[3].tenant
    assert out[4].tenant == "given"
    assert all(r.tenant.startswith("tenant-") for r in out[:4])
    assert assign_tenants(requests, 50, seed=1) == out
    assert [r.block_ids for r in out] == [r.block_ids for r in requests]
    with pytest.raises(InvalidArgument):
        assign_tenants(requests, 0)


def test_shared_trace_expands_and_keys_match_prefix_hits(shared_trace) -> None:  # type: ignore[no-untyped-def]
    from kvctl.workload.trace import prefix_hit_blocks, read_mooncake_trace

    requests = read_mooncake_trace(shared_trace, limit=300)
    chainer = _chainer(512)
    seen: set[bytes] = set()
    hits = 0
    for r in requests:
        keys = chainer.keys(r)
        assert len(keys) == r.input_tokens // 512
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits += n
        seen.update(keys)
    # the keys' prefix hits are the trace's prefix hits over full blocks
    expected = sum(
        min(h, r.input_tokens // 512)
        for r, h in zip(requests, prefix_hit_blocks(requests), strict=True)
    )
    assert hits == expected > 0


def test_salts_keep_workloads_apart() -> None:
    from kvctl.workload.tokens import content_salt

    one, two = content_salt("rag:seed=0"), content_salt("chat:seed=0")
    assert one != two and content_salt("rag:seed=0") == one
    assert not np.array_equal(
        content_tokens(0, 0, 64, salt=one), content_tokens(0, 0, 64, salt=two)
    )
    salted = KeyChainer(lambda _: NS, 256, salt=one)
    request = generate("rag", 0, requests=1)[0]
    assert salted.keys(request) == keys_for(request_tokens(request, salt=one).tolist(), NS, 256)
    assert salted.keys(request) != _chainer(256).keys(request)
