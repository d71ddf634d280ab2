"""The agent's layered configuration: defaults < TOML file < ``KVCTL_*`` environment < flags.

The file is ``$KVCTL_CONFIG``, else ``$XDG_CONFIG_HOME/kvctl/agent.toml``, else
``~/.config/kvctl/agent.toml``; its settings live in an ``[agent]`` table::

    [agent]
    listen = "0.0.0.0:7070"
    token = "..."            # required off loopback
    cpu = "64GiB"
    disk = "1TiB"            # 0 disables the disk tier
    gpu_capacity = "8GiB"    # CUDA memory above cpu; 0 (the default) disables the gpu tier

    [[agent.models]]
    id = "llama-3.1-8b"
    layers = 32
    kv_heads = 8
    head_dim = 128

Every value is checked where it is read, so an error names the setting, the source it came from,
what is wrong and a value that would work. Unknown keys are refused: a misspelt setting would
otherwise be silently replaced by its default.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from kvctl.agent.settings import (
    DEFAULT_CONTROL_PORT,
    DEFAULT_DATA_PORT,
    MIN_TIER_BYTES,
    AgentSettings,
    LinkSpec,
    ModelSpec,
)
from kvctl.errors import InvalidArgument
from kvctl.profiles import GPUS
from kvctl.store.keys import KVLayout
from kvctl.store.policies import ADMISSION_POLICIES, EVICTION_POLICIES, make_admission_policy
from kvctl.store.tiers.gpu import parse_device  # no torch: that is imported only to use a GPU
from kvctl.units import parse_size
from kvctl.wire.address import bind_ip, is_loopback, listeners_overlap, split_host_port

#: ``sun_path`` on Linux holds 108 bytes including the terminating NUL
UNIX_SOCKET_PATH_MAX = 108
LOG_LEVELS = ("debug", "info", "warning", "error")
ROLES = ("node", "pool")
POOL_WRITES = ("through", "off")
POOL_SCHEMES = ("redis", "rediss", "valkey", "valkeys", "redis+cluster", "kvctl")
LINK_OVERRIDES = ("auto", "fetch", "recompute")
_LINK_KEYS = ("override", "rtt_ms", "bandwidth", "delay_ms")
CONFIG_ENV = "KVCTL_CONFIG"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_MODEL_KEYS = ("id", "layers", "kv_heads", "head_dim", "dtype")
_MODEL_EXAMPLE = (
    '[[agent.models]] with id = "llama-3.1-8b", layers = 32, kv_heads = 8, head_dim = 128, '
    'dtype = "bfloat16"'
)


class ConfigError(InvalidArgument):
    """A setting could not be loaded. The message says which setting, from which source, what is
    wrong and gives an example of a good value; ``setting`` and ``source`` repeat the first two
    for callers that want them apart (either may be None for errors about the file itself)."""

    def __init__(
        self, message: str, *, setting: str | None = None, source: str | None = None
    ) -> None:
        super().__init__(message)
        self.setting = setting
        self.source = source


@dataclass(frozen=True)
class LoadedSettings:
    settings: AgentSettings
    #: field name -> "default" | "file:/path/agent.toml" | "env:KVCTL_CPU" | "flag:--cpu"
    sources: dict[str, str]
    #: the file that was read, if any
    config_file: Path | None


# --- parsing of single values -----------------------------------------------------------------


class _Invalid(Exception):
    """What is wrong with a value, before it is tied to a setting and a source."""


@dataclass(frozen=True, slots=True)
class _Ctx:
    kind: str  # "file" | "env" | "flag": env and flag values may be text for any type
    env: Mapping[str, str]


def _wrong_type(expected: str, value: object) -> _Invalid:
    return _Invalid(f"expected {expected}, got {value!r} ({type(value).__name__})")


def _text(value: object, ctx: _Ctx) -> str:
    if isinstance(value, PurePath) and ctx.kind == "flag":
        value = str(value)
    if not isinstance(value, str):
        raise _wrong_type("a string", value)
    return value.strip()


def _expand_home(path: str, env: Mapping[str, str]) -> str:
    # TOML does not expand "~"; without this, data_dir = "~/kv" creates a directory named "~"
    if path == "~" or path.startswith("~/"):
        home = env.get("HOME") or str(Path.home())
        return home + path[1:]
    return path


def _name(value: object, ctx: _Ctx) -> str:
    text = _text(value, ctx)
    # the name is a directory under the state dir, so it must be one plain path component
    if not text or text in (".", "..") or "/" in text or "\0" in text:
        raise _Invalid(f"must be a non-empty name without '/', got {text!r}")
    return text


def _non_empty(value: object, ctx: _Ctx) -> str:
    text = _text(value, ctx)
    if not text:
        raise _Invalid("must not be empty")
    return text


def _address(default_port: int, *, may_be_off: bool) -> Callable[[object, _Ctx], str]:
    def parse(value: object, ctx: _Ctx) -> str:
        text = _text(value, ctx)
        if text.lower() == "off":
            if may_be_off:
                return "off"
            # split_host_port would take "off" for a host name
            raise _Invalid("the control API cannot be turned off; give HOST:PORT")
        try:
            split_host_port(text, default_port)
        except ValueError as exc:
            raise _Invalid(str(exc)) from None
        return text

    return parse


def _socket(value: object, ctx: _Ctx) -> str:
    text = _text(value, ctx)
    if text.lower() == "off":
        return "off"
    return _expand_home(text, ctx.env)


def _path(value: object, ctx: _Ctx) -> str:
    return _expand_home(_text(value, ctx), ctx.env)


def _size(minimum: int) -> Callable[[object, _Ctx], int]:
    def parse(value: object, ctx: _Ctx) -> int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise _wrong_type('a size such as "64GiB" or a number of bytes', value)
        try:
            n = parse_size(value)
        except InvalidArgument as exc:
            raise _Invalid(str(exc)) from None
        if n < minimum:
            raise _Invalid(f"must be at least {minimum} byte(s), got {value!r}")
        return n

    return parse


def _cuda_device(value: object, ctx: _Ctx) -> str:
    text = _text(value, ctx).lower()
    try:
        index = parse_device(text)
    except InvalidArgument as exc:
        raise _Invalid(str(exc)) from None
    return f"cuda:{index}"  # one spelling, so logs and /v1/info agree


def _positive_int(value: object, ctx: _Ctx) -> int:
    if isinstance(value, str) and ctx.kind != "file":
        try:
            value = int(value.strip())
        except ValueError:
            raise _Invalid(f"expected a whole number, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong_type("a whole number", value)
    if value <= 0:
        raise _Invalid(f"must be greater than 0, got {value}")
    return value


def _float(*, allow_zero: bool) -> Callable[[object, _Ctx], float]:
    def parse(value: object, ctx: _Ctx) -> float:
        if isinstance(value, str) and ctx.kind != "file":
            try:
                value = float(value.strip())
            except ValueError:
                raise _Invalid(f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _wrong_type("a number", value)
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            bound = "0 or more" if allow_zero else "greater than 0"
            raise _Invalid(f"must be a finite number {bound}, got {value}")
        return float(value)

    return parse


_positive_float = _float(allow_zero=False)
_non_negative_float = _float(allow_zero=True)


def _bool(value: object, ctx: _Ctx) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and ctx.kind != "file":
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise _Invalid(f"expected one of 1/0, true/false, yes/no, on/off, got {value!r}")
    raise _wrong_type("true or false", value)


def _choice(what: str, choices: Iterable[str]) -> Callable[[object, _Ctx], str]:
    options = tuple(choices)

    def parse(value: object, ctx: _Ctx) -> str:
        text = _text(value, ctx).lower()
        if text not in options:
            raise _Invalid(f"unknown {what} {text!r}; choose from {', '.join(options)}")
        return text

    return parse


def _admission(value: object, ctx: _Ctx) -> str:
    text = _text(value, ctx).lower()
    try:
        make_admission_policy(text)
    except InvalidArgument:
        raise _Invalid(
            f"unknown disk admission policy {text!r}; choose from {', '.join(ADMISSION_POLICIES)}"
        ) from None
    return text


def _token(value: object, ctx: _Ctx) -> str:
    # never put the value in a message: it is a secret, and messages end up in logs
    if not isinstance(value, str):
        raise _Invalid(f"expected a string, got {type(value).__name__}")
    if any(c.isspace() or not c.isprintable() for c in value):
        # it is sent in an HTTP header, where whitespace is trimmed and control characters break
        raise _Invalid("must not contain whitespace or control characters (value not shown)")
    return value


def _tenants(value: object, ctx: _Ctx) -> tuple[str, ...]:
    if isinstance(value, str) and ctx.kind != "file":
        items = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, list | tuple):
        items = []
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item.strip():
                raise _Invalid(f"item {i} must be a non-empty string, got {item!r}")
            items.append(item.strip())
    else:
        raise _wrong_type("a list of tenant names", value)
    return tuple(dict.fromkeys(items))  # drop repeats, keep order


def _pool_url(value: object, ctx: _Ctx) -> str:
    text = _text(value, ctx)
    if not text or text.lower() == "off":
        return ""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme.lower() not in POOL_SCHEMES or not rest.strip("/"):
        # never echo the URL: it may carry a password
        raise _Invalid(
            f"expected a URL whose scheme is one of {', '.join(POOL_SCHEMES)} (URL not shown)"
        )
    if scheme.lower() == "kvctl":
        if "@" in rest:  # it was read as part of the host, and logged with it
            raise _Invalid(
                "a kvctl:// pool takes no user or password in its URL: the agent presents it "
                "remote_token (KVCTL_REMOTE_TOKEN), else its own token (URL not shown)"
            )
        try:
            split_host_port(rest.rstrip("/"), DEFAULT_DATA_PORT)
        except ValueError as exc:
            raise _Invalid(str(exc)) from None
    return text


def _index_url(value: object, ctx: _Ctx) -> str:
    text = _text(value, ctx)
    if not text or text.lower() == "off":
        return ""
    scheme, sep, rest = text.partition("://")
    host = rest.partition("/")[0].rpartition("@")[2]
    if not sep or scheme.lower() not in ("http", "https") or not host:
        # never echo the URL: it may carry a password
        raise _Invalid("expected a router's URL http://HOST:PORT or https://HOST:PORT (not shown)")
    try:
        split_host_port(host, 80 if scheme.lower() == "http" else 443)
    except ValueError as exc:
        raise _Invalid(str(exc)) from None
    return text.rstrip("/")


def _prefix(value: object, ctx: _Ctx) -> str:
    text = _text(value, ctx)
    if not text or any(c in text for c in "{}*?[] ") or not text.isprintable():
        raise _Invalid(f"must be a plain non-empty word (no spaces, braces or globs), got {text!r}")
    return text


def _peers(value: object, ctx: _Ctx) -> tuple[tuple[str, str], ...]:
    if isinstance(value, Mapping):
        pairs = [(str(k), v) for k, v in value.items()]
    else:
        if isinstance(value, str) and ctx.kind != "file":
            value = [p for p in value.split(",") if p.strip()]
        if not isinstance(value, list | tuple):
            raise _wrong_type('a list of "NAME=HOST:PORT"', value)
        pairs = []
        for i, item in enumerate(value):
            if isinstance(item, tuple) and len(item) == 2:
                pairs.append((str(item[0]), item[1]))
                continue
            if not isinstance(item, str) or "=" not in item:
                raise _Invalid(f'item {i} must look like "NAME=HOST:PORT", got {item!r}')
            name, _, addr = item.partition("=")
            pairs.append((name, addr))
    out: dict[str, str] = {}
    for name, addr in pairs:
        name = name.strip()
        if not name or any(c.isspace() for c in name) or name == "pool":
            raise _Invalid(f"peer name {name!r} must be a non-empty word other than 'pool'")
        if not isinstance(addr, str):
            raise _Invalid(f"peer {name}: address must be a string HOST:PORT, got {addr!r}")
        try:
            split_host_port(addr.strip(), DEFAULT_DATA_PORT)
        except ValueError as exc:
            raise _Invalid(f"peer {name}: {exc}") from None
        if name in out:
            raise _Invalid(f"peer {name!r} appears twice")
        out[name] = addr.strip()
    return tuple(out.items())


def _link(name: str, fields: Mapping[str, object]) -> LinkSpec:
    unknown = sorted(set(fields) - set(_LINK_KEYS))
    if unknown:
        raise _Invalid(f"link {name}: unknown key {unknown[0]!r}; valid: {', '.join(_LINK_KEYS)}")
    override = str(fields.get("override", "auto")).strip().lower()
    if override not in LINK_OVERRIDES:
        raise _Invalid(f"link {name}: override must be one of {', '.join(LINK_OVERRIDES)}")

    def number(key: str) -> float | None:
        raw = fields.get(key)
        if raw is None:
            return None
        try:
            if not isinstance(raw, str | int | float):
                raise TypeError
            v = float(raw)
        except (TypeError, ValueError):
            raise _Invalid(f"link {name}: {key} must be a number, got {raw!r}") from None
        if not math.isfinite(v) or v < 0:
            raise _Invalid(f"link {name}: {key} must be 0 or more, got {raw!r}")
        return v

    rtt_ms, delay_ms = number("rtt_ms"), number("delay_ms")
    bandwidth: float | None = None
    raw_bandwidth = fields.get("bandwidth")
    if raw_bandwidth is not None:
        try:
            text = raw_bandwidth if isinstance(raw_bandwidth, int) else str(raw_bandwidth)
            bandwidth = float(parse_size(text))
        except InvalidArgument as exc:
            raise _Invalid(f"link {name}: bandwidth (bytes per second): {exc}") from None
        if bandwidth <= 0:
            raise _Invalid(f"link {name}: bandwidth must be positive")
    return LinkSpec(
        name=name,
        override=override,
        rtt_seconds=None if rtt_ms is None else rtt_ms / 1000,
        bandwidth_bytes_per_second=bandwidth,
        delay_seconds=(delay_ms or 0.0) / 1000,
    )


def _links(value: object, ctx: _Ctx) -> tuple[LinkSpec, ...]:
    """File: ``[agent.links.NAME]`` tables; env and flags: "NAME:key=value,key=value"."""
    specs: list[LinkSpec] = []
    if isinstance(value, Mapping):
        for name, fields in value.items():
            if not isinstance(fields, Mapping):
                raise _Invalid(f"links.{name} must be a table, got {fields!r}")
            specs.append(_link(str(name), fields))
    else:
        if isinstance(value, str) and ctx.kind != "file":
            value = [p for p in value.split(";") if p.strip()]
        if not isinstance(value, list | tuple):
            raise _wrong_type('"NAME:override=fetch,rtt_ms=2,bandwidth=10GB,delay_ms=1"', value)
        for item in value:
            if isinstance(item, LinkSpec):
                specs.append(item)
                continue
            if not isinstance(item, str) or ":" not in item:
                raise _Invalid(f'a link looks like "NAME:key=value,...", got {item!r}')
            name, _, rest = item.partition(":")
            given: dict[str, object] = {}
            for part in filter(None, (p.strip() for p in rest.split(","))):
                key, eq, val = part.partition("=")
                if not eq:
                    raise _Invalid(f"link {name}: {part!r} is not key=value")
                given[key.strip()] = val.strip()
            specs.append(_link(name.strip(), given))
    names = [s.name for s in specs]
    if len(set(names)) != len(names) or not all(names):
        raise _Invalid(f"link names must be unique and non-empty, got {names}")
    return tuple(specs)


def _model(i: int, raw: object) -> ModelSpec:
    where = f"models[{i}]"
    if isinstance(raw, ModelSpec):
        raw = dataclasses.asdict(raw)
    if not isinstance(raw, Mapping):
        raise _wrong_type(f"a table for {where}", raw)
    unknown = sorted(set(raw) - set(_MODEL_KEYS))
    if unknown:
        raise _Invalid(
            f"{where}: unknown key {unknown[0]!r}; valid keys are {', '.join(_MODEL_KEYS)}"
        )
    missing = [k for k in _MODEL_KEYS[:4] if k not in raw]
    if missing:
        raise _Invalid(f"{where}: missing {', '.join(missing)}")
    model_id = raw["id"]
    if not isinstance(model_id, str) or not model_id.strip():
        raise _Invalid(f"{where}.id must be a non-empty string, got {model_id!r}")
    dims: dict[str, int] = {}
    for key in ("layers", "kv_heads", "head_dim"):
        n = raw[key]
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise _Invalid(f"{where}.{key} must be a whole number greater than 0, got {n!r}")
        dims[key] = n
    dtype = raw.get("dtype", "bfloat16")
    if not isinstance(dtype, str):
        raise _Invalid(f"{where}.dtype must be a string, got {dtype!r}")
    try:
        KVLayout(dims["layers"], dims["kv_heads"], dims["head_dim"], dtype).dtype_bytes  # noqa: B018
    except InvalidArgument as exc:
        raise _Invalid(f"{where}.dtype: {exc}") from None
    return ModelSpec(model_id.strip(), dims["layers"], dims["kv_heads"], dims["head_dim"], dtype)


def _models(value: object, ctx: _Ctx) -> tuple[ModelSpec, ...]:
    if not isinstance(value, list | tuple):
        raise _wrong_type("a list of [[agent.models]] tables", value)
    models = tuple(_model(i, raw) for i, raw in enumerate(value))
    seen: set[str] = set()
    for model in models:
        if model.id in seen:
            raise _Invalid(f"model id {model.id!r} appears twice; ids must be unique")
        seen.add(model.id)
    return models


# --- the settings table -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Setting:
    field: str  # AgentSettings field
    key: str  # spelling in the file and in flags
    parse: Callable[[object, _Ctx], object]
    example: object
    env: str | None = None
    #: the command-line flag, where it is not --KEY (a repeatable flag is named for one item)
    flag: str | None = None

    def flag_for(self, key: str) -> str:
        return self.flag or "--" + key.replace("_", "-")


_SETTINGS: tuple[_Setting, ...] = (
    _Setting("name", "name", _name, "gpu-node-17", "KVCTL_NAME"),
    _Setting("dc", "dc", _non_empty, "us-east-1a", "KVCTL_DC"),
    _Setting(
        "listen",
        "listen",
        _address(DEFAULT_CONTROL_PORT, may_be_off=False),
        f"127.0.0.1:{DEFAULT_CONTROL_PORT}",
        "KVCTL_LISTEN",
    ),
    _Setting(
        "data_listen",
        "data_listen",
        _address(DEFAULT_DATA_PORT, may_be_off=True),
        f"127.0.0.1:{DEFAULT_DATA_PORT}",
        "KVCTL_DATA_LISTEN",
    ),
    _Setting("socket", "socket", _socket, "/run/kvctl/agent.sock", "KVCTL_SOCKET"),
    _Setting("data_dir", "data_dir", _path, "/var/lib/kvctl", "KVCTL_DATA_DIR"),
    _Setting("cpu_bytes", "cpu", _size(MIN_TIER_BYTES["cpu"]), "64GiB", "KVCTL_CPU"),
    _Setting("disk_bytes", "disk", _size(MIN_TIER_BYTES["disk"]), "1TiB", "KVCTL_DISK"),
    _Setting(
        "gpu_capacity_bytes",
        "gpu_capacity",
        _size(MIN_TIER_BYTES["gpu"]),
        "8GiB",
        "KVCTL_GPU_CAPACITY",
    ),
    _Setting("gpu_device", "gpu_device", _cuda_device, "cuda:0", "KVCTL_GPU_DEVICE"),
    _Setting("chunk_tokens", "chunk_tokens", _positive_int, 256, "KVCTL_CHUNK_TOKENS"),
    _Setting("max_chunk_bytes", "max_chunk", _size(1), "256MiB", "KVCTL_MAX_CHUNK"),
    _Setting("max_body_bytes", "max_body", _size(1), "4MiB", "KVCTL_MAX_BODY"),
    _Setting(
        "data_frame_timeout_seconds",
        "data_frame_timeout_seconds",
        _positive_float,
        30.0,
        "KVCTL_DATA_FRAME_TIMEOUT_SECONDS",
    ),
    _Setting("data_put_budget_bytes", "data_put_budget", _size(1), "1GiB", "KVCTL_DATA_PUT_BUDGET"),
    _Setting(
        "data_max_connections",
        "data_max_connections",
        _positive_int,
        1024,
        "KVCTL_DATA_MAX_CONNECTIONS",
    ),
    _Setting(
        "data_max_unauthenticated_per_source",
        "data_max_unauthenticated_per_source",
        _positive_int,
        32,
        "KVCTL_DATA_MAX_UNAUTHENTICATED_PER_SOURCE",
    ),
    _Setting(
        "data_max_connections_per_source",
        "data_max_connections_per_source",
        _positive_int,
        256,
        "KVCTL_DATA_MAX_CONNECTIONS_PER_SOURCE",
    ),
    _Setting(
        "eviction",
        "eviction",
        _choice("eviction policy", EVICTION_POLICIES),
        "lineage-adaptive",
        "KVCTL_EVICTION",
    ),
    _Setting("disk_admission", "disk_admission", _admission, "frequency", "KVCTL_DISK_ADMISSION"),
    _Setting("fsync", "fsync", _bool, True, "KVCTL_FSYNC"),
    _Setting("bypass_unreachable", "bypass_unreachable", _bool, True, "KVCTL_BYPASS_UNREACHABLE"),
    _Setting("token", "token", _token, "<output of: openssl rand -hex 32>", "KVCTL_TOKEN"),
    _Setting("shm", "shm", _bool, False, "KVCTL_SHM"),
    _Setting("lease_seconds", "lease_seconds", _positive_float, 10.0, "KVCTL_LEASE_SECONDS"),
    _Setting(
        "isolated_tenants",
        "isolated_tenants",
        _tenants,
        ("acme", "globex"),
        "KVCTL_ISOLATED_TENANTS",
    ),
    _Setting("models", "models", _models, None),
    _Setting(
        "stop_demote_seconds",
        "stop_demote_seconds",
        _non_negative_float,
        15.0,
        "KVCTL_STOP_DEMOTE_SECONDS",
    ),
    _Setting("log_level", "log_level", _choice("log level", LOG_LEVELS), "info", "KVCTL_LOG_LEVEL"),
    _Setting("log_max_bytes", "log_max", _size(0), "64MiB", "KVCTL_LOG_MAX"),
    _Setting("log_backups", "log_backups", _positive_int, 3, "KVCTL_LOG_BACKUPS"),
    _Setting("role", "role", _choice("role", ROLES), "pool", "KVCTL_ROLE"),
    _Setting("pool", "pool", _pool_url, "redis://10.0.0.5:6379/0", "KVCTL_POOL"),
    _Setting("pool_prefix", "pool_prefix", _prefix, "kvctl-prod", "KVCTL_POOL_PREFIX"),
    _Setting("pool_capacity_bytes", "pool_capacity", _size(0), "512GiB", "KVCTL_POOL_CAPACITY"),
    _Setting(
        "pool_tenant_quota_bytes",
        "pool_tenant_quota",
        _size(0),
        "64GiB",
        "KVCTL_POOL_TENANT_QUOTA",
    ),
    _Setting(
        "pool_ttl_seconds", "pool_ttl_seconds", _non_negative_float, 3600, "KVCTL_POOL_TTL_SECONDS"
    ),
    _Setting("pool_write", "pool_write", _choice("pool write mode", POOL_WRITES), "through"),
    _Setting("peers", "peers", _peers, ("fra-2=10.1.0.7:7071",), "KVCTL_PEERS", "--peer"),
    _Setting("links", "links", _links, ("pool:override=fetch,rtt_ms=2",), "KVCTL_LINKS", "--link"),
    _Setting(
        "prefill_tokens_per_second",
        "prefill_tokens_per_second",
        _non_negative_float,
        20000,
        "KVCTL_PREFILL_TOKENS_PER_SECOND",
    ),
    _Setting(
        "disk_read_bytes_per_second",
        "disk_read_bytes_per_second",
        _non_negative_float,
        2e9,
        "KVCTL_DISK_READ_BYTES_PER_SECOND",
    ),
    _Setting("gpu", "gpu", _choice("GPU profile", GPUS), "h100", "KVCTL_GPU"),
    _Setting("remote_token", "remote_token", _token, "<the pool's token>", "KVCTL_REMOTE_TOKEN"),
    _Setting("index_url", "index_url", _index_url, "http://10.0.0.9:7400", "KVCTL_INDEX_URL"),
    _Setting(
        "index_token",
        "index_token",
        _token,
        "<the router's token>",
        "KVCTL_INDEX_TOKEN",
        # read from a file: a value on the command line is in every process listing
        flag="--index-token-file",
    ),
    _Setting(
        "index_timeout_seconds",
        "index_timeout_seconds",
        _positive_float,
        0.25,
        "KVCTL_INDEX_TIMEOUT_SECONDS",
    ),
)
_BY_FIELD = {s.field: s for s in _SETTINGS}
# file and flag spellings: the short one ("cpu") and the field name ("cpu_bytes")
_BY_KEY = {**_BY_FIELD, **{s.key: s for s in _SETTINGS}}
#: every variable ``load_settings`` reads (the settings' and the config file's): what a detached
#: agent, handed its settings whole, is not given (a token or a pool password among them)
SETTINGS_ENV_NAMES = frozenset({CONFIG_ENV, *(s.env for s in _SETTINGS if s.env)})
assert set(_BY_FIELD) == {f.name for f in dataclasses.fields(AgentSettings)}


def _toml_literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_literal(v) for v in value) + "]"
    return str(value)


def _plain(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _example(setting: _Setting, kind: str, key: str) -> str:
    if setting.field == "models":
        return _MODEL_EXAMPLE
    value = setting.example
    if kind == "env" and setting.env:
        return f"{setting.env}={_plain(value)}"
    if kind == "flag":
        flag = setting.flag_for(key)
        if isinstance(value, bool):
            return flag if value else f"--no-{key.replace('_', '-')}"
        return f"{flag} {_plain(value)}"
    return f"{key} = {_toml_literal(value)} in [agent]"


def _parse(setting: _Setting, key: str, value: object, ctx: _Ctx, source: str) -> object:
    try:
        return setting.parse(value, ctx)
    except _Invalid as exc:
        raise ConfigError(
            f"{key} from {source}: {exc}; for example: {_example(setting, ctx.kind, key)}",
            setting=setting.field,
            source=source,
        ) from None


Layer = dict[str, tuple[object, str]]  # field -> (value, source)


def _put(layer: Layer, setting: _Setting, kind: str, value: object, source: str) -> None:
    if setting.field in layer:
        raise ConfigError(
            f"{setting.field} is given twice in {kind} settings "
            f"(as {setting.key} and {setting.field}); keep one, e.g. "
            f"{_example(setting, kind, setting.key)}",
            setting=setting.field,
            source=source,
        )
    layer[setting.field] = (value, source)


def _unknown_key(key: str, where: str, source: str) -> ConfigError:
    valid = sorted(_BY_KEY)
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"unknown setting {key!r} in {where}{hint}; valid settings are {', '.join(valid)}",
        setting=key,
        source=source,
    )


# --- the sources ------------------------------------------------------------------------------


def default_config_path(env: Mapping[str, str] = os.environ) -> Path:
    """``$KVCTL_CONFIG``, else ``$XDG_CONFIG_HOME/kvctl/agent.toml``, else
    ``~/.config/kvctl/agent.toml`` (home taken from ``env``'s HOME when set)."""
    chosen = env.get(CONFIG_ENV, "").strip()
    if chosen:
        return Path(_expand_home(chosen, env))
    xdg = env.get("XDG_CONFIG_HOME", "").strip()
    # the XDG spec says to ignore relative paths here
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "kvctl" / "agent.toml"
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".config" / "kvctl" / "agent.toml"


def _read_file(path: Path, chosen_by: str) -> dict[str, object]:
    if not path.exists():
        raise ConfigError(
            f"config file {path}{chosen_by} does not exist; create it with an [agent] table, "
            'e.g. [agent] cpu = "64GiB"',
            setting="config",
            source=f"file:{path}",
        )
    try:
        # a byte order mark at its start (what Windows editors write) is dropped, as
        # kvctl.paths.read_text_file drops it from option files
        return tomllib.loads(path.read_bytes().removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        problem = f"is not valid TOML: {exc}"
    except RecursionError:  # '[[[[...' thousands deep: tomllib gives up, no line said
        problem = "is not valid TOML: nested too deep to read"
    except UnicodeDecodeError as exc:
        problem = f"is not UTF-8 text: {exc}"
    except OSError as exc:
        problem = f"cannot be read: {exc.strerror or exc}"
    raise ConfigError(
        f"config file {path}{chosen_by} {problem}", setting="config", source=f"file:{path}"
    )


def _file_layer(document: Mapping[str, object], path: Path, env: Mapping[str, str]) -> Layer:
    source = f"file:{path}"
    # a setting outside [agent] (forgotten header, "[agnet]") would otherwise be ignored
    extra = sorted(set(document) - {"agent"})
    if extra:
        raise ConfigError(
            f"unexpected top-level key {extra[0]!r} in {path}: agent settings belong in an "
            '[agent] table, e.g. [agent] cpu = "64GiB"',
            setting=extra[0],
            source=source,
        )
    table = document.get("agent", {})
    if not isinstance(table, dict):
        raise ConfigError(
            f"agent in {path} must be a table ([agent]), got {type(table).__name__}",
            setting="agent",
            source=source,
        )
    ctx = _Ctx("file", env)
    layer: Layer = {}
    for key, raw in table.items():
        setting = _BY_KEY.get(key)
        if setting is None:
            raise _unknown_key(key, f"[agent] of {path}", source)
        _put(layer, setting, ctx.kind, _parse(setting, key, raw, ctx, source), source)
    return layer


def _env_layer(env: Mapping[str, str]) -> Layer:
    ctx = _Ctx("env", env)
    layer: Layer = {}
    for setting in _SETTINGS:
        if setting.env is None:
            continue
        raw = env.get(setting.env)
        if raw is None or not raw.strip():
            continue  # an empty variable is how shells and compose files say "unset"
        source = f"env:{setting.env}"
        layer[setting.field] = (_parse(setting, setting.key, raw, ctx, source), source)
    return layer


def _flag_layer(flags: Mapping[str, object], env: Mapping[str, str]) -> Layer:
    ctx = _Ctx("flag", env)
    layer: Layer = {}
    for name, raw in flags.items():
        if raw is None:
            continue
        key = name.removeprefix("--").replace("-", "_")
        setting = _BY_KEY.get(key)
        if setting is None:
            raise _unknown_key(key, "flags", "flag:--" + key.replace("_", "-"))
        source = "flag:" + setting.flag_for(key)
        if setting.field in ("isolated_tenants", "models", "peers", "links") and raw in ((), []):
            continue  # CLIs report a repeatable option that was not given as an empty list
        _put(layer, setting, ctx.kind, _parse(setting, key, raw, ctx, source), source)
    return layer


def _choose_file(config_file: Path | None, env: Mapping[str, str]) -> tuple[Path, bool, str]:
    """(path, must exist, how it was chosen for messages)."""
    if config_file is not None:
        return Path(config_file).absolute(), True, ""
    path = default_config_path(env).absolute()
    if env.get(CONFIG_ENV, "").strip():
        # naming a file explicitly and having it silently ignored would be a trap
        return path, True, f" (from {CONFIG_ENV})"
    return path, False, ""


# --- checks that need several settings --------------------------------------------------------


def _check_exposure(settings: AgentSettings, sources: Mapping[str, str]) -> None:
    if settings.token:
        return
    for field, host_port in (
        ("listen", settings.control_host_port),
        ("data_listen", settings.data_host_port),
    ):
        if host_port is None or is_loopback(host_port[0]):
            continue
        host = host_port[0]
        raise ConfigError(
            f"binding to {host} needs a bearer token: set KVCTL_TOKEN or token in [agent] of the "
            f'config file (e.g. token = "<output of: openssl rand -hex 32>"), or bind to '
            f"127.0.0.1 ({field} = {getattr(settings, field)!r} from {sources[field]})",
            setting=field,
            source=sources[field],
        )


def _check_socket(settings: AgentSettings, sources: Mapping[str, str]) -> None:
    path = settings.socket_path
    if path is None:
        return
    size = len(os.fsencode(path))
    if size < UNIX_SOCKET_PATH_MAX:
        return
    if settings.socket:
        setting, origin = "socket", f"socket from {sources['socket']}"
    else:
        setting = "data_dir"
        origin = f"<data_dir>/agent.sock, data_dir from {sources['data_dir']}"
    raise ConfigError(
        f"socket path {path} ({origin}) is {size} bytes; Unix socket paths must be shorter than "
        f"{UNIX_SOCKET_PATH_MAX} bytes: set socket to a shorter path "
        '(e.g. socket = "/run/kvctl/agent.sock" in [agent] or KVCTL_SOCKET=/run/kvctl/agent.sock)'
        ' or to "off"',
        setting=setting,
        source=sources[setting],
    )


def _check_ports(settings: AgentSettings, sources: Mapping[str, str]) -> None:
    """The control API and the data plane on one TCP port: the second bind would fail at
    start, saying this very process holds the port."""
    data = settings.data_host_port
    if data is None:
        return
    (c_host, c_port), (d_host, d_port) = settings.control_host_port, data
    if not c_port or c_port != d_port:
        return
    if _binds_conflict(c_host, d_host):
        # said of the one given (data_listen's when both are): a default's source is nothing
        # the operator can fix where it is
        field = "listen" if sources["data_listen"] == "default" else "data_listen"
        raise ConfigError(
            f"listen ({settings.listen}, from {sources['listen']}) and data_listen "
            f"({settings.data_listen}, from {sources['data_listen']}) are one port: the control "
            "API and the data plane each need their own; give one of them another port",
            setting=field,
            source=sources[field],
        )


def _binds_conflict(a_host: str, b_host: str) -> bool:
    """Whether binds to ``a_host`` and ``b_host`` on one port conflict, as the addresses they
    take (localhost is 127.0.0.1; [::1] and 0.0.0.0 can share a port). A name that does not
    resolve is compared as text: its bind will say."""
    a, b = bind_ip(a_host), bind_ip(b_host)
    if a is None or b is None:
        return a_host == b_host
    return listeners_overlap(a, b)


def _check_remote(settings: AgentSettings, sources: Mapping[str, str]) -> None:
    if settings.role == "pool" and settings.pool:
        raise ConfigError(
            f'a pool agent (role = "pool" from {sources["role"]}) serves as the remote tier '
            f"itself and cannot use another pool (pool from {sources['pool']}); unset one",
            setting="pool",
            source=sources["pool"],
        )
    if settings.index_url and not settings.peers:
        raise ConfigError(
            f"index_url from {sources['index_url']} tells which peers to probe, and no peers "
            'are configured: add peers (e.g. peers = ["fra-2=10.1.0.7:7071"]) or unset index_url',
            setting="index_url",
            source=sources["index_url"],
        )
    if settings.bypass_unreachable and (settings.pool or settings.peers):
        # this node's lookups take chunks from the pool and peers past a gap in the local
        # prefix (``FetchPlanner``), so a chunk deeper than the local tiers hold may be
        # reached; and a chunk turned away here is never written through to the pool either
        remote = "pool" if settings.pool else "peers"
        raise ConfigError(
            f"bypass_unreachable from {sources['bypass_unreachable']} turns away chunks deeper "
            f"than this node's tiers hold, and with a pool or peers ({remote} from "
            f"{sources[remote]}) a lookup can reach them through chunks held there: unset "
            "bypass_unreachable (or KVCTL_BYPASS_UNREACHABLE), or the pool and peers",
            setting="bypass_unreachable",
            source=sources["bypass_unreachable"],
        )
    known = {"pool", *(name for name, _ in settings.peers)}
    for spec in settings.links:
        if spec.name not in known:
            raise ConfigError(
                f"links from {sources['links']}: {spec.name!r} is neither 'pool' nor a peer "
                f'({", ".join(sorted(known))}); e.g. links = ["pool:override=fetch"]',
                setting="links",
                source=sources["links"],
            )


# --- entry points -----------------------------------------------------------------------------


def load_settings(
    *,
    config_file: Path | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
) -> LoadedSettings:
    """Defaults < ``config_file`` (or the default path, if it exists) < ``env`` < ``flags``.

    ``env`` defaults to ``os.environ``; ``flags`` maps file spellings ("cpu", "data_dir") to
    values, None meaning "not given". Raises ConfigError for anything it cannot accept.
    """
    env = os.environ if env is None else env
    path, must_exist, chosen_by = _choose_file(config_file, env)
    read: Path | None = None
    layers: list[Layer] = []
    if must_exist or path.exists():
        layers.append(_file_layer(_read_file(path, chosen_by), path, env))
        read = path
    layers.append(_env_layer(env))
    layers.append(_flag_layer(flags or {}, env))

    values: dict[str, Any] = {}  # each value was parsed for its field (_SETTINGS)
    sources = {f.name: "default" for f in dataclasses.fields(AgentSettings)}
    for layer in layers:
        for field, (value, source) in layer.items():
            values[field] = value
            sources[field] = source
    settings = AgentSettings(**values)
    _check_exposure(settings, sources)
    _check_socket(settings, sources)
    _check_ports(settings, sources)
    _check_remote(settings, sources)
    return LoadedSettings(settings, sources, read)


def _format_size(n: int) -> str:
    # exact, and readable back by parse_size
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def _format(field: str, settings: AgentSettings) -> str:
    value = getattr(settings, field)
    if field in ("token", "remote_token", "index_token"):
        return "***" if value else ""
    if field in ("pool", "index_url"):
        from kvctl.redact import redact_url

        return redact_url(value)
    if field == "peers":
        return ",".join(f"{n}={a}" for n, a in value)
    if field == "links":
        return "; ".join(
            f"{s.name}:override={s.override}"
            + ("" if s.rtt_seconds is None else f",rtt_ms={s.rtt_seconds * 1000:g}")
            + (
                ""
                if s.bandwidth_bytes_per_second is None
                else f",bandwidth={s.bandwidth_bytes_per_second:.0f}"
            )
            + (f",delay_ms={s.delay_seconds * 1000:g}" if s.delay_seconds else "")
            for s in value
        )
    if field == "data_dir" and not value:
        return str(settings.data_path)
    if field == "socket" and not value:
        return str(settings.socket_path)
    if field.endswith("_bytes"):
        return _format_size(value)
    if field == "models":
        return "; ".join(
            f"{m.id} (layers={m.layers}, kv_heads={m.kv_heads}, head_dim={m.head_dim}, "
            f"dtype={m.dtype})"
            for m in value
        )
    if isinstance(value, float):
        return f"{value:g}"
    return _plain(value)


def describe(loaded: LoadedSettings) -> list[dict[str, str]]:
    """One row per setting, in field order: {"setting", "value", "source"}. The token shows as
    "***" ("" when unset); data_dir and socket left to default show the path they resolve to."""
    return [
        {
            "setting": f.name,
            "value": _format(f.name, loaded.settings),
            "source": loaded.sources.get(f.name, "default"),
        }
        for f in dataclasses.fields(AgentSettings)
    ]


__all__ = [
    "CONFIG_ENV",
    "LOG_LEVELS",
    "UNIX_SOCKET_PATH_MAX",
    "ConfigError",
    "LoadedSettings",
    "default_config_path",
    "describe",
    "load_settings",
]
