"""`kvctl replay` against real agents: the replay's own bookkeeping equals what the agents count
and what the collector writes to the database (SQLite and PostgreSQL), and with one unlimited
node it equals the workload's prefix hits computed offline."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db.analytics.summary import node_cache_counters
from kvctl.db.inventory import add_dc, add_link, add_node
from kvctl.errors import InvalidArgument
from kvctl.index.follower import Followers
from kvctl.index.model import EmbeddedIndex
from kvctl.ports import free_loopback_ports
from kvctl.profiles import ModeledInputs, gpu_profile, model_profile
from kvctl.remote.fetchplan import PrefillModel
from kvctl.router.app import RouterServer
from kvctl.router.client import RouterClient
from kvctl.router.score import Costs
from kvctl.router.service import Router
from kvctl.router.topology import DcLink, Node, Topology
from kvctl.workload.generators import generate
from kvctl.workload.replay import NodeTally, ReplayNode, ReplayReport, RequestTally, replay
from kvctl.workload.tokens import KeyChainer
from kvctl.workload.trace import (
    TraceRequest,
    assign_tenants,
    prefix_hit_blocks,
    read_mooncake_trace,
)
from tests.functional.agents import Agent, closed_port, running_agent

runner = CliRunner()
INPUTS = ModeledInputs(model_profile("qwen2.5-0.5b"), gpu_profile("h100"))
SCALE = 1 / 256  # 48 bytes per token: 12 KiB chunks of 256 tokens


def _config(path: Path, chunk_tokens: int) -> str:
    path.write_text(f"[agent]\nchunk_tokens = {chunk_tokens}\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def two_dcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent, Agent]]:
    """Three small agents (evictions happen): two in fra, one in ams."""
    root = tmp_path_factory.mktemp("replay")
    small = ("--cpu", "1MiB", "--disk", "3MiB")
    with (
        running_agent(root / "a", "--name", "fra-a", "--dc", "fra", *small) as a,
        running_agent(root / "b", "--name", "fra-b", "--dc", "fra", *small) as b,
        running_agent(root / "c", "--name", "ams-a", "--dc", "ams", *small) as c,
    ):
        yield a, b, c


def _nodes(agents: tuple[Agent, ...]) -> list[ReplayNode]:
    return [ReplayNode(a.state.name, a.state.dc, a.state.control_url) for a in agents]


def _check_agents(report: ReplayReport) -> None:
    assert report.agent_counters
    for node, fields in report.agent_counters.items():
        for name, (ours, theirs) in fields.items():
            assert ours == theirs, f"{node}.{name}: replay {ours}, agent {theirs}"
    assert report.agents_agree is True


def _offline_full_block_hits(requests: list[TraceRequest]) -> int:
    """Prefix hits from the workload's own 512-token block ids, full blocks only (a partial
    tail is never a key): what one unlimited node must hit."""
    return sum(
        min(h, r.input_tokens // 512)
        for r, h in zip(requests, prefix_hit_blocks(requests), strict=True)
    )


def test_one_unlimited_node_hits_exactly_the_offline_prefix_hits(tmp_path: Path) -> None:
    requests = generate("builtin", 5, requests=150)
    config = _config(tmp_path / "agent.toml", 512)
    with running_agent(
        tmp_path / "a", "--name", "a", "--config", config, "--cpu", "512MiB", "--disk", "0"
    ) as a:
        report = replay(requests, _nodes((a,)), INPUTS, kv_scale=SCALE)
    _check_agents(report)
    expected = _offline_full_block_hits(requests)
    assert report.requests.hit_chunks == report.nodes["a"].hit_chunks == expected > 0
    assert report.requests.chunks == sum(r.input_tokens // 512 for r in requests)
    t = report.nodes["a"]
    assert t.puts == {"stored": report.requests.computed_chunks}
    assert t.bytes_fetched == expected * report.chunk_bytes
    assert report.chunk_bytes == 512 * round(INPUTS.model.kv_bytes_per_token * SCALE)
    assert t.reuse_hits + t.sharing_hits == expected
    assert t.reuse_hits > 0 and t.sharing_hits > 0
    assert t.lost_chunks == 0


def test_shared_trace_on_one_unlimited_node(tmp_path: Path, shared_trace: Path) -> None:
    requests = assign_tenants(read_mooncake_trace(shared_trace, limit=120), 8)
    config = _config(tmp_path / "agent.toml", 512)
    with running_agent(
        tmp_path / "a", "--name", "a", "--config", config, "--cpu", "1GiB", "--disk", "0"
    ) as a:
        report = replay(requests, _nodes((a,)), INPUTS, kv_scale=SCALE)
    _check_agents(report)
    expected = _offline_full_block_hits(requests)
    assert report.requests.hit_chunks == expected > 0


def test_evicting_fleet_with_peers_agrees_with_agents_and_database(
    two_dcs: tuple[Agent, Agent, Agent], db: Engine
) -> None:
    from collectors.collector import Collector, CollectorConfig

    with db.begin() as conn:
        add_dc(conn, "fra")
        add_dc(conn, "ams")
        add_link(conn, "fra", "ams", distance_km=100)
        for a in two_dcs:
            add_node(conn, a.state.name, dc=a.state.dc, agent_url=a.state.control_url)
    collector = Collector(db, CollectorConfig())
    try:
        collector.collect_once()  # the baseline: a node's first sample counts nothing
        requests = generate("rag", 2, requests=200)
        report = replay(
            requests, _nodes(two_dcs), INPUTS, kv_scale=SCALE, links_km={("fra", "ams"): 100}
        )
        collector.collect_once()
    finally:
        collector.close()
    _check_agents(report)
    rq = report.requests
    assert rq.cross_dc_hits > 0 and rq.bytes_by_link["ams<->fra"] == rq.cross_dc_hits * (
        report.chunk_bytes
    )
    # the emulated delay: one 1 ms round trip (100 km) per cross-DC fetch at least
    assert rq.emulated_delay_seconds >= 0.001
    evicted = sum(t.puts.get("stored", 0) for t in report.nodes.values()) * report.chunk_bytes
    assert evicted > 3 * 4 * 2**20  # more was stored than the three nodes hold
    with db.connect() as conn:
        sums = node_cache_counters(conn, 0, 2**62)
    for name, t in report.nodes.items():
        whole = sums[name]["all"]
        assert whole["lookups"] == t.lookup_chunks
        assert whole["hits"] == t.hit_chunks
        assert whole["hit_tokens"] == t.hit_tokens
        assert whole["reuse_hits"] == t.reuse_hits
        assert whole["sharing_hits"] == t.sharing_hits
        for tier, hits in t.hits_by_tier.items():
            assert sums[name][tier]["hits"] == hits
    # request view = what the nodes served: home hits + peer fetches (uncounted by the peer)
    assert rq.hit_chunks == sum(
        t.hit_chunks - t.lost_chunks + t.served_to_peers for t in report.nodes.values()
    )
    # one counted lookup per request (a request shorter than a chunk asks none)
    assert sum(t.lookups for t in report.nodes.values()) == sum(
        1 for r in requests if r.input_tokens >= report.chunk_tokens
    )


def test_round_robin_spreads_requests(two_dcs: tuple[Agent, Agent, Agent]) -> None:
    requests = [
        r.__class__(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "tenant": "t"})
        for r in generate("chat", 1, requests=40)
    ]
    fra = two_dcs[:2]
    report = replay(requests, _nodes(fra), INPUTS, kv_scale=SCALE, routing="round-robin",
                    peer_fetch=False)  # fmt: skip
    assert [report.nodes[a.state.name].lookups for a in fra] == [20, 20]
    _check_agents(report)


def test_prefix_routing_beats_round_robin(tmp_path: Path) -> None:
    requests = generate("chat", 4, requests=120)
    ratios = {}
    for routing in ("round-robin", "prefix"):
        with (
            running_agent(tmp_path / routing / "a", "--name", "a", "--cpu", "64MiB") as a,
            running_agent(tmp_path / routing / "b", "--name", "b", "--cpu", "64MiB") as b,
        ):
            report = replay(requests, _nodes((a, b)), INPUTS, kv_scale=SCALE, routing=routing,
                            peer_fetch=False)  # fmt: skip
        _check_agents(report)
        ratios[routing] = report.requests.hit_chunks / report.requests.chunks
    assert ratios["prefix"] > ratios["round-robin"]


def test_a_corrupt_chunk_is_caught(two_dcs: tuple[Agent, Agent, Agent]) -> None:
    from kvctl.store.keys import Namespace
    from kvctl.workload.replay import ReplayError

    a = two_dcs[0]
    requests = generate("system-prompt", 7, requests=3)
    model = INPUTS.model
    chainer = KeyChainer(lambda _: Namespace(model.name, model.layout), 256, salt=99)
    key = chainer.keys(requests[0])[0]
    with a.data() as dc:
        # the right size, the wrong bytes: what a buggy tier or a mixed-up key would serve
        dc.put(key, b"x" * (256 * 48), tenant=requests[0].tenant)
    with pytest.raises(ReplayError, match="wrong bytes"):
        replay(requests[:1], _nodes((a,)), INPUTS, kv_scale=SCALE, salt=99)


def test_an_agent_killed_mid_replay_is_named(tmp_path: Path) -> None:
    """Before: "lost the connection to the agent: [Errno 32] Broken pipe", naming no node."""
    from kvctl.workload.replay import ReplayError

    requests = [
        r.__class__(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "tenant": "t"})
        for r in generate("chat", 2, requests=20)
    ]
    with (
        running_agent(tmp_path / "a", "--name", "stays", "--cpu", "8MiB") as a,
        running_agent(tmp_path / "b", "--name", "killed", "--cpu", "8MiB") as b,
    ):

        def progress(done: int, _total: int) -> None:
            if done == 4:  # round-robin, a then b: request 6 is the killed node's
                b.kill9()

        with pytest.raises(ReplayError) as caught:
            replay(requests, _nodes((a, b)), INPUTS, kv_scale=SCALE, routing="round-robin",
                   peer_fetch=False, progress=progress)  # fmt: skip
    said = str(caught.value)
    assert said.startswith("node killed failed at request 6 of 20 (5 served before it): "), said


def test_a_trace_whose_next_request_is_years_away_waits_and_stops_with_its_summary(
    tmp_path: Path,
) -> None:
    """--speed honours the timestamps; a gap past threading.TIMEOUT_MAX (~292 years: epoch
    nanoseconds after a first request at 0) raised OverflowError from the wait, and the replay
    of everything before it was lost. Now it waits, and Ctrl-C (``stop``) ends it with the
    summary of what ran."""
    import dataclasses
    import threading

    first, second = generate("chat", 3, requests=2)
    requests = [
        dataclasses.replace(first, timestamp_ms=0),
        dataclasses.replace(second, timestamp_ms=10**19),
    ]
    stop = threading.Event()

    def progress(done: int, _total: int) -> None:
        if done == 1:  # the operator's Ctrl-C, while the replay waits for the second request
            threading.Timer(0.5, stop.set).start()

    with running_agent(tmp_path / "a", "--name", "a", "--cpu", "8MiB") as a:
        report = replay(
            requests, _nodes((a,)), INPUTS, kv_scale=SCALE, speed=1.0, stop=stop,
            progress=progress,
        )  # fmt: skip
    assert report.stopped_early and report.requests.requests == 1
    _check_agents(report)


def test_an_agent_gone_after_the_last_request_leaves_the_summary_and_its_check_unread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The agents' counters are read again after the last request; an agent gone by then
    (restarted, its host down) failed the whole replay with that read's error, every request's
    figures lost. Now its check is said unread and the rest stands."""
    requests = [
        r.__class__(**{**{f: getattr(r, f) for f in r.__dataclass_fields__}, "tenant": "t"})
        for r in generate("chat", 2, requests=12)
    ]
    with (
        running_agent(tmp_path / "a", "--name", "stays", "--cpu", "8MiB") as a,
        running_agent(tmp_path / "b", "--name", "gone", "--cpu", "8MiB") as b,
    ):

        def progress(done: int, total: int) -> None:
            if done == total:
                b.kill9()

        report = replay(requests, _nodes((a, b)), INPUTS, kv_scale=SCALE, routing="round-robin",
                        peer_fetch=False, progress=progress)  # fmt: skip
    assert report.requests.requests == 12 and not report.stopped_early
    assert report.nodes["gone"].lookups == 6  # its tally stands: the replay's own
    assert report.agent_counters is not None and report.agent_counters["gone"] == {}
    assert "gone" in report.agents_unread and "stays" not in report.agents_unread
    checked = report.agent_counters["stays"]
    assert checked and all(ours == theirs for ours, theirs in checked.values())
    assert report.agents_agree is None  # not all checked: neither agreed nor not
    out = report.as_dict()
    assert set(out["agents_unread"]) == {"gone"} and out["agents_agree"] is None
    from kvctl.cli.replay import render_replay

    capsys.readouterr()
    render_replay(report)
    said = " ".join(capsys.readouterr().err.split())
    assert "gone's counters could not be read after the run (cannot reach the agent" in said


