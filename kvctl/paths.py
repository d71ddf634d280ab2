"""Where kvctl keeps its state on this machine (per user, survives reboots), and how its files
there are written."""

from __future__ import annotations

import os
from pathlib import Path


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/kvctl`` or ``~/.local/state/kvctl``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvctl"


def write_atomic(path: Path, text: str, *, mode: int) -> None:
    """``text`` in ``path`` with ``mode`` whatever the umask, replaced atomically: a reader
    (systemd, another kvctl) sees the old file or the new one, never half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a killed process's leftover would keep its old mode
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
