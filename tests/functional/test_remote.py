"""The remote tiers between real agents on loopback: the embedded pool (`--role pool`), peer pull,
fetch-or-recompute on configured link figures, a pool dying mid-run, tenant isolation."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.agent.settings import DEFAULT_MODELS
from kvctl.cli.main import app
from kvctl.store.keys import Namespace, keys_for, parents_of
from tests.functional.agents import Agent, payload, running_agent
from tests.functional.waiting import wait_until as wait_for

CHUNK_BYTES = 1 << 20
NS = Namespace(DEFAULT_MODELS[0].id, DEFAULT_MODELS[0].layout)
SMALL = ["--disk", "0", "--cpu", "256MiB"]
#: pullers model prefill on an L4 (~70 ms per 256 tokens of llama 8B), so on measured loopback
#: links, even on a loaded CI machine, fetching 1 MiB chunks is clearly the better choice
SLOW_GPU = ["--gpu", "l4"]


def chain(n: int, seed: int = 0) -> list[bytes]:
    return keys_for([seed * 1_000_003 + i for i in range(256 * n)], NS, 256)


def put_chain(agent: Agent, keys: list[bytes], tenant: str) -> None:
    with agent.data() as d:
        outs = d.put_many(
            [(k, payload(k, CHUNK_BYTES)) for k in keys],
            tenant=tenant,
            parents=parents_of(keys),
            tokens=256,
        )
    assert {o.status for o in outs} == {"stored"}


def remote(agent: Agent) -> dict[str, Any]:
    return agent.control()._request("GET", "/v1/remote")


def pool_holds(pool: Agent, n: int) -> Callable[[], bool]:
    return lambda: pool.control().stats()["usage"]["cpu"]["chunks"] >= n


def link_costed(agent: Agent, name: str) -> Callable[[], bool]:
    def check() -> bool:
        r = remote(agent)
        sources = [r["pool"], *r["peers"]] if r["pool"] else r["peers"]
        return any(s["name"] == name and s["link"]["costed"] for s in sources)

    return check


@pytest.fixture
def pool_agent(tmp_path: Path):  # type: ignore[no-untyped-def]
    with running_agent(tmp_path / "pool", "--role", "pool", "--name", "pool", *SMALL) as pool:
        yield pool


def test_a_chunk_stored_on_one_node_hits_on_another_through_the_pool(
    tmp_path: Path, pool_agent: Agent
) -> None:
    url = f"kvctl://{pool_agent.state.data_tcp}"
    keys = chain(6)
    with (
        running_agent(tmp_path / "a", "--name", "a", "--pool", url, *SMALL) as a,
        running_agent(tmp_path / "b", "--name", "b", "--pool", url, *SLOW_GPU, *SMALL) as b,
    ):
        put_chain(a, keys, tenant="t1")
        wait_for("the write-through to reach the pool", pool_holds(pool_agent, len(keys)))
        wait_for("b to measure its link to the pool", link_costed(b, "pool"))
        with b.data("unix") as d:  # a same-host engine: reads through shared-memory leases
            assert d.shm
            res = d.lookup(keys, tenant="t2")
            assert res.matched_chunks == len(keys)
            assert set(res.locations) == {"remote"}
            got = d.get_many(keys, tenant="t2")
            assert [bytes(g) for g in got] == [payload(k, CHUNK_BYTES) for k in keys]  # type: ignore[arg-type]
            assert set(d.exists(keys, tenant="t2")) == {"cpu"}  # pulled in, now local
        stats = b.control().stats()
        tier = stats["stats"]["tiers"]["remote"]
        assert tier["hits"] == len(keys)
        assert tier["sharing_hits"] == len(keys)  # stored by t1, hit by t2
        assert tier["bytes_read"] == len(keys) * CHUNK_BYTES
        assert stats["stats"]["tiers"]["cpu"]["promotions"] == len(keys)
        r = stats["remote"]
        assert r["plans"]["fetch_chunks"] == len(keys)
        assert r["pool"]["chunks_in"] == len(keys)
        a_write = remote(a)["write"]
        assert a_write["written"] == len(keys) and a_write["failed"] == 0
        # the operator's view of it
        out = CliRunner().invoke(app, ["agent", "remote", "--url", b.state.control_url, "--json"])
        assert out.exit_code == 0, out.output
        assert json.loads(out.output)["plans"]["fetch_chunks"] == len(keys)
        out = CliRunner().invoke(
            app, ["agent", "remote", "--url", b.state.control_url], env={"COLUMNS": "160"}
        )
        assert out.exit_code == 0, out.output
        assert "pool" in out.output and "measured" in out.output and "up" in out.output
        # the decision and its inputs are in the event stream
        events = b.control().events(after=0)["events"]
        plans = [e for e in events if e["type"] == "fetch_plan"]
        assert plans and plans[0]["fetch"] == len(keys)
        assert plans[0]["links"]["pool"]["source"] == "measured"
        assert plans[0]["prefill"]["basis"].startswith("modeled: llama-3.1-8b on l4")


def test_peer_pull_across_dcs_with_emulated_distance(tmp_path: Path) -> None:
    keys = chain(8, seed=1)
    with running_agent(tmp_path / "a", "--name", "a", "--dc", "fra", *SMALL) as a:
        put_chain(a, keys, tenant="t1")
        with running_agent(
            tmp_path / "b",
            "--name",
            "b",
            "--dc",
            "ams",
            "--peer",
            f"fra-a={a.state.data_tcp}",
            "--link",
            "fra-a:delay_ms=5",
            *SLOW_GPU,
            *SMALL,
        ) as b:
            wait_for("b to measure its link to fra-a", link_costed(b, "fra-a"))
            link = remote(b)["peers"][0]["link"]
            assert link["rtt_basis"] == "emulated" and link["rtt_s"] >= 0.005
            with b.data() as d:
                res = d.lookup(keys, tenant="t1")
                # 1 MiB over loopback + 5 ms costs less than prefilling 256 tokens (modeled)
                assert res.matched_chunks == len(keys)
                assert set(res.locations) == {"peer"}
                got = d.get_many(keys, tenant="t1")
            assert [bytes(g) for g in got] == [payload(k, CHUNK_BYTES) for k in keys]  # type: ignore[arg-type]
            tier = b.control().stats()["stats"]["tiers"]["peer"]
            assert tier["hits"] == len(keys) and tier["reuse_hits"] == len(keys)
            peer = remote(b)["peers"][0]
            assert peer["chunks_in"] == len(keys) and peer["errors"] == 0


def test_peer_stream_delivers_the_first_chunks_before_the_last(tmp_path: Path) -> None:
    keys = chain(16, seed=2)
    with running_agent(tmp_path / "a", "--name", "a", *SMALL) as a:
        put_chain(a, keys, tenant="t1")
        arrivals: list[tuple[int, bytes]] = []
        with a.data() as d:
            got = d.fetch(
                keys, tenant="t1", arrived=lambda i, meta, data: arrivals.append((i, bytes(data)))
            )
        assert [i for i, _ in arrivals] == list(range(len(keys)))  # in order, one at a time
        assert all(data == payload(keys[i], CHUNK_BYTES) for i, data in arrivals)
        for k, parent, g in zip(keys, parents_of(keys), got, strict=True):
            assert g is not None
            meta, data = g
            assert data is not None and bytes(data) == payload(k, CHUNK_BYTES)
            assert meta.key == k and meta.parent == parent and meta.tenant == "t1"
            assert meta.tokens == 256 and not meta.isolated
        # metadata only: moves no bytes and counts no hit
        hits_before = a.control().stats()["stats"]["hit_chunks"]
        with a.data() as d:
            metas = d.fetch([*keys[:2], bytes(16)], tenant="t1", payload=False)
        assert metas[2] is None and all(m is not None and m[1] is None for m in metas[:2])
        assert a.control().stats()["stats"]["hit_chunks"] == hits_before


@pytest.mark.parametrize(
    ("link", "reason", "matched"),
    [
        # 50 ms + 1 MiB at 1 MB/s = 1.1 s per chunk; prefilling 256 tokens takes ~8 ms (modeled)
        ("pool:rtt_ms=50,bandwidth=1MB", "slower-than-recompute", 0),
        ("pool:override=recompute", "override", 0),
        # 1 ms + 1 MiB at 10 GB/s = 1.1 ms per chunk: fetch
        ("pool:rtt_ms=1,bandwidth=10GB", "fetch", 4),
    ],
)
def test_fetch_or_recompute_follows_the_link_figures(
    tmp_path: Path, pool_agent: Agent, link: str, reason: str, matched: int
) -> None:
    keys = chain(4, seed=3)
    put_chain(pool_agent, keys, tenant="t1")
    url = f"kvctl://{pool_agent.state.data_tcp}"
    with running_agent(tmp_path / "b", "--name", "b", "--pool", url, "--link", link, *SMALL) as b:
        with b.data() as d:
            res = d.lookup(keys, tenant="t1")
        assert res.matched_chunks == matched
        assert set(res.locations) == {"remote"}  # found either way: the plan decides use
        r = remote(b)
        assert r["plans"]["reasons"] == {reason: 1}
        plan = r["last_plan"]
        assert plan["reason"] == reason and plan["fetch"] == matched
        assert plan["recompute"] == len(keys) - matched
        if reason != "override":
            assert plan["links"]["pool"]["source"] == "configured"
            assert plan["recompute_s"] >= 0 and "prefill" in plan


def test_a_pool_killed_mid_run_turns_remote_hits_into_misses(
    tmp_path: Path, pool_agent: Agent
) -> None:
    keys, more = chain(4, seed=4), chain(4, seed=5)
    put_chain(pool_agent, keys, tenant="t1")
    url = f"kvctl://{pool_agent.state.data_tcp}"
    with running_agent(
        tmp_path / "b", "--name", "b", "--pool", url, "--link", "pool:override=fetch", *SMALL
    ) as b:
        with b.data() as d:
            assert d.lookup(keys, tenant="t1").matched_chunks == len(keys)
            pool_agent.kill9()
            # every request still answers: misses, never errors or wrong bytes
            for _ in range(3):
                assert d.lookup(keys, tenant="t1").matched_chunks == 0
                assert d.get_many(keys, tenant="t1") == [None] * len(keys)
            put_chain(b, more, tenant="t1")  # local work goes on; the writer's failure is counted
            got = d.get_many(more, tenant="t1")
            assert [bytes(g) for g in got] == [payload(k, CHUNK_BYTES) for k in more]  # type: ignore[arg-type]
        wait_for("the writer to give up on the dead pool", lambda: remote(b)["write"]["failed"] > 0)
        r = remote(b)
        assert r["pool"]["errors"] >= 1 and r["pool"]["last_error"]
        assert b.control().health()["status"] == "ok"


def _isolated_config(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text('[agent]\nisolated_tenants = ["acme"]\n')
    return path


def test_an_isolated_tenants_chunks_never_reach_another_tenant_through_the_pool(
    tmp_path: Path, pool_agent: Agent
) -> None:
    url = f"kvctl://{pool_agent.state.data_tcp}"
    keys = chain(3, seed=6)
    with (
        running_agent(
            tmp_path / "a",
            "--config",
            str(_isolated_config(tmp_path, "a")),
            "--name",
            "a",
            "--pool",
            url,
            *SMALL,
        ) as a,
        running_agent(
            tmp_path / "b", "--name", "b", "--pool", url, "--link", "pool:override=fetch", *SMALL
        ) as b,
    ):
        put_chain(a, keys, tenant="acme")
        wait_for("the pool to hold acme's chunks", pool_holds(pool_agent, len(keys)))
        with b.data() as d:
            # the same keys, asked by another tenant: not there, in any way it can observe
            assert d.lookup(keys, tenant="globex").matched_chunks == 0
            assert d.exists(keys, tenant="globex") == [None] * len(keys)
            assert d.get_many(keys, tenant="globex") == [None] * len(keys)
            # its owner, on another node, still hits it there
            assert d.lookup(keys, tenant="acme").matched_chunks == len(keys)
            got = d.get_many(keys, tenant="acme")
            assert [bytes(g) for g in got] == [payload(k, CHUNK_BYTES) for k in keys]  # type: ignore[arg-type]
            # kept isolated on b too
            assert d.get_many(keys, tenant="globex") == [None] * len(keys)


def test_agent_remote_without_remote_tiers_and_when_down(tmp_path: Path) -> None:
    with running_agent(tmp_path / "a", "--name", "a", *SMALL) as a:
        out = CliRunner().invoke(app, ["agent", "remote", "--url", a.state.control_url])
        assert out.exit_code == 0 and "no pool and no peers" in out.output
    out = CliRunner().invoke(app, ["agent", "remote", "--url", "http://127.0.0.1:1"])
    assert out.exit_code == 1 and "Traceback" not in out.output


# --- a Redis pool ---------------------------------------------------------------------------


def redis_args(url: str, prefix: str) -> list[str]:
    return ["--pool", url, "--pool-prefix", prefix, "--pool-capacity", "64MiB"]


def test_cross_node_hit_through_a_redis_pool(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    keys = chain(5, seed=7)
    pool = redis_args(redis_url, redis_prefix)
    with (
        running_agent(tmp_path / "a", "--name", "a", *pool, *SMALL) as a,
        running_agent(tmp_path / "b", "--name", "b", *pool, *SLOW_GPU, *SMALL) as b,
    ):
        put_chain(a, keys, tenant="t1")
        wait_for("a's writes to reach Redis", lambda: remote(a)["write"]["written"] == len(keys))
        wait_for("b to measure its link to Redis", link_costed(b, "pool"))
        with b.data() as d:
            res = d.lookup(keys, tenant="t1")
            assert res.matched_chunks == len(keys) and set(res.locations) == {"remote"}
            got = d.get_many(keys, tenant="t1")
        assert [bytes(g) for g in got] == [payload(k, CHUNK_BYTES) for k in keys]  # type: ignore[arg-type]
        stats = b.control().stats()
        assert stats["stats"]["tiers"]["remote"]["reuse_hits"] == len(keys)
        assert "remote" not in stats["usage"]  # the pool is not this node's to sum
        wait_for(
            "b's view of the pool's usage",
            lambda: (remote(b)["pool_usage"] or {}).get("chunks") == len(keys),
        )
        assert remote(b)["pool_usage"]["capacity_bytes"] == 64 << 20


def test_redis_killed_mid_run_degrades_to_misses_and_recovers(
    tmp_path: Path, private_redis: Any
) -> None:
    keys, more = chain(4, seed=8), chain(3, seed=9)
    pool = redis_args(private_redis.url, "kvctl")
    with (
        running_agent(tmp_path / "a", "--name", "a", *pool, *SMALL) as a,
        running_agent(
            tmp_path / "b", "--name", "b", *pool, "--link", "pool:override=fetch", *SMALL
        ) as b,
    ):
        put_chain(a, keys, tenant="t1")
        wait_for("a's writes to reach Redis", lambda: remote(a)["write"]["written"] == len(keys))
        with b.data() as d:
            assert d.lookup(keys[:1], tenant="t1").matched_chunks == 1
            assert bytes(d.get(keys[0], tenant="t1")) == payload(keys[0], CHUNK_BYTES)
            private_redis.kill()
            t0 = time.monotonic()
            for _ in range(3):  # every request still answers: the local chunk, then misses
                res = d.lookup(keys, tenant="t1")
                assert res.matched_chunks == 1 and res.locations == ("cpu", None, None, None)
                assert d.get_many(keys[1:], tenant="t1") == [None] * (len(keys) - 1)
            assert time.monotonic() - t0 < 30  # bounded by timeouts and backoff, never hung
            # the chunk it pulled before the kill is local now, and intact
            assert bytes(d.get(keys[0], tenant="t1")) == payload(keys[0], CHUNK_BYTES)
        put_chain(a, more, tenant="t1")  # local work goes on while the pool is away
        wait_for("a to count failed pool writes", lambda: remote(a)["write"]["failed"] > 0)
        assert remote(b)["pool"]["errors"] >= 1
        private_redis.start()  # back, empty (no persistence)
        written = remote(a)["write"]["written"]
        # after its backoff the writer reaches the pool again with what is stored next
        deadline, seed = time.monotonic() + 40, 100
        while remote(a)["write"]["written"] == written:
            assert time.monotonic() < deadline, "the pool writer never recovered"
            put_chain(a, chain(1, seed=seed), tenant="t1")
            seed += 1
            time.sleep(0.5)
        assert a.control().health()["status"] == "ok" and b.control().health()["status"] == "ok"
