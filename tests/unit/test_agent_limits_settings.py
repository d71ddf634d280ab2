"""The data plane's cap on connections one address holds before they authenticate is a
setting like its siblings: in the file, the environment and ``kvctl agent config --show``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvctl.agent.config import ConfigError, describe, load_settings

KEY = "data_max_unauthenticated_per_source"


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """An environment with no config file in its default places."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}


def test_the_per_source_cap_is_a_setting(tmp_path: Path, env: dict[str, str]) -> None:
    assert getattr(load_settings(env=env).settings, KEY) == 32
    config = tmp_path / "agent.toml"
    config.write_text(f"[agent]\n{KEY} = 8\n")
    assert getattr(load_settings(config_file=config, env=env).settings, KEY) == 8
    loaded = load_settings(env={**env, "KVCTL_DATA_MAX_UNAUTHENTICATED_PER_SOURCE": "4"})
    assert getattr(loaded.settings, KEY) == 4
    assert loaded.sources[KEY] == "env:KVCTL_DATA_MAX_UNAUTHENTICATED_PER_SOURCE"
    shown = {row["setting"]: row for row in describe(loaded)}
    assert shown[KEY]["value"] == "4"
    config.write_text(f"[agent]\n{KEY} = 0\n")
    with pytest.raises(ConfigError, match=KEY):
        load_settings(config_file=config, env=env)


def test_the_per_source_cap_on_all_tcp_connections_is_a_setting(
    tmp_path: Path, env: dict[str, str]
) -> None:
    key = "data_max_connections_per_source"
    assert getattr(load_settings(env=env).settings, key) == 256
    config = tmp_path / "agent.toml"
    config.write_text(f"[agent]\n{key} = 64\n")
    assert getattr(load_settings(config_file=config, env=env).settings, key) == 64
    loaded = load_settings(env={**env, "KVCTL_DATA_MAX_CONNECTIONS_PER_SOURCE": "16"})
    assert getattr(loaded.settings, key) == 16
    assert loaded.sources[key] == "env:KVCTL_DATA_MAX_CONNECTIONS_PER_SOURCE"
    assert {row["setting"]: row for row in describe(loaded)}[key]["value"] == "16"
    config.write_text(f"[agent]\n{key} = 0\n")
    with pytest.raises(ConfigError, match=key):
        load_settings(config_file=config, env=env)
