"""Running an agent: bind its sockets, serve until SIGTERM/SIGINT, shut down cleanly.

The agent records where it listens in ``<data_dir>/agent.json`` (written atomically once every
socket is bound, removed on a clean exit), which ``kvctl agent stop/status`` and tests read. A
file left by a killed agent is recognised by its lock, free (below), and replaced.

While it runs the agent holds ``<data_dir>/agent.lock`` (flock, exclusive, its pid written in
it), from before it binds anything until after it has removed ``agent.json``: the kernel drops
the lock when the process dies, however it dies, so a held lock is the only proof that the agent
``agent.json`` records still runs. A pid alone is not: after a SIGKILL or a reboot it may be
another process's, even another agent's, which ``stop`` must never signal. Two agents started
at once on one data directory meet at the lock, and one of them refuses.

A detached agent gets its settings in an anonymous memory file (memfd) it inherits, not on its
command line (``ps`` shows every process's argv to every user, and the settings may hold a token
or a pool password) and not in a file: a start killed at any moment leaves them nowhere. A
settings file an older build's start left in the data directory (``agent-settings.toml``, or
``agent-settings.PID.toml`` whose start is gone) is removed by the next agent to hold it.

A detached agent's log, ``<data_dir>/agent.log``, is rolled over by size (``kvctl.agent.logfile``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import math
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from shlex import quote
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

from kvctl import __version__, http_serving, json_text
from kvctl.agent.logfile import LogFollower, start_rotation
from kvctl.agent.settings import AgentSettings, LinkSpec
from kvctl.paths import WriteFailed, make_private_dir, write_atomic
from kvctl.wire.address import (
    IPAddress,
    connect_host,
    listeners_overlap,
    plain_ip,
    url_host,
)

if TYPE_CHECKING:
    pass

log = logging.getLogger("kvctl.agent")

STATE_FILE = "agent.json"
#: held (flock) by the agent of the data directory for as long as it runs
LOCK_FILE = "agent.lock"
#: seconds a starting agent tries for the lock: a `kvctl agent status` checking it holds it for
#: microseconds, another agent for as long as it runs
LOCK_WAIT_S = 2.0
LOG_FILE = "agent.log"
#: where older builds' detached starts handed their agent its settings, each its own file
#: (``agent-settings.PID.toml``, its pid): one whose start was killed before its agent read it
#: stayed in the data dir, token and all
SETTINGS_FILE_PATTERN = "agent-settings.*.toml"


#: the one settings file of every detached start before ``agent-settings.PID.toml``: a start
#: killed midway (a closed ssh session) left it in the data dir, token and all
OLD_SETTINGS_FILE = "agent-settings.toml"


def remove_stale_settings(data_dir: Path) -> list[Path]:
    """Remove the settings files that no agent will read from ``data_dir`` (they may hold a
    token or a pool password), which older builds' starts left: ``agent-settings.toml``, and
    each ``agent-settings.PID.toml`` whose start (PID) is gone, killed before its agent read it.
    A live start's is left to it (an older build's, running now), and so is what no start of
    this user wrote (not a regular file, another user's, a name with no pid in it: logged), or
    what cannot be removed (logged): a clean-up never keeps the agent from starting. For the
    agent that holds ``data_dir``'s lock; the paths removed."""
    removed = []
    for path in sorted(data_dir.glob("agent-settings*.toml")):
        if not _stale_settings_name(path.name):
            continue
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            # no start of ours wrote it (a directory, a link planted there, another user's in
            # a shared data dir): not ours to delete
            log.warning(
                "%s is named like the settings a start hands its agent, but this user's starts "
                "did not write it (%s): left as it is; remove it by hand if it holds a secret",
                path,
                "not a regular file" if not stat.S_ISREG(st.st_mode) else f"owner uid {st.st_uid}",
            )
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning(
                "cannot remove %s, settings a start killed midway left (%s): remove it by hand",
                path,
                exc.strerror or exc,
            )
            continue
        removed.append(path)
    return removed


#: the largest pid Linux gives (PID_MAX_LIMIT, 2^22): a larger number in a name is no start's
_PID_MAX = 1 << 22


def _stale_settings_name(name: str) -> bool:
    """Whether ``name`` is the settings file of a start that is gone: the older layout's, or
    ``agent-settings.PID.toml`` with no live kvctl process PID (a name with no pid in it is not
    a start's: never)."""
    if name == OLD_SETTINGS_FILE:
        return True
    pid = name.removeprefix("agent-settings.").removesuffix(".toml")
    # ASCII digits only: str.isdigit() takes '²' too, which int() refuses
    if not (pid.isascii() and pid.isdigit() and 0 < int(pid) <= _PID_MAX):
        return False
    return not pid_alive(int(pid))


#: every file the agent writes is its owner's alone, whatever the umask and the directory's mode:
#: the log names tenants and keys, chunks hold prompts' KV
PRIVATE_FILE_MODE = 0o600
#: group's and others' permission bits
SHARED_BITS = 0o077
#: descriptors the agent needs beside its connections' (chunk files, listeners, the log)
SPARE_DESCRIPTORS = 256


class AgentRunning(RuntimeError):
    """Another live agent already uses this data directory."""


#: the longest a failed start looks through /proc for who holds its port (20 ms with 100
#: processes; each process's descriptors are read)
HOLDER_SEARCH_SECONDS = 2.0


class SocketInUse(RuntimeError):
    """Another live process, another agent most likely, listens where this agent was told to:
    on the Unix socket path of its data plane, or on the TCP port of its control API or data
    plane."""


class DataDirFull(RuntimeError):
    """A detached agent did not start, and the filesystem holding its data directory is full:
    most likely it could not write its files there (its log could not say so either)."""


#: free bytes under which a data directory's filesystem counts as full: the agent's own files
#: there (agent.json, the settings handed over) are a few KiB
FULL_BELOW_BYTES = 64 << 10


def free_bytes(path: Path) -> int | None:
    """Free bytes of ``path``'s filesystem for an unprivileged writer (None: cannot ask)."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


def read_record(path: Path) -> str:
    """``path``'s text, bytes that are not UTF-8 replaced (U+FFFD): an agent writes its record
    as UTF-8 JSON, so a damaged one parses as no agent's record rather than raise
    UnicodeDecodeError, which is no OSError."""
    return path.read_text(encoding="utf-8", errors="replace")


@dataclass(frozen=True, slots=True)
class AgentState:
    pid: int
    name: str
    dc: str
    control_url: str
    data_tcp: str | None
    data_unix: str | None
    started_s: float
    version: str

    @classmethod
    def read(cls, data_dir: Path) -> AgentState | None:
        try:
            return cls.parse(read_record(data_dir / STATE_FILE))
        except OSError:
            return None

    @classmethod
    def parse(cls, text: str) -> AgentState | None:
        """The state an agent wrote as ``text``; None for anything else (a torn or hand-edited
        file), so no caller signals a pid or asks a URL it made up."""
        try:
            raw = json_text.loads(text)
        except ValueError:
            return None
        if not isinstance(raw, dict):
            return None
        pid, url = raw.get("pid"), raw.get("control_url")
        # at most a pid_t's 2**31 - 1: past it, os.kill (``alive``) raised OverflowError
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < 2**31:
            return None
        if not isinstance(url, str) or not url:
            return None
        values: dict[str, Any] = {k: raw.get(k) for k in cls.__slots__}
        return cls(**values)

    def write(self, data_dir: Path) -> None:
        text = json.dumps({k: getattr(self, k) for k in self.__slots__}, indent=2)
        write_private(data_dir / STATE_FILE, text)

    @property
    def alive(self) -> bool:
        return pid_alive(self.pid)


def pid_alive(pid: int) -> bool:
    """True when ``pid`` runs and is a kvctl process (a recycled pid is not our agent)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the signal check
    if b"kvctl" not in cmdline:
        return False
    try:  # a killed child not yet reaped by its parent is gone for our purposes
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def process_stopped(pid: int) -> bool:
    """True when ``pid`` is stopped by a signal (SIGSTOP, SIGTSTP: Ctrl-Z in its terminal): it
    answers nothing until SIGCONT. Not a debugger's stop ("t"), which SIGCONT does not end."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


#: what flock fails with on a filesystem without locks (NFSv3 whose lock daemon does not
#: answer: ENOLCK; some FUSE and network filesystems: EOPNOTSUPP, ENOSYS, EINVAL)
NO_LOCKS_ERRNOS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def hold_data_dir(data_dir: Path, *, wait_s: float = LOCK_WAIT_S) -> int:
    """Take ``data_dir``'s :data:`LOCK_FILE` for this process and write its pid there; the
    descriptor to keep open while the agent runs, or -1 on a filesystem without locks (logged:
    the agent runs there as before the lock, known by its pid). Raises :class:`AgentRunning`
    when another process holds it, :class:`WriteFailed` when the file cannot be created."""
    path = data_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except OSError as exc:
        raise WriteFailed(path, exc) from exc
    deadline_s = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline_s:
                holder = _flock_holder(fd) or _pid_in(fd)
                os.close(fd)
                who = f"an agent (pid {holder})" if holder else "another agent"
                raise AgentRunning(
                    f"{who} already serves {data_dir} (it holds {path}); stop it with "
                    f"`kvctl agent stop --data-dir {quote(str(data_dir))}` or choose another "
                    "--data-dir"
                ) from None
            time.sleep(0.01)
        except OSError as exc:
            if exc.errno not in NO_LOCKS_ERRNOS:
                os.close(fd)
                raise
            os.close(fd)
            log.warning(
                "cannot lock %s (%s): its filesystem takes no locks, so whether this agent "
                "runs is judged by the pid in %s, and a second agent started at once on %s is "
                "not kept out; a data dir on a local filesystem has neither problem",
                path,
                exc.strerror or exc,
                STATE_FILE,
                data_dir,
            )
            return -1
    # best effort: on a full filesystem the pid may not fit (agent.json records it too), and
    # the foreground start that trims the disk tier to make room must still get that far
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _pid_in(fd: int) -> int | None:
    """The pid written in a lock file (None: none yet, or not a pid)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


#: what :func:`_probe_lock` says of a data directory without a lock file it can open
NO_LOCK = -1


def _probe_lock(data_dir: Path) -> int | None:
    """Whether ``data_dir``'s lock is held: the holder's pid (0 when it is not known), None when
    it is free, :data:`NO_LOCK` when there is no lock file this user can open, or its
    filesystem takes no locks."""
    try:
        fd = os.open(data_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return NO_LOCK
    try:
        # a shared lock, dropped at once: an agent starting meanwhile waits for it (LOCK_WAIT_S)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if not isinstance(exc, BlockingIOError):  # a filesystem without locks: cannot tell
            return NO_LOCK
        # the kernel's word first: the file is empty between the holder's flock and its write,
        # or for good where its pid did not fit (a full filesystem), and may still name the
        # agent before it where that write failed
        return _flock_holder(fd) or _pid_in(fd) or 0
    finally:
        os.close(fd)
    return None


def _flock_holder(fd: int) -> int | None:
    """The pid that holds an exclusive flock on ``fd``'s file, as /proc/locks says (None: not
    listed there, no /proc, or a holder in another pid namespace, listed as pid 0)."""
    try:
        st = os.fstat(fd)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:5678 0 EOF" (a waiter's line has "->" after "1:")
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if fields[1:4] == ["FLOCK", "ADVISORY", "WRITE"] and fields[5:6] == [wanted]:
            return int(fields[4]) if fields[4].isdigit() and int(fields[4]) > 0 else None
    return None


def holder_pid(data_dir: Path, recorded_pid: int) -> int | None:
    """The pid of the agent running from ``data_dir`` now, ``recorded_pid`` being the one its
    ``agent.json`` names; None when none runs, or its holder's pid is not known. The lock
    decides (see the module's doc); a data directory without a lock file (an older build's
    agent), or one this user cannot open, falls back to asking whether ``recorded_pid`` is a
    live kvctl process."""
    held = _probe_lock(data_dir)
    if held == NO_LOCK:
        return recorded_pid if pid_alive(recorded_pid) else None
    # a holder whose pid is not known is not taken for the recorded one: that may be a dead
    # agent's pid, another process's by now
    return held or None


def starting_agent(data_dir: Path) -> int | None:
    """The pid of an agent that holds ``data_dir`` but has not recorded itself in its
    ``agent.json`` yet: it opens its tiers first (a large disk tier's scan takes minutes), and
    a record there until then is a dead agent's. None when there is none (or its pid is not
    known)."""
    held = _probe_lock(data_dir)
    if held is None or held <= 0:
        return None
    state = AgentState.read(data_dir)
    return None if state is not None and state.pid == held else held


def _starting_message(data_dir: Path, pid: int) -> NoAgentHere:
    return NoAgentHere(
        f"an agent (pid {pid}) is starting from {data_dir}: it holds {LOCK_FILE} but has not "
        f"written {STATE_FILE} yet (it opens its tiers first; a large disk tier's scan takes "
        "minutes)",
        f"wait for it (its log: {data_dir / LOG_FILE} if detached), or stop it: "
        f"`kvctl agent stop --data-dir {quote(str(data_dir))}`",
    )


def running_agent(data_dir: Path) -> AgentState | None:
    """The agent ``data_dir``'s ``agent.json`` records, if that agent runs now: not when its
    pid has gone, or belongs to another process now (a SIGKILLed agent's record)."""
    state = AgentState.read(data_dir)
    if state is None or holder_pid(data_dir, state.pid) != state.pid:
        return None
    return state


class NoAgentHere(LookupError):
    """A data directory that was named holds no record of a running agent: the message says
    what is there, ``hint`` what to do next."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


def recorded_agent(data_dir: Path, *, running: bool = True) -> AgentState:
    """The agent that ``data_dir``'s ``agent.json`` records as running there. Raises
    :class:`NoAgentHere` when there is no such file (no agent has run from it, or the last one
    stopped) or it cannot be read or is not an agent's; with ``running``, also when its
    process is gone."""
    path = data_dir / STATE_FILE
    start = f"start one there: `kvctl agent start --data-dir {quote(str(data_dir))} --detach`"
    starting = starting_agent(data_dir)
    if starting is not None:
        raise _starting_message(data_dir, starting)
    try:
        text = read_record(path)
    except FileNotFoundError:
        if not data_dir.is_dir():
            raise NoAgentHere(
                f"no agent has run from {data_dir}: there is no such directory", start
            ) from None
        raise NoAgentHere(
            f"no agent is running from {data_dir}: it holds no {STATE_FILE}, which an agent "
            "writes while it serves (none has run from it, or the last one stopped)",
            start,
        ) from None
    except NotADirectoryError:
        # a file where the directory should be: no user could read an agent's record there
        raise NoAgentHere(
            f"no agent has run from {data_dir}: {_file_on(data_dir)} is a file, not a directory",
            "give --data-dir the agent's data directory (the one `kvctl agent start "
            "--data-dir` was given), or --url its control URL",
        ) from None
    except OSError as exc:
        raise NoAgentHere(
            f"cannot read {path}: {exc.strerror or exc}",
            "run this as the agent's user, or give --url its control URL",
        ) from None
    state = AgentState.parse(text)
    if state is None:
        raise NoAgentHere(
            f"{path} is not an agent's record (an agent writes pid, addresses and version "
            "there as JSON)",
            f"if no agent runs from {data_dir}, remove that file and {start}",
        )
    if running and holder_pid(data_dir, state.pid) != state.pid:
        raise NoAgentHere(
            f"the agent {path} records (pid {state.pid}, {state.control_url}) is not running: "
            "it did not stop cleanly",
            f"its log is {data_dir / LOG_FILE} if it was detached; {start}",
        )
    return state


def _file_on(path: Path) -> Path:
    """The file on ``path`` where a directory should be: ``path`` itself or one above it."""
    for p in (path, *path.parents):
        if p.exists():  # the deepest that exists; all below it failed for want of a directory
            return path if p.is_dir() else p
    return path


def control_url_for(data_dir: Path, configured_url: str, *, named: bool) -> str:
    """Where to ask the agent of ``data_dir``: the control URL its ``agent.json`` records.
    Without one, the configured URL, unless the data directory was ``named`` (--data-dir): an
    agent answering there may serve another directory, so none is asked and
    :class:`NoAgentHere` says why."""
    if named:
        return recorded_agent(data_dir).control_url
    starting = starting_agent(data_dir)
    if starting is not None:  # its control port may take connections it does not answer yet
        raise _starting_message(data_dir, starting)
    state = AgentState.read(data_dir)
    return state.control_url if state is not None else configured_url


def serve(settings: AgentSettings) -> int:
    """Run the agent in this process until SIGTERM or SIGINT; returns the exit code."""
    data_dir = settings.data_path
    make_private_dir(data_dir, "data directory")
    warn_if_shared(data_dir)
    lock_fd = hold_data_dir(data_dir)
    if lock_fd < 0:  # no lock on this filesystem: the pid check that came before it
        other = running_agent(data_dir)
        if other is not None and other.pid != os.getpid():
            raise AgentRunning(
                f"an agent (pid {other.pid}) already serves {data_dir}; stop it with "
                f"`kvctl agent stop --data-dir {quote(str(data_dir))}` or choose another "
                "--data-dir"
            )
    for path in remove_stale_settings(data_dir):
        log.info("removed %s: settings a start killed midway left (a token, maybe)", path)
    # the lock's holder alone rolls the data dir's log over (a detached agent's: see logfile)
    rotator = start_rotation(data_dir / LOG_FILE, settings.log_max_bytes, settings.log_backups)
    try:
        return _serve_holding(settings, data_dir)
    finally:  # last: once agent.json is gone, and the store closed
        if rotator is not None:
            rotator.stop()
        if lock_fd >= 0:
            os.close(lock_fd)


def _serve_holding(settings: AgentSettings, data_dir: Path) -> int:
    """:func:`serve` once this process holds ``data_dir``."""
    import uvicorn

    from kvctl.agent.api import create_app
    from kvctl.agent.dataplane import DataPlaneServer
    from kvctl.agent.runtime import AgentRuntime
    from kvctl.agent.starting import StartingResponder
    from kvctl.agent.stop_demotion import demote_for_stop

    # before the tiers open (a large disk tier's scan takes minutes, the arena's commit a few
    # seconds a GiB): a socket or port another agent serves would only be found once they had
    check_socket_free(settings.socket_path)
    # put back once stopped: serve() may run inside a longer process (tests, an embedder)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    # the TCP sockets themselves, kept and served once the tiers are open (no trial bind); a
    # failed start closes them
    control, data_tcp = _bind_ports(settings)
    # from here on whatever failed (the runtime's open, the data plane's construction, a
    # Ctrl-C at start) closes what was opened: a runtime left open keeps the disk tier's lock,
    # the arena and its threads, and the TCP sockets their ports, in a process that goes on
    runtime: AgentRuntime | None = None
    dataplane: DataPlaneServer | None = None
    responder: StartingResponder | None = None
    serving = False
    try:
        # until the API serves, each request on its port is answered "starting" (503)
        responder = StartingResponder(control)
        responder.start()
        runtime = AgentRuntime.open(settings)
        dataplane = DataPlaneServer(
            runtime,
            frame_timeout_s=settings.data_frame_timeout_seconds,
            put_budget_bytes=settings.data_put_budget_bytes,
            max_connections=settings.data_max_connections,
        )
        if data_tcp is not None:
            _listen_data_tcp(data_tcp)
            dataplane.serve_tcp(data_tcp)
        if settings.socket_path is not None:
            with _naming(str(settings.socket_path), "the data plane's Unix socket (socket)"):
                dataplane.listen_unix(settings.socket_path)
        dataplane.start()
        if runtime.remote is not None:
            runtime.remote.start()
        bound = control.getsockname()
        state = AgentState(
            pid=os.getpid(),
            name=settings.name,
            dc=settings.dc,
            control_url=f"http://{_hostport(bound[0], bound[1])}",
            data_tcp=None if dataplane.tcp_address is None else _hostport(*dataplane.tcp_address),
            data_unix=None if dataplane.unix_path is None else str(dataplane.unix_path),
            started_s=runtime.started_s,
            version=__version__,
        )
        runtime.bound = {"tcp": state.data_tcp, "unix": state.data_unix}
        state.write(data_dir)
        log.info(
            "agent %s (dc %s) serving: control %s, data tcp %s, unix %s; tiers %s",
            settings.name,
            settings.dc,
            state.control_url,
            state.data_tcp,
            state.data_unix,
            ", ".join(f"{n}={u['capacity_bytes']}B" for n, u in runtime.store.usage().items()),
        )
        http_serving.throttle_accept_errors()
        warn_if_few_descriptors(settings.data_max_connections)
        config = http_serving.serving_config(
            create_app(runtime, max_body_bytes=settings.max_body_bytes), settings.log_level
        )

        class _AgentServer(uvicorn.Server):
            """uvicorn's server, logging each signal as it comes: the first starts the
            shutdown; uvicorn itself says nothing of them."""

            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                _log_shutdown_signal(sig, already=self.should_exit)
                super().handle_exit(sig, frame)

        server = _AgentServer(config)
        # uvicorn handles SIGTERM/SIGINT while it runs (stops accepting, lets in-flight HTTP
        # requests finish, returns here), then re-raises each signal it caught to the handler
        # it found: make that one silent (_AgentServer logged them as they came), so the drain
        # below runs and the exit code is 0; a signal during the drain is only logged
        responder.stop()  # (a signal while it finishes a client: as at any point of the start)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _ignore_signal)
        serving = True
        server.run(sockets=[control])
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _already_stopping)
        if responder is not None:
            responder.stop()  # (before the socket closes: a failed start)
        # each step runs whatever the one before raised: a failed drain still closes the store
        with contextlib.ExitStack() as steps:
            for sig, handler in previous.items():
                if handler is not None:  # (one set outside Python cannot be put back from here)
                    steps.callback(signal.signal, sig, handler)
            steps.callback(_forget_state, data_dir)
            steps.callback(control.close)
            if data_tcp is not None:  # (closed by dataplane.stop too, once it serves it)
                steps.callback(data_tcp.close)
            if runtime is not None:
                steps.callback(runtime.close)
                if serving:  # a clean stop: the volatile tiers' chunks to disk, once drained
                    steps.callback(demote_for_stop, runtime.store, settings.stop_demote_seconds)
            if dataplane is not None:
                log.info("agent %s stopping: draining the data plane", settings.name)
                steps.callback(dataplane.stop)
    log.info("agent %s stopped cleanly", settings.name)
    return 0


def check_socket_free(path: Path | None) -> None:
    """Raise :class:`SocketInUse`, naming it, when a process listens on ``path`` (the data
    plane's Unix socket, None: none). A socket nobody listens on (a killed agent's), or
    anything that is no socket, is left to the data plane's bind, which takes over the one and
    refuses the other."""
    if path is None:
        return
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return
    except OSError:
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
        pid = _peer_pid(probe)
    except OSError:
        return  # refused: a killed agent's; or cannot be checked: the bind says so
    finally:
        probe.close()
    who, data_dir = _describe_process(pid)
    stop = (
        ""
        if data_dir is None
        else f"stop it (`kvctl agent stop --data-dir {quote(str(data_dir))}`) or "
    )
    raise SocketInUse(
        f"cannot serve the data plane's Unix socket (socket) on {path}: {who} listens on it; "
        f"{stop}give this agent another --socket (or --socket off)"
    )


def _bind_ports(settings: AgentSettings) -> tuple[socket.socket, socket.socket | None]:
    """The control API's listening socket and the data plane's TCP one (None: data_listen
    off). The data plane's is bound but not listening until :func:`_listen_data_tcp`: an
    engine or peer that connects while the tiers open is refused at once, as by a stopped
    agent, not connected to a port that answers nothing for minutes. The control API's
    listens already (the CLI knows a starting agent by its data dir), so a second agent given
    the same ports is refused before its tiers open even while the first one's are. A port
    another process listens on raises :class:`SocketInUse`, naming it; any other failure to
    bind its OSError, naming the address. Neither is left open then."""
    from kvctl.agent.dataplane import bind_tcp

    host, port = settings.control_host_port
    with _holder_named(_address_text(host, port), "the control API", "--listen"):
        control = _bind_tcp(host, port)
    tcp = settings.data_host_port
    if tcp is None:
        return control, None
    try:
        address, what = _data_address(tcp)
        with _holder_named(address, what, "--data-listen"), _naming(address, what):
            return control, bind_tcp(*tcp, listen=False)
    except BaseException:
        control.close()
        raise


def _listen_data_tcp(sock: socket.socket) -> None:
    """Start listening on the data plane's TCP socket from :func:`_bind_ports`, as it is about
    to serve. A port another process took while the tiers opened (a bind with SO_REUSEADDR
    may take one only bound) raises :class:`SocketInUse`, naming it."""
    from kvctl.agent.dataplane import LISTEN_BACKLOG

    address, what = _data_address(sock.getsockname()[:2])  # (port 0: the one it got)
    with _holder_named(address, what, "--data-listen"), _naming(address, what):
        sock.listen(LISTEN_BACKLOG)


def _data_address(tcp: tuple[str, int]) -> tuple[str, str]:
    """The data plane's ``host:port`` as errors say it, and what it is for."""
    return _address_text(*tcp), "the data plane (data_listen)"


def _address_text(host: str, port: int) -> str:
    """``host:port`` as the settings write it: an IPv6 host in brackets ('::1:7071' reads as
    an address with no port)."""
    return f"{url_host(host)}:{port}"


@contextlib.contextmanager
def _holder_named(address: str, what: str, option: str) -> Iterator[None]:
    """An "address in use" from binding ``address`` (HOST:PORT, for ``what``, set by
    ``option``) raised as :class:`SocketInUse`, saying who listens there and what to do."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        host, _, port = address.rpartition(":")
        pid = _tcp_listener_pid(host.strip("[]"), int(port))
        if pid == os.getpid():  # (this agent's other port, or an embedder's socket)
            who, data_dir = f"this process (pid {pid})", None
        else:
            who, data_dir = _describe_process(pid)
            if pid is None:
                who = "another process"
        stop = (
            ""
            if data_dir is None
            else f"stop it (`kvctl agent stop --data-dir {quote(str(data_dir))}`) or "
        )
        raise SocketInUse(
            f"cannot listen on {address} for {what}: {who} listens there; {stop}give this "
            f"agent another {option} (port 0 takes any free one)"
        ) from exc


def _tcp_listener_pid(
    host: str, port: int, *, budget_s: float = HOLDER_SEARCH_SECONDS
) -> int | None:
    """The pid of a process listening on TCP ``port`` at an address that overlaps ``host``'s,
    an agent's first (None: none this user can see: another user's, or gone since; or none
    found within ``budget_s``, a host with many processes' descriptors to read: the start's
    error then says "another process" rather than wait)."""
    inodes = _listening_inodes(host, port)
    if not inodes:
        return None
    deadline_s = time.monotonic() + budget_s
    holders: list[int] = []
    for entry in os.scandir("/proc"):
        if time.monotonic() >= deadline_s:
            break
        if not entry.name.isdigit():
            continue
        for link in _fd_targets(entry.name):
            if link in inodes:
                pid = int(entry.name)
                if _agent_data_dir(pid) is not None:
                    return pid
                holders.append(pid)
                break
    return holders[0] if holders else None


def _listening_inodes(host: str, port: int) -> set[str]:
    """The sockets (as /proc/PID/fd links name them) listening on TCP ``port`` at an address
    a bind to ``host`` conflicts with (``listeners_overlap``; a host name: any)."""
    try:
        wanted: IPAddress | None = plain_ip(host)
    except ValueError:
        wanted = None
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: TCP_LISTEN
                continue
            hex_ip, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) != port:
                continue
            if wanted is None or listeners_overlap(wanted, plain_ip(_proc_net_ip(hex_ip))):
                inodes.add(f"socket:[{fields[9]}]")
    return inodes


def _proc_net_ip(hex_ip: str) -> str:
    """An address as /proc/net/tcp{,6} writes it (32-bit words in host order, little-endian
    here), in text."""
    raw = bytes.fromhex(hex_ip)
    packed = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, packed)


def _peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process listening at the other end of a connected Unix socket (None:
    not known, as for one in another pid namespace)."""
    creds = struct.Struct("3i")  # struct ucred: pid, uid, gid
    try:
        pid = creds.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds.size))[0]
    except (OSError, AttributeError):  # (no SO_PEERCRED outside Linux)
        return None
    return pid if pid > 0 else None


