"""The agent's control API over a real tiered store (cpu arena + disk directory)."""

from __future__ import annotations

import dataclasses
import json
import queue
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from kvctl import __version__
from kvctl.agent import api
from kvctl.agent.api import create_app
from kvctl.agent.events import EventHub
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.store.keys import keys_for, parents_of
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier

CHUNK = 4096  # payload bytes per chunk
CT = 4  # tokens per chunk
TOKEN = "s3cret-token"


def _settings(tmp_path: Path) -> AgentSettings:
    return AgentSettings(
        name="t1",
        dc="dc-a",
        data_dir=str(tmp_path),
        cpu_bytes=4 * CHUNK,  # four chunks: a fifth demotes one to disk
        disk_bytes=16 * CHUNK,
        chunk_tokens=CT,
        token="",
        isolated_tenants=("secret",),
    )


def _runtime(settings: AgentSettings, tmp_path: Path) -> AgentRuntime:
    store = TieredStore(
        [CpuTier(settings.cpu_bytes), DiskTier(tmp_path / "disk", settings.disk_bytes)],
        chunk_tokens=settings.chunk_tokens,
    )
    return AgentRuntime(settings, store)


@pytest.fixture
def client(runtime: AgentRuntime) -> Iterator[TestClient]:
    with TestClient(create_app(runtime)) as c:
        yield c


def tokens(n_chunks: int, seed: int = 0, extra: int = 0) -> list[int]:
    return [seed * 10_000 + i for i in range(n_chunks * CT + extra)]


def put_prompt(rt: AgentRuntime, toks: list[int], tenant: str = "a") -> list[bytes]:
    """Store every full chunk of a prompt the way an engine would; returns its keys."""
    keys = keys_for(toks, rt.namespace(None, tenant), CT)
    for k, p in zip(keys, parents_of(keys), strict=True):
        rt.store.put(
            k, bytes([k[0]]) * CHUNK, tenant=tenant, parent=p, isolated=rt.is_isolated(tenant)
        )
    return keys


