"""`kvctl fleet export -o FILE` by a user (not root) over a FILE that is not simply theirs to
replace. Its rename over FILE (31846e6) needs only the directory to be writable: a FILE made
read-only (chmod a-w, to keep a reviewed fleet file) was replaced without a word, where written
in place, as `>` does, it was refused; another user's FILE (group-writable, in a shared
directory) became the exporter's, its owner and group lost with their access."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.functional.test_fleet_export_dir_not_writable import (
    NOBODY,
    OLD,
    ROOT,
    _export,
    base,
    pytestmark,
)

__all__ = ["base", "pytestmark"]  # the fixture and the skip, shared


def test_a_read_only_file_is_not_replaced(base: Path) -> None:
    fleet = base / "fleet.toml"  # in a directory the exporter may write
    fleet.write_text(OLD)
    if ROOT:
        os.chown(fleet, NOBODY, NOBODY)
    fleet.chmod(0o444)
    out = _export(base, fleet)
    assert out.returncode == 2 and "permission denied" in out.stderr, out.stderr
    assert fleet.read_text() == OLD


@pytest.mark.skipif(not ROOT, reason="needs a file of another user")
def test_another_users_writable_file_stays_theirs(base: Path) -> None:
    fleet = base / "fleet.toml"  # in the exporter's own directory
    fleet.write_text(OLD)
    os.chown(fleet, 1234, 1235)
    fleet.chmod(0o666)
    out = _export(base, fleet)
    assert out.returncode == 0, out.stderr
    assert "gpu-1" in fleet.read_text()
    st = fleet.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (1234, 1235, 0o666)


@pytest.mark.skipif(not ROOT, reason="needs a group to give the exporter")
def test_the_exporters_own_file_keeps_its_group(base: Path) -> None:
    fleet = base / "fleet.toml"
    fleet.write_text(OLD)
    os.chown(fleet, NOBODY, 1235)  # nobody's, shared with group 1235 (ops), nobody in it
    fleet.chmod(0o660)
    out = _export(base, fleet, groups=(1235,))
    assert out.returncode == 0, out.stderr
    assert "gpu-1" in fleet.read_text()
    st = fleet.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (NOBODY, 1235, 0o660)