def _describe_process(pid: int | None) -> tuple[str, Path | None]:
    """Who ``pid`` is, as an error says it, and its data dir: the agent it is (name, data
    dir, control URL) when it holds a data dir's lock this user can see, else the process."""
    if pid is None:
        return "another process (another agent?)", None
    data_dir = _agent_data_dir(pid)
    if data_dir is None:
        return f"another process (pid {pid})", None
    state = AgentState.read(data_dir)
    if state is None or state.pid != pid:  # still opening its tiers
        return f"another agent (pid {pid}, data dir {data_dir})", data_dir
    return (
        f"another agent, {state.name} (pid {pid}, data dir {data_dir}, control "
        f"{state.control_url})",
        data_dir,
    )


def _agent_data_dir(pid: int) -> Path | None:
    """The data dir whose lock ``pid`` holds open (None: none, or its descriptors cannot be
    read: another user's process)."""
    for link in _fd_targets(pid):
        if link.startswith("/") and Path(link).name == LOCK_FILE:
            return Path(link).parent
    return None


def _fd_targets(pid: int | str) -> Iterator[str]:
    """What each of ``pid``'s open descriptors names (a path, ``socket:[INODE]``, ...): none
    when they cannot be read (another user's process, or gone); one closed since the listing
    (a connection's, say) is skipped."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            yield os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue


def _forget_state(data_dir: Path) -> None:
    """Remove ``agent.json`` if this process wrote it."""
    state_now = AgentState.read(data_dir)
    if state_now is not None and state_now.pid == os.getpid():
        with contextlib.suppress(FileNotFoundError):
            (data_dir / STATE_FILE).unlink()


def descriptors_needed(data_max_connections: int) -> int:
    """Open files an agent needs with every connection cap full: both data-plane transports,
    the control API and the spares."""
    return 2 * data_max_connections + http_serving.MAX_CONNECTIONS + SPARE_DESCRIPTORS


def warn_if_few_descriptors(data_max_connections: int) -> None:
    """Log a warning when the process's open-files limit is below what its connection caps
    need: clients would run it out of descriptors before any cap refused them."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = descriptors_needed(data_max_connections)
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning(
            "the open-files limit (%d) is below the %d the connection caps need "
            "(data_max_connections %d per transport): raise it (`ulimit -n`, LimitNOFILE in "
            "a systemd unit) or lower data_max_connections",
            soft,
            need,
            data_max_connections,
        )