def hexes(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


# --- agent -----------------------------------------------------------------------------------


def test_health_and_info(client: TestClient) -> None:
    h = client.get("/v1/health")
    assert h.status_code == 200
    body = h.json()
    assert (body["status"], body["name"], body["dc"]) == ("ok", "t1", "dc-a")
    assert 0 <= body["uptime_seconds"] < 60

    info = client.get("/v1/info").json()
    assert info["name"] == "t1"
    assert info["version"] == __version__
    assert [t["name"] for t in info["tiers"]] == ["cpu", "disk"]
    assert info["tiers"][0]["capacity_bytes"] == 4 * CHUNK
    assert info["auth"] is False


def test_stats_hit_ratio_is_unknown_before_any_lookup(client: TestClient) -> None:
    # no lookup yet: no ratio (None, as `kvctl status` shows N/A), not a 0% that reads as misses
    body = client.get("/v1/stats").json()
    assert body["stats"]["lookup_chunks"] == 0
    assert body["hit_ratio"] is None and body["stats"]["hit_ratio"] is None


def test_stats_derive_hit_ratio(client: TestClient, runtime: AgentRuntime) -> None:
    toks = tokens(3)
    put_prompt(runtime, toks[: 2 * CT])  # two of the three chunks
    r = client.post("/v1/lookup", json={"tenant": "a", "tokens": toks})
    assert r.json()["matched_chunks"] == 2

    stats = client.get("/v1/stats")
    assert stats.status_code == 200
    body = stats.json()
    assert body["hit_ratio"] == pytest.approx(2 / 3)
    assert body["stats"]["lookups"] == 1
    assert body["usage"]["cpu"]["chunks"] == 2


# --- lookup ----------------------------------------------------------------------------------


def test_lookup_by_tokens_reports_prefix_and_tiers(
    client: TestClient, runtime: AgentRuntime
) -> None:
    toks = tokens(6)
    keys = put_prompt(runtime, toks)  # six chunks in a four-chunk cpu tier: two on disk
    # two more full chunks nobody stored, plus a partial tail that must not count
    r = client.post("/v1/lookup", json={"tenant": "a", "tokens": toks + tokens(2, seed=9) + [1]})
    assert r.status_code == 200
    body = r.json()
    assert body["total_chunks"] == 8
    assert body["matched_chunks"] == 6
    assert body["matched_tokens"] == 6 * CT
    chunks = body["chunks"]
    assert [c["key"] for c in chunks[:6]] == hexes(keys)
    assert [c["tier"] for c in chunks[:6]] == [runtime.store.entry(k).tier for k in keys]
    assert {c["tier"] for c in chunks[:6]} == {"cpu", "disk"}
    assert [c["tier"] for c in chunks[6:]] == [None, None]


def test_lookup_partial_match_stops_at_the_first_gap(
    client: TestClient, runtime: AgentRuntime
) -> None:
    keys = put_prompt(runtime, tokens(3))
    assert client.post("/v1/evict", json={"keys": [keys[1].hex()]}).json()["done"] == 1

    r = client.post("/v1/lookup", json={"tenant": "a", "keys": hexes(keys)})
    assert r.status_code == 200
    body = r.json()
    assert (body["total_chunks"], body["matched_chunks"], body["matched_tokens"]) == (3, 1, CT)
    # the chunk after the gap is still located, just not usable as a prefix
    assert [c["tier"] for c in body["chunks"]] == ["cpu", None, "cpu"]


def test_lookup_with_count_false_leaves_the_hit_statistics_alone(
    client: TestClient, runtime: AgentRuntime
) -> None:
    toks = tokens(3)
    put_prompt(runtime, toks[: 2 * CT])
    before = client.get("/v1/stats").json()["stats"]
    quiet = client.post("/v1/lookup", json={"tenant": "a", "tokens": toks, "count": False})
    assert client.get("/v1/stats").json()["stats"] == before
    counted = client.post("/v1/lookup", json={"tenant": "a", "tokens": toks})
    assert quiet.json() == counted.json()
    assert client.get("/v1/stats").json()["stats"]["hit_chunks"] == before["hit_chunks"] + 2


def test_health_and_info_carry_clock_and_disk_for_doctor(client: TestClient) -> None:
    import time

    t0 = time.time()
    health = client.get("/v1/health").json()
    assert t0 - 1 <= health["time_s"] <= time.time() + 1
    disk = client.get("/v1/info").json()["data_dir"]
    assert disk["total_bytes"] > 0 and 0 <= disk["free_bytes"] <= disk["total_bytes"]


@pytest.mark.parametrize(
    "body",
    [{"tenant": "a"}, {"tokens": [1, 2, 3, 4], "keys": ["00" * 16]}],
    ids=["neither", "both"],
)
def test_lookup_needs_exactly_one_of_tokens_or_keys(client: TestClient, body: dict) -> None:
    r = client.post("/v1/lookup", json=body)
    assert r.status_code == 422
    assert "exactly one of tokens or keys" in r.text


def test_lookup_unknown_model_is_400(client: TestClient) -> None:
    r = client.post("/v1/lookup", json={"model": "gpt-nope", "tokens": [1, 2, 3, 4]})
    assert r.status_code == 400
    assert "unknown model 'gpt-nope'" in r.json()["detail"]


def test_isolated_tenant_does_not_match_shared_chunks(
    client: TestClient, runtime: AgentRuntime
) -> None:
    toks = tokens(3)
    shared = put_prompt(runtime, toks, tenant="a")

    def matched(tenant: str, **req: object) -> int:
        r = client.post("/v1/lookup", json={"tenant": tenant, **req})
        assert r.status_code == 200
        return r.json()["matched_chunks"]

    assert matched("b", tokens=toks) == 3  # non-isolated tenants share one namespace
    assert matched("secret", tokens=toks) == 0  # salted namespace: different keys
    secret = put_prompt(runtime, toks, tenant="secret")
    assert set(secret).isdisjoint(shared)
    assert matched("secret", tokens=toks) == 3
    assert matched("a", keys=hexes(secret)) == 0  # isolated chunks are invisible to others


# --- input errors ----------------------------------------------------------------------------


def test_bad_hex_key_is_400_naming_the_value(client: TestClient) -> None:
    bad = "zz" + "ab" * 40
    r = client.post("/v1/evict", json={"keys": ["00" * 16, bad]})
    assert r.status_code == 400
    detail = r.json()["detail"]
    assert "keys[1]" in detail
    assert "32 hex characters" in detail
    assert bad[:20] in detail and bad not in detail  # named, but truncated

    short = client.post("/v1/lookup", json={"keys": ["abcd"]})
    assert short.status_code == 400
    assert "'abcd'" in short.json()["detail"]


def test_too_many_keys_is_400(client: TestClient) -> None:
    r = client.post("/v1/unpin", json={"keys": ["00" * 16] * (api.MAX_KEYS_PER_REQUEST + 1)})
    assert r.status_code == 400
    assert "100,000" in r.json()["detail"]


def test_unknown_tier_is_400(client: TestClient, runtime: AgentRuntime) -> None:
    keys = hexes(put_prompt(runtime, tokens(1)))
    for path, body in [
        ("/v1/pin", {"keys": keys, "tier": "gpu"}),
        ("/v1/move", {"keys": keys, "tier": "gpu"}),
        ("/v1/flush", {"tier": "gpu"}),
        ("/v1/resize", {"tier": "gpu", "capacity": "1MiB"}),
    ]:
        r = client.post(path, json=body)
        assert r.status_code == 400, path
        assert "unknown tier 'gpu'" in r.json()["detail"], path
    assert client.get("/v1/keys", params={"tier": "gpu"}).status_code == 400


def test_missing_field_keeps_fastapi_422(client: TestClient) -> None:
    r = client.post("/v1/move", json={"keys": []})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "tier"]


