"""A staging segment that cannot be had for now (the client's memory short: ENOMEM; the agent
unable to map it) costs staged puts only while that lasts. Before, the first failure turned
staged puts off until the client reconnected (and an agent that could not map the segment
failed the put itself, INTERNAL, and closed the connection): an operator's transient memory
pressure cost them for the life of every engine's connection. Now puts that need a new
segment go over the socket, nothing lost, and one is tried again after a back-off (one try per
interval, not one per put). Memory is made short for real: RLIMIT_AS, on a child process that
is the client, and on the agent process (prlimit)."""

from __future__ import annotations

import logging
import resource
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .agents import Agent, key, payload
from .child_report import child_report
from .dataplane_hostile_agents import RawConn, error_of, hostile_agent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="memfd and RLIMIT_AS are Linux")

MiB = 1 << 20


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Agent]:
    with hostile_agent(tmp_path / "a", "--cpu", "128MiB", "--disk", "0") as a:
        yield a


def _vm_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))


CLIENT = r"""
import json, logging, resource, sys, time
import kvctl.client as client_module
from kvctl.client import DataClient
from tests.functional.agents import key, payload

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
# no retry by the clock during the test
client_module.STAGING_RETRY_FIRST_SECONDS = client_module.STAGING_RETRY_MAX_SECONDS = 3600.0
made = []  # sizes of the segments the client set out to make
real_segment = client_module._sealed_segment

def counting_segment(size):
    made.append(size)
    return real_segment(size)

client_module._sealed_segment = counting_segment
MiB = 1 << 20
c = DataClient.connect(sys.argv[1])
assert c.shm
report = {}
small = key(1, 31)
c.put(small, payload(small, 64 << 10), tenant="t")  # a first segment, the smallest
report["first"] = len(c._staging)
big = [[key(i, 32 + p) for i in range(4)] for p in range(3)]
data = {k: payload(k, 4 * MiB) for ks in big for k in ks}  # allocated before the limit
with open("/proc/self/status") as f:
    vm_bytes = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
# room for the puts' small allocations, not for a 16 MiB segment
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + 8 * MiB, resource.RLIM_INFINITY))
report["outcomes"] = []
for ks in big[:2]:
    out = c.put_many([(k, data[k]) for k in ks], tenant="t")
    report["outcomes"].append([o.status for o in out])
    report.setdefault("staging_after", []).append(len(c._staging))
report["tries_under_limit"] = len(made) - 1
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
# the back-off is over (as an hour later)
c._staging_retry_at_s = getattr(c, "_staging_retry_at_s", 0.0) - 3600.0
out = c.put_many([(k, data[k]) for k in big[2]], tenant="t")
report["outcomes"].append([o.status for o in out])
report["staging_after"].append(len(c._staging))
report["small_again"] = c.put(key(2, 31), payload(key(2, 31), 64 << 10), tenant="t")
every = [k for ks in big for k in ks]
got = c.get_many(every, tenant="t")
report["same"] = all(g is not None and bytes(g) == data[k] for g, k in zip(got, every))
print(json.dumps(report))
"""


def test_staged_puts_come_back_after_the_client_ran_short_of_memory(agent: Agent) -> None:
    report, stderr = child_report(CLIENT, str(agent.state.data_unix))
    assert report["first"] == 2 * MiB
    # every chunk stored: over the socket while the segment could not grow
    assert report["outcomes"] == [["stored"] * 4] * 3, stderr[-3000:]
    assert report["same"]
    # the failed growth tried the doubled size and only then what the put needed (16 MiB is
    # both here): one try in all, not one per put, while the back-off ran
    assert report["tries_under_limit"] == 1, stderr[-3000:]
    # the small segment kept serving; a 16 MiB one once memory came back
    assert report["staging_after"] == [2 * MiB, 2 * MiB, 16 * MiB], stderr[-3000:]
    assert report["small_again"] == "cpu"
    said = stderr
    assert said.count("could not make a staging segment of 16777216 bytes here") == 1, said
    assert "a new one is tried in 3600 s" in said and "RLIMIT_AS" in said
    assert "staged puts resumed" in said
    assert "Traceback" not in said


