"""Bad control requests: every one gets a 4xx with a JSON error body and changes nothing.

Each test names the input that used to give a 500 (or was silently accepted) before the API
checked it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvctl.agent.api import MAX_KEYS_PER_REQUEST, create_app
from kvctl.agent.runtime import AgentRuntime
from tests.unit.test_agent_api import CHUNK, hexes, put_prompt, tokens

JSON = {"content-type": "application/json"}


@pytest.fixture
def client(runtime: AgentRuntime) -> Iterator[TestClient]:
    # raise_server_exceptions=False: a 500 must show up as a status to assert on, not a raise
    with TestClient(create_app(runtime), raise_server_exceptions=False) as c:
        yield c


def _post_raw(client: TestClient, path: str, body: str | bytes) -> Any:
    return client.post(path, content=body, headers=JSON)


def _assert_error(r: Any, status: int, *needles: str) -> None:
    """A 4xx in the API's error format: {"detail": "..."} (or FastAPI's list for a 422)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    detail = r.json()["detail"]
    text = detail if isinstance(detail, str) else json.dumps(detail)
    for needle in needles:
        assert needle in text, text


# --- resize ----------------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [10**30, 2**63, -1], ids=["10**30", "2**63", "negative"])
def test_resize_out_of_range_integer_is_422_and_changes_nothing(
    client: TestClient, runtime: AgentRuntime, capacity: int
) -> None:
    before = runtime.store.usage()
    r = client.post("/v1/resize", json={"tier": "cpu", "capacity": capacity})
    _assert_error(r, 422, "capacity")
    assert runtime.store.usage() == before


def test_resize_size_text_beyond_the_integer_range_is_400(
    client: TestClient, runtime: AgentRuntime
) -> None:
    before = runtime.store.usage()
    r = client.post("/v1/resize", json={"tier": "cpu", "capacity": "99999999999TiB"})
    _assert_error(r, 400, "99999999999TiB", str(2**63 - 1))
    assert runtime.store.usage() == before


def test_resize_cpu_beyond_what_memory_can_map_is_409_and_keeps_chunks(
    client: TestClient, runtime: AgentRuntime
) -> None:
    keys = put_prompt(runtime, tokens(2))
    before = runtime.store.usage()
    # 4 EiB: more than any address space maps, so the new arena cannot be made
    r = client.post("/v1/resize", json={"tier": "cpu", "capacity": 2**62})
    _assert_error(r, 409, "cpu", "4,194,304 TiB", "keeps its capacity of 16 KiB")
    assert runtime.store.usage() == before
    assert all(runtime.store.get(k, tenant="a") == bytes([k[0]]) * CHUNK for k in keys)


@pytest.mark.parametrize("capacity", [0, "0", "0GiB"])
def test_resize_cpu_to_zero_is_400_as_agent_start_refuses_it(
    client: TestClient, runtime: AgentRuntime, capacity: int | str
) -> None:
    put_prompt(runtime, tokens(2))
    before = runtime.store.usage()
    r = client.post("/v1/resize", json={"tier": "cpu", "capacity": capacity})
    _assert_error(r, 400, "the cpu tier cannot be 0 bytes", "kvctl flush --tier cpu")
    assert runtime.store.usage() == before  # nothing moved out


@pytest.mark.parametrize("capacity", [True, False], ids=["true", "false"])
def test_resize_boolean_capacity_is_422(
    client: TestClient, runtime: AgentRuntime, capacity: bool
) -> None:
    before = runtime.store.usage()
    r = client.post("/v1/resize", json={"tier": "cpu", "capacity": capacity})
    _assert_error(r, 422, "capacity")
    assert runtime.store.usage() == before


@pytest.mark.parametrize(
    "text",
    ["\uff11\uff12\uff13KiB", " 4096", "4096\n", "4_096", "1e30", ""],
    ids=["fullwidth-digits", "leading-space", "trailing-newline", "underscore", "exp", "empty"],
)
def test_resize_size_text_is_ascii_digits_and_a_unit(
    client: TestClient, runtime: AgentRuntime, text: str
) -> None:
    before = runtime.store.usage()
    r = client.post("/v1/resize", json={"tier": "cpu", "capacity": text})
    _assert_error(r, 400, "not a size")
    assert runtime.store.usage() == before


def test_resize_size_text_of_400_digits_is_400_not_500(
    client: TestClient, runtime: AgentRuntime
) -> None:
    before = runtime.store.usage()
    r = client.post("/v1/resize", json={"tier": "disk", "capacity": "9" * 400})
    _assert_error(r, 400, "not a size")
    assert runtime.store.usage() == before


