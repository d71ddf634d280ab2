"""The kustomize base in deploy/kubernetes/base: every resource it lists checked against
Kubernetes' OpenAPI schemas offline (kubernetes-validate, strict: unknown fields fail), the
ServiceMonitor against a schema of the prometheus-operator CRD fields it uses, and the pieces
checked against each other and against the agent: labels and selectors, port names, volume and
Secret names, the probes, and agent.toml as the agent's own settings loader reads it with the
pod's environment. There is no kustomize binary here: the base is read as kustomize would, from
kustomization.yaml's resources and configMapGenerator."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvctl.agent.config import ConfigError, load_settings
from kvctl.agent.settings import AgentSettings
from kvctl.agent.systemd import render_unit
from kvctl.units import parse_size
from tests.unit.test_systemd_unit import one, unit_settings

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base"
#: the oldest Kubernetes still maintained when this was written, and the newest schema shipped
KUBERNETES_VERSIONS = ("1.29", kubernetes_validate.latest_version())
TOKEN = "a" * 64  # stands in for the Secret's value
NODE = "gpu-node-7"

Doc = dict[str, Any]


def kustomization() -> Doc:
    doc: Doc = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    return doc


def resources() -> list[Doc]:
    """The base as kustomize builds it, before its name suffixes: the listed resources and the
    generated ConfigMap."""
    docs = [
        doc
        for name in kustomization()["resources"]
        for doc in yaml.safe_load_all((BASE / name).read_text())
        if doc is not None
    ]
    for gen in kustomization().get("configMapGenerator", []):
        data = {Path(f).name: (BASE / f).read_text() for f in gen["files"]}
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": gen["name"]},
                "data": data,
            }
        )
    return docs


def of_kind(kind: str) -> Doc:
    found = [d for d in resources() if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s in the base"
    return found[0]


def pod_spec() -> Doc:
    spec: Doc = of_kind("DaemonSet")["spec"]["template"]["spec"]
    return spec


def agent_container() -> Doc:
    (agent,) = [c for c in pod_spec()["containers"] if c["name"] == "agent"]
    return agent


def probe_script() -> str:
    """The Python the probes run in the agent's container (the same for all three)."""
    agent = agent_container()
    commands = [
        agent[p]["exec"]["command"] for p in ("startupProbe", "livenessProbe", "readinessProbe")
    ]
    assert commands[0] == commands[1] == commands[2]
    python, flag, script = commands[0]
    assert (python, flag) == ("python3", "-c")
    return str(script)


