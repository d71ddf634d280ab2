"""The agent's systemd unit: what it renders (the real kvctl path, escaped for ExecStart=),
what `kvctl agent install --systemd` writes and refuses, and `systemd-analyze verify` and
`security --offline` on the installed files. systemd-analyze is needed for those two (skipped
without it outside CI)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvctl.agent import systemd
from kvctl.agent.config import ConfigError, load_settings
from kvctl.agent.systemd import (
    DEFAULT_CONFIG,
    GPU_DROPIN,
    NEXT_STEP,
    UNIT_NAME,
    UnitError,
    check_reachable,
    exec_arg,
    find_kvctl,
    gpu_dropin,
    hidden_from_service,
    install_units,
    render_unit,
)
from kvctl.cli.main import app
from tests.tools import required_tool

OPT_KVCTL = Path("/opt/kvctl/bin/kvctl")


def unit_settings(*texts: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of a unit and its drop-ins, in order (systemd keeps repeated keys;
    an empty assignment resets the list, as systemd does)."""
    out: dict[str, list[str]] = {}
    for text in texts:
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";", "[")):
                continue
            key, sep, value = line.partition("=")
            assert sep, f"not a Key=value line: {raw!r}"
            out[key] = [] if value == "" else [*out.get(key, []), value]
    return out


def one(settings: dict[str, list[str]], key: str) -> str:
    values = settings.get(key, [])
    assert len(values) == 1, f"{key}: {values}"
    return values[0]


def last(settings: dict[str, list[str]], key: str) -> str:
    """A single-valued setting's value where a drop-in may assign it again (the last wins)."""
    values = settings.get(key, [])
    assert values, f"{key} is not set"
    return values[-1]


def systemd_analyze() -> str:
    return required_tool("systemd-analyze", "apt-get install systemd")


