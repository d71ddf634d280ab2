"""Where kvctl keeps its state on this machine (per user, survives reboots)."""

from __future__ import annotations

import os
from pathlib import Path


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/kvctl`` or ``~/.local/state/kvctl``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "kvctl"
