"""Chunk keys: 128-bit digests chained over a token prefix.

``key_i = H(key_{i-1} || tokens_i)`` with a root that folds in the model id, the KV layout and the
tenant's cache salt, so two requests share a chunk key only when their whole prefix (and model,
layout and salt) match. A position-independent variant ``H(namespace || b"pi" || tokens_i)`` serves
engines that blend non-prefix chunks.
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvctl.store.errors import InvalidArgument

KEY_BYTES = 16
#: a key as text: its hex digits
KEY_TEXT_CHARS = KEY_BYTES * 2
_KEY_TEXT = re.compile(f"[0-9a-fA-F]{{{KEY_TEXT_CHARS}}}")
DEFAULT_CHUNK_TOKENS = 256
#: the fewest bytes a token's KV takes in any layout: a K and a V of one byte (one layer, one
#: head, one dimension, an 8-bit type); real models take thousands
MIN_KV_BYTES_PER_TOKEN = 2
_MAX_TOKEN = 2**32 - 1
_KEY_VERSION = b"kvctl-key-v1"

ChunkKey = bytes
"""A 16-byte digest. Displayed as 32 hex characters."""


def most_tokens(chunk_tokens: int, size_bytes: int) -> int:
    """The most tokens a chunk of ``size_bytes`` can claim: ``chunk_tokens``, or as many as
    its bytes hold at ``MIN_KV_BYTES_PER_TOKEN``. Not ``chunk_tokens`` alone: an engine may
    chunk larger than its agent (the vLLM connector's and the transformers adapter's
    ``chunk_tokens``; models with different chunk sizes share an agent's tiers). A claim past
    it (a hostile or broken client, peer, pool or agent) would count as hit or saved tokens."""
    return max(chunk_tokens, size_bytes // MIN_KV_BYTES_PER_TOKEN)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of the KV cache a model writes per token; part of every key's root."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be positive")

    @property
    def dtype_bytes(self) -> int:
        sizes = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1}
        try:
            return sizes[self.dtype]
        except KeyError:
            raise InvalidArgument(
                f"unknown KV dtype {self.dtype!r}; expected one of {sorted(sizes)}"
            ) from None

    @property
    def bytes_per_token(self) -> int:
        """K and V for every layer: layers x kv_heads x head_dim x 2 x dtype bytes."""
        return self.layers * self.kv_heads * self.head_dim * 2 * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Namespace:
    """Model id + KV layout + tenant salt. An empty salt means the common (shared) namespace."""

    model_id: str
    layout: KVLayout
    tenant_salt: str = ""
    root: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise InvalidArgument("Namespace.model_id must not be empty")
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvctl-root")
        for part in (
            _KEY_VERSION,
            self.model_id.encode(),
            f"{self.layout.layers}:{self.layout.kv_heads}:{self.layout.head_dim}".encode(),
            self.layout.dtype.encode(),
            self.tenant_salt.encode(),
        ):
            # length-prefix each part so ("ab", "c") and ("a", "bc") differ
            h.update(len(part).to_bytes(4, "little"))
            h.update(part)
        object.__setattr__(self, "root", h.digest())


def _pack_tokens(tokens: Sequence[int]) -> bytes:
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise InvalidArgument(f"tokens must be integers in 0..{_MAX_TOKEN}: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - 'I' is 4 bytes on every supported platform
        packed = array("L", tokens)
    return packed.tobytes()


def chain_key(parent: bytes, chunk_tokens: Sequence[int]) -> ChunkKey:
    """One link of the chain: ``H(parent || tokens)``."""
    return chain_key_packed(parent, _pack_tokens(chunk_tokens))


def chain_key_packed(parent: bytes, packed_tokens: bytes) -> ChunkKey:
    """``chain_key`` of tokens already packed as little-endian uint32 (e.g. a numpy array's
    ``astype("<u4").tobytes()``), for callers that hold tokens in arrays."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=b"kvctl-chain")
    h.update(packed_tokens)
    return h.digest()


def keys_for(
    tokens: Sequence[int],
    namespace: Namespace,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    *,
    include_partial: bool = False,
) -> list[ChunkKey]:
    """Prefix-chained keys, one per full chunk of ``tokens`` (plus the partial tail if asked).

    A partial tail chunk is left out by default: its KV changes as the prompt grows, so it is
    rarely reusable, and engines page KV in whole blocks.
    """
    if chunk_tokens <= 0:
        raise InvalidArgument(f"chunk_tokens must be positive, got {chunk_tokens}")
    keys: list[ChunkKey] = []
    parent = namespace.root
    n = len(tokens)
    end = n if include_partial else n - n % chunk_tokens
    for start in range(0, end, chunk_tokens):
        parent = chain_key(parent, tokens[start : min(start + chunk_tokens, n)])
        keys.append(parent)
    return keys


def position_independent_key(chunk_tokens: Sequence[int], namespace: Namespace) -> ChunkKey:
    """Key of a chunk by its own tokens only (CacheBlend-style reuse at any position)."""
    h = hashlib.blake2b(namespace.root, digest_size=KEY_BYTES, person=b"kvctl-pi")
    h.update(_pack_tokens(chunk_tokens))
    return h.digest()


def is_key_text(text: str) -> bool:
    """Whether ``text`` is a key as the control API takes it: exactly 32 hex digits
    (``bytes.fromhex`` alone would also take spaces around and between them)."""
    return _KEY_TEXT.fullmatch(text) is not None


def parse_key_text(text: str, what: str) -> ChunkKey:
    """A key the agent's or the router's API was sent, by ``is_key_text``'s rule; else
    ``InvalidArgument`` naming ``what`` (where it came: ``keys[3]``) and the text (clipped)."""
    if not is_key_text(text):
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise InvalidArgument(f"bad {what} {shown!r}: keys are {KEY_TEXT_CHARS} hex characters")
    return bytes.fromhex(text)


def key_text_schema() -> dict[str, object]:
    """The JSON schema of what ``is_key_text`` accepts, as the daemons' APIs state it (a fresh
    dict each call: schema generators may change what they are given)."""
    return {
        "type": "string",
        "pattern": f"^{_KEY_TEXT.pattern}$",
        "minLength": KEY_TEXT_CHARS,
        "maxLength": KEY_TEXT_CHARS,
    }


def parse_key(text: str) -> ChunkKey:
    """Parse 32 hex characters into a key, with a clear error otherwise."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise InvalidArgument(f"not a hex key: {text!r}") from None
    if len(key) != KEY_BYTES:
        raise InvalidArgument(f"a key is {KEY_BYTES * 2} hex characters, got {len(text.strip())}")
    return key


def parents_of(keys: Iterable[ChunkKey]) -> list[ChunkKey | None]:
    """Parent link of each key in a chain: None for the first, the previous key otherwise."""
    out: list[ChunkKey | None] = []
    prev: ChunkKey | None = None
    for key in keys:
        out.append(prev)
        prev = key
    return out
