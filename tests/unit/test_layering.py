"""The core never imports a UI library: the store, db and collectors must stay importable and
light for the agent and collectors, and `kvctl --help` must not pay for heavy imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
UI = ("rich", "typer", "textual", "dash", "plotly", "click")


def imported_by(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return set(out.stdout.split())


def test_store_and_workload_never_import_ui() -> None:
    for module in (
        "kvctl.store.store",
        "kvctl.store.tiers.disk",
        "kvctl.workload.simulate",
        "kvctl.workload.seeds",
        "kvctl.bench.store",
        "collectors",
        "collectors.rows",
        "kvctl.db.migrate",
        "kvctl.db.analytics.overview",
        "kvctl.db.analytics.recorded",
        "kvctl.db.analytics.summary",
        "kvctl.ratios",
        "dashboard",
        "kvctl.db.analytics.savings",
        "kvctl.db.plans",
        "kvctl.tui.model",
    ):
        loaded = imported_by(module)
        assert not {m.split(".")[0] for m in loaded} & set(UI), module


def test_store_never_imports_torch() -> None:
    """torch is optional and slow to import: only building a gpu tier (or its benchmark's run)
    loads it, never importing the store, its tiers, the agent's config or the benchmark."""
    for module in (
        "kvctl.store.store",
        "kvctl.store.tiers.gpu",
        "kvctl.agent.config",
        "kvctl.agent.runtime",
        "kvctl.bench.gpu",
    ):
        assert "torch" not in imported_by(module), module


def test_cli_help_does_not_import_the_store_engine() -> None:
    code = (
        "import sys; from kvctl.cli.main import app; "
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('kvctl'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    loaded = set(out.stdout.split())
    assert "kvctl.store.store" not in loaded and "kvctl.workload.simulate" not in loaded


def _imports(path: Path) -> set[str]:
    import ast

    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_core_sources_never_import_ui() -> None:
    """Static check for modules whose HTTP client (httpx) drags in click and rich for its own
    command line: our code itself must still never import a UI library, even lazily."""
    for folder in (
        "kvctl/store",
        "kvctl/db",
        "kvctl/agent",
        "kvctl/fleet",
        "collectors",
        "migrations",
    ):
        for path in (ROOT / folder).rglob("*.py"):
            assert not _imports(path) & set(UI), path


def test_top_model_and_sources_never_import_ui() -> None:
    """`kvctl top --json` and the figures' tests use them without Textual."""
    for name in ("model.py", "sources.py", "__init__.py"):
        assert not _imports(ROOT / "kvctl" / "tui" / name) & set(UI), name


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run(
        [str(lint), "--no-cache"], capture_output=True, text=True, cwd=root, timeout=300
    )


def test_the_layer_contracts_hold() -> None:
    """ARCHITECTURE.md's parts and their allowed imports, as pyproject.toml's contracts say."""
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_a_planted_violation_breaks_the_contracts(tmp_path: Path) -> None:
    """The contracts can fail: the store importing the SDK, and the dashboard asking an agent,
    planted in a copy of the tree, are each reported."""
    import shutil

    for part in ("kvctl", "collectors", "dashboard"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    keys = tmp_path / "kvctl" / "store" / "keys.py"
    keys.write_text(keys.read_text() + "\nfrom kvctl.client import AgentClient  # planted\n")
    app = tmp_path / "dashboard" / "app.py"
    app.write_text(app.read_text() + "\nimport kvctl.client  # planted\n")
    done = _lint_imports(tmp_path)
    assert done.returncode != 0
    assert "kvctl.store is not allowed to import kvctl.client" in done.stdout, done.stdout
    assert "dashboard is not allowed to import kvctl.client" in done.stdout, done.stdout
