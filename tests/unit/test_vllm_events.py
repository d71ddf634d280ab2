"""vLLM KV events -> kvctl chunk events: chains reassembled across events, chunk boundaries,
removal and re-store, clears, both encodings of vLLM's batches, malformed input and the memory
cap; every emitted key is checked against kvctl's own key function for the same tokens."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import msgpack
import pytest

from kvctl.errors import InvalidArgument
from kvctl.index.events import ChunkEvent
from kvctl.index.model import EmbeddedIndex
from kvctl.index.vllm_events import (
    MAX_MALFORMED_PER_BATCH,
    VllmEventSubscriber,
    VllmEventTranslator,
)
from kvctl.store.keys import KVLayout, Namespace, keys_for

LAYOUT = KVLayout(layers=2, kv_heads=2, head_dim=4)
NS = Namespace("test-model", LAYOUT)
BLOCK = 4  # vLLM's block_size here
CHUNK = 16  # kvctl chunk_tokens: 4 blocks
TOKENS = list(range(1000, 1000 + 4 * CHUNK))  # 4 chunks, 16 blocks


def translator(**kw: Any) -> VllmEventTranslator:
    kw.setdefault("namespace", NS)
    kw.setdefault("chunk_tokens", CHUNK)
    return VllmEventTranslator("engine-a", **kw)


def stored(
    hashes: list[Any], parent: Any, tokens: list[int], *, extra: tuple[Any, ...] = ("GPU",)
) -> list[Any]:
    """A BlockStored as a release with ``array_like`` encodes it (lora_id None, then medium)."""
    return ["BlockStored", hashes, parent, tokens, BLOCK, None, *extra]


def removed(hashes: list[Any]) -> list[Any]:
    return ["BlockRemoved", hashes, "GPU"]


def blocks(tokens: list[int], first: int = 0) -> list[tuple[int, list[int]]]:
    """(hash, tokens) per block; the hash is any id unique to the block's prefix."""
    return [(first + i, tokens[i * BLOCK : (i + 1) * BLOCK]) for i in range(len(tokens) // BLOCK)]


def store_one_by_one(t: VllmEventTranslator, tokens: list[int], first: int = 0) -> list[ChunkEvent]:
    out: list[ChunkEvent] = []
    parent = None
    for h, toks in blocks(tokens, first):
        out += t.translate([stored([h], parent, toks)])
        parent = h
    return out


def stored_keys(events: list[ChunkEvent]) -> list[bytes]:
    return [e.key for e in events if e.kind == "stored"]


def removed_keys(events: list[ChunkEvent]) -> list[bytes]:
    return [e.key for e in events if e.kind == "removed"]


def test_chunk_keys_equal_kvctl_keys_for_the_same_tokens() -> None:
    t = translator(tenant="acme")
    out = store_one_by_one(t, TOKENS)
    assert stored_keys(out) == keys_for(TOKENS, NS, CHUNK)
    e = out[0]
    assert (e.tier, e.tenant, e.isolated, e.tokens) == ("gpu", "acme", False, CHUNK)
    assert e.size_bytes == CHUNK * LAYOUT.bytes_per_token
    assert t.stats()["live_chunks"] == 4 and t.block_size == BLOCK


def test_a_chunk_is_emitted_when_its_last_block_arrives_not_before() -> None:
    t = translator()
    out = store_one_by_one(t, TOKENS[: CHUNK - BLOCK])  # 3 of the first chunk's 4 blocks
    assert out == []
    out = t.translate([stored([3], 2, TOKENS[CHUNK - BLOCK : CHUNK])])
    assert stored_keys(out) == keys_for(TOKENS[:CHUNK], NS, CHUNK)


def test_one_event_with_many_blocks_chains_them_and_a_later_event_continues() -> None:
    t = translator()
    # blocks 0..5 in one event (a chunk and a half), 6..11 in the next: the chunk that
    # straddles the two events is reassembled
    first = t.translate([stored(list(range(6)), None, TOKENS[: 6 * BLOCK])])
    second = t.translate([stored(list(range(6, 12)), 5, TOKENS[6 * BLOCK : 12 * BLOCK])])
    keys = keys_for(TOKENS, NS, CHUNK)
    assert stored_keys(first) == keys[:1]
    assert stored_keys(second) == keys[1:3]


def test_bytes_hashes_and_map_encoded_events_of_newer_releases() -> None:
    t = translator()
    hashes = [bytes([i + 1]) * 32 for i in range(8)]
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": TOKENS[: 8 * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
        "a_field_from_the_future": 1,
    }
    batch = {"ts": 1.5, "events": [event], "data_parallel_rank": 0}
    out = t.translate_payload(msgpack.packb(batch))
    assert stored_keys(out) == keys_for(TOKENS[: 2 * CHUNK], NS, CHUNK)
    out = t.translate_payload(
        msgpack.packb({"ts": 2.0, "events": [{"type": "BlockRemoved", "block_hashes": hashes[7:]}]})
    )
    assert removed_keys(out) == keys_for(TOKENS[: 2 * CHUNK], NS, CHUNK)[1:]
    out = t.translate_payload(msgpack.packb({"ts": 3.0, "events": [{"type": "AllBlocksCleared"}]}))
    assert removed_keys(out) == keys_for(TOKENS[:CHUNK], NS, CHUNK) and t.clears == 1


def test_array_encoded_batch_with_and_without_the_rank_and_missing_medium() -> None:
    t = translator()
    old = ["BlockStored", [1, 2, 3, 4], None, TOKENS[:CHUNK], BLOCK, None]  # before `medium`
    out = t.translate_payload(msgpack.packb([1.0, [old]]))
    assert stored_keys(out) == keys_for(TOKENS[:CHUNK], NS, CHUNK)
    longer = stored([5, 6, 7, 8], 4, TOKENS[CHUNK : 2 * CHUNK], extra=("GPU", None, None, 0))
    out = t.translate_payload(msgpack.packb([2.0, [longer], 0]))
    assert stored_keys(out) == keys_for(TOKENS[: 2 * CHUNK], NS, CHUNK)[1:]


def test_removing_a_block_removes_its_chunk_and_every_chunk_after_it() -> None:
    t = translator()
    keys = keys_for(TOKENS, NS, CHUNK)
    store_one_by_one(t, TOKENS)
    # block 5 is in chunk 1: chunks 1, 2 and 3 are no longer usable, chunk 0 is
    out = t.translate([removed([5])])
    assert sorted(removed_keys(out)) == sorted(keys[1:])
    assert t.live_chunks == 1
    # vLLM computes block 5 again: the chunks after it come back whole
    out = t.translate([stored([5], 4, TOKENS[5 * BLOCK : 6 * BLOCK])])
    assert stored_keys(out) == keys[1:]
    # the last block of the last chunk: only that chunk goes
    out = t.translate([removed([15])])
    assert removed_keys(out) == keys[3:]
    assert t.stats()["blocks_removed"] == 2


def test_removing_a_block_of_an_incomplete_chunk_emits_nothing() -> None:
    t = translator()
    store_one_by_one(t, TOKENS[: CHUNK + 2 * BLOCK])  # a chunk and half of the next
    assert t.translate([removed([5])]) == []
    assert t.translate([removed([999])]) == []  # never tracked: counted, nothing to say
    assert t.stats()["blocks_unknown_removed"] == 1 and t.live_chunks == 1


def test_branches_sharing_a_prefix_get_their_own_keys() -> None:
    t = translator()
    other = TOKENS[:CHUNK] + [7] * CHUNK  # the same first chunk, another second one
    out = store_one_by_one(t, TOKENS[: 2 * CHUNK])
    # the branch's own blocks have other hashes (vLLM's hash covers the prefix); its first
    # block's parent is the shared chunk's last block
    parent = CHUNK // BLOCK - 1
    out += t.translate([stored([100, 101, 102, 103], parent, other[CHUNK:])])
    assert (
        stored_keys(out)
        == keys_for(TOKENS[: 2 * CHUNK], NS, CHUNK) + keys_for(other, NS, CHUNK)[1:]
    )
    # removing a block of the shared chunk removes all three
    assert len(removed_keys(t.translate([removed([1])]))) == 3


def test_all_blocks_cleared_removes_every_chunk_and_starts_over() -> None:
    t = translator()
    keys = keys_for(TOKENS, NS, CHUNK)
    store_one_by_one(t, TOKENS)
    out = t.translate([["AllBlocksCleared"]])
    assert sorted(removed_keys(out)) == sorted(keys) and t.live_chunks == 0
    assert t.stats()["blocks_tracked"] == 0 and t.clears == 1
    # a child of a block from before the clear is an orphan; a new sequence is mapped again
    assert t.translate([stored([20], 3, TOKENS[:BLOCK])]) == []
    assert stored_keys(store_one_by_one(t, TOKENS[:CHUNK], first=50)) == keys[:1]
    assert t.stats()["blocks_skipped"]["orphan"] == 1


def test_reset_removes_what_was_stored_for_an_engine_restart() -> None:
    t = translator()
    store_one_by_one(t, TOKENS[: 2 * CHUNK])
    assert removed_keys(t.reset()) != [] and t.live_chunks == 0 and t.reset() == []


def test_malformed_events_are_counted_and_the_rest_of_the_batch_still_counts() -> None:
    t = translator()
    good = stored([0, 1, 2, 3], None, TOKENS[:CHUNK])
    bad: list[Any] = [
        "not an event",
        [],
        [42],
        ["BlockStored", [1], None],  # too few fields
        ["BlockStored", [], None, [], BLOCK],  # no blocks
        ["BlockStored", [1], None, [1, 2], BLOCK],  # fewer tokens than a block
        ["BlockStored", [1], None, [-1, 2, 3, 4], BLOCK],  # a token below 0
        ["BlockStored", [1], None, [2**32, 2, 3, 4], BLOCK],  # a token beyond uint32
        ["BlockStored", [1.5], None, [1, 2, 3, 4], BLOCK],  # a float hash
        ["BlockStored", [True], None, [1, 2, 3, 4], BLOCK],  # a bool is not a hash
        ["BlockStored", [1], None, [1, 2, 3, 4], 0],  # block_size 0
        ["BlockStored", [1], None, [1, 2, 3, 4], BLOCK, None, 7],  # medium not a string
        ["BlockStored", [1], 1, [1, 2, 3, 4], BLOCK],  # its own parent (after a store of 1)
        ["BlockRemoved"],
        ["BlockRemoved", "abc"],
        {"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2, 3, 4], "block_size": 4},
        {"no": "type"},
        [[1], 2],  # a tag that is not a string (and not hashable)
        {"type": ["BlockStored"]},
    ]
    out = t.translate([*bad[:12], ["BlockStored", [1], None, [1, 2, 3, 4], BLOCK], *bad[12:], good])
    assert stored_keys(out) == keys_for(TOKENS[:CHUNK], NS, CHUNK)
    assert t.malformed == len(bad)
    assert t.translate([["SomeFutureEvent", 1, 2]]) == [] and t.ignored == 1
    for payload in (b"\xc1", b"", msgpack.packb({"ts": 1}), msgpack.packb([1.0]), msgpack.packb(3)):
        assert t.translate_payload(payload) == []
    assert t.malformed == len(bad) + 5


def test_lora_extra_keys_other_media_and_groups_are_skipped_and_counted() -> None:
    t = translator()
    assert t.translate([["BlockStored", [1, 2, 3, 4], None, TOKENS[:CHUNK], BLOCK, 3, "GPU"]]) == []
    assert t.translate([stored([1, 2, 3, 4], None, TOKENS[:CHUNK], extra=("CPU",))]) == []
    assert (
        t.translate([stored([1, 2, 3, 4], None, TOKENS[:CHUNK], extra=("GPU", None, None, 1))])
        == []
    )
    # extra keys on block 2 (say, an image): blocks 0 and 1 are tracked, 2 skipped, 3 an orphan
    extra = ("GPU", None, [None, None, ["mm-hash"], None])
    assert t.translate([stored([1, 2, 3, 4], None, TOKENS[:CHUNK], extra=extra)]) == []
    skipped = t.stats()["blocks_skipped"]
    assert skipped == {
        "lora": 4,
        "extra_keys": 1,
        "medium": 4,
        "group": 4,
        "geometry": 0,
        "orphan": 1,
    }
    assert t.stats()["blocks_tracked"] == 2
    # a removal on another medium leaves the GPU's blocks alone
    t.translate([["BlockRemoved", [1], "CPU"]])
    assert t.stats()["blocks_tracked"] == 2


def test_a_block_size_that_does_not_divide_chunk_tokens_maps_nothing() -> None:
    t = translator(chunk_tokens=CHUNK + 2)
    assert t.translate([stored([1, 2, 3, 4], None, TOKENS[:CHUNK])]) == []
    assert t.stats()["blocks_skipped"]["geometry"] == 4 and t.block_size is None


def test_a_block_size_that_does_not_divide_chunk_tokens_is_logged_once_not_per_batch(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engine sends a batch every step: a warning per batch would flood the log."""
    t = translator(chunk_tokens=CHUNK + 2)
    with caplog.at_level(logging.WARNING, logger="kvctl.index.vllm_events"):
        for first in range(0, 100, 4):
            t.translate([stored([first, first + 1, first + 2, first + 3], None, TOKENS[:CHUNK])])
    assert len([r for r in caplog.records if "not a multiple" in r.getMessage()]) == 1
    assert t.stats()["blocks_skipped"]["geometry"] == 100


def test_memory_cap_evicts_the_oldest_block_with_the_blocks_after_it() -> None:
    blocks_per_chunk = CHUNK // BLOCK
    t = translator(max_blocks=6)
    a = store_one_by_one(t, TOKENS[:CHUNK])  # sequence A: one chunk, 4 blocks
    other = [5] * CHUNK
    b = store_one_by_one(t, other, first=100)  # B's third block pushes A's first out
    assert stored_keys(a) == keys_for(TOKENS[:CHUNK], NS, CHUNK)
    # A's first block went with everything after it: A's chunk is removed, B's is whole
    assert removed_keys(b) == stored_keys(a)
    assert stored_keys(b) == keys_for(other, NS, CHUNK)
    stats = t.stats()
    assert stats["blocks_evicted"] == blocks_per_chunk and stats["blocks_tracked"] == 4
    assert stats["live_chunks"] == 1
    # a block whose parent was evicted is an orphan, not a crash
    assert t.translate([stored([7], 3, TOKENS[4 * BLOCK : 5 * BLOCK])]) == []


def test_isolated_namespace_marks_chunks_isolated_for_that_tenant() -> None:
    ns = Namespace("test-model", LAYOUT, tenant_salt="acme")
    t = translator(namespace=ns, tenant="acme", kv_bytes_per_token=10)
    out = store_one_by_one(t, TOKENS[:CHUNK])
    assert stored_keys(out) == keys_for(TOKENS[:CHUNK], ns, CHUNK)
    assert out[0].isolated and out[0].tenant == "acme" and out[0].size_bytes == CHUNK * 10
    assert not out[0].visible_to("other") and stored_keys(out) != keys_for(
        TOKENS[:CHUNK], NS, CHUNK
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"chunk_tokens": 0},
        {"chunk_tokens": True},
        {"max_blocks": 0},
        {"kv_bytes_per_token": -1},
        {"tenant": ""},
        {"namespace": "test-model"},
        {"namespace": Namespace("m", LAYOUT, tenant_salt="acme"), "tenant": "bob"},
    ],
)
def test_bad_translator_settings_are_refused(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        translator(**kw)
    with pytest.raises(InvalidArgument):
        VllmEventTranslator("", namespace=NS, chunk_tokens=CHUNK)


def test_the_router_finds_the_engine_through_the_index() -> None:
    index = EmbeddedIndex()
    t = translator()
    index.apply(t.node, store_one_by_one(t, TOKENS[: 2 * CHUNK]))
    prompt = [*TOKENS[: 2 * CHUNK], 1, 2, 3]
    held = index.holders(keys_for(prompt, NS, CHUNK), tenant="anyone")
    assert [[h.node for h in hs] for hs in held] == [["engine-a"], ["engine-a"]]
    assert held[0][0].tier == "gpu"
    index.apply(t.node, t.translate([removed([0])]))
    assert index.nodes() == {}


@pytest.mark.parametrize(
    "endpoint", ["tcp://*:5557", "tcp://host", "tcp://host:0", "http://host:5557", "", "tcp://:1"]
)
def test_subscriber_refuses_an_endpoint_it_cannot_connect_to(endpoint: str) -> None:
    with pytest.raises(InvalidArgument):
        VllmEventSubscriber(EmbeddedIndex(), translator(), endpoint)


def test_a_batch_stops_being_translated_after_its_malformed_events_cap() -> None:
    """A batch of a good chunk, then 100,000 malformed events, then another good chunk: the
    good chunk before counts, translation stops at the cap (the batch counted once as cut),
    and the rest is not looked at (before, each of the 100,000 was translated and counted)."""
    t = translator()
    first = stored([0, 1, 2, 3], None, TOKENS[:CHUNK])
    after = stored([4, 5, 6, 7], 3, TOKENS[CHUNK : 2 * CHUNK])
    payload = msgpack.packb([1.0, [first, *([[42]] * 100_000), after], 0])
    out = t.translate_payload(payload)
    assert stored_keys(out) == keys_for(TOKENS[:CHUNK], NS, CHUNK)
    assert t.malformed == MAX_MALFORMED_PER_BATCH
    assert t.stats()["batches_cut"] == 1
    # the next batch is translated afresh
    assert stored_keys(t.translate([after])) == keys_for(TOKENS[: 2 * CHUNK], NS, CHUNK)[1:]


class _HeldIndex(EmbeddedIndex):
    """An index whose apply waits until the test lets it go (a batch in progress)."""

    def __init__(self) -> None:
        super().__init__()
        self.applying = threading.Event()
        self.go = threading.Event()

    def apply(self, node: str, events: Iterable[ChunkEvent]) -> int:
        self.applying.set()
        self.go.wait(60)
        return super().apply(node, events)


def test_status_does_not_wait_for_a_batch_in_progress() -> None:
    """While a batch is being applied (here: an index call that waits), the subscriber's status
    answers (before, it waited on the batch's lock, and so did /metrics and /v1/index: a
    100 MiB message held them for minutes)."""
    index = _HeldIndex()
    sub = VllmEventSubscriber(index, translator(), "tcp://127.0.0.1:5557")
    payload = msgpack.packb([1.0, [stored([0, 1, 2, 3], None, TOKENS[:CHUNK])], 0])
    batch = threading.Thread(target=sub._process, args=(0, payload))
    batch.start()
    try:
        assert index.applying.wait(30)
        got: list[dict[str, Any]] = []
        reader = threading.Thread(target=lambda: got.append(sub.status()), daemon=True)
        reader.start()
        reader.join(20)
        assert got, "status() waited for the batch in progress"
        assert got[0]["messages"] == 1 and got[0]["last_seq"] == 0
    finally:
        index.go.set()
        batch.join(30)
    assert index.nodes() == {"engine-a": 1}
