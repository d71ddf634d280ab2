"""A detached agent's log, ``<data_dir>/agent.log``: rolled over by size, and read across
rollovers.

A detached agent (``kvctl agent start --detach``, and every agent :func:`spawn_agent` starts)
writes its log to its stdout and stderr, both ``agent.log`` opened by the starting process.
Left alone it grows for as long as the agent runs, until the disk is full. :class:`LogRotator`
runs in the agent: once the file passes ``log_max_bytes`` it becomes ``agent.log.1`` (the older
ones shifted to ``.2``, ``.3``; ``log_backups`` of them kept, the oldest deleted) and a new
``agent.log`` takes its place. The new file is ``dup2()``'d over descriptors 1 and 2 before it
is named ``agent.log``, so whatever writes there, Python's logging or a C library's message or
a traceback, lands in it; a logging record is written whole into one file or the other (the
handlers' locks are held across the switch). An agent whose stdout and stderr are not its data
dir's ``agent.log`` (a terminal in the foreground, journald under systemd) is left alone.

:class:`LogFollower` is the other side: the starting process reading what its agent logs from a
point on, which follows the file it started in to ``agent.log.1`` and on to the new one.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("kvctl.agent")

#: seconds between two looks at the log's size: the file passes its cap by at most what the
#: agent logs in that time
CHECK_SECONDS = 0.5
#: the new file's name until it is ``agent.log``
NEXT_SUFFIX = ".next"
_STDIO = (1, 2)


def rotated_path(path: Path, n: int) -> Path:
    """The ``n``-th newest rolled-over log: ``agent.log.1`` is the one ``agent.log`` was last."""
    return path.with_name(f"{path.name}.{n}")


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def stdio_fds_writing(path: Path) -> tuple[int, ...]:
    """Which of descriptors 1 and 2 write to ``path`` (none when it does not exist)."""
    try:
        target = os.stat(path)
    except OSError:
        return ()
    fds = []
    for fd in _STDIO:
        with contextlib.suppress(OSError):
            if _same_file(os.fstat(fd), target):
                fds.append(fd)
    return tuple(fds)


@contextlib.contextmanager
def _handlers_held() -> Iterator[None]:
    """Every logging handler's lock, so no record is half written when the file changes (a
    record larger than a stream's buffer takes several writes)."""
    # (a copy made at once: another thread may add a logger meanwhile)
    loggers = [logging.getLogger(), *list(logging.Logger.manager.loggerDict.values())]
    handlers = {id(h): h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers}
    held: list[logging.Handler] = []
    try:
        for handler in handlers.values():
            handler.acquire()
            held.append(handler)
        yield
    finally:
        for handler in reversed(held):
            handler.release()


class LogRotator:
    """Rolls ``path`` over once it passes ``max_bytes``, keeping ``backups`` older files, for a
    process whose descriptors ``fds`` (of 1 and 2) write to it. A thread looks at its size every
    :data:`CHECK_SECONDS`, the first time at once (a file an earlier run left over the cap is
    rolled over before this run adds to it)."""

    def __init__(self, path: Path, fds: tuple[int, ...], max_bytes: int, backups: int) -> None:
        if max_bytes <= 0 or backups < 1 or not fds:
            raise ValueError(f"nothing to roll over: {max_bytes=} {backups=} {fds=}")
        self.path = path
        self.fds = fds
        self.max_bytes = max_bytes
        self.backups = backups
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvctl-log-rotate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                self.rotate_if_due()
                if self._stop.wait(CHECK_SECONDS):
                    return
        except Exception:  # said where the operator looks, not a thread's silent end
            log.exception("rolling %s over failed: it is not rolled over from now on", self.path)

    def rotate_if_due(self) -> bool:
        """Roll the log over if it has passed its cap; whether it did."""
        try:
            size = os.fstat(self.fds[0]).st_size
        except OSError:
            return False
        if size < self.max_bytes:
            return False
        try:
            self.rotate()
        except OSError as exc:
            # logged once: the next try (next check) writes the same line to the same file
            if not self._failed:
                self._failed = True
                log.warning(
                    "cannot roll %s over (%s): it grows past log_max until this is fixed",
                    self.path,
                    exc.strerror or exc,
                )
            return False
        self._failed = False
        log.info(
            "%s passed %d bytes: rolled over, the lines before are in %s (%d kept)",
            self.path.name,
            self.max_bytes,
            rotated_path(self.path, 1).name,
            self.backups,
        )
        return True

    def rotate(self) -> None:
        """``agent.log`` -> ``agent.log.1`` (and each older one a number up, the oldest
        dropped), a new ``agent.log`` written from now on by descriptors 1 and 2."""
        next_path = self.path.with_name(self.path.name + NEXT_SUFFIX)
        # the new file before anything moves: where it cannot be made (out of descriptors, of
        # inodes or quota) the backups are as they were for the try at the next check; shifted
        # first, each failed try (one every check) shifted them again, dropping one more
        with contextlib.suppress(FileNotFoundError):
            os.unlink(next_path)  # a crashed rollover's, or anything planted under the name
        # a file of its own, never one reached through a link planted in a data dir others can
        # write to (the log would truncate and then fill what it points at)
        fd = os.open(
            next_path,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_APPEND | os.O_CLOEXEC,
            0o600,
        )
        try:
            os.fchmod(fd, 0o600)  # whatever the umask: the log names tenants and keys
            self._shift_backups()
            with _handlers_held():
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()  # what is buffered belongs to the old file
                old = os.dup(self.fds[0])
                try:
                    # from here on every write to 1 and 2 lands in the new file
                    for target in self.fds:
                        os.dup2(fd, target)
                    self._name_new(next_path)
                except OSError:
                    for target in self.fds:  # back to the old file, which is still agent.log
                        os.dup2(old, target)
                    with contextlib.suppress(OSError):
                        os.unlink(next_path)
                    raise
                finally:
                    os.close(old)
        finally:
            os.close(fd)

    def _shift_backups(self) -> None:
        """Each kept file a number up, the oldest dropped, so that ``agent.log.1`` is free; not
        where it is free already (by hand, or a try that failed after its shift): shifting
        again would drop one more file the operator may need."""
        first = rotated_path(self.path, 1)
        try:
            if _same_file(os.lstat(first), os.stat(self.path)):
                # a second name of agent.log: a rollover killed between its link and its rename
                # (the new file never named) left it; it is no backup, and shifted up as one it
                # would drop the oldest real one
                os.unlink(first)
                return
        except FileNotFoundError:
            if not os.path.lexists(first):
                return  # free already
        for n in range(self.backups, 1, -1):  # the oldest first: none is overwritten unread
            with contextlib.suppress(FileNotFoundError):
                os.replace(rotated_path(self.path, n - 1), rotated_path(self.path, n))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(first)  # where only one is kept: the previous rollover's

    def _name_new(self, next_path: Path) -> None:
        """The old file becomes ``agent.log.1`` and the new one ``agent.log``; with a hard link
        first, so that ``agent.log`` is never missing for whoever reads it."""
        first = rotated_path(self.path, 1)
        took = ""  # how the old file took the name agent.log.1: "link", "move" or not at all
        try:
            os.link(self.path, first)
            took = "link"
        except FileNotFoundError:
            pass  # moved away by hand: nothing to keep under its name
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.EXDEV):
                raise
            os.replace(self.path, first)  # a filesystem without hard links
            took = "move"
        try:
            os.replace(next_path, self.path)
        except OSError:
            # the old file stays agent.log (rotate() puts fds 1 and 2 back on it), and
            # agent.log.1 is free again: as a second name of it, the next try would shift it
            # up as if it were a backup and drop the oldest real one
            with contextlib.suppress(OSError):
                if took == "link":
                    os.unlink(first)
                elif took == "move":
                    os.replace(first, self.path)
            raise


