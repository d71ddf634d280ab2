"""A real `kvctl router serve` process, operated: its log at --log-level info is not one line
per poll of every agent."""

from __future__ import annotations

import time

from tests.functional.routers import running_router
from tests.unit.test_index_follower import scripted

TOKEN = "serve-ops-token"


def _script() -> dict[str, object]:
    return {"instance": "one", "events": [], "items": []}


def test_info_logs_are_not_one_line_per_poll(tmp_path) -> None:  # type: ignore[no-untyped-def]
    token_file = tmp_path / "router.token"
    token_file.write_text(TOKEN + "\n")
    with scripted(_script()) as agent_url:
        args = ["--agent", f"a1={agent_url}@fra", "--token-file", str(token_file)]
        args += ["--log-level", "info", "--poll-s", "0.05"]
        with running_router(args, token=TOKEN) as router:
            time.sleep(1.0)  # about 20 polls
            assert router.http.get("/v1/health").json()["followers_up"] == 1
        assert router.proc.stdout is not None
        log = router.proc.stdout.read()
    assert "a1: resynced" in log  # info from kvctl itself still shows
    assert "HTTP Request" not in log, log[-2000:]
