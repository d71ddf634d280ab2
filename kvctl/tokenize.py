"""Tokenizers for operators' tools (no model download): enough to compute chunk keys by hand.

``simple`` splits on whitespace and maps each word to a stable 31-bit id; ``bytes`` uses the UTF-8
bytes. Neither matches a model's tokenizer, so keys computed from text only match keys computed
the same way; engines pass real token ids.
"""

from __future__ import annotations

import hashlib

from kvctl.errors import InvalidArgument

TOKENIZERS = ("simple", "bytes")


def tokenize(text: str, tokenizer: str = "simple") -> list[int]:
    if tokenizer == "simple":
        return [
            int.from_bytes(hashlib.blake2b(w.encode(), digest_size=4).digest(), "little") >> 1
            for w in text.split()
        ]
    if tokenizer == "bytes":
        return list(text.encode())
    raise InvalidArgument(f"unknown tokenizer {tokenizer!r}; choose from {', '.join(TOKENIZERS)}")


#: token ids are hashed as uint32 (kvctl.store.keys); agents refuse any other id
MAX_TOKEN_ID = 2**32 - 1


def read_token_file(text: str) -> list[int]:
    """Token ids separated by whitespace or commas (a JSON list also parses), each in
    0..MAX_TOKEN_ID: one out of range is refused here, before any agent is asked."""
    cleaned = text.replace(",", " ").replace("[", " ").replace("]", " ").split()
    try:
        ids = [int(t) for t in cleaned]
    except ValueError as exc:
        raise InvalidArgument(f"token file must hold integers: {exc}") from None
    for i, token in enumerate(ids):
        if not 0 <= token <= MAX_TOKEN_ID:
            raise InvalidArgument(
                f"token #{i + 1} is {token}: token ids are 0..{MAX_TOKEN_ID} (unsigned 32-bit)"
            )
    return ids