def test_resize_size_text_is_exact_beyond_float_precision(client: TestClient) -> None:
    # 2**53 + 1: a float parse gives 2**53. No filesystem here holds 8 PiB: the disk tier
    # refuses to grow that far, naming the exact size it was asked for
    r = client.post("/v1/resize", json={"tier": "disk", "capacity": "9007199254740993"})
    _assert_error(r, 409, "(9,007,199,254,740,993 bytes)", "free; free space or ask for less")
    r = client.post("/v1/resize", json={"tier": "disk", "capacity": "8796093022209KiB"})
    _assert_error(r, 409, f"({8796093022209 * 1024:,} bytes)")


def test_resize_accepts_the_documented_forms(client: TestClient, runtime: AgentRuntime) -> None:
    for capacity, want in [(8192, 8192), ("16KiB", 16384), ("1.5KiB", 1536), ("32k", 32768)]:
        r = client.post("/v1/resize", json={"tier": "disk", "capacity": capacity})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["capacity_bytes"] == want
    # the largest size the API takes is parsed; the filesystem then refuses it (409, not 422)
    top = client.post("/v1/resize", json={"tier": "disk", "capacity": 2**63 - 1})
    _assert_error(top, 409, f"({2**63 - 1:,} bytes)")


# --- NaN and infinity ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/resize", '{"tier": "cpu", "capacity": NaN}', "capacity"),
        ("/v1/resize", '{"tier": "cpu", "capacity": Infinity}', "capacity"),
        ("/v1/lookup", '{"tokens": [1, -Infinity, 3, 4]}', "tokens"),
        ("/v1/probe", '{"target": "127.0.0.1:1", "timeout_s": NaN}', "timeout_s"),
        ("/v1/probe", '{"target": "127.0.0.1:1", "timeout_s": Infinity}', "timeout_s"),
        ("/v1/flush", '{"tier": "cpu", "demote": NaN}', "demote"),
    ],
)
def test_non_finite_numbers_are_422_not_500(
    client: TestClient, path: str, body: str, field: str
) -> None:
    # Python's json reads NaN/Infinity; echoing them back in the 422 used to crash the encoder
    r = _post_raw(client, path, body)
    _assert_error(r, 422, field)


# --- keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [" " + "00" * 16, "00" * 16 + " ", "00 " * 15 + "00", "00" * 16 + "\n", "\u0660" * 32],
    ids=["leading-space", "trailing-space", "spaced-bytes", "newline", "arabic-indic-digits"],
)
def test_key_must_be_exactly_32_hex_characters(
    client: TestClient, runtime: AgentRuntime, key: str
) -> None:
    put_prompt(runtime, tokens(1))
    for path in ("/v1/lookup", "/v1/evict", "/v1/pin", "/v1/unpin", "/v1/prefetch", "/v1/move"):
        body: dict[str, Any] = {"keys": [key]}
        if path == "/v1/move":
            body["tier"] = "disk"
        _assert_error(client.post(path, json=body), 400, "keys[0]", "32 hex characters")
    _assert_error(client.get("/v1/keys", params={"after": key}), 400, "32 hex characters")
    assert len(runtime.store) == 1


def test_wrongly_typed_key_lists_answer_one_error_not_one_per_item(client: TestClient) -> None:
    # a list of integers where keys (strings) belong: one error per item used to be built and
    # echoed, 2 GB of RSS for a 4 MB body of 2M items
    r = client.post("/v1/evict", json={"keys": [1] * 50_000})
    _assert_error(r, 422, "keys")
    assert len(r.json()["detail"]) <= 20
    assert len(r.content) < 10_000


def test_validation_errors_clip_what_they_echo(client: TestClient) -> None:
    # a model-level error echoes the whole body; 300,000 tokens must not come back
    r = client.post("/v1/lookup", json={"tokens": list(range(300_000)), "keys": ["00" * 16]})
    _assert_error(r, 422, "exactly one of tokens or keys")
    assert len(r.content) < 10_000
    r = client.post("/v1/lookup", json={"tenant": "x" * 100_000})
    _assert_error(r, 422, "exactly one of tokens or keys")
    assert len(r.content) < 10_000


def test_too_many_keys_still_400_within_the_body_limit(client: TestClient) -> None:
    r = client.post("/v1/evict", json={"keys": ["00" * 16] * (MAX_KEYS_PER_REQUEST + 1)})
    _assert_error(r, 400, f"{MAX_KEYS_PER_REQUEST:,}")


