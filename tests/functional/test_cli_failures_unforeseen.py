"""A failure no command foresaw (a bug) through the `kvctl` entry point: one line on stderr
naming it and exit 1, not a screenful of rich traceback in an operator's terminal or a
script's log; KVCTL_DEBUG=1 shows the traceback to report."""

from __future__ import annotations

import sys
from typing import NoReturn

import pytest

import kvctl.tokenize
from kvctl.cli.main import _unforeseen, main


def _bug(*args: object, **kw: object) -> NoReturn:
    raise RuntimeError("boom [/x]")  # markup-looking text too: shown as it is


def test_an_unforeseen_failure_is_one_line_and_exit_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(kvctl.tokenize, "tokenize", _bug)
    monkeypatch.setattr(sys, "argv", ["kvctl", "keys", "--text", "a b"])
    monkeypatch.delenv("KVCTL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 1
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: kvctl failed where it did not expect to: RuntimeError: boom [/x]")
    assert "KVCTL_DEBUG=1" in err and "Traceback" not in err


def test_kvctl_debug_lets_the_traceback_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvctl.tokenize, "tokenize", _bug)
    monkeypatch.setattr(sys, "argv", ["kvctl", "keys", "--text", "a b"])
    monkeypatch.setenv("KVCTL_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main()


def test_a_permission_denied_names_the_file_and_the_user_to_run_as_not_a_bug(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Another user's agent (its data dir 0700, its process) denied kvctl a read or a signal no
    command catches (`kvctl agent stop` by another user): it said 'kvctl failed where it did not
    expect to' and asked for a bug report, where the fix is running as the agent's user."""
    denied = PermissionError(13, "Permission denied", "/var/lib/kvctl/gpu-07/agent.json")
    with pytest.raises(SystemExit) as exited:
        _unforeseen(denied)
    assert exited.value.code == 1
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("error: permission denied: /var/lib/kvctl/gpu-07/agent.json"), err
    assert "run kvctl as that user, or as root" in err
    assert "did not expect" not in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        _unforeseen(PermissionError(1, "Operation not permitted"))  # a signal: no file
    assert "error: permission denied (Operation not permitted)" in capsys.readouterr().err
