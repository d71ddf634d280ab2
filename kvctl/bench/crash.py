"""The crash-consistency benchmark: kill -9 a real agent under write load, restart it on the same
data directory, and check what its disk tier kept.

What the disk tier promises (kvctl/store/tiers/disk.py): a chunk is written to a temp file in
its fan-out directory and renamed into place, so a process killed at any instant leaves either
no chunk or the whole one; the open after a crash drops leftover temp files and any file whose
header or length is wrong, and every read checks the payload's checksum, so a damaged chunk is a
miss, never wrong bytes. A demotion to disk is made by the put that made room for it, which
waits for its file (written without the store's lock): once that put is answered, or the
chunk's ``demote`` event emitted, the demoted chunk's file is renamed into place.
The cpu tier is DRAM: what was only there is gone after a kill, by design. ``fsync`` (on by
default) only matters for power loss or a kernel crash, which a kill -9 is not: the page cache
survives the process, so this benchmark measures crash consistency, not power-loss durability.

Each trial:

1. starts an agent on an empty data directory (its start time is the reference for the
   restart), with a small cpu tier over a disk tier large enough that nothing is evicted from
   disk, and every demotion admitted (``disk_admission = all``);
2. runs WRITERS client threads, each putting fresh chunks of deterministic bytes (seeded by the
   key) over TCP and recording each put before sending it and when it is acknowledged (with the
   tier the agent answered), while a follower polls the agent's events and records each chunk
   demoted to disk;
3. kill -9s the agent at a random instant of the load (seeded);
4. audits the data directory as the killed agent left it, without changing it: whole chunk
   files (payloads checksummed), leftover temp files, files an open would drop;
5. restarts the agent on the same directory (timed to its first health answer) and reads back
   every chunk any writer sent, comparing every byte.

Counted per trial and in total: corrupt reads (bytes served that differ from what was put: must
be 0), acknowledged chunks known to be on disk before the kill (put answered "disk", or a demote
event seen) that the restarted agent does not serve (must be 0), whole chunk files found after
the kill that it does not serve (must be 0), acknowledged chunks last seen in the cpu tier that
are gone (expected: DRAM) or that it serves (demoted after the follower's last poll), puts in
flight at the kill that it serves, temp files and damaged files found and whether the restart
dropped them, and the restart time next to the fresh start.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvctl.bench.common import host_info, spawned_agent_process
from kvctl.errors import InvalidArgument

if TYPE_CHECKING:
    from kvctl.agent.daemon import AgentState

DEFAULT_TRIALS = 20
DEFAULT_WRITERS = 2
DEFAULT_CHUNK_BYTES = 256 << 10
DEFAULT_CPU_BYTES = 8 << 20
DEFAULT_DISK_BYTES = 4 << 30
DEFAULT_KILL_AFTER_S = (0.2, 1.5)
#: reads after the restart go in batches this size (each promotes into the small cpu tier)
READ_BATCH = 8
#: how often the follower asks for new store events
EVENT_POLL_S = 0.01
#: spawn_agent checks this often whether the agent answers: the start times' resolution
START_POLL_S = 0.05
#: figures that must be 0 for the disk tier to keep its promise
MUST_BE_ZERO = ("corrupt_reads", "acked_disk_lost", "disk_files_not_served")


def payload(key: bytes, size_bytes: int) -> bytes:
    """The bytes a writer puts for ``key``: pseudo-random, seeded by the key, so every byte read
    back can be checked without keeping a copy."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size_bytes)


def chunk_key(trial: int, writer: int, i: int, run_id: str) -> bytes:
    return hashlib.blake2b(f"{run_id}:{trial}:{writer}:{i}".encode(), digest_size=16).digest()


