"""A shared (Redis) index keeps what a router left of nodes no running router removed: one removed
from the inventory while no router ran, one a router was restarted without (fewer --agent
flags), and ``NODE#vllm`` (its engine's own KV events) of a node removed while a router ran. A
router whose inventory is the fleet database drops the nodes it does not name at start and at
each reread; one given --agent flags or a fleet file drops nothing (a developer's router with a
few nodes against the fleet's Redis must not empty it) but names them in its status, and
`kvctl router forget NODE` drops one. Real agents, a real Redis (127.0.0.1:6379 under a prefix
of each test; a router process of its own Redis for `kvctl router serve`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app as cli_app
from kvctl.cli.router import FleetSource, inventory_reader
from kvctl.index.events import ChunkEvent
from kvctl.index.follower import Followers
from kvctl.index.redis_index import RedisIndex
from kvctl.remote.fetchplan import PrefillModel
from kvctl.router.app import RouterServer
from kvctl.router.inventory import InventoryReloader
from kvctl.router.score import Costs
from kvctl.router.service import Router
from tests.functional.agents import Agent, key, payload, running_agent
from tests.functional.routers import running_router
from tests.functional.waiting import wait_until

TOKEN = "forget-nodes-token"
CHUNK_BYTES = 4096
CHUNKS = 3
#: what the engine of the removed node "y" left in the index (its own KV events: NODE#vllm)
ENGINE_CHUNKS = 2


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Agent]]:
    """Real agents "x" and "y", each holding CHUNKS chunks."""
    root = tmp_path_factory.mktemp("forget-agents")
    with contextlib.ExitStack() as stack:
        out: dict[str, Agent] = {}
        for space, name in enumerate(("x", "y")):
            args = ["--name", name, "--dc", "fra", "--cpu", "16MiB", "--disk", "0"]
            agent = stack.enter_context(running_agent(root / name, *args))
            keys = [key(i, 7000 + space) for i in range(CHUNKS)]
            with agent.data() as d:
                outs = d.put_many(
                    [(k, payload(k, CHUNK_BYTES)) for k in keys],
                    tenant="t",
                    parents=[None, *keys[:-1]],
                    tokens=16,
                )
            assert {o.status for o in outs} == {"stored"}
            out[name] = agent
        yield out


@pytest.fixture
def shared(redis_url: str, redis_prefix: str) -> Iterator[RedisIndex]:
    index = RedisIndex(redis_url, prefix=f"{redis_prefix}:index:")
    yield index
    index.close()


def _engine_events() -> list[ChunkEvent]:
    return [
        ChunkEvent("stored", key(i, 7999), "gpu", "t", size_bytes=CHUNK_BYTES, tokens=16)
        for i in range(ENGINE_CHUNKS)
    ]


def left_by_an_earlier_router(index: RedisIndex, agents: dict[str, Agent]) -> None:
    """What a router that followed both agents (and read y's engine's KV events) left in the
    index when it stopped: each node's entries, y#vllm's."""
    followers = Followers(index, {n: (a.state.control_url, None) for n, a in agents.items()})
    followers.poll_all()
    followers.close()
    index.apply("y#vllm", _engine_events())
    assert index.nodes() == {"x": CHUNKS, "y": CHUNKS, "y#vllm": ENGINE_CHUNKS}


def _fleet_toml(nodes: dict[str, str]) -> str:
    text = '[[dcs]]\nname = "fra"\nregion = "eu"\nlocation = "Frankfurt"\n'
    for name, url in nodes.items():
        text += f'[[nodes]]\nname = "{name}"\ndc = "fra"\nagent_url = "{url}"\n'
    return text


def kvctl(*args: str) -> tuple[int, str]:
    done = CliRunner().invoke(cli_app, list(args), env={"COLUMNS": "300"})
    return done.exit_code, done.output


def fleet_db(tmp_path: Path, nodes: dict[str, str]) -> str:
    """A SQLite fleet database of ``nodes`` (name -> agent URL), all in DC fra."""
    db = f"sqlite:///{tmp_path / 'fleet.db'}"
    seed = tmp_path / "fleet.toml"
    seed.write_text(_fleet_toml(nodes))
    code, out = kvctl("fleet", "import", str(seed), "--db", db, "--yes")
    assert code == 0, out
    return db


def _costs() -> Costs:
    return Costs(PrefillModel(1e-4, 0.0, "configured: test"))


@contextlib.contextmanager
def router_on(
    index: RedisIndex,
    source: FleetSource,
    *,
    forget_unknown: bool,
    reload_s: float = 0.0,
    **reloader_kw: float,
) -> Iterator[tuple[Router, InventoryReloader]]:
    """A router over ``index`` as `kvctl router serve` builds it from ``source``, started."""
    from kvctl.cli.router import load_fleet

    topology, urls = load_fleet(source)
    name, read = inventory_reader(source)
    followers = Followers(index, {n: (u, None) for n, u in urls.items()}, poll_s=0.05)
    router = Router(index, topology, _costs(), followers=followers)
    reloader = InventoryReloader(
        read,
        router,
        followers,
        source=name,
        interval_s=reload_s,
        forget_unknown=forget_unknown,
        **reloader_kw,  # type: ignore[arg-type]
    )
    router.inventory = reloader
    router.start()
    try:
        yield router, reloader
    finally:
        # the index is the test's: the router stops without closing it
        reloader.stop()
        router.stop_claims()
        followers.close()


def test_a_node_removed_from_the_database_while_no_router_ran_is_dropped_at_start(
    tmp_path: Path, shared: RedisIndex, agents: dict[str, Agent]
) -> None:
    # before: y stayed in the index for good (x's router never followed it, so never dropped
    # it): routes and /v1/index/holders named y, `kvctl router status` listed its entries
    urls = {n: a.state.control_url for n, a in agents.items()}
    db = fleet_db(tmp_path, urls)
    left_by_an_earlier_router(shared, agents)
    code, out = kvctl("fleet", "rm", "node", "y", "--db", db, "--yes")  # no router runs
    assert code == 0, out
    with router_on(shared, FleetSource(db=db), forget_unknown=True) as (router, reloader):
        wait_until(  # counted after the drops: the index empties first
            "y and y#vllm dropped and counted",
            lambda: reloader.status()["forgotten_entries"] == CHUNKS + ENGINE_CHUNKS,
        )
        assert shared.nodes() == {"x": CHUNKS}
        assert reloader.status()["forgotten_nodes"] == 1  # y, with y#vllm
        assert reloader.status()["forgotten_entries"] == CHUNKS + ENGINE_CHUNKS
        assert sorted(reloader.status()["last_forgotten"]) == ["y", "y#vllm"]
        engine_keys = [e.key for e in _engine_events()]
        assert shared.holders(engine_keys, tenant="t") == [[]] * ENGINE_CHUNKS
        assert router.unknown_index_nodes(shared.nodes()) == {}


def test_a_reread_drops_a_node_the_database_no_longer_names_that_this_router_never_followed(
    tmp_path: Path, shared: RedisIndex, agents: dict[str, Agent]
) -> None:
    """Another router (started with more nodes) writes y; this one never follows it: y goes at
    this router's next reread once the database does not name it."""
    db = fleet_db(tmp_path, {"x": agents["x"].state.control_url})
    with router_on(shared, FleetSource(db=db), forget_unknown=True) as (_, reloader):
        wait_until("x indexed", lambda: shared.nodes().get("x") == CHUNKS)
        wait_until("the start's pass", lambda: reloader.reads >= 1)
        left_by_an_earlier_router(shared, agents)  # y, y#vllm written after that pass
        assert reloader.reload()
        assert shared.nodes() == {"x": CHUNKS}
        assert reloader.status()["forgotten_nodes"] == 1


