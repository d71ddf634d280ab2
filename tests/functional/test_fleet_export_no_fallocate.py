"""`kvctl fleet export -o FILE` written through (FILE hard-linked) on a full filesystem without
fallocate (ext2/ext3, NFSv3, older ZFS) keeps FILE's old text. write_in_place reserves the
room first with posix_fallocate, which glibc emulates there by reading each block it would
fill: through a write-only descriptor that failed (EBADF), was taken for "no fallocate here"
and ignored, and the write then tore the file at the first block the disk lacked."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db

runner = CliRunner()
#: longer than a block: glibc's emulation reads the blocks the old text holds
OLD = "# the fleet as it was\n" + "#" * 8192 + "\n"


@contextlib.contextmanager
def ext2(path: Path, size: str) -> Iterator[Path]:
    """``path`` (made here) with an ext2 of ``size`` (``truncate -s``) loop-mounted on it for
    the block: a real filesystem without fallocate. Skips where none can be mounted."""
    image = path.with_suffix(".img")
    path.mkdir()
    try:
        subprocess.run(["truncate", "-s", size, str(image)], check=True, timeout=30)
        made = subprocess.run(
            ["mkfs.ext2", "-q", "-F", str(image)], capture_output=True, text=True, timeout=30
        )
        if made.returncode != 0:
            pytest.skip(f"cannot make an ext2 here: {made.stderr.strip()}")
        mounted = subprocess.run(
            ["mount", "-o", "loop", str(image), str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError as exc:
        pytest.skip(f"cannot mount an ext2 here: no {exc.filename}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount an ext2 here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False, timeout=30)


def test_a_hard_linked_file_on_a_full_disk_without_fallocate_keeps_its_old_text(
    tmp_path: Path,
) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    engine = open_db(db, create=True)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        for i in range(300):  # an export several times the old file's length
            add_node(
                conn, f"gpu-{i:03}", dc="fra", agent_url=f"http://10.0.{i // 256}.{i % 256}:7070"
            )
    engine.dispose()
    with ext2(tmp_path / "small", "1M") as small:
        fleet = small / "fleet.toml"
        fleet.write_text(OLD)
        os.link(fleet, small / "other.toml")
        fd = os.open(small / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:  # the filesystem full to the last block
                os.write(fd, b"\0" * 1024)
        os.close(fd)
        out = runner.invoke(app, ["fleet", "export", "-o", str(fleet), "--db", db])
        kept = (fleet.read_text(), (small / "other.toml").read_text(), fleet.stat().st_nlink)
    said = " ".join(out.output.split())
    assert out.exit_code == 2, said
    assert "no space left" in said.lower() and str(fleet) in said, said
    assert kept == (OLD, OLD, 2)
