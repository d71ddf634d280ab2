"""PUT chunks an agent refused as damaged on the way (their bytes did not match their sender's
XXH3-64) are counted in ``/v1/stats`` (``dataplane.corrupt_puts``) as on ``/metrics``, and
``kvctl agent status`` shows them: before, only a Prometheus scrape told an operator that a
writer's NIC or link damaged what it sent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvctl.wire.protocol import Status, chunk_checksum, put_meta
from tests.functional.agents import Agent, metric
from tests.functional.test_put_checksums import (
    CHUNK_BYTES,
    CORRUPT_PUTS,
    RawConnection,
    _batch,
    agent,  # noqa: F401 - fixture
    raw,  # noqa: F401 - fixture
)


def _status(data_dir: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    return subprocess.run(
        [sys.executable, "-m", "kvctl", "agent", "status", "--data-dir", str(data_dir), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_refused_corrupt_puts_are_in_stats_and_agent_status(
    agent: Agent,  # noqa: F811
    raw: RawConnection,  # noqa: F811
    tmp_path: Path,
) -> None:
    counts = agent.control().stats()["dataplane"]
    assert (counts["corrupt_puts"], counts["no_room_puts"]) == (0, 0)
    assert "PUT chunk" not in _status(tmp_path / "a", tmp_path).stdout

    _keys, chunks, items = _batch(seed=83)
    meta = put_meta("t1", items, [chunk_checksum(c) for c in chunks])
    damaged = [bytearray(c) for c in chunks[:2]]
    for d in damaged:
        d[CHUNK_BYTES // 3] ^= 0x04  # after the checksum was computed: as if on the way
    assert raw.put(meta, bytes(damaged[0]) + bytes(damaged[1]) + chunks[2]) == [
        Status.CORRUPT,
        Status.CORRUPT,
        Status.OK,
    ]
    assert agent.control().stats()["dataplane"]["corrupt_puts"] == 2
    assert metric(agent, CORRUPT_PUTS) == 2  # the same count

    out = _status(tmp_path / "a", tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["corrupt_puts"] == 2
    out = _status(tmp_path / "a", tmp_path)
    assert "refused 2 PUT chunks whose bytes did not match" in " ".join(out.stdout.split())
