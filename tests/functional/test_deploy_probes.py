"""The Kubernetes probes' script (deploy/kubernetes/base/daemonset.yaml) run against a real
agent with a token: it passes with the pod's token and fails with a wrong one, without one and
when nothing answers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.functional.agents import closed_port, running_agent
from tests.unit.test_deploy_kubernetes import probe_script

TOKEN = "probe-token-" + "b" * 40
POD_ADDRESS = "127.0.0.1:7070"


def _probe(script: str, address: str, token: str | None) -> subprocess.CompletedProcess[str]:
    assert script.count(POD_ADDRESS) == 1
    env = {k: v for k, v in os.environ.items() if k != "KVCTL_TOKEN"}
    if token is not None:
        env["KVCTL_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-c", script.replace(POD_ADDRESS, address)],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_probe_passes_only_with_the_agents_token(tmp_path: Path) -> None:
    script = probe_script()
    with running_agent(tmp_path / "agent", "--cpu", "64MiB", "--disk", "0", token=TOKEN) as agent:
        address = agent.state.control_url.removeprefix("http://")
        ok = _probe(script, address, TOKEN)
        assert ok.returncode == 0, ok.stderr
        wrong = _probe(script, address, "not-the-token")
        assert wrong.returncode == 1 and "401" in wrong.stderr, wrong.stderr
        missing = _probe(script, address, None)
        assert missing.returncode == 1 and "KVCTL_TOKEN" in missing.stderr, missing.stderr
    down = _probe(script, f"127.0.0.1:{closed_port()}", TOKEN)
    assert down.returncode == 1 and "Connection refused" in down.stderr, down.stderr
