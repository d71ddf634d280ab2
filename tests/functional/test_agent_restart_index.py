"""A real agent restarted on its data dir: after a clean stop its disk tier opens from the index
the stop left (no chunk file's header read), after a kill -9 it scans every file; either way it
serves the same chunks, byte for byte."""

from __future__ import annotations

from pathlib import Path

from kvctl.store.tiers.disk_index import INDEX_NAME

from .agents import Agent, key, payload, start_agent

CHUNK = 64 << 10
ARGS = ("--cpu", "1MiB", "--disk", "64MiB")


def _spill(agent: Agent, n: int) -> list[bytes]:
    keys = [key(i, 7) for i in range(n)]
    with agent.data("tcp") as c:
        assert {o.status for o in c.put_many([(k, payload(k, CHUNK)) for k in keys])} == {"stored"}
    agent.control().move(keys, "disk")
    return keys


def _serves(agent: Agent, keys: list[bytes]) -> None:
    with agent.data("tcp") as c:
        assert c.exists(keys) == ["disk"] * len(keys)
        got = c.get_many(keys)
    assert [None if g is None else bytes(g) for g in got] == [payload(k, CHUNK) for k in keys]


def _scan_line(agent: Agent) -> str:
    return [line for line in agent.log().splitlines() if "disk tier disk: scanned" in line][-1]


def test_a_clean_stop_leaves_an_index_the_restart_reads_and_a_kill_leaves_none(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "a"
    agent = start_agent(data_dir, *ARGS)
    try:
        keys = _spill(agent, 12)
        assert agent.stop() == 0
        assert (data_dir / "disk" / INDEX_NAME).is_file()

        agent = start_agent(data_dir, *ARGS)
        assert _scan_line(agent).endswith(", 12 of them from its clean-close index")
        assert not (data_dir / "disk" / INDEX_NAME).exists()  # taken away: a crash now scans
        _serves(agent, keys)
        agent.control().move(keys, "disk")  # (a read takes a disk chunk up into the cpu tier)
        agent.kill9()
        assert not (data_dir / "disk" / INDEX_NAME).exists()

        agent = start_agent(data_dir, *ARGS)
        said = _scan_line(agent)
        assert ": 12 files, 12 chunks (" in said and "clean-close index" not in said, said
        _serves(agent, keys)
    finally:
        if agent.proc.poll() is None:
            assert agent.stop() == 0
