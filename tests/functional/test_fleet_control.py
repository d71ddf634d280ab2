"""`kvctl status`, `lookup`, the control actions and `audit` against real agents on loopback and
a real SQLite and PostgreSQL inventory: tables and --json, confirmation, partial failure with a
node down, and the audit rows every action writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.engine import Engine
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db.ingest import insert_rows
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.models import Audit, raw_table
from kvctl.fleet.audit import recent
from kvctl.tokenize import tokenize
from tests.functional.agents import Agent, closed_port, running_agent
from tests.not_an_agent import answering_url, web_page_url
from tests.starting_agent import starting_url

runner = CliRunner()
CHUNK_BYTES = 4096
# 600 words: two full 256-token chunks under the simple tokenizer
PROMPT = " ".join(f"word{i}" for i in range(600))


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent]]:
    root = tmp_path_factory.mktemp("fleet")
    args = ("--cpu", "8MiB", "--disk", "32MiB")
    with (
        running_agent(root / "a", "--name", "gpu-a", "--dc", "fra", *args) as a,
        running_agent(root / "b", "--name", "gpu-b", "--dc", "fra", *args) as b,
    ):
        yield a, b


@pytest.fixture
def fleet(db: Engine, empty_db_url: str, agents: tuple[Agent, Agent]) -> str:
    """Two live nodes in fra, one in ams whose agent is not running; returns the DB URL."""
    a, b = agents
    with db.begin() as conn:
        add_dc(conn, "fra")
        add_dc(conn, "ams")
        add_node(conn, "gpu-a", dc="fra", agent_url=a.state.control_url)
        add_node(conn, "gpu-b", dc="fra", agent_url=b.state.control_url)
        add_node(conn, "gpu-down", dc="ams", agent_url=f"http://127.0.0.1:{closed_port()}")
    return empty_db_url


def _prompt_keys(agent: Agent, text: str) -> list[bytes]:
    found = agent.control().lookup(tokens=tokenize(text), count=False)
    return [bytes.fromhex(c["key"]) for c in found["chunks"]]


def _store(agent: Agent, text: str, tenant: str = "") -> list[bytes]:
    keys = _prompt_keys(agent, text)
    with agent.data() as c:
        parent = None
        for k in keys:
            c.put(k, b"x" * CHUNK_BYTES, tenant=tenant, parent=parent, tokens=256)
            parent = k
    return keys


def _run(*args: str, input: str | None = None) -> Any:
    return runner.invoke(app, list(args), input=input, env={"KVCTL_ACTOR": "alice@bastion"})


def _audit(db: Engine) -> list[Any]:
    with db.connect() as conn:
        return recent(conn, limit=1000)


def test_status_shows_up_and_down_nodes_with_totals(fleet: str, db: Engine, agents: Any) -> None:
    a, _ = agents
    _store(a, PROMPT + " status")
    a.control().lookup(tokens=tokenize(PROMPT + " status"))  # one counted lookup: 2 hits
    with db.begin() as conn:  # the collectors once reached the down node
        down_id = conn.execute(select(func.max(raw_table("node").c.id))).scalar()
        insert_rows(
            conn,
            raw_table("node_sample"),
            [{"node_id": down_id, "ts_ms": 1_700_000_000_000, "up": True}],
        )
    table = _run("status", "--db", fleet)
    assert table.exit_code == 0, table.output
    for text in ("gpu-a", "gpu-b", "gpu-down", "down", "fra", "ams", "fleet", "cpu"):
        assert text in table.output
    out = _run("status", "--db", fleet, "--json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    nodes = {n["node"]: n for n in doc["nodes"]}
    assert nodes["gpu-a"]["up"] and nodes["gpu-a"]["hits"] >= 2
    assert nodes["gpu-a"]["hit_ratio"] is not None and 0 < nodes["gpu-a"]["hit_ratio"] <= 1
    assert nodes["gpu-a"]["reuse_share_of_hits"] == 1.0  # stored and read by the same tenant
    assert nodes["gpu-a"]["tiers"]["cpu"]["capacity_bytes"] == 8 << 20
    assert not nodes["gpu-down"]["up"] and "cannot reach" in nodes["gpu-down"]["error"]
    assert nodes["gpu-down"]["last_seen_ms"] == 1_700_000_000_000
    dcs = {d["dc"]: d for d in doc["dcs"]}
    assert (dcs["fra"]["up"], dcs["fra"]["nodes"]) == (2, 2)
    assert (dcs["ams"]["up"], dcs["ams"]["nodes"]) == (0, 1)
    assert doc["total"]["nodes"] == 3 and doc["total"]["up"] == 2
    only = json.loads(_run("status", "--db", fleet, "--dc", "ams", "--json").stdout)
    assert [n["node"] for n in only["nodes"]] == ["gpu-down"]


def test_lookup_shows_tiers_per_node_and_counts_nothing(
    fleet: str, agents: Any, tmp_path: Path
) -> None:
    a, _ = agents
    text = PROMPT + " lookup"
    keys = _store(a, text)
    a.control().move([keys[1]], "disk")
    before = a.control().stats()["stats"]["lookup_chunks"]
    out = _run("lookup", "--db", fleet, "-n", "gpu-a", "-n", "gpu-b", "--text", text, "--json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["tokens"] == 601
    by_node = {n["node"]: n for n in doc["nodes"]}
    assert [c["tier"] for c in by_node["gpu-a"]["chunks"]] == ["cpu", "disk"]
    assert by_node["gpu-a"]["matched_chunks"] == 2 and by_node["gpu-a"]["matched_tokens"] == 512
    assert by_node["gpu-b"]["matched_chunks"] == 0 and by_node["gpu-b"]["total_chunks"] == 2
    assert [c["key"] for c in by_node["gpu-a"]["chunks"]] == [k.hex() for k in keys]
    # an operator's lookup must not move the hit ratio it inspects
    assert a.control().stats()["stats"]["lookup_chunks"] == before
    table = _run("lookup", "--db", fleet, "--node", "gpu-a", "--text", text)
    assert table.exit_code == 0, table.output
    assert "2/2" in table.output and "disk" in table.output and keys[0].hex() in table.output
    # a node that does not answer: reported, exit 1
    down = _run("lookup", "--db", fleet, "--dc", "ams", "--text", text)
    assert down.exit_code == 1 and "gpu-down" in down.output
    # by key, as an operator who has keys (from an event or a log) asks: the same answer
    by_key = _run("lookup", "--db", fleet, "-n", "gpu-a", "--key", keys[0].hex(), "--key",
                  keys[1].hex(), "--json")  # fmt: skip
    assert by_key.exit_code == 0, by_key.output
    chain = json.loads(by_key.stdout)
    assert chain["keys"] == 2 and "tokens" not in chain
    (node,) = chain["nodes"]
    assert [(c["key"], c["tier"]) for c in node["chunks"]] == [
        (keys[0].hex(), "cpu"),
        (keys[1].hex(), "disk"),
    ]
    assert node["matched_chunks"] == 2
    keys_file = tmp_path / "chain.keys"
    keys_file.write_text(f"# the second chunk alone, asked as given\n{keys[1].hex()}\n")
    alone = _run("lookup", "--db", fleet, "-n", "gpu-a", "--keys-file", str(keys_file))
    assert alone.exit_code == 0, alone.output
    assert "1 keys" in alone.output and "1/1" in alone.output and "disk" in alone.output
    assert a.control().stats()["stats"]["lookup_chunks"] == before
    both = _run("lookup", "--db", fleet, "-n", "gpu-a", "--text", text, "--key", keys[0].hex())
    assert both.exit_code == 2 and "give a prompt" in both.output


def test_pin_evict_unpin_by_key_on_a_dc_with_audit_rows(
    fleet: str, db: Engine, agents: Any
) -> None:
    a, b = agents
    text = PROMPT + " pin"
    keys = _store(a, text)
    _store(b, text)
    key_args = [arg for k in keys for arg in ("--key", k.hex())]
    pin = _run("pin", "--db", fleet, "--dc", "fra", *key_args, "--yes", "--json")
    assert pin.exit_code == 0, pin.output
    doc = json.loads(pin.stdout)
    assert doc["ok"] and doc["failed"] == []
    assert {n["node"]: n["result"]["done"] for n in doc["nodes"]} == {"gpu-a": 2, "gpu-b": 2}
    evict = _run("evict", "--db", fleet, "--node", "gpu-a", *key_args)
    assert evict.exit_code == 0, evict.output
    # both chunks passed over as pinned, said in a column named so (before: "pinned", which
    # read as chunks pinned)
    cells = " ".join(evict.output.replace("│", " ").replace("┃", " ").split())
    assert "done skipped pinned missing no room" in cells, evict.output
    assert "gpu-a fra ok 0 2 0 0" in cells, evict.output
    again = _run("pin", "--db", fleet, "--node", "gpu-b", *key_args, "--yes")
    # pin skips nothing as pinned: no such column; one pinned already counts as done
    cells = " ".join(again.output.replace("│", " ").replace("┃", " ").split())
    assert "result done missing no room time" in cells and "skipped" not in cells, again.output
    assert "gpu-b fra ok 2 0 0" in cells, again.output
    assert a.control().lookup(keys=keys, count=False)["matched_chunks"] == 2  # pinned: kept
    unpin = _run("unpin", "--db", fleet, "--node", "gpu-a", "--text", text, "--json")
    assert json.loads(unpin.stdout)["nodes"][0]["result"]["done"] == 2
    evict = _run("evict", "--db", fleet, "--node", "gpu-a", *key_args, "--json")
    assert json.loads(evict.stdout)["nodes"][0]["result"]["done"] == 2
    assert a.control().lookup(keys=keys, count=False)["matched_chunks"] == 0
    rows = _audit(db)
    assert sorted((r.action, r.target) for r in rows) == [
        ("evict", "gpu-a"),
        ("evict", "gpu-a"),
        ("pin", "gpu-a"),
        ("pin", "gpu-b"),
        ("pin", "gpu-b"),
        ("unpin", "gpu-a"),
    ]
    assert all(r.ok and r.actor == "alice@bastion" for r in rows)
    pins = [r for r in rows if r.action == "pin"]
    assert {r.target for r in pins} == {"gpu-a", "gpu-b"}
    assert all(p.args == {"keys": 2} and json.loads(p.result)["done"] == 2 for p in pins)
    unpins = [r for r in rows if r.action == "unpin"]
    assert unpins[0].args["prompt_tokens"] == 601


def test_all_asks_first_and_partial_failure_names_the_down_node(
    fleet: str, db: Engine, agents: Any
) -> None:
    a, _ = agents
    keys = _store(a, PROMPT + " all")
    declined = _run("evict", "--db", fleet, "--all", "--key", keys[0].hex(), input="n\n")
    assert declined.exit_code == 1 and "nothing done" in declined.output
    assert "ALL 3 node(s) in 2 DC(s)" in declined.output
    # no answer at all (stdin closed, as in a script without --yes): also a no
    silent = _run("evict", "--db", fleet, "--all", "--key", keys[0].hex(), input="")
    assert silent.exit_code == 1 and "nothing done" in silent.output
    assert _audit(db) == []
    assert a.control().lookup(keys=keys, count=False)["matched_chunks"] == 2

    out = _run("evict", "--db", fleet, "--all", "--key", keys[0].hex(), "--json", input="y\n")
    assert out.exit_code == 1
    assert "failed on 1 of 3 node(s)" in out.stderr and "gpu-down" in out.stderr
    # CliRunner echoes the typed answer onto stdout; a terminal would not
    doc = json.loads(out.stdout[out.stdout.index("{") :])
    assert doc["failed"] == ["gpu-down"] and not doc["ok"]
    assert a.control().lookup(keys=keys, count=False)["matched_chunks"] == 0
    rows = {r.target: r for r in _audit(db)}
    assert set(rows) == {"gpu-a", "gpu-b", "gpu-down"}
    assert rows["gpu-a"].ok and rows["gpu-b"].ok  # gpu-b: the key was missing, not an error
    assert not rows["gpu-down"].ok and "cannot reach" in rows["gpu-down"].result

    failed = json.loads(_run("audit", "--db", fleet, "--failed", "--json").stdout)
    assert [(r["target"], r["ok"]) for r in failed] == [("gpu-down", False)]

    table = _run("flush", "--db", fleet, "--all", "--yes", "--tier", "disk")
    assert table.exit_code == 1
    assert "failed" in table.output and "gpu-down" in table.output


def test_a_whole_dc_asks_first_like_all(fleet: str, db: Engine, agents: Any) -> None:
    """--dc acts on every node of a DC, which no one named one by one: it asks like --all."""
    a, b = agents
    text = "dc " + PROMPT  # chunks of its own: the other tests' pins leave them alone
    keys = _store(a, text)
    _store(b, text)
    key = keys[0].hex()
    declined = _run("evict", "--db", fleet, "--dc", "fra", "--key", key, input="n\n")
    assert declined.exit_code == 1 and "nothing done" in declined.output
    assert "evict on ALL 2 node(s) in DC fra?" in declined.output
    # no answer at all (stdin closed, as in a script without --yes): also a no
    silent = _run("evict", "--db", fleet, "--dc", "fra", "--key", key, input="")
    assert silent.exit_code == 1 and "nothing done" in silent.output
    # the down node's DC with a node of another named too: the question names both
    both = _run("evict", "--db", fleet, "--dc", "ams", "-n", "gpu-a", "--key", key, input="n\n")
    assert both.exit_code == 1 and "ALL 1 node(s) in DC ams and on gpu-a?" in both.output
    assert _audit(db) == []  # no agent was asked
    assert a.control().lookup(keys=keys, count=False)["matched_chunks"] == 2
    assert b.control().lookup(keys=keys, count=False)["matched_chunks"] == 2

    out = _run("evict", "--db", fleet, "--dc", "fra", "--key", key, "--json", input="y\n")
    assert out.exit_code == 0, out.output
    # CliRunner echoes the typed answer onto stdout; a terminal would not
    doc = json.loads(out.stdout[out.stdout.index("{") :])
    assert {n["node"]: n["result"]["done"] for n in doc["nodes"]} == {"gpu-a": 1, "gpu-b": 1}
    assert sorted(r.target for r in _audit(db)) == ["gpu-a", "gpu-b"]
    # named nodes only: nothing to ask
    named = _run("evict", "--db", fleet, "-n", "gpu-a", "-n", "gpu-b", "--key", keys[1].hex())
    assert named.exit_code == 0 and "ALL" not in named.output, named.output


def test_tier_actions_move_prefetch_flush_resize(fleet: str, db: Engine, agents: Any) -> None:
    a, _ = agents
    text = PROMPT + " tiers"
    keys = _store(a, text)
    ctl = a.control()

    def tiers() -> list[str | None]:
        return [c["tier"] for c in ctl.lookup(keys=keys, count=False)["chunks"]]

    moved = _run("move", "--db", fleet, "-n", "gpu-a", "--to", "disk", "--text", text)
    assert moved.exit_code == 0, moved.output
    assert tiers() == ["disk", "disk"]
    up = _run("prefetch", "--db", fleet, "-n", "gpu-a", "--to", "cpu", "--text", text, "--json")
    assert json.loads(up.stdout)["nodes"][0]["result"]["done"] == 2
    assert tiers() == ["cpu", "cpu"]
    flush = _run("flush", "--db", fleet, "-n", "gpu-a", "--tier", "cpu", "--demote", "--json")
    assert flush.exit_code == 0, flush.output
    assert tiers() == ["disk", "disk"]
    resize = _run("resize", "--db", fleet, "-n", "gpu-a", "--tier", "cpu", "--size", "4MiB")
    assert resize.exit_code == 0, resize.output
    assert next(t for t in ctl.info()["tiers"] if t["name"] == "cpu")["capacity_bytes"] == 4 << 20
    back = _run("resize", "--db", fleet, "-n", "gpu-a", "--tier", "cpu", "--size", "8MiB")
    assert back.exit_code == 0, back.output
    actions = [r.action for r in _audit(db)][::-1]
    assert actions == ["move", "prefetch", "flush", "resize", "resize"]
    # refused by the agent: an unknown tier is that node's failure, recorded
    bad_tier = _run("flush", "--db", fleet, "-n", "gpu-a", "--tier", "tape")
    assert bad_tier.exit_code == 1 and "tape" in bad_tier.output
    assert not _audit(db)[0].ok


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["resize", "-n", "gpu-a", "--tier", "cpu", "--size", "lots"], "not a size"),
        (["pin", "-n", "gpu-a", "--key", "beef"], "32 hex characters"),
        (["pin", "-n", "gpu-a"], "give a prompt"),
        (["evict", "--key", "00" * 16], "name the targets"),
        (["evict", "-n", "nope", "--key", "00" * 16], "no node named 'nope'"),
        # a target that is not there is looked up, not added
        (
            ["unpin", "--dc", "nowhere", "--key", "00" * 16],
            "no DC named 'nowhere' (known: ams, fra); `kvctl fleet ls` lists them",
        ),
        (["evict", "-n", "nope", "--key", "00" * 16], "`kvctl fleet ls` lists them"),
        # the rule of `kvctl agent start --cpu`: every agent has a cpu tier
        (
            ["resize", "-n", "gpu-a", "--tier", "cpu", "--size", "0"],
            "the cpu tier cannot be 0 bytes",
        ),
        (["resize", "-n", "gpu-a", "--tier", "cpu", "--size", "0GiB"], "kvctl flush --tier cpu"),
        (["audit", "--action", "nosuch"], "unknown action 'nosuch'; one of evict, fleet.add-dc"),
        (["audit", "--action", "pinn"], "or a prefix ending in '.' such as 'fleet.'"),
        (["lookup", "-n", "gpu-a"], "give a prompt"),
        # bytes.fromhex takes spaces between digits; the agents do not
        (["evict", "-n", "gpu-a", "--key", "7e " * 15 + "7e"], "32 hex characters"),
        # disk is every agent's bottom tier: --demote would drop what it promises to keep
        (["flush", "-n", "gpu-a", "--tier", "disk", "--demote"], "nothing is below it"),
    ],
)
def test_bad_input_is_refused_before_any_agent_is_asked(
    fleet: str, db: Engine, args: list[str], message: str
) -> None:
    out = _run(*args, "--db", fleet)
    assert out.exit_code == 2, out.output
    said = " ".join(out.output.split())  # rich wraps at the terminal's width
    assert message in said and "Traceback" not in said
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Audit)).scalar() == 0


def test_a_resize_no_host_can_map_says_sizes_in_human_units(fleet: str, agents: Any) -> None:
    out = _run("resize", "--db", fleet, "-n", "gpu-a", "--tier", "cpu", "--size", "4194304TiB")
    assert out.exit_code == 1
    said = " ".join(out.output.split())
    assert "cannot reserve 4,194,304 TiB" in said or "cannot map 4,194,304 TiB" in said, said
    assert str(4194304 << 40) not in said


def test_a_keyed_action_on_chunks_not_cached_says_so_under_the_table(
    fleet: str, agents: Any
) -> None:
    a, _ = agents
    # prompts of their own: other tests' start with PROMPT, so share its two chunks
    text = " ".join(f"never{i}" for i in range(600))
    stored = " ".join(f"missing{i}" for i in range(600))
    keys = [*_store(a, stored)[:1], bytes(16)]
    pin = _run("pin", "--db", fleet, "-n", "gpu-a", "--text", text, "--tier", "cpu")
    assert pin.exit_code == 0, pin.output  # as documented: the action ran
    assert (
        "gpu-a: 2 of 2 chunk(s) not cached there: nothing to pin for them; "
        "`kvctl lookup --node gpu-a --text ...` shows what is"
    ) in pin.stderr
    cached = _run("prefetch", "--db", fleet, "-n", "gpu-a", "--text", stored)
    assert cached.exit_code == 0 and "not cached" not in cached.stderr
    key_args = [arg for k in keys for arg in ("--key", k.hex())]
    evict = _run("evict", "--db", fleet, "-n", "gpu-a", "-n", "gpu-b", *key_args)
    assert evict.exit_code == 0, evict.output
    notes = [ln for ln in evict.stderr.splitlines() if "not cached there" in ln]
    assert [n.split(":")[0] for n in notes] == ["gpu-a", "gpu-b"]  # one line per node
    assert "gpu-a: 1 of 2 chunk(s)" in notes[0] and "gpu-b: 2 of 2 chunk(s)" in notes[1]
    assert "the keys may be another model's" in notes[0]
    short = _run("move", "--db", fleet, "-n", "gpu-a", "--to", "disk", "--text", "too short")
    assert "gpu-a: the prompt makes no full chunk there: nothing to move" in short.stderr
    # --json already says it: `missing` of `keys` per node, nothing on stderr to parse around
    doc = json.loads(_run("unpin", "--db", fleet, "-n", "gpu-a", "--text", text, "--json").stdout)
    assert doc["nodes"][0]["result"]["missing"] == doc["nodes"][0]["result"]["keys"] == 2


def test_agent_status_counts_as_kvctl_status_does(
    db: Engine, empty_db_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("vocabulary")
    with running_agent(root / "c", "--name", "gpu-c", "--cpu", "8MiB", "--disk", "0") as c:
        with db.begin() as conn:
            add_dc(conn, "fra")
            add_node(conn, "gpu-c", dc="fra", agent_url=c.state.control_url)
        url = c.state.control_url

        def both() -> tuple[dict[str, Any], dict[str, Any], str]:
            agent = _run("agent", "status", "--url", url, "--json")
            fleet = _run("status", "--db", empty_db_url, "--json")
            assert agent.exit_code == fleet.exit_code == 0, agent.output + fleet.output
            table = _run("agent", "status", "--url", url).output
            return json.loads(agent.stdout), json.loads(fleet.stdout)["nodes"][0], table

        agent, node, table = both()  # no lookup yet: no ratio, N/A, as `kvctl status` says
        assert agent["lookups"] == 0 and agent["hit_ratio"] is None and node["hit_ratio"] is None
        assert "hit ratio N/A" in " ".join(table.split())
        keys = [bytes([i]) * 16 for i in range(5)]
        with c.data() as d:
            for k in keys:
                d.put(k, b"x" * CHUNK_BYTES)
            d.lookup(keys)
            d.lookup(keys)
        agent, node, table = both()
        for name in ("lookups", "hits", "reuse_hits", "sharing_hits", "hit_ratio",
                     "reuse_share_of_hits", "sharing_share_of_hits"):  # fmt: skip
            assert agent[name] == node[name], name
        assert (agent["lookups"], agent["hits"], agent["lookup_requests"]) == (10, 10, 2)
        assert "hit_chunks" not in json.dumps(agent) and "stats" not in agent
        assert "lookups 10 chunks in 2 requests hits 10 hit ratio 100.0%" in " ".join(table.split())


def test_status_and_audit_in_a_real_subprocess(
    sqlite_url: str, agents: tuple[Agent, Agent]
) -> None:
    from kvctl.db.migrate import open_db

    a, _ = agents
    engine = open_db(sqlite_url)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "gpu-a", dc="fra", agent_url=a.state.control_url)
    engine.dispose()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env |= {"KVCTL_DB_URL": sqlite_url, "KVCTL_ACTOR": "bob@laptop"}

    def kvctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvctl", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    status = kvctl("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["nodes"][0]["up"] is True
    flush = kvctl("flush", "--tier", "disk", "--all", "--yes")
    assert flush.returncode == 0, flush.stderr
    audit = kvctl("audit", "--json")
    rows = json.loads(audit.stdout)
    assert [(r["actor"], r["action"], r["target"], r["ok"]) for r in rows] == [
        ("bob@laptop", "flush", "gpu-a", True)
    ]
    env["COLUMNS"] = "200"  # wide enough that no cell is cut short
    table = kvctl("audit", "--action", "flush")
    assert "bob@laptop" in table.stdout and "tier=disk" in table.stdout


def test_a_node_that_is_not_an_agent_is_that_nodes_failure(
    fleet: str, db: Engine, agents: Any
) -> None:
    with web_page_url() as url:
        with db.begin() as conn:
            add_node(conn, "web", dc="ams", agent_url=url)
        status = _run("status", "--db", fleet, "--json")
        assert status.exit_code == 0, status.output
        web = next(n for n in json.loads(status.stdout)["nodes"] if n["node"] == "web")
        assert not web["up"] and web["error"]
        out = _run("flush", "--db", fleet, "-n", "web", "-n", "gpu-a", "--tier", "cpu", "--json")
        assert out.exit_code == 1 and "Traceback" not in out.output
        doc = json.loads(out.stdout)
        assert doc["failed"] == ["web"]
        assert {r.target: r.ok for r in _audit(db)} == {"web": False, "gpu-a": True}


@pytest.mark.parametrize(
    ("option", "content", "message"),
    [
        (["evict", "--keys-file"], None, "cannot read --keys-file {path}: it is a directory"),
        (["pin", "--tokens"], None, "cannot read --tokens {path}: it is a directory"),
        (["lookup", "--tokens"], None, "cannot read --tokens {path}: it is a directory"),
        (["pin", "--tokens"], b"12 \xff 7", "cannot read --tokens {path}: not UTF-8 text"),
        (["evict", "--keys-file"], b"\xfe\xff", "cannot read --keys-file {path}: not UTF-8"),
        # an agent answers a negative id with a 422, and the action was a node's failure
        (["pin", "--tokens"], b"1 2 -5", "token #3 is -5: token ids are 0..4294967295"),
        # before: "give a prompt ... or its keys", though a keys file was given
        (["evict", "--keys-file"], b"# none yet\n\n", "--keys-file {path} names no key"),
    ],
)
def test_unreadable_files_and_bad_token_ids_are_refused_before_any_agent_is_asked(
    fleet: str, db: Engine, tmp_path: Any, option: list[str], content: bytes | None, message: str
) -> None:
    path = tmp_path / "given"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    command, flag = option
    out = _run(command, "--db", fleet, "-n", "gpu-a", flag, str(path))
    assert out.exit_code == 2, out.output
    said = "".join(out.output.split())  # long paths wrap at any character
    assert "".join(message.format(path=path).split()) in said and "Traceback" not in said
    with db.connect() as conn:
        assert conn.execute(select(func.count()).select_from(Audit)).scalar() == 0


def test_a_key_with_whitespace_around_it_is_taken(fleet: str, agents: Any) -> None:
    a, _ = agents
    keys = _store(a, PROMPT + " spaced")
    out = _run("evict", "--db", fleet, "-n", "gpu-a", "--key", f" {keys[0].hex()}\t", "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["nodes"][0]["result"]["done"] == 1
    assert a.control().lookup(keys=keys, count=False)["chunks"][0]["tier"] is None


def test_flush_demote_with_nothing_below_is_refused_by_the_agent_and_drops_nothing(
    fleet: str, db: Engine, tmp_path: Any
) -> None:
    # cpu is the bottom tier of an agent whose disk is off: only the agent knows that
    with running_agent(tmp_path / "c", "--name", "gpu-c", "--cpu", "8MiB", "--disk", "0") as c:
        with db.begin() as conn:
            add_node(conn, "gpu-c", dc="fra", agent_url=c.state.control_url)
        keys = _store(c, PROMPT + " bottom")
        out = _run("flush", "--db", fleet, "-n", "gpu-c", "--tier", "cpu", "--demote")
        assert out.exit_code == 1
        said = " ".join(out.output.split())
        assert "cannot demote the cpu tier's chunks: no tier is below it" in said
        assert [ch["tier"] for ch in c.control().lookup(keys=keys, count=False)["chunks"]] == [
            "cpu",
            "cpu",
        ]
        assert c.control().stats()["stats"]["tiers"]["cpu"]["evictions"].get("flush", 0) == 0
    assert not _audit(db)[0].ok


def test_status_shows_an_agent_that_refuses_the_token_as_up(
    fleet: str, db: Engine, tmp_path: Any
) -> None:
    with running_agent(tmp_path / "t", "--cpu", "8MiB", "--disk", "0", token="t0k") as t:
        with db.begin() as conn:
            add_node(conn, "gpu-t", dc="ams", agent_url=t.state.control_url)
        env = {"KVCTL_TOKEN": None}
        out = runner.invoke(app, ["status", "--db", fleet, "--dc", "ams", "--json"], env=env)
        wide = env | {"COLUMNS": "200"}  # no cell wrapped
        table = runner.invoke(app, ["status", "--db", fleet, "--dc", "ams"], env=wide)
    assert out.exit_code == 0, out.output
    nodes = {n["node"]: n for n in json.loads(out.stdout)["nodes"]}
    assert nodes["gpu-t"]["up"] is True and nodes["gpu-t"]["auth_refused"] is True
    assert "is up but needs a token" in nodes["gpu-t"]["error"]
    assert nodes["gpu-down"]["up"] is False and nodes["gpu-down"]["auth_refused"] is False
    said = " ".join(table.output.split())
    assert "up, token refused" in said and "gpu-t down" not in said and "KVCTL_TOKEN" in said


def test_status_shows_an_agent_still_opening_its_tiers_as_up_starting_not_down(
    fleet: str, db: Engine
) -> None:
    # restarting an agent that is merely starting would only start it over
    with starting_url() as url:
        with db.begin() as conn:
            add_node(conn, "gpu-s", dc="ams", agent_url=url)
        out = runner.invoke(app, ["status", "--db", fleet, "--dc", "ams", "--json"])
        wide = {"COLUMNS": "200"}  # no cell wrapped
        table = runner.invoke(app, ["status", "--db", fleet, "--dc", "ams"], env=wide)
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    nodes = {n["node"]: n for n in doc["nodes"]}
    s = nodes["gpu-s"]
    assert (s["up"], s["starting"], s["auth_refused"], s["state"]) == (
        True,
        True,
        False,
        "starting",
    )
    assert s["error"].startswith("the agent is starting") and s["hit_ratio"] is None
    assert s["last_seen_ms"] is not None  # it answered now
    assert nodes["gpu-down"]["starting"] is False and nodes["gpu-down"]["state"] == "down"
    ams = next(d for d in doc["dcs"] if d["dc"] == "ams")
    assert ams["up"] == 1 and ams["lookups"] is None  # up, and nothing of it counted
    said = " ".join(table.output.split())
    assert table.exit_code == 0, table.output
    assert "up, starting" in said and "gpu-s down" not in said
    assert "opening its tiers" in said


def test_a_node_answering_404_pages_gets_a_short_reason(fleet: str, db: Engine) -> None:
    page = b"<!DOCTYPE HTML>\n<html>\n" + b"<p>Nothing matches the given URI.</p>\n" * 200
    for body, shown in ((page, "(<!DOCTYPE HTML>)"), (b"", "(empty body)")):
        with answering_url(404, body) as url:
            with db.begin() as conn:
                add_node(conn, f"web{len(body)}", dc="ams", agent_url=url)
            out = _run("status", "--db", fleet, "--node", f"web{len(body)}", "--json")
        (node,) = json.loads(out.stdout)["nodes"]
        assert node["error"].startswith(f"HTTP 404 from {url}/v1/stats {shown}")
        assert "not a kvctl agent's control API?" in node["error"] and len(node["error"]) < 200


def test_keys_computes_what_lookup_shows_for_an_agent_with_default_settings(
    fleet: str, agents: Any
) -> None:
    # the bad-key hint sends operators to `kvctl keys --text`: it must give the node's keys
    text = PROMPT + " same keys"
    offline = json.loads(_run("keys", "--text", text, "--json").stdout)
    looked_up = json.loads(
        _run("lookup", "--db", fleet, "-n", "gpu-a", "--text", text, "--json").stdout
    )
    assert [ch["key"] for ch in offline["chunks"]] == [
        ch["key"] for ch in looked_up["nodes"][0]["chunks"]
    ]
    assert len(offline["chunks"]) == 2