def write_private(path: Path, text: str) -> None:
    """``text`` in ``path``, 0600 whatever the umask, replaced atomically."""
    write_atomic(path, text, mode=PRIVATE_FILE_MODE)


def open_private_log(path: Path) -> IO[bytes]:
    """``path`` opened for appending, created 0600; one an older build made readable by others
    is tightened (its lines are the agent's, so its owner is this user)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except OSError as exc:
        raise WriteFailed(path, exc) from exc
    try:
        if os.fstat(fd).st_mode & SHARED_BITS:
            os.fchmod(fd, PRIVATE_FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "ab")


def shared_mode(path: Path) -> int | None:
    """``path``'s permission bits when group or others have any (None when it is private or
    cannot be read)."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None
    return mode if mode & SHARED_BITS else None


def warn_if_shared(data_dir: Path) -> None:
    """Log a warning when other users can reach the data directory: the agent's own files are
    0600, but files an operator or an older build left there, and the chunks' names, are not
    protected by that."""
    mode = shared_mode(data_dir)
    if mode is not None:
        log.warning(
            "data directory %s has mode %s: group/others can read it; `chmod 700 %s`",
            data_dir,
            f"{mode:04o}",
            data_dir,
        )


def _already_stopping(signum: int, _frame: object) -> None:
    log.info("signal %d: already shutting down", signum)


