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

        with a.data() as d:  # a peer's FETCH with bytes counts; a metadata-only probe does not
            assert [x is not None for x in d.fetch(keys[1:3], tenant="t1")] == [True, False]
            d.fetch(keys, tenant="t1", payload=False)
        assert metric(a, READ_CHUNKS, op="fetch", outcome="found") == 1
        assert metric(a, READ_CHUNKS, op="fetch", outcome="missing") == 1
        counts = a.control().stats()["dataplane"]
        assert (counts["read_chunks"], counts["read_missing_chunks"]) == (9, 4)

        out = _status(a, tmp_path, "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert (report["read_chunks"], report["read_missing_chunks"]) == (9, 4)
        out = _status(a, tmp_path)
        assert out.returncode == 0, out.stderr
        said = " ".join(out.stdout.split())
        assert "4 chunks of 9 reads asked for (44.4%) were not here" in said, said
