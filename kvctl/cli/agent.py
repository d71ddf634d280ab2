"""`kvctl agent ...`: start, stop and inspect the KV-cache agent of this node."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from shlex import quote
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.markup import escape

from kvctl.agent.systemd import DEFAULT_CONFIG, DEFAULT_UNIT_DIR
from kvctl.cli.options import JsonOpt, bundled, read_secret_file
from kvctl.cli.output import console, err_console, fail, print_json

if TYPE_CHECKING:
    from kvctl.agent.config import LoadedSettings
    from kvctl.agent.daemon import AgentState
    from kvctl.agent.settings import AgentSettings
    from kvctl.agent.systemd import InstallReport
    from kvctl.paths import WriteFailed

agent_app = typer.Typer(
    no_args_is_help=True, help="Run and inspect the tiered KV-cache agent on this node."
)

ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="TOML file with an \\[agent] table (default: $KVCTL_CONFIG or "
        "~/.config/kvctl/agent.toml when it exists).",
    ),
]
NameOpt = Annotated[str | None, typer.Option(help="Agent name (default: the host name).")]
DataDirOpt = Annotated[
    str | None,
    typer.Option(
        "--data-dir", help="State and disk-tier directory (default: ~/.local/state/kvctl/NAME)."
    ),
]


def _load(config: Path | None, **flags: object) -> LoadedSettings:
    from kvctl.agent.config import ConfigError, load_settings

    try:
        return load_settings(config_file=config, flags=flags)
    except ConfigError as exc:
        fail(str(exc), hint=_config_hint(exc.source))


def _config_hint(source: str | None) -> str:
    """What to do about a setting that did not load from ``source``. A file or a variable is
    to be fixed where it is: `kvctl agent config --show` reads them too, and fails the same."""
    kind, _, where = (source or "").partition(":")
    if kind == "file":
        return f"fix {where}, or give another file with --config"
    if kind == "env":
        return f"fix or unset {where}"
    return "`kvctl agent config --show` prints every setting and its source"


def _handed_over(fd: int) -> AgentSettings:
    """The settings a detaching `kvctl agent start` handed this process in the memory file it
    inherited as ``fd`` (``settings_memfd``), as they are: no config file and no KVCTL_*
    variable applies on top."""
    from kvctl.agent.config import ConfigError, load_settings
    from kvctl.agent.daemon import SETTINGS_MEMFD_NAME

    path = Path(f"/proc/self/fd/{fd}")
    try:
        try:
            target = os.readlink(path)
        except OSError as exc:
            fail(
                f"cannot read the settings this agent's start handed it (descriptor {fd}, read "
                f"as {path}): {exc.strerror or exc}",
                hint="is /proc mounted? or start the agent in the foreground (without --detach)",
                code=1,
            )
        if not target.startswith(f"/memfd:{SETTINGS_MEMFD_NAME}"):
            # (anything else would load as a config file, or as defaults where it reads empty)
            fail(
                f"descriptor {fd} is {target}, not the settings a detaching start hands its "
                "agent: --settings-fd is kvctl agent start --detach's own",
                code=1,
            )
        try:
            return load_settings(config_file=path, env={}).settings
        except ConfigError as exc:
            fail(str(exc), code=1)
    finally:  # read: the agent's own children never hold it
        with contextlib.suppress(OSError):
            os.close(fd)


@dataclass(frozen=True, slots=True)
class StartFlags:
    """`kvctl agent start`'s settings flags, named as the config spells them; unset (None)
    leaves the value to the file, the KVCTL_* variables or the default."""

    name: NameOpt = None
    dc: Annotated[str | None, typer.Option(help="Datacenter this node is in.")] = None
    listen: Annotated[
        str | None, typer.Option(help="Control API HOST:PORT (default 127.0.0.1:7070).")
    ] = None
    data_listen: Annotated[
        str | None,
        typer.Option(
            "--data-listen", help="Data plane TCP HOST:PORT, or 'off' (default 127.0.0.1:7071)."
        ),
    ] = None
    socket: Annotated[
        str | None,
        typer.Option(
            "--socket", help="Data plane Unix socket path, or 'off' (default DATA_DIR/agent.sock)."
        ),
    ] = None
    data_dir: DataDirOpt = None
    cpu: Annotated[str | None, typer.Option(help="Host-memory tier size, e.g. 64GiB.")] = None
    disk: Annotated[
        str | None, typer.Option(help="Disk tier size, e.g. 512GiB; 0 turns it off.")
    ] = None
    gpu_capacity: Annotated[
        str | None,
        typer.Option(
            "--gpu-capacity",
            help="CUDA-memory tier size above cpu, e.g. 8GiB (default 0: off). Without CUDA "
            "the agent starts without it and says why.",
        ),
    ] = None
    gpu_device: Annotated[
        str | None,
        typer.Option("--gpu-device", help="CUDA device of the gpu tier: cuda or cuda:N."),
    ] = None
    eviction: Annotated[
        str | None,
        typer.Option(
            help="Eviction policy of every tier (default lineage-adaptive; lineage-lru2 spends "
            "less CPU per chunk read; see `kvctl simulate --help` to compare them on a trace)."
        ),
    ] = None
    role: Annotated[
        str | None,
        typer.Option(help="'node' (serves engines) or 'pool' (the shared tier for other agents)."),
    ] = None
    pool: Annotated[
        str | None,
        typer.Option(
            help="Shared remote tier: redis://HOST:6379/0, redis+cluster://HOST:PORT, "
            "valkey://..., or kvctl://HOST:PORT (a --role pool agent)."
        ),
    ] = None
    pool_prefix: Annotated[
        str | None,
        typer.Option(help="Key prefix in a Redis pool: agents that share it share chunks."),
    ] = None
    pool_capacity: Annotated[
        str | None,
        typer.Option(help="The pool's capacity, e.g. 512GiB (shared: every agent sees it)."),
    ] = None
    peers: Annotated[
        list[str] | None,
        typer.Option(
            "--peer", help="A peer agent to pull chunks from: NAME=HOST:PORT (repeatable)."
        ),
    ] = None
    links: Annotated[
        list[str] | None,
        typer.Option(
            "--link",
            help="Link override: NAME:override=auto|fetch|recompute,rtt_ms=N,bandwidth=SIZE,"
            "delay_ms=N (NAME is 'pool' or a peer; delay_ms emulates distance). Repeatable.",
        ),
    ] = None
    pool_write: Annotated[
        str | None,
        typer.Option(help="'through' (copy every stored chunk to the pool) or 'off'."),
    ] = None
    index_url: Annotated[
        str | None,
        typer.Option(
            help="A router's fleet index (http://HOST:9480): lookups probe only the peers it "
            "names, every peer when it does not answer. Peers must be named as in the fleet."
        ),
    ] = None
    index_token_file: Annotated[
        Path | None,
        typer.Option(
            help="File holding the router's token, first line (default: $KVCTL_INDEX_TOKEN or "
            "index_token in the config, else the remote token, else the agent's). Never the "
            "token itself on the command line: every process listing shows it.",
            show_default=False,
        ),
    ] = None
    gpu: Annotated[
        str | None,
        typer.Option(
            help="GPU profile (e.g. h100) the fetch-or-recompute decision models prefill on; "
            "not the gpu tier (--gpu-capacity)."
        ),
    ] = None
    stop_demote_seconds: Annotated[
        float | None,
        typer.Option(
            "--stop-demote-seconds",
            min=0,
            help="At a clean stop, demote the gpu and cpu tiers' unpinned chunks to disk, "
            "hottest first, for at most this long, so a restart keeps them (default 15; 0 "
            "off). Keep 10 s of drain plus this under the stopper's timeout.",
        ),
    ] = None
    log_level: Annotated[
        str | None,
        typer.Option(
            "--log-level",
            help="debug, info, warning or error (default info): the agent's log, stderr in the "
            "foreground, DATA_DIR/agent.log detached.",
        ),
    ] = None
    log_max: Annotated[
        str | None,
        typer.Option(
            "--log-max",
            help="Detached: DATA_DIR/agent.log rolls over to agent.log.1 past this size, e.g. "
            "64MiB (the default); 0 never. A terminal's or journald's log, or an agent.log "
            "that links elsewhere, is left alone.",
        ),
    ] = None
    log_backups: Annotated[
        int | None,
        typer.Option(
            "--log-backups",
            help="Rolled-over logs kept, agent.log.1 (newest) to agent.log.N (default 3).",
        ),
    ] = None

    def as_flags(self) -> dict[str, object]:
        """The flags for the config's flag layer; a repeatable flag not given is unset."""
        flags: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        token_file = flags.pop("index_token_file")
        flags["index_token"] = None  # a secret is never a flag's value: ps shows those
        if token_file is not None:
            flags["index_token"] = read_secret_file(Path(str(token_file)), "--index-token-file")
        return flags | {"peers": self.peers or None, "links": self.links or None}


