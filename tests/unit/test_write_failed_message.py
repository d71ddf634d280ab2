"""WriteFailed's line reads as one sentence for every errno it carries: 'cannot write PATH:
REASON', where it read 'is a directory writing PATH' (REASON was strerror glued on)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvctl.paths import WriteFailed, write_atomic, write_in_place

P = Path("/srv/kv/agent.json")


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (errno.ENOSPC, "its filesystem is full (no space left on device)"),
        (errno.EDQUOT, "its filesystem is full for this user (disk quota exceeded)"),
        (errno.EROFS, "its filesystem is read-only"),
        (errno.EACCES, "permission denied"),
        (errno.EPERM, "operation not permitted"),
        (errno.EIO, "input/output error (its disk may be failing)"),
        (errno.EISDIR, "it is a directory"),
        (errno.ENOTDIR, "a path above it is a file, not a directory"),
        (errno.ENOENT, "its directory does not exist"),
        (errno.ENAMETOOLONG, "its name is too long"),
        (errno.ELOOP, "too many levels of symbolic links"),
        (errno.EMFILE, "too many open files in this process"),
        (errno.ENFILE, "too many open files on this system"),
        (errno.ETXTBSY, "text file busy"),  # any other: its strerror, in lower case
    ],
)
def test_each_errno_reads_as_a_sentence(code: int, reason: str) -> None:
    exc = WriteFailed(P, OSError(code, os.strerror(code)))
    assert str(exc) == f"cannot write {P}: {reason}"
    assert exc.errno == code and exc.full == (code in (errno.ENOSPC, errno.EDQUOT))


def test_an_oserror_without_an_errno_still_reads_well() -> None:
    assert str(WriteFailed(P, OSError("odd"))) == f"cannot write {P}: odd"


def test_a_directory_and_a_path_through_a_file_say_so(tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    with pytest.raises(WriteFailed) as info:
        write_atomic(tmp_path / "adir", "x", mode=0o600)
    assert str(info.value) == f"cannot write {tmp_path / 'adir'}: it is a directory"
    (tmp_path / "afile").write_text("")
    with pytest.raises(WriteFailed) as info:
        write_in_place(tmp_path / "afile" / "x", "x")
    assert str(info.value) == (
        f"cannot write {tmp_path / 'afile' / 'x'}: a path above it is a file, not a directory"
    )