# --- bulk operations -------------------------------------------------------------------------


def test_pin_then_flush_skips_pinned(client: TestClient, runtime: AgentRuntime) -> None:
    keys = put_prompt(runtime, tokens(3))
    r = client.post("/v1/pin", json={"keys": [keys[0].hex(), "11" * 16]})
    assert r.status_code == 200
    assert r.json() == {"done": 1, "skipped_pinned": 0, "missing": 1, "failed": 0}

    flushed = client.post("/v1/flush", json={"tier": "cpu"}).json()
    assert (flushed["done"], flushed["skipped_pinned"]) == (2, 1)
    left = client.get("/v1/keys", params={"tier": "cpu"}).json()["items"]
    assert [(i["key"], i["pinned"]) for i in left] == [(keys[0].hex(), True)]
    assert len(runtime.store) == 1  # dropped, not demoted

    assert client.post("/v1/unpin", json={"keys": [keys[0].hex()]}).json()["done"] == 1
    assert client.post("/v1/flush", json={"tier": "cpu", "demote": True}).json()["done"] == 1
    assert runtime.store.entry(keys[0]).tier == "disk"


def test_flush_demote_of_the_bottom_tier_is_400_and_keeps_every_chunk(
    client: TestClient, runtime: AgentRuntime
) -> None:
    keys = put_prompt(runtime, tokens(2))
    assert client.post("/v1/move", json={"keys": hexes(keys), "tier": "disk"}).status_code == 200
    r = client.post("/v1/flush", json={"tier": "disk", "demote": True})
    assert r.status_code == 400 and "no tier is below it" in r.json()["detail"]
    assert [runtime.store.entry(k).tier for k in keys] == ["disk", "disk"]
    assert runtime.store.stats.tiers["disk"].evictions["flush"] == 0


def test_pin_beyond_tier_capacity_is_409(client: TestClient, runtime: AgentRuntime) -> None:
    keys = put_prompt(runtime, tokens(6))
    r = client.post("/v1/pin", json={"keys": hexes(keys), "tier": "cpu"})
    assert r.status_code == 409
    assert "exceeds its capacity" in r.json()["detail"]
    assert not any(runtime.store.entry(k).pinned for k in keys)


