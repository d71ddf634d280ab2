"""Requests to real token ids and chunk keys, as an engine would compute them.

Every content id expands to a deterministic token stream (``content_tokens``): token ``i`` of
content ``c`` is a mix of ``(c, i)``, so any slice is computed directly and equal ids give equal
tokens at any chunk size. For a Mooncake trace a content id is a prefix-block hash id, which
already names its whole prefix; for generated workloads it names a prompt, document or message.

``KeyChainer`` turns a request into the prefix-chained chunk keys of ``kvctl.store.keys`` (full
chunks only, like ``keys_for``). Chunks recur across requests (that is the point of the cache),
so it remembers each chunk's key by (parent key, content pieces) and hashes a chunk's tokens
only the first time it sees that prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from kvctl.errors import InvalidArgument
from kvctl.store.keys import ChunkKey, Namespace, chain_key_packed
from kvctl.workload.segments import Piece, split_pieces
from kvctl.workload.trace import MAX_BLOCK_ID, TraceRequest

#: Llama-2's vocabulary size; any size works, the keys only need distinct, stable ids
DEFAULT_VOCAB = 32_000
_MAX_CONTENT_ID = MAX_BLOCK_ID  # a trace's block id is a content id
# an odd constant: salts spread over the whole id space
_SALT_STEP = 0x9E3779B97F4A7C15
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection on uint64 that scatters neighbouring inputs."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def content_tokens(
    content_id: int, start: int, end: int, vocab: int = DEFAULT_VOCAB, *, salt: int = 0
) -> np.ndarray:
    """Tokens ``start..end`` of content ``content_id`` as uint32 ids below ``vocab``. ``salt``
    keeps workloads apart: two workloads both number their contents from 0."""
    if not 0 <= content_id <= _MAX_CONTENT_ID:
        raise InvalidArgument(f"content ids must be in 0..{_MAX_CONTENT_ID}, got {content_id}")
    if not 0 <= start <= end:
        raise InvalidArgument(f"bad token range {start}..{end}")
    salted = content_id ^ ((salt * _SALT_STEP) & _MAX_CONTENT_ID)
    base = _mix(np.array([salted], dtype=np.uint64))
    with np.errstate(over="ignore"):
        mixed = _mix(base + np.arange(start, end, dtype=np.uint64))
    return (mixed % np.uint64(vocab)).astype(np.uint32)


def content_salt(name: str) -> int:
    """A workload's salt from its name (a trace's file name, or ``generator:seed=N``), so
    replaying the same workload again hits what the last replay stored, and another does not."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def request_tokens(
    request: TraceRequest, vocab: int = DEFAULT_VOCAB, *, salt: int = 0
) -> np.ndarray:
    """The whole input of ``request`` as token ids (tests and engines; the replay uses keys)."""
    parts = [content_tokens(c, 0, n, vocab, salt=salt) for c, n in request.content]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


class KeyChainer:
    """Chunk keys of requests for one model; ``namespace_of(tenant)`` gives each tenant's
    namespace (a salted one for isolated tenants)."""

    def __init__(
        self,
        namespace_of: Callable[[str], Namespace],
        chunk_tokens: int,
        *,
        vocab: int = DEFAULT_VOCAB,
        salt: int = 0,
    ) -> None:
        if chunk_tokens <= 0:
            raise InvalidArgument(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.vocab = vocab
        self.salt = salt
        self._namespace_of = namespace_of
        self._roots: dict[str, bytes] = {}
        self._memo: dict[tuple[bytes, tuple[Piece, ...]], ChunkKey] = {}
        #: chunks hashed (memo misses): how much work the memo saved is ``keys - hashed``
        self.hashed = 0

    def keys(self, request: TraceRequest) -> list[ChunkKey]:
        root = self._roots.get(request.tenant)
        if root is None:
            root = self._roots[request.tenant] = self._namespace_of(request.tenant).root
        out: list[ChunkKey] = []
        parent = root
        # a partial tail is never a key (see kvctl.store.keys.keys_for)
        for pieces in split_pieces(request.content, self.chunk_tokens)[0]:
            memo_key = (parent, pieces)
            key = self._memo.get(memo_key)
            if key is None:
                tokens = np.concatenate(
                    [content_tokens(c, a, b, self.vocab, salt=self.salt) for c, a, b in pieces]
                )
                key = chain_key_packed(parent, tokens.astype("<u4").tobytes())
                self._memo[memo_key] = key
                self.hashed += 1
            out.append(key)
            parent = key
        return out
