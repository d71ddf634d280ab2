"""The agent's layered configuration: defaults < TOML file < KVCTL_* environment < flags."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvctl.agent.config import (
    ConfigError,
    LoadedSettings,
    default_config_path,
    describe,
    load_settings,
)
from kvctl.agent.settings import AgentSettings, ModelSpec
from kvctl.errors import InvalidArgument


@pytest.fixture(autouse=True)
def short_state_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    # AgentSettings.data_path reads XDG_STATE_HOME from the process environment; pin it so the
    # derived socket path is short and the same on every machine (nothing is created there)
    monkeypatch.setenv("XDG_STATE_HOME", "/tmp/kvctl-test-state")


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """An environment with no config file in its default places."""
    return {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return tmp_path / "agent.toml"


def load_file(path: Path, text: str, **kwargs: object) -> LoadedSettings:
    write(path, text)
    kwargs.setdefault("env", {})
    return load_settings(config_file=path, **kwargs)  # type: ignore[arg-type]


# --- defaults and file discovery --------------------------------------------------------------


def test_defaults_when_nothing_is_set(env: dict[str, str]) -> None:
    loaded = load_settings(env=env)
    defaults = AgentSettings()
    for f in dataclasses.fields(AgentSettings):
        assert getattr(loaded.settings, f.name) == getattr(defaults, f.name), f.name
    assert set(loaded.sources.values()) == {"default"}
    assert set(loaded.sources) == {f.name for f in dataclasses.fields(AgentSettings)}
    assert loaded.config_file is None


def test_default_config_path_order(tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    assert default_config_path({"HOME": home}) == Path(home, ".config", "kvctl", "agent.toml")
    xdg = {"HOME": home, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    assert default_config_path(xdg) == tmp_path / "xdg" / "kvctl" / "agent.toml"
    chosen = {**xdg, "KVCTL_CONFIG": str(tmp_path / "mine.toml")}
    assert default_config_path(chosen) == tmp_path / "mine.toml"
    # relative XDG paths are invalid per the XDG spec and are skipped
    relative = {"HOME": home, "XDG_CONFIG_HOME": "relative/dir"}
    assert default_config_path(relative) == Path(home, ".config", "kvctl", "agent.toml")


def test_file_at_default_path_is_read(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path / "xdg" / "kvctl" / "agent.toml", '[agent]\ndc = "us-west"\n')
    loaded = load_settings(env=env)
    assert loaded.settings.dc == "us-west"
    assert loaded.sources["dc"] == f"file:{path}"
    assert loaded.config_file == path


def test_home_fallback_is_read(tmp_path: Path) -> None:
    path = write(tmp_path / ".config" / "kvctl" / "agent.toml", '[agent]\ndc = "home-dc"\n')
    loaded = load_settings(env={"HOME": str(tmp_path)})
    assert loaded.settings.dc == "home-dc"
    assert loaded.config_file == path


def test_kvctl_config_chooses_the_file(tmp_path: Path, env: dict[str, str]) -> None:
    path = write(tmp_path / "elsewhere.toml", '[agent]\ndc = "picked"\n')
    loaded = load_settings(env={**env, "KVCTL_CONFIG": str(path)})
    assert loaded.settings.dc == "picked"
    assert loaded.sources["dc"] == f"file:{path}"


def test_missing_explicit_file_is_an_error(tmp_path: Path, env: dict[str, str]) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_settings(config_file=missing, env=env)
    assert str(missing) in str(info.value)


def test_missing_file_named_by_kvctl_config_is_an_error(
    tmp_path: Path, env: dict[str, str]
) -> None:
    missing = tmp_path / "typo.toml"
    with pytest.raises(ConfigError, match="KVCTL_CONFIG") as info:
        load_settings(env={**env, "KVCTL_CONFIG": str(missing)})
    assert str(missing) in str(info.value)


def test_bad_toml_names_file_and_position(config: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML") as info:
        load_file(config, '[agent]\ncpu = "64GiB\n')
    message = str(info.value)
    assert str(config) in message
    assert "line 2" in message  # tomllib's own message is kept


def test_a_byte_order_mark_at_the_files_start_is_dropped(config: Path) -> None:
    """A Windows editor's BOM made the file 'not valid TOML: Invalid statement (at line 1,
    column 1)'; ae27cc3 dropped it from option files but not from the agent's config file."""
    config.write_bytes(b"\xef\xbb\xbf[agent]\nchunk_tokens = 512\n")
    assert load_settings(config_file=config, env={}).settings.chunk_tokens == 512


def test_a_file_nested_thousands_deep_is_not_valid_toml_not_a_bug(config: Path) -> None:
    """tomllib raises RecursionError (no TOMLDecodeError) on '[[[[...' thousands deep: out of
    load_settings, kvctl agent start said a bug's line, not the file's fault."""
    with pytest.raises(ConfigError, match="not valid TOML: nested too deep"):
        load_file(config, "[agent]\nx = " + "[" * 5000 + "]" * 5000 + "\n")


def test_config_error_is_an_invalid_argument(config: Path) -> None:
    with pytest.raises(InvalidArgument):
        load_file(config, "[agent]\nchunk_tokens = 0\n")


# --- precedence -------------------------------------------------------------------------------


def test_precedence_default_file_env_flag(config: Path) -> None:
    write(
        config,
        '[agent]\ncpu = "2GiB"\ndisk = "10GiB"\neviction = "lru"\ndc = "file-dc"\n',
    )
    loaded = load_settings(
        config_file=config,
        env={"KVCTL_CPU": "4GiB", "KVCTL_EVICTION": "priority"},
        flags={"cpu": "8GiB", "data_dir": "/srv/kv", "dc": None},
    )
    s = loaded.settings
    assert s.cpu_bytes == 8 << 30
    assert loaded.sources["cpu_bytes"] == "flag:--cpu"
    assert s.eviction == "priority"
    assert loaded.sources["eviction"] == "env:KVCTL_EVICTION"
    assert s.disk_bytes == 10 << 30
    assert loaded.sources["disk_bytes"] == f"file:{config}"
    assert s.dc == "file-dc"  # a None flag is "not given"
    assert loaded.sources["dc"] == f"file:{config}"
    assert s.data_dir == "/srv/kv"
    assert loaded.sources["data_dir"] == "flag:--data-dir"
    assert s.log_level == "info"
    assert loaded.sources["log_level"] == "default"
    assert loaded.config_file == config


def test_empty_env_values_are_ignored(config: Path) -> None:
    loaded = load_file(config, '[agent]\ncpu = "2GiB"\n', env={"KVCTL_CPU": "", "KVCTL_DC": "  "})
    assert loaded.settings.cpu_bytes == 2 << 30
    assert loaded.sources["cpu_bytes"] == f"file:{config}"
    assert loaded.sources["dc"] == "default"


def test_settings_are_frozen(env: dict[str, str]) -> None:
    loaded = load_settings(env=env, flags={"cpu": 4096})
    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.settings.cpu_bytes = 1  # type: ignore[misc]


# --- sizes ------------------------------------------------------------------------------------


def test_sizes_from_file_strings_ints_and_full_names(config: Path) -> None:
    loaded = load_file(config, '[agent]\ncpu = "512MiB"\ndisk = 0\nmax_chunk_bytes = 1048576\n')
    s = loaded.settings
    assert (s.cpu_bytes, s.disk_bytes, s.max_chunk_bytes) == (512 << 20, 0, 1 << 20)
    assert loaded.sources["max_chunk_bytes"] == f"file:{config}"


def test_sizes_from_env_and_flags(env: dict[str, str]) -> None:
    loaded = load_settings(
        env={**env, "KVCTL_CPU": "64GiB", "KVCTL_DISK": "1TB", "KVCTL_MAX_CHUNK": "4096"},
        flags={"disk": 0, "max_chunk": "1MiB"},
    )
    s = loaded.settings
    assert s.cpu_bytes == 64 << 30
    assert loaded.sources["cpu_bytes"] == "env:KVCTL_CPU"
    assert s.disk_bytes == 0
    assert loaded.sources["disk_bytes"] == "flag:--disk"
    assert s.max_chunk_bytes == 1 << 20
    assert loaded.sources["max_chunk_bytes"] == "flag:--max-chunk"


@pytest.mark.parametrize(
    ("env_value", "problem"),
    [("lots", "not a size"), ("0", "at least 1"), ("12parsecs", "unknown size unit")],
)
def test_bad_cpu_size_from_env(env: dict[str, str], env_value: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem) as info:
        load_settings(env={**env, "KVCTL_CPU": env_value})
    message = str(info.value)
    assert "cpu" in message and "env:KVCTL_CPU" in message
    assert "KVCTL_CPU=64GiB" in message  # an example of a good value
    assert info.value.setting == "cpu_bytes"
    assert info.value.source == "env:KVCTL_CPU"


def test_short_and_full_spelling_together_is_refused(config: Path) -> None:
    with pytest.raises(ConfigError, match="given twice"):
        load_file(config, '[agent]\ncpu = "1GiB"\ncpu_bytes = 1024\n')


# --- typos and wrong types --------------------------------------------------------------------


def test_unknown_key_is_refused_with_valid_keys_listed(config: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_file(config, '[agent]\ncpu_size = "1GiB"\n')
    message = str(info.value)
    assert "'cpu_size'" in message
    assert str(config) in message
    assert "disk" in message and "log_level" in message  # the valid keys
    # a near miss gets a suggestion
    with pytest.raises(ConfigError, match="did you mean 'eviction'"):
        load_file(config, '[agent]\nevicton = "lru"\n')


def test_setting_outside_agent_table_is_refused(config: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[agent\]") as info:
        load_file(config, 'cpu = "1GiB"\n')
    assert "'cpu'" in str(info.value)


def test_unknown_flag_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="'cpus'"):
        load_settings(env=env, flags={"cpus": "1GiB"})


@pytest.mark.parametrize(
    ("flag", "value", "spelled"),
    [("peers", ["bad"], "--peer fra-2="), ("links", ["bad"], "--link pool:")],
)
def test_a_repeatable_flags_error_names_the_flag_as_typed(
    env: dict[str, str], flag: str, value: list[str], spelled: str
) -> None:
    # `kvctl agent start` takes --peer and --link, once per item: an error naming --peers
    # would send the operator to a flag that does not exist
    with pytest.raises(ConfigError) as info:
        load_settings(env=env, flags={flag: value})
    message = str(info.value)
    assert f"from flag:{spelled.split()[0]}:" in message and f"for example: {spelled}" in message
    assert f"--{flag}" not in message
    loaded = load_settings(env=env, flags={"peers": ["fra-2=10.1.0.7:7071"]})
    assert loaded.sources["peers"] == "flag:--peer"


@pytest.mark.parametrize(
    ("line", "setting"),
    [
        ("cpu = true", "cpu"),
        ('chunk_tokens = "abc"', "chunk_tokens"),
        ("chunk_tokens = 2.5", "chunk_tokens"),
        ('fsync = "yes"', "fsync"),
        ('lease_seconds = "10"', "lease_seconds"),
        ("name = 7", "name"),
        ('isolated_tenants = "acme"', "isolated_tenants"),
    ],
)
def test_wrong_type_in_file_names_setting_and_source(config: Path, line: str, setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_file(config, f"[agent]\n{line}\n")
    message = str(info.value)
    assert message.startswith(f"{setting} from file:{config}")
    assert "expected" in message


def test_numbers_from_env_are_parsed(env: dict[str, str]) -> None:
    s = load_settings(
        env={**env, "KVCTL_CHUNK_TOKENS": "512", "KVCTL_LEASE_SECONDS": "2.5"}
    ).settings
    assert (s.chunk_tokens, s.lease_seconds) == (512, 2.5)
    with pytest.raises(ConfigError, match="KVCTL_LEASE_SECONDS"):
        load_settings(env={**env, "KVCTL_LEASE_SECONDS": "0"})
    with pytest.raises(ConfigError, match="KVCTL_CHUNK_TOKENS"):
        load_settings(env={**env, "KVCTL_CHUNK_TOKENS": "many"})


# --- booleans ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1", True),
        ("TRUE", True),
        ("yes", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("OFF", False),
    ],
)
def test_bool_words(env: dict[str, str], text: str, expected: bool) -> None:
    loaded = load_settings(env={**env, "KVCTL_FSYNC": text, "KVCTL_SHM": text})
    assert loaded.settings.fsync is expected
    assert loaded.settings.shm is expected
    assert loaded.sources["fsync"] == "env:KVCTL_FSYNC"


def test_bad_bool_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="yes/no") as info:
        load_settings(env={**env, "KVCTL_FSYNC": "maybe"})
    assert "env:KVCTL_FSYNC" in str(info.value)


def test_bool_in_file_and_flag(config: Path) -> None:
    loaded = load_file(config, "[agent]\nfsync = true\nshm = true\n", flags={"shm": False})
    assert loaded.settings.fsync is True
    assert loaded.settings.shm is False
    assert loaded.sources["shm"] == "flag:--shm"


# --- choices and addresses --------------------------------------------------------------------


def test_policy_and_level_choices(env: dict[str, str]) -> None:
    s = load_settings(
        env={**env, "KVCTL_DISK_ADMISSION": "frequency", "KVCTL_LOG_LEVEL": "WARNING"}
    ).settings
    assert (s.disk_admission, s.log_level) == ("frequency", "warning")
    arc = load_settings(env={**env, "KVCTL_EVICTION": "lineage-arc"}).settings
    assert arc.eviction == "lineage-arc"
    with pytest.raises(ConfigError, match="lineage-lru2"):
        load_settings(env={**env, "KVCTL_EVICTION": "belady"})  # simulation only
    with pytest.raises(ConfigError, match="all, frequency"):
        load_settings(env={**env, "KVCTL_DISK_ADMISSION": "sometimes"})
    with pytest.raises(ConfigError, match="debug, info, warning, error"):
        load_settings(env={**env, "KVCTL_LOG_LEVEL": "verbose"})


def test_bad_port_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="bad port") as info:
        load_settings(env={**env, "KVCTL_LISTEN": "127.0.0.1:99999"})
    assert "env:KVCTL_LISTEN" in str(info.value)


def test_data_listen_off_and_listen_not(env: dict[str, str]) -> None:
    loaded = load_settings(env={**env, "KVCTL_DATA_LISTEN": "OFF"})
    assert loaded.settings.data_listen == "off"
    assert loaded.settings.data_host_port is None
    with pytest.raises(ConfigError, match="cannot be turned off"):
        load_settings(env={**env, "KVCTL_LISTEN": "off"})


def test_isolated_tenants_from_env_and_file(config: Path) -> None:
    loaded = load_file(
        config,
        '[agent]\nisolated_tenants = ["acme"]\n',
        env={"KVCTL_ISOLATED_TENANTS": "globex, initech,,globex"},
    )
    assert loaded.settings.isolated_tenants == ("globex", "initech")
    assert loaded.sources["isolated_tenants"] == "env:KVCTL_ISOLATED_TENANTS"
    assert load_file(
        config, '[agent]\nisolated_tenants = ["acme"]\n'
    ).settings.isolated_tenants == ("acme",)


# --- the security rule ------------------------------------------------------------------------


def test_wildcard_bind_without_token_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(env={**env, "KVCTL_LISTEN": "0.0.0.0:7070"})
    message = str(info.value)
    assert message.startswith("binding to 0.0.0.0 needs a bearer token: set KVCTL_TOKEN")
    assert "env:KVCTL_LISTEN" in message
    assert (info.value.setting, info.value.source) == ("listen", "env:KVCTL_LISTEN")


def test_wildcard_data_bind_without_token_is_refused(config: Path) -> None:
    with pytest.raises(ConfigError, match="binding to :: needs a bearer token") as info:
        load_file(config, '[agent]\ndata_listen = "[::]:7071"\n')
    assert f"file:{config}" in str(info.value)


def test_wildcard_bind_with_token_from_env_is_accepted(env: dict[str, str]) -> None:
    loaded = load_settings(
        env={**env, "KVCTL_LISTEN": "0.0.0.0:7070", "KVCTL_TOKEN": "s3cret-token"},
        flags={"data_listen": "10.0.0.5:7071"},
    )
    assert loaded.settings.control_host_port == ("0.0.0.0", 7070)
    assert loaded.settings.token == "s3cret-token"
    assert loaded.sources["token"] == "env:KVCTL_TOKEN"


def test_loopback_needs_no_token(env: dict[str, str]) -> None:
    loaded = load_settings(env={**env, "KVCTL_LISTEN": "[::1]:0", "KVCTL_DATA_LISTEN": ":7171"})
    assert loaded.settings.token == ""
    assert loaded.settings.data_host_port == ("127.0.0.1", 7171)


def test_token_with_whitespace_is_refused_without_echoing_it(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="whitespace") as info:
        load_settings(env={**env, "KVCTL_TOKEN": "abc def-secret"})
    assert "def-secret" not in str(info.value)


# --- describe ---------------------------------------------------------------------------------


def test_describe_masks_the_token(config: Path) -> None:
    secret = "hunter2-very-secret"
    loaded = load_file(
        config,
        f'[agent]\ntoken = "{secret}"\ncpu = "64GiB"\nlisten = "0.0.0.0:7070"\n',
        flags={"lease_seconds": 2.5},
    )
    rows = describe(loaded)
    assert [r["setting"] for r in rows] == [f.name for f in dataclasses.fields(AgentSettings)]
    assert all(set(r) == {"setting", "value", "source"} for r in rows)
    assert all(secret not in v for r in rows for v in r.values())
    by_name = {r["setting"]: r for r in rows}
    assert by_name["token"] == {"setting": "token", "value": "***", "source": f"file:{config}"}
    assert by_name["cpu_bytes"]["value"] == "64GiB"
    assert by_name["lease_seconds"] == {
        "setting": "lease_seconds",
        "value": "2.5",
        "source": "flag:--lease-seconds",
    }


def test_describe_shows_unset_token_as_empty(env: dict[str, str]) -> None:
    rows = {r["setting"]: r for r in describe(load_settings(env=env))}
    assert rows["token"]["value"] == ""
    assert rows["disk_bytes"]["value"] == "8GiB"
    assert rows["socket"]["value"].endswith("agent.sock")  # the path it resolves to


# --- models -----------------------------------------------------------------------------------


def test_models_from_file(config: Path) -> None:
    loaded = load_file(
        config,
        """
