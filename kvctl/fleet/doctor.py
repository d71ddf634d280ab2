"""`kvctl doctor`'s checks as a library: the database, each agent, NVML, disk space, clocks and
who can read an agent's data directory.

Every check becomes a :class:`Check` row (ok, warn, fail or skip) with a one-line detail and,
where something is wrong, a one-line fix. Nothing here raises for a broken fleet: a database
that will not open, an agent that is down or answers nonsense, a reading that is missing, all
become rows, because a doctor that crashes on the very fault it should diagnose is useless. The
checks only read: a SQLite database that is behind is reported, never upgraded.

The classification functions (``classify_*``) are pure so the thresholds can be tested without
GPUs, full disks or skewed clocks; :func:`run_checks` gathers the readings and calls them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvctl import __version__
from kvctl.format import finite
from kvctl.wire.address import is_loopback

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from kvctl.client import AgentClient
    from kvctl.db.inventory import NodeInfo
    from kvctl.nvml import NvmlStatus

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)
#: below this free ratio a disk fails whatever the warning threshold: writes are about to fail
DISK_FAIL_RATIO = 0.02

DB_FIX = "set KVCTL_DB_URL or --db to the fleet's database (`kvctl db current` shows which is used)"
NTP_FIX = (
    "enable NTP on {node}: `timedatectl set-ntp true` or `systemctl enable --now chronyd`, "
    "then check `chronyc tracking`"
)


@dataclass(frozen=True, slots=True)
class Check:
    """One row of the doctor's report. ``values`` carries the raw numbers for ``--json``."""

    name: str
    status: str
    detail: str
    fix: str | None = None
    values: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        # one line each: error texts from drivers and servers often carry newlines
        object.__setattr__(self, "detail", _one_line(self.detail))
        if self.fix is not None:
            object.__setattr__(self, "fix", _one_line(self.fix))
        # readings are an agent's, as it sent them: NaN or Infinity (which Python's json reads)
        # would make the --json report invalid JSON for every other parser
        object.__setattr__(self, "values", finite(self.values))

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "detail": self.detail,
            "fix": self.fix,
            "values": dict(self.values),
        }


def summarize(checks: Iterable[Check]) -> dict[str, int]:
    out = dict.fromkeys(STATUSES, 0)
    for check in checks:
        out[check.status] += 1
    return out