# --- tokens ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "toks",
    [[10**30], [-1], [2**32], [True, 2, 3, 4], [1.5, 2, 3, 4], ["1", 2, 3, 4]],
    ids=["huge-partial-chunk", "negative-partial", "2**32", "bool", "float", "string"],
)
def test_lookup_tokens_are_uint32_integers(
    client: TestClient, runtime: AgentRuntime, toks: list[Any]
) -> None:
    r = client.post("/v1/lookup", json={"tokens": toks})
    _assert_error(r, 422, "tokens")
    assert runtime.store.stats.lookups == 0


def test_lookup_wrong_types_are_422(client: TestClient) -> None:
    for body in [
        {"tokens": [1, 2, 3, 4], "count": "yes"},
        {"tokens": [1, 2, 3, 4], "tenant": 5},
        {"tokens": [1, 2, 3, 4], "model": 5},
        {"keys": "00" * 16},
        {"tokens": None, "keys": None},
    ]:
        assert client.post("/v1/lookup", json=body).status_code == 422, body


# --- tiers -----------------------------------------------------------------------------------


def test_empty_tier_name_is_unknown_everywhere(client: TestClient, runtime: AgentRuntime) -> None:
    keys = hexes(put_prompt(runtime, tokens(1)))
    for path, body in [
        ("/v1/prefetch", {"keys": keys, "tier": ""}),
        ("/v1/pin", {"keys": keys, "tier": ""}),
        ("/v1/move", {"keys": keys, "tier": ""}),
        ("/v1/flush", {"tier": ""}),
        ("/v1/resize", {"tier": "", "capacity": 8192}),
    ]:
        _assert_error(client.post(path, json=body), 400, "unknown tier ''")
    _assert_error(client.get("/v1/keys", params={"tier": ""}), 400, "unknown tier ''")
    _assert_error(client.get("/v1/keys", params={"after": ""}), 400, "32 hex characters")


@pytest.mark.parametrize("tier", ["CPU", "cpu ", "c\u0440u", "\x00"], ids=str.encode)
def test_tier_names_match_exactly(client: TestClient, runtime: AgentRuntime, tier: str) -> None:
    before = runtime.store.usage()
    _assert_error(client.post("/v1/flush", json={"tier": tier}), 400, "unknown tier")
    _assert_error(
        client.post("/v1/resize", json={"tier": tier, "capacity": 8192}), 400, "unknown tier"
    )
    assert runtime.store.usage() == before


# --- other fields ----------------------------------------------------------------------------


def test_bool_fields_reject_other_types(client: TestClient, runtime: AgentRuntime) -> None:
    put_prompt(runtime, tokens(1))
    for demote in ("yes", 1, "true", None):
        r = client.post("/v1/flush", json={"tier": "cpu", "demote": demote})
        _assert_error(r, 422, "demote")
    assert len(runtime.store) == 1


def test_probe_integers_reject_bools_and_floats(client: TestClient) -> None:
    for field, value in [("pings", True), ("pings", 2.5), ("bytes", True), ("bytes", "10")]:
        r = client.post("/v1/probe", json={"target": "127.0.0.1:1", field: value})
        _assert_error(r, 422, field)


def test_events_recent_cursor_is_bounded(client: TestClient) -> None:
    r = client.get("/v1/events/recent", params={"after": 2**63})
    _assert_error(r, 422, "after")
    assert client.get("/v1/events/recent", params={"after": 2**63 - 1}).status_code == 200


@pytest.mark.parametrize(
    "value", ["\u0661\u0662", "1_0", " 5", "5 ", "+5", "1" * 30], ids=str.encode
)
def test_last_event_id_is_ascii_digits(client: TestClient, value: str) -> None:
    with client.stream("GET", "/v1/events", headers={"Last-Event-ID": value.encode()}) as r:
        assert r.status_code == 400
        r.read()
        assert "Last-Event-ID" in r.json()["detail"]


def test_malformed_bodies_are_4xx(client: TestClient) -> None:
    for body in [b"{", b"\xff\xfe{}", b"[]", b"null", b'"x"', b"[" * 100_000 + b"]" * 100_000]:
        r = _post_raw(client, "/v1/evict", body)
        assert r.status_code in (400, 422), (body[:10], r.status_code, r.text[:200])
        assert "detail" in r.json()


def test_lookup_by_keys_checks_the_model_too(client: TestClient) -> None:
    # found by schemathesis: the model was only looked at for token lookups
    r = client.post("/v1/lookup", json={"keys": ["00" * 16], "model": "gpt-nope"})
    _assert_error(r, 400, "unknown model 'gpt-nope'")
    ok = client.post("/v1/lookup", json={"keys": ["00" * 16], "model": "llama-3.1-8b"})
    assert ok.status_code == 200, ok.text
