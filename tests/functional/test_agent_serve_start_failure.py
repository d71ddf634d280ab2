"""An agent whose start fails part-way in ``serve`` closes what it had opened: the control
socket (its port), and once the runtime is open, the runtime (the disk tier's lock, the arena,
the retry thread). Before, a failure between ``AgentRuntime.open`` and the ``try`` that closes
things (the data plane's construction, a Ctrl-C at that moment) left all of it open in a
process that may go on (an embedder, a test run): another agent could not take the data
directory (DirectoryInUse) nor the port.

Checked on the real things: the disk tier's flock is taken again by a fresh runtime in this
process (flock conflicts between two opens of the file, in one process too), and the control
port is bound again."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvctl.agent import daemon, dataplane
from kvctl.agent.runtime import AgentRuntime
from kvctl.agent.settings import AgentSettings
from kvctl.ports import free_loopback_port
from kvctl.store.errors import DirectoryInUse, TierUnavailable
from kvctl.store.tiers.disk import DiskTier


def _settings(tmp_path: Path, port: int) -> AgentSettings:
    return AgentSettings(
        name="s1",
        data_dir=str(tmp_path / "data"),
        listen=f"127.0.0.1:{port}",
        data_listen="off",
        socket="off",
        cpu_bytes=1 << 20,
        disk_bytes=4 << 20,
        shm=False,
    )


def _port_free(port: int) -> bool:
    """The control port can be listened on again (a socket still listening there holds it,
    SO_REUSEADDR or not)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen(1)
        except OSError:
            return False
        return True


class _Interrupted(KeyboardInterrupt):
    """A Ctrl-C that lands while the data plane is being built."""


def test_a_failed_data_plane_construction_closes_the_runtime_and_the_control_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_loopback_port()
    settings = _settings(tmp_path, port)
    built: list[AgentRuntime] = []

    def interrupted(runtime: AgentRuntime, **_limits: object) -> None:
        built.append(runtime)
        raise _Interrupted

    # serve imports DataPlaneServer from its module when it runs
    monkeypatch.setattr(dataplane, "DataPlaneServer", interrupted)
    with pytest.raises(_Interrupted) as raised:
        daemon.serve(settings)
    assert raised.traceback  # held, with serve's frame, while the rest is checked
    [runtime] = built
    with pytest.raises(TierUnavailable, match="closed"):  # its store (the arena) closed
        runtime.store.put(b"k" * 16, b"chunk")
    assert _port_free(port)
    # the disk tier's lock is free: another runtime opens the data directory here and now
    again = AgentRuntime.open(settings)
    try:
        assert "disk" in again.store.tier_names and not again.store.absent_tiers
    finally:
        again.close()


def test_a_failed_runtime_open_closes_the_control_socket(tmp_path: Path) -> None:
    port = free_loopback_port()
    settings = _settings(tmp_path, port)
    # another holder of the disk directory: the runtime's open raises DirectoryInUse
    with DiskTier(settings.data_path / "disk", 4 << 20), pytest.raises(DirectoryInUse) as raised:
        daemon.serve(settings)
    # checked while the error is held (its traceback holds serve's frame, as a caller that
    # logs or keeps it does): only dropping the last reference to a leaked socket closes it
    assert raised.traceback and _port_free(port)