def _ignore_signal(_signum: int, _frame: object) -> None:
    """uvicorn's re-raise of a signal it caught and :class:`_AgentServer` logged."""


def _log_shutdown_signal(signum: int, already: bool) -> None:
    if already:
        log.info("signal %d: already shutting down", signum)
    else:
        log.info("signal %d: shutting down, letting requests in flight finish", signum)


def spawn_agent(
    argv: list[str],
    data_dir: Path,
    *,
    timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    detach: bool = True,
    progress: Callable[[float, str], None] | None = None,
) -> tuple[subprocess.Popen[bytes], AgentState]:
    """Start ``kvctl agent start ARGV`` (in the foreground of a child process) with its output
    in ``<data_dir>/agent.log``, and wait until it serves: while it is alive and writes to its
    log, and up to ``timeout_s`` after its last line (see ``StartWait``). ``detach`` puts it in
    its own session, so a closed terminal (SIGHUP) does not take it down. ``progress`` is told
    each new line of its log as it starts. Raises RuntimeError with the end of its log when it
    does not come up."""
    return _spawn(["--data-dir", str(data_dir), *argv], data_dir, timeout_s, env, detach, progress)


#: seconds a starting agent may go without a new line in its log (a scan of a large disk tier
#: logs its progress every few seconds), plus START_SECONDS_PER_GIB for each GiB of memory it
#: commits at start, silently (the cpu arena; the gpu tier's, which CUDA also pins the arena for)
START_SECONDS = 30.0
#: committing took up to ~2.2 s a GiB on huge pages while the kernel compacted memory, 0.1 s
#: on small ones; registering the arena with CUDA ~0.3-0.4 s a GiB (bench/README.md)
START_SECONDS_PER_GIB = 3.0


