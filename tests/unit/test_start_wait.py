"""How long `kvctl agent start --detach` waits for its agent: while the agent is alive and
writes to its log, and up to the timeout after its last line. Found in review: a disk tier of
160k chunk files took over 30 s to scan (logging its progress every 5 s), and the wait, a fixed
30 s plus 3 s a GiB of cpu, killed the agent every time ('not serving after 30 s, so stopped').
A fake clock drives the wait; the agent is a real process and its log a real file."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvctl.agent.daemon import START_POLL_SECONDS, StartWait, wait_serving
from kvctl.agent.logfile import LogFollower

TIMEOUT_S = 30.0


def test_the_timeout_runs_from_the_last_line_of_the_log() -> None:
    wait = StartWait(TIMEOUT_S, started_s=100.0, log_bytes=10)
    assert wait.observe(120.0, 10)  # silent, within the timeout from the start
    assert wait.observe(125.0, 80)  # a new line: the timeout starts again from here
    assert wait.observe(154.9, 80)
    assert not wait.observe(155.0, 80)  # 30 s without a line
    assert wait.gave_up(155.0) == (
        "not serving after 55 s, its log silent for the last 30 s, so stopped"
    )


def test_an_agent_that_says_nothing_is_given_up_after_the_timeout() -> None:
    wait = StartWait(TIMEOUT_S, started_s=0.0, log_bytes=0)
    assert wait.observe(29.0, 0)
    assert not wait.observe(30.0, 0)


class FakeTime:
    """A clock that moves only when the wait sleeps; while ``lines_left``, each sleep of
    ``line_every_s`` (in polls) ends with a line in the agent's log, as its disk scan logs."""

    def __init__(self, log: Path, lines: int, line_every_s: float) -> None:
        self.now_s = 1000.0
        self.log = log
        self.lines_left = lines
        self.polls_per_line = round(line_every_s / START_POLL_SECONDS)
        self.polls = 0
        self.seen: list[tuple[float, str]] = []

    def clock(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.now_s += seconds
        self.polls += 1
        if self.lines_left and self.polls % self.polls_per_line == 0:
            self.lines_left -= 1
            with open(self.log, "a") as f:
                f.write(f"INFO disk tier disk: scan: {self.polls} files so far\n")

    def progress(self, elapsed_s: float, line: str) -> None:
        self.seen.append((elapsed_s, line))


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_an_agent_logging_its_progress_is_waited_for_past_the_timeout(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    log = tmp_path / "agent.log"
    log.write_text("an earlier run's line\n")
    # 24 lines 5 s apart: 120 s of start-up, four times the timeout, then silence
    fake = FakeTime(log, lines=24, line_every_s=5.0)
    why = wait_serving(
        child,
        tmp_path,
        LogFollower.open(log),
        TIMEOUT_S,
        progress=fake.progress,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    assert isinstance(why, str) and why.startswith("not serving after 150 s, its log silent")
    assert child.poll() is not None  # given up on: killed
    assert len(fake.seen) == 24  # each new line, told as it came
    assert fake.seen[0] == pytest.approx((5.0, "INFO disk tier disk: scan: 100 files so far"))
    assert fake.seen[-1][0] == pytest.approx(120.0)


def test_an_earlier_runs_lines_are_not_progress(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    log = tmp_path / "agent.log"
    log.write_text("an earlier run's line\n" * 100)
    fake = FakeTime(log, lines=0, line_every_s=5.0)
    why = wait_serving(
        child, tmp_path, LogFollower.open(log), TIMEOUT_S, clock=fake.clock, sleep=fake.sleep
    )
    assert why == "not serving after 30 s, its log silent for the last 30 s, so stopped"
    assert child.poll() is not None


def test_an_agent_that_exits_is_not_waited_for(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    log = tmp_path / "agent.log"
    log.write_text("")
    fake = FakeTime(log, lines=0, line_every_s=5.0)
    follower = LogFollower.open(log, 0)
    why = wait_serving(proc, tmp_path, follower, TIMEOUT_S, clock=fake.clock, sleep=fake.sleep)
    assert why == "exit code 3"
    assert fake.now_s == 1000.0  # not one wait


def test_the_operator_sees_the_agents_log_lines_once_the_start_takes_a_while() -> None:
    from kvctl.cli.agent import START_QUIET_SECONDS, _StartProgress
    from kvctl.cli.output import err_console

    show = _StartProgress()
    with err_console.capture() as captured:
        show(START_QUIET_SECONDS / 2, "2026-11-29 17:28:47,745 INFO kvctl.agent: quick")
        show(
            35.2,
            "2026-11-29 17:28:47,745 INFO kvctl.store.tiers.disk: disk tier disk: scan of "
            "/d/disk: 120000 files so far, 119000 chunks (7.3 GiB), 35 s",
        )
        show(36.0, "2026-11-29 17:28:48,001 WARNING kvctl.agent: disk tier disk: capacity")
        show(37.0, "a line of its own [not markup]")
    assert captured.get().splitlines() == [
        "starting (35 s): disk tier disk: scan of /d/disk: 120000 files so far, 119000 chunks "
        "(7.3 GiB), 35 s",
        "starting (36 s): WARNING: disk tier disk: capacity",
        "starting (37 s): a line of its own [not markup]",
    ]


def test_a_start_limit_bounds_an_agent_that_keeps_logging(
    tmp_path: Path, child: subprocess.Popen[bytes]
) -> None:
    """``--start-timeout``: an agent that logs a line every 5 s forever (an error in a loop) is
    given up at the limit, where without one it would be waited for as long as it logs."""
    log = tmp_path / "agent.log"
    log.write_text("")
    fake = FakeTime(log, lines=10_000, line_every_s=5.0)
    why = wait_serving(
        child,
        tmp_path,
        LogFollower.open(log, 0),
        TIMEOUT_S,
        limit_s=90.0,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    assert why == "not serving after 90 s, the limit given (--start-timeout 90), so stopped"
    assert child.poll() is not None
    assert fake.lines_left > 9_000  # stopped at the limit, not when the lines ran out


def test_the_limit_is_a_bound_not_a_delay() -> None:
    wait = StartWait(TIMEOUT_S, started_s=0.0, log_bytes=0, limit_s=600.0)
    assert wait.observe(29.0, 0)
    assert not wait.observe(30.0, 0)  # silent for the timeout: given up before the limit
    assert wait.gave_up(30.0).endswith("its log silent for the last 30 s, so stopped")


def test_start_timeout_needs_detach(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from kvctl.cli.main import app

    result = CliRunner().invoke(
        app, ["agent", "start", "--data-dir", str(tmp_path / "d"), "--start-timeout", "60"]
    )
    assert result.exit_code == 2
    assert "--start-timeout bounds a --detach start" in result.output
    assert not (tmp_path / "d").exists()  # nothing made before the error