@pytest.mark.parametrize("garbage", ["tiers-not-a-mapping", "count-past-a-float"])
def test_an_agent_answering_garbage_after_the_last_request_leaves_its_check_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, garbage: str
) -> None:
    """Its stats after the run as another version (or a broken proxy) might send them: tiers
    that are no mapping (AttributeError) or a count of 1e400 (inf: OverflowError in int())
    escaped 405916f's catch, and the replay's figures were lost with a bug's line."""
    import threading

    from kvctl.client import AgentClient
    from kvctl.workload.replay import CHECKED_COUNTERS

    requests = generate("chat", 2, requests=6)
    done_all = threading.Event()
    real_stats = AgentClient.stats
    with (
        running_agent(tmp_path / "a", "--name", "sound", "--cpu", "8MiB") as a,
        running_agent(tmp_path / "b", "--name", "odd", "--cpu", "8MiB") as b,
    ):

        def stats(client: AgentClient) -> Any:
            answer = real_stats(client)
            if done_all.is_set() and client.url == b.state.control_url.rstrip("/"):
                if garbage == "tiers-not-a-mapping":
                    answer["stats"]["tiers"] = ["cpu"]
                else:
                    answer["stats"][CHECKED_COUNTERS[0]] = float("inf")
            return answer

        monkeypatch.setattr(AgentClient, "stats", stats)

        def progress(done: int, total: int) -> None:
            if done == total:
                done_all.set()

        report = replay(requests, _nodes((a, b)), INPUTS, kv_scale=SCALE, routing="round-robin",
                        peer_fetch=False, progress=progress)  # fmt: skip
    assert report.requests.requests == 6
    assert set(report.agents_unread) == {"odd"} and report.agents_agree is None


