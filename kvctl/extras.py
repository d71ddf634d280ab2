"""Which optional extra of the kvctl distribution provides which module.

``pip install kvctl`` installs what a GPU node needs (the agent and the CLI); the dashboard, the
live view, the reference engine and vLLM's KV events are extras (pyproject.toml's
``[project.optional-dependencies]``). A command that needs one checks it here first, so a
missing extra is one line naming it rather than a traceback from deep inside an import.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Final

from kvctl.errors import KvctlError

#: extra -> the top-level modules its requirements provide (and code imports)
MODULES: Final[Mapping[str, tuple[str, ...]]] = {
    "dashboard": ("dash", "plotly", "waitress"),
    "tui": ("textual",),
    "engine": ("torch", "transformers"),
    "vllm-events": ("zmq", "msgpack"),
}
#: top-level module -> the extra that installs it
EXTRA_OF: Final[Mapping[str, str]] = {m: extra for extra, ms in MODULES.items() for m in ms}


class MissingExtra(KvctlError):
    """``what`` needs an extra that is not installed."""

    def __init__(self, what: str, extra: str, *, otherwise: str | None = None) -> None:
        self.what, self.extra = what, extra
        text = f"{what} needs the '{extra}' extra: pip install 'kvctl[{extra}]'"
        super().__init__(f"{text} ({otherwise})" if otherwise else text)


def extra_of(exc: ImportError) -> str | None:
    """The extra whose absence ``exc`` reports, or None when it is about another module."""
    name = getattr(exc, "name", None)
    return None if not name else EXTRA_OF.get(name.partition(".")[0])


def missing_module(extra: str) -> str | None:
    """The first module of ``extra`` that cannot be imported here, or None when all can.
    Finds them without importing them (torch takes seconds to import)."""
    if extra not in MODULES:
        raise ValueError(f"unknown extra {extra!r}; kvctl's extras are {', '.join(MODULES)}")
    for module in MODULES[extra]:
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except ImportError:  # a finder that refuses it, or a broken parent package
            return module
    return None


def require(what: str, extra: str, *, otherwise: str | None = None) -> None:
    """Raise :class:`MissingExtra` when a module of ``extra`` is not installed."""
    if missing_module(extra) is not None:
        raise MissingExtra(what, extra, otherwise=otherwise)
