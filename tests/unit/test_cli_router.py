"""`kvctl route` and `kvctl router status` against a router served in this process (uvicorn in a
thread over an EmbeddedIndex fed directly), and how `kvctl router serve` reads the fleet."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.cli.router import CostFlags, FleetSource, _render_status, engine_feed_line, load_fleet
from kvctl.index.events import ChunkEvent
from kvctl.index.follower import Followers
from kvctl.index.model import EmbeddedIndex
from kvctl.router.app import RouterServer
from kvctl.router.score import Costs
from kvctl.router.service import KeySpace, Router
from kvctl.router.topology import DcLink, Node, Topology
from kvctl.tokenize import tokenize
from tests.functional.agents import closed_port
from tests.functional.test_cli_failures_markup_router import STATS as STATUS_STATS
from tests.functional.waiting import wait_until
from tests.unit.test_index_follower import K1, _ReplaceFails, _stored, scripted

CHUNK_TOKENS = 4
CHUNK_BYTES = CHUNK_TOKENS * 131_072
TOKEN = "cli-router-token"


def stored(ks: list[bytes], tenant: str = "acme") -> list[ChunkEvent]:
    return [ChunkEvent("stored", k, "cpu", tenant, False, CHUNK_BYTES, CHUNK_TOKENS) for k in ks]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path, Router]]:
    topology = Topology.build(
        [Node("a1", "fra"), Node("a2", "fra"), Node("b1", "ams")],
        {("fra", "ams"): DcLink.fiber(360)},
    )
    router = Router(
        EmbeddedIndex(),
        topology,
        Costs(CostFlags(prefill_tokens_per_s=10_000).costs().prefill),
        keyspace=KeySpace.of_model("llama-3.1-8b", chunk_tokens=CHUNK_TOKENS),
    )
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    with RouterServer(router, listen="127.0.0.1:0", token=TOKEN) as server:
        yield server.url, token_file, router


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def test_route_by_text_goes_to_the_holder_and_prints_why(served) -> None:  # type: ignore[no-untyped-def]
    url, token_file, router = served
    text = "one two three four five six seven eight nine"
    keys = router.keys_for(tokenize(text), tenant="acme")
    assert len(keys) == 2
    router.index.apply("a2", stored(keys))
    base = ["--router", url, "--token-file", str(token_file), "--tenant", "acme"]
    code, out = run("route", *base, "--text", text, "--json")
    assert code == 0, out
    d = json.loads(out)
    assert d["node"] == "a2" and d["local_chunks"] == 2 and "decision_id" in d
    code, out = run("route", *base, "--text", text, "--origin-dc", "fra", "--explain")
    assert code == 0, out
    assert "route to a2" in out and "with a full prefill" in out
    assert "b1" in out and "a2/cpu" in out  # every node's row, and the pull's link
    assert "360 km of fiber" in out  # the DC link's basis


def test_route_by_keys_and_tokens_as_lookup_takes_them(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, token_file, router = served
    toks = list(range(3 * CHUNK_TOKENS))
    keys = router.keys_for(toks, tenant="t")
    router.index.apply("b1", stored(keys, tenant="t"))
    base = ["--router", url, "--token-file", str(token_file), "--tenant", "t", "--json"]
    by_key = [a for k in keys for a in ("--key", k.hex())]
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("".join(k.hex() + "\n" for k in keys))
    tokens_file = tmp_path / "ids.txt"
    tokens_file.write_text(",".join(map(str, toks)))
    for way in (by_key, ["--keys-file", str(keys_file)], ["--tokens", str(tokens_file)]):
        code, out = run("route", *base, *way)
        assert code == 0, (way, out)
        assert json.loads(out)["node"] == "b1", way
    # two keys: the route is asked for that prefix, as given
    code, out = run("route", *base, *by_key[:4])
    assert code == 0 and json.loads(out)["local_chunks"] == 2


def test_router_status_shows_index_and_decisions(served) -> None:  # type: ignore[no-untyped-def]
    url, token_file, router = served
    keys = router.keys_for(list(range(2 * CHUNK_TOKENS)), tenant="t")
    router.index.apply("a1", stored(keys, tenant="t"))
    router.route(keys, tenant="t")
    code, out = run("router", "status", "--router", url, "--token-file", str(token_file), "--json")
    assert code == 0, out
    report = json.loads(out)
    assert report["index"]["nodes"] == {"a1": 2}
    assert report["stats"]["decisions"] == 1 and report["stats"]["to_holder"] == 1
    code, out = run("router", "status", "--router", url, "--token-file", str(token_file))
    assert code == 0 and "a1" in out and "decisions 1" in out


def test_router_status_says_a_nodes_index_replace_is_failing_and_when_it_is_retried(
    tmp_path: Path,
) -> None:
    """A node whose entries the index fails to replace (a replace longer than the index
    client's timeout) keeps stale entries, and its follower waits up to 30 s between tries: the
    status said only "up", so nothing told an operator why the node's entries were stale. It
    says the replace fails, how many times in a row, and when it is sent again."""
    index = _ReplaceFails()  # every replace fails; every other call answers
    topology = Topology.build([Node("a1", "fra"), Node("a2", "fra")])
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    script = {"instance": "one", "events": [], "items": [_stored(K1)]}
    with scripted(script) as agent_url:
        followers = Followers(index, {"a1": (agent_url, None)})
        costs = Costs(CostFlags(prefill_tokens_per_s=10_000).costs().prefill)
        router = Router(index, topology, costs, followers=followers)
        with RouterServer(router, listen="127.0.0.1:0", token=TOKEN) as server:
            # counted, not only sent: the follower counts the failure just after sending it
            wait_until(
                "a failed replace",
                lambda: followers.status()[0]["index_replace_failures"] >= 1,
            )
            base = ["router", "status", "--router", server.url, "--token-file", str(token_file)]
            code, out = run(*base, "--json")
            assert code == 0, out
            [a1] = json.loads(out)["index"]["followers"]
            assert a1["up"] is True and a1["index_replace_failures"] >= 1, a1
            assert 0 <= a1["index_retry_in_s"] <= 30, a1
            code, out = run(*base)
    assert code == 0, out
    [line] = [line for line in out.splitlines() if "index replace failing" in line]
    assert re.search(r"retry (now|in \d+ s) \(\d+ failed in a row\)", line), out


def test_router_status_says_an_engine_feeds_index_replace_is_failing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The same for a vLLM event feed (its status from a real feed: test_vllm_events_redis)."""
    feed = {
        "node": "a1#vllm",
        "endpoint": "tcp://10.0.0.7:5557",
        "connected": True,
        "live_chunks": 12,
        "messages": 40,
        "gaps": 0,
        "unrecovered": 0,
        "restarts": 0,
        "last_error": "IndexUnavailable: OOM command not allowed",
        "index_replace_failures": 4,
        "index_retry_in_s": 7.2,
    }
    index = {"kind": "redis", "nodes": {}, "followers": [], "engines": [feed]}
    _render_status({"router": "http://127.0.0.1:9480", "index": index, "stats": STATUS_STATS})
    out = capsys.readouterr().out
    assert "index replace failing: retry in 8 s (4 failed in a row)" in out, out
    follower = {"node": "a2", "up": False, "index_replace_failures": 2, "index_retry_in_s": 0.0}
    down = {"kind": "redis", "nodes": {}, "followers": [follower], "engines": []}
    _render_status({"router": "http://127.0.0.1:9480", "index": down, "stats": STATUS_STATS})
    # its wait is over but nothing is sent while the agent is down: not "retry now"
    assert "retry once the agent answers (2 failed in a row)" in capsys.readouterr().out
    feed.update(index_replace_failures=0, index_retry_in_s=None)  # done since: nothing said
    _render_status({"router": "http://127.0.0.1:9480", "index": index, "stats": STATUS_STATS})
    assert "index replace failing" not in capsys.readouterr().out


def test_router_status_says_a_nodes_role_was_not_read(capsys: pytest.CaptureFixture[str]) -> None:
    """A follower whose role read fails (``role_error``: a token without access to /v1/info)
    was shown only "up", while the agent was routed requests even if it was a pool agent."""
    follower = {"node": "a2", "up": True, "role": None, "role_error": "AgentError: 403 denied"}
    index = {"kind": "redis", "nodes": {}, "followers": [follower], "engines": []}
    _render_status({"router": "http://127.0.0.1:9480", "index": index, "stats": STATUS_STATS})
    out = capsys.readouterr().out
    assert "role not read" in out and "AgentError: 403 denied" in out, out
    follower["role_error"] = None  # read since: nothing said
    _render_status({"router": "http://127.0.0.1:9480", "index": index, "stats": STATUS_STATS})
    assert "role not read" not in capsys.readouterr().out


def test_router_status_shows_an_agents_reasons_as_text(capsys: pytest.CaptureFixture[str]) -> None:
    """A role read's failure and a poll's (``role_error``, ``last_error``) quote what the agent
    or a proxy in front of it answered: their escape sequences and line breaks were written to
    the terminal as they were (restyling what follows, a forged line), and their markup must
    show as text too."""
    said = "RequestError: 500: [bold]x[/] \x1b[31mred\x1b[0m\r\nCRITICAL forged"
    up = {"node": "a2", "up": True, "role": None, "role_error": said}
    down = {"node": "a3", "up": False, "role": None, "role_error": None, "last_error": said}
    index = {"kind": "redis", "nodes": {}, "followers": [up, down], "engines": []}
    _render_status({"router": "http://127.0.0.1:9480", "index": index, "stats": STATUS_STATS})
    out = capsys.readouterr().out
    assert "\x1b[31mred" not in out and "\r" not in out and "\nCRITICAL" not in out, repr(out)
    # each as written, both times (no blank in either: a narrow terminal wraps neither)
    assert out.count("[bold]x[/]") == out.count("\\x1b[31mred\\x1b[0m\\r\\nCRITICAL") == 2, out


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        ([], 2, "give a prompt"),
        (["--key", "ab" * 16, "--text", "a b"], 2, "give a prompt"),
        (["--key", "zz"], 2, "bad key #1"),
        (["--tokens", "BAD_IDS"], 2, "integer"),
        (["--tokens", "IDS", "--origin-dc", "mars"], 2, "unknown origin DC"),
        (["--tokens", "MISSING"], 2, "MISSING"),
    ],
)
def test_route_errors_are_one_line_and_exit_2(served, tmp_path: Path, args, code, says) -> None:  # type: ignore[no-untyped-def]
    url, token_file, _ = served
    (tmp_path / "BAD_IDS").write_text("1,x")
    (tmp_path / "IDS").write_text("1,2")
    args = [str(tmp_path / a) if a in ("BAD_IDS", "IDS", "MISSING") else a for a in args]
    got, out = run("route", "--router", url, "--token-file", str(token_file), *args)
    assert got == code, out
    assert says in out and "Traceback" not in out


