"""The agent as a systemd service: the hardened unit (``unitfiles/kvctl-agent.service``) rendered
for this machine's kvctl and config file, an optional drop-in for GPU access
(``unitfiles/gpu.conf``), and their installation into a unit directory.

Installing never overwrites a different file unless forced, and writes each file atomically
(0644), so ``systemctl daemon-reload`` never reads a half-written unit."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path, PurePosixPath

from kvctl.errors import InvalidArgument
from kvctl.paths import write_atomic

UNIT_NAME = "kvctl-agent.service"
GPU_DROPIN = f"{UNIT_NAME}.d/gpu.conf"
DEFAULT_UNIT_DIR = Path("/etc/systemd/system")
DEFAULT_CONFIG = Path("/etc/kvctl/agent.toml")
NEXT_STEP = "systemctl daemon-reload && systemctl enable --now kvctl-agent"
#: ProtectHome=yes hides these from the service: a kvctl, interpreter or config there cannot run
PROTECT_HOME_ROOTS = (PurePosixPath("/home"), PurePosixPath("/root"), PurePosixPath("/run/user"))
#: PrivateTmp=yes gives the service empty ones of its own
PRIVATE_TMP_ROOTS = (PurePosixPath("/tmp"), PurePosixPath("/var/tmp"))
HIDDEN_ROOTS = PROTECT_HOME_ROOTS + PRIVATE_TMP_ROOTS
UNIT_FILE_MODE = 0o644


class UnitError(InvalidArgument):
    """The unit cannot be rendered or installed as asked; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class UnitFile:
    """One file to install: its path relative to the unit directory and its text."""

    relative_path: str
    text: str


@dataclass(frozen=True, slots=True)
class InstalledFile:
    path: Path
    #: "create", "replace" (different file, forced) or "unchanged" (same text already there)
    action: str
    text: str


@dataclass(frozen=True, slots=True)
class InstallReport:
    files: tuple[InstalledFile, ...]
    executable: Path
    config: Path
    dry_run: bool
    #: what the operator should know before starting it (a missing config file, ...)
    warnings: tuple[str, ...]
    next_step: str = NEXT_STEP


def _template(name: str) -> str:
    return resources.files("kvctl.agent").joinpath("unitfiles", name).read_text(encoding="utf-8")


def exec_arg(path: Path, *, command: bool = False) -> str:
    """``path`` as one word of a unit's ExecStart=: ``%`` escaped (systemd expands specifiers
    in every word), ``$`` escaped in an argument (where systemd expands variables; it does not
    in the ``command`` word), quoted when it holds a space, quote or backslash."""
    text = str(path)
    if not path.is_absolute():
        raise UnitError(f"{text!r} is not an absolute path: systemd needs one in ExecStart=")
    if any(not c.isprintable() for c in text):
        raise UnitError(f"{text!r} holds control characters: choose a plain path")
    if command and any(c in text for c in "'\"\\"):
        # systemd refuses such an executable ("contains special characters")
        raise UnitError(f"systemd cannot run {text!r}: its path holds a quote or backslash")
    text = text.replace("%", "%%")
    if not command:
        text = text.replace("$", "$$")
    if any(c in text for c in " \t\"\\'"):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text


def render_unit(executable: Path, config: Path) -> str:
    """The service unit running ``executable agent start --config config``."""
    return (
        _template(UNIT_NAME)
        .replace("@KVCTL@", exec_arg(executable, command=True))
        .replace("@CONFIG@", exec_arg(config))
    )


def gpu_dropin() -> str:
    """The drop-in that opens the NVIDIA devices and lifts what CUDA cannot run under."""
    return _template("gpu.conf")


def unit_files(executable: Path, config: Path, *, gpu: bool = False) -> tuple[UnitFile, ...]:
    files = [UnitFile(UNIT_NAME, render_unit(executable, config))]
    if gpu:
        files.append(UnitFile(GPU_DROPIN, gpu_dropin()))
    return tuple(files)


def find_kvctl(argv0: str | None = None) -> Path:
    """The kvctl executable to put in ExecStart=: the one running (``argv0``, default
    ``sys.argv[0]``) when it is the kvctl script, else ``kvctl`` on PATH, else the one beside
    this Python (``python -m kvctl`` in a virtual environment)."""
    running = Path(sys.argv[0] if argv0 is None else argv0)
    if running.name == "kvctl" and running.is_file() and os.access(running, os.X_OK):
        return running.absolute()
    on_path = shutil.which("kvctl")
    if on_path is not None:
        return Path(on_path).absolute()
    beside = Path(sys.executable).with_name("kvctl")
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    raise UnitError("cannot find the kvctl executable (not running as kvctl, none on PATH)")


