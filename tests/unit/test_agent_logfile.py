"""Rolling a log over under a process that writes to it as its stdout and stderr, and reading
it from a point on across the rollovers (what `kvctl agent start --detach` does with its
agent's log as it starts). The writer is a real process whose fds 1 and 2 are the log."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.agent.logfile import LogFollower, LogRotator, rotated_path, start_rotation

# phases of lines, each ended by a rollover check; a byte on the pipe after each phase, and the
# next phase once a byte comes on stdin
WRITER = """
import os, sys
from pathlib import Path
from kvctl.agent.logfile import LogRotator
path, phases, per_phase, backups, done = Path(sys.argv[1]), *map(int, sys.argv[2:])
rotator = LogRotator(path, (1, 2), max_bytes=300, backups=backups)
i = 0
for _ in range(phases):
    for _ in range(per_phase):
        # both ways a process writes: Python's buffered stdout and a raw write to fd 2
        print(f"line {i}", flush=True) if i % 2 else os.write(2, f"line {i}\\n".encode())
        i += 1
        rotator.rotate_if_due()
    os.write(done, b".")
    sys.stdin.buffer.read(1)
"""


def _run_writer(
    path: Path, phases: int, per_phase: int, backups: int, follower: LogFollower | None
) -> list[bytes]:
    """Run the writer to its end; what ``follower`` read after each phase."""
    done_r, done_w = os.pipe()
    got: list[bytes] = []
    with open(path, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                str(path),
                *map(str, (phases, per_phase, backups, done_w)),
            ],
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=out,
            pass_fds=(done_w,),
        )
    os.close(done_w)
    assert proc.stdin is not None
    try:
        for _ in range(phases):
            assert os.read(done_r, 1) == b".", "the writer died"
            if follower is not None:
                got.append(follower.read())
            proc.stdin.write(b"g")
            proc.stdin.flush()
        proc.stdin.close()
        assert proc.wait(60) == 0
    finally:
        os.close(done_r)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return got


def _lines(data: bytes) -> list[int]:
    return [int(line.removeprefix(b"line ")) for line in data.splitlines()]


def test_a_follower_reads_every_line_once_in_order_across_rollovers(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_bytes(b"an earlier run's line\n")
    with LogFollower.open(log) as follower:
        # 40 lines of ~8 bytes a phase: a rollover at least every phase (past 300 bytes)
        got = _run_writer(log, phases=6, per_phase=40, backups=100, follower=follower)
        got.append(follower.read())
    assert _lines(b"".join(got)) == list(range(240))
    assert all(got[:6])  # something new after each phase
    assert rotated_path(log, 5).exists()  # it did roll over, several times


def test_a_follower_that_fell_behind_goes_on_at_the_oldest_kept(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_bytes(b"")
    with LogFollower.open(log, 0) as follower:
        _run_writer(log, phases=6, per_phase=40, backups=2, follower=None)
        lines = _lines(follower.read())
    # its own file (held open) read to its end, then the files after it that were deleted
    # unread are skipped: the oldest kept and the rest read whole, in order, to the end
    gap = next(i for i in range(1, len(lines)) if lines[i] != lines[i - 1] + 1)
    assert lines[:gap] == list(range(gap))
    assert lines[gap:] == list(range(lines[gap], 240)) and lines[gap] > gap
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["agent.log", "agent.log.1", "agent.log.2"]


def test_the_writers_fds_follow_and_no_line_is_cut(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    _run_writer(log, phases=3, per_phase=40, backups=100, follower=None)
    files = [log, *(rotated_path(log, n) for n in range(1, 100))]
    texts = [p.read_bytes() for p in files if p.exists()]
    assert len(texts) > 2
    assert all(t.endswith(b"\n") for t in texts if t)
    assert sorted(_lines(b"".join(texts))) == list(range(120))


def test_no_rotation_where_stdio_is_not_the_log(tmp_path: Path) -> None:
    log = tmp_path / "agent.log"
    log.write_bytes(b"x" * 1000)
    assert start_rotation(log, 10, 3) is None  # this process's stdio is pytest's, not the log
    assert not rotated_path(log, 1).exists()


def test_a_rotator_needs_a_cap_and_a_backup() -> None:
    with pytest.raises(ValueError):
        LogRotator(Path("agent.log"), (2,), 0, 3)
    with pytest.raises(ValueError):
        LogRotator(Path("agent.log"), (2,), 100, 0)


class _Broken(LogRotator):
    def rotate(self) -> None:
        raise RuntimeError("not an OSError")


def test_a_rollover_that_fails_unforeseen_is_logged_not_a_silent_thread_end(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "agent.log"
    log.write_bytes(b"x" * 100)
    with open(log, "ab") as f:
        rotator = _Broken(log, (f.fileno(),), max_bytes=10, backups=1)
        rotator.start()
        rotator.stop()  # returns once the thread has ended: at its first look, failed
    said = [r for r in caplog.records if r.levelname == "ERROR"]
    assert said and f"rolling {log} over failed" in said[0].getMessage()


def test_a_rollover_that_keeps_failing_leaves_the_backups_as_they_were(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A rollover that cannot make its new file (here a directory where agent.log.next goes; in
    life out of descriptors, inodes or quota) is tried again at every check. It shifted the
    backups first, so each failed try dropped the oldest: two checks (one second) and the
    incident's older logs were gone. They stay as they were, and the writer's file with them."""
    log = tmp_path / "agent.log"
    log.write_bytes(b"the current log\n" * 10)
    for n in (1, 2):
        rotated_path(log, n).write_bytes(f"backup {n}\n".encode())
    (tmp_path / "agent.log.next").mkdir()
    with open(log, "ab") as f:
        rotator = LogRotator(log, (f.fileno(),), max_bytes=10, backups=2)
        with caplog.at_level(logging.WARNING, logger="kvctl.agent"):
            assert [rotator.rotate_if_due() for _ in range(3)] == [False] * 3
        f.write(b"written after\n")
    assert rotated_path(log, 1).read_bytes() == b"backup 1\n"
    assert rotated_path(log, 2).read_bytes() == b"backup 2\n"
    assert log.read_bytes() == b"the current log\n" * 10 + b"written after\n"
    assert [r.getMessage() for r in caplog.records if "cannot roll" in r.getMessage()]


