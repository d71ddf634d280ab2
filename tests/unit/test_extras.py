"""The optional extras: pyproject.toml's `all` holds every other non-dev extra, kvctl.extras
knows which modules each one provides, and a missing one is named in one message."""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from collections.abc import Iterator
from importlib.abc import MetaPathFinder
from typing import Any

import pytest
from packaging.requirements import Requirement

from kvctl.errors import KvctlError
from kvctl.extras import EXTRA_OF, MODULES, MissingExtra, extra_of, missing_module, require
from tests.functional.lean import ROOT, closure, core_requirements, pyproject

NOT_FEATURES = {"dev", "all"}


def extras() -> dict[str, list[str]]:
    project: Any = pyproject()["project"]
    return dict(project["optional-dependencies"])


def canonical(requirement: str) -> str:
    r = Requirement(requirement)
    name = re.sub(r"[-_.]+", "-", r.name).lower()
    return f"{name}[{','.join(sorted(r.extras))}]{r.specifier}{r.marker or ''}"


def test_all_holds_every_other_extra_and_nothing_else() -> None:
    declared = extras()
    features = {name: reqs for name, reqs in declared.items() if name not in NOT_FEATURES}
    assert features, "no optional extras declared"
    wanted = {canonical(r) for reqs in features.values() for r in reqs}
    assert {canonical(r) for r in declared["all"]} == wanted


def test_every_extra_is_mapped_to_the_modules_it_provides() -> None:
    declared = extras()
    assert set(MODULES) == set(declared) - NOT_FEATURES
    provided = md.packages_distributions()
    for extra, modules in MODULES.items():
        dists = closure(declared[extra])
        for module in modules:
            if module not in provided:
                pytest.skip(f"{module} ('{extra}' extra) is not installed here")
            names = {re.sub(r"[-_.]+", "-", d).lower() for d in provided[module]}
            assert names & dists, f"{module} does not come with the '{extra}' extra"


def test_no_core_dependency_brings_an_extra_along() -> None:
    core = closure(core_requirements())
    for extra, reqs in extras().items():
        if extra in NOT_FEATURES:
            continue
        for r in reqs:
            name = re.sub(r"[-_.]+", "-", Requirement(r).name).lower()
            assert name not in core, f"{name} ('{extra}' extra) is also a core dependency"


def test_the_set_up_commands_install_every_extra() -> None:
    # the README's `make demo` / `make test` install what every test and the demo need
    assert '-e ".[all,dev]"' in (ROOT / "Makefile").read_text()


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("textual", "tui"),
        ("textual.widgets", "tui"),
        ("dash", "dashboard"),
        ("plotly.graph_objects", "dashboard"),
        ("torch", "engine"),
        ("zmq", "vllm-events"),
        ("numpy", None),
        ("dashboard", None),  # kvctl's own package, not the dash distribution
        (None, None),
    ],
)
def test_extra_of_a_failed_import(name: str | None, extra: str | None) -> None:
    assert extra_of(ModuleNotFoundError("No module", name=name)) == extra
    assert EXTRA_OF.get((name or "").partition(".")[0]) == extra


class _Refuse(MetaPathFinder):
    """What a lean environment's finder does: refuse the module outright."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == self.name:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@pytest.fixture
def fake_extra(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    finder = _Refuse("kvctl_test_refused_module")
    sys.meta_path.insert(0, finder)
    monkeypatch.setitem(MODULES, "fake", ("json", "kvctl_test_absent_module"))  # type: ignore[index]
    monkeypatch.setitem(MODULES, "refused", ("kvctl_test_refused_module",))  # type: ignore[index]
    try:
        yield "fake"
    finally:
        sys.meta_path.remove(finder)


def test_missing_module_finds_without_importing(fake_extra: str) -> None:
    assert missing_module(fake_extra) == "kvctl_test_absent_module"
    assert missing_module("refused") == "kvctl_test_refused_module"
    torch_loaded = "torch" in sys.modules
    for extra in ("dashboard", "tui", "engine", "vllm-events"):
        # installed or not, the answer is one of its modules or None
        assert missing_module(extra) in (None, *MODULES[extra])
    assert torch_loaded or "torch" not in sys.modules  # found, never imported (seconds)


def test_missing_module_of_an_unknown_extra() -> None:
    with pytest.raises(ValueError, match="unknown extra 'gui'"):
        missing_module("gui")


def test_require_names_the_extra_in_one_line(fake_extra: str) -> None:
    with pytest.raises(MissingExtra) as info:
        require("kvctl thing", fake_extra)
    assert str(info.value) == "kvctl thing needs the 'fake' extra: pip install 'kvctl[fake]'"
    assert isinstance(info.value, KvctlError)
    assert (info.value.what, info.value.extra) == ("kvctl thing", "fake")
    with pytest.raises(MissingExtra, match=r"kvctl\[refused\]' \(or not\)$"):
        require("kvctl thing", "refused", otherwise="or not")
