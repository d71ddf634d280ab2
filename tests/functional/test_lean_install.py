"""`pip install kvctl` without extras: the agent and the CLI work, and a command whose extra is
missing says which one in one line.

Every process here runs in a lean environment (tests/functional/lean.py): a Python that cannot
import any installed distribution outside the core dependencies' closure, as on a GPU node that
installed kvctl alone. Agents serve the data plane, /metrics and a Redis pool tier; the SDK and
the CLI run lean too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvctl.agent.daemon import spawn_agent
from kvctl.extras import EXTRA_OF, MODULES
from tests.functional.agents import EPHEMERAL
from tests.functional.lean import ROOT, blocked_modules, lean_env

#: modules that need an extra (module or package prefix -> the extra); every other module of
#: kvctl, collectors and dashboard must import in a lean install
OPTIONAL_MODULES = {
    "dashboard.": "dashboard",
    "kvctl.engines.": "engine",
    "kvctl.tui.app": "tui",
    "kvctl.tui.dialogs": "tui",
    "kvctl.tui.fleet_screen": "tui",
    "kvctl.tui.node_screen": "tui",
    "kvctl.index.vllm_events": "vllm-events",
}

IMPORT_EVERYTHING = """
import importlib, json, pkgutil
failed = {}
for pkg in ("kvctl", "collectors", "dashboard"):
    root = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(root.__path__, pkg + "."):
        if info.name.endswith(".__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            failed[info.name] = exc.name
print(json.dumps(failed))
"""

#: the SDK, lean: put a chain on node a (written through to the Redis pool), read it on node b
#: (pulled from the pool), and scrape a's /metrics
CLIENT = """
import json, sys, time
import httpx
from kvctl.agent.settings import DEFAULT_MODELS
from kvctl.client import AgentClient, DataClient
from kvctl.store.keys import Namespace, keys_for, parents_of

a_data, a_url, b_data, b_url = sys.argv[1:5]
ns = Namespace(DEFAULT_MODELS[0].id, DEFAULT_MODELS[0].layout)
keys = keys_for(list(range(256 * 4)), ns, 256)
blob = lambda k: (k * (65536 // len(k)))[:65536]

def wait(what, check, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)

with DataClient.connect(a_data) as d:
    outs = d.put_many([(k, blob(k)) for k in keys], tenant="t1", parents=parents_of(keys),
                      tokens=256)
a, b = AgentClient(a_url), AgentClient(b_url)
wait("the write-through", lambda: a._request("GET", "/v1/remote")["write"]["written"] >= len(keys))
def costed():
    pool = b._request("GET", "/v1/remote")["pool"]
    return pool is not None and pool["link"]["costed"]
wait("b's link to the pool", costed)
with DataClient.connect(b_data) as d:  # as an engine does: look up the prefix, then read it
    found = d.lookup(keys, tenant="t2")
    got = d.get_many(keys, tenant="t2")
metrics = httpx.get(a_url.rstrip("/") + "/metrics", timeout=5).text
print(json.dumps({
    "stored": sorted({o.status for o in outs}),
    "same_bytes": [bytes(g) == blob(k) if g is not None else None for k, g in zip(keys, got)],
    "found": [found.matched_chunks, sorted(set(found.locations))],
    "b_remote_hits": b.stats()["stats"]["tiers"]["remote"]["hits"],
    "metrics_lines": [l for l in metrics.splitlines() if l.startswith("kvctl_")],
}))
"""


def run(
    env: dict[str, str], *args: str, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )


def kvctl(env: dict[str, str], *args: str) -> dict[str, Any]:
    """A CLI command in the lean environment, which must succeed and print JSON."""
    out = run(env, "-m", "kvctl", *args)
    assert out.returncode == 0, f"kvctl {' '.join(args)}: {out.returncode}\n{out.stderr}"
    assert "Traceback" not in out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return lean_env(tmp_path_factory.mktemp("lean"))


def test_the_lean_environment_lacks_every_extra(env: dict[str, str]) -> None:
    # the finder must be active, or every other test here proves nothing
    for module in EXTRA_OF:
        out = run(env, "-c", f"import {module}")
        assert out.returncode == 1
        assert f"No module named '{module}'" in out.stderr
    assert set(EXTRA_OF) <= blocked_modules()  # none of them is a core dependency's
    assert run(env, "-c", "import numpy, sqlalchemy, redis, fastapi").returncode == 0


def test_core_modules_import_without_any_extra(env: dict[str, str]) -> None:
    out = run(env, "-c", IMPORT_EVERYTHING, timeout_s=180)
    assert out.returncode == 0, out.stderr
    failed: dict[str, str] = json.loads(out.stdout)
    for module, missing in failed.items():
        extra = next(
            (x for prefix, x in OPTIONAL_MODULES.items() if module.startswith(prefix)), None
        )
        assert extra is not None, f"{module} fails without {missing!r} in a lean install"
        assert missing.partition(".")[0] in MODULES[extra], (module, missing, extra)
    # the optional ones do need their extra (else the list above hides nothing and can go)
    assert {m for m in failed if not m.startswith(("dashboard.", "kvctl.engines."))} == {
        m for m in OPTIONAL_MODULES if not m.endswith(".")
    }
    assert any(m.startswith("dashboard.") for m in failed)
    assert any(m.startswith("kvctl.engines.") for m in failed)


def test_agent_pool_tier_sdk_and_cli_without_any_extra(
    env: dict[str, str], tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    pool = ["--pool", redis_url, "--pool-prefix", redis_prefix, "--cpu", "64MiB", "--disk", "0"]
    a_proc, a = spawn_agent([*EPHEMERAL, "--name", "a", *pool], tmp_path / "a", env=env)
    try:
        # b models an L4's prefill, so fetching the chunks from the pool is the better choice
        b_proc, b = spawn_agent(
            [*EPHEMERAL, "--name", "b", "--gpu", "l4", *pool], tmp_path / "b", env=env
        )
        try:
            assert a.data_tcp and b.data_tcp
            out = run(env, "-c", CLIENT, a.data_tcp, a.control_url, b.data_tcp, b.control_url)
            assert out.returncode == 0, out.stderr
            got = json.loads(out.stdout)
            assert got["stored"] == ["stored"]
            assert got["same_bytes"] == [True] * 4
            assert got["found"] == [4, ["remote"]]  # b holds none: the pool tier has them
            assert got["b_remote_hits"] == 4
            assert 'kvctl_puts_total{tier="cpu"} 4.0' in got["metrics_lines"]

            status = kvctl(env, "agent", "status", "--url", a.control_url, "--json")
            assert status["up"] and status["info"]["name"] == "a"
            remote = kvctl(env, "agent", "remote", "--url", b.control_url, "--json")
            assert remote["pool"]["chunks_in"] == 4

            db = ["--db", f"sqlite:///{tmp_path / 'fleet.db'}"]
            kvctl(env, "fleet", "add-dc", "fra", *db, "--json")
            for name, state in (("a", a), ("b", b)):
                kvctl(
                    env,
                    *("fleet", "add-node", name, "--dc", "fra"),
                    *("--agent-url", state.control_url, *db, "--json"),
                )
            fleet = kvctl(env, "fleet", "ls", *db, "--json")
            assert sorted(n["name"] for n in fleet["nodes"]) == ["a", "b"]
            live = kvctl(env, "status", *db, "--json")
            assert sorted(n["node"] for n in live["nodes"] if n["up"]) == ["a", "b"]
            cycle = kvctl(env, "collect", "--once", "--no-links", *db, "--json")
            assert sorted(cycle["scrape"]["up"]) == ["a", "b"]
            assert cycle["scrape"]["written"]
            assert kvctl(env, "db", "current", *db, "--json")["up_to_date"]
            top = kvctl(env, "top", "--agent", a.control_url, "--json", "--interval", "0.2")
            assert top["nodes"][0]["up"]
        finally:
            b_proc.terminate()
            assert b_proc.wait(20) == 0
    finally:
        a_proc.terminate()
        assert a_proc.wait(20) == 0


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["top", "--agent", "http://127.0.0.1:9"],
            "kvctl top needs the 'tui' extra: pip install 'kvctl[tui]' "
            "(`kvctl top --json` runs without it)",
        ),
        (
            ["dashboard"],
            "kvctl dashboard needs the 'dashboard' extra: pip install 'kvctl[dashboard]'",
        ),
        (
            ["demo", "--duration", "1"],
            "kvctl demo needs the 'dashboard' extra: pip install 'kvctl[dashboard]' "
            "(or run it with --no-dashboard)",
        ),
        (
            ["bench", "ttft"],
            "kvctl bench ttft needs the 'engine' extra: pip install 'kvctl[engine]'",
        ),
        (["bench", "gpu"], "kvctl bench gpu needs the 'engine' extra: pip install 'kvctl[engine]'"),
        (["bench", "top"], "kvctl bench top needs the 'tui' extra: pip install 'kvctl[tui]'"),
    ],
)
def test_a_missing_extra_is_one_line_and_exit_2(
    env: dict[str, str], tmp_path: Path, args: list[str], line: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvctl", *args],
        env={**env, "KVCTL_DB_URL": f"sqlite:///{tmp_path / 'x.db'}"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert out.stderr == f"error: {line}\n"
    assert out.stdout == ""
    assert not list(tmp_path.iterdir())  # refused before doing anything


def test_an_unchecked_import_of_an_extra_is_the_same_one_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    # the entry point's safety net, for a code path that forgot its check: run main() with a
    # command that imports the live view's app directly
    script = (
        "import typer\n"
        "from kvctl.cli.main import app, main\n"
        "@app.command('forgot-its-check')\n"
        "def _forgot() -> None:\n"
        "    import kvctl.tui.app\n"
        "main()\n"
    )
    out = run(env, "-c", script, "forgot-its-check")
    assert out.returncode == 2
    assert out.stderr == (
        "error: this kvctl command needs the 'tui' extra: pip install 'kvctl[tui]'\n"
    )


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("CI") != "true" and os.environ.get("KVCTL_TEST_PIP_INSTALL") != "1",
    reason="pip-installs kvctl and its core dependencies into a fresh venv (about a minute, "
    "from the package index): runs in CI, or with KVCTL_TEST_PIP_INSTALL=1",
)
def test_pip_install_without_extras_in_a_fresh_venv(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python, exe = venv / "bin" / "python", venv / "bin" / "kvctl"
    # a copy of what the distribution is built from: pip builds in the source tree
    src = tmp_path / "src"
    for part in ("kvctl", "collectors", "dashboard", "migrations"):
        shutil.copytree(ROOT / part, src / part, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / part, src / part)
    # --no-compile: byte-compiling every dependency was a fifth of this test's CPU (34.7 s
    # against 26.9 s without), and what is checked here is what gets installed and runs
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-compile", str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    installed = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "kvctl" in installed
    optional = {
        "dash",
        "plotly",
        "waitress",
        "textual",
        "torch",
        "transformers",
        "pyzmq",
        "msgpack",
    }
    assert not installed & optional

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "xdg"), NO_COLOR="1")

    def kvctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(exe), *args], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
        )

    data_dir = ["--data-dir", str(tmp_path / "agent")]
    started = kvctl("agent", "start", *EPHEMERAL, "--cpu", "16MiB", "--disk", "0", "--detach",
                    *data_dir)  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        status = kvctl("agent", "status", *data_dir, "--json")
        assert status.returncode == 0, status.stderr
        url = json.loads(status.stdout)["control_url"]
        assert "kvctl_lookups_total" in httpx.get(f"{url}/metrics", timeout=5).text
    finally:
        stopped = kvctl("agent", "stop", *data_dir)
        assert stopped.returncode == 0, stopped.stderr
    for args, extra in (
        (["top"], "tui"),
        (["dashboard"], "dashboard"),
        (["bench", "ttft"], "engine"),
    ):
        out = kvctl(*args)
        assert out.returncode == 2
        assert out.stderr.startswith(f"error: kvctl {' '.join(args)} needs the '{extra}' extra")
        assert out.stderr.count("\n") == 1