def test_staged_puts_come_back_after_the_agent_could_not_map_the_segment(
    agent: Agent, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvctl.client as client_module

    monkeypatch.setattr(client_module, "STAGING_RETRY_FIRST_SECONDS", 3600.0, raising=False)
    monkeypatch.setattr(client_module, "STAGING_RETRY_MAX_SECONDS", 3600.0, raising=False)
    pid = agent.proc.pid
    keys = [key(i, 40) for i in range(24)]
    data = {k: payload(k, MiB) for k in keys}  # 1 MiB chunks: the agent's kept buffer
    with agent.data("unix") as c, caplog.at_level(logging.INFO, logger="kvctl.client"):
        assert c.shm
        hard = resource.prlimit(pid, resource.RLIMIT_AS)[1]
        # the agent's buffers fit (the connection's thread runs already); a 12 MiB mapping not
        resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 4 * MiB, hard))
        try:
            out = c.put_many([(k, data[k]) for k in keys[:12]], tenant="t")
            assert [o.status for o in out] == ["stored"] * 12
            out = c.put_many([(k, data[k]) for k in keys[12:]], tenant="t")
            assert [o.status for o in out] == ["stored"] * 12
            assert c._staging is None  # over the socket: the agent could not map one
            assert getattr(c, "_staging_failures", None) == 1  # one try during the back-off
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
        # the back-off is over (as an hour later)
        c._staging_retry_at_s = getattr(c, "_staging_retry_at_s", 0.0) - 3600.0
        again = [key(i, 41) for i in range(12)]
        out = c.put_many([(k, payload(k, MiB)) for k in again], tenant="t")
        assert [o.status for o in out] == ["stored"] * 12
        assert c._staging is not None and len(c._staging) == 12 * MiB
        got = c.get_many(keys, tenant="t")
        assert [bytes(g) if g is not None else None for g in got] == [data[k] for k in keys]
    said = [r.getMessage() for r in caplog.records if r.name == "kvctl.client"]
    refused = [m for m in said if "the agent refused this client's staging segment" in m]
    assert len(refused) == 1, said
    # the agent's own reason, and what to do
    assert "could not map a staging segment of 12582912 bytes" in refused[0], refused
    assert "see the agent's log" in refused[0], refused
    assert any("staged puts resumed" in m for m in said), said
    log = agent.log()
    assert "Traceback" not in log, log[-3000:]
    assert "could not map a staging segment" in log and "LimitAS=" in log, log[-3000:]
    assert "older SDK" not in log


