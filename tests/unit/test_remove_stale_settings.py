"""What an agent starting on a data dir removes of the settings files starts left there
(remove_stale_settings): only regular files of this user named for a start that is gone; what
else bears such a name is left as it is, and nothing there keeps the agent from starting (serve()
calls it before anything else, so an exception here was a start that failed)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvctl.agent.daemon import remove_stale_settings


def _dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def test_what_no_start_of_ours_wrote_is_left_and_the_start_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory bearing the old file's name made the start fail (IsADirectoryError), as did a
    name whose 'pid' int() refuses ('²' passes str.isdigit) or os.kill cannot take (OverflowError);
    a symlink planted under the name was deleted. Now each is left, and the stale file beside them
    still removed."""
    (tmp_path / "agent-settings.toml").mkdir()
    odd = [tmp_path / "agent-settings.\u00b2.toml", tmp_path / f"agent-settings.{10**20}.toml"]
    for path in odd:
        path.write_text("[agent]\n")
    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text("[agent]\n")
    planted = tmp_path / "agent-settings.1.toml.d"  # not the pattern: never looked at
    planted.write_text("")
    link = tmp_path / f"agent-settings.{_dead_pid()}.toml"
    link.symlink_to(elsewhere)
    dead = tmp_path / f"agent-settings.{_dead_pid()}.toml"
    dead.write_text('[agent]\ntoken = "s3cret"\n')
    with caplog.at_level(logging.WARNING, logger="kvctl.agent"):
        removed = remove_stale_settings(tmp_path)
    assert removed == [dead] and not dead.exists()
    assert (tmp_path / "agent-settings.toml").is_dir() and link.is_symlink()
    assert all(path.exists() for path in odd) and elsewhere.exists() and planted.exists()
    assert f"{link} is named like the settings" in caplog.text, caplog.text
    assert "not a regular file" in caplog.text


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file of another user takes root")
def test_another_users_file_is_not_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """In a data dir others can write to (a shared one warns, but serves), a file another user
    left under the old name was deleted; it is that user's, not this agent's, to remove."""
    theirs = tmp_path / "agent-settings.toml"
    theirs.write_text("[agent]\n")
    os.chown(theirs, 65534, 65534)
    with caplog.at_level(logging.WARNING, logger="kvctl.agent"):
        assert remove_stale_settings(tmp_path) == []
    assert theirs.exists()
    assert "owner uid 65534" in caplog.text, caplog.text