def start_timeout_seconds(settings: AgentSettings) -> float:
    """How long an agent with ``settings`` may go without a new line in its log as it starts
    before it is given up on."""
    committed_gib = (settings.cpu_bytes + settings.gpu_capacity_bytes) / (1 << 30)
    return START_SECONDS + START_SECONDS_PER_GIB * committed_gib


def spawn_with_settings(
    settings: AgentSettings,
    *,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    detach: bool = True,
    progress: Callable[[float, str], None] | None = None,
    limit_s: float | None = None,
    lines: Callable[[str], None] | None = None,
) -> tuple[subprocess.Popen[bytes], AgentState]:
    """:func:`spawn_agent` for an agent that runs with exactly ``settings``: they are handed over
    in an anonymous memory file the child inherits (:func:`settings_memfd`), which it reads
    with ``load_settings`` and nothing else (no config file, no ``KVCTL_*`` setting, none of
    which it is given). Nothing holding them is in a file, so a start killed at any moment
    leaves no token behind. ``timeout_s``: by default ``start_timeout_seconds(settings)``;
    ``limit_s``: the start's bound whatever the agent logs (``StartWait``); ``lines``: told each
    line the agent logged from its start until it served (:func:`wait_serving`). Raises
    RuntimeError where this system has no memory files (not Linux, or a filter forbids them)."""
    if timeout_s is None:
        timeout_s = start_timeout_seconds(settings)
    from kvctl.agent.config import SETTINGS_ENV_NAMES

    # the child reads none of them: a token there would only sit in its /proc/PID/environ
    env = {
        k: v for k, v in (os.environ if env is None else env).items() if k not in SETTINGS_ENV_NAMES
    }
    fd = settings_memfd(settings_toml(settings))
    return _spawn(
        ["--settings-fd", str(fd)],
        settings.data_path,
        timeout_s,
        env,
        detach,
        progress,
        limit_s,
        lines,
        hand_over_fd=fd,
    )