def test_an_index_holding_none_of_the_databases_nodes_is_not_emptied(
    tmp_path: Path, shared: RedisIndex, agents: dict[str, Agent]
) -> None:
    """A developer's router reading their own SQLite file (node "dev", no entries yet) against
    the fleet's Redis: nothing is dropped, and the status says why."""
    left_by_an_earlier_router(shared, agents)
    db = fleet_db(tmp_path, {"dev": "http://127.0.0.1:9"})
    with router_on(shared, FleetSource(db=db), forget_unknown=True) as (_, reloader):
        wait_until("the start's pass", lambda: reloader.reads >= 1)
        assert reloader.reload()
        assert set(shared.nodes()) >= {"x", "y", "y#vllm"}
        assert "none dropped" in reloader.status()["forget_note"]
        assert reloader.status()["forgotten_nodes"] == 0


@pytest.mark.parametrize(
    "fleet_follows",
    [("y",), ("x", "y")],
    ids=["a-developers-own-node", "a-stale-copy-of-the-database"],
)
def test_a_node_another_running_router_follows_is_kept(
    tmp_path: Path,
    shared: RedisIndex,
    agents: dict[str, Agent],
    fleet_follows: tuple[str, ...],
) -> None:
    """The fleet's router follows y; a router on a database naming only x shares its Redis: a
    developer's own SQLite file with their node x (reachable, so in the index after its first
    poll), or a stale copy of the fleet database (x, not y, which joined since). Before, once x
    was in the index the 'holds none of the inventory's nodes' check passed, and that router
    dropped y at each reread (the fleet router's follower resyncing it each time)."""
    fleet = FleetSource(agents=[f"{n}={agents[n].state.control_url}@fra" for n in fleet_follows])
    db = fleet_db(tmp_path, {"x": agents["x"].state.control_url})
    with (
        router_on(shared, fleet, forget_unknown=False),
        router_on(shared, FleetSource(db=db), forget_unknown=True) as (_, reloader),
    ):
        wait_until("x and y indexed", lambda: shared.nodes() == {"x": CHUNKS, "y": CHUNKS})
        wait_until("the start's pass", lambda: reloader.reads >= 1)
        assert reloader.reload()
        assert reloader.status()["forgotten_nodes"] == 0, reloader.status()
        assert shared.nodes() == {"x": CHUNKS, "y": CHUNKS}
        assert "another router follows 1 of them" in reloader.status()["forget_note"]