def test_evict(client: TestClient, runtime: AgentRuntime) -> None:
    keys = put_prompt(runtime, tokens(2))
    runtime.store.pin([keys[1]])
    r = client.post("/v1/evict", json={"keys": [*hexes(keys), "22" * 16]})
    assert r.json() == {"done": 1, "skipped_pinned": 1, "missing": 1, "failed": 0}
    assert keys[0] not in runtime.store
    assert keys[1] in runtime.store


def test_move_to_disk_and_prefetch_back(client: TestClient, runtime: AgentRuntime) -> None:
    keys = put_prompt(runtime, tokens(2))
    r = client.post("/v1/move", json={"keys": hexes(keys), "tier": "disk"})
    assert r.status_code == 200
    assert r.json()["done"] == 2
    assert [runtime.store.entry(k).tier for k in keys] == ["disk", "disk"]
    assert runtime.store.usage()["cpu"]["used_bytes"] == 0

    r = client.post("/v1/prefetch", json={"keys": hexes(keys)})  # default: the top tier
    assert r.json()["done"] == 2
    assert [runtime.store.entry(k).tier for k in keys] == ["cpu", "cpu"]
    # already there: nothing to do
    assert (
        client.post("/v1/prefetch", json={"keys": hexes(keys), "tier": "cpu"}).json()["done"] == 0
    )


def test_resize_live_with_size_text(client: TestClient, runtime: AgentRuntime) -> None:
    keys = put_prompt(runtime, tokens(4))
    assert runtime.store.usage()["cpu"]["chunks"] == 4

    r = client.post("/v1/resize", json={"tier": "cpu", "capacity": "8KiB"})
    assert r.status_code == 200
    body = r.json()
    assert body["done"] == 2  # two chunks had to leave
    assert body["usage"]["capacity_bytes"] == 8192
    assert body["usage"]["chunks"] == 2
    assert sorted(runtime.store.entry(k).tier for k in keys) == ["cpu", "cpu", "disk", "disk"]

    cpu_key = next(k for k in keys if runtime.store.entry(k).tier == "cpu")
    runtime.store.pin([cpu_key])
    small = client.post("/v1/resize", json={"tier": "cpu", "capacity": "2KiB"})
    assert small.status_code == 409  # smaller than what is pinned there
    assert "pinned" in small.json()["detail"]
    assert runtime.store.usage()["cpu"]["capacity_bytes"] == 8192

    bad = client.post("/v1/resize", json={"tier": "cpu", "capacity": "lots"})
    assert bad.status_code == 400
    assert "not a size" in bad.json()["detail"]

    grown = client.post("/v1/resize", json={"tier": "cpu", "capacity": 16 * CHUNK})
    assert grown.json()["usage"]["capacity_bytes"] == 16 * CHUNK