def exit_code(checks: Iterable[Check]) -> int:
    """1 when any check failed; warnings alone do not fail the doctor."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _is_number(value: object) -> bool:
    """A reading from JSON that can be computed with (not None, a string or a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _size(n: float) -> str:
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{int(n)} B"


# --- pure classification ----------------------------------------------------------------------


def skew_of(agent_time_s: float, sent_s: float, received_s: float) -> tuple[float, float]:
    """(skew, round trip): the agent's clock minus the midpoint of the local send and receive
    times. The agent read its clock somewhere in that window, so the round trip bounds the
    error."""
    return agent_time_s - (sent_s + received_s) / 2, received_s - sent_s


def classify_skew(
    node: str,
    skew_s: float | None,
    rtt_s: float | None,
    *,
    warn_s: float = 1.0,
    fail_s: float = 30.0,
) -> Check:
    name = f"clock {node}"
    if skew_s is None or not math.isfinite(skew_s):
        return Check(name, SKIP, "clock skew N/A: the agent does not report its clock (time_s)")
    rtt = rtt_s if rtt_s is not None and math.isfinite(rtt_s) else None
    direction = "ahead of" if skew_s >= 0 else "behind"
    uncertainty = "N/A" if rtt is None else f"{rtt:.3f} s"
    detail = f"{abs(skew_s):.3f} s {direction} this machine (± {uncertainty} round trip)"
    size = abs(skew_s)
    status = FAIL if size >= fail_s else WARN if size >= warn_s else OK
    fix = None if status == OK else NTP_FIX.format(node=node)
    return Check(name, status, detail, fix, {"skew_s": skew_s, "rtt_s": rtt})


def classify_disk(
    name: str,
    path: str | Path | None,
    free_bytes: int | None,
    total_bytes: int | None,
    *,
    warn_ratio: float = 0.10,
    fail_ratio: float = DISK_FAIL_RATIO,
    fix: str | None = None,
) -> Check:
    """``fix`` replaces the generic advice (e.g. naming the node the path is on)."""
    where = str(path) if path else "N/A"
    values: dict[str, Any] = {"path": where, "free_bytes": free_bytes, "total_bytes": total_bytes}
    free = free_bytes if _is_number(free_bytes) else None
    total = total_bytes if _is_number(total_bytes) else None
    if free is None or total is None or total <= 0:
        return Check(name, SKIP, f"free space N/A at {where}", None, values)
    ratio = free / total
    values["free_ratio"] = ratio
    detail = f"{_size(free)} free of {_size(total)} ({ratio:.1%}) at {where}"
    status = FAIL if ratio < fail_ratio else WARN if ratio < warn_ratio else OK
    if status == OK:
        return Check(name, OK, detail, None, values)
    advice = fix or f"free space under {where}: delete old files or grow the volume"
    return Check(name, status, detail, advice, values)


def disk_usage_check(name: str, path: Path, *, warn_ratio: float, fix: str | None = None) -> Check:
    """A disk check for a local path; a path not created yet is judged by the nearest existing
    directory above it (where it will be created)."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return classify_disk(name, path, None, None, warn_ratio=warn_ratio)
    return classify_disk(name, path, usage.free, usage.total, warn_ratio=warn_ratio, fix=fix)


#: group's and others' permission bits: any of them on an agent's data directory lets other
#: users list it, and read whatever in it is not 0600 (KV chunks hold prompts)
SHARED_MODE_BITS = 0o077


def classify_data_dir_mode(
    name: str, path: str | Path | None, mode: int | None, *, where: str | None = None
) -> Check:
    """An agent data directory's permission bits: a warning with the ``chmod 700`` that fixes
    it when group or others have any. ``where`` names the node the directory is on."""
    shown = str(path) if path else "N/A"
    if mode is None or not path:
        return Check(name, SKIP, f"permissions N/A for {shown}", None, {"path": shown})
    mode &= 0o7777
    values = {"path": shown, "mode": f"{mode:04o}"}
    if not mode & SHARED_MODE_BITS:
        return Check(name, OK, f"{shown} is the owner's alone (mode {mode:04o})", None, values)
    fix = f"chmod 700 {shown}" + (f" on {where}" if where else "")
    detail = (
        f"{shown} has mode {mode:04o}: group/others can list it and read any file in it that "
        "is not 0600 (the agent writes its own 0600)"
    )
    return Check(name, WARN, detail, fix, values)


def _local_mode(path: str | Path) -> int | None:
    """The permission bits of a local directory; None when it is missing or unreadable."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return stat.S_IMODE(st.st_mode) if stat.S_ISDIR(st.st_mode) else None


def _is_loopback(url: str) -> bool:
    """True when ``url`` names this machine, so its agent's paths are paths here."""
    from urllib.parse import urlsplit

    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return False
    return is_loopback(host)


def nvml_status_from_dict(raw: Mapping[str, Any]) -> NvmlStatus:
    """An agent's ``/v1/gpus`` "nvml" object as an NvmlStatus; missing fields read as N/A."""
    from kvctl.nvml import NvmlStatus

    try:
        count = int(raw.get("device_count") or 0)
    except (TypeError, ValueError):
        count = 0
    return NvmlStatus(
        available=bool(raw.get("available")),
        driver_version=raw.get("driver_version"),
        nvml_version=raw.get("nvml_version"),
        device_count=count,
        error=raw.get("error"),
        hint=raw.get("hint"),
    )


def classify_nvml(name: str, status: NvmlStatus, *, where: str = "this machine") -> Check:
    """Unavailable NVML is a warning, not a failure: CPU-only hosts are normal in a fleet."""
    values = {
        "available": status.available,
        "driver_version": status.driver_version,
        "device_count": status.device_count,
        "error": status.error,
    }
    driver = status.driver_version or "N/A"
    if status.available and status.device_count > 0:
        detail = f"{status.device_count} GPU(s), driver {driver}"
        return Check(name, OK, detail, None, values)
    if status.available:
        return Check(
            name,
            WARN,
            f"NVML works (driver {driver}) but sees no GPU",
            f"on {where}: check `nvidia-smi`; in a container, expose the GPUs (--gpus all)",
            values,
        )
    error = status.error or "not opened"
    hint = status.hint or "check that the NVIDIA driver is installed and `nvidia-smi` works"
    return Check(name, WARN, f"NVML unavailable: {error}", f"on {where}: {hint}", values)


@dataclass(frozen=True, slots=True)
class AgentProbe:
    """What one agent answered. ``failure`` is None, "unreachable", "not answering" (it took
    the connection and said nothing in time: hung or overloaded), "auth", "starting" (it
    answered that it is still opening its tiers), "overdue" (its answers did not come in full
    within the doctor's deadline) or "error" (it answered, but not like a kvctl agent); the
    later calls' errors leave their reading N/A."""

    failure: str | None = None
    error: str | None = None
    health: Mapping[str, Any] | None = None
    sent_s: float | None = None
    received_s: float | None = None
    info: Mapping[str, Any] | None = None
    info_error: str | None = None
    gpus: Mapping[str, Any] | None = None
    gpus_error: str | None = None


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _attempt(call: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any] | None, str | None]:
    try:
        return call(), None
    except Exception as exc:  # a missing reading is N/A, whatever went wrong getting it
        return None, _describe(exc)


