"""An agent's runtime and data plane served in the test's own process, on a Unix socket and a
loopback TCP port: for tests that need the store's internals beside a real data plane."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvctl.agent.dataplane import DataPlaneServer
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.store.store import TieredStore
from kvctl.store.tiers.base import Tier


class InProcessNode:
    def __init__(
        self, tmp_path: Path, settings: AgentSettings, tiers: list[Tier], **server: Any
    ) -> None:
        self.store = TieredStore(tiers, chunk_tokens=settings.chunk_tokens)
        self.runtime = AgentRuntime(settings, self.store)
        self.server = DataPlaneServer(self.runtime, **server)
        self.unix = str(self.server.listen_unix(tmp_path / "data.sock"))
        self.tcp = self.server.listen_tcp("127.0.0.1", 0)
        self.server.start()

    def leases(self) -> int:
        return int(self.store.snapshot()["leases"])

    def lookups(self) -> int:
        return int(self.store.snapshot()["stats"]["lookups"])

    def close(self) -> None:
        self.server.stop()
        self.runtime.close()
