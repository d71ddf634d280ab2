"""A clean stop demotes the volatile tiers' chunks to disk, hottest first, so a restart keeps
the hot set (``stop_demote_seconds``; kvctl/agent/stop_demotion.py): real agents, stopped with
SIGTERM and started again on the same data dir."""

from __future__ import annotations

import threading
from pathlib import Path

from tests.functional.agents import Agent, key, payload, running_agent, start_agent

CHUNK = 64 << 10
N = 10


def _put(agent: Agent, keys: list[bytes]) -> None:
    with agent.data() as dc:
        for k in keys:
            dc.put(k, payload(k, CHUNK))


def _read(agent: Agent, keys: list[bytes]) -> None:
    with agent.data() as dc:
        for k in keys:
            assert dc.get(k) == payload(k, CHUNK)


def _where(agent: Agent, keys: list[bytes]) -> list[str | None]:
    with agent.data() as dc:
        return dc.exists(keys)


def _read_once_from_disk(agent: Agent, keys: list[bytes]) -> None:
    """The restart review's repro: stored, flushed down to disk, read once (now in cpu)."""
    _put(agent, keys)
    agent.control().flush("cpu", demote=True)
    assert _where(agent, keys) == ["disk"] * len(keys)
    _read(agent, keys)
    assert _where(agent, keys) == ["cpu"] * len(keys)


def test_a_clean_restart_keeps_chunks_read_from_disk(tmp_path: Path) -> None:
    keys = [key(i, 1) for i in range(N)]
    agent = start_agent(tmp_path, "--disk", "64MiB")
    _read_once_from_disk(agent, keys)
    assert agent.stop() == 0
    with running_agent(tmp_path, "--disk", "64MiB") as again:
        assert _where(again, keys) == ["disk"] * N  # before: [None] * 10
        _read(again, keys)
    assert "stop: demoted 10 chunks" in agent.log()


def test_stop_demote_seconds_0_keeps_the_old_behaviour(tmp_path: Path) -> None:
    keys = [key(i, 2) for i in range(N)]
    args = ("--disk", "64MiB", "--stop-demote-seconds", "0")
    agent = start_agent(tmp_path, *args)
    _read_once_from_disk(agent, keys)
    assert agent.stop() == 0
    with running_agent(tmp_path, *args) as again:
        assert _where(again, keys) == [None] * N


def test_pinned_chunks_are_not_moved(tmp_path: Path) -> None:
    keys = [key(i, 3) for i in range(N)]
    pinned, free = keys[:3], keys[3:]
    agent = start_agent(tmp_path, "--disk", "64MiB")
    _put(agent, keys)
    assert agent.control().pin(pinned, tier="cpu")["done"] == 3
    assert agent.stop() == 0
    with running_agent(tmp_path, "--disk", "64MiB") as again:
        # a pin holds its tier: the pinned chunks stayed in cpu and went with the process
        assert _where(again, pinned) == [None] * 3
        assert _where(again, free) == ["disk"] * len(free)
    assert "3 pinned (lost with the process)" in agent.log()


def test_hot_chunks_replace_colder_ones_on_a_full_disk(tmp_path: Path) -> None:
    """The disk holds fewer chunks than the cpu tier: the cold ones on disk make room, then
    the hottest of the cpu tier's (read last, under LRU) are kept, never evicted for colder."""
    args = ("--disk", "1MiB", "--eviction", "lru")
    cold = [key(i, 4) for i in range(40)]
    hot = [key(i, 5) for i in range(30)]
    agent = start_agent(tmp_path, *args)
    _put(agent, cold)
    agent.control().flush("cpu", demote=True)  # fills the disk; what does not fit is dropped
    on_disk = [k for k, t in zip(cold, _where(agent, cold), strict=True) if t == "disk"]
    room = len(on_disk)
    assert 10 <= room < len(hot)
    _put(agent, hot)
    _read(agent, hot)  # LRU: hot[-1] read last is the hottest
    assert set(_where(agent, hot)) == {"cpu"}
    assert agent.stop() == 0
    with running_agent(tmp_path, *args) as again:
        assert _where(again, cold) == [None] * len(cold)  # every cold one made room
        found = [t == "disk" for t in _where(again, hot)]
        assert found == [False] * (len(hot) - room) + [True] * room
        _read(again, hot[-room:])


def test_kill_9_during_the_demotion_leaves_only_intact_chunks(tmp_path: Path) -> None:
    """SIGTERM, then SIGKILL once the demotion has landed some chunks (a big one, fsync'd,
    300 MiB): the next start scans the disk tier and serves only whole chunks."""
    config = tmp_path / "agent.toml"
    config.write_text("[agent]\nfsync = true\n")
    args = ("--config", str(config), "--cpu", "512MiB", "--disk", "1GiB")
    big = 1 << 20
    keys = [key(i, 6) for i in range(300)]
    agent = start_agent(tmp_path, *args)
    with agent.data() as dc:
        for k in keys:
            dc.put(k, payload(k, big))
    disk = tmp_path / "disk"
    begun = threading.Event()

    def watch() -> None:  # until some chunks landed whole (or the agent exited meanwhile)
        while agent.proc.poll() is None and not begun.is_set():
            if len(list(disk.glob("*/*.kv"))) >= 20:
                begun.set()

    watcher = threading.Thread(target=watch)
    watcher.start()
    agent.proc.terminate()
    watcher.join(60)
    agent.kill9()
    with running_agent(tmp_path, *args) as again:
        tiers = _where(again, keys)
        assert set(tiers) <= {"disk", None}
        found = [k for k, t in zip(keys, tiers, strict=True) if t == "disk"]
        assert len(found) >= 20  # what had landed by the kill, or all of them
        with again.data() as dc:
            for k in found:
                assert dc.get(k) == payload(k, big)
    assert not list(disk.glob("*/.*.tmp"))