#: health calls per agent; the clock reading with the shortest round trip is kept
CLOCK_SAMPLES = 2


def probe_agent(
    client: AgentClient, clock: Callable[[], float] = time.time, samples: int = CLOCK_SAMPLES
) -> AgentProbe:
    """Ask one agent for everything the doctor needs; never raises."""
    from kvctl.client import AgentNotAnswering, AgentStarting, AgentUnreachable, AuthError

    sent_s = clock()
    try:
        health = dict(client.health())
    except AuthError as exc:
        return AgentProbe(failure="auth", error=_describe(exc))
    except AgentStarting as exc:  # up, not serving yet: neither down nor "not an agent"
        return AgentProbe(failure="starting", error=_describe(exc))
    except AgentUnreachable as exc:
        # one that took the connection and said nothing runs: starting another is not the fix
        failure = "not answering" if isinstance(exc, AgentNotAnswering) else "unreachable"
        return AgentProbe(failure=failure, error=_describe(exc))
    except Exception as exc:  # e.g. a web server that is not an agent: a 404 or an HTML page
        return AgentProbe(failure="error", error=_describe(exc))
    received_s = clock()
    # NTP's trick: the agent read its clock somewhere inside each window, so the shortest
    # round trip gives the tightest bound (the first includes the TCP handshake, later ones
    # can wait on delayed ACKs: neither is reliably the shorter)
    for _ in range(samples - 1):
        t0 = clock()
        again, _error = _attempt(client.health)
        t1 = clock()
        if again is not None and t1 - t0 < received_s - sent_s:
            health, sent_s, received_s = again, t0, t1
    info, info_error = _attempt(client.info)
    gpus, gpus_error = _attempt(client.gpus)
    return AgentProbe(None, None, health, sent_s, received_s, info, info_error, gpus, gpus_error)