# --- the command --------------------------------------------------------------------------
@pytest.fixture
def inventory(db: Engine, empty_db_url: str, two_dcs: tuple[Agent, Agent, Agent]) -> str:
    with db.begin() as conn:
        add_dc(conn, "fra")
        add_dc(conn, "ams")
        add_link(conn, "fra", "ams", distance_km=50)
        for a in two_dcs:
            add_node(conn, a.state.name, dc=a.state.dc, agent_url=a.state.control_url)
    return empty_db_url


def test_replay_command_json(inventory: str) -> None:
    result = runner.invoke(
        app,
        ["replay", "--db", inventory, "--workload", "chat", "--limit", "60",
         "--model", "qwen2.5-0.5b", "--kv-scale", "1/256", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["requests"]["requests"] == 60
    assert out["agents_agree"] is True
    assert set(out["nodes"]) == {"fra-a", "fra-b", "ams-a"}
    assert out["links_emulated"]["ams<->fra"]["distance_km"] == 50
    assert out["links_emulated"]["ams<->fra"]["basis"] == "emulated"
    assert out["modeled"]["basis"] == "modeled"
    assert out["modeled"]["inputs"]["model"]["name"] == "qwen2.5-0.5b"
    assert out["kv_scale"] == pytest.approx(1 / 256)


def test_replay_command_table(inventory: str) -> None:
    result = runner.invoke(
        app,
        ["replay", "--db", inventory, "--dc", "fra", "--workload", "system-prompt",
         "--limit", "30", "--kv-scale", "0.001", "--route", "round-robin"],
        env={"COLUMNS": "120"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    for text in ("hit ratio", "reuse / sharing", "fra-a (fra)", "modeled", "not measured", "✓"):
        assert text in result.output
    assert "ams-a" not in result.output
    # a node's requests apart from its chunks (before: one "lookups" column counting requests,
    # where every other lookups column counts chunks)
    header = " ".join(next(ln for ln in result.output.splitlines() if "node (dc)" in ln).split())
    assert header.startswith("node (dc) requests chunks hit ratio"), header
    # energy in the units and on the basis the demo's other energy lines use
    assert "(IT: GPU board power)" in result.output and " kJ" not in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-scale", "0"], "--kv-scale"),
        (["--kv-scale", "abc"], "not a fraction"),
        (["--route", "random"], "unknown routing"),
        (["--workload", "nope"], "nope"),
        (["--model", "gpt-9"], "unknown model"),
        (["--trace", "/nonexistent/trace.jsonl"], "no such"),
        (["--node", "nobody"], "no node named"),
        (["--router", "http://127.0.0.1:9", "--route", "round-robin"], "exclude each other"),
        (["--router", "http://127.0.0.1:9", "--router-policy", "best"], "unknown --router-policy"),
        (["--router-policy", "round-robin"], "goes with --router"),
    ],
)
def test_replay_command_bad_input(inventory: str, args: list[str], message: str) -> None:
    result = runner.invoke(app, ["replay", "--db", inventory, "--limit", "5", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_replay_command_unreachable_node(db: Engine, empty_db_url: str) -> None:
    with db.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "gone", dc="fra", agent_url=f"http://127.0.0.1:{closed_port()}")
    result = runner.invoke(app, ["replay", "--db", empty_db_url, "--limit", "5"])
    assert result.exit_code == 1  # a failure, as agent status and the control commands say it
    assert "gone" in result.output or "127.0.0.1" in result.output
    assert "Traceback" not in result.output


def test_a_chunk_lost_between_lookup_and_get_keeps_the_ledger_exact(tmp_path: Path) -> None:
    """Tiers of two chunks each and a chain of four: fetching promotes, promotion evicts,
    and a chunk the lookup saw is gone by the time it is read. Only what is really gone is
    stored again, so the owners (reuse vs sharing) stay the agent's."""
    size = f"{2 * 256 * 48}B"
    chain = (1, 2, 3, 4)
    requests = [
        TraceRequest(i, 1024, 1, chain, tenant=t, block_tokens=256)
        for i, t in enumerate(("A", "B", "A", "B", "A"))
    ]
    with running_agent(
        tmp_path / "a", "--name", "a", "--cpu", size, "--disk", size, "--eviction", "lru"
    ) as a:
        report = replay(requests, _nodes((a,)), INPUTS, kv_scale=SCALE)
    _check_agents(report)
    t = report.nodes["a"]
    assert t.lost_chunks > 0  # the scenario happened
    assert t.hit_chunks > 0 and t.reuse_hits > 0 and t.sharing_hits > 0


def test_peer_fetch_counts_each_requests_lookup_once(tmp_path: Path) -> None:
    """Two nodes of one DC taking turns, the same chain of four chunks asked twice: the first
    request misses on fra-a and stores it there; the second, on fra-b, misses and takes all
    four from fra-a. One lookup per request in all (fra-b's), never a second on the peer: fra-a
    counts one lookup of 4 chunks, fra-b one of 4, and fra-a's 4 chunks are served uncounted."""
    chain = (1, 2, 3, 4)
    requests = [TraceRequest(i, 1024, 1, chain, tenant="t", block_tokens=256) for i in range(2)]
    with (
        running_agent(tmp_path / "a", "--name", "fra-a", "--dc", "fra") as a,
        running_agent(tmp_path / "b", "--name", "fra-b", "--dc", "fra") as b,
    ):
        report = replay(requests, _nodes((a, b)), INPUTS, kv_scale=SCALE,
                        routing="round-robin", peer_fetch=True)  # fmt: skip
    _check_agents(report)
    fra_a, fra_b = report.nodes["fra-a"], report.nodes["fra-b"]
    assert (fra_a.lookups, fra_a.lookup_chunks, fra_a.hit_chunks) == (1, 4, 0)
    assert (fra_b.lookups, fra_b.lookup_chunks, fra_b.hit_chunks) == (1, 4, 0)
    assert sum(t.lookups for t in report.nodes.values()) == report.requests.requests == 2
    assert (fra_a.served_to_peers, fra_b.served_to_peers) == (4, 0)
    rq = report.requests
    assert (rq.peer_hits, rq.hit_chunks, rq.computed_chunks, rq.reuse_hits) == (4, 4, 4, 4)
    assert fra_a.bytes_fetched == 4 * report.chunk_bytes


# --- routing by a router: the agents pull from their peers and pool themselves -------------


@contextlib.contextmanager
def _router(agents: dict[str, Agent]) -> Iterator[RouterClient]:
    """A router in this process following ``agents`` (in their DCs, fra and ams 50 km apart),
    and a client of it."""
    index = EmbeddedIndex()
    followers = Followers(
        index, {name: (a.state.control_url, None) for name, a in agents.items()}, poll_s=0.05
    )
    router = Router(
        index,
        Topology.build(
            [Node(name, a.state.dc) for name, a in agents.items()],
            {("fra", "ams"): DcLink.fiber(50)},
        ),
        Costs(PrefillModel(1e-4, 0.0, "configured: test")),
        followers=followers,
    )
    server = RouterServer(router, listen="127.0.0.1:0")
    server.start()
    try:
        with RouterClient(server.url) as client:
            yield client
    finally:
        server.stop()


@pytest.mark.parametrize("cpu", ["64MiB", "4MiB"])
def test_router_routing_counts_the_agents_own_peer_and_pool_pulls_exactly(
    tmp_path: Path, cpu: str
) -> None:
    """Two nodes with each other as peer and a pool agent, requests spread by the router's
    round-robin baseline: the next turn of a conversation, or the next tenant of a system
    prompt, lands where the prefix is not, and the agent pulls it. The replay moves nothing
    itself, yet predicts every counter, the reuse/sharing split of the pulled hits included,
    and the agents' pull counters equal its pulled hits. With room for every chunk the owner
    of every pulled hit is learnt; in a small cache a long pull evicts chunks it pulled before
    the replay reads their owner, and that node's split is then left unchecked, never
    guessed."""
    pa, pb = free_loopback_ports(2)
    small = ("--cpu", cpu, "--disk", "0")
    # fetch whatever a peer or the pool holds, whatever loopback measures: the test is about
    # the accounting, not the cost model
    fetch = ("--link", "pool:override=fetch")
    with running_agent(tmp_path / "pool", "--role", "pool", "--name", "pool", *small) as pool:
        url = f"kvctl://{pool.state.data_tcp}"
        with (
            running_agent(
                tmp_path / "a", "--name", "fra-a", "--dc", "fra", "--data-listen",
                f"127.0.0.1:{pa}", "--pool", url, "--peer", f"fra-b=127.0.0.1:{pb}",
                "--link", "fra-b:override=fetch", *fetch, *small,
            ) as a,
            running_agent(
                tmp_path / "b", "--name", "fra-b", "--dc", "fra", "--data-listen",
                f"127.0.0.1:{pb}", "--pool", url, "--peer", f"fra-a=127.0.0.1:{pa}",
                "--link", "fra-a:override=fetch", *fetch, *small,
            ) as b,
            _router({"fra-a": a, "fra-b": b}) as client,
        ):  # fmt: skip
            requests = generate("system-prompt", 3, requests=40)
            report = replay(
                requests, _nodes((a, b)), INPUTS, kv_scale=SCALE, routing="router",
                router=client, router_policy="round-robin", source_dcs={"pool": "fra"},
            )  # fmt: skip
    _check_agents(report)
    assert report.agent_counters is not None
    for name, known in report.owners_known.items():
        assert ("reuse_hits" in report.agent_counters[name]) is known
    if cpu == "64MiB":
        assert all(report.owners_known.values())  # so reuse/sharing was checked everywhere
    routed = report.router
    assert routed is not None and routed.policy == "round-robin"
    assert routed.fallbacks == 0 and routed.decisions == report.requests.requests
    assert set(routed.by_node) == {"fra-a", "fra-b"}
    pulled_hits = sum(
        t.hits_by_tier["peer"] + t.hits_by_tier["remote"] for t in report.nodes.values()
    )
    assert pulled_hits > 0
    assert sum(t.sharing_hits for t in report.nodes.values()) > 0
    assert report.pulls is not None
    lost = sum(t.lost_chunks for t in report.nodes.values())
    # every pulled hit arrived (a lost one may have arrived and been evicted since)
    assert pulled_hits - lost <= report.pulls.by_link["fra"].chunks <= pulled_hits
    if cpu == "64MiB":
        assert lost == 0
    assert report.pulls.cross_dc_bytes == 0
    rq = report.requests
    assert rq.peer_hits == rq.cross_dc_hits == 0 and not rq.bytes_by_link  # the replay moved none
    if cpu == "64MiB":  # nothing lost: the requests got every hit the nodes counted
        assert rq.hit_chunks == sum(t.hit_chunks for t in report.nodes.values())


def test_a_router_that_does_not_answer_falls_back_to_round_robin(
    two_dcs: tuple[Agent, Agent, Agent],
) -> None:
    requests = generate("chat", 4, requests=20)
    with RouterClient(f"http://127.0.0.1:{closed_port()}", timeout_s=2.0) as client:
        report = replay(
            requests, _nodes(two_dcs), INPUTS, kv_scale=SCALE, routing="router", router=client
        )
    _check_agents(report)
    routed = report.router
    assert routed is not None and routed.decisions == 0
    assert routed.fallbacks == sum(1 for r in requests if r.input_tokens >= 256) > 0
    assert routed.no_chunks == len(requests) - routed.fallbacks
    assert "did not answer" in routed.last_error
    with pytest.raises(InvalidArgument, match="router"):
        replay(requests, _nodes(two_dcs), INPUTS, routing="router")


def test_replay_command_asks_the_router(
    inventory: str, two_dcs: tuple[Agent, Agent, Agent]
) -> None:
    with _router({a.state.name: a for a in two_dcs}) as client:
        result = runner.invoke(
            app,
            ["replay", "--db", inventory, "--workload", "chat", "--limit", "30",
             "--model", "qwen2.5-0.5b", "--kv-scale", "1/256", "--router", client.url,
             "--router-policy", "round-robin", "--json"],
        )  # fmt: skip
        table = runner.invoke(
            app,
            ["replay", "--db", inventory, "--workload", "chat", "--limit", "10",
             "--kv-scale", "1/256", "--router", client.url],
            env={"COLUMNS": "120"},
        )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["routing"] == "router" and out["agents_agree"] is True
    routed = out["router"]
    assert routed["policy"] == "round-robin" and routed["fallbacks"] == 0
    assert routed["decisions"] == sum(routed["by_node"].values()) > 0
    assert out["pulls"]["basis"].startswith("measured") and out["links_emulated"] == {}
    assert table.exit_code == 0, table.output
    assert "router decisions" in table.output and "✓" in table.output


def test_replay_json_ratios_with_nothing_under_them_are_null() -> None:
    """`kvctl replay --json`'s ratios mean what every other JSON's do (kvctl/ratios.py): null
    where nothing is under them (N/A in the replay's own table), never 0.0, which reads as "no
    hits". A node the replay never looked up on (restarted, dealt no tenant) said 0.0 where its
    agent's /v1/stats says null."""
    assert NodeTally().as_dict()["hit_ratio"] is None
    empty = RequestTally().as_dict()
    assert empty["hit_ratio"] is None and empty["token_hit_ratio"] is None
    # with lookups, unchanged: no hits is a measured 0
    assert NodeTally(lookups=1, lookup_chunks=4, hit_chunks=1).as_dict()["hit_ratio"] == 0.25
    missed = RequestTally(requests=1, chunks=4, input_tokens=1000).as_dict()
    assert missed["hit_ratio"] == 0.0 and missed["token_hit_ratio"] == 0.0


def test_pool_hits_are_reuse_or_sharing_by_the_pulled_copys_owner(tmp_path: Path) -> None:
    """Without a router, a node's hit in its pool is counted by the agent as reuse or sharing by
    the tenant that stored the pool's copy (through another node); the replay, whose ledger
    only knew what it stored on that node, counted every such hit as sharing and exited 1 on a
    healthy fleet ('reuse_hits: replay 158, agent 763' on an audit's two nodes sharing a pool).
    It now learns the pulled copies' owners, as it does with a router."""
    from tests.functional.test_remote import SLOW_GPU, link_costed, pool_holds, wait_for

    small = ("--disk", "0", "--cpu", "64MiB")
    same = {"input_tokens": 2048, "output_tokens": 1, "block_ids": (1, 2, 3, 4)}
    with running_agent(tmp_path / "pool", "--role", "pool", "--name", "pool", *small) as pool:
        url = f"kvctl://{pool.state.data_tcp}"
        with (
            running_agent(tmp_path / "a", "--name", "a", "--dc", "fra", "--pool", url, *small) as a,
            running_agent(
                tmp_path / "b", "--name", "b", "--dc", "fra", "--pool", url, *SLOW_GPU, *small
            ) as b,
        ):
            first = replay(
                [TraceRequest(0, **same, tenant="t1")], _nodes((a,)), INPUTS, kv_scale=SCALE,
                peer_fetch=False,
            )  # fmt: skip
            stored = first.nodes["a"].puts["stored"]
            assert stored == 8
            wait_for("the write-through to reach the pool", pool_holds(pool, stored))
            wait_for("b to measure its link to the pool", link_costed(b, "pool"))
            report = replay(
                [TraceRequest(1, **same, tenant="t1"), TraceRequest(2, **same, tenant="t2")],
                _nodes((b,)), INPUTS, kv_scale=SCALE, peer_fetch=False,
            )  # fmt: skip
    on_b = report.nodes["b"]
    assert on_b.hits_by_tier["remote"] == 8  # t1's request: all of it from the pool
    # t1's own chunks (stored through a) are reuse; t2 hits t1's pulled copies: sharing
    assert (on_b.reuse_hits, on_b.sharing_hits) == (8, 8)
    assert report.owners_known == {"b": True}
    _check_agents(report)
