"""A real agent asked for a gpu tier: without CUDA it starts without the tier, serves from cpu,
and says why (log, /v1/info, `kvctl agent status`); with CUDA the tier is on top."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.store.tiers.gpu import gpu_available

from .agents import key, payload, running_agent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the agent's shm path is Linux")

CHUNK = 256 << 10
GPU_OK, GPU_DETAIL = gpu_available()


def status_text(data_dir: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["XDG_CONFIG_HOME"] = str(data_dir / "xdg")
    out = subprocess.run(
        [sys.executable, "-m", "kvctl", "agent", "status", "--data-dir", str(data_dir)],
        capture_output=True, text=True, env={**env, "COLUMNS": "200"}, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.skipif(GPU_OK, reason="this machine has CUDA: the gpu tier is built")
def test_agent_without_cuda_starts_serves_on_cpu_and_says_why(tmp_path: Path) -> None:
    data_dir = tmp_path / "a"
    args = ("--cpu", "8MiB", "--disk", "0", "--gpu-capacity", "64MiB", "--gpu-device", "cuda:0")
    with running_agent(data_dir, *args) as agent:
        info = agent.control().info()
        assert [t["name"] for t in info["tiers"]] == ["cpu"]
        assert info["unavailable_tiers"] == [
            {"name": "gpu", "capacity_bytes": 64 << 20, "device": "cuda:0", "reason": GPU_DETAIL}
        ]
        keys = [key(i, 40) for i in range(6)]
        for transport, shm in (("tcp", False), ("unix", True)):
            with agent.data(transport, use_shm=shm) as c:
                assert c.shm is shm
                assert c.tiers == ["cpu"]
                for k in keys:
                    assert c.put(k, payload(k, CHUNK)) == "cpu"
                for k in keys:
                    assert bytes(c.get(k)) == payload(k, CHUNK)
        assert "gpu tier unavailable" in status_text(data_dir)
        assert GPU_DETAIL in status_text(data_dir).replace("\n", " ")
    log = agent.log()
    assert log.count("gpu tier unavailable") == 1 and GPU_DETAIL in log


@pytest.mark.skipif(not GPU_OK, reason=f"needs CUDA: {GPU_DETAIL}")
def test_agent_with_cuda_puts_chunks_in_the_gpu_tier(tmp_path: Path) -> None:
    args = ("--cpu", "8MiB", "--disk", "0", "--gpu-capacity", "4MiB")
    with running_agent(tmp_path / "a", *args) as agent:
        info = agent.control().info()
        assert [t["name"] for t in info["tiers"]] == ["gpu", "cpu"]
        assert info["unavailable_tiers"] == []
        keys = [key(i, 41) for i in range(24)]  # 6 MiB through a 4 MiB gpu tier
        with agent.data("tcp") as c:
            assert c.put(keys[0], payload(keys[0], CHUNK)) == "gpu"
            for k in keys[1:]:
                assert c.put(k, payload(k, CHUNK)) in ("gpu", "cpu")
            assert set(c.exists(keys)) == {"gpu", "cpu"}
            for k in keys:  # gpu chunks are read through the cpu tier, in place
                assert bytes(c.get(k)) == payload(k, CHUNK)
        with agent.data("unix") as c:
            for k in keys:
                assert bytes(c.get(k)) == payload(k, CHUNK)
        stats = agent.control().stats()
        assert stats["stats"]["tiers"]["cpu"]["demotions"] > 0
        assert stats["leases"] == 0
