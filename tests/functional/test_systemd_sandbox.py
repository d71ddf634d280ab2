"""The agent's systemd sandbox against what a real agent does. There is no systemd to run the
unit here, so the agent runs under strace through start-up, puts and gets over TCP, the Unix
socket and shared memory (spilling to the disk tier), the control API and a SIGTERM drain. Then
every system call it made must be one the unit's SystemCallFilter= allows (its groups as this
machine's systemd-analyze expands them), every socket of a family RestrictAddressFamilies=
allows, no mapping writable and executable or made executable later (MemoryDenyWriteExecute=),
and every file it wrote in its data directory (ProtectSystem=strict). Needs strace and
systemd-analyze: skipped without them outside CI."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvctl.agent.daemon import AgentState
from kvctl.agent.systemd import render_unit
from kvctl.client import AgentClient, AgentError, ChunkNotFound, DataClient
from tests.functional.agents import key, payload
from tests.tools import required_tool
from tests.unit.test_systemd_unit import one, systemd_analyze, unit_settings

TOKEN = "sandbox-" + "c" * 40
MiB = 1 << 20
#: system calls whose arguments name a file they create, change or remove
_WRITES = re.compile(
    r"^\d+\s+(?:open|openat|creat|mkdir|mkdirat|unlink|unlinkat|rename|renameat2?|truncate)\("
    r'(?:AT_FDCWD, )?"([^"]*)"(.*)$'
)


def syscall_groups(analyze: str) -> dict[str, set[str]]:
    """systemd's @groups, each with its members (system calls and nested @groups)."""
    listing = subprocess.run(
        [analyze, "syscall-filter", "--no-pager"], capture_output=True, text=True, check=True
    ).stdout
    groups: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in listing.splitlines():
        if line.startswith("@"):
            current = groups.setdefault(line.split()[0], set())
        elif current is not None and line.strip() and not line.strip().startswith("#"):
            current.add(line.split()[0])
    return groups


def expand(groups: dict[str, set[str]], item: str) -> set[str]:
    if not item.startswith("@"):
        return {item}
    return set().union(*(expand(groups, member) for member in groups[item]))


def allowed_syscalls(filters: list[str], groups: dict[str, set[str]]) -> set[str]:
    """What SystemCallFilter= lines allow: the allow-list minus every ~deny entry."""
    allowed: set[str] = set()
    denied: set[str] = set()
    for line in filters:
        for item in line.split():
            if item.startswith("~"):
                denied |= expand(groups, item[1:])
            else:
                allowed |= expand(groups, item)
    return allowed - denied


@dataclass
class Trace:
    syscalls: set[str] = field(default_factory=set)
    families: set[str] = field(default_factory=set)
    write_exec: list[str] = field(default_factory=list)
    written: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, path: Path) -> Trace:
        trace = cls()
        for line in path.read_text(errors="replace").splitlines():
            call = re.match(r"^\d+\s+(?:<\.\.\. )?(\w+)(?:\(| resumed>)", line)
            if call is None:
                continue  # signals, exits
            name = call.group(1)
            trace.syscalls.add(name)
            # a call another thread interrupted is two lines: "socket(AF_UNIX, ... <unfinished
            # ...>" carries the arguments, "<... socket resumed>) = 5" only the result
            if name in ("socket", "socketpair") and not call.group(0).endswith("resumed>"):
                trace.families.add(line.split("(", 1)[1].split(",", 1)[0])
            if name == "mmap" and "PROT_EXEC" in line and "PROT_WRITE" in line:
                trace.write_exec.append(line)
            if name in ("mprotect", "pkey_mprotect") and "PROT_EXEC" in line:
                trace.write_exec.append(line)
            written = _WRITES.match(line)
            if written is not None:
                path_arg, rest = written.groups()
                opens = name in ("open", "openat")
                if not opens or re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC", rest):
                    trace.written.add(path_arg)
        return trace