def _as_float(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def classify_agent(
    node: NodeInfo,
    probe: AgentProbe,
    *,
    local_version: str = __version__,
    skew_warn_s: float = 1.0,
    skew_fail_s: float = 30.0,
    disk_warn_ratio: float = 0.10,
) -> list[Check]:
    """The agent, clock, NVML and disk rows of one node. A node whose agent did not answer gets
    only its agent row: the others could not be measured and would repeat the same cause."""
    name, url = node.name, node.agent_url
    row = f"agent {name}"
    if probe.failure == "auth":
        return [
            Check(
                row,
                FAIL,
                # the client's error names the URL and says the agent is up but refused
                probe.error or f"{url} is up but refused the token",
                f"set KVCTL_TOKEN to the token of {name}'s agent (its KVCTL_TOKEN, or token in "
                "[agent] of its agent.toml)",
            )
        ]
    if probe.failure == "starting":  # not healthy yet: a failure, though time is the fix
        return [
            Check(
                row,
                FAIL,
                # the client's error says it is starting and names the URL
                probe.error or f"{url} is starting: it is opening its tiers",
                f"{name}'s agent is opening its tiers (a large disk tier's scan can take "
                "minutes): run `kvctl doctor` again shortly; its log (agent.log in its data dir "
                f"on {name}) shows the progress",
            )
        ]
    if probe.failure == "unreachable":
        return [
            Check(
                row,
                FAIL,
                f"unreachable: {probe.error}",
                f"start the agent on {name} (`kvctl agent start`), or check its URL with "
                "`kvctl fleet ls`",
            )
        ]
    if probe.failure == "not answering":
        return [
            Check(
                row,
                FAIL,
                f"not answering: {probe.error}",
                f"{name}'s agent runs but did not answer within --timeout: hung or overloaded; "
                f"check its load and its log (agent.log in its data dir) on {name}, and restart "
                "it (`kvctl agent stop`, then `kvctl agent start`) only if it stays so",
            )
        ]
    if probe.failure == "overdue":  # each read came in time, the whole answer did not
        return [
            Check(
                row,
                FAIL,
                probe.error or f"{url} did not answer in full in time",
                f"{name}'s agent is hung or overloaded, or its answers trickle (a slow link?): "
                f"check its load and `kvctl agent status` on {name}",
            )
        ]
    if probe.failure is not None or probe.health is None:
        return [
            Check(
                row,
                FAIL,
                f"{url} did not answer like a kvctl agent: {probe.error or 'no health reading'}",
                f"check {name}'s URL with `kvctl fleet ls`: it must be the agent's control URL "
                "(e.g. http://HOST:7070)",
            )
        ]

    health, info = probe.health, probe.info or {}
    version = info.get("version")
    reported = health.get("name")
    problems: list[str] = []
    fixes: list[str] = []
    if version is None:
        problems.append(f"version N/A ({probe.info_error or 'not reported'})")
    elif version != local_version:
        problems.append(f"version {version} differs from kvctl {local_version} here")
        fixes.append(f"run the same kvctl version on {name} and here")
    if reported is not None and reported != name:
        problems.append(f"it calls itself {reported!r}")
        fixes.append(
            f"check {name}'s URL with `kvctl fleet ls`, or restart its agent with --name {name}"
        )
    role = info.get("role")
    role = role if isinstance(role, str) else None
    detail = f"up at {url}, version {version or 'N/A'}"
    if role == "pool":
        detail += ", a pool agent (it answers other agents' pulls, not requests)"
    if problems:
        detail += "; " + "; ".join(problems)
    values = {"url": url, "version": version, "name": reported, "role": role}
    # a version we cannot read is N/A, not a fault; a differing one or a wrong name is
    status = WARN if fixes else OK
    checks = [Check(row, status, detail, "; ".join(fixes) or None, values)]

    agent_time = _as_float(health.get("time_s"))
    if agent_time is None or probe.sent_s is None or probe.received_s is None:
        checks.append(classify_skew(name, None, None))
    else:
        skew, rtt = skew_of(agent_time, probe.sent_s, probe.received_s)
        checks.append(classify_skew(name, skew, rtt, warn_s=skew_warn_s, fail_s=skew_fail_s))

    nvml = (probe.gpus or {}).get("nvml")
    if isinstance(nvml, Mapping):
        checks.append(classify_nvml(f"nvml {name}", nvml_status_from_dict(nvml), where=name))
    else:
        why = probe.gpus_error or "the agent does not report NVML"
        checks.append(Check(f"nvml {name}", SKIP, f"NVML status N/A: {why}"))

    data_dir = info.get("data_dir")
    if isinstance(data_dir, Mapping):
        path = data_dir.get("path")
        disk = classify_disk(
            f"disk {name}",
            path,
            data_dir.get("free_bytes"),
            data_dir.get("total_bytes"),
            warn_ratio=disk_warn_ratio,
            fix=f"free space under {path or 'the data dir'} on {name}: delete other files, "
            f"grow the volume, or shrink its disk tier (`kvctl resize --node {name} --tier "
            "disk --size SIZE`)",
        )
        checks.append(_tier_filled_volume(disk, info.get("tiers"), name))
    else:
        why = probe.info_error or "the agent does not report its data dir"
        checks.append(Check(f"disk {name}", SKIP, f"free space N/A: {why}"))
    mode_row = _agent_data_dir_mode(name, url, data_dir)
    if mode_row is not None:
        checks.append(mode_row)
    dataplane = info.get("dataplane")
    if isinstance(dataplane, Mapping) and dataplane.get("shm"):
        checks.append(classify_huge_pages(f"huge pages {name}", dataplane, where=name))
    if isinstance(dataplane, Mapping):
        checks.append(classify_features(f"features {name}", dataplane, where=name))
    return checks


def classify_features(name: str, dataplane: Mapping[str, Any], *, where: str) -> Check:
    """Whether an agent's data plane has every capability this kvctl's agents have. Builds
    with and without one report the same package version, so in a rolling upgrade the version
    row cannot tell an old agent: its reported features can. Features this kvctl does not
    know (a newer agent's) are not asked about."""
    from kvctl.wire.protocol import DATA_PLANE_FEATURES, FEATURE_NAMES

    features = dataplane.get("features")
    fix = (
        f"upgrade kvctl on {where} to this one's build and restart its agent (`kvctl agent "
        "stop`, then `kvctl agent start`)"
    )
    if not isinstance(features, Mapping):
        return Check(
            name,
            WARN,
            "the agent does not report its data-plane features: it predates this kvctl's "
            f"agents, whatever its version says ({', '.join(FEATURE_NAMES.values())} may be "
            "missing: unverified pulls and puts, engine re-reads counted twice)",
            fix,
        )
    lacking = [FEATURE_NAMES[k] for k, v in DATA_PLANE_FEATURES.items() if features.get(k) != v]
    if lacking:
        return Check(name, WARN, f"the data plane lacks {', '.join(lacking)}", fix)
    return Check(name, OK, "the data plane has every feature this kvctl knows")


def _tier_filled_volume(check: Check, tiers: Any, node: str) -> Check:
    """A data dir's volume short of free space because the agent's own disk tier (which lies
    in it) has filled its share, with room left for what it may still store: a warning, not a
    failure. Only where free space is under what the tier may still grow by (or on a volume a
    full tier leaves nearly no room on) does the failure stand, saying so."""
    free = check.values.get("free_bytes")
    if check.status != FAIL or not _is_number(free):
        return check
    disk = next(
        (t for t in tiers or () if isinstance(t, Mapping) and t.get("name") == "disk"), None
    )
    capacity, used = (disk or {}).get("capacity_bytes"), (disk or {}).get("used_bytes")
    if not (_is_number(capacity) and _is_number(used)):
        return check
    room = max(0, int(capacity) - int(used))
    if free < room + DISK_TIER_SPARE_BYTES:
        detail = (
            f"{check.detail}: its disk tier may still grow by {_size(room)} "
            f"(capacity {_size(capacity)}, {_size(used)} used), more than is free"
        )
        return dataclasses.replace(check, detail=detail)
    detail = (
        f"{check.detail}, most of it held by its disk tier ({_size(used)} of "
        f"{_size(capacity)}), which has the room it needs"
    )
    fix = (
        f"nothing, if the disk tier on {node} is meant to fill its volume; else shrink it "
        f"(`kvctl resize --node {node} --tier disk --size SIZE`)"
    )
    return dataclasses.replace(check, status=WARN, detail=detail, fix=fix)


#: free space a volume must keep beyond its disk tier's room: the agent's own files (agent.json,
#: its log across rollovers: 4 x 64 MiB)
DISK_TIER_SPARE_BYTES = 320 << 20


def classify_huge_pages(name: str, dataplane: Mapping[str, Any], *, where: str) -> Check:
    """Whether an agent's shared arena lies on huge pages: engines copy out of 4 KiB pages
    4-25% more slowly (copies of 4-64 MiB on a 2-core VM), a cost on every fetch."""
    from kvctl.store.tiers.hugepages import HUGE_MODES, SHMEM_SETTING

    huge, mode = dataplane.get("shm_huge_page_bytes"), dataplane.get("shmem_huge_pages")
    values = {"shm_huge_page_bytes": huge, "shmem_huge_pages": mode}
    if not _is_number(huge):
        return Check(name, SKIP, "shared arena page size N/A: the agent does not report it")
    if huge > 0:
        return Check(name, OK, f"shared arena: {_size(huge)} on huge pages", None, values)
    detail = f"shared arena on 4 KiB pages (shmem_enabled {mode or 'N/A'}): engines copy out of it "
    detail += "more slowly than out of huge pages"
    if mode in HUGE_MODES:  # allowed now, but the arena was made before (or memory was short)
        fix = f"restart the agent on {where}: its arena then commits on huge pages"
    else:
        fix = (
            f"on {where}, as root: `echo advise > {SHMEM_SETTING}`, then restart the agent "
            "(the setting does not survive a reboot: set it at boot too)"
        )
    return Check(name, WARN, detail, fix, values)


def _agent_data_dir_mode(name: str, url: str, data_dir: object) -> Check | None:
    """The data dir's permissions of an agent that reports them (``mode`` in its info) or runs
    on this machine (a loopback URL: the directory is read here); None when neither."""
    if not isinstance(data_dir, Mapping):
        return None
    path = data_dir.get("path")
    if not isinstance(path, str) or not path:
        return None
    mode = data_dir.get("mode")
    if isinstance(mode, int) and not isinstance(mode, bool):
        return classify_data_dir_mode(f"data dir {name}", path, mode, where=name)
    if _is_loopback(url):
        local = _local_mode(path)
        if local is not None:
            return classify_data_dir_mode(f"data dir {name}", path, local, where=name)
    return None


# --- gathering --------------------------------------------------------------------------------


def check_local_nvml(reader_factory: Callable[[], Any] | None = None) -> Check:
    """NVML on this machine. ``reader_factory`` makes an object with ``open() -> NvmlStatus``
    and ``close()`` (the real NvmlReader by default)."""
    from kvctl.nvml import NvmlStatus

    if reader_factory is None:
        from kvctl.nvml import NvmlReader

        reader_factory = NvmlReader
    try:
        reader = reader_factory()
        try:
            status = reader.open()
        finally:
            reader.close()
    except Exception as exc:  # NvmlReader never raises; a broken stand-in must not crash us
        status = NvmlStatus(False, None, None, 0, _describe(exc), None)
    return classify_nvml("nvml (local)", status)


def check_local_agent_config(warn_ratio: float = 0.10) -> list[Check]:
    """When this machine has an agent config file (or KVCTL_CONFIG names one): whether it loads,
    and the free space where its data dir is. Nothing when there is no file."""
    from kvctl.agent.config import CONFIG_ENV, ConfigError, default_config_path, load_settings

    path = default_config_path()
    if not (os.environ.get(CONFIG_ENV, "").strip() or path.exists()):
        return []
    try:
        loaded = load_settings()
    except ConfigError as exc:
        where = (exc.source or f"file:{path}").removeprefix("file:").replace("env:", "$")
        fix = f"correct {exc.setting or 'the setting'} in {where} (the detail gives an example)"
        return [Check("config (local agent)", FAIL, str(exc), fix)]
    except Exception as exc:
        return [Check("config (local agent)", FAIL, f"{path}: {_describe(exc)}", f"fix {path}")]
    data_path = loaded.settings.data_path
    return [
        Check("config (local agent)", OK, f"{loaded.config_file or path} loads"),
        disk_usage_check(
            "disk (local agent)",
            data_path,
            warn_ratio=warn_ratio,
            fix=f"free space under {data_path}: delete other files, grow the volume, or set a "
            "smaller disk tier (disk in [agent])",
        ),
    ]


def check_local_data_dir() -> list[Check]:
    """The permissions of this machine's agent data directory (from its config file, or the
    default one), when it exists; nothing when it does not (the agent creates it 0700) or the
    settings do not load (``check_local_agent_config`` reports that)."""
    from kvctl.agent.config import load_settings

    try:
        path = load_settings().settings.data_path
    except Exception:  # a broken config is check_local_agent_config's row, never a crash
        return []
    mode = _local_mode(path)
    if mode is None:
        return []
    return [classify_data_dir_mode("data dir (local agent)", path, mode)]


def _skip_agents(reason: str) -> Check:
    return Check("agents", SKIP, f"agents not checked: {reason}")


def _with_connect_timeout(url: str, timeout_s: float) -> str:
    """A PostgreSQL URL that gives up connecting after about ``timeout_s`` (an unroutable host
    would otherwise hang the doctor for minutes)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql" or "connect_timeout" in parsed.query:
        return url
    seconds = str(max(1, math.ceil(timeout_s)))
    return parsed.update_query_dict({"connect_timeout": seconds}).render_as_string(
        hide_password=False
    )


def database_checks(
    db_url: str | None,
    *,
    nodes: Sequence[str] = (),
    dcs: Sequence[str] = (),
    timeout_s: float = 3.0,
    disk_warn_ratio: float = 0.10,
) -> tuple[list[Check], list[NodeInfo] | Check]:
    """The database's rows, and either the nodes whose agents to check or the one "agents" row
    that says why they cannot be (no database, no schema, no nodes, an unknown --node...)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    from kvctl.db.engine import DatabaseError, display_url, resolve_url

    try:
        url = resolve_url(db_url)
    except DatabaseError as exc:
        return [Check("database", FAIL, str(exc), DB_FIX)], _skip_agents("no usable database")
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    shown = display_url(url)
    local_disk: list[Check] = []
    if backend == "sqlite" and parsed.database and parsed.database != ":memory:":
        path = Path(parsed.database).expanduser()
        local_disk.append(
            disk_usage_check("disk (local db)", path.parent, warn_ratio=disk_warn_ratio)
        )
        if not path.exists():
            # connecting would create an empty file; the doctor only looks. The default file
            # missing is a machine not set up yet; one named (--db, KVCTL_DB_URL) is more
            # likely mistyped, and a health check passing then would have checked nothing
            named = bool(db_url or os.environ.get("KVCTL_DB_URL"))
            create = "`kvctl fleet add-dc NAME` (the first DC) or `kvctl fleet import FILE`"
            if named:
                missing = Check(
                    "database",
                    FAIL,
                    f"no database at {path}",
                    f"{DB_FIX}; a new fleet's database is created by {create}",
                )
            else:
                missing = Check(
                    "database",
                    WARN,
                    f"no database yet at {path}",
                    f"create it: {create}, or {DB_FIX}",
                )
            return [missing, *local_disk], _skip_agents("no database, so no inventory")
    try:
        checks, targets = _open_and_inspect(
            _with_connect_timeout(url, timeout_s), shown, backend, nodes, dcs
        )
    except (DatabaseError, SQLAlchemyError, OSError) as exc:
        reason = getattr(exc, "orig", None) or exc
        if backend == "postgresql":
            host, port = parsed.host or "localhost", parsed.port or 5432
            fix = (
                f"start PostgreSQL at {host}:{port} and check it accepts this user "
                f"(`pg_isready -h {host} -p {port}`), or {DB_FIX}"
            )
        else:
            fix = f"check that {parsed.database} is a readable SQLite file, or {DB_FIX}"
        checks = [Check("database", FAIL, f"cannot use {shown}: {_describe(reason)}", fix)]
        targets = _skip_agents("the database is unusable")
    return [*checks, *local_disk], targets


def _open_and_inspect(
    url: str, shown: str, backend: str, nodes: Sequence[str], dcs: Sequence[str]
) -> tuple[list[Check], list[NodeInfo] | Check]:
    from kvctl.db.engine import create_db_engine

    engine = create_db_engine(url)
    try:
        return _inspect(engine, shown, backend, nodes, dcs)
    finally:
        engine.dispose()


def _schema_check(current: str | None, backend: str) -> Check:
    from kvctl.db import migrate

    head = migrate.head_revision()
    values = {"current": current, "head": head}
    where = f"at {current}" if current else "empty"
    if current == head:
        return Check("database schema", OK, f"at head ({head})", None, values)
    if current is not None and current not in migrate.revisions():
        return Check(
            "database schema",
            FAIL,
            f"at {current}, which kvctl {__version__} does not know (a newer kvctl migrated it)",
            "upgrade kvctl on this machine to the version the fleet runs",
            values,
        )
    if backend == "sqlite":
        return Check(
            "database schema",
            WARN,
            f"{where}, kvctl needs {head}; SQLite upgrades itself on first use",
            "`kvctl db upgrade` (or run any kvctl command that opens the database)",
            values,
        )
    # shared PostgreSQL is never migrated behind its users' backs: commands refuse it until then
    return Check(
        "database schema",
        FAIL,
        f"{where}, kvctl needs {head}; PostgreSQL is only migrated by hand",
        "`kvctl db upgrade` (with the same --db / KVCTL_DB_URL)",
        values,
    )


def _inspect(
    engine: Engine, shown: str, backend: str, nodes: Sequence[str], dcs: Sequence[str]
) -> tuple[list[Check], list[NodeInfo] | Check]:
    from sqlalchemy import func, select
    from sqlalchemy.exc import SQLAlchemyError

    from kvctl.db import migrate
    from kvctl.db.engine import SchemaNotKnown
    from kvctl.db.inventory import InventoryError, list_nodes
    from kvctl.db.models import DataCenter, Node
    from kvctl.fleet.targets import resolve_targets

    try:
        current = migrate.current_revision(engine)  # the first connection: errors mean unusable
        schema = _schema_check(current, backend)
    except SchemaNotKnown as several:  # it answers: its schema is what this kvctl does not know
        current = "several"
        values = {"current": None, "head": migrate.head_revision()}
        schema = Check("database schema", FAIL, str(several), several.hint, values)
    checks = [Check("database", OK, f"{backend} at {shown}", None, {"url": shown}), schema]
    if current is None:
        return checks, _skip_agents("the database has no schema yet, so no inventory")

    # the inventory tables date from the first revision, so a database behind head still
    # lists its nodes
    try:
        with engine.connect() as conn:
            n_dcs = conn.execute(select(func.count()).select_from(DataCenter)).scalar_one()
            n_nodes = conn.execute(select(func.count()).select_from(Node)).scalar_one()
            targets: list[NodeInfo] = []
            if n_nodes and (nodes or dcs):
                targets = resolve_targets(conn, nodes=nodes, dcs=dcs)
            elif n_nodes:
                targets = list_nodes(conn)
    except InventoryError as exc:
        fix = "`kvctl fleet ls` lists the fleet's DCs and nodes"
        return checks, Check("agents", FAIL, str(exc), fix)
    except SQLAlchemyError as exc:
        reason = _describe(getattr(exc, "orig", None) or exc)
        return checks, _skip_agents(f"cannot read the inventory: {reason}")

    counts = {"dcs": n_dcs, "nodes": n_nodes}
    if not n_nodes:
        checks.append(
            Check(
                "fleet inventory",
                WARN,
                f"{n_dcs} DC(s), no nodes",
                "add nodes with `kvctl fleet add-node ...` or `kvctl fleet import FILE`",
                counts,
            )
        )
        return checks, _skip_agents("no nodes in the inventory")
    checks.append(Check("fleet inventory", OK, f"{n_dcs} DC(s), {n_nodes} node(s)", None, counts))
    return checks, targets


def _valid_url(url: str) -> bool:
    import httpx

    try:
        parsed = httpx.URL(url)
    except Exception:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.host)


