"""Chunks reads asked for, and those not here, counted per op (``/v1/stats`` dataplane and
``kvctl_dataplane_read_chunks_total``) and shown by ``kvctl agent status``. A lookup counts its
hits when it answers; an engine that reads later (the vLLM connector's worker, a replay) loses
a hit whose chunk was evicted in between, and a figures audit found such a fleet counting 7,005
hits where 4,507 were read, with nothing on the agent to tell the two apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.functional.agents import Agent, key, metric, payload, running_agent

CHUNK_BYTES = 64 << 10
READ_CHUNKS = "kvctl_dataplane_read_chunks_total"


def _status(agent: Agent, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "kvctl",
            "agent",
            "status",
            "--data-dir",
            str(agent.data_dir),
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_reads_of_chunks_evicted_since_their_lookup_are_counted_missing(tmp_path: Path) -> None:
    with running_agent(tmp_path / "a", "--disk", "0", "--cpu", "16MiB") as a:
        keys = [key(i, space=7) for i in range(4)]
        with a.data() as d:
            d.put_many([(k, payload(k, CHUNK_BYTES)) for k in keys], tenant="t1")
            assert d.lookup(keys, tenant="t1").matched_chunks == 4  # 4 hits, counted now
        assert a.control().stats()["dataplane"]["read_chunks"] == 0  # a lookup reads nothing
        a.control().evict([keys[2], keys[3]])  # gone before the engine reads them
        with a.data() as d:
            got = d.get_many(keys, tenant="t1")
        assert [g is not None for g in got] == [True, True, False, False]
        counts = a.control().stats()["dataplane"]
        assert (counts["read_chunks"], counts["read_missing_chunks"]) == (4, 2)
        assert metric(a, READ_CHUNKS, op="get", outcome="found") == 2
        assert metric(a, READ_CHUNKS, op="get", outcome="missing") == 2

        # a same-host engine's LEASE
        with a.data(transport="unix") as d, d.leased(keys[:3], tenant="t1") as held:
            assert [held.valid(i) for i in range(3)] == [True, True, False]
        assert metric(a, READ_CHUNKS, op="lease", outcome="found") == 2
        assert metric(a, READ_CHUNKS, op="lease", outcome="missing") == 1

        # a peer's FETCH with bytes counts on /metrics only (the read it serves is counted on
        # that peer); a metadata-only probe not at all
        with a.data() as d:
            assert [x is not None for x in d.fetch(keys[1:3], tenant="t1")] == [True, False]
            d.fetch(keys, tenant="t1", payload=False)
        assert metric(a, READ_CHUNKS, op="fetch", outcome="found") == 1
        assert metric(a, READ_CHUNKS, op="fetch", outcome="missing") == 1
        counts = a.control().stats()["dataplane"]
        assert (counts["read_chunks"], counts["read_missing_chunks"]) == (7, 3)

        out = _status(a, tmp_path, "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert (report["read_chunks"], report["read_missing_chunks"]) == (7, 3)
        assert report["read_missing_ratio"] == 3 / 7  # named as `kvctl status --json` names it
        out = _status(a, tmp_path)
        assert out.returncode == 0, out.stderr
        said = " ".join(out.stdout.split())
        assert "3 chunks of 7 reads asked for (42.9%) were not here" in said, said


def _reads(agent: Agent) -> tuple[int, int]:
    counts = agent.control().stats()["dataplane"]
    return counts["read_chunks"], counts["read_missing_chunks"]


def test_a_same_host_read_of_a_chunk_it_cannot_lease_counts_it_once(tmp_path: Path) -> None:
    """A chunk pinned on disk is not leasable: the LEASE answers FALLBACK (and counts it
    served) and the client reads it again with GET_COUNTED, which counts nothing. Counted at
    neither, 3 chunks read showed as 2."""
    with running_agent(tmp_path / "a", "--cpu", "8MiB", "--disk", "64MiB") as a:
        keys = [key(i, 8) for i in range(3)]
        with a.data("unix") as d:
            assert d.shm and d.takes_get_counted
            d.put_many([(k, payload(k, CHUNK_BYTES)) for k in keys])
            assert a.control().pin([keys[2]], tier="disk")["done"] == 1
            got = d.get_many(keys)
        assert [g is not None for g in got] == [True, True, True]
        assert _reads(a) == (3, 0)
        assert metric(a, READ_CHUNKS, op="lease", outcome="found") == 3
        assert metric(a, READ_CHUNKS, op="get", outcome="found") == 0


def test_a_key_named_twice_in_a_get_is_one_read_as_in_a_lease(tmp_path: Path) -> None:
    with running_agent(tmp_path / "a", "--cpu", "8MiB", "--disk", "0") as a:
        k, gone = key(0, 9), key(1, 9)
        with a.data() as d:
            d.put(k, payload(k, CHUNK_BYTES))
            got = d.get_many([k, gone, k, gone])
        assert [g is not None for g in got] == [True, False, True, False]
        assert _reads(a) == (2, 1)


def test_a_read_pulled_from_a_peer_is_counted_once_in_the_fleet(tmp_path: Path) -> None:
    """A node's GET of chunks its lookup found on a peer pulls them with a FETCH there: the
    read is the node's. Counted by both, the fleet's sums (the collector adds the nodes'
    counts) read 8 chunks for 4 hits, and a chunk gone from the peer would be 2 missing."""
    small = ("--disk", "0", "--cpu", "64MiB")
    with running_agent(tmp_path / "b", "--name", "b", *small) as b:
        peer = ("--peer", f"b={b.state.data_tcp}", "--link", "b:override=fetch")
        with running_agent(tmp_path / "a", "--name", "a", *small, *peer) as a:
            keys = [key(i, 10) for i in range(4)]
            with b.data() as d:
                d.put_many([(k, payload(k, CHUNK_BYTES)) for k in keys], tenant="t1")
            with a.data() as d:
                assert set(d.lookup(keys, tenant="t1").locations) == {"peer"}
                got = d.get_many(keys, tenant="t1")
            assert [g is not None for g in got] == [True] * 4
            assert _reads(a) == (4, 0)
            assert _reads(b) == (0, 0)  # its FETCH, on /metrics only
            assert metric(b, READ_CHUNKS, op="fetch", outcome="found") == 4


def _inventory(url: str, nodes: dict[str, tuple[str, str]]) -> None:
    """nodes: name -> (dc, agent URL)."""
    from kvctl.db.inventory import add_dc, add_node
    from kvctl.db.migrate import open_db

    engine = open_db(url, auto_upgrade=True)
    try:
        with engine.begin() as conn:
            for dc in sorted({dc for dc, _ in nodes.values()}):
                add_dc(conn, dc)
            for name, (dc, agent_url) in nodes.items():
                add_node(conn, name, dc=dc, agent_url=agent_url)
    finally:
        engine.dispose()


def reads_gone_case(agent: Agent) -> None:
    """6 chunks of t1 looked up by t1 (6 reuse hits) and 2 of them by t2 (2 sharing hits), all
    in cpu; then 2 evicted before t1's engine reads the 6: 6 reads, 2 gone."""
    keys = [key(i, space=11) for i in range(6)]
    with agent.data() as d:
        d.put_many([(k, payload(k, CHUNK_BYTES)) for k in keys], tenant="t1")
        assert d.lookup(keys, tenant="t1").matched_chunks == 6
        assert d.lookup(keys[:2], tenant="t2").matched_chunks == 2
        agent.control().evict(keys[4:])
        assert sum(g is None for g in d.get_many(keys, tenant="t1")) == 2
    assert _reads(agent) == (6, 2)