@dataclass(frozen=True, slots=True)
class AgentHome:
    """Which agent of this node: its config file, its name and its data dir."""

    config: ConfigOpt = None
    name: NameOpt = None
    data_dir: DataDirOpt = None

    def load(self) -> LoadedSettings:
        return _load(self.config, name=self.name, data_dir=self.data_dir)

    @property
    def named(self) -> bool:
        """--data-dir was given: only an agent recorded there may answer for it."""
        return self.data_dir is not None


UrlOpt = Annotated[
    str | None, typer.Option(help="Control URL of an agent elsewhere (http://host:7070).")
]


@agent_app.command("start")
@bundled
def start_command(
    *,
    config: ConfigOpt = None,
    flags: StartFlags,
    detach: Annotated[
        bool, typer.Option("--detach", "-d", help="Run in the background and return when ready.")
    ] = False,
    start_timeout: Annotated[
        float | None,
        typer.Option(
            "--start-timeout",
            min=1.0,
            help="With --detach: give up (and stop the agent) after this many seconds whatever "
            "it logs. Default: wait while its log moves (a large disk tier's scan logs its "
            "progress), giving up 30 s (plus 3 s a GiB of memory) after its last line.",
        ),
    ] = None,
    settings_fd: Annotated[
        int | None,
        # how --detach hands the child its settings (an inherited memory file, never argv or a
        # file on disk): not for people
        typer.Option("--settings-fd", hidden=True),
    ] = None,
) -> None:
    """Start the agent: the control API, the data plane (TCP, Unix socket, shared memory)
    and /metrics. Runs in the foreground until SIGTERM or Ctrl-C unless --detach.

    Settings come from defaults, then the config file, then KVCTL_* variables, then flags.
    Binding anywhere but loopback needs a token (KVCTL_TOKEN or `token` in the file).

    Examples:

      kvctl agent start --cpu 8GiB --disk 100GiB

      kvctl agent start --gpu-capacity 8GiB --gpu-device cuda:1 --cpu 32GiB

      kvctl agent start --name gpu-07 --dc fra-1 --detach

      kvctl agent start --detach --start-timeout 600

      KVCTL_TOKEN=$(cat /etc/kvctl/token) kvctl agent start --listen 0.0.0.0:7070

      kvctl agent start --pool redis://10.0.0.5:6379/0 --peer fra-2=10.1.0.7:7071

      kvctl agent start --peer fra-2=10.1.0.7:7071 --peer ams-1=10.2.0.3:7071 --index-url http://10.0.0.9:9480

      kvctl agent start --role pool --name pool --listen 127.0.0.1:7170 --data-listen 127.0.0.1:7171
    """
    if start_timeout is not None and not detach:
        fail("--start-timeout bounds a --detach start", hint="add --detach, or drop it")
    if settings_fd is not None:
        settings = _handed_over(settings_fd)
    else:
        loaded = _load(config, **flags.as_flags())
        settings = loaded.settings
        exposed = _secrets_others_read(loaded)
        if exposed is not None:  # a warning, not a refusal: the agent itself is not at risk
            err_console.print(f"[yellow]warning:[/] {escape(exposed)}", highlight=False)
        if not detach and _password_in_pool_flag(loaded):
            err_console.print(
                "[yellow]warning:[/] the password in --pool is on this agent's command line, "
                "which `ps` shows every user for as long as it runs: give the pool URL in "
                "KVCTL_POOL or the config file (0600), or start it with --detach (its agent "
                "gets its settings in memory, not on its command line)",
                highlight=False,
                soft_wrap=True,
            )
    from kvctl.agent.daemon import AgentRunning, running_agent
    from kvctl.paths import UnusableDirectory, WriteFailed, make_private_dir

    not_utf8 = _not_utf8(settings)
    if not_utf8 is not None:
        what, name = not_utf8
        fail(
            f"{what} is not valid UTF-8: the agent says its settings and paths as UTF-8 "
            "text (agent.json, `kvctl agent status`, the settings a --detach start hands over)",
            hint="give it a UTF-8 name (rename the directory)"
            if name in ("data_dir", "socket")
            else f"give {name} in UTF-8",
        )
    try:  # before anything is started or written: a bad --data-dir is the user's to fix
        make_private_dir(settings.data_path, "data directory")
    except UnusableDirectory as exc:
        fail(str(exc), hint="give --data-dir a directory this user can write (or create)")
    other = running_agent(settings.data_path)
    if other is not None:
        fail(
            f"an agent (pid {other.pid}) already serves {settings.data_path} at "
            f"{other.control_url}",
            hint=f"`kvctl agent stop --data-dir {quote(str(settings.data_path))}` first, or give "
            "another --data-dir and ports",
            code=1,
        )
    if detach:
        from kvctl.agent.daemon import DataDirFull, spawn_with_settings

        warnings = _StartWarnings(settings.data_path / "agent.log")
        try:
            _, state = spawn_with_settings(
                settings, progress=_StartProgress(), limit_s=start_timeout, lines=warnings
            )
        except WriteFailed as exc:
            fail(str(exc), hint=_write_failed_hint(exc, settings.data_path))
        except DataDirFull as exc:
            fail(str(exc), hint=_full_data_dir_hint(settings.data_path))
        except RuntimeError as exc:
            fail(str(exc), code=1)
        console.print(
            f"agent [bold]{state.name}[/] started (pid {state.pid}): control {state.control_url}"
            f", data tcp {state.data_tcp or 'off'}, unix {state.data_unix or 'off'}\n"
            f"[dim]logs: {settings.data_path / 'agent.log'}; stop: kvctl agent stop "
            f"--data-dir {escape(quote(str(settings.data_path)))}[/]",
            highlight=False,
            soft_wrap=True,
        )
        # said in the foreground on stderr; detached, only its log had them
        for warning in warnings.said():
            err_console.print(f"[yellow]{escape(warning)}[/]", highlight=False, soft_wrap=True)
        return
    from kvctl import daemon_logging

    daemon_logging.configure(settings.log_level)
    from kvctl.agent.daemon import SocketInUse, serve
    from kvctl.errors import KvctlError

    try:
        code = serve(settings)
    except (AgentRunning, SocketInUse) as exc:
        fail(str(exc), code=1)
    except WriteFailed as exc:  # the agent's own files: its state (agent.json)
        fail(str(exc), hint=_write_failed_hint(exc, settings.data_path))
    except (OSError, KvctlError) as exc:
        fail(str(exc), hint="check the sizes, ports and --data-dir", code=1)
    raise typer.Exit(code)


