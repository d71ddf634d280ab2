"""Files and directories users name: one clear error naming the path, never a traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

import pytest

from kvctl.errors import InvalidArgument
from kvctl.paths import (
    UnusableDirectory,
    WriteFailed,
    make_private_dir,
    read_text_file,
    write_atomic,
)
from tests.tmpfs import tmpfs


def test_read_text_file_reads_utf8(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("caf\u00e9\n", encoding="utf-8")
    assert read_text_file(path, "--keys-file") == "caf\u00e9\n"


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: p.mkdir(), "it is a directory; give a file"),
        (lambda p: None, "no such file"),
        (lambda p: p.write_bytes(b"12 \xff\xfe 7"), "not UTF-8 text (byte 0xff at offset 3)"),
    ],
)
def test_read_text_file_names_the_file_and_what_is_wrong(
    tmp_path: Path, make: object, reason: str
) -> None:
    path = tmp_path / "f"
    make(path)  # type: ignore[operator]
    with pytest.raises(InvalidArgument) as info:
        read_text_file(path, "--tokens")
    assert str(info.value) == f"cannot read --tokens {path}: {reason}"


def test_make_private_dir_creates_it_0700(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b"
    make_private_dir(path, "data directory")
    make_private_dir(path, "data directory")  # there already: fine
    assert path.is_dir() and stat.S_IMODE(path.stat().st_mode) == 0o700


def test_make_private_dir_refuses_a_file_and_a_path_through_one(tmp_path: Path) -> None:
    file = tmp_path / "afile"
    file.write_text("")
    with pytest.raises(UnusableDirectory) as info:
        make_private_dir(file, "data directory")
    assert str(info.value).startswith(f"the data directory {file} exists and is not a directory")
    with pytest.raises(UnusableDirectory, match="a part of its path is a file") as info:
        make_private_dir(file / "sub", "data directory")
    assert str(file / "sub") in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any directory")
def test_make_private_dir_refuses_one_it_cannot_write(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(UnusableDirectory, match="not writable by this user"):
            make_private_dir(locked, "data directory")
        with pytest.raises(UnusableDirectory, match="cannot create the data directory"):
            make_private_dir(locked / "sub", "data directory")
    finally:
        locked.chmod(0o700)


def test_write_atomic_names_the_file_it_could_not_write(tmp_path: Path) -> None:
    """A full filesystem (real ENOSPC, from a tmpfs): WriteFailed names the file and says why in
    words, still an OSError with its errno; the old file is left whole, no temp file behind."""
    with tmpfs(tmp_path / "fs", "64k") as fs:
        path = fs / "agent.json"
        write_atomic(path, "old", mode=0o600)
        with open(fs / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        with pytest.raises(WriteFailed) as info:
            write_atomic(path, "new" * 4096, mode=0o600)
        assert str(info.value) == (
            f"cannot write {path}: its filesystem is full (no space left on device)"
        )
        assert info.value.errno == errno.ENOSPC and info.value.full
        assert isinstance(info.value, OSError)
        assert path.read_text() == "old"
        assert sorted(p.name for p in fs.iterdir()) == ["agent.json", "filler"]
