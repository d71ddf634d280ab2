"""A control action whose audit trail cannot be written (its SQLite database on a full disk)
says which nodes were asked all the same, so acted unrecorded. Before, the command ended on
"database error: database or disk is full" alone: the agents already asked had pinned or
evicted, and the operator was told nothing of it, as if nothing had been done."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from pathlib import Path

from tests.functional.test_cli_failures_interrupt import GUARD_S, KEY, _agents, _cli
from tests.tmpfs import tmpfs


def test_an_audit_trail_on_a_full_disk_names_the_nodes_asked(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "2m") as small, _agents(2) as agents:
        db = f"sqlite:///{small / 'kvctl.db'}"
        _cli(db, "fleet", "add-dc", "fra")
        for name, agent in zip(("gpu-1", "gpu-2"), agents, strict=True):
            _cli(db, "fleet", "add-node", name, "--dc", "fra", "--agent-url", agent.url)

        def fill_then_answer() -> None:
            # once both are asked (the database open, the trail written to as they answer),
            # the disk fills to the last byte; then they answer
            for agent in agents:
                agent.asked.wait(GUARD_S)
            fd = os.open(small / "filler", os.O_WRONLY | os.O_CREAT)
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)
            os.close(fd)
            for agent in agents:
                agent.release.set()

        filler = threading.Thread(target=fill_then_answer)
        filler.start()
        # its own process: one that ends closes the database, which the tmpfs's unmount needs
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        out = subprocess.run(
            [sys.executable, "-m", "kvctl", "pin", "--all", "--yes", "--key", KEY,
             "--db", db, "--json"],
            capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, timeout=GUARD_S,
        )  # fmt: skip
        filler.join(GUARD_S)
        asked = [a.asked.is_set() for a in agents]
    said = " ".join((out.stdout + out.stderr).split())
    assert out.returncode == 2 and not out.stdout, said
    assert asked == [True, True], said
    assert "audit trail cannot be written" in said, said
    assert "gpu-1, gpu-2" in said and "not recorded" in said, said
