"""`kvctl fleet export -o FILE` where FILE is the operator's to write but its directory is not:
written through, as before 31846e6. Since export writes a temporary file beside FILE and
renames it over, a directory the operator cannot write (a shared deploy dir holding a file
granted to them) failed with "permission denied", and so did a sticky one like /tmp holding
another user's world-writable file (the rename over it is refused)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db

OLD = "# the fleet as it was\n" + "#" * 4096 + "\n"  # longer than the export: its tail cut
#: the user the command runs as when the tests run as root (who may write any directory)
NOBODY = 65534
ROOT = os.geteuid() == 0
pytestmark = pytest.mark.skipif(
    ROOT and shutil.which("setpriv") is None, reason="as root, the CLI runs as nobody by setpriv"
)


@pytest.fixture
def base() -> Iterator[Path]:
    # not under tmp_path: its parents are private to the user running pytest, not the CLI's
    path = Path(tempfile.mkdtemp(prefix="kvctl-export-"))
    try:
        path.chmod(0o755)
        db = f"sqlite:///{path / 'kvctl.db'}"
        engine = open_db(db, create=True)
        with engine.begin() as conn:
            add_dc(conn, "fra")
            add_node(conn, "gpu-1", dc="fra", agent_url="http://10.0.0.7:7070")
        engine.dispose()
        if ROOT:  # the database is the CLI user's own
            for p in (path, *path.iterdir()):
                os.chown(p, NOBODY, NOBODY)
        yield path
    finally:
        for p in path.rglob("*"):  # a directory made read-only below, so rmtree can empty it
            if p.is_dir():
                p.chmod(0o755)
        shutil.rmtree(path)


def _export(
    base: Path, output: Path, groups: tuple[int, ...] = ()
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    # setpriv, not subprocess's user=: here the latter's exec of this Python (under root's
    # private home) is refused. ``groups``: nobody's supplementary groups
    in_groups = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", in_groups]
    return subprocess.run(
        [*(as_nobody if ROOT else []), sys.executable, "-m", "kvctl", "fleet", "export",
         "-f", "toml", "-o", str(output), "--db", f"sqlite:///{base / 'kvctl.db'}"],
        env=env, cwd=base, text=True, capture_output=True, timeout=60,
    )  # fmt: skip


def test_a_writable_file_in_a_directory_the_user_cannot_write(base: Path) -> None:
    deploy = base / "deploy"
    deploy.mkdir()
    fleet = deploy / "fleet.toml"
    fleet.write_text(OLD)
    fleet.chmod(0o640)
    if ROOT:
        os.chown(fleet, NOBODY, NOBODY)  # the file is theirs, the directory root's
    deploy.chmod(0o555)
    out = _export(base, fleet)
    assert out.returncode == 0, out.stderr
    text = fleet.read_text()
    assert "gpu-1" in text and "#" * 100 not in text, text
    st = fleet.stat()
    assert st.st_mode & 0o777 == 0o640
    assert st.st_uid == (NOBODY if ROOT else os.geteuid())
    assert sorted(p.name for p in deploy.iterdir()) == ["fleet.toml"]


@pytest.mark.skipif(not ROOT, reason="needs a file of another user in a sticky directory")
def test_another_users_world_writable_file_in_a_sticky_directory(base: Path) -> None:
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # like /tmp: anyone may create, none may rename over another's file
    fleet = shared / "fleet.toml"
    fleet.write_text(OLD)
    fleet.chmod(0o666)  # root's, for every user to write
    if Path("/proc/sys/fs/protected_regular").read_text().strip() != "0":
        pytest.skip("fs.protected_regular refuses opening another user's file here at all")
    out = _export(base, fleet)
    assert out.returncode == 0, out.stderr
    assert "gpu-1" in fleet.read_text()
    st = fleet.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (0, 0o666)
    assert sorted(p.name for p in shared.iterdir()) == ["fleet.toml"]


def test_a_file_the_user_cannot_write_still_fails(base: Path) -> None:
    deploy = base / "deploy"
    deploy.mkdir()
    fleet = deploy / "fleet.toml"
    fleet.write_text(OLD)
    fleet.chmod(0o444)  # root's when the tests run as root; read-only to its owner otherwise
    deploy.chmod(0o555)
    out = _export(base, fleet)
    assert out.returncode == 2 and "permission denied" in out.stderr, out.stderr
    assert fleet.read_text() == OLD