def test_a_link_planted_as_the_new_files_name_is_not_followed(tmp_path: Path) -> None:
    """The new file was opened by name with O_CREAT|O_TRUNC, following a symlink: in a data dir
    others can write to (one the agent only warns about), a link planted as agent.log.next had
    the rollover truncate the file it pointed at (the agent's user's, root's) and then, renamed
    agent.log, the log written into it. The link is replaced by a file of the rollover's own."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    victim = tmp_path / "victim.conf"
    victim.write_bytes(b"not the log's\n")
    log = data_dir / "agent.log"
    log.write_bytes(b"x" * 100)
    (data_dir / "agent.log.next").symlink_to(victim)
    with open(log, "ab") as f:
        assert LogRotator(log, (f.fileno(),), max_bytes=10, backups=1).rotate_if_due()
        f.write(b"after the rollover\n")
    assert victim.read_bytes() == b"not the log's\n"
    assert not log.is_symlink() and log.read_bytes() == b"after the rollover\n"
    assert rotated_path(log, 1).read_bytes() == b"x" * 100


def test_a_rollover_killed_between_link_and_rename_costs_no_backup_at_the_next(
    tmp_path: Path,
) -> None:
    """An agent killed mid-rollover, after agent.log.1 was linked to agent.log but before the
    new file was named, leaves agent.log.1 a second name of agent.log (and agent.log.next).
    The restarted agent's rollover shifted that name up as a backup: agent.log.2 a copy of
    agent.log.1, and the real agent.log.2 dropped. It is dropped instead, the backups kept."""
    log = tmp_path / "agent.log"
    log.write_bytes(b"the log the killed agent and its restart wrote\n")
    os.link(log, rotated_path(log, 1))
    rotated_path(log, 2).write_bytes(b"the real backup\n")
    (tmp_path / "agent.log.next").write_bytes(b"")  # the killed rollover's new file
    with open(log, "ab") as f:
        assert LogRotator(log, (f.fileno(),), max_bytes=10, backups=2).rotate_if_due()
    assert rotated_path(log, 1).read_bytes() == b"the log the killed agent and its restart wrote\n"
    assert rotated_path(log, 2).read_bytes() == b"the real backup\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agent.log", "agent.log.1", "agent.log.2"]


def test_a_log_linked_elsewhere_is_left_to_the_operator(tmp_path: Path) -> None:
    """An operator who keeps the log elsewhere (agent.log a link to /var/log/...) had the link
    replaced by a file in the data dir at the first rollover, and the file it pointed at left
    growing with no one writing it. The agent leaves such a log alone, and says so."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    elsewhere = tmp_path / "var-log-kvctl.log"
    elsewhere.write_bytes(b"x" * 100)
    log = data_dir / "agent.log"
    log.symlink_to(elsewhere)
    code = (
        "import logging, sys; from pathlib import Path; from kvctl.agent.logfile import *; "
        "logging.basicConfig(); "
        "r = start_rotation(Path(sys.argv[1]), 10, 2); r and r.stop(); print('started', bool(r))"
    )
    with open(log, "ab") as out:
        subprocess.run([sys.executable, "-c", code, str(log)], stdout=out, stderr=out, check=True)
    assert log.is_symlink() and not rotated_path(log, 1).exists()
    said = elsewhere.read_text()
    assert "started False" in said and f"{log} is a link to {elsewhere}" in said, said
