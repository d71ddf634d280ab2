"""Where kvctl keeps its state on this machine (per user, survives reboots), and how its files
there are written."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from kvctl.errors import InvalidArgument, KvctlError


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/kvctl`` or ``~/.local/state/kvctl``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvctl"


#: errnos that mean the filesystem has no room left for what is written
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class WriteFailed(KvctlError, OSError):
    """A file kvctl writes for itself (an agent's state, its settings, a unit) could not be
    written: the message names the file and says why in words. Still an OSError (its errno
    kept), so callers that catch those go on working."""

    def __init__(self, path: Path, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror, str(path))
        reason = _WRITE_REASONS.get(cause.errno or 0) or _lower_first(cause.strerror or str(cause))
        self.message = f"cannot write {path}: {reason}"

    @property
    def full(self) -> bool:
        """The filesystem had no room left (ENOSPC, EDQUOT): freeing space is the fix."""
        return self.errno in FULL_ERRNOS

    def __str__(self) -> str:
        return self.message


#: why a write failed, in words that follow 'cannot write PATH: '; any other errno's strerror
_WRITE_REASONS = {
    errno.ENOSPC: "its filesystem is full (no space left on device)",
    errno.EDQUOT: "its filesystem is full for this user (disk quota exceeded)",
    errno.EROFS: "its filesystem is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "input/output error (its disk may be failing)",
    errno.EISDIR: "it is a directory",
    errno.ENOTDIR: "a path above it is a file, not a directory",
    errno.ENOENT: "its directory does not exist",
    errno.ENAMETOOLONG: "its name is too long",
    errno.ELOOP: "too many levels of symbolic links",
    errno.EMFILE: "too many open files in this process",
    errno.ENFILE: "too many open files on this system",
}


def _lower_first(text: str) -> str:
    """'Text file busy' as the end of a sentence (strerror starts with a capital)."""
    return text[:1].lower() + text[1:]


def write_atomic(path: Path, text: str, *, mode: int, keep_owner: bool = False) -> None:
    """``text`` in ``path`` with ``mode`` whatever the umask, replaced atomically: a reader
    (systemd, another kvctl) sees the old file or the new one, never half of it. With
    ``keep_owner``, the new file gets the old one's group, and as root its owner too (best
    effort: a filesystem or a group that refuses it still gets the file). Raises WriteFailed
    naming ``path`` (a full filesystem, no permission), the old file left as it was."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.unlink(missing_ok=True)  # a killed process's leftover would keep its old mode
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            if keep_owner:
                _chown_like(tmp, path)
            os.chmod(tmp, mode)  # after the chown, which may clear bits
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except WriteFailed:
        raise
    except OSError as exc:
        raise WriteFailed(path, exc) from exc


def _chown_like(path: Path, old: Path) -> None:
    # a file written anew is its writer's, in their group: another user's file (their fleet
    # file, written by root's cron) would stop being theirs to edit, and one shared with a
    # group (0660, group ops) would shut that group out. Root keeps both; any other user the
    # group, when they are in it (the owner is theirs already, or it is no file of theirs to
    # replace)
    try:
        st = os.stat(old)
    except FileNotFoundError:
        return  # a new file: its writer's, as open() would make it
    uid = st.st_uid if os.geteuid() == 0 else -1
    with contextlib.suppress(OSError):  # best effort: vfat, unmapped ids, a group not theirs
        os.chown(path, uid, st.st_gid)


def write_output(path: Path, text: str) -> None:
    """``text`` in the file ``path`` a user named for a command's output (``-o FILE``): a file
    of its own replaced whole or not at all (write_atomic), else written through
    (write_in_place). Raises WriteFailed naming ``path``."""
    if _written_through(path):
        # /dev/stdout, a FIFO, a symlink kept a link to its file, a file whose other hard
        # links a new file would leave with the old text, a file not the writer's to replace
        # (read-only, another user's): written through (room reserved first, so a full disk
        # fails before the old text is touched). A symlink's target is not replaced:
        # /dev/stdout and /dev/fd/N lead through /proc to the caller's redirect, which a
        # rename would detach
        write_in_place(path, text)
        return
    # replaced whole or not at all: written in place, a full disk truncated the old file and
    # left half of the new one; an existing file keeps its permissions, its group and (root
    # writing another user's file) its owner, a new one the umask's mode, as written in place
    # (write_atomic sets the mode as is)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
    try:
        write_atomic(path, text, mode=mode, keep_owner=True)
    except WriteFailed as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM) or not path.is_file():
            raise
        # the file is the user's to write, its directory not: no temporary file can be made
        # there, or (sticky, like /tmp) another user's file cannot be renamed over. Written
        # through; a file they cannot write fails
        write_in_place(path, text)


