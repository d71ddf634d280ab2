"""Settings files no agent will read, left in a data dir, are removed when an agent starts
there: an older build's agent-settings.toml (one for every start, left by a start killed
midway, token and all) and an agent-settings.PID.toml whose start (PID) is gone. Nothing reads
them; they only kept a secret on disk. A live start's own file is left to it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.functional.agents import running_agent

SECRET = 'token = "left-t0ken-s3cret"\n'


def test_an_agent_removes_settings_no_agent_will_read(tmp_path: Path) -> None:
    data_dir = tmp_path / "agent"
    data_dir.mkdir(mode=0o700)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a start that died before its agent read its settings
    # a start still running (its argv names kvctl, as a `kvctl agent start` does)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "kvctl"])
    try:
        old = data_dir / "agent-settings.toml"
        dead = data_dir / f"agent-settings.{gone.pid}.toml"
        kept = data_dir / f"agent-settings.{live.pid}.toml"
        for path in (old, dead, kept):
            path.write_text("[agent]\n" + SECRET)
            path.chmod(0o600)
        with running_agent(data_dir, "--cpu", "8MiB", "--disk", "0") as agent:
            assert not old.exists() and not dead.exists()
            assert kept.read_text() == "[agent]\n" + SECRET
            said = agent.log()
            assert f"removed {old}: settings a start killed midway left" in said, said
            assert f"removed {dead}" in said and str(kept) not in said
    finally:
        live.kill()
        live.wait()
