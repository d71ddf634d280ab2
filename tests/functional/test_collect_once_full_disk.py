"""`kvctl collect --once` on a SQLite file that cannot grow (a full disk: here the process's
file size limit, RLIMIT_FSIZE, so the kernel fails its writes with EFBIG): exit 1 saying the
batch is not recorded, the file intact, and the next run counts the increases that run could
not save. It said "keeping 5 rows for retry", a retry no single run makes."""

from __future__ import annotations

import os
import resource
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from tests.functional.agents import running_agent, traffic

pytestmark = pytest.mark.slow

#: SQLite's shared-memory index of the WAL is 32 KiB: it fits, a batch's WAL frames do not
FILE_LIMIT_BYTES = 32768 + 4096


def _collect_once(url: str, *, limit_bytes: int | None = None) -> subprocess.CompletedProcess[str]:
    def limited() -> None:
        if limit_bytes is not None:  # the soft limit: writes past it fail, the process lives
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))

    return subprocess.run(
        [sys.executable, "-m", "kvctl", "collect", "--once", "--no-links", "--db", url],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
        preexec_fn=limited,
        timeout=120,
        check=False,
    )


def test_collect_once_on_a_full_disk_says_what_is_not_recorded(tmp_path: Path) -> None:
    path = tmp_path / "metrics.db"
    url = f"sqlite:///{path}"
    db = open_db(url, auto_upgrade=True)
    try:
        with running_agent(tmp_path / "a1", "--name", "n1") as a1:
            with db.begin() as conn:
                add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
                add_node(conn, "n1", dc="fra", agent_url=a1.state.control_url)
            db.dispose()
            first = _collect_once(url)
            assert first.returncode == 0, first.stdout + first.stderr  # the baseline
            traffic(a1, 3, space=7)
            full = _collect_once(url, limit_bytes=FILE_LIMIT_BYTES)
            after = _collect_once(url)
        said = full.stdout + full.stderr
        assert full.returncode == 1, said
        assert "database refused the batch" in said and "not recorded" in said, said
        assert "for retry" not in said and "loop goes on" not in said, said
        assert "Traceback" not in said, said
        assert after.returncode == 0, after.stdout + after.stderr
        with sqlite3.connect(path) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            samples = conn.execute("SELECT count(*) FROM node_sample").fetchone()[0]
            hits = conn.execute("SELECT sum(hits) FROM cache_sample WHERE tier = 'all'")
            assert samples == 2  # the full disk's run recorded none
            assert hits.fetchone()[0] == 3  # counted by the run after it
    finally:
        db.dispose()