def test_a_wrong_token_and_a_router_that_is_not_there(served, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url, _, _ = served
    wrong = tmp_path / "wrong.token"
    wrong.write_text("nope")
    code, out = run("route", "--router", url, "--token-file", str(wrong), "--text", "a")
    assert code == 1 and "401" in out and "--token-file" in out
    down = f"http://127.0.0.1:{closed_port()}"
    code, out = run("route", "--router", down, "--text", "a")
    assert code == 1 and "did not answer" in out and "kvctl router serve" in out
    code, out = run("router", "status", "--router", down)
    assert code == 1


def test_the_fleet_from_a_fleet_file_and_from_agent_flags(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(
        """
[[dcs]]
name = "fra"
carbon_g_per_kwh = 300.0
pue = 1.2
[[dcs]]
name = "ams"
[[nodes]]
name = "a1"
dc = "fra"
agent_url = "http://10.0.0.1:7070"
[[nodes]]
name = "b1"
dc = "ams"
agent_url = "http://10.0.0.2:7070"
[[links]]
a = "fra"
b = "ams"
distance_km = 360
"""
    )
    topo, urls = load_fleet(FleetSource(fleet=fleet))
    assert urls == {"a1": "http://10.0.0.1:7070", "b1": "http://10.0.0.2:7070"}
    assert topo.nodes["a1"].carbon_g_per_kwh == 300.0 and topo.nodes["a1"].pue == 1.2
    link = topo.link("fra", "ams")
    assert link is not None and "360 km" in link.basis
    topo, urls = load_fleet(
        FleetSource(agents=["x=http://h:7070@fra", "y=http://h:7080@ams"], links=["fra:ams=90"])
    )
    assert set(topo.nodes) == {"x", "y"} and urls["y"] == "http://h:7080"
    link = topo.link("ams", "fra")
    assert link is not None and "90 km" in link.basis


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--agent", "nonsense"], "NAME=URL@DC"),
        (["--agent", "a=http://h:1@fra", "--link", "fra-ams"], "A:B=KM"),
        (["--listen", "0.0.0.0:0", "--agent", "a=http://h:1@fra"], "without a token"),
        (["--fleet", "missing.toml"], "no such file"),
        (["--agent", "a=http://h:1@fra", "--model", "gpt-9"], "unknown model"),
    ],
)
def test_serve_refuses_bad_setups_before_serving(
    args: list[str], says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCTL_ROUTER_TOKEN", raising=False)
    code, out = run("router", "serve", *args)
    assert code == 2, out
    assert says in out


def test_the_fleet_from_the_fleet_database(tmp_path: Path) -> None:
    from kvctl.db import inventory as inv
    from kvctl.db.migrate import open_db

    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    engine = open_db(url)
    with engine.begin() as conn:
        inv.add_dc(conn, "fra", carbon_g_per_kwh=250.0)
        inv.add_dc(conn, "ams")
        inv.add_node(conn, "a1", dc="fra", agent_url="http://10.0.0.1:7070")
        inv.add_node(conn, "b1", dc="ams", agent_url="http://10.0.0.2:7070")
        inv.add_link(conn, "fra", "ams", distance_km=360)
    engine.dispose()
    topo, urls = load_fleet(FleetSource(db=url))
    assert urls == {"a1": "http://10.0.0.1:7070", "b1": "http://10.0.0.2:7070"}
    assert topo.nodes["a1"].carbon_g_per_kwh == 250.0 and topo.nodes["b1"].dc == "ams"
    link = topo.link("fra", "ams")
    assert link is not None and "360 km" in link.basis
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    open_db(empty).dispose()  # an inventory with no nodes (a missing one is its own error)
    code, out = run("router", "serve", "--db", empty)
    assert code == 2 and "no nodes" in out


def test_an_engine_feeds_line_says_what_it_dropped() -> None:
    """`kvctl router status` names an engine feed's refused messages and cut batches (each a
    gap in the index), as its --json and /metrics do; a feed that dropped none says nothing."""
    feed = {
        "node": "a1#vllm",
        "endpoint": "tcp://10.0.0.5:5557",
        "connected": True,
        "live_chunks": 1200,
        "messages": 40,
        "gaps": 2,
        "unrecovered": 1,
        "restarts": 0,
        "max_message_bytes": 64 << 20,
        "oversized": 0,
        "translator": {"batches_cut": 0},
    }
    clean = engine_feed_line(feed)
    assert "refused" not in clean and "cut" not in clean
    dropped = engine_feed_line({**feed, "oversized": 3, "translator": {"batches_cut": 2}})
    assert "3 messages over 64 MiB refused" in dropped
    assert "2 batches cut at malformed events" in dropped
