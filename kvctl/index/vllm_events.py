"""vLLM's own KV cache events (ZMQ + msgpack) as the fleet index's chunk events.

vLLM publishes what its GPU prefix cache stores and evicts when started with, e.g.::

    vllm serve MODEL --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'

Each message is multipart ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter that
starts at 0 when the engine starts, ``payload`` a msgpack ``KVEventBatch``
(``vllm/distributed/kv_events.py``: msgspec Structs, events tagged with their class name).
Earlier releases encode the structs as arrays (``array_like``), later ones as maps; both are
read::

    [ts, events, data_parallel_rank?]      or  {"ts": .., "events": [..], ...}
    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
     lora_name, extra_keys, group_idx, ...]  or  {"type": "BlockStored", "block_hashes": .., ...}
    ["BlockRemoved", block_hashes, medium, group_idx]
    ["AllBlocksCleared"]

One ``BlockStored`` names consecutive blocks: ``block_hashes[i]``'s parent is
``block_hashes[i-1]`` (the first's is ``parent_block_hash``, None at the start of a sequence) and
``token_ids`` holds ``block_size`` tokens per block. Hashes are ints or bytes (a vLLM setting).
Fields a release added later may be missing (``medium`` None reads as the GPU) and fields this
module does not know are ignored. The replay socket (a ROUTER) answers ``[b"", start_seq]`` with
``[b"", seq, payload]`` for each batch it still buffers from ``start_seq`` on, then
``[b"", -1, b""]``.

``VllmEventTranslator`` turns the blocks into kvctl chunks: it tracks each block (its tokens, its
parent, its place in the sequence) and, whenever the blocks from the start of a sequence make up
a whole kvctl chunk (``chunk_tokens``, a multiple of vLLM's ``block_size``), emits a stored
``ChunkEvent`` (tier ``gpu``) under kvctl's own key, ``key_i = H(key_{i-1} || tokens_i)`` from the
namespace's root, so a router computing keys from a prompt's tokens finds the engine's cache.
A chunk is usable only whole and only after its whole prefix (vLLM's prefix lookup stops at the
first missing block), so removing any block removes the chunk holding it and every chunk after
it; a block stored again brings them back. ``VllmEventSubscriber`` reads one engine's socket on a
thread, feeds the translator and applies the chunk events to a ``FleetIndex``.

Limits (what is not mapped, and what the index may then miss or keep):

- Only the token ids are keyed. Blocks with a LoRA adapter (``lora_id``/``lora_name``) or with
  ``extra_keys`` (multimodal inputs, a ``cache_salt``, prompt embeddings) are skipped and
  counted, and the blocks after them count as orphans. Releases before ``extra_keys`` do not say
  which blocks have them: there a salted or multimodal block is keyed as if its tokens were
  plain text, and the index may say the engine holds a prefix that vLLM reuses only for that
  request (a worse route, never wrong data: nothing is read from an engine's GPU cache through
  the index). Only the ``GPU`` medium and KV cache group 0 are tracked (a hybrid model's other
  groups, and blocks vLLM's offloading reports on other media, are skipped and counted).
- A subscriber sees only what is stored after it connects (plus vLLM's replay buffer when a
  replay endpoint is given: the last ``buffer_steps`` batches): a prefix cached before then is
  unknown until vLLM evicts and stores it again; its later blocks are counted as orphans.
- Memory is bounded by ``max_blocks``: past it the oldest tracked block is evicted with every
  block after it, and their chunks are removed from the index (counted). Set it above the
  engine's GPU cache size in blocks (vLLM logs the size in tokens at start-up; divide by the
  block size) so that this never happens; a tracked block costs about 0.5 KB.
- A gap that cannot be replayed, like the rest of a batch after its ``MAX_MALFORMED_PER_BATCH``-th
  malformed event (``batches_cut``), is counted and skipped: a store missed leaves a chunk out of
  the index until it is stored again; a removal missed leaves a stale entry (whoever fetches
  re-checks with the holder). An engine restart (its ``seq`` starting over) removes every chunk
  the translator had stored. With data parallelism each rank publishes on its own port (the
  endpoint's port plus the rank) and needs its own subscriber and node name.
- A message frame over ``max_message_bytes`` (64 MiB by default, far past any real batch) is
  refused at its header, before it is allocated (ZMQ_MAXMSGSIZE, on the replay socket too), and
  counted (``oversized``): that batch is lost, as a gap that cannot be replayed is. libzmq
  (4.3.5) then drops the connection and never makes it again by itself, so the subscriber
  connects again (a disconnect without libzmq's reconnect within ``RECONNECT_CHECK_S``); the
  batches missed meanwhile are a gap, replayed past the oversized one.
- The index keeps one entry per node and key: name the engine's GPU cache ``NODE#vllm``
  (``engine_index_name``), where NODE is the serving node's name. The router counts a
  ``NODE#...`` holding as NODE's own (``kvctl.router.score``) and never as a source another node
  could pull from (an engine's GPU cache serves that engine only), and the agent on the same
  host keeps its own entries under NODE (its resync replaces only those). ``AllBlocksCleared``
  and a restart therefore remove this translator's chunks one by one rather than clearing the
  node.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from kvctl.errors import InvalidArgument
from kvctl.index.backoff import Backoff
from kvctl.index.events import ChunkEvent
from kvctl.index.model import FleetIndex
from kvctl.store.keys import Namespace, chain_key_packed

log = logging.getLogger("kvctl.index.vllm_events")

GPU_TIER = "gpu"
#: vLLM's medium for its GPU prefix cache (None on releases before media were reported)
_GPU_MEDIUM = "GPU"
#: blocks tracked at most by default: 2M tokens at vLLM's default 16-token blocks, more than
#: twice the GPU cache of an 8B model on a 141 GB GPU; a tracked block costs about 0.5 KB
#: (measured: 126 MB of RSS for 262,144 blocks of 16 tokens), so this is about 65 MB at most
DEFAULT_MAX_BLOCKS = 131_072
#: vLLM's default topic (``KVEventsConfig.topic``): an empty one; set both to the same
DEFAULT_TOPIC = ""
#: how often a subscriber whose index failed tries it again
INDEX_RETRY_S = 1.0
#: the longest wait before a replace is sent again after failing: each failed one doubles the
#: wait from INDEX_RETRY_S (a replace the server takes longer to run than the client waits holds
#: the server for its whole length at each try); a replace done resets it
INDEX_RETRY_MAX_S = 30.0
#: how often a subscriber looks whether the index still holds the engine's entries (one read of
#: the node's marker), busy or idle: a Redis restarted empty or flushed between two writes fails
#: none of them (the client reconnects), and an idle engine sends nothing that would notice
INDEX_CHECK_S = 1.0
#: malformed events in one batch after which the rest of it is not translated (counted once in
#: ``batches_cut``): a batch of millions of bad events must not hold the translation for minutes
MAX_MALFORMED_PER_BATCH = 64
#: the largest message frame (a batch's payload) a subscriber takes by default
#: (``max_message_bytes``): a BlockStored costs about 5 bytes a token id and 34 a block hash
#: (msgpack), so this holds a step that stores some 9M tokens, past any batch vLLM sends
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
#: how long after a disconnect libzmq's own reconnect must have shown (its CONNECT_RETRIED
#: event comes microseconds after the disconnect's): none by then and libzmq ended the
#: connection for good, as it does at a message over ZMQ_MAXMSGSIZE
RECONNECT_CHECK_S = 1.0
#: the replay socket's end-of-replay sequence number (-1 as a signed 8-byte int)
_REPLAY_END = (-1).to_bytes(8, "big", signed=True)
_MAX_TOKEN = 2**32 - 1
#: why blocks are skipped (their counters are always reported, zero or not)
SKIP_REASONS = ("lora", "extra_keys", "medium", "group", "geometry", "orphan")
#: each event's fields in declared order: the order of the array encoding (``array_like``)
_ARRAY_FIELDS: dict[object, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
        "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}  # fmt: skip

BlockHash = int | bytes


@dataclass(slots=True)
class _Block:
    parent: BlockHash | None
    #: the block's token ids packed as kvctl packs them (uint32, native order, as ``keys``)
    tokens: bytes
    #: the block's place in its sequence (0: first); fixed, since vLLM's hash covers the prefix
    depth: int
    #: on a chunk's last block: the chunk's kvctl key, once computed (fixed, like the depth)
    chunk_key: bytes | None = None
    #: on a chunk's last block: the chunk was emitted as stored and not removed since
    live: bool = False


class VllmEventTranslator:
    """vLLM block events -> kvctl ``ChunkEvent``s for one engine (see the module).

    ``namespace`` is the key root the router uses for this engine's requests (model id, KV
    layout, and the tenant's salt for an isolated tenant: then the chunks are ``isolated`` and
    visible to ``tenant`` only). ``kv_bytes_per_token`` defaults to the layout's. Not
    thread-safe: one subscriber feeds it.
    """

    def __init__(
        self,
        node: str,
        *,
        namespace: Namespace,
        chunk_tokens: int,
        tenant: str = "default",
        kv_bytes_per_token: int | None = None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
    ) -> None:
        if not isinstance(node, str) or not node:
            raise InvalidArgument(f"a vLLM event translator needs a node name, got {node!r}")
        if not isinstance(namespace, Namespace):
            raise InvalidArgument(f"namespace must be a kvctl Namespace, got {namespace!r:.60}")
        _check_positive("chunk_tokens", chunk_tokens)
        if not isinstance(tenant, str) or not tenant:
            raise InvalidArgument(f"tenant must be a non-empty string, got {tenant!r}")
        if namespace.tenant_salt and namespace.tenant_salt != tenant:
            raise InvalidArgument(
                f"the namespace is salted for tenant {namespace.tenant_salt!r} (isolated), not "
                f"{tenant!r}: an isolated tenant's chunks are keyed under its own name"
            )
        if kv_bytes_per_token is None:
            kv_bytes_per_token = namespace.layout.bytes_per_token
        _check_positive("kv_bytes_per_token", kv_bytes_per_token)
        _check_positive("max_blocks", max_blocks)
        self.node = node
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.tenant = tenant
        self.isolated = bool(namespace.tenant_salt)
        self.chunk_bytes = chunk_tokens * kv_bytes_per_token
        self.max_blocks = max_blocks
        #: vLLM's block size, from the first block event (one per engine)
        self.block_size: int | None = None
        self._blocks_per_chunk = 0
        # oldest first: eviction past max_blocks takes the front
        self._blocks: OrderedDict[BlockHash, _Block] = OrderedDict()
        # parent hash -> tracked children; kept for a removed parent so that storing it again
        # reconnects the blocks after it. Lists, not sets: almost every block has one child,
        # and a one-item set costs three times the memory
        self._children: dict[BlockHash, list[BlockHash]] = {}
        self.live_chunks = 0
        self.events = 0
        self.blocks_stored = 0
        self.blocks_removed = 0
        self.blocks_unknown_removed = 0
        self.blocks_evicted = 0
        self.skipped: dict[str, int] = dict.fromkeys(SKIP_REASONS, 0)
        self.chunks_stored = 0
        self.chunks_removed = 0
        self.clears = 0
        self.malformed = 0
        #: batches whose translation stopped at MAX_MALFORMED_PER_BATCH malformed events
        self.batches_cut = 0
        self.ignored = 0

    # --- input ------------------------------------------------------------------------------------
    def translate_payload(self, payload: bytes) -> list[ChunkEvent]:
        """The chunk events of one msgpack ``KVEventBatch``; a payload that does not decode as
        one is counted as malformed and yields nothing."""
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception:  # msgpack raises several unrelated types for bad input
            self.malformed += 1
            return []
        return self.translate_batch(batch)

    def translate_batch(self, batch: object) -> list[ChunkEvent]:
        """The chunk events of one decoded batch (``[ts, events, dp_rank?]``, or the same as a
        map); a malformed event is counted and skipped, the batch's other events still count."""
        events: object = None
        if isinstance(batch, dict):
            events = batch.get("events")
        elif isinstance(batch, list | tuple) and len(batch) >= 2:
            events = batch[1]
        if not isinstance(events, list | tuple):
            self.malformed += 1
            return []
        return self.translate(events)

    def translate(self, events: Iterable[object]) -> list[ChunkEvent]:
        """The chunk events of decoded vLLM events, in order."""
        out: list[ChunkEvent] = []
        bad = 0
        for event in events:
            if bad >= MAX_MALFORMED_PER_BATCH:
                # the rest is not translated: what came before it still counts
                self.batches_cut += 1
                log.debug(
                    "%s: a vLLM batch with %d malformed events: the rest of it skipped",
                    self.node,
                    bad,
                )
                break
            self.events += 1
            try:
                self._event(event, out)
            except InvalidArgument as exc:
                self.malformed += 1
                bad += 1
                log.debug("%s: malformed vLLM event skipped: %s", self.node, exc)
        return out

    def held(self) -> list[ChunkEvent]:
        """A stored event for each chunk this translator has stored and not removed since."""
        return [self._stored(b) for b in self._blocks.values() if b.live]

    def reset(self) -> list[ChunkEvent]:
        """Forget every block (the engine restarted or cleared its cache): a removed event for
        each chunk this translator had stored."""
        out = [self._removed(b) for b in self._blocks.values() if b.live]
        self._blocks.clear()
        self._children.clear()
        self.live_chunks = 0
        return out

    # --- vLLM events ------------------------------------------------------------------------------
    def _event(self, event: object, out: list[ChunkEvent]) -> None:
        tag, fields = _fields(event)
        if tag == "BlockStored":
            self._block_stored(fields, out)
        elif tag == "BlockRemoved":
            self._block_removed(fields, out)
        elif tag == "AllBlocksCleared":
            self.clears += 1
            out.extend(self.reset())
        else:  # an event type this translator does not know says nothing it could use
            self.ignored += 1

    def _block_stored(self, fields: dict[str, Any], out: list[ChunkEvent]) -> None:
        for name in ("block_hashes", "parent_block_hash", "token_ids", "block_size"):
            if name not in fields:
                raise InvalidArgument(f"BlockStored without {name}")
        hashes = _hashes(fields["block_hashes"])
        parent = None if fields["parent_block_hash"] is None else _hash(fields["parent_block_hash"])
        block_size = fields["block_size"]
        _check_positive("BlockStored block_size", block_size)
        tokens = _tokens(fields["token_ids"], len(hashes) * block_size)
        medium = _medium(fields)
        extra_keys = fields.get("extra_keys")
        if extra_keys is not None and not isinstance(extra_keys, list | tuple):
            raise InvalidArgument(f"BlockStored extra_keys must be a list, got {extra_keys!r:.40}")
        skip = None
        if fields.get("lora_id") is not None or fields.get("lora_name") is not None:
            skip = "lora"
        elif medium != _GPU_MEDIUM:
            skip = "medium"
        elif fields.get("group_idx") not in (None, 0):
            skip = "group"
        elif not self._geometry(block_size):
            skip = "geometry"
        if skip is not None:
            self.skipped[skip] += len(hashes)
            return
        width = block_size * 4  # packed uint32 tokens per block
        for i, h in enumerate(hashes):
            if extra_keys is not None and i < len(extra_keys) and extra_keys[i]:
                # multimodal inputs, a LoRA, a cache salt or prompt embeddings: the block's KV
                # is not a function of its tokens, so no kvctl key names it (its successors
                # then count as orphans)
                self.skipped["extra_keys"] += 1
            else:
                self._store(h, parent, tokens[i * width : (i + 1) * width], out)
            parent = h

    def _block_removed(self, fields: dict[str, Any], out: list[ChunkEvent]) -> None:
        if "block_hashes" not in fields:
            raise InvalidArgument("BlockRemoved without block_hashes")
        hashes = _hashes(fields["block_hashes"])
        if _medium(fields) != _GPU_MEDIUM or fields.get("group_idx") not in (None, 0):
            return  # blocks of another medium or cache group were never tracked
        for h in hashes:
            self._remove(h, out, evict=False)

    def _geometry(self, block_size: int) -> bool:
        if self.block_size is None:
            if self.chunk_tokens % block_size:
                if self.skipped["geometry"]:
                    return False  # said once: the engine sends a batch every step
                log.warning(
                    "%s: kvctl chunk_tokens %d is not a multiple of vLLM's block_size %d: no block "
                    "is mapped (set chunk_tokens to a multiple)",
                    self.node, self.chunk_tokens, block_size,
                )  # fmt: skip
                return False
            self.block_size = block_size
            self._blocks_per_chunk = self.chunk_tokens // block_size
        return block_size == self.block_size

    # --- the block tree ---------------------------------------------------------------------------
    def _store(
        self, h: BlockHash, parent: BlockHash | None, tokens: bytes, out: list[ChunkEvent]
    ) -> None:
        if parent == h:
            raise InvalidArgument(f"block {h!r:.40} names itself as its parent")
        if parent is None:
            depth = 0
        else:
            above = self._blocks.get(parent)
            if above is None:  # its prefix was never seen (stored before this subscriber)
                self.skipped["orphan"] += 1
                return
            depth = above.depth + 1
        old = self._blocks.get(h)
        if old is not None:
            if old.parent == parent and old.tokens == tokens:
                self._blocks.move_to_end(h)  # stored again while tracked: nothing changed
                return
            self._remove(h, out, evict=False)  # the same hash for other content: start over
        while len(self._blocks) >= self.max_blocks:
            self._remove(next(iter(self._blocks)), out, evict=True)
        if parent is not None and parent not in self._blocks:
            # the eviction just took this block's prefix
            self.skipped["orphan"] += 1
            return
        self.blocks_stored += 1
        self._blocks[h] = _Block(parent, tokens, depth)
        if parent is not None:
            # never there already: a removal or an eviction took it out of its parent's list
            self._children.setdefault(parent, []).append(h)
        self._settle(h, out)

    def _settle(self, h: BlockHash, out: list[ChunkEvent]) -> None:
        """Emit every chunk that block ``h`` completes: its own and, when it fills a hole, the
        ones after it whose blocks were waiting (top-down, so a prefix is live before its
        successors are tried)."""
        stack = [h]
        seen: set[BlockHash] = set()
        while stack:
            x = stack.pop()
            block = self._blocks.get(x)
            if block is None or x in seen:
                continue
            seen.add(x)
            if self._is_chunk_end(block) and not self._emit(block, out):
                continue  # the chunks after it need it whole first
            stack.extend(self._children.get(x, ()))

    def _is_chunk_end(self, block: _Block) -> bool:
        return (block.depth + 1) % self._blocks_per_chunk == 0

    def _emit(self, last: _Block, out: list[ChunkEvent]) -> bool:
        """Store the chunk ending at ``last`` if its blocks and its prefix are all here."""
        if last.live:
            return True
        parts = [last.tokens]
        first = last
        for _ in range(self._blocks_per_chunk - 1):
            if first.parent is None:
                return False  # cannot happen for a chunk end (depth says how many are above)
            above = self._blocks.get(first.parent)
            if above is None:
                return False
            first = above
            parts.append(first.tokens)
        if first.parent is None:
            prefix = self.namespace.root
        else:
            before = self._blocks.get(first.parent)
            if before is None or not before.live or before.chunk_key is None:
                return False
            prefix = before.chunk_key
        if last.chunk_key is None:
            parts.reverse()
            last.chunk_key = chain_key_packed(prefix, b"".join(parts))
        last.live = True
        self.live_chunks += 1
        self.chunks_stored += 1
        out.append(self._stored(last))
        return True

    def _stored(self, last: _Block) -> ChunkEvent:
        assert last.chunk_key is not None  # live implies keyed
        return ChunkEvent(
            kind="stored",
            key=last.chunk_key,
            tier=GPU_TIER,
            tenant=self.tenant,
            isolated=self.isolated,
            size_bytes=self.chunk_bytes,
            tokens=self.chunk_tokens,
        )

    def _remove(self, h: BlockHash, out: list[ChunkEvent], *, evict: bool) -> None:
        """Forget block ``h``; remove the chunk holding it and every live chunk after it. An
        eviction (``evict``) forgets the blocks after it too (they cannot be used without it,
        and memory is what it is for)."""
        block = self._blocks.pop(h, None)
        if block is None:
            self.blocks_unknown_removed += 1
            return
        if evict:
            self.blocks_evicted += 1
        else:
            self.blocks_removed += 1
        self._unlink(h, block.parent)
        stack: list[tuple[BlockHash, _Block]] = [(h, block)]
        seen: set[BlockHash] = set()
        while stack:
            x, b = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if b.live:
                out.append(self._removed(b))
            elif self._is_chunk_end(b) and not evict:
                continue  # nothing after a chunk that is not live is live
            below = self._children.pop(x, []) if evict else self._children.get(x, [])
            for c in below:
                child = self._blocks.pop(c, None) if evict else self._blocks.get(c)
                if child is not None:
                    if evict:
                        self.blocks_evicted += 1
                    stack.append((c, child))

    def _unlink(self, h: BlockHash, parent: BlockHash | None) -> None:
        if parent is None:
            return
        siblings = self._children.get(parent)
        if siblings is not None and h in siblings:
            siblings.remove(h)
            if not siblings:
                del self._children[parent]

    def _removed(self, block: _Block) -> ChunkEvent:
        assert block.chunk_key is not None  # live implies keyed
        block.live = False
        self.live_chunks -= 1
        self.chunks_removed += 1
        return ChunkEvent(kind="removed", key=block.chunk_key)

    # --- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "block_size": self.block_size,
            "chunk_tokens": self.chunk_tokens,
            "events": self.events,
            "blocks_tracked": len(self._blocks),
            "max_blocks": self.max_blocks,
            "blocks_stored": self.blocks_stored,
            "blocks_removed": self.blocks_removed,
            "blocks_unknown_removed": self.blocks_unknown_removed,
            "blocks_evicted": self.blocks_evicted,
            "blocks_skipped": dict(self.skipped),
            "live_chunks": self.live_chunks,
            "chunks_stored": self.chunks_stored,
            "chunks_removed": self.chunks_removed,
            "clears": self.clears,
            "malformed": self.malformed,
            "batches_cut": self.batches_cut,
            "ignored_events": self.ignored,
        }