#: the settings that hold a secret: a token, or a pool URL's password
SECRET_SETTINGS = ("token", "remote_token", "index_token", "pool")


def _secrets_others_read(loaded: LoadedSettings) -> str | None:
    """What is wrong when the config file gives a secret and other users can read it (its mode
    has group or others' read bit); None when it does not."""
    from kvctl.redact import redact_url

    path = loaded.config_file
    if path is None:
        return None
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    if not mode & 0o044:
        return None
    held = [
        name
        for name in SECRET_SETTINGS
        if loaded.sources.get(name) == f"file:{path}"
        and (value := getattr(loaded.settings, name))
        and (name != "pool" or redact_url(value) != value)
    ]
    if not held:
        return None
    return (
        f"{path} gives {' and '.join(held)} and other users can read it (mode {mode:04o}): "
        f"`chmod 600 {quote(str(path))}`, or give the token in KVCTL_TOKEN (an environment "
        "file of mode 0600 for a service)"
    )


def _password_in_pool_flag(loaded: LoadedSettings) -> bool:
    """--pool gave the pool URL, with a password in it."""
    from kvctl.redact import redact_url

    pool = loaded.settings.pool
    return loaded.sources.get("pool") == "flag:--pool" and redact_url(pool) != pool


#: settings whose value is never shown, even in part: a URL's password, or a URL that may hold one
UNSHOWN_SETTINGS = (*SECRET_SETTINGS, "index_url")


def _not_utf8(settings: AgentSettings) -> tuple[str, str] | None:
    """The first setting whose text is not UTF-8 (a path or name typed with other bytes, which
    Python holds as lone surrogates), as the error names it, and its name; None when all are.
    A secret's value, or a URL's, is not shown (a pool URL's password may be the bytes)."""
    texts = {f.name: getattr(settings, f.name) for f in fields(settings)}
    texts |= {"data_dir": str(settings.data_path), "socket": str(settings.socket_path or "")}
    for name, value in texts.items():
        if not isinstance(value, str):
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            if name in UNSHOWN_SETTINGS:
                return f"{name} (value not shown)", name
            # the bytes as typed, those that are not UTF-8 as \xNN
            shown = os.fsencode(value).decode("utf-8", "backslashreplace")
            return f"{name} '{shown}'", name
    return None


#: a start quicker than this shows nothing of the agent's log
START_QUIET_SECONDS = 2.0
#: a line of the agent's log (``kvctl.daemon_logging.LINE_FORMAT``)
_LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ([A-Z]+) [\w.]+: (.*)")


#: warnings a detached start repeats at most (the rest are in its log)
START_WARNINGS_SHOWN = 20