def fake_kvctl(directory: Path) -> Path:
    """An executable named kvctl (a shell script: /bin/sh is outside ProtectHome's reach)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "kvctl"
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


# --- rendering ----------------------------------------------------------------------------------


def test_the_unit_runs_the_agent_in_the_foreground_with_the_config() -> None:
    text = render_unit(OPT_KVCTL, DEFAULT_CONFIG)
    s = unit_settings(text)
    assert one(s, "ExecStart") == "/opt/kvctl/bin/kvctl agent start --config /etc/kvctl/agent.toml"
    assert not re.search("@[A-Z]+@", text)  # every placeholder filled
    assert one(s, "Type") == "exec"  # the agent does not fork: systemd watches the process
    assert one(s, "EnvironmentFile") == "-/etc/kvctl/agent.env"  # the token, read as root


def test_the_unit_is_sandboxed() -> None:
    s = unit_settings(render_unit(OPT_KVCTL, DEFAULT_CONFIG))
    expected = {
        "DynamicUser": "yes",
        "StateDirectory": "kvctl",
        "StateDirectoryMode": "0700",
        "RuntimeDirectory": "kvctl",
        "PrivateTmp": "yes",
        "PrivateDevices": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "NoNewPrivileges": "yes",
        "CapabilityBoundingSet": None,  # empty: no capability at all
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "MemoryDenyWriteExecute": "yes",
        "Restart": "on-failure",
        "KillSignal": "SIGTERM",
        "KillMode": "mixed",
    }
    for key, value in expected.items():
        if value is None:
            assert key not in s or s[key] == [], key
        else:
            assert one(s, key) == value, key
    assert s["SystemCallFilter"] == ["@system-service", "~@privileged"]


def test_the_units_paths_are_the_agents_settings() -> None:
    # the unit's KVCTL_* variables are real agent settings, and land in the directories systemd
    # makes for the service (%S = /var/lib, %t = /run for a system unit)
    s = unit_settings(render_unit(OPT_KVCTL, DEFAULT_CONFIG))
    env = dict(v.split("=", 1) for v in s["Environment"])
    specifiers = {"%S": "/var/lib", "%t": "/run"}
    resolved = {k: re.sub(r"%[St]", lambda m: specifiers[m.group()], v) for k, v in env.items()}
    settings = load_settings(config_file=None, env={"HOME": "/nonexistent", **resolved}).settings
    assert settings.data_path == Path("/var/lib") / one(s, "StateDirectory")
    assert settings.socket_path == Path("/run") / one(s, "RuntimeDirectory") / "agent.sock"


def test_restart_prevent_status_is_the_settings_error_code(tmp_path: Path) -> None:
    # RestartPreventExitStatus=2: `kvctl agent start` exits 2 for settings it cannot accept
    s = unit_settings(render_unit(OPT_KVCTL, DEFAULT_CONFIG))
    result = CliRunner().invoke(
        app, ["agent", "start", "--config", str(tmp_path / "missing.toml")], env={"HOME": "/x"}
    )
    assert result.exit_code == int(one(s, "RestartPreventExitStatus")) == 2, result.output
    with pytest.raises(ConfigError):
        load_settings(config_file=tmp_path / "missing.toml", env={})


def test_the_gpu_dropin_opens_nvidia_devices_and_lifts_what_cuda_needs() -> None:
    base = render_unit(OPT_KVCTL, DEFAULT_CONFIG)
    s = unit_settings(base, gpu_dropin())
    assert last(s, "PrivateDevices") == "no"
    assert last(s, "DevicePolicy") == "closed"
    assert s["DeviceAllow"] == ["char-nvidia* rw"]
    assert last(s, "LimitMEMLOCK") == "infinity"
    assert last(s, "MemoryDenyWriteExecute") == "no"
    assert s["SystemCallFilter"] == []  # reset by the drop-in's empty assignment
    assert last(s, "ProtectSystem") == "strict"  # the rest of the sandbox stays


@pytest.mark.parametrize(
    ("path", "command", "word"),
    [
        ("/opt/kvctl/bin/kvctl", True, "/opt/kvctl/bin/kvctl"),
        ("/opt/kv ctl/kvctl", True, '"/opt/kv ctl/kvctl"'),
        ("/opt/50%/kvctl", True, "/opt/50%%/kvctl"),
        ("/opt/$HOME/kvctl", True, "/opt/$HOME/kvctl"),  # no variables in the command word
        ("/etc/$HOME/a.toml", False, "/etc/$$HOME/a.toml"),
        ("/etc/it's/a.toml", False, '"/etc/it\'s/a.toml"'),
        ('/etc/a"b\\c.toml', False, '"/etc/a\\"b\\\\c.toml"'),
    ],
)
def test_exec_arg_escapes_for_systemd(path: str, command: bool, word: str) -> None:
    assert exec_arg(Path(path), command=command) == word


@pytest.mark.parametrize(
    ("path", "command", "error"),
    [
        ("bin/kvctl", True, "not an absolute path"),
        ("/opt/a\nb/kvctl", True, "control characters"),
        ("/opt/it's/kvctl", True, "quote or backslash"),
        ("/opt/a\\b/kvctl", True, "quote or backslash"),
    ],
)
def test_exec_arg_refuses_what_systemd_cannot_run(path: str, command: bool, error: str) -> None:
    with pytest.raises(UnitError, match=error):
        exec_arg(Path(path), command=command)


@pytest.fixture
def tmp_reachable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let units be installed from pytest's tmp_path (under /tmp, which PrivateTmp= hides
    from a running service): these tests render, write and check units, never start them."""
    monkeypatch.setattr(systemd, "HIDDEN_ROOTS", systemd.PROTECT_HOME_ROOTS)


# --- what the sandbox hides ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "root"),
    [
        ("/home/ann/.venv/bin/kvctl", "/home"),
        ("/root/.pyenv/versions/3.11/bin/python3", "/root"),
        ("/run/user/1000/kvctl", "/run/user"),
        ("/tmp/venv/bin/kvctl", "/tmp"),  # PrivateTmp=: the service's /tmp is its own
        ("/var/tmp/agent.toml", "/var/tmp"),
        ("/opt/kvctl/bin/kvctl", None),
        ("/homework/kvctl", None),
    ],
)
def test_protect_home_and_private_tmp_hide(path: str, root: str | None) -> None:
    hidden = hidden_from_service(Path(path))
    assert (None if hidden is None else str(hidden[1])) == root


@pytest.mark.usefixtures("tmp_reachable")
def test_a_link_into_home_is_hidden_too(tmp_path: Path) -> None:
    link = tmp_path / "kvctl"
    link.symlink_to("/home/ann/.local/bin/kvctl")
    hidden = hidden_from_service(link)
    assert hidden is not None and str(hidden[1]) == "/home"