#: the name a memory file of settings has (``/proc/PID/fd/N`` shows ``/memfd:NAME``)
SETTINGS_MEMFD_NAME = "kvctl-agent-settings"


def settings_memfd(text: str) -> int:
    """A file descriptor (3 or above: never one of a child's standard streams, which its
    ``Popen`` would put over it) of an anonymous memory file holding ``text``, for a child to
    inherit (close-on-exec until ``Popen(pass_fds=...)`` hands it on) and read as
    ``/proc/self/fd/FD``. Only this user's processes can open it; it is gone once the last one
    holding it closes it or exits. RuntimeError where memory files cannot be made."""
    try:
        made = os.memfd_create(SETTINGS_MEMFD_NAME, os.MFD_CLOEXEC)
    except (AttributeError, OSError) as exc:  # (no such call off Linux; ENOSYS, EPERM)
        why = getattr(exc, "strerror", None) or "this system has no memfd_create"
        raise RuntimeError(
            f"cannot hand a detached agent its settings: no memory file ({why}); start it in "
            "the foreground instead (without --detach; under systemd, `kvctl agent install`)"
        ) from exc
    try:
        # a start run with its standard streams closed gets 0, 1 or 2 for it
        fd = fcntl.fcntl(made, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(made)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def settings_toml(settings: AgentSettings) -> str:
    """``settings`` as an ``[agent]`` table that ``load_settings`` reads back to equal settings
    (``data_dir`` resolved, so the child does not resolve it again in another environment)."""
    lines = ["[agent]"]
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name == "data_dir":
            value = str(settings.data_path)
        elif f.name == "peers":
            value = dict(value)
        elif f.name == "links":
            value = {spec.name: _link_table(spec) for spec in value}
        elif f.name == "models":
            value = [dataclasses.asdict(m) for m in value]
        lines.append(f"{f.name} = {_toml(value)}")
    return "\n".join(lines) + "\n"


def _link_table(spec: LinkSpec) -> dict[str, object]:
    # the file's spelling: milliseconds, bytes per second
    table: dict[str, object] = {"override": spec.override, "delay_ms": spec.delay_seconds * 1000}
    if spec.rtt_seconds is not None:
        table["rtt_ms"] = spec.rtt_seconds * 1000
    if spec.bandwidth_bytes_per_second is not None:
        table["bandwidth"] = round(spec.bandwidth_bytes_per_second)
    return table


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        assert math.isfinite(value), value  # the loader admits finite numbers only
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{_toml_string(str(k))} = {_toml(v)}" for k, v in value.items()) + "}"
        )
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _toml_string(text: str) -> str:
    """A TOML basic string: quote, backslash and control characters escaped, the rest as is."""
    return '"' + "".join(_toml_char(c) for c in text) + '"'


