"""A Python that sees only what ``pip install kvctl`` (no extras) would install.

The core closure is read from pyproject.toml's ``[project] dependencies`` and walked through the
installed distributions' own requirements (markers evaluated, requested extras followed). Every
top-level module of any other installed distribution is blocked in a child process by a meta
path finder installed from ``sitecustomize.py`` on its PYTHONPATH: importing one raises
ModuleNotFoundError exactly as on a machine without it. The standard library and kvctl's own
packages stay importable.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

_FINDER = """\
import sys
from importlib.abc import MetaPathFinder

_BLOCKED = frozenset({blocked})


class _LeanInstall(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _LeanInstall())
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def core_requirements() -> list[str]:
    project = pyproject()["project"]
    assert isinstance(project, dict)
    return list(project["dependencies"])


def closure(requirements: Iterable[str]) -> set[str]:
    """Normalised names of the distributions these requirements install, transitively (as far
    as they are installed here; one that is not cannot be imported anyway)."""
    names: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        key = (_norm(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        names.add(key[0])
        try:
            requires = md.distribution(req.name).requires or []
        except md.PackageNotFoundError:
            continue
        extras = sorted(req.extras) or [""]
        for text in requires:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append(sub)
    return names


def blocked_modules() -> set[str]:
    """Top-level modules installed here that a lean install would not have."""
    allowed = closure(core_requirements()) | {"kvctl"}
    return {
        module
        for module, dists in md.packages_distributions().items()
        if not any(_norm(d) in allowed for d in dists)
    }


def lean_env(directory: Path, blocked: set[str] | None = None) -> dict[str, str]:
    """The environment of a child process that imports like a lean install: a
    ``sitecustomize.py`` in ``directory`` blocks the modules, the repository stays importable."""
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(blocked_modules() if blocked is None else blocked)
    (directory / "sitecustomize.py").write_text(_FINDER.format(blocked=json.dumps(names)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(directory), str(ROOT)])
    env["XDG_CONFIG_HOME"] = str(directory / "xdg")
    env["NO_COLOR"] = "1"
    env["COLUMNS"] = "200"
    return env