def agent_checks(
    nodes: Sequence[NodeInfo],
    *,
    token: str | None = None,
    timeout_s: float = 3.0,
    clock: Callable[[], float] = time.time,
    local_version: str = __version__,
    skew_warn_s: float = 1.0,
    skew_fail_s: float = 30.0,
    disk_warn_ratio: float = 0.10,
) -> list[Check]:
    """Every node's agent, asked concurrently; rows in the order of ``nodes``."""
    from kvctl.fleet.fanout import fan_out, read_deadline_s

    probes: dict[int, AgentProbe] = {}
    askable: list[NodeInfo] = []
    for n in nodes:
        if _valid_url(n.agent_url):
            askable.append(n)
        else:
            # AgentClient would raise outside fan_out's net on a URL httpx cannot parse
            probes[n.id] = AgentProbe(failure="error", error=f"not an http(s) URL: {n.agent_url}")
    try:
        results = fan_out(
            askable,
            lambda c: probe_agent(c, clock),
            token=token,
            timeout_s=timeout_s,
            # each of a probe's calls bounded as one read: an agent whose answers trickle
            # (each read within timeout_s) held the whole doctor for as long as they did
            deadline_s=(CLOCK_SAMPLES + 2) * read_deadline_s(timeout_s),
        )
    except Exception as exc:  # fan_out lets unexpected errors through; report, never crash
        results = []
        for n in askable:
            probes[n.id] = AgentProbe(failure="error", error=f"could not ask: {_describe(exc)}")
    for res in results:
        if res.ok and res.value is not None:
            probes[res.node.id] = res.value
        else:  # fan_out caught it (e.g. the client could not be made), or cut it off
            failure = "overdue" if res.overdue else "error"
            probes[res.node.id] = AgentProbe(failure=failure, error=res.error)

    checks: list[Check] = []
    for n in nodes:
        checks.extend(
            classify_agent(
                n,
                probes[n.id],
                local_version=local_version,
                skew_warn_s=skew_warn_s,
                skew_fail_s=skew_fail_s,
                disk_warn_ratio=disk_warn_ratio,
            )
        )
    return checks