def _toml_char(c: str) -> str:
    return f"\\u{ord(c):04x}" if c in '"\\' or ord(c) < 0x20 or ord(c) == 0x7F else c


def _spawn(
    args: list[str],
    data_dir: Path,
    timeout_s: float,
    env: dict[str, str] | None,
    detach: bool,
    progress: Callable[[float, str], None] | None = None,
    limit_s: float | None = None,
    lines: Callable[[str], None] | None = None,
    hand_over_fd: int | None = None,
) -> tuple[subprocess.Popen[bytes], AgentState]:
    """``hand_over_fd``: a descriptor the child inherits (at the same number), closed here once
    it is spawned (or could not be): the child holds the only copy while it starts."""
    try:
        make_private_dir(data_dir, "data directory")
        log_path = data_dir / LOG_FILE
        with open_private_log(log_path) as out:
            # from its end: earlier runs' lines are not this one's progress; and from this file,
            # which the agent may roll over before it serves
            log = LogFollower.open(log_path, out.seek(0, os.SEEK_END))
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "kvctl", "agent", "start", *args],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=detach,
                    env=env,
                    pass_fds=() if hand_over_fd is None else (hand_over_fd,),
                )
            except BaseException:
                log.close()
                raise
    finally:
        if hand_over_fd is not None:
            os.close(hand_over_fd)
    # this run's last lines, for a failure to show: the file's own end may be an earlier
    # run's (a start that failed before this one logged nothing of its own)
    ran: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def told(line: str) -> None:
        if line:
            ran.append(line)
        if lines is not None:
            lines(line)

    with log:
        why = wait_serving(
            proc, data_dir, log, timeout_s, progress=progress, lines=told, limit_s=limit_s
        )
    if isinstance(why, AgentState):
        return proc, why
    tail = "\n".join(ran)
    free = free_bytes(data_dir)
    if free is not None and free < FULL_BELOW_BYTES:
        raise DataDirFull(
            f"the agent did not start ({why}): the filesystem holding {data_dir} has "
            f"{free:,} bytes free, too few for the files the agent writes there (agent.json); "
            + (
                f"the end of {log_path}:\n{tail}"
                if tail.strip()
                else f"its log, {log_path}, is empty: no room for it either"
            )
        )
    raise RuntimeError(
        f"the agent did not start ({why}); "
        + (
            f"what it logged, in {log_path}:\n{tail}"
            if tail
            else f"it logged nothing in {log_path}"
        )
    )


#: lines of a failed start's log its error shows
TAIL_LINES = 20
#: seconds between two looks at a starting agent
START_POLL_SECONDS = 0.05


@dataclass(slots=True)
class StartWait:
    """When to give up on a starting agent: once it has written nothing new to its log for
    ``timeout_s``. A start-up that takes long but says how far it got (the disk tier's scan logs
    its progress every few seconds: 160k chunk files took over 30 s) is waited for; one that
    hangs silently is given up ``timeout_s`` after its last line. ``limit_s``: given up that
    long after the start whatever its log says (one that logs the same error in a loop would
    otherwise be waited for forever; a script wants a bound); None: no such limit."""

    timeout_s: float
    started_s: float
    log_bytes: int
    limit_s: float | None = None
    last_progress_s: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.last_progress_s = self.started_s

    def observe(self, now_s: float, log_bytes: int) -> bool:
        """How far the log has grown (bytes, across rollovers) at ``now_s``; True while the
        agent is worth waiting for."""
        if log_bytes != self.log_bytes:
            self.log_bytes = log_bytes
            self.last_progress_s = now_s
        if self._past_limit(now_s):
            return False
        return now_s - self.last_progress_s < self.timeout_s

    def _past_limit(self, now_s: float) -> bool:
        return self.limit_s is not None and now_s - self.started_s >= self.limit_s

    def gave_up(self, now_s: float) -> str:
        if self._past_limit(now_s):
            return (
                f"not serving after {now_s - self.started_s:.0f} s, the limit given "
                f"(--start-timeout {self.limit_s:g}), so stopped"
            )
        return (
            f"not serving after {now_s - self.started_s:.0f} s, its log silent for the last "
            f"{now_s - self.last_progress_s:.0f} s, so stopped"
        )


