from __future__ import annotations

import re
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvctl.errors import InvalidArgument
from kvctl.store.keys import (
    KEY_BYTES,
    KVLayout,
    Namespace,
    chain_key,
    is_key_text,
    key_text_schema,
    keys_for,
    parents_of,
    parse_key,
    parse_key_text,
    position_independent_key,
)

LAYOUT = KVLayout(32, 8, 128, "bfloat16")


def test_llama_8b_layout_bytes_per_token() -> None:
    # design.md: 32 layers x 8 kv heads x 128 dim x 2 (K,V) x 2 bytes
    assert LAYOUT.bytes_per_token == 131_072
    assert KVLayout(80, 8, 128).bytes_per_token == 327_680  # Llama-3.1-70B
    assert KVLayout(28, 4, 128).bytes_per_token == 57_344  # Qwen2.5-7B


def test_keys_are_128_bit_and_one_per_full_chunk() -> None:
    ns = Namespace("m", LAYOUT)
    keys = keys_for(list(range(1000)), ns, 256)
    assert len(keys) == 3  # the 232-token tail is not keyed by default
    assert all(len(k) == KEY_BYTES for k in keys)
    assert len(keys_for(list(range(1000)), ns, 256, include_partial=True)) == 4


def test_keys_are_prefix_chained() -> None:
    ns = Namespace("m", LAYOUT)
    keys = keys_for(list(range(1024)), ns, 256)
    assert keys[0] == chain_key(ns.root, range(256))
    assert keys[2] == chain_key(keys[1], range(512, 768))


def test_same_chunk_after_a_different_prefix_gets_a_different_key() -> None:
    ns = Namespace("m", LAYOUT)
    a = keys_for([1] * 256 + [7] * 256, ns, 256)
    b = keys_for([2] * 256 + [7] * 256, ns, 256)
    assert a[1] != b[1]
    # ...but the position-independent key of that chunk is the same
    assert position_independent_key([7] * 256, ns) == position_independent_key([7] * 256, ns)
    assert position_independent_key([7] * 256, ns) not in (a[1], b[1])


@pytest.mark.parametrize(
    "other",
    [
        Namespace("m2", LAYOUT),
        Namespace("m", KVLayout(32, 8, 128, "float16")),
        Namespace("m", KVLayout(32, 4, 128)),
        Namespace("m", LAYOUT, tenant_salt="tenant-a"),
    ],
)
def test_root_folds_model_layout_and_salt(other: Namespace) -> None:
    base = Namespace("m", LAYOUT)
    tokens = list(range(256))
    assert keys_for(tokens, base) != keys_for(tokens, other)


def test_root_parts_are_length_prefixed() -> None:
    assert Namespace("ab", LAYOUT, "c").root != Namespace("a", LAYOUT, "bc").root


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=64),
    st.lists(st.integers(0, 2**32 - 1), max_size=64),
    st.integers(1, 16),
)
def test_shared_keys_iff_shared_prefix(a: list[int], b: list[int], chunk: int) -> None:
    ns = Namespace("m", LAYOUT)
    ka, kb = keys_for(a, ns, chunk), keys_for(b, ns, chunk)
    for i in range(min(len(ka), len(kb))):
        same_prefix = a[: (i + 1) * chunk] == b[: (i + 1) * chunk]
        assert (ka[i] == kb[i]) == same_prefix


def test_bad_inputs_have_clear_errors() -> None:
    ns = Namespace("m", LAYOUT)
    with pytest.raises(InvalidArgument, match="chunk_tokens"):
        keys_for([1, 2], ns, 0)
    with pytest.raises(InvalidArgument, match="tokens must be integers"):
        keys_for([-1] * 4, ns, 4)
    with pytest.raises(InvalidArgument, match="tokens must be integers"):
        keys_for([2**32] * 4, ns, 4)
    with pytest.raises(InvalidArgument, match="model_id"):
        Namespace("", LAYOUT)
    with pytest.raises(InvalidArgument, match="layers"):
        KVLayout(0, 8, 128)
    with pytest.raises(InvalidArgument, match="dtype"):
        _ = KVLayout(1, 1, 1, "int3").bytes_per_token


def test_parse_key_round_trip_and_errors() -> None:
    key = keys_for(list(range(4)), Namespace("m", LAYOUT), 4)[0]
    assert parse_key(key.hex()) == key
    with pytest.raises(InvalidArgument, match="not a hex key"):
        parse_key("zz")
    with pytest.raises(InvalidArgument, match="32 hex"):
        parse_key("abcd")


def test_key_text_is_exactly_32_hex_digits() -> None:
    key = "7e" * 16
    assert is_key_text(key) and is_key_text(key.upper())
    # bytes.fromhex takes all of these; an agent takes none
    for bad in (f" {key}", f"{key}\n", "7e " * 15 + "7e", key[:-1], key + "0", "zz" * 16):
        assert not is_key_text(bad), bad


@given(
    st.text(alphabet="0123456789abcdefABCDEF g\n\u0660\uff41", max_size=34)
    | st.text(alphabet="0123456789abcdefABCDEF\u0660", min_size=32, max_size=32)
)
def test_key_text_rule_schema_and_parse_agree(text: str) -> None:
    # one rule for the agent's and the router's APIs: the check, the parse and the JSON schema
    # they state (non-ASCII digits, which str.isdigit-style checks take, are refused by all)
    expected = len(text) == KEY_BYTES * 2 and all(c in string.hexdigits for c in text)
    assert is_key_text(text) == expected
    schema = key_text_schema()
    assert schema["minLength"] == schema["maxLength"] == KEY_BYTES * 2
    # (fullmatch: a JSON schema's $ is the end, where Python's also takes a final newline)
    assert (re.fullmatch(str(schema["pattern"]), text) is not None) == expected
    if expected:
        assert parse_key_text(text, "keys[0]") == bytes.fromhex(text)
    else:
        with pytest.raises(
            InvalidArgument, match=r"^bad keys\[0\] .*: keys are 32 hex characters$"
        ):
            parse_key_text(text, "keys[0]")


def test_parse_key_text_clips_what_it_echoes() -> None:
    with pytest.raises(InvalidArgument) as exc:
        parse_key_text("z" * 100, "after")
    assert str(exc.value) == f"bad after {'z' * 40 + '...'!r}: keys are 32 hex characters"


def test_parents_of() -> None:
    assert parents_of([b"a", b"b", b"c"]) == [None, b"a", b"b"]