def run_checks(
    db_url: str | None = None,
    *,
    nodes: Sequence[str] = (),
    dcs: Sequence[str] = (),
    token: str | None = None,
    timeout_s: float = 3.0,
    skew_warn_s: float = 1.0,
    skew_fail_s: float = 30.0,
    disk_warn_ratio: float = 0.10,
    nvml_reader_factory: Callable[[], Any] | None = None,
    clock: Callable[[], float] = time.time,
    local_version: str = __version__,
    local_config: bool = True,
) -> list[Check]:
    """Every check, in report order: database, this machine, then each agent (all nodes, or
    those named by ``nodes``/``dcs``). ``token`` defaults to KVCTL_TOKEN; ``local_config``
    False leaves out this machine's agent config file."""
    checks, targets = database_checks(
        db_url, nodes=nodes, dcs=dcs, timeout_s=timeout_s, disk_warn_ratio=disk_warn_ratio
    )
    checks.append(check_local_nvml(nvml_reader_factory))
    if local_config:
        checks.extend(check_local_agent_config(disk_warn_ratio))
        checks.extend(check_local_data_dir())
    if isinstance(targets, Check):
        checks.append(targets)
        return checks
    agents = agent_checks(
        targets,
        token=token,
        timeout_s=timeout_s,
        clock=clock,
        local_version=local_version,
        skew_warn_s=skew_warn_s,
        skew_fail_s=skew_fail_s,
        disk_warn_ratio=disk_warn_ratio,
    )
    roles = {n.name: _role(agents, n.name) for n in targets}
    return [_with_serving(c, roles) for c in checks] + agents


