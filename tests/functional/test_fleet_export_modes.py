"""`kvctl fleet export -o FILE` since it replaces FILE through a renamed temporary file
(31846e6): a new file gets the mode the operator's umask gives, as written in place it did (it
was 0644 whatever the umask), an existing one keeps its own, and /dev/stdout is still written
through, to a pipe or to the file the shell redirected it to."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import IO

from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db


def _db(tmp_path: Path) -> str:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    engine = open_db(db, create=True)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        add_node(conn, "gpu-1", dc="fra", agent_url="http://10.0.0.7:7070")
    engine.dispose()
    return db


def _export(
    db: str, output: str, umask: int, stdout: int | IO[str]
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    return subprocess.run(
        [sys.executable, "-m", "kvctl", "fleet", "export", "-f", "toml", "-o", output, "--db", db],
        env=env,
        text=True,
        stderr=subprocess.PIPE,
        timeout=60,
        process_group=0,
        umask=umask,
        stdout=stdout,
    )


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_takes_the_umask_and_an_existing_one_keeps_its_mode(tmp_path: Path) -> None:
    db = _db(tmp_path)
    private = tmp_path / "private.toml"
    done = _export(db, str(private), 0o077, stdout=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert _mode(private) == 0o600  # not readable by others: the operator's umask says so
    shared = tmp_path / "shared.toml"
    done = _export(db, str(shared), 0o002, stdout=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert _mode(shared) == 0o664
    shared.chmod(0o640)
    done = _export(db, str(shared), 0o077, stdout=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert _mode(shared) == 0o640 and "gpu-1" in shared.read_text()


def test_dev_stdout_is_written_through_to_a_pipe_and_to_a_redirected_file(
    tmp_path: Path,
) -> None:
    db = _db(tmp_path)
    piped = _export(db, "/dev/stdout", 0o022, stdout=subprocess.PIPE)
    assert piped.returncode == 0, piped.stderr
    assert 'name = "gpu-1"' in piped.stdout
    redirected = tmp_path / "redirected.toml"
    redirected.write_text("# old\n")
    redirected.chmod(0o600)
    with redirected.open("w") as f:
        done = _export(db, "/dev/stdout", 0o022, stdout=f)
    assert done.returncode == 0, done.stderr
    assert 'name = "gpu-1"' in redirected.read_text() and _mode(redirected) == 0o600
