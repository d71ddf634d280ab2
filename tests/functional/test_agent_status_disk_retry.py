"""`kvctl agent status` on an agent whose disk tier could not be opened at start: the tier is
said unavailable with its retries and the next one, then, once its directory is fixed and a
retry brought it online, it is a row of the table like any tier (no restart)."""

from __future__ import annotations

import json
from pathlib import Path

from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from tests.functional.test_agent_status_impossible_values import _agent_status
from tests.functional.test_collector_impossible_values import StandIn


def _answer(stand_in: StandIn, runtime: AgentRuntime) -> None:
    """The runtime's own /v1/info and /v1/stats, as its control API writes them."""
    stand_in.answers["/v1/info"] = json.loads(json.dumps(runtime.info()))
    stand_in.answers["/v1/stats"] = json.loads(json.dumps(runtime.stats()))


def test_status_says_the_disk_tier_is_retried_then_shows_it_online(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.write_bytes(b"not a directory")
    settings = AgentSettings(
        name="n1", data_dir=str(tmp_path), cpu_bytes=1 << 20, disk_bytes=4 << 20, shm=False
    )
    runtime = AgentRuntime.open(settings, disk_retry_first_s=3600, disk_retry_max_s=3600)
    stand_in = StandIn("n1")
    try:
        retry = runtime.disk_retry
        assert retry is not None and retry.try_now() is False
        _answer(stand_in, runtime)
        run = _agent_status(stand_in.url)
        assert run.returncode == 0, run.stderr
        said = " ".join(run.stdout.split())
        assert f"disk tier unavailable (asked for 4 MiB on {disk}; 1 retry so far, next in" in said
        assert "cannot use directory" in said, said

        disk.unlink()
        assert retry.try_now() is True
        _answer(stand_in, runtime)
        run = _agent_status(stand_in.url)
        assert run.returncode == 0, run.stderr
        said = " ".join(run.stdout.split())
        assert "unavailable" not in said, said
        rows = [line.split() for line in run.stdout.splitlines() if "disk" in line]
        assert any(row[:2] == ["│", "disk"] and "4 MiB" in " ".join(row) for row in rows), said
        report = json.loads(_agent_status(stand_in.url, "--json").stdout)
        assert report["info"]["unavailable_tiers"] == []
        assert [t["name"] for t in report["info"]["tiers"]] == ["cpu", "disk"]
    finally:
        stand_in.close()
        runtime.close()