def _role(agents: Sequence[Check], node: str) -> str | None:
    """The role (``node`` or ``pool``) ``node``'s agent reported; None when it did not answer
    or did not say."""
    row = next((c for c in agents if c.name == f"agent {node}"), None)
    return None if row is None else row.values.get("role")


def _with_serving(check: Check, roles: Mapping[str, str | None]) -> Check:
    """The "fleet inventory" row, saying how many of its nodes serve requests when an agent
    asked is a pool agent: it runs no engine, yet replay sends requests to every node of the
    inventory (a router routes none to it: its followers read each agent's role). ``roles``:
    each node asked, and the role its agent reported. A node not asked, or whose agent did not
    say, may be one too: then "at most"."""
    pools = sorted(name for name, role in roles.items() if role == "pool")
    n_nodes = check.values.get("nodes")
    if check.name != "fleet inventory" or not pools or not isinstance(n_nodes, int):
        return check
    from kvctl.format import count_of

    known = len(roles) == n_nodes and all(role is not None for role in roles.values())
    serving = n_nodes - len(pools)
    detail = (
        f"{check.detail}, {'' if known else 'at most '}{serving} serving requests: "
        f"{count_of(len(pools), 'pool agent')} ({', '.join(pools)}) answer other agents' pulls"
    )
    fix = (
        "`kvctl replay` sends requests to every node of the inventory (a router routes none "
        "to a pool agent): keep a pool agent out of it (nodes reach it as their pool, e.g. "
        f"`kvctl agent start --pool kvctl://HOST:PORT`): `kvctl fleet rm node {pools[0]}`"
        + (" (and the others)" if len(pools) > 1 else "")
    )
    values = {
        **check.values,
        "serving": serving if known else None,
        "serving_at_most": serving,
        "pool_agents": pools,
    }
    return Check(check.name, WARN, detail, fix, values)


__all__ = [
    "FAIL",
    "OK",
    "SKIP",
    "STATUSES",
    "WARN",
    "AgentProbe",
    "Check",
    "agent_checks",
    "check_local_data_dir",
    "check_local_nvml",
    "classify_agent",
    "classify_data_dir_mode",
    "classify_disk",
    "classify_features",
    "classify_huge_pages",
    "classify_nvml",
    "classify_skew",
    "database_checks",
    "exit_code",
    "probe_agent",
    "run_checks",
    "skew_of",
    "summarize",
]