@pytest.mark.parametrize(
    ("declared", "file_bytes", "reason", "to_do"),
    [
        (2 * MiB, MiB, f"holds {MiB} bytes, not {2 * MiB}", "a bug in the client"),
        (0, MiB, "needs a size, got 0", "a bug in the client"),
    ],
)
def test_the_agent_says_why_it_refused_a_segment_and_what_to_do(
    agent: Agent, declared: int, file_bytes: int, reason: str, to_do: str
) -> None:
    """A refusal that no older SDK causes blames none: it says its reason and the remedy."""
    import fcntl
    import os

    conn = RawConn(agent, "unix")
    fd = os.memfd_create("liar", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.pwrite(fd, bytes(file_bytes), 0)
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | 0x10 | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        conn.hello()
        from kvctl.wire.protocol import ErrorCode, MetaWriter, Op

        code, message = error_of(conn.call(Op.ATTACH, MetaWriter().u64(declared).build(), fds=[fd]))
        assert code == ErrorCode.BAD_REQUEST and reason in message, message
    finally:
        os.close(fd)
        conn.close()
    lines = [line for line in agent.log().splitlines() if "staging segment" in line]
    assert len(lines) == 1, lines
    assert reason in lines[0] and to_do in lines[0], lines
    assert "older SDK" not in lines[0], lines


def test_a_refused_segment_is_tried_again_later_not_per_put(
    agent: Agent, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent that keeps refusing (here: a segment this client makes unsealed) costs one try
    per back-off interval, each longer than the last; every put is stored over the socket. The
    back-off is an hour here, not its real 1 s: with 1 s, a machine slow enough to take a
    second over a round's three puts had the clock end it mid-round (a second try counted)."""
    import math
    import mmap
    import os

    import kvctl.client as client_module

    made: list[int] = []
    delays_s: list[float] = []

    def unsealed(size: int) -> tuple[int, mmap.mmap]:
        made.append(size)
        fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size)

    real_delay_s = client_module.staging_retry_delay_s

    def recorded_delay_s(failures: int) -> float:
        delays_s.append(real_delay_s(failures))
        return delays_s[-1]

    monkeypatch.setattr(client_module, "_sealed_segment", unsealed)
    monkeypatch.setattr(client_module, "STAGING_RETRY_FIRST_SECONDS", 3600.0)
    monkeypatch.setattr(client_module, "STAGING_RETRY_MAX_SECONDS", 8 * 3600.0)
    monkeypatch.setattr(client_module, "staging_retry_delay_s", recorded_delay_s)
    with agent.data("unix") as c, caplog.at_level(logging.WARNING, logger="kvctl.client"):
        for round_ in range(3):
            for i in range(3):
                k = key(i, 50 + round_)
                assert c.put(k, payload(k, 8192), tenant="t") == "cpu"
            assert len(made) == round_ + 1  # one try this round, then the back-off
            c._staging_retry_at_s = -math.inf  # the back-off ran out
        assert c._staging is None and c._staging_failures == 3
    assert delays_s == [3600.0, 7200.0, 14400.0]  # each longer than the last
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1, refused  # the first of the row, not each
    assert "this one is not sealed" in refused[0], refused
    assert "a new one is tried in 3600 s" in refused[0], refused
    lines = [line for line in agent.log().splitlines() if "staging segment" in line]
    assert len(lines) == 1 and "upgrade the client's kvctl" in lines[0], lines


def test_the_back_off_doubles_up_to_its_cap() -> None:
    from kvctl.client import staging_retry_delay_s

    assert [staging_retry_delay_s(n) for n in range(1, 11)] == [
        1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 120.0, 120.0, 120.0
    ]  # fmt: skip
    assert staging_retry_delay_s(10**9) == 120.0


def test_staged_puts_come_back_after_the_agent_ran_out_of_descriptors(
    agent: Agent, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent out of descriptors cannot take the one ATTACH passes (the kernel drops it,
    MSG_CTRUNC, as it drops descriptors past what the agent reads): its refusal says so, not
    only that the client passed too many, its log says to raise the open files limit, and the
    client's staged puts come back once it has room."""
    import kvctl.client as client_module

    monkeypatch.setattr(client_module, "STAGING_RETRY_FIRST_SECONDS", 3600.0, raising=False)
    monkeypatch.setattr(client_module, "STAGING_RETRY_MAX_SECONDS", 3600.0, raising=False)
    pid = agent.proc.pid
    keys = [key(i, 70) for i in range(4)]
    with agent.data("unix") as c, caplog.at_level(logging.WARNING, logger="kvctl.client"):
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        # 3: stdin, stdout and stderr, which the agent never closes. A limit of as many as it
        # had open (a count) let a descriptor it closed meanwhile (a finished HTTP connection's)
        # make room for the one passed, and the agent failed to dup it when mapping instead
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, hard))
        try:
            out = c.put_many([(k, payload(k, 8192)) for k in keys[:2]], tenant="t")
            assert [o.status for o in out] == ["stored"] * 2
            assert c._staging is None
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        c._staging_retry_at_s = getattr(c, "_staging_retry_at_s", 0.0) - 3600.0
        out = c.put_many([(k, payload(k, 8192)) for k in keys[2:]], tenant="t")
        assert [o.status for o in out] == ["stored"] * 2
        assert c._staging is not None
        got = c.get_many(keys, tenant="t")
        assert [bytes(g) if g is not None else None for g in got] == [
            payload(k, 8192) for k in keys
        ]
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and "could not take the one passed" in refused[0], refused
    lines = [line for line in agent.log().splitlines() if "staging segment" in line]
    assert len(lines) == 1 and "LimitNOFILE=" in lines[0], lines


