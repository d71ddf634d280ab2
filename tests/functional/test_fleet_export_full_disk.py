"""`kvctl fleet export -o FILE` on a full filesystem leaves the FILE that was there as it was.
It wrote in place: the old fleet file was truncated first, then the new text failed halfway
(exit 2, "cannot write"), leaving neither the old fleet nor the new one, only a torn file that
`kvctl fleet import` could then load as a smaller fleet (or refuse)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from typer.testing import CliRunner

from kvctl.cli.main import app
from kvctl.db.inventory import add_dc, add_node
from kvctl.db.migrate import open_db
from tests.tmpfs import tmpfs

runner = CliRunner()
OLD = "# the fleet as it was\n"


def test_a_failed_export_keeps_the_old_file(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'kvctl.db'}"
    engine = open_db(db, create=True)
    with engine.begin() as conn:
        add_dc(conn, "fra")
        for i in range(80):  # an export of several pages, more than the old file's one
            add_node(conn, f"gpu-{i:03}", dc="fra", agent_url=f"http://10.0.{i}.7:7070")
    engine.dispose()
    with tmpfs(tmp_path / "small", "64k") as small:
        out_file = small / "fleet.toml"
        out_file.write_text(OLD)
        fd = os.open(small / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:  # the filesystem full to the last byte
                os.write(fd, b"\0" * 4096)
        os.close(fd)
        out = runner.invoke(app, ["fleet", "export", "-o", str(out_file), "--db", db])
        kept = out_file.read_text()
        leftovers = sorted(p.name for p in small.iterdir())
    said = " ".join(out.output.split())
    assert out.exit_code == 2, said
    assert "no space left" in said.lower() and str(out_file) in said, said
    assert kept == OLD
    assert leftovers == ["filler", "fleet.toml"]  # no temporary file left behind