@dataclass(slots=True)
class _Ledger:
    """What the clients know: every put sent, every put acknowledged (with its tier), every
    chunk seen demoted to disk. Written by several threads."""

    sent: set[bytes] = field(default_factory=set)
    acked: dict[bytes, str | None] = field(default_factory=dict)
    seen_on_disk: set[bytes] = field(default_factory=set)
    put_errors: list[str] = field(default_factory=list)
    events_missed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_crash_bench(
    *,
    trials: int = DEFAULT_TRIALS,
    writers: int = DEFAULT_WRITERS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    cpu_bytes: int = DEFAULT_CPU_BYTES,
    disk_bytes: int = DEFAULT_DISK_BYTES,
    kill_after_s: tuple[float, float] = DEFAULT_KILL_AFTER_S,
    fsync: bool = True,
    seed: int = 0,
    directory: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Run ``trials`` kill -9 trials (see the module docstring); ``progress(done, total)`` after
    each. Every agent started is stopped (SIGTERM, then SIGKILL) and every trial directory
    removed, also on errors and Ctrl-C."""
    if trials < 1 or writers < 1:
        raise InvalidArgument("trials and writers must be at least 1")
    if chunk_bytes <= 0 or cpu_bytes < chunk_bytes:
        raise InvalidArgument("chunk size must be positive and fit the cpu tier")
    if disk_bytes < 4 * cpu_bytes:
        raise InvalidArgument("the disk tier must be at least 4 x the cpu tier")
    low_s, high_s = kill_after_s
    if not 0 < low_s <= high_s:
        raise InvalidArgument("the kill window must be 0 < FIRST <= LAST seconds")
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    run_id = f"{os.getpid()}-{time.time_ns()}"
    started_s = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvctl-bench-crash-", dir=directory) as tmp:
        for t in range(trials):
            kill_s = rng.uniform(low_s, high_s)
            trial_dir = Path(tmp) / f"trial-{t}"
            rows.append(
                _trial(
                    t,
                    trial_dir,
                    run_id=run_id,
                    writers=writers,
                    chunk_bytes=chunk_bytes,
                    cpu_bytes=cpu_bytes,
                    disk_bytes=disk_bytes,
                    kill_s=kill_s,
                    fsync=fsync,
                )
            )
            _remove_tree(trial_dir)
            if progress is not None:
                progress(t + 1, trials)
        filesystem = _filesystem(Path(tmp))
    return _summary(
        rows,
        settings={
            "trials": trials,
            "writers": writers,
            "chunk_bytes": chunk_bytes,
            "cpu_bytes": cpu_bytes,
            "disk_bytes": disk_bytes,
            "kill_after_seconds": [low_s, high_s],
            "fsync": fsync,
            "disk_admission": "all",
            "seed": seed,
            "directory": str(directory) if directory else tempfile.gettempdir(),
            "filesystem": filesystem,
        },
        elapsed_s=time.perf_counter() - started_s,
    )


# --- one trial --------------------------------------------------------------------------------
def _trial(
    index: int,
    data_dir: Path,
    *,
    run_id: str,
    writers: int,
    chunk_bytes: int,
    cpu_bytes: int,
    disk_bytes: int,
    kill_s: float,
    fsync: bool,
) -> dict[str, Any]:
    from kvctl.client import AgentClient, DataClient
    from kvctl.store.tiers.disk import audit_directory

    data_dir.mkdir(parents=True, mode=0o700)
    argv = ["--cpu", str(cpu_bytes), "--disk", str(disk_bytes), "--name", f"crash-{index}"]
    env = _env(fsync)
    ledger = _Ledger()
    killing = threading.Event()  # set just before the kill: a put failing after it is its
    stop = threading.Event()  # set after it

    t0 = time.perf_counter()
    with _agent(data_dir, argv, env) as (proc, state):
        fresh_start_s = time.perf_counter() - t0
        assert state.data_tcp is not None
        threads = [
            threading.Thread(
                target=_writer,
                args=(state.data_tcp, index, w, run_id, chunk_bytes, ledger, killing, stop),
                name=f"crash-writer-{w}",
                daemon=True,
            )
            for w in range(writers)
        ]
        follower = threading.Thread(
            target=_follow, args=(state.control_url, ledger, stop), daemon=True
        )
        follower.start()
        for th in threads:
            th.start()
        time.sleep(kill_s)
        killing.set()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        stop.set()
        for th in [*threads, follower]:
            th.join(30)

    # the directory exactly as the killed agent left it
    audit = audit_directory(data_dir / "disk", verify=True)
    left_behind = [data_dir / "disk" / rel for rel in audit.temp_files] + [
        data_dir / "disk" / bad.split(":", 1)[0] for bad in audit.invalid_files
    ]

    t0 = time.perf_counter()
    with _agent(data_dir, argv, env) as (_proc, state):
        restart_s = time.perf_counter() - t0
        assert state.data_tcp is not None
        dropped = sum(not p.exists() for p in left_behind)
        with AgentClient(state.control_url) as ctl:
            tiers = {t["name"]: t for t in ctl.info()["tiers"]}
        with DataClient.connect(state.data_tcp, token="") as client:
            served, corrupt = _read_back(client, sorted(ledger.sent), chunk_bytes)

    acked = set(ledger.acked)
    on_disk_known = {k for k in acked if ledger.acked[k] == "disk"} | (ledger.seen_on_disk & acked)
    cpu_last = acked - on_disk_known
    unacked = ledger.sent - acked
    return {
        "trial": index,
        "kill_after_seconds": kill_s,
        "puts_sent": len(ledger.sent),
        "puts_acked": len(acked),
        "put_errors_before_kill": len(ledger.put_errors),
        "put_error_examples": ledger.put_errors[:3],
        "events_missed": ledger.events_missed,
        "acked_on_disk_known": len(on_disk_known),
        "acked_disk_lost": len(on_disk_known - served),
        "acked_cpu_last_seen": len(cpu_last),
        "acked_cpu_lost": len(cpu_last - served),
        "acked_cpu_served": len(cpu_last & served),
        "unacked_in_flight": len(unacked),
        "unacked_served": len(unacked & served),
        "disk_files_at_kill": len(audit.chunk_keys),
        "disk_bytes_at_kill": audit.chunk_bytes,
        "disk_files_not_served": len(audit.chunk_keys - served),
        "disk_files_unknown_key": len(audit.chunk_keys - ledger.sent),
        "temp_files_at_kill": len(audit.temp_files),
        "damaged_files_at_kill": len(audit.invalid_files),
        "damaged_examples": list(audit.invalid_files[:5]),
        "left_behind_dropped_at_restart": dropped,
        "disk_chunks_after_restart": tiers.get("disk", {}).get("chunks"),
        "reads": len(ledger.sent),
        "served": len(served),
        "corrupt_reads": corrupt,
        "fresh_start_seconds": fresh_start_s,
        "restart_seconds": restart_s,
    }


def _writer(
    address: str,
    trial: int,
    writer: int,
    run_id: str,
    chunk_bytes: int,
    ledger: _Ledger,
    killing: threading.Event,
    stop: threading.Event,
) -> None:
    """Put fresh chunks until the agent dies: each key is recorded as sent before its put goes
    out and as acknowledged (with the tier the agent names) when the answer comes back."""
    from kvctl.client import DataClient

    try:
        client = DataClient.connect(address, token="", timeout_s=10.0)
    except Exception as exc:  # the kill can come before a slow connect
        if not killing.is_set():
            with ledger.lock:
                ledger.put_errors.append(f"connect: {exc}")
        return
    i = 0
    try:
        while not stop.is_set():
            key = chunk_key(trial, writer, i, run_id)
            data = payload(key, chunk_bytes)
            with ledger.lock:
                ledger.sent.add(key)
            try:
                tier = client.put(key, data)
            except Exception as exc:  # the kill: the connection drops mid-request
                if not killing.is_set():
                    with ledger.lock:
                        ledger.put_errors.append(str(exc))
                return
            with ledger.lock:
                ledger.acked[key] = tier
            i += 1
    finally:
        with contextlib.suppress(Exception):
            client.close()


def _follow(control_url: str, ledger: _Ledger, stop: threading.Event) -> None:
    """Record every chunk the agent reports demoted to disk, until it dies."""
    from kvctl.client import AgentClient

    after = 0
    try:
        with AgentClient(control_url, timeout_s=5.0) as ctl:
            while not stop.is_set():
                batch = ctl.events(after=after, limit=1000)
                disk = [
                    bytes.fromhex(e["key"])
                    for e in batch["events"]
                    if e.get("type") == "demote" and e.get("tier") == "disk"
                ]
                with ledger.lock:
                    ledger.seen_on_disk.update(disk)
                    ledger.events_missed += int(batch["dropped"])
                after = int(batch["last_seq"])
                if not batch["events"]:
                    time.sleep(EVENT_POLL_S)
    except Exception:  # the kill: the agent stops answering
        return


def _read_back(client: Any, keys: list[bytes], chunk_bytes: int) -> tuple[set[bytes], int]:
    """The keys the restarted agent serves, and how many of them came back with other bytes."""
    served: set[bytes] = set()
    corrupt = 0
    for start in range(0, len(keys), READ_BATCH):
        batch = keys[start : start + READ_BATCH]
        for key, got in zip(batch, client.get_many(batch), strict=True):
            if got is None:
                continue
            served.add(key)
            if bytes(got) != payload(key, chunk_bytes):
                corrupt += 1
    return served, corrupt


# --- agents -----------------------------------------------------------------------------------
def _env(fsync: bool) -> dict[str, str]:
    return {
        "KVCTL_DISK_ADMISSION": "all",  # every demotion reaches the disk
        "KVCTL_FSYNC": "true" if fsync else "false",
    }


def _agent(
    data_dir: Path, argv: list[str], env: dict[str, str]
) -> contextlib.AbstractContextManager[tuple[subprocess.Popen[bytes], AgentState]]:
    return spawned_agent_process(data_dir, *argv, "--socket", "off", env=env)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _filesystem(path: Path) -> str | None:
    """The filesystem type under ``path`` (from /proc/mounts), when it can be told."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    best, fstype = "", None
    real = os.path.realpath(path)
    for line in mounts:
        parts = line.split()
        if (
            len(parts) >= 3
            and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/"))
            and len(parts[1]) > len(best)
        ):
            best, fstype = parts[1], parts[2]
    return fstype


# --- the report -------------------------------------------------------------------------------
_TOTALS = (
    "puts_sent",
    "puts_acked",
    "acked_on_disk_known",
    "acked_disk_lost",
    "acked_cpu_last_seen",
    "acked_cpu_lost",
    "acked_cpu_served",
    "unacked_in_flight",
    "unacked_served",
    "disk_files_at_kill",
    "disk_files_not_served",
    "disk_files_unknown_key",
    "temp_files_at_kill",
    "damaged_files_at_kill",
    "left_behind_dropped_at_restart",
    "reads",
    "served",
    "corrupt_reads",
    "events_missed",
    "put_errors_before_kill",
)


def _summary(rows: list[dict[str, Any]], *, settings: dict[str, Any], elapsed_s: float) -> dict:
    totals = {name: sum(int(r[name]) for r in rows) for name in _TOTALS}
    restart = [r["restart_seconds"] for r in rows]
    fresh = [r["fresh_start_seconds"] for r in rows]
    left = totals["temp_files_at_kill"] + totals["damaged_files_at_kill"]
    return {
        "benchmark": "crash",
        **host_info(),
        **settings,
        "elapsed_seconds": elapsed_s,
        "totals": totals,
        # each figure beside what it is judged against
        "figures": {
            "corrupt_reads": {
                "value": totals["corrupt_reads"],
                "reference": 0,
                "of_reads": totals["reads"],
            },
            "acked_disk_lost": {
                "value": totals["acked_disk_lost"],
                "reference": 0,
                "of": totals["acked_on_disk_known"],
            },
            "disk_files_not_served": {
                "value": totals["disk_files_not_served"],
                "reference": 0,
                "of": totals["disk_files_at_kill"],
            },
            "acked_cpu_lost": {
                "value": totals["acked_cpu_lost"],
                "reference": "expected: DRAM does not survive a kill",
                "of": totals["acked_cpu_last_seen"],
            },
            "torn_or_partial_files_dropped": {
                "value": totals["left_behind_dropped_at_restart"],
                "reference": left,
                "temp_files": totals["temp_files_at_kill"],
                "damaged_files": totals["damaged_files_at_kill"],
            },
            "restart_seconds_median": {
                "value": statistics.median(restart),
                "max": max(restart),
                "reference": statistics.median(fresh),
                "reference_is": "the same agent's start on an empty data directory, same trials",
                "ratio": statistics.median(restart) / statistics.median(fresh),
            },
        },
        "ok": all(totals[name] == 0 for name in MUST_BE_ZERO),
        "trials_detail": rows,
        "notes": [
            "kill -9 ends the process, not the kernel: written pages stay in the page cache, so "
            "this measures crash consistency (rename-into-place, the scan at open, checksums), "
            "not durability against power loss (that is what fsync, on by default, is for)",
            "acked_on_disk_known: puts answered 'disk', or chunks the agent's event stream "
            "reported demoted to disk before the kill; the put that made room for a demotion "
            "waits for its file, and its demote event is emitted once the file is in place, so "
            "the chunk's file was renamed into place by then",
            "acked_cpu_served: chunks last seen in the cpu tier but served after the restart: "
            "demoted to disk after the follower's last poll",
            "disk_files_at_kill: whole chunk files in the directory after the kill, payloads "
            "checksummed, read before the restart without changing anything",
            f"start times are to the agent's first health answer, polled every {START_POLL_S} s "
            "(the figures' resolution); both include starting the Python interpreter",
        ],
    }


def render_crash_bench(result: dict[str, Any]) -> Any:
    """A table for people: each figure beside its reference."""
    from rich.table import Table

    figs = result["figures"]
    table = Table(
        title=f"kvctl crash consistency: {result['trials']} kill -9 trials, "
        f"{result['writers']} writer(s), {result['chunk_bytes'] >> 10} KiB chunks, "
        f"fsync {'on' if result['fsync'] else 'off'}",
        caption=f"{result['filesystem'] or 'unknown filesystem'} under {result['directory']}; "
        + ("every must-be-zero figure is zero" if result["ok"] else "A MUST-BE-ZERO FIGURE IS NOT"),
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("reference")
    t = result["totals"]
    table.add_row(
        "corrupt reads", str(figs["corrupt_reads"]["value"]), f"0 (of {t['reads']:,} reads)"
    )
    table.add_row(
        "acked chunks on disk, lost",
        str(t["acked_disk_lost"]),
        f"0 (of {t['acked_on_disk_known']:,} known on disk)",
    )
    table.add_row(
        "chunk files at kill, not served",
        str(t["disk_files_not_served"]),
        f"0 (of {t['disk_files_at_kill']:,} whole files)",
    )
    table.add_row(
        "acked chunks in cpu only, lost",
        str(t["acked_cpu_lost"]),
        f"expected (DRAM; {t['acked_cpu_served']:,} of {t['acked_cpu_last_seen']:,} had reached "
        "disk unseen)",
    )
    table.add_row(
        "in-flight puts served", str(t["unacked_served"]), f"of {t['unacked_in_flight']:,} sent"
    )
    table.add_row(
        "torn/partial files dropped at restart",
        str(t["left_behind_dropped_at_restart"]),
        f"{t['temp_files_at_kill']} temp + {t['damaged_files_at_kill']} damaged found",
    )
    r = figs["restart_seconds_median"]
    table.add_row(
        "restart (median / max)",
        f"{r['value']:.2f} s / {r['max']:.2f} s",
        f"fresh start {r['reference']:.2f} s (x{r['ratio']:.2f})",
    )
    return table