@pytest.mark.usefixtures("tmp_reachable")
def test_a_kvctl_whose_interpreter_is_under_root_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "kvctl"
    script.write_text("#!/root/.venv/bin/python3\nprint()\n")
    script.chmod(0o755)
    with pytest.raises(UnitError, match=r"interpreter /root/\.venv/bin/python3 is under /root"):
        check_reachable(script, DEFAULT_CONFIG)
    with pytest.raises(UnitError, match=r"config file /home/ann/agent\.toml is under /home"):
        check_reachable(fake_kvctl(tmp_path / "ok"), Path("/home/ann/agent.toml"))


def test_a_config_or_kvctl_in_tmp_is_refused_naming_private_tmp() -> None:
    with pytest.raises(UnitError, match=r"/tmp/agent\.toml is under /tmp, .*PrivateTmp=yes"):
        check_reachable(OPT_KVCTL, Path("/tmp/agent.toml"))
    with pytest.raises(UnitError, match=r"kvctl /var/tmp/v/bin/kvctl is under /var/tmp"):
        install_units(Path("/nonexistent/units"), executable=Path("/var/tmp/v/bin/kvctl"))


def test_find_kvctl_prefers_the_running_one_then_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = fake_kvctl(tmp_path / "running")
    assert find_kvctl(str(running)) == running
    on_path = fake_kvctl(tmp_path / "on-path")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_kvctl("/usr/lib/python3/kvctl/__main__.py") == on_path


# --- installing ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("tmp_reachable")
def test_install_writes_then_keeps_then_refuses_a_different_unit(tmp_path: Path) -> None:
    kvctl, units = fake_kvctl(tmp_path / "bin"), tmp_path / "units"
    first = install_units(units, executable=kvctl, config=DEFAULT_CONFIG, gpu=True)
    assert [(f.path.relative_to(units).as_posix(), f.action) for f in first.files] == [
        (UNIT_NAME, "create"),
        (GPU_DROPIN, "create"),
    ]
    unit = units / UNIT_NAME
    assert unit.read_text() == render_unit(kvctl, DEFAULT_CONFIG)
    assert (units / GPU_DROPIN).read_text() == gpu_dropin()
    assert unit.stat().st_mode & 0o777 == 0o644
    again = install_units(units, executable=kvctl, config=DEFAULT_CONFIG, gpu=True)
    assert [f.action for f in again.files] == ["unchanged", "unchanged"]

    unit.write_text(unit.read_text() + "# a local change\n")
    edited = unit.read_text()
    other = Path("/etc/kvctl/other.toml")
    with pytest.raises(UnitError, match=r"exists and differs.*--force"):
        install_units(units, executable=kvctl, config=other)
    assert unit.read_text() == edited  # nothing written
    with pytest.raises(UnitError, match="exists and differs"):
        install_units(units, executable=kvctl, config=other, dry_run=True)
    forced = install_units(units, executable=kvctl, config=other, force=True)
    assert [f.action for f in forced.files] == ["replace"]
    assert unit.read_text() == render_unit(kvctl, other)


@pytest.mark.usefixtures("tmp_reachable")
def test_a_refusal_writes_none_of_the_files(tmp_path: Path) -> None:
    kvctl, units = fake_kvctl(tmp_path / "bin"), tmp_path / "units"
    (units / GPU_DROPIN).parent.mkdir(parents=True)
    (units / GPU_DROPIN).write_text("[Service]\n# mine\n")
    with pytest.raises(UnitError, match=r"gpu\.conf exists and differs"):
        install_units(units, executable=kvctl, gpu=True)
    assert not (units / UNIT_NAME).exists()


@pytest.mark.usefixtures("tmp_reachable")
def test_dry_run_writes_nothing_and_warns_of_a_missing_config(tmp_path: Path) -> None:
    kvctl, units = fake_kvctl(tmp_path / "bin"), tmp_path / "units"
    report = install_units(units, executable=kvctl, config=tmp_path / "agent.toml", dry_run=True)
    assert [f.action for f in report.files] == ["create"] and not units.exists()
    assert report.dry_run and report.next_step == NEXT_STEP
    assert any("agent.toml does not exist yet" in w for w in report.warnings)


@pytest.mark.usefixtures("tmp_reachable")
def test_install_refuses_a_kvctl_that_is_not_executable(tmp_path: Path) -> None:
    with pytest.raises(UnitError, match="not an executable file"):
        install_units(tmp_path / "units", executable=tmp_path / "missing" / "kvctl")


# --- the command --------------------------------------------------------------------------------


def _install(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["agent", "install", *args])
    return result.exit_code, result.output