def test_a_client_out_of_descriptors_is_told_to_raise_its_open_files_limit(
    agent: Agent, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment takes descriptors in the client too (its memfd, mmap's dup of it): one that
    cannot be made for want of them (EMFILE) is logged with the open files limit to raise, not
    memory (it said 'free memory ... RLIMIT_AS, LimitAS='), and its put goes over the socket.
    This process's limit is set to its lowest free descriptor: no new one fits."""
    import os

    import kvctl.client as client_module

    monkeypatch.setattr(client_module, "STAGING_RETRY_FIRST_SECONDS", 3600.0)
    monkeypatch.setattr(client_module, "STAGING_RETRY_MAX_SECONDS", 3600.0)
    keys = [key(i, 72) for i in range(2)]
    with agent.data("unix") as c, caplog.at_level(logging.WARNING, logger="kvctl.client"):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest_free = os.open(os.devnull, os.O_RDONLY)
        os.close(lowest_free)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
        try:
            out = c.put_many([(k, payload(k, 8192)) for k in keys], tenant="t")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert [o.status for o in out] == ["stored"] * 2
        assert c._staging is None and c._staging_failures == 1
        got = c.get_many(keys, tenant="t")
        assert [bytes(g) if g is not None else None for g in got] == [
            payload(k, 8192) for k in keys
        ]
    said = [r.getMessage() for r in caplog.records if "staging segment" in r.getMessage()]
    assert len(said) == 1 and "Too many open files" in said[0], said
    assert "LimitNOFILE=" in said[0] and "LimitAS=" not in said[0], said


def test_a_segment_the_agent_could_not_map_holds_back_only_segments_as_large(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The back-off after a segment the agent could not map for want of memory holds back
    segments of that size and larger, which it would refuse the same: a put that needs a
    smaller one gets it at once (it went over the socket for the whole back-off, up to
    120 s), and that smaller one ends no back-off for the larger size. The agent's memory is
    made short for real (prlimit); the back-off's clock is the client's seam, moved by hand."""
    import kvctl.client as client_module

    made: list[int] = []  # sizes of the segments the client set out to make
    real_segment = client_module._sealed_segment

    def counting_segment(size: int) -> Any:
        made.append(size)
        return real_segment(size)

    monkeypatch.setattr(client_module, "_sealed_segment", counting_segment)
    now_s = [1000.0]
    pid = agent.proc.pid
    big = [[key(i, 80 + p) for i in range(16)] for p in range(3)]
    data = {k: payload(k, MiB) for ks in big for k in ks}  # 1 MiB chunks: 16 MiB a put
    small = key(0, 83)
    with agent.data("unix") as c:
        assert c.shm
        c._monotonic_s = lambda: now_s[0]
        hard = resource.prlimit(pid, resource.RLIMIT_AS)[1]
        # the agent's buffers and a 2 MiB mapping fit; a 16 MiB one not
        resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 8 * MiB, hard))
        try:
            out = c.put_many([(k, data[k]) for k in big[0]], tenant="t")
            assert [o.status for o in out] == ["stored"] * 16
            assert c._staging is None and made == [16 * MiB]  # refused: over the socket
            assert c.put(small, payload(small, 64 << 10), tenant="t") == "cpu"
            # a smaller segment at once, in the back-off the 16 MiB refusal began
            assert made == [16 * MiB, 2 * MiB]
            assert c._staging is not None and len(c._staging) == 2 * MiB
            out = c.put_many([(k, data[k]) for k in big[1]], tenant="t")
            assert [o.status for o in out] == ["stored"] * 16
            # 16 MiB still waits out its back-off: no try, and the row goes on
            assert made == [16 * MiB, 2 * MiB] and len(c._staging) == 2 * MiB
            assert c._staging_failures == 1
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
        now_s[0] = c._staging_retry_at_s  # the back-off ran out
        out = c.put_many([(k, data[k]) for k in big[2]], tenant="t")
        assert [o.status for o in out] == ["stored"] * 16
        assert made[2:] == [16 * MiB] and len(c._staging) == 16 * MiB
        assert c._staging_failures == 0
        every = [k for ks in big for k in ks]
        got = c.get_many(every, tenant="t")
        assert all(g is not None and bytes(g) == data[k] for g, k in zip(got, every, strict=True))
    assert "Traceback" not in agent.log()


def test_where_the_agent_cannot_map_the_doubled_segment_the_puts_own_size_is_tried(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A segment grows by doubling; where the doubled size cannot be had, only what the put
    needs is tried. That held for a segment the client could not make, not for one the agent
    could not map: its put went over the socket and the back-off began, though the agent
    would have mapped the smaller size. The agent's memory is made short for real (prlimit)."""
    import kvctl.client as client_module

    made: list[int] = []
    real_segment = client_module._sealed_segment

    def counting_segment(size: int) -> Any:
        made.append(size)
        return real_segment(size)

    monkeypatch.setattr(client_module, "_sealed_segment", counting_segment)
    pid = agent.proc.pid
    first = [key(i, 84) for i in range(8)]
    second = [key(i, 85) for i in range(9)]
    data = {k: payload(k, MiB) for k in [*first, *second]}
    with agent.data("unix") as c:
        assert c.shm
        out = c.put_many([(k, data[k]) for k in first], tenant="t")
        assert [o.status for o in out] == ["stored"] * 8 and made == [8 * MiB]
        hard = resource.prlimit(pid, resource.RLIMIT_AS)[1]
        # a 10 MiB mapping fits beside the 8 MiB one held; a 16 MiB one not
        resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 13 * MiB, hard))
        try:
            out = c.put_many([(k, data[k]) for k in second], tenant="t")  # needs 10 MiB
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
        assert [o.status for o in out] == ["stored"] * 9
        assert made == [8 * MiB, 16 * MiB, 10 * MiB]  # the doubled size, then the put's own
        assert c._staging is not None and len(c._staging) == 10 * MiB
        # staged puts went on; only the refused 16 MiB and larger wait out a back-off
        assert c._staging_failures == 1 and c._staging_refused_bytes == 16 * MiB
        every = [*first, *second]
        got = c.get_many(every, tenant="t")
        assert all(g is not None and bytes(g) == data[k] for g, k in zip(got, every, strict=True))


def test_a_doubled_size_the_agent_could_not_map_is_held_back_though_the_puts_own_attached(
    agent: Agent, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the agent refused the doubled size for want of memory and the put's own size then
    attached, the doubled size had no back-off: each later growth made (filled, sealed) and
    sent a doomed doubled segment before asking for what its put needed. Now the refusal holds
    back that size and larger, as where nothing attached: the next growth asks straight for
    its put's size until the back-off runs out. The agent's memory is made short for real
    (prlimit); the back-off's clock is the client's seam, moved by hand."""
    import kvctl.client as client_module

    made: list[int] = []  # sizes of the segments the client made (each one sent, ATTACH)
    real_segment = client_module._sealed_segment

    def counting_segment(size: int) -> Any:
        made.append(size)
        return real_segment(size)

    monkeypatch.setattr(client_module, "_sealed_segment", counting_segment)
    now_s = [1000.0]
    pid = agent.proc.pid
    puts = [[key(i, 90 + p) for i in range(n)] for p, n in enumerate((8, 9, 11, 13))]
    data = {k: payload(k, MiB) for ks in puts for k in ks}  # 1 MiB chunks
    with agent.data("unix") as c, caplog.at_level(logging.INFO, logger="kvctl.client"):
        assert c.shm
        c._monotonic_s = lambda: now_s[0]
        out = c.put_many([(k, data[k]) for k in puts[0]], tenant="t")
        assert [o.status for o in out] == ["stored"] * 8 and made == [8 * MiB]
        hard = resource.prlimit(pid, resource.RLIMIT_AS)[1]
        try:
            # a 10 MiB mapping fits beside the 8 MiB one held; a 16 MiB one not
            resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 13 * MiB, hard))
            out = c.put_many([(k, data[k]) for k in puts[1]], tenant="t")  # needs 10 MiB
            assert [o.status for o in out] == ["stored"] * 9
            assert made == [8 * MiB, 16 * MiB, 10 * MiB] and len(c._staging) == 10 * MiB
            # a 12 MiB mapping fits beside the 10 MiB one held; a 20 MiB one not
            resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 15 * MiB, hard))
            out = c.put_many([(k, data[k]) for k in puts[2]], tenant="t")  # needs 12 MiB
            assert [o.status for o in out] == ["stored"] * 11
            # straight to the put's own size: no doomed 20 MiB segment first
            assert made[3:] == [12 * MiB], made
            assert len(c._staging) == 12 * MiB
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
        now_s[0] = c._staging_retry_at_s  # the back-off ran out: doubling again
        out = c.put_many([(k, data[k]) for k in puts[3]], tenant="t")  # needs 14 MiB
        assert [o.status for o in out] == ["stored"] * 13
        assert made[4:] == [24 * MiB] and len(c._staging) == 24 * MiB
        assert c._staging_failures == 0 and c._staging_refused_bytes is None
        every = [k for ks in puts for k in ks]
        got = c.get_many(every, tenant="t")
        assert all(g is not None and bytes(g) == data[k] for g, k in zip(got, every, strict=True))
    said = [r.getMessage() for r in caplog.records if "attached instead" in r.getMessage()]
    assert len(said) == 1 and "staging segment of 16777216 bytes" in said[0], said
    assert "one of 10485760 bytes" in said[0] and "not tried for 1 s" in said[0], said
    assert "Traceback" not in agent.log()


def test_within_a_back_off_smaller_sizes_that_fail_too_are_not_each_tried(
    agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A back-off after a segment refused for want of memory lets a smaller one be tried at
    once; where that fails too, each still smaller put tried its own size at once (one try per
    2 MiB step down, each a segment made in full and sent). Now one such failure holds back
    every size until the back-off runs out. The agent's memory is made short for real."""
    import kvctl.client as client_module

    made: list[int] = []
    real_segment = client_module._sealed_segment

    def counting_segment(size: int) -> Any:
        made.append(size)
        return real_segment(size)

    monkeypatch.setattr(client_module, "_sealed_segment", counting_segment)
    now_s = [1000.0]
    pid = agent.proc.pid
    puts = [[key(i, 95 + p) for i in range(n)] for p, n in enumerate((16, 14, 12, 10, 2))]
    data = {k: payload(k, MiB) for ks in puts for k in ks}
    with agent.data("unix") as c:
        assert c.shm
        c._monotonic_s = lambda: now_s[0]
        hard = resource.prlimit(pid, resource.RLIMIT_AS)[1]
        # the agent's buffers fit; no mapping of 6 MiB or more
        resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 4 * MiB, hard))
        try:
            for ks in puts[:4]:
                out = c.put_many([(k, data[k]) for k in ks], tenant="t")
                assert [o.status for o in out] == ["stored"] * len(ks)
            # 16 MiB refused, 14 MiB tried at once and refused: not 12 nor 10 MiB
            assert made == [16 * MiB, 14 * MiB], made
            assert c._staging is None and c._staging_failures == 2
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
        now_s[0] = c._staging_retry_at_s  # the back-off ran out
        out = c.put_many([(k, data[k]) for k in puts[4]], tenant="t")
        assert [o.status for o in out] == ["stored"] * 2
        assert made[2:] == [2 * MiB] and c._staging_failures == 0
        every = [k for ks in puts for k in ks]
        got = c.get_many(every, tenant="t")
        assert all(g is not None and bytes(g) == data[k] for g, k in zip(got, every, strict=True))
    assert "Traceback" not in agent.log()


