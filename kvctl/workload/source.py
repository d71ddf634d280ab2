"""Pick a workload: a Mooncake trace file, or a seeded generated workload when there is none."""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
from dataclasses import dataclass

from kvctl.store.errors import InvalidArgument
from kvctl.workload.trace import TraceRequest, read_mooncake_trace


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    requests: list[TraceRequest]
    #: what names its content for token expansion: a trace file's name (wherever it is read
    #: from), a digest of what a pipe gave, or the generator and seed
    content_name: str = ""

    @property
    def salt(self) -> int:
        from kvctl.workload.tokens import content_salt

        return content_salt(self.content_name or self.name)


#: the directory of a process's (or a thread's) open descriptors, resolved: /dev/fd/N,
#: /dev/stdin (through /proc/self/fd/0), /proc/self/fd/N, /proc/thread-self/fd/N lead there
_DESCRIPTOR_DIR = re.compile(r"/proc/\d+(/task/\d+)?/fd")


def _is_descriptor_path(path: pathlib.Path) -> bool:
    """Whether ``path`` stands for an open descriptor, not a file: it or a link it leads
    through (``ln -s /dev/stdin in.jsonl``) is an entry of a descriptor directory."""
    at = os.path.abspath(path)
    for _ in range(40):  # a link loop ends the walk (as the kernel's bound does)
        try:
            if _DESCRIPTOR_DIR.fullmatch(os.path.realpath(os.path.dirname(at))):
                return True
            if not os.path.islink(at):
                return False
            at = os.path.normpath(os.path.join(os.path.dirname(at), os.readlink(at)))
        except OSError:
            return False
    return False


def _file_name(path: pathlib.Path) -> str | None:
    """What names a regular file's content: its file name. A descriptor's path on one
    (`--trace /dev/stdin < a.jsonl`) is named as the file it is open on: its own name ("stdin",
    "3") was the same for every file, so two different traces salted their tokens alike. None
    where that file has no name to read (deleted, a memfd): it is named as a stream then."""
    if not _is_descriptor_path(path):
        return path.name
    try:
        real = os.path.realpath(path)  # "/tmp/a.jsonl (deleted)" for a deleted one
        opened, named = os.stat(path), os.stat(real)
    except OSError:  # no such name (deleted, a memfd), or another process's link unreadable
        return None
    # the very file the descriptor is open on: a file that happens to be called
    # "a.jsonl (deleted)" beside a deleted a.jsonl is another file, with its own content
    if (opened.st_dev, opened.st_ino) != (named.st_dev, named.st_ino):
        return None
    return pathlib.Path(real).name


def load_workload(
    trace: str | pathlib.Path | None,
    *,
    seed: int = 0,
    limit: int | None = None,
    workload: str = "builtin",
) -> Workload:
    """Read ``trace``, or when it is None generate the workload named ``workload`` (a name in
    ``kvctl.workload.generators.GENERATORS``, e.g. "builtin", "system-prompt", "chat", "rag", "mix")
    with ``seed``; its name is then ``"<workload>:seed=N"``.

    ``limit`` caps the requests read from a trace; for a generated workload it is the number of
    requests generated (see ``kvctl.workload.generators.generate``). An unknown ``workload``
    raises ``InvalidArgument`` listing the names.
    """
    if limit is not None and limit < 0:  # one message whether a trace is read or generated
        raise InvalidArgument(f"limit must be non-negative, got {limit}")
    if trace is None:
        from kvctl.workload.generators import generate

        return Workload(f"{workload}:seed={seed}", generate(workload, seed, requests=limit))
    path = pathlib.Path(trace)
    # a directory: read_mooncake_trace says so; a pipe (`--trace <(zcat t.jsonl.gz)`, a FIFO,
    # /dev/stdin) is read as a stream: it was refused as "no such file", though it was there
    if not path.exists():
        raise FileNotFoundError(2, "no such trace file", str(path))
    # a directory as given (read_mooncake_trace refuses it), a file by its file name
    name = path.name if path.is_dir() else _file_name(path) if path.is_file() else None
    if name is not None:
        return Workload(str(path), read_mooncake_trace(path, limit=limit), name)
    # A stream's name says nothing of its content: /dev/fd/63 from `<(zcat a.jsonl.gz)` and
    # `<(zcat b.jsonl.gz)` alike, and every /dev/stdin. Named by their file name ("63",
    # "stdin"), two different traces salted their tokens alike and shared chunks in a replay;
    # named by a digest of the lines read, equal content shares, as a file read again does.
    digest = hashlib.sha256()
    requests = read_mooncake_trace(path, limit=limit, digest=digest)
    return Workload(str(path), requests, f"stream sha256:{digest.hexdigest()}")
