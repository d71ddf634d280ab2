"""``agent.json``: only what an agent wrote is taken as an agent's record, so no command signals
a pid or asks a control URL that a torn or hand-edited file made up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvctl.agent.daemon import AgentState, NoAgentHere, control_url_for, recorded_agent

GOOD = {"pid": 4242, "name": "a", "dc": "local", "control_url": "http://127.0.0.1:7070",
        "data_tcp": None, "data_unix": None, "started_s": 1.0, "version": "0"}  # fmt: skip


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{",
        "[]",
        "null",
        "{}",
        '{"pid": "4242", "control_url": "http://x"}',
        '{"pid": true, "control_url": "http://x"}',
        '{"pid": 0, "control_url": "http://x"}',
        '{"pid": 4242, "control_url": ""}',
        "[" * 100_000,  # nested too deep for Python's parser: RecursionError, not ValueError
        # past a pid_t: .alive's os.kill raised OverflowError
        '{"pid": 2147483648, "control_url": "http://x"}',
        '{"pid": 100000000000000000000, "control_url": "http://x"}',
    ],
)
def test_anything_but_an_agents_record_is_none(text: str) -> None:
    assert AgentState.parse(text) is None


def test_an_agents_record_is_read_back() -> None:
    state = AgentState.parse(json.dumps(GOOD))
    assert state is not None and state.pid == 4242 and state.control_url == GOOD["control_url"]


def test_a_named_data_dir_without_a_record_never_falls_back_to_the_configured_url(
    tmp_path: Path,
) -> None:
    configured = "http://127.0.0.1:47070"
    assert control_url_for(tmp_path, configured, named=False) == configured
    with pytest.raises(NoAgentHere, match=r"holds no agent\.json") as exc:
        control_url_for(tmp_path, configured, named=True)
    assert f"kvctl agent start --data-dir {tmp_path} --detach" in exc.value.hint
    (tmp_path / "agent.json").write_text("[]")
    with pytest.raises(NoAgentHere, match="is not an agent's record"):
        recorded_agent(tmp_path)
    with pytest.raises(NoAgentHere, match="no such directory"):
        recorded_agent(tmp_path / "nope")


def test_a_record_that_is_not_utf8_is_no_agents_record(tmp_path: Path) -> None:
    """Bytes no agent writes (a damaged file: 0xff is never UTF-8) are not an agent's record,
    as any other damaged file is: `kvctl agent start`, `status` and `stop` said "a bug in
    kvctl" (UnicodeDecodeError) and the start refused to run."""
    (tmp_path / "agent.json").write_bytes(b"\xff\xfe\x00" + json.dumps(GOOD).encode())
    assert AgentState.read(tmp_path) is None
    with pytest.raises(NoAgentHere, match="is not an agent's record"):
        recorded_agent(tmp_path)