def test_a_node_whose_router_stopped_is_dropped_once_its_claim_is_stale(
    tmp_path: Path, shared: RedisIndex, agents: dict[str, Agent]
) -> None:
    """The claims keep a node only while its router runs: stopped (y removed from the
    fleet with it), y goes at the first reread after its claim is older than claim_stale_s."""
    fleet = FleetSource(agents=[f"y={agents['y'].state.control_url}@fra"])
    db = fleet_db(tmp_path, {"x": agents["x"].state.control_url})
    with router_on(shared, FleetSource(db=db), forget_unknown=True, claim_stale_s=0.5) as (
        _,
        reloader,
    ):
        with router_on(shared, fleet, forget_unknown=False):
            wait_until("x and y indexed", lambda: shared.nodes() == {"x": CHUNKS, "y": CHUNKS})
            assert reloader.reload()
            assert set(shared.nodes()) == {"x", "y"}
        wait_until(
            "y dropped once its claim is stale",
            lambda: reloader.reload() and set(shared.nodes()) == {"x"},
        )
        assert reloader.status()["forgotten_nodes"] == 1
        assert reloader.status()["forget_note"] == ""


def test_forget_refuses_a_node_another_running_router_follows(
    tmp_path: Path, shared: RedisIndex, agents: dict[str, Agent]
) -> None:
    """Before, y's entries were dropped, said dropped, and written again by the other router's
    follower at its next poll."""
    fleet = FleetSource(agents=[f"y={agents['y'].state.control_url}@fra"])
    mine = FleetSource(agents=[f"x={agents['x'].state.control_url}@fra"])
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    with (
        router_on(shared, fleet, forget_unknown=False),
        router_on(shared, mine, forget_unknown=False) as (router, _),
        RouterServer(router, listen="127.0.0.1:0", token=TOKEN) as server,
    ):
        wait_until("x and y indexed", lambda: shared.nodes() == {"x": CHUNKS, "y": CHUNKS})
        wait_until("y claimed", lambda: "y" in (router.index_claims() or {}))
        at = ["--router", server.url, "--token-file", str(token_file)]
        code, out = kvctl("router", "forget", "y", *at)
        assert code == 2 and "another running router follows 'y'" in out, out
        assert shared.nodes() == {"x": CHUNKS, "y": CHUNKS}