def _counting_segments(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the staging segments the client makes (each one sent, ATTACH)."""
    import kvctl.client as client_module

    made: list[int] = []
    real_segment = client_module._sealed_segment

    def counting_segment(size: int) -> Any:
        made.append(size)
        return real_segment(size)

    monkeypatch.setattr(client_module, "_sealed_segment", counting_segment)
    return made


def _said(caplog: pytest.LogCaptureFixture, level: int, part: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and part in r.getMessage()]


def test_a_row_of_doubled_sizes_held_back_alone_is_not_said_as_puts_over_the_socket(
    agent: Agent, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A doubled size held back though the put's own size attached counts in the row of
    failures (its back-off grows), but no put went over the socket for it: the doubled size
    attaching later said 'staged puts resumed ... after 1 failure(s)', and the first put that
    did go over the socket, in that back-off, was warned as '2 failures in a row ... still go
    over the Unix socket' without the row's first line ('If this persists'). The agent's memory
    is made short for real (prlimit); the back-off's clock is the client's seam."""
    made = _counting_segments(monkeypatch)
    now_s = [1000.0]
    pid = agent.proc.pid
    puts = [[key(i, 110 + p) for i in range(n)] for p, n in enumerate((8, 9, 11, 21, 23))]
    data = {k: payload(k, MiB) for ks in puts for k in ks}  # 1 MiB chunks
    with agent.data("unix") as c, caplog.at_level(logging.INFO, logger="kvctl.client"):
        assert c.shm
        c._monotonic_s = lambda: now_s[0]

        def put(ks: list[bytes]) -> None:
            out = c.put_many([(k, data[k]) for k in ks], tenant="t")
            assert [o.status for o in out] == ["stored"] * len(ks)

        put(puts[0])
        hard = resource.prlimit(pid, resource.RLIMIT_AS)[1]
        try:
            # a 10 MiB mapping fits beside the 8 MiB one held; a 16 MiB one not
            resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 13 * MiB, hard))
            put(puts[1])  # needs 10 MiB
            assert made == [8 * MiB, 16 * MiB, 10 * MiB] and c._staging_failures == 1
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
        now_s[0] = c._staging_retry_at_s  # the back-off ran out: doubling again
        put(puts[2])  # needs 12 MiB: the doubled 20 MiB attaches
        assert made[3:] == [20 * MiB] and c._staging_failures == 0
        # no put went over the socket: nothing resumed
        assert _said(caplog, logging.INFO, "resumed") == []
        try:
            # a 22 MiB mapping fits beside the 20 MiB one held; a 40 MiB one not
            resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 30 * MiB, hard))
            put(puts[3])  # needs 22 MiB: the doubled 40 MiB held back
            assert made[4:] == [40 * MiB, 22 * MiB] and c._staging_failures == 1
            # within that back-off, a 24 MiB mapping beside the 22 MiB one held: not had
            resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 23 * MiB, hard))
            put(puts[4])  # needs 24 MiB: over the socket
            assert made[6:] == [24 * MiB] and len(c._staging) == 22 * MiB
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
        every = [k for ks in puts for k in ks]
        got = c.get_many(every, tenant="t")
        assert all(g is not None and bytes(g) == data[k] for g, k in zip(got, every, strict=True))
    warned = _said(caplog, logging.WARNING, "staging segment")
    # the first put over the socket is said as the row's first
    assert len(warned) == 1 and "If this persists" in warned[0], warned
    assert "in a row" not in warned[0] and "still go over" not in warned[0], warned
    assert "Traceback" not in agent.log()