def _interpreter(executable: Path) -> Path | None:
    """The interpreter of a ``#!`` script (a console script names its venv's Python)."""
    try:
        with executable.open("rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode("utf-8", "replace").split()
    return Path(words[0]) if words else None


def hidden_from_service(path: Path) -> tuple[Path, PurePosixPath] | None:
    """The spelling of ``path`` (as given or with links resolved) that ProtectHome= or
    PrivateTmp= hides from the service and the hidden root it is under, or None when the
    service can reach it."""
    for candidate in (path.absolute(), path.resolve()):
        pure = PurePosixPath(candidate)
        for root in HIDDEN_ROOTS:
            if pure == root or root in pure.parents:
                return candidate, root
    return None


def check_reachable(executable: Path, config: Path) -> None:
    """Refuse a kvctl, its interpreter or a config file the sandbox would hide: the service
    would fail at start (status 203/EXEC, or a missing config) with nothing saying why."""
    interpreter = _interpreter(executable)
    for what, path in (
        ("kvctl", executable),
        ("kvctl's interpreter", interpreter),
        ("the config file", config),
    ):
        if path is None:
            continue
        hidden = hidden_from_service(path)
        if hidden is not None:
            spelling, root = hidden
            where = "" if spelling == path.absolute() else f" (as {spelling})"
            setting = "PrivateTmp=yes" if root in PRIVATE_TMP_ROOTS else "ProtectHome=yes"
            raise UnitError(
                f"{what} {path}{where} is under {root}, which the unit's {setting} "
                "hides from the service: install "
                "kvctl where the service can run it (e.g. a virtual environment in /opt/kvctl) "
                "and pass --kvctl, and keep the config in /etc/kvctl"
            )


def _plan(path: Path, text: str, force: bool) -> str:
    try:
        current = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return "create"
    except (OSError, UnicodeDecodeError) as exc:
        if not force:
            raise UnitError(
                f"cannot read the existing {path} ({exc}); --force replaces it"
            ) from None
        return "replace"
    if current == text:
        return "unchanged"
    if not force:
        raise UnitError(
            f"{path} exists and differs from the unit kvctl would write: compare them with "
            "--dry-run, keep local changes in a drop-in (systemctl edit kvctl-agent), and "
            "replace it with --force"
        )
    return "replace"


def install_units(
    unit_dir: Path,
    *,
    executable: Path,
    config: Path = DEFAULT_CONFIG,
    gpu: bool = False,
    force: bool = False,
    dry_run: bool = False,
) -> InstallReport:
    """Write the agent's unit (and with ``gpu`` its GPU drop-in) into ``unit_dir``. Every file
    is checked before any is written, so a refusal leaves the directory as it was; a dry run
    checks the same and writes nothing."""
    executable, config = executable.absolute(), config.absolute()
    check_reachable(executable, config)
    if not (executable.is_file() and os.access(executable, os.X_OK)):
        raise UnitError(f"{executable} is not an executable file; pass kvctl's path with --kvctl")
    files = unit_files(executable, config, gpu=gpu)
    planned = tuple(
        InstalledFile(
            unit_dir / f.relative_path, _plan(unit_dir / f.relative_path, f.text, force), f.text
        )
        for f in files
    )
    if not dry_run:
        for f in planned:
            if f.action != "unchanged":
                f.path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(f.path, f.text, mode=UNIT_FILE_MODE)
    warnings = []
    if not config.exists():
        warnings.append(
            f"{config} does not exist yet: the service exits 2 (not restarted) until it does; "
            'it needs an [agent] table, e.g. [agent] cpu = "64GiB"'
        )
    return InstallReport(planned, executable, config, dry_run, tuple(warnings))


__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_UNIT_DIR",
    "GPU_DROPIN",
    "NEXT_STEP",
    "PRIVATE_TMP_ROOTS",
    "PROTECT_HOME_ROOTS",
    "UNIT_NAME",
    "InstallReport",
    "InstalledFile",
    "UnitError",
    "UnitFile",
    "check_reachable",
    "exec_arg",
    "find_kvctl",
    "gpu_dropin",
    "hidden_from_service",
    "install_units",
    "render_unit",
    "unit_files",
]
