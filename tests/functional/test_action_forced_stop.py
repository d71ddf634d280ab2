"""Ctrl-C twice while a control command's audit write is stuck on a lock (another session
holds the audit table): the command stops at once, as the "Ctrl-C again in a moment to stop
now" line promises, and names the nodes it asked that the audit trail lacks. Before, the forced
stop was taken as a first Ctrl-C: the command went on waiting for a silent agent (up to four
times --timeout) and then tried the same stuck write again, and its last line said `kvctl
audit` showed how each node ended when the trail held none of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from sqlalchemy import create_engine, text

from kvctl.fleet.audit import Audit
from kvctl.interrupts import FORCE_AFTER_SECONDS
from tests.functional.test_cli_failures_interrupt import GUARD_S, KEY, _agents, _cli


def _waits_on_a_lock(engine_url: str) -> bool:
    engine = create_engine(engine_url)
    try:
        with engine.connect() as conn:
            return bool(
                conn.execute(
                    text(
                        "SELECT count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
                    )
                ).scalar_one()
            )
    finally:
        engine.dispose()


def test_a_forced_stop_of_a_stuck_audit_write_stops_now_and_names_the_unrecorded(
    pg_url: str,
) -> None:
    with _agents(2) as (fast, slow):
        _cli(pg_url, "db", "upgrade")
        _cli(pg_url, "fleet", "add-dc", "fra")
        _cli(pg_url, "fleet", "add-node", "fast", "--dc", "fra", "--agent-url", fast.url)
        _cli(pg_url, "fleet", "add-node", "slow", "--dc", "fra", "--agent-url", slow.url)
        fast.release.set()
        holder_engine = create_engine(pg_url)
        holder = holder_engine.connect()
        holder.begin()
        holder.execute(text(f"LOCK TABLE {Audit.__tablename__} IN ACCESS EXCLUSIVE MODE"))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvctl", "pin", "--all", "--yes", "--key", KEY,
             "--timeout", "30", "--db", pg_url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        try:
            assert slow.asked.wait(GUARD_S)
            deadline = time.monotonic() + GUARD_S
            while not _waits_on_a_lock(pg_url) and time.monotonic() < deadline:
                time.sleep(0.05)  # fast's answer is in, its audit write waits on the lock
            proc.send_signal(signal.SIGINT)  # held: the write must not be torn
            time.sleep(FORCE_AFTER_SECONDS + 0.5)
            proc.send_signal(signal.SIGINT)  # forced
            # slow is never released and the lock is still held: only the forced stop ends it
            _, err = proc.communicate(timeout=GUARD_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            holder.rollback()
            holder.close()
            holder_engine.dispose()
    said = " ".join(err.decode().split())
    assert proc.returncode == 130, said
    assert "Traceback" not in said, said
    assert "not in the audit trail" in said and said.endswith("possibly acted: fast, slow"), said
    assert "shows how each ended" not in said, said
    # what it said is what the trail holds: neither node
    assert json.loads(_cli(pg_url, "audit", "--action", "pin", "--json")) == []