def test_claims_name_other_routers_nodes_and_drop_an_hour_old_router(
    shared: RedisIndex, redis_url: str
) -> None:
    import redis

    from kvctl.index.redis_index import CLAIMS_KEPT_S

    shared.claim("router-a", ["x", "y"])
    shared.claim("router-b", ["y", "z#vllm"])
    ages = shared.claims()
    assert set(ages) == {"x", "y", "z#vllm"} and all(0 <= a < 60 for a in ages.values())
    assert set(shared.claims(excluding="router-a")) == {"y", "z#vllm"}
    shared.claim("router-a", ["x"])  # in place of its claim before
    assert set(shared.claims(excluding="router-b")) == {"x"}
    raw = redis.Redis.from_url(redis_url)
    try:
        key = f"{shared.prefix}claims"
        seconds, _ = raw.time()
        old_ms = (seconds - CLAIMS_KEPT_S - 60) * 1000
        raw.hset(key, "router-gone", json.dumps({"ms": old_ms, "nodes": ["w"]}))
        raw.hset(key, "not-a-claim", "garbage")
        assert "w" not in shared.claims()
        assert raw.hexists(key, "router-gone") == 0  # an hour-old router's field goes
        assert raw.hexists(key, "not-a-claim") == 1  # not ours to delete
    finally:
        raw.close()


def test_a_node_removed_from_a_fleet_file_goes_with_its_engines_entries(
    tmp_path: Path, shared: RedisIndex, agents: dict[str, Agent]
) -> None:
    # before: y's own entries were dropped and y#vllm's stayed for good
    urls = {n: a.state.control_url for n, a in agents.items()}
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(_fleet_toml(urls))
    with router_on(shared, FleetSource(fleet=fleet), forget_unknown=False) as (_, reloader):
        wait_until("x and y indexed", lambda: shared.nodes() == {"x": CHUNKS, "y": CHUNKS})
        shared.apply("y#vllm", _engine_events())
        fleet.write_text(_fleet_toml({"x": urls["x"]}))
        assert reloader.reload()
        assert shared.nodes() == {"x": CHUNKS}
        assert reloader.status()["last_forgotten"] == ["y#vllm"]


def test_a_router_given_agent_flags_drops_nothing_and_forget_drops_a_named_node(
    tmp_path: Path, shared: RedisIndex, agents: dict[str, Agent]
) -> None:
    left_by_an_earlier_router(shared, agents)
    x_url = agents["x"].state.control_url
    source = FleetSource(agents=[f"x={x_url}@fra"])
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    with (
        router_on(shared, source, forget_unknown=False) as (router, _),
        RouterServer(router, listen="127.0.0.1:0", token=TOKEN) as server,
    ):
        wait_until(
            "x followed", lambda: router.followers is not None and router.up_nodes() == {"x"}
        )
        assert shared.nodes() == {"x": CHUNKS, "y": CHUNKS, "y#vllm": ENGINE_CHUNKS}
        at = ["--router", server.url, "--token-file", str(token_file)]
        code, out = kvctl("router", "status", *at, "--json")
        assert code == 0, out
        assert json.loads(out)["index"]["not_in_inventory"] == {"y": CHUNKS, "y#vllm": 2}
        code, out = kvctl("router", "status", *at)
        assert code == 0, out
        assert "in the index, not in this router's inventory: 1 node (5 entries), e.g. y; " in out
        assert "`kvctl router forget NODE` drops them" in out
        assert "not in inventory" in out  # y's and y#vllm's rows in the table
        # a node the router follows: refused (it would be written again at once)
        code, out = kvctl("router", "forget", "x", *at)
        assert code == 2 and "'x' is in this router's inventory" in out, out
        code, out = kvctl("router", "forget", "y", *at, "--json")
        assert code == 0, out
        answer = json.loads(out)
        assert answer["dropped"] == {"y": CHUNKS, "y#vllm": ENGINE_CHUNKS}
        assert answer["entries"] == CHUNKS + ENGINE_CHUNKS and answer["node"] == "y"
        assert shared.nodes() == {"x": CHUNKS}
        code, out = kvctl("router", "forget", "y", *at)
        assert code == 2 and "the index holds no entry of 'y'" in out, out
        code, out = kvctl("router", "status", *at)
        assert code == 0 and "not in this router's inventory" not in out, out


