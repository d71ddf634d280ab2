"""A PUT chunk no tier can take reaches the client with its likely causes, and the agent's log
with the store's reason. Before, a chunk refused because the disk tier's filesystem was full
(not its --disk budget) was a bare per-chunk NO_ROOM ('no room for chunk ...'): nothing said
why, nor where to look. Now the NO_ROOM item's tier code names the tier whose filesystem was
full (a field the protocol already has: older agents send NO_TIER, older clients take it for a
tier name they do not use), the SDK's NoRoom names the causes and `kvctl agent status`, and the
agent logs the store's reason (once a minute at most)."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import pytest

from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.client import DataClient, NoRoom
from kvctl.store.store import TieredStore
from kvctl.store.tiers.cpu import CpuTier
from kvctl.store.tiers.disk import DiskTier
from tests.functional.agents import key, payload
from tests.functional.test_agent_status_impossible_values import _agent_status
from tests.functional.test_collector_impossible_values import StandIn
from tests.tmpfs import tmpfs

MIB = 1 << 20


class Node:
    """A 1 MiB cpu tier over a disk tier in ``disk_dir``, served over TCP in this process."""

    def __init__(self, tmp_path: Path, disk_dir: Path, disk_bytes: int) -> None:
        settings = AgentSettings(
            name="nr", data_dir=str(tmp_path), cpu_bytes=MIB, max_chunk_bytes=4 * MIB
        )
        store = TieredStore([CpuTier(MIB), DiskTier(disk_dir, disk_bytes)], eviction="lru")
        self.runtime = AgentRuntime(settings, store)
        self.server = DataPlaneServer(self.runtime)
        host, port = self.server.listen_tcp("127.0.0.1", 0)[:2]
        self.server.start()
        self.client = DataClient.connect(f"{host}:{port}")

    def close(self) -> None:
        self.client.close()
        self.server.stop()
        self.runtime.close()


def test_a_put_refused_by_a_full_filesystem_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with tmpfs(tmp_path / "fs", "4m") as fs:
        node = Node(tmp_path, fs / "tier", 64 * MIB)  # the budget is not what is short
        try:
            with open(fs / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
                f.write(b"\0" * 4 * MIB)
            caplog.set_level(logging.WARNING, logger="kvctl.agent.dataplane")
            # 2 MiB: more than the cpu tier, so only the disk tier could take it
            [out] = node.client.put_many([(key(1), payload(key(1), 2 * MIB))])
            assert (out.status, out.tier) == ("no_room", "disk")
            with pytest.raises(NoRoom) as info:
                node.client.put(key(1), payload(key(1), 2 * MIB))
            said = str(info.value)
            assert "disk tier found its filesystem full" in said, said
            assert "`kvctl agent status`" in said, said
            logged = [r.getMessage() for r in caplog.records if "NO_ROOM" in r.getMessage()]
            assert logged and "its filesystem is full (0 bytes free" in logged[0], logged
            assert len(logged) == 1  # the second within the minute is counted, not logged
            assert node.server.no_room_puts.total == 2
            # the connection is in step, and space coming back is taken at once
            (fs / "filler").unlink()
            assert node.client.put(key(1), payload(key(1), 2 * MIB)) == "disk"
        finally:
            node.close()


def test_a_put_refused_for_another_reason_names_the_likely_causes(tmp_path: Path) -> None:
    node = Node(tmp_path, tmp_path / "disk", MIB)  # 2 MiB fits no tier
    try:
        [out] = node.client.put_many([(key(2), payload(key(2), 2 * MIB))])
        assert (out.status, out.tier) == ("no_room", None)
        with pytest.raises(NoRoom) as info:
            node.client.put(key(2), payload(key(2), 2 * MIB))
        said = str(info.value)
        assert "no tier of the agent could take it" in said and "larger than a tier" in said
        assert "`kvctl agent status`" in said, said
        # counted, in /v1/stats and on /metrics alike
        assert node.runtime.stats()["dataplane"]["no_room_puts"] == 2
        text = node.runtime.metrics.render()[0].decode()
        assert "kvctl_dataplane_no_room_puts_total 2.0" in text
        # and `kvctl agent status` says so, on the runtime's own answers
        stand_in = StandIn("nr")
        try:
            stand_in.answers["/v1/info"] = json.loads(json.dumps(node.runtime.info()))
            stand_in.answers["/v1/stats"] = json.loads(json.dumps(node.runtime.stats()))
            run = _agent_status(stand_in.url)
            assert run.returncode == 0, run.stderr
            assert "refused 2 PUT chunks for want of room" in " ".join(run.stdout.split())
            report = json.loads(_agent_status(stand_in.url, "--json").stdout)
            assert report["no_room_puts"] == 2
        finally:
            stand_in.close()
    finally:
        node.close()