class _StartWarnings:
    """The warnings and errors an agent logs as it starts (each line it logs until it serves,
    told as ``spawn_with_settings`` reads them, across a rollover of its log), as
    ``warning: MESSAGE`` lines."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.found: list[str] = []
        self.more = 0

    def __call__(self, line: str) -> None:
        m = _LOG_LINE.fullmatch(line)
        if m is None or m[1] not in ("WARNING", "ERROR", "CRITICAL"):
            return
        if len(self.found) < START_WARNINGS_SHOWN:
            self.found.append(f"{m[1].lower()}: {m[2]}")
        else:
            self.more += 1

    def said(self) -> list[str]:
        if not self.more:
            return self.found
        return [*self.found, f"... and {self.more} more in {self.log_path}"]


class _StartProgress:
    """What a detached agent logs as it starts, on stderr, once it takes a while: the operator
    sees why it is not serving yet (the disk tier's scan: files so far) and that it moves on."""

    def __call__(self, elapsed_s: float, line: str) -> None:
        if elapsed_s < START_QUIET_SECONDS:
            return
        # the log's own time and logger name are noise here: its message, the level if not INFO
        m = _LOG_LINE.fullmatch(line)
        if m is not None:
            line = m[2] if m[1] == "INFO" else f"{m[1]}: {m[2]}"
        err_console.print(
            f"[dim]starting ({elapsed_s:.0f} s):[/] {escape(line)}", highlight=False, soft_wrap=True
        )


def _write_failed_hint(exc: WriteFailed, data_dir: Path) -> str:
    if exc.full:
        return _full_data_dir_hint(data_dir)
    return "give --data-dir a directory this user can write (or create)"


def _full_data_dir_hint(data_dir: Path) -> str:
    hint = f"free space on the filesystem holding {data_dir}"
    tier = data_dir / "disk"
    if tier.is_dir():  # chunks there: the agent can make the room itself, at start
        hint += (
            f"; where the disk tier ({tier}) filled it, start once in the foreground with a "
            "smaller --disk (the tier is trimmed to it at start, its oldest chunks deleted, "
            "before the agent writes its files)"
        )
    return hint + "; or give another --data-dir"


@agent_app.command("stop")
@bundled
def stop_command(
    home: AgentHome,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for a clean exit.", min=0)] = 30.0,
    force: Annotated[
        bool, typer.Option("--force", help="SIGKILL if it has not exited by then.")
    ] = False,
) -> None:
    """Stop the agent of this data dir: SIGTERM, wait for in-flight requests to finish
    (HTTP and data plane, 10 s at most each), then for its gpu and cpu tiers' unpinned chunks
    to go down to disk, hottest first (stop_demote_seconds, default 15 s), so its next start
    has them. Exits 1 when --data-dir holds no record of an agent (a mistyped path stops
    nothing), 2 when it is a file (or under one).

    Examples:

      kvctl agent stop

      kvctl agent stop --data-dir /var/lib/kvctl/gpu-07 --timeout 60 --force
    """
    from kvctl.agent.daemon import (
        NoAgentHere,
        recorded_agent,
        starting_agent,
        stop_agent_saying,
    )

    settings = home.load().settings
    if home.named and starting_agent(settings.data_path) is None:
        try:  # a mistyped --data-dir is not "nothing to stop": the agent meant runs on
            recorded_agent(settings.data_path, running=False)
        except NoAgentHere as exc:
            fail(str(exc), hint=exc.hint, code=_no_agent_code(settings.data_path))
    try:
        stopped = stop_agent_saying(settings.data_path, timeout_s=timeout, force=force)
    except TimeoutError as exc:
        fail(str(exc), code=1)
    if stopped is None:
        console.print(
            f"no agent is running for {settings.data_path}", highlight=False, soft_wrap=True
        )
        elsewhere = elsewhere_hint(home, None, settings.data_path, "stop")
        if elsewhere:  # nothing to stop here is not "stopped": the one meant may run on
            err_console.print(f"[dim]hint:[/] {escape(elsewhere)}", highlight=False, soft_wrap=True)
        return
    state, killed = stopped
    if not state.name:  # one still starting, not recorded yet
        state = replace(state, name=f"starting from {settings.data_path}")
    if killed:  # not a clean stop: requests in flight were cut, its log ends mid-way
        console.print(
            f"agent {state.name} (pid {state.pid}) killed (SIGKILL): it had not exited "
            f"{timeout:g} s after SIGTERM",
            highlight=False,
        )
        return
    console.print(f"agent {state.name} (pid {state.pid}) stopped", highlight=False)


def _where(home: AgentHome, url: str | None) -> tuple[AgentSettings, str]:
    """This node's settings and the control URL to ask: ``url``, else the running agent's
    (from its state file), else the configured one, but never that for a --data-dir with no
    running agent recorded (NoAgentHere). A ``url`` that is not an agent URL is a usage error
    (exit 2), checked as `kvctl fleet add-node` checks one."""
    from kvctl.agent.daemon import control_url_for

    if url is not None:
        from kvctl.db.inventory import url_problem

        problem = url_problem(url)
        if problem:
            fail(f"--url: {problem}", hint="the agent's control URL, as in `kvctl fleet ls`")
    settings = home.load().settings
    if url is not None:
        return settings, url
    return settings, control_url_for(settings.data_path, settings.control_url, named=home.named)


def _no_agent_code(data_dir: Path) -> int:
    """The exit code of a data dir that records no agent: 2 (a usage error, as `kvctl agent
    start --data-dir FILE` has it) when it is a file or runs through one, which no agent can
    ever run from; else 1: no agent runs there now, a state of this node."""
    for path in (data_dir, *data_dir.parents):
        try:
            mode = path.stat().st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # the nearest existing path above it says
        except OSError:
            return 1
        return 1 if stat.S_ISDIR(mode) else 2
    return 1


def _target(home: AgentHome, url: str | None) -> tuple[AgentSettings, str]:
    """:func:`_where`, exiting 1 with the reason when a --data-dir has no agent to ask (2 when
    it is a file)."""
    from kvctl.agent.daemon import NoAgentHere

    try:
        return _where(home, url)
    except NoAgentHere as exc:
        fail(str(exc), hint=exc.hint, code=_no_agent_code(home.load().settings.data_path))


TOKEN_HINT = (
    "the agent is running, so do not start another: set KVCTL_TOKEN to its token (or token in "
    "[agent] of the config file, --config)"
)


class _AgentStopped(Exception):
    """The agent of this host that did not answer is stopped (SIGSTOP, Ctrl-Z): not hung."""

    def __init__(self, message: str, pid: int) -> None:
        super().__init__(message)
        self.pid = pid


def _stopped(exc: Exception, target: str, data_dir: Path) -> Exception:
    """``exc``, or where the agent that did not answer in time runs from this host's data dir
    and is stopped by a signal, an error saying so: "hung or overloaded? ... --force" sent the
    operator to kill an agent that SIGCONT resumes."""
    from kvctl.agent.daemon import process_stopped, running_agent
    from kvctl.client import AgentNotAnswering

    if not isinstance(exc, AgentNotAnswering):
        return exc
    state = running_agent(data_dir)
    if state is None or state.control_url != target or not process_stopped(state.pid):
        return exc
    return _AgentStopped(
        f"the agent at {target} does not answer: the agent process (pid {state.pid}) is "
        "stopped (SIGSTOP, or Ctrl-Z in the terminal it runs in)",
        state.pid,
    )


def _failure(exc: Exception, down_hint: str | None = None) -> tuple[str, str | None]:
    """How a failed call to the agent reads: a label, and what to do next (for an agent that
    is down, ``down_hint`` when given). An agent that refused the token is up; something that
    is not an agent's control API is not down."""
    from kvctl.client import (
        AgentNotAnswering,
        AgentStarting,
        AgentUnreachable,
        AuthError,
        NoHttpAnswer,
        NotAnAgent,
    )

    control_url = "give --url the agent's control URL (its --listen, default 7070)"
    if isinstance(exc, _AgentStopped):
        return "not answering", (
            f"`kill -CONT {exc.pid}` resumes it (`fg` in the shell that suspended it); until "
            "then `kvctl agent stop` waits in vain (its --force kills it)"
        )
    if isinstance(exc, AuthError):
        return "token refused", TOKEN_HINT
    if isinstance(exc, AgentStarting):
        return "starting", (
            "it serves once its tiers are open (a large disk tier's scan can take minutes); its "
            "log (agent.log in its data dir) shows the progress"
        )
    if isinstance(exc, NoHttpAnswer):  # first: it may also be an agent that went away
        return "no HTTP answer", control_url
    if isinstance(exc, NotAnAgent):
        return "not an agent", control_url
    if isinstance(exc, AgentNotAnswering):
        return "not answering", (
            "something accepted the connection and then said nothing: a hung or overloaded "
            "agent? Its log (agent.log in its data dir) says what it was doing; `kvctl agent "
            "stop --force` and start it again if it stays so"
        )
    if isinstance(exc, AgentUnreachable):
        return "down", down_hint or (
            "start it with `kvctl agent start --detach`; if it runs, compare the address it "
            "listens on (`kvctl agent config --show`: listen) and read its log (agent.log in its "
            "data dir)"
        )
    return "error", None


def _agent_failed(exc: Exception, down_hint: str | None = None) -> NoReturn:
    label, hint = _failure(exc, down_hint)
    fail(f"{label}: {exc}" if label != "error" else str(exc), hint=hint, code=1)


def _agents_beside(data_dir: Path) -> list[tuple[Path, AgentState]]:
    """The agents running from the data dirs beside ``data_dir`` (another --name's)."""
    from kvctl.agent.daemon import running_agent

    try:
        dirs = sorted(d for d in data_dir.parent.iterdir() if d.is_dir() and d != data_dir)
    except OSError:
        return []
    found = ((d, running_agent(d)) for d in dirs)
    return [(d, state) for d, state in found if state is not None]


def elsewhere_hint(home: AgentHome, url: str | None, data_dir: Path, command: str) -> str | None:
    """Where this node's agents run when none runs from ``data_dir`` and the command looked
    for this host's default agent (no --url, no --data-dir): an agent started with --name runs
    from a data dir of its own, and "start one" would mislead. None when there is none."""
    from kvctl.agent.daemon import AgentState

    if url is not None or home.named or AgentState.read(data_dir) is not None:
        return None
    others = _agents_beside(data_dir)
    if not others:
        return None
    shown = ", ".join(f"{state.name} from {d}" for d, state in others[:3])
    more = f" and {len(others) - 3} more" if len(others) > 3 else ""
    return (
        f"no agent runs from {data_dir}, but {len(others)} on this host do: {shown}{more}; "
        f"name one: `kvctl agent {command} --data-dir {quote(str(others[0][0]))}` (or --name)"
    )


@agent_app.command("status")
@bundled
def status_command(
    home: AgentHome,
    url: UrlOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Is the agent up, where does it listen, how full are its tiers, what is its hit ratio.
    Exits 1 when the agent is down, does not answer (hung: it is not called down), is not an
    agent, refuses the token or is still opening its tiers (it is up then, and says so), or
    when --data-dir records no running agent (no other agent is asked then); 2 when
    --data-dir is a file (or under one).

    Examples:

      kvctl agent status

      kvctl agent status --url http://10.0.3.7:7070 --json
    """
    from kvctl.agent.daemon import NoAgentHere
    from kvctl.client import AgentClient, AgentError, AgentStarting, AuthError, NotAnAgent
    from kvctl.db.sample_checks import checked_stats
    from kvctl.fleet.since_start import since_start
    from kvctl.wire.stats import agent_figures

    def unread(control_url: str | None) -> dict[str, Any]:
        return {"up": False, "auth_refused": False, "starting": False, "control_url": control_url}

    try:
        settings, target = _where(home, url)
    except NoAgentHere as exc:
        if json_out:
            print_json(unread(None) | {"error": str(exc)})
        fail(str(exc), hint=exc.hint, code=_no_agent_code(home.load().settings.data_path))
    report = unread(target)
    failure: Exception | None = None
    try:
        with AgentClient(target, token=settings.token or None) as client:
            report["info"] = client.info()
            stats = client.stats()
            report["up"] = True
        # the fleet's vocabulary, as `kvctl status` reports a node: lookups and hits in chunks;
        # a figure that cannot be true is unknown and named, as status and top have it
        checked, rejected = checked_stats(stats)
        since = since_start(checked)
        try:
            report |= agent_figures(checked)
        except (KeyError, TypeError, AttributeError) as exc:  # another JSON API's answer
            lacks = f"no {exc.args[0]}" if isinstance(exc, KeyError) and exc.args else str(exc)
            raise NotAnAgent(
                f"{target}/v1/stats did not answer an agent's stats ({lacks}): is a kvctl "
                "agent's control API listening there?"
            ) from None
        if since.impossible:  # more hits than lookups: unknown, as status and top have them
            report |= since.counts.hit_figures() | since.token_figures()
            # a tier's too (its hit tokens included), not shown as said
            for name, t in since.tier_hits.items():
                for part in t.unknown & set(report["tiers"].get(name, {})):
                    report["tiers"][name][part] = None
        report["rejected"] = dict(rejected.fields) | since.impossible
        # as checked: a count that cannot be true (or a dataplane not an object) is unknown and
        # named under rejected, not shown as said
        dataplane = checked.get("dataplane") or {}
        # PUT chunks refused as damaged on the way; None from an agent before the count
        report["corrupt_puts"] = dataplane.get("corrupt_puts")
        # PUT chunks no tier could take; None from an agent before the count
        report["no_room_puts"] = dataplane.get("no_room_puts")
        # chunks reads asked for, those not here and their share, as `kvctl status` has them:
        # None from an agent before the counts, or where they were rejected (named above)
        report |= since.read_figures()
    except AgentError as exc:
        failure = _stopped(exc, target, settings.data_path) if url is None else exc
        report["error"] = str(failure)
        # it answered: up, though it cannot be read (yet)
        report["up"] = isinstance(exc, AuthError | AgentStarting)
        report["auth_refused"] = isinstance(exc, AuthError)
        report["starting"] = isinstance(exc, AgentStarting)
    if json_out:
        print_json(report)
    elif failure is not None:
        state, hint = _failure(failure, elsewhere_hint(home, url, settings.data_path, "status"))
        colour = "yellow" if report["up"] else "bold red"
        err_console.print(
            f"[{colour}]{state}[/]: {escape(str(failure))}"
            + (f"\n[dim]hint: {escape(hint)}[/]" if hint else ""),
            highlight=False,
            soft_wrap=True,
        )
    else:
        _render_status(report)
    if failure is not None:
        raise typer.Exit(1)


@agent_app.command("retry-tier")
@bundled
def retry_tier_command(
    tier: Annotated[
        str,
        typer.Argument(
            help="The tier to try: one not opened at start, or taken offline (disk).",
            show_default=False,
        ),
    ],
    home: AgentHome,
    timeout: Annotated[
        float,
        typer.Option(
            min=1,
            help="Seconds to wait for the answer: the agent opens and indexes the tier's "
            "directory (a large one takes a while) before it answers.",
        ),
    ] = 300.0,
    url: UrlOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Try a tier the agent could not open at start (its disk directory was missing, a file,
    not mounted), or one a failed write took offline, once now, instead of waiting for the
    agent's own retries (every 5 s at first, then up to every 60 s; an offline tier on a put
    60 s after it failed): run it once you fixed the directory or device. Exits 0 when the
    tier is online (brought online now, or it was already), 1 when it is still unavailable
    or offline (the reason is said; the agent goes on trying by itself), when the agent has
    no such tier, or when the agent is down.

    Examples:

      kvctl agent retry-tier disk

      kvctl agent retry-tier disk --url http://10.0.3.7:7070 --json
    """
    from kvctl.client import AgentClient, AgentError, RequestError

    if not re.fullmatch(r"[\w.-]{1,64}", tier):  # a "/" would reach no endpoint at all
        fail(f"{tier!r} is not a tier name", hint="the agent's tiers: cpu, disk (and gpu)")
    settings, target = _target(home, url)
    try:
        with AgentClient(target, token=settings.token or None) as client:
            answer = client.retry_tier(tier, timeout_s=timeout)
    except RequestError as exc:
        if exc.code != 400:
            _agent_failed(exc)
        fail(
            str(exc).removeprefix("400: "),
            hint="`kvctl agent status` lists the agent's tiers and those it could not open",
            code=1,
        )
    except AgentError as exc:
        _agent_failed(exc, elsewhere_hint(home, url, settings.data_path, "retry-tier"))
    if json_out:
        print_json(answer)
    else:
        _render_retry(answer)
    if not answer["online"]:
        raise typer.Exit(1)


def _render_retry(answer: dict[str, Any]) -> None:
    from kvctl.format import format_bytes

    name = escape(answer["tier"])
    if answer["state"] == "online":
        usage = answer.get("usage") or {}
        if not answer["retried"]:
            console.print(f"{name} tier is online already: nothing to retry", highlight=False)
            return
        console.print(
            f"[bold green]{name} tier online[/]: {usage.get('chunks', 0):,} chunks "
            f"({format_bytes(usage.get('used_bytes', 0))}) in it, capacity "
            f"{format_bytes(usage.get('capacity_bytes', 0))}",
            highlight=False,
        )
        return
    reason = escape(answer.get("reason") or "")
    if answer["state"] == "offline":
        # a disk tier was written to now; a tier with no such test is tried by the next put
        err_console.print(
            f"[yellow]{name} tier still offline[/] (failed in service): {reason}\n"
            "[dim]hint: fix what the reason names (its device, mount or directory), then run "
            "this again; the agent tries it again by itself on a put[/]",
            highlight=False,
            soft_wrap=True,
        )
        return
    again = ""
    if answer.get("next_try_s") is not None:
        again = f"; the agent tries again by itself in {_seconds_from_now(answer['next_try_s'])}"
    tries = answer.get("tries") or 0
    err_console.print(
        f"[yellow]{name} tier still unavailable[/] ({tries:,} "
        f"{'try' if tries == 1 else 'tries'} so far{again}): {reason}\n"
        "[dim]hint: fix its directory (the reason names it), then run this again[/]",
        highlight=False,
        soft_wrap=True,
    )


def _seconds_from_now(when_s: float) -> str:
    return f"{max(0.0, when_s - time.time()):.0f} s"


@agent_app.command("remote")
@bundled
def remote_command(
    home: AgentHome,
    url: UrlOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The agent's shared pool and peers: up or down (with the last error), link RTT and
    bandwidth (measured, configured or emulated), pool usage, how many chunks lookups chose to
    fetch or recompute and why, and the pool writer's counts. Exits 1 when the agent is down.

    Examples:

      kvctl agent remote

      kvctl agent remote --url http://10.0.3.7:7070 --json
    """
    from kvctl.client import AgentClient, AgentError

    settings, target = _target(home, url)
    try:
        with AgentClient(target, token=settings.token or None) as client:
            report = client.remote()
    except AgentError as exc:
        _agent_failed(exc, elsewhere_hint(home, url, settings.data_path, "remote"))
    if json_out:
        print_json(report)
    else:
        _render_remote(report)


@agent_app.command("probe")
@bundled
def probe_command(
    target: Annotated[
        str,
        typer.Argument(
            help="Data-plane address of the agent to probe, HOST:PORT.", show_default=False
        ),
    ],
    home: AgentHome,
    target_name: Annotated[
        str | None,
        typer.Option(
            help="The target node's name in the fleet: when the agent has a peer of that name "
            "with an emulated delay (--link NAME:delay_ms=N), the probe includes it. Without "
            "it, the agent matches its peers and pool by address."
        ),
    ] = None,
    target_token: Annotated[
        str | None,
        typer.Option(
            envvar="KVCTL_TARGET_TOKEN",
            help="The target's data-plane token (prefer $KVCTL_TARGET_TOKEN: a flag shows in ps).",
            show_default=False,
        ),
    ] = None,
    pings: Annotated[int, typer.Option(min=1, max=100, help="PING round trips to time.")] = 5,
    size: Annotated[
        str, typer.Option("--bytes", help="Bytes to upload, then download (0: latency only).")
    ] = "1MiB",
    timeout: Annotated[
        float, typer.Option(min=0.001, max=30, help="Seconds each step may take.")
    ] = 2.0,
    url: UrlOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Have this node's agent probe the link to another agent: RTT (median, fastest), loss
    and bandwidth. The RTT says its basis: "measured" is the network's; "emulated" includes the
    delay the agent's own fetches over that configured link wait (a demo's or test's distance).
    Exits 1 when the probe fails.

    Examples:

      kvctl agent probe 10.1.0.7:7071 --target-name fra-2

      kvctl agent probe 10.1.0.7:7071 --bytes 0 --pings 20 --json
    """
    from kvctl.client import AgentClient, AgentError
    from kvctl.errors import InvalidArgument
    from kvctl.units import parse_size
    from kvctl.wire.address import tcp_target_problem

    try:
        size_bytes = parse_size(size)
    except InvalidArgument as exc:
        fail(f"--bytes: {exc}")
    problem = tcp_target_problem(target)
    if problem:
        fail(problem, hint="the target agent's --data-listen address, e.g. 10.1.0.7:7071")
    settings, control_url = _target(home, url)
    try:
        with AgentClient(control_url, token=settings.token or None) as client:
            probe = client.probe(
                target,
                token=target_token,
                pings=pings,
                size_bytes=size_bytes,
                timeout_s=timeout,
                name=target_name,
            )
    except AgentError as exc:
        _agent_failed(exc, elsewhere_hint(home, url, settings.data_path, "probe"))
    if json_out:
        print_json(dict(probe))
    else:
        _render_probe(dict(probe), target_name)
    if not probe["ok"]:
        raise typer.Exit(1)


def probe_rtt_text(rtt_s: float | None, rtt_basis: str, emulated_delay_s: float | None) -> str:
    """A probe's RTT with its basis: "0.85 ms (emulated +0.80 ms)", "0.17 ms (measured)"."""
    rtt = "N/A" if rtt_s is None else f"{rtt_s * 1000:.2f} ms"
    if rtt_basis == "emulated" and emulated_delay_s is not None:
        return f"{rtt} (emulated +{emulated_delay_s * 1000:.2f} ms)"
    return f"{rtt} ({rtt_basis})"


def _render_probe(probe: dict[str, Any], target_name: str | None) -> None:
    from rich.table import Table

    from kvctl.format import format_bytes, format_rate, percent

    basis = (probe["rtt_basis"], probe["emulated_delay_s"])
    title = f"probe of {target_name} ({probe['target']})" if target_name else probe["target"]
    table = Table("", "", title=title, show_header=False)
    table.add_row("rtt", probe_rtt_text(probe["rtt_s"], *basis))
    table.add_row("fastest", probe_rtt_text(probe["rtt_min_s"], *basis))
    table.add_row("loss", percent(probe["loss_ratio"]))
    if probe["probe_bytes"]:
        up, down = probe["upload_bytes_per_s"], probe["download_bytes_per_s"]
        table.add_row(
            "bandwidth",
            "N/A"
            if probe["bandwidth_bytes_per_s"] is None
            else f"{format_rate(probe['bandwidth_bytes_per_s'])} "
            f"(up {format_rate(up)}, down {format_rate(down)}; "
            f"{format_bytes(probe['probe_bytes'])} each way)",
        )
    console.print(table)
    if probe["error"]:
        err_console.print(f"[red]probe failed:[/] {probe['error']}", highlight=False)


def _link_cells(link: dict[str, Any]) -> tuple[str, str, str]:
    from kvctl.format import format_rate

    rtt = "N/A" if link["rtt_s"] is None else f"{link['rtt_s'] * 1000:.2f} ms"
    bw = (
        "N/A"
        if link["bandwidth_bytes_per_s"] is None
        else format_rate(link["bandwidth_bytes_per_s"])
    )
    return f"{rtt} ({link['rtt_basis']})", bw, link["override"]


def _breaker_cell(src: dict[str, Any]) -> str:
    """A source's circuit breaker: up, probing after an outage, or open until its next retry."""
    breaker = src.get("breaker") or {}
    state = breaker.get("state", "closed" if src["up"] else "open")
    if state == "closed":
        return "[green]up[/]"
    if state == "half_open":
        return "[yellow]probing[/]"
    retry_s = breaker.get("retry_in_s")
    return "[bold red]open[/]" + (f", retry in {retry_s:.1f} s" if retry_s is not None else "")


def _count_or_dash(value: object) -> str:
    return f"{value:,}" if isinstance(value, int) else "-"


def _render_remote(report: dict[str, Any]) -> None:
    from rich.table import Table

    from kvctl.format import format_bytes

    if not report["configured"]:
        console.print(
            f"role {report['role']}: no pool and no peers configured\n"
            "[dim]hint: kvctl agent start --pool redis://HOST:6379/0 --peer NAME=HOST:PORT[/]",
            highlight=False,
            soft_wrap=True,
        )
        return
    table = Table(
        "source",
        "state",
        "RTT",
        "bandwidth",
        "override",
        "in/out",
        "errors",
        "late/overdue/corrupt",
    )
    down: list[str] = []
    for src in [report["pool"], *report["peers"]]:
        if src is None:
            continue
        if not src["up"]:
            # the error's text is the source's (a peer's error message, a non-agent's bytes):
            # shown as it is, never read as markup (a stray "[/]" made the command fail)
            down.append(f"{escape(str(src['name']))}: {escape(str(src['last_error']))}")
        table.add_row(
            f"{escape(str(src['name']))} ({src['tier']})\n[dim]{escape(str(src['address']))}[/]",
            _breaker_cell(src),
            *_link_cells(src["link"]),
            f"{src['chunks_in']:,}/{src['chunks_out']:,}",
            str(src["errors"]),
            # probes too late for a lookup, pulls cut at their deadline, and chunks that failed
            # their check on arrival
            # (- where the agent does not count it: one of an older version)
            "/".join(_count_or_dash(src.get(k)) for k in ("late", "overdue", "corrupt")),
        )
    console.print(table)
    for line in down:
        console.print(f"[red]last error[/] {line}", highlight=False)
    usage = report.get("pool_usage")
    if usage:
        pool = report.get("pool") or {}
        read_s = report.get("pool_usage_read_s")
        # kept from the last read: through an outage it says how old it is
        stale = (
            f" [yellow](read {time.time() - read_s:.0f} s ago; the pool is not answering)[/]"
            if read_s is not None and not pool.get("up", True)
            else ""
        )
        console.print(
            f"pool: {format_bytes(usage['used_bytes'])} of {format_bytes(usage['capacity_bytes'])}"
            f", {usage['chunks']:,} chunks{stale}",
            highlight=False,
        )
    index = report.get("index")
    if index:
        state = (
            "[green]up[/]" if index["up"] else f"[red]down[/] ({escape(str(index['last_error']))})"
        )
        console.print(
            f"fleet index {escape(str(index['address']))}: {state}; {index['queries']:,} queries, "
            f"{index['peer_probes_saved']:,} peer probes saved, {index['fallbacks']:,} fallbacks "
            f"to probing every peer, {index['stale_chunks']:,} stale chunks",
            highlight=False,
        )
    plans, write = report["plans"], report["write"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(plans["reasons"].items())) or "none yet"
    console.print(
        f"lookups planned: {plans['lookups']:,}; chunks fetched "
        f"{plans['fetch_chunks']:,}, recomputed {plans['recompute_chunks']:,} ({reasons}); "
        + (
            f"{plans['unasked_lookups']:,} not asked of the pool or peers (no fetch could pay); "
            if plans.get("unasked_lookups")
            else ""
        )
        + f"prefill time saved net of fetching {plans['saved_s']:.3f} s [dim](prefill: "
        f"{report['prefill']['basis']}, {report['prefill']['tokens_per_s']:,.0f} tokens/s)[/]\n"
        f"pool writer ({write['mode']}): written {write['written']:,}, queued {write['queued']:,}"
        f", refused {write.get('refused', 0):,}, failed {write['failed']:,}"
        f", dropped {write['dropped']:,}"
        + (
            f" [dim](last failure: {escape(str(write['last_error']))})[/]"
            if write["failed"] and write.get("last_error")
            else ""
        )
        + (
            f"\n[yellow]pulls short of local room[/]: {no_room:,} chunks not kept (the local "
            "tiers could not hold the whole chain)"
            if (no_room := (report.get("pull") or {}).get("no_room_chunks"))
            else ""
        ),
        highlight=False,
    )


def _render_status(report: dict[str, Any]) -> None:
    from rich.table import Table

    from kvctl.format import describe_policy, format_bytes, percent
    from kvctl.wire.stats import STORAGE_TROUBLE

    info = report["info"]
    uptime = time.time() - info["started_s"]
    dp = info["dataplane"]
    console.print(
        f"[bold green]up[/] agent [bold]{escape(info['name'])}[/] dc {escape(info['dc'])} "
        f"pid {info['pid']} "
        f"version {info['version']} uptime {uptime:.0f}s\n"
        f"control {report['control_url']}  data tcp {dp['tcp'] or 'off'}  "
        f"unix {dp['unix'] or 'off'}  shm {_shm_words(dp)}",
        highlight=False,
        soft_wrap=True,
    )
    table = Table("tier", "used", "capacity", "use", "chunks", "pinned", "hits", title=None)
    for tier in info["tiers"]:
        cap = tier["capacity_bytes"]
        table.add_row(
            tier["name"],
            format_bytes(tier["used_bytes"]),
            format_bytes(cap),
            percent(tier["used_bytes"] / cap if cap else None),
            str(tier["chunks"]),
            format_bytes(tier["pinned_bytes"]),
            _count(report["tiers"].get(tier["name"], {}).get("hits"), "hit", noun_shown=False),
        )
    console.print(table)
    if report.get("rejected"):
        console.print(
            f"[yellow]{len(report['rejected'])} value(s) rejected as impossible, shown N/A:[/] "
            + escape(", ".join(f"{w} ({why})" for w, why in report["rejected"].items())),
            highlight=False,
            soft_wrap=True,
        )
    for tier in info.get("unavailable_tiers", []):
        where = (
            "failed in service, puts go to the next tier"
            if tier.get("offline")
            else f"asked for {format_bytes(tier['capacity_bytes'])} on {tier['device']}"
        )
        # a disk tier not opened yet is tried again (an agent before that says neither)
        retry = ""
        if tier.get("next_try_s") is not None:
            wait_s = max(0.0, tier["next_try_s"] - time.time())
            tries = tier.get("tries", 0)
            retry = (
                f"; {tries:,} {'retry' if tries == 1 else 'retries'} so far, next in {wait_s:.0f} s"
                f"; once fixed, `kvctl agent retry-tier {escape(tier['name'])}` tries it now"
            )
        console.print(
            f"[yellow]{tier['name']} tier unavailable[/] ({where}{retry}): "
            f"{escape(tier['reason'])}",
            highlight=False,
        )
    policies = report["policies"]
    if policies:
        # a tier not opened yet keeps its policy in the store, idle: said absent, not running
        absent = {t["name"] for t in info.get("unavailable_tiers", []) if not t.get("offline")}
        console.print(
            "eviction: "
            + ", ".join(
                f"{tier} absent" if tier in absent else f"{tier} {describe_policy(p)}"
                for tier, p in policies.items()
            ),
            highlight=False,
        )
    # the words and the N/A of `kvctl status`: chunks, and no ratio before any lookup
    console.print(
        f"lookups {_count(report['lookups'], 'chunk')} in "
        f"{_count(report['lookup_requests'], 'request')}  "
        f"hits {_count(report['hits'], 'hit', noun_shown=False)}  "
        f"hit ratio {percent(report['hit_ratio'])}  "
        f"reuse {percent(report['reuse_share_of_hits'])} / "
        f"sharing {percent(report['sharing_share_of_hits'])} of hits",
        highlight=False,
    )
    for name, tier in report["tiers"].items():
        trouble = [
            f"{_count(n, 'write')} met its filesystem full (room made by evicting its chunks)"
            if what == "filesystem_full"
            else f"{_count(n, 'chunk file')} unreadable at start, skipped (see the agent log)"
            for what, n in tier.items()
            if what in STORAGE_TROUBLE and n
        ]
        if trouble:
            console.print(
                f"[yellow]{escape(name)}:[/] " + "; ".join(trouble), highlight=False, soft_wrap=True
            )
    if report.get("demotion_failures"):
        console.print(
            f"[yellow]dropped {_count(report['demotion_failures'], 'chunk')}[/] on the way down "
            "a tier (the lower tier could not take them: full or failing; see the agent log)",
            highlight=False,
            soft_wrap=True,
        )
    if report.get("corrupt_puts"):
        console.print(
            f"[yellow]refused {_count(report['corrupt_puts'], 'PUT chunk')}[/] whose bytes did "
            "not match their sender's checksum (damaged on the way: a bad NIC or link?)",
            highlight=False,
        )
    if report.get("no_room_puts"):
        console.print(
            f"[yellow]refused {_count(report['no_room_puts'], 'PUT chunk')}[/] for want of room "
            "(every tier full of pinned or leased chunks, a chunk larger than a tier, or a disk "
            "tier's filesystem full: see filesystem_full above and the agent log)",
            highlight=False,
            soft_wrap=True,
        )
    if report.get("read_missing_chunks"):
        missing, asked = report["read_missing_chunks"], report.get("read_chunks") or 0
        console.print(
            f"[yellow]{_count(missing, 'chunk')} of {asked:,} reads asked for "
            f"({percent(report.get('read_missing_ratio'))}) were not here[/]: evicted between "
            "the lookup that counted them as hits and the read (tiers too small for how long "
            "the engine takes to read?), or never looked up",
            highlight=False,
            soft_wrap=True,
        )


def _count(n: int | None, noun: str, *, noun_shown: bool = True) -> str:
    """``n`` with its noun; N/A where unknown (a figure rejected as impossible)."""
    if n is None:
        return "N/A"
    return f"{n:,}" + (f" {noun}" + ("" if n == 1 else "s") if noun_shown else "")


def _shm_words(dataplane: dict[str, Any]) -> str:
    """'off', or 'on' and the pages the arena lies on (N/A from an agent that does not say)."""
    if not dataplane["shm"]:
        return "off"
    huge, mode = dataplane.get("shm_huge_page_bytes"), dataplane.get("shmem_huge_pages")
    if huge is None:
        return "on (page size N/A)"
    if huge:
        from kvctl.format import format_bytes

        return f"on ({format_bytes(huge)} on huge pages)"
    return f"on (4 KiB pages, shmem_enabled {mode or 'N/A'}: see `kvctl doctor`)"


#: bytes read back from the end of agent.log to find its last lines (a line is rarely longer)
_TAIL_WINDOW_BYTES = 4 << 20
#: seconds between two looks at a followed log
_FOLLOW_POLL_SECONDS = 0.25


@agent_app.command("logs")
@bundled
def logs_command(
    home: AgentHome,
    lines: Annotated[
        int, typer.Option("--lines", "-n", min=0, help="How many of the last lines to print.")
    ] = 50,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="Keep printing what it logs, across rollovers, until Ctrl-C."
        ),
    ] = False,
) -> None:
    """Print the end of the agent's log (DATA_DIR/agent.log, written by a detached agent), and
    with --follow what it logs next, following the file across its rollovers. An agent in the
    foreground logs to its terminal, one under systemd to journald.

    Examples:

      kvctl agent logs

      kvctl agent logs --data-dir /var/lib/kvctl/gpu-07 -n 200

      kvctl agent logs -f | grep -i warning
    """
    import sys
    import threading

    from kvctl.agent.daemon import LOG_FILE
    from kvctl.agent.logfile import LogFollower
    from kvctl.interrupts import stop_signals

    data_dir = home.load().settings.data_path
    path = data_dir / LOG_FILE
    try:
        # its last lines lie in the window before the end (followed from there, so a rollover
        # while they are read loses nothing)
        begin = max(0, path.stat().st_size - _TAIL_WINDOW_BYTES)
        follower = LogFollower.open(path, begin)
    except FileNotFoundError:
        fail(
            f"no agent log at {path}",
            hint="only a detached agent writes one (`kvctl agent start --detach`); one in the "
            "foreground logs to its terminal, one under systemd to journald (`journalctl -u "
            "kvctl-agent`); --data-dir names another agent's",
        )
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")
    out = sys.stdout.buffer
    with follower:
        head = follower.read(2 * _TAIL_WINDOW_BYTES)
        if begin:  # (the window's first line is a part of one)
            head = head.partition(b"\n")[2]
        out.write(b"".join(head.splitlines(keepends=True)[-lines:] if lines else []))
        out.flush()
        if not follow:
            return
        stop = threading.Event()
        with stop_signals(stop):  # Ctrl-C ends a follow as a stopped tail does: exit 0
            while not stop.wait(_FOLLOW_POLL_SECONDS):
                if data := follower.read():
                    out.write(data)
                    out.flush()


@agent_app.command("config")
@bundled
def config_command(
    home: AgentHome,
    show: Annotated[bool, typer.Option("--show", help="Print every setting (the default).")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Print the effective value of every agent setting and where it came from (default,
    file, KVCTL_* variable or flag). The token is never printed.

    Examples:

      kvctl agent config --show

      KVCTL_CPU=16GiB kvctl agent config --show --json
    """
    from kvctl.agent.config import describe

    loaded = home.load()
    rows = describe(loaded)
    running = _running_beside(loaded.settings)
    if json_out:
        print_json({"config_file": loaded.config_file, "settings": rows, "running": running})
        return
    from rich.table import Table

    table = Table("setting", "value", "source")
    for row in rows:
        # escaped: values are the user's text (a name, a path), not markup
        table.add_row(*(escape(str(row[c])) for c in ("setting", "value", "source")))
    console.print(table)
    console.print(
        f"[dim]config file: {loaded.config_file or 'none'}[/]", highlight=False, soft_wrap=True
    )
    if running is not None:
        where = (
            f"an agent runs from {running['data_dir']} (pid {running['pid']}): name "
            f"{running['name']}, control API {running['control_url']}, data plane "
            f"{running['data_tcp'] or 'off'}"
        )
        if running["differs"]:
            console.print(
                f"[yellow]{escape(where)}; it started with other settings than these, which "
                f"differ in: {', '.join(running['differs'])}[/]",
                highlight=False,
                soft_wrap=True,
            )
        else:
            console.print(f"[dim]{escape(where)}[/]", highlight=False, soft_wrap=True)


def _running_beside(settings: AgentSettings) -> dict[str, Any] | None:
    """The agent running from ``settings``' data dir, as its agent.json records it, and which
    of these settings it was not started with (what ``agent status`` would then show differs
    from what this command prints); None when none runs there."""
    from kvctl.agent.daemon import running_agent

    state = running_agent(settings.data_path)
    if state is None:
        return None
    ours = {"name": settings.name, "dc": settings.dc}
    theirs = {"name": state.name, "dc": state.dc}
    if settings.control_host_port[1]:  # (port 0: any free one, whichever it got)
        ours["listen"], theirs["listen"] = settings.control_url, state.control_url
    return {
        "data_dir": str(settings.data_path),
        "pid": state.pid,
        "name": state.name,
        "dc": state.dc,
        "control_url": state.control_url,
        "data_tcp": state.data_tcp,
        "data_unix": state.data_unix,
        "differs": [k for k in ours if ours[k] != theirs[k]],
    }


@agent_app.command("install")
def install_command(
    systemd: Annotated[
        bool, typer.Option("--systemd", help="Install the agent as a systemd service.")
    ] = False,
    unit_dir: Annotated[
        Path, typer.Option("--unit-dir", help="Where unit files go.", file_okay=False)
    ] = DEFAULT_UNIT_DIR,
    config: Annotated[
        Path, typer.Option("--config", help="The config file the service starts the agent with.")
    ] = DEFAULT_CONFIG,
    gpu: Annotated[
        bool,
        typer.Option(
            "--gpu",
            help="Also write the drop-in opening the NVIDIA devices (NVML power, the gpu tier).",
        ),
    ] = False,
    kvctl: Annotated[
        Path | None,
        typer.Option(
            "--kvctl",
            help="The kvctl executable the service runs (default: this one).",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace unit files that differ from these.")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would be written; write nothing.")
    ] = False,
    json_out: JsonOpt = False,
) -> None:
    """Install the agent as a hardened systemd service (kvctl-agent.service): a dynamic
    user, state in /var/lib/kvctl (0700), the socket in /run/kvctl, a read-only system and
    a system-call filter; the token goes in /etc/kvctl/agent.env (KVCTL_TOKEN=..., root
    0600). Refuses to overwrite a different unit without --force.

    Examples:

      kvctl agent install --systemd --dry-run

      sudo kvctl agent install --systemd --gpu

      kvctl agent install --systemd --unit-dir ./units --config /etc/kvctl/agent.toml --json
    """
    from kvctl.agent.systemd import UnitError, find_kvctl, install_units

    if not systemd:
        fail("say what to install: --systemd (the only kind so far)", hint="see --help")
    try:
        report = install_units(
            unit_dir,
            executable=kvctl if kvctl is not None else find_kvctl(),
            config=config,
            gpu=gpu,
            force=force,
            dry_run=dry_run,
        )
    except UnitError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(f"cannot write to {unit_dir}: {exc.strerror or exc}", hint="run it as root (sudo)")
    if json_out:
        print_json(
            {
                "files": [
                    {"path": str(f.path), "action": f.action, "text": f.text} for f in report.files
                ],
                "executable": str(report.executable),
                "config": str(report.config),
                "dry_run": report.dry_run,
                "warnings": list(report.warnings),
                "next_step": report.next_step,
            }
        )
        return
    _render_install(report)


def _render_install(report: InstallReport) -> None:
    for f in report.files:
        if report.dry_run:
            console.print(
                f"[bold]{escape(str(f.path))}[/] (would {f.action}):",
                highlight=False,
                soft_wrap=True,
            )
            console.print(escape(f.text), highlight=False, soft_wrap=True)
        else:
            done = {"create": "created", "replace": "replaced", "unchanged": "unchanged"}
            console.print(
                f"{done[f.action]} {escape(str(f.path))}", highlight=False, soft_wrap=True
            )
    for warning in report.warnings:
        err_console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    verb = "then" if report.dry_run else "next"
    console.print(f"{verb}: {report.next_step}", highlight=False, soft_wrap=True)
