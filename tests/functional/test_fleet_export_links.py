"""`kvctl fleet export -o FILE` since it replaces FILE through a renamed temporary file
(31846e6): the file stays the operator's file. Root writing another user's file leaves it
theirs (the rename gave root's), a hard-linked file keeps its links (the rename left the other
names with the old text), a symlink stays a link to its file; written through, a full disk
still fails before the old text is touched."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from tests.tmpfs import tmpfs

runner = CliRunner()
OLD = "# the fleet as it was\n"


def _db(tmp_path: Path, nodes: int = 1) -> str:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    engine = open_db(db, create=True)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        for i in range(nodes):
            add_node(conn, f"gpu-{i:03}", dc="fra", agent_url=f"http://10.0.{i}.7:7070")
    engine.dispose()
    return db


def _export(db: str, output: Path) -> str:
    out = runner.invoke(app, ["fleet", "export", "-o", str(output), "--db", db])
    said = " ".join(out.output.split())
    assert out.exit_code == 0, said
    return said


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_root_keeps_the_files_owner(tmp_path: Path) -> None:
    db = _db(tmp_path)
    theirs = tmp_path / "fleet.toml"
    theirs.write_text(OLD)
    os.chown(theirs, 1234, 1235)
    theirs.chmod(0o640)
    _export(db, theirs)
    st = theirs.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1234, 1235, 0o640)
    assert "gpu-000" in theirs.read_text()


def test_a_hard_linked_file_keeps_its_links(tmp_path: Path) -> None:
    db = _db(tmp_path)
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(OLD + "x" * 4096)  # longer than the export: no old tail left after it
    other = tmp_path / "deploy" / "fleet.toml"
    other.parent.mkdir()
    os.link(fleet, other)
    _export(db, fleet)
    assert fleet.stat().st_ino == other.stat().st_ino and fleet.stat().st_nlink == 2
    text = other.read_text()
    assert 'name = "gpu-000"' in text and OLD not in text and "xxx" not in text


def test_a_symlink_stays_a_link_to_the_new_text(tmp_path: Path) -> None:
    db = _db(tmp_path)
    real = tmp_path / "real.toml"
    real.write_text(OLD)
    link = tmp_path / "fleet.toml"
    link.symlink_to(real.name)
    _export(db, link)
    assert link.is_symlink() and os.readlink(link) == real.name
    assert 'name = "gpu-000"' in real.read_text() and OLD not in real.read_text()


def test_a_hard_linked_file_on_a_full_disk_keeps_its_old_text(tmp_path: Path) -> None:
    db = _db(tmp_path, nodes=80)  # an export of several pages, more than the old file's one
    with tmpfs(tmp_path / "small", "64k") as small:
        fleet = small / "fleet.toml"
        fleet.write_text(OLD)
        os.link(fleet, small / "other.toml")
        fd = os.open(small / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:  # the filesystem full to the last byte
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        out = runner.invoke(app, ["fleet", "export", "-o", str(fleet), "--db", db])
        kept = (fleet.read_text(), (small / "other.toml").read_text(), fleet.stat().st_nlink)
    said = " ".join(out.output.split())
    assert out.exit_code == 2, said
    assert "no space left" in said.lower() and str(fleet) in said, said
    assert kept == (OLD, OLD, 2)