def test_resize_past_the_hosts_memory_is_409_and_keeps_the_size(
    client: TestClient, runtime: AgentRuntime, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvctl.store.tiers import memroom

    # the host says 100 MiB are available of 1 GiB (64 MiB of them the reserve): a resize to
    # 200 GiB must not reach the kernel, whose answer would be an out-of-memory kill
    fake = tmp_path / "meminfo"
    fake.write_text(f"MemTotal: {1 << 20} kB\nMemAvailable: {100 << 10} kB\n")
    monkeypatch.setattr(memroom, "MEMINFO", fake)
    monkeypatch.setattr(memroom, "CGROUP_ROOT", tmp_path / "no-cgroups")
    r = client.post("/v1/resize", json={"tier": "cpu", "capacity": "200GiB"})
    assert r.status_code == 409, r.text
    assert "36 MiB can be committed" in r.json()["detail"]
    assert runtime.store.usage()["cpu"]["capacity_bytes"] == 4 * CHUNK


# --- index paging ----------------------------------------------------------------------------


def test_keys_pages_in_key_order_without_duplicates(
    client: TestClient, runtime: AgentRuntime
) -> None:
    keys = put_prompt(runtime, tokens(7))  # across both tiers
    first = client.get("/v1/keys", params={"limit": 4}).json()
    assert len(first["items"]) == 4
    assert first["next"] == first["items"][-1]["key"]
    second = client.get("/v1/keys", params={"limit": 4, "after": first["next"]}).json()
    assert len(second["items"]) == 3
    assert second["next"] is None

    seen = [i["key"] for i in first["items"] + second["items"]]
    assert seen == sorted(hexes(keys))  # ordered, complete, no duplicates
    item = first["items"][0]
    entry = runtime.store.entry(bytes.fromhex(item["key"]))
    assert (item["tier"], item["size_bytes"], item["tokens"], item["tenant"]) == (
        entry.tier,
        CHUNK,
        CT,
        "a",
    )

    exact = client.get("/v1/keys", params={"limit": 7}).json()
    assert len(exact["items"]) == 7
    assert exact["next"] is None  # nothing after this page
    on_disk = client.get("/v1/keys", params={"tier": "disk"}).json()["items"]
    assert len(on_disk) == runtime.store.usage()["disk"]["chunks"] == 3


def test_keys_rejects_bad_limit_and_cursor(client: TestClient) -> None:
    assert client.get("/v1/keys", params={"limit": 0}).status_code == 422
    assert client.get("/v1/keys", params={"limit": 10_001}).status_code == 422
    r = client.get("/v1/keys", params={"after": "nope"})
    assert r.status_code == 400
    assert "32 hex characters" in r.json()["detail"]


def test_top_keys_by_hits_with_their_prefixes(client: TestClient, runtime: AgentRuntime) -> None:
    assert client.get("/v1/keys/top").json() == {"items": []}
    keys = put_prompt(runtime, tokens(3))  # root, middle, leaf: all in cpu
    for k in (keys[2], keys[2], keys[0]):
        runtime.store.touch(k, tenant="a")
    before = client.get("/v1/stats").json()["stats"]

    r = client.get("/v1/keys/top")
    assert r.status_code == 200
    items = r.json()["items"]
    assert [i["key"] for i in items] == hexes([keys[2], keys[0], keys[1]])
    leaf = items[0]
    entry = runtime.store.entry(keys[2])
    assert leaf == {
        "key": keys[2].hex(),
        "tier": "cpu",
        "size_bytes": CHUNK,
        "tokens": CT,
        "tenant": "a",
        "pinned": False,
        "priority": entry.priority,
        "hit_count": 2,
        "last_access_s": entry.last_access_s,
        "isolated": False,
        "prefix_chunks": 3,
        "prefix_tokens": 3 * CT,
        "prefix_complete": True,
    }
    assert [(i["prefix_chunks"], i["prefix_complete"]) for i in items[1:]] == [(1, True), (2, True)]
    assert client.get("/v1/stats").json()["stats"] == before  # reading it counts nothing

    assert [i["key"] for i in client.get("/v1/keys/top", params={"limit": 1}).json()["items"]] == [
        keys[2].hex()
    ]
    runtime.store.pin([keys[1]])
    pinned = client.get("/v1/keys/top", params={"pinned": "true"}).json()["items"]
    assert [(i["key"], i["pinned"]) for i in pinned] == [(keys[1].hex(), True)]

    assert client.post("/v1/evict", json={"keys": [keys[0].hex()]}).json()["done"] == 1
    items = client.get("/v1/keys/top").json()["items"]
    assert [(i["prefix_chunks"], i["prefix_tokens"], i["prefix_complete"]) for i in items] == [
        (2, 2 * CT, False),  # the leaf: its root is gone, so the prefix is only partly known
        (1, CT, False),
    ]


def test_top_keys_rejects_bad_limit_and_flag(client: TestClient) -> None:
    for limit in (0, api.MAX_TOP + 1, "many"):
        r = client.get("/v1/keys/top", params={"limit": limit})
        assert r.status_code == 422, limit
        assert r.json()["detail"][0]["loc"] == ["query", "limit"]
    assert client.get("/v1/keys/top", params={"limit": api.MAX_TOP}).status_code == 200
    assert client.get("/v1/keys/top", params={"pinned": "maybe"}).status_code == 422


def test_top_keys_route_is_not_shadowed_and_is_its_own_metric_label(
    client: TestClient, runtime: AgentRuntime
) -> None:
    paths = [getattr(r, "path", "") for r in client.app.routes]  # type: ignore[attr-defined]
    assert paths.index("/v1/keys/top") < paths.index("/v1/keys")
    assert client.get("/v1/keys/top").status_code == 200
    text = client.get("/metrics").text
    assert re.search(
        r'kvctl_http_requests_total\{[^}]*method="GET"[^}]*route="/v1/keys/top"[^}]*status="200"',
        text,
    )


# --- events ----------------------------------------------------------------------------------


def test_recent_events_after_a_put(client: TestClient, runtime: AgentRuntime) -> None:
    (key,) = put_prompt(runtime, tokens(1))
    r = client.get("/v1/events/recent", params={"after": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["dropped"] == 0
    stores = [e for e in body["events"] if e["type"] == "store"]
    assert [e["key"] for e in stores] == [key.hex()]
    assert stores[0]["tier"] == "cpu"
    assert body["last_seq"] == stores[-1]["seq"]

    again = client.get("/v1/events/recent", params={"after": body["last_seq"]}).json()
    assert again["events"] == []


class SseReader:
    """Reads an event stream on a helper thread so that every wait is bounded: a stream that
    goes quiet fails the test after ``timeout_s`` instead of hanging it."""

    def __init__(self, response: httpx.Response, timeout_s: float = 5.0) -> None:
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._timeout_s = timeout_s
        threading.Thread(target=self._pump, args=(response,), daemon=True).start()

    def _pump(self, response: httpx.Response) -> None:
        try:
            for line in response.iter_lines():
                self._lines.put(line)
        except Exception:  # closed under us when the test leaves the stream
            pass
        self._lines.put(None)

    def line(self) -> str:
        try:
            line = self._lines.get(timeout=self._timeout_s)
        except queue.Empty:
            raise AssertionError(f"no line from the event stream in {self._timeout_s} s") from None
        if line is None:
            raise AssertionError("the event stream ended")
        return line

    def until(self, want: str, max_lines: int = 200) -> list[dict]:
        """Parsed messages up to and including the first of event type ``want``."""
        messages: list[dict] = []
        current: dict = {}
        for _ in range(max_lines):
            line = self.line()
            if line == "":
                if current:
                    messages.append(current)
                    if current.get("event") == want:
                        return messages
                current = {}
            elif line.startswith(":"):
                current.setdefault("comments", []).append(line[1:].strip())
            else:
                field, _, value = line.partition(": ")
                current[field] = value
        raise AssertionError(f"no {want!r} message in {max_lines} lines: {messages}")


def test_event_stream_yields_store_events(client: TestClient, runtime: AgentRuntime) -> None:
    (key,) = put_prompt(runtime, tokens(1))
    with client.stream("GET", "/v1/events?after=0") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        msgs = SseReader(r).until("store")
    msg = msgs[-1]
    data = json.loads(msg["data"])
    assert data["key"] == key.hex()
    assert int(msg["id"]) == data["seq"]


def test_event_stream_from_now_and_resume(client: TestClient, runtime: AgentRuntime) -> None:
    (old,) = put_prompt(runtime, tokens(1))
    with client.stream("GET", "/v1/events") as r:  # no cursor: only what happens from now
        sse = SseReader(r)
        assert sse.line() == ": connected"
        (new,) = put_prompt(runtime, tokens(1, seed=1))
        msgs = sse.until("store")
    assert [json.loads(m["data"])["key"] for m in msgs if m.get("event")] == [new.hex()]

    first_seq = runtime.events.read(0).events[0]["seq"]
    with client.stream("GET", "/v1/events", headers={"Last-Event-ID": str(first_seq)}) as r:
        msgs = SseReader(r).until("store")
    assert json.loads(msgs[-1]["data"])["key"] == new.hex()  # resumed past the old event
    assert old.hex() not in str(msgs)


def test_event_stream_reports_dropped_events(client: TestClient, runtime: AgentRuntime) -> None:
    runtime.events = EventHub(capacity=2)  # a follower 5 behind a 2-event buffer misses 3
    for i in range(5):
        runtime.events.publish({"type": "evict", "key": f"{i:032x}"})
    with client.stream("GET", "/v1/events?after=0") as r:
        msgs = SseReader(r).until("evict")
    dropped = [m for m in msgs if m.get("event") == "dropped"]
    assert [json.loads(m["data"]) for m in dropped] == [{"dropped": 3}]
    assert json.loads(msgs[-1]["data"])["seq"] == 4


def test_event_stream_keep_alive(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api, "KEEPALIVE_SECONDS", 0.2)
    monkeypatch.setattr(api, "_EVENT_WAIT_SECONDS", 0.05)
    with client.stream("GET", "/v1/events") as r:
        sse = SseReader(r, timeout_s=3.0)  # a keep-alive is due after ~0.15 s of silence
        seen = [sse.line() for _ in range(4)]
    assert seen == [": connected", "", ": keep-alive", ""]


# --- auth, schema, metrics -------------------------------------------------------------------


@pytest.fixture
def authed(tmp_path: Path) -> Iterator[TestClient]:
    rt = _runtime(dataclasses.replace(_settings(tmp_path), token=TOKEN), tmp_path)
    with TestClient(create_app(rt)) as c:
        yield c
    rt.close()


def test_auth_requires_the_bearer_token(authed: TestClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = authed.get("/v1/health", headers=headers)
        assert r.status_code == 401, headers
        assert r.json() == {"detail": "missing or wrong bearer token"}
        assert r.headers["www-authenticate"] == "Bearer"
        assert TOKEN not in r.text

    ok = authed.get("/v1/health", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200
    info = authed.get("/v1/info", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert info["auth"] is True


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/no/such/path"),
        ("POST", "/v1/flush"),
        ("GET", "/v1/events"),
    ],
)
def test_auth_covers_every_path(authed: TestClient, method: str, path: str) -> None:
    r = authed.request(method, path, json={"tier": "cpu"} if method == "POST" else None)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"


def test_openapi_lists_every_v1_path(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    assert schema["info"] == {
        "title": "kvctl agent",
        "version": __version__,
        "description": schema["info"]["description"],
    }
    expected = {
        "/v1/health",
        "/v1/info",
        "/v1/stats",
        "/v1/lookup",
        "/v1/pin",
        "/v1/unpin",
        "/v1/evict",
        "/v1/flush",
        "/v1/prefetch",
        "/v1/move",
        "/v1/resize",
        "/v1/keys",
        "/v1/keys/top",
        "/v1/events",
        "/v1/events/recent",
    }
    assert expected <= set(schema["paths"])
    routes = {getattr(r, "path", "") for r in client.app.routes}  # type: ignore[attr-defined]
    assert {p for p in routes if p.startswith("/v1/")} <= set(schema["paths"])
    lookup = schema["components"]["schemas"]["LookupRequest"]["properties"]
    assert "description" in lookup["tokens"]


def test_metrics_render_and_count_route_templates(
    client: TestClient, runtime: AgentRuntime
) -> None:
    client.post("/v1/lookup", json={"keys": []})
    client.get("/no/such/path")
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert re.search(
        r'kvctl_http_requests_total\{[^}]*method="POST"[^}]*route="/v1/lookup"[^}]*status="200"',
        text,
    )
    assert re.search(r'kvctl_http_requests_total\{[^}]*route="other"[^}]*status="404"', text)
    assert "/no/such/path" not in text


def test_control_listener_is_tcp_so_accepted_sockets_get_nodelay() -> None:
    import socket

    from kvctl.agent.daemon import _bind_tcp

    # asyncio sets TCP_NODELAY on accepted sockets only when proto says TCP; without it every
    # keep-alive request after the first waits on a delayed ACK (~40 ms)
    sock = _bind_tcp("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