def start_rotation(path: Path, max_bytes: int, backups: int) -> LogRotator | None:
    """A started :class:`LogRotator` for this process's log ``path`` (None where stdout and
    stderr do not write to it, or ``max_bytes`` is 0: rollover off; or ``path`` is a symbolic
    link, logged: an operator who links the log elsewhere rolls it there, and a rollover here
    would replace the link with a file in the data dir)."""
    fds = stdio_fds_writing(path)
    if max_bytes <= 0 or not fds:
        return None
    if path.is_symlink():
        log.warning(
            "%s is a link to %s: not rolled over by the agent (log_max); roll it over where it "
            "is (logrotate with copytruncate), or make it a file",
            path,
            os.path.realpath(path),
        )
        return None
    rotator = LogRotator(path, fds, max_bytes, backups)
    rotator.start()
    return rotator


class LogFollower:
    """What is written to the log ``path`` from a point on, read as it grows and followed
    across rollovers: when the file it reads has become ``path.K``, what was written to it is
    read to its end, then ``path.K-1`` (``path`` after ``path.1``) from its start. It holds the
    file it reads open until :meth:`close`, so that one is read to its end even once deleted;
    where the files after it were deleted unread (more rollovers than are kept), it goes on at
    the oldest kept, and what was deleted is lost to it."""

    def __init__(self, path: Path, fd: int, offset: int) -> None:
        self.path = path
        self._fd = fd
        self._offset = offset
        #: bytes read so far, across files
        self.read_bytes = 0

    @classmethod
    def open(cls, path: Path, offset: int | None = None) -> LogFollower:
        """Follow ``path`` from ``offset`` (None: its end now)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        if offset is None:
            offset = os.fstat(fd).st_size
        return cls(path, fd, offset)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> LogFollower:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def read(self, most_bytes: int = 1 << 20) -> bytes:
        """What was written since the last read, across rollovers (at most ``most_bytes``)."""
        chunks: list[bytes] = []
        left = most_bytes
        while left > 0 and self._fd >= 0:
            data = os.pread(self._fd, left, self._offset)
            if data:
                chunks.append(data)
                self._offset += len(data)
                left -= len(data)
                continue
            successor = self._successor()
            if successor is None:
                break
            os.close(self._fd)
            self._fd, self._offset = successor, 0
        out = b"".join(chunks)
        self.read_bytes += len(out)
        return out

    def _successor(self) -> int | None:
        """The file written after this one, open; None while this one is still ``path`` (or a
        rollover is half done: the next read looks again)."""
        mine = os.fstat(self._fd)
        try:
            if _same_file(os.stat(self.path), mine):
                return None
        except OSError:
            return None
        for _ in range(3):  # a rollover between the look and the open moves both: look again
            where = self._where(mine)
            if where is None:
                return None
            at, after = where
            try:
                fd = os.open(after, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            # still where it was: the rollover that would move the successor moves this first
            if at is None or _still(at, mine):
                return fd
            os.close(fd)
        return None

    def _where(self, mine: os.stat_result) -> tuple[Path | None, Path] | None:
        """Where this file is now (None: deleted) and the file after it."""
        kept = []
        n = 1
        while (candidate := rotated_path(self.path, n)).exists():
            kept.append(candidate)
            n += 1
        if mine.st_nlink == 0:  # rolled out of those kept: go on at the oldest kept
            return (None, kept[-1]) if kept else (None, self.path)
        for i, candidate in enumerate(kept):
            if _still(candidate, mine):
                return candidate, kept[i - 1] if i else self.path
        return None


def _still(path: Path, mine: os.stat_result) -> bool:
    try:
        return _same_file(os.stat(path), mine)
    except OSError:
        return False