def _umask() -> int:
    """The process's umask (reading it means setting it: put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _written_through(output: Path) -> bool:
    """Whether ``output`` is written through rather than replaced by a renamed new file: not a
    plain file of its own (a symlink, /dev/stdout, a FIFO, hard links), or not the writer's to
    replace. A rename needs only the directory writable: a file made read-only
    would be replaced without a word (written through, it is refused as `>` refuses it), and
    another user's file would become the writer's (root keeps its owner: write_atomic)."""
    if output.is_symlink():
        return True
    try:
        st = output.stat()
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        return True
    euid = os.geteuid()
    if euid == 0:
        return False
    writable = os.access(output, os.W_OK, effective_ids=os.access in os.supports_effective_ids)
    return st.st_uid != euid or not writable


def write_in_place(path: Path, text: str) -> None:
    """``text`` written through ``path``, the file itself kept: its hard links, owner and mode,
    the target of a symlink, /dev/stdout or a FIFO. A regular file's room is reserved first, so
    a full filesystem fails before the old text is touched (copy-on-write ones aside); a reader
    may see it half written. Raises WriteFailed naming ``path``."""
    data = text.encode("utf-8")
    try:
        fd = _open_to_write_through(path)
        try:
            st = os.fstat(fd)
            regular = stat.S_ISREG(st.st_mode)
            if regular and data:
                try:
                    os.posix_fallocate(fd, 0, len(data))
                except OSError as exc:
                    if exc.errno in FULL_ERRNOS:
                        with contextlib.suppress(OSError):  # a partial reservation undone
                            os.ftruncate(fd, st.st_size)
                        raise
                    # EOPNOTSUPP, EINVAL: a filesystem without it (glibc emulates it on most)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if regular:  # the old text's tail, where the new one is shorter
                os.ftruncate(fd, len(data))
        finally:
            os.close(fd)
    except OSError as exc:
        raise WriteFailed(path, exc) from exc


def _open_to_write_through(path: Path) -> int:
    # a regular file read and written: where the filesystem has no fallocate (ext2, NFSv3),
    # glibc emulates it by reading each block it would fill, and through a write-only
    # descriptor that fails (EBADF), taken for no fallocate at all: no room reserved
    flags = os.O_WRONLY
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.stat(path).st_mode):
            flags = os.O_RDWR
    try:
        return os.open(path, flags | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except PermissionError:
        if flags == os.O_WRONLY:
            raise
        # a file its writer may write but not read: no emulated reservation, as before
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o666)


def read_text_file(path: Path, what: str = "") -> str:
    """The UTF-8 text of a file a user named (``what`` says which, e.g. "the token file"); a
    missing file, a directory, no permission or bytes that are not UTF-8 raise InvalidArgument
    naming the file, so every command reports them the same way. A byte order mark at its
    start (what Windows editors write) is dropped: it made a keys file's first key, a token
    file's first id and a token file's secret read as bad ('\ufeff3f2a...')."""
    try:
        data = path.read_bytes()
        text = data.removeprefix(b"\xef\xbb\xbf")
        return text.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start : exc.start + 1].hex()
        offset = exc.start + len(data) - len(text)  # in the file, its BOM counted
        reason = f"not UTF-8 text (byte 0x{bad} at offset {offset})"
    except FileNotFoundError:
        reason = "no such file"
    except IsADirectoryError:
        reason = "it is a directory; give a file"
    except PermissionError:
        reason = "permission denied"
    except OSError as exc:
        reason = exc.strerror or str(exc)
    raise InvalidArgument(f"cannot read {what + ' ' if what else ''}{path}: {reason}")


class UnusableDirectory(KvctlError):
    """A directory kvctl must create and write (an agent's data dir) is a file, cannot be
    created, or is not writable by this user."""


def make_private_dir(path: Path, what: str = "directory") -> None:
    """Create ``path`` (and its parents) 0700 if missing; raise UnusableDirectory naming it and
    what is wrong when it is not a directory this user can write."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:  # exist_ok raises it only when path is not a directory
        raise UnusableDirectory(
            f"the {what} {path} exists and is not a directory; give a directory, or a path "
            "to create"
        ) from None
    except NotADirectoryError:
        raise UnusableDirectory(
            f"cannot create the {what} {path}: a part of its path is a file, not a directory"
        ) from None
    except OSError as exc:
        raise UnusableDirectory(f"cannot create the {what} {path}: {exc.strerror or exc}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        if _read_only_mount(path):  # no owner or mode fixes that: said as it is
            raise UnusableDirectory(
                f"the {what} {path} is on a read-only filesystem; remount it read-write, or "
                "give a directory on a writable one"
            )
        raise UnusableDirectory(
            f"the {what} {path} is not writable by this user; give one it owns, or fix its "
            "owner or mode"
        )


def _read_only_mount(path: Path) -> bool:
    """``path`` lies on a filesystem mounted read-only (False when that cannot be asked)."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False
