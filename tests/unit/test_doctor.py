"""`kvctl doctor`'s classification: clock skew, disk ratios, NVML statuses, agent answers, the
summary, and the library never raising on a database or agent that is not there."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest

from kvctl import __version__
from kvctl.agent_starting import STARTING_DETAIL, STARTING_PREFIX
from kvctl.client import AgentClient
from kvctl.db.inventory import NodeInfo
from kvctl.fleet.doctor import (
    FAIL,
    OK,
    SKIP,
    WARN,
    AgentProbe,
    Check,
    agent_checks,
    check_local_agent_config,
    check_local_nvml,
    classify_agent,
    classify_disk,
    classify_nvml,
    classify_skew,
    disk_usage_check,
    exit_code,
    nvml_status_from_dict,
    probe_agent,
    run_checks,
    skew_of,
    summarize,
)
from kvctl.nvml import NvmlReader, NvmlStatus
from tests.functional.agents import closed_port
from tests.not_an_agent import answering_url
from tests.starting_agent import starting_url

GiB = 1 << 30
MiB = 1 << 20
ROOT = Path(__file__).parents[2]


# --- clock skew -------------------------------------------------------------------------------


def test_skew_is_agent_time_minus_the_midpoint_and_the_round_trip_bounds_it() -> None:
    skew, rtt = skew_of(agent_time_s=1000.5, sent_s=999.0, received_s=1000.0)
    assert skew == pytest.approx(1.0) and rtt == pytest.approx(1.0)
    skew, rtt = skew_of(agent_time_s=100.0, sent_s=100.2, received_s=100.4)
    assert skew == pytest.approx(-0.3) and rtt == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("skew_s", "status"),
    [
        (0.0, OK),
        (0.999, OK),
        (-0.999, OK),
        (1.0, WARN),  # the threshold itself warns
        (-5.0, WARN),
        (29.9, WARN),
        (30.0, FAIL),
        (-3600.0, FAIL),
    ],
)
def test_skew_thresholds(skew_s: float, status: str) -> None:
    check = classify_skew("node-a", skew_s, 0.002, warn_s=1.0, fail_s=30.0)
    assert check.name == "clock node-a" and check.status == status
    assert check.values == {"skew_s": skew_s, "rtt_s": 0.002}
    assert "0.002 s round trip" in check.detail
    assert ("behind" in check.detail) == (skew_s < 0)
    if status == OK:
        assert check.fix is None
    else:
        assert check.fix is not None and "NTP" in check.fix and "node-a" in check.fix
        assert "chrony" in check.fix


def test_skew_thresholds_are_configurable() -> None:
    assert classify_skew("n", 0.2, 0.001, warn_s=0.1, fail_s=0.5).status == WARN
    assert classify_skew("n", 0.6, 0.001, warn_s=0.1, fail_s=0.5).status == FAIL


@pytest.mark.parametrize("skew_s", [None, math.nan, math.inf])
def test_missing_clock_reading_is_na_not_a_crash(skew_s: float | None) -> None:
    check = classify_skew("node-a", skew_s, None)
    assert check.status == SKIP and "N/A" in check.detail and check.fix is None


def test_missing_round_trip_still_classifies() -> None:
    check = classify_skew("n", 2.0, None)
    assert check.status == WARN and "± N/A" in check.detail


# --- disk -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("free", "status"),
    [
        (50 * GiB, OK),
        (10 * GiB, OK),  # exactly at the warning ratio: not below it
        (9 * GiB, WARN),
        (2 * GiB, WARN),  # exactly 2%: not below the failing ratio
        (1 * GiB, FAIL),
        (0, FAIL),
    ],
)
def test_disk_ratios(free: int, status: str) -> None:
    check = classify_disk("disk node-a", "/var/lib/kvctl", free, 100 * GiB, warn_ratio=0.10)
    assert check.status == status
    assert check.values["free_ratio"] == pytest.approx(free / (100 * GiB))
    assert "/var/lib/kvctl" in check.detail and "of 100.0 GiB" in check.detail
    assert (check.fix is None) == (status == OK)


def test_disk_fix_can_name_the_node() -> None:
    check = classify_disk("disk n", "/d", 1, 100, fix="free space under /d on n")
    assert check.status == FAIL and check.fix == "free space under /d on n"
    generic = classify_disk("disk n", "/d", 5, 100)
    assert generic.status == WARN and generic.fix is not None and "/d" in generic.fix


@pytest.mark.parametrize(
    ("free", "total"),
    [(None, 100), (10, None), (None, None), (0, 0), (5, -1), ("5", 100), (True, 2)],
)
def test_missing_disk_reading_is_na(free: Any, total: Any) -> None:
    check = classify_disk("disk n", None, free, total)
    assert check.status == SKIP and "N/A" in check.detail


def test_disk_usage_of_a_real_path_and_of_one_not_created_yet(tmp_path: Path) -> None:
    here = disk_usage_check("disk (local db)", tmp_path, warn_ratio=0.10)
    assert here.status in (OK, WARN, FAIL) and here.values["total_bytes"] > 0
    later = disk_usage_check("disk (local db)", tmp_path / "a" / "b", warn_ratio=0.10)
    # judged by the directory it will be created in
    assert later.values["total_bytes"] == here.values["total_bytes"]
    assert str(tmp_path / "a" / "b") in later.detail
    assert not (tmp_path / "a").exists()


# --- NVML -------------------------------------------------------------------------------------


class StandInNvml:
    """Stands in for pynvml on GPU hardware (or a broken driver) this machine does not have;
    the errors are pynvml's real NVMLError classes, so the hint matching runs for real."""

    def __init__(self, gpus: int = 0, init_error: BaseException | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlSystemGetNVMLVersion(self) -> str:
        return "12.550.54.15"


def test_nvml_statuses() -> None:
    ok = classify_nvml("nvml (local)", NvmlStatus(True, "550.54.15", "12.5", 8, None, None))
    assert ok.status == OK and "8 GPU(s)" in ok.detail and "550.54.15" in ok.detail
    assert ok.fix is None

    none_seen = classify_nvml("nvml n", NvmlStatus(True, "550", "12", 0, None, None), where="n")
    assert none_seen.status == WARN and none_seen.fix is not None and "--gpus" in none_seen.fix

    broken = NvmlStatus(False, None, None, 0, "Driver/library version mismatch", "Reboot it.")
    check = classify_nvml("nvml n", broken, where="n")
    # a CPU-only host or a broken driver is a warning: the node still serves KV caches
    assert check.status == WARN and "version mismatch" in check.detail
    assert check.fix == "on n: Reboot it."

    never_opened = classify_nvml("nvml n", NvmlStatus(False, None, None, 0, None, None))
    assert never_opened.status == WARN and never_opened.fix is not None
    assert "nvidia-smi" in never_opened.fix


def test_local_nvml_with_a_driver_library_mismatch_gives_the_reboot_hint() -> None:
    nvml = StandInNvml(init_error=pynvml.NVMLError(pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH))
    check = check_local_nvml(lambda: NvmlReader(nvml))
    assert check.name == "nvml (local)" and check.status == WARN
    assert check.fix is not None and "Reboot" in check.fix


def test_local_nvml_with_gpus() -> None:
    nvml = StandInNvml(gpus=2)
    check = check_local_nvml(lambda: NvmlReader(nvml))
    assert check.status == OK and "2 GPU(s)" in check.detail
    assert nvml.shutdowns == 1  # the doctor closes what it opened


def test_local_nvml_reader_that_raises_is_a_warning() -> None:
    def broken() -> Any:
        raise RuntimeError("no reader for you")

    check = check_local_nvml(broken)
    assert check.status == WARN and "no reader for you" in check.detail


def test_local_nvml_on_this_machine_never_raises() -> None:
    check = check_local_nvml()
    assert check.status in (OK, WARN)
    assert check.status == OK or check.fix


def test_agent_nvml_dict_with_missing_fields_reads_as_na() -> None:
    status = nvml_status_from_dict({"available": False, "device_count": "x"})
    assert status == NvmlStatus(False, None, None, 0, None, None)
    full = nvml_status_from_dict(
        {"available": True, "driver_version": "550", "device_count": 4, "error": None}
    )
    assert full.available and full.device_count == 4 and full.driver_version == "550"


# --- agents -----------------------------------------------------------------------------------

NODE = NodeInfo(1, "node-a", "fra", "http://10.0.0.7:7070", "H100", None)


def _healthy(**overrides: Any) -> AgentProbe:
    fields: dict[str, Any] = {
        "health": {"status": "ok", "name": "node-a", "dc": "fra", "time_s": 1000.0},
        "sent_s": 999.99,
        "received_s": 1000.01,
        "info": {
            "name": "node-a",
            "version": __version__,
            "data_dir": {
                "path": "/var/lib/kvctl",
                "free_bytes": 50 * GiB,
                "total_bytes": 100 * GiB,
            },
        },
        "gpus": {
            "nvml": {"available": True, "driver_version": "550", "device_count": 8},
            "gpus": [],
        },
    }
    fields.update(overrides)
    return AgentProbe(**fields)


def _by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_healthy_agent_gives_four_ok_rows() -> None:
    checks = classify_agent(NODE, _healthy())
    assert [c.name for c in checks] == [
        "agent node-a",
        "clock node-a",
        "nvml node-a",
        "disk node-a",
    ]
    assert {c.status for c in checks} == {OK}
    clock = _by_name(checks)["clock node-a"]
    assert clock.values["skew_s"] == pytest.approx(0.0)
    assert clock.values["rtt_s"] == pytest.approx(0.02)


@pytest.mark.parametrize(
    ("failure", "error", "in_fix"),
    [
        ("unreachable", "cannot reach the agent at http://10.0.0.7:7070", "kvctl agent start"),
        ("unreachable", "connection refused", "kvctl fleet ls"),
        ("not answering", "took the connection but did not answer", "hung or overloaded"),
        ("auth", "the agent refused the token", "KVCTL_TOKEN"),
        ("starting", f"{STARTING_DETAIL} (http://10.0.0.7:7070)", "`kvctl doctor` again shortly"),
        ("error", "404: Not Found", "kvctl fleet ls"),
    ],
)
def test_agent_that_does_not_answer_fails_with_a_fix(failure: str, error: str, in_fix: str) -> None:
    checks = classify_agent(NODE, AgentProbe(failure=failure, error=error))
    # the other rows would only repeat the cause
    assert len(checks) == 1
    (check,) = checks
    assert check.name == "agent node-a" and check.status == FAIL
    assert error in check.detail and check.fix is not None and in_fix in check.fix


def test_other_version_and_other_name_warn() -> None:
    probe = _healthy(
        health={"name": "gpu-17", "time_s": 1000.0},
        info={"version": "0.0.1", "data_dir": {"path": "/d", "free_bytes": 1, "total_bytes": 2}},
    )
    agent = _by_name(classify_agent(NODE, probe, local_version="0.1.0"))["agent node-a"]
    assert agent.status == WARN
    assert "0.0.1" in agent.detail and "0.1.0" in agent.detail and "'gpu-17'" in agent.detail
    assert agent.fix is not None and "same kvctl version" in agent.fix
    assert "--name node-a" in agent.fix


def test_missing_readings_are_na_never_a_crash() -> None:
    probe = _healthy(
        health={"name": "node-a"},  # an older agent: no time_s
        info=None,
        info_error="500: boom",
        gpus=None,
        gpus_error="404: Not Found",
    )
    rows = _by_name(classify_agent(NODE, probe))
    assert rows["agent node-a"].status == OK and "version N/A" in rows["agent node-a"].detail
    assert rows["clock node-a"].status == SKIP
    assert rows["nvml node-a"].status == SKIP and "404" in rows["nvml node-a"].detail
    assert rows["disk node-a"].status == SKIP and "500: boom" in rows["disk node-a"].detail
    odd = _healthy(health={"name": "node-a", "time_s": "soon"}, info={"data_dir": None})
    rows = _by_name(classify_agent(NODE, odd))
    assert rows["clock node-a"].status == SKIP and rows["disk node-a"].status == SKIP


def _with_dataplane(**dataplane: Any) -> AgentProbe:
    probe = _healthy()
    assert probe.info is not None
    return _healthy(info={**probe.info, "dataplane": {"tcp": None, "unix": "/s", **dataplane}})


def test_an_arena_on_huge_pages_is_ok_and_small_pages_warn_with_the_fix() -> None:
    on_huge = _with_dataplane(shm=True, shm_huge_page_bytes=4 * GiB, shmem_huge_pages="advise")
    row = _by_name(classify_agent(NODE, on_huge))["huge pages node-a"]
    assert row.status == OK and "4.0 GiB on huge pages" in row.detail

    small = _with_dataplane(shm=True, shm_huge_page_bytes=0, shmem_huge_pages="never")
    row = _by_name(classify_agent(NODE, small))["huge pages node-a"]
    assert row.status == WARN and "4 KiB pages (shmem_enabled never)" in row.detail
    assert row.fix is not None and "echo advise > /sys/kernel/mm/transparent_hugepage" in row.fix
    assert "node-a" in row.fix and row.values == {
        "shm_huge_page_bytes": 0,
        "shmem_huge_pages": "never",
    }


def test_huge_pages_allowed_but_not_taken_asks_for_a_restart() -> None:
    probe = _with_dataplane(shm=True, shm_huge_page_bytes=0, shmem_huge_pages="advise")
    row = _by_name(classify_agent(NODE, probe))["huge pages node-a"]
    assert row.status == WARN and row.fix is not None and "restart the agent" in row.fix
    assert "echo" not in row.fix


def test_no_huge_page_row_without_shared_memory_and_na_from_an_older_agent() -> None:
    rows = _by_name(classify_agent(NODE, _with_dataplane(shm=False)))
    assert "huge pages node-a" not in rows
    older = _by_name(classify_agent(NODE, _with_dataplane(shm=True)))  # fields not reported
    assert older["huge pages node-a"].status == SKIP and "N/A" in older["huge pages node-a"].detail


def test_agent_skew_and_disk_use_the_thresholds() -> None:
    probe = _healthy(
        health={"name": "node-a", "time_s": 1045.0},
        info={
            "version": __version__,
            "data_dir": {"path": "/d", "free_bytes": 5, "total_bytes": 100},
        },
        gpus={"nvml": {"available": False, "error": "NVML Shared Library Not Found", "hint": "h"}},
    )
    rows = _by_name(classify_agent(NODE, probe, skew_fail_s=30.0, disk_warn_ratio=0.10))
    assert rows["clock node-a"].status == FAIL and "45.000 s ahead" in rows["clock node-a"].detail
    assert rows["disk node-a"].status == WARN
    assert rows["disk node-a"].fix is not None and "on node-a" in rows["disk node-a"].fix
    assert rows["nvml node-a"].status == WARN and rows["nvml node-a"].fix == "on node-a: h"


def test_probe_of_a_closed_port_is_unreachable() -> None:
    with AgentClient(f"http://127.0.0.1:{closed_port()}", token="", timeout_s=2.0) as client:
        probe = probe_agent(client)
    assert probe.failure == "unreachable" and probe.error


def test_probe_of_a_starting_agent_is_starting_not_an_error() -> None:
    with starting_url() as url, AgentClient(url, token="", timeout_s=2.0) as client:
        probe = probe_agent(client)
    assert probe.failure == "starting" and probe.health is None
    assert probe.error is not None and probe.error.startswith(STARTING_PREFIX)
    assert url in probe.error
    (check,) = classify_agent(NODE, probe)
    # not healthy yet: a failure, worded as starting, with the wait (not a URL) as its fix
    assert check.status == FAIL and check.detail.startswith(STARTING_PREFIX)
    assert check.fix is not None and "opening its tiers" in check.fix
    assert "agent.log" in check.fix and "kvctl fleet ls" not in check.fix


def test_agent_checks_with_a_bad_url_and_a_closed_port_do_not_raise() -> None:
    nodes = [
        NodeInfo(1, "bad", "fra", "ftp://x", "", None),
        NodeInfo(2, "down", "fra", f"http://127.0.0.1:{closed_port()}", "", None),
    ]
    checks = agent_checks(nodes, token="", timeout_s=2.0)
    assert [(c.name, c.status) for c in checks] == [("agent bad", FAIL), ("agent down", FAIL)]
    assert "ftp://x" in checks[0].detail


# --- the report ---------------------------------------------------------------------------------


def test_summary_and_exit_code() -> None:
    checks = [
        Check("a", OK, "fine"),
        Check("b", WARN, "meh", "do x"),
        Check("c", SKIP, "n/a"),
        Check("d", OK, "fine"),
    ]
    assert summarize(checks) == {"ok": 2, "warn": 1, "fail": 0, "skip": 1}
    assert exit_code(checks) == 0
    checks.append(Check("e", FAIL, "broken", "fix it"))
    assert summarize(checks)["fail"] == 1 and exit_code(checks) == 1
    assert summarize([]) == {"ok": 0, "warn": 0, "fail": 0, "skip": 0}


def test_check_is_one_line_and_validated() -> None:
    check = Check("database", FAIL, "connection refused\n  Is the server running?", "start\nit")
    assert check.detail == "connection refused Is the server running?" and check.fix == "start it"
    assert check.as_dict() == {
        "name": "database",
        "status": FAIL,
        "detail": check.detail,
        "fix": "start it",
        "values": {},
    }
    with pytest.raises(ValueError, match="status"):
        Check("x", "bad", "")


# --- run_checks without a usable database ---------------------------------------------------------


def test_unreachable_postgresql_fails_with_a_fix_and_skips_agents() -> None:
    checks = _by_name(run_checks("postgresql://nobody@127.0.0.1:1/x", local_config=False))
    db = checks["database"]
    assert db.status == FAIL and "127.0.0.1" in db.detail
    assert db.fix is not None and "PostgreSQL" in db.fix and "KVCTL_DB_URL" in db.fix
    assert checks["agents"].status == SKIP and "unusable" in checks["agents"].detail
    assert "nvml (local)" in checks  # this machine is still checked


def test_bad_database_url_fails() -> None:
    checks = _by_name(run_checks("mysql://x/y", local_config=False))
    assert checks["database"].status == FAIL and "--db" in (checks["database"].fix or "")


def test_missing_sqlite_file_is_not_created(tmp_path: Path) -> None:
    """A database file named (--db) and missing fails: more likely mistyped than not made
    yet, and a health check must not pass having checked no agent (before: a warning, exit
    0). The default file missing, on a machine not set up yet, warns."""
    path = tmp_path / "state" / "metrics.db"
    checks = _by_name(run_checks(f"sqlite:///{path}", local_config=False))
    assert checks["database"].status == FAIL
    assert checks["database"].detail == f"no database at {path}"
    assert "kvctl fleet import" in (checks["database"].fix or "")
    assert checks["disk (local db)"].status in (OK, WARN, FAIL)
    assert checks["agents"].status == SKIP
    assert not path.exists() and not path.parent.exists()


def test_the_default_database_missing_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCTL_DB_URL", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    checks = _by_name(run_checks(None, local_config=False))
    assert checks["database"].status == WARN
    assert checks["database"].detail.startswith("no database yet at ")
    assert str(tmp_path / "state") in checks["database"].detail
    assert checks["agents"].status == SKIP


def test_empty_sqlite_database_warns_about_schema_and_inventory(sqlite_url: str) -> None:
    from kvctl.db.migrate import open_db

    open_db(sqlite_url).dispose()
    checks = _by_name(run_checks(sqlite_url, local_config=False))
    assert checks["database"].status == OK and checks["database schema"].status == OK
    inventory = checks["fleet inventory"]
    assert inventory.status == WARN and "kvctl fleet add-node" in (inventory.fix or "")
    assert checks["agents"].status == SKIP
    unknown = _by_name(run_checks(sqlite_url, nodes=["ghost"], local_config=False))
    assert unknown["fleet inventory"].status == WARN  # no nodes at all: nothing to select


# --- this machine's agent config ------------------------------------------------------------------


def test_local_agent_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("KVCTL_CONFIG", raising=False)
    assert check_local_agent_config() == []  # no file: nothing to say

    good = tmp_path / "agent.toml"
    good.write_text(f'[agent]\nname = "n1"\ndata_dir = "{tmp_path / "data"}"\n')
    monkeypatch.setenv("KVCTL_CONFIG", str(good))
    config, disk = check_local_agent_config()
    assert config.status == OK and str(good) in config.detail
    assert disk.name == "disk (local agent)" and str(tmp_path / "data") in disk.detail

    bad = tmp_path / "bad.toml"
    bad.write_text('[agent]\ncpu = "lots"\n')
    monkeypatch.setenv("KVCTL_CONFIG", str(bad))
    (check,) = check_local_agent_config()
    assert check.status == FAIL and "cpu" in check.detail and check.fix


def test_library_imports_no_cli_framework(tmp_path: Path) -> None:
    # rich and click may arrive with httpx's own CLI; typer must not come from the library
    code = (
        "import sys; from kvctl.fleet.doctor import run_checks; "
        f"run_checks('sqlite:///{tmp_path}/none.db', local_config=False); "
        "print(' '.join(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert "typer" not in {m.split(".")[0] for m in out.stdout.split()}
    source = (ROOT / "kvctl" / "fleet" / "doctor.py").read_text()
    assert "import typer" not in source and "from rich" not in source


def test_a_refused_token_is_said_once_and_the_agent_is_not_called_down() -> None:
    with (
        answering_url(401, b'{"detail": "bad token"}', "application/json") as url,
        AgentClient(url, token="", timeout_s=2.0) as client,
    ):
        probe = probe_agent(client)
    (check,) = classify_agent(NodeInfo(1, "node-a", "fra", url, "", None), probe)
    assert check.status == FAIL and check.detail.count("token") == 2  # "needs a token", KVCTL_TOKEN
    assert "is up but needs a token" in check.detail and "refused the token:" not in check.detail
    assert check.fix is not None and "KVCTL_TOKEN" in check.fix and "agent start" not in check.fix


def _filled(free_bytes: int, disk: dict[str, int] | None) -> Check:
    info: dict[str, Any] = {
        "name": "node-a",
        "version": __version__,
        "data_dir": {"path": "/d", "free_bytes": free_bytes, "total_bytes": 100 * GiB},
        "tiers": [{"name": "cpu", "capacity_bytes": GiB, "used_bytes": GiB}]
        + ([{"name": "disk", **disk}] if disk else []),
    }
    return _by_name(classify_agent(NODE, _healthy(info=info)))["disk node-a"]


def test_a_volume_filled_by_the_agents_own_disk_tier_warns_not_fails() -> None:
    """A disk tier sized to fill its volume leaves under 2% free by design: it failed as if
    the disk were in trouble, its fix a restart with a smaller --disk."""
    mine = _filled(GiB, {"capacity_bytes": 95 * GiB, "used_bytes": 94 * GiB + 512 * MiB})
    assert mine.status == WARN and "held by its disk tier" in mine.detail
    assert mine.fix is not None and "kvctl resize --node node-a --tier disk" in mine.fix
    # the tier may still grow by more than is free: it will hit a full disk, a failure
    short = _filled(GiB, {"capacity_bytes": 95 * GiB, "used_bytes": 90 * GiB})
    assert short.status == FAIL and "may still grow by 5.0 GiB" in short.detail
    assert short.fix is not None and "kvctl resize --node node-a --tier disk" in short.fix
    # no disk tier: the volume is full of something else
    assert _filled(GiB, None).status == FAIL


def test_an_agent_that_predates_a_data_plane_feature_warns_whatever_its_version() -> None:
    """In a rolling upgrade every build says version 0.1.0, so the version row passes an old
    agent: the features row tells it. One whose /v1/info has no ``features`` (every agent
    before them, e.g. 2026-11-28's, without FETCH/PUT checksums and GET_COUNTED) warns and
    says what to upgrade; one lacking a feature names it; a current one is ok."""
    from kvctl.wire.protocol import DATA_PLANE_FEATURES

    older = _by_name(classify_agent(NODE, _with_dataplane(shm=False), local_version="0.1.0"))
    assert older["agent node-a"].status == OK  # same version: the version row cannot tell
    row = older["features node-a"]
    assert row.status == WARN and "predates" in row.detail
    assert row.fix is not None and "upgrade kvctl on node-a" in row.fix
    lacking = {k: v for k, v in DATA_PLANE_FEATURES.items() if k != "get_counted"}
    row = _by_name(classify_agent(NODE, _with_dataplane(features=lacking)))["features node-a"]
    assert row.status == WARN and row.detail == "the data plane lacks GET_COUNTED"
    current = {**DATA_PLANE_FEATURES, "a_later_feature": True}  # a newer agent's: not asked
    row = _by_name(classify_agent(NODE, _with_dataplane(features=current)))["features node-a"]
    assert row.status == OK
