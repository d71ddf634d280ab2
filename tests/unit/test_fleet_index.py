"""The fleet index's vocabulary (ChunkEvent, from_agent_event, from_listing), EmbeddedIndex,
the index factory, and a property test that attacks tenant isolation with random event streams.

``ops`` and ``check_against_model`` are shared with tests/functional/test_redis_index.py, which
runs the same streams against RedisIndex."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from kvctl.errors import InvalidArgument
from kvctl.index.events import KEY_BYTES, ChunkEvent, from_agent_event, from_listing
from kvctl.index.model import EmbeddedIndex, FleetIndex, Holding
from kvctl.index.open import open_index
from kvctl.index.redis_index import RedisIndex, _holding, encode_entry


def key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=KEY_BYTES).digest()


def stored(
    i: int,
    tier: str = "cpu",
    tenant: str = "acme",
    *,
    isolated: bool = False,
    size_bytes: int = 100,
    tokens: int = 16,
) -> ChunkEvent:
    return ChunkEvent("stored", key(i), tier, tenant, isolated, size_bytes, tokens)


def removed(i: int) -> ChunkEvent:
    return ChunkEvent("removed", key(i))


CLEARED = ChunkEvent("cleared")


# --- ChunkEvent -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"kind": "deleted", "key": key(0)}, "kind"),
        ({"kind": "cleared", "key": key(0)}, "names no key"),
        ({"kind": "removed", "key": b"short"}, "16 bytes"),
        ({"kind": "removed", "key": key(0).hex()}, "16 bytes"),
        ({"kind": "stored", "key": key(0)}, "tier"),
        ({"kind": "stored", "key": key(0), "tier": "cpu", "size_bytes": -1}, "size_bytes"),
        ({"kind": "stored", "key": key(0), "tier": "cpu", "tokens": True}, "tokens"),
        ({"kind": "stored", "key": key(0), "tier": "cpu", "tokens": 1.5}, "tokens"),
    ],
)
def test_a_malformed_chunk_event_is_refused(kwargs: dict[str, Any], why: str) -> None:
    with pytest.raises(InvalidArgument, match=why):
        ChunkEvent(**kwargs)


def test_an_isolated_chunk_is_visible_to_its_own_tenant_only() -> None:
    shared = stored(0, tenant="acme")
    isolated = stored(0, tenant="acme", isolated=True)
    assert shared.visible_to("acme") and shared.visible_to("globex") and shared.visible_to("")
    assert isolated.visible_to("acme")
    assert not isolated.visible_to("globex") and not isolated.visible_to("")


# --- from_agent_event / from_listing --------------------------------------------------------
def agent_event(type_: str, **fields: Any) -> dict[str, Any]:
    event: dict[str, Any] = {
        "seq": 7,
        "time_s": 1.0,
        "type": type_,
        "key": key(1).hex(),
        "tier": "disk",
        "size_bytes": 4096,
        "tokens": 32,
        "tenant": "acme",
        "isolated": True,
    }
    event.update(fields)
    return event


@pytest.mark.parametrize("type_", ["store", "demote", "promote", "move"])
def test_agent_events_that_place_a_chunk_become_stored(type_: str) -> None:
    assert from_agent_event(agent_event(type_)) == ChunkEvent(
        "stored", key(1), "disk", "acme", True, 4096, 32
    )


def test_an_evict_becomes_removed_and_other_events_say_nothing() -> None:
    got = from_agent_event(agent_event("evict", tier=None))
    assert got is not None and (got.kind, got.key, got.tier) == ("removed", key(1), "")
    assert from_agent_event(agent_event("fetch_plan")) is None
    assert from_agent_event({"type": "hello"}) is None
    assert from_agent_event({}) is None


def test_missing_optional_fields_default() -> None:
    got = from_agent_event({"type": "store", "key": key(2).hex(), "tier": "gpu"})
    assert got == ChunkEvent("stored", key(2), "gpu", "", False, 0, 0)
    assert from_agent_event(agent_event("store", tenant=None)).tenant == ""  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "fields",
    [
        {"key": None},
        {"key": "zz" * KEY_BYTES},
        {"key": "ab"},
        {"key": key(0).hex() + "00"},
        {"tier": ""},
        {"size_bytes": "4096"},
        {"size_bytes": -5},
        {"tokens": 3.0},
        {"tokens": False},
    ],
)
def test_a_malformed_agent_event_raises_invalid_argument(fields: dict[str, Any]) -> None:
    event = agent_event("store", **fields)
    if fields.get("key", "") is None:
        del event["key"]
    with pytest.raises(InvalidArgument):
        from_agent_event(event)


def test_a_bad_key_is_said_with_where_it_came_from() -> None:
    for event in ({"type": "evict"}, agent_event("store", key="zz" * KEY_BYTES)):
        with pytest.raises(InvalidArgument, match=r"^agent event without a valid key: "):
            from_agent_event(event)


def test_a_listing_item_becomes_a_stored_event() -> None:
    item = {"key": key(3).hex(), "tier": "cpu", "size_bytes": 10, "tokens": 1, "tenant": "t"}
    assert from_listing(item) == ChunkEvent("stored", key(3), "cpu", "t", False, 10, 1)
    with pytest.raises(InvalidArgument, match=r"^listed chunk without a valid key: "):
        from_listing({"tier": "cpu"})
    with pytest.raises(InvalidArgument, match=r"^listed chunk without a valid key: "):
        from_listing({"key": "nothex", "tier": "cpu"})
    with pytest.raises(InvalidArgument, match="tier"):
        from_listing({"key": key(3).hex()})


# --- EmbeddedIndex --------------------------------------------------------------------------
def test_holders_answer_per_key_in_node_name_order() -> None:
    index = EmbeddedIndex()
    assert isinstance(index, FleetIndex)
    assert index.apply("b", [stored(0, "gpu", size_bytes=7, tokens=1)]) == 1
    assert index.apply("a", [stored(0, "disk"), stored(1)]) == 2
    assert index.holders([key(0), key(1), key(2)], tenant="x") == [
        [Holding("a", "disk", 100, 16), Holding("b", "gpu", 7, 1)],
        [Holding("a", "cpu", 100, 16)],
        [],
    ]
    assert index.holders([], tenant="x") == []
    assert index.nodes() == {"a": 2, "b": 1}
    assert len(index) == 3


def test_applying_events_twice_changes_nothing() -> None:
    events = [stored(0), stored(1, "gpu"), removed(0), stored(2), stored(1, "disk")]
    once, twice = EmbeddedIndex(), EmbeddedIndex()
    once.apply("n", events)
    twice.apply("n", events)
    twice.apply("n", events)
    keys = [key(i) for i in range(3)]
    assert twice.holders(keys, tenant="acme") == once.holders(keys, tenant="acme")
    assert twice.nodes() == once.nodes() == {"n": 2}
    assert once.holders([key(1)], tenant="acme") == [[Holding("n", "disk", 100, 16)]]


def test_a_later_stored_event_moves_the_chunk_without_a_second_entry() -> None:
    index = EmbeddedIndex()
    index.apply("n", [stored(0, "gpu"), stored(0, "cpu", size_bytes=5)])
    assert index.holders([key(0)], tenant="acme") == [[Holding("n", "cpu", 5, 16)]]
    assert len(index) == 1


def test_removing_an_unknown_chunk_changes_nothing() -> None:
    index = EmbeddedIndex()
    index.apply("a", [stored(0)])
    # counted as applied (the follower's bookkeeping), but nothing to remove
    assert index.apply("b", [removed(0), removed(9)]) == 2
    assert index.apply("a", [removed(9)]) == 1
    assert index.nodes() == {"a": 1}
    assert index.holders([key(0)], tenant="acme") == [[Holding("a", "cpu", 100, 16)]]
    index.apply("a", [removed(0)])
    assert index.nodes() == {} and len(index) == 0
    assert index.holders([key(0)], tenant="acme") == [[]]


def test_cleared_forgets_the_node_only_then_later_events_apply() -> None:
    index = EmbeddedIndex()
    index.apply("a", [stored(0), stored(1)])
    index.apply("b", [stored(0)])
    index.apply("a", [stored(2), CLEARED, stored(3)])
    assert index.nodes() == {"a": 1, "b": 1}
    assert index.holders([key(0), key(1), key(3)], tenant="acme") == [
        [Holding("b", "cpu", 100, 16)],
        [],
        [Holding("a", "cpu", 100, 16)],
    ]


def test_replace_makes_the_listing_the_nodes_whole_holding() -> None:
    index = EmbeddedIndex()
    index.apply("a", [stored(0), stored(1)])
    index.apply("b", [stored(1)])
    assert index.replace("a", [stored(1, "gpu"), stored(2), stored(2)]) == 2
    assert index.nodes() == {"a": 2, "b": 1}
    assert index.holders([key(0), key(1), key(2)], tenant="acme") == [
        [],
        [Holding("a", "gpu", 100, 16), Holding("b", "cpu", 100, 16)],
        [Holding("a", "cpu", 100, 16)],
    ]
    assert index.replace("a", []) == 0
    assert index.nodes() == {"b": 1}


def test_drop_forgets_a_node_and_says_how_many_entries() -> None:
    index = EmbeddedIndex()
    index.apply("a", [stored(0), stored(1)])
    index.apply("b", [stored(0)])
    assert index.drop("a") == 2
    assert index.drop("a") == 0
    assert index.drop("never-seen") == 0
    assert index.nodes() == {"b": 1}
    assert index.holders([key(0), key(1)], tenant="acme") == [[Holding("b", "cpu", 100, 16)], []]


def test_isolated_entries_are_seen_by_their_tenant_only_per_node() -> None:
    index = EmbeddedIndex()
    index.apply("a", [stored(0, tenant="acme", isolated=True)])
    index.apply("b", [stored(0, tenant="globex", isolated=False)])
    index.apply("c", [stored(0, tenant="globex", isolated=True)])
    nodes_seen = {
        t: [h.node for h in index.holders([key(0)], tenant=t)[0]]
        for t in ("acme", "globex", "initech", "")
    }
    assert nodes_seen == {
        "acme": ["a", "b"],
        "globex": ["b", "c"],
        "initech": ["b"],
        "": ["b"],
    }
    # nodes() is operators' bookkeeping: it counts every entry, isolated or not
    assert index.nodes() == {"a": 1, "b": 1, "c": 1}


# --- open_index and RedisIndex's construction and encoding (no server needed) ---------------
def test_open_index_accepts_the_documented_forms_only() -> None:
    assert isinstance(open_index("embedded"), EmbeddedIndex)
    for url in ("redis://127.0.0.1:1/0", "rediss://h:6380", "unix:///tmp/r.sock?db=1"):
        index = open_index(url, prefix="p:")
        assert isinstance(index, RedisIndex) and index.kind == "redis" and index.prefix == "p:"
        index.close()
    for bad in ("", "memory", "http://h:6379", "redis+cluster://h:7000", "127.0.0.1:6379"):
        with pytest.raises(InvalidArgument, match="embedded"):
            open_index(bad)


def test_open_index_errors_do_not_show_a_password() -> None:
    with pytest.raises(InvalidArgument) as err:
        open_index("http://user:s3cret@h:6379/0")
    assert "s3cret" not in str(err.value)


def test_redis_index_refuses_bad_settings() -> None:
    with pytest.raises(InvalidArgument, match="prefix"):
        RedisIndex(prefix="")
    with pytest.raises(InvalidArgument, match="scheme"):
        RedisIndex("http://127.0.0.1:6379")
    with pytest.raises(InvalidArgument, match="timeout_s"):
        RedisIndex(timeout_s=0)
    decoding = redis.Redis(decode_responses=True)
    with pytest.raises(InvalidArgument, match="decode"):
        RedisIndex(client=decoding)
    decoding.close()


text = st.text(st.characters(codec="utf-8") | st.sampled_from(["\ud800", "\x00", " "]))


@given(tier=text, tenant=text, isolated=st.booleans(), size=st.integers(0, 1 << 62))
def test_redis_entry_encoding_round_trips_any_tier_and_tenant(
    tier: str, tenant: str, isolated: bool, size: int
) -> None:
    event = ChunkEvent("stored", key(0), tier or "t", tenant, isolated, size, size // 3)
    value = encode_entry(event)
    got = _holding("n\x00é".encode(), value, tenant.encode("utf-8", "surrogatepass"))
    assert got == Holding("n\x00é", tier or "t", size, size // 3)
    other = _holding(b"n", value, (tenant + "x").encode("utf-8", "surrogatepass"))
    assert (other is None) == isolated


# --- the isolation property, against a reference model ---------------------------------------
NODES = ("n0", "n 1", "nœud\x00")
TENANTS = ("", "acme", "glo bex", "\ud800")
KEYS = tuple(key(i) for i in range(6))

chunk = st.builds(
    ChunkEvent,
    kind=st.just("stored"),
    key=st.sampled_from(KEYS),
    tier=st.sampled_from(["gpu", "cpu", "disk", "pool tier"]),
    tenant=st.sampled_from(TENANTS),
    isolated=st.booleans(),
    size_bytes=st.integers(0, 1 << 40),
    tokens=st.integers(0, 4096),
)
event = st.one_of(
    chunk,
    chunk,  # stored twice as likely: the index should hold something most of the time
    st.builds(ChunkEvent, kind=st.just("removed"), key=st.sampled_from(KEYS)),
    st.just(CLEARED),
)
node = st.sampled_from(NODES)
#: ("apply", node, events) | ("replace", node, chunks) | ("drop", node, [])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("apply"), node, st.lists(event, max_size=8)),
        st.tuples(st.just("replace"), node, st.lists(chunk, max_size=6)),
        st.tuples(st.just("drop"), node, st.just([])),
    ),
    min_size=1,
    max_size=12,
)
Op = tuple[str, str, list[ChunkEvent]]


def run_op(index: FleetIndex, op: Op) -> int:
    what, name, events = op
    if what == "apply":
        return index.apply(name, events)
    if what == "replace":
        return index.replace(name, events)
    return index.drop(name)


def model_step(model: dict[tuple[str, bytes], ChunkEvent], op: Op) -> None:
    """The reference: (node, key) -> the stored event that holds, written as plainly as
    possible."""
    what, name, events = op
    if what in ("replace", "drop"):
        for k in [k for k in model if k[0] == name]:
            del model[k]
    for e in events:
        if e.kind == "stored":
            model[name, e.key] = e
        elif e.kind == "removed":
            model.pop((name, e.key), None)
        else:
            for k in [k for k in model if k[0] == name]:
                del model[k]


def check_against_model(
    index: FleetIndex, model: dict[tuple[str, bytes], ChunkEvent], keys: Sequence[bytes]
) -> None:
    """No tenant is ever shown another tenant's isolated chunk, and every tenant is shown every
    entry it may see, as the model says."""
    for tenant in (*TENANTS, "outsider"):
        answer = index.holders(keys, tenant=tenant)
        assert len(answer) == len(keys)
        for k, row in zip(keys, answer, strict=True):
            for h in row:
                held = model.get((h.node, k))
                assert held is not None, f"{h} is not in the model"
                assert held.visible_to(tenant), f"{tenant!r} was shown {held}"
                assert h == Holding(h.node, held.tier, held.size_bytes, held.tokens)
            expected = sorted(n for (n, kk), e in model.items() if kk == k and e.visible_to(tenant))
            assert [h.node for h in row] == expected
    counts: dict[str, int] = {}
    for n, _ in model:
        counts[n] = counts.get(n, 0) + 1
    assert index.nodes() == dict(sorted(counts.items()))


@settings(max_examples=150, deadline=None)
@given(stream=ops)
def test_no_tenant_is_ever_shown_another_tenants_isolated_chunk(stream: list[Op]) -> None:
    index = EmbeddedIndex()
    model: dict[tuple[str, bytes], ChunkEvent] = {}
    for op in stream:
        run_op(index, op)
        model_step(model, op)
        check_against_model(index, model, KEYS)