def test_live_status_shows_the_reads_gone_and_each_tiers_reuse_and_sharing(
    tmp_path: Path, sqlite_url: str
) -> None:
    """`kvctl status` (live, no --window) from real agents: a node whose engine read 6 chunks,
    2 of them evicted since their lookup, and an idle node (no reads: N/A, not 0%)."""
    from typer.testing import CliRunner

    from kvctl.cli.main import app

    small = ("--disk", "0", "--cpu", "16MiB")
    with (
        running_agent(tmp_path / "a", "--name", "n1", *small) as a,
        running_agent(tmp_path / "b", "--name", "n2", *small) as b,
    ):
        _inventory(
            sqlite_url, {"n1": ("fra", a.state.control_url), "n2": ("ams", b.state.control_url)}
        )
        reads_gone_case(a)
        runner = CliRunner()
        out = runner.invoke(app, ["status", "--db", sqlite_url, "--json"])
        assert out.exit_code == 0, out.output
        doc = json.loads(out.stdout)
        table = runner.invoke(app, ["status", "--db", sqlite_url], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    nodes = {n["node"]: n for n in doc["nodes"]}
    dcs = {d["dc"]: d for d in doc["dcs"]}
    for scope in (nodes["n1"], dcs["fra"], doc["total"]):
        assert (scope["read_chunks"], scope["read_missing_chunks"]) == (6, 2), scope
        assert scope["read_missing_ratio"] == 2 / 6
        # 8 lookups: cpu served 6 reuse and 2 sharing hits
        cpu = scope["tiers"]["cpu"]
        assert (cpu["hits"], cpu["reuse_hits"], cpu["sharing_hits"]) == (8, 6, 2), cpu
        assert (cpu["hit_ratio"], cpu["reuse_hit_ratio"], cpu["sharing_hit_ratio"]) == (
            1.0,
            0.75,
            0.25,
        )
    # beside the tier's occupancy, as before
    assert nodes["n1"]["tiers"]["cpu"]["capacity_bytes"] == 16 << 20
    assert doc["total"]["tiers"]["cpu"]["capacity_bytes"] == 32 << 20
    # an idle agent reports its reads: 0, so the share is unknown, not 0%
    idle = nodes["n2"]
    assert (idle["read_chunks"], idle["read_missing_chunks"], idle["read_missing_ratio"]) == (
        0,
        0,
        None,
    )
    assert idle["tiers"]["cpu"]["hits"] == 0 and idle["tiers"]["cpu"]["reuse_hit_ratio"] is None
    lines = table.stdout.splitlines()
    assert any("reads gone" in line for line in lines), table.stdout
    n1 = next(line for line in lines if line.startswith("│ n1"))
    n2 = next(line for line in lines if line.startswith("│ n2"))
    assert "33.3%" in n1 and "N/A" in n2, table.stdout
    split = lines.index(
        next(line for line in lines if line.startswith("reuse / sharing hit ratio"))
    )
    fra = next(line for line in lines[split:] if "fra" in line)
    assert "75.0% / 25.0%" in fra, table.stdout