def pod_env(*, token: str | None = TOKEN) -> dict[str, str]:
    """The agent container's environment as the kubelet would fill it on node ``NODE``."""
    labels = of_kind("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    env: dict[str, str] = {}
    for var in agent_container()["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "secretKeyRef" in source:
            if token is not None:
                env[var["name"]] = token
        elif source["fieldRef"]["fieldPath"] == "spec.nodeName":
            env[var["name"]] = NODE
        else:
            label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", source["fieldRef"]["fieldPath"])
            assert label, source
            env[var["name"]] = labels[label.group(1)]
    return env


def agent_settings(env: dict[str, str]) -> AgentSettings:
    config_args = agent_container()["args"]
    assert config_args[:3] == ["agent", "start", "--config"]
    mount = Path(config_args[3]).parent
    (volume,) = [
        m["name"] for m in agent_container()["volumeMounts"] if Path(m["mountPath"]) == mount
    ]
    (config_map,) = [v["configMap"]["name"] for v in pod_spec()["volumes"] if v["name"] == volume]
    generated = {g["name"]: g for g in kustomization()["configMapGenerator"]}
    (file_name,) = generated[config_map]["files"]
    assert Path(file_name).name == Path(config_args[3]).name
    return load_settings(config_file=BASE / file_name, env={"HOME": "/nonexistent", **env}).settings


# --- schemas ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_built_in_kinds_match_kubernetes_openapi(version: str) -> None:
    checked = []
    for doc in resources():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        checked.append(doc["kind"])
    assert sorted(checked) == ["ConfigMap", "DaemonSet", "Service"]


def test_strict_validation_refuses_a_misspelt_field() -> None:
    daemonset = copy.deepcopy(of_kind("DaemonSet"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSIONS[-1], strict=True)


_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
_SECRET_KEY = {
    "type": "object",
    "required": ["key", "name"],
    "additionalProperties": False,
    "properties": {
        "key": {"type": "string", "minLength": 1},
        "name": {"type": "string", "minLength": 1},
        "optional": {"type": "boolean"},
    },
}
#: The fields of monitoring.coreos.com/v1 ServiceMonitor this base uses, as prometheus-operator's
#: CRD (v0.84) defines them; stricter than the CRD where it helps (no unknown keys at the levels
#: written here, a Secret's name required). kubernetes-validate has no schema for CRDs.
SERVICE_MONITOR_SCHEMA: Doc = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["endpoints", "selector"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                            "minProperties": 1,
                        }
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": _DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": _DURATION},
                            "authorization": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": _SECRET_KEY,
                                },
                            },
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "action": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                        "separator": {"type": "string"},
                                        "targetLabel": {"type": "string"},
                                        "sourceLabels": {
                                            "type": "array",
                                            "items": {
                                                "type": "string",
                                                "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$",
                                            },
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def test_service_monitor_matches_the_crd_fields_it_uses() -> None:
    monitor = of_kind("ServiceMonitor")
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
    (endpoint,) = monitor["spec"]["endpoints"]
    seconds = {
        k: int(endpoint[k].removesuffix("s")) for k in ("interval", "scrapeTimeout")
    }  # the operator refuses a timeout longer than the interval
    assert seconds["scrapeTimeout"] <= seconds["interval"]


@pytest.mark.parametrize(
    "breakage",
    ["misspelt key", "no selector", "scheme", "secret without key"],
)
def test_the_service_monitor_schema_refuses_mistakes(breakage: str) -> None:
    monitor = copy.deepcopy(of_kind("ServiceMonitor"))
    endpoint = monitor["spec"]["endpoints"][0]
    if breakage == "misspelt key":
        endpoint["bearerTokenScret"] = endpoint.pop("authorization")
    elif breakage == "no selector":
        del monitor["spec"]["selector"]
    elif breakage == "scheme":
        endpoint["scheme"] = "tcp"
    else:
        del endpoint["authorization"]["credentials"]["key"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)


# --- the pieces agree -------------------------------------------------------------------------


def test_selectors_pick_the_agent_pods_and_the_service() -> None:
    daemonset, service = of_kind("DaemonSet"), of_kind("Service")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["clusterIP"] == "None"  # headless: one address per agent
    monitor = of_kind("ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )


def test_ports_are_named_alike_and_are_the_agents() -> None:
    container_ports = {p["name"]: p["containerPort"] for p in agent_container()["ports"]}
    service_ports = {p["name"]: p for p in of_kind("Service")["spec"]["ports"]}
    for name, port in service_ports.items():
        assert port["targetPort"] in container_ports, name
        assert port["port"] == container_ports[port["targetPort"]]
    (endpoint,) = of_kind("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] in service_ports and endpoint["path"] == "/metrics"
    settings = agent_settings(pod_env())
    assert settings.control_host_port == ("0.0.0.0", container_ports["control"])
    assert settings.data_host_port == ("0.0.0.0", container_ports["data"])
    assert service_ports[endpoint["port"]]["targetPort"] == "control"  # /metrics is on control


def test_the_probes_ask_v1_health_on_the_control_port_with_the_token() -> None:
    script = probe_script()
    compile(script, "probe", "exec")
    control = {p["name"]: p["containerPort"] for p in agent_container()["ports"]}["control"]
    assert f'"http://127.0.0.1:{control}/v1/health"' in script
    assert 'os.environ["KVCTL_TOKEN"]' in script and "Bearer " in script
    probes = {p: agent_container()[p] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    for name, probe in probes.items():
        assert probe["timeoutSeconds"] >= 5, name  # the script's own timeout is 4 s


def test_the_token_comes_from_the_secret_the_monitor_reads() -> None:
    (token_var,) = [v for v in agent_container()["env"] if v["name"] == "KVCTL_TOKEN"]
    ref = token_var["valueFrom"]["secretKeyRef"]
    (endpoint,) = of_kind("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["authorization"]["credentials"] == {"name": ref["name"], "key": ref["key"]}
    assert endpoint["authorization"]["type"] == "Bearer"
    # never the token itself: no Secret in the base, none in agent.toml
    assert "Secret" not in {d["kind"] for d in resources()}
    config = of_kind("ConfigMap")["data"]["agent.toml"]
    assert not re.search(r"^\s*(token|remote_token|index_token)\s*=", config, re.MULTILINE)


def test_the_secrets_setup_keeps_the_token_off_the_command_line() -> None:
    # kubectl's arguments are readable by any local user (ps, /proc/PID/cmdline) while it runs
    text = (BASE / "kustomization.yaml").read_text()
    setup = " ".join(ln.lstrip("# ") for ln in text.splitlines() if ln.startswith("#"))
    assert "kubectl create secret generic kvctl-agent-token" in setup
    assert "--from-literal" not in setup and "$(" not in setup
    assert "--from-file=token=/dev/stdin" in setup


def test_volumes_and_mounts_agree() -> None:
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    for container in pod_spec()["containers"] + pod_spec()["initContainers"]:
        for mount in container["volumeMounts"]:
            assert mount["name"] in volumes, (container["name"], mount["name"])
    generated = {g["name"] for g in kustomization()["configMapGenerator"]}
    assert {v["configMap"]["name"] for v in volumes.values() if "configMap" in v} <= generated


def test_agent_toml_is_accepted_by_the_agent_with_the_pods_environment() -> None:
    settings = agent_settings(pod_env())
    labels = of_kind("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert settings.name == NODE and settings.dc == labels["kvctl-dc"] and settings.token == TOKEN
    mounts = {m["name"]: Path(m["mountPath"]) for m in agent_container()["volumeMounts"]}
    host_paths = {v["name"] for v in pod_spec()["volumes"] if "hostPath" in v}
    # the disk tier and the socket on the node, so they outlive the pod
    assert settings.data_path == mounts["data"] and "data" in host_paths
    assert settings.socket_path is not None and settings.socket_path.parent == mounts["run"]
    assert "run" in host_paths
    # the init container hands exactly those host directories to the agent's user
    (init,) = pod_spec()["initContainers"]
    script = init["command"][2]
    assert f'"{mounts["data"]}", "{mounts["run"]}"' in script
    uid = pod_spec()["securityContext"]["runAsUser"]
    assert f"os.chown(path, {uid}, {uid})" in script and f"st_uid != {uid}" in script


def test_without_the_secret_the_agent_refuses_to_listen_on_the_pod_ip() -> None:
    with pytest.raises(ConfigError, match="needs a bearer token"):
        agent_settings(pod_env(token=None))


def test_memory_limit_holds_the_cpu_tier() -> None:
    # the cpu tier is a memfd: its pages are charged to the container's memory cgroup
    resources_ = agent_container()["resources"]
    limit_bytes = parse_size(resources_["limits"]["memory"] + "B")
    assert parse_size(resources_["requests"]["memory"] + "B") == limit_bytes
    cpu_bytes = agent_settings(pod_env()).cpu_bytes
    assert limit_bytes - cpu_bytes >= 1 << 30, (limit_bytes, cpu_bytes)
    assert "cpu" not in resources_["limits"]  # throttling would stall the data plane


def test_containers_run_unprivileged() -> None:
    spec = pod_spec()
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    agent = agent_container()["securityContext"]
    assert agent["runAsNonRoot"] is True and agent["readOnlyRootFilesystem"] is True
    assert agent["allowPrivilegeEscalation"] is False
    assert agent["capabilities"] == {"drop": ["ALL"]}
    # the one root step: chown of the host directories, with nothing but CAP_CHOWN
    (init,) = spec["initContainers"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert init["securityContext"]["readOnlyRootFilesystem"] is True


def test_gpu_nodes_only() -> None:
    spec = pod_spec()
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]


def test_grace_period_is_the_systemd_units_stop_timeout() -> None:
    # one drain budget for SIGTERM, whichever runs the agent
    unit = unit_settings(render_unit(Path("/opt/kvctl/bin/kvctl"), Path("/etc/kvctl/agent.toml")))
    assert pod_spec()["terminationGracePeriodSeconds"] == int(one(unit, "TimeoutStopSec"))


def test_monitor_labels_match_the_prometheus_rules() -> None:
    # deploy/prometheus's rules aggregate by dc (a target label) under job "kvctl"
    (endpoint,) = of_kind("ServiceMonitor")["spec"]["endpoints"]
    relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert relabel["job"]["replacement"] == "kvctl"
    labels = of_kind("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    (source,) = relabel["dc"]["sourceLabels"]
    # Prometheus names a pod label's meta label with every character outside [a-zA-Z0-9_] as _
    (label,) = [
        k for k in labels if source == "__meta_kubernetes_pod_label_" + re.sub(r"\W", "_", k)
    ]
    assert label == "kvctl-dc"