def _wait_serving(data_dir: Path, proc: subprocess.Popen[bytes]) -> AgentState:
    deadline = time.monotonic() + 120  # strace slows the start-up's imports several times
    while time.monotonic() < deadline:
        assert proc.poll() is None, (data_dir / "agent.log").read_text()
        state = AgentState.read(data_dir)
        if state is not None:
            with contextlib.suppress(AgentError), AgentClient(state.control_url, token=TOKEN) as c:
                c.health()
                return state
        time.sleep(0.2)
    raise AssertionError("the traced agent did not serve:\n" + (data_dir / "agent.log").read_text())


@contextlib.contextmanager
def traced_agent(strace: str, data_dir: Path, trace: Path) -> Iterator[AgentState]:
    data_dir.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
    env |= {"XDG_CONFIG_HOME": str(data_dir / "xdg"), "KVCTL_TOKEN": TOKEN}
    argv = [sys.executable, "-m", "kvctl", "agent", "start", "--data-dir", str(data_dir)]
    argv += ["--listen", "127.0.0.1:0", "--data-listen", "127.0.0.1:0"]
    argv += ["--cpu", "8MiB", "--disk", "64MiB"]
    with (data_dir / "agent.log").open("wb") as log:
        proc = subprocess.Popen(
            [strace, "-f", "-qq", "-o", str(trace), *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    state: AgentState | None = None
    try:
        state = _wait_serving(data_dir, proc)
        yield state
        os.kill(state.pid, signal.SIGTERM)  # the agent, not strace: it drains and exits
        assert proc.wait(120) == 0, (data_dir / "agent.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            if state is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(state.pid, signal.SIGKILL)
            proc.kill()
            proc.wait(30)


def _drive(state: AgentState) -> None:
    """What engines and operators do to an agent, on every transport."""
    transports = [("tcp", state.data_tcp, False), ("unix", state.data_unix, False)]
    transports.append(("shm", state.data_unix, True))
    for space, (_, address, shm) in enumerate(transports):
        assert address is not None
        keys = [key(i, space) for i in range(16)]  # 16 MiB each: more than the cpu tier holds
        with DataClient.connect(address, token=TOKEN, use_shm=shm) as client:
            assert client.shm is shm
            for k in keys:
                client.put(k, payload(k, MiB))
            for k in keys:
                with contextlib.suppress(ChunkNotFound):
                    assert bytes(client.get(k)) == payload(k, MiB)
            client.lookup(keys)
    with AgentClient(state.control_url, token=TOKEN) as control:
        control.info()
        control.stats()
        assert "kvctl_" in control.metrics_text()
        control.remote()
        control.gpus()
        control.resize("cpu", "16MiB")
        control.flush("cpu", demote=True)


def test_the_unit_sandbox_admits_what_the_agent_does(tmp_path: Path) -> None:
    strace = required_tool("strace", "apt-get install strace")
    analyze = systemd_analyze()
    unit = unit_settings(render_unit(Path("/opt/kvctl/bin/kvctl"), Path("/etc/kvctl/agent.toml")))
    allowed = allowed_syscalls(unit["SystemCallFilter"], syscall_groups(analyze))
    assert {"read", "mmap", "memfd_create"} <= allowed and "mount" not in allowed  # parsed

    data_dir, trace_file = tmp_path / "agent", tmp_path / "agent.strace"
    with traced_agent(strace, data_dir, trace_file) as state:
        _drive(state)
    trace = Trace.read(trace_file)

    assert {"memfd_create", "sendmsg", "accept4"} <= trace.syscalls  # the trace saw the work
    assert trace.syscalls <= allowed, (
        f"outside SystemCallFilter=: {sorted(trace.syscalls - allowed)}"
    )
    families = set(one(unit, "RestrictAddressFamilies").split())
    assert trace.families and trace.families <= families, trace.families
    assert one(unit, "MemoryDenyWriteExecute") == "yes"
    assert not trace.write_exec, trace.write_exec[:5]
    assert any(p.endswith(".kv") for p in trace.written)  # chunks reached the disk tier
    # .pyc caches are the interpreter's: under ProtectSystem=strict it skips them
    outside = sorted(
        p
        for p in trace.written
        if not Path(p).is_relative_to(data_dir) and "/__pycache__/" not in p
    )
    assert not outside, outside
