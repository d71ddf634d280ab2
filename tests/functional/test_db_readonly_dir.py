"""A SQLite database whose directory the user cannot write: SQLite in WAL mode makes its -wal
and -shm files there, so every connection fails with "attempt to write a readonly database",
though the file itself is writable. `kvctl collect` (and every command opening the database)
now names the directory as the cause; it named only the file's URL, which sent the operator to
the file. Run without root's capabilities (setpriv) where the tests run as root, as root
writes any directory."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db

pytestmark = pytest.mark.slow


def _as_a_user() -> list[str]:
    """The command prefix that takes root's right to write any directory away (none needed
    for another user); skips where it cannot."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: a read-only directory is writable")
    return [setpriv, "--bounding-set=-all", "--inh-caps=-all", "--"]


def test_a_read_only_directory_is_named_as_the_cause(tmp_path: Path) -> None:
    prefix = _as_a_user()
    folder = tmp_path / "db"
    folder.mkdir()
    path = folder / "metrics.db"
    url = f"sqlite:///{path}"
    db = open_db(url)
    with db.begin() as conn:
        add_dc(conn, "fra", region="eu", carbon_g_per_kwh=300, pue=1.3)
        add_node(conn, "n1", dc="fra", agent_url="http://127.0.0.1:9")
    db.dispose()
    before = path.read_bytes()
    folder.chmod(0o555)
    try:
        result = subprocess.run(
            [*prefix, sys.executable, "-m", "kvctl", "collect", "--once", "--db", url],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        folder.chmod(0o755)
    said = " ".join(result.stderr.split())
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"its directory {folder} is not writable" in said, said
    assert "metrics.db-wal" in said and "Traceback" not in said, said
    assert path.read_bytes() == before  # nothing written, nothing half-written
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