def test_a_row_warned_of_ends_where_the_size_it_refused_attaches_below_a_doubled_refused(
    agent: Agent, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """After a WARNING that puts go over the socket (10 MiB refused), the back-off ran out and
    10 MiB attached while its doubled 16 MiB was refused: the doubled size's back-off kept the
    row going, so 'staged puts resumed' was never said, and the next failure within 10 minutes
    (STAGING_RELOG_SECONDS) was not warned of either. Now that attach ends the row (said), and
    the held-back doubled size starts one of its own. Memory short for real (prlimit)."""
    made = _counting_segments(monkeypatch)
    now_s = [1000.0]
    pid = agent.proc.pid
    puts = [[key(i, 120 + p) for i in range(n)] for p, n in enumerate((8, 9, 9, 11))]
    data = {k: payload(k, MiB) for ks in puts for k in ks}  # 1 MiB chunks
    with agent.data("unix") as c, caplog.at_level(logging.INFO, logger="kvctl.client"):
        assert c.shm
        c._monotonic_s = lambda: now_s[0]

        def put(ks: list[bytes]) -> None:
            out = c.put_many([(k, data[k]) for k in ks], tenant="t")
            assert [o.status for o in out] == ["stored"] * len(ks)

        put(puts[0])
        hard = resource.prlimit(pid, resource.RLIMIT_AS)[1]
        try:
            # neither a 16 nor a 10 MiB mapping beside the 8 MiB one held
            resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 9 * MiB, hard))
            put(puts[1])  # needs 10 MiB: over the socket, warned
            assert made == [8 * MiB, 16 * MiB, 10 * MiB] and len(c._staging) == 8 * MiB
            assert len(_said(caplog, logging.WARNING, "staging segment")) == 1
            # a 10 MiB mapping fits beside the 8 MiB one held; a 16 MiB one not
            resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 13 * MiB, hard))
            now_s[0] = c._staging_retry_at_s  # the back-off ran out
            put(puts[2])  # needs 10 MiB: attaches, its doubled 16 MiB refused
            assert made[3:] == [16 * MiB, 10 * MiB] and len(c._staging) == 10 * MiB
            resumed = _said(caplog, logging.INFO, "staged puts resumed")
            assert len(resumed) == 1 and "10485760 bytes" in resumed[0], resumed
            assert c._staging_failures == 1 and c._staging_refused_bytes == 16 * MiB
            # a second later, in the 16 MiB back-off: a 12 MiB mapping beside the 10 MiB one
            # held is not had either
            resource.prlimit(pid, resource.RLIMIT_AS, (_vm_bytes(pid) + 11 * MiB, hard))
            now_s[0] += 1.0 / 4
            put(puts[3])  # needs 12 MiB: over the socket, warned again
            assert made[5:] == [12 * MiB] and len(c._staging) == 10 * MiB
        finally:
            resource.prlimit(pid, resource.RLIMIT_AS, (hard, hard))
        every = [k for ks in puts for k in ks]
        got = c.get_many(every, tenant="t")
        assert all(g is not None and bytes(g) == data[k] for g, k in zip(got, every, strict=True))
    warned = _said(caplog, logging.WARNING, "staging segment")
    assert len(warned) == 2 and "12582912 bytes" in warned[1], warned
    assert "If this persists" in warned[1], warned
    assert "Traceback" not in agent.log()