def wait_serving(
    proc: subprocess.Popen[bytes],
    data_dir: Path,
    log: LogFollower,
    timeout_s: float,
    *,
    progress: Callable[[float, str], None] | None = None,
    lines: Callable[[str], None] | None = None,
    limit_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> AgentState | str:
    """Wait until ``proc`` serves (its state, read from ``data_dir``), or say why it will not:
    it exited, or it was killed after ``StartWait`` gave up on it (``limit_s``: its bound
    whatever the log says). ``log`` reads what it logs from its start on, across rollovers:
    ``progress(seconds, line)`` is called with each new last line, ``lines(line)`` with every
    line up to the moment it serves, or, where it does not, every line it logged."""
    wait = StartWait(timeout_s, clock(), 0, limit_s)
    said = _LineSplitter(lines)
    while True:
        state = AgentState.read(data_dir)
        if state is not None and state.pid == proc.pid and _answers(state.control_url):
            said.feed(_read(log))  # what it logged after the last look, up to serving
            return state
        if proc.poll() is not None:
            said.feed(_read(log) + b"\n")  # its last words, a last line with no end too
            return f"exit code {proc.returncode}"
        now = clock()
        last = said.feed(_read(log))
        if not wait.observe(now, log.read_bytes):
            proc.kill()
            proc.wait()
            said.feed(_read(log) + b"\n")
            return wait.gave_up(now)
        if last and progress is not None:
            progress(now - wait.started_s, last)
        sleep(START_POLL_SECONDS)


def _read(log: LogFollower) -> bytes:
    try:
        return log.read()
    except OSError:  # the log cannot be read (a full or failing disk): no progress to show
        return b""


#: the most of an unfinished line kept until its end comes
PARTIAL_LINE_BYTES = 64 << 10


class _LineSplitter:
    """Whole lines out of the bytes a log grows by, each told to ``told`` (a line's end may
    come with a later read)."""

    def __init__(self, told: Callable[[str], None] | None) -> None:
        self.told = told
        self.partial = b""

    def feed(self, data: bytes) -> str:
        """The last whole line ``data`` ends (stripped), "" where it ends none."""
        *whole, self.partial = (self.partial + data).split(b"\n")
        self.partial = self.partial[-PARTIAL_LINE_BYTES:]  # a line with no end in sight
        texts = [line.decode(errors="replace").strip() for line in whole]
        if self.told is not None:
            for text in texts:
                self.told(text)
        return next((t for t in reversed(texts) if t), "")


def stop_agent(
    data_dir: Path, *, timeout_s: float = 30.0, force: bool = False
) -> AgentState | None:
    """SIGTERM the agent of ``data_dir`` and wait for it to exit; None if none was running.
    Raises TimeoutError if it is still running after ``timeout_s`` (unless ``force``: then
    SIGKILL, which the disk tier survives by design)."""
    stopped = stop_agent_saying(data_dir, timeout_s=timeout_s, force=force)
    return None if stopped is None else stopped[0]


#: seconds a SIGKILLed agent gets to be gone (the kernel closes its files, dropping the lock)
KILLED_WAIT_S = 10.0


def stop_agent_saying(
    data_dir: Path, *, timeout_s: float = 30.0, force: bool = False
) -> tuple[AgentState, bool] | None:
    """:func:`stop_agent`, also saying whether the agent had to be killed (SIGKILL after
    ``timeout_s`` with ``force``). Only the process that holds ``data_dir``'s lock is signalled:
    never a pid a dead agent left in ``agent.json`` that another process has since."""
    state = running_agent(data_dir)
    if state is None:
        pid = starting_agent(data_dir)
        if pid is None:
            return None
        # not recorded yet: what is known of it is its pid (SIGTERM before it serves ends it
        # at once; the disk tier survives that by design)
        state = AgentState(pid, "", "", "", None, None, 0.0, "")
    os.kill(state.pid, signal.SIGTERM)
    if _gone_within(data_dir, state.pid, timeout_s):
        return state, False
    if not force:
        if process_stopped(state.pid):  # Ctrl-Z: not hung, and SIGTERM waits for a SIGCONT
            raise TimeoutError(
                f"agent pid {state.pid} still running {timeout_s:g} s after SIGTERM: it is "
                f"stopped (SIGSTOP, or Ctrl-Z in its terminal): `kill -CONT {state.pid}` "
                "resumes it, and it acts on the SIGTERM then; or retry with --force to kill it "
                "(SIGKILL; chunks on disk stay intact)"
            )
        raise TimeoutError(
            f"agent pid {state.pid} still running {timeout_s:g} s after SIGTERM (it is still "
            "shutting down, or hung: its log is agent.log in its data dir); retry with --force "
            "to kill it (SIGKILL; chunks on disk stay intact)"
        )
    if holder_pid(data_dir, state.pid) == state.pid:  # not gone between the last look and here
        os.kill(state.pid, signal.SIGKILL)
    if not _gone_within(data_dir, state.pid, KILLED_WAIT_S):
        raise TimeoutError(
            f"agent pid {state.pid} still running {KILLED_WAIT_S:g} s after SIGKILL (stuck in "
            "the kernel: a hung disk or GPU driver?)"
        )
    return state, True


def _gone_within(data_dir: Path, pid: int, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the agent ``pid`` of ``data_dir`` to be gone: its lock
    dropped, then its process exited (it drops the lock as serve() returns, and exits after:
    atexit handlers, threads joined at exit, a GPU context's teardown). That pid held the lock
    a moment ago, so it is the agent's, not a stranger's."""
    deadline_s = time.monotonic() + timeout_s
    while holder_pid(data_dir, pid) == pid or pid_alive(pid):
        if time.monotonic() >= deadline_s:
            return False
        time.sleep(0.05)
    return True


def _bind_tcp(host: str, port: int) -> socket.socket:
    sock = http_serving.listen_tcp(
        host,
        port,
        cannot_bind=lambda exc: OSError(
            exc.errno,
            f"cannot listen on {_address_text(host, port)} for the control API: {exc.strerror}",
        ),
    )
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def _naming(address: str, what: str) -> Iterator[None]:
    """A failure to listen said with the address and what it is for, as the control API's is:
    a bare "[Errno 98] Address already in use" named neither."""
    try:
        yield
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot listen on {address} for {what}: {exc.strerror or exc}"
        ) from exc


def _hostport(host: str, port: int) -> str:
    """Where a local client reaches a bound address, as ``host:port`` (IPv6 in brackets)."""
    return f"{url_host(connect_host(host))}:{port}"


def _answers(url: str) -> bool:
    import httpx

    try:
        # 401 also proves the agent serves (the token is the caller's business)
        return httpx.get(f"{url}/v1/health", timeout=1.0).status_code in (200, 401)
    except httpx.HTTPError:
        return False