def test_forget_drops_one_engines_entries_and_says_how_many(
    tmp_path: Path, shared: RedisIndex, agents: dict[str, Agent]
) -> None:
    left_by_an_earlier_router(shared, agents)
    source = FleetSource(agents=[f"x={agents['x'].state.control_url}@fra"])
    with (
        router_on(shared, source, forget_unknown=False) as (router, _),
        RouterServer(router, listen="127.0.0.1:0", token=TOKEN) as server,
    ):
        code, out = kvctl("router", "forget", "y#vllm", "--router", server.url)
        assert code == 1 and "401" in out, out  # the router's token is needed
        token_file = tmp_path / "router.token"
        token_file.write_text(TOKEN + "\n")
        code, out = kvctl(
            "router", "forget", "y#vllm", "--router", server.url, "--token-file", str(token_file)
        )
        assert code == 0, out
        assert f"dropped {ENGINE_CHUNKS} index entries of y#vllm (y#vllm {ENGINE_CHUNKS})" in out
        assert shared.nodes() == {"x": CHUNKS, "y": CHUNKS}


def test_kvctl_router_serve_on_the_fleet_database_drops_what_a_removed_node_left(
    tmp_path: Path,
    private_redis,
    agents: dict[str, Agent],  # type: ignore[no-untyped-def]
) -> None:
    """The serve command's wiring: the database's router forgets, an --agent one does not
    (a Redis of this test alone: the serve command writes under the default prefix)."""
    index = RedisIndex(private_redis.url)
    try:
        left_by_an_earlier_router(index, agents)
        token_file = tmp_path / "router.token"
        token_file.write_text(TOKEN + "\n")
        x_url = agents["x"].state.control_url
        base = ["--token-file", str(token_file), "--index", private_redis.url, "--poll-s", "0.05"]
        with running_router([*base, "--agent", f"x={x_url}@fra"], token=TOKEN) as router:
            wait_until(
                "x followed",
                lambda: router.http.get("/v1/health").json()["followers_up"] == 1,
            )
            answer = router.http.get("/v1/index").json()
            assert answer["not_in_inventory"] == {"y": CHUNKS, "y#vllm": ENGINE_CHUNKS}
            assert answer["nodes"] == {"x": CHUNKS, "y": CHUNKS, "y#vllm": ENGINE_CHUNKS}
            metrics = router.http.get("/metrics").text
            assert "kvctl_index_unknown_nodes 1.0" in metrics  # y and y#vllm: one node
        db = fleet_db(tmp_path, {"x": x_url})
        with running_router([*base, "--db", db], token=TOKEN) as router:
            wait_until("y and y#vllm dropped", lambda: index.nodes() == {"x": CHUNKS})
            inventory = router.http.get("/v1/stats").json()["inventory"]
            assert inventory["forgets_unknown"] is True and inventory["forgotten_nodes"] == 1
            code, out = kvctl(
                "router", "status", "--router", router.url, "--token-file", str(token_file)
            )
            assert code == 0, out
            assert "dropped from the index as not in the inventory: 1 node, 5 entries" in out, out
    finally:
        index.close()