[agent]
cpu = "1GiB"

[[agent.models]]
id = "llama-3.1-8b"
layers = 32
kv_heads = 8
head_dim = 128

[[agent.models]]
id = "qwen-tiny"
layers = 4
kv_heads = 2
head_dim = 64
dtype = "float16"
""",
    )
    assert loaded.settings.models == (
        ModelSpec("llama-3.1-8b", 32, 8, 128, "bfloat16"),
        ModelSpec("qwen-tiny", 4, 2, 64, "float16"),
    )
    assert loaded.sources["models"] == f"file:{config}"
    assert "qwen-tiny" in {r["setting"]: r for r in describe(loaded)}["models"]["value"]


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ('id = "m"\nlayers = 0\nkv_heads = 8\nhead_dim = 128', "models[0].layers"),
        ('id = "m"\nlayers = 2\nkv_heads = 8\nhead_dim = 128\ndtype = "int3"', "unknown KV dtype"),
        ('id = "m"\nlayers = 2\nkv_heads = 8', "missing head_dim"),
        ('id = "m"\nlayers = 2\nkv_heads = 8\nhead_dim = 1\nheads = 4', "unknown key 'heads'"),
        ('id = ""\nlayers = 2\nkv_heads = 8\nhead_dim = 1', "models[0].id"),
    ],
)
def test_bad_model_is_refused(config: Path, table: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(problem)) as info:
        load_file(config, f"[[agent.models]]\n{table}\n")
    assert f"file:{config}" in str(info.value)


def test_duplicate_model_ids_are_refused(config: Path) -> None:
    model = '[[agent.models]]\nid = "m"\nlayers = 1\nkv_heads = 1\nhead_dim = 1\n'
    with pytest.raises(ConfigError, match="appears twice"):
        load_file(config, model + model)


# --- socket path length -----------------------------------------------------------------------


def test_derived_socket_path_too_long(tmp_path: Path, env: dict[str, str]) -> None:
    deep = tmp_path / ("d" * 120)
    with pytest.raises(ConfigError, match="shorter than 108 bytes") as info:
        load_settings(env={**env, "KVCTL_DATA_DIR": str(deep)})
    message = str(info.value)
    assert "env:KVCTL_DATA_DIR" in message
    assert 'socket = "/run/kvctl/agent.sock"' in message
    # turning the socket off, or pointing it somewhere short, fixes it
    off = load_settings(env={**env, "KVCTL_DATA_DIR": str(deep), "KVCTL_SOCKET": "off"})
    assert off.settings.socket_path is None
    short = load_settings(env={**env, "KVCTL_DATA_DIR": str(deep)}, flags={"socket": "/tmp/a.s"})
    assert short.settings.socket_path == Path("/tmp/a.s")


def test_explicit_socket_path_too_long(config: Path) -> None:
    long_path = "/tmp/" + "s" * 110 + ".sock"
    with pytest.raises(ConfigError, match="Unix socket paths must be shorter") as info:
        load_file(config, f'[agent]\nsocket = "{long_path}"\n')
    assert f"socket from file:{config}" in str(info.value)
    assert info.value.setting == "socket"


def test_tilde_in_paths_uses_home_from_env(config: Path) -> None:
    loaded = load_file(config, '[agent]\ndata_dir = "~/kv"\n', env={"HOME": "/home/ops"})
    assert loaded.settings.data_dir == "/home/ops/kv"


def test_index_settings_from_start_flags(env: dict[str, str], tmp_path: Path) -> None:
    from kvctl.cli.agent import StartFlags

    token_file = tmp_path / "index.token"
    token_file.write_text("s3cret\n")
    flags = StartFlags(
        peers=["fra-2=127.0.0.1:7071"],
        index_url="http://127.0.0.1:9480",
        index_token_file=token_file,
    ).as_flags()
    loaded = load_settings(env=env, flags=flags)
    assert loaded.settings.index_url == "http://127.0.0.1:9480"
    assert loaded.sources["index_url"] == "flag:--index-url"
    assert loaded.settings.index_token == "s3cret"
    assert loaded.sources["index_token"] == "flag:--index-token-file"
    with pytest.raises(ConfigError, match="index_url"):
        load_settings(env=env, flags=StartFlags(index_url="ftp://nowhere").as_flags())


@pytest.mark.parametrize(
    ("remote", "named"),
    [
        ({"KVCTL_POOL": "redis://127.0.0.1:6379/0"}, "pool from env:KVCTL_POOL"),
        ({"KVCTL_PEERS": "fra-2=10.1.0.7:7071"}, "peers from env:KVCTL_PEERS"),
    ],
)
def test_bypass_unreachable_is_refused_beside_a_pool_or_peers(
    env: dict[str, str], remote: dict[str, str], named: str
) -> None:
    """The rule's premise (a lookup reaches a chunk only through the chunks before it, all
    held here) fails where this node's lookups continue into a pool or peers: the planner
    takes a chunk held here past one the pool holds, and a chunk turned away is never written
    through to the pool. Refused rather than quietly losing those hits."""
    on = {"KVCTL_BYPASS_UNREACHABLE": "yes"}
    assert load_settings(env={**env, **on}).settings.bypass_unreachable
    assert load_settings(env={**env, **remote}).settings.bypass_unreachable is False
    with pytest.raises(ConfigError, match="bypass_unreachable") as info:
        load_settings(env={**env, **on, **remote})
    assert named in str(info.value)
    assert info.value.setting == "bypass_unreachable"
    assert info.value.source == "env:KVCTL_BYPASS_UNREACHABLE"


def test_the_data_plane_connection_cap_is_a_setting(config: Path, env: dict[str, str]) -> None:
    assert load_settings(env=env).settings.data_max_connections == 1024
    loaded = load_file(config, "[agent]\ndata_max_connections = 64\n")
    assert loaded.settings.data_max_connections == 64
    loaded = load_settings(env={**env, "KVCTL_DATA_MAX_CONNECTIONS": "16"})
    assert loaded.settings.data_max_connections == 16
    assert loaded.sources["data_max_connections"] == "env:KVCTL_DATA_MAX_CONNECTIONS"
    with pytest.raises(ConfigError, match="data_max_connections"):
        load_file(config, "[agent]\ndata_max_connections = 0\n")


@pytest.mark.parametrize(
    "pool", ["kvctl://:s3cretpw@10.0.0.5:7171", "kvctl://user:s3cretpw@10.0.0.5", "kvctl://a@b:1"]
)
def test_a_kvctl_pool_url_with_a_password_is_refused_unshown(
    env: dict[str, str], pool: str
) -> None:
    # a kvctl:// pool's credential is remote_token: userinfo was read as part of the host, and
    # the agent logged it with every failed probe
    with pytest.raises(ConfigError) as caught:
        load_settings(env=env, flags={"pool": pool})
    assert "takes no user or password in its URL" in str(caught.value)
    assert "s3cretpw" not in str(caught.value) and "a@b" not in str(caught.value)


@pytest.mark.parametrize(
    ("listen", "data_listen", "refused"),
    [
        ("127.0.0.1:7500", "127.0.0.1:7500", True),
        ("0.0.0.0:7500", "127.0.0.1:7500", True),
        ("127.0.0.1:7500", "[::]:7500", True),
        ("127.0.0.1:7500", "127.0.0.1:7501", False),
        ("127.0.0.1:0", "127.0.0.1:0", False),  # each takes a free port of its own
        ("127.0.0.1:7500", "off", False),
        # a name is what it resolves to (before: compared as text, and started to fail)
        ("localhost:7500", "127.0.0.1:7500", True),
        ("127.0.0.1:7500", "localhost:7500", True),
        ("localhost:7500", "0.0.0.0:7500", True),
        # IPv4's wildcard does not cover an IPv6 address (before: refused, though both bind)
        ("[::1]:7500", "0.0.0.0:7500", False),
        ("0.0.0.0:7500", "[::1]:7500", False),
        ("127.0.0.2:7500", "127.0.0.1:7500", False),
    ],
)
def test_the_control_api_and_the_data_plane_on_one_port_are_refused(
    env: dict[str, str], listen: str, data_listen: str, refused: bool
) -> None:
    """Before, the second bind failed at start, saying this very process held the port."""
    flags = {"listen": listen, "data_listen": data_listen}
    env = {**env, "KVCTL_TOKEN": "t" * 32}  # a wildcard bind needs one
    if not refused:
        assert load_settings(env=env, flags=flags).settings.data_listen == data_listen
        return
    with pytest.raises(ConfigError, match="are one port") as info:
        load_settings(env=env, flags=flags)
    assert info.value.setting == "data_listen" and info.value.source == "flag:--data-listen"


def test_one_port_is_said_of_the_setting_given_not_of_a_default(env: dict[str, str]) -> None:
    """listen given on the data plane's default port: the conflict is that setting's (its
    source is what the operator fixes). Said of data_listen's "default", the CLI's hint sent
    the operator to `kvctl agent config --show`, which loads the same and fails the same."""
    data_port = int(load_settings(env=env).settings.data_listen.rpartition(":")[2])
    with pytest.raises(ConfigError, match="are one port") as info:
        load_settings(env={**env, "KVCTL_LISTEN": f"127.0.0.1:{data_port}"})
    assert info.value.setting == "listen" and info.value.source == "env:KVCTL_LISTEN"
    # given both, the data plane's is said, as before
    with pytest.raises(ConfigError, match="are one port") as info:
        load_settings(env=env, flags={"listen": "127.0.0.1:7500", "data_listen": "127.0.0.1:7500"})
    assert info.value.setting == "data_listen" and info.value.source == "flag:--data-listen"