@pytest.mark.usefixtures("tmp_reachable")
def test_cli_dry_run_prints_the_unit_and_the_next_step(tmp_path: Path) -> None:
    kvctl, units = fake_kvctl(tmp_path / "bin"), tmp_path / "units"
    code, out = _install("--systemd", "--kvctl", str(kvctl), "--unit-dir", str(units), "--dry-run")
    assert code == 0, out
    assert f"ExecStart={kvctl} agent start --config /etc/kvctl/agent.toml" in out
    assert "(would create)" in out and NEXT_STEP in out
    assert not units.exists()


@pytest.mark.usefixtures("tmp_reachable")
def test_cli_json_then_refuse_then_force(tmp_path: Path) -> None:
    kvctl, units = fake_kvctl(tmp_path / "bin"), tmp_path / "units"
    base = ["--systemd", "--kvctl", str(kvctl), "--unit-dir", str(units)]
    code, out = _install(*base, "--gpu", "--json")
    assert code == 0, out
    report = json.loads(out)
    assert [(f["path"], f["action"]) for f in report["files"]] == [
        (str(units / UNIT_NAME), "create"),
        (str(units / GPU_DROPIN), "create"),
    ]
    assert report["executable"] == str(kvctl) and report["next_step"] == NEXT_STEP
    assert report["files"][0]["text"] == (units / UNIT_NAME).read_text()

    other = ["--config", "/etc/kvctl/other.toml"]
    code, out = _install(*base, *other)
    assert code == 2 and "exists and differs" in out and "--force" in out
    code, out = _install(*base, *other, "--force")
    assert code == 0 and f"replaced {units / UNIT_NAME}" in out
    assert "--config /etc/kvctl/other.toml" in (units / UNIT_NAME).read_text()


def test_cli_needs_a_target_and_a_runnable_kvctl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out = _install("--unit-dir", str(tmp_path))
    assert code == 2 and "--systemd" in out
    # resolved from /, so not under a root the sandbox hides wherever the checkout lives
    monkeypatch.chdir("/")
    code, out = _install("--systemd", "--kvctl", "relative/kvctl", "--unit-dir", str(tmp_path))
    assert code == 2 and "not an executable file" in out


# --- systemd's own checks -----------------------------------------------------------------------


def _verify(analyze: str, unit: Path) -> subprocess.CompletedProcess[str]:
    # --man=no: no man pages in containers; the unit's own directory is searched for drop-ins
    return subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.usefixtures("tmp_reachable")
def test_systemd_analyze_verifies_the_installed_unit_and_dropin(tmp_path: Path) -> None:
    analyze = systemd_analyze()
    # a path with a space and a %: ExecStart= must quote and escape it for systemd to find it
    kvctl, units = fake_kvctl(tmp_path / "kv ctl 100%"), tmp_path / "units"
    install_units(units, executable=kvctl, config=Path("/etc/kvctl/a b.toml"), gpu=True)
    done = _verify(analyze, units / UNIT_NAME)
    complaints = [ln for ln in (done.stdout + done.stderr).splitlines() if UNIT_NAME in ln]
    assert done.returncode == 0 and not complaints, done.stdout + done.stderr

    # the same check does see a broken drop-in and a kvctl that is not there
    (units / GPU_DROPIN).write_text(gpu_dropin() + "DeviceAlow=char-nvidia* rw\n")
    broken = _verify(analyze, units / UNIT_NAME)
    assert "Unknown key 'DeviceAlow'" in broken.stderr, broken.stderr
    kvctl.unlink()
    assert _verify(analyze, units / UNIT_NAME).returncode != 0


def _exposure(analyze: str, unit: Path) -> float:
    done = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
    assert match, done.stdout[-2000:] + done.stderr
    return float(match.group(1))


@pytest.mark.usefixtures("tmp_reachable")
def test_systemd_analyze_security_exposure(tmp_path: Path) -> None:
    # systemd's score: 0 (every restriction) to 10 (none); the GPU drop-in gives up the device
    # policy, the system-call filter and W^X, so it scores higher
    analyze = systemd_analyze()
    kvctl = fake_kvctl(tmp_path / "bin")
    install_units(tmp_path / "base", executable=kvctl)
    install_units(tmp_path / "gpu", executable=kvctl, gpu=True)
    base = _exposure(analyze, tmp_path / "base" / UNIT_NAME)
    gpu = _exposure(analyze, tmp_path / "gpu" / UNIT_NAME)
    assert base <= 2.0 and base < gpu <= 4.0, (base, gpu)