def _fields(event: object) -> tuple[str, dict[str, Any]]:
    """(tag, fields) of one event, in either encoding: a map with its tag under ``type`` or an
    array led by its tag, fields in their declared order (a missing trailing field is absent,
    an extra one ignored)."""
    if isinstance(event, dict):
        tag = event.get("type")
        fields = event
    elif isinstance(event, list | tuple) and event and isinstance(event[0], str):
        tag = event[0]
        fields = dict(zip(_ARRAY_FIELDS.get(tag, ()), event[1:], strict=False))
    else:
        tag, fields = None, {}
    if not isinstance(tag, str):
        raise InvalidArgument(f"not a tagged vLLM event: {event!r:.80}")
    return tag, fields


def _medium(fields: dict[str, Any]) -> str:
    medium = fields.get("medium")
    if medium is None:
        return _GPU_MEDIUM  # releases before media were reported had the GPU cache only
    if not isinstance(medium, str):
        raise InvalidArgument(f"medium must be a string, got {medium!r:.40}")
    return medium.upper()


def _check_positive(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgument(f"{what} must be a positive integer, got {value!r:.40}")


def _hash(value: object) -> BlockHash:
    if isinstance(value, bytes) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise InvalidArgument(f"a block hash is an int or bytes, got {value!r:.40}")


def _hashes(value: object) -> list[BlockHash]:
    if not isinstance(value, list | tuple) or not value:
        raise InvalidArgument(f"block_hashes must be a non-empty list, got {value!r:.60}")
    return [_hash(v) for v in value]


def _tokens(value: object, expected: int) -> bytes:
    if not isinstance(value, list | tuple) or len(value) != expected:
        n = len(value) if isinstance(value, list | tuple) else value
        raise InvalidArgument(f"expected {expected} token ids (blocks x block_size), got {n!r:.40}")
    if not all(type(t) is int for t in value):
        raise InvalidArgument("token ids must be integers")
    try:
        # packed as kvctl.store.keys packs a chunk's tokens, so the keys match keys_for's
        return array("I", value).tobytes()
    except OverflowError:
        raise InvalidArgument(f"token ids must be in 0..{_MAX_TOKEN}") from None


class VllmEventSubscriber:
    """Reads one vLLM engine's KV events (a ZMQ SUB socket on ``endpoint``, messages of
    ``topic``) on a thread, translates them and applies the chunk events to ``index`` under the
    translator's node name.

    Sequence numbers: a jump is a gap (counted); with ``replay_endpoint`` (vLLM's replay ROUTER)
    the missing batches are asked for and applied in order, and at start the replay buffer is
    read to learn what was stored before this subscriber connected (``catch_up``). A sequence
    number that goes back is an engine restart: every chunk of the engine is removed and the
    stream is followed from there. A malformed message is counted and skipped; a failing index
    is counted (``errors``) and the stream goes on: what it missed meanwhile is made good once it
    answers again, the engine's entries replaced by the chunks the translator holds
    (``index_resyncs``): it is tried again ``INDEX_RETRY_S`` after a failure, not at every batch,
    and each replace that fails doubles the wait, up to ``INDEX_RETRY_MAX_S`` (``Backoff``, on
    ``clock``); status says how many failed in a row and when the next is tried.

    An index that loses the engine's entries without failing a call (a Redis restarted empty or
    flushed between two writes, the engine idle meanwhile) is noticed by its marker
    (``FleetIndex.marker``): every ``INDEX_CHECK_S``, idle or not, one read of the node's marker;
    gone or another than the one this subscriber's last resync left, the engine's entries are
    written again whole (``index_resyncs``, ``index_lost``). Without a marker yet, the first look
    takes the one the node has (another router's subscriber to the same engine, or this router
    before a restart, left it: their entries are kept, as they always were), else resyncs to
    leave one (replacing entries an older subscriber, which left none, wrote).

    A message frame over ``max_message_bytes`` (``DEFAULT_MAX_MESSAGE_BYTES``) is refused at
    its header, before any of it is allocated (ZMQ_MAXMSGSIZE, on the replay socket too), but
    libzmq then drops the connection and never makes it again (the feed would end there): a
    disconnect that libzmq does not follow with its own reconnect within
    ``RECONNECT_CHECK_S`` is counted (``oversized``), logged, and connected again here. The
    batches missed meanwhile are a gap, replayed where the replay buffer has them.
    """

    def __init__(
        self,
        index: FleetIndex,
        translator: VllmEventTranslator,
        endpoint: str,
        *,
        topic: str = DEFAULT_TOPIC,
        replay_endpoint: str | None = None,
        replay_timeout_s: float = 1.0,
        catch_up: bool = True,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        poll_interval_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        _check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint)
        if not isinstance(topic, str):
            raise InvalidArgument(f"topic must be a string, got {topic!r:.40}")
        for what, value in (
            ("replay_timeout_s", replay_timeout_s),
            ("poll_interval_s", poll_interval_s),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 60:
                raise InvalidArgument(f"{what} must be in (0, 60] seconds, got {value!r:.40}")
        _check_positive("max_message_bytes", max_message_bytes)
        self.index = index
        self.translator = translator
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._topic = topic.encode()
        self._replay_timeout_ms = max(1, round(replay_timeout_s * 1000))
        self._poll_ms = max(1, round(poll_interval_s * 1000))
        self._catch_up = catch_up and replay_endpoint is not None
        self.max_message_bytes = max_message_bytes
        self._lock = threading.Lock()
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._sub: zmq.Socket[Any] | None = None
        self._monitor: zmq.Socket[Any] | None = None
        self._replay: zmq.Socket[Any] | None = None
        self._replay_monitor: zmq.Socket[Any] | None = None
        self.connected = False
        self.last_seq: int | None = None
        # after a replay, the SUB socket may still hold batches the replay already applied
        self._dedupe_through: int | None = None
        self.messages = 0
        self.malformed = 0
        self.duplicates = 0
        self.other_topic = 0
        self.gaps = 0
        self.missed = 0
        self.replayed = 0
        self.unrecovered = 0
        self.replay_failures = 0
        self.restarts = 0
        #: messages over max_message_bytes refused, live (libzmq then ended the connection for
        #: good; it is made again) or from the replay socket (asked again past them)
        self.oversized = 0
        #: when the last disconnect was read, until libzmq's reconnect shows (None: none due)
        self._disconnected_at_s: float | None = None
        #: the SUB's connection finished its ZMTP handshake, and whether the one dropped last
        #: had: one that never did met a peer that is not a PUB socket (the replay ROUTER's
        #: port, say), which libzmq drops for good too, and no message was refused
        self._handshaken = False
        self._dropped_handshaken = False
        #: a peer that failed the handshake was said (once, until a handshake succeeds)
        self._handshake_warned = False
        #: the replay socket's connection finished its handshake (a drop before is no cut)
        self._replay_handshaken = False
        self.errors = 0
        self.last_error: str | None = None
        #: the index failed a call: the events it missed are lost, so the engine's entries are
        #: replaced whole at the next write it takes (a Redis restarted empty lost the rest too)
        self._index_failing = False
        #: when the index is tried again after a failed call: INDEX_RETRY_S after the last one,
        #: doubled by each failed replace up to INDEX_RETRY_MAX_S
        self._index_backoff = Backoff(INDEX_RETRY_S, INDEX_RETRY_MAX_S, clock)
        #: the last look at the node's marker failed (said once per outage): no write failed
        #: and no event was missed for it, so nothing is replaced when the index answers again
        self._look_failing = False
        #: the node's marker in the index as of this subscriber's last resync (None: none yet)
        self._marker: str | None = None
        self._index_checked_s = -math.inf
        self.index_resyncs = 0
        #: resyncs because the index lost the engine's entries without failing a call
        self.index_lost = 0

    # --- life -------------------------------------------------------------------------------------
    def start(self) -> VllmEventSubscriber:
        """Connect and start reading (the sockets are made here, so a bad endpoint raises
        now); returns self."""
        if self._thread is not None:
            raise InvalidArgument("this subscriber was already started")
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            self._monitor = sub.get_monitor_socket(
                zmq.EVENT_CONNECTED
                | zmq.EVENT_DISCONNECTED
                | zmq.EVENT_CONNECT_RETRIED
                | zmq.EVENT_HANDSHAKE_SUCCEEDED
            )
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            sub.connect(self.endpoint)
        except zmq.ZMQError as exc:
            ctx.destroy(linger=0)
            raise InvalidArgument(
                f"cannot connect to vLLM's events at {self.endpoint}: {exc}"
            ) from None
        self._ctx, self._sub = ctx, sub
        # the socket now belongs to the thread (thread start is the memory barrier pyzmq asks)
        self._thread = threading.Thread(
            target=self._run, name=f"kvctl-vllm-events-{self.translator.node}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop reading and close the sockets (waits up to ``timeout_s`` for the thread); the
        index keeps what it has."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning(
                    "%s: the vLLM event thread did not stop in %.1fs",
                    self.translator.node,
                    timeout_s,
                )

    def __enter__(self) -> VllmEventSubscriber:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        assert self._ctx is not None and self._sub is not None and self._monitor is not None
        sub, monitor = self._sub, self._monitor
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            if self._catch_up:
                self._replay_from(0, None)
                self._dedupe_through = self.last_seq
            while not self._stop.is_set():
                ready = dict(poller.poll(self._poll_ms))
                # busy or idle (an idle engine sends nothing that would retry or check it)
                self._index_tick()
                if (
                    monitor in ready
                    and self._on_monitor(monitor)
                    and self._dedupe_through is not None
                ):
                    # the catch-up's duplicates can only be batches the socket holds now; once
                    # the engine is gone, a seq that goes back is a restart (its seq starts over
                    # at 0, inside the window), not a duplicate
                    while sub.poll(0) and not self._stop.is_set():
                        self._read(sub)
                    self._dedupe_through = None
                    continue  # what ``ready`` said of the socket was read: poll again
                if sub in ready:
                    self._read(sub)
                if self._disconnected_at_s is not None:
                    self._check_reconnect(sub, monitor)
        except Exception as exc:  # a bug must show in status, not vanish with the thread
            self._failed("the vLLM event subscriber stopped", exc)
        finally:
            self.connected = False
            sub.disable_monitor()
            for sock in (monitor, sub):
                sock.close(linger=0)
            self._close_replay()
            self._ctx.term()

    def _failed(self, what: str, exc: Exception) -> None:
        log.error("%s: %s", self.translator.node, what, exc_info=exc)
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"

    def _read(self, sub: zmq.Socket[Any]) -> None:
        frames = sub.recv_multipart()
        try:
            self._on_message(frames)
        except zmq.ZMQError:
            raise
        except Exception as exc:  # one message must not end the stream: count it
            self._failed("a vLLM event message failed", exc)

    def _on_monitor(self, monitor: zmq.Socket[Any]) -> bool:
        """Note a connect or a disconnect; returns whether the engine disconnected."""
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor).get("event")
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
            self._disconnected_at_s = None
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self._disconnected_at_s = None  # libzmq connects again by itself
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._handshaken, self._handshake_warned = True, False
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected = False
            self._disconnected_at_s = time.monotonic()
            self._dropped_handshaken, self._handshaken = self._handshaken, False
            return True
        return False

    def _check_reconnect(self, sub: zmq.Socket[Any], monitor: zmq.Socket[Any]) -> None:
        """After a disconnect: once ``RECONNECT_CHECK_S`` has passed without libzmq's own
        reconnect, libzmq ended the connection for good (a message frame over
        ``max_message_bytes``; a peer breaking ZMTP ends it the same way): count it and connect
        again, or the feed would end here. A connection that never finished its handshake (a
        peer that is not a PUB socket) refused no message: said once, not counted, and tried
        again. The monotonic clock, not ``clock``: libzmq's timers run on real time."""
        while monitor.poll(0):  # the reconnect may be queued behind a long batch
            self._on_monitor(monitor)
        since_s = self._disconnected_at_s
        if since_s is None or time.monotonic() - since_s < RECONNECT_CHECK_S:
            return
        self._disconnected_at_s = None
        if self._dropped_handshaken:
            self.oversized += 1
            log.warning(
                "%s: libzmq dropped the connection to the engine's events at %s and will not "
                "make it again (a message over max_message_bytes, %d bytes, refused; or a peer "
                "that broke ZMTP); connecting again (the batches missed are a gap)",
                self.translator.node,
                self.endpoint,
                self.max_message_bytes,
            )
        elif not self._handshake_warned:  # it would say so every RECONNECT_CHECK_S
            self._handshake_warned = True
            self.last_error = f"the peer at {self.endpoint} failed the ZMTP handshake"
            log.warning(
                "%s: the peer at %s failed the ZMTP handshake (not vLLM's KV-event PUB socket: "
                "its replay port?); trying again every %.0f s",
                self.translator.node,
                self.endpoint,
                RECONNECT_CHECK_S,
            )
        with contextlib.suppress(zmq.ZMQError):  # not known to the socket any more
            sub.disconnect(self.endpoint)
        sub.connect(self.endpoint)

    # --- the stream -------------------------------------------------------------------------------
    def _on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed += 1
            return
        if frames[0] != self._topic:
            self.other_topic += 1  # the SUB filter is a prefix: another topic may start with ours
            return
        seq = int.from_bytes(frames[1], "big")
        expected = seq
        if self.last_seq is not None:
            if seq <= self.last_seq:
                if self._dedupe_through is not None and seq <= self._dedupe_through:
                    self.duplicates += 1
                    return
                # the engine restarted: its sequence started over and its cache is empty
                self.restarts += 1
                log.info(
                    "%s: vLLM restarted (seq %d after %d)", self.translator.node, seq, self.last_seq
                )
                with self._lock:
                    self._apply(self.translator.reset())
                self.last_seq = None
                expected = 0
            else:
                expected = self.last_seq + 1
        self._dedupe_through = None
        if seq > expected:
            self.gaps += 1
            self.missed += seq - expected
            if self.replay_endpoint is None:
                self.unrecovered += seq - expected
            else:
                self._replay_from(expected, seq)
        self._process(seq, frames[2])

    def _process(self, seq: int, payload: bytes) -> None:
        # the lock keeps the index tick's writes from interleaving with a batch's; status()
        # does not take it (a batch of a 16 MiB message may take seconds to translate)
        with self._lock:
            self.messages += 1
            self.last_seq = seq
            self._apply(self.translator.translate_payload(payload))

    def _apply(self, events: list[ChunkEvent]) -> None:
        """Write ``events`` (the translator's latest) to the index; while it fails, replace the
        engine's entries with every chunk the translator holds instead (it reflects
        ``events``), tried when the backoff says (``INDEX_RETRY_S`` after the last try, longer
        after failed replaces)."""
        if self._index_failing:
            # not at every batch: a hung index costs each try its timeout, and the socket's
            # queue would overflow meanwhile; the replace to come covers these events
            if self._index_backoff.due():
                try:
                    # one cheap call first: a down index fails it, before every chunk the
                    # engine holds is gathered and encoded for the replace (CPU, under the
                    # lock, each retry of the outage)
                    self.index.marker(self.translator.node)
                except Exception as exc:
                    self._index_failed(exc)
                    return
                self._resync("index_back")
            return
        if not events:
            return
        if self._look_failing and not self._index_backoff.due():
            # a look found it not answering just now: not tried at every batch either; these
            # events are missed, so the entries are replaced once it answers
            self._index_failing = True
            return
        try:
            self.index.apply(self.translator.node, events)
        except Exception as exc:  # the index's own failure (e.g. Redis down): count, go on
            self._index_failed(exc)

    def _index_tick(self) -> None:
        """Between reads of the stream: retry a failed index, or look at the node's marker
        every ``INDEX_CHECK_S`` (one call)."""
        if self._index_failing:
            with self._lock:
                self._apply([])
            return
        if self._clock() - self._index_checked_s < INDEX_CHECK_S:
            return
        node = self.translator.node
        try:
            # not under the lock: status() must not wait on the index
            marker = self.index.marker(node)
        except Exception as exc:
            with self._lock:
                self._look_failed(exc)
            return
        finally:
            self._index_checked_s = self._clock()
        if self._look_failing:
            self._look_failing = False
            log.info("%s: the index answers again", node)
        if marker is not None and (marker == self._marker or self._marker is None):
            self._marker = marker  # ours, or another subscriber's taken as is (see the class)
            return
        with self._lock:
            if self._marker is None:
                self._resync(None)  # the first: leaves the node a marker
                return
            self.index_lost += 1
            log.warning(
                "%s: the index lost the engine's entries (Redis restarted empty or flushed: the "
                "node's marker is %s); writing the engine's %d chunks again",
                node,
                "gone" if marker is None else "another",
                self.translator.live_chunks,
            )
            self._resync("index_lost")

    def _resync(self, reason: str | None) -> None:
        """Replace the engine's entries with every chunk the translator holds and note the
        node's marker; counted in ``index_resyncs`` when ``reason`` ("index_back" or
        "index_lost") says why (None: the first, which is not counted)."""
        node = self.translator.node
        try:
            n = self.index.replace(node, self.translator.held())
        except Exception as exc:
            self._index_failed(exc, replace=True)
            return
        try:
            self._marker = self.index.marker(node)
        except Exception as exc:
            self._index_failed(exc)
            return
        self._index_backoff.succeeded()
        self._index_failing = self._look_failing = False
        self._index_checked_s = self._clock()
        if reason is None:
            log.info("%s: the engine's %d chunks written to the index", node, n)
            return
        self.index_resyncs += 1
        if reason == "index_back":
            log.info("%s: the index answers again; the engine's %d chunks written", node, n)
        else:
            log.info("%s: the engine's %d chunks written to the index again", node, n)

    def _look_failed(self, exc: Exception) -> None:
        """Count a failed look at the node's marker; once per outage, say so. Only a look:
        no write failed and no event was missed, so the entries are not replaced when the
        index answers again (a Redis back with its data lost nothing; one back empty has no
        marker, which the next look notices); a write failing meanwhile replaces them."""
        self._index_error(exc)  # a write waits INDEX_RETRY_S, as after its own failure
        if not self._look_failing:
            self._look_failing = True
            log.warning(
                "%s: the index does not answer (%s); looked at again every %g s",
                self.translator.node,
                exc,
                INDEX_CHECK_S,
            )

    def _index_failed(self, exc: Exception, *, replace: bool = False) -> None:
        """Count the index's failure (``replace``: a replace's, which lengthens the wait); once
        per outage, say so (a batch comes every step)."""
        self._index_error(exc, replace=replace)
        if not self._index_failing:
            self._index_failing = True
            log.warning(
                "%s: the index failed (%s); the engine's entries are replaced when it answers "
                "again",
                self.translator.node,
                exc,
            )

    def _index_error(self, exc: Exception, *, replace: bool = False) -> None:
        """Count a failed index call and start the wait before the next try. From the try's
        end: a hung index's timeout (Redis's is 2 s) outlasts the interval, and counted from
        its start the next batch would try again at once."""
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._index_backoff.failed(lengthen=replace)

    def _index_retry_in_s(self) -> float | None:
        """Seconds until the index is written again after failing (None: it does not fail)."""
        return self._index_backoff.retry_in_s() if self._index_failing else None

    def _replay_from(self, start: int, upto: int | None) -> None:
        """Ask vLLM's replay socket for batches ``start..upto-1`` (``upto`` None: all it has)
        and apply the ones newer than ``last_seq``, in order. A batch over
        ``max_message_bytes`` drops the replay's connection at it (counted in ``oversized``):
        the rest is asked for again from the batch after it."""
        wanted = None if upto is None else upto - start
        got = 0
        while True:
            n, cut_at = self._replay_once(start, upto)
            got += n
            if cut_at is None or self._stop.is_set() or (upto is not None and cut_at + 1 >= upto):
                break
            self.oversized += 1
            log.warning(
                "%s: the engine's replay socket at %s sent batch %d over max_message_bytes "
                "(%d bytes), refused; asking again from the next",
                self.translator.node,
                self.replay_endpoint,
                cut_at,
                self.max_message_bytes,
            )
            start = cut_at + 1
        if wanted is not None and got < wanted:
            self.unrecovered += wanted - got

    def _replay_once(self, start: int, upto: int | None) -> tuple[int, int | None]:
        """One replay request from ``start``: the batches applied, and the seq the replay was
        at when libzmq dropped its connection for good (None: it was not)."""
        assert self._ctx is not None and self.replay_endpoint is not None
        if self._replay is None:
            replay = self._ctx.socket(zmq.DEALER)
            replay.setsockopt(zmq.LINGER, 0)
            # a batch over the cap is refused at its header, then the connection dropped
            replay.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            self._replay_monitor = replay.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            )
            replay.connect(self.replay_endpoint)
            self._replay, self._replay_handshaken = replay, False
        replay, monitor = self._replay, self._replay_monitor
        assert monitor is not None
        poller = zmq.Poller()
        poller.register(replay, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        replay.send_multipart([b"", start.to_bytes(8, "big")])
        at, got, ended, cut = start, 0, False, False
        answer_by_s = time.monotonic() + self._replay_timeout_ms / 1000
        while not self._stop.is_set():
            left_s = answer_by_s - time.monotonic()
            if cut:  # only what the socket holds already
                ready = dict(poller.poll(0))
            else:
                ready = dict(poller.poll(math.ceil(left_s * 1000))) if left_s > 0 else {}
            if replay in ready:
                answer_by_s = time.monotonic() + self._replay_timeout_ms / 1000
                frames = replay.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.malformed += 1
                    continue
                if frames[1] == _REPLAY_END or not frames[2]:
                    ended = True
                    break
                seq = int.from_bytes(frames[1], "big")
                at = max(at, seq + 1)
                if (upto is not None and seq >= upto) or (
                    self.last_seq is not None and seq <= self.last_seq
                ):
                    continue
                self._process(seq, frames[2])
                self.replayed += 1
                got += 1
            elif monitor in ready:
                handshaken = self._replay_handshaken
                if self._dropped_for_good(monitor):
                    if not handshaken:
                        # a peer that is not a ROUTER, which refuses every replay (a failed
                        # replay, not a batch to skip: asking past it would ask it again for
                        # ever)
                        break
                    # libzmq tells of the drop before it hands over the batches it decoded
                    # ahead of the refused one (seen: a good batch then taken for the refused
                    # one and skipped): read what the socket holds by now, then stop
                    cut = True
                    poller.unregister(monitor)
            else:
                break  # no answer in time
        if not ended:
            # no answer in time, a connection dropped (or stopping): a late answer must not be
            # read as the next replay's
            if not self._stop.is_set() and not cut:
                self.replay_failures += 1
            self._close_replay()
        return got, at if cut else None

    def _dropped_for_good(self, monitor: zmq.Socket[Any]) -> bool:
        """Read a monitor event of the replay socket: whether it is a disconnect that libzmq
        does not follow with its own reconnect within ``RECONNECT_CHECK_S`` (the connection
        ended at a message over ``max_message_bytes``)."""
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(monitor).get("event")
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._replay_handshaken = True
        if event != zmq.EVENT_DISCONNECTED:
            return False
        self._replay_handshaken = False  # the next connection shakes hands again
        deadline_s = time.monotonic() + RECONNECT_CHECK_S
        while (left_s := deadline_s - time.monotonic()) > 0 and monitor.poll(
            math.ceil(left_s * 1000)
        ):
            if recv_monitor_message(monitor).get("event") == zmq.EVENT_CONNECT_RETRIED:
                return False
        return True

    def _close_replay(self) -> None:
        if self._replay is not None:
            self._replay.disable_monitor()
            self._replay.close(linger=0)
        if self._replay_monitor is not None:
            self._replay_monitor.close(linger=0)
        self._replay = self._replay_monitor = None

    # --- reporting --------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The subscriber's state. Read without the lock a batch is translated and applied
        under, so a long batch (or an index call it waits on) never holds /metrics or the
        router's status: each counter is read as it is, so a batch in progress may show
        partly counted."""
        t = self.translator.stats()
        return {
            "node": self.translator.node,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
            "running": self.running,
            "connected": self.connected,
            "last_seq": self.last_seq,
            "messages": self.messages,
            "events": t["events"],
            "chunks_stored": t["chunks_stored"],
            "chunks_removed": t["chunks_removed"],
            "live_chunks": t["live_chunks"],
            "malformed": self.malformed + t["malformed"],
            "duplicates": self.duplicates,
            "other_topic": self.other_topic,
            "gaps": self.gaps,
            "missed": self.missed,
            "replayed": self.replayed,
            "unrecovered": self.unrecovered,
            "replay_failures": self.replay_failures,
            "restarts": self.restarts,
            "max_message_bytes": self.max_message_bytes,
            "oversized": self.oversized,
            "errors": self.errors,
            "last_error": self.last_error,
            "index_resyncs": self.index_resyncs,
            "index_lost": self.index_lost,
            # a replace failing: how many in a row, and when the next is sent (None: none)
            "index_replace_failures": self._index_backoff.failures,
            "index_retry_in_s": self._index_retry_in_s(),
            "translator": t,
        }


def _check_endpoint(what: str, endpoint: object) -> None:
    """A ZMQ address to connect to: vLLM's ``tcp://*:5557`` is where it binds, so a subscriber
    names the engine's host instead."""
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise InvalidArgument(
            f"{what} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {endpoint!r:.80}"
        )
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if not host or host == "*" or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(
                f"{what} must name the engine's host and port (tcp://HOST:PORT; vLLM's "
                f"'tcp://*:PORT' is where it listens), got {endpoint!r:.80}"
            )
